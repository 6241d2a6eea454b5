//! Round assignment for plans whose planner lists transfers by sender:
//! [`SenderLists`] collects them, [`RoundPacker`] packs each stage's pairs
//! of ranks into rounds under the staging limit, and the figures follow
//! from what it packed.

mod packer;
mod sender_lists;

pub(crate) use sender_lists::SenderLists;

use super::{Endpoint, Figures, Group, Plan};
use packer::RoundPacker;

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

#[cfg(test)]
mod tests;
