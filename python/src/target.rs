//! The memory of Python objects refit reads and writes in place, found
//! from the objects themselves and never trusted past the moment it was
//! checked.
//!
//! [`find`] asks an object for its memory through the library that made
//! it: a torch tensor through `torch.Tensor`'s own methods (checked
//! against its storage), a numpy array from its C struct (no Python
//! attribute of it runs: [`crate::ndarray`]), a CUDA array through
//! `__cuda_array_interface__`, a DLPack tensor through its capsule. What
//! it finds ([`Found`]) carries a *keeper*: the object that keeps the
//! memory alive whatever is done to the registered object (a torch
//! storage, the DLPack capsule; a weak reference for a numpy array, which
//! makes numpy refuse `resize`), and a *probe* that reads where the memory
//! is again without running Python code (the numpy struct; a DLPack export
//! by torch's C function; the capsule).
//!
//! [`Targets`] are a rank's registered buffers. Before every use
//! ([`RegisteredMemory::visit`], under one GIL hold) all of them are looked up
//! again (the objects' own code may run here: a torch subclass's
//! `__torch_function__`), then all are checked with no Python code running
//! (each probe must still read what its look-up found, so a look-up that
//! freed, moved or resized another buffer is caught; each must still be
//! what was registered), then used (the commit's copy; a source's refit
//! and a direct destination take the regions) with no Python code in
//! between. One that changed is refused, naming the buffer and what
//! changed, or with `follow` taken at its new place after the same checks
//! as at registration. Memory freed by another thread while a refit uses
//! it is not defended (docs/python.md). Nothing here takes an address from
//! the caller.

use crate::ndarray;
use crate::writable_maps::WritableMaps;
use orchestrator::{RegisteredMemory, RegisteredMemoryError, RegisteredVisitError, Residence};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use reshard::DType;
use std::sync::Mutex;

/// Where memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Device {
    /// Host memory.
    Host,
    /// Memory of CUDA device `0`.
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Host => f.write_str("host memory"),
            Device::Cuda(i) => write!(f, "GPU {i}"),
        }
    }
}

/// What an object's elements are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Elem {
    /// One of refit's dtypes.
    Is(DType),
    /// 16-bit integers (bf16 given as its raw bits).
    Bits16,
    /// Anything else, as the object names it.
    Other(String),
}

impl Elem {
    /// Whether elements of this kind hold a buffer of `want`: the same
    /// dtype, or raw bits of its size (bf16 as 16-bit integers, the 8-bit
    /// floats as bytes). bf16 and f16 are told apart.
    pub(crate) fn holds(&self, want: DType) -> bool {
        match self {
            Elem::Is(d) => *d == want || (matches!(want, DType::F8E4M3 | DType::F8E5M2) && matches!(d, DType::U8 | DType::I8)),
            Elem::Bits16 => want == DType::BF16,
            Elem::Other(_) => false,
        }
    }
}

impl std::fmt::Display for Elem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Elem::Is(d) => write!(f, "{d}"),
            Elem::Bits16 => f.write_str("16-bit integers"),
            Elem::Other(s) => f.write_str(s),
        }
    }
}

/// An object's memory as found just now.
pub(crate) struct Found {
    pub(crate) addr: u64,
    pub(crate) nbytes: usize,
    pub(crate) elem: Elem,
    pub(crate) shape: Vec<u64>,
    pub(crate) device: Device,
    /// False where the object says its memory is read-only (a torch CPU
    /// tensor's memory is checked against the process's mappings apart).
    pub(crate) writable: bool,
    /// Keeps the memory alive.
    pub(crate) keeper: Py<PyAny>,
    /// The address of the array that owns the memory, for a numpy view
    /// (whose own address would not change if its owner's memory were
    /// replaced).
    pub(crate) origin: Option<u64>,
    /// How to read where the memory is again without running Python code.
    probe: Probe,
}

