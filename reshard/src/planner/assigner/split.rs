//! Splitting a piece among the ranks that hold it ([`Assigner::split`]),
//! where that lowers the busiest source rank.

use super::{Assigner, SRC_OUT};
use crate::block::Block;
use crate::layout::Rank;
use crate::overlap::with_range;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

impl Assigner {
    /// Whether to split a piece (`block`, `bytes` on the wire, needed by
    /// `k` destination nodes) among its `candidates`, and if so its parts
    /// in `parts`: (block, bytes, the one candidate to send it, or `None`:
    /// any of them), at most `room` parts.
    ///
    /// The piece is cut along its first dimension of more than one index
    /// into ranges of whole rows, so every part stays one strided span of
    /// its holders' buffers, each part at least `min_split` bytes. Sent
    /// whole, the direct option sends it `k` times, from the least loaded
    /// candidates in turn (by outlook). It is split only when that would
    /// raise both the busiest source rank's outlook and the level its
    /// candidates are expected to reach anyway (outlook plus their share
    /// of pieces still to come, which later pieces even out), and the split
    /// ends lower:
    /// - `k = 1`: the copy is levelled (water-filled) over the least loaded
    ///   candidates, as many as the rows and `min_split` allow, each part
    ///   sent by one;
    /// - `k > 1` with more candidates than `k`: into equal parts, about one
    ///   per `k` candidates, each part then chosen for like any piece (its
    ///   `k` copies from different candidates, or relayed), so the copies
    ///   spread over all candidates instead of `k` of them. (With no more
    ///   candidates than copies, the direct option already uses them all.)
    #[inline]
    pub(in crate::planner) fn split(
        &mut self,
        block: &Block,
        bytes: u64,
        k: u64,
        candidates: &[Rank],
        room: u64,
        parts: &mut Vec<(Block, u64, Option<Rank>)>,
    ) -> bool {
        parts.clear();
        let n = candidates.len() as u64;
        if n < 2 || bytes / 2 < self.min_split || room < 2 || (k > 1 && n <= k) {
            return false;
        }
        let Some(d) = (0..block.ndim()).find(|&d| block.extent()[d] > 1) else { return false };
        let rows = block.extent()[d];
        let row_bytes = bytes / rows;
        let min_rows = self.min_split.div_ceil(row_bytes.max(1)).max(1);
        if row_bytes == 0 || rows / 2 < min_rows {
            return false;
        }
        let mut by_load = std::mem::take(&mut self.by_load);
        by_load.clear();
        let mut bar = self.src_max;
        for &c in candidates {
            by_load.push((self.outlook(c), c));
            bar = bar.max(self.load(0, SRC_OUT, c).saturating_add(self.shares[c as usize]));
        }
        by_load.sort_unstable();
        let split = self.whole_raises(&by_load, k, bytes, bar).is_some_and(|whole| {
            if k == 1 {
                self.level(&by_load, bytes, rows, row_bytes, min_rows, room, whole)
            } else {
                let p = (n / k).min(rows / min_rows).min(room);
                self.rows.clear();
                self.rows.extend((0..p).map(|i| rows / p + u64::from(i < rows % p)));
                p >= 2
            }
        });
        if split {
            let mut at = block.offset()[d];
            for (i, &r) in self.rows.iter().enumerate() {
                let sender = (k == 1).then(|| by_load[i].1);
                parts.push((with_range(block, d, at, r), r * row_bytes, sender));
                at += r;
            }
        }
        self.by_load = by_load;
        split
    }

    /// The most outlook among the candidates (`by_load`, least first)
    /// after `k` copies of `bytes` from the least loaded in turn, if that
    /// is above `bar`.
    fn whole_raises(&self, by_load: &[(u64, Rank)], k: u64, bytes: u64, bar: u64) -> Option<u64> {
        // If the k least loaded each take a copy without passing the bar,
        // so does the choice in turn (while fewer than k are chosen, one
        // of the k least loaded is not, so each copy goes to a candidate at
        // most as loaded as the k-th least).
        if k as usize <= by_load.len() && by_load[k as usize - 1].0.saturating_add(bytes) <= bar {
            return None;
        }
        let mut loads: BinaryHeap<Reverse<u64>> = by_load.iter().map(|&(l, _)| Reverse(l)).collect();
        let mut whole = 0;
        for _ in 0..k {
            let Some(Reverse(least)) = loads.pop() else { break };
            let l = least.saturating_add(bytes);
            loads.push(Reverse(l));
            whole = whole.max(l);
        }
        (whole > bar).then_some(whole)
    }

    /// Rows per part (in `self.rows`, for the first candidates of
    /// `by_load`, least loaded first) that level one copy of a piece of
    /// `rows` rows over the least loaded candidates, if that ends below
    /// `whole`, the most after sending it whole.
    #[allow(clippy::too_many_arguments)]
    fn level(&mut self, by_load: &[(u64, Rank)], bytes: u64, rows: u64, row_bytes: u64, min_rows: u64, room: u64, whole: u64) -> bool {
        let (total, unit) = (bytes as u128, row_bytes as u128);
        // The candidates below the level of all of them (water-filling:
        // the least loaded p whose level is above the p-th load).
        let mut below = 0;
        let mut sum = total;
        for (i, &(l, _)) in by_load.iter().enumerate() {
            if (l as u128) * (i as u128) >= sum {
                break;
            }
            sum += l as u128;
            below = i + 1;
        }
        let most_parts = (rows / min_rows).min(below as u64).min(room) as usize;
        for p in (2..=most_parts).rev() {
            // Level L over the p least loaded: p·L = bytes + their loads;
            // candidate i takes (L - load_i) / row_bytes rows.
            let sum: u128 = by_load[..p].iter().map(|&(l, _)| l as u128).sum::<u128>() + total;
            let denom = p as u128 * unit;
            self.rows.clear();
            let mut fracs: Vec<(u128, usize)> = Vec::with_capacity(p);
            let mut given = 0u64;
            let mut fits = true;
            for (i, &(l, _)) in by_load[..p].iter().enumerate() {
                let Some(num) = sum.checked_sub(p as u128 * l as u128) else {
                    fits = false;
                    break;
                };
                let n = (num / denom) as u64;
                self.rows.push(n);
                fracs.push((num % denom, i));
                given += n;
            }
            if !fits {
                continue;
            }
            // The rows left by rounding down, to the largest remainders.
            fracs.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            for &(_, i) in fracs.iter().take(rows.saturating_sub(given) as usize) {
                self.rows[i] += 1;
            }
            if self.rows.iter().sum::<u64>() != rows || self.rows.iter().any(|&n| n < min_rows) {
                continue;
            }
            let most = by_load[..p].iter().zip(&self.rows).map(|(&(l, _), &n)| l.saturating_add(n * row_bytes)).max().unwrap_or(u64::MAX);
            return most < whole;
        }
        false
    }
}
