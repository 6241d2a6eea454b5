//! The copy kernel: strided pieces between buffers, with dtype conversion.

use reshard::dtype::convert_slice;
use reshard::{DType, MAX_DIMS};

/// A strided view of elements inside a byte region.
///
/// Its region (pointer and length) is fixed at construction, which is
/// `unsafe` ([`StridedRef::new`]): whoever makes one promises the region is
/// valid for as long as the view or a copy of it is used. Every reader
/// checks the element offsets against the region ([`in_bounds`]) before it
/// touches memory, so the offsets may be anything.
#[derive(Clone, Copy, Debug)]
pub struct StridedRef {
    /// Start of the region (a whole buffer or staging area).
    ptr: *const u8,
    /// Region length in bytes, for bounds checks.
    len: usize,
    /// Element offset of the first element.
    pub base: u64,
    /// Element stride per dimension (same dims as the counts).
    pub strides: [u64; MAX_DIMS],
    /// Element type.
    pub dtype: DType,
}

impl StridedRef {
    /// A view into the `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads (and, for a view that is written
    /// through, writes) of `len` bytes for as long as this view or any copy
    /// of it, or any [`Segment`](crate::Segment) or payload made from it,
    /// is used; concurrent writes to the bytes it is read from must not
    /// happen while it is read.
    pub unsafe fn new(ptr: *const u8, len: usize, base: u64, strides: [u64; MAX_DIMS], dtype: DType) -> StridedRef {
        StridedRef { ptr, len, base, strides, dtype }
    }

    /// The same region with other offsets (safe: readers check bounds).
    pub fn at(self, base: u64, strides: [u64; MAX_DIMS], dtype: DType) -> StridedRef {
        StridedRef { base, strides, dtype, ..self }
    }