/// How a [`Found`]'s memory is read again with no Python code running
/// ([`Probe::now`]): between a refit's look-ups, which run the objects'
/// own code, and its use of the memory.
enum Probe {
    /// A numpy array (of numpy's ndarray type as found): its C struct.
    Numpy { array: Py<PyAny>, ndarray: ndarray::NdArrayTypeRef },
    /// A torch tensor: a DLPack export made by torch's C function
    /// `torch._C._to_dlpack` (no `__torch_function__` runs), whose
    /// address must be the tensor's and hold the bytes found.
    Torch { tensor: Py<PyAny>, to_dlpack: Py<PyAny> },
    /// A DLPack capsule registered as it is (read again from the capsule).
    Capsule(Py<PyAny>),
    /// Read only through the object's own Python code (a CUDA array
    /// interface, a `__dlpack__` method): what its look-up found is used.
    Unread,
}

impl Probe {
    /// (address, bytes, origin) of the memory now, or why it cannot be
    /// told; `None` for [`Probe::Unread`]. Runs no Python code.
    fn now(&self, py: Python<'_>) -> Result<Option<(u64, usize, Option<u64>)>, String> {
        match self {
            Probe::Numpy { array, ndarray } => {
                let state = ndarray::state(&ndarray.bind(py), array.bind(py)).ok_or("no longer an ndarray")?;
                if !state.c_contiguous {
                    return Err("no longer in C order".into());
                }
                Ok(Some((state.addr, state.nbytes, state.origin)))
            }
            Probe::Torch { tensor, to_dlpack } => {
                let capsule = to_dlpack.bind(py).call1((tensor.bind(py),)).map_err(|e| format!("torch's DLPack export failed: {e}"))?;
                let found = dlpack(&capsule, capsule.clone().unbind(), Probe::Unread).map_err(|e| e.to_string())??;
                Ok(Some((found.addr, found.nbytes, None)))
            }
            Probe::Capsule(capsule) => {
                let capsule = capsule.bind(py);
                let found = dlpack(capsule, capsule.clone().unbind(), Probe::Unread).map_err(|e| e.to_string())??;
                Ok(Some((found.addr, found.nbytes, None)))
            }
            Probe::Unread => Ok(None),
        }
    }
}

impl Found {
    /// The first `elems` elements, as a flat array.
    fn prefix(mut self, elems: u64) -> Result<Found, String> {
        let numel: u64 = self.shape.iter().product();
        let size = (self.nbytes as u64).checked_div(numel).unwrap_or(0);
        let need = elems.checked_mul(size).and_then(|n| usize::try_from(n).ok()).ok_or("a cut that overflows")?;
        if elems > numel {
            return Err(format!("the parameter holds {numel} elements ({:?}), the buffer needs {elems}", self.shape));
        }
        self.nbytes = need;
        self.shape = vec![elems];
        Ok(self)
    }

    fn describe(&self) -> String {
        format!("{} {:?} on {} ({} bytes at {:#x})", self.elem, self.shape, self.device, self.nbytes, self.addr)
    }
}

/// `sys.modules[name]` if imported (refit never imports torch or numpy
/// itself).
fn imported<'py>(py: Python<'py>, name: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    let modules = py.import("sys")?.getattr("modules")?;
    Ok(modules.get_item(name).ok())
}

fn checked_bytes(shape: &[u64], size: u64) -> Option<usize> {
    shape.iter().try_fold(size, |acc, &d| acc.checked_mul(d)).and_then(|n| usize::try_from(n).ok())
}

