//! Layouts built in code (`LayoutBuilder`, `TensorBuilder`), each call
//! returning a new builder that shares what came before.

use crate::errors::{layout_err, LayoutError};
use crate::layout::PyLayout;
use pyo3::prelude::*;
use reshard::{DType, Layout, Rank, Region, Storage};
use std::sync::Arc;

fn dtype(name: &str, tensor: &str) -> PyResult<DType> {
    DType::from_name(name).ok_or_else(|| {
        let known: Vec<&str> = reshard::ALL_DTYPES.iter().map(|d| d.name()).collect();
        LayoutError::new_err(format!("tensor '{tensor}': unknown dtype '{name}' (expected one of {})", known.join(", ")))
    })
}

/// A persistent list, newest first: a builder that returns a new builder
/// per call shares what came before, so adding the `n`-th item costs the
/// same as the first (a model's tensors, a replicated tensor's shards).
struct Chain<T>(Option<Arc<(T, Chain<T>)>>);

impl<T> Clone for Chain<T> {
    fn clone(&self) -> Self {
        Chain(self.0.clone())
    }
}

impl<T> Default for Chain<T> {
    fn default() -> Self {
        Chain(None)
    }
}

impl<T: Clone> Chain<T> {
    fn push(&self, item: T) -> Chain<T> {
        Chain(Some(Arc::new((item, self.clone()))))
    }

    /// The items, oldest first.
    fn to_vec(&self) -> Vec<T> {
        let mut items = Vec::new();
        let mut at = &self.0;
        while let Some(node) = at {
            items.push(node.0.clone());
            at = &node.1 .0;
        }
        items.reverse();
        items
    }
}

impl<T> Drop for Chain<T> {
    // Unlinks node by node: dropping a long chain recursively would
    // overflow the stack.
    fn drop(&mut self) {
        let mut next = self.0.take();
        while let Some(node) = next {
            next = match Arc::try_unwrap(node) {
                Ok((_, mut rest)) => rest.0.take(),
                Err(_) => None, // the rest is shared: its other owner drops it
            };
        }
    }
}

/// One tensor of a `LayoutBuilder` (mirrors `reshard::TensorBuilder`):
/// every method returns a new builder.
#[pyclass(module = "refit._refit", name = "TensorBuilder", frozen, skip_from_py_object)]
#[derive(Clone)]
pub(crate) struct PyTensorBuilder {
    /// Everything but the explicit shards.
    inner: reshard::TensorBuilder,
    /// The explicit shards, added to `inner` when the tensor is built.
    shards: Chain<(Rank, Region, Storage)>,
    name: String,
}

impl PyTensorBuilder {
    fn with(&self, inner: reshard::TensorBuilder) -> Self {
        PyTensorBuilder { inner, shards: self.shards.clone(), name: self.name.clone() }
    }

    /// The tensor with its shards, as `reshard` builds it.
    fn builder(&self) -> reshard::TensorBuilder {
        self.shards.to_vec().into_iter().fold(self.inner.clone(), |t, (rank, region, storage)| t.shard(rank, region, storage))
    }
}

#[pymethods]
impl PyTensorBuilder {
    #[new]
    fn new(name: String, dtype_name: &str, shape: Vec<u64>) -> PyResult<Self> {
        let dt = dtype(dtype_name, &name)?;
        Ok(PyTensorBuilder { inner: reshard::TensorBuilder::new(name.clone(), dt, shape), shards: Chain::default(), name })
    }

