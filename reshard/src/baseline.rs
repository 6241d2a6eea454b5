//! The gather-and-broadcast baseline, as RL frameworks do it today: per
//! tensor, gather the whole tensor on one source rank (the first rank of its
//! mesh), broadcast it whole to every destination rank holding any of it
//! (one copy per destination node, relayed node to node by doubling, then
//! fanned out inside the node), and let each rank keep its slices.
//!
//! Same pieces, transfers and figures as the reshard, so the two compare on
//! equal terms. Stages: 0 gathers, 1 sends the root's copy to the first
//! destination node, the next ones double across nodes and fan out inside
//! them, and a last stage copies each rank's slices out of scratch. Each
//! stage's transfers are packed into rounds first-fit, in the order they are
//! made, so that no rank stages more than the cap in one round (every
//! transfer fits on its own): the rule the reshard's rounds follow too.
//!
//! [`plan_baseline`] builds the whole plan (millions of transfers on a
//! large model). [`baseline_summary`] gives its figures and estimate without
//! it: it streams the same transfers, stage by stage, through the same
//! round packer and keeps only per-round counters. Both start from one
//! outline: per tensor, a recipe shared by every tensor placed alike.

use crate::block::Block;
use crate::cost::{LinkModel, PipelinedBroadcast};
use crate::dtype::{wire_dtype, DType};
use crate::layout::{Layout, Placement, Rank};
use crate::overlap::{atomize, SourceIndex};
use crate::plan::{
    lower_bound, rank_round_seconds, Endpoint, Estimate, Figures, Group, Piece, Plan, PlanError, PlanOptions, PlanParts, Scheduled,
    Strategy, Transfer, MAX_PIECES,
};
use crate::planner::{add_node_needs, match_tensors, placed_alike, placement_key, receivers_of};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// Plans the gather-broadcast baseline from `src` to `dst`.
pub fn plan_baseline(src: &Layout, dst: &Layout, options: &PlanOptions) -> Result<Plan, PlanError> {
    let outline = Outline::new(src, dst, options)?;
    let mut pieces: Vec<Piece> = Vec::with_capacity(outline.pieces as usize);
    let mut by_stage: Vec<Vec<Transfer>> = Vec::new();
    let mut transfers = StageLists(&mut by_stage);
    // Local copies out of scratch happen after every broadcast stage.
    let mut finals: Vec<Transfer> = Vec::new();
    let mut scratch_blocks: Vec<Block> = dst.tensors().iter().map(|t| Block::full(&t.shape)).collect();
    for &(ts, td, recipe) in &outline.tensors {
        let Some(rec) = &outline.recipes[recipe as usize] else { continue };
        let tree = &outline.trees[rec.tree as usize];
        scratch_blocks[td as usize] = rec.full;
        let mut piece = |block: Block| {
            pieces.push(Piece { src_tensor: ts, dst_tensor: td, block });
            pieces.len() as u32 - 1
        };
        // Gather onto the root's scratch buffer.
        for &(sender, block, _) in rec.gather() {
            let piece = piece(block);
            transfers.push(Transfer {
                piece,
                from: Endpoint::src(sender),
                to: Endpoint::src(rec.root),
                stage: 0,
                from_scratch: false,
                to_scratch: true,
                round: 0,
            });
        }
        // Broadcast the whole tensor: root -> first node, doubling across
        // nodes, then fan-out inside each node.
        for &block in &rec.broadcast {
            let piece = piece(block);
            let mut push = |from: Endpoint, to: Endpoint, stage: u16| {
                transfers.push(Transfer { piece, from, to, stage, from_scratch: true, to_scratch: true, round: 0 });
            };
            push(Endpoint::src(rec.root), Endpoint::dst(tree.leader), 1);
            for (stage, list) in tree.stages.iter().enumerate() {
                for &pair in list {
                    let (from, to) = outline.pairs[pair as usize];
                    push(from, to, stage as u16);
                }
            }
        }
        // Each rank keeps its slices.
        for (block, ranks) in &rec.finals {
            let piece = piece(*block);
            for &r in ranks {
                finals.push(Transfer {
                    piece,
                    from: Endpoint::dst(r),
                    to: Endpoint::dst(r),
                    stage: 0,
                    from_scratch: true,
                    to_scratch: false,
                    round: 0,
                });
            }
        }
    }
    for mut t in finals {
        t.stage = outline.last_stage + 1;
        transfers.push(t);
    }
    // Rounds, stage by stage.
    let ends = Ends::new(src, dst);
    let mut packer = Packer::new(ends.count(), options.max_staging_bytes);
    let mut rounds = 0u32;
    for list in by_stage.iter_mut() {
        packer.reset();
        for t in list.iter_mut() {
            if t.from == t.to {
                packer.local();
                t.round = rounds;
                continue;
            }
            let p = &pieces[t.piece as usize];
            let (s, d) = outline.wire[p.dst_tensor as usize];
            let bytes = p.block.numel() * if t.to.group == Group::Src { s.size() } else { wire_dtype(s, d).size() };
            t.round = rounds + packer.place(ends.idx(t.from), ends.idx(t.to), ends.cross(t.from, t.to), bytes);
        }
        rounds += packer.rounds;
    }
    drop(packer);
    let stages = by_stage.len() as u32;
    let mut all = by_stage.first_mut().map(std::mem::take).unwrap_or_default();
    for rest in by_stage.iter_mut().skip(1) {
        all.append(rest);
    }
    drop(by_stage);
    let parts =
        PlanParts { pieces, wire: outline.wire, needed_node_bytes: outline.needs, unique_bytes: outline.unique_bytes, scratch_blocks };
    Ok(Plan::assemble_in_rounds(Strategy::Baseline, src, dst, options, parts, Scheduled { transfers: all, rounds, stages }))
}

