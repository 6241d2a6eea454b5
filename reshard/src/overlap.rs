//! Overlap computation for one tensor: split the destination needs into
//! disjoint atoms, and cover each atom with source holdings.
//!
//! Works on distinct blocks ([`Holding`]s), never on all rank pairs, so a
//! tensor replicated on hundreds of ranks costs as much as one held once.

use crate::block::Block;
use crate::layout::{Holding, Rank};

/// A disjoint part of the destination needs and the holdings that need it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Atom {
    /// The elements.
    pub block: Block,
    /// Indices of the destination holdings containing it.
    pub holdings: Vec<u32>,
}

/// Splits the union of `holdings` into disjoint atoms; each atom records
/// which holdings contain it. Atoms follow the holdings' order.
pub fn atomize(holdings: &[Holding]) -> Vec<Atom> {
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

/// Whether no two holdings overlap (sweep over dimension 0).
fn pairwise_disjoint(holdings: &[Holding]) -> bool {
    if holdings.len() < 2 {
        return true;
    }
    if holdings[0].block.ndim() == 0 {
        return false;
    }
    let mut order: Vec<usize> = (0..holdings.len()).collect();
    order.sort_unstable_by_key(|&i| holdings[i].block.offset()[0]);
    for (k, &i) in order.iter().enumerate() {
        let bi = &holdings[i].block;
        for &j in &order[k + 1..] {
            let bj = &holdings[j].block;
            if bj.offset()[0] >= bi.end(0) {
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
pub struct SourceIndex<'a> {
    holdings: &'a [Holding],
    order: Vec<u32>,
    max_ext0: u64,
}

/// A covered part of an atom and the source ranks able to send it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cover {
    /// The elements.
    pub block: Block,
    /// Source ranks holding all of it, sorted, deduplicated.
    pub candidates: Vec<Rank>,
}

impl<'a> SourceIndex<'a> {
    /// Indexes `holdings` by their offset in dimension 0.
    pub fn new(holdings: &'a [Holding]) -> SourceIndex<'a> {
        let mut order: Vec<u32> = (0..holdings.len() as u32).collect();
        let key = |i: &u32| holdings[*i as usize].block.offset().first().copied().unwrap_or(0);
        order.sort_by_key(key);
        let max_ext0 = holdings.iter().map(|h| h.block.extent().first().copied().unwrap_or(1)).max().unwrap_or(0);
        SourceIndex { holdings, order, max_ext0 }
    }

    /// Holdings overlapping `b`, in index order.
    fn overlapping(&self, b: &Block) -> Vec<u32> {
        if b.ndim() == 0 {
            return self.order.clone();
        }
        let off0 = |i: &u32| self.holdings[*i as usize].block.offset()[0];
        let (lo, hi) = (b.offset()[0], b.end(0));
        let start = self.order.partition_point(|i| off0(i).saturating_add(self.max_ext0) <= lo);
        let end = self.order.partition_point(|i| off0(i) < hi);
        self.order[start..end.max(start)].iter().copied().filter(|&i| self.holdings[i as usize].block.intersect(b).is_some()).collect()
    }

    /// Covers `atom` with source holdings. Returns the covered parts and,
    /// if some part is held by no source, that part.
    pub fn cover(&self, atom: &Block) -> Result<Vec<Cover>, Box<Block>> {
        let over = self.overlapping(atom);
        let candidates_of = |piece: &Block| {
            let mut c: Vec<Rank> = Vec::new();
            for &i in &over {
                let h = &self.holdings[i as usize];
                if h.block.contains(piece) {
                    c.extend(h.holders.iter().map(|l| l.rank));
                }
            }
            c.sort_unstable();
            c.dedup();
            c
        };
        // Fast path: one holding contains the whole atom.
        if over.iter().any(|&i| self.holdings[i as usize].block.contains(atom)) {
            return Ok(vec![Cover { block: *atom, candidates: candidates_of(atom) }]);
        }
        let mut uncovered = vec![*atom];
        let mut parts = Vec::new();
        for &i in &over {
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
        Ok(parts.into_iter().map(|p| Cover { block: p, candidates: candidates_of(&p) }).collect())
    }
}

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
}
