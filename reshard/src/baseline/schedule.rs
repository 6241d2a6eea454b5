//! The baseline's transfers, made in order ([`schedule`]), and the
//! endpoints as indices ([`Ends`]).

use super::outline::Outline;
use super::packer::Packer;
use super::{Move, Step};
use crate::layout::Layout;
use crate::plan::{Endpoint, Group};

/// Makes the baseline's pieces and transfers, tensor by tensor and chunk by
/// chunk, placing every transfer in its round with `packer` (see the
/// module's doc), and hands them to `step`.
pub(super) fn schedule(o: &Outline, ends: &Ends, packer: &mut Packer, mut step: impl FnMut(Step)) {
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
pub(super) struct Ends {
    n_src: usize,
    n_dst: usize,
    src_rpn: u32,
    dst_rpn: u32,
}

impl Ends {
    pub(super) fn new(src: &Layout, dst: &Layout) -> Ends {
        Ends {
            n_src: src.ranks() as usize,
            n_dst: dst.ranks() as usize,
            src_rpn: src.ranks_per_node().max(1),
            dst_rpn: dst.ranks_per_node().max(1),
        }
    }

    #[inline]
    pub(super) fn count(&self) -> usize {
        self.n_src + self.n_dst
    }

    #[inline]
    pub(super) fn idx(&self, e: Endpoint) -> usize {
        match e.group {
            Group::Src => e.rank as usize,
            Group::Dst => self.n_src + e.rank as usize,
        }
    }

    #[inline]
    pub(super) fn node(&self, e: Endpoint) -> u32 {
        match e.group {
            Group::Src => e.rank / self.src_rpn,
            Group::Dst => e.rank / self.dst_rpn,
        }
    }

    /// Whether a transfer crosses a node boundary (source and destination
    /// nodes are distinct machines).
    #[inline]
    pub(super) fn cross(&self, from: Endpoint, to: Endpoint) -> bool {
        from.group != to.group || self.node(from) != self.node(to)
    }
}
