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
    /// The source group: the training ranks.
    Src,
    /// The destination group: the inference ranks.
    Dst,
}

impl std::fmt::Display for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Group::Src => "src",
            Group::Dst => "dst",
        })
    }
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
#[derive(Clone, Debug, PartialEq)]
pub struct PlanOptions {
    /// Most bytes a rank stages (sends plus receives) in one round.
    pub max_staging_bytes: u64,
    /// Link bandwidths used to choose senders and relays.
    pub links: LinkModel,
    /// Least bytes of each part when the reshard planner splits a piece
    /// among several source ranks that hold it (replicas, or holdings cut
    /// differently): a piece is split only into parts at least this large
    /// (so only pieces of at least twice this), which bounds how many more
    /// pieces and transfers splitting makes. `u64::MAX`: never split.
    pub min_split_bytes: u64,
    /// Plan only these destination tensors (a *subset refit*: LoRA
    /// adapters, one stage's weights); `None`: every tensor. The plan moves
    /// nothing of the others, and its programs name the destination
    /// buffers that hold any of them ([`RankProgram::carried`](crate::RankProgram::carried)), whose bytes
    /// a refit must keep from the version the destination serves.
    pub only: Option<TensorSubset>,
}

/// Names of destination tensors, sorted and without duplicates.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorSubset(std::sync::Arc<[String]>);

impl TensorSubset {
    /// The subset of these names (any order, duplicates dropped).
    pub fn new<S: Into<String>>(names: impl IntoIterator<Item = S>) -> TensorSubset {
        let mut v: Vec<String> = names.into_iter().map(Into::into).collect();
        v.sort_unstable();
        v.dedup();
        TensorSubset(v.into())
    }

    /// The names, sorted.
    pub fn names(&self) -> &[String] {
        &self.0
    }

    /// Which of `dst`'s tensors are in the subset, by index (a block-scaled
    /// tensor and its scale tensor both, if either is named); an error
    /// names the first name `dst` does not have, or an empty subset.
    pub fn mask(&self, dst: &Layout) -> Result<Vec<bool>, PlanError> {
        if self.0.is_empty() {
            return Err(PlanError::EmptySubset);
        }
        let mut mask = vec![false; dst.tensors().len()];
        for name in self.0.iter() {
            let i = dst.tensor_index(name).ok_or_else(|| PlanError::UnknownSubsetTensor { tensor: name.clone() })?;
            mask[i as usize] = true;
        }
        // A block-scaled tensor and its scale are written together.
        for t in 0..mask.len() as u32 {
            if let Some((s, _)) = dst.scale_of(t) {
                let both = mask[t as usize] || mask[s as usize];
                mask[t as usize] = both;
                mask[s as usize] = both;
            }
        }
        Ok(mask)
    }
}

/// The default of [`PlanOptions::min_split_bytes`]: 64 KiB per part.
pub const DEFAULT_MIN_SPLIT_BYTES: u64 = 64 << 10;

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions { max_staging_bytes: 256 << 20, links: LinkModel::default(), min_split_bytes: DEFAULT_MIN_SPLIT_BYTES, only: None }
    }
}

impl Hash for PlanOptions {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.max_staging_bytes.hash(h);
        self.min_split_bytes.hash(h);
        self.links.net_bytes_per_s.to_bits().hash(h);
        self.links.intra_bytes_per_s.to_bits().hash(h);
        self.links.message_latency_s.to_bits().hash(h);
        self.only.hash(h);
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
///
/// **Bytes moved** is [`total_bytes`](Self::total_bytes): the payload of
/// every message between two ranks, counted once per message in the dtype
/// it travels in. It is the one figure `refit plan`, `refit run`,
/// `refit bench` and `orchestrator::RefitReport::bytes` report under that name, and it
/// splits exactly into bytes sent by source ranks
/// ([`src_egress_bytes`](Self::src_egress_bytes)) and bytes that
/// destination ranks forward to other destination ranks
/// ([`relayed_bytes`](Self::relayed_bytes)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Figures {
    /// Bytes sent by source ranks (to destination ranks, and, in the
    /// baseline's gather, to other source ranks).
    pub src_egress_bytes: u64,
    /// Per source rank, the bytes it sends to other nodes (over its NIC):
    /// its part of [`src_egress_bytes`](Self::src_egress_bytes), less what
    /// it sends to ranks of its own node (the baseline's gather inside a
    /// node). One entry per source rank.
    pub src_rank_egress_bytes: Vec<u64>,
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
    /// Bytes moved: every message's payload between two ranks (see the
    /// type's doc).
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

impl Figures {
    /// Bytes destination ranks forward to other destination ranks: the
    /// fan-out inside a destination node (reshard), or the broadcast tree
    /// among destinations (baseline). `total_bytes - src_egress_bytes`.
    pub fn relayed_bytes(&self) -> u64 {
        self.total_bytes.saturating_sub(self.src_egress_bytes)
    }

