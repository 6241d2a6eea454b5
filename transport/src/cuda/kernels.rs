//! Device casts and strided copy-casts: the CUDA C source (`kernels.cu`,
//! for NVRTC) and the launch geometry of its kernels. Compiled in every
//! build: the conversions are integer code that also compiles as C on the
//! host, where the tests check them against the host conversion
//! ([`reshard::convert_slice`]) over every 16-bit value and a
//! million f32 values, without a GPU.
//!
//! A piece whose dtype changes is cut into [`CastBox`]es ([`plan_casts`]:
//! up to three strided dimensions each, the rest a loop), one launch of a
//! `refit_strided_*` kernel each; [`CastBox::apply`] replays a box on host
//! bytes as the kernel runs it, which the tests check against the host
//! executor's strided copy.

// Pure, and tested without a GPU in every build; what runs it on a device
// needs the `cuda` feature.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// The kernels' CUDA C source.
pub(crate) const SOURCE: &str = include_str!("kernels.cu");

/// [`SOURCE`] compiled to PTX for `compute_80` by NVRTC 12.0
/// (`scripts/gen-kernels-ptx.py`: PTX ISA 8.0, which drivers of CUDA 12.0
/// and later load, from release 525 on), what the driver JIT-compiles for
/// the device; its first line names the source's [`source_hash`].
pub(crate) const SHIPPED_PTX: &str = include_str!("kernels.ptx");

/// FNV-1a (64-bit) of [`SOURCE`]: what [`SHIPPED_PTX`] was generated from.
pub(crate) fn source_hash() -> u64 {
    SOURCE.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// Whether [`SHIPPED_PTX`] was generated from this [`SOURCE`].
pub(crate) fn shipped_ptx_is_current() -> bool {
    SHIPPED_PTX.lines().next().is_some_and(|l| l.contains(&format!("fnv1a64 {:016x}", source_hash())))
}

/// The kernels `SOURCE` defines: element-wise casts (`refit_cast_*`,
/// arguments `src, dst, n`; launch with [`launch_1d`]) and strided box
/// copy-casts (`refit_strided_*`, arguments `src, dst, c0, c1, c2, sb, ss0,
/// ss1, ss2, db, ds0, ds1, ds2`; launch with [`launch_3d`]).
pub(crate) const KERNELS: [&str; 15] = [
    "refit_cast_f32_bf16",
    "refit_cast_bf16_f32",
    "refit_cast_f32_f16",
    "refit_cast_f16_f32",
    "refit_strided_f32_bf16",
    "refit_strided_bf16_f32",
    "refit_strided_f32_f16",
    "refit_strided_f16_f32",
    "refit_strided_bf16_f16",
    "refit_strided_f16_bf16",
    "refit_fp8_scales",
    "refit_fp8_codes",
    "refit_strided_copy32",
    "refit_strided_copy16",
    "refit_strided_copy128",
];

/// Threads per block of every kernel.
pub(crate) const THREADS: u32 = 256;

/// Most blocks a grid-stride launch uses along x (enough to fill any
/// current GPU several times over; more only adds scheduling).
pub(crate) const MAX_BLOCKS_X: u32 = 8192;

/// Most blocks along y and z (CUDA's limit); the kernels stride past it.
pub(crate) const MAX_BLOCKS_YZ: u32 = 65_535;

/// Grid and block dimensions of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Blocks per dimension (x, y, z), each at least 1.
    pub grid: [u32; 3],
    /// Threads per block (x, y, z).
    pub block: [u32; 3],
}

/// The launch of an element-wise kernel over `n` elements: a thread per
/// element up to [`MAX_BLOCKS_X`] blocks, the kernel striding past that.
pub(crate) fn launch_1d(n: u64) -> Launch {
    let blocks = n.div_ceil(THREADS as u64).clamp(1, MAX_BLOCKS_X as u64) as u32;
    Launch { grid: [blocks, 1, 1], block: [THREADS, 1, 1] }
}

/// The launch of a strided kernel over a box of `counts` elements
/// (innermost first): x covers the innermost dimension like
/// [`launch_1d`], y and z one block per index up to [`MAX_BLOCKS_YZ`].
pub(crate) fn launch_3d(counts: [u64; 3]) -> Launch {
    let x = launch_1d(counts[0]).grid[0];
    let yz = |c: u64| c.clamp(1, MAX_BLOCKS_YZ as u64) as u32;
    Launch { grid: [x, yz(counts[1]), yz(counts[2])], block: [THREADS, 1, 1] }
}

