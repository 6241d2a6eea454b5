//! Estimated refit time of a plan under a [`LinkModel`]: per round the
//! busiest rank, summed over rounds, and the lower bound for any plan
//! between the same layouts.

use super::{Endpoint, Group, Plan, Transfer};
use crate::cost::{rank_round_seconds, LinkModel};
use std::collections::HashMap;

/// Estimated refit time under a [`LinkModel`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    /// Predicted time of this plan: per round, the busiest link, summed.
    pub seconds: f64,
    /// Lower bound for any plan between these layouts: the busiest link's
    /// unavoidable bytes over its bandwidth.
    pub lower_bound_seconds: f64,
}

impl Plan {
    /// Estimated time under `links`: for every round, the busiest link
    /// (bytes over bandwidth, plus message latency), summed over rounds.
    ///
    /// Time and memory are linear in the number of transfers, whatever the
    /// numbers of rounds and ranks: each stage's run of transfers (their
    /// rounds follow those of the run before) is summed in one pass into
    /// per-round, per-rank counters where those are few, else bucketed by
    /// round so that each round touches only the ranks taking part in it.
    pub fn estimate(&self, links: &LinkModel) -> Estimate {
        self.estimate_within(links, DENSE_ESTIMATE_BYTES)
    }

    /// [`estimate`](Self::estimate), counting per round and rank in one
    /// pass only where that takes at most `dense_bytes`.
    pub(crate) fn estimate_within(&self, links: &LinkModel, dense_bytes: u64) -> Estimate {
        let n = (self.src_ranks + self.dst_ranks) as u64;
        let dense = |transfers: usize, rounds: u64| rounds * n * 36 + (n * n).min(transfers as u64) * rounds.div_ceil(64) * 8;
        let all = self.figures.rounds as u64;
        let runs = if dense(self.transfers.len(), all) <= dense_bytes {
            // Every round at once, in one pass.
            vec![(0..self.transfers.len(), 0, all)]
        } else {
            self.round_runs()
        };
        let mut seconds = 0.0;
        for (range, first, rounds) in runs {
            let run = &self.transfers[range];
            let busiest = if dense(run.len(), rounds) <= dense_bytes {
                self.busiest_dense(run, first, rounds, links)
            } else {
                self.busiest_bucketed(run, first, rounds, links)
            };
            for w in busiest {
                seconds += w;
            }
        }
        Estimate { seconds, lower_bound_seconds: self.lower_bound(links) }
    }

    /// The transfers in runs (index range, first round, number of rounds)
    /// whose rounds follow one another: one run per stage where each
    /// stage's rounds follow the last one's (as the planners make them),
    /// else one run of them all. Local copies do not count.
    fn round_runs(&self) -> Vec<(std::ops::Range<usize>, u32, u64)> {
        let mut runs: Vec<(std::ops::Range<usize>, u32, u32)> = Vec::new();
        let (mut start, mut lo, mut hi) = (0, u32::MAX, 0);
        for (i, t) in self.transfers.iter().enumerate() {
            if t.stage != self.transfers[start].stage {
                if lo <= hi {
                    runs.push((start..i, lo, hi));
                }
                (start, lo, hi) = (i, u32::MAX, 0);
            }
            if t.from != t.to {
                (lo, hi) = (lo.min(t.round), hi.max(t.round));
            }
        }
        if lo <= hi {
            runs.push((start..self.transfers.len(), lo, hi));
        }
        let ordered = runs.windows(2).all(|w| w[0].2 < w[1].1);
        if !ordered {
            let lo = runs.iter().map(|r| r.1).min().unwrap_or(0);
            let hi = runs.iter().map(|r| r.2).max().unwrap_or(0);
            runs = vec![(0..self.transfers.len(), lo, hi)];
        }
        runs.into_iter().map(|(range, lo, hi)| (range, lo, (hi - lo) as u64 + 1)).collect()
    }

    /// Per endpoint index (source ranks, then destination ranks), its node
    /// (source nodes, then destination nodes).
    fn endpoint_nodes(&self) -> Vec<u32> {
        let src_nodes = self.src_ranks.div_ceil(self.src_rpn.max(1));
        let src = (0..self.src_ranks).map(|r| r / self.src_rpn.max(1));
        src.chain((0..self.dst_ranks).map(|r| src_nodes + r / self.dst_rpn.max(1))).collect()
    }

