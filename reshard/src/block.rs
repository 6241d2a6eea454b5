//! Boxes of a tensor's index space ([`Block`]) and the arithmetic on them.

use std::fmt;

/// Most dimensions a tensor may have.
pub const MAX_DIMS: usize = 8;

/// An axis-aligned box of a tensor's global index space: `offset` and
/// `extent` per dimension. A 0-d block is the single element of a scalar.
///
/// Stored inline (no heap) so millions of them stay cheap.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(into = "BlockWire", try_from = "BlockWire")]
pub struct Block {
    ndim: u8,
    offset: [u64; MAX_DIMS],
    extent: [u64; MAX_DIMS],
}

/// A [`Block`] as it crosses a process boundary: offsets and extents as
/// lists, checked on the way in (at most [`MAX_DIMS`] dimensions, equal
/// lengths, no index past `u64::MAX`).
#[derive(serde::Serialize, serde::Deserialize)]
struct BlockWire {
    offset: Vec<u64>,
    extent: Vec<u64>,
}

impl From<Block> for BlockWire {
    fn from(b: Block) -> BlockWire {
        BlockWire { offset: b.offset().to_vec(), extent: b.extent().to_vec() }
    }
}

impl TryFrom<BlockWire> for Block {
    type Error = String;

    fn try_from(w: BlockWire) -> Result<Block, String> {
        if w.offset.len() != w.extent.len() || w.offset.len() > MAX_DIMS {
            return Err(format!("block with {} offsets and {} extents (at most {MAX_DIMS} each, equal)", w.offset.len(), w.extent.len()));
        }
        if w.offset.iter().zip(&w.extent).any(|(o, e)| o.checked_add(*e).is_none()) {
            return Err("block ends past the largest index".into());
        }
        Ok(Block::new(&w.offset, &w.extent))
    }
}

impl Block {
    /// A block from per-dimension offsets and extents (same length, at most
    /// [`MAX_DIMS`]; callers validate first).
    pub fn new(offset: &[u64], extent: &[u64]) -> Block {
        assert!(offset.len() == extent.len() && offset.len() <= MAX_DIMS);
        let mut b = Block { ndim: offset.len() as u8, offset: [0; MAX_DIMS], extent: [0; MAX_DIMS] };
        // A fixed number of words, not `copy_from_slice`: a call to
        // `memcpy` for a few words cost more than the copy where blocks
        // are made by the million (every rank's holdings at 4,096 ranks).
        for d in 0..MAX_DIMS {
            b.offset[d] = offset.get(d).copied().unwrap_or(0);
            b.extent[d] = extent.get(d).copied().unwrap_or(0);
        }
        b
    }

    /// A block of `ndim` dimensions from `ndim` offsets then `ndim` extents
    /// in one slice (as [`Pieces`](crate::program::Pieces) packs them).
    /// Copies a fixed number of words, so it costs no call to `memcpy` in
    /// the executor's per-piece loops.
    pub(crate) fn from_packed(ndim: usize, words: &[u64]) -> Block {
        assert!(ndim <= MAX_DIMS && words.len() == 2 * ndim);
        let (offset, extent) = words.split_at(ndim);
        Block::new(offset, extent)
    }

    /// The whole of a tensor of this shape.
    pub fn full(shape: &[u64]) -> Block {
        Block::new(&[0; MAX_DIMS][..shape.len().min(MAX_DIMS)], shape)
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.ndim as usize
    }

    /// Offsets per dimension.
    pub fn offset(&self) -> &[u64] {
        &self.offset[..self.ndim()]
    }

    /// Extents per dimension.
    pub fn extent(&self) -> &[u64] {
        &self.extent[..self.ndim()]
    }

    /// One past the last index in dimension `d`.
    pub fn end(&self, d: usize) -> u64 {
        self.offset[d] + self.extent[d]
    }

    /// Number of elements (1 for a scalar), saturating at `u64::MAX`: a
    /// box from a program or a peer whose extents multiply past `u64`
    /// counts as too large for any buffer, never as a small box (see
    /// [`Block::checked_numel`] to tell).
    pub fn numel(&self) -> u64 {
        self.extent().iter().fold(1u64, |n, &e| n.saturating_mul(e))
    }

    /// Number of elements, `None` where the extents multiply past `u64`.
    pub fn checked_numel(&self) -> Option<u64> {
        self.extent().iter().try_fold(1u64, |n, &e| n.checked_mul(e))
    }

    /// Whether the block holds no element.
    pub fn is_empty(&self) -> bool {
        self.extent().contains(&0)
    }

