//! A plan: the pieces of tensors to move, the transfers that move them
//! (who sends, who receives, in which round), and the figures that describe
//! the traffic. Produced by [`plan_reshard`](crate::plan_reshard) or
//! [`plan_baseline`](crate::plan_baseline); turned into per-rank programs by
//! [`Plan::programs`].

use crate::block::Block;
use crate::cost::LinkModel;
use crate::dtype::{wire_dtype, DType};
use crate::fingerprint::{fnv64, Fingerprint, Fnv64};
use crate::layout::{Layout, Rank};
use std::collections::HashMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use thiserror::Error;

/// Which group a rank belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum Group {
    /// The training (source) group.
    Src,
    /// The inference (destination) group.
    Dst,
}

/// A rank of one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Endpoint {
    /// Its group.
    pub group: Group,
    /// Its rank within the group.
    pub rank: Rank,
}

impl Endpoint {
    /// A source rank.
    pub const fn src(rank: Rank) -> Endpoint {
        Endpoint { group: Group::Src, rank }
    }

    /// A destination rank.
    pub const fn dst(rank: Rank) -> Endpoint {
        Endpoint { group: Group::Dst, rank }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.group {
            Group::Src => write!(f, "src rank {}", self.rank),
            Group::Dst => write!(f, "dst rank {}", self.rank),
        }
    }
}

/// Which planner made a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Strategy {
    /// Intersect both layouts; send each destination node exactly what it needs.
    Reshard,
    /// Gather each tensor on one source rank, broadcast it whole.
    Baseline,
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Strategy::Reshard => "reshard",
            Strategy::Baseline => "baseline",
        })
    }
}

/// Planner options.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlanOptions {
    /// Most bytes a rank stages (sends plus receives) in one round.
    pub max_staging_bytes: u64,
    /// Link bandwidths used to choose senders and relays.
    pub links: LinkModel,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions { max_staging_bytes: 256 << 20, links: LinkModel::default() }
    }
}

impl Hash for PlanOptions {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.max_staging_bytes.hash(h);
        self.links.net_bytes_per_s.to_bits().hash(h);
        self.links.intra_bytes_per_s.to_bits().hash(h);
        self.links.message_latency_s.to_bits().hash(h);
    }
}

/// A block of one tensor that moves as a unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Tensor index in the source layout.
    pub src_tensor: u32,
    /// Tensor index in the destination layout.
    pub dst_tensor: u32,
    /// The elements, in global tensor coordinates.
    pub block: Block,
}

/// One piece moving from one rank to another (or copied locally when
/// `from == to`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// Index into [`Plan::pieces`].
    pub piece: u32,
    /// Sender.
    pub from: Endpoint,
    /// Receiver.
    pub to: Endpoint,
    /// Dependency stage: data a rank forwards arrived in an earlier stage.
    pub stage: u16,
    /// Sender reads from the tensor's scratch buffer, not its shards.
    pub from_scratch: bool,
    /// Receiver writes into the tensor's scratch buffer, not its shards.
    pub to_scratch: bool,
    /// Execution round (rounds of one stage follow those of the previous).
    pub round: u32,
}

/// Traffic figures of a plan. Local copies (`from == to`) are not traffic.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Figures {
    /// Bytes leaving source ranks.
    pub src_egress_bytes: u64,
    /// Bytes entering each destination node from outside it.
    pub dst_node_ingress_bytes: Vec<u64>,
    /// Bytes crossing a node boundary (every source-to-destination byte does).
    pub cross_node_bytes: u64,
    /// Most bytes one rank sends.
    pub max_rank_send_bytes: u64,
    /// Most bytes one rank receives.
    pub max_rank_recv_bytes: u64,
    /// Number of messages (one per sender, receiver and round).
    pub messages: u64,
    /// Most messages one rank sends in a refit.
    pub max_rank_send_messages: u64,
    /// Most messages one rank receives in a refit.
    pub max_rank_recv_messages: u64,
    /// Total bytes moved between ranks.
    pub total_bytes: u64,
    /// Number of rounds.
    pub rounds: u32,
    /// Number of dependency stages.
    pub stages: u32,
    /// Number of pieces.
    pub pieces: u64,
    /// Number of transfers, local copies included.
    pub transfers: u64,
}

