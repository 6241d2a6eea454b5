//! The bit stream of the blocks form: fixed-width fields, Rice-coded gaps
//! and byte-aligned raw bytes, least significant bit first.
//!
//! A gap (units unchanged before a changed one) with parameter `k` is its
//! quotient by 2^k in unary (that many one bits, then a zero) and its `k`
//! low bits. The encoder picks `k` per block from the block's count of
//! changes (`k_for`), near the best parameter for gaps spread like
//! independent draws, so the stream comes within a few percent of the
//! entropy of the positions.

/// The largest Rice parameter (gaps inside a block are under 2^13).
pub(super) const MAX_K: u32 = 12;

/// The Rice parameter for `count` changes among `units` units: the floor
/// of log2 of `ln 2` times their mean gap (0 where they are dense).
pub(super) fn k_for(count: u32, units: u32) -> u32 {
    if count == 0 {
        return 0;
    }
    // ln 2 ~ 11/16.
    let target = u64::from(units - count.min(units)) * 11 / 16 / u64::from(count);
    (63 - target.max(1).leading_zeros()).min(MAX_K)
}

/// Writes a bit stream into a byte buffer.
pub(super) struct BitWriter<'a> {
    out: &'a mut [u8],
    /// Whole bytes written.
    at: usize,
    acc: u64,
    /// Bits held in `acc` (under 8 between writes).
    bits: u32,
    /// A write found the buffer full.
    overflow: bool,
}

