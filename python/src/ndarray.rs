//! A numpy array's memory read from its C struct, never through its
//! Python attributes: reading it runs no Python code (an ndarray
//! subclass's `__array_interface__` or `base` property is never called),
//! so it can be read again between a refit's look-ups and its use of the
//! memory with nothing able to run in between.
//!
//! The fields read are the leading ones of numpy's `PyArrayObject_fields`
//! and `PyArray_Descr` (`ndarraytypes.h`), laid out the same in numpy 1.x
//! and 2.x. They are read only from objects whose type is numpy's own
//! `ndarray` type (a static type of at least this struct's size) or a
//! subclass of it.

use crate::target::Elem;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyType;
use reshard::DType;
use std::os::raw::{c_char, c_int, c_ulong};

/// `PyArrayObject_fields`, up to `flags`.
#[repr(C)]
struct ArrayFields {
    head: ffi::PyObject,
    data: *mut u8,
    nd: c_int,
    dimensions: *const isize,
    strides: *const isize,
    base: *mut ffi::PyObject,
    descr: *const DescrFields,
    flags: c_int,
}

/// `PyArray_Descr`, up to `type_num`.
#[repr(C)]
struct DescrFields {
    head: ffi::PyObject,
    typeobj: *mut ffi::PyTypeObject,
    kind: c_char,
    type_char: c_char,
    byteorder: c_char,
    former_flags: c_char,
    type_num: c_int,
}

const C_CONTIGUOUS: c_int = 0x0001;
const WRITEABLE: c_int = 0x0400;
/// Views are followed to their owner at most this deep.
const MAX_BASES: usize = 1 << 16;

/// numpy's `ndarray` type, checked to be the static type whose instances
/// hold [`ArrayFields`].
pub(crate) struct NdArrayType<'py>(Bound<'py, PyType>);

impl<'py> NdArrayType<'py> {
    /// `numpy.ndarray` of the imported `numpy`: `Ok(None)` if it is not
    /// numpy's own static type (replaced by something else).
    pub(crate) fn of(numpy: &Bound<'py, PyAny>) -> PyResult<Option<NdArrayType<'py>>> {
        let Ok(t) = numpy.getattr("ndarray")?.cast_into::<PyType>() else { return Ok(None) };
        let flags: c_ulong = t.getattr("__flags__")?.extract()?;
        let basic: usize = t.getattr("__basicsize__")?.extract()?;
        let heap = flags & ffi::Py_TPFLAGS_HEAPTYPE != 0;
        let named = t.name()?.to_cow()? == "ndarray";
        Ok((!heap && named && basic >= std::mem::size_of::<ArrayFields>()).then_some(NdArrayType(t)))
    }

    /// This type, to hold across GIL holds.
    pub(crate) fn unbind(&self) -> NdArrayTypeRef {
        NdArrayTypeRef(self.0.clone().unbind())
    }

    /// Whether `object` is an ndarray (of a subclass or not), from its C
    /// type alone (no `__class__` or `__instancecheck__` code runs).
    pub(crate) fn holds(&self, object: &Bound<'_, PyAny>) -> bool {
        // SAFETY: both are live objects under the GIL; PyType_IsSubtype
        // only walks the type's MRO tuple.
        unsafe { ffi::PyType_IsSubtype(ffi::Py_TYPE(object.as_ptr()), self.0.as_ptr().cast()) != 0 }
    }
}

/// An [`NdArrayType`] held across GIL holds.
pub(crate) struct NdArrayTypeRef(Py<PyType>);

impl NdArrayTypeRef {
    pub(crate) fn bind<'py>(&self, py: Python<'py>) -> NdArrayType<'py> {
        NdArrayType(self.0.bind(py).clone())
    }
}

/// What an ndarray's struct says now.
pub(crate) struct NdState {
    pub(crate) addr: u64,
    pub(crate) nbytes: usize,
    pub(crate) elem: Elem,
    pub(crate) shape: Vec<u64>,
    pub(crate) writable: bool,
    pub(crate) c_contiguous: bool,
    /// Big-endian elements.
    pub(crate) swapped: bool,
    /// The ndarray that owns the memory (`object` itself, or the last
    /// ndarray of its chain of bases), borrowed from the chain.
    pub(crate) owner: *mut ffi::PyObject,
    /// The owner's data address, where the owner is not `object`.
    pub(crate) origin: Option<u64>,
}

