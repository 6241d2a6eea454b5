//! `refit._refit`: the compiled half of the `refit` Python package.
//!
//! Thin bindings over the workspace crates — no second implementation:
//! layouts are `reshard` layouts (parsed, built and validated there), the
//! stores are `orchestrator::SrcStore` / `DstStore`, joining is
//! `orchestrator::join`, and the orchestrator is the Rust actor. The pure
//! Python layer (`refit/__init__.py`) adds registration of arrays and
//! tensors, the DTensor mapping, dataclasses and the exception hierarchy's
//! documentation.
//!
//! Every call that waits (a refit, a join, an update that waits for a refit
//! reading the store) runs on one tokio runtime per process with the GIL
//! released, and polls for signals every 100 ms so Ctrl-C interrupts it
//! (the wait is abandoned; see `wait`). Weights cross the boundary in
//! place for C-contiguous host arrays (numpy, torch CPU: one copy between
//! the array and the store, each array looked up right before its copy,
//! under the GIL) and as `bytes` for anything else, checked for dtype and
//! length against the rank's block either way. In-place stores register
//! objects, never addresses: `target` finds and re-checks their memory
//! before every use (the `unsafe` of this crate is there, and in the
//! copies below, each after its check).

use actors::ActorGroup;
use orchestrator::rendezvous::ControlConfig;
use orchestrator::{
    BufferError, Buffers, DstStore, Fabric, JoinConfig, Joined, Member, NodeFabric, OrchestratorConfig, OrchestratorError,
    OrchestratorHandle, PlanReport, RefitError as RustRefitError, RefitReport, RefitSystem, Rendezvous, Role, SrcStore,
};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict};
use reshard::{DType, Endpoint, Group, Layout, Rank, Region, Storage};
mod target;

use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use target::{Access, Device, Targets, Want};

create_exception!(_refit, RefitError, PyException, "Base class of every error refit raises.");
create_exception!(_refit, LayoutError, RefitError, "A layout is invalid (the message names the tensor and field).");
create_exception!(_refit, PlanError, RefitError, "The two layouts cannot be planned (a tensor missing, shapes differ, ...).");
create_exception!(_refit, TensorError, RefitError, "A tensor or buffer of a rank cannot be read or written as asked.");
create_exception!(_refit, VersionError, RefitError, "No whole version to refit, the sources disagree, or a version is not served.");
create_exception!(_refit, MemberError, RefitError, "A member timed out, died, or refused its part of a refit.");
create_exception!(_refit, JoinError, RefitError, "Joining or opening a rendezvous failed.");
create_exception!(
    _refit,
    RegistrationError,
    TensorError,
    "Memory registered in place is no longer what was registered (moved, freed, resized, another dtype), or cannot be registered."
);

// ---------------------------------------------------------------------------
// The runtime and waiting on it.

/// The process's tokio runtime and the process that made it.
struct Runtime {
    rt: tokio::runtime::Runtime,
    pid: u32,
}

static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();

fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    let made = RUNTIME.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 4);
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("refit")
            .enable_all()
            .build()
            .map(|rt| Runtime { rt, pid: std::process::id() })
            .map_err(|e| format!("cannot start the refit runtime: {e}"))
    });
    match made {
        Ok(r) if r.pid == std::process::id() => Ok(&r.rt),
        Ok(r) => Err(RefitError::new_err(format!(
            "refit was used in process {} before it forked into this one ({}); a forked copy of its runtime does not work: \
             start worker processes with multiprocessing's 'spawn' (or 'forkserver') start method",
            r.pid,
            std::process::id()
        ))),
        Err(e) => Err(RefitError::new_err(e.clone())),
    }
}

/// Runs `fut` on the runtime and waits for it with the GIL released,
/// checking for signals every 100 ms: Ctrl-C (any Python signal handler
/// that raises) abandons the wait and raises. An abandoned refit call is
/// dropped on this side; the orchestrator actor finishes or fails that
/// refit on its own, and the next refit waits for it.
fn wait<T: Send + 'static>(py: Python<'_>, fut: impl Future<Output = PyResult<T>> + Send + 'static) -> PyResult<T> {
    let rt = runtime()?;
    let mut handle = rt.spawn(fut);
    loop {
        let polled = py.detach(|| rt.block_on(async { tokio::time::timeout(Duration::from_millis(100), &mut handle).await }));
        match polled {
            Ok(Ok(result)) => return result,
            Ok(Err(e)) => return Err(RefitError::new_err(format!("internal error in refit (please report): {e}"))),
            Err(_elapsed) => {
                if let Err(e) = py.check_signals() {
                    handle.abort();
                    return Err(e);
                }
            }
        }
    }
}

/// Holds `T` and drops it inside the runtime (actors, nodes and sockets
/// may spawn or deregister on drop).
struct InRuntime<T>(Option<T>);

impl<T> InRuntime<T> {
    fn get(&self) -> &T {
        // Only `drop` takes the value out.
        self.0.as_ref().expect("taken only on drop")
    }
}

