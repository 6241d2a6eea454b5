//! The gather-and-broadcast baseline, as RL frameworks do it today: per
//! tensor, gather the whole tensor on one source rank (the first rank of its
//! mesh), broadcast it whole to every destination rank holding any of it,
//! and let each rank keep its slices. The broadcast runs the way NCCL and
//! gloo run one: pipelined in chunks, the root sending each chunk once.
//!
//! - **Chunks.** Each tensor's needed extent is cut into chunks of about
//!   [`PIPELINE_CHUNK_BYTES`] (more for large models, at most half the
//!   staging cap); every chunk is gathered, forwarded and copied out on its
//!   own, so a rank forwards one chunk while it takes in the next.
//! - **Tree.** A chunk goes from the root to one leader per destination
//!   node: the first node's, which forwards it to the next node's, and so
//!   on (nodes ascending); each leader also starts a chain through its
//!   node's other receivers. Every receiver gets the whole chunk once.
//!   Tensors take turns (channels, as NCCL's): in turn `c` the `c`-th
//!   receiver of each node leads, so the nodes' ranks share the network
//!   links; all chunks of one tensor take the same turn, so its last
//!   receivers on each node only keep their slices (the executor then
//!   copies their slices straight out of what arrives).
//! - **Rounds.** Transfers are placed first-fit, chunk by chunk in tensor
//!   order, each in the first round in which both its ranks have room and
//!   not before the data is there: a gather from round 0, a chunk's first
//!   hop after its gathers, each later hop after the one that brought it,
//!   each rank's copy of its slices after its chunk arrived. A round gives
//!   each rank one chunk's worth of bytes per link direction (network out,
//!   network in, intra-node out, intra-node in) and never more than the
//!   staging cap in all (every transfer fits on its own), so round `k`
//!   carries chunk `k`'s gather, chunk `k-1`'s first hop, and so on: the
//!   stages of the broadcast overlap. The executor runs rounds per rank, a
//!   rank waiting only for its own messages, so the chunks stream.
//! - **Stages.** Each round is its own dependency stage (data a rank
//!   forwards arrived in an earlier round); `stage` is the round, saturated
//!   at `u16::MAX`.
//!
//! Same pieces, transfers and figures as the reshard, so the two compare on
//! equal terms: every destination node still receives every tensor whole.
//!
//! [`plan_baseline`] builds the whole plan (millions of transfers on a
//! large model). [`baseline_summary`] gives its figures and estimate without
//! it: it makes the same transfers in the same order through the same
//! packer and keeps only per-round counters. Both start from one outline:
//! per tensor, a recipe shared by every tensor placed alike.

mod chain;
mod outline;
mod packer;
mod schedule;

use crate::block::Block;
use crate::cost::{rank_round_seconds, LinkModel};
use crate::layout::Layout;
use crate::plan::{
    lower_bound, Endpoint, Estimate, Figures, Group, Piece, Plan, PlanError, PlanOptions, PlanParts, Scheduled, Strategy, Transfer,
};
use outline::Outline;
use packer::Packer;
use schedule::{schedule, Ends};

/// The smallest chunk of the pipelined broadcast, in bytes. A relay
/// forwards one chunk while it takes in the next. NCCL pipelines in steps
/// of 512 KiB (its 4 MiB buffer, `NCCL_BUFFSIZE`, in 8 steps); on loopback
/// with one process per rank, 1 MiB chunks moved Llama 3 8B / 8 fastest
/// (0.5–2 MiB alike; 4 MiB and more slower; docs/benchmarks.md).
pub(crate) const PIPELINE_CHUNK_BYTES: u64 = 1 << 20;

/// Larger models get larger chunks, so that all tensors together make about
/// this many chunks at most (fewer pieces and rounds to plan).
const MOST_CHUNKS: u64 = 2048;

/// The chunk size for `total` bytes of destination tensors under a staging
/// cap of `cap` bytes: at least [`PIPELINE_CHUNK_BYTES`], about
/// `total / MOST_CHUNKS` for large models, never more than half the cap (a
/// relay takes one chunk in and sends one out in a round).
pub(super) fn chunk_bytes(total: u64, cap: u64) -> u64 {
    (total / MOST_CHUNKS).max(PIPELINE_CHUNK_BYTES).min((cap / 2).max(1))
}

