//! Layouts built in code: the same content as a [layout file], without
//! writing JSON.
//!
//! ```
//! use reshard::{DType, Layout, MeshDim::{Replicate, Shard}, TensorBuilder};
//! // Two ranks, tensor parallel: `w` split by rows; `b` whole on both ranks,
//! // after `w`'s shard in one fused buffer `params` of each rank.
//! let layout = Layout::builder(2)
//!     .tensor(TensorBuilder::new("w", DType::F32, [4, 8]).mesh([2], [Shard(0)]).buffer("params", 0))
//!     .tensor(TensorBuilder::new("b", DType::F32, [8]).mesh([2], [Replicate]).buffer("params", 16))
//!     .build()?;
//! assert_eq!(layout.rank_buffers(1)[0].elems, 24);
//! # Ok::<(), reshard::LayoutError>(())
//! ```
//!
//! [`LayoutBuilder::build`] validates through [`Layout::new`], so a layout
//! built here obeys every rule a file does and is rejected with the same
//! errors.
//!
//! [layout file]: crate::file

use crate::dtype::DType;
use crate::layout::{BlockScale, Layout, LayoutError, MeshDim, MeshPlacement, Placement, Rank, Region, ShardSpec, Storage, TensorLayout};

/// Builds a [`Layout`] tensor by tensor ([`Layout::builder`]).
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct LayoutBuilder {
    ranks: u32,
    ranks_per_node: Option<u32>,
    tensors: Vec<TensorBuilder>,
}

impl Layout {
    /// A builder for a layout of `ranks` ranks, all on one node unless
    /// [`ranks_per_node`](LayoutBuilder::ranks_per_node) says otherwise.
    pub fn builder(ranks: u32) -> LayoutBuilder {
        LayoutBuilder { ranks, ranks_per_node: None, tensors: Vec::new() }
    }
}

impl LayoutBuilder {
    /// Ranks per machine: rank `r` is on node `r / n`.
    pub fn ranks_per_node(mut self, n: u32) -> LayoutBuilder {
        self.ranks_per_node = Some(n);
        self
    }

    /// Adds a tensor (tensors keep the order they are added in).
    pub fn tensor(mut self, tensor: TensorBuilder) -> LayoutBuilder {
        self.tensors.push(tensor);
        self
    }

    /// Validates and builds the layout. Errors name the tensor (and the
    /// field, as `tensors[i].…`) at fault, as for a layout file.
    pub fn build(self) -> Result<Layout, LayoutError> {
        let tensors = self.tensors.into_iter().enumerate().map(|(i, t)| t.finish(i)).collect::<Result<Vec<_>, _>>()?;
        Layout::new(self.ranks, self.ranks_per_node, tensors)
    }
}

/// How a [`TensorBuilder`] places its tensor so far.
#[derive(Clone, Debug)]
enum Placing {
    /// Nothing said yet.
    Unplaced,
    /// On a mesh.
    Mesh { shape: Vec<u32>, ranks: Option<Vec<Rank>>, dims: Vec<MeshDim>, storage: Storage },
    /// An explicit list of shards.
    Shards(Vec<ShardSpec>),
    /// Both forms were used: an error at build time.
    Both,
}

/// One tensor of a [`LayoutBuilder`]: a name, an element type, a global
/// shape, and either a mesh placement ([`mesh`](Self::mesh), DTensor
/// style) or explicit shards ([`shard`](Self::shard)).
#[derive(Clone, Debug)]
#[must_use = "add the tensor to a layout with `LayoutBuilder::tensor`"]
pub struct TensorBuilder {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    placing: Placing,
    /// `buffer` was called before `mesh`, or on a shard-list tensor.
    misplaced_buffer: bool,
    scale: Option<BlockScale>,
}

impl TensorBuilder {
    /// A tensor `name` of `dtype` with global shape `shape` (empty for a
    /// scalar).
    pub fn new(name: impl Into<String>, dtype: DType, shape: impl IntoIterator<Item = u64>) -> TensorBuilder {
        TensorBuilder {
            name: name.into(),
            dtype,
            shape: shape.into_iter().collect(),
            placing: Placing::Unplaced,
            misplaced_buffer: false,
            scale: None,
        }
    }