    /// The common part of two blocks of the same tensor, if not empty.
    pub fn intersect(&self, other: &Block) -> Option<Block> {
        debug_assert_eq!(self.ndim, other.ndim);
        let mut out = *self;
        for d in 0..self.ndim() {
            let lo = self.offset[d].max(other.offset[d]);
            let hi = self.end(d).min(other.end(d));
            if hi <= lo {
                return None;
            }
            out.offset[d] = lo;
            out.extent[d] = hi - lo;
        }
        Some(out)
    }

    /// Whether `other` lies entirely inside `self`.
    pub fn contains(&self, other: &Block) -> bool {
        (0..self.ndim()).all(|d| self.offset[d] <= other.offset[d] && other.end(d) <= self.end(d))
    }

    /// The parts of `self` outside `other`, as at most `2 * ndim` disjoint
    /// blocks.
    pub fn subtract(&self, other: &Block) -> Vec<Block> {
        let Some(inter) = self.intersect(other) else {
            return vec![*self];
        };
        let mut out = Vec::new();
        let mut cur = *self;
        for d in 0..self.ndim() {
            if cur.offset[d] < inter.offset[d] {
                let mut b = cur;
                b.extent[d] = inter.offset[d] - cur.offset[d];
                out.push(b);
            }
            if cur.end(d) > inter.end(d) {
                let mut b = cur;
                b.offset[d] = inter.end(d);
                b.extent[d] = cur.end(d) - inter.end(d);
                out.push(b);
            }
            cur.offset[d] = inter.offset[d];
            cur.extent[d] = inter.extent[d];
        }
        out
    }

    /// Row-major flat index (in a tensor of `shape`) of this block's first
    /// element.
    #[allow(clippy::needless_range_loop)] // parallel arrays indexed by dim
    pub fn flat_start(&self, shape: &[u64]) -> u64 {
        let mut idx = 0;
        for d in 0..self.ndim() {
            idx = idx * shape[d] + self.offset[d];
        }
        idx
    }

    /// Splits the block into consecutive row-major chunks of at most
    /// `max_elems` elements each (at least one element per chunk).
    pub fn split_to_fit(&self, max_elems: u64) -> Vec<Block> {
        let max_elems = max_elems.max(1);
        if self.numel() <= max_elems {
            return vec![*self];
        }
        // Outermost dim d whose trailing product fits; chunk along d.
        let nd = self.ndim();
        let mut inner = 1u64;
        let mut d = nd;
        while d > 0 && inner.saturating_mul(self.extent[d - 1]) <= max_elems {
            inner *= self.extent[d - 1];
            d -= 1;
        }
        // Here extent[d-1] * inner > max_elems and inner <= max_elems.
        let dim = d - 1;
        let per = (max_elems / inner).max(1);
        let mut out = Vec::new();
        let mut row = 0;
        let ext = self.extent[dim];
        // Iterate over all index combinations of dims before `dim`.
        let outer: Vec<u64> = self.extent[..dim].to_vec();
        let mut idx = vec![0u64; dim];
        loop {
            while row < ext {
                let n = per.min(ext - row);
                let mut b = *self;
                for (k, &i) in idx.iter().enumerate() {
                    b.offset[k] = self.offset[k] + i;
                    b.extent[k] = 1;
                }
                b.offset[dim] = self.offset[dim] + row;
                b.extent[dim] = n;
                out.push(b);
                row += n;
            }
            row = 0;
            // odometer over the outer dims
            let mut k = dim;
            loop {
                if k == 0 {
                    return out;
                }
                k -= 1;
                idx[k] += 1;
                if idx[k] < outer[k] {
                    break;
                }
                idx[k] = 0;
            }
        }
    }
}

impl fmt::Debug for Block {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Block {
    /// `[0:4, 8:16]` style, ends exclusive.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for d in 0..self.ndim() {
            if d > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}:{}", self.offset[d], self.end(d))?;
        }
        f.write_str("]")
    }
}

/// Decomposes the flat row-major range `[start, start + len)` of a tensor of
/// `shape` into blocks, in order. Each block is contiguous in the flat order
/// and its own row-major order equals the flat order, so a flat shard stored
/// contiguously is the same as these blocks stored back to back.
/// Requires `start + len <= numel(shape)`.
pub(crate) fn flat_blocks(shape: &[u64], start: u64, len: u64) -> Vec<Block> {
    let mut out = Vec::new();
    if len > 0 {
        let mut prefix = Vec::with_capacity(shape.len());
        flat_rec(shape, 0, start, start + len, &mut prefix, &mut out);
    }
    out
}