impl<'a> BitWriter<'a> {
    pub(super) fn new(out: &'a mut [u8]) -> BitWriter<'a> {
        BitWriter { out, at: 0, acc: 0, bits: 0, overflow: false }
    }

    /// Whether a write found the buffer full.
    pub(super) fn overflowed(&self) -> bool {
        self.overflow
    }

    /// Bits written so far.
    #[cfg(test)]
    pub(super) fn position(&self) -> u64 {
        self.at as u64 * 8 + u64::from(self.bits)
    }

    /// Writes the `n` (at most 32) low bits of `value`: the bits held
    /// stay under 8 after each write, whose whole bytes are stored eight
    /// at a time where eight fit (no branch on how many).
    #[inline(always)]
    pub(super) fn put(&mut self, value: u64, n: u32) {
        debug_assert!(n <= 32 && value >> n == 0);
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

    /// Writes one gap with parameter `k` (at most [`MAX_K`]).
    #[inline(always)]
    pub(super) fn gap(&mut self, gap: u64, k: u32) {
        let mut q = gap >> k;
        while q >= 20 && !self.overflow {
            self.put((1 << 20) - 1, 20);
            q -= 20;
        }
        // `q` ones, a zero, the low bits: at most 19 + 1 + 12 bits.
        let low = gap & ((1u64 << k) - 1);
        self.put(((1u64 << q) - 1) | low << (q + 1), q as u32 + 1 + k);
    }

    /// Pads with zeros to a whole byte.
    pub(super) fn align(&mut self) {
        if self.bits > 0 {
            self.put(0, 8 - self.bits);
        }
    }

    /// Writes `bytes` as they are (after [`BitWriter::align`]).
    pub(super) fn bytes(&mut self, bytes: &[u8]) {
        debug_assert_eq!(self.bits, 0);
        match self.out.get_mut(self.at..self.at + bytes.len()) {
            Some(to) => {
                to.copy_from_slice(bytes);
                self.at += bytes.len();
            }
            None => self.overflow = true,
        }
    }

    /// Writes the last bits (zeros pad the last byte): the bytes written,
    /// or `None` if they did not fit.
    pub(super) fn finish(mut self) -> Option<usize> {
        self.align();
        (!self.overflow).then_some(self.at)
    }
}

/// Reads what a [`BitWriter`] wrote; every read refuses (`None`) a stream
/// that ends first.
pub(super) struct BitReader<'a> {
    data: &'a [u8],
    /// The next byte of `data` to load.
    pos: usize,
    acc: u64,
    /// Bits held in `acc` (the last `bits / 8` whole bytes before `pos`,
    /// and part of the one before them).
    bits: u32,
}

impl<'a> BitReader<'a> {
    pub(super) fn new(data: &'a [u8]) -> BitReader<'a> {
        BitReader { data, pos: 0, acc: 0, bits: 0 }
    }

    /// Loads bytes until more than 56 bits are held or the data ends:
    /// eight at a time while eight remain.
    #[inline(always)]
    fn refill(&mut self) {
        if self.bits > 56 {
            return;
        }
        if let Some(word) = self.data.get(self.pos..).and_then(|d| d.first_chunk::<8>()) {
            // Whole bytes that fit above the bits held.
            let take = (64 - self.bits) / 8;
            let loaded = u64::from_le_bytes(*word) & (u64::MAX >> (64 - 8 * take));
            self.acc |= loaded << self.bits;
            self.bits += 8 * take;
            self.pos += take as usize;
            return;
        }
        while self.bits <= 56 {
            let Some(&b) = self.data.get(self.pos) else { return };
            self.acc |= u64::from(b) << self.bits;
            self.bits += 8;
            self.pos += 1;
        }
    }

    /// Drops `n` (at most the bits held) bits.
    #[inline(always)]
    fn consume(&mut self, n: u32) {
        self.acc = if n >= 64 { 0 } else { self.acc >> n };
        self.bits -= n;
    }

    /// The next `n` (at most 32) bits as a number.
    #[inline(always)]
    pub(super) fn get(&mut self, n: u32) -> Option<u64> {
        debug_assert!(n <= 32);
        self.refill();
        if self.bits < n {
            return None;
        }
        let v = self.acc & ((1u64 << n) - 1);
        self.consume(n);
        Some(v)
    }

    /// The next gap with parameter `k` (at most [`MAX_K`]); `None` if the
    /// stream ends first or the gap is more than `most`.
    #[inline(always)]
    pub(super) fn gap(&mut self, k: u32, most: u64) -> Option<u64> {
        self.refill();
        // The usual case: the unary part and the low bits are all held.
        let ones = self.acc.trailing_ones();
        if ones < self.bits && ones + 1 + k <= self.bits {
            let low = (self.acc >> (ones + 1)) & ((1u64 << k) - 1);
            self.consume(ones + 1 + k);
            let gap = (u64::from(ones) << k) | low;
            return (gap <= most).then_some(gap);
        }
        let mut q = 0u64;
        loop {
            self.refill();
            if self.bits == 0 {
                return None;
            }
            let ones = self.acc.trailing_ones().min(self.bits);
            q += u64::from(ones);
            if q > most >> k {
                return None;
            }
            if ones < self.bits {
                self.consume(ones + 1);
                break;
            }
            self.consume(ones);
        }
        let gap = (q << k) | self.get(k)?;
        (gap <= most).then_some(gap)
    }

    /// Drops the bits up to a whole byte; `None` if they are not zeros.
    pub(super) fn align(&mut self) -> Option<()> {
        let n = self.bits % 8;
        let pad = self.acc & ((1u64 << n) - 1);
        self.consume(n);
        (pad == 0).then_some(())
    }

    /// The next `n` bytes as they are (after [`BitReader::align`]).
    pub(super) fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        debug_assert_eq!(self.bits % 8, 0);
        // The whole bytes held are the last ones loaded.
        let start = self.pos - (self.bits / 8) as usize;
        let out = self.data.get(start..start.checked_add(n)?)?;
        (self.pos, self.acc, self.bits) = (start + n, 0, 0);
        Some(out)
    }

