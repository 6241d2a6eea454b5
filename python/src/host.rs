//! Host arrays read and written in place: a C-contiguous numpy array (its
//! `__array_interface__`) or a contiguous torch CPU tensor (`data_ptr`,
//! `numel`, `element_size`), so a step copies a registered array straight
//! into the store and a load copies a committed version straight into the
//! array — one copy each way, none through Python `bytes`.
//!
//! The memory is found from the object itself and used only while the GIL
//! is held and a strong reference keeps the object alive: between finding
//! and copying, no Python code runs, so the array cannot be resized or
//! freed in between. Anything else (a non-contiguous array, a GPU tensor,
//! an object with neither interface) is not a host array here, and the
//! Python layer copies it through `bytes` as before.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// The memory of a host array: `len` bytes at `ptr`, writable or not.
///
/// Only made by [`HostArray::find`] and used under the same GIL hold (the
/// borrow of `Python<'py>` ties it there).
pub(crate) struct HostArray<'py> {
    ptr: usize,
    len: usize,
    writable: bool,
    _object: Bound<'py, PyAny>,
}

impl<'py> HostArray<'py> {
    /// The memory of `object` if it is a C-contiguous host array (numpy
    /// array or torch CPU tensor); `None` if it is something else.
    pub(crate) fn find(object: &Bound<'py, PyAny>) -> PyResult<Option<HostArray<'py>>> {
        if let Some(found) = Self::torch(object)? {
            return Ok(Some(found));
        }
        Self::numpy(object)
    }

    fn torch(object: &Bound<'py, PyAny>) -> PyResult<Option<HostArray<'py>>> {
        let module: String = object.get_type().getattr("__module__").and_then(|m| m.extract()).unwrap_or_default();
        if !module.starts_with("torch") || !object.hasattr("data_ptr")? {
            return Ok(None);
        }
        let device: String = object.getattr("device")?.getattr("type")?.extract()?;
        let contiguous: bool = object.call_method0("is_contiguous")?.extract()?;
        if device != "cpu" || !contiguous {
            return Ok(None);
        }
        let numel: usize = object.call_method0("numel")?.extract()?;
        let size: usize = object.call_method0("element_size")?.extract()?;
        let ptr: usize = object.call_method0("data_ptr")?.extract()?;
        let Some(len) = numel.checked_mul(size) else { return Ok(None) };
        Ok(Some(HostArray { ptr, len, writable: true, _object: object.clone() }))
    }

    fn numpy(object: &Bound<'py, PyAny>) -> PyResult<Option<HostArray<'py>>> {
        let Ok(interface) = object.getattr("__array_interface__") else { return Ok(None) };
        let Ok(interface) = interface.cast_into::<PyDict>() else { return Ok(None) };
        // C order only: `strides` is None exactly for C-contiguous arrays.
        match interface.get_item("strides")? {
            Some(s) if !s.is_none() => return Ok(None),
            _ => {}
        }
        let Some(data) = interface.get_item("data")? else { return Ok(None) };
        let Ok(data) = data.cast_into::<PyTuple>() else { return Ok(None) };
        let (ptr, readonly): (usize, bool) = data.extract()?;
        let typestr: String = match interface.get_item("typestr")? {
            Some(t) => t.extract()?,
            None => return Ok(None),
        };
        // Little-endian or byte-sized elements only.
        if !(typestr.starts_with('<') || typestr.starts_with('|')) {
            return Ok(None);
        }
        let Ok(size) = typestr[2..].parse::<usize>() else { return Ok(None) };
        let shape: Vec<usize> = match interface.get_item("shape")? {
            Some(s) => s.extract()?,
            None => return Ok(None),
        };
        let Some(len) = shape.iter().try_fold(size, |acc, &d| acc.checked_mul(d)) else { return Ok(None) };
        Ok(Some(HostArray { ptr, len, writable: !readonly, _object: object.clone() }))
    }

    /// Bytes of the array.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether the array may be written.
    pub(crate) fn writable(&self) -> bool {
        self.writable
    }

    /// Copies the array's bytes into `out` (exactly its length: checked).
    pub(crate) fn copy_to(&self, out: &mut [u8]) -> bool {
        if out.len() != self.len {
            return false;
        }
        if self.len > 0 {
            // SAFETY: the object reported `len` bytes of C-contiguous
            // memory at `ptr` while the GIL was held, the GIL has been held
            // since (the `'py` borrow) so no Python code ran to resize or
            // free it, and `_object` keeps it alive; `out` is a distinct
            // Rust buffer of the same length. Nothing is written through
            // `ptr`. On any failure above this block is not reached.
            unsafe { std::ptr::copy_nonoverlapping(self.ptr as *const u8, out.as_mut_ptr(), self.len) };
        }
        true
    }

    /// Overwrites the array with `data` (exactly its length, and only a
    /// writable array: checked).
    pub(crate) fn copy_from(&self, data: &[u8]) -> bool {
        if data.len() != self.len || !self.writable {
            return false;
        }
        if self.len > 0 {
            // SAFETY: as in `copy_to`, and the object reported its memory
            // writable; `data` is a Rust buffer (a store snapshot) that
            // cannot overlap memory Python allocated for the array.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr as *mut u8, self.len) };
        }
        true
    }
}
