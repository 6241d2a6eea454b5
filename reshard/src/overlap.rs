//! Overlap computation for one tensor: split the destination needs into
//! disjoint atoms, and cover each atom with source holdings.
//!
//! Works on distinct blocks ([`Holding`]s), never on all rank pairs, so a
//! tensor replicated on hundreds of ranks costs as much as one held once.

use crate::block::Block;
use crate::layout::{Holding, Rank};

/// A disjoint part of the destination needs and the holdings that need it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Atom {
    /// The elements.
    pub block: Block,
    /// Indices of the destination holdings containing it.
    pub holdings: Vec<u32>,
}

/// Splits the union of `holdings` into disjoint atoms; each atom records
/// which holdings contain it. Atoms follow the holdings' order.
pub(crate) fn atomize(holdings: &[Holding]) -> Vec<Atom> {
    if pairwise_disjoint(holdings) {
        return holdings.iter().enumerate().map(|(i, h)| Atom { block: h.block, holdings: vec![i as u32] }).collect();
    }
    let mut atoms: Vec<Atom> = Vec::new();
    for (hi, h) in holdings.iter().enumerate() {
        let mut rest = vec![h.block];
        let existing = atoms.len();
        for ai in 0..existing {
            let Some(inter) = atoms[ai].block.intersect(&h.block) else { continue };
            let outside = atoms[ai].block.subtract(&h.block);
            let owners = atoms[ai].holdings.clone();
            atoms[ai].block = inter;
            atoms[ai].holdings.push(hi as u32);
            atoms.extend(outside.into_iter().map(|b| Atom { block: b, holdings: owners.clone() }));
            rest = rest.into_iter().flat_map(|r| r.subtract(&inter)).collect();
        }
        atoms.extend(rest.into_iter().map(|b| Atom { block: b, holdings: vec![hi as u32] }));
    }
    atoms
}

/// Whether no two holdings overlap (a sweep over the dimension along
/// which their offsets differ most, so blocks cut along any one dimension
/// are compared with their neighbours only).
fn pairwise_disjoint(holdings: &[Holding]) -> bool {
    if holdings.len() < 2 {
        return true;
    }
    if holdings[0].block.ndim() == 0 {
        return false;
    }
    let mut order: Vec<usize> = (0..holdings.len()).collect();
    let distinct = |d: usize, order: &mut Vec<usize>| {
        order.sort_unstable_by_key(|&i| holdings[i].block.offset()[d]);
        1 + order.windows(2).filter(|w| holdings[w[0]].block.offset()[d] != holdings[w[1]].block.offset()[d]).count()
    };
    let ndim = holdings[0].block.ndim();
    let d = (0..ndim).max_by_key(|&d| (distinct(d, &mut order), std::cmp::Reverse(d))).unwrap_or(0);
    order.sort_unstable_by_key(|&i| holdings[i].block.offset()[d]);
    for (k, &i) in order.iter().enumerate() {
        let bi = &holdings[i].block;
        for &j in &order[k + 1..] {
            let bj = &holdings[j].block;
            if bj.offset()[d] >= bi.end(d) {
                break;
            }
            if bi.intersect(bj).is_some() {
                return false;
            }
        }
    }
    true
}

/// Index over source holdings for fast overlap queries.
pub(crate) struct SourceIndex<'a> {
    holdings: &'a [Holding],
    order: Vec<u32>,
    max_ext0: u64,
}

/// A covered part of an atom and the source ranks able to send it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Cover {
    /// The elements.
    pub block: Block,
    /// Source ranks holding all of it, sorted, deduplicated.
    pub candidates: Vec<Rank>,
}

