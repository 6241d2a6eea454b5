//! The reshard planner: intersect both layouts, send each destination node
//! exactly the union of what its ranks need, choose senders and relays with
//! the link model, fan out inside nodes.

use crate::cost::LinkModel;
use crate::dtype::{can_convert, wire_dtype, DType};
use crate::layout::{Holding, Layout, Rank};
use crate::overlap::{atomize, SourceIndex};
use crate::plan::{fingerprint, finish, Endpoint, Figures, Piece, Plan, PlanError, PlanOptions, Strategy, Transfer};

/// Matches destination tensors to source tensors and checks shapes and
/// dtypes; returns, per destination tensor, the source index and dtypes.
pub(crate) fn match_tensors(src: &Layout, dst: &Layout) -> Result<Vec<(u32, DType, DType)>, PlanError> {
    dst.tensors()
        .iter()
        .map(|t| {
            let si = src.tensor_index(&t.name).ok_or_else(|| PlanError::MissingTensor { tensor: t.name.clone() })?;
            let s = &src.tensors()[si as usize];
            if s.shape != t.shape {
                return Err(PlanError::ShapeMismatch { tensor: t.name.clone(), src: s.shape.clone(), dst: t.shape.clone() });
            }
            if !can_convert(s.dtype, t.dtype) {
                return Err(PlanError::Conversion { tensor: t.name.clone(), from: s.dtype, to: t.dtype });
            }
            Ok((si, s.dtype, t.dtype))
        })
        .collect()
}

/// Sorted, deduplicated ranks holding any of `holdings[idx]`.
pub(crate) fn receivers_of(hd: &[Holding], idx: &[u32]) -> Vec<Rank> {
    let mut r: Vec<Rank> = idx.iter().flat_map(|&h| hd[h as usize].holders.iter().map(|l| l.rank)).collect();
    r.sort_unstable();
    r.dedup();
    r
}

/// Adds the bytes of `block` to every destination node among `ranks`.
pub(crate) fn add_node_needs(needs: &mut [u64], ranks: &[Rank], rpn: u32, bytes: u64) {
    let mut last = u32::MAX;
    for &r in ranks {
        let n = r / rpn;
        if n != last {
            needs[n as usize] += bytes;
            last = n;
        }
    }
}

/// One piece still to be assigned senders.
struct Work {
    piece: u32,
    bytes: u64,
    receivers: (u32, u32),
    candidates: (u32, u32),
}

/// Plans a reshard from `src` to `dst`.
pub fn plan_reshard(src: &Layout, dst: &Layout, options: &PlanOptions) -> Result<Plan, PlanError> {
    let matched = match_tensors(src, dst)?;
    let mut pieces: Vec<Piece> = Vec::new();
    let mut work: Vec<Work> = Vec::new();
    let mut pool: Vec<Rank> = Vec::new();
    let mut needs = vec![0u64; dst.nodes() as usize];
    let mut unique_bytes = 0u64;
    for (td, &(ts, sd, dd)) in matched.iter().enumerate() {
        let wire = wire_dtype(sd, dd);
        let hs = src.holdings(ts);
        let hd = dst.holdings(td as u32);
        let index = SourceIndex::new(&hs);
        let max_elems = (options.max_staging_bytes / wire.size()).max(1);
        for atom in atomize(&hd) {
            let receivers = receivers_of(&hd, &atom.holdings);
            let covers = index.cover(&atom.block).map_err(|region| PlanError::NotCovered {
                tensor: dst.tensors()[td].name.clone(),
                rank: receivers[0],
                region,
            })?;
            let bytes = atom.block.numel() * wire.size();
            unique_bytes += bytes;
            add_node_needs(&mut needs, &receivers, dst.ranks_per_node(), bytes);
            let r0 = pool.len() as u32;
            pool.extend_from_slice(&receivers);
            let rlen = receivers.len() as u32;
            for c in covers {
                let c0 = pool.len() as u32;
                pool.extend_from_slice(&c.candidates);
                let clen = c.candidates.len() as u32;
                for block in c.block.split_to_fit(max_elems) {
                    work.push(Work {
                        piece: pieces.len() as u32,
                        bytes: block.numel() * wire.size(),
                        receivers: (r0, rlen),
                        candidates: (c0, clen),
                    });
                    pieces.push(Piece { src_tensor: ts, dst_tensor: td as u32, block });
                }
            }
        }
    }
    // Largest first; ties by piece order, so the result is deterministic.
    work.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.piece.cmp(&b.piece)));
    let mut assigner = Assigner::new(src, dst, options.links);
    let mut transfers = Vec::with_capacity(work.len() * 2);
    for w in &work {
        let receivers = &pool[w.receivers.0 as usize..(w.receivers.0 + w.receivers.1) as usize];
        let candidates = &pool[w.candidates.0 as usize..(w.candidates.0 + w.candidates.1) as usize];
        assigner.assign(w.piece, w.bytes, receivers, candidates, &mut transfers);
    }
    let mut plan = Plan {
        strategy: Strategy::Reshard,
        fingerprint: fingerprint(src, dst, options, Strategy::Reshard),
        options: *options,
        src_ranks: src.ranks(),
        dst_ranks: dst.ranks(),
        src_rpn: src.ranks_per_node(),
        dst_rpn: dst.ranks_per_node(),
        pieces,
        transfers,
        wire: matched.iter().map(|&(_, s, d)| (s, d)).collect(),
        figures: Figures::default(),
        needed_node_bytes: needs,
        unique_bytes,
    };
    finish(&mut plan);
    Ok(plan)
}