impl<T> Drop for InRuntime<T> {
    fn drop(&mut self) {
        if let Some(value) = self.0.take() {
            match RUNTIME.get() {
                Some(Ok(r)) if r.pid == std::process::id() => {
                    let _entered = r.rt.enter();
                    drop(value);
                }
                // A forked child: the runtime's threads are not here; leak
                // rather than touch a runtime that cannot run.
                _ => std::mem::forget(value),
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Errors.

fn layout_err(e: impl std::fmt::Display) -> PyErr {
    LayoutError::new_err(e.to_string())
}

fn tensor_err(e: BufferError) -> PyErr {
    TensorError::new_err(e.to_string())
}

fn refit_err(e: RustRefitError) -> PyErr {
    let text = e.to_string();
    match e {
        RustRefitError::Refit(o) => match o {
            OrchestratorError::Plan(_) => PlanError::new_err(text),
            OrchestratorError::Layout { .. } => LayoutError::new_err(text),
            OrchestratorError::NoWeights { .. }
            | OrchestratorError::VersionMismatch { .. }
            | OrchestratorError::VersionsDisagree { .. } => VersionError::new_err(text),
            _ => MemberError::new_err(text),
        },
        RustRefitError::Call(_) => RefitError::new_err(text),
    }
}

fn join_err(e: orchestrator::JoinError) -> PyErr {
    JoinError::new_err(e.to_string())
}

fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| RefitError::new_err(format!("{what}: {s} is not a number of seconds >= 0")))
}

// ---------------------------------------------------------------------------
// Layouts.

fn dtype(name: &str, tensor: &str) -> PyResult<DType> {
    DType::from_name(name).ok_or_else(|| {
        let known: Vec<&str> = reshard::dtype::ALL_DTYPES.iter().map(|d| d.name()).collect();
        LayoutError::new_err(format!("tensor '{tensor}': unknown dtype '{name}' (expected one of {})", known.join(", ")))
    })
}

/// One block a rank holds: `(tensor, dtype, offset, extent)`.
type BlockInfo = (String, String, Vec<u64>, Vec<u64>);

/// A validated layout: which block of which tensor every rank holds, and
/// where it is stored. `Layout.from_json` reads the layout file format
/// (docs/layout-format.md); `LayoutBuilder` builds one in code.
#[pyclass(module = "refit._refit", name = "Layout", frozen)]
struct PyLayout {
    inner: Arc<Layout>,
}

impl PyLayout {
    fn check_rank(&self, rank: Rank) -> PyResult<()> {
        if rank >= self.inner.ranks() {
            return Err(RefitError::new_err(format!("rank {rank}: the layout has {} ranks", self.inner.ranks())));
        }
        Ok(())
    }
}

#[pymethods]
impl PyLayout {
    /// Parses the layout file format.
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<PyLayout> {
        reshard::parse_layout(text).map(|l| PyLayout { inner: Arc::new(l) }).map_err(layout_err)
    }

    /// The layout in the file format.
    fn to_json(&self) -> PyResult<String> {
        serde_json::to_string_pretty(&reshard::layout_to_json(&self.inner)).map_err(|e| RefitError::new_err(e.to_string()))
    }

    /// Number of ranks.
    #[getter]
    fn ranks(&self) -> u32 {
        self.inner.ranks()
    }

    /// Ranks per node (machine).
    #[getter]
    fn ranks_per_node(&self) -> u32 {
        self.inner.ranks_per_node()
    }

    /// The layout's fingerprint (equal layouts, equal fingerprints).
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.inner.fingerprint()
    }

    /// Tensor names, in layout order.
    fn tensor_names(&self) -> Vec<String> {
        self.inner.tensors().iter().map(|t| t.name.clone()).collect()
    }

    /// `(dtype, shape)` of tensor `name`.
    fn tensor(&self, name: &str) -> PyResult<(String, Vec<u64>)> {
        let t = self.inner.tensor_index(name).ok_or_else(|| TensorError::new_err(format!("the layout has no tensor '{name}'")))?;
        let t = &self.inner.tensors()[t as usize];
        Ok((t.dtype.name().to_string(), t.shape.clone()))
    }

    /// Every block rank `rank` holds: `(tensor, dtype, offset, extent)`,
    /// in layout order.
    fn blocks(&self, rank: Rank) -> PyResult<Vec<BlockInfo>> {
        self.check_rank(rank)?;
        let mut out = Vec::new();
        for (i, t) in self.inner.tensors().iter().enumerate() {
            for (block, _) in self.inner.rank_holdings(i as u32, rank) {
                out.push((t.name.clone(), t.dtype.name().to_string(), block.offset().to_vec(), block.extent().to_vec()));
            }
        }
        Ok(out)
    }

    /// Rank `rank`'s buffers: `(name, dtype, elements)`.
    fn buffers(&self, rank: Rank) -> PyResult<Vec<(String, String, u64)>> {
        self.check_rank(rank)?;
        Ok(self.inner.rank_buffers(rank).into_iter().map(|b| (b.name, b.dtype.name().to_string(), b.elems)).collect())
    }

    /// Pickles as its JSON (layouts travel to Ray actors and
    /// multiprocessing workers).
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, (String,))> {
        Ok((py.get_type::<PyLayout>().getattr("from_json")?, (self.to_json()?,)))
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.extract::<PyRef<'_, PyLayout>>().is_ok_and(|o| *o.inner == *self.inner)
    }

