//! The copy kernel: strided pieces between buffers, with dtype conversion.

use reshard::convert_slice;
use reshard::{DType, MAX_DIMS};

/// A strided view of elements inside a byte region.
///
/// Its region (pointer and length) is fixed at construction, which is
/// `unsafe` ([`StridedRef::new`]): whoever makes one promises the region is
/// valid for as long as the view or a copy of it is used. Every reader
/// checks the element offsets against the region (`in_bounds`) before it
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
pub(crate) fn in_bounds(counts: &[u64], r: &StridedRef) -> bool {
    fits(counts, r.len, r.base, &r.strides, r.dtype)
}

/// Whether `counts` elements of `dtype` at element offset `base` with
/// `strides` stay inside a region of `len` bytes (no memory is involved).
/// Every count, offset and stride may come from a program or a peer: the
/// arithmetic is checked, and a view of more elements than its region
/// holds (strides that alias elements, which no program makes) does not
/// fit either, so whatever is sized by a view's elements (staging, a
/// converted copy) is bounded by a region that exists.
pub(crate) fn fits(counts: &[u64], len: usize, base: u64, strides: &[u64; MAX_DIMS], dtype: DType) -> bool {
    if counts.len() > MAX_DIMS {
        return false;
    }
    let numel = counts.iter().try_fold(1u64, |n, &c| n.checked_mul(c));
    numel.and_then(|n| n.checked_mul(dtype.size())).is_some_and(|bytes| bytes <= len as u64)
        && extent_elems(counts, base, &strides[..counts.len()])
            .and_then(|e| e.checked_mul(dtype.size()))
            .is_some_and(|bytes| bytes <= len as u64)
}

/// Row-major strides for `counts` (a packed, contiguous piece);
/// saturating, so counts from the wire whose product passes `u64` give
/// strides no view of them fits (`fits`) instead of wrapped ones.
pub fn packed_strides(counts: &[u64]) -> [u64; MAX_DIMS] {
    let mut s = [0u64; MAX_DIMS];
    let mut acc = 1u64;
    for d in (0..counts.len().min(MAX_DIMS)).rev() {
        s[d] = acc;
        acc = acc.saturating_mul(counts[d]);
    }
    s
}

/// The dimensions of a copy between two strided views of `counts`
/// elements: dims with a count of 1 dropped, and dims that are contiguous
/// on both sides merged; `(count, src stride, dst stride)`, outermost
/// first. `None` if the piece is empty.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn joint_dims(counts: &[u64], src_strides: &[u64], dst_strides: &[u64]) -> Option<Vec<(u64, u64, u64)>> {
    Dims::joint(counts, src_strides, dst_strides).map(|d| d.as_slice().to_vec())
}

/// [`joint_dims`] without a heap allocation (at most [`MAX_DIMS`] dims).
#[derive(Clone, Copy)]
struct Dims {
    n: usize,
    d: [(u64, u64, u64); MAX_DIMS],
}

impl Dims {
    fn joint(counts: &[u64], src_strides: &[u64], dst_strides: &[u64]) -> Option<Dims> {
        let mut out = Dims { n: 0, d: [(0, 0, 0); MAX_DIMS] };
        for ((&c, &s), &t) in counts.iter().zip(src_strides).zip(dst_strides).take(MAX_DIMS) {
            if c == 0 {
                return None;
            }
            if c > 1 {
                // Merge with the previous (outer) dim when it is contiguous
                // over this one on both sides.
                if out.n > 0 {
                    let (c_out, s_out, d_out) = out.d[out.n - 1];
                    if let (Some(cs), Some(ct), Some(cc)) = (c.checked_mul(s), c.checked_mul(t), c_out.checked_mul(c)) {
                        if s_out == cs && d_out == ct {
                            out.d[out.n - 1] = (cc, s, t);
                            continue;
                        }
                    }
                }
                out.d[out.n] = (c, s, t);
                out.n += 1;
            }
        }
        Some(out)
    }

    fn as_slice(&self) -> &[(u64, u64, u64)] {
        &self.d[..self.n]
    }
}

