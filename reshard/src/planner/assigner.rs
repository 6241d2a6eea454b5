//! The greedy sender and relay choice of the reshard planner
//! ([`Assigner`]), against per-stage link loads.

mod split;

use crate::cost::LinkModel;
use crate::layout::{Layout, Rank};
use crate::plan::{Endpoint, Group, SenderLists};

/// Most stages a reshard can use: one source send, doubling relays across
/// up to 2^30 nodes, one intra-node fan-out.
const MAX_STAGES: usize = 33;

/// Greedy sender/relay choice against per-stage link loads.
///
/// The cost of a plan is modelled as the sum over stages of the busiest
/// link's time in that stage. Each piece (largest first) takes whichever of
/// two shapes adds less to that cost: direct (a source sends to one leader
/// rank in every destination node that needs it) or relay (a source sends to
/// one node; nodes that have it forward to others, doubling each stage).
/// Either way the leader then fans out to the other ranks of its node.
pub(super) struct Assigner {
    n_src: usize,
    n_dst: usize,
    n_links: usize,
    net_bw: f64,
    /// Seconds per byte: network, then intra-node.
    inv_bw: [f64; 2],
    /// Node of each destination rank.
    dst_node: Vec<u32>,
    /// Node of each source rank, and bytes each source node sends.
    src_node: Vec<u32>,
    src_node_load: Vec<u64>,
    /// Bytes per (stage, link), stage-major; grown a stage at a time.
    loads: Vec<u64>,
    /// Per stage: the most bytes on any link timed at network bandwidth
    /// and on any timed at intra-node bandwidth (see [`Assigner::add`]).
    max_bytes: [[u64; 2]; MAX_STAGES],
    /// The same including the option being evaluated (equal to
    /// `max_bytes` outside an evaluation), up to stage `top`.
    pending: [[u64; 2]; MAX_STAGES],
    top: usize,
    /// Total ingress per destination rank (leader choice).
    dst_in_total: Vec<u64>,
    /// Transfers of the relay option while it is evaluated (taken off the
    /// links one by one on rollback). The direct option is known from
    /// `groups`, `leaders` and `picks` alone.
    emitted: Vec<(Endpoint, Endpoint, u16)>,
    /// The piece's receivers by node (ranges of its receivers), each
    /// node's leader, and whether any node has more than one receiver.
    groups: Vec<(u32, u32)>,
    leaders: Vec<Rank>,
    fans: bool,
    /// Scratch: candidates' (egress << 64 | node egress, rank), and the
    /// senders picked.
    cand: Vec<(u128, Rank)>,
    picks: Vec<Rank>,
    arrival: Vec<u16>,
    /// Least bytes of a part when a piece is split among its candidates
    /// ([`PlanOptions::min_split_bytes`](crate::PlanOptions::min_split_bytes)).
    min_split: u64,
    /// Per source rank, the bytes that pieces only it holds will still add
    /// to its egress (once per receiving node); with its stage-0 egress
    /// so far, its *outlook*, by which senders are chosen among several
    /// candidates: a piece others hold too goes elsewhere than to the rank
    /// that alone must send much later.
    forced: Vec<u64>,
    /// Per source rank, its even share of what the pieces it holds (with
    /// others or alone) not assigned yet will add to the source ranks'
    /// egress: its stage-0 egress plus this is about where the ranks it
    /// shares pieces with end up anyway.
    shares: Vec<u64>,
    /// The most any source rank's outlook has been.
    src_max: u64,
    /// Scratch for [`split`](Self::split): candidates' (stage-0 egress,
    /// rank), and rows per part.
    by_load: Vec<(u64, Rank)>,
    rows: Vec<u64>,
}

const SRC_OUT: usize = 0;
const DST_IN_NET: usize = 1;
const DST_OUT_NET: usize = 2;
const DST_IN_NV: usize = 3;
const DST_OUT_NV: usize = 4;