/// Plans the gather-broadcast baseline from `src` to `dst`.
pub fn plan_baseline(src: &Layout, dst: &Layout, options: &PlanOptions) -> Result<Plan, PlanError> {
    let outline = Outline::new(src, dst, options)?;
    let ends = Ends::new(src, dst);
    let mut packer = Packer::new(ends.count(), options.max_staging_bytes, outline.chunk);
    let mut pieces: Vec<Piece> = Vec::with_capacity(outline.pieces as usize);
    let mut transfers: Vec<Transfer> = Vec::with_capacity(outline.transfers as usize);
    let mut scratch_blocks: Vec<Block> = dst.tensors().iter().map(|t| Block::full(&t.shape)).collect();
    let mut tensors = (0u32, 0u32);
    schedule(&outline, &ends, &mut packer, |step| match step {
        Step::Tensor { src_tensor, dst_tensor, full } => {
            tensors = (src_tensor, dst_tensor);
            scratch_blocks[dst_tensor as usize] = full;
        }
        Step::Piece(block) => pieces.push(Piece { src_tensor: tensors.0, dst_tensor: tensors.1, block }),
        Step::Move(m) => transfers.push(Transfer {
            piece: pieces.len() as u32 - 1,
            from: m.from,
            to: m.to,
            stage: stage_of(m.round),
            from_scratch: m.from_scratch,
            to_scratch: m.to_scratch,
            round: m.round,
        }),
    });
    // Stage order is round order (stable: each round's transfers in the
    // order they were made).
    transfers.sort_by_key(|t| t.round);
    let rounds = packer.rounds;
    drop(packer);
    let parts = PlanParts {
        pieces,
        wire: outline.wire,
        routes: outline.routes,
        needed_node_bytes: outline.needs,
        unique_bytes: outline.unique_bytes,
        scratch_blocks,
    };
    Ok(Plan::assemble_in_rounds(Strategy::Baseline, src, dst, options, parts, Scheduled { transfers, rounds, stages: stages_of(rounds) }))
}

/// The stage of a transfer in `round`: the round, saturated.
pub(super) fn stage_of(round: u32) -> u16 {
    round.min(u16::MAX as u32) as u16
}

/// Number of stages of a plan of `rounds` rounds.
pub(super) fn stages_of(rounds: u32) -> u32 {
    rounds.min(u16::MAX as u32 + 1)
}

/// The baseline's figures and estimated refit times, without its plan.
#[derive(Clone, Debug, PartialEq)]
pub struct BaselineSummary {
    /// Exactly `plan_baseline(src, dst, options)?.figures()`.
    pub figures: Figures,
    /// `plan_baseline(src, dst, options)?.estimate(links)`: the same
    /// per-round maxima, summed in the same order. This prices the plan as
    /// it is written: its rounds one after the other, each as long as its
    /// busiest rank.
    pub estimate: Estimate,
    /// The baseline as NCCL runs it: the gathers, then per tensor a
    /// pipelined, chunked ring broadcast from its root, broadcasts of
    /// different roots overlapping (the model of [`LinkModel`]). This is
    /// the baseline time to compare with the reshard's estimate; its lower
    /// bound is the same as `estimate`'s.
    ///
    /// [`LinkModel`]: crate::LinkModel
    pub pipelined: Estimate,
}

