//! The baseline's rounds: [`Packer`] places each transfer first-fit in
//! the first round, at or after the one its data is there in, where both
//! its ranks have room.

/// First-fit placement of transfers into rounds, in the order they come:
/// each goes to the first round at or after the one its data is ready in
/// where both its ranks have room: on the transfer's lane (network out,
/// network in, intra-node out, intra-node in) no more than a chunk, and in
/// all no more than the cap (a rank with nothing on the lane, or nothing
/// in the round, takes any transfer that fits the other limit). Per rank
/// and lane it keeps a skip list (union-find with path halving) over rounds
/// that are nearly full, so a search jumps over them instead of scanning,
/// and the bytes it stages per round, by lane where it uses more than one.
pub(super) struct Packer {
    cap: u64,
    /// A round counts as full once less than 1/16 of the cap is left.
    nearly_full: u64,
    lane_cap: u64,
    lane_nearly_full: u64,
    pub(super) ranks: Vec<RankRounds>,
    /// Ranks with any bytes.
    pub(super) touched: Vec<usize>,
    /// Rounds used so far.
    pub(super) rounds: u32,
}

/// One rank's rounds.
#[derive(Clone, Default)]
pub(super) struct RankRounds {
    /// Bytes staged per round, all lanes together.
    pub(super) total: Vec<u64>,
    /// Lanes used so far (bit `k` for lane `k`); while only one is, its
    /// bytes are `total` and `lanes` stays empty.
    kinds: u8,
    lanes: [Vec<u64>; 4],
    /// Per lane, `skip[l][x] != x` marks round `x` full for lane `l`.
    skip: [Vec<u32>; 4],
}

impl RankRounds {
    /// Bytes on `lane` in round `r`.
    #[inline]
    pub(super) fn lane(&self, r: usize, lane: usize) -> u64 {
        let bit = 1u8 << lane;
        if self.kinds & bit == 0 {
            0
        } else if self.kinds == bit {
            self.total.get(r).copied().unwrap_or(0)
        } else {
            self.lanes[lane].get(r).copied().unwrap_or(0)
        }
    }

    pub(super) fn fits(&self, r: u32, lane: usize, bytes: u64, cap: u64, lane_cap: u64) -> bool {
        let t = self.total.get(r as usize).copied().unwrap_or(0);
        let l = self.lane(r as usize, lane);
        (t == 0 || t + bytes <= cap) && (l == 0 || l + bytes <= lane_cap)
    }

    /// Adds `bytes` on `lane` in round `r`; returns the round's new total
    /// and the lane's.
    pub(super) fn add(&mut self, r: u32, lane: usize, bytes: u64) -> (u64, u64) {
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
    #[inline]
    pub(super) fn loads(&self, r: usize) -> [u64; 4] {
        let mut out = [0u64; 4];
        for (k, o) in out.iter_mut().enumerate() {
            *o = self.lane(r, k);
        }
        out
    }
}

/// Marks round `r` full in `skip`.
pub(super) fn mark_full(skip: &mut Vec<u32>, r: u32) {
    if skip.len() <= r as usize + 1 {
        let from = skip.len() as u32;
        skip.extend(from..r + 2);
    }
    skip[r as usize] = r + 1;
}

impl Packer {
    pub(super) fn new(ranks: usize, max_staging_bytes: u64, chunk: u64) -> Packer {
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
    pub(super) fn local(&mut self, r: u32) {
        self.rounds = self.rounds.max(r + 1);
    }

    /// Places a transfer of `bytes` from rank `a` to rank `z` (indices,
    /// distinct) whose data is there from round `ready`; returns its round.
    pub(super) fn place(&mut self, a: usize, z: usize, cross: bool, bytes: u64, ready: u32) -> u32 {
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
pub(super) fn open_round(skip: &mut [u32], mut r: u32) -> u32 {
    while (r as usize) < skip.len() && skip[r as usize] != r {
        let next = skip[r as usize];
        if (next as usize) < skip.len() {
            skip[r as usize] = skip[next as usize];
        }
        r = next;
    }
    r
}