    fn __repr__(&self) -> String {
        format!(
            "Layout(ranks={}, tensors={}, fingerprint={:016x})",
            self.inner.ranks(),
            self.inner.tensors().len(),
            self.inner.fingerprint()
        )
    }
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
struct PyTensorBuilder {
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
                reshard::file::parse_mesh_dim(p).ok_or_else(|| {
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
struct PyLayoutBuilder {
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

// ---------------------------------------------------------------------------
// Stores.

/// What a name refers to on a rank: a tensor's block, or a whole buffer.
fn target_len(b: &Buffers, name: &str) -> Result<(DType, usize), BufferError> {
    match b.layout().tensor_index(name) {
        Some(t) => {
            let view = b.tensor(name)?;
            Ok((b.layout().tensors()[t as usize].dtype, view.bytes().len()))
        }
        None => match b.buffer(name) {
            Ok(bytes) => {
                let spec = b.specs().iter().find(|s| s.name == name);
                Ok((spec.map_or(DType::U8, |s| s.dtype), bytes.len()))
            }
            // Neither a tensor nor a buffer: say so as for a tensor.
            Err(_) => b.tensor(name).map(|_| (DType::U8, 0)),
        },
    }
}

/// What a step writes into one name: bytes Python made, or a host array
/// read in place (under the GIL, when the write happens).
enum Write {
    Bytes(PyBackedBytes),
    Array(Py<PyAny>),
}

impl<'py> FromPyObject<'_, 'py> for Write {
    type Error = PyErr;

    fn extract(object: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        match object.extract::<PyBackedBytes>() {
            Ok(bytes) => Ok(Write::Bytes(bytes)),
            Err(_) => Ok(Write::Array(object.to_owned().unbind())),
        }
    }
}

/// The bytes of `name` on this rank (a tensor's block or a whole buffer).
fn target_mut<'a>(b: &'a mut Buffers, name: &str) -> Result<&'a mut [u8], BufferError> {
    if b.layout().tensor_index(name).is_some() {
        Ok(b.tensor_mut(name)?.into_bytes_mut())
    } else {
        b.buffer_mut(name)
    }
}

/// A host array's memory, found right before it is copied: its bytes
/// must be `len`, its elements `dtype` (or its raw bits).
fn host_array(object: &Bound<'_, PyAny>, what: &str, dtype: DType, len: usize, write: bool) -> PyResult<target::Found> {
    let found = target::find(object)?.map_err(|why| TensorError::new_err(format!("{what}: {why}")))?;
    if found.device != Device::Host {
        return Err(TensorError::new_err(format!("{what}: memory on {}, not a host array", found.device)));
    }
    if !found.elem.holds(dtype) {
        return Err(TensorError::new_err(format!("{what}: {} given for {dtype}", found.elem)));
    }
    if found.nbytes != len {
        let size = dtype.size() as usize;
        return Err(tensor_err(BufferError::Length {
            what: format!("{what} ({dtype}, {len} bytes)"),
            expected: (len / size) as u64,
            given: (found.nbytes / size) as u64,
        }));
    }
    if write && !found.writable {
        return Err(TensorError::new_err(format!("{what}: the array is read-only")));
    }
    if write && len > 0 {
        let maps = target::WritableMaps::read().map_err(TensorError::new_err)?;
        if !maps.covers(found.addr, len) {
            return Err(TensorError::new_err(format!(
                "{what}: its {len} bytes at {:#x} are not writable memory (a read-only map?)",
                found.addr
            )));
        }
    }
    Ok(found)
}

/// Checks every write, then copies them all: a write that does not fit
/// fails before anything changed (the version and the weights stay).
/// Each array is looked up again right before its copy, with no Python
/// code in between (a look-up runs the object's code, which could free
/// another array).
fn write_all(b: &mut Buffers, writes: &[(String, Write)]) -> Result<(), PyErr> {
    let rank = b.rank();
    Python::attach(|py| {
        for (name, write) in writes {
            let (dt, len) = target_len(b, name).map_err(tensor_err)?;
            let what = format!("src rank {rank}: '{name}'");
            match write {
                Write::Bytes(data) if data.len() != len => {
                    let size = dt.size() as usize;
                    return Err(tensor_err(BufferError::Length {
                        what: format!("{what} ({dt}, {len} bytes)"),
                        expected: (len / size) as u64,
                        given: (data.len() / size) as u64,
                    }));
                }
                Write::Bytes(_) => {}
                Write::Array(object) => drop(host_array(object.bind(py), &what, dt, len, false)?),
            }
        }
        for (name, write) in writes {
            let (dt, len) = target_len(b, name).map_err(tensor_err)?;
            let what = format!("src rank {rank}: '{name}'");
            match write {
                Write::Bytes(data) => target_mut(b, name).map_err(tensor_err)?.copy_from_slice(data),
                Write::Array(object) => {
                    let found = host_array(object.bind(py), &what, dt, len, false)?;
                    let target = target_mut(b, name).map_err(tensor_err)?;
                    if found.nbytes > 0 {
                        // SAFETY: `found` was looked up just now, under
                        // this GIL hold, and no Python code ran since: its
                        // `nbytes` (== `target.len()`, checked) bytes of host
                        // memory at `addr` are the object's, alive (its
                        // keeper is held in `found`). `target` is the
                        // store's own buffer, not inside it.
                        unsafe { std::ptr::copy_nonoverlapping(found.addr as *const u8, target.as_mut_ptr(), target.len()) };
                    }
                }
            }
        }
        Ok(())
    })
}

/// A copy of the bytes of `name` (a tensor's block or a buffer).
fn read_bytes(b: &Buffers, name: &str) -> Result<Vec<u8>, BufferError> {
    source_bytes(b, name).map(<[u8]>::to_vec)
}

/// The bytes of `name` (a tensor's block or a buffer), borrowed.
fn source_bytes<'a>(b: &'a Buffers, name: &str) -> Result<&'a [u8], BufferError> {
    if b.layout().tensor_index(name).is_some() {
        Ok(b.tensor(name)?.into_bytes())
    } else {
        b.buffer(name).or_else(|_| b.tensor(name).map(|v| v.into_bytes()))
    }
}

/// Rank `rank`'s buffers, and the block each is where it is one
/// tensor's only block on the rank.
fn wants(layout: &Layout, rank: Rank) -> Vec<Want> {
    layout
        .rank_buffers(rank)
        .into_iter()
        .map(|spec| {
            let shape = spec.name.rsplit_once('#').and_then(|(tensor, _)| {
                let t = layout.tensor_index(tensor)?;
                let held: Vec<_> = layout.rank_holdings(t, rank).into_iter().map(|(b, _)| b.extent().to_vec()).collect();
                match held.as_slice() {
                    [extent] if extent.iter().product::<u64>() == spec.elems => Some(extent.clone()),
                    _ => None,
                }
            });
            Want { name: spec.name, dtype: spec.dtype, elems: spec.elems, shape }
        })
        .collect()
}

/// Rank `rank`'s weights in the memory of `objects` (one per buffer, in
/// `Layout.buffers(rank)` order), found and checked now and before every
/// use.
fn in_place(
    layout: &PyLayout,
    rank: Rank,
    side: &str,
    objects: Vec<Bound<'_, PyAny>>,
    access: Access,
) -> PyResult<(orchestrator::Registered, Arc<Targets>)> {
    layout.check_rank(rank)?;
    let what = format!("{side} rank {rank}");
    let targets = Targets::register(what.clone(), access, wants(&layout.inner, rank), objects)?.map_err(RegistrationError::new_err)?;
    let (regions, device) = targets.regions();
    let residence = match device {
        Some(Device::Cuda(ordinal)) => orchestrator::Residence::Device { ordinal },
        _ => orchestrator::Residence::Host,
    };
    // SAFETY: every region was found just now from the object registered
    // for it, with its keeper held by `targets` for as long as the
    // registration lives; before each use the store's refit or commit
    // re-derives it through `targets` (`with_check`), which refuses memory
    // that moved, and the commit copies inside that check's GIL hold.
    let registered = unsafe { orchestrator::Registered::new(&layout.inner, rank, residence, regions) }
        .map_err(|e| RegistrationError::new_err(format!("{what}: {e}")))?;
    let targets = Arc::new(targets);
    // SAFETY: as above, for every region the check yields.
    let registered = unsafe { registered.with_check(targets.clone()) };
    Ok((registered, targets))
}

/// Raises `RegistrationError` if a registered buffer is no longer what
/// was registered.
fn check_targets(py: Python<'_>, targets: &Option<Arc<Targets>>) -> PyResult<()> {
    match targets {
        Some(t) => t.check_all(py).map_err(RegistrationError::new_err),
        None => Ok(()),
    }
}

/// The weights of one training (source) rank, with the version fence:
/// `update` writes them under the store's write lock (waiting for a refit
/// that reads them) and bumps the version.
#[pyclass(module = "refit._refit", name = "SrcStore", frozen)]
struct PySrcStore {
    inner: Arc<SrcStore>,
    layout: Arc<Layout>,
    /// A step begun by `begin_step`, holding the store's write lock.
    stepping: Mutex<Option<orchestrator::UpdateGuard>>,
    /// The objects an in-place store's weights live in.
    targets: Option<Arc<Targets>>,
}