/// The strided kernel that copies elements of `from` into elements of
/// `to` (converting), if there is one: f32 ↔ bf16, f32 ↔ f16, bf16 ↔ f16,
/// and plain copies of 4- and 2-byte elements. Other pairs (f64, FP8) are
/// converted by the host.
pub(crate) fn strided_kernel(from: reshard::DType, to: reshard::DType) -> Option<&'static str> {
    use reshard::DType::*;
    Some(match (from, to) {
        (F32, BF16) => "refit_strided_f32_bf16",
        (BF16, F32) => "refit_strided_bf16_f32",
        (F32, F16) => "refit_strided_f32_f16",
        (F16, F32) => "refit_strided_f16_f32",
        (BF16, F16) => "refit_strided_bf16_f16",
        (F16, BF16) => "refit_strided_f16_bf16",
        (a, b) if a == b && a.size() == 4 => "refit_strided_copy32",
        (a, b) if a == b && a.size() == 2 => "refit_strided_copy16",
        _ => return None,
    })
}

/// Why no device kernel can move a piece from `from` through `wire` into
/// each of `to` (the first dtype pair none converts: those with f64), or
/// `None` if there is a kernel for every change: one cast where the dtype
/// changes on one side, two through the wire dtype where it changes on
/// both (as `exec::piece_ops` runs them).
pub(crate) fn without_kernel(from: reshard::DType, wire: reshard::DType, to: &[reshard::DType]) -> Option<String> {
    let missing = |a: reshard::DType, b: reshard::DType| a != b && strided_kernel(a, b).is_none();
    to.iter().find_map(|&t| {
        let pairs = if from != wire && wire != t { vec![(from, wire), (wire, t)] } else { vec![(from, t)] };
        pairs.into_iter().find(|&(a, b)| missing(a, b)).map(|(a, b)| format!("no device kernel converts {a} -> {b}"))
    })
}

/// One launch of a strided kernel: a box of `counts` elements (innermost
/// first), element `(i, j, k)` read at `src_base + i*src_strides[0] +
/// j*src_strides[1] + k*src_strides[2]` and written at the same place of
/// the destination side (element units of each side's dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CastBox {
    /// Elements per dimension, innermost first.
    pub counts: [u64; 3],
    /// Source element offset of `(0, 0, 0)`.
    pub src_base: u64,
    /// Source element strides, innermost first.
    pub src_strides: [u64; 3],
    /// Destination element offset of `(0, 0, 0)`.
    pub dst_base: u64,
    /// Destination element strides, innermost first.
    pub dst_strides: [u64; 3],
}

impl CastBox {
    /// Elements in the box (saturating at `u64::MAX`).
    pub fn numel(&self) -> u64 {
        self.counts.iter().fold(1u64, |n, &c| n.saturating_mul(c))
    }

    /// The launch geometry.
    pub fn launch(&self) -> Launch {
        launch_3d(self.counts)
    }

    /// One past the last element read and written; `None` where either
    /// passes `u64` (such a box fits no buffer).
    pub fn ends(&self) -> Option<(u64, u64)> {
        let end = |base: u64, strides: &[u64; 3]| -> Option<u64> {
            if self.counts.contains(&0) {
                return Some(base);
            }
            let mut last = base;
            for (&c, &s) in self.counts.iter().zip(strides) {
                last = last.checked_add((c - 1).checked_mul(s)?)?;
            }
            last.checked_add(1)
        };
        Some((end(self.src_base, &self.src_strides)?, end(self.dst_base, &self.dst_strides)?))
    }

    /// Runs the box on host bytes as the kernel does (every element
    /// converted by the host conversion, which the kernels' own is checked
    /// against). Returns false, touching nothing, if it would leave either
    /// side.
    pub fn apply(&self, from: reshard::DType, src: &[u8], to: reshard::DType, dst: &mut [u8]) -> bool {
        let Some((se, de)) = self.ends() else { return false };
        let (fs, ts) = (from.size(), to.size());
        if se.checked_mul(fs).is_none_or(|n| n > src.len() as u64) || de.checked_mul(ts).is_none_or(|n| n > dst.len() as u64) {
            return false;
        }
        let [c0, c1, c2] = self.counts;
        for k in 0..c2 {
            for j in 0..c1 {
                for i in 0..c0 {
                    let at = |base: u64, st: &[u64; 3]| base + i * st[0] + j * st[1] + k * st[2];
                    let (s, d) = (at(self.src_base, &self.src_strides) * fs, at(self.dst_base, &self.dst_strides) * ts);
                    reshard::convert_slice(from, &src[s as usize..(s + fs) as usize], to, &mut dst[d as usize..(d + ts) as usize]);
                }
            }
        }
        true
    }
}

/// Rows narrower than this many bytes are copied by the strided copy
/// kernels rather than one multi-row copy call
/// (`DeviceRunOptions::narrow_rows_by_kernel`, on by default;
/// gpu_check's throughput check times both).
pub(crate) const NARROW_ROW: u64 = 64 << 10;