/// The memory of `object` if it is a C-contiguous torch tensor, numpy
/// array, CUDA array or DLPack tensor: `Ok(Err(why))` when it is none of
/// them or not usable in place (non-contiguous, ...). Runs the object's
/// own code (properties, methods): call it right before the memory is
/// used, under the same GIL hold.
pub(crate) fn find(object: &Bound<'_, PyAny>) -> PyResult<Result<Found, String>> {
    let py = object.py();
    let object = &local(object)?;
    if let Some(torch) = imported(py, "torch")? {
        if object.is_instance(&torch.getattr("Tensor")?)? {
            // A flat view `refit.param_buffers` cut from a parameter: the
            // parameter's memory, looked up from the parameter itself (so
            // `param.data = ...` is seen), cut to the buffer's elements.
            if let Ok(origin) = object.getattr("_refit_param") {
                let (param, elems): (Bound<'_, PyAny>, u64) = origin.extract()?;
                let param = local(&param)?;
                if !param.is_instance(&torch.getattr("Tensor")?)? {
                    return Ok(Err("a view of a parameter that is no longer a torch tensor".into()));
                }
                return Ok(torch_tensor(&torch, &param)?.and_then(|found| found.prefix(elems)));
            }
            return torch_tensor(&torch, object);
        }
    }
    if let Some(numpy) = imported(py, "numpy")? {
        if let Some(ndarray) = ndarray::NdArrayType::of(&numpy)? {
            if ndarray.holds(object) {
                return numpy_array(py, &ndarray, object);
            }
        }
    }
    if object.hasattr("__cuda_array_interface__")? {
        return cuda_array(object);
    }
    if object.get_type().name()? == "PyCapsule" {
        return dlpack(object, object.clone().unbind(), Probe::Capsule(object.clone().unbind()));
    }
    if object.hasattr("__dlpack__")? {
        let capsule = object.call_method0("__dlpack__")?;
        return dlpack(&capsule, capsule.clone().unbind(), Probe::Unread);
    }
    Ok(Err(format!(
        "{} holds no memory refit can use in place (a C-contiguous numpy array, torch tensor, CUDA array or DLPack tensor can)",
        object.get_type().name()?
    )))
}

/// A DTensor's local shard; anything else as it is.
fn local<'py>(object: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    if object.get_type().name()? == "DTensor" && object.hasattr("to_local")? {
        return object.call_method0("to_local");
    }
    Ok(object.clone())
}

fn torch_tensor(torch: &Bound<'_, PyAny>, object: &Bound<'_, PyAny>) -> PyResult<Result<Found, String>> {
    // torch.Tensor's own methods, not whatever a subclass put in their place.
    let tensor = torch.getattr("Tensor")?;
    let call = |m: &str| tensor.getattr(m)?.call1((object,));
    if !call("is_contiguous")?.extract::<bool>()? {
        return Ok(Err("a non-contiguous tensor".into()));
    }
    let device = object.getattr("device")?;
    let kind: String = device.getattr("type")?.extract()?;
    let device = match kind.as_str() {
        "cpu" => Device::Host,
        "cuda" => Device::Cuda(device.getattr("index")?.extract::<Option<usize>>()?.unwrap_or(0)),
        other => return Ok(Err(format!("a tensor on {other}, which refit does not reach"))),
    };
    let dtype: String = object.getattr("dtype")?.str()?.extract()?;
    let elem = match dtype.trim_start_matches("torch.") {
        "float64" => Elem::Is(DType::F64),
        "float32" => Elem::Is(DType::F32),
        "float16" => Elem::Is(DType::F16),
        "bfloat16" => Elem::Is(DType::BF16),
        "float8_e4m3fn" => Elem::Is(DType::F8E4M3),
        "float8_e5m2" => Elem::Is(DType::F8E5M2),
        "int64" => Elem::Is(DType::I64),
        "int32" => Elem::Is(DType::I32),
        "int8" => Elem::Is(DType::I8),
        "uint8" => Elem::Is(DType::U8),
        "int16" | "uint16" => Elem::Bits16,
        _ => Elem::Other(dtype.clone()),
    };
    let shape: Vec<u64> = object.getattr("shape")?.extract()?;
    let size: u64 = call("element_size")?.extract()?;
    let Some(nbytes) = checked_bytes(&shape, size) else { return Ok(Err(format!("a tensor of shape {shape:?} overflows"))) };
    let addr: u64 = call("data_ptr")?.extract()?;
    let storage = call("untyped_storage")?;
    let base: u64 = storage.call_method0("data_ptr")?.extract()?;
    let len: u64 = storage.call_method0("nbytes")?.extract()?;
    let inside = addr.checked_sub(base).and_then(|off| off.checked_add(nbytes as u64)).is_some_and(|end| end <= len);
    if !inside && nbytes > 0 {
        return Ok(Err(format!("a tensor whose {nbytes} bytes at {addr:#x} are not inside its storage ({len} bytes at {base:#x})")));
    }
    let probe = Probe::Torch { tensor: object.clone().unbind(), to_dlpack: torch.getattr("_C")?.getattr("_to_dlpack")?.unbind() };
    Ok(Ok(Found { addr, nbytes, elem, shape, device, writable: true, keeper: storage.unbind(), origin: None, probe }))
}

