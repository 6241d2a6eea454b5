//! [`SenderLists`]: a planner's transfers by stage and sender, as the
//! reshard planner makes them and the round packer reads them.

use crate::plan::{Endpoint, Group};

/// A planner's transfers grouped by stage and by sender: the receiver
/// and piece of each, in the order they were added. Every transfer goes to
/// a destination rank and reads and writes the ranks' own shards (no
/// scratch buffers).
pub(crate) struct SenderLists {
    n_src: usize,
    n: usize,
    /// Per stage, per sender (endpoint index).
    pub(super) stages: Vec<Vec<Sends>>,
    pub(super) len: usize,
}

/// One sender's transfers in one stage of [`SenderLists`].
#[derive(Clone)]
pub(super) struct Sends {
    /// (receiver, piece), in the order added.
    pub(super) to: Vec<(u32, u32)>,
    /// Where the bytes of a transfer change: (position in `to`, bytes from
    /// there on). A planner that adds pieces by size adds few.
    pub(super) bytes: Vec<(u32, u64)>,
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
    /// ([`Budget`](crate::plan::Budget)): per stage, each endpoint's number of
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
    pub(super) fn add(&mut self, z: u32, piece: u32, bytes: u64) {
        if self.last != bytes {
            self.last = bytes;
            self.bytes.push((self.to.len() as u32, bytes));
        }
        self.to.push((z, piece));
    }
}