#[pymethods]
impl PySrcStore {
    #[new]
    fn new(layout: PyRef<'_, PyLayout>, rank: Rank) -> PyResult<Self> {
        layout.check_rank(rank)?;
        Ok(PySrcStore {
            inner: Arc::new(SrcStore::new(&layout.inner, rank)),
            layout: layout.inner.clone(),
            stepping: Mutex::new(None),
            targets: None,
        })
    }

    /// A store over the memory of `objects` (torch tensors, numpy arrays,
    /// CUDA arrays, DLPack tensors), one per buffer of the rank in
    /// `Layout.buffers(rank)` order: each checked for dtype, elements,
    /// shape (a tensor's block, or flat) and contiguity now, and looked up
    /// again before every refit reads it and every step. `follow`: memory
    /// an object moved to is taken (after the same checks) instead of
    /// refused.
    #[staticmethod]
    #[pyo3(signature = (layout, rank, objects, follow=false))]
    fn in_place(layout: PyRef<'_, PyLayout>, rank: Rank, objects: Vec<Bound<'_, PyAny>>, follow: bool) -> PyResult<Self> {
        let (registered, targets) = in_place(&layout, rank, "src", objects, Access { writable: false, follow })?;
        Ok(PySrcStore {
            inner: Arc::new(SrcStore::registered(&layout.inner, rank, registered)),
            layout: layout.inner.clone(),
            stepping: Mutex::new(None),
            targets: Some(targets),
        })
    }

    /// Looks every registered object up again: `RegistrationError` names
    /// the buffer and what changed.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        check_targets(py, &self.targets)
    }

    /// Begins a step written outside the store (in place): waits while a
    /// refit reads, then holds the write lock until `end_step`.
    fn begin_step(&self, py: Python<'_>) -> PyResult<()> {
        if self.stepping.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            return Err(VersionError::new_err(format!("src rank {}: a step is in progress already", self.inner.rank())));
        }
        let store = self.inner.clone();
        let guard = wait(py, async move { Ok(store.begin_update().await) })?;
        *self.stepping.lock().unwrap_or_else(|e| e.into_inner()) = Some(guard);
        Ok(())
    }

    /// Ends the step `begin_step` began: `ok`, the version goes up by one
    /// (returned); otherwise it stays and the store is torn.
    /// A step whose registered memory moved or changed (and is not
    /// followed) fails: the version stays, the store is torn, and
    /// `RegistrationError` says what changed.
    fn end_step(&self, py: Python<'_>, ok: bool) -> PyResult<Option<u64>> {
        let guard = self.stepping.lock().unwrap_or_else(|e| e.into_inner()).take();
        let guard = guard.ok_or_else(|| VersionError::new_err(format!("src rank {}: no step in progress", self.inner.rank())))?;
        if !ok {
            return Ok(None);
        }
        if let Err(e) = check_targets(py, &self.targets) {
            drop(guard);
            return Err(e);
        }
        Ok(Some(guard.finish()))
    }

    /// One optimizer step: writes `[(name, bytes)]` (each a tensor's block
    /// or a whole buffer, in the layout's dtype) and returns the new
    /// version. Every write is checked before any is made.
    fn update(&self, py: Python<'_>, writes: Vec<(String, Write)>) -> PyResult<u64> {
        let store = self.inner.clone();
        wait(py, async move { store.try_update(|b| write_all(b, &writes)).await.map(|(v, ())| v) })
    }

    /// Loads known weights (initial ones, a checkpoint) as `version`.
    fn restore(&self, py: Python<'_>, version: u64, writes: Vec<(String, Write)>) -> PyResult<()> {
        let store = self.inner.clone();
        wait(py, async move { store.try_restore(version, |b| write_all(b, &writes)).await })
    }

    /// The bytes of `name` (a tensor's block or a buffer) as the store
    /// holds them.
    fn read<'py>(&self, py: Python<'py>, name: String) -> PyResult<Bound<'py, PyBytes>> {
        let store = self.inner.clone();
        let bytes = wait(py, async move { store.read(|b| read_bytes(b, &name)).await.map_err(tensor_err) })?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// The version (None before the first update or restore).
    #[getter]
    fn version(&self) -> Option<u64> {
        self.inner.version()
    }

    /// The weights as a refit finds them, in words.
    #[getter]
    fn weights(&self) -> String {
        self.inner.weights().to_string()
    }

    /// This store's rank.
    #[getter]
    fn rank(&self) -> Rank {
        self.inner.rank()
    }

    /// The layout.
    #[getter]
    fn layout(&self) -> PyLayout {
        PyLayout { inner: self.layout.clone() }
    }
}

/// The weights of one inference (destination) rank: the committed
/// version, the one before it, and a staging copy refits write; a refit
/// commits on every rank of the group only once all have staged it.
#[pyclass(module = "refit._refit", name = "DstStore", frozen)]
struct PyDstStore {
    inner: Arc<DstStore>,
    layout: Arc<Layout>,
    /// Holds taken by `begin_serving` (one per reader in a `serving()`
    /// block), released by `end_serving`.
    serving: Mutex<Vec<orchestrator::Serving>>,
    /// The objects an in-place store's weights are served in.
    targets: Option<Arc<Targets>>,
}

impl PyDstStore {
    /// The committed version to read: the current one, or `version` if it
    /// is the current or the previous one.
    fn snapshot(&self, version: Option<u64>) -> PyResult<Arc<orchestrator::Snapshot>> {
        let rank = self.inner.rank();
        match version {
            None => self.inner.snapshot().ok_or_else(|| VersionError::new_err(format!("dst rank {rank}: no refit has committed yet"))),
            Some(v) => self.inner.snapshot_at(v).ok_or_else(|| {
                let serving = self.inner.version().map_or("nothing yet".to_string(), |c| format!("version {c}"));
                VersionError::new_err(format!(
                    "dst rank {rank}: version {v} is not served (serving {serving}; the previous committed version is kept too)"
                ))
            }),
        }
    }
}

#[pymethods]
impl PyDstStore {
    #[new]
    fn new(layout: PyRef<'_, PyLayout>, rank: Rank) -> PyResult<Self> {
        layout.check_rank(rank)?;
        Ok(PyDstStore {
            inner: Arc::new(DstStore::new(&layout.inner, rank)),
            layout: layout.inner.clone(),
            serving: Mutex::default(),
            targets: None,
        })
    }