/// The baseline's figures and estimated refit times, without its plan.
#[derive(Clone, Debug, PartialEq)]
pub struct BaselineSummary {
    /// Exactly `plan_baseline(src, dst, options)?.figures()`.
    pub figures: Figures,
    /// `plan_baseline(src, dst, options)?.estimate(links)`: the same
    /// per-round maxima, summed in the same order. This prices the plan as
    /// it is written, store and forward: every stage (the gathers, each
    /// doubling across nodes, each fan-out inside them) waits for the one
    /// before, and a node forwards only whole pieces.
    pub estimate: Estimate,
    /// The baseline as NCCL runs it: the gathers, then per tensor a
    /// pipelined, chunked ring broadcast from its root, broadcasts of
    /// different roots overlapping ([`PipelinedBroadcast`] gives the
    /// formula). This is the baseline time to compare with the reshard's
    /// estimate; its lower bound is the same as `estimate`'s.
    ///
    /// [`PipelinedBroadcast`]: crate::cost::PipelinedBroadcast
    pub pipelined: Estimate,
}

/// The figures and the estimate of the gather-broadcast baseline from `src`
/// to `dst` (what [`plan_baseline`] followed by [`Plan::figures`] and
/// [`Plan::estimate`] with `links` give, and the same errors), without
/// building the plan.
///
/// The baseline's transfers are made again stage by stage from the shared
/// per-tensor recipes and packed into rounds by the same first-fit packer,
/// keeping only per-stage, per-rank round counters: memory follows the
/// busiest stage's rounds times the ranks active in it, not the number of
/// transfers, and time is linear in the transfers.
pub fn baseline_summary(src: &Layout, dst: &Layout, options: &PlanOptions, links: &LinkModel) -> Result<BaselineSummary, PlanError> {
    let outline = Outline::new(src, dst, options)?;
    let ends = Ends::new(src, dst);
    let n = ends.count();
    // Every (sender, receiver) pair as rank indices, and whether it crosses nodes.
    let pairs: Vec<(usize, usize, bool)> = outline.pairs.iter().map(|&(f, t)| (ends.idx(f), ends.idx(t), ends.cross(f, t))).collect();
    let mut sum = Summing {
        pairs: &pairs,
        packer: Packer::new(n, options.max_staging_bytes),
        msgs: vec![Vec::new(); n],
        pair_rounds: vec![Vec::new(); pairs.len()],
        used_pairs: Vec::new(),
        pair_bytes: vec![0; pairs.len()],
        pair_msgs: vec![0; pairs.len()],
    };
    let mut seconds = 0.0;
    let mut rounds = 0u32;
    let mut worst: Vec<f64> = Vec::new();
    for stage in 0..outline.stages() {
        for &e in &sum.packer.touched {
            sum.msgs[e] = Vec::new();
        }
        sum.packer.reset();
        for &p in &sum.used_pairs {
            sum.pair_rounds[p as usize] = Vec::new();
        }
        sum.used_pairs.clear();
        if stage == outline.last_stage as u32 + 1 {
            // Only the local copies out of scratch.
            sum.packer.local();
        }
        // Where every tensor's broadcast makes the same transfers in this
        // stage, they split into groups of ranks that never meet; groups
        // alike get the same rounds, so one of each kind is packed and the
        // others copy its totals.
        let alike = outline.same_pushes(stage).map(|list| Alike::new(list, &pairs));
        let before = alike.as_ref().map(|_| (sum.pair_bytes.clone(), sum.pair_msgs.clone()));
        for &(_, _, recipe) in &outline.tensors {
            let Some(rec) = &outline.recipes[recipe as usize] else { continue };
            if stage == 0 {
                for &(sender, block, pair) in rec.gather() {
                    if sender == rec.root {
                        sum.packer.local();
                    } else {
                        sum.send(pair, block.numel() * rec.src_size);
                    }
                }
            } else if stage == 1 {
                for block in &rec.broadcast {
                    sum.send(rec.first_pair, block.numel() * rec.wire_size);
                }
            } else {
                let list = match &alike {
                    Some(a) => &a.packed[..],
                    None => outline.trees[rec.tree as usize].stages.get(stage as usize).map_or(&[][..], |l| &l[..]),
                };
                for block in &rec.broadcast {
                    let bytes = block.numel() * rec.wire_size;
                    for &pair in list {
                        sum.send(pair, bytes);
                    }
                }
            }
        }
        if let (Some(alike), Some((bytes, msgs))) = (&alike, &before) {
            for &(pair, like) in &alike.copies {
                let (p, l) = (pair as usize, like as usize);
                sum.pair_bytes[p] += sum.pair_bytes[l] - bytes[l];
                sum.pair_msgs[p] += sum.pair_msgs[l] - msgs[l];
            }
        }
        // The busiest rank of every round of this stage, in round order.
        worst.clear();
        worst.resize(sum.packer.rounds as usize, 0.0);
        for &e in &sum.packer.touched {
            let rank = &sum.packer.ranks[e];
            let msgs = &sum.msgs[e];
            for (r, w) in worst.iter_mut().enumerate().take(rank.total.len()) {
                let busy = rank_round_seconds(&rank.loads(r), msgs.get(r).copied().unwrap_or(0), links);
                *w = w.max(busy);
            }
        }
        for &w in &worst {
            seconds += w;
        }
        rounds += sum.packer.rounds;
    }
    // The figures that do not depend on rounds, from the pairs' totals.
    let mut f = Figures {
        dst_node_ingress_bytes: vec![0; dst.nodes() as usize],
        src_rank_egress_bytes: vec![0; src.ranks() as usize],
        rounds,
        stages: outline.stages(),
        pieces: outline.pieces,
        transfers: outline.transfers,
        ..Figures::default()
    };
    let (mut sent, mut recv, mut sent_msgs, mut recv_msgs) = (vec![0u64; n], vec![0u64; n], vec![0u64; n], vec![0u64; n]);
    for (k, &(from, to)) in outline.pairs.iter().enumerate() {
        let ((a, z, cross), bytes, msgs) = (pairs[k], sum.pair_bytes[k], sum.pair_msgs[k]);
        f.total_bytes += bytes;
        f.messages += msgs;
        sent[a] += bytes;
        recv[z] += bytes;
        sent_msgs[a] += msgs;
        recv_msgs[z] += msgs;
        if from.group == Group::Src {
            f.src_egress_bytes += bytes;
        }
        if cross {
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

/// The running state of [`baseline_summary`]: the stage being packed and
/// the totals per (sender, receiver) pair.
struct Summing<'a> {
    /// Per pair: sender and receiver indices, and whether it crosses nodes.
    pairs: &'a [(usize, usize, bool)],
    packer: Packer,
    /// Per rank, messages it sends in each round of the stage.
    msgs: Vec<Vec<u64>>,
    /// Per pair, a bitmap of the stage's rounds in which it already has a
    /// message.
    pair_rounds: Vec<Vec<u64>>,
    used_pairs: Vec<u32>,
    /// Per pair: bytes and messages over the whole plan.
    pair_bytes: Vec<u64>,
    pair_msgs: Vec<u64>,
}

impl Summing<'_> {
    /// One transfer of `bytes` between the ranks of pair `pair`.
    fn send(&mut self, pair: u32, bytes: u64) {
        let p = pair as usize;
        let (a, z, cross) = self.pairs[p];
        let r = self.packer.place(a, z, cross, bytes) as usize;
        self.pair_bytes[p] += bytes;
        let bits = &mut self.pair_rounds[p];
        if bits.is_empty() {
            self.used_pairs.push(pair);
        }
        let (word, mask) = (r / 64, 1u64 << (r % 64));
        if bits.len() <= word {
            bits.resize(word + 1, 0);
        }
        if bits[word] & mask == 0 {
            bits[word] |= mask;
            self.pair_msgs[p] += 1;
            let m = &mut self.msgs[a];
            if m.len() <= r {
                m.resize(r + 1, 0);
            }
            m[r] += 1;
        }
    }
}

/// One stage's transfers per broadcast block (pairs, in order), split into
/// groups of ranks no transfer joins: two groups whose transfers are the
/// same up to the names of their ranks (in order, crossing nodes alike) are
/// packed alike, round for round, so only the first of each kind is packed.
struct Alike {
    /// The transfers of the first group of each kind, in order.
    packed: Vec<u32>,
    /// Every other transfer, and the packed one it copies.
    copies: Vec<(u32, u32)>,
}

impl Alike {
    /// `pushes`: pairs; `pairs`: per pair, sender and receiver indices and
    /// whether it crosses nodes.
    fn new(pushes: Vec<u32>, pairs: &[(usize, usize, bool)]) -> Alike {
        // Ranks numbered in order of appearance; groups by union-find.
        let mut local: HashMap<usize, usize> = HashMap::new();
        let mut parent: Vec<usize> = Vec::new();
        fn find(parent: &mut [usize], mut x: usize) -> usize {
            while parent[x] != x {
                parent[x] = parent[parent[x]];
                x = parent[x];
            }
            x
        }
        let mut ends = Vec::with_capacity(pushes.len());
        for &p in &pushes {
            let (a, z, _) = pairs[p as usize];
            let mut id = |e: usize| {
                *local.entry(e).or_insert_with(|| {
                    parent.push(parent.len());
                    parent.len() - 1
                })
            };
            let (la, lz) = (id(a), id(z));
            let (ra, rz) = (find(&mut parent, la), find(&mut parent, lz));
            parent[ra.max(rz)] = ra.min(rz);
            ends.push((la, lz));
        }
        // Each group's transfers, and their shape: ranks renumbered in
        // order of appearance within the group.
        let mut groups: Vec<RankGroup> = Vec::new();
        let mut group_of: HashMap<usize, usize> = HashMap::new();
        for (&p, &(la, lz)) in pushes.iter().zip(&ends) {
            let root = find(&mut parent, la);
            let g = *group_of.entry(root).or_insert_with(|| {
                groups.push(Default::default());
                groups.len() - 1
            });
            let group = &mut groups[g];
            let mut name = |e: usize| {
                let next = group.names.len() as u32;
                *group.names.entry(e).or_insert(next)
            };
            let (na, nz) = (name(la), name(lz));
            group.pushes.push(p);
            group.shape.push((na, nz, pairs[p as usize].2));
        }
        let mut first_of: HashMap<&[(u32, u32, bool)], usize> = HashMap::new();
        let mut like = vec![0usize; groups.len()];
        for (g, group) in groups.iter().enumerate() {
            like[g] = *first_of.entry(&group.shape[..]).or_insert(g);
        }
        let mut alike = Alike { packed: Vec::new(), copies: Vec::new() };
        let mut seen = vec![0usize; groups.len()];
        for (&p, &(la, _)) in pushes.iter().zip(&ends) {
            let g = group_of[&find(&mut parent, la)];
            let f = like[g];
            if f == g {
                alike.packed.push(p);
            } else {
                alike.copies.push((p, groups[f].pushes[seen[g]]));
            }
            seen[g] += 1;
        }
        // A pair twice in a group is twice in the one it copies: its totals
        // are copied once.
        alike.copies.sort_unstable();
        alike.copies.dedup();
        alike
    }
}

/// One group of ranks of [`Alike`]: its transfers (pairs) in order, their
/// shape (sender and receiver renumbered in order of appearance, and
/// whether they cross nodes), and the renumbering.
#[derive(Default)]
struct RankGroup {
    pushes: Vec<u32>,
    shape: Vec<(u32, u32, bool)>,
    names: HashMap<usize, u32>,
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

/// First-fit packing of one stage's transfers into rounds, in the order
/// they come: each goes to the first round in which neither of its ranks
/// would stage more than the cap (a rank with nothing in a round takes any
/// transfer). Per rank it keeps a skip list (union-find with path halving)
/// over rounds that are nearly full, so a search jumps over them instead of
/// scanning, and the bytes it stages per round, by lane (network out,
/// network in, intra-node out, intra-node in) where it uses more than one.
struct Packer {
    cap: u64,
    /// A round counts as full once less than 1/16 of the cap is left.
    nearly_full: u64,
    ranks: Vec<RankRounds>,
    /// Ranks with any bytes in the stage.
    touched: Vec<usize>,
    /// Rounds the stage uses so far.
    rounds: u32,
}

/// One rank's rounds in the stage being packed.
#[derive(Clone, Default)]
struct RankRounds {
    /// Bytes staged per round, all lanes together.
    total: Vec<u64>,
    /// Lanes used so far (bit `k` for lane `k`); while only one is, its
    /// bytes are `total` and `lanes` stays empty.
    kinds: u8,
    lanes: [Vec<u64>; 4],
    /// `skip[x] != x` marks round `x` full.
    skip: Vec<u32>,
}

impl RankRounds {
    fn fits(&self, r: u32, bytes: u64, cap: u64) -> bool {
        let l = self.total.get(r as usize).copied().unwrap_or(0);
        l == 0 || l + bytes <= cap
    }

    /// Adds `bytes` on `lane` in round `r`; returns the round's new total.
    fn add(&mut self, r: u32, lane: usize, bytes: u64) -> u64 {
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
        if self.kinds != bit {
            let l = &mut self.lanes[lane];
            if l.len() <= r {
                l.resize(r + 1, 0);
            }
            l[r] += bytes;
        }
        if self.total.len() <= r {
            self.total.resize(r + 1, 0);
        }
        self.total[r] += bytes;
        self.total[r]
    }

    /// Bytes by lane in round `r`.
    fn loads(&self, r: usize) -> [u64; 4] {
        let mut out = [0u64; 4];
        if self.kinds.count_ones() == 1 {
            out[self.kinds.trailing_zeros() as usize] = self.total.get(r).copied().unwrap_or(0);
        } else {
            for (o, l) in out.iter_mut().zip(&self.lanes) {
                *o = l.get(r).copied().unwrap_or(0);
            }
        }
        out
    }
}

impl Packer {
    fn new(ranks: usize, max_staging_bytes: u64) -> Packer {
        let cap = max_staging_bytes.max(1);
        Packer { cap, nearly_full: cap - cap / 16, ranks: vec![RankRounds::default(); ranks], touched: Vec::new(), rounds: 0 }
    }

    /// Starts a stage (and frees the last one's counters).
    fn reset(&mut self) {
        for &e in &self.touched {
            self.ranks[e] = RankRounds::default();
        }
        self.touched.clear();
        self.rounds = 0;
    }

    /// A local copy: it takes the stage's first round.
    fn local(&mut self) {
        self.rounds = self.rounds.max(1);
    }

    /// Places a transfer of `bytes` from rank `a` to rank `z` (indices,
    /// distinct); returns its round within the stage.
    fn place(&mut self, a: usize, z: usize, cross: bool, bytes: u64) -> u32 {
        let mut r = 0u32;
        loop {
            let ra = open_round(&mut self.ranks[a].skip, r);
            let rz = open_round(&mut self.ranks[z].skip, ra);
            if rz != ra {
                r = rz;
                continue;
            }
            if self.ranks[a].fits(ra, bytes, self.cap) && self.ranks[z].fits(ra, bytes, self.cap) {
                r = ra;
                break;
            }
            r = ra + 1;
        }
        let (out, inn) = if cross { (0, 1) } else { (2, 3) };
        for (e, lane) in [(a, out), (z, inn)] {
            let rank = &mut self.ranks[e];
            if rank.kinds == 0 {
                self.touched.push(e);
            }
            if rank.add(r, lane, bytes) >= self.nearly_full {
                let s = &mut rank.skip;
                if s.len() <= r as usize + 1 {
                    let from = s.len() as u32;
                    s.extend(from..r + 2);
                }
                s[r as usize] = r + 1;
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
    trees: Vec<Tree>,
    /// Every distinct (sender, receiver) pair of the recipes and trees.
    pairs: Vec<(Endpoint, Endpoint)>,
    /// Per destination tensor: source and destination dtypes.
    wire: Vec<(DType, DType)>,
    /// Per destination node, bytes of the union of its ranks' needs.
    needs: Vec<u64>,
    unique_bytes: u64,
    /// Pieces and transfers of the plan.
    pieces: u64,
    transfers: u64,
    /// The last broadcast stage; the local copies out of scratch follow it.
    last_stage: u16,
    /// Whether there is any local copy out of scratch.
    any_final: bool,
    /// The trees the tensors use.
    used_trees: Vec<u32>,
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
    /// Gather pieces (sender, block, pair to the root), or the region of
    /// `full` no source holds; `None` when the pieces were not made because
    /// the tensor alone would pass [`MAX_PIECES`].
    gather: Option<Gather>,
    /// The broadcast's blocks.
    broadcast: Vec<Block>,
    /// The pair of the first hop (root to the first node's leader).
    first_pair: u32,
    tree: u32,
    /// Per destination block, the ranks that keep it.
    finals: Vec<(Block, Vec<Rank>)>,
    unique_bytes: u64,
    needs: Vec<(u32, u64)>,
}

/// Gather pieces (sender, block, pair), or the region no source holds.
type Gather = Result<Vec<(Rank, Block, u32)>, Box<Block>>;

impl Recipe {
    fn gather(&self) -> &[(Rank, Block, u32)] {
        match &self.gather {
            Some(Ok(g)) => g,
            _ => &[],
        }
    }
}

/// The broadcast among one set of destination ranks: the leader of the
/// first node receives from the root, nodes double, leaders fan out.
struct Tree {
    leader: Rank,
    /// The receivers, node by node, in the order the broadcast reaches the
    /// nodes (ascending).
    nodes: Vec<Vec<Rank>>,
    /// Transfers by stage (stages 0 and 1 have none), as pairs of
    /// destination ranks, in the order the plan makes them.
    stages: Vec<Vec<u32>>,
    /// Its last stage (at least 1).
    last: u16,
}

impl Tree {
    fn new(receivers: &[Rank], rpn: u32, pairs: &mut Pairs) -> Tree {
        let mut groups: Vec<&[Rank]> = Vec::new();
        let mut start = 0;
        for i in 1..=receivers.len() {
            if i == receivers.len() || receivers[i] / rpn != receivers[start] / rpn {
                groups.push(&receivers[start..i]);
                start = i;
            }
        }
        let mut tree = Tree {
            leader: receivers.first().copied().unwrap_or(0),
            nodes: groups.iter().map(|g| g.to_vec()).collect(),
            stages: Vec::new(),
            last: 1,
        };
        let mut push = |from: Rank, to: Rank, stage: u16| {
            let s = stage as usize;
            if tree.stages.len() <= s {
                tree.stages.resize_with(s + 1, Vec::new);
            }
            tree.stages[s].push(pairs.id(Endpoint::dst(from), Endpoint::dst(to)));
        };
        let mut arrival = vec![1u16; groups.len()];
        let (mut have, mut stage) = (1usize, 2u16);
        while have < groups.len() {
            let senders = have;
            for i in 0..senders {
                if have >= groups.len() {
                    break;
                }
                push(groups[i][0], groups[have][0], stage);
                arrival[have] = stage;
                have += 1;
            }
            stage += 1;
        }
        let mut last = 1u16;
        for (g, &a) in groups.iter().zip(&arrival) {
            for &r in &g[1..] {
                push(g[0], r, a + 1);
                last = last.max(a + 1);
            }
            last = last.max(a);
        }
        tree.last = last;
        tree
    }

    /// Transfers per broadcast block, the first hop included.
    fn transfers(&self) -> u64 {
        1 + self.stages.iter().map(|s| s.len() as u64).sum::<u64>()
    }
}

/// The broadcast trees (one per set of receivers) and the pairs the
/// recipes use.
#[derive(Default)]
struct Interned {
    trees: Vec<Tree>,
    by_receivers: HashMap<Vec<Rank>, u32>,
    pairs: Pairs,
}

impl Interned {
    /// The tree among `receivers` (sorted, deduplicated), `rpn` to a node.
    fn tree(&mut self, receivers: Vec<Rank>, rpn: u32) -> u32 {
        if let Some(&t) = self.by_receivers.get(&receivers) {
            return t;
        }
        self.trees.push(Tree::new(&receivers, rpn, &mut self.pairs));
        let t = self.trees.len() as u32 - 1;
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
        let matched = match_tensors(src, dst)?;
        let mut o = Outline {
            tensors: Vec::new(),
            recipes: Vec::new(),
            trees: Vec::new(),
            pairs: Vec::new(),
            wire: matched.iter().map(|&(_, s, d)| (s, d)).collect(),
            needs: vec![0; dst.nodes() as usize],
            unique_bytes: 0,
            pieces: 0,
            transfers: 0,
            last_stage: 0,
            any_final: false,
            used_trees: Vec::new(),
        };
        let mut interned = Interned::default();
        let mut by_key: HashMap<u64, Vec<u32>> = HashMap::new();
        // Per recipe, the (source, destination) tensors it was made from.
        let mut made_from: Vec<(u32, u32)> = Vec::new();
        let mut tree_used: Vec<bool> = Vec::new();
        for (td, &(ts, sd, dd)) in matched.iter().enumerate() {
            let (st, dt) = (&src.tensors()[ts as usize], &dst.tensors()[td]);
            // Tensors placed alike (storage aside) with the same dtypes
            // share a recipe.
            let key = {
                let mut h = placement_key(st, dt);
                sd.hash(&mut h);
                dd.hash(&mut h);
                h.finish()
            };
            let same = |r: &(u32, u32)| {
                let (rs, rd) = (&src.tensors()[r.0 as usize], &dst.tensors()[r.1 as usize]);
                rs.dtype == sd && rd.dtype == dd && placed_alike(st, dt, rs, rd)
            };
            let found = by_key.get(&key).and_then(|list| list.iter().copied().find(|&i| same(&made_from[i as usize])));
            let id = match found {
                Some(i) => i,
                None => {
                    let rec = Recipe::new(src, dst, (ts, td as u32), (sd, dd), options, &mut interned);
                    o.recipes.push(rec);
                    made_from.push((ts, td as u32));
                    let id = o.recipes.len() as u32 - 1;
                    by_key.entry(key).or_default().push(id);
                    tree_used.resize(interned.trees.len(), false);
                    id
                }
            };
            let Some(rec) = &o.recipes[id as usize] else { continue };
            let fail_pieces = || PlanError::TooManyPieces { tensor: st.name.clone(), limit: MAX_PIECES };
            let bound = rec.full.numel().div_ceil(max_elems_for(options, sd)).saturating_mul(2);
            if o.pieces.saturating_add(bound) > MAX_PIECES {
                return Err(fail_pieces());
            }
            let gather = match &rec.gather {
                Some(Ok(g)) => g,
                Some(Err(region)) => {
                    return Err(PlanError::BaselineNotCovered {
                        tensor: st.name.clone(),
                        extent: Box::new(rec.full),
                        region: region.clone(),
                    })
                }
                None => return Err(fail_pieces()),
            };
            let tree = &interned.trees[rec.tree as usize];
            o.unique_bytes += rec.unique_bytes;
            for &(node, bytes) in &rec.needs {
                o.needs[node as usize] += bytes;
            }
            let finals: u64 = rec.finals.iter().map(|(_, r)| r.len() as u64).sum();
            o.pieces += (gather.len() + rec.broadcast.len() + rec.finals.len()) as u64;
            o.transfers += gather.len() as u64 + rec.broadcast.len() as u64 * tree.transfers() + finals;
            o.last_stage = o.last_stage.max(tree.last);
            o.any_final |= finals > 0;
            o.tensors.push((ts, td as u32, id));
            if !tree_used[rec.tree as usize] {
                tree_used[rec.tree as usize] = true;
                o.used_trees.push(rec.tree);
            }
        }
        o.trees = interned.trees;
        o.pairs = interned.pairs.list;
        Ok(o)
    }

    /// The transfers every tensor's broadcast makes in `stage` (2 or more),
    /// as pairs, when they are the same for all; `None` otherwise.
    fn same_pushes(&self, stage: u32) -> Option<Vec<u32>> {
        let list = |t: u32| self.trees[t as usize].stages.get(stage as usize).map_or(&[][..], |l| &l[..]);
        let (&first, rest) = self.used_trees.split_first()?;
        let l0 = list(first);
        (stage >= 2 && !l0.is_empty() && rest.iter().all(|&t| list(t) == l0)).then(|| l0.to_vec())
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
            for &(sender, block, _) in rec.gather() {
                if sender != rec.root {
                    let bytes = block.numel().saturating_mul(rec.src_size);
                    model.gather(sender, rec.root, ends.cross(Endpoint::src(sender), root), bytes, count);
                }
            }
            let nodes: Vec<&[Rank]> = self.trees[rec.tree as usize].nodes.iter().map(Vec::as_slice).collect();
            model.broadcast(rec.root, rec.full.numel().saturating_mul(rec.wire_size), &nodes, count);
        }
        model.seconds()
    }

    /// Number of stages: gathers, broadcast stages, local copies.
    fn stages(&self) -> u32 {
        if self.tensors.is_empty() {
            0
        } else {
            self.last_stage as u32 + 1 + self.any_final as u32
        }
    }
}

impl Recipe {
    /// The recipe for source tensor `tensors.0` to destination tensor
    /// `tensors.1` with these dtypes; `None` when the destination holds none
    /// of it. Its trees and pairs go to `interned`.
    fn new(
        src: &Layout,
        dst: &Layout,
        tensors: (u32, u32),
        dtypes: (DType, DType),
        options: &PlanOptions,
        interned: &mut Interned,
    ) -> Option<Recipe> {
        let ((ts, td), (sd, dd)) = (tensors, dtypes);
        let hd = dst.holdings(td);
        if hd.is_empty() {
            return None;
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
        // A tensor that alone passes the piece limit fails wherever it
        // comes: its pieces are not made.
        let gather_elems = max_elems_for(options, sd);
        let gather = (full.numel().div_ceil(gather_elems).saturating_mul(2) <= MAX_PIECES).then(|| {
            let index = SourceIndex::new(&hs);
            index.cover(&full).map(|covers| {
                let mut g = Vec::new();
                for c in covers {
                    let sender = if c.candidates.contains(&root) { root } else { c.candidates[0] };
                    let pair = interned.pairs.id(Endpoint::src(sender), Endpoint::src(root));
                    g.extend(c.block.split_to_fit(gather_elems).into_iter().map(|b| (sender, b, pair)));
                }
                g
            })
        });
        let broadcast = match gather {
            Some(Ok(_)) => full.split_to_fit((options.max_staging_bytes / wire.size()).max(1)),
            _ => Vec::new(),
        };
        let all: Vec<u32> = (0..hd.len() as u32).collect();
        let receivers = receivers_of(&hd, &all);
        let tree = interned.tree(receivers, rpn);
        let first_pair = interned.pairs.id(Endpoint::src(root), Endpoint::dst(interned.trees[tree as usize].leader));
        let finals = hd
            .iter()
            .map(|h| {
                let mut ranks: Vec<Rank> = h.holders.iter().map(|l| l.rank).collect();
                ranks.dedup();
                (h.block, ranks)
            })
            .collect();
        Some(Recipe {
            full,
            root,
            src_size: sd.size(),
            wire_size: wire.size(),
            gather,
            broadcast,
            first_pair,
            tree,
            finals,
            unique_bytes,
            needs: needs.into_iter().enumerate().filter(|&(_, b)| b > 0).map(|(n, b)| (n as u32, b)).collect(),
        })
    }
}

fn max_elems_for(options: &PlanOptions, dtype: DType) -> u64 {
    (options.max_staging_bytes / dtype.size()).max(1)
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

/// Transfers bucketed by stage as they are made.
struct StageLists<'a>(&'a mut Vec<Vec<Transfer>>);

impl StageLists<'_> {
    fn push(&mut self, t: Transfer) {
        let s = t.stage as usize;
        if self.0.len() <= s {
            self.0.resize_with(s + 1, Vec::new);
        }
        self.0[s].push(t);
    }
}
