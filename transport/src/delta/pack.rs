//! The changed units' values of a group of 64 units, packed one after the
//! other ([`gather`]) and put back where they belong ([`scatter`]), a mask
//! bit per unit. Units of 2 bytes (bf16, f16: what delta refits mostly
//! move) go eight at a time through byte shuffles on x86-64 with SSSE3
//! (found at run time), with no branch on which units changed; every other
//! unit size, and the last bytes of a buffer, one changed unit at a time.

/// Appends the units of `group` (64 units of `U` bytes; fewer in a short
/// last group, whose mask has no bit past them) that `mask` marks to
/// `out` from `at`: the new `at`. `out` holds at least `at` plus the
/// marked units' bytes.
#[inline]
pub(super) fn gather<const U: usize>(mask: u64, group: &[u8], out: &mut [u8], at: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    if U == 2 && group.len() == 128 && out.len() >= at + 128 + 16 && shuffles() {
        // SAFETY: the only requirement of calling an `ssse3` function is
        // that the processor has SSSE3, found at run time (`shuffles`).
        // Inside, every read and write goes through checked slice
        // indexing: a mask that marks more units than `out` has room for
        // panics in safe code, never touches memory outside the slices.
        return unsafe { ssse3::gather2(mask, group, out, at) };
    }
    gather_one_by_one::<U>(mask, group, out, at)
}

/// [`gather`] one changed unit at a time.
#[inline]
fn gather_one_by_one<const U: usize>(mut mask: u64, group: &[u8], out: &mut [u8], mut at: usize) -> usize {
    while mask != 0 {
        let i = mask.trailing_zeros() as usize;
        mask &= mask - 1;
        out[at..at + U].copy_from_slice(&group[i * U..i * U + U]);
        at += U;
    }
    at
}

/// Writes the values `values[at..]` holds, in order, into the units of
/// `group` that `mask` marks: the new `at`. `values` holds at least the
/// marked units' bytes from `at`.
#[inline]
pub(super) fn scatter<const U: usize>(mask: u64, values: &[u8], at: usize, group: &mut [u8]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if U == 2 && group.len() == 128 && values.len() >= at + 128 + 16 && shuffles() {
        // SAFETY: as in `gather`: SSSE3 found at run time, every access
        // checked. `values` comes from a peer: a mask marking more units
        // than it sent panics in safe code (the decoder refuses such a
        // block first, checking its count against the values sent and
        // the bitmap against its count).
        return unsafe { ssse3::scatter2(mask, values, at, group) };
    }
    scatter_one_by_one::<U>(mask, values, at, group)
}

/// [`scatter`] one changed unit at a time.
#[inline]
fn scatter_one_by_one<const U: usize>(mut mask: u64, values: &[u8], mut at: usize, group: &mut [u8]) -> usize {
    while mask != 0 {
        let i = mask.trailing_zeros() as usize;
        mask &= mask - 1;
        group[i * U..i * U + U].copy_from_slice(&values[at..at + U]);
        at += U;
    }
    at
}

/// Whether this processor has SSSE3's byte shuffle (found once).
#[cfg(target_arch = "x86_64")]
#[inline]
fn shuffles() -> bool {
    std::arch::is_x86_feature_detected!("ssse3")
}

#[cfg(target_arch = "x86_64")]
mod ssse3 {
    use crate::delta::compare::sse2::load;
    use core::arch::x86_64::{
        __m128i, _mm_and_si128, _mm_andnot_si128, _mm_cmpeq_epi16, _mm_cvtsi128_si64, _mm_or_si128, _mm_set1_epi16, _mm_set_epi16,
        _mm_shuffle_epi8, _mm_srli_si128,
    };

    /// For each byte of a mask (eight 2-byte units): the shuffle that
    /// packs the marked units' bytes to the front (`GATHER`), and the one
    /// that spreads packed values to the marked units (`SCATTER`); 0x80
    /// where a byte is left zero.
    const fn tables() -> ([[u8; 16]; 256], [[u8; 16]; 256]) {
        let mut gather = [[0x80u8; 16]; 256];
        let mut scatter = [[0x80u8; 16]; 256];
        let mut m = 0;
        while m < 256 {
            let (mut lane, mut packed) = (0, 0);
            while lane < 8 {
                if m >> lane & 1 == 1 {
                    gather[m][2 * packed] = 2 * lane as u8;
                    gather[m][2 * packed + 1] = 2 * lane as u8 + 1;
                    scatter[m][2 * lane] = 2 * packed as u8;
                    scatter[m][2 * lane + 1] = 2 * packed as u8 + 1;
                    packed += 1;
                }
                lane += 1;
            }
            m += 1;
        }
        (gather, scatter)
    }

    static GATHER: [[u8; 16]; 256] = tables().0;
    static SCATTER: [[u8; 16]; 256] = tables().1;

