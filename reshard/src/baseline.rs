//! The gather-and-broadcast baseline, as RL frameworks do it today: per
//! tensor, gather the whole tensor on one source rank (the first rank of its
//! mesh), broadcast it whole to every destination rank holding any of it
//! (one copy per destination node, relayed node to node by doubling, then
//! fanned out inside the node), and let each rank keep its slices.
//!
//! Same pieces, transfers and figures as the reshard, so the two compare on
//! equal terms.

use crate::block::Block;
use crate::dtype::{wire_dtype, DType};
use crate::layout::{Layout, Placement, Rank};
use crate::overlap::{atomize, SourceIndex};
use crate::plan::{Endpoint, Piece, Plan, PlanError, PlanOptions, PlanParts, Strategy, Transfer, MAX_PIECES};
use crate::planner::{add_node_needs, match_tensors, receivers_of};

/// Plans the gather-broadcast baseline from `src` to `dst`.
pub fn plan_baseline(src: &Layout, dst: &Layout, options: &PlanOptions) -> Result<Plan, PlanError> {
    let matched = match_tensors(src, dst)?;
    let mut pieces: Vec<Piece> = Vec::new();
    let mut by_stage: Vec<Vec<Transfer>> = Vec::new();
    let mut transfers = StageLists(&mut by_stage);
    let mut needs = vec![0u64; dst.nodes() as usize];
    let mut unique_bytes = 0u64;
    let rpn = dst.ranks_per_node();
    // Local copies out of scratch happen after every broadcast stage.
    let mut finals: Vec<Transfer> = Vec::new();
    let mut last_stage = 0u16;
    let mut scratch_blocks: Vec<Block> = dst.tensors().iter().map(|t| Block::full(&t.shape)).collect();
    for (td, &(ts, sd, dd)) in matched.iter().enumerate() {
        let tensor = &src.tensors()[ts as usize];
        let hs = src.holdings(ts);
        let hd = dst.holdings(td as u32);
        if hd.is_empty() {
            continue;
        }
        let wire = wire_dtype(sd, dd);
        // Lower-bound bookkeeping, identical to the reshard's.
        for atom in atomize(&hd) {
            let bytes = atom.block.numel() * wire.size();
            unique_bytes += bytes;
            add_node_needs(&mut needs, &receivers_of(&hd, &atom.holdings), rpn, bytes);
        }
        // The whole needed extent: the bounding box of every destination
        // block (the whole tensor, whenever the destination holds all of it).
        let full = bounding_box(hd.iter().map(|h| h.block));
        if pieces.len() as u64 + 2 * full.numel().div_ceil(max_elems_for(options, sd)) > MAX_PIECES {
            return Err(PlanError::TooManyPieces { tensor: tensor.name.clone(), limit: MAX_PIECES });
        }
        scratch_blocks[td] = full;
        let root = match &tensor.placement {
            Placement::Mesh(m) => m.ranks[0],
            Placement::Shards(_) => hs.iter().flat_map(|h| h.holders.iter().map(|l| l.rank)).min().unwrap_or(0),
        };
        // Gather onto the root's scratch buffer.
        let index = SourceIndex::new(&hs);
        let covers = index.cover(&full).map_err(|region| PlanError::BaselineNotCovered {
            tensor: tensor.name.clone(),
            extent: Box::new(full),
            region,
        })?;
        let gather_elems = (options.max_staging_bytes / sd.size()).max(1);
        for c in covers {
            let sender = if c.candidates.contains(&root) { root } else { c.candidates[0] };
            for block in c.block.split_to_fit(gather_elems) {
                let piece = pieces.len() as u32;
                pieces.push(Piece { src_tensor: ts, dst_tensor: td as u32, block });
                transfers.push(Transfer {
                    piece,
                    from: Endpoint::src(sender),
                    to: Endpoint::src(root),
                    stage: 0,
                    from_scratch: false,
                    to_scratch: true,
                    round: 0,
                });
            }
        }
        // Broadcast the whole tensor: root -> first node, doubling across
        // nodes, then fan-out inside each node.
        let all: Vec<u32> = (0..hd.len() as u32).collect();
        let receivers = receivers_of(&hd, &all);
        let mut groups: Vec<&[Rank]> = Vec::new();
        let mut start = 0;
        for i in 1..=receivers.len() {
            if i == receivers.len() || receivers[i] / rpn != receivers[start] / rpn {
                groups.push(&receivers[start..i]);
                start = i;
            }
        }
        let elems = (options.max_staging_bytes / wire.size()).max(1);
        for block in full.split_to_fit(elems) {
            let piece = pieces.len() as u32;
            pieces.push(Piece { src_tensor: ts, dst_tensor: td as u32, block });
            let mut push = |from: Endpoint, to: Endpoint, stage: u16| {
                transfers.push(Transfer { piece, from, to, stage, from_scratch: true, to_scratch: true, round: 0 });
            };
            push(Endpoint::src(root), Endpoint::dst(groups[0][0]), 1);
            let mut arrival = vec![1u16; groups.len()];
            let (mut have, mut stage) = (1usize, 2u16);
            while have < groups.len() {
                let senders = have;
                for i in 0..senders {
                    if have >= groups.len() {
                        break;
                    }
                    push(Endpoint::dst(groups[i][0]), Endpoint::dst(groups[have][0]), stage);
                    arrival[have] = stage;
                    have += 1;
                }
                stage += 1;
            }
            for (g, &a) in groups.iter().zip(&arrival) {
                for &r in &g[1..] {
                    push(Endpoint::dst(g[0]), Endpoint::dst(r), a + 1);
                    last_stage = last_stage.max(a + 1);
                }
                last_stage = last_stage.max(a);
            }
        }
        // Each rank keeps its slices.
        for h in &hd {
            let piece = pieces.len() as u32;
            pieces.push(Piece { src_tensor: ts, dst_tensor: td as u32, block: h.block });
            let mut ranks: Vec<Rank> = h.holders.iter().map(|l| l.rank).collect();
            ranks.dedup();
            for r in ranks {
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
        t.stage = last_stage + 1;
        transfers.push(t);
    }
    let parts = PlanParts {
        pieces,
        wire: matched.iter().map(|&(_, s, d)| (s, d)).collect(),
        needed_node_bytes: needs,
        unique_bytes,
        scratch_blocks,
    };
    Ok(Plan::assemble(Strategy::Baseline, src, dst, options, parts, by_stage))
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
