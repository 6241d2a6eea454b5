//! Strided pieces as CUDA copies: a piece (element counts, with element
//! strides on each side) becomes a short list of [`CopyOp`]s, each one
//! linear copy (`cuMemcpyAsync`), one 2-D copy (`cuMemcpy2DAsync`: rows of
//! `width` bytes at a pitch) or one 3-D copy (`cuMemcpy3DAsync`: slices of
//! rows). Dimensions contiguous on both sides merge into the row; the two
//! innermost remaining dimensions become rows and slices; any dimension
//! beyond that is a loop over ops.
//!
//! Pure arithmetic, compiled and tested without a GPU: [`CopyOp::apply`]
//! replays an op on host bytes exactly as CUDA defines it, and the tests
//! check every plan against the host copy kernel.

// Pure, and tested without a GPU in every build; what runs it on a device
// needs the `cuda` feature.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use reshard::MAX_DIMS;

/// One copy: `depth` slices of `height` rows of `width` bytes. Offsets are
/// bytes from the start of each side's region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CopyOp {
    /// Byte offset of the first byte read.
    pub src: u64,
    /// Byte offset of the first byte written.
    pub dst: u64,
    /// Bytes per row.
    pub width: u64,
    /// Rows per slice.
    pub height: u64,
    /// Slices.
    pub depth: u64,
    /// Bytes from one source row to the next.
    pub src_pitch: u64,
    /// Rows from one source slice to the next (slice stride = pitch × this).
    pub src_height: u64,
    /// Bytes from one destination row to the next.
    pub dst_pitch: u64,
    /// Rows from one destination slice to the next.
    pub dst_height: u64,
}

/// The CUDA call an op maps to.
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyKind {
    /// One contiguous run (`cuMemcpyAsync`).
    Linear,
    /// Rows (`cuMemcpy2DAsync`).
    TwoD,
    /// Slices of rows (`cuMemcpy3DAsync`).
    ThreeD,
}

impl CopyOp {
    /// Which CUDA call runs it.
    #[cfg(test)]
    pub(crate) fn kind(&self) -> CopyKind {
        if self.depth > 1 {
            CopyKind::ThreeD
        } else if self.height > 1 {
            CopyKind::TwoD
        } else {
            CopyKind::Linear
        }
    }

    /// Bytes copied.
    pub(crate) fn bytes(&self) -> u64 {
        self.width * self.height * self.depth
    }

    /// One past the last source byte read.
    pub(crate) fn src_end(&self) -> u64 {
        end(self.src, self.width, self.height, self.depth, self.src_pitch, self.src_height)
    }

    /// One past the last destination byte written.
    pub(crate) fn dst_end(&self) -> u64 {
        end(self.dst, self.width, self.height, self.depth, self.dst_pitch, self.dst_height)
    }

    /// Replays the op on host memory, as CUDA defines it (a reference for
    /// tests and for host-side staging). Returns false, copying nothing, if
    /// it would leave either slice.
    #[cfg(test)]
    pub(crate) fn apply(&self, src: &[u8], dst: &mut [u8]) -> bool {
        if self.src_end() > src.len() as u64 || self.dst_end() > dst.len() as u64 {
            return false;
        }
        let w = self.width as usize;
        for z in 0..self.depth {
            for y in 0..self.height {
                let s = (self.src + z * self.src_pitch * self.src_height + y * self.src_pitch) as usize;
                let d = (self.dst + z * self.dst_pitch * self.dst_height + y * self.dst_pitch) as usize;
                dst[d..d + w].copy_from_slice(&src[s..s + w]);
            }
        }
        true
    }
}

fn end(base: u64, width: u64, height: u64, depth: u64, pitch: u64, rows: u64) -> u64 {
    if width == 0 || height == 0 || depth == 0 {
        return base;
    }
    base + (depth - 1) * pitch * rows + (height - 1) * pitch + width
}

/// One side of a strided piece: element offset of its first element and
/// element strides per dimension (as in [`reshard::Span`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Side {
    /// Element offset of the first element.
    pub base: u64,
    /// Element stride per dimension.
    pub strides: [u64; MAX_DIMS],
}