    /// A store that serves its weights in the memory of `objects` (as
    /// `SrcStore.in_place`, and writable: read-only memory is refused); a
    /// refit's commit looks each up again and copies the version in,
    /// under one hold of the GIL per buffer. `follow`: as for sources.
    #[staticmethod]
    #[pyo3(signature = (layout, rank, objects, follow=false))]
    fn in_place(layout: PyRef<'_, PyLayout>, rank: Rank, objects: Vec<Bound<'_, PyAny>>, follow: bool) -> PyResult<Self> {
        let (registered, targets) = in_place(&layout, rank, "dst", objects, Access { writable: true, follow })?;
        Ok(PyDstStore {
            inner: Arc::new(DstStore::registered(&layout.inner, rank, registered)),
            layout: layout.inner.clone(),
            serving: Mutex::default(),
            targets: Some(targets),
        })
    }

    /// Looks every registered object up again: `RegistrationError` names
    /// the buffer and what changed.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        check_targets(py, &self.targets)
    }

    /// Takes a reader's hold on the served weights (waiting while a commit
    /// copies into registered memory): no commit changes them until
    /// `end_serving`. Returns the version they hold (None: nothing
    /// committed yet, or torn by a failed commit).
    fn begin_serving(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        let store = self.inner.clone();
        let hold = wait(py, async move { Ok(store.serve().await) })?;
        // What the readers will read must still be what was registered.
        check_targets(py, &self.targets)?;
        let version = hold.version();
        self.serving.lock().unwrap_or_else(|e| e.into_inner()).push(hold);
        Ok(version)
    }

    /// Releases a hold `begin_serving` took.
    fn end_serving(&self) -> PyResult<()> {
        match self.serving.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            Some(_) => Ok(()),
            None => Err(VersionError::new_err(format!("dst rank {}: not serving", self.inner.rank()))),
        }
    }

    /// Whether the weights are served in registered memory.
    #[getter]
    fn is_in_place(&self) -> bool {
        self.inner.registered_memory().is_some()
    }

    /// The weights as a refit finds them, in words.
    #[getter]
    fn weights(&self) -> String {
        self.inner.weights().to_string()
    }

    /// `(version, [bytes of each name])` from one committed version: the
    /// current one, or `version` if it is the current or the previous one.
    #[pyo3(signature = (names, version=None))]
    fn read<'py>(&self, py: Python<'py>, names: Vec<String>, version: Option<u64>) -> PyResult<(u64, Vec<Bound<'py, PyBytes>>)> {
        let snap = self.snapshot(version)?;
        let mut out = Vec::with_capacity(names.len());
        for name in &names {
            let bytes = read_bytes(&snap.buffers, name).map_err(tensor_err)?;
            out.push(PyBytes::new(py, &bytes));
        }
        Ok((snap.version, out))
    }

    /// Copies one committed version (as `read`) into `targets`
    /// (`[(name, array)]`): straight into each C-contiguous host array
    /// (numpy, torch CPU) of the block's dtype and bytes, writable, looked
    /// up again right before its copy; for any other target, its bytes are
    /// returned for the caller to copy. Every target is checked before any
    /// is written. Returns `(version, [None or bytes per target])`.
    #[pyo3(signature = (targets, version=None))]
    fn load_into<'py>(
        &self,
        py: Python<'py>,
        targets: Vec<(String, Bound<'py, PyAny>)>,
        version: Option<u64>,
    ) -> PyResult<(u64, Vec<Option<Bound<'py, PyBytes>>>)> {
        let rank = self.inner.rank();
        let snap = self.snapshot(version)?;
        let mut in_place = Vec::with_capacity(targets.len());
        for (name, target) in &targets {
            let (dt, len) = target_len(&snap.buffers, name).map_err(tensor_err)?;
            let host = matches!(target::find(target)?, Ok(f) if f.device == Device::Host);
            if host {
                drop(host_array(target, &format!("dst rank {rank}: '{name}'"), dt, len, true)?);
            }
            in_place.push(host);
        }
        let mut out = Vec::with_capacity(targets.len());
        for ((name, target), host) in targets.iter().zip(in_place) {
            if !host {
                out.push(Some(PyBytes::new(py, &read_bytes(&snap.buffers, name).map_err(tensor_err)?)));
                continue;
            }
            let (dt, len) = target_len(&snap.buffers, name).map_err(tensor_err)?;
            let found = host_array(target, &format!("dst rank {rank}: '{name}'"), dt, len, true)?;
            let bytes = source_bytes(&snap.buffers, name).map_err(tensor_err)?;
            if bytes.len() != found.nbytes {
                return Err(TensorError::new_err(format!(
                    "dst rank {rank}: '{name}': {} bytes served for {} registered",
                    bytes.len(),
                    found.nbytes
                )));
            }
            if found.nbytes > 0 {
                // SAFETY: `found` was looked up just now, under this GIL
                // hold, with no Python code since: `nbytes` bytes of
                // writable host memory (the object's flag and the process's
                // mappings checked) at `addr`, alive (its keeper is held);
                // `bytes` is the snapshot's (refit's own memory), of the
                // same length, not inside it.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), found.addr as *mut u8, bytes.len()) };
            }
            out.push(None);
        }
        Ok((snap.version, out))
    }

    /// The version readers get (None before the first commit).
    #[getter]
    fn version(&self) -> Option<u64> {
        self.inner.version()
    }

    /// This store's rank.
    #[getter]
    fn rank(&self) -> Rank {
        self.inner.rank()
    }

    /// The layout.
    #[getter]
    fn layout(&self) -> PyLayout {
        PyLayout { inner: self.layout.clone() }
    }
}

// ---------------------------------------------------------------------------
// Joining, the orchestrator.

fn join_config(rendezvous: Option<String>, secret: Option<String>) -> PyResult<JoinConfig> {
    use std::net::ToSocketAddrs;
    let rendezvous = match rendezvous {
        Some(text) => text
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| JoinError::new_err(format!("rendezvous address '{text}': not host:port")))?,
        None => JoinConfig::from_env().map_err(join_err)?.rendezvous,
    };
    let secret = match secret {
        Some(s) => actors::Secret::from_bytes(s.into_bytes()).map_err(|e| JoinError::new_err(format!("secret: {e}")))?,
        None => actors::Secret::from_env(orchestrator::rendezvous::SECRET_ENV)
            .map_err(|e| JoinError::new_err(format!("{}: {e}", orchestrator::rendezvous::SECRET_ENV)))?,
    };
    Ok(JoinConfig { rendezvous, secret, control: ControlConfig::default() })
}

/// A process's membership of a rendezvous: serves its ranks' members.
#[pyclass(module = "refit._refit", name = "Joined", frozen)]
struct PyJoined {
    inner: InRuntime<Arc<Joined>>,
}