/// Estimated refit time under a [`LinkModel`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    /// Predicted time of this plan: per round, the busiest link, summed.
    pub seconds: f64,
    /// Lower bound for any plan between these layouts: the busiest link's
    /// unavoidable bytes over its bandwidth.
    pub lower_bound_seconds: f64,
}

/// Why planning failed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PlanError {
    /// A destination tensor does not exist in the source layout.
    #[error("destination tensor '{tensor}' is absent from the source layout")]
    MissingTensor {
        /// Tensor name.
        tensor: String,
    },
    /// Shapes differ between the two layouts.
    #[error("tensor '{tensor}': source shape {src:?} differs from destination shape {dst:?}")]
    ShapeMismatch {
        /// Tensor name.
        tensor: String,
        /// Source shape.
        src: Vec<u64>,
        /// Destination shape.
        dst: Vec<u64>,
    },
    /// The dtypes cannot be converted.
    #[error("tensor '{tensor}': cannot convert {from} to {to} (only f64/f32/bf16/f16 convert among themselves)")]
    Conversion {
        /// Tensor name.
        tensor: String,
        /// Source dtype.
        from: DType,
        /// Destination dtype.
        to: DType,
    },
    /// Part of what a destination rank needs is held by no source rank.
    #[error("tensor '{tensor}': region {region} needed by dst rank {rank} is not covered by any source shard")]
    NotCovered {
        /// Tensor name.
        tensor: String,
        /// A destination rank that needs it.
        rank: Rank,
        /// The uncovered region.
        region: Box<Block>,
    },
    /// The baseline gathers the whole needed extent of a tensor on one
    /// source rank, but no source shard holds part of it.
    #[error("tensor '{tensor}': the baseline gathers {extent} on one source rank, but region {region} is not covered by any source shard")]
    BaselineNotCovered {
        /// Tensor name.
        tensor: String,
        /// The extent the baseline gathers.
        extent: Box<Block>,
        /// The part no source holds.
        region: Box<Block>,
    },
    /// The plan would need more pieces than supported.
    #[error("tensor '{tensor}': the plan would need more than {limit} pieces; raise the staging limit (--max-staging-mib)")]
    TooManyPieces {
        /// Tensor being planned when the limit was hit.
        tensor: String,
        /// The limit.
        limit: u64,
    },
    /// The plan was made for other layouts or options.
    #[error("plan fingerprint {plan} does not match these layouts ({layouts})")]
    FingerprintMismatch {
        /// The plan's fingerprint.
        plan: Fingerprint,
        /// The fingerprint of the layouts given.
        layouts: Fingerprint,
    },
}

/// A complete plan for one refit.
#[derive(Clone, Debug)]
pub struct Plan {
    pub(crate) strategy: Strategy,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) options: PlanOptions,
    pub(crate) src_ranks: u32,
    pub(crate) dst_ranks: u32,
    pub(crate) src_rpn: u32,
    pub(crate) dst_rpn: u32,
    pub(crate) pieces: Vec<Piece>,
    pub(crate) transfers: Vec<Transfer>,
    pub(crate) wire: Vec<(DType, DType)>,
    pub(crate) figures: Figures,
    /// Per destination node: bytes of the union of its ranks' needs.
    pub(crate) needed_node_bytes: Vec<u64>,
    /// Bytes of the union of all destination needs.
    pub(crate) unique_bytes: u64,
    /// Per destination tensor, the block a scratch buffer holds (baseline
    /// only: the bounding box of the destination's needs).
    pub(crate) scratch_blocks: Vec<Block>,
}

impl Plan {
    /// Which planner made it.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// Fingerprint of both layouts, the options and the strategy.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// The options used.
    pub fn options(&self) -> &PlanOptions {
        &self.options
    }

    /// All pieces.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// All transfers, in stage order.
    pub fn transfers(&self) -> &[Transfer] {
        &self.transfers
    }

    /// Traffic figures.
    pub fn figures(&self) -> &Figures {
        &self.figures
    }

    /// Number of source ranks.
    pub fn src_ranks(&self) -> u32 {
        self.src_ranks
    }

    /// Number of destination ranks.
    pub fn dst_ranks(&self) -> u32 {
        self.dst_ranks
    }

    /// Node of an endpoint (source and destination nodes are distinct
    /// machines; both are numbered from 0 within their group).
    pub fn node_of(&self, e: Endpoint) -> (Group, u32) {
        match e.group {
            Group::Src => (Group::Src, e.rank / self.src_rpn),
            Group::Dst => (Group::Dst, e.rank / self.dst_rpn),
        }
    }

