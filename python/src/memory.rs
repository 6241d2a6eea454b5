//! Weights crossing the boundary: `bytes`, or C-contiguous host arrays
//! copied in place (each looked up right before its copy), checked for
//! dtype and length against a rank's block or buffer.

use crate::errors::{tensor_err, TensorError};
use crate::target::{self, Device};
use orchestrator::{BufferError, Buffers};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use reshard::DType;

/// What a name refers to on a rank: a tensor's block, or a whole buffer.
pub(crate) fn target_len(b: &Buffers, name: &str) -> Result<(DType, usize), BufferError> {
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
pub(crate) enum Write {
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
pub(crate) fn host_array(object: &Bound<'_, PyAny>, what: &str, dtype: DType, len: usize, write: bool) -> PyResult<target::Found> {
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
        let maps = crate::writable_maps::WritableMaps::read().map_err(TensorError::new_err)?;
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
pub(crate) fn write_all(b: &mut Buffers, writes: &[(String, Write)]) -> Result<(), PyErr> {
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
pub(crate) fn read_bytes(b: &Buffers, name: &str) -> Result<Vec<u8>, BufferError> {
    source_bytes(b, name).map(<[u8]>::to_vec)
}

/// The bytes of `name` (a tensor's block or a buffer), borrowed.
pub(crate) fn source_bytes<'a>(b: &'a Buffers, name: &str) -> Result<&'a [u8], BufferError> {
    if b.layout().tensor_index(name).is_some() {
        Ok(b.tensor(name)?.into_bytes())
    } else {
        b.buffer(name).or_else(|_| b.tensor(name).map(|v| v.into_bytes()))
    }
}

/// Whether `object` is a C-contiguous host array refit copies in place
/// (numpy, torch CPU, DLPack on the CPU).
#[pyfunction]
pub(crate) fn is_host_array(object: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(matches!(target::find(object)?, Ok(f) if f.device == Device::Host))
}

/// `(address, bytes, GPU or None)` of the memory refit would use in place
/// for `object` (for inspection and tests: nothing takes an address
/// back); `TensorError` saying why for anything else.
#[pyfunction]
pub(crate) fn memory_of(object: &Bound<'_, PyAny>) -> PyResult<(u64, usize, Option<usize>)> {
    let found = target::find(object)?.map_err(TensorError::new_err)?;
    let gpu = match found.device {
        Device::Host => None,
        Device::Cuda(i) => Some(i),
    };
    Ok((found.addr, found.nbytes, gpu))
}