#[pymethods]
impl PyJoined {
    /// Joins the rendezvous at `rendezvous` (`host:port`) with `secret`;
    /// either missing is read from the environment (`REFIT_RENDEZVOUS`, or
    /// `MASTER_ADDR` with `REFIT_PORT`; `REFIT_SECRET`).
    #[new]
    #[pyo3(signature = (rendezvous=None, secret=None))]
    fn new(py: Python<'_>, rendezvous: Option<String>, secret: Option<String>) -> PyResult<Self> {
        let config = join_config(rendezvous, secret)?;
        let joined = wait(py, async move { orchestrator::join(&config).await.map_err(join_err) })?;
        Ok(PyJoined { inner: InRuntime(Some(Arc::new(joined))) })
    }

    /// Serves the refit member of a training rank over `store` (`gpu`: the
    /// CUDA device it uses on the NCCL and IPC fabrics).
    #[pyo3(signature = (store, gpu=None))]
    fn serve_src(&self, py: Python<'_>, store: PyRef<'_, PySrcStore>, gpu: Option<usize>) -> PyResult<()> {
        let (joined, layout, rank, role) =
            (self.inner.get().clone(), store.layout.clone(), store.inner.rank(), Role::Src(store.inner.clone()));
        let config = orchestrator::MemberConfig { gpu, ..joined.member_config() };
        wait(py, async move { joined.serve_member_with(layout, rank, role, config).await.map(drop).map_err(join_err) })
    }

    /// Serves the refit member of an inference rank over `store` (`gpu`: as
    /// for `serve_src`).
    #[pyo3(signature = (store, gpu=None))]
    fn serve_dst(&self, py: Python<'_>, store: PyRef<'_, PyDstStore>, gpu: Option<usize>) -> PyResult<()> {
        let (joined, layout, rank, role) =
            (self.inner.get().clone(), store.layout.clone(), store.inner.rank(), Role::Dst(store.inner.clone()));
        let config = orchestrator::MemberConfig { gpu, ..joined.member_config() };
        wait(py, async move { joined.serve_member_with(layout, rank, role, config).await.map(drop).map_err(join_err) })
    }

    /// Waits until the rendezvous goes away (returns why), or `timeout`
    /// seconds (returns None).
    #[pyo3(signature = (timeout=None))]
    fn wait_closed(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<String>> {
        let joined = self.inner.get().clone();
        let timeout = timeout.map(|t| seconds("timeout", t)).transpose()?;
        wait(py, async move {
            Ok(match timeout {
                Some(t) => tokio::time::timeout(t, joined.closed()).await.ok(),
                None => Some(joined.closed().await),
            })
        })
    }

    /// Closes this process's control node (its members stop being
    /// reachable).
    fn shutdown(&self) {
        let Ok(rt) = runtime() else { return };
        let _entered = rt.enter();
        self.inner.get().shutdown();
    }
}

fn report_dict<'py>(py: Python<'py>, r: &RefitReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", r.version)?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("seconds", r.wall.as_secs_f64())?;
    d.set_item("transfer_seconds", r.transfer_time.as_secs_f64())?;
    d.set_item("already_served", r.already_served)?;
    d.set_item("replanned", r.replanned)?;
    d.set_item("fingerprint", r.fingerprint.map(|f| f.to_string()))?;
    d.set_item("mode", r.mode.to_string())?;
    Ok(d)
}

fn plan_dict<'py>(py: Python<'py>, r: &PlanReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("fingerprint", r.fingerprint.to_string())?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("replanned", r.replanned)?;
    d.set_item("mode", r.mode.to_string())?;
    Ok(d)
}

/// The groups of members the orchestrator runs over: sources, destinations.
type Groups = (ActorGroup<Member>, ActorGroup<Member>);

/// What the orchestrator runs over.
#[derive(Clone)]
enum Over {
    /// Members in other processes, found through this rendezvous; their
    /// groups once `connect` found them (replaced members put in by
    /// `recover`).
    Rendezvous(Arc<Rendezvous>, Arc<tokio::sync::Mutex<Option<Groups>>>),
    /// Every member and store in this process.
    Local(Arc<tokio::sync::Mutex<RefitSystem>>),
}

/// The orchestrator: over a rendezvous that member processes join
/// (`Orchestrator(secret, bind)` then `connect`), or over members in this
/// process (`spawn_local`).
#[pyclass(module = "refit._refit", name = "Orchestrator", frozen)]
struct PyOrchestrator {
    over: InRuntime<Mutex<Over>>,
    handle: InRuntime<Mutex<Option<OrchestratorHandle>>>,
    config: OrchestratorConfig,
}

impl PyOrchestrator {
    fn handle(&self) -> PyResult<OrchestratorHandle> {
        let h = self.handle.get().lock().unwrap_or_else(|e| e.into_inner()).clone();
        h.ok_or_else(|| RefitError::new_err("the orchestrator has no members yet: call connect(src_ranks, dst_ranks) first"))
    }
}

/// The fabric named `name`; `local`: every member is in this process.
fn fabric(name: &str, local: bool) -> PyResult<Fabric> {
    use orchestrator::{CommPlane, IpcFabric, NcclFabric};
    Ok(match name {
        "in_process" if local => Fabric::InProcess,
        "node" => Fabric::Node(NodeFabric::default()),
        "nccl" => Fabric::Nccl(NcclFabric::new(CommPlane::Cuda)),
        "ipc" => Fabric::Ipc(IpcFabric::new(CommPlane::Cuda)),
        // Host memory standing in for the GPUs, every member in this
        // process: pipelines tested without a GPU.
        "simulated-nccl" => Fabric::Nccl(NcclFabric::new(CommPlane::Simulated { world: "python".into() })),
        "simulated-ipc" => Fabric::Ipc(IpcFabric::new(CommPlane::Simulated { world: "python".into() })),
        _ => {
            let known = if local {
                "'in_process', 'node', 'nccl', 'ipc', 'simulated-nccl' or 'simulated-ipc'"
            } else {
                "'node', 'nccl', 'ipc', 'simulated-nccl' or 'simulated-ipc'"
            };
            return Err(PyValueError::new_err(format!("fabric '{name}': expected {known}")));
        }
    })
}

fn config(deadline: f64, control_timeout: f64, fabric: Fabric, delta: bool) -> PyResult<OrchestratorConfig> {
    Ok(OrchestratorConfig {
        fabric,
        delta,
        deadline: seconds("deadline", deadline)?,
        control_timeout: seconds("control_timeout", control_timeout)?,
        ..OrchestratorConfig::default()
    })
}