    /// Most bytes one source rank sends to other nodes (the largest of
    /// [`src_rank_egress_bytes`](Self::src_rank_egress_bytes); 0 when there
    /// are none).
    pub fn max_src_rank_egress_bytes(&self) -> u64 {
        self.src_rank_egress_bytes.iter().copied().max().unwrap_or(0)
    }
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
    /// A subset refit names a tensor the destination layout lacks.
    #[error("tensor '{tensor}' named for a subset refit is not in the destination layout")]
    UnknownSubsetTensor {
        /// The name.
        tensor: String,
    },
    /// A subset refit names no tensor.
    #[error("a subset refit must name at least one tensor")]
    EmptySubset,
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
    #[error("tensor '{tensor}': cannot convert {from} to {to} (only f64/f32/bf16/f16 convert among themselves, and to an f8e4m3 destination that has a block scale)")]
    Conversion {
        /// Tensor name.
        tensor: String,
        /// Source dtype.
        from: DType,
        /// Destination dtype.
        to: DType,
    },
    /// A block-scaled destination's source is not a float it quantizes.
    #[error("tensor '{tensor}': cannot quantize {from} to block-scaled f8e4m3 (the source must be f64, f32, bf16 or f16)")]
    Quantize {
        /// Tensor name.
        tensor: String,
        /// Source dtype.
        from: DType,
    },
    /// A source tensor is block-scaled.
    #[error("tensor '{tensor}': block-scaled source tensors are not supported (a scale belongs to a destination layout)")]
    ScaledSource {
        /// Tensor name.
        tensor: String,
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
    /// Builds a plan from a planner's parts and its transfers grouped by
    /// stage and pair of ranks: assigns rounds, lays the transfers out by
    /// stage and pair, and computes the figures.
    pub(crate) fn assemble_by_sender(
        strategy: Strategy,
        src: &Layout,
        dst: &Layout,
        options: &PlanOptions,
        parts: PlanParts,
        lists: SenderLists,
    ) -> Plan {
        let mut plan = Plan::skeleton(strategy, src, dst, options, parts);
        finish_by_sender(&mut plan, lists);
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
        let mut plan = Plan::skeleton(strategy, src, dst, options, parts);
        plan.transfers = transfers;
        let piece_bytes = plan.piece_bytes();
        plan.figures = count_figures(&plan, &piece_bytes, rounds, stages);
        plan
    }

    /// A plan without transfers or figures yet.
    fn skeleton(strategy: Strategy, src: &Layout, dst: &Layout, options: &PlanOptions, parts: PlanParts) -> Plan {
        Plan {
            strategy,
            fingerprint: fingerprint(src, dst, options, strategy),
            options: options.clone(),
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
        }
    }
}

/// A planner's transfers grouped by stage and by sender: the receiver
/// and piece of each, in the order they were added. Every transfer goes to
/// a destination rank and reads and writes the ranks' own shards (no
/// scratch buffers).
pub(crate) struct SenderLists {
    n_src: usize,
    n: usize,
    /// Per stage, per sender (endpoint index).
    stages: Vec<Vec<Sends>>,
    len: usize,
}

/// One sender's transfers in one stage of [`SenderLists`].
#[derive(Clone)]
struct Sends {
    /// (receiver, piece), in the order added.
    to: Vec<(u32, u32)>,
    /// Where the bytes of a transfer change: (position in `to`, bytes from
    /// there on). A planner that adds pieces by size adds few.
    bytes: Vec<(u32, u64)>,
    /// The bytes of the last transfer added (`u64::MAX`: none yet).
    last: u64,
}

impl Default for Sends {
    fn default() -> Self {
        Sends { to: Vec::new(), bytes: Vec::new(), last: u64::MAX }
    }
}

impl SenderLists {
    /// No transfers yet between `src_ranks` and `dst_ranks` ranks; room for
    /// about `expected` source sends in stage 0, spread evenly (lists that
    /// outgrow it grow as usual).
    pub(crate) fn new(src_ranks: u32, dst_ranks: u32, expected: usize) -> SenderLists {
        let n_src = src_ranks as usize;
        let n = n_src + dst_ranks as usize;
        let each = expected.div_ceil(n_src.max(1));
        let stage0 = (0..n)
            .map(|a| Sends { to: if a < n_src { Vec::with_capacity(each + each / 8) } else { Vec::new() }, ..Sends::default() })
            .collect();
        SenderLists { n_src, n, stages: vec![stage0], len: 0 }
    }