    /// On a mesh of `shape`, one placement per mesh dimension
    /// (`"replicate"` or `"shard(D)"`), over `ranks` (row-major mesh
    /// order; default `0..product(shape)`).
    #[pyo3(signature = (shape, placements, ranks=None))]
    fn mesh(&self, shape: Vec<u32>, placements: Vec<String>, ranks: Option<Vec<Rank>>) -> PyResult<Self> {
        let dims = placements
            .iter()
            .enumerate()
            .map(|(i, p)| {
                reshard::parse_mesh_dim(p).ok_or_else(|| {
                    LayoutError::new_err(format!(
                        "tensor '{}': placements[{i}]: unknown placement '{p}' (expected \"replicate\" or \"shard(D)\")",
                        self.name
                    ))
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let mut inner = self.inner.clone().mesh(shape, dims);
        if let Some(ranks) = ranks {
            inner = inner.on_ranks(ranks);
        }
        Ok(self.with(inner))
    }

    /// Stores every rank's block from element `at` of the rank's buffer
    /// `name` (fused QKV, gate_up, a flat parameter buffer).
    fn buffer(&self, name: String, at: u64) -> Self {
        self.with(self.inner.clone().buffer(name, at))
    }

    /// Block-scales this `f8e4m3` destination tensor: blocks of `block`
    /// elements per dimension, their f32 scales in the layout's tensor
    /// `tensor` (docs/layout-format.md, "Block-scaled FP8").
    fn scale(&self, tensor: String, block: Vec<u64>) -> Self {
        self.with(self.inner.clone().scale(tensor, block))
    }

    /// An explicit shard: rank `rank` holds the box `offset`/`extent`, or
    /// the flat range `flat=(start, len)`; in its own buffer, or in
    /// `buffer` from element `at`.
    #[pyo3(signature = (rank, *, offset=None, extent=None, flat=None, buffer=None, at=0))]
    fn shard(
        &self,
        rank: Rank,
        offset: Option<Vec<u64>>,
        extent: Option<Vec<u64>>,
        flat: Option<(u64, u64)>,
        buffer: Option<String>,
        at: u64,
    ) -> PyResult<Self> {
        let region = match (offset, extent, flat) {
            (Some(offset), Some(extent), None) => Region::Block { offset, extent },
            (None, None, Some((start, len))) => Region::Flat { start, len },
            _ => {
                return Err(LayoutError::new_err(format!(
                    "tensor '{}': shard of rank {rank}: give offset= and extent=, or flat=(start, len)",
                    self.name
                )))
            }
        };
        let storage = match buffer {
            Some(buffer) => Storage::InBuffer { buffer, at },
            None => Storage::Own,
        };
        Ok(PyTensorBuilder { inner: self.inner.clone(), shards: self.shards.push((rank, region, storage)), name: self.name.clone() })
    }

    fn __repr__(&self) -> String {
        format!("TensorBuilder('{}')", self.name)
    }
}

/// Builds a `Layout` tensor by tensor (mirrors `reshard::LayoutBuilder`).
#[pyclass(module = "refit._refit", name = "LayoutBuilder", frozen)]
pub(crate) struct PyLayoutBuilder {
    ranks: u32,
    ranks_per_node: Option<u32>,
    /// The tensors added so far (a new builder per call shares them).
    tensors: Chain<reshard::TensorBuilder>,
}

#[pymethods]
impl PyLayoutBuilder {
    #[new]
    #[pyo3(signature = (ranks, ranks_per_node=None))]
    fn new(ranks: u32, ranks_per_node: Option<u32>) -> Self {
        PyLayoutBuilder { ranks, ranks_per_node, tensors: Chain::default() }
    }

    /// A new builder with `tensor` added.
    fn tensor(&self, tensor: PyRef<'_, PyTensorBuilder>) -> Self {
        PyLayoutBuilder { ranks: self.ranks, ranks_per_node: self.ranks_per_node, tensors: self.tensors.push(tensor.builder()) }
    }

    /// Validates (every rule of the file format) and builds.
    fn build(&self) -> PyResult<PyLayout> {
        let mut builder = Layout::builder(self.ranks);
        if let Some(n) = self.ranks_per_node {
            builder = builder.ranks_per_node(n);
        }
        let builder = self.tensors.to_vec().into_iter().fold(builder, reshard::LayoutBuilder::tensor);
        builder.build().map(|l| PyLayout { inner: Arc::new(l) }).map_err(layout_err)
    }
}