/// The copies that move a piece of element counts `counts` from `src` to
/// `dst`, both of element size `elem` bytes (same dtype on both sides).
/// Pitches above `max_pitch` bytes (the device's `MAX_PITCH`) are split
/// into more ops. Empty pieces give no ops.
pub(crate) fn plan_copies(counts: &[u64], src: &Side, dst: &Side, elem: u64, max_pitch: u64) -> Vec<CopyOp> {
    // Dimensions with more than one element, outermost first, merging
    // neighbours that are contiguous on both sides.
    let Some(mut dims) = crate::copy::joint_dims(counts, &src.strides[..counts.len()], &dst.strides[..counts.len()]) else {
        return Vec::new();
    };
    // The row: the innermost dimension if contiguous on both sides, else
    // one element.
    let width = match dims.last() {
        Some(&(c, 1, 1)) => {
            dims.pop();
            c * elem
        }
        _ => elem,
    };
    let pitch_ok = |s: u64, d: u64| s * elem >= width && d * elem >= width && s * elem <= max_pitch && d * elem <= max_pitch;
    let mut template =
        CopyOp { src: 0, dst: 0, width, height: 1, depth: 1, src_pitch: width, src_height: 1, dst_pitch: width, dst_height: 1 };
    // Rows: the innermost remaining dimension, if its pitches are legal.
    if let Some(&(c, s, d)) = dims.last() {
        if pitch_ok(s, d) {
            dims.pop();
            template.height = c;
            template.src_pitch = s * elem;
            template.dst_pitch = d * elem;
            template.src_height = c;
            template.dst_height = c;
            // Slices: the next one, if its strides are whole numbers of rows
            // at least `height` rows apart on both sides.
            if let Some(&(cz, sz, dz)) = dims.last() {
                if sz % s == 0 && dz % d == 0 && sz / s >= c && dz / d >= c {
                    dims.pop();
                    template.depth = cz;
                    template.src_height = sz / s;
                    template.dst_height = dz / d;
                }
            }
        }
    }
    // Loop over what is left.
    let mut ops = Vec::new();
    crate::copy::for_each_offset(&dims, src.base, dst.base, |so, doff| ops.push(CopyOp { src: so * elem, dst: doff * elem, ..template }));
    ops
}

