//! The reshard planner: intersect both layouts, send each destination node
//! exactly the union of what its ranks need, choose senders and relays with
//! the link model, fan out inside nodes.
//!
//! [`plan_reshard`] runs the steps in order: match tensors
//! ([`matching`]), compute each tensor's overlap, shared among tensors
//! placed alike ([`template`]), order the pieces largest first, assign
//! each its senders and relays ([`assigner`], which may split a piece
//! among its holders), move source sends among holders
//! ([`rebalance`](crate::rebalance)), and pack the rounds.

mod assigner;
mod matching;
mod template;

pub(crate) use matching::{hash_scale, match_tensors, placed_alike, placement_key, scaled_alike, wire_pairs, Matched};
pub(crate) use template::{add_node_needs, expand_work, receivers_of};

use crate::block::Block;
use crate::layout::{Layout, Rank};
use crate::plan::{Budget, Piece, Plan, PlanError, PlanOptions, PlanParts, SenderLists, Strategy, MAX_PIECES};
use crate::rebalance::rebalance;
use assigner::Assigner;
use template::{Overlaps, Template, NOT_PLANNED};

/// One piece still to be assigned senders.
#[derive(Clone, Copy)]
struct Work {
    piece: u32,
    bytes: u64,
    receivers: (u32, u32),
    candidates: (u32, u32),
    /// Destination nodes among the receivers.
    nodes: u32,
}

/// Plans a reshard from `src` to `dst`.
pub fn plan_reshard(src: &Layout, dst: &Layout, options: &PlanOptions) -> Result<Plan, PlanError> {
    let (matched, routes) = match_tensors(src, dst, options.quantize_at)?;
    let only = options.only.as_ref().map(|s| s.mask(dst)).transpose()?;
    let mut budget = Budget::new(options.max_work);
    let overlaps = Overlaps::new(src, dst, (&matched, &routes), only.as_deref(), options, &mut budget)?;
    let mut ordered = Ordered::new(&overlaps, &matched);
    let mut assigner = Assigner::new(src, dst, options.links, options.min_split_bytes);
    let mut lists = ordered.assign((src, dst), &overlaps.pool, &mut assigner, &mut budget)?;
    let Ordered { pieces, holders, work } = ordered;
    drop(work);
    // Source sends move among their pieces' holders where that lowers the
    // busiest source rank.
    rebalance(&mut lists, assigner.source_egress(), &holders, &overlaps.pool);
    budget.take(lists.packing_work(), || "packing the transfers into rounds (ranks with many peers each)".into())?;
    let parts = PlanParts {
        pieces,
        wire: wire_pairs(&matched),
        routes,
        needed_node_bytes: overlaps.needs,
        unique_bytes: overlaps.unique_bytes,
        scratch_blocks: Vec::new(),
    };
    Ok(Plan::assemble_by_sender(Strategy::Reshard, src, dst, options, parts, lists))
}

/// The ranks of range `r` (start, length) of `pool`.
#[inline]
fn ranks(pool: &[Rank], r: (u32, u32)) -> &[Rank] {
    &pool[r.0 as usize..(r.0 + r.1) as usize]
}

/// The plan's pieces in tensor order and the work on them, largest first.
struct Ordered {
    pieces: Vec<Piece>,
    /// The ranks holding each piece (a range of the pool), for the last
    /// step.
    holders: Vec<(u32, u32)>,
    work: Vec<Work>,
}