    /// Places the tensor on a mesh of shape `shape` with one placement per
    /// mesh dimension (`torch.chunk` splits). The mesh covers ranks
    /// `0..product(shape)` in row-major order unless
    /// [`on_ranks`](Self::on_ranks) names others (a pipeline stage, say).
    pub fn mesh(mut self, shape: impl IntoIterator<Item = u32>, placements: impl IntoIterator<Item = MeshDim>) -> TensorBuilder {
        let mesh = Placing::Mesh {
            shape: shape.into_iter().collect(),
            ranks: None,
            dims: placements.into_iter().collect(),
            storage: Storage::Own,
        };
        self.placing = match self.placing {
            Placing::Unplaced => mesh,
            _ => Placing::Both,
        };
        self
    }

    /// The ranks of the mesh, in row-major order of mesh coordinates
    /// (after [`mesh`](Self::mesh)).
    pub fn on_ranks(mut self, ranks: impl IntoIterator<Item = Rank>) -> TensorBuilder {
        match &mut self.placing {
            Placing::Mesh { ranks: r, .. } => *r = Some(ranks.into_iter().collect()),
            _ => self.placing = Placing::Both,
        }
        self
    }

    /// Stores every rank's block row-major from element `at` of the rank's
    /// buffer `buffer`, shared with other tensors (fused QKV, gate_up, a
    /// flat parameter buffer), instead of a buffer of its own (after
    /// [`mesh`](Self::mesh); shards say where they live in
    /// [`ShardSpec::storage`]).
    pub fn buffer(mut self, buffer: impl Into<String>, at: u64) -> TensorBuilder {
        match &mut self.placing {
            Placing::Mesh { storage, .. } => *storage = Storage::InBuffer { buffer: buffer.into(), at },
            _ => self.misplaced_buffer = true,
        }
        self
    }

    /// Adds an explicit shard: rank `rank` holds `region`, stored as
    /// `storage` says. Use shards or a mesh, not both.
    pub fn shard(mut self, rank: Rank, region: Region, storage: Storage) -> TensorBuilder {
        let shard = ShardSpec { rank, region, storage };
        match &mut self.placing {
            Placing::Unplaced => self.placing = Placing::Shards(vec![shard]),
            Placing::Shards(shards) => shards.push(shard),
            _ => self.placing = Placing::Both,
        }
        self
    }

    /// Block-scales this `f8e4m3` tensor: blocks of `block` elements per
    /// dimension, their scales in the layout's f32 tensor `scale_tensor`
    /// (see [`crate::quantize`]).
    pub fn scale(mut self, scale_tensor: impl Into<String>, block: impl IntoIterator<Item = u64>) -> TensorBuilder {
        self.scale = Some(BlockScale { tensor: scale_tensor.into(), block: block.into_iter().collect() });
        self
    }

