//! The broadcast trees among one set of destination ranks ([`Chain`]: a
//! ring per channel) and the interned chains and (sender, receiver) pairs
//! the recipes share ([`Interned`]).

use crate::layout::Rank;
use crate::plan::Endpoint;
use std::collections::HashMap;

/// The broadcast trees among one set of destination ranks.
pub(super) struct Chain {
    /// The receivers, ascending.
    pub(super) receivers: Vec<Rank>,
    /// One tree per channel: as many as the most receivers on one node.
    pub(super) channels: Vec<Ring>,
}

/// One tree of a channel `c`: on every node, the `c`-th receiver (modulo
/// the node's receivers) leads; the root sends to the first node's leader,
/// each leader forwards to the next node's (nodes ascending) and to the
/// chain of its node's other receivers (from the leader on, going round),
/// each of which forwards to the next.
pub(super) struct Ring {
    /// The receiver of the root's send (an index into
    /// [`Chain::receivers`]).
    pub(super) entry: u32,
    /// Every other hop: (sender, receiver, pair), senders and receivers as
    /// indices into [`Chain::receivers`], each after the hop that brought
    /// its sender the data.
    pub(super) hops: Vec<(u32, u32, u32)>,
}

impl Chain {
    /// The hops of [`Chain::new`]'s rings among `receivers` (sorted),
    /// counted without making them: one ring per receiver of the fullest
    /// node, each reaching every receiver.
    /// Also the nodes the chain passes, one after another.
    pub(super) fn hops(receivers: &[Rank], rpn: u32) -> (u64, u64) {
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

    pub(super) fn new(receivers: &[Rank], rpn: u32, pairs: &mut Pairs) -> Chain {
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
pub(super) struct Interned {
    pub(super) chains: Vec<Chain>,
    pub(super) by_receivers: HashMap<Vec<Rank>, u32>,
    pub(super) pairs: Pairs,
}

impl Interned {
    /// The chain among `receivers` (sorted, deduplicated), `rpn` to a node.
    pub(super) fn chain(&mut self, receivers: Vec<Rank>, rpn: u32) -> u32 {
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
pub(super) struct Pairs {
    ids: HashMap<(Endpoint, Endpoint), u32>,
    pub(super) list: Vec<(Endpoint, Endpoint)>,
}

impl Pairs {
    pub(super) fn id(&mut self, from: Endpoint, to: Endpoint) -> u32 {
        *self.ids.entry((from, to)).or_insert_with(|| {
            self.list.push((from, to));
            self.list.len() as u32 - 1
        })
    }
}