    /// Start of the region.
    pub fn ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Length of the region in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Bytes one element of `counts` touches at most: the end (exclusive, in
/// elements) of a strided view.
fn extent_elems(counts: &[u64], base: u64, strides: &[u64]) -> Option<u64> {
    if counts.contains(&0) {
        return Some(base);
    }
    let mut last = base;
    for (c, s) in counts.iter().zip(strides) {
        last = last.checked_add((c - 1).checked_mul(*s)?)?;
    }
    last.checked_add(1)
}

/// Whether a strided view of `counts` stays inside its region.
pub fn in_bounds(counts: &[u64], r: &StridedRef) -> bool {
    fits(counts, r.len, r.base, &r.strides, r.dtype)
}

/// Whether `counts` elements of `dtype` at element offset `base` with
/// `strides` stay inside a region of `len` bytes (no memory is involved).
pub fn fits(counts: &[u64], len: usize, base: u64, strides: &[u64; MAX_DIMS], dtype: DType) -> bool {
    extent_elems(counts, base, &strides[..counts.len()]).and_then(|e| e.checked_mul(dtype.size())).is_some_and(|bytes| bytes <= len as u64)
}

/// Row-major strides for `counts` (a packed, contiguous piece).
pub fn packed_strides(counts: &[u64]) -> [u64; MAX_DIMS] {
    let mut s = [0u64; MAX_DIMS];
    let mut acc = 1;
    for d in (0..counts.len()).rev() {
        s[d] = acc;
        acc *= counts[d];
    }
    s
}

/// The dimensions of a copy between two strided views of `counts`
/// elements: dims with a count of 1 dropped, and dims that are contiguous
/// on both sides merged; `(count, src stride, dst stride)`, outermost
/// first. `None` if the piece is empty.
pub fn joint_dims(counts: &[u64], src_strides: &[u64], dst_strides: &[u64]) -> Option<Vec<(u64, u64, u64)>> {
    let mut dims: Vec<(u64, u64, u64)> = Vec::with_capacity(counts.len());
    for (d, &c) in counts.iter().enumerate() {
        if c == 0 {
            return None;
        }
        if c > 1 {
            dims.push((c, src_strides[d], dst_strides[d]));
        }
    }
    let mut i = dims.len();
    while i >= 2 {
        let (c_in, s_in, d_in) = dims[i - 1];
        let (c_out, s_out, d_out) = dims[i - 2];
        if s_out == c_in * s_in && d_out == c_in * d_in {
            dims[i - 2] = (c_out * c_in, s_in, d_in);
            dims.remove(i - 1);
        }
        i -= 1;
    }
    Some(dims)
}

/// Calls `f(src_offset, dst_offset)` for every index of `dims` (as from
/// [`joint_dims`]), in row-major order, starting from the two bases.
pub fn for_each_offset(dims: &[(u64, u64, u64)], src_base: u64, dst_base: u64, mut f: impl FnMut(u64, u64)) {
    let mut idx = vec![0u64; dims.len()];
    let (mut so, mut doff) = (src_base, dst_base);
    loop {
        f(so, doff);
        let mut k = dims.len();
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            idx[k] += 1;
            so += dims[k].1;
            doff += dims[k].2;
            if idx[k] < dims[k].0 {
                break;
            }
            so -= dims[k].0 * dims[k].1;
            doff -= dims[k].0 * dims[k].2;
            idx[k] = 0;
        }
    }
}

/// Copies every element of a piece with element counts `counts` from `src`
/// to `dst`, converting dtype.
///
/// # Safety
/// Both views must be in bounds ([`in_bounds`]); `dst.ptr` must be valid
/// for writes of that region, and no other thread may access the written
/// elements, or write the read elements, during the call.
pub unsafe fn copy_strided(counts: &[u64], src: &StridedRef, dst: &StridedRef) {
    let Some(dims) = joint_dims(counts, &src.strides[..counts.len()], &dst.strides[..counts.len()]) else { return };
    let (run, outer) = match dims.last() {
        Some(&(c, 1, 1)) => (c, &dims[..dims.len() - 1]),
        _ => (1, &dims[..]),
    };
    let (fs, ts) = (src.dtype.size() as usize, dst.dtype.size() as usize);
    for_each_offset(outer, src.base, dst.base, |so, doff| {
        // SAFETY: in bounds by the caller's contract; regions disjoint.
        unsafe {
            let s = src.ptr.add(so as usize * fs);
            let d = (dst.ptr as *mut u8).add(doff as usize * ts);
            if src.dtype == dst.dtype {
                copy_run(s, d, run as usize * fs);
            } else {
                let s = std::slice::from_raw_parts(s, run as usize * fs);
                let d = std::slice::from_raw_parts_mut(d, run as usize * ts);
                convert_slice(src.dtype, s, dst.dtype, d);
            }
        }
    });
    store_fence();
}

/// Calls `f` with every maximal contiguous byte run of a strided view of
/// `counts` elements, in element order (for writing a piece to a stream).
///
/// # Safety
/// The view must be in bounds ([`in_bounds`]) and its memory valid for
/// reads, not written concurrently, for the duration of the call.
pub unsafe fn for_each_run(counts: &[u64], view: &StridedRef, mut f: impl FnMut(&[u8])) {
    let strides = &view.strides[..counts.len()];
    let Some(dims) = joint_dims(counts, strides, strides) else { return };
    let (run, outer) = match dims.last() {
        Some(&(c, 1, _)) => (c, &dims[..dims.len() - 1]),
        _ => (1, &dims[..]),
    };
    let size = view.dtype.size();
    // SAFETY: in bounds by the caller's contract.
    for_each_offset(outer, view.base, view.base, |off, _| {
        f(unsafe { std::slice::from_raw_parts(view.ptr.add((off * size) as usize), (run * size) as usize) })
    });
}

/// Runs at least this long are written with non-temporal stores.
const STREAM_MIN: usize = 256;

/// Copies `len` bytes. Destination bytes are not read again soon (they are
/// weights for the next step), so on x86-64 long runs are written with
/// non-temporal stores: that skips reading each destination cache line
/// before overwriting it (a third of the memory traffic of a copy), which
/// is what `memcpy` itself does for very large copies. Short runs are copied
/// inline: a `memcpy` call per run costs as much as the copy itself.
/// Callers issue [`store_fence`] before publishing what they wrote.
///
/// # Safety
/// `src` valid for reads and `dst` for writes of `len` bytes, not overlapping.
#[inline]
unsafe fn copy_run(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= STREAM_MIN {
        // SAFETY: by the caller's contract.
        unsafe { stream_copy(src, dst, len) };
        return;
    }
    if len >= 2048 {
        // SAFETY: by the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return;
    }
    let mut i = 0;
    // SAFETY: every access below is within `len` bytes of both pointers.
    unsafe {
        while i + 32 <= len {
            let v = std::ptr::read_unaligned(src.add(i) as *const [u64; 4]);
            std::ptr::write_unaligned(dst.add(i) as *mut [u64; 4], v);
            i += 32;
        }
        while i + 8 <= len {
            let v = std::ptr::read_unaligned(src.add(i) as *const u64);
            std::ptr::write_unaligned(dst.add(i) as *mut u64, v);
            i += 8;
        }
        while i < len {
            *dst.add(i) = *src.add(i);
            i += 1;
        }
    }
}

/// Copy with SSE2 streaming stores (16-byte aligned destination chunks).
///
/// # Safety
/// As [`copy_run`].
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    // Head: up to the first 16-byte aligned destination address.
    let head = (dst.align_offset(16)).min(len);
    // SAFETY: all offsets below stay within `len` bytes; streaming stores
    // go to 16-byte aligned destinations; SSE2 is part of x86-64.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 64 <= len {
            let a = _mm_loadu_si128(src.add(i) as *const __m128i);
            let b = _mm_loadu_si128(src.add(i + 16) as *const __m128i);
            let c = _mm_loadu_si128(src.add(i + 32) as *const __m128i);
            let d = _mm_loadu_si128(src.add(i + 48) as *const __m128i);
            _mm_stream_si128(dst.add(i) as *mut __m128i, a);
            _mm_stream_si128(dst.add(i + 16) as *mut __m128i, b);
            _mm_stream_si128(dst.add(i + 32) as *mut __m128i, c);
            _mm_stream_si128(dst.add(i + 48) as *mut __m128i, d);
            i += 64;
        }
        while i + 16 <= len {
            let a = _mm_loadu_si128(src.add(i) as *const __m128i);
            _mm_stream_si128(dst.add(i) as *mut __m128i, a);
            i += 16;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
    }
}

