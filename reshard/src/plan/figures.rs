//! Traffic figures of a plan: bytes and messages per rank, node and
//! group, counted from its transfers.

use super::{Endpoint, Group, Plan, Transfer};

/// Traffic figures of a plan. Local copies (`from == to`) are not traffic.
///
/// **Bytes moved** is [`total_bytes`](Self::total_bytes): the payload of
/// every message between two ranks, counted once per message in the dtype
/// it travels in. It is the one figure `refit plan`, `refit run`,
/// `refit bench` and `orchestrator::RefitReport::bytes` report under that name, and it
/// splits exactly into bytes sent by source ranks
/// ([`src_egress_bytes`](Self::src_egress_bytes)) and bytes that
/// destination ranks forward to other destination ranks
/// ([`relayed_bytes`](Self::relayed_bytes)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Figures {
    /// Bytes sent by source ranks (to destination ranks, and, in the
    /// baseline's gather, to other source ranks).
    pub src_egress_bytes: u64,
    /// Per source rank, the bytes it sends to other nodes (over its NIC):
    /// its part of [`src_egress_bytes`](Self::src_egress_bytes), less what
    /// it sends to ranks of its own node (the baseline's gather inside a
    /// node). One entry per source rank.
    pub src_rank_egress_bytes: Vec<u64>,
    /// Bytes entering each destination node from outside it.
    pub dst_node_ingress_bytes: Vec<u64>,
    /// Bytes crossing a node boundary (every source-to-destination byte does).
    pub cross_node_bytes: u64,
    /// Most bytes one rank sends.
    pub max_rank_send_bytes: u64,
    /// Most bytes one rank receives.
    pub max_rank_recv_bytes: u64,
    /// Number of messages (one per sender, receiver and round).
    pub messages: u64,
    /// Most messages one rank sends in a refit.
    pub max_rank_send_messages: u64,
    /// Most messages one rank receives in a refit.
    pub max_rank_recv_messages: u64,
    /// Bytes moved: every message's payload between two ranks (see the
    /// type's doc).
    pub total_bytes: u64,
    /// Number of rounds.
    pub rounds: u32,
    /// Number of dependency stages.
    pub stages: u32,
    /// Number of pieces.
    pub pieces: u64,
    /// Number of transfers, local copies included.
    pub transfers: u64,
}

impl Figures {
    /// Bytes destination ranks forward to other destination ranks: the
    /// fan-out inside a destination node (reshard), or the broadcast tree
    /// among destinations (baseline). `total_bytes - src_egress_bytes`.
    pub fn relayed_bytes(&self) -> u64 {
        self.total_bytes.saturating_sub(self.src_egress_bytes)
    }

    /// Most bytes one source rank sends to other nodes (the largest of
    /// [`src_rank_egress_bytes`](Self::src_rank_egress_bytes); 0 when there
    /// are none).
    pub fn max_src_rank_egress_bytes(&self) -> u64 {
        self.src_rank_egress_bytes.iter().copied().max().unwrap_or(0)
    }
}

