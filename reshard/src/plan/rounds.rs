//! Round assignment for plans whose planner lists transfers by sender:
//! [`SenderLists`] collects them, [`RoundPacker`] packs each stage's pairs
//! of ranks into rounds under the staging limit, and the figures follow
//! from what it packed.

use super::{Endpoint, Figures, Group, Plan, Transfer};

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
    /// What packing these transfers into rounds costs, in units of work
    /// ([`Budget`](super::Budget)): per stage, each endpoint's number of
    /// peers squared, summed (an endpoint with room left weighs its waiting
    /// pairs against each other for each pair it starts). Counted in one
    /// pass over the transfers, before the packing.
    pub(crate) fn packing_work(&self) -> u64 {
        let mut peers = vec![0u64; self.n];
        let mut seen = vec![u32::MAX; self.n];
        let mut work = 0u64;
        for senders in &self.stages {
            peers.iter_mut().for_each(|p| *p = 0);
            seen.iter_mut().for_each(|s| *s = u32::MAX);
            for (a, sends) in senders.iter().enumerate() {
                for &(z, _) in &sends.to {
                    if seen[z as usize] != a as u32 {
                        seen[z as usize] = a as u32;
                        peers[a] += 1;
                        peers[z as usize] += 1;
                    }
                }
            }
            work = peers.iter().fold(work, |w, &p| w.saturating_add(p.saturating_mul(p)));
        }
        work
    }

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
        self.stages[stage as usize][a].add(z as u32, piece, bytes);
        self.len += 1;
    }
}

impl SenderLists {
    /// Source rank `rank`'s stage-0 transfers, in the order added:
    /// (position, receiver, piece, bytes); the receiver as an index over
    /// both groups (destination rank `n_src + r`).
    pub(crate) fn source_sends(&self, rank: u32) -> impl Iterator<Item = (u32, u32, u32, u64)> + '_ {
        let sends = self.stages.first().and_then(|s| s.get(rank as usize));
        let (to, runs) = sends.map_or((&[][..], &[][..]), |s| (&s.to[..], &s.bytes[..]));
        let mut run = 0;
        to.iter().enumerate().map(move |(i, &(z, piece))| {
            while run + 1 < runs.len() && runs[run + 1].0 as usize <= i {
                run += 1;
            }
            (i as u32, z, piece, runs[run].1)
        })
    }

    /// Gives stage-0 transfers of source ranks to other source ranks:
    /// each `(sender, position, new sender)` (positions as
    /// [`source_sends`](Self::source_sends) numbers them, each at most
    /// once). A sender keeps its other transfers in their order; the new
    /// sender takes the moved ones after its own, in the order of `moves`.
    pub(crate) fn move_source_sends(&mut self, moves: &[(u32, u32, u32)]) {
        if moves.is_empty() {
            return;
        }
        let stage = &mut self.stages[0];
        let mut gone: Vec<(u32, u32)> = moves.iter().map(|&(s, at, _)| (s, at)).collect();
        gone.sort_unstable();
        let taken: Vec<(u32, u32, u32, u64)> = moves
            .iter()
            .map(|&(s, at, to)| {
                let sends = &stage[s as usize];
                let run = sends.bytes.partition_point(|&(p, _)| p <= at) - 1;
                let (z, piece) = sends.to[at as usize];
                (to, z, piece, sends.bytes[run].1)
            })
            .collect();
        let mut k = 0;
        while k < gone.len() {
            let s = gone[k].0;
            let end = k + gone[k..].iter().take_while(|g| g.0 == s).count();
            let old = std::mem::take(&mut stage[s as usize]);
            let kept = &mut stage[s as usize];
            let mut drop = gone[k..end].iter().map(|g| g.1).peekable();
            let mut run = 0;
            for (i, &(z, piece)) in old.to.iter().enumerate() {
                while run + 1 < old.bytes.len() && old.bytes[run + 1].0 as usize <= i {
                    run += 1;
                }
                if drop.peek() == Some(&(i as u32)) {
                    drop.next();
                    continue;
                }
                kept.add(z, piece, old.bytes[run].1);
            }
            k = end;
        }
        for (to, z, piece, bytes) in taken {
            stage[to as usize].add(z, piece, bytes);
        }
    }
}

impl Sends {
    /// Appends a transfer to `z` of `piece`, `bytes` on the wire.
    #[inline(always)]
    fn add(&mut self, z: u32, piece: u32, bytes: u64) {
        if self.last != bytes {
            self.last = bytes;
            self.bytes.push((self.to.len() as u32, bytes));
        }
        self.to.push((z, piece));
    }
}

/// Assigns rounds to transfers grouped by sender, stage by stage (see
/// [`RoundPacker`]), lays them out by stage, sender, then the order they
/// were added in, and computes the figures.
pub(super) fn finish_by_sender(plan: &mut Plan, mut lists: SenderLists) {
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
    use crate::{parse_layout, plan_baseline, plan_reshard, Layout, PlanOptions, Strategy};
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
}