impl Assigner {
    pub(super) fn new(src: &Layout, dst: &Layout, links: LinkModel, min_split: u64) -> Assigner {
        let (n_src, n_dst) = (src.ranks() as usize, dst.ranks() as usize);
        Assigner {
            n_src,
            n_dst,
            n_links: n_src + 4 * n_dst,
            net_bw: links.net_bytes_per_s,
            inv_bw: [1.0 / links.net_bytes_per_s, 1.0 / links.intra_bytes_per_s],
            dst_node: (0..dst.ranks()).map(|r| dst.node_of(r)).collect(),
            src_node: (0..src.ranks()).map(|r| src.node_of(r)).collect(),
            src_node_load: vec![0; src.nodes() as usize],
            loads: Vec::new(),
            max_bytes: [[0; 2]; MAX_STAGES],
            pending: [[0; 2]; MAX_STAGES],
            top: 0,
            dst_in_total: vec![0; n_dst],
            emitted: Vec::new(),
            groups: Vec::new(),
            leaders: Vec::new(),
            fans: false,
            cand: Vec::new(),
            picks: Vec::new(),
            arrival: Vec::new(),
            min_split: min_split.max(1),
            forced: vec![0; n_src],
            shares: vec![0; n_src],
            src_max: 0,
            by_load: Vec::new(),
            rows: Vec::new(),
        }
    }

    #[inline]
    fn link(&self, kind: usize, rank: Rank) -> usize {
        match kind {
            SRC_OUT => rank as usize,
            k => self.n_src + (k - 1) * self.n_dst + rank as usize,
        }
    }

    /// Time of a stage's busiest links (bytes per bandwidth class).
    #[inline]
    fn time(&self, bytes: [u64; 2]) -> f64 {
        (bytes[0] as f64 * self.inv_bw[0]).max(bytes[1] as f64 * self.inv_bw[1])
    }

    /// Adds `bytes` to a link in `stage`. Destination egress inside the
    /// node is timed at the intra-node bandwidth, every other link (the
    /// ingress side of a transfer inside the node included) at the
    /// network's, so the busiest time of a stage is the larger of the two
    /// classes' busiest links.
    #[inline]
    fn add(&mut self, stage: u16, kind: usize, rank: Rank, bytes: u64) {
        let s = stage as usize;
        let need = (s + 1) * self.n_links;
        if self.loads.len() < need {
            self.loads.resize(need, 0);
        }
        let i = s * self.n_links + self.link(kind, rank);
        let load = self.loads[i] + bytes;
        self.loads[i] = load;
        let class = &mut self.pending[s][(kind == DST_OUT_NV) as usize];
        if load > *class {
            *class = load;
        }
        self.top = self.top.max(s + 1);
    }

    /// Takes back what [`add`](Self::add) added.
    #[inline]
    fn sub(&mut self, stage: u16, kind: usize, rank: Rank, bytes: u64) {
        let i = stage as usize * self.n_links + self.link(kind, rank);
        self.loads[i] -= bytes;
    }

    /// Source rank `r`'s stage-0 egress so far plus what pieces only it
    /// holds will still add.
    #[inline]
    fn outlook(&self, r: Rank) -> u64 {
        self.load(0, SRC_OUT, r).saturating_add(self.forced[r as usize])
    }

    /// Counts (`on`) or takes back what a piece of `bytes` held by
    /// `candidates` is expected to add to their egress: once per receiving
    /// node, shared evenly among them (`shares`), and all of it to the
    /// one candidate of a piece only one rank holds (`forced`); `k` is
    /// the number of receiving nodes.
    #[inline]
    pub(super) fn expect(&mut self, candidates: &[Rank], bytes: u64, k: u64, on: bool) {
        let total = k.saturating_mul(bytes);
        let share = total / candidates.len().max(1) as u64;
        let change = |x: &mut u64, by: u64| *x = if on { x.saturating_add(by) } else { x.saturating_sub(by) };
        if let [only] = candidates {
            change(&mut self.forced[*only as usize], total);
            if on {
                self.src_max = self.src_max.max(self.forced[*only as usize]);
            }
        }
        for &c in candidates {
            change(&mut self.shares[c as usize], share);
        }
    }

