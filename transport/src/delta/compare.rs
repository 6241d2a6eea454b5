//! Where a message differs from its base: the units that changed, found
//! 64 at a time by vector compares into masks (bit `i` of a group's mask:
//! unit `i` of the group differs), a block of groups at a time.

/// Groups of 64 units compared at a time into a block of masks (the
/// blocks form's block: 4096 units).
pub(super) const BLOCK: usize = 64;

/// The `unit`-byte units where `new` differs from `base` (same lengths, a
/// multiple of `unit`).
#[derive(Clone, Copy)]
pub(super) struct Changes<'a> {
    pub(super) base: &'a [u8],
    pub(super) new: &'a [u8],
    pub(super) unit: usize,
}

impl Changes<'_> {
    /// Groups of 64 units in the message (the last may be short).
    pub(super) fn groups(&self) -> usize {
        (self.new.len() / self.unit).div_ceil(64)
    }

    /// Compares the block of (up to) [`BLOCK`] groups from group `first`
    /// into `masks` ([`differing`]): the groups compared.
    pub(super) fn compare_block(&self, first: usize, masks: &mut [u64; BLOCK]) -> usize {
        let end = (first + BLOCK).min(self.groups());
        let (lo, hi) = (first * 64 * self.unit, (end * 64 * self.unit).min(self.new.len()));
        let (new, base, masks) = (&self.new[lo..hi], &self.base[lo..hi], &mut masks[..end - first]);
        match self.unit {
            1 => differing::<1>(new, base, masks),
            2 => differing::<2>(new, base, masks),
            4 => differing::<4>(new, base, masks),
            _ => differing::<8>(new, base, masks),
        }
        end - first
    }
}