/// Byte offset of each piece of a message packed back to back, each piece
/// starting at a multiple of `align` bytes, and the total length (`None`
/// past `u64`). Both ends of a transfer compute the same layout from the
/// same plan.
pub(crate) fn packed_offsets(piece_bytes: &[u64], align: u64) -> Option<(Vec<u64>, u64)> {
    // Checked: sizes from a program may add up past `u64`, and wrapped
    // offsets would lie outside what their total sizes.
    let mut pos = 0u64;
    let offsets = piece_bytes
        .iter()
        .map(|&b| {
            let at = pos.checked_next_multiple_of(align.max(1))?;
            pos = at.checked_add(b)?;
            Some(at)
        })
        .collect::<Option<Vec<u64>>>()?;
    Some((offsets, pos))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::copy::{copy_strided, packed_strides, StridedRef};
    use proptest::prelude::*;
    use reshard::span_in;
    use reshard::{Block, DType};

    fn side(span: reshard::Span) -> Side {
        Side { base: span.base, strides: span.strides }
    }

    /// Runs the plan on host bytes and compares with the host kernel.
    fn check(stored_a: &Block, stored_b: &Block, piece: &Block, dtype: DType, max_pitch: u64) -> Vec<CopyOp> {
        let elem = dtype.size();
        let a = span_in(0, stored_a, 0, piece);
        let b = span_in(0, stored_b, 0, piece);
        let src: Vec<u8> = (0..stored_a.numel() * elem).map(|i| (i * 131 + 7) as u8).collect();
        let mut want = vec![0u8; (stored_b.numel() * elem) as usize];
        let mut got = want.clone();
        // SAFETY: `src` and `want` live to the end of the test.
        let sr = unsafe { StridedRef::new(src.as_ptr(), src.len(), a.base, a.strides, dtype) };
        let dr = unsafe { StridedRef::new(want.as_mut_ptr(), want.len(), b.base, b.strides, dtype) };
        unsafe { copy_strided(piece.extent(), &sr, &dr) };
        let ops = plan_copies(piece.extent(), &side(a), &side(b), elem, max_pitch);
        for op in &ops {
            assert!(op.apply(&src, &mut got), "op out of bounds: {op:?}");
            assert!(op.width <= op.src_pitch && op.width <= op.dst_pitch, "{op:?}");
            assert!(op.src_pitch <= max_pitch.max(op.width) && op.dst_pitch <= max_pitch.max(op.width), "{op:?}");
            if op.depth > 1 {
                assert!(op.height <= op.src_height && op.height <= op.dst_height, "{op:?}");
            }
        }
        assert_eq!(ops.iter().map(CopyOp::bytes).sum::<u64>(), piece.numel() * elem);
        assert!(got == want, "plan {ops:?} differs from the host kernel");
        ops
    }

    fn block(offset: &[u64], extent: &[u64]) -> Block {
        Block::new(offset, extent)
    }

    #[test]
    fn contiguous_piece_is_one_linear_copy() {
        let stored = block(&[0, 0], &[8, 16]);
        let piece = block(&[2, 0], &[3, 16]);
        let ops = check(&stored, &piece, &piece, DType::F32, 1 << 31);
        assert_eq!(ops.len(), 1);
        assert_eq!(ops[0].kind(), CopyKind::Linear);
        assert_eq!((ops[0].src, ops[0].dst, ops[0].width), (2 * 16 * 4, 0, 3 * 16 * 4));
    }

    #[test]
    fn column_block_is_one_2d_copy() {
        let stored = block(&[0, 0], &[8, 16]);
        let piece = block(&[0, 4], &[8, 4]);
        let ops = check(&stored, &piece, &piece, DType::BF16, 1 << 31);
        assert_eq!(ops.len(), 1);
        assert_eq!(ops[0].kind(), CopyKind::TwoD);
        assert_eq!((ops[0].width, ops[0].height, ops[0].src_pitch, ops[0].dst_pitch), (8, 8, 32, 8));
    }

    #[test]
    fn sub_cube_is_one_3d_copy_and_4d_loops() {
        let stored = block(&[0, 0, 0], &[6, 5, 7]);
        let piece = block(&[1, 1, 2], &[4, 3, 4]);
        let ops = check(&stored, &piece, &piece, DType::F16, 1 << 31);
        assert_eq!(ops.len(), 1);
        assert_eq!(ops[0].kind(), CopyKind::ThreeD);
        let stored = block(&[0, 0, 0, 0], &[3, 6, 5, 7]);
        let piece = block(&[1, 1, 1, 2], &[2, 4, 3, 4]);
        let ops = check(&stored, &stored, &piece, DType::F64, 1 << 31);
        assert_eq!(ops.len(), 2);
        assert!(ops.iter().all(|o| o.kind() == CopyKind::ThreeD));
    }

    #[test]
    fn single_column_and_small_max_pitch() {
        // One element per row: rows of one element at a pitch.
        let stored = block(&[0, 0], &[9, 5]);
        let piece = block(&[0, 3], &[9, 1]);
        let ops = check(&stored, &piece, &piece, DType::I32, 1 << 31);
        assert_eq!((ops.len(), ops[0].width, ops[0].height), (1, 4, 9));
        // A pitch over the limit falls back to one op per row.
        let piece = block(&[0, 1], &[9, 2]);
        let ops = check(&stored, &piece, &piece, DType::I32, 16);
        assert_eq!(ops.len(), 9);
        assert!(ops.iter().all(|o| o.kind() == CopyKind::Linear));
    }

    #[test]
    fn empty_piece_has_no_ops() {
        let s = Side { base: 0, strides: packed_strides(&[0, 4]) };
        assert!(plan_copies(&[0, 4], &s, &s, 4, 1 << 31).is_empty());
    }

    #[test]
    fn packed_offsets_align() {
        assert_eq!(packed_offsets(&[3, 8, 1], 4), Some((vec![0, 4, 12], 13)));
        assert_eq!(packed_offsets(&[], 256), Some((vec![], 0)));
        assert_eq!(packed_offsets(&[u64::MAX - 100, 8], 256), None, "the second starts past u64");
        assert_eq!(packed_offsets(&[256, u64::MAX - 255], 256), None, "the total passes u64");
    }

    fn dims() -> impl Strategy<Value = (Vec<u64>, Vec<u64>, Vec<u64>, Vec<u64>)> {
        (1usize..=4).prop_flat_map(|nd| {
            (proptest::collection::vec((1u64..6, 0u64..3, 0u64..3, 0u64..3), nd)).prop_map(|v| {
                let extent: Vec<u64> = v.iter().map(|t| t.0).collect();
                let off: Vec<u64> = v.iter().map(|t| t.1.min(t.0 - 1)).collect();
                let pad_a: Vec<u64> = v.iter().map(|t| t.2).collect();
                let pad_b: Vec<u64> = v.iter().map(|t| t.3).collect();
                (extent, off, pad_a, pad_b)
            })
        })
    }

    proptest! {
        #[test]
        fn plans_match_the_host_kernel((extent, off, pad_a, pad_b) in dims(), pitch in prop_oneof![Just(1u64 << 31), 8u64..64]) {
            let piece_ext: Vec<u64> = extent.iter().zip(&off).map(|(e, o)| e - o).collect();
            let piece = block(&off, &piece_ext);
            let a_ext: Vec<u64> = extent.iter().zip(&pad_a).map(|(e, p)| e + p).collect();
            let b_ext: Vec<u64> = extent.iter().zip(&pad_b).map(|(e, p)| e + p).collect();
            let zero = vec![0u64; extent.len()];
            check(&block(&zero, &a_ext), &block(&zero, &b_ext), &piece, DType::F32, pitch);
            check(&block(&zero, &a_ext), &piece, &piece, DType::U8, pitch);
        }
    }
}
