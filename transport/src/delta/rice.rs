//! The positions of a message's changed units as Rice-coded gaps: each
//! gap (units unchanged since the last changed one) as its quotient by
//! 2^k in unary (that many one bits, then a zero) and its k low bits,
//! least significant bit first. The parameter `k` adapts to the gaps seen
//! ([`Adapt`]: both ends run it alike), so it follows the density of
//! changes along the message: for positions spread like independent draws
//! (geometric gaps) the stream comes within a few percent of their
//! entropy, and clusters of changes cost less.

/// The Rice parameter as it adapts to the gaps seen: the smallest `k`
/// with `count · 2^k` at least `ln 2` times their `sum` (near the best
/// parameter for geometric gaps of that mean), over a window that halves
/// every 64 gaps so it follows the local density. `k` is worked out again
/// every [`EVERY`] gaps, not after each: each gap's coding then waits on
/// no arithmetic of the one before it.
#[derive(Clone, Copy, Debug)]
struct Adapt {
    sum: u64,
    count: u64,
    k: u32,
}

/// Gaps between two choices of the parameter.
const EVERY: u64 = 8;

impl Adapt {
    /// Starting as if one gap of `2^k0` had been seen.
    fn new(k0: u32) -> Adapt {
        let k0 = k0.min(MAX_K);
        Adapt { sum: 1u64 << k0, count: 1, k: k0 }
    }

    /// The parameter for the next gap.
    #[inline(always)]
    fn k(&self) -> u32 {
        self.k
    }

    #[inline(always)]
    fn seen(&mut self, gap: u64) {
        self.sum = self.sum.saturating_add(gap);
        self.count += 1;
        if self.count.is_multiple_of(EVERY) {
            if self.count >= 64 {
                self.sum /= 2;
                self.count /= 2;
            }
            // ln 2 ~ 11/16; k as the difference of bit lengths (within one
            // of log2 of the ratio, with no division).
            let target = self.sum - self.sum / 4 - self.sum / 16;
            let bits = |x: u64| 64 - x.leading_zeros();
            self.k = bits(target).saturating_sub(bits(self.count)).min(MAX_K);
        }
    }
}

/// The largest parameter (low bits of a gap).
const MAX_K: u32 = 62;

/// The starting parameter where nothing is known of the gaps.
pub(super) const START_K: u32 = 4;

/// Writes gaps into a byte buffer, least significant bit first.
pub(super) struct GapWriter<'a> {
    out: &'a mut [u8],
    /// Bytes written.
    at: usize,
    adapt: Adapt,
    acc: u64,
    bits: u32,
    /// A write found the buffer full.
    overflow: bool,
}

impl<'a> GapWriter<'a> {
    /// Gaps with starting parameter `k0`, written into `out` from its
    /// start.
    pub(super) fn new(out: &'a mut [u8], k0: u32) -> GapWriter<'a> {
        GapWriter { out, at: 0, adapt: Adapt::new(k0), acc: 0, bits: 0, overflow: false }
    }

    /// Whether a write found the buffer full.
    pub(super) fn overflowed(&self) -> bool {
        self.overflow
    }

    /// Writes the `n` (at most 32) low bits of `value`: the bits held
    /// stay under 8 after each write, whose whole bytes are stored eight
    /// at a time where eight fit (no branch on how many).
    #[inline(always)]
    fn put(&mut self, value: u64, n: u32) {
        debug_assert!(n <= 32 && value >> n == 0);
        // Fewer than 8 bits held before: at most 39 after.
        self.acc |= value << self.bits;
        self.bits += n;
        let bytes = (self.bits / 8) as usize;
        match self.out.get_mut(self.at..self.at + 8) {
            Some(to) => to.copy_from_slice(&self.acc.to_le_bytes()),
            None => match self.out.get_mut(self.at..self.at + bytes) {
                Some(to) => to.copy_from_slice(&self.acc.to_le_bytes()[..bytes]),
                None => self.overflow = true,
            },
        }
        self.at += bytes;
        // (`bytes` is at most 4: the shift stays under 64.)
        self.acc >>= 8 * bytes as u32;
        self.bits %= 8;
    }

    /// Writes one gap.
    #[inline(always)]
    pub(super) fn gap(&mut self, gap: u64) {
        let k = self.adapt.k();
        self.adapt.seen(gap);
        let mut q = gap >> k;
        while q >= 31 && !self.overflow {
            self.put((1 << 31) - 1, 31);
            q -= 31;
        }
        // `q` ones, then a zero, then the low bits.
        let q = q.min(30) as u32;
        let low = gap & ((1u64 << k) - 1);
        if q + 1 + k <= 32 {
            self.put(((1 << q) - 1) | low << (q + 1), q + 1 + k);
        } else {
            self.put((1 << q) - 1, q + 1);
            if k > 32 {
                self.put(low & 0xffff_ffff, 32);
                self.put(low >> 32, k - 32);
            } else {
                self.put(low, k);
            }
        }
    }

    /// Writes the last bits (zeros pad the last byte): the bytes written,
    /// or `None` if they did not fit.
    pub(super) fn finish(mut self) -> Option<usize> {
        let bytes = self.bits.div_ceil(8) as usize;
        match self.out.get_mut(self.at..self.at + bytes) {
            Some(to) if !self.overflow => to.copy_from_slice(&self.acc.to_le_bytes()[..bytes]),
            _ => return None,
        }
        self.at += bytes;
        Some(self.at)
    }
}

/// Reads gaps a [`GapWriter`] wrote, refusing a stream that ends early or
/// holds a gap of more than `most` units.
pub(super) struct GapReader<'a> {
    data: &'a [u8],
    adapt: Adapt,
    most: u64,
    acc: u64,
    bits: u32,
}