/// Calls `f(src_offset, dst_offset)` for every index of `dims` (as from
/// [`joint_dims`]), in row-major order, starting from the two bases.
pub(crate) fn for_each_offset(dims: &[(u64, u64, u64)], src_base: u64, dst_base: u64, mut f: impl FnMut(u64, u64)) {
    match dims {
        [] => f(src_base, dst_base),
        &[(c, s, d)] => {
            for i in 0..c {
                f(src_base + i * s, dst_base + i * d);
            }
        }
        &[(c0, s0, d0), (c1, s1, d1)] => {
            for i in 0..c0 {
                let (so, doff) = (src_base + i * s0, dst_base + i * d0);
                for j in 0..c1 {
                    f(so + j * s1, doff + j * d1);
                }
            }
        }
        _ => {
            let mut small = [0u64; MAX_DIMS];
            let mut large = Vec::new();
            let idx: &mut [u64] = if dims.len() <= MAX_DIMS {
                &mut small[..dims.len()]
            } else {
                large.resize(dims.len(), 0);
                &mut large
            };
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
    }
}

/// Copies every element of a piece with element counts `counts` from `src`
/// to `dst`, converting dtype.
///
/// # Safety
/// Both views must be in bounds ([`in_bounds`]); `dst.ptr` must be valid
/// for writes of that region, and no other thread may access the written
/// elements, or write the read elements, during the call.
pub(crate) unsafe fn copy_strided(counts: &[u64], src: &StridedRef, dst: &StridedRef) {
    // SAFETY: the caller's contract.
    unsafe { copy_strided_unfenced(counts, src, dst) };
    store_fence();
}

/// [`copy_strided`] without the closing [`store_fence`]: for a caller that
/// copies many pieces and fences once before it tells anyone they are
/// there.
///
/// # Safety
/// As [`copy_strided`].
pub(crate) unsafe fn copy_strided_unfenced(counts: &[u64], src: &StridedRef, dst: &StridedRef) {
    let n = counts.len().min(MAX_DIMS);
    let Some(dims) = Dims::joint(&counts[..n], &src.strides[..n], &dst.strides[..n]) else { return };
    let dims = dims.as_slice();
    let (run, outer) = match dims.last() {
        Some(&(c, 1, 1)) => (c, &dims[..dims.len() - 1]),
        _ => (1, dims),
    };
    let (fs, ts) = (src.dtype.size() as usize, dst.dtype.size() as usize);
    let same = src.dtype == dst.dtype;
    for_each_offset(outer, src.base, dst.base, |so, doff| {
        // SAFETY: in bounds by the caller's contract; regions disjoint.
        unsafe {
            let s = src.ptr.add(so as usize * fs);
            let d = (dst.ptr as *mut u8).add(doff as usize * ts);
            if same {
                copy_run(s, d, run as usize * fs);
            } else {
                convert_run(s, src.dtype, d, dst.dtype, run as usize);
            }
        }
    });
}

/// Bytes in the longest contiguous run of a strided view of `counts`
/// elements (its rows, where a row is contiguous; else one element).
pub(crate) fn run_bytes(counts: &[u64], view: &StridedRef) -> u64 {
    let n = counts.len().min(MAX_DIMS);
    let strides = &view.strides[..n];
    let elems = match Dims::joint(&counts[..n], strides, strides).as_ref().and_then(|d| d.as_slice().last().copied()) {
        Some((c, 1, _)) => c,
        _ => 1,
    };
    elems * view.dtype.size()
}

/// Calls `f` with every maximal contiguous byte run of a strided view of
/// `counts` elements, in element order (for writing a piece to a stream).
///
/// # Safety
/// The view must be in bounds ([`in_bounds`]) and its memory valid for
/// reads, not written concurrently, for the duration of the call.
pub(crate) unsafe fn for_each_run(counts: &[u64], view: &StridedRef, mut f: impl FnMut(&[u8])) {
    // SAFETY: the same contract; each run lies in the view's memory, valid
    // for reads and unchanged during the call (the caller's contract).
    unsafe { for_each_run_ptr(counts, view, |ptr, len| f(std::slice::from_raw_parts(ptr, len))) }
}

/// Calls `f(pointer, length)` with every maximal contiguous byte run of a
/// strided view of `counts` elements, in element order (for reading a
/// piece off a stream into place).
///
/// # Safety
/// The view must be in bounds ([`in_bounds`]); what `f` does with the
/// pointers is up to its own contract.
pub(crate) unsafe fn for_each_run_ptr(counts: &[u64], view: &StridedRef, mut f: impl FnMut(*mut u8, usize)) {
    let n = counts.len().min(MAX_DIMS);
    let strides = &view.strides[..n];
    let Some(dims) = Dims::joint(&counts[..n], strides, strides) else { return };
    let dims = dims.as_slice();
    let (run, outer) = match dims.last() {
        Some(&(c, 1, _)) => (c, &dims[..dims.len() - 1]),
        _ => (1, dims),
    };
    let size = view.dtype.size();
    // SAFETY: in bounds by the caller's contract, so every offset stays
    // inside the region.
    for_each_offset(outer, view.base, view.base, |off, _| {
        f(unsafe { view.ptr.add((off * size) as usize) } as *mut u8, (run * size) as usize)
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
    // SAFETY: every access below is within `len` bytes of both pointers
    // (a short run is copied as two overlapping words: head and tail).
    unsafe {
        if len <= 16 {
            if len >= 8 {
                copy_pair::<u64>(src, dst, len);
            } else if len >= 4 {
                copy_pair::<u32>(src, dst, len);
            } else if len >= 2 {
                copy_pair::<u16>(src, dst, len);
            } else if len == 1 {
                *dst = *src;
            }
            return;
        }
        if len <= 32 {
            copy_pair::<[u64; 2]>(src, dst, len);
            return;
        }
        let mut i = 0;
        while i + 32 <= len {
            let v = std::ptr::read_unaligned(src.add(i) as *const [u64; 4]);
            std::ptr::write_unaligned(dst.add(i) as *mut [u64; 4], v);
            i += 32;
        }
        if i < len {
            // The last 32 bytes, overlapping what was copied.
            let v = std::ptr::read_unaligned(src.add(len - 32) as *const [u64; 4]);
            std::ptr::write_unaligned(dst.add(len - 32) as *mut [u64; 4], v);
        }
    }
}

/// Copies `len` bytes as a `T` at the start and a `T` at the end (they
/// overlap when `len` < 2 × size of `T`).
///
/// # Safety
/// As [`copy_run`], and `size_of::<T>() <= len`.
#[inline(always)]
unsafe fn copy_pair<T: Copy>(src: *const u8, dst: *mut u8, len: usize) {
    let n = std::mem::size_of::<T>();
    // SAFETY: by the caller's contract both words lie within `len` bytes.
    unsafe {
        let a = std::ptr::read_unaligned(src as *const T);
        let b = std::ptr::read_unaligned(src.add(len - n) as *const T);
        std::ptr::write_unaligned(dst as *mut T, a);
        std::ptr::write_unaligned(dst.add(len - n) as *mut T, b);
    }
}

/// Converted runs whose output is at least this long are written with
/// non-temporal stores, as [`copy_run`] writes long copies.
const CONVERT_STREAM_MIN: usize = 4096;

/// Bytes of output converted at a time into a buffer that stays in the
/// first-level cache, then streamed out (a few KiB: L1 is 32 KiB or more).
const CONVERT_CHUNK: usize = 4096;

/// Converts `n` elements of type `from` at `src` into type `to` at `dst`.
/// Long runs are converted a few KiB at a time into a buffer that stays in
/// cache and streamed from there to `dst` with non-temporal stores: the
/// destination's cache lines are never read (less memory traffic than
/// converting in place, the saving [`copy_run`] makes for copies), for
/// every pair of types `convert_slice` converts. Callers issue [`store_fence`]
/// before publishing what they wrote.
///
/// # Safety
/// `src` valid for reads of `n` elements of `from`, `dst` for writes of `n`
/// elements of `to`, not overlapping.
#[inline]
unsafe fn convert_run(src: *const u8, from: DType, dst: *mut u8, to: DType, n: usize) {
    let (fs, ts) = (from.size() as usize, to.size() as usize);
    // SAFETY: `n` elements at each, by the caller's contract.
    let (src, dst) = unsafe { (std::slice::from_raw_parts(src, n * fs), std::slice::from_raw_parts_mut(dst, n * ts)) };
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= CONVERT_STREAM_MIN {
        #[repr(align(64))]
        struct Lines([u8; CONVERT_CHUNK]);
        let mut buf = Lines([0; CONVERT_CHUNK]);
        // Up to the first whole destination cache line directly, so that
        // every chunk after it starts on a line (a destination not aligned
        // to its element size streams what it can, from the start).
        let head = dst.as_ptr().align_offset(64);
        let head = if head.is_multiple_of(ts) { (head / ts).min(n) } else { 0 };
        let (src_head, src_rest) = src.split_at(head * fs);
        let (dst_head, dst_rest) = dst.split_at_mut(head * ts);
        convert_slice(from, src_head, to, dst_head);
        for (s, d) in src_rest.chunks(CONVERT_CHUNK / ts * fs).zip(dst_rest.chunks_mut(CONVERT_CHUNK / ts * ts)) {
            let out = &mut buf.0[..d.len()];
            convert_slice(from, s, to, out);
            // SAFETY: `d` is `out.len()` bytes of this run's destination;
            // `out` is this frame's own buffer.
            unsafe { stream_copy(out.as_ptr(), d.as_mut_ptr(), d.len()) };
        }
        return;
    }
    convert_slice(from, src, to, dst);
}

/// Copy with SSE2 streaming stores (16-byte aligned destination chunks).
///
/// # Safety
/// As [`copy_run`].
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    // Only whole destination cache lines are streamed: a partly streamed
    // line leaves the write-combining buffer as a partial write, which
    // costs more than reading the line. Head (up to the first 64-byte
    // aligned address) and tail (past the last whole line) are ordinary
    // stores. (Large heap blocks start 16 bytes into a page, so without
    // this every run would begin and end mid-line.)
    let head = (dst.align_offset(64)).min(len);
    let lines = (len - head) / 64;
    // SAFETY: all offsets below stay within `len` bytes; streaming stores
    // go to 64-byte aligned destinations; SSE2 is part of x86-64.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        for _ in 0..lines {
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
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
    }
}

/// Hints that the memory at `p` will be read soon: a piece list's words a
/// few pieces ahead, so walking it does not wait on memory piece by piece.
/// Any address will do (nothing is read, nothing faults).
#[inline]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing architecturally and never faults,
    // whatever the address; SSE is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// How far ahead of the piece being read a walk over packed pieces
/// prefetches, in bytes (about six 2-D pieces).
pub(crate) const PREFETCH_AHEAD: usize = 512;

/// Orders this thread's earlier non-temporal stores before its later
/// stores (call before telling another thread the data is there).
#[inline]
pub(crate) fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions; SSE is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Long converted runs (streamed out of a cached chunk) match
    /// `convert_slice` for every pair, at every destination alignment
    /// and at lengths around the chunk and the streaming threshold, and
    /// write nothing outside the run.
    #[test]
    fn converted_runs_match_convert_slice_at_every_alignment_and_length() {
        let floats = [DType::F32, DType::BF16, DType::F16, DType::F64];
        for from in floats {
            for to in floats.into_iter().filter(|&t| t != from) {
                let (fs, ts) = (from.size() as usize, to.size() as usize);
                for n in [1, 100, CONVERT_STREAM_MIN / ts - 1, CONVERT_STREAM_MIN / ts, CONVERT_CHUNK / ts * 3 + 7, 20_011] {
                    // Values of every kind: normal, tiny, huge, NaN.
                    let src: Vec<u8> = (0..n)
                        .flat_map(|i| {
                            let v = match i % 7 {
                                0 => f64::NAN,
                                1 => 1e-30 * i as f64,
                                2 => -65504.0 * i as f64,
                                _ => (i as f64) * 0.37 - 1e3,
                            };
                            let mut e = vec![0u8; fs];
                            reshard::convert_slice(DType::F64, &v.to_le_bytes(), from, &mut e);
                            e
                        })
                        .collect();
                    let mut want = vec![0u8; n * ts];
                    reshard::convert_slice(from, &src, to, &mut want);
                    for misalign in [0, 1, 2, 6, 8, 30, 62] {
                        let mut dst = vec![0xa5u8; n * ts + 128];
                        let at = dst.as_ptr().align_offset(64) + misalign;
                        // SAFETY: `n` elements at `at` lie inside `dst`;
                        // `src` holds `n` elements.
                        unsafe { convert_run(src.as_ptr(), from, dst.as_mut_ptr().add(at), to, n) };
                        store_fence();
                        assert_eq!(&dst[at..at + n * ts], &want[..], "{from} -> {to}, {n} elements, {misalign} bytes off a line");
                        assert!(dst[..at].iter().chain(&dst[at + n * ts..]).all(|&b| b == 0xa5), "{from} -> {to}: wrote outside the run");
                    }
                }
            }
        }
    }

    #[test]
    fn copy_run_copies_every_length() {
        let src: Vec<u8> = (0..3000u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in (0..=80).chain([100, 127, 128, 129, 255, 256, 257, 2047, 2048, 2999]) {
            let mut dst = vec![0u8; 3000];
            unsafe { copy_run(src.as_ptr().add(1), dst.as_mut_ptr().add(1), len) };
            assert_eq!(&dst[1..1 + len], &src[1..1 + len]);
            assert!(dst[1 + len..].iter().all(|&b| b == 0) && dst[0] == 0);
        }
    }

    /// Strided copies of random shapes, strides and types (with
    /// dimensions of count 1 and dimensions contiguous on one side, both
    /// or neither) match an element-by-element reference.
    #[test]
    fn strided_copies_match_an_element_by_element_reference() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for _ in 0..2000 {
            let ndim = 1 + next(4) as usize;
            let counts: Vec<u64> = (0..ndim).map(|_| [1, 1, 2, 3, 5, 17][next(6) as usize]).collect();
            // Each side: row-major strides of a padded box (so runs merge or
            // not), inner dims padded at random.
            let side = |next: &mut dyn FnMut(u64) -> u64| {
                let mut strides = [0u64; MAX_DIMS];
                let mut acc = 1;
                for d in (0..ndim).rev() {
                    strides[d] = acc;
                    acc *= counts[d] + if next(2) == 0 { 0 } else { next(3) };
                }
                (strides, acc + next(4))
            };
            let (ss, slen) = side(&mut next);
            let (ds, dlen) = side(&mut next);
            let (sbase, dbase) = (next(3), next(3));
            let types = [DType::BF16, DType::F32, DType::U8, DType::F64];
            let st = types[next(4) as usize];
            let dt = if next(3) == 0 && st != DType::U8 { [DType::BF16, DType::F32][next(2) as usize] } else { st };
            let src_bytes: Vec<u8> = (0..(sbase + slen) * st.size()).map(|i| (i * 131 % 251) as u8).collect();
            // Floats converted must be finite: use small integers.
            let src_bytes: Vec<u8> = match st {
                DType::F32 => (0..sbase + slen).flat_map(|i| ((i % 97) as f32).to_le_bytes()).collect(),
                DType::BF16 => (0..sbase + slen).flat_map(|i| (((i % 97) as f32).to_bits() >> 16).to_le_bytes()[..2].to_vec()).collect(),
                _ => src_bytes,
            };
            let mut dst_bytes = vec![0xAAu8; ((dbase + dlen) * dt.size()) as usize];
            let mut want = dst_bytes.clone();
            let src = StridedRef { ptr: src_bytes.as_ptr(), len: src_bytes.len(), base: sbase, strides: ss, dtype: st };
            let dst = StridedRef { ptr: dst_bytes.as_mut_ptr(), len: dst_bytes.len(), base: dbase, strides: ds, dtype: dt };
            assert!(in_bounds(&counts, &src) && in_bounds(&counts, &dst));
            // Reference: one element at a time.
            let numel: u64 = counts.iter().product();
            for flat in 0..numel {
                let (mut so, mut doff, mut rest) = (sbase, dbase, flat);
                for d in (0..ndim).rev() {
                    let i = rest % counts[d];
                    rest /= counts[d];
                    so += i * ss[d];
                    doff += i * ds[d];
                }
                let s = &src_bytes[(so * st.size()) as usize..((so + 1) * st.size()) as usize];
                let d = &mut want[(doff * dt.size()) as usize..((doff + 1) * dt.size()) as usize];
                convert_slice(st, s, dt, d);
            }
            unsafe { copy_strided(&counts, &src, &dst) };
            assert_eq!(dst_bytes, want, "counts {counts:?} src {ss:?} dst {ds:?} {st:?} -> {dt:?}");
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