/// A multi-row byte copy (`op`, offsets from buffers at `src_addr` and
/// `dst_addr`) with rows narrower than [`NARROW_ROW`], as one box of a
/// strided copy kernel: 16-byte units where every offset, row and pitch
/// allows (`refit_strided_copy128`, one vector load and store a thread),
/// else 4-byte ones (`copy32`), else 2-byte ones (`copy16`). `None`
/// for a single-row copy, wide rows, an odd byte anywhere, or a slice
/// pitch that does not fit (the copy call is used then).
pub(crate) fn copy_as_box(op: &crate::cuda::copyplan::CopyOp, src_addr: u64, dst_addr: u64) -> Option<(&'static str, CastBox)> {
    if op.height.checked_mul(op.depth)? <= 1 || op.width >= NARROW_ROW || op.width == 0 {
        return None;
    }
    let src_slice = op.src_pitch.checked_mul(op.src_height)?;
    let dst_slice = op.dst_pitch.checked_mul(op.dst_height)?;
    let all = [op.width, op.src, op.dst, op.src_pitch, op.dst_pitch, src_slice, dst_slice, src_addr, dst_addr];
    let (kernel, unit) = if all.iter().all(|v| v % 16 == 0) {
        ("refit_strided_copy128", 16)
    } else if all.iter().all(|v| v % 4 == 0) {
        ("refit_strided_copy32", 4)
    } else if all.iter().all(|v| v % 2 == 0) {
        ("refit_strided_copy16", 2)
    } else {
        return None;
    };
    Some((
        kernel,
        CastBox {
            counts: [op.width / unit, op.height, op.depth],
            src_base: op.src / unit,
            src_strides: [1, op.src_pitch / unit, src_slice / unit],
            dst_base: op.dst / unit,
            dst_strides: [1, op.dst_pitch / unit, dst_slice / unit],
        },
    ))
}

/// The launches that copy-cast a piece of element counts `counts`
/// (outermost first, as in [`reshard::Span`]) from `src` to `dst`:
/// dimensions contiguous on both sides merge, the innermost three that
/// remain become one box, any further out a loop over boxes. Empty pieces
/// give none.
pub(crate) fn plan_casts(counts: &[u64], src: &crate::cuda::copyplan::Side, dst: &crate::cuda::copyplan::Side) -> Vec<CastBox> {
    let n = counts.len();
    let Some(mut dims) = crate::copy::joint_dims(counts, &src.strides[..n], &dst.strides[..n]) else {
        return Vec::new();
    };
    let mut template = CastBox { counts: [1; 3], src_base: 0, src_strides: [0; 3], dst_base: 0, dst_strides: [0; 3] };
    for d in 0..3 {
        if let Some((c, s, t)) = dims.pop() {
            template.counts[d] = c;
            template.src_strides[d] = s;
            template.dst_strides[d] = t;
        }
    }
    let mut boxes = Vec::new();
    crate::copy::for_each_offset(&dims, src.base, dst.base, |so, doff| boxes.push(CastBox { src_base: so, dst_base: doff, ..template }));
    boxes
}

/// Compiles [`SOURCE`] to PTX with NVRTC (`libnvrtc`, loaded at run time;
/// no GPU needed) for the virtual architecture of compute capability
/// `arch` (`(9, 0)`: `compute_90`; `None`: NVRTC's default). Never panics:
/// a missing library is an error.
#[cfg(feature = "cuda")]
pub(crate) fn compile(arch: Option<(i32, i32)>) -> Result<String, crate::cuda::device::KernelError> {
    crate::cuda::device::no_panic("NVRTC", || {
        nvrtc_present()?;
        let options = arch.map(|(major, minor)| vec![format!("--gpu-architecture=compute_{major}{minor}")]).unwrap_or_default();
        let opts = cudarc::nvrtc::CompileOptions { name: Some("refit_kernels.cu".into()), options, ..Default::default() };
        cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map(|ptx| ptx.to_src()).map_err(crate::cuda::device::KernelError::Compile)
    })
}

/// NVRTC's version (`major.minor`), or why it does not load. Never panics.
#[cfg(feature = "cuda")]
pub fn nvrtc_version() -> Result<String, crate::cuda::device::KernelError> {
    crate::cuda::device::no_panic("NVRTC", || {
        nvrtc_present()?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: writes two ints through valid pointers.
        let rc = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        if rc != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(crate::cuda::device::KernelError::Nvrtc { call: "nvrtcVersion", code: rc });
        }
        Ok(format!("{major}.{minor}"))
    })
}

#[cfg(feature = "cuda")]
fn nvrtc_present() -> Result<(), crate::cuda::device::KernelError> {
    // SAFETY: only tries to open the library.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(crate::cuda::device::KernelError::NoNvrtc)
    }
}

/// The PTX ISA version `SHIPPED_PTX` declares (`.version 8.0`): the
/// oldest driver that loads it is the one of the CUDA release of that ISA.
pub fn shipped_ptx_isa() -> Option<&'static str> {
    SHIPPED_PTX.lines().find_map(|l| l.strip_prefix(".version ")).map(str::trim)
}