#[pymethods]
impl PyOrchestrator {
    /// Opens a rendezvous at `bind` (port 0: any) that member processes
    /// join with `secret` (16 bytes or more).
    #[new]
    #[pyo3(signature = (secret, bind="127.0.0.1:0", deadline=60.0, control_timeout=10.0, fabric="node", delta=false))]
    fn new(py: Python<'_>, secret: String, bind: &str, deadline: f64, control_timeout: f64, fabric: &str, delta: bool) -> PyResult<Self> {
        let config = config(deadline, control_timeout, self::fabric(fabric, false)?, delta)?;
        let secret = actors::Secret::from_bytes(secret.into_bytes()).map_err(|e| JoinError::new_err(format!("secret: {e}")))?;
        let bind: std::net::SocketAddr = bind.parse().map_err(|_| JoinError::new_err(format!("bind address '{bind}': not ip:port")))?;
        let rendezvous = wait(py, async move { Rendezvous::bind(secret, bind, &ControlConfig::default()).await.map_err(join_err) })?;
        Ok(PyOrchestrator {
            over: InRuntime(Some(Mutex::new(Over::Rendezvous(Arc::new(rendezvous), Arc::default())))),
            handle: InRuntime(Some(Mutex::new(None))),
            config,
        })
    }

    /// The rendezvous address member processes join (`host:port`); None
    /// for a local system.
    #[getter]
    fn address(&self) -> Option<String> {
        match &*self.over.get().lock().unwrap_or_else(|e| e.into_inner()) {
            Over::Rendezvous(r, _) => Some(r.addr().to_string()),
            Over::Local(_) => None,
        }
    }

    /// Waits up to `timeout` seconds for the members of source ranks
    /// `0..src_ranks` and destination ranks `0..dst_ranks` to join, starts
    /// the orchestrator over them, plans and installs every member's
    /// program. Returns the plan report (dict).
    #[pyo3(signature = (src_ranks, dst_ranks, timeout=60.0))]
    fn connect<'py>(&self, py: Python<'py>, src_ranks: u32, dst_ranks: u32, timeout: f64) -> PyResult<Bound<'py, PyDict>> {
        let within = seconds("timeout", timeout)?;
        let (rendezvous, groups) = match &*self.over.get().lock().unwrap_or_else(|e| e.into_inner()) {
            Over::Rendezvous(r, g) => (r.clone(), g.clone()),
            Over::Local(_) => return Err(RefitError::new_err("a local system is connected already")),
        };
        let config = self.config.clone();
        let (handle, plan) = wait(py, async move {
            let src = rendezvous.members(Group::Src, src_ranks, within).await.map_err(join_err)?;
            let dst = rendezvous.members(Group::Dst, dst_ranks, within).await.map_err(join_err)?;
            let handle = orchestrator::spawn_orchestrator(src.clone(), dst.clone(), config);
            *groups.lock().await = Some((src, dst));
            let plan = handle.plan().await.map_err(refit_err)?;
            Ok((handle, plan))
        })?;
        let old = self.handle.get().lock().unwrap_or_else(|e| e.into_inner()).replace(handle);
        drop(InRuntime(old));
        plan_dict(py, &plan)
    }

    /// Refits exactly `version`, which every source must hold.
    fn refit<'py>(&self, py: Python<'py>, version: u64) -> PyResult<Bound<'py, PyDict>> {
        let h = self.handle()?;
        let r = wait(py, async move { h.refit(version).await.map_err(refit_err) })?;
        report_dict(py, &r)
    }

    /// Refits the newest version every source holds.
    fn refit_latest<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let h = self.handle()?;
        let r = wait(py, async move { h.refit_latest().await.map_err(refit_err) })?;
        report_dict(py, &r)
    }

    /// A subset refit of `version` (None: the newest every source holds)
    /// for the destination tensors `only` (see
    /// `OrchestratorHandle::refit_only`).
    #[pyo3(signature = (only, version=None))]
    fn refit_only<'py>(&self, py: Python<'py>, only: Vec<String>, version: Option<u64>) -> PyResult<Bound<'py, PyDict>> {
        let h = self.handle()?;
        let target = version.map_or(orchestrator::RefitTarget::Latest, orchestrator::RefitTarget::Version);
        let r = wait(py, async move { h.refit_only(target, orchestrator::TensorSubset::new(only)).await.map_err(refit_err) })?;
        report_dict(py, &r)
    }

    /// Puts a new member in the place of every member whose process died
    /// (or went silent past the heartbeat timeout): the process that joins
    /// under the dead one's rank within `timeout` seconds, in all. Returns
    /// the ranks replaced as `(group, rank)`, `group` `"src"` or `"dst"`
    /// (empty: every member is alive). On a local system a stopped member
    /// is restarted over its store. A rank whose replacement does not join
    /// in time raises `JoinError` naming it; ranks replaced before it stay
    /// replaced.
    #[pyo3(signature = (timeout=60.0))]
    fn recover(&self, py: Python<'_>, timeout: f64) -> PyResult<Vec<(String, u32)>> {
        let within = seconds("timeout", timeout)?;
        let h = self.handle()?;
        // Cloned out, so that nothing waits on the lock while this waits.
        let over = self.over.get().lock().unwrap_or_else(|e| e.into_inner()).clone();
        let replaced = match over {
            Over::Rendezvous(rendezvous, groups) => wait(py, async move {
                let mut groups = groups.lock().await;
                let Some((src, dst)) = groups.as_mut() else { return Ok(Vec::new()) };
                rendezvous.recover(&h, src, dst, within).await.map_err(join_err)
            }),
            Over::Local(system) => wait(py, async move {
                let mut system = system.lock().await;
                let gone: Vec<Endpoint> = [(Group::Src, &system.src_members), (Group::Dst, &system.dst_members)]
                    .into_iter()
                    .flat_map(|(g, m)| m.iter().filter(|(_, a)| !a.is_alive()).map(move |(r, _)| Endpoint { group: g, rank: r as u32 }))
                    .collect();
                for &e in &gone {
                    system.replace_member(e).await.map_err(refit_err)?;
                }
                Ok(gone)
            }),
        }?;
        Ok(replaced.into_iter().map(|e| (e.group.to_string(), e.rank)).collect())
    }

    /// Checks both groups' layouts, plans and installs now.
    fn plan<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let h = self.handle()?;
        let r = wait(py, async move { h.plan().await.map_err(refit_err) })?;
        plan_dict(py, &r)
    }

    /// `"reshard"` or `"baseline"` (gather on one rank and broadcast).
    fn set_mode(&self, py: Python<'_>, mode: &str) -> PyResult<()> {
        let mode = match mode {
            "reshard" => reshard::Strategy::Reshard,
            "baseline" => reshard::Strategy::Baseline,
            other => return Err(RefitError::new_err(format!("mode '{other}': expected 'reshard' or 'baseline'"))),
        };
        let h = self.handle()?;
        wait(py, async move { h.set_mode(mode).await.map_err(refit_err) })
    }

    /// Stops the orchestrator and closes the rendezvous: member processes
    /// see it go (`Joined.wait_closed` returns).
    fn close(&self) {
        let Ok(rt) = runtime() else { return };
        let _entered = rt.enter();
        drop(self.handle.get().lock().unwrap_or_else(|e| e.into_inner()).take());
        if let Over::Rendezvous(r, _) = &*self.over.get().lock().unwrap_or_else(|e| e.into_inner()) {
            r.node().shutdown();
        }
    }
}