impl<'a> SourceIndex<'a> {
    /// Indexes `holdings` by their offset in dimension 0.
    pub(crate) fn new(holdings: &'a [Holding]) -> SourceIndex<'a> {
        let mut order: Vec<u32> = (0..holdings.len() as u32).collect();
        let key = |i: &u32| holdings[*i as usize].block.offset().first().copied().unwrap_or(0);
        order.sort_by_key(key);
        let max_ext0 = holdings.iter().map(|h| h.block.extent().first().copied().unwrap_or(1)).max().unwrap_or(0);
        SourceIndex { holdings, order, max_ext0 }
    }

    /// How many holdings [`cover_split`](Self::cover_split) compares with
    /// `b`, at most (those whose span of dimension 0 may meet it): found
    /// by two binary searches, before any is compared.
    pub(crate) fn window(&self, b: &Block) -> usize {
        let (start, end) = self.window_range(b);
        end.max(start) - start
    }

    fn window_range(&self, b: &Block) -> (usize, usize) {
        if b.ndim() == 0 {
            return (0, self.order.len());
        }
        let off0 = |i: &u32| self.holdings[*i as usize].block.offset()[0];
        let (lo, hi) = (b.offset()[0], b.end(0));
        let start = self.order.partition_point(|i| off0(i).saturating_add(self.max_ext0) <= lo);
        let end = self.order.partition_point(|i| off0(i) < hi);
        (start, end)
    }

    /// Holdings overlapping `b`, in index order.
    pub(crate) fn overlapping(&self, b: &Block) -> Vec<u32> {
        if b.ndim() == 0 {
            return self.order.clone();
        }
        let (start, end) = self.window_range(b);
        self.order[start..end.max(start)].iter().copied().filter(|&i| self.holdings[i as usize].block.intersect(b).is_some()).collect()
    }

    /// Covers `atom` with source holdings. Returns the covered parts and,
    /// if some part is held by no source, that part.
    pub(crate) fn cover(&self, atom: &Block) -> Result<Vec<Cover>, Box<Block>> {
        self.cover_split(atom, u64::MAX)
    }

    /// [`cover`](Self::cover), where a part that holdings overlap only in
    /// part (cut differently: a rank holds the whole part, others halves of
    /// it) is cut along those holdings' edges into cells, each with every
    /// rank holding it as a candidate, so that ranks holding only part of
    /// the part can send their share. Only where every cell has at least
    /// `min_cell` elements and there are at most [`MAX_CELLS`] of them.
    pub(crate) fn cover_split(&self, atom: &Block, min_cell: u64) -> Result<Vec<Cover>, Box<Block>> {
        self.cover_split_among(atom, &self.overlapping(atom), min_cell)
    }

    /// [`cover_split`](Self::cover_split) with the holdings overlapping
    /// `atom` found already ([`overlapping`](Self::overlapping)): it
    /// compares each cover with each of them.
    pub(crate) fn cover_split_among(&self, atom: &Block, over: &[u32], min_cell: u64) -> Result<Vec<Cover>, Box<Block>> {
        let candidates_of = |piece: &Block| {
            let mut c: Vec<Rank> = Vec::new();
            for &i in over {
                let h = &self.holdings[i as usize];
                if h.block.contains(piece) {
                    c.extend(h.holders.iter().map(|l| l.rank));
                }
            }
            c.sort_unstable();
            c.dedup();
            c
        };
        let cells = |part: &Block| -> Option<Vec<Block>> { self.cells(part, over, min_cell) };
        // Fast path: one holding contains the whole atom.
        if over.iter().any(|&i| self.holdings[i as usize].block.contains(atom)) {
            return Ok(match cells(atom) {
                None => vec![Cover { block: *atom, candidates: candidates_of(atom) }],
                Some(cells) => cells.into_iter().map(|c| Cover { block: c, candidates: candidates_of(&c) }).collect(),
            });
        }
        let mut uncovered = vec![*atom];
        let mut parts = Vec::new();
        for &i in over {
            if uncovered.is_empty() {
                break;
            }
            let sb = &self.holdings[i as usize].block;
            let mut next = Vec::new();
            for u in uncovered {
                match u.intersect(sb) {
                    Some(p) => {
                        parts.push(p);
                        next.extend(u.subtract(sb));
                    }
                    None => next.push(u),
                }
            }
            uncovered = next;
        }
        if let Some(u) = uncovered.first() {
            return Err(Box::new(*u));
        }
        Ok(parts
            .into_iter()
            .flat_map(|p| cells(&p).unwrap_or_else(|| vec![p]))
            .map(|p| Cover { block: p, candidates: candidates_of(&p) })
            .collect())
    }

    /// `part` cut along the edges (inside it) of the holdings among `over`
    /// that overlap it without containing it, into at most [`MAX_CELLS`]
    /// cells of at least `min_cell` elements: where the edges make more
    /// or smaller cells, the thinnest slabs (relative to the part) are
    /// merged with a neighbour until they do not. `None` if no holding
    /// overlaps `part` only in part, or no cut is left. Any block inside
    /// `part` is covered: `part` lies inside some holding.
    fn cells(&self, part: &Block, over: &[u32], min_cell: u64) -> Option<Vec<Block>> {
        let min_cell = min_cell.max(1);
        if part.numel() / 2 < min_cell {
            return None;
        }
        let nd = part.ndim();
        let mut cuts: Vec<Vec<u64>> = (0..nd).map(|d| vec![part.offset()[d], part.end(d)]).collect();
        for &i in over {
            let b = &self.holdings[i as usize].block;
            if b.contains(part) || b.intersect(part).is_none() {
                continue;
            }
            for (d, c) in cuts.iter_mut().enumerate() {
                for x in [b.offset()[d], b.end(d)] {
                    if x > part.offset()[d] && x < part.end(d) {
                        c.push(x);
                    }
                }
            }
        }
        for c in &mut cuts {
            c.sort_unstable();
            c.dedup();
            if c.len() > MAX_CUTS {
                return None;
            }
        }
        let width = |c: &[u64], j: usize| c[j + 1] - c[j];
        let thinnest = |c: &[u64]| (0..c.len() - 1).min_by_key(|&j| width(c, j)).unwrap_or(0);
        loop {
            let count = cuts.iter().map(|c| c.len() as u64 - 1).product::<u64>();
            if count < 2 {
                return None;
            }
            // Every cell is at least the product of the narrowest slab of
            // every dimension.
            let smallest: u64 = cuts.iter().map(|c| width(c, thinnest(c))).product();
            if count <= MAX_CELLS as u64 && smallest >= min_cell {
                break;
            }
            // The dimension whose thinnest slab is the smallest share of
            // the part's extent: merge that slab with its thinner
            // neighbour.
            let d = (0..nd)
                .filter(|&d| cuts[d].len() > 2)
                .min_by(|&a, &b| {
                    let (wa, wb) = (width(&cuts[a], thinnest(&cuts[a])) as u128, width(&cuts[b], thinnest(&cuts[b])) as u128);
                    (wa * part.extent()[b] as u128).cmp(&(wb * part.extent()[a] as u128))
                })
                .unwrap_or(0);
            let c = &mut cuts[d];
            let j = thinnest(c);
            let last = c.len() - 2;
            let drop = if j == 0 {
                1
            } else if j == last || width(c, j - 1) <= width(c, j + 1) {
                j
            } else {
                j + 1
            };
            c.remove(drop);
        }
        let mut cells = vec![*part];
        for (d, c) in cuts.iter().enumerate() {
            if c.len() > 2 {
                cells = cells.into_iter().flat_map(|b| c.windows(2).map(move |w| with_range(&b, d, w[0], w[1] - w[0]))).collect();
            }
        }
        Some(cells)
    }
}

/// Most cut points per dimension [`SourceIndex::cover_split`] considers
/// (more: the part is not cut).
const MAX_CUTS: usize = 256;

/// `b` with dimension `d` narrowed to `len` indices from `start`.
pub(crate) fn with_range(b: &Block, d: usize, start: u64, len: u64) -> Block {
    let (mut offset, mut extent) = (b.offset().to_vec(), b.extent().to_vec());
    offset[d] = start;
    extent[d] = len;
    Block::new(&offset, &extent)
}

/// Most cells [`SourceIndex::cover_split`] cuts one part into.
pub(crate) const MAX_CELLS: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{BufferKey, Loc};