/// Every index a launch's threads visit with the kernels' loops, as
/// (i, j, k), in no particular order: what the tests check covers a box
/// exactly once.
#[cfg(test)]
pub(crate) fn visited(launch: &Launch, counts: [u64; 3], mut f: impl FnMut(u64, u64, u64)) {
    let [gx, gy, gz] = launch.grid.map(u64::from);
    let bx = launch.block[0] as u64;
    for bz in 0..gz {
        for by in 0..gy {
            for b in 0..gx {
                for t in 0..bx {
                    let mut k = bz;
                    while k < counts[2] {
                        let mut j = by;
                        while j < counts[1] {
                            let mut i = b * bx + t;
                            while i < counts[0] {
                                f(i, j, k);
                                i += gx * bx;
                            }
                            j += gy;
                        }
                        k += gz;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard::convert_slice;
    use reshard::DType;
    use std::io::Write;
    use std::process::{Command, Stdio};

    use crate::copy::{copy_strided, StridedRef};
    use crate::cuda::copyplan::Side;
    use proptest::prelude::*;
    use reshard::span_in;
    use reshard::Block;

    /// A piece of `stored_a` copied into `stored_b`, `from` → `to`: the
    /// boxes replayed on host bytes equal the host executor's strided copy.
    fn check_casts(stored_a: &Block, stored_b: &Block, piece: &Block, from: DType, to: DType) -> Vec<CastBox> {
        let a = span_in(0, stored_a, 0, piece);
        let b = span_in(0, stored_b, 0, piece);
        // Source bytes that are valid values of `from` with varied bits.
        let n = stored_a.numel() as usize;
        let vals: Vec<f32> = (0..n).map(|i| ((i * 2_654_435_761) % 100_003) as f32 * 0.37 - 18_000.0).collect();
        let mut src = vec![0u8; n * from.size() as usize];
        convert_slice(DType::F32, bytemuck_f32(&vals), from, &mut src);
        let mut want = vec![0xa5u8; (stored_b.numel() * to.size()) as usize];
        let mut got = want.clone();
        // SAFETY: `src` and `want` live to the end of this function.
        let sr = unsafe { StridedRef::new(src.as_ptr(), src.len(), a.base, a.strides, from) };
        let dr = unsafe { StridedRef::new(want.as_mut_ptr(), want.len(), b.base, b.strides, to) };
        unsafe { copy_strided(piece.extent(), &sr, &dr) };
        let boxes = plan_casts(piece.extent(), &Side { base: a.base, strides: a.strides }, &Side { base: b.base, strides: b.strides });
        for bx in &boxes {
            assert!(bx.apply(from, &src, to, &mut got), "box out of bounds: {bx:?}");
        }
        assert_eq!(boxes.iter().map(CastBox::numel).sum::<u64>(), piece.numel());
        assert!(got == want, "boxes {boxes:?} differ from the host copy");
        boxes
    }

    fn bytemuck_f32(v: &[f32]) -> &[u8] {
        // SAFETY: f32 has no padding and any byte view of it is valid.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
    }

    #[test]
    fn only_dtype_pairs_without_a_kernel_are_named() {
        use reshard::DType::*;
        assert_eq!(without_kernel(F32, BF16, &[BF16]), None);
        assert_eq!(without_kernel(F32, BF16, &[F32, F16]), None, "through the wire dtype: two kernels each");
        assert_eq!(without_kernel(F64, F64, &[F64]), None, "no dtype change: copies");
        assert_eq!(without_kernel(F32, F64, &[F64]).as_deref(), Some("no device kernel converts f32 -> f64"));
        assert_eq!(without_kernel(BF16, F32, &[F32, F64]).as_deref(), Some("no device kernel converts f32 -> f64"));
        assert_eq!(without_kernel(F64, F32, &[BF16]).as_deref(), Some("no device kernel converts f64 -> f32"));
    }

    #[test]
    fn casts_of_pieces_are_few_boxes() {
        let blk = |o: &[u64], e: &[u64]| Block::new(o, e);
        // A contiguous piece: one box of one merged dimension.
        let boxes = check_casts(&blk(&[0, 0], &[8, 16]), &blk(&[2, 0], &[3, 16]), &blk(&[2, 0], &[3, 16]), DType::F32, DType::BF16);
        assert_eq!(boxes.len(), 1);
        assert_eq!(boxes[0].counts, [48, 1, 1]);
        // A column block: rows at a stride.
        let boxes = check_casts(&blk(&[0, 0], &[8, 16]), &blk(&[0, 4], &[8, 4]), &blk(&[0, 4], &[8, 4]), DType::BF16, DType::F32);
        assert_eq!((boxes.len(), boxes[0].counts, boxes[0].src_strides[1]), (1, [4, 8, 1], 16));
        // Four strided dimensions: a loop over 3-D boxes.
        let stored = blk(&[0, 0, 0, 0], &[3, 6, 5, 7]);
        let piece = blk(&[1, 1, 1, 2], &[2, 4, 3, 4]);
        assert_eq!(check_casts(&stored, &stored, &piece, DType::F32, DType::F16).len(), 2);
        let empty = Side { base: 0, strides: crate::copy::packed_strides(&[0, 4]) };
        assert!(plan_casts(&[0, 4], &empty, &empty).is_empty());
    }

    #[test]
    fn the_shipped_ptx_is_generated_from_this_source_and_has_every_kernel() {
        assert!(shipped_ptx_is_current(), "kernels.ptx is stale (kernels.cu hash {:016x}): run scripts/gen-kernels-ptx.py", source_hash());
        for k in KERNELS {
            assert!(SHIPPED_PTX.contains(&format!(".entry {k}(")), "{k} missing from kernels.ptx");
        }
    }

    #[test]
    fn kernels_cover_the_usual_pairs_only() {
        assert_eq!(strided_kernel(DType::F32, DType::BF16), Some("refit_strided_f32_bf16"));
        assert_eq!(strided_kernel(DType::I32, DType::I32), Some("refit_strided_copy32"));
        assert_eq!(strided_kernel(DType::BF16, DType::BF16), Some("refit_strided_copy16"));
        assert_eq!(strided_kernel(DType::F64, DType::BF16), None);
        assert_eq!(strided_kernel(DType::BF16, DType::F16), Some("refit_strided_bf16_f16"));
        assert_eq!(strided_kernel(DType::F64, DType::F32), None);
        for k in [DType::F32, DType::BF16, DType::F16] {
            for t in [DType::F32, DType::BF16, DType::F16] {
                if let Some(name) = strided_kernel(k, t) {
                    assert!(KERNELS.contains(&name), "{name}");
                }
            }
        }
    }

    fn shapes() -> impl Strategy<Value = (Vec<u64>, Vec<u64>, Vec<u64>, Vec<u64>)> {
        (1usize..=5).prop_flat_map(|nd| {
            proptest::collection::vec((1u64..6, 0u64..3, 0u64..3, 0u64..3), nd).prop_map(|v| {
                let extent: Vec<u64> = v.iter().map(|t| t.0).collect();
                let off: Vec<u64> = v.iter().map(|t| t.1.min(t.0 - 1)).collect();
                (extent, off, v.iter().map(|t| t.2).collect(), v.iter().map(|t| t.3).collect())
            })
        })
    }

    proptest! {
        #[test]
        fn cast_plans_match_the_host_copy((extent, off, pad_a, pad_b) in shapes(), pair in 0usize..8) {
            let (from, to) = [(DType::F32, DType::BF16), (DType::BF16, DType::F32), (DType::F32, DType::F16),
                              (DType::F16, DType::F32), (DType::F32, DType::F32), (DType::BF16, DType::BF16),
                              (DType::BF16, DType::F16), (DType::F16, DType::BF16)][pair];
            let piece_ext: Vec<u64> = extent.iter().zip(&off).map(|(e, o)| e - o).collect();
            let piece = Block::new(&off, &piece_ext);
            let zero = vec![0u64; extent.len()];
            let a_ext: Vec<u64> = extent.iter().zip(&pad_a).map(|(e, p)| e + p).collect();
            let b_ext: Vec<u64> = extent.iter().zip(&pad_b).map(|(e, p)| e + p).collect();
            check_casts(&Block::new(&zero, &a_ext), &Block::new(&zero, &b_ext), &piece, from, to);
            check_casts(&Block::new(&zero, &a_ext), &piece, &piece, from, to);
        }
    }

    proptest! {
        /// A narrow-row copy run by the strided copy kernel (its box
        /// replayed as the kernel runs it) writes exactly what the copy
        /// call would, byte for byte, and nothing else.
        #[test]
        fn narrow_row_copies_as_kernel_boxes_match_the_copy_calls((extent, off, pad_a, pad_b) in shapes(), e in 0usize..5) {
            use crate::cuda::copyplan::{plan_copies, Side as CSide};
            let elem = [1u64, 2, 4, 8, 16][e];
            let piece_ext: Vec<u64> = extent.iter().zip(&off).map(|(e, o)| e - o).collect();
            let piece = Block::new(&off, &piece_ext);
            let zero = vec![0u64; extent.len()];
            let a_ext: Vec<u64> = extent.iter().zip(&pad_a).map(|(e, p)| e + p).collect();
            let b_ext: Vec<u64> = extent.iter().zip(&pad_b).map(|(e, p)| e + p).collect();
            let (stored_a, stored_b) = (Block::new(&zero, &a_ext), Block::new(&zero, &b_ext));
            let (a, b) = (span_in(0, &stored_a, 0, &piece), span_in(0, &stored_b, 0, &piece));
            let src: Vec<u8> = (0..stored_a.numel() * elem).map(|i| (i * 37 % 251) as u8).collect();
            let ops = plan_copies(piece.extent(), &CSide { base: a.base, strides: a.strides }, &CSide { base: b.base, strides: b.strides }, elem, 1 << 31);
            for op in ops {
                let mut want = vec![0x5au8; (stored_b.numel() * elem) as usize];
                let mut got = want.clone();
                prop_assert!(op.apply(&src, &mut want));
                match copy_as_box(&op, 0, 0) {
                    Some((kernel, bx)) => {
                        prop_assert!(op.height * op.depth > 1 && op.width < NARROW_ROW);
                        let unit = match kernel {
                            "refit_strided_copy128" => 16,
                            "refit_strided_copy32" => 4,
                            _ => 2,
                        };
                        if unit < 16 {
                            let dtype = if unit == 4 { DType::I32 } else { DType::BF16 };
                            prop_assert_eq!(strided_kernel(dtype, dtype), Some(kernel));
                        }
                        prop_assert!(replay_copy_box(&bx, unit, &src, &mut got), "box out of bounds: {:?}", bx);
                        prop_assert!(got == want, "{:?} as {:?} differs from the copy", op, bx);
                    }
                    None => prop_assert!(op.height * op.depth <= 1 || op.width % 2 == 1 || op.width >= NARROW_ROW || elem == 1),
                }
            }
        }
    }

    /// A copy kernel's box replayed on host bytes in `unit`-byte elements,
    /// as the kernel moves them; false, touching nothing, if it would
    /// leave either side.
    fn replay_copy_box(bx: &CastBox, unit: u64, src: &[u8], dst: &mut [u8]) -> bool {
        let Some((se, de)) = bx.ends() else { return false };
        if se * unit > src.len() as u64 || de * unit > dst.len() as u64 {
            return false;
        }
        let [c0, c1, c2] = bx.counts;
        for k in 0..c2 {
            for j in 0..c1 {
                for i in 0..c0 {
                    let at = |base: u64, st: &[u64; 3]| ((base + i * st[0] + j * st[1] + k * st[2]) * unit) as usize;
                    let (s, d) = (at(bx.src_base, &bx.src_strides), at(bx.dst_base, &bx.dst_strides));
                    dst[d..d + unit as usize].copy_from_slice(&src[s..s + unit as usize]);
                }
            }
        }
        true
    }

    #[test]
    fn narrow_rows_of_a_column_shard_go_to_the_kernel_and_odd_addresses_do_not() {
        use crate::cuda::copyplan::CopyOp;
        // 512 rows of 2 KiB out of 4 KiB rows: a bf16 column shard.
        let op = CopyOp {
            src: 2048,
            dst: 0,
            width: 2048,
            height: 512,
            depth: 1,
            src_pitch: 4096,
            src_height: 512,
            dst_pitch: 2048,
            dst_height: 512,
        };
        let (kernel, bx) = copy_as_box(&op, 1 << 20, 2 << 20).unwrap();
        assert_eq!(kernel, "refit_strided_copy128");
        assert_eq!((bx.counts, bx.src_base, bx.src_strides), ([128, 512, 1], 128, [1, 256, 512 * 256]));
        assert_eq!(copy_as_box(&op, (1 << 20) + 4, 2 << 20).unwrap().0, "refit_strided_copy32");
        assert_eq!(copy_as_box(&op, (1 << 20) + 2, 2 << 20).unwrap().0, "refit_strided_copy16");
        assert_eq!(copy_as_box(&op, (1 << 20) + 1, 2 << 20), None);
        assert_eq!(copy_as_box(&CopyOp { height: 1, ..op }, 0, 0), None, "one row: the copy call");
        assert_eq!(copy_as_box(&CopyOp { width: NARROW_ROW, src_pitch: 2 * NARROW_ROW, dst_pitch: NARROW_ROW, ..op }, 0, 0), None);
    }

    #[test]
    fn launches_stay_within_limits_and_cover_each_index_once() {
        assert_eq!(launch_1d(0).grid, [1, 1, 1]);
        assert_eq!(launch_1d(256).grid, [1, 1, 1]);
        assert_eq!(launch_1d(257).grid, [2, 1, 1]);
        assert_eq!(launch_1d(u64::MAX).grid, [MAX_BLOCKS_X, 1, 1]);
        assert_eq!(launch_3d([10, 70_000, 3]).grid, [1, MAX_BLOCKS_YZ, 3]);
        for counts in [[1, 1, 1], [300, 2, 2], [5, 3, 7], [0, 4, 4], [257, 1, 11]] {
            // A small grid with the same loop shape: the coverage rule does
            // not depend on the sizes.
            let mut l = launch_3d(counts);
            l.grid = [l.grid[0].min(3), l.grid[1].min(2), l.grid[2].min(5)];
            l.block[0] = 64;
            let mut seen = std::collections::HashMap::new();
            visited(&l, counts, |i, j, k| *seen.entry((i, j, k)).or_insert(0) += 1);
            let n = counts.iter().product::<u64>() as usize;
            assert_eq!(seen.len(), n, "{counts:?}");
            assert!(seen.values().all(|&c| c == 1), "{counts:?}");
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn the_source_compiles_with_nvrtc() {
        match compile(None) {
            Ok(ptx) => {
                for k in KERNELS {
                    assert!(ptx.contains(&format!(".entry {k}(")), "{k} missing from the PTX");
                }
            }
            Err(e @ crate::cuda::device::KernelError::NoNvrtc) => eprintln!("skipped: {e}"),
            Err(e) => panic!("{e}"),
        }
    }

    /// Drivers load PTX of their CUDA release's ISA or older: ISA 8.0 is
    /// CUDA 12.0's (drivers from 525 on).
    #[test]
    fn the_shipped_ptx_loads_on_cuda_12_0_drivers() {
        let isa = shipped_ptx_isa().expect("a .version line");
        let (major, minor) = isa.split_once('.').expect("major.minor");
        let v = (major.parse::<u32>().unwrap(), minor.parse::<u32>().unwrap());
        assert!(v <= (8, 0), "PTX ISA {isa} needs a newer driver than CUDA 12.0's: regenerate with NVRTC 12.0");
    }

    #[test]
    fn the_source_names_every_kernel() {
        for k in KERNELS {
            assert!(SOURCE.contains(&format!("({k},")) || SOURCE.contains(&format!("void {k}(")), "{k}");
        }
    }

    /// The conversions compiled as C by the host compiler, fed `input`
    /// (`mode`: which conversion) on stdin; `None` without a C compiler.
    fn run_host(mode: &str, input: &[u8]) -> Option<Vec<u8>> {
        let main = format!(
            "int main(void) {{ unsigned char b[4]; const char *m = \"{mode}\";\n\
             int wide = m[0] == 'f' && m[1] == '3';\n\
             while (fread(b, wide ? 4 : 2, 1, stdin) == 1) {{\n\
               u32 v; u16 h; memcpy(&v, b, 4); memcpy(&h, b, 2);\n\
               if (!strcmp(m, \"f32_bf16\")) {{ u16 o = refit_f32_to_bf16(v); fwrite(&o, 2, 1, stdout); }}\n\
               if (!strcmp(m, \"f32_f16\")) {{ u16 o = refit_f32_to_f16(v); fwrite(&o, 2, 1, stdout); }}\n\
               if (!strcmp(m, \"bf16_f32\")) {{ u32 o = refit_bf16_to_f32(h); fwrite(&o, 4, 1, stdout); }}\n\
               if (!strcmp(m, \"f16_f32\")) {{ u32 o = refit_f16_to_f32(h); fwrite(&o, 4, 1, stdout); }}\n\
               if (!strcmp(m, \"bf16_f16\")) {{ u16 o = refit_bf16_to_f16(h); fwrite(&o, 2, 1, stdout); }}\n\
               if (!strcmp(m, \"f16_bf16\")) {{ u16 o = refit_f16_to_bf16(h); fwrite(&o, 2, 1, stdout); }}\n\
             }} return 0; }}\n"
        );
        run_c(mode, &main, input)
    }

    /// `SOURCE` and `main` compiled as C by the host compiler and run with
    /// `input` on stdin; its stdout, or `None` without a C compiler.
    fn run_c(name: &str, main: &str, input: &[u8]) -> Option<Vec<u8>> {
        let dir = std::env::temp_dir().join(format!("refit-kernels-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let harness = format!("{SOURCE}\n#include <stdio.h>\n#include <string.h>\n{main}");
        let (c, exe) = (dir.join("harness.c"), dir.join("harness"));
        std::fs::write(&c, harness).ok()?;
        let built = Command::new("cc").args(["-O1", "-o"]).arg(&exe).arg(&c).status().ok()?;
        assert!(built.success(), "the kernel source does not compile as C");
        let mut child = Command::new(&exe).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().ok()?;
        let mut stdin = child.stdin.take()?;
        let input = input.to_vec();
        let writer = std::thread::spawn(move || stdin.write_all(&input));
        let out = child.wait_with_output().ok()?;
        writer.join().ok()?.ok()?;
        let _ = std::fs::remove_dir_all(&dir);
        Some(out.stdout)
    }

    /// Every 16-bit pattern, and a million f32 values (every exponent,
    /// random mantissas, NaNs and infinities among them).
    fn inputs() -> (Vec<u8>, Vec<u8>) {
        let all16: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut f32s: Vec<u8> = Vec::with_capacity(4 << 20);
        for i in 0..1_000_000u32 {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let r = (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) as u32;
            // Every 256th value an exponent sweep with exact ties.
            let v = if i % 256 == 0 { ((i >> 8) % 512) << 23 | 0x1000 | (r & 0x8000_0000) } else { r };
            f32s.extend_from_slice(&v.to_le_bytes());
        }
        (all16, f32s)
    }

    /// The FP8 functions compiled as C: for each (x, s) pair of f32 bits,
    /// `refit_quantize(x, s)` (1 byte) and `refit_block_scale(x & 0x7fffffff)`
    /// (4 bytes), against `reshard::quantize`.
    #[test]
    fn host_compiled_fp8_functions_equal_the_host_quantizer() {
        use reshard::{block_scale, quantize_value};
        let main = "int main(void) { u32 v[2];\n\
                    while (fread(v, 4, 2, stdin) == 2) {\n\
                      u8 q = refit_quantize(v[0], v[1]); u32 s = refit_block_scale(v[0] & 0x7fffffffu);\n\
                      fwrite(&q, 1, 1, stdout); fwrite(&s, 4, 1, stdout);\n\
                    } return 0; }\n";
        let (_, f32s) = inputs();
        let xs: Vec<u32> = f32s.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        // Scales as quantization makes them (from a block's largest
        // magnitude), 1.0 (so the codes are e4m3 of x itself), and the
        // smallest: subnormal scales and a scale that underflowed to 0.
        let mut pairs: Vec<(u32, u32)> = Vec::with_capacity(xs.len() + (1 << 16));
        for (i, &x) in xs.iter().enumerate() {
            let s = match i % 4 {
                0 => 1.0f32.to_bits(),
                1 => block_scale(f32::from_bits(xs[(i * 7919) % xs.len()] & 0x7f7f_ffff)).to_bits(),
                2 => (xs[(i * 31) % xs.len()] & 0x007f_ffff) | 1,
                _ => block_scale(f32::from_bits(x & 0x7fff_ffff).min(f32::MAX) * 1.75).to_bits(),
            };
            pairs.push((x, s));
        }
        // Every e4m3 code's neighbourhood: each 16-bit prefix of f32.
        pairs.extend((0..=u16::MAX).map(|h| ((h as u32) << 16 | 0x8000, 1.0f32.to_bits())));
        pairs.push((1.0f32.to_bits(), 0));
        let input: Vec<u8> = pairs.iter().flat_map(|&(x, s)| [x.to_le_bytes(), s.to_le_bytes()]).flatten().collect();
        let Some(got) = run_c("fp8", main, &input) else {
            eprintln!("no C compiler: the kernel FP8 functions are not checked");
            return;
        };
        assert_eq!(got.len(), pairs.len() * 5);
        for (k, &(x, s)) in pairs.iter().enumerate() {
            let (q, sc) = (got[k * 5], u32::from_le_bytes([got[k * 5 + 1], got[k * 5 + 2], got[k * 5 + 3], got[k * 5 + 4]]));
            let (xf, sf) = (f32::from_bits(x), f32::from_bits(s));
            assert_eq!(q, quantize_value(xf, sf), "quantize({x:#010x}, {s:#010x})");
            let amax = f32::from_bits(x & 0x7fff_ffff);
            if amax.is_finite() {
                assert_eq!(sc, block_scale(amax).to_bits(), "block_scale({:#010x})", x & 0x7fff_ffff);
            }
        }
    }

    #[test]
    fn host_compiled_conversions_equal_the_host_conversion() {
        let (all16, f32s) = inputs();
        for (mode, from, to, input) in [
            ("f32_bf16", DType::F32, DType::BF16, &f32s),
            ("f32_f16", DType::F32, DType::F16, &f32s),
            ("bf16_f32", DType::BF16, DType::F32, &all16),
            ("f16_f32", DType::F16, DType::F32, &all16),
            ("bf16_f16", DType::BF16, DType::F16, &all16),
            ("f16_bf16", DType::F16, DType::BF16, &all16),
        ] {
            let Some(got) = run_host(mode, input) else {
                eprintln!("no C compiler: the kernel conversions are not checked");
                return;
            };
            let n = input.len() / from.size() as usize;
            let mut want = vec![0u8; n * to.size() as usize];
            convert_slice(from, input, to, &mut want);
            assert_eq!(got.len(), want.len(), "{mode}");
            let ts = to.size() as usize;
            if let Some(k) = (0..n).find(|&k| got[k * ts..(k + 1) * ts] != want[k * ts..(k + 1) * ts]) {
                let fs = from.size() as usize;
                panic!(
                    "{mode}: input {:02x?} gives {:02x?}, the host {:02x?}",
                    &input[k * fs..(k + 1) * fs],
                    &got[k * ts..(k + 1) * ts],
                    &want[k * ts..(k + 1) * ts]
                );
            }
        }
    }
}
