//! The positions of a message's changed units as Rice-coded gaps: each
//! gap (units unchanged since the last changed one) as its quotient by
//! 2^k in unary (that many one bits, then a zero) and its k low bits,
//! least significant bit first. For positions spread like independent
//! draws (geometric gaps) this comes within a few percent of their
//! entropy, where a bitmap spends a bit per unit and an index list 32 bits
//! per change.

/// The Rice parameter for `changed` gaps summing to `gap_sum`: the `k`
/// with the fewest bits at most ([`most_bits`]).
pub(super) fn parameter(changed: u64, gap_sum: u64) -> u32 {
    (0..64).min_by_key(|&k| most_bits(changed, gap_sum, k)).unwrap_or(0)
}

/// The most bits `changed` gaps summing to `gap_sum` take with parameter
/// `k`: their quotients sum to at most `gap_sum >> k`, and each gap adds
/// its zero and its `k` low bits.
pub(super) fn most_bits(changed: u64, gap_sum: u64, k: u32) -> u64 {
    (gap_sum >> k).saturating_add(changed.saturating_mul(1 + u64::from(k)))
}

/// Writes gaps into a byte buffer, least significant bit first.
pub(super) struct GapWriter<'a> {
    out: &'a mut Vec<u8>,
    k: u32,
    acc: u64,
    bits: u32,
}

impl<'a> GapWriter<'a> {
    /// Gaps with parameter `k` (below 64), appended to `out`.
    pub(super) fn new(out: &'a mut Vec<u8>, k: u32) -> GapWriter<'a> {
        GapWriter { out, k, acc: 0, bits: 0 }
    }

    /// Appends the `n` (at most 32) low bits of `value`.
    fn put(&mut self, value: u64, n: u32) {
        debug_assert!(n <= 32 && value >> n == 0);
        self.acc |= value << self.bits;
        self.bits += n;
        if self.bits >= 32 {
            self.out.extend_from_slice(&(self.acc as u32).to_le_bytes());
            self.acc >>= 32;
            self.bits -= 32;
        }
    }

    /// Appends one gap.
    pub(super) fn gap(&mut self, gap: u64) {
        let mut q = gap >> self.k;
        while q >= 31 {
            self.put((1 << 31) - 1, 31);
            q -= 31;
        }
        // `q` ones, then a zero.
        self.put((1 << q) - 1, q as u32 + 1);
        let low = gap & ((1u64 << self.k) - 1);
        if self.k > 32 {
            self.put(low & 0xffff_ffff, 32);
            self.put(low >> 32, self.k - 32);
        } else {
            self.put(low, self.k);
        }
    }

    /// Flushes the last bits (zeros pad the last byte).
    pub(super) fn finish(self) {
        let bytes = self.bits.div_ceil(8) as usize;
        self.out.extend_from_slice(&self.acc.to_le_bytes()[..bytes]);
    }
}

/// Reads gaps a [`GapWriter`] wrote, refusing a stream that ends early or
/// holds a gap of more than `most` units.
pub(super) struct GapReader<'a> {
    data: &'a [u8],
    k: u32,
    most: u64,
    acc: u64,
    bits: u32,
}

impl<'a> GapReader<'a> {
    /// Gaps with parameter `k` (below 64) in `data`, none above `most`.
    pub(super) fn new(data: &'a [u8], k: u32, most: u64) -> GapReader<'a> {
        GapReader { data, k, most, acc: 0, bits: 0 }
    }

    /// Loads bytes until more than 56 bits are held or the data ends.
    fn refill(&mut self) {
        while self.bits <= 56 {
            let Some((&b, rest)) = self.data.split_first() else { return };
            self.acc |= u64::from(b) << self.bits;
            self.bits += 8;
            self.data = rest;
        }
    }

    /// Drops `n` (at most the bits held) bits.
    fn consume(&mut self, n: u32) {
        self.acc = if n >= 64 { 0 } else { self.acc >> n };
        self.bits -= n;
    }

    /// The next gap; `None` if the stream ends first or the gap is more
    /// than `most`.
    pub(super) fn gap(&mut self) -> Option<u64> {
        let mut q = 0u64;
        loop {
            self.refill();
            if self.bits == 0 {
                return None;
            }
            let ones = self.acc.trailing_ones().min(self.bits);
            q += u64::from(ones);
            if q > self.most >> self.k {
                return None;
            }
            if ones < self.bits {
                self.consume(ones + 1);
                break;
            }
            self.consume(ones);
        }
        let mut low = 0u64;
        let mut got = 0;
        while got < self.k {
            self.refill();
            let n = (self.k - got).min(32).min(self.bits);
            if n == 0 {
                return None;
            }
            low |= (self.acc & ((1u64 << n) - 1)) << got;
            self.consume(n);
            got += n;
        }
        let gap = (q << self.k) | low;
        (gap <= self.most).then_some(gap)
    }

    /// Whether every byte was read and the bits left are the last byte's
    /// zero padding.
    pub(super) fn at_end(&self) -> bool {
        self.data.is_empty() && self.bits < 8 && self.acc == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_round_trip_for_every_parameter() {
        for k in [0u32, 1, 2, 5, 13, 31, 32, 33, 40, 63] {
            // (A gap of 2^33 in unary would be a gigabyte: only where k
            // makes it short.)
            let huge = if k >= 24 { (1u64 << 33) + 5 } else { 99 };
            let gaps: Vec<u64> = [0u64, 1, 2, 3, 7, 8, 31, 32, 33, 1000, 1 << 20, huge, 0, 0, 12345].to_vec();
            let mut out = Vec::new();
            let mut w = GapWriter::new(&mut out, k);
            gaps.iter().for_each(|&g| w.gap(g));
            w.finish();
            let sum: u64 = gaps.iter().sum();
            assert!(out.len() as u64 * 8 <= most_bits(gaps.len() as u64, sum, k) + 7, "k {k}: {} bytes", out.len());
            let mut r = GapReader::new(&out, k, u64::MAX >> 1);
            let back: Vec<u64> = (0..gaps.len()).map(|_| r.gap().expect("a gap")).collect();
            assert_eq!(back, gaps, "k {k}");
            assert!(r.at_end(), "k {k}");
            // Cut short: refused, never a wrong gap.
            let mut short = GapReader::new(&out[..out.len() - 1], k, u64::MAX >> 1);
            let read: Vec<Option<u64>> = (0..gaps.len()).map(|_| short.gap()).collect();
            assert!(read.iter().any(Option::is_none) || !short.at_end(), "k {k}: a cut stream read whole");
        }
    }

    #[test]
    fn a_gap_past_the_limit_is_refused_without_reading_on() {
        let mut out = Vec::new();
        let mut w = GapWriter::new(&mut out, 2);
        w.gap(1 << 20);
        w.finish();
        assert_eq!(GapReader::new(&out, 2, 1000).gap(), None);
        // All ones: a quotient past the limit stops at the limit.
        let ones = vec![0xffu8; 1 << 16];
        assert_eq!(GapReader::new(&ones, 0, 100).gap(), None);
    }

    #[test]
    fn the_parameter_follows_the_mean_gap() {
        // Mean gap 1: k 0; mean gap ~ 1000: k near log2(1000 ln 2) ~ 9.
        assert_eq!(parameter(1000, 1000), 0);
        let k = parameter(1000, 1_000_000);
        assert!((8..=10).contains(&k), "{k}");
        assert_eq!(parameter(0, 0), 0);
    }
}