impl<'a> GapReader<'a> {
    /// Gaps with starting parameter `k0` in `data`, none above `most`.
    pub(super) fn new(data: &'a [u8], k0: u32, most: u64) -> GapReader<'a> {
        GapReader { data, adapt: Adapt::new(k0), most, acc: 0, bits: 0 }
    }

    /// Loads bytes until more than 56 bits are held or the data ends:
    /// eight at a time while eight remain.
    #[inline(always)]
    fn refill(&mut self) {
        if self.bits > 56 {
            return;
        }
        if let Some((word, _)) = self.data.split_first_chunk::<8>() {
            // Whole bytes that fit above the bits held.
            let take = (64 - self.bits) / 8;
            let loaded = u64::from_le_bytes(*word) & (u64::MAX >> (64 - 8 * take));
            self.acc |= loaded << self.bits;
            self.bits += 8 * take;
            self.data = &self.data[take as usize..];
            return;
        }
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
    #[inline(always)]
    pub(super) fn gap(&mut self) -> Option<u64> {
        let k = self.adapt.k();
        self.refill();
        // The usual case: the unary part and the low bits are all held.
        let ones = self.acc.trailing_ones();
        if ones < self.bits && ones + 1 + k <= self.bits {
            let low = if k == 0 { 0 } else { (self.acc >> (ones + 1)) & (u64::MAX >> (64 - k)) };
            self.consume(ones + 1 + k);
            let gap = (u64::from(ones) << k) | low;
            self.adapt.seen(gap);
            return (gap <= self.most).then_some(gap);
        }
        self.gap_slowly(k)
    }

    /// [`GapReader::gap`] across refills: a unary part or low bits longer
    /// than the bits held, or the stream's end.
    fn gap_slowly(&mut self, k: u32) -> Option<u64> {
        let mut q = 0u64;
        loop {
            self.refill();
            if self.bits == 0 {
                return None;
            }
            let ones = self.acc.trailing_ones().min(self.bits);
            q += u64::from(ones);
            if q > self.most >> k {
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
        while got < k {
            self.refill();
            let n = (k - got).min(32).min(self.bits);
            if n == 0 {
                return None;
            }
            low |= (self.acc & ((1u64 << n) - 1)) << got;
            self.consume(n);
            got += n;
        }
        let gap = (q << k) | low;
        self.adapt.seen(gap);
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
            let mut out = vec![0u8; 1 << 20];
            let mut w = GapWriter::new(&mut out, k);
            gaps.iter().for_each(|&g| w.gap(g));
            let written = w.finish().expect("the stream fits");
            out.truncate(written);
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
    fn a_stream_past_its_buffer_is_refused() {
        // Gaps of 0 from parameter 0: a bit each.
        let mut out = vec![0u8; 5];
        let mut w = GapWriter::new(&mut out, 0);
        (0..41).for_each(|_| w.gap(0));
        assert_eq!(w.finish(), None, "41 bits in 40");
        let mut out = vec![0u8; 5];
        let mut w = GapWriter::new(&mut out, 0);
        (0..40).for_each(|_| w.gap(0));
        assert_eq!(w.finish(), Some(5), "40 bits in 40");
    }

    #[test]
    fn a_gap_past_the_limit_is_refused_without_reading_on() {
        let mut out = vec![0u8; 1 << 20];
        let mut w = GapWriter::new(&mut out, 2);
        w.gap(1 << 20);
        let written = w.finish().expect("the stream fits");
        out.truncate(written);
        assert_eq!(GapReader::new(&out, 2, 1000).gap(), None);
        // All ones: a quotient past the limit stops at the limit.
        let ones = vec![0xffu8; 1 << 16];
        assert_eq!(GapReader::new(&ones, 0, 100).gap(), None);
    }

    #[test]
    fn the_parameter_follows_the_mean_gap() {
        let settle = |gap: u64| {
            let mut a = Adapt::new(START_K);
            (0..200).for_each(|_| a.seen(gap));
            a.k()
        };
        // Mean gap 1: k 0; mean gap 1000: k near log2(1000 ln 2) ~ 9.4.
        assert_eq!(settle(0), 0);
        assert!(settle(1) <= 1, "{}", settle(1));
        assert!((9..=10).contains(&settle(1000)), "{}", settle(1000));
        assert!(settle(u64::MAX) > 50, "{}", settle(u64::MAX));
    }

    #[test]
    fn the_stream_of_spread_changes_is_near_their_entropy() {
        // Independent changes with probability p: the positions' entropy
        // is n·H(p) bits.
        for (p, n) in [(0.001f64, 4_000_000u64), (0.03, 1_000_000), (0.3, 200_000)] {
            let mut state = 0x9e37_79b9_7f4a_7c15u64;
            let mut gaps = Vec::new();
            let mut gap = 0u64;
            for _ in 0..n {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                if ((state >> 11) as f64 / (1u64 << 53) as f64) < p {
                    gaps.push(gap);
                    gap = 0;
                } else {
                    gap += 1;
                }
            }
            let mut out = vec![0u8; n as usize];
            let mut w = GapWriter::new(&mut out, START_K);
            gaps.iter().for_each(|&g| w.gap(g));
            let bytes = w.finish().expect("fits");
            let h = -(p * p.log2() + (1.0 - p) * (1.0 - p).log2());
            let ratio = bytes as f64 * 8.0 / (n as f64 * h);
            assert!(ratio < 1.08, "p {p}: {ratio:.3} of the entropy");
            let mut r = GapReader::new(&out[..bytes], START_K, n);
            assert!(gaps.iter().all(|&g| r.gap() == Some(g)) && r.at_end(), "p {p}");
        }
    }
}