    /// The tensor, or why it cannot be one; `index` is its position in the
    /// layout (for the field path).
    fn finish(self, index: usize) -> Result<TensorLayout, LayoutError> {
        let problem = |p: &str| LayoutError::Field { field: format!("tensors[{index}] ('{}')", self.name), problem: p.to_string() };
        if self.misplaced_buffer {
            return Err(problem("buffer() applies to a mesh placement: call mesh() first (shards give their storage each)"));
        }
        let placement = match self.placing {
            Placing::Unplaced => return Err(problem("no placement: call mesh() or shard()")),
            Placing::Both => return Err(problem("placed both on a mesh and by shards (or on_ranks() without mesh()): use one form")),
            Placing::Shards(shards) => Placement::Shards(shards),
            Placing::Mesh { shape, ranks, dims, storage } => {
                let ranks = match ranks {
                    Some(r) => r,
                    None => {
                        let size = shape.iter().try_fold(1u32, |a, &b| a.checked_mul(b)).ok_or_else(|| problem("mesh too large"))?;
                        (0..size).collect()
                    }
                };
                Placement::Mesh(MeshPlacement { shape, ranks, dims, storage })
            }
        };
        Ok(TensorLayout { name: self.name, dtype: self.dtype, shape: self.shape, placement, scale: self.scale })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::MeshDim::{Replicate, Shard};
    use crate::parse_layout;

    /// Builds `built` and parses `json`; both must give the same layout, or
    /// the same error text.
    fn check(built: LayoutBuilder, json: &str) {
        let b = built.build();
        let p = parse_layout(json);
        match (b, p) {
            (Ok(b), Ok(p)) => assert_eq!(b, p),
            (b, p) => panic!("built {b:?}\nparsed {p:?}"),
        }
    }

    #[test]
    fn builder_matches_the_file_format() {
        check(
            Layout::builder(4).ranks_per_node(2).tensor(TensorBuilder::new("w", DType::BF16, [8, 4]).mesh([2, 2], [Replicate, Shard(0)])),
            r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [{"name": "w", "dtype": "bf16", "shape": [8, 4],
                "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]}]}"#,
        );
        check(
            Layout::builder(4)
                .tensor(TensorBuilder::new("q", DType::F32, [4, 4]).mesh([2], [Shard(0)]).on_ranks([2, 3]).buffer("qkv", 0))
                .tensor(TensorBuilder::new("k", DType::F32, [4, 4]).mesh([2], [Shard(0)]).on_ranks([2, 3]).buffer("qkv", 8)),
            r#"{"ranks": 4, "tensors": [
                {"name": "q", "dtype": "f32", "shape": [4, 4], "mesh": {"shape": [2], "ranks": [2, 3]}, "placements": ["shard(0)"], "buffer": "qkv", "at": 0},
                {"name": "k", "dtype": "f32", "shape": [4, 4], "mesh": {"shape": [2], "ranks": [2, 3]}, "placements": ["shard(0)"], "buffer": "qkv", "at": 8}]}"#,
        );
        check(
            Layout::builder(2).tensor(
                TensorBuilder::new("f", DType::F32, [4, 4]).shard(0, Region::Flat { start: 0, len: 6 }, Storage::Own).shard(
                    1,
                    Region::Flat { start: 6, len: 10 },
                    Storage::InBuffer { buffer: "flat".into(), at: 2 },
                ),
            ),
            r#"{"ranks": 2, "tensors": [{"name": "f", "dtype": "f32", "shape": [4, 4], "shards": [
                {"rank": 0, "flat": [0, 6]}, {"rank": 1, "flat": [6, 10], "buffer": "flat", "at": 2}]}]}"#,
        );
    }

    /// The layouts `docs/pipeline.md` §1 builds.
    #[test]
    fn the_pipeline_guide_layouts_build() {
        let train = Layout::builder(2)
            .tensor(TensorBuilder::new("w", DType::F32, [4, 8]).mesh([2], [Shard(0)]).buffer("params", 0))
            .tensor(TensorBuilder::new("b", DType::F32, [8]).mesh([2], [Replicate]).buffer("params", 16))
            .build()
            .unwrap();
        let infer = Layout::builder(1)
            .tensor(TensorBuilder::new("w", DType::BF16, [4, 8]).mesh([1], [Replicate]))
            .tensor(TensorBuilder::new("b", DType::BF16, [8]).mesh([1], [Replicate]))
            .build()
            .unwrap();
        assert_eq!(train.rank_buffers(1).iter().map(|b| (b.name.as_str(), b.elems)).collect::<Vec<_>>(), [("params", 24)]);
        assert_eq!(infer.rank_buffers(0).iter().map(|b| (b.name.as_str(), b.elems)).collect::<Vec<_>>(), [("w#0", 32), ("b#0", 8)]);
    }

    #[test]
    fn builder_errors_name_the_tensor() {
        let err = |b: LayoutBuilder| b.build().unwrap_err().to_string();
        let unplaced = err(Layout::builder(1).tensor(TensorBuilder::new("w", DType::F32, [2])));
        assert_eq!(unplaced, "tensors[0] ('w'): no placement: call mesh() or shard()");
        let both = err(Layout::builder(2).tensor(TensorBuilder::new("w", DType::F32, [2]).mesh([2], [Shard(0)]).shard(
            0,
            Region::Flat { start: 0, len: 2 },
            Storage::Own,
        )));
        assert!(both.contains("'w'") && both.contains("one form"), "{both}");
        let early = err(Layout::builder(1).tensor(TensorBuilder::new("w", DType::F32, [2]).buffer("p", 0).mesh([1], [Replicate])));
        assert!(early.contains("call mesh() first"), "{early}");
        // Rules of the layout itself come from Layout::new, as for files.
        let bad_dim = err(Layout::builder(2).tensor(TensorBuilder::new("w", DType::F32, [2]).mesh([2], [Shard(1)])));
        assert_eq!(bad_dim, "tensor 'w': placements[0]: shard(1) but the tensor has 1 dims");
        let too_big = err(Layout::builder(2).tensor(TensorBuilder::new("w", DType::F32, [2]).mesh([4], [Shard(0)])));
        assert!(too_big.contains("rank 2 >= ranks (2)"), "{too_big}");
    }
}