/// The figures of a plan whose transfers have their rounds: `piece_bytes`
/// gives each piece's wire bytes to a destination and to a source receiver,
/// `rounds` and `stages` the numbers of rounds and stages.
pub(super) fn count_figures(plan: &Plan, piece_bytes: &[(u64, u64)], rounds: u32, stages: u32) -> Figures {
    let n_src = plan.src_ranks as usize;
    let n = n_src + plan.dst_ranks as usize;
    let idx = |e: Endpoint| match e.group {
        Group::Src => e.rank as usize,
        Group::Dst => n_src + e.rank as usize,
    };
    let bytes_of = |t: &Transfer| {
        let b = piece_bytes[t.piece as usize];
        if t.to.group == Group::Src {
            b.1
        } else {
            b.0
        }
    };
    let base = rounds;
    let mut f = Figures {
        dst_node_ingress_bytes: vec![0; plan.dst_ranks.div_ceil(plan.dst_rpn) as usize],
        src_rank_egress_bytes: vec![0; n_src],
        rounds: base,
        stages,
        pieces: plan.pieces.len() as u64,
        transfers: plan.transfers.len() as u64,
        ..Figures::default()
    };
    let mut sent = vec![0u64; n];
    let mut recv = vec![0u64; n];
    let (mut sent_msgs, mut recv_msgs) = (vec![0u64; n], vec![0u64; n]);
    // Node of every endpoint; source and destination nodes are distinct.
    let node: Vec<(Group, u32)> = (0..n)
        .map(|i| if i < n_src { plan.node_of(Endpoint::src(i as u32)) } else { plan.node_of(Endpoint::dst((i - n_src) as u32)) })
        .collect();
    // Messages: distinct (sender, receiver, round) triples, counted with a
    // bitmap over them (a hash set where the bitmap would be too large).
    let bits = (n * n) as u64 * base as u64;
    let mut bitmap: Vec<u64> = if bits <= 1 << 31 { vec![0; bits.div_ceil(64) as usize] } else { Vec::new() };
    let mut seen: std::collections::HashSet<(usize, usize, u32)> = std::collections::HashSet::new();
    for t in &plan.transfers {
        if t.from == t.to {
            continue;
        }
        let b = bytes_of(t);
        let (a, z) = (idx(t.from), idx(t.to));
        f.total_bytes += b;
        sent[a] += b;
        recv[z] += b;
        if t.from.group == Group::Src {
            f.src_egress_bytes += b;
        }
        let (from_node, to_node) = (node[a], node[z]);
        if from_node != to_node {
            f.cross_node_bytes += b;
            if t.from.group == Group::Src {
                f.src_rank_egress_bytes[a] += b;
            }
            if t.to.group == Group::Dst {
                f.dst_node_ingress_bytes[to_node.1 as usize] += b;
            }
        }
        let new = if bitmap.is_empty() {
            seen.insert((a, z, t.round))
        } else {
            let bit = ((a * n + z) as u64 * base as u64 + t.round as u64) as usize;
            let (word, mask) = (bit / 64, 1u64 << (bit % 64));
            let new = bitmap[word] & mask == 0;
            bitmap[word] |= mask;
            new
        };
        f.messages += new as u64;
        sent_msgs[a] += new as u64;
        recv_msgs[z] += new as u64;
    }
    f.max_rank_send_messages = sent_msgs.into_iter().max().unwrap_or(0);
    f.max_rank_recv_messages = recv_msgs.into_iter().max().unwrap_or(0);
    f.max_rank_send_bytes = sent.into_iter().max().unwrap_or(0);
    f.max_rank_recv_bytes = recv.into_iter().max().unwrap_or(0);
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{parse_layout, plan_baseline, plan_reshard, PlanOptions, Strategy};

    /// Per source rank, the bytes it sends off its node, counted from the
    /// transfers: one entry per source rank, summing to the source bytes
    /// that cross nodes (all of them in the reshard, all but the gathers
    /// inside a node in the baseline).
    #[test]
    fn src_rank_egress_is_what_each_source_rank_sends_off_its_node() {
        for (s, d) in [
            (include_str!("../../../examples/mixed-2d/src.json"), include_str!("../../../examples/mixed-2d/dst.json")),
            (include_str!("../../../examples/tp-to-tp/src.json"), include_str!("../../../examples/tp-to-tp/dst.json")),
            (include_str!("../../../examples/ep-moe/src.json"), include_str!("../../../examples/ep-moe/dst.json")),
        ] {
            let (src, dst) = (parse_layout(s).unwrap(), parse_layout(d).unwrap());
            for (a, b) in [(&src, &dst), (&dst, &src)] {
                for plan in [plan_reshard(a, b, &PlanOptions::default()).unwrap(), plan_baseline(a, b, &PlanOptions::default()).unwrap()] {
                    let mut want = vec![0u64; plan.src_ranks() as usize];
                    for t in plan.transfers().iter().filter(|t| t.from.group == Group::Src && plan.node_of(t.from) != plan.node_of(t.to)) {
                        want[t.from.rank as usize] += plan.wire_bytes(t);
                    }
                    let f = plan.figures();
                    assert_eq!(f.src_rank_egress_bytes, want, "{:?}", plan.strategy());
                    assert_eq!(f.max_src_rank_egress_bytes(), want.iter().copied().max().unwrap_or(0));
                    if plan.strategy() == Strategy::Reshard {
                        assert_eq!(want.iter().sum::<u64>(), f.src_egress_bytes);
                    } else {
                        assert!(want.iter().sum::<u64>() <= f.src_egress_bytes);
                    }
                }
            }
        }
    }
}