    /// The number of destination nodes among `receivers` (at least 1).
    #[inline]
    pub(super) fn nodes(&self, receivers: &[Rank]) -> u64 {
        // The receivers are sorted, so a node's are a run.
        let mut k = 0u64;
        let mut last = u32::MAX;
        for &r in receivers {
            let n = self.dst_node[r as usize];
            if n != last {
                (k, last) = (k + 1, n);
            }
        }
        k.max(1)
    }

    #[inline]
    fn load(&self, stage: u16, kind: usize, rank: Rank) -> u64 {
        self.loads.get(stage as usize * self.n_links + self.link(kind, rank)).copied().unwrap_or(0)
    }

    /// Every source rank's stage-0 egress, by rank.
    pub(super) fn source_egress(&self) -> Vec<u64> {
        (0..self.n_src as Rank).map(|r| self.load(0, SRC_OUT, r)).collect()
    }

    /// Cost increase of the option being evaluated.
    fn delta(&self) -> f64 {
        (0..self.top).map(|s| self.time(self.pending[s]) - self.time(self.max_bytes[s])).sum()
    }

    /// Forgets the evaluated option's maxima.
    fn forget(&mut self) {
        self.pending[..self.top].copy_from_slice(&self.max_bytes[..self.top]);
        self.top = 0;
    }

    /// Takes the relay option off the links and forgets it.
    fn rollback(&mut self, bytes: u64) {
        for i in 0..self.emitted.len() {
            let (from, to, stage) = self.emitted[i];
            let (out, inn) = self.link_kinds(from, to);
            self.sub(stage, out, from.rank, bytes);
            self.sub(stage, inn, to.rank, bytes);
        }
        self.emitted.clear();
        self.forget();
    }

    /// Puts the direct option on the links (`on`) or takes it off: each
    /// chosen source sends to its node's leader in stage 0, which fans out
    /// inside its node in stage 1.
    fn direct_links(&mut self, receivers: &[Rank], bytes: u64, on: bool) {
        // Stage 0 (source egress and leader ingress, both network links)
        // in one sweep over that stage's loads.
        let need = 2 * self.n_links;
        if self.loads.len() < need {
            self.loads.resize(need, 0);
        }
        let (n_src, loads) = (self.n_src, &mut self.loads[..self.n_links]);
        let (sources, leaders) = (&self.picks, &self.leaders);
        if on {
            let mut most = self.pending[0][0];
            for (&s, &l) in sources.iter().zip(leaders) {
                loads[s as usize] += bytes;
                loads[n_src + l as usize] += bytes;
                most = most.max(loads[s as usize]).max(loads[n_src + l as usize]);
            }
            self.pending[0][0] = most;
            self.top = self.top.max(1);
        } else {
            for (&s, &l) in sources.iter().zip(leaders) {
                loads[s as usize] -= bytes;
                loads[n_src + l as usize] -= bytes;
            }
        }
        if !self.fans {
            return;
        }
        // Stage 1: fan-out inside nodes.
        for j in 0..self.groups.len() {
            let (g, l) = (self.groups[j], self.leaders[j]);
            if g.1 - g.0 > 1 {
                for &r in &receivers[g.0 as usize..g.1 as usize] {
                    if r == l {
                        continue;
                    }
                    if on {
                        self.add(1, DST_OUT_NV, l, bytes);
                        self.add(1, DST_IN_NV, r, bytes);
                    } else {
                        self.sub(1, DST_OUT_NV, l, bytes);
                        self.sub(1, DST_IN_NV, r, bytes);
                    }
                }
            }
        }
    }