/// `object`'s memory as its struct says now; `None` for an object that is
/// not an ndarray. Runs no Python code.
pub(crate) fn state(ndarray: &NdArrayType<'_>, object: &Bound<'_, PyAny>) -> Option<NdState> {
    if !ndarray.holds(object) {
        return None;
    }
    // SAFETY: `object` is an instance of numpy's ndarray type (checked
    // just above), whose instances start with `ArrayFields`, alive under
    // the GIL we hold; `dimensions` points to `nd` sizes and `descr` to a
    // live descriptor while the array is, and nothing runs between these
    // reads and their use (no Python code: plain loads).
    let (fields, shape, descr) = unsafe {
        let fields = &*object.as_ptr().cast::<ArrayFields>();
        let nd = usize::try_from(fields.nd).unwrap_or(0);
        let dims = if nd == 0 || fields.dimensions.is_null() { &[][..] } else { std::slice::from_raw_parts(fields.dimensions, nd) };
        let shape: Vec<u64> = dims.iter().map(|&d| u64::try_from(d).unwrap_or(0)).collect();
        let descr = (!fields.descr.is_null()).then(|| &*fields.descr);
        (fields, shape, descr)
    };
    let (elem, size, swapped) = match descr {
        Some(d) => {
            let (elem, size) = elem_of(d.type_num);
            (elem, size, d.byteorder == b'>' as c_char)
        }
        None => (Elem::Other("an array without a dtype".into()), 0, false),
    };
    let nbytes = shape.iter().try_fold(size, |acc, &d| acc.checked_mul(d)).and_then(|n| usize::try_from(n).ok()).unwrap_or(usize::MAX);
    // The owner: the last ndarray of the chain of bases.
    let mut owner = object.as_ptr();
    let mut origin = None;
    for _ in 0..MAX_BASES {
        // SAFETY: `owner` is an ndarray (the object, or a base checked
        // below), alive: each array holds a reference to its base.
        let base = unsafe { (*owner.cast::<ArrayFields>()).base };
        // SAFETY: a non-null base is a live object held by the array.
        if base.is_null() || unsafe { ffi::PyType_IsSubtype(ffi::Py_TYPE(base), ndarray.0.as_ptr().cast()) } == 0 {
            break;
        }
        owner = base;
        // SAFETY: as above, `owner` is now a live ndarray.
        origin = Some(unsafe { (*owner.cast::<ArrayFields>()).data } as u64);
    }
    Some(NdState {
        addr: fields.data as u64,
        nbytes,
        elem,
        shape,
        writable: fields.flags & WRITEABLE != 0,
        c_contiguous: fields.flags & C_CONTIGUOUS != 0,
        swapped,
        owner,
        origin,
    })
}

/// An element of numpy's type number `n` (numpy's `NPY_TYPES`, the same
/// in 1.x and 2.x), and its size in bytes (0 where refit cannot tell).
fn elem_of(n: c_int) -> (Elem, u64) {
    let long = std::mem::size_of::<std::os::raw::c_long>() as u64;
    let other = |name: &str, size: u64| (Elem::Other(name.to_owned()), size);
    match n {
        0 => (Elem::Is(DType::U8), 1),
        1 => (Elem::Is(DType::I8), 1),
        2 => (Elem::Is(DType::U8), 1),
        3 | 4 => (Elem::Bits16, 2),
        5 => (Elem::Is(DType::I32), 4),
        6 => other("uint32", 4),
        7 if long == 8 => (Elem::Is(DType::I64), 8),
        7 => (Elem::Is(DType::I32), 4),
        8 => other("unsigned long", long),
        9 => (Elem::Is(DType::I64), 8),
        10 => other("uint64", 8),
        11 => (Elem::Is(DType::F32), 4),
        12 => (Elem::Is(DType::F64), 8),
        13 => other("longdouble", 0),
        14 => other("complex64", 8),
        15 => other("complex128", 16),
        16 => other("clongdouble", 0),
        17 => other("object", 0),
        18 => other("bytes", 0),
        19 => other("str", 0),
        20 => other("void", 0),
        21 => other("datetime64", 8),
        22 => other("timedelta64", 8),
        23 => (Elem::Is(DType::F16), 2),
        n => other(&format!("numpy type number {n}"), 0),
    }
}