/// Greedy sender/relay choice against per-stage link loads.
///
/// The cost of a plan is modelled as the sum over stages of the busiest
/// link's time in that stage. Each piece (largest first) takes whichever of
/// two shapes adds less to that cost: direct (a source sends to one leader
/// rank in every destination node that needs it) or relay (a source sends to
/// one node; nodes that have it forward to others, doubling each stage).
/// Either way the leader then fans out to the other ranks of its node.
struct Assigner {
    n_src: usize,
    n_dst: usize,
    dst_rpn: u32,
    links: LinkModel,
    /// Per stage, per link: bytes.
    loads: Vec<Vec<u64>>,
    /// Per stage: busiest link time.
    max_time: Vec<f64>,
    /// Total ingress per destination rank (leader choice).
    dst_in_total: Vec<u64>,
    log: Vec<(u16, u32, u64)>,
    emitted: Vec<(Endpoint, Endpoint, u16)>,
}

const SRC_OUT: usize = 0;
const DST_IN_NET: usize = 1;
const DST_OUT_NET: usize = 2;
const DST_IN_NV: usize = 3;
const DST_OUT_NV: usize = 4;

impl Assigner {
    fn new(src: &Layout, dst: &Layout, links: LinkModel) -> Assigner {
        Assigner {
            n_src: src.ranks() as usize,
            n_dst: dst.ranks() as usize,
            dst_rpn: dst.ranks_per_node(),
            links,
            loads: Vec::new(),
            max_time: Vec::new(),
            dst_in_total: vec![0; dst.ranks() as usize],
            log: Vec::new(),
            emitted: Vec::new(),
        }
    }

    fn link(&self, kind: usize, rank: Rank) -> u32 {
        match kind {
            SRC_OUT => rank,
            k => (self.n_src + (k - 1) * self.n_dst) as u32 + rank,
        }
    }

    fn bw(&self, link: u32) -> f64 {
        if (link as usize) < self.n_src + 3 * self.n_dst {
            self.links.net_bytes_per_s
        } else {
            self.links.intra_bytes_per_s
        }
    }

    fn add(&mut self, stage: u16, kind: usize, rank: Rank, bytes: u64) {
        let s = stage as usize;
        while self.loads.len() <= s {
            self.loads.push(vec![0; self.n_src + 4 * self.n_dst]);
            self.max_time.push(0.0);
        }
        let link = self.link(kind, rank);
        self.loads[s][link as usize] += bytes;
        self.log.push((stage, link, bytes));
    }

    fn load(&self, stage: u16, kind: usize, rank: Rank) -> u64 {
        self.loads.get(stage as usize).map_or(0, |l| l[self.link(kind, rank) as usize])
    }

    /// Cost increase of the logged additions.
    fn delta(&self) -> f64 {
        let mut new_max: Vec<(u16, f64)> = Vec::new();
        for &(s, link, _) in &self.log {
            let t = self.loads[s as usize][link as usize] as f64 / self.bw(link);
            match new_max.iter_mut().find(|(st, _)| *st == s) {
                Some((_, m)) => *m = m.max(t),
                None => new_max.push((s, t)),
            }
        }
        new_max.iter().map(|&(s, m)| (m - self.max_time[s as usize]).max(0.0)).sum()
    }

    fn rollback(&mut self) {
        for (s, link, b) in self.log.drain(..) {
            self.loads[s as usize][link as usize] -= b;
        }
        self.emitted.clear();
    }