    /// Adds the transfer of `piece` (`bytes` on the wire) from `from` to
    /// `to` in `stage`.
    #[inline(always)]
    pub(crate) fn push(&mut self, stage: u16, from: Endpoint, to: Endpoint, piece: u32, bytes: u64) {
        debug_assert_eq!(to.group, Group::Dst);
        let index = |e: Endpoint| match e.group {
            Group::Src => e.rank as usize,
            Group::Dst => self.n_src + e.rank as usize,
        };
        let (a, z) = (index(from), index(to));
        while self.stages.len() <= stage as usize {
            self.stages.push(vec![Sends::default(); self.n]);
        }
        let sends = &mut self.stages[stage as usize][a];
        if sends.last != bytes {
            sends.last = bytes;
            sends.bytes.push((sends.to.len() as u32, bytes));
        }
        sends.to.push((z as u32, piece));
        self.len += 1;
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

/// Assigns rounds to transfers grouped by sender, stage by stage (see
/// [`RoundPacker`]), lays them out by stage, sender, then the order they
/// were added in, and computes the figures.
fn finish_by_sender(plan: &mut Plan, mut lists: SenderLists) {
    while lists.stages.last().is_some_and(|s| s.iter().all(|sends| sends.to.is_empty())) {
        lists.stages.pop();
    }
    let mut packer = RoundPacker::new(plan);
    let mut all = Vec::with_capacity(lists.len);
    let mut base = 0u32;
    let stages = lists.stages.len() as u32;
    for (stage, senders) in lists.stages.iter_mut().enumerate() {
        base += packer.stage_by_sender(senders, stage as u16, base, &mut all);
    }
    plan.figures = figures(plan, &packer, stages, base, all.len());
    plan.transfers = all;
}

/// The figures, from the bytes and messages of every pair of ranks.
fn figures(plan: &Plan, packer: &RoundPacker, stages: u32, rounds: u32, transfers: usize) -> Figures {
    let (n_src, n) = (packer.n_src, packer.n);
    let mut f = Figures {
        dst_node_ingress_bytes: vec![0; plan.dst_ranks.div_ceil(plan.dst_rpn) as usize],
        src_rank_egress_bytes: vec![0; n_src],
        stages,
        pieces: plan.pieces.len() as u64,
        transfers: transfers as u64,
        rounds,
        messages: packer.messages,
        ..Figures::default()
    };
    let (mut sent, mut recv) = (vec![0u64; n], vec![0u64; n]);
    // Node of every endpoint; source and destination nodes are distinct.
    let node: Vec<(Group, u32)> = (0..n)
        .map(|i| if i < n_src { plan.node_of(Endpoint::src(i as u32)) } else { plan.node_of(Endpoint::dst((i - n_src) as u32)) })
        .collect();
    for &(a, z, b) in &packer.traffic {
        let (a, z) = (a as usize, z as usize);
        f.total_bytes += b;
        sent[a] += b;
        recv[z] += b;
        if a < n_src {
            f.src_egress_bytes += b;
        }
        let (from_node, to_node) = (node[a], node[z]);
        if from_node != to_node {
            f.cross_node_bytes += b;
            if a < n_src {
                f.src_rank_egress_bytes[a] += b;
            }
            if to_node.0 == Group::Dst {
                f.dst_node_ingress_bytes[to_node.1 as usize] += b;
            }
        }
    }
    f.max_rank_send_messages = packer.sent_msgs.iter().copied().max().unwrap_or(0);
    f.max_rank_recv_messages = packer.recv_msgs.iter().copied().max().unwrap_or(0);
    f.max_rank_send_bytes = sent.into_iter().max().unwrap_or(0);
    f.max_rank_recv_bytes = recv.into_iter().max().unwrap_or(0);
    f
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
        src_rank_egress_bytes: vec![0; n_src],
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
            if t.from.group == Group::Src {
                f.src_rank_egress_bytes[a] += b;
            }
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

/// No run, or no pair.
const NONE: u32 = u32::MAX;

/// Consecutive transfers of one pair (in the order they were read) with the
/// same bytes.
#[derive(Clone, Copy)]
struct Run {
    bytes: u64,
    /// Position (among the pair's transfers) of its first transfer not yet
    /// given a round, and how many are left (they follow it).
    start: u32,
    count: u32,
    /// Neighbours in the pair's list of runs (largest bytes first).
    prev: u32,
    next: u32,
}

/// One pair of ranks while a stage's rounds are assigned.
#[derive(Clone, Copy)]
struct Pair {
    /// Sender and receiver (endpoint indices).
    from: u32,
    to: u32,
    /// Its transfers, and how many were given a round.
    total: u32,
    taken: u32,
    /// Its runs with transfers left, largest first: the first and the
    /// last.
    head: u32,
    tail: u32,
    /// The last round it was visited.
    visited: u32,
    /// Bytes of its smallest transfer left.
    edge: u64,
    /// Whether it has taken anything.
    started: bool,
}

/// A pair while the stage's transfers are read: its transfers so far, its
/// last run, and that run's bytes and length.
#[derive(Clone, Copy)]
struct Reading {
    bytes: u64,
    total: u32,
    tail: u32,
    count: u32,
}

impl Default for Reading {
    fn default() -> Self {
        Reading { bytes: 0, total: 0, tail: NONE, count: 0 }
    }
}

/// Adds a transfer of `bytes` to a pair being read, after the earlier ones:
/// its last run grows, or a new run (in `runs`) begins.
#[inline]
fn read(pair: &mut Reading, runs: &mut Vec<Run>, bytes: u64) {
    pair.total += 1;
    if pair.tail != NONE && pair.bytes == bytes {
        pair.count += 1;
    } else {
        let r = runs.len() as u32;
        let tail = std::mem::replace(&mut pair.tail, r);
        pair.bytes = bytes;
        let count = std::mem::replace(&mut pair.count, 1);
        if tail != NONE {
            runs[tail as usize].count = count;
            runs[tail as usize].next = r;
        }
        runs.push(Run { bytes, start: pair.total - 1, count: 0, prev: tail, next: NONE });
    }
}

/// A receiver's pair with the sender at hand, while a stage of
/// [`SenderLists`] is read and then written.
#[derive(Clone, Copy, Default)]
struct With {
    reading: Reading,
    writing: Writing,
}

/// A pair while rounds are written into the stage's transfers (in the
/// order they were read): its current segment, how many of its transfers
/// are left in it, and its round.
#[derive(Clone, Copy, Default)]
struct Writing {
    segment: u32,
    left: u32,
    round: u32,
}

/// Round assignment of one stage at a time, by pairs of ranks.
///
/// All transfers of a stage from one sender to one receiver form a
/// *pair*; the pieces of a pair that share a round travel as one message,
/// so a pair should span as few rounds as it can. Rounds are filled one
/// after another. In each round the ranks are visited busiest first (most
/// bytes still to stage in this stage), so the ranks that bound the number
/// of rounds are served every round. A rank with room first continues the
/// pairs it has already started (oldest first), then starts new ones, each
/// time the one whose other end has the most bytes left among those where
/// something fits at both ends. A pair takes its largest transfers while
/// they fit at both ends, then fills what is left with its smallest. So a
/// rank streams its pairs one after another and a pair splits only where a
/// round fills up: a rank sends or receives about one message per round
/// plus one per peer, not one per peer and round.
///
/// A round never puts more than the cap on a rank, except a transfer larger
/// than the cap, which travels alone (both its ends empty). Every round
/// places at least one transfer (the first rank visited has an empty
/// round), so the assignment ends. Ties go by rank and pair index, so the
/// result is deterministic.
///
/// A pair's transfers are kept as runs of equal bytes (a model has few
/// distinct piece sizes), largest first, and what a pair takes in a round
/// as a segment of its transfers (by position in the order they were
/// read), so the work per round is per pair, not per transfer; rounds are
/// written into the transfers in one pass at the end of the stage.
struct RoundPacker {
    n: usize,
    n_src: usize,
    cap: u64,
    /// The stage's pairs: their ends, then their state while transfers are
    /// read, while rounds are filled and while rounds are written (small
    /// records for the passes over every transfer).
    ends: Vec<(u32, u32)>,
    reading: Vec<Reading>,
    pairs: Vec<Pair>,
    writing: Vec<Writing>,
    /// Per endpoint: its pair with the sender at hand, while a stage of
    /// [`SenderLists`] is read and written.
    with: Vec<With>,
    runs: Vec<Run>,
    /// What pairs took: (pair << 32 | first position, count, round).
    segments: Vec<(u64, u32, u32)>,
    /// Per endpoint: bytes left in the stage, bytes in the current round,
    /// its smallest transfer, pairs started (oldest first) and not started
    /// (with the other end).
    left: Vec<u64>,
    load: Vec<u64>,
    smallest: Vec<u64>,
    open: Vec<Vec<u32>>,
    waiting: Vec<Vec<(u32, u32)>>,
    /// Endpoints with load in the current round, and the visiting order.
    touched: Vec<u32>,
    order: Vec<u32>,
    /// Messages, and messages per endpoint sent and received.
    messages: u64,
    sent_msgs: Vec<u64>,
    recv_msgs: Vec<u64>,
    /// Bytes from sender to receiver, per pair of every stage.
    traffic: Vec<(u32, u32, u64)>,
}

impl RoundPacker {
    fn new(plan: &Plan) -> RoundPacker {
        let n_src = plan.src_ranks as usize;
        let n = n_src + plan.dst_ranks as usize;
        let cap = plan.options.max_staging_bytes.max(1);
        RoundPacker {
            n,
            n_src,
            cap,
            ends: Vec::new(),
            reading: Vec::new(),
            pairs: Vec::new(),
            writing: Vec::new(),
            with: Vec::new(),
            runs: Vec::new(),
            segments: Vec::new(),
            left: vec![0; n],
            load: vec![0; n],
            smallest: vec![u64::MAX; n],
            open: vec![Vec::new(); n],
            waiting: vec![Vec::new(); n],
            touched: Vec::new(),
            order: Vec::new(),
            messages: 0,
            sent_msgs: vec![0; n],
            recv_msgs: vec![0; n],
            traffic: Vec::new(),
        }
    }

    /// Room left on endpoint `e` in this round (anything fits an empty one).
    #[inline]
    fn room(&self, e: u32) -> u64 {
        match self.load[e as usize] {
            0 => u64::MAX,
            l => self.cap.saturating_sub(l),
        }
    }

    /// Assigns rounds `base..` to one stage of [`SenderLists`]: appends its
    /// transfers to `out` with rounds `base..`, sender after sender, each
    /// sender's in the order they were added (and then frees its list).
    /// Pairs are numbered by sender, then by first appearance of the
    /// receiver.
    fn stage_by_sender(&mut self, senders: &mut [Sends], stage: u16, base: u32, out: &mut Vec<Transfer>) -> u32 {
        // Per receiver: its pair with the sender at hand, read, then
        // written (one load a transfer, not two).
        let mut with = std::mem::take(&mut self.with);
        with.clear();
        with.resize(self.n, With::default());
        // Per sender, its first pair.
        let mut first = Vec::with_capacity(senders.len() + 1);
        for (a, sends) in senders.iter().enumerate() {
            first.push(self.ends.len() as u32);
            let mut sizes = sends.bytes.iter().peekable();
            let mut bytes = 0;
            for (k, &(z, _)) in sends.to.iter().enumerate() {
                if let Some(&(_, b)) = sizes.next_if(|&&(at, _)| at as usize == k) {
                    bytes = b;
                }
                let reading = &mut with[z as usize].reading;
                if reading.total == 0 {
                    self.ends.push((a as u32, z));
                }
                read(reading, &mut self.runs, bytes);
            }
            for &(_, z) in &self.ends[first[a] as usize..] {
                self.reading.push(std::mem::take(&mut with[z as usize]).reading);
            }
        }
        first.push(self.ends.len() as u32);
        let mut rounds = 0;
        if !self.ends.is_empty() {
            self.prepare();
            rounds = self.fill_rounds();
            self.start_writing();
            let n_src = self.n_src as u32;
            let endpoint = |e: u32| if e < n_src { Endpoint::src(e) } else { Endpoint::dst(e - n_src) };
            for (a, sends) in senders.iter_mut().enumerate() {
                for p in first[a] as usize..first[a + 1] as usize {
                    with[self.ends[p].1 as usize].writing = self.writing[p];
                }
                let from = endpoint(a as u32);
                for &(z, piece) in &sends.to {
                    let pair = &mut with[z as usize].writing;
                    if pair.left == 0 {
                        pair.segment += 1;
                        (_, pair.left, pair.round) = self.segments[pair.segment as usize];
                    }
                    pair.left -= 1;
                    out.push(Transfer {
                        piece,
                        from,
                        to: endpoint(z),
                        stage,
                        from_scratch: false,
                        to_scratch: false,
                        round: base + pair.round,
                    });
                }
                *sends = Sends::default();
            }
        }
        self.with = with;
        self.reset();
        rounds
    }

    /// Once a stage's transfers are read: the pairs, their traffic, and
    /// every endpoint's bytes left, smallest transfer and waiting pairs.
    fn prepare(&mut self) {
        let mut order: Vec<u32> = Vec::new();
        for (p, (&(a, z), reading)) in self.ends.iter().zip(&self.reading).enumerate() {
            self.runs[reading.tail as usize].count = reading.count;
            // Back from its last run to its first: bytes and smallest.
            let (mut r, mut head, mut bytes, mut small) = (reading.tail, reading.tail, 0u64, u64::MAX);
            let mut sorted = true;
            while r != NONE {
                let run = &self.runs[r as usize];
                bytes += run.bytes * run.count as u64;
                small = small.min(run.bytes);
                sorted &= run.prev == NONE || self.runs[run.prev as usize].bytes >= run.bytes;
                head = r;
                r = run.prev;
            }
            let mut tail = reading.tail;
            if !sorted {
                // Largest first, then by position.
                order.clear();
                let mut r = head;
                while r != NONE {
                    order.push(r);
                    r = self.runs[r as usize].next;
                }
                order.sort_by_key(|&r| (std::cmp::Reverse(self.runs[r as usize].bytes), self.runs[r as usize].start));
                for (i, &r) in order.iter().enumerate() {
                    let run = &mut self.runs[r as usize];
                    run.prev = if i == 0 { NONE } else { order[i - 1] };
                    run.next = order.get(i + 1).copied().unwrap_or(NONE);
                }
                (head, tail) = (order[0], order[order.len() - 1]);
            }
            self.pairs.push(Pair {
                from: a,
                to: z,
                total: reading.total,
                taken: 0,
                head,
                tail,
                visited: NONE,
                edge: self.runs[tail as usize].bytes,
                started: false,
            });
            self.traffic.push((a, z, bytes));
            for (e, other) in [(a, z), (z, a)] {
                self.left[e as usize] += bytes;
                self.smallest[e as usize] = self.smallest[e as usize].min(small);
                self.waiting[e as usize].push((other, p as u32));
            }
        }
    }

    /// Clears a stage's state for the next.
    fn reset(&mut self) {
        self.ends.clear();
        self.reading.clear();
        self.pairs.clear();
        self.writing.clear();
        self.runs.clear();
        self.segments.clear();
        for e in 0..self.n {
            self.open[e].clear();
            self.waiting[e].clear();
            self.smallest[e] = u64::MAX;
            self.load[e] = 0;
        }
        self.touched.clear();
    }

    /// Fills rounds until every pair is done; returns how many it used.
    fn fill_rounds(&mut self) -> u32 {
        let mut active = self.pairs.len();
        self.order.clear();
        self.order.extend((0..self.n as u32).filter(|&e| self.left[e as usize] > 0));
        let mut round = 0u32;
        while active > 0 {
            for &e in &self.touched {
                self.load[e as usize] = 0;
            }
            self.touched.clear();
            // Busiest first; the order changes little from round to round.
            let left = &self.left;
            self.order.retain(|&e| left[e as usize] > 0);
            self.order.sort_by_key(|&e| (std::cmp::Reverse(left[e as usize]), e));
            for i in 0..self.order.len() {
                let x = self.order[i];
                active -= self.serve(x, round);
            }
            round += 1;
        }
        round
    }

    /// Serves endpoint `x` in `round`: its started pairs, then new ones,
    /// while it has room. Returns how many pairs it finished.
    fn serve(&mut self, x: u32, round: u32) -> usize {
        let xs = x as usize;
        let mut done = 0;
        if self.left[xs] == 0 || self.room(x) < self.smallest[xs] {
            return 0;
        }
        // Started pairs, oldest first (finished ones are dropped).
        let mut open = std::mem::take(&mut self.open[xs]);
        open.retain(|&p| {
            let pair = &self.pairs[p as usize];
            pair.taken < pair.total
        });
        for &p in &open {
            if self.room(x) < self.smallest[xs] {
                break;
            }
            if self.pairs[p as usize].visited != round {
                done += self.visit(p, round);
            }
        }
        self.open[xs] = open;
        // New pairs: the one whose other end has the most left, among those
        // where something fits at both ends.
        while self.left[xs] > 0 && self.room(x) >= self.smallest[xs] {
            let mut waiting = std::mem::take(&mut self.waiting[xs]);
            let room = self.room(x);
            let mut best: Option<(u64, u32)> = None;
            // Started pairs leave the list when met among those that fit
            // (the others' ends are full: checked first, cheaply).
            let mut kept = 0;
            for i in 0..waiting.len() {
                let (y, p) = waiting[i];
                waiting[kept] = (y, p);
                kept += 1;
                let room = room.min(self.room(y));
                if room < self.smallest[y as usize] {
                    continue;
                }
                let pair = &self.pairs[p as usize];
                if pair.started {
                    kept -= 1;
                    continue;
                }
                if room < pair.edge {
                    continue;
                }
                let key = self.left[y as usize];
                match best {
                    Some((k, _)) if k >= key => {}
                    _ => best = Some((key, p)),
                }
            }
            waiting.truncate(kept);
            self.waiting[xs] = waiting;
            match best {
                Some((_, p)) => done += self.visit(p, round),
                None => break,
            }
        }
        done
    }

    /// Gives pair `p` as many of its transfers as fit at both ends in
    /// `round`: its largest, then its smallest. Returns 1 if that finished
    /// the pair.
    fn visit(&mut self, p: u32, round: u32) -> usize {
        let mut pair = self.pairs[p as usize];
        pair.visited = round;
        let (a, z) = (pair.from, pair.to);
        let mut took = false;
        while pair.taken < pair.total {
            let room = self.room(a).min(self.room(z));
            let fits = |run: &Run| match room {
                u64::MAX => 1,
                _ if run.bytes == 0 => run.count,
                _ => (room / run.bytes).min(run.count as u64) as u32,
            };
            let (h, t) = (pair.head as usize, pair.tail as usize);
            let (k, first, bytes) = match (fits(&self.runs[h]), fits(&self.runs[t])) {
                (0, 0) => break,
                // The largest run's first transfers, or the smallest's last.
                (k, _) if k > 0 => {
                    let run = &mut self.runs[h];
                    let first = run.start;
                    run.start += k;
                    run.count -= k;
                    if run.count == 0 {
                        pair.head = run.next;
                    }
                    (k, first, run.bytes)
                }
                (_, k) => {
                    let run = &mut self.runs[t];
                    run.count -= k;
                    if run.count == 0 {
                        pair.tail = run.prev;
                    }
                    (k, run.start + run.count, run.bytes)
                }
            };
            pair.taken += k;
            self.segments.push(((p as u64) << 32 | first as u64, k, round));
            let b = bytes * k as u64;
            for e in [a as usize, z as usize] {
                if self.load[e] == 0 {
                    self.touched.push(e as u32);
                }
                self.load[e] += b;
                self.left[e] -= b;
            }
            took = true;
        }
        let finished = pair.taken == pair.total;
        if !finished {
            pair.edge = self.runs[pair.tail as usize].bytes;
        }
        if took {
            self.messages += 1;
            self.sent_msgs[a as usize] += 1;
            self.recv_msgs[z as usize] += 1;
            if !pair.started {
                pair.started = true;
                self.open[a as usize].push(p);
                self.open[z as usize].push(p);
            }
        }
        self.pairs[p as usize] = pair;
        finished as usize
    }

    /// Sorts the segments by pair and position (a pair's then cover its
    /// transfers one after another) and points every pair at its first.
    fn start_writing(&mut self) {
        self.segments.sort_unstable_by_key(|s| s.0);
        let mut at = 0usize;
        for p in 0..self.pairs.len() {
            let (key, left, round) = self.segments[at];
            debug_assert_eq!(key, (p as u64) << 32);
            self.writing.push(Writing { segment: at as u32, left, round });
            while at < self.segments.len() && self.segments[at].0 >> 32 == p as u64 {
                at += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{parse_layout, plan_baseline, plan_reshard};
    use std::collections::{HashMap, HashSet};

    /// Checks what the round assignment promises: every stage's rounds
    /// after the previous stage's, local copies in their stage's first
    /// round, no rank staging more than the cap in a round unless one
    /// transfer alone, and message figures that count (sender, receiver,
    /// round) triples.
    fn check_rounds(plan: &Plan) {
        let f = plan.figures();
        let cap = plan.options().max_staging_bytes;
        let mut spans: HashMap<u16, (u32, u32)> = HashMap::new();
        let mut staged: HashMap<(Endpoint, u32), (u64, u32)> = HashMap::new();
        let mut messages: HashSet<(Endpoint, Endpoint, u32)> = HashSet::new();
        for t in plan.transfers() {
            let span = spans.entry(t.stage).or_insert((u32::MAX, 0));
            *span = (span.0.min(t.round), span.1.max(t.round));
            assert!(t.round < f.rounds, "round {} of {}", t.round, f.rounds);
            if t.from == t.to {
                continue;
            }
            for e in [t.from, t.to] {
                let s = staged.entry((e, t.round)).or_insert((0, 0));
                *s = (s.0 + plan.wire_bytes(t), s.1 + 1);
            }
            messages.insert((t.from, t.to, t.round));
        }
        let mut stages: Vec<(u16, (u32, u32))> = spans.into_iter().collect();
        stages.sort_unstable();
        for w in stages.windows(2) {
            assert!(w[0].1 .1 < w[1].1 .0, "stage {} ends in round {}, stage {} begins in round {}", w[0].0, w[0].1 .1, w[1].0, w[1].1 .0);
        }
        for t in plan.transfers().iter().filter(|t| t.from == t.to) {
            assert_eq!(Some(t.round), stages.iter().find(|s| s.0 == t.stage).map(|s| s.1 .0), "local copy not in its stage's first round");
        }
        for ((e, round), (bytes, count)) in &staged {
            assert!(*bytes <= cap || *count == 1, "{e} stages {bytes} bytes in {count} transfers in round {round} (cap {cap})");
        }
        assert_eq!(f.messages, messages.len() as u64);
        let per_rank = |side: fn(&(Endpoint, Endpoint, u32)) -> Endpoint| {
            let mut n: HashMap<Endpoint, u64> = HashMap::new();
            for m in &messages {
                *n.entry(side(m)).or_default() += 1;
            }
            n.into_values().max().unwrap_or(0)
        };
        assert_eq!(f.max_rank_send_messages, per_rank(|m| m.0));
        assert_eq!(f.max_rank_recv_messages, per_rank(|m| m.1));
    }

    /// TP4 over two nodes (f32) to DP2 x TP2 over two nodes (bf16), with a
    /// replicated vector and a scalar: the reshard relays and fans out, the
    /// baseline gathers onto source ranks and copies locally.
    fn layouts() -> (Layout, Layout) {
        let tensor = |name: &str, shape: &str, placements: &str| {
            format!(r#"{{"name": "{name}", "dtype": "DT", "shape": {shape}, "mesh": {{"shape": MESH}}, "placements": {placements}}}"#)
        };
        let mut src = Vec::new();
        let mut dst = Vec::new();
        for i in 0..6 {
            src.push(tensor(&format!("w{i}"), "[32, 24]", r#"["shard(0)"]"#));
            dst.push(tensor(&format!("w{i}"), "[32, 24]", r#"["replicate", "shard(1)"]"#));
        }
        src.push(tensor("norm", "[24]", r#"["replicate"]"#));
        dst.push(tensor("norm", "[24]", r#"["replicate", "replicate"]"#));
        src.push(tensor("scale", "[]", r#"["replicate"]"#));
        dst.push(tensor("scale", "[]", r#"["replicate", "replicate"]"#));
        let file = |tensors: Vec<String>, dtype: &str, mesh: &str| {
            format!(r#"{{"ranks": 4, "ranks_per_node": 2, "tensors": [{}]}}"#, tensors.join(", "))
                .replace("DT", dtype)
                .replace("MESH", mesh)
        };
        (parse_layout(&file(src, "f32", "[4]")).unwrap(), parse_layout(&file(dst, "bf16", "[2, 2]")).unwrap())
    }

    #[test]
    fn rounds_keep_the_cap_and_the_stage_order() {
        let (src, dst) = layouts();
        // From one round for everything down to one byte (every transfer
        // then travels alone).
        for cap in [1 << 20, 1000, 200, 7, 1] {
            let options = PlanOptions { max_staging_bytes: cap, ..PlanOptions::default() };
            for plan in [plan_reshard(&src, &dst, &options).unwrap(), plan_baseline(&src, &dst, &options).unwrap()] {
                check_rounds(&plan);
                let again = match plan.strategy() {
                    Strategy::Reshard => plan_reshard(&src, &dst, &options).unwrap(),
                    Strategy::Baseline => plan_baseline(&src, &dst, &options).unwrap(),
                };
                assert_eq!(plan.transfers(), again.transfers(), "{} with cap {cap}: not deterministic", plan.strategy());
            }
        }
    }

    #[test]
    fn a_pair_takes_as_few_rounds_as_the_cap_allows() {
        // One sender and one receiver, 12 tensors of 512 bytes (bf16), a cap
        // of 4 tensors: 3 rounds, one message each, not 12.
        let tensors = |dtype: &str| {
            (0..12)
                .map(|i| format!(r#"{{"name": "t{i}", "dtype": "{dtype}", "shape": [16, 16], "mesh": {{"shape": [1]}}, "placements": ["replicate"]}}"#))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let src = parse_layout(&format!(r#"{{"ranks": 1, "tensors": [{}]}}"#, tensors("f32"))).unwrap();
        let dst = parse_layout(&format!(r#"{{"ranks": 1, "tensors": [{}]}}"#, tensors("bf16"))).unwrap();
        let options = PlanOptions { max_staging_bytes: 4 * 512, ..PlanOptions::default() };
        let plan = plan_reshard(&src, &dst, &options).unwrap();
        check_rounds(&plan);
        let f = plan.figures();
        assert_eq!((f.rounds, f.messages, f.max_rank_send_messages), (3, 3, 3), "{f:?}");
    }

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

    /// Per source rank, the bytes it sends off its node, counted from the
    /// transfers: one entry per source rank, summing to the source bytes
    /// that cross nodes (all of them in the reshard, all but the gathers
    /// inside a node in the baseline).
    #[test]
    fn src_rank_egress_is_what_each_source_rank_sends_off_its_node() {
        for (s, d) in [
            (include_str!("../../examples/mixed-2d/src.json"), include_str!("../../examples/mixed-2d/dst.json")),
            (include_str!("../../examples/tp-to-tp/src.json"), include_str!("../../examples/tp-to-tp/dst.json")),
            (include_str!("../../examples/ep-moe/src.json"), include_str!("../../examples/ep-moe/dst.json")),
        ] {
            let (src, dst) = (parse_layout(s).unwrap(), parse_layout(d).unwrap());
            for (a, b) in [(&src, &dst), (&dst, &src)] {
                for plan in [plan_reshard(a, b, &PlanOptions::default()).unwrap(), plan_baseline(a, b, &PlanOptions::default()).unwrap()] {
                    let mut want = vec![0u64; plan.src_ranks() as usize];
                    for t in plan.transfers().iter().filter(|t| t.from.group == Group::Src && plan.node_of(t.from) != plan.node_of(t.to)) {
                        want[t.from.rank as usize] += plan.wire_bytes(t);
                    }
                    let f = plan.figures();
                    assert_eq!(f.src_rank_egress_bytes, want, "{:?}", plan.strategy());
                    assert_eq!(f.max_src_rank_egress_bytes(), want.iter().copied().max().unwrap_or(0));
                    if plan.strategy() == Strategy::Reshard {
                        assert_eq!(want.iter().sum::<u64>(), f.src_egress_bytes);
                    } else {
                        assert!(want.iter().sum::<u64>() <= f.src_egress_bytes);
                    }
                }
            }
        }
    }
}