    /// Keeps the direct option: its maxima, and its transfers in `out`:
    /// the sources' sends to the leaders, then the leaders' fan-outs.
    fn commit_direct(&mut self, piece: u32, bytes: u64, receivers: &[Rank], out: &mut SenderLists) {
        self.max_bytes[..self.top].copy_from_slice(&self.pending[..self.top]);
        self.top = 0;
        for (&s, &l) in self.picks.iter().zip(&self.leaders) {
            self.src_node_load[self.src_node[s as usize] as usize] += bytes;
            self.src_max = self.src_max.max(self.outlook(s));
            out.push(0, Endpoint::src(s), Endpoint::dst(l), piece, bytes);
        }
        if !self.fans {
            return;
        }
        for (&g, &l) in self.groups.iter().zip(&self.leaders) {
            if g.1 - g.0 > 1 {
                for &r in &receivers[g.0 as usize..g.1 as usize] {
                    if r != l {
                        out.push(1, Endpoint::dst(l), Endpoint::dst(r), piece, bytes);
                    }
                }
            }
        }
    }

    /// Keeps the relay option: its maxima, and its transfers in `out`.
    fn commit(&mut self, piece: u32, bytes: u64, out: &mut SenderLists) {
        self.max_bytes[..self.top].copy_from_slice(&self.pending[..self.top]);
        self.top = 0;
        let mut emitted = std::mem::take(&mut self.emitted);
        for (from, to, stage) in emitted.drain(..) {
            if from.group == Group::Src {
                self.src_node_load[self.src_node[from.rank as usize] as usize] += bytes;
                self.src_max = self.src_max.max(self.outlook(from.rank));
            }
            out.push(stage, from, to, piece, bytes);
        }
        self.emitted = emitted;
    }

    /// A lower bound on the relay option's cost, computed while the direct
    /// option's additions are still applied: the growth of the stage-0
    /// maximum from the relay's one source send (the source's load before
    /// the direct option was at least its load now minus `k` sends) and its
    /// first leader's ingress (direct added exactly this piece to it).
    fn relay_first_hop_cost(&self, candidates: &[Rank], bytes: u64) -> f64 {
        let k = self.leaders.len() as u64;
        let least = candidates.iter().map(|&c| self.load(0, SRC_OUT, c)).min().unwrap_or(0);
        let src = (least.saturating_sub(k * bytes) + bytes) as f64 / self.net_bw;
        let dst = self.load(0, DST_IN_NET, self.leaders[0]) as f64 / self.net_bw;
        (src.max(dst) - self.time(self.max_bytes[0])).max(0.0)
    }

    /// Chooses `k` senders in turn, each the least loaded (as
    /// [`best_source`](Self::best_source)) after the earlier choices' bytes.
    fn pick_sources(&mut self, candidates: &[Rank], k: usize, bytes: u64) {
        self.picks.clear();
        if let [only] = candidates {
            self.picks.resize(k, *only);
            return;
        }
        // (egress, node egress) as one number, compared at once.
        let mut cand = std::mem::take(&mut self.cand);
        cand.clear();
        cand.extend(candidates.iter().map(|&c| {
            let node = self.src_node_load[self.src_node[c as usize] as usize];
            ((self.outlook(c) as u128) << 64 | node as u128, c)
        }));
        for _ in 0..k {
            let (mut best, mut least) = (0, cand[0].0);
            for (i, &(key, _)) in cand.iter().enumerate().skip(1) {
                if key < least {
                    (best, least) = (i, key);
                }
            }
            cand[best].0 += (bytes as u128) << 64;
            self.picks.push(cand[best].1);
        }
        self.cand = cand;
    }

    /// The candidate with the least outlook; ties go to the one on the
    /// least loaded source node, then to the one listed first.
    fn best_source(&self, candidates: &[Rank]) -> Rank {
        let mut best = candidates[0];
        let mut best_load = (u64::MAX, u64::MAX);
        for &c in candidates {
            let l = (self.outlook(c), self.src_node_load[self.src_node[c as usize] as usize]);
            if l < best_load {
                best = c;
                best_load = l;
            }
        }
        best
    }