    /// Bytes a transfer puts on the wire.
    pub fn wire_bytes(&self, t: &Transfer) -> u64 {
        let p = &self.pieces[t.piece as usize];
        p.block.numel() * self.transfer_wire_dtype(t).size()
    }

    /// The dtype a transfer travels in: the source dtype inside the source
    /// group, else the narrower of source and destination dtypes.
    pub fn transfer_wire_dtype(&self, t: &Transfer) -> DType {
        let (s, d) = self.wire[self.pieces[t.piece as usize].dst_tensor as usize];
        if t.to.group == Group::Src {
            s
        } else {
            wire_dtype(s, d)
        }
    }

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

    /// Per piece, its bytes on the wire to a destination rank and to a
    /// source rank (see [`wire_bytes`](Self::wire_bytes)).
    fn piece_bytes(&self) -> Vec<(u64, u64)> {
        self.pieces
            .iter()
            .map(|p| {
                let (s, d) = self.wire[p.dst_tensor as usize];
                let numel = p.block.numel();
                (numel * wire_dtype(s, d).size(), numel * s.size())
            })
            .collect()
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
        /// A transfer between ranks: sender (its top bit set when the
        /// transfer crosses nodes), receiver and bytes.
        #[derive(Clone, Copy, Default)]
        struct Rec {
            from: u32,
            to: u32,
            bytes: u64,
        }
        const CROSS: u32 = 1 << 31;
        let n = (self.src_ranks + self.dst_ranks) as usize;
        let rounds = rounds as usize;
        // Transfers between ranks, with their round from `first` (no
        // planner makes one outside the rounds counted).
        let moves =
            || run.iter().filter(|t| t.from != t.to).map(|t| (t, t.round.wrapping_sub(first) as usize)).filter(|&(_, r)| r < rounds);
        // Records bucketed by round: `recs[start[r]..start[r + 1]]`.
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
        drop(next);
        // Per rank, for the round at hand: bytes (net out, net in, intra
        // out, intra in), messages sent, whether it takes part, and its
        // slot among the round's senders.
        let mut loads = vec![[0u64; 4]; n];
        let mut msgs = vec![0u64; n];
        let mut active = vec![false; n];
        let mut touched: Vec<usize> = Vec::new();
        const NONE: u32 = u32::MAX;
        let mut slot = vec![NONE; n];
        let mut senders: Vec<usize> = Vec::new();
        let mut grouped: Vec<Rec> = Vec::new();
        // Per receiver, the last sender group that reached it, so that each
        // (sender, receiver) pair of a round counts one message.
        let mut seen = vec![0u64; n];
        let mut epoch = 0u64;
        let mut busiest = vec![0.0f64; rounds];
        for (r, worst) in busiest.iter_mut().enumerate() {
            let bucket = &recs[start[r]..start[r + 1]];
            if bucket.is_empty() {
                continue;
            }
            // The round's records grouped by sender (a counting sort over
            // the senders present, in order of first appearance).
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
            grouped.clear();
            grouped.resize(bucket.len(), Rec::default());
            for rec in bucket {
                let s = &mut senders[slot[(rec.from & !CROSS) as usize] as usize];
                grouped[*s] = *rec;
                *s += 1;
            }
            let mut sender = usize::MAX;
            for rec in &grouped {
                let (a, z) = ((rec.from & !CROSS) as usize, rec.to as usize);
                if a != sender {
                    sender = a;
                    epoch += 1;
                }
                let (out, inn) = if rec.from & CROSS != 0 { (0, 1) } else { (2, 3) };
                loads[a][out] += rec.bytes;
                loads[z][inn] += rec.bytes;
                if seen[z] != epoch {
                    seen[z] = epoch;
                    msgs[a] += 1;
                }
                for e in [a, z] {
                    if !active[e] {
                        active[e] = true;
                        touched.push(e);
                    }
                }
            }
            for &e in &touched {
                *worst = (*worst).max(rank_round_seconds(&loads[e], msgs[e], links));
                loads[e] = [0; 4];
                msgs[e] = 0;
                active[e] = false;
                slot[e] = NONE;
            }
            touched.clear();
        }
        busiest
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

    /// The block held by the scratch buffer of destination tensor `t`
    /// (baseline plans only).
    pub fn scratch_block(&self, t: u32) -> Option<&Block> {
        self.scratch_blocks.get(t as usize)
    }

    /// Per destination node, bytes of the union of what its ranks need (in
    /// wire dtype): the least that must enter the node.
    pub fn needed_node_bytes(&self) -> &[u64] {
        &self.needed_node_bytes
    }
}

/// Seconds one rank is busy in one round: the slower of its network and
/// intra-node links (each the larger of its two directions' bytes over the
/// bandwidth), plus the latency of the messages it sends. `loads` are bytes
/// out and in over the network, then out and in inside the node.
pub(crate) fn rank_round_seconds(loads: &[u64; 4], messages: u64, links: &LinkModel) -> f64 {
    let net = loads[0].max(loads[1]) as f64 / links.net_bytes_per_s;
    let intra = loads[2].max(loads[3]) as f64 / links.intra_bytes_per_s;
    net.max(intra) + messages as f64 * links.message_latency_s
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

/// Transfers with their rounds, as a planner that assigns rounds itself
/// made them.
pub(crate) struct Scheduled {
    /// All transfers, in stage order.
    pub(crate) transfers: Vec<Transfer>,
    /// Number of rounds.
    pub(crate) rounds: u32,
    /// Number of stages.
    pub(crate) stages: u32,
}

/// What a planner produced, before rounds and figures.
pub(crate) struct PlanParts {
    pub(crate) pieces: Vec<Piece>,
    pub(crate) wire: Vec<(DType, DType)>,
    pub(crate) needed_node_bytes: Vec<u64>,
    pub(crate) unique_bytes: u64,
    pub(crate) scratch_blocks: Vec<Block>,
}

impl Plan {
    /// Builds a plan from a planner's parts and its transfers by stage:
    /// assigns rounds and computes the figures.
    pub(crate) fn assemble(
        strategy: Strategy,
        src: &Layout,
        dst: &Layout,
        options: &PlanOptions,
        parts: PlanParts,
        by_stage: Vec<Vec<Transfer>>,
    ) -> Plan {
        let mut plan = Plan {
            strategy,
            fingerprint: fingerprint(src, dst, options, strategy),
            options: *options,
            src_ranks: src.ranks(),
            dst_ranks: dst.ranks(),
            src_rpn: src.ranks_per_node(),
            dst_rpn: dst.ranks_per_node(),
            pieces: parts.pieces,
            transfers: Vec::new(),
            wire: parts.wire,
            figures: Figures::default(),
            needed_node_bytes: parts.needed_node_bytes,
            unique_bytes: parts.unique_bytes,
            scratch_blocks: parts.scratch_blocks,
        };
        finish(&mut plan, by_stage);
        plan
    }

    /// Builds a plan from a planner's parts and its transfers with their
    /// rounds already assigned: computes the figures.
    pub(crate) fn assemble_in_rounds(
        strategy: Strategy,
        src: &Layout,
        dst: &Layout,
        options: &PlanOptions,
        parts: PlanParts,
        scheduled: Scheduled,
    ) -> Plan {
        let Scheduled { transfers, rounds, stages } = scheduled;
        let mut plan = Plan {
            strategy,
            fingerprint: fingerprint(src, dst, options, strategy),
            options: *options,
            src_ranks: src.ranks(),
            dst_ranks: dst.ranks(),
            src_rpn: src.ranks_per_node(),
            dst_rpn: dst.ranks_per_node(),
            pieces: parts.pieces,
            transfers,
            wire: parts.wire,
            figures: Figures::default(),
            needed_node_bytes: parts.needed_node_bytes,
            unique_bytes: parts.unique_bytes,
            scratch_blocks: parts.scratch_blocks,
        };
        let piece_bytes: Vec<(u64, u64)> = plan
            .pieces
            .iter()
            .map(|p| {
                let (s, d) = plan.wire[p.dst_tensor as usize];
                let numel = p.block.numel();
                (numel * wire_dtype(s, d).size(), numel * s.size())
            })
            .collect();
        plan.figures = count_figures(&plan, &piece_bytes, rounds, stages);
        plan
    }
}

/// Most memory [`Plan::estimate`] gives per-round, per-rank counters for
/// one stage before it buckets the stage's transfers by round instead.
const DENSE_ESTIMATE_BYTES: u64 = 32 << 20;

/// Most pieces one plan may have.
pub const MAX_PIECES: u64 = 1 << 28;

/// The fingerprint of a planning problem.
pub fn fingerprint(src: &Layout, dst: &Layout, options: &PlanOptions, strategy: Strategy) -> Fingerprint {
    let mut h = Fnv64::default();
    src.ranks().hash(&mut h);
    src.ranks_per_node().hash(&mut h);
    src.tensors().hash(&mut h);
    dst.ranks().hash(&mut h);
    dst.ranks_per_node().hash(&mut h);
    dst.tensors().hash(&mut h);
    options.hash(&mut h);
    strategy.hash(&mut h);
    Fingerprint(h.finish() ^ fnv64("refit-plan-v1"))
}

/// Assigns rounds to transfers, stage by stage, so that no rank stages more
/// than the cap in one round (every transfer fits on its own), puts the
/// stages' transfers in one list, and computes the figures.
fn finish(plan: &mut Plan, mut by_stage: Vec<Vec<Transfer>>) {
    let cap = plan.options.max_staging_bytes.max(1);
    let n_src = plan.src_ranks as usize;
    let n = n_src + plan.dst_ranks as usize;
    let idx = |e: Endpoint| match e.group {
        Group::Src => e.rank as usize,
        Group::Dst => n_src + e.rank as usize,
    };
    while by_stage.last().is_some_and(Vec::is_empty) {
        by_stage.pop();
    }
    let stages = by_stage.len();
    // Wire bytes per piece, for destination and for source receivers.
    let piece_bytes: Vec<(u64, u64)> = plan
        .pieces
        .iter()
        .map(|p| {
            let (s, d) = plan.wire[p.dst_tensor as usize];
            let numel = p.block.numel();
            (numel * wire_dtype(s, d).size(), numel * s.size())
        })
        .collect();
    let bytes_of = |t: &Transfer| {
        let b = piece_bytes[t.piece as usize];
        if t.to.group == Group::Src {
            b.1
        } else {
            b.0
        }
    };
    // First-fit round assignment. Per endpoint: bytes per round of this
    // stage, and a skip list (union-find with path halving) over rounds that
    // are nearly full, so a search jumps over them instead of scanning.
    let mut base = 0u32;
    let mut loads: Vec<Vec<u64>> = vec![Vec::new(); n];
    let mut skip: Vec<Vec<u32>> = vec![Vec::new(); n];
    // A round counts as full once less than 1/16 of the cap is left.
    let nearly_full = cap - cap / 16;
    for list in by_stage.iter_mut() {
        loads.iter_mut().for_each(Vec::clear);
        skip.iter_mut().for_each(Vec::clear);
        let mut stage_rounds = 0u32;
        for t in list.iter_mut() {
            if t.from == t.to {
                t.round = base;
                stage_rounds = stage_rounds.max(1);
                continue;
            }
            let b = bytes_of(t);
            let (a, z) = (idx(t.from), idx(t.to));
            let fits = |loads: &Vec<Vec<u64>>, e: usize, r: u32| {
                let l = loads[e].get(r as usize).copied().unwrap_or(0);
                l == 0 || l + b <= cap
            };
            let mut r = 0u32;
            loop {
                let ra = open_round(&mut skip[a], r);
                let rz = open_round(&mut skip[z], ra);
                if rz != ra {
                    r = rz;
                    continue;
                }
                if fits(&loads, a, ra) && fits(&loads, z, ra) {
                    r = ra;
                    break;
                }
                r = ra + 1;
            }
            for e in [a, z] {
                if loads[e].len() <= r as usize {
                    loads[e].resize(r as usize + 1, 0);
                }
                loads[e][r as usize] += b;
                if loads[e][r as usize] >= nearly_full {
                    let s = &mut skip[e];
                    if s.len() <= r as usize + 1 {
                        let from = s.len() as u32;
                        s.extend(from..r + 2);
                    }
                    s[r as usize] = r + 1;
                }
            }
            t.round = base + r;
            stage_rounds = stage_rounds.max(r + 1);
        }
        base += stage_rounds;
    }
    drop((loads, skip));
    // Stages in order, in one vector (the first stage's, usually the
    // largest, is extended in place).
    let mut all = by_stage.first_mut().map(std::mem::take).unwrap_or_default();
    for rest in by_stage.iter_mut().skip(1) {
        all.append(rest);
    }
    drop(by_stage);
    plan.transfers = all;
    plan.figures = count_figures(plan, &piece_bytes, base, stages as u32);
}

/// The figures of a plan whose transfers have their rounds: `piece_bytes`
/// gives each piece's wire bytes to a destination and to a source receiver,
/// `rounds` and `stages` the numbers of rounds and stages.
fn count_figures(plan: &Plan, piece_bytes: &[(u64, u64)], rounds: u32, stages: u32) -> Figures {
    let n_src = plan.src_ranks as usize;
    let n = n_src + plan.dst_ranks as usize;
    let idx = |e: Endpoint| match e.group {
        Group::Src => e.rank as usize,
        Group::Dst => n_src + e.rank as usize,
    };
    let bytes_of = |t: &Transfer| {
        let b = piece_bytes[t.piece as usize];
        if t.to.group == Group::Src {
            b.1
        } else {
            b.0
        }
    };
    let base = rounds;
    let mut f = Figures {
        dst_node_ingress_bytes: vec![0; plan.dst_ranks.div_ceil(plan.dst_rpn) as usize],
        rounds: base,
        stages,
        pieces: plan.pieces.len() as u64,
        transfers: plan.transfers.len() as u64,
        ..Figures::default()
    };
    let mut sent = vec![0u64; n];
    let mut recv = vec![0u64; n];
    let (mut sent_msgs, mut recv_msgs) = (vec![0u64; n], vec![0u64; n]);
    // Node of every endpoint; source and destination nodes are distinct.
    let node: Vec<(Group, u32)> = (0..n)
        .map(|i| if i < n_src { plan.node_of(Endpoint::src(i as u32)) } else { plan.node_of(Endpoint::dst((i - n_src) as u32)) })
        .collect();
    // Messages: distinct (sender, receiver, round) triples, counted with a
    // bitmap over them (a hash set where the bitmap would be too large).
    let bits = (n * n) as u64 * base as u64;
    let mut bitmap: Vec<u64> = if bits <= 1 << 31 { vec![0; bits.div_ceil(64) as usize] } else { Vec::new() };
    let mut seen: std::collections::HashSet<(usize, usize, u32)> = std::collections::HashSet::new();
    for t in &plan.transfers {
        if t.from == t.to {
            continue;
        }
        let b = bytes_of(t);
        let (a, z) = (idx(t.from), idx(t.to));
        f.total_bytes += b;
        sent[a] += b;
        recv[z] += b;
        if t.from.group == Group::Src {
            f.src_egress_bytes += b;
        }
        let (from_node, to_node) = (node[a], node[z]);
        if from_node != to_node {
            f.cross_node_bytes += b;
            if t.to.group == Group::Dst {
                f.dst_node_ingress_bytes[to_node.1 as usize] += b;
            }
        }
        let new = if bitmap.is_empty() {
            seen.insert((a, z, t.round))
        } else {
            let bit = ((a * n + z) as u64 * base as u64 + t.round as u64) as usize;
            let (word, mask) = (bit / 64, 1u64 << (bit % 64));
            let new = bitmap[word] & mask == 0;
            bitmap[word] |= mask;
            new
        };
        f.messages += new as u64;
        sent_msgs[a] += new as u64;
        recv_msgs[z] += new as u64;
    }
    f.max_rank_send_messages = sent_msgs.into_iter().max().unwrap_or(0);
    f.max_rank_recv_messages = recv_msgs.into_iter().max().unwrap_or(0);
    f.max_rank_send_bytes = sent.into_iter().max().unwrap_or(0);
    f.max_rank_recv_bytes = recv.into_iter().max().unwrap_or(0);
    f
}

/// The first round at or after `r` not marked full in `skip` (where
/// `skip[x] != x` means round `x` is full); path halving keeps it near O(1).
fn open_round(skip: &mut [u32], mut r: u32) -> u32 {
    while (r as usize) < skip.len() && skip[r as usize] != r {
        let next = skip[r as usize];
        if (next as usize) < skip.len() {
            skip[r as usize] = skip[next as usize];
        }
        r = next;
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{parse_layout, plan_baseline, plan_reshard};

    /// Both ways of counting give the same estimate: one pass over
    /// per-round counters, bucketing by round, and either over transfers in
    /// any order (one run of all rounds).
    #[test]
    fn estimate_is_the_same_however_it_is_counted() {
        let src = parse_layout(include_str!("../../examples/mixed-2d/src.json")).unwrap();
        let dst = parse_layout(include_str!("../../examples/mixed-2d/dst.json")).unwrap();
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