    /// A transfer's sender and receiver indices (source ranks, then
    /// destination ranks), and whether they are on different nodes.
    fn ends(&self, t: &Transfer, nodes: &[u32]) -> (usize, usize, bool) {
        let idx = |e: Endpoint| match e.group {
            Group::Src => e.rank as usize,
            Group::Dst => self.src_ranks as usize + e.rank as usize,
        };
        let (a, z) = (idx(t.from), idx(t.to));
        (a, z, nodes[a] != nodes[z])
    }

    /// The busiest rank's time in each of `rounds` rounds from `first`,
    /// in one pass over `run` into per-round, per-rank counters.
    fn busiest_dense(&self, run: &[Transfer], first: u32, rounds: u64, links: &LinkModel) -> Vec<f64> {
        let n = (self.src_ranks + self.dst_ranks) as usize;
        let rounds = rounds as usize;
        // Per (round, rank): bytes (net out, net in, intra out, intra in)
        // and messages sent.
        let mut loads = vec![[0u64; 4]; rounds * n];
        let mut msgs = vec![0u32; rounds * n];
        // Per (sender, receiver) pair: an id, and a bitmap of the rounds in
        // which it has a message.
        let words = rounds.div_ceil(64);
        let mut table: Vec<u32> = if n <= 2048 { vec![u32::MAX; n * n] } else { Vec::new() };
        let mut ids: HashMap<(usize, usize), u32> = HashMap::new();
        let mut bits: Vec<u64> = Vec::new();
        let mut next = 0u32;
        let nodes = self.endpoint_nodes();
        let piece_bytes = self.piece_bytes();
        for t in run.iter().filter(|t| t.from != t.to) {
            let (a, z, cross) = self.ends(t, &nodes);
            let r = t.round.wrapping_sub(first) as usize;
            if r >= rounds {
                // Outside the rounds the plan counts (no planner makes one).
                continue;
            }
            let (to_dst, to_src) = piece_bytes[t.piece as usize];
            let b = if t.to.group == Group::Src { to_src } else { to_dst };
            let (out, inn) = if cross { (0, 1) } else { (2, 3) };
            loads[r * n + a][out] += b;
            loads[r * n + z][inn] += b;
            let id = if table.is_empty() {
                *ids.entry((a, z)).or_insert(next)
            } else {
                let slot = &mut table[a * n + z];
                if *slot == u32::MAX {
                    *slot = next;
                }
                *slot
            };
            if id == next {
                bits.resize(bits.len() + words, 0);
                next += 1;
            }
            let (word, mask) = (id as usize * words + r / 64, 1u64 << (r % 64));
            if bits[word] & mask == 0 {
                bits[word] |= mask;
                msgs[r * n + a] += 1;
            }
        }
        (0..rounds)
            .map(|r| {
                let mut worst: f64 = 0.0;
                for e in r * n..(r + 1) * n {
                    worst = worst.max(rank_round_seconds(&loads[e], msgs[e] as u64, links));
                }
                worst
            })
            .collect()
    }

    /// The busiest rank's time in each of `rounds` rounds from `first`:
    /// the transfers of `run` bucketed by round (a counting sort into
    /// compact records), then per round only the ranks taking part.
    fn busiest_bucketed(&self, run: &[Transfer], first: u32, rounds: u64, links: &LinkModel) -> Vec<f64> {
        let n = (self.src_ranks + self.dst_ranks) as usize;
        let rounds = rounds as usize;
        let (start, recs) = self.bucket_by_round(run, first, rounds);
        let mut round = RoundLoads::new(n);
        let mut busiest = vec![0.0f64; rounds];
        for (r, worst) in busiest.iter_mut().enumerate() {
            let bucket = &recs[start[r]..start[r + 1]];
            if !bucket.is_empty() {
                *worst = round.busiest(bucket, links);
            }
        }
        busiest
    }