    /// A vector into sixteen bytes (two word stores the compiler merges).
    #[target_feature(enable = "ssse3")]
    #[inline]
    fn store(v: __m128i, to: &mut [u8]) {
        to[..8].copy_from_slice(&_mm_cvtsi128_si64(v).to_le_bytes());
        to[8..16].copy_from_slice(&_mm_cvtsi128_si64(_mm_srli_si128::<8>(v)).to_le_bytes());
    }

    /// Before each byte of `mask`, how many bits the bytes below it have
    /// set (byte `j` of the result), found at once (no chain from one
    /// byte's count to the next): the packed offsets of each eight units.
    #[inline]
    fn offsets(mask: u64) -> u64 {
        let c = mask - ((mask >> 1) & 0x5555_5555_5555_5555);
        let c = (c & 0x3333_3333_3333_3333) + ((c >> 2) & 0x3333_3333_3333_3333);
        let c = (c + (c >> 4)) & 0x0f0f_0f0f_0f0f_0f0f;
        // Each byte the sum of the counts below and at it (at most 64),
        // moved up a byte: the sum of those below.
        c.wrapping_mul(0x0101_0101_0101_0101) << 8
    }

    /// [`super::gather`] for 64 units of 2 bytes, eight at a time: each
    /// eight shuffled to the front of a 16-byte store at their packed
    /// offset (`out` holds 16 bytes past the last value).
    #[target_feature(enable = "ssse3")]
    pub(super) fn gather2(mask: u64, group: &[u8], out: &mut [u8], at: usize) -> usize {
        let before = offsets(mask);
        for j in 0..8 {
            let m = (mask >> (8 * j)) as u8;
            let to = at + 2 * ((before >> (8 * j)) & 0xff) as usize;
            let v = _mm_shuffle_epi8(load(&group[16 * j..16 * j + 16]), load(&GATHER[usize::from(m)]));
            store(v, &mut out[to..to + 16]);
        }
        at + 2 * mask.count_ones() as usize
    }

    /// [`super::scatter`] for 64 units of 2 bytes, eight at a time: the
    /// sixteen bytes of values from their packed offset spread to the
    /// marked units, blended with the units left as they are (`values`
    /// holds 16 bytes past the last value read).
    #[target_feature(enable = "ssse3")]
    pub(super) fn scatter2(mask: u64, values: &[u8], at: usize, group: &mut [u8]) -> usize {
        // Lane i's bit of a mask byte, to find the marked lanes.
        let bit = _mm_set_epi16(128, 64, 32, 16, 8, 4, 2, 1);
        let before = offsets(mask);
        for j in 0..8 {
            let m = (mask >> (8 * j)) as u8;
            let from = at + 2 * ((before >> (8 * j)) & 0xff) as usize;
            let spread = _mm_shuffle_epi8(load(&values[from..from + 16]), load(&SCATTER[usize::from(m)]));
            let marked = _mm_cmpeq_epi16(_mm_and_si128(_mm_set1_epi16(i16::from(m)), bit), bit);
            let to = &mut group[16 * j..16 * j + 16];
            let kept = _mm_andnot_si128(marked, load(to));
            store(_mm_or_si128(_mm_and_si128(marked, spread), kept), to);
        }
        at + 2 * mask.count_ones() as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every mask over 64 bf16 units, whatever the room left: the same as
    /// one by one (the vector path where it applies).
    #[test]
    fn packed_values_are_the_marked_units_in_order() {
        let group: Vec<u8> = (0..128u32).map(|i| (i * 37 % 251) as u8).collect();
        let mut seed = 3u64;
        for round in 0..2000 {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let mask = match round {
                0 => 0,
                1 => u64::MAX,
                _ => seed & (seed >> 7) | (seed << 3 & seed >> 11),
            };
            let n = mask.count_ones() as usize * 2;
            for slack in [0usize, 16, 200] {
                let mut out = vec![0xeeu8; 5 + n + slack];
                let at = gather::<2>(mask, &group, &mut out, 5);
                let mut want = vec![0xeeu8; 5 + n + slack];
                gather_one_by_one::<2>(mask, &group, &mut want, 5);
                assert_eq!((at, &out[..5 + n]), (5 + n, &want[..5 + n]), "mask {mask:x}");
                let mut back = vec![0u8; 128];
                let mut values = out[..5 + n].to_vec();
                values.resize(5 + n + slack, 0x77);
                assert_eq!(scatter::<2>(mask, &values, 5, &mut back), 5 + n);
                for i in 0..64 {
                    let want = if mask >> i & 1 == 1 { &group[2 * i..2 * i + 2] } else { &[0, 0][..] };
                    assert_eq!(&back[2 * i..2 * i + 2], want, "mask {mask:x}, unit {i}");
                }
            }
        }
    }
}