/// Orders this thread's earlier non-temporal stores before its later
/// stores (call before telling another thread the data is there).
#[inline]
pub fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions; SSE is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_run_copies_every_length() {
        let src: Vec<u8> = (0..3000u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0, 1, 7, 8, 9, 31, 32, 33, 100, 255, 256, 2047, 2048, 2999] {
            let mut dst = vec![0u8; 3000];
            unsafe { copy_run(src.as_ptr().add(1), dst.as_mut_ptr().add(1), len) };
            assert_eq!(&dst[1..1 + len], &src[1..1 + len]);
            assert!(dst[1 + len..].iter().all(|&b| b == 0) && dst[0] == 0);
        }
    }

    #[test]
    fn strided_to_packed_and_back() {
        // A 4x6 f32 buffer; copy the [1:3, 2:5] sub-block out and back in.
        let buf: Vec<u8> = (0..24u32).flat_map(|v| (v as f32).to_le_bytes()).collect();
        let counts = [2u64, 3];
        let src = StridedRef { ptr: buf.as_ptr(), len: buf.len(), base: 6 + 2, strides: [6, 1, 0, 0, 0, 0, 0, 0], dtype: DType::F32 };
        let mut packed = vec![0u8; 6 * 2];
        let dst = StridedRef { ptr: packed.as_mut_ptr(), len: packed.len(), base: 0, strides: packed_strides(&counts), dtype: DType::BF16 };
        assert!(in_bounds(&counts, &src) && in_bounds(&counts, &dst));
        unsafe { copy_strided(&counts, &src, &dst) };
        let got: Vec<f32> = packed.chunks(2).map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)).collect();
        assert_eq!(got, vec![8.0, 9.0, 10.0, 14.0, 15.0, 16.0]);
        let oob = StridedRef { base: 6 * 3 + 4, ..src };
        assert!(!in_bounds(&counts, &oob));
    }
}
