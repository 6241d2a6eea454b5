//! [`RoundPacker`]: the rounds of one stage at a time, filled pair of
//! ranks by pair of ranks.

use super::sender_lists::Sends;
use crate::plan::{Endpoint, Plan, Transfer};

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
/// [`SenderLists`](super::SenderLists) is read and then written.
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
pub(super) struct RoundPacker {
    pub(super) n: usize,
    pub(super) n_src: usize,
    cap: u64,
    /// The stage's pairs: their ends, then their state while transfers are
    /// read, while rounds are filled and while rounds are written (small
    /// records for the passes over every transfer).
    ends: Vec<(u32, u32)>,
    reading: Vec<Reading>,
    pairs: Vec<Pair>,
    writing: Vec<Writing>,
    /// Per endpoint: its pair with the sender at hand, while a stage of
    /// [`SenderLists`](super::SenderLists) is read and written.
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
    pub(super) messages: u64,
    pub(super) sent_msgs: Vec<u64>,
    pub(super) recv_msgs: Vec<u64>,
    /// Bytes from sender to receiver, per pair of every stage.
    pub(super) traffic: Vec<(u32, u32, u64)>,
}

impl RoundPacker {
    pub(super) fn new(plan: &Plan) -> RoundPacker {
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

    /// Assigns rounds `base..` to one stage of [`SenderLists`](super::SenderLists): appends its
    /// transfers to `out` with rounds `base..`, sender after sender, each
    /// sender's in the order they were added (and then frees its list).
    /// Pairs are numbered by sender, then by first appearance of the
    /// receiver.
    #[inline]
    pub(super) fn stage_by_sender(&mut self, senders: &mut [Sends], stage: u16, base: u32, out: &mut Vec<Transfer>) -> u32 {
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