/// Elements of a numpy / CUDA array interface `typestr` (little-endian or
/// byte-sized only).
fn typestr_elem(typestr: &str) -> Result<Elem, String> {
    let (order, kind) = typestr.split_at(typestr.len().min(1));
    if !matches!(order, "<" | "|" | "=") {
        return Err(format!("elements of type '{typestr}' (big-endian)"));
    }
    Ok(match kind {
        "f8" => Elem::Is(DType::F64),
        "f4" => Elem::Is(DType::F32),
        "f2" => Elem::Is(DType::F16),
        "i8" => Elem::Is(DType::I64),
        "i4" => Elem::Is(DType::I32),
        "i1" => Elem::Is(DType::I8),
        "u1" | "b1" => Elem::Is(DType::U8),
        "u2" | "i2" => Elem::Bits16,
        _ => Elem::Other(format!("'{typestr}'")),
    })
}

fn interface_size(typestr: &str) -> Option<u64> {
    typestr.get(2..)?.parse().ok()
}

/// A numpy array's memory, read from its C struct ([`ndarray::state`]):
/// no property of the array (of an ndarray subclass) runs.
fn numpy_array(py: Python<'_>, ndarray: &ndarray::NdArrayType<'_>, object: &Bound<'_, PyAny>) -> PyResult<Result<Found, String>> {
    let Some(state) = ndarray::state(ndarray, object) else { return Ok(Err("not an ndarray".into())) };
    if !state.c_contiguous {
        return Ok(Err("an array not in C order".into()));
    }
    if state.swapped {
        return Ok(Err(format!("elements of type {} (big-endian)", state.elem)));
    }
    if state.nbytes == usize::MAX {
        return Ok(Err(format!("an array of shape {:?} overflows", state.shape)));
    }
    // A weak reference to the array that owns the memory (a view's
    // base): numpy refuses to resize an array that has one.
    // SAFETY: `state.owner` is `object` or an ndarray of its chain of
    // bases, each held by the one before: alive under the GIL.
    let owner = unsafe { Bound::from_borrowed_ptr(py, state.owner) };
    let keeper = py.import("weakref")?.getattr("ref")?.call1((&owner,))?;
    Ok(Ok(Found {
        addr: state.addr,
        nbytes: state.nbytes,
        elem: state.elem,
        shape: state.shape,
        device: Device::Host,
        writable: state.writable,
        keeper: keeper.unbind(),
        origin: state.origin,
        probe: Probe::Numpy { array: object.clone().unbind(), ndarray: ndarray.unbind() },
    }))
}

fn cuda_array(object: &Bound<'_, PyAny>) -> PyResult<Result<Found, String>> {
    let interface = object.getattr("__cuda_array_interface__")?.cast_into::<PyDict>()?;
    if interface.get_item("strides")?.is_some_and(|s| !s.is_none()) {
        return Ok(Err("a CUDA array not in C order".into()));
    }
    let Some(device) = object.getattr("device").ok().and_then(|d| d.getattr("id").ok()) else {
        return Ok(Err("a CUDA array without a device id".into()));
    };
    let device = Device::Cuda(device.extract()?);
    let data = interface.get_item("data")?.ok_or_else(|| pyo3::exceptions::PyKeyError::new_err("no 'data'"))?;
    let (addr, readonly): (u64, bool) = data.extract()?;
    let typestr: String = interface.get_item("typestr")?.map_or(Ok(String::new()), |t| t.extract())?;
    let elem = match typestr_elem(&typestr) {
        Ok(e) => e,
        Err(why) => return Ok(Err(why)),
    };
    let Some(size) = interface_size(&typestr) else { return Ok(Err(format!("elements of type '{typestr}'"))) };
    let shape: Vec<u64> = interface.get_item("shape")?.map_or(Ok(Vec::new()), |s| s.extract())?;
    let Some(nbytes) = checked_bytes(&shape, size) else { return Ok(Err(format!("an array of shape {shape:?} overflows"))) };
    Ok(Ok(Found {
        addr,
        nbytes,
        elem,
        shape,
        device,
        writable: !readonly,
        keeper: object.clone().unbind(),
        origin: None,
        probe: Probe::Unread,
    }))
}