/// The figures and the estimate of the gather-broadcast baseline from `src`
/// to `dst` (what [`plan_baseline`] followed by [`Plan::figures`] and
/// [`Plan::estimate`] with `links` give, and the same errors), without
/// building the plan.
///
/// The baseline's transfers are made again in the same order from the
/// shared per-tensor recipes and placed by the same packer, keeping only
/// per-round, per-rank counters and per-pair totals: memory follows the
/// rounds times the ranks, not the number of transfers, and time is linear
/// in the transfers.
pub fn baseline_summary(src: &Layout, dst: &Layout, options: &PlanOptions, links: &LinkModel) -> Result<BaselineSummary, PlanError> {
    let outline = Outline::new(src, dst, options)?;
    let ends = Ends::new(src, dst);
    let n = ends.count();
    let mut packer = Packer::new(n, options.max_staging_bytes, outline.chunk);
    let pairs = outline.pairs.len();
    let mut sum = Summing {
        msgs: vec![Vec::new(); n],
        pair_rounds: vec![Vec::new(); pairs],
        pair_bytes: vec![0; pairs],
        pair_msgs: vec![0; pairs],
        pair_ends: outline.pairs.iter().map(|&(f, t)| (ends.idx(f), ends.idx(t))).collect(),
    };
    schedule(&outline, &ends, &mut packer, |step| {
        if let Step::Move(m) = step {
            if let Some(pair) = m.pair {
                sum.send(pair, m.bytes, m.round);
            }
        }
    });
    let rounds = packer.rounds;
    // The busiest rank of every round, summed in round order.
    let mut worst = vec![0.0f64; rounds as usize];
    for &e in &packer.touched {
        let rank = &packer.ranks[e];
        let msgs = &sum.msgs[e];
        for (r, w) in worst.iter_mut().enumerate().take(rank.total.len()) {
            let busy = rank_round_seconds(&rank.loads(r), msgs.get(r).copied().unwrap_or(0) as u64, links);
            *w = w.max(busy);
        }
    }
    let seconds = worst.iter().sum::<f64>();
    // The figures that do not depend on rounds, from the pairs' totals.
    let mut f = Figures {
        dst_node_ingress_bytes: vec![0; dst.nodes() as usize],
        src_rank_egress_bytes: vec![0; src.ranks() as usize],
        rounds,
        stages: stages_of(rounds),
        pieces: outline.pieces,
        transfers: outline.transfers,
        ..Figures::default()
    };
    let (mut sent, mut recv, mut sent_msgs, mut recv_msgs) = (vec![0u64; n], vec![0u64; n], vec![0u64; n], vec![0u64; n]);
    for (k, &(from, to)) in outline.pairs.iter().enumerate() {
        let ((a, z), bytes, msgs) = (sum.pair_ends[k], sum.pair_bytes[k], sum.pair_msgs[k]);
        f.total_bytes += bytes;
        f.messages += msgs;
        sent[a] += bytes;
        recv[z] += bytes;
        sent_msgs[a] += msgs;
        recv_msgs[z] += msgs;
        if from.group == Group::Src {
            f.src_egress_bytes += bytes;
        }
        if ends.cross(from, to) {
            f.cross_node_bytes += bytes;
            if from.group == Group::Src {
                if let Some(b) = f.src_rank_egress_bytes.get_mut(from.rank as usize) {
                    *b += bytes;
                }
            }
            if to.group == Group::Dst {
                if let Some(b) = f.dst_node_ingress_bytes.get_mut(ends.node(to) as usize) {
                    *b += bytes;
                }
            }
        }
    }
    f.max_rank_send_bytes = sent.into_iter().max().unwrap_or(0);
    f.max_rank_recv_bytes = recv.into_iter().max().unwrap_or(0);
    f.max_rank_send_messages = sent_msgs.into_iter().max().unwrap_or(0);
    f.max_rank_recv_messages = recv_msgs.into_iter().max().unwrap_or(0);
    let lower_bound_seconds = lower_bound(&outline.needs, outline.unique_bytes, src.ranks(), dst.ranks(), dst.ranks_per_node(), links);
    let pipelined = Estimate { seconds: outline.pipelined_seconds(src, dst, &ends, links), lower_bound_seconds };
    Ok(BaselineSummary { figures: f, estimate: Estimate { seconds, lower_bound_seconds }, pipelined })
}

/// What [`schedule`](schedule::schedule) makes, in order.
enum Step {
    /// The next pieces and transfers are of these tensors; the
    /// destination's scratch buffer holds `full`.
    Tensor { src_tensor: u32, dst_tensor: u32, full: Block },
    /// A new piece; the moves that follow carry it.
    Piece(Block),
    /// One transfer of the last piece.
    Move(Move),
}

/// One transfer, placed.
struct Move {
    from: Endpoint,
    to: Endpoint,
    /// The pair of ranks (`None`: a local copy).
    pair: Option<u32>,
    /// Bytes on the wire (0 for a local copy).
    bytes: u64,
    round: u32,
    from_scratch: bool,
    to_scratch: bool,
}

/// The running totals of [`baseline_summary`].
struct Summing {
    /// Per rank, messages it sends in each round.
    msgs: Vec<Vec<u32>>,
    /// Per pair, a bitmap of the rounds in which it already has a message.
    pair_rounds: Vec<Vec<u64>>,
    /// Per pair: bytes and messages over the whole plan.
    pair_bytes: Vec<u64>,
    pair_msgs: Vec<u64>,
    /// Per pair: sender and receiver indices.
    pair_ends: Vec<(usize, usize)>,
}

impl Summing {
    /// One transfer of `bytes` between the ranks of pair `pair` in `round`.
    fn send(&mut self, pair: u32, bytes: u64, round: u32) {
        let p = pair as usize;
        self.pair_bytes[p] += bytes;
        let (r, bits) = (round as usize, &mut self.pair_rounds[p]);
        let (word, mask) = (r / 64, 1u64 << (r % 64));
        if bits.len() <= word {
            bits.resize(word + 1, 0);
        }
        if bits[word] & mask == 0 {
            bits[word] |= mask;
            self.pair_msgs[p] += 1;
            let m = &mut self.msgs[self.pair_ends[p].0];
            if m.len() <= r {
                m.resize(r + 1, 0);
            }
            m[r] += 1;
        }
    }
}