/// Into `masks[g]`, bit `i` set where unit `i` of group `g` (64 units of
/// `U` bytes; the last group may be short) of `new` and `base` differ: as
/// vector compares on x86-64 (SSE2, [`sse2`]), one unit at a time
/// elsewhere and for a short group.
fn differing<const U: usize>(new: &[u8], base: &[u8], masks: &mut [u64]) {
    let (new_groups, new_tail) = new.as_chunks::<U>().0.as_chunks::<64>();
    let (base_groups, base_tail) = base.as_chunks::<U>().0.as_chunks::<64>();
    let whole = new_groups.len();
    #[cfg(target_arch = "x86_64")]
    if U <= 4 {
        // SAFETY: `sse2::differing` is compiled for SSE2, which every
        // x86-64 processor has (the target's baseline); it assumes
        // nothing else.
        unsafe { sse2::differing(new_groups, base_groups, &mut masks[..whole]) };
    } else {
        scalar_differing(new_groups, base_groups, &mut masks[..whole]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    scalar_differing(new_groups, base_groups, &mut masks[..whole]);
    if let Some(last) = masks.get_mut(whole) {
        *last = new_tail.iter().zip(base_tail).enumerate().fold(0, |m, (i, (n, b))| m | u64::from(n != b) << i);
    }
}

/// [`differing`] one unit at a time.
fn scalar_differing<const U: usize>(new: &[[[u8; U]; 64]], base: &[[[u8; U]; 64]], masks: &mut [u64]) {
    for ((n, b), mask) in new.iter().zip(base).zip(masks.iter_mut()) {
        *mask = (0..64).fold(0u64, |m, i| m | u64::from(n[i] != b[i]) << i);
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod sse2 {
    use core::arch::x86_64::{
        __m128i, _mm_cmpeq_epi16, _mm_cmpeq_epi32, _mm_cmpeq_epi8, _mm_movemask_epi8, _mm_packs_epi16, _mm_packs_epi32, _mm_prefetch,
        _mm_set_epi64x, _MM_HINT_T1,
    };

    /// How far ahead of the compare both streams are fetched, in bytes
    /// (into L2). With the processor's own prefetchers alone one core
    /// compared an unchanged 512 MiB message at 7.9-8.8 GB/s here, asked
    /// this far ahead at 8.0-10.6 (2 KiB and 16 KiB did no better;
    /// docs/benchmarks.md, "The blocks form").
    const AHEAD: usize = 8192;

    /// [`super::differing`] for units of `U` = 1, 2 or 4 bytes.
    #[target_feature(enable = "sse2")]
    pub(super) fn differing<const U: usize>(new: &[[[u8; U]; 64]], base: &[[[u8; U]; 64]], masks: &mut [u64]) {
        for ((n, b), mask) in new.iter().zip(base).zip(masks.iter_mut()) {
            let (n, b) = (n.as_flattened(), b.as_flattened());
            for line in (0..64 * U).step_by(64) {
                // Only asks for a cache line: never faults, whatever the
                // address (past the message's end near its end), and
                // `wrapping_add` never dereferences it.
                _mm_prefetch::<_MM_HINT_T1>(n.as_ptr().wrapping_add(AHEAD + line).cast());
                _mm_prefetch::<_MM_HINT_T1>(b.as_ptr().wrapping_add(AHEAD + line).cast());
            }
            let step = 16 * U;
            *mask = (0..4).fold(0u64, |m, j| {
                let at = j * step..(j + 1) * step;
                m | u64::from(differing16::<U>(&n[at.clone()], &b[at])) << (16 * j)
            });
        }
    }

    /// Sixteen bytes as a vector (two word loads the compiler merges);
    /// the delta module's vector code loads through it.
    #[target_feature(enable = "sse2")]
    #[inline]
    pub(in crate::delta) fn load(b: &[u8]) -> __m128i {
        let word = |at: usize| i64::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3], b[at + 4], b[at + 5], b[at + 6], b[at + 7]]);
        _mm_set_epi64x(word(8), word(0))
    }

    /// Bit `i` set where unit `i` (of `U` = 1, 2 or 4 bytes) of the
    /// sixteen units in `new` and `base` (`16 * U` bytes each) differs.
    #[target_feature(enable = "sse2")]
    #[inline]
    fn differing16<const U: usize>(new: &[u8], base: &[u8]) -> u16 {
        let eq = |v: usize| {
            let (n, b) = (load(&new[16 * v..16 * v + 16]), load(&base[16 * v..16 * v + 16]));
            match U {
                1 => _mm_cmpeq_epi8(n, b),
                2 => _mm_cmpeq_epi16(n, b),
                _ => _mm_cmpeq_epi32(n, b),
            }
        };
        // Each unit's lanes all ones where equal, packed (signed
        // saturation keeps -1 and 0) down to one byte per unit.
        let bytes = match U {
            1 => eq(0),
            2 => _mm_packs_epi16(eq(0), eq(1)),
            _ => _mm_packs_epi16(_mm_packs_epi32(eq(0), eq(1)), _mm_packs_epi32(eq(2), eq(3))),
        };
        !(_mm_movemask_epi8(bytes) as u16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The masks the block-wise vector compares find mark exactly the
    /// units that differ, for every unit size, across short last groups
    /// and block boundaries.
    #[test]
    fn masks_mark_every_unit_that_differs() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            seed >> 33
        };
        for unit in [1usize, 2, 4, 8] {
            for units in [0usize, 1, 63, 64, 65, 4095, 4096, 4097, 64 * BLOCK * 2 + 17] {
                let base: Vec<u8> = (0..units * unit).map(|_| next() as u8).collect();
                let mut new = base.clone();
                for b in new.iter_mut() {
                    // About one byte in twelve changes (each of a unit's bytes alone).
                    if next() % 12 == 0 {
                        *b ^= 1 << (next() % 8);
                    }
                }
                let want: Vec<usize> = (0..units).filter(|&i| new[i * unit..(i + 1) * unit] != base[i * unit..(i + 1) * unit]).collect();
                let changes = Changes { base: &base, new: &new, unit };
                let (mut got, mut first, mut masks) = (Vec::new(), 0, [0u64; BLOCK]);
                while first < changes.groups() {
                    let filled = changes.compare_block(first, &mut masks);
                    for (g, &m) in masks[..filled].iter().enumerate() {
                        got.extend((0..64).filter(|i| m >> i & 1 == 1).map(|i| (first + g) * 64 + i));
                    }
                    first += filled;
                }
                assert_eq!(got, want, "unit {unit}, {units} units");
            }
        }
    }
}