impl Ordered {
    /// Pieces in tensor order, and the work on them largest first, ties by
    /// piece order (deterministic): a counting sort over the few distinct
    /// piece sizes, which the templates know.
    fn new(overlaps: &Overlaps, matched: &[Matched]) -> Ordered {
        let (templates, template_of, total_pieces) = (&overlaps.templates, &overlaps.template_of, overlaps.total_pieces);
        let mut sizes: Vec<u64> = templates.iter().flat_map(|t| t.pieces.iter().map(|p| p.0.numel() * t.wire.size())).collect();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        sizes.dedup();
        let size_of = |t: &Template| -> Vec<u32> {
            t.pieces.iter().map(|p| sizes.partition_point(|&s| s > p.0.numel() * t.wire.size()) as u32).collect()
        };
        let slots: Vec<Vec<u32>> = templates.iter().map(size_of).collect();
        let mut starts = vec![0usize; sizes.len() + 1];
        for &t in template_of.iter().filter(|&&t| t != NOT_PLANNED) {
            for &slot in &slots[t as usize] {
                starts[slot as usize + 1] += 1;
            }
        }
        for i in 1..starts.len() {
            starts[i] += starts[i - 1];
        }
        let mut pieces: Vec<Piece> = Vec::with_capacity(total_pieces as usize);
        let mut holders: Vec<(u32, u32)> = Vec::with_capacity(total_pieces as usize);
        let mut work: Vec<Work> = vec![Work { piece: 0, bytes: 0, receivers: (0, 0), candidates: (0, 0), nodes: 0 }; total_pieces as usize];
        for (td, (m, &t)) in matched.iter().zip(template_of).enumerate() {
            let Some(&(ts, _, _)) = m.as_ref().filter(|_| t != NOT_PLANNED) else {
                continue;
            };
            let t = t as usize;
            for (&(block, receivers, candidates), &slot) in templates[t].pieces.iter().zip(&slots[t]) {
                let at = &mut starts[slot as usize];
                work[*at] = Work { piece: pieces.len() as u32, bytes: sizes[slot as usize], receivers, candidates, nodes: 0 };
                *at += 1;
                pieces.push(Piece { src_tensor: ts, dst_tensor: td as u32, block });
                holders.push(candidates);
            }
        }
        Ordered { pieces, holders, work }
    }

    /// Assigns every piece its senders, largest first, splitting some among
    /// their holders (new pieces at the end of the list); returns the
    /// transfers by sender.
    fn assign(
        &mut self,
        (src, dst): (&Layout, &Layout),
        pool: &[Rank],
        assigner: &mut Assigner,
        budget: &mut Budget,
    ) -> Result<SenderLists, PlanError> {
        // Every receiver of a piece gets one transfer of it, almost all from a
        // source in stage 0.
        let expected = self.work.iter().map(|w| w.receivers.1 as usize).sum();
        let mut lists = SenderLists::new(src.ranks(), dst.ranks(), expected);
        // What every piece is expected to add to the egress of the source
        // ranks holding it (see `Assigner::expect`).
        for w in self.work.iter_mut() {
            w.nodes = assigner.nodes(ranks(pool, w.receivers)) as u32;
            assigner.expect(ranks(pool, w.candidates), w.bytes, w.nodes as u64, true);
        }
        let mut parts: Vec<(Block, u64, Option<Rank>)> = Vec::new();
        for w in &self.work {
            let (receivers, candidates) = (ranks(pool, w.receivers), ranks(pool, w.candidates));
            let k = w.nodes as u64;
            assigner.expect(candidates, w.bytes, k, false);
            // A piece that several ranks hold may be split among them (parts
            // of whole rows), where that lowers the busiest source link; the
            // first part keeps the piece's index, the others are new pieces.
            let room = MAX_PIECES.saturating_sub(self.pieces.len() as u64).min(budget.left() / (1 + receivers.len() as u64));
            let piece = self.pieces[w.piece as usize];
            if !assigner.split(&piece.block, w.bytes, k, candidates, room, &mut parts) {
                assigner.assign(w.piece, w.bytes, receivers, candidates, &mut lists);
                continue;
            }
            // Each part past the first is a piece more, delivered to every
            // receiver (within `room`, so within the budget).
            let more = (parts.len() as u64).saturating_sub(1).saturating_mul(1 + receivers.len() as u64);
            budget.take(more, || format!("splitting a piece of tensor '{}'", dst.tensors()[piece.dst_tensor as usize].name))?;
            for (i, &(block, bytes, sender)) in parts.iter().enumerate() {
                let index = if i == 0 {
                    self.pieces[w.piece as usize].block = block;
                    w.piece
                } else {
                    self.pieces.push(Piece { block, ..piece });
                    self.holders.push(w.candidates);
                    self.pieces.len() as u32 - 1
                };
                match sender {
                    Some(s) => assigner.assign(index, bytes, receivers, &[s], &mut lists),
                    None => assigner.assign(index, bytes, receivers, candidates, &mut lists),
                }
            }
        }
        Ok(lists)
    }
}