/// DLPack's `DLTensor` (dlpack.h), which a `DLManagedTensor` starts with.
#[repr(C)]
struct DlTensor {
    data: *mut std::ffi::c_void,
    device_type: i32,
    device_id: i32,
    ndim: i32,
    code: u8,
    bits: u8,
    lanes: u16,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

fn dlpack(capsule: &Bound<'_, PyAny>, keeper: Py<PyAny>, probe: Probe) -> PyResult<Result<Found, String>> {
    const NAME: &std::ffi::CStr = c"dltensor";
    // SAFETY: `capsule` is a live Python object (borrowed under the GIL);
    // PyCapsule_IsValid only reads its type and name.
    let valid = unsafe { pyo3::ffi::PyCapsule_IsValid(capsule.as_ptr(), NAME.as_ptr()) } == 1;
    if !valid {
        return Ok(Err("not an unconsumed DLPack capsule (named 'dltensor')".into()));
    }
    // SAFETY: checked just above to be a capsule named "dltensor".
    let ptr = unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), NAME.as_ptr()) } as *const DlTensor;
    if ptr.is_null() {
        return Err(PyErr::fetch(capsule.py()));
    }
    // SAFETY: by the DLPack protocol an unconsumed "dltensor" capsule
    // points to a DLManagedTensor, which starts with a DLTensor, alive
    // while the capsule is (we hold it, under the GIL); `shape` (and
    // `strides`, unless null) point to `ndim` int64s.
    let (t, shape, strides) = unsafe {
        let t = &*ptr;
        let ndim = usize::try_from(t.ndim).unwrap_or(0);
        let shape = if ndim == 0 || t.shape.is_null() { Vec::new() } else { std::slice::from_raw_parts(t.shape, ndim).to_vec() };
        let strides = (!t.strides.is_null() && ndim > 0).then(|| std::slice::from_raw_parts(t.strides, ndim).to_vec());
        (t, shape, strides)
    };
    if shape.iter().any(|&d| d < 0) {
        return Ok(Err(format!("a DLPack tensor of shape {shape:?}")));
    }
    let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    if let Some(strides) = strides {
        let mut expect: i64 = 1;
        for (&n, &s) in shape.iter().zip(&strides).rev() {
            if n != 1 && s != expect {
                return Ok(Err("a non-contiguous DLPack tensor".into()));
            }
            expect = expect.saturating_mul(n as i64);
        }
    }
    if t.lanes != 1 || t.bits % 8 != 0 {
        return Ok(Err(format!("DLPack elements of {} bits x {} lanes", t.bits, t.lanes)));
    }
    let elem = match (t.code, t.bits) {
        (2, 64) => Elem::Is(DType::F64),
        (2, 32) => Elem::Is(DType::F32),
        (2, 16) => Elem::Is(DType::F16),
        (4, 16) => Elem::Is(DType::BF16),
        (0, 64) => Elem::Is(DType::I64),
        (0, 32) => Elem::Is(DType::I32),
        (0, 8) => Elem::Is(DType::I8),
        (1, 8) | (6, 8) => Elem::Is(DType::U8),
        (0 | 1, 16) => Elem::Bits16,
        (code, bits) => Elem::Other(format!("DLPack type code {code} of {bits} bits")),
    };
    let device = match t.device_type {
        1 | 3 => Device::Host,
        2 | 13 => Device::Cuda(usize::try_from(t.device_id).unwrap_or(0)),
        kind => return Ok(Err(format!("a DLPack tensor on device type {kind} (CPU or CUDA can be used)"))),
    };
    let Some(nbytes) = checked_bytes(&shape, u64::from(t.bits / 8)) else {
        return Ok(Err(format!("a DLPack tensor of shape {shape:?} overflows")));
    };
    let Some(addr) = (t.data as u64).checked_add(t.byte_offset) else { return Ok(Err("a DLPack address that overflows".into())) };
    Ok(Ok(Found { addr, nbytes, elem, shape, device, writable: true, keeper, origin: None, probe }))
}