/// Plans a refit from `src` to `dst` without running it (`mode`:
/// `"reshard"` or `"baseline"`) and returns its figures, those `refit plan`
/// prints (dict); a pair that cannot be planned raises `PlanError`.
#[pyfunction]
#[pyo3(signature = (src, dst, mode="reshard"))]
fn plan_figures<'py>(py: Python<'py>, src: PyRef<'py, PyLayout>, dst: PyRef<'py, PyLayout>, mode: &str) -> PyResult<Bound<'py, PyDict>> {
    let planner = match mode {
        "reshard" => reshard::plan_reshard,
        "baseline" => reshard::plan_baseline,
        other => return Err(PlanError::new_err(format!("mode '{other}': expected 'reshard' or 'baseline'"))),
    };
    let (s, d) = (src.inner.clone(), dst.inner.clone());
    let plan = py.detach(move || planner(&s, &d, &reshard::PlanOptions::default())).map_err(|e| PlanError::new_err(e.to_string()))?;
    let f = plan.figures();
    let out = PyDict::new(py);
    out.set_item("bytes", f.total_bytes)?;
    out.set_item("src_egress_bytes", f.src_egress_bytes)?;
    out.set_item("relayed_bytes", f.relayed_bytes())?;
    out.set_item("cross_node_bytes", f.cross_node_bytes)?;
    out.set_item("dst_node_ingress_bytes", f.dst_node_ingress_bytes.clone())?;
    out.set_item("src_rank_egress_bytes", f.src_rank_egress_bytes.clone())?;
    out.set_item("max_rank_send_bytes", f.max_rank_send_bytes)?;
    out.set_item("max_rank_recv_bytes", f.max_rank_recv_bytes)?;
    out.set_item("messages", f.messages)?;
    out.set_item("rounds", f.rounds)?;
    out.set_item("fingerprint", plan.fingerprint().to_string())?;
    Ok(out)
}

/// Spawns one store and one member per rank of both layouts in this
/// process and an orchestrator over them, and plans. Returns
/// `(orchestrator, [SrcStore], [DstStore])`.
#[pyfunction]
#[pyo3(signature = (src, dst, deadline=60.0, control_timeout=10.0, fabric="in_process", delta=false))]
fn spawn_local(
    py: Python<'_>,
    src: PyRef<'_, PyLayout>,
    dst: PyRef<'_, PyLayout>,
    deadline: f64,
    control_timeout: f64,
    fabric: &str,
    delta: bool,
) -> PyResult<(PyOrchestrator, Vec<PySrcStore>, Vec<PyDstStore>)> {
    let config = config(deadline, control_timeout, self::fabric(fabric, true)?, delta)?;
    let (s, d, c) = (src.inner.clone(), dst.inner.clone(), config.clone());
    let system = wait(py, async move { orchestrator::spawn_refit(&s, &d, c).await.map_err(refit_err) })?;
    let srcs = system
        .src_stores
        .iter()
        .map(|st| PySrcStore { inner: st.clone(), layout: src.inner.clone(), stepping: Mutex::new(None), targets: None })
        .collect();
    let dsts = system
        .dst_stores
        .iter()
        .map(|st| PyDstStore { inner: st.clone(), layout: dst.inner.clone(), serving: Mutex::default(), targets: None })
        .collect();
    let handle = system.orchestrator.clone();
    let orchestrator = PyOrchestrator {
        over: InRuntime(Some(Mutex::new(Over::Local(Arc::new(tokio::sync::Mutex::new(system)))))),
        handle: InRuntime(Some(Mutex::new(Some(handle)))),
        config,
    };
    Ok((orchestrator, srcs, dsts))
}

/// Whether `object` is a C-contiguous host array refit copies in place
/// (numpy, torch CPU, DLPack on the CPU).
#[pyfunction]
fn is_host_array(object: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(matches!(target::find(object)?, Ok(f) if f.device == Device::Host))
}

/// `(address, bytes, GPU or None)` of the memory refit would use in place
/// for `object` (for inspection and tests: nothing takes an address
/// back); `TensorError` saying why for anything else.
#[pyfunction]
fn memory_of(object: &Bound<'_, PyAny>) -> PyResult<(u64, usize, Option<usize>)> {
    let found = target::find(object)?.map_err(TensorError::new_err)?;
    let gpu = match found.device {
        Device::Host => None,
        Device::Cuda(i) => Some(i),
    };
    Ok((found.addr, found.nbytes, gpu))
}

#[pymodule]
fn _refit(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("RefitError", py.get_type::<RefitError>())?;
    m.add("LayoutError", py.get_type::<LayoutError>())?;
    m.add("PlanError", py.get_type::<PlanError>())?;
    m.add("TensorError", py.get_type::<TensorError>())?;
    m.add("VersionError", py.get_type::<VersionError>())?;
    m.add("MemberError", py.get_type::<MemberError>())?;
    m.add("JoinError", py.get_type::<JoinError>())?;
    m.add("RegistrationError", py.get_type::<RegistrationError>())?;
    m.add_function(wrap_pyfunction!(is_host_array, m)?)?;
    m.add_function(wrap_pyfunction!(memory_of, m)?)?;
    m.add_class::<PyLayout>()?;
    m.add_class::<PyTensorBuilder>()?;
    m.add_class::<PyLayoutBuilder>()?;
    m.add_function(wrap_pyfunction!(plan_figures, m)?)?;
    m.add_class::<PySrcStore>()?;
    m.add_class::<PyDstStore>()?;
    m.add_class::<PyJoined>()?;
    m.add_class::<PyOrchestrator>()?;
    m.add_function(wrap_pyfunction!(spawn_local, m)?)?;
    Ok(())
}