    /// The transfers between ranks of `run` in `rounds` rounds from `first`
    /// as records bucketed by round: `recs[start[r]..start[r + 1]]`.
    fn bucket_by_round(&self, run: &[Transfer], first: u32, rounds: usize) -> (Vec<usize>, Vec<Rec>) {
        // Transfers between ranks, with their round from `first` (no
        // planner makes one outside the rounds counted).
        let moves =
            || run.iter().filter(|t| t.from != t.to).map(|t| (t, t.round.wrapping_sub(first) as usize)).filter(|&(_, r)| r < rounds);
        let mut start = vec![0usize; rounds + 1];
        for (_, r) in moves() {
            start[r + 1] += 1;
        }
        for r in 1..start.len() {
            start[r] += start[r - 1];
        }
        let mut recs = vec![Rec::default(); start[rounds]];
        let mut next = start.clone();
        let nodes = self.endpoint_nodes();
        let piece_bytes = self.piece_bytes();
        for (t, r) in moves() {
            let (a, z, cross) = self.ends(t, &nodes);
            let (to_dst, to_src) = piece_bytes[t.piece as usize];
            let bytes = if t.to.group == Group::Src { to_src } else { to_dst };
            let slot = &mut next[r];
            recs[*slot] = Rec { from: a as u32 | if cross { CROSS } else { 0 }, to: z as u32, bytes };
            *slot += 1;
        }
        (start, recs)
    }

    /// Lower bound on refit time for any plan between these layouts: each
    /// destination node must take in the union of its ranks' needs through
    /// its ranks' network links, and the source group must send every needed
    /// element at least once through its ranks' network links.
    pub fn lower_bound(&self, links: &LinkModel) -> f64 {
        lower_bound(&self.needed_node_bytes, self.unique_bytes, self.src_ranks, self.dst_ranks, self.dst_rpn, links)
    }

    /// Lower bound on refit time when only each rank's network *egress* is
    /// capped (as by link emulation on one machine): every needed element
    /// must leave the source group at least once, through its ranks' links.
    pub fn egress_lower_bound(&self, links: &LinkModel) -> f64 {
        self.unique_bytes as f64 / (self.src_ranks as f64 * links.net_bytes_per_s)
    }
}

/// [`Plan::lower_bound`] from its inputs: per destination node the bytes it
/// needs, the bytes of the union of all needs, and the group sizes.
pub(crate) fn lower_bound(
    needed_node_bytes: &[u64],
    unique_bytes: u64,
    src_ranks: u32,
    dst_ranks: u32,
    dst_rpn: u32,
    links: &LinkModel,
) -> f64 {
    let mut worst: f64 = 0.0;
    for (node, &bytes) in needed_node_bytes.iter().enumerate() {
        let ranks_on_node = dst_ranks.saturating_sub((node as u32).saturating_mul(dst_rpn)).min(dst_rpn) as f64;
        worst = worst.max(bytes as f64 / (ranks_on_node * links.net_bytes_per_s));
    }
    worst.max(unique_bytes as f64 / (src_ranks as f64 * links.net_bytes_per_s))
}

/// Most memory [`Plan::estimate`] gives per-round, per-rank counters for
/// one stage before it buckets the stage's transfers by round instead.
const DENSE_ESTIMATE_BYTES: u64 = 32 << 20;

/// A transfer between ranks: sender (its top bit set when the transfer
/// crosses nodes), receiver and bytes.
#[derive(Clone, Copy, Default)]
struct Rec {
    from: u32,
    to: u32,
    bytes: u64,
}

/// The bit of [`Rec::from`] set when the transfer crosses nodes.
const CROSS: u32 = 1 << 31;

/// No slot.
const NONE: u32 = u32::MAX;

/// Per rank, for the round at hand: bytes (net out, net in, intra out,
/// intra in), messages sent, whether it takes part, and its slot among the
/// round's senders; reused round after round.
struct RoundLoads {
    loads: Vec<[u64; 4]>,
    msgs: Vec<u64>,
    active: Vec<bool>,
    touched: Vec<usize>,
    slot: Vec<u32>,
    senders: Vec<usize>,
    grouped: Vec<Rec>,
    /// Per receiver, the last sender group that reached it, so that each
    /// (sender, receiver) pair of a round counts one message.
    seen: Vec<u64>,
    epoch: u64,
}