    fn h(off: &[u64], ext: &[u64], ranks: &[Rank]) -> Holding {
        Holding {
            block: Block::new(off, ext),
            holders: ranks.iter().map(|&r| Loc { rank: r, buffer: BufferKey::Named(0), at: 0 }).collect(),
        }
    }

    #[test]
    fn overlapping_needs_become_disjoint_atoms() {
        let hs = vec![h(&[0, 0], &[4, 4], &[0]), h(&[2, 2], &[4, 4], &[1])];
        let atoms = atomize(&hs);
        let total: u64 = atoms.iter().map(|a| a.block.numel()).sum();
        assert_eq!(total, 16 + 16 - 4);
        let shared: Vec<&Atom> = atoms.iter().filter(|a| a.holdings.len() == 2).collect();
        assert_eq!(shared.len(), 1);
        assert_eq!(shared[0].block, Block::new(&[2, 2], &[2, 2]));
    }

    #[test]
    fn cover_splits_across_sources_and_reports_holes() {
        let src = vec![h(&[0, 0], &[2, 4], &[0, 2]), h(&[2, 0], &[2, 4], &[1]), h(&[0, 0], &[4, 4], &[3])];
        let idx = SourceIndex::new(&src);
        let c = idx.cover(&Block::new(&[1, 0], &[2, 4])).unwrap();
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].candidates, vec![3]);
        let src2 = vec![h(&[0, 0], &[2, 4], &[0]), h(&[3, 0], &[1, 4], &[1])];
        let idx2 = SourceIndex::new(&src2);
        assert_eq!(idx2.cover(&Block::new(&[0, 0], &[4, 4])), Err(Box::new(Block::new(&[2, 0], &[1, 4]))));
    }

    #[test]
    fn cover_split_cuts_along_holdings_cut_differently() {
        // Rank 0 holds it all, ranks 1 and 2 its halves.
        let src = vec![h(&[0, 0], &[4, 4], &[0]), h(&[0, 0], &[2, 4], &[1]), h(&[2, 0], &[2, 4], &[2])];
        let idx = SourceIndex::new(&src);
        let atom = Block::new(&[0, 0], &[4, 4]);
        let c = idx.cover_split(&atom, 1).unwrap();
        assert_eq!(
            c,
            vec![
                Cover { block: Block::new(&[0, 0], &[2, 4]), candidates: vec![0, 1] },
                Cover { block: Block::new(&[2, 0], &[2, 4]), candidates: vec![0, 2] }
            ]
        );
        // Cells of 8 elements are too small for 9: the atom stays whole.
        assert_eq!(idx.cover_split(&atom, 9).unwrap(), vec![Cover { block: atom, candidates: vec![0] }]);
        assert_eq!(idx.cover(&atom).unwrap(), idx.cover_split(&atom, 9).unwrap());
    }

    #[test]
    fn cover_split_merges_thin_slabs() {
        // A one-row slab (8 elements) on rank 1 and a 3-row one on rank 3:
        // with cells of at least 16 elements the thin slab merges with its
        // neighbour, which rank 1 does not hold all of.
        let src = vec![h(&[0, 0], &[8, 8], &[0]), h(&[0, 0], &[1, 8], &[1]), h(&[1, 0], &[7, 8], &[2]), h(&[5, 0], &[3, 8], &[3])];
        let idx = SourceIndex::new(&src);
        let atom = Block::new(&[0, 0], &[8, 8]);
        let fine = idx.cover_split(&atom, 8).unwrap();
        assert_eq!(fine.iter().map(|c| c.block.extent()[0]).collect::<Vec<_>>(), vec![1, 4, 3]);
        assert_eq!(fine.iter().map(|c| c.candidates.clone()).collect::<Vec<_>>(), vec![vec![0, 1], vec![0, 2], vec![0, 2, 3]]);
        let coarse = idx.cover_split(&atom, 16).unwrap();
        assert_eq!(coarse.iter().map(|c| (c.block.offset()[0], c.block.extent()[0])).collect::<Vec<_>>(), vec![(0, 5), (5, 3)]);
        assert_eq!(coarse[0].candidates, vec![0]);
    }

    /// Random holdings over a 2-D tensor: whatever the cell size, the
    /// covers partition the atom and every candidate holds its cover.
    #[test]
    fn cover_split_partitions_the_atom() {
        let mut seed = 7u64;
        let mut below = |n: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for _ in 0..300 {
            let mut src = vec![h(&[0, 0], &[9, 7], &[0])];
            for r in 1..1 + below(5) as u32 {
                let (o0, o1) = (below(9), below(7));
                src.push(h(&[o0, o1], &[1 + below(9 - o0), 1 + below(7 - o1)], &[r]));
            }
            let idx = SourceIndex::new(&src);
            let (a0, a1) = (below(9), below(7));
            let atom = Block::new(&[a0, a1], &[1 + below(9 - a0), 1 + below(7 - a1)]);
            for min_cell in [1, 2, 5, 64] {
                let covers = idx.cover_split(&atom, min_cell).unwrap();
                assert!(covers.len() <= MAX_CELLS);
                assert_eq!(covers.iter().map(|c| c.block.numel()).sum::<u64>(), atom.numel());
                for (i, c) in covers.iter().enumerate() {
                    assert!(atom.contains(&c.block) && c.block.numel() > 0);
                    assert!(covers.len() == 1 || c.block.numel() >= min_cell, "{c:?} under {min_cell}");
                    for d in &covers[i + 1..] {
                        assert!(c.block.intersect(&d.block).is_none());
                    }
                    for &r in &c.candidates {
                        assert!(src.iter().any(|s| s.holders[0].rank == r && s.block.contains(&c.block)));
                    }
                    let holders: Vec<Rank> = src.iter().filter(|s| s.block.contains(&c.block)).map(|s| s.holders[0].rank).collect();
                    assert_eq!(c.candidates.len(), holders.len());
                }
            }
        }
    }
}