    /// Whether every byte was read and the bits left are the last byte's
    /// zero padding.
    pub(super) fn at_end(&self) -> bool {
        self.pos == self.data.len() && self.bits < 8 && self.acc == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_gaps_and_bytes_round_trip() {
        let mut out = vec![0u8; 1 << 16];
        let mut w = BitWriter::new(&mut out);
        let gaps = [0u64, 1, 2, 3, 7, 8, 31, 32, 33, 1000, 4095, 0, 12];
        for k in 0..=MAX_K {
            w.put(u64::from(k), 4);
            gaps.iter().for_each(|&g| w.gap(g, k));
        }
        w.put(0b101, 3);
        w.align();
        w.bytes(&[9, 8, 7]);
        w.put(1, 1);
        w.put(0x1fff, 13);
        let written = w.finish().expect("fits");
        let mut r = BitReader::new(&out[..written]);
        for k in 0..=MAX_K {
            assert_eq!(r.get(4), Some(u64::from(k)));
            for &g in &gaps {
                assert_eq!(r.gap(k, 4095), Some(g), "k {k}");
            }
        }
        assert_eq!(r.get(3), Some(0b101));
        assert_eq!(r.align(), Some(()));
        assert_eq!(r.bytes(3), Some(&[9u8, 8, 7][..]));
        assert_eq!((r.get(1), r.get(13)), (Some(1), Some(0x1fff)));
        assert_eq!(r.align(), Some(()));
        assert!(r.at_end());
        assert_eq!(r.get(1), None);
    }

    #[test]
    fn a_stream_past_its_buffer_is_refused() {
        let mut out = vec![0u8; 5];
        let mut w = BitWriter::new(&mut out);
        (0..41).for_each(|_| w.gap(0, 0));
        assert_eq!(w.finish(), None, "41 bits in 40");
        let mut out = vec![0u8; 5];
        let mut w = BitWriter::new(&mut out);
        (0..40).for_each(|_| w.gap(0, 0));
        assert_eq!(w.finish(), Some(5), "40 bits in 40");
        let mut out = vec![0u8; 5];
        let mut w = BitWriter::new(&mut out);
        w.bytes(&[1; 6]);
        assert!(w.overflowed());
    }

    #[test]
    fn a_gap_past_the_limit_or_the_stream_is_refused() {
        let mut out = vec![0u8; 1 << 10];
        let mut w = BitWriter::new(&mut out);
        w.gap(3000, 2);
        let written = w.finish().expect("fits");
        assert_eq!(BitReader::new(&out[..written]).gap(2, 1000), None);
        // All ones: a quotient past the limit stops at the limit.
        let ones = vec![0xffu8; 1 << 12];
        assert_eq!(BitReader::new(&ones).gap(0, 100), None);
        // Cut short.
        assert_eq!(BitReader::new(&out[..2]).gap(2, 4095), None);
        assert_eq!(BitReader::new(&[0xff]).bytes(2), None);
        // Padding that is not zeros.
        let mut r = BitReader::new(&[0b10]);
        assert_eq!(r.get(1), Some(0));
        assert_eq!(r.align(), None);
    }

    #[test]
    fn the_parameter_follows_the_density() {
        assert_eq!(k_for(4096, 4096), 0);
        assert_eq!(k_for(2048, 4096), 0);
        // One change in 1000: k near log2(1000 ln 2) ~ 9.4.
        assert_eq!(k_for(4, 4096), 9);
        assert_eq!(k_for(1, 4096), MAX_K.min(11));
        assert_eq!(k_for(0, 4096), 0);
    }

    #[test]
    fn gaps_of_spread_changes_are_near_their_entropy() {
        // Independent changes with probability p, coded as the blocks form
        // codes them: per block of 4096 units, k from the block's count.
        // (Denser than about 1 in 4, the blocks form takes a bitmap.)
        for p in [0.001f64, 0.03, 0.1] {
            let mut state = 0x9e37_79b9_7f4a_7c15u64;
            let (n, block) = (1u32 << 22, 4096u32);
            let mut out = vec![0u8; 1 << 22];
            let mut w = BitWriter::new(&mut out);
            for _ in 0..n / block {
                let mut gaps = Vec::new();
                let mut gap = 0u64;
                for _ in 0..block {
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
                let k = k_for(gaps.len() as u32, block);
                gaps.iter().for_each(|&g| w.gap(g, k));
            }
            let bits = w.position() as f64;
            let h = -(p * p.log2() + (1.0 - p) * (1.0 - p).log2());
            let ratio = bits / (f64::from(n) * h);
            assert!(ratio < 1.06, "p {p}: {ratio:.3} of the entropy");
        }
    }
}