    /// The links a transfer loads: the sender's and the receiver's.
    #[inline]
    fn link_kinds(&self, from: Endpoint, to: Endpoint) -> (usize, usize) {
        match (from.group, from.group == Group::Dst && self.dst_node[from.rank as usize] == self.dst_node[to.rank as usize]) {
            (Group::Src, _) => (SRC_OUT, DST_IN_NET),
            (Group::Dst, false) => (DST_OUT_NET, DST_IN_NET),
            (Group::Dst, true) => (DST_OUT_NV, DST_IN_NV),
        }
    }

    fn send(&mut self, from: Endpoint, to: Endpoint, stage: u16, bytes: u64) {
        let (out, inn) = self.link_kinds(from, to);
        self.add(stage, out, from.rank, bytes);
        self.add(stage, inn, to.rank, bytes);
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

    pub(super) fn assign(&mut self, piece: u32, bytes: u64, receivers: &[Rank], candidates: &[Rank], out: &mut SenderLists) {
        // Receivers grouped by node (they are sorted, so groups are runs).
        self.groups.clear();
        self.leaders.clear();
        self.fans = false;
        let mut start = 0;
        let mut node = receivers.first().map_or(0, |&r| self.dst_node[r as usize]);
        for i in 1..=receivers.len() {
            let next = receivers.get(i).map_or(u32::MAX, |&r| self.dst_node[r as usize]);
            if next != node {
                let leader = match &receivers[start..i] {
                    &[only] => only,
                    g => {
                        self.fans = true;
                        g.iter().copied().min_by_key(|&r| (self.dst_in_total[r as usize], r)).unwrap_or(g[0])
                    }
                };
                self.groups.push((start as u32, i as u32));
                self.leaders.push(leader);
                (start, node) = (i, next);
            }
        }
        let k = self.groups.len();
        let group = |g: (u32, u32)| &receivers[g.0 as usize..g.1 as usize];

        // Option A: direct from sources to every node; senders chosen as
        // `best_source` would, one after another, on a local copy of the
        // candidates' loads.
        self.pick_sources(candidates, k, bytes);
        self.direct_links(receivers, bytes, true);
        let direct_cost = if k >= 2 { self.delta() } else { 0.0 };
        let mut direct = true;
        // The relay costs at least its first hop's growth of the stage-0
        // maximum; skip evaluating it when that alone is no better.
        if k >= 2 && self.relay_first_hop_cost(candidates, bytes) < direct_cost {
            self.direct_links(receivers, bytes, false);
            self.forget();

            // Option B: one source send, then node-to-node doubling.
            let s = self.best_source(candidates);
            let l0 = self.leaders[0];
            self.send(Endpoint::src(s), Endpoint::dst(l0), 0, bytes);
            self.arrival.clear();
            self.arrival.resize(k, 0);
            let (mut have, mut stage) = (1usize, 1u16);
            while have < k {
                let senders = have;
                for i in 0..senders {
                    if have >= k {
                        break;
                    }
                    let (from, to) = (self.leaders[i], self.leaders[have]);
                    self.send(Endpoint::dst(from), Endpoint::dst(to), stage, bytes);
                    self.arrival[have] = stage;
                    have += 1;
                }
                stage += 1;
            }
            for j in 0..k {
                let (g, l, a) = (self.groups[j], self.leaders[j], self.arrival[j]);
                self.fan_out(l, group(g), a + 1, bytes);
            }
            if self.delta() + 1e-15 >= direct_cost {
                self.rollback(bytes);
                self.direct_links(receivers, bytes, true);
            } else {
                direct = false;
            }
        }
        for j in 0..k {
            self.dst_in_total[self.leaders[j] as usize] += bytes;
        }
        if direct {
            self.commit_direct(piece, bytes, receivers, out);
        } else {
            self.commit(piece, bytes, out);
        }
    }
}