    fn commit(&mut self, piece: u32, out: &mut Vec<Transfer>) {
        for &(s, link, _) in &self.log {
            let t = self.loads[s as usize][link as usize] as f64 / self.bw(link);
            if t > self.max_time[s as usize] {
                self.max_time[s as usize] = t;
            }
        }
        self.log.clear();
        for (from, to, stage) in self.emitted.drain(..) {
            out.push(Transfer { piece, from, to, stage, from_scratch: false, to_scratch: false, round: 0 });
        }
    }

    fn best_source(&self, candidates: &[Rank]) -> Rank {
        let mut best = candidates[0];
        let mut best_load = u64::MAX;
        for &c in candidates {
            let l = self.load(0, SRC_OUT, c);
            if l < best_load {
                best = c;
                best_load = l;
            }
        }
        best
    }

    fn send(&mut self, from: Endpoint, to: Endpoint, stage: u16, bytes: u64) {
        use crate::plan::Group;
        match (from.group, from.rank / self.dst_rpn == to.rank / self.dst_rpn) {
            (Group::Src, _) => {
                self.add(stage, SRC_OUT, from.rank, bytes);
                self.add(stage, DST_IN_NET, to.rank, bytes);
            }
            (Group::Dst, false) => {
                self.add(stage, DST_OUT_NET, from.rank, bytes);
                self.add(stage, DST_IN_NET, to.rank, bytes);
            }
            (Group::Dst, true) => {
                self.add(stage, DST_OUT_NV, from.rank, bytes);
                self.add(stage, DST_IN_NV, to.rank, bytes);
            }
        }
        self.emitted.push((from, to, stage));
    }

    /// Sends from the node leader to the other receivers of its node.
    fn fan_out(&mut self, leader: Rank, group: &[Rank], stage: u16, bytes: u64) {
        for &r in group {
            if r != leader {
                self.send(Endpoint::dst(leader), Endpoint::dst(r), stage, bytes);
            }
        }
    }

    fn assign(&mut self, piece: u32, bytes: u64, receivers: &[Rank], candidates: &[Rank], out: &mut Vec<Transfer>) {
        // Receivers grouped by node (they are sorted, so groups are runs).
        let mut groups: Vec<&[Rank]> = Vec::new();
        let mut start = 0;
        for i in 1..=receivers.len() {
            if i == receivers.len() || receivers[i] / self.dst_rpn != receivers[start] / self.dst_rpn {
                groups.push(&receivers[start..i]);
                start = i;
            }
        }
        let leaders: Vec<Rank> =
            groups.iter().map(|g| *g.iter().min_by_key(|&&r| (self.dst_in_total[r as usize], r)).unwrap_or(&g[0])).collect();

        // Option A: direct from sources to every node.
        for (g, &l) in groups.iter().zip(&leaders) {
            let s = self.best_source(candidates);
            self.send(Endpoint::src(s), Endpoint::dst(l), 0, bytes);
            self.fan_out(l, g, 1, bytes);
        }
        if groups.len() < 2 {
            self.finish_assign(piece, bytes, &leaders, out);
            return;
        }
        let direct_cost = self.delta();
        let direct: Vec<(Endpoint, Endpoint, u16)> = self.emitted.clone();
        self.rollback();

        // Option B: one source send, then node-to-node doubling.
        let s = self.best_source(candidates);
        self.send(Endpoint::src(s), Endpoint::dst(leaders[0]), 0, bytes);
        let mut arrival = vec![0u16; groups.len()];
        let mut have = 1usize;
        let mut stage = 1u16;
        while have < groups.len() {
            let senders = have;
            for i in 0..senders {
                if have >= groups.len() {
                    break;
                }
                self.send(Endpoint::dst(leaders[i]), Endpoint::dst(leaders[have]), stage, bytes);
                arrival[have] = stage;
                have += 1;
            }
            stage += 1;
        }
        for (i, g) in groups.iter().enumerate() {
            self.fan_out(leaders[i], g, arrival[i] + 1, bytes);
        }
        let relay_cost = self.delta();
        if relay_cost + 1e-15 < direct_cost {
            self.finish_assign(piece, bytes, &leaders, out);
        } else {
            self.rollback();
            for (from, to, st) in direct {
                self.send(from, to, st, bytes);
            }
            self.finish_assign(piece, bytes, &leaders, out);
        }
    }

    fn finish_assign(&mut self, piece: u32, bytes: u64, leaders: &[Rank], out: &mut Vec<Transfer>) {
        for &l in leaders {
            self.dst_in_total[l as usize] += bytes;
        }
        self.commit(piece, out);
    }
}