/// What a registered buffer must be.
#[derive(Debug, Clone)]
pub(crate) struct Want {
    pub(crate) name: String,
    pub(crate) dtype: DType,
    pub(crate) elems: u64,
    /// The block's extent, where the buffer is one tensor's block.
    pub(crate) shape: Option<Vec<u64>>,
}

impl Want {
    fn bytes(&self) -> Option<usize> {
        self.elems.checked_mul(self.dtype.size()).and_then(|n| usize::try_from(n).ok())
    }
}

/// How a registration treats memory: written (a destination) or only
/// read, and whether an object that moved is followed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Access {
    pub(crate) writable: bool,
    pub(crate) follow: bool,
}

/// Checks `found` against what the buffer must be (everything but its
/// address): why not, if it does not fit.
fn fits(found: &Found, want: &Want, access: Access, maps: &mut Option<WritableMaps>) -> Result<(), String> {
    if !found.elem.holds(want.dtype) {
        let hint = if want.dtype == DType::BF16 { " (bf16 may be given as its raw bits: 16-bit integers)" } else { "" };
        return Err(format!("{} given for a {} buffer{hint}", found.elem, want.dtype));
    }
    let elem_size = match &found.elem {
        Elem::Is(d) => d.size(),
        Elem::Bits16 => 2,
        Elem::Other(_) => 0,
    };
    let given: u64 = found.shape.iter().product();
    if given != want.elems || Some(found.nbytes) != want.bytes() || elem_size != want.dtype.size() {
        return Err(format!(
            "{given} elements ({} bytes) given, the buffer holds {} ({} bytes)",
            found.nbytes,
            want.elems,
            want.bytes().unwrap_or(0)
        ));
    }
    if let Some(extent) = &want.shape {
        let flat = found.shape.len() == 1;
        if &found.shape != extent && !flat {
            return Err(format!("shape {:?} given, the block is {extent:?} (or flat [{}])", found.shape, want.elems));
        }
    }
    if access.writable {
        if !found.writable {
            return Err("read-only memory given for weights refit writes".into());
        }
        if found.device == Device::Host && found.nbytes > 0 {
            if maps.is_none() {
                *maps = Some(WritableMaps::read()?);
            }
            if !maps.as_ref().is_some_and(|m| m.covers(found.addr, found.nbytes)) {
                return Err(format!("its {} bytes at {:#x} are not writable memory (a read-only map?)", found.nbytes, found.addr));
            }
        }
    }
    Ok(())
}

/// Where a registered buffer is now, and what keeps it there.
struct Pinned {
    addr: u64,
    origin: Option<u64>,
    nbytes: usize,
    device: Device,
    described: String,
    _keeper: Py<PyAny>,
}

impl Pinned {
    fn at(found: &Found, keeper: Py<PyAny>) -> Pinned {
        Pinned {
            addr: found.addr,
            origin: found.origin,
            nbytes: found.nbytes,
            device: found.device,
            described: found.describe(),
            _keeper: keeper,
        }
    }
}

struct Entry {
    want: Want,
    object: Py<PyAny>,
    pinned: Mutex<Pinned>,
}

/// A rank's registered buffers: the objects, what each must be, and
/// where each was found (held alive).
pub(crate) struct Targets {
    what: String,
    access: Access,
    entries: Vec<Entry>,
    /// Where every buffer is (one device for all, and a buffer never
    /// moves to another: [`Targets::verify`]).
    residence: Residence,
}