fn flat_rec(shape: &[u64], dim: usize, s: u64, e: u64, prefix: &mut Vec<u64>, out: &mut Vec<Block>) {
    let nd = shape.len();
    if s >= e {
        return;
    }
    let make = |prefix: &[u64], lo: u64, hi: u64| {
        let mut off = prefix.to_vec();
        let mut ext = vec![1; prefix.len()];
        if dim < nd {
            off.push(lo);
            ext.push(hi - lo);
            off.extend(std::iter::repeat_n(0, nd - dim - 1));
            ext.extend_from_slice(&shape[dim + 1..]);
        }
        Block::new(&off, &ext)
    };
    if dim == nd {
        out.push(make(prefix, 0, 0));
        return;
    }
    let inner: u64 = shape[dim + 1..].iter().product();
    if inner == 0 {
        return;
    }
    let (rs, re) = (s / inner, e / inner);
    if rs == re {
        prefix.push(rs);
        flat_rec(shape, dim + 1, s - rs * inner, e - rs * inner, prefix, out);
        prefix.pop();
        return;
    }
    let mut row = rs;
    if !s.is_multiple_of(inner) {
        prefix.push(rs);
        flat_rec(shape, dim + 1, s % inner, inner, prefix, out);
        prefix.pop();
        row += 1;
    }
    if re > row {
        out.push(make(prefix, row, re));
    }
    if !e.is_multiple_of(inner) {
        prefix.push(re);
        flat_rec(shape, dim + 1, 0, e % inner, prefix, out);
        prefix.pop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(off: &[u64], ext: &[u64]) -> Block {
        Block::new(off, ext)
    }

    #[test]
    fn element_counts_never_wrap() {
        // 3 * 0xAAAA_AAAA_AAAA_AAAB is 2^65 + 1: 1 if it wrapped.
        let huge = b(&[0, 0], &[3, 0xAAAA_AAAA_AAAA_AAAB]);
        assert_eq!(huge.checked_numel(), None);
        assert_eq!(huge.numel(), u64::MAX);
        assert_eq!(b(&[5, 6], &[3, 4]).checked_numel(), Some(12));
        assert_eq!(b(&[], &[]).checked_numel(), Some(1));
        assert_eq!(b(&[0, 0], &[0, u64::MAX]).numel(), 0);
    }

    #[test]
    fn intersect_and_contains() {
        let a = b(&[0, 0], &[4, 4]);
        let c = b(&[2, 3], &[4, 4]);
        assert_eq!(a.intersect(&c), Some(b(&[2, 3], &[2, 1])));
        assert_eq!(a.intersect(&b(&[4, 0], &[1, 1])), None);
        assert!(a.contains(&b(&[1, 1], &[3, 3])));
        assert!(!a.contains(&c));
    }

    #[test]
    fn subtract_covers_exactly() {
        let a = b(&[0, 0, 0], &[5, 6, 7]);
        let c = b(&[1, 2, 3], &[2, 10, 2]);
        let parts = a.subtract(&c);
        let inter = a.intersect(&c).unwrap();
        let total: u64 = parts.iter().map(Block::numel).sum();
        assert_eq!(total + inter.numel(), a.numel());
        for (i, p) in parts.iter().enumerate() {
            assert!(p.intersect(&c).is_none());
            for q in &parts[i + 1..] {
                assert!(p.intersect(q).is_none());
            }
        }
    }

    #[test]
    fn flat_blocks_are_in_order_and_exact() {
        let shape = [3u64, 4, 5];
        for start in 0..60 {
            for len in 0..=(60 - start) {
                let blocks = flat_blocks(&shape, start, len);
                let mut next = start;
                for blk in &blocks {
                    assert_eq!(blk.flat_start(&shape), next, "start={start} len={len}");
                    next += blk.numel();
                }
                assert_eq!(next, start + len);
            }
        }
        assert_eq!(flat_blocks(&[], 0, 1), vec![Block::new(&[], &[])]);
    }

    #[test]
    fn split_to_fit_partitions() {
        let a = b(&[1, 2, 3], &[3, 5, 7]);
        for max in [1, 2, 6, 7, 8, 20, 35, 36, 104, 105, 1000] {
            let parts = a.split_to_fit(max);
            let total: u64 = parts.iter().map(Block::numel).sum();
            assert_eq!(total, a.numel());
            for (i, p) in parts.iter().enumerate() {
                assert!(p.numel() <= max.max(1));
                assert!(a.contains(p));
                for q in &parts[i + 1..] {
                    assert!(p.intersect(q).is_none());
                }
            }
        }
    }
}
