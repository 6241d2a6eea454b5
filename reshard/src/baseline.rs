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

use crate::block::Block;
use crate::cost::{rank_round_seconds, LinkModel, PipelinedBroadcast};
use crate::dtype::{wire_dtype, DType};
use crate::layout::{Layout, Placement, Rank};
use crate::overlap::{atomize, SourceIndex};
use crate::plan::{
    lower_bound, Budget, Endpoint, Estimate, Figures, Group, Piece, Plan, PlanError, PlanOptions, PlanParts, Scheduled, Strategy, Transfer,
    MAX_PIECES,
};
use crate::planner::{add_node_needs, hash_scale, match_tensors, placed_alike, placement_key, receivers_of, scaled_alike, wire_pairs};
use crate::route::{self, QuantizeAt, Route};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

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
fn chunk_bytes(total: u64, cap: u64) -> u64 {
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
fn stage_of(round: u32) -> u16 {
    round.min(u16::MAX as u32) as u16
}

/// Number of stages of a plan of `rounds` rounds.
fn stages_of(rounds: u32) -> u32 {
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

/// What [`schedule`] makes, in order.
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

/// Makes the baseline's pieces and transfers, tensor by tensor and chunk by
/// chunk, placing every transfer in its round with `packer` (see the
/// module's doc), and hands them to `step`.
fn schedule(o: &Outline, ends: &Ends, packer: &mut Packer, mut step: impl FnMut(Step)) {
    let mut turn = 0usize;
    // Per receiver of the current chain, the round its chunk arrived.
    let mut arrival: Vec<u32> = Vec::new();
    for &(ts, td, recipe) in &o.tensors {
        let Some(rec) = &o.recipes[recipe as usize] else { continue };
        let chain = &o.chains[rec.chain as usize];
        let Some((gather, gather_ends)) = rec.gather.as_ref().and_then(|g| g.as_ref().ok()) else { continue };
        step(Step::Tensor { src_tensor: ts, dst_tensor: td, full: rec.full });
        arrival.clear();
        arrival.resize(chain.receivers.len(), 0);
        let root = Endpoint::src(rec.root);
        let root_idx = ends.idx(root);
        let mut finals = rec.finals.iter().peekable();
        // Tensors take the trees (channels) in turn, so that the nodes'
        // ranks share the leading; all chunks of a tensor take one, so its
        // last receivers only keep their slices.
        let c = turn % chain.channels.len().max(1);
        turn += 1;
        let mut first = 0usize;
        for (k, &chunk) in rec.chunks.iter().enumerate() {
            let last = gather_ends.get(k).map_or(first, |&e| e as usize);
            let pieces = gather.get(first..last).unwrap_or(&[]);
            first = last;
            // The gathers onto the root's scratch.
            let mut ready = 0u32;
            for &(sender, block, pair) in pieces.iter().filter(|g| g.0 != rec.root) {
                let from = Endpoint::src(sender);
                let bytes = block.numel() * rec.src_size;
                let round = packer.place(ends.idx(from), root_idx, ends.cross(from, root), bytes, 0);
                ready = ready.max(round + 1);
                step(Step::Piece(block));
                step(Step::Move(Move { from, to: root, pair: Some(pair), bytes, round, from_scratch: false, to_scratch: true }));
            }
            // The tree: root to the first leader, then hop by hop.
            let Some(ring) = chain.channels.get(c) else { continue };
            let entry = ring.entry;
            let bytes = chunk.numel() * rec.wire_size;
            let to = Endpoint::dst(chain.receivers[entry as usize]);
            let round = packer.place(root_idx, ends.idx(to), true, bytes, ready);
            // What the root holds itself is copied in just before it sends.
            for &(_, block, _) in pieces.iter().filter(|g| g.0 == rec.root) {
                packer.local(round);
                step(Step::Piece(block));
                step(Step::Move(Move { from: root, to: root, pair: None, bytes: 0, round, from_scratch: false, to_scratch: true }));
            }
            step(Step::Piece(chunk));
            let first_pair = rec.first_pairs.get(c).copied();
            step(Step::Move(Move { from: root, to, pair: first_pair, bytes, round, from_scratch: true, to_scratch: true }));
            arrival[entry as usize] = round;
            for &(a, z, pair) in &ring.hops {
                let (from, to) = (Endpoint::dst(chain.receivers[a as usize]), Endpoint::dst(chain.receivers[z as usize]));
                let round = packer.place(ends.idx(from), ends.idx(to), ends.cross(from, to), bytes, arrival[a as usize] + 1);
                arrival[z as usize] = round;
                step(Step::Move(Move { from, to, pair: Some(pair), bytes, round, from_scratch: true, to_scratch: true }));
            }
            // Each rank keeps its slices of the chunk once it has it.
            while let Some(&&(kk, part, holding)) = finals.peek() {
                if kk as usize != k {
                    break;
                }
                finals.next();
                step(Step::Piece(part));
                for &i in rec.holders.get(holding as usize).map_or(&[][..], |h| &h[..]) {
                    let round = arrival[i as usize] + 1;
                    packer.local(round);
                    let me = Endpoint::dst(chain.receivers[i as usize]);
                    step(Step::Move(Move { from: me, to: me, pair: None, bytes: 0, round, from_scratch: true, to_scratch: false }));
                }
            }
        }
    }
}

/// Endpoints as indices (source ranks, then destination ranks) and their nodes.
struct Ends {
    n_src: usize,
    n_dst: usize,
    src_rpn: u32,
    dst_rpn: u32,
}

impl Ends {
    fn new(src: &Layout, dst: &Layout) -> Ends {
        Ends {
            n_src: src.ranks() as usize,
            n_dst: dst.ranks() as usize,
            src_rpn: src.ranks_per_node().max(1),
            dst_rpn: dst.ranks_per_node().max(1),
        }
    }

    fn count(&self) -> usize {
        self.n_src + self.n_dst
    }

    fn idx(&self, e: Endpoint) -> usize {
        match e.group {
            Group::Src => e.rank as usize,
            Group::Dst => self.n_src + e.rank as usize,
        }
    }

    fn node(&self, e: Endpoint) -> u32 {
        match e.group {
            Group::Src => e.rank / self.src_rpn,
            Group::Dst => e.rank / self.dst_rpn,
        }
    }

    /// Whether a transfer crosses a node boundary (source and destination
    /// nodes are distinct machines).
    fn cross(&self, from: Endpoint, to: Endpoint) -> bool {
        from.group != to.group || self.node(from) != self.node(to)
    }
}

/// First-fit placement of transfers into rounds, in the order they come:
/// each goes to the first round at or after the one its data is ready in
/// where both its ranks have room: on the transfer's lane (network out,
/// network in, intra-node out, intra-node in) no more than a chunk, and in
/// all no more than the cap (a rank with nothing on the lane, or nothing
/// in the round, takes any transfer that fits the other limit). Per rank
/// and lane it keeps a skip list (union-find with path halving) over rounds
/// that are nearly full, so a search jumps over them instead of scanning,
/// and the bytes it stages per round, by lane where it uses more than one.
struct Packer {
    cap: u64,
    /// A round counts as full once less than 1/16 of the cap is left.
    nearly_full: u64,
    lane_cap: u64,
    lane_nearly_full: u64,
    ranks: Vec<RankRounds>,
    /// Ranks with any bytes.
    touched: Vec<usize>,
    /// Rounds used so far.
    rounds: u32,
}

/// One rank's rounds.
#[derive(Clone, Default)]
struct RankRounds {
    /// Bytes staged per round, all lanes together.
    total: Vec<u64>,
    /// Lanes used so far (bit `k` for lane `k`); while only one is, its
    /// bytes are `total` and `lanes` stays empty.
    kinds: u8,
    lanes: [Vec<u64>; 4],
    /// Per lane, `skip[l][x] != x` marks round `x` full for lane `l`.
    skip: [Vec<u32>; 4],
}

impl RankRounds {
    /// Bytes on `lane` in round `r`.
    fn lane(&self, r: usize, lane: usize) -> u64 {
        let bit = 1u8 << lane;
        if self.kinds & bit == 0 {
            0
        } else if self.kinds == bit {
            self.total.get(r).copied().unwrap_or(0)
        } else {
            self.lanes[lane].get(r).copied().unwrap_or(0)
        }
    }

    fn fits(&self, r: u32, lane: usize, bytes: u64, cap: u64, lane_cap: u64) -> bool {
        let t = self.total.get(r as usize).copied().unwrap_or(0);
        let l = self.lane(r as usize, lane);
        (t == 0 || t + bytes <= cap) && (l == 0 || l + bytes <= lane_cap)
    }

    /// Adds `bytes` on `lane` in round `r`; returns the round's new total
    /// and the lane's.
    fn add(&mut self, r: u32, lane: usize, bytes: u64) -> (u64, u64) {
        let r = r as usize;
        let bit = 1u8 << lane;
        if self.kinds & bit == 0 {
            if self.kinds.count_ones() == 1 {
                // A second lane: the first one's bytes so far are the totals.
                let first = self.kinds.trailing_zeros() as usize;
                self.lanes[first] = self.total.clone();
            }
            self.kinds |= bit;
        }
        if self.total.len() <= r {
            self.total.resize(r + 1, 0);
        }
        self.total[r] += bytes;
        if self.kinds == bit {
            return (self.total[r], self.total[r]);
        }
        let l = &mut self.lanes[lane];
        if l.len() <= r {
            l.resize(r + 1, 0);
        }
        l[r] += bytes;
        (self.total[r], l[r])
    }

    /// Bytes by lane in round `r`.
    fn loads(&self, r: usize) -> [u64; 4] {
        let mut out = [0u64; 4];
        for (k, o) in out.iter_mut().enumerate() {
            *o = self.lane(r, k);
        }
        out
    }
}

/// Marks round `r` full in `skip`.
fn mark_full(skip: &mut Vec<u32>, r: u32) {
    if skip.len() <= r as usize + 1 {
        let from = skip.len() as u32;
        skip.extend(from..r + 2);
    }
    skip[r as usize] = r + 1;
}

impl Packer {
    fn new(ranks: usize, max_staging_bytes: u64, chunk: u64) -> Packer {
        let cap = max_staging_bytes.max(1);
        let lane_cap = chunk.clamp(1, cap);
        Packer {
            cap,
            nearly_full: cap - cap / 16,
            lane_cap,
            lane_nearly_full: lane_cap - lane_cap / 16,
            ranks: vec![RankRounds::default(); ranks],
            touched: Vec::new(),
            rounds: 0,
        }
    }

    /// A local copy in round `r`.
    fn local(&mut self, r: u32) {
        self.rounds = self.rounds.max(r + 1);
    }

    /// Places a transfer of `bytes` from rank `a` to rank `z` (indices,
    /// distinct) whose data is there from round `ready`; returns its round.
    fn place(&mut self, a: usize, z: usize, cross: bool, bytes: u64, ready: u32) -> u32 {
        let (la, lz) = if cross { (0, 1) } else { (2, 3) };
        let mut r = ready;
        loop {
            let ra = open_round(&mut self.ranks[a].skip[la], r);
            let rz = open_round(&mut self.ranks[z].skip[lz], ra);
            if rz != ra {
                r = rz;
                continue;
            }
            if self.ranks[a].fits(ra, la, bytes, self.cap, self.lane_cap) && self.ranks[z].fits(ra, lz, bytes, self.cap, self.lane_cap) {
                r = ra;
                break;
            }
            r = ra + 1;
        }
        for (e, lane) in [(a, la), (z, lz)] {
            let rank = &mut self.ranks[e];
            if rank.kinds == 0 {
                self.touched.push(e);
            }
            let (total, on_lane) = rank.add(r, lane, bytes);
            if total >= self.nearly_full {
                for l in 0..4 {
                    if rank.kinds & (1 << l) != 0 {
                        mark_full(&mut rank.skip[l], r);
                    }
                }
            } else if on_lane >= self.lane_nearly_full {
                mark_full(&mut rank.skip[lane], r);
            }
        }
        self.rounds = self.rounds.max(r + 1);
        r
    }
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

/// The baseline before its transfers are made: per destination tensor, a
/// recipe (shared by tensors placed alike), checked in tensor order for
/// the errors [`plan_baseline`] reports.
struct Outline {
    /// Per destination tensor the destination holds any of, in order:
    /// (source tensor, destination tensor, recipe).
    tensors: Vec<(u32, u32, u32)>,
    /// `None`: the destination holds none of the tensor.
    recipes: Vec<Option<Recipe>>,
    chains: Vec<Chain>,
    /// Every distinct (sender, receiver) pair of the recipes and chains.
    pairs: Vec<(Endpoint, Endpoint)>,
    /// Per destination tensor: source and destination dtypes.
    wire: Vec<(DType, DType)>,
    /// Per destination tensor, how its values travel.
    routes: Vec<Route>,
    /// Per destination node, bytes of the union of its ranks' needs.
    needs: Vec<u64>,
    unique_bytes: u64,
    /// Pieces and transfers of the plan.
    pieces: u64,
    transfers: u64,
    /// Bytes of a chunk.
    chunk: u64,
}

/// What the baseline does with one tensor.
struct Recipe {
    /// The whole needed extent: the bounding box of every destination
    /// block (the whole tensor, whenever the destination holds all of it).
    full: Block,
    /// The source rank that gathers it.
    root: Rank,
    /// Bytes per element into a source rank, and on the wire to a
    /// destination rank.
    src_size: u64,
    wire_size: u64,
    /// The chunks of `full`, in order (none unless the gather was made).
    chunks: Vec<Block>,
    /// Gather pieces (sender, block, pair to the root), chunk after chunk,
    /// with the end of each chunk's, or the region of `full` no source
    /// holds; `None` when the pieces were not made because the tensor alone
    /// would pass [`MAX_PIECES`].
    gather: Option<Gather>,
    /// Per ring of its chain, the pair from the root to the ring's first
    /// receiver.
    first_pairs: Vec<u32>,
    chain: u32,
    /// The slices the ranks keep, chunk by chunk: (chunk, part of a
    /// destination block inside it, that block's index in `holders`).
    finals: Vec<(u32, Block, u32)>,
    /// Per destination block, the ranks that keep it, as indices into the
    /// chain's receivers.
    holders: Vec<Vec<u32>>,
    unique_bytes: u64,
    needs: Vec<(u32, u64)>,
}

/// Gather pieces (sender, block, pair) and the end of each chunk's, or the
/// region no source holds.
type Gather = Result<(Vec<(Rank, Block, u32)>, Vec<u32>), Box<Block>>;

/// The broadcast trees among one set of destination ranks.
struct Chain {
    /// The receivers, ascending.
    receivers: Vec<Rank>,
    /// One tree per channel: as many as the most receivers on one node.
    channels: Vec<Ring>,
}

/// One tree of a channel `c`: on every node, the `c`-th receiver (modulo
/// the node's receivers) leads; the root sends to the first node's leader,
/// each leader forwards to the next node's (nodes ascending) and to the
/// chain of its node's other receivers (from the leader on, going round),
/// each of which forwards to the next.
struct Ring {
    /// The receiver of the root's send (an index into
    /// [`Chain::receivers`]).
    entry: u32,
    /// Every other hop: (sender, receiver, pair), senders and receivers as
    /// indices into [`Chain::receivers`], each after the hop that brought
    /// its sender the data.
    hops: Vec<(u32, u32, u32)>,
}

impl Chain {
    /// The hops of [`Chain::new`]'s rings among `receivers` (sorted),
    /// counted without making them: one ring per receiver of the fullest
    /// node, each reaching every receiver.
    /// Also the nodes the chain passes, one after another.
    fn hops(receivers: &[Rank], rpn: u32) -> (u64, u64) {
        let (mut most, mut start, mut nodes) = (0usize, 0usize, 0u64);
        for i in 1..=receivers.len() {
            if i == receivers.len() || receivers[i] / rpn != receivers[start] / rpn {
                most = most.max(i - start);
                start = i;
                nodes += 1;
            }
        }
        ((most as u64).saturating_mul(receivers.len() as u64), nodes)
    }

    fn new(receivers: &[Rank], rpn: u32, pairs: &mut Pairs) -> Chain {
        let mut groups: Vec<(usize, usize)> = Vec::new();
        let mut start = 0;
        for i in 1..=receivers.len() {
            if i == receivers.len() || receivers[i] / rpn != receivers[start] / rpn {
                groups.push((start, i));
                start = i;
            }
        }
        let channels = groups.iter().map(|&(a, b)| b - a).max().unwrap_or(0);
        let rings = (0..channels)
            .map(|c| {
                let mut hops: Vec<(u32, u32, u32)> = Vec::with_capacity(receivers.len());
                let mut hop = |from: usize, to: usize, hops: &mut Vec<(u32, u32, u32)>| {
                    let pair = pairs.id(Endpoint::dst(receivers[from]), Endpoint::dst(receivers[to]));
                    hops.push((from as u32, to as u32, pair));
                };
                let mut leader: Option<usize> = None;
                for &(a, b) in &groups {
                    let at = a + c % (b - a);
                    if let Some(l) = leader {
                        hop(l, at, &mut hops);
                    }
                    let mut prev = at;
                    for i in (at + 1..b).chain(a..at) {
                        hop(prev, i, &mut hops);
                        prev = i;
                    }
                    leader = Some(at);
                }
                let entry = groups.first().map_or(0, |&(a, b)| a + c % (b - a)) as u32;
                Ring { entry, hops }
            })
            .collect();
        Chain { receivers: receivers.to_vec(), channels: rings }
    }
}

/// The chains (one per set of receivers) and the pairs the recipes use.
#[derive(Default)]
struct Interned {
    chains: Vec<Chain>,
    by_receivers: HashMap<Vec<Rank>, u32>,
    pairs: Pairs,
}

impl Interned {
    /// The chain among `receivers` (sorted, deduplicated), `rpn` to a node.
    fn chain(&mut self, receivers: Vec<Rank>, rpn: u32) -> u32 {
        if let Some(&t) = self.by_receivers.get(&receivers) {
            return t;
        }
        self.chains.push(Chain::new(&receivers, rpn, &mut self.pairs));
        let t = self.chains.len() as u32 - 1;
        self.by_receivers.insert(receivers, t);
        t
    }
}

/// Interned (sender, receiver) pairs.
#[derive(Default)]
struct Pairs {
    ids: HashMap<(Endpoint, Endpoint), u32>,
    list: Vec<(Endpoint, Endpoint)>,
}

impl Pairs {
    fn id(&mut self, from: Endpoint, to: Endpoint) -> u32 {
        *self.ids.entry((from, to)).or_insert_with(|| {
            self.list.push((from, to));
            self.list.len() as u32 - 1
        })
    }
}

impl Outline {
    fn new(src: &Layout, dst: &Layout, options: &PlanOptions) -> Result<Outline, PlanError> {
        let (matched, routes) = match_tensors(src, dst, QuantizeAt::Destination)?;
        let only = options.only.as_ref().map(|s| s.mask(dst)).transpose()?;
        let included = |td: usize| only.as_ref().is_none_or(|m| m[td]);
        let planned = |(td, m): (usize, &Option<(u32, DType, DType)>)| m.filter(|_| included(td)).map(|m| (td, m));
        let total = matched
            .iter()
            .enumerate()
            .filter_map(planned)
            .map(|(td, (_, s, d))| dst.tensors()[td].shape.iter().product::<u64>().saturating_mul(wire_dtype(s, d).size()))
            .fold(0u64, u64::saturating_add);
        let mut o = Outline {
            tensors: Vec::new(),
            recipes: Vec::new(),
            chains: Vec::new(),
            pairs: Vec::new(),
            wire: wire_pairs(&matched),
            routes,
            needs: vec![0; dst.nodes() as usize],
            unique_bytes: 0,
            pieces: 0,
            transfers: 0,
            chunk: chunk_bytes(total, options.max_staging_bytes),
        };
        let mut interned = Interned::default();
        let mut budget = Budget::new(options.max_work);
        let mut by_key: HashMap<u64, Vec<u32>> = HashMap::new();
        // Per recipe, the (source, destination) tensors it was made from.
        let mut made_from: Vec<(u32, u32)> = Vec::new();
        for (td, (ts, sd, dd)) in matched.iter().enumerate().filter_map(planned) {
            let (st, dt) = (&src.tensors()[ts as usize], &dst.tensors()[td]);
            // Tensors placed alike (storage aside) with the same dtypes
            // share a recipe.
            let key = {
                let mut h = placement_key(st, dt);
                sd.hash(&mut h);
                dd.hash(&mut h);
                hash_scale(dst, td as u32, &mut h);
                h.finish()
            };
            let same = |r: &(u32, u32)| {
                let (rs, rd) = (&src.tensors()[r.0 as usize], &dst.tensors()[r.1 as usize]);
                let dtypes = matched[r.1 as usize].map(|(_, s, d)| (s, d));
                rs.dtype == sd && dtypes == Some((sd, dd)) && placed_alike(st, dt, rs, rd) && scaled_alike(dst, td as u32, r.1)
            };
            let found = by_key.get(&key).and_then(|list| list.iter().copied().find(|&i| same(&made_from[i as usize])));
            let id = match found {
                Some(i) => i,
                None => {
                    let rec = Recipe::new(src, dst, (ts, td as u32), (sd, dd), o.chunk, (&mut interned, &mut budget))?;
                    o.recipes.push(rec);
                    made_from.push((ts, td as u32));
                    let id = o.recipes.len() as u32 - 1;
                    by_key.entry(key).or_default().push(id);
                    id
                }
            };
            let Some(rec) = &o.recipes[id as usize] else { continue };
            let fail_pieces = || PlanError::TooManyPieces { tensor: st.name.clone(), limit: MAX_PIECES };
            let bound = rec.full.numel().div_ceil(chunk_elems(o.chunk, sd, dd)).saturating_mul(2);
            if o.pieces.saturating_add(bound) > MAX_PIECES {
                return Err(fail_pieces());
            }
            let gather = match &rec.gather {
                Some(Ok((g, _))) => g,
                Some(Err(region)) => {
                    return Err(PlanError::BaselineNotCovered {
                        tensor: st.name.clone(),
                        extent: Box::new(rec.full),
                        region: region.clone(),
                    })
                }
                None => return Err(fail_pieces()),
            };
            let receivers = interned.chains[rec.chain as usize].receivers.len() as u64;
            o.unique_bytes += rec.unique_bytes;
            for &(node, bytes) in &rec.needs {
                o.needs[node as usize] += bytes;
            }
            let finals: u64 = rec.finals.iter().map(|&(_, _, h)| rec.holders[h as usize].len() as u64).sum();
            let pieces = (gather.len() + rec.chunks.len() + rec.finals.len()) as u64;
            let transfers =
                (gather.len() as u64).saturating_add((rec.chunks.len() as u64).saturating_mul(receivers)).saturating_add(finals);
            // Every tensor's transfers are made and packed, whether or not
            // it shares its recipe.
            budget.take(pieces.saturating_add(transfers), || {
                format!("the baseline, tensor '{}': {pieces} pieces, {transfers} transfers", dt.name)
            })?;
            o.pieces += pieces;
            o.transfers += transfers;
            o.tensors.push((ts, td as u32, id));
        }
        o.chains = interned.chains;
        o.pairs = interned.pairs.list;
        Ok(o)
    }

    /// The baseline's time as NCCL runs it ([`PipelinedBroadcast`]): each
    /// recipe once, weighted by the tensors that use it.
    fn pipelined_seconds(&self, src: &Layout, dst: &Layout, ends: &Ends, links: &LinkModel) -> f64 {
        let mut uses = vec![0u64; self.recipes.len()];
        for &(_, _, recipe) in &self.tensors {
            uses[recipe as usize] += 1;
        }
        let mut model = PipelinedBroadcast::new(src.ranks(), dst.ranks(), links);
        for (rec, &count) in self.recipes.iter().zip(&uses) {
            let Some(rec) = rec.as_ref().filter(|_| count > 0) else { continue };
            let root = Endpoint::src(rec.root);
            if let Some(Ok((gather, _))) = &rec.gather {
                // One gather message per sender and tensor, whatever the
                // plan's chunks.
                let mut senders: Vec<(Rank, u64)> = Vec::new();
                for &(sender, block, _) in gather.iter().filter(|g| g.0 != rec.root) {
                    let bytes = block.numel().saturating_mul(rec.src_size);
                    match senders.iter_mut().find(|s| s.0 == sender) {
                        Some(s) => s.1 = s.1.saturating_add(bytes),
                        None => senders.push((sender, bytes)),
                    }
                }
                for (sender, bytes) in senders {
                    model.gather(sender, rec.root, ends.cross(Endpoint::src(sender), root), bytes, count);
                }
            }
            let chain = &self.chains[rec.chain as usize];
            let mut nodes: Vec<&[Rank]> = Vec::new();
            let mut start = 0;
            let rpn = dst.ranks_per_node().max(1);
            for i in 1..=chain.receivers.len() {
                if i == chain.receivers.len() || chain.receivers[i] / rpn != chain.receivers[start] / rpn {
                    nodes.push(&chain.receivers[start..i]);
                    start = i;
                }
            }
            model.broadcast(rec.root, rec.full.numel().saturating_mul(rec.wire_size), &nodes, count);
        }
        model.seconds()
    }
}

/// Elements of one chunk of a tensor: its bytes in the wider of the two
/// dtypes (gathers travel in the source dtype, the broadcast in the wire
/// dtype), at least one.
fn chunk_elems(chunk: u64, src: DType, dst: DType) -> u64 {
    (chunk / src.size().max(wire_dtype(src, dst).size())).max(1)
}

impl Recipe {
    /// The recipe for source tensor `tensors.0` to destination tensor
    /// `tensors.1` with these dtypes, in chunks of `chunk` bytes; `None`
    /// when the destination holds none of it. Its chains and pairs go to
    /// `interned`; the work of making them is taken from `budget` first
    /// (the chain's hops, the chunks with the blocks kept of each).
    fn new(
        src: &Layout,
        dst: &Layout,
        tensors: (u32, u32),
        dtypes: (DType, DType),
        chunk: u64,
        (interned, budget): (&mut Interned, &mut Budget),
    ) -> Result<Option<Recipe>, PlanError> {
        let ((ts, td), (sd, dd)) = (tensors, dtypes);
        let name = || format!("the baseline, tensor '{}'", dst.tensors()[td as usize].name);
        // Expanding both placements costs a holding per rank of each.
        let places = |t: &crate::layout::TensorLayout| match &t.placement {
            Placement::Mesh(m) => m.ranks.len() as u64,
            Placement::Shards(s) => s.len() as u64,
        };
        let expand = places(&src.tensors()[ts as usize]).saturating_add(places(&dst.tensors()[td as usize]));
        budget.take(expand, || format!("{}: placed on {expand} ranks in all", name()))?;
        let hd = route::delivered_holdings(dst, td, route::at_destination(dst, td));
        if hd.is_empty() {
            return Ok(None);
        }
        let wire = wire_dtype(sd, dd);
        let rpn = dst.ranks_per_node().max(1);
        // Lower-bound bookkeeping, identical to the reshard's.
        let (mut unique_bytes, mut needs) = (0u64, vec![0u64; dst.nodes() as usize]);
        for atom in atomize(&hd) {
            let bytes = atom.block.numel() * wire.size();
            unique_bytes += bytes;
            add_node_needs(&mut needs, &receivers_of(&hd, &atom.holdings), rpn, bytes);
        }
        let full = bounding_box(hd.iter().map(|h| h.block));
        let hs = src.holdings(ts);
        let root = match &src.tensors()[ts as usize].placement {
            Placement::Mesh(m) => m.ranks.first().copied().unwrap_or(0),
            Placement::Shards(_) => hs.iter().flat_map(|h| h.holders.iter().map(|l| l.rank)).min().unwrap_or(0),
        };
        let all: Vec<u32> = (0..hd.len() as u32).collect();
        let receivers = receivers_of(&hd, &all);
        let (hops, nodes) = Chain::hops(&receivers, rpn);
        if !interned.by_receivers.contains_key(&receivers) {
            budget.take(hops, || format!("{}: a broadcast of {hops} hops among {} ranks", name(), receivers.len()))?;
        }
        // Each receiver keeps per-round loads up to the round its last
        // chunk reaches it: past the chain's nodes, one after another, and
        // the chunks.
        let chunks = full.numel().div_ceil(chunk_elems(chunk, sd, dd));
        let rounds = nodes.saturating_add(chunks).saturating_mul(receivers.len() as u64);
        budget.take(rounds, || format!("{}: {chunks} chunks through a chain of {nodes} nodes", name()))?;
        let chain = interned.chain(receivers, rpn);
        // A tensor that alone passes the piece limit fails wherever it
        // comes: its pieces are not made.
        let elems = chunk_elems(chunk, sd, dd);
        let made = full.numel().div_ceil(elems).saturating_mul(2) <= MAX_PIECES;
        if made {
            // Each chunk is covered by the source holdings and met with
            // every destination block.
            let chunks = full.numel().div_ceil(elems);
            let work = chunks.saturating_mul(hd.len() as u64 + 1);
            budget.take(work, || format!("{}: {chunks} chunks, each met with {} destination blocks", name(), hd.len()))?;
        }
        let chunks = if made { full.split_to_fit(elems) } else { Vec::new() };
        let gather = made.then(|| {
            let index = SourceIndex::new(&hs);
            let (mut g, mut ends) = (Vec::new(), Vec::with_capacity(chunks.len()));
            for c in &chunks {
                for cover in index.cover(c)? {
                    let sender = if cover.candidates.contains(&root) { root } else { cover.candidates.first().copied().unwrap_or(root) };
                    let pair = interned.pairs.id(Endpoint::src(sender), Endpoint::src(root));
                    g.extend(cover.block.split_to_fit(elems).into_iter().map(|b| (sender, b, pair)));
                }
                ends.push(g.len() as u32);
            }
            Ok((g, ends))
        });
        let (chunks, finals, holders, first_pairs) = match &gather {
            Some(Ok(_)) => {
                let c = &interned.chains[chain as usize];
                let holders: Vec<Vec<u32>> = hd
                    .iter()
                    .map(|h| {
                        let mut ranks: Vec<Rank> = h.holders.iter().map(|l| l.rank).collect();
                        ranks.dedup();
                        ranks.iter().filter_map(|r| c.receivers.binary_search(r).ok().map(|i| i as u32)).collect()
                    })
                    .collect();
                let mut finals = Vec::new();
                for (k, chunk) in chunks.iter().enumerate() {
                    for (i, h) in hd.iter().enumerate() {
                        if let Some(part) = h.block.intersect(chunk) {
                            finals.push((k as u32, part, i as u32));
                        }
                    }
                }
                let entries: Vec<Rank> = c.channels.iter().map(|ring| c.receivers[ring.entry as usize]).collect();
                let first_pairs = entries.into_iter().map(|entry| interned.pairs.id(Endpoint::src(root), Endpoint::dst(entry))).collect();
                (chunks, finals, holders, first_pairs)
            }
            _ => (Vec::new(), Vec::new(), Vec::new(), Vec::new()),
        };
        Ok(Some(Recipe {
            full,
            root,
            src_size: sd.size(),
            wire_size: wire.size(),
            chunks,
            gather,
            first_pairs,
            chain,
            finals,
            holders,
            unique_bytes,
            needs: needs.into_iter().enumerate().filter(|&(_, b)| b > 0).map(|(n, b)| (n as u32, b)).collect(),
        }))
    }
}

/// The smallest block containing all `blocks` (at least one).
fn bounding_box(mut blocks: impl Iterator<Item = Block>) -> Block {
    let first = blocks.next().unwrap_or_else(|| Block::new(&[], &[]));
    let nd = first.ndim();
    let mut lo: Vec<u64> = first.offset().to_vec();
    let mut hi: Vec<u64> = (0..nd).map(|d| first.end(d)).collect();
    for b in blocks {
        for d in 0..nd {
            lo[d] = lo[d].min(b.offset()[d]);
            hi[d] = hi[d].max(b.end(d));
        }
    }
    let ext: Vec<u64> = (0..nd).map(|d| hi[d] - lo[d]).collect();
    Block::new(&lo, &ext)
}