impl Targets {
    /// Registers `objects` for `wants` (the rank's buffers, in order):
    /// each found and checked now. `what` names the rank in errors.
    pub(crate) fn register(
        what: String,
        access: Access,
        wants: Vec<Want>,
        objects: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Result<Targets, String>> {
        if wants.len() != objects.len() {
            return Ok(Err(format!("{what}: {} objects for {} buffers", objects.len(), wants.len())));
        }
        let mut maps = None;
        let mut entries = Vec::with_capacity(wants.len());
        let mut device = None;
        for (want, object) in wants.into_iter().zip(objects) {
            let found = match find(&object)? {
                Ok(f) => f,
                Err(why) => return Ok(Err(format!("{what}: buffer '{}': {why}", want.name))),
            };
            if let Err(why) = fits(&found, &want, access, &mut maps) {
                return Ok(Err(format!("{what}: buffer '{}': {why}", want.name)));
            }
            if found.addr == 0 && found.nbytes > 0 {
                return Ok(Err(format!("{what}: buffer '{}': a null address", want.name)));
            }
            match device {
                None => device = Some(found.device),
                Some(d) if d != found.device => {
                    return Ok(Err(format!(
                        "{what}: buffer '{}' is on {}, an earlier one on {d}: all must be on one device",
                        want.name, found.device
                    )))
                }
                Some(_) => {}
            }
            let pinned = Pinned::at(&found, found.keeper.clone_ref(object.py()));
            entries.push(Entry { want, object: object.unbind(), pinned: Mutex::new(pinned) });
        }
        let residence = match device {
            Some(Device::Cuda(ordinal)) => Residence::Device { ordinal },
            _ => Residence::Host,
        };
        Ok(Ok(Targets { what, access, entries, residence }))
    }

    /// Looks buffer `i` up again: the object's own code may run (a
    /// property, `__torch_function__`), and may change any buffer.
    fn resolve(&self, py: Python<'_>, i: usize) -> Result<Found, String> {
        let name = &self.entries[i].want.name;
        match find(self.entries[i].object.bind(py)) {
            Ok(Ok(f)) => Ok(f),
            Ok(Err(why)) => Err(format!("buffer '{name}': the registered object changed: now {why}")),
            Err(e) => Err(format!("buffer '{name}': looking the registered object up raised {e}")),
        }
    }

    /// Checks buffer `i` as `found` (its look-up) says it is: the same
    /// memory as its probe reads now (nothing changed it since the
    /// look-up, such as a later buffer's look-up), still what was
    /// registered (or, following, fitting at a new place). Where it is
    /// now, and the new pin if it moved. Runs no Python code.
    fn verify(
        &self,
        py: Python<'_>,
        i: usize,
        found: &Found,
        maps: &mut Option<WritableMaps>,
    ) -> Result<(u64, usize, Option<Pinned>), String> {
        let entry = &self.entries[i];
        let name = &entry.want.name;
        match found.probe.now(py) {
            Ok(None) => {}
            Ok(Some((addr, nbytes, origin))) if addr == found.addr && nbytes >= found.nbytes && origin == found.origin => {}
            Ok(Some((addr, nbytes, _))) => {
                return Err(format!(
                    "buffer '{name}': changed while the registered objects were looked up (code run by a look-up freed, moved or resized it): found {}, now {nbytes} bytes at {addr:#x}",
                    found.describe()
                ))
            }
            Err(why) => return Err(format!("buffer '{name}': changed while the registered objects were looked up: {why}")),
        }
        let pinned = entry.pinned.lock().unwrap_or_else(|e| e.into_inner());
        if found.device != pinned.device {
            return Err(format!("buffer '{name}': moved from {} to {}; register it again", pinned.device, found.device));
        }
        if found.addr == pinned.addr && found.nbytes == pinned.nbytes && found.origin == pinned.origin {
            // Where it was: what it holds must still fit (a dtype or shape
            // changed in place).
            if let Err(why) = fits(found, &entry.want, Access { writable: false, ..self.access }, maps) {
                return Err(format!("buffer '{name}': changed since it was registered: {why}"));
            }
            return Ok((pinned.addr, pinned.nbytes, None));
        }
        if !self.access.follow {
            return Err(format!(
                "buffer '{name}': its memory was replaced since it was registered (was {}, now {}): register it again, or register with follow=True",
                pinned.described,
                found.describe()
            ));
        }
        if let Err(why) = fits(found, &entry.want, self.access, maps) {
            return Err(format!("buffer '{name}': its memory was replaced by one that does not fit: {why}"));
        }
        if found.addr == 0 && found.nbytes > 0 {
            return Err(format!("buffer '{name}': its memory was replaced by a null address"));
        }
        if found.origin.is_some() && found.origin != pinned.origin {
            // A view whose owner's memory was replaced still points at the
            // old memory: there is nothing to follow.
            return Err(format!("buffer '{name}': the array it is a view of was given other memory: register a view of it again"));
        }
        Ok((found.addr, found.nbytes, Some(Pinned::at(found, found.keeper.clone_ref(py)))))
    }

    /// Every buffer where it is now, in three passes under one GIL hold:
    /// every object looked up (their own code runs here), then every
    /// buffer checked (no Python code: a look-up that changed an earlier
    /// buffer is caught here), then `f` on each (no Python code between
    /// the checks and the end of `f`). An error names the buffer and what
    /// changed; nothing is visited after it.
    fn visit_checked(
        &self,
        py: Python<'_>,
        f: &mut dyn FnMut(usize, (u64, usize)) -> Result<(), RegisteredVisitError>,
    ) -> Result<(), RegisteredVisitError> {
        let found = (0..self.entries.len()).map(|i| self.resolve(py, i)).collect::<Result<Vec<_>, _>>().map_err(refused)?;
        // No garbage collection from the checks to the end of the uses:
        // a collection (the checks' probes allocate) could run finalizers.
        let gc = py.import("gc").map_err(|e| refused(format!("the gc module: {e}")))?;
        let collecting = gc.call_method0("isenabled").and_then(|b| b.is_truthy()).map_err(|e| refused(format!("gc.isenabled: {e}")))?;
        gc.call_method0("disable").map_err(|e| refused(format!("gc.disable: {e}")))?;
        let used = self.check_and_use(py, &found, f);
        if collecting {
            gc.call_method0("enable").map_err(|e| refused(format!("gc.enable: {e}")))?;
        }
        let moved = used?;
        // Followed buffers pinned at their new places; the old pins (and
        // what they kept alive) are dropped after every use, as are the
        // look-ups' keepers.
        let old: Vec<Pinned> = moved
            .into_iter()
            .map(|(i, pin)| std::mem::replace(&mut *self.entries[i].pinned.lock().unwrap_or_else(|e| e.into_inner()), pin))
            .collect();
        drop((old, found));
        Ok(())
    }

    /// The checks and uses of [`visit_checked`](Self::visit_checked) (no
    /// Python code runs): the pins of buffers that moved.
    fn check_and_use(
        &self,
        py: Python<'_>,
        found: &[Found],
        f: &mut dyn FnMut(usize, (u64, usize)) -> Result<(), RegisteredVisitError>,
    ) -> Result<Vec<(usize, Pinned)>, RegisteredVisitError> {
        let mut maps = None;
        let mut regions = Vec::with_capacity(found.len());
        let mut moved = Vec::new();
        for (i, found) in found.iter().enumerate() {
            let (addr, nbytes, pin) = self.verify(py, i, found, &mut maps).map_err(refused)?;
            regions.push((addr, nbytes));
            if let Some(pin) = pin {
                moved.push((i, pin));
            }
        }
        for (i, region) in regions.into_iter().enumerate() {
            f(i, region)?;
        }
        Ok(moved)
    }

    /// Looks every buffer up again (as before a refit): an error names
    /// the rank, the buffer and what changed.
    pub(crate) fn check_all(&self, py: Python<'_>) -> Result<(), String> {
        self.visit_checked(py, &mut |_, _| Ok(())).map_err(|e| format!("{}: {e}", self.what))
    }
}

/// The owner's refusal of a buffer, in `words` (naming it).
fn refused(words: String) -> RegisteredVisitError {
    RegisteredVisitError::Owner(RegisteredMemoryError::new(words))
}

// SAFETY: each region is yielded right after its checks (under one GIL
// hold, no Python code in between: `visit_checked`) as the memory its
// object holds now, of the registered device (`verify` refuses another),
// at least the buffer's bytes (`fits`); its keeper stays pinned while the
// registration lives and until a later visit finds the buffer elsewhere
// (the user's side of the contract, docs/python.md: a source's tensors are
// written only inside `update`, a destination's touched only inside
// `serve`, and memory is not freed by another thread during a refit).
unsafe impl RegisteredMemory for Targets {
    fn residence(&self) -> Residence {
        self.residence
    }

    fn buffers(&self) -> usize {
        self.entries.len()
    }

    fn visit(&self, f: &mut dyn FnMut(usize, (u64, usize)) -> Result<(), RegisteredVisitError>) -> Result<(), RegisteredVisitError> {
        Python::attach(|py| self.visit_checked(py, f))
    }
}