impl RoundLoads {
    fn new(n: usize) -> RoundLoads {
        RoundLoads {
            loads: vec![[0u64; 4]; n],
            msgs: vec![0u64; n],
            active: vec![false; n],
            touched: Vec::new(),
            slot: vec![NONE; n],
            senders: Vec::new(),
            grouped: Vec::new(),
            seen: vec![0u64; n],
            epoch: 0,
        }
    }

    /// The busiest rank's time in the round of `bucket` (not empty); leaves
    /// every rank's counters at zero for the next round.
    fn busiest(&mut self, bucket: &[Rec], links: &LinkModel) -> f64 {
        self.group_by_sender(bucket);
        let mut worst = 0.0f64;
        let mut sender = usize::MAX;
        for rec in &self.grouped {
            let (a, z) = ((rec.from & !CROSS) as usize, rec.to as usize);
            if a != sender {
                sender = a;
                self.epoch += 1;
            }
            let (out, inn) = if rec.from & CROSS != 0 { (0, 1) } else { (2, 3) };
            self.loads[a][out] += rec.bytes;
            self.loads[z][inn] += rec.bytes;
            if self.seen[z] != self.epoch {
                self.seen[z] = self.epoch;
                self.msgs[a] += 1;
            }
            for e in [a, z] {
                if !self.active[e] {
                    self.active[e] = true;
                    self.touched.push(e);
                }
            }
        }
        for &e in &self.touched {
            worst = worst.max(rank_round_seconds(&self.loads[e], self.msgs[e], links));
            self.loads[e] = [0; 4];
            self.msgs[e] = 0;
            self.active[e] = false;
            self.slot[e] = NONE;
        }
        self.touched.clear();
        worst
    }

    /// The round's records grouped by sender into `grouped` (a counting
    /// sort over the senders present, in order of first appearance).
    fn group_by_sender(&mut self, bucket: &[Rec]) {
        let (slot, senders) = (&mut self.slot, &mut self.senders);
        senders.clear();
        for rec in bucket {
            let a = (rec.from & !CROSS) as usize;
            if slot[a] == NONE {
                slot[a] = senders.len() as u32;
                senders.push(0);
            }
            senders[slot[a] as usize] += 1;
        }
        let mut offset = 0;
        for s in senders.iter_mut() {
            let count = *s;
            *s = offset;
            offset += count;
        }
        self.grouped.clear();
        self.grouped.resize(bucket.len(), Rec::default());
        for rec in bucket {
            let s = &mut senders[slot[(rec.from & !CROSS) as usize] as usize];
            self.grouped[*s] = *rec;
            *s += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{parse_layout, plan_baseline, plan_reshard, PlanOptions};

    /// Both ways of counting give the same estimate: one pass over
    /// per-round counters, bucketing by round, and either over transfers in
    /// any order (one run of all rounds).
    #[test]
    fn estimate_is_the_same_however_it_is_counted() {
        let src = parse_layout(include_str!("../../../examples/mixed-2d/src.json")).unwrap();
        let dst = parse_layout(include_str!("../../../examples/mixed-2d/dst.json")).unwrap();
        let links = LinkModel { net_bytes_per_s: 3e3, intra_bytes_per_s: 7e3, message_latency_s: 1e-3 };
        for cap in [1 << 20, 256, 32] {
            let options = PlanOptions { max_staging_bytes: cap, ..PlanOptions::default() };
            for mut plan in [plan_reshard(&src, &dst, &options).unwrap(), plan_baseline(&src, &dst, &options).unwrap()] {
                let dense = plan.estimate_within(&links, u64::MAX);
                assert_eq!(plan.estimate_within(&links, 0), dense, "cap {cap}: bucketed");
                assert_eq!(plan.estimate(&links), dense, "cap {cap}");
                assert!(plan.round_runs().len() >= plan.figures().stages as usize - 1, "cap {cap}: a run per stage with transfers");
                // Reversed, the stages' rounds no longer follow one another.
                plan.transfers.reverse();
                if plan.figures().stages > 2 {
                    assert_eq!(plan.round_runs().len(), 1, "cap {cap}: one run of everything");
                }
                assert_eq!(plan.estimate_within(&links, 0), dense, "cap {cap}: bucketed, reversed");
                assert_eq!(plan.estimate_within(&links, u64::MAX), dense, "cap {cap}: dense, reversed");
            }
        }
    }
}
