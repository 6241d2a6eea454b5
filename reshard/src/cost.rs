//! The link model: per-rank network and intra-node bandwidths, used by the
//! planner to choose senders and relays and by [`estimate`](crate::Plan::estimate)
//! to predict refit time, and [`PipelinedBroadcast`]: the gather-broadcast
//! baseline priced as NCCL runs it.

/// Bandwidths of one rank's links, in bytes per second, per direction.
///
/// A transfer between ranks on different nodes uses the sender's network
/// egress and the receiver's network ingress; one inside a node uses the
/// intra-node link (NVLink) of both. Source and destination groups are on
/// different nodes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkModel {
    /// Network bandwidth of one rank (its NIC), each direction.
    pub net_bytes_per_s: f64,
    /// Intra-node bandwidth of one rank, each direction.
    pub intra_bytes_per_s: f64,
    /// Fixed cost per message, in seconds.
    pub message_latency_s: f64,
}

impl LinkModel {
    /// DGX H100: one 400 Gb/s NIC per GPU, NVLink 4 at 900 GB/s per GPU
    /// (450 GB/s each direction).
    pub const DGX_H100: LinkModel = LinkModel { net_bytes_per_s: 50e9, intra_bytes_per_s: 450e9, message_latency_s: 10e-6 };
    /// GB200 NVL72: one 800 Gb/s NIC per GPU, NVLink 5 at 1.8 TB/s per GPU.
    pub const GB200: LinkModel = LinkModel { net_bytes_per_s: 100e9, intra_bytes_per_s: 900e9, message_latency_s: 10e-6 };
}

impl Default for LinkModel {
    fn default() -> Self {
        LinkModel::DGX_H100
    }
}

/// Seconds one rank is busy in one round: the slower of its network and
/// intra-node links (each the larger of its two directions' bytes over the
/// bandwidth), plus the latency of the messages it sends. `loads` are bytes
/// out and in over the network, then out and in inside the node.
pub(crate) fn rank_round_seconds(loads: &[u64; 4], messages: u64, links: &LinkModel) -> f64 {
    let net = loads[0].max(loads[1]) as f64 / links.net_bytes_per_s;
    let intra = loads[2].max(loads[3]) as f64 / links.intra_bytes_per_s;
    net.max(intra) + messages as f64 * links.message_latency_s
}

/// Bytes of one chunk of a pipelined broadcast: NCCL's default buffer
/// (`NCCL_BUFFSIZE`, 4 MiB) split into its 8 pipeline steps.
pub(crate) const BROADCAST_CHUNK_BYTES: u64 = 512 << 10;

/// The gather-broadcast baseline as NCCL runs it: per tensor, a gather of
/// the whole tensor onto its root, then a pipelined, chunked ring broadcast
/// (one NCCL call) from the root to every destination rank that holds any
/// of it. Loads are added tensor by tensor; [`seconds`](Self::seconds)
/// turns them into a time.
///
/// For tensor `t` of `B` bytes (in its wire dtype) whose receivers lie on
/// `K` destination nodes, `m_k` of them on the `k`-th node of the ring and
/// `R = Σ m_k` in all, with `c = min(B, BROADCAST_CHUNK_BYTES)`, `λ` the
/// message latency, `net` and `intra` the bandwidths of [`LinkModel`]:
///
/// - **gather**: every gather runs at once. `T_gather` is the busiest
///   source rank's time with all its gather bytes and messages, costed as
///   one round of the reshard's estimate (the larger direction of each
///   link over its bandwidth, plus `λ` per message sent).
/// - **broadcast, per rank**: a rank takes part in the broadcasts one call
///   after the other, and consecutive calls stream through the ring without
///   waiting for the last one to drain, so each call costs a rank its bytes
///   over its links plus `λ`. The root sends `B` through its own NIC.
///   NCCL's channels spread a tensor over the NICs of its `m_k` receivers
///   on node `k`: each takes `⌈B/m_k⌉` from the network and, unless its node
///   is the last of the ring, sends as much on to the next node; inside the
///   node it takes the rest, `⌈B (m_k − 1)/m_k⌉`, over NVLink (and forwards
///   about as much, which does not change the larger direction).
///   `T_rank = max(max(net out, net in)/net, intra in/intra) + λ · calls`,
///   summed over its calls.
/// - **ring fill**: `F_t = K (c/net + λ) + (R − K) (c/intra + λ)`: the
///   first chunk of a call crosses `K` network hops (root to the first
///   node, node to node) and `R − K` NVLink hops before the last rank has
///   it. Paid once, for the longest ring: later calls overlap it.
///
/// `T = T_gather + max over ranks of T_rank + max_t F_t`: the gathers first
/// (the baseline plan's first stage), then every root's broadcasts, those
/// of different roots overlapping, as fast as the busiest rank allows, then
/// the last ring drains. Like the reshard's estimate it assumes perfect
/// overlap and links at line rate without congestion, and counts wire time
/// only. It is never below [`Plan::lower_bound`]: a node's receivers take
/// in at least what the node needs, and the roots send every needed byte
/// at least once.
///
/// [`Plan::lower_bound`]: crate::Plan::lower_bound
#[derive(Clone, Debug)]
pub(crate) struct PipelinedBroadcast<'a> {
    links: &'a LinkModel,
    src_ranks: usize,
    /// Gathers, per source rank: bytes by lane (network out, network in,
    /// intra-node out, intra-node in) and messages sent.
    gather: Vec<([u64; 4], u64)>,
    /// Broadcasts, per rank (source ranks, then destination ranks): bytes
    /// by lane, as in `gather`, and calls taken part in.
    broadcast: Vec<([u64; 4], u64)>,
    /// The longest ring fill of any call.
    fill: f64,
}

impl<'a> PipelinedBroadcast<'a> {
    /// No tensors yet between `src_ranks` and `dst_ranks` ranks.
    pub(crate) fn new(src_ranks: u32, dst_ranks: u32, links: &'a LinkModel) -> Self {
        let (s, d) = (src_ranks as usize, dst_ranks as usize);
        PipelinedBroadcast { links, src_ranks: s, gather: vec![([0; 4], 0); s], broadcast: vec![([0; 4], 0); s + d], fill: 0.0 }
    }

    /// `count` gather messages of `bytes` each from source rank `from` to
    /// source rank `to` (distinct), across nodes or not.
    pub(crate) fn gather(&mut self, from: u32, to: u32, cross: bool, bytes: u64, count: u64) {
        let (out, inn) = if cross { (0, 1) } else { (2, 3) };
        let b = bytes.saturating_mul(count);
        if let Some((loads, msgs)) = self.gather.get_mut(from as usize) {
            loads[out] = loads[out].saturating_add(b);
            *msgs = msgs.saturating_add(count);
        }
        if let Some((loads, _)) = self.gather.get_mut(to as usize) {
            loads[inn] = loads[inn].saturating_add(b);
        }
    }

    /// `count` tensors of `bytes` each, each broadcast by one call from
    /// source rank `root` to the destination ranks `nodes`: the receivers on
    /// each node, nodes in ring order (empty ones are skipped).
    pub(crate) fn broadcast(&mut self, root: u32, bytes: u64, nodes: &[&[u32]], count: u64) {
        let nodes: Vec<&[u32]> = nodes.iter().copied().filter(|g| !g.is_empty()).collect();
        if nodes.is_empty() || count == 0 {
            return;
        }
        let mut add = |rank: usize, lane: usize, b: u64| {
            if let Some((loads, _)) = self.broadcast.get_mut(rank) {
                loads[lane] = loads[lane].saturating_add(b.saturating_mul(count));
            }
        };
        add(root as usize, 0, bytes);
        for (i, group) in nodes.iter().enumerate() {
            let m = group.len() as u128;
            let net = (bytes as u128).div_ceil(m) as u64;
            let intra = (bytes as u128 * (m - 1)).div_ceil(m) as u64;
            let forwards = i + 1 < nodes.len();
            for &rank in group.iter() {
                let r = self.src_ranks + rank as usize;
                add(r, 1, net);
                if forwards {
                    add(r, 0, net);
                }
                add(r, 3, intra);
            }
        }
        let ranks = std::iter::once(root as usize).chain(nodes.iter().flat_map(|g| g.iter().map(|&r| self.src_ranks + r as usize)));
        for r in ranks {
            if let Some((_, calls)) = self.broadcast.get_mut(r) {
                *calls = calls.saturating_add(count);
            }
        }
        let l = self.links;
        let chunk = bytes.min(BROADCAST_CHUNK_BYTES) as f64;
        let (k, r) = (nodes.len() as f64, nodes.iter().map(|g| g.len()).sum::<usize>() as f64);
        let fill = k * (chunk / l.net_bytes_per_s + l.message_latency_s) + (r - k) * (chunk / l.intra_bytes_per_s + l.message_latency_s);
        self.fill = self.fill.max(fill);
    }

    /// The modelled time, in seconds (see the type's doc).
    pub(crate) fn seconds(&self) -> f64 {
        let busiest =
            |ranks: &[([u64; 4], u64)]| ranks.iter().map(|(loads, n)| rank_round_seconds(loads, *n, self.links)).fold(0.0, f64::max);
        busiest(&self.gather) + busiest(&self.broadcast) + self.fill
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::baseline::PIPELINE_CHUNK_BYTES;
    use crate::{baseline_summary, parse_layout, Layout, PlanOptions};
    use proptest::prelude::*;

    /// Round numbers: 1 GB/s network, 10 GB/s inside a node, 1 µs a message.
    const LINKS: LinkModel = LinkModel { net_bytes_per_s: 1e9, intra_bytes_per_s: 1e10, message_latency_s: 1e-6 };

    fn layout(ranks: u32, rpn: u32, tensors: &[String]) -> Layout {
        parse_layout(&format!(r#"{{"ranks": {ranks}, "ranks_per_node": {rpn}, "tensors": [{}]}}"#, tensors.join(", ")))
            .expect("valid layout")
    }

    fn mesh(name: &str, shape: &str, mesh: &str, placements: &str) -> String {
        format!(r#"{{"name": "{name}", "dtype": "f32", "shape": {shape}, "mesh": {mesh}, "placements": {placements}}}"#)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
    }

    /// The pipelined estimate of the baseline from `src` to `dst` under [`LINKS`].
    fn pipelined(src: &Layout, dst: &Layout) -> (f64, f64) {
        let summary = baseline_summary(src, dst, &PlanOptions::default(), &LINKS).expect("baseline summary");
        (summary.pipelined.seconds, summary.pipelined.lower_bound_seconds)
    }

    /// One fill of the ring: `k` network hops and `intra` NVLink hops of one chunk.
    fn fill(bytes: u64, k: u32, intra: u32) -> f64 {
        let c = bytes.min(BROADCAST_CHUNK_BYTES) as f64;
        k as f64 * (c / LINKS.net_bytes_per_s + LINKS.message_latency_s)
            + intra as f64 * (c / LINKS.intra_bytes_per_s + LINKS.message_latency_s)
    }

    /// One tensor held whole by one source rank, replicated on `k`
    /// destination nodes of one rank each: the ring streams it once at
    /// network bandwidth, plus one chunk per hop: `B/net + λ + k (c/net +
    /// λ)`, not `k B/net` (one copy per node sent in turn) nor the
    /// store-and-forward doubling's `(1 + log2 k) B/net`.
    #[test]
    fn one_tensor_to_k_nodes_streams_once() {
        let bytes = 4096 * 4096 * 4u64; // [4096, 4096] f32: 64 MiB, 128 chunks
        let src = layout(1, 1, &[mesh("w", "[4096, 4096]", r#"{"shape": [1]}"#, r#"["replicate"]"#)]);
        for k in [1u32, 2, 4, 16] {
            let dst = layout(k, 1, &[mesh("w", "[4096, 4096]", &format!(r#"{{"shape": [{k}]}}"#), r#"["replicate"]"#)]);
            let (got, lower) = pipelined(&src, &dst);
            let want = bytes as f64 / LINKS.net_bytes_per_s + LINKS.message_latency_s + fill(bytes, k, 0);
            assert!(close(got, want), "k {k}: {got} s, want {want} s");
            assert!(got >= lower, "k {k}: {got} below the lower bound {lower}");
            if k >= 4 {
                assert!(got < 1.2 * bytes as f64 / LINKS.net_bytes_per_s, "k {k}: {got} s is not about one copy's time");
            }
            // The plan itself pipelines the ring: its `n` chunks pass `k`
            // hops in `n + k - 1` rounds of one chunk and one message per
            // sender each (then a round of copies out of scratch that moves
            // nothing), not store and forward's `(1 + log2 k)` copies.
            let summary = baseline_summary(&src, &dst, &PlanOptions::default(), &LINKS).expect("summary");
            let c = PIPELINE_CHUNK_BYTES;
            let rounds = (bytes / c + k as u64 - 1) as f64;
            let plan = rounds * (c as f64 / LINKS.net_bytes_per_s + LINKS.message_latency_s);
            assert!(close(summary.estimate.seconds, plan), "k {k}: the plan's estimate {} s, want {plan} s", summary.estimate.seconds);
            assert_eq!(summary.figures.rounds as u64, bytes / c + k as u64, "k {k}: rounds");
        }
    }

    /// Two nodes of four ranks: each rank takes a quarter of the tensor
    /// from the network (the first node also sends it on) and the rest over
    /// NVLink; the root's NIC is the bottleneck.
    #[test]
    fn nodes_of_several_ranks_split_the_network_and_nvlink() {
        let bytes = 1024 * 1024 * 4u64;
        let src = layout(1, 1, &[mesh("w", "[1024, 1024]", r#"{"shape": [1]}"#, r#"["replicate"]"#)]);
        let dst = layout(8, 4, &[mesh("w", "[1024, 1024]", r#"{"shape": [8]}"#, r#"["shard(0)"]"#)]);
        let (got, _) = pipelined(&src, &dst);
        let f = fill(bytes, 2, 6);
        let root = bytes as f64 / LINKS.net_bytes_per_s + LINKS.message_latency_s;
        let rank =
            (bytes as f64 / 4.0 / LINKS.net_bytes_per_s).max(bytes as f64 * 0.75 / LINKS.intra_bytes_per_s) + LINKS.message_latency_s;
        assert!(rank < root);
        assert!(close(got, root + f), "{got} vs {}", root + f);
        // By hand, through the model directly.
        let mut model = PipelinedBroadcast::new(1, 8, &LINKS);
        model.broadcast(0, bytes, &[&[0, 1, 2, 3], &[4, 5, 6, 7]], 1);
        assert!(close(model.seconds(), root + f), "{}", model.seconds());
    }

    /// Many tensors: those of one root follow one another through its NIC;
    /// those of different roots overlap, down to what the receiving ranks'
    /// links take in (here 1/8 of each tensor over the network).
    #[test]
    fn many_tensors_one_root_add_up_and_different_roots_overlap() {
        let bytes = 64 * 64 * 4u64;
        let n = 8u32;
        let one = |i: u32, ranks: &str| {
            mesh(&format!("w{i}"), "[64, 64]", &format!(r#"{{"shape": [1], "ranks": [{ranks}]}}"#), r#"["replicate"]"#)
        };
        let dst = layout(
            16,
            8,
            &(0..n).map(|i| mesh(&format!("w{i}"), "[64, 64]", r#"{"shape": [16]}"#, r#"["replicate"]"#)).collect::<Vec<_>>(),
        );
        let (b, lat, f) = (bytes as f64 / LINKS.net_bytes_per_s, LINKS.message_latency_s, fill(bytes, 2, 14));
        // All on rank 0: one after the other through its NIC, one fill.
        let src = layout(n, 1, &(0..n).map(|i| one(i, "0")).collect::<Vec<_>>());
        let (same_root, _) = pipelined(&src, &dst);
        let want = n as f64 * (b + lat) + f;
        assert!(close(same_root, want), "{same_root} vs {want}");
        // One per rank: each receiver takes 1/8 of every tensor from the
        // network (the rest over NVLink) and a message latency per call.
        let src = layout(n, 1, &(0..n).map(|i| one(i, &i.to_string())).collect::<Vec<_>>());
        let (spread, lower) = pipelined(&src, &dst);
        let rank = n as f64 * (b / 8.0).max(bytes as f64 * 7.0 / 8.0 / LINKS.intra_bytes_per_s) + n as f64 * lat;
        let want = rank.max(b + lat) + f;
        assert!(close(spread, want), "{spread} vs {want}");
        assert!(spread >= lower && spread < same_root, "{spread}, lower bound {lower}, one root {same_root}");
    }

    /// A gather from a rank on another node adds its time before the
    /// broadcasts.
    #[test]
    fn gathers_come_first() {
        let bytes = 1024 * 1024 * 4u64;
        let src = layout(2, 1, &[mesh("w", "[1024, 1024]", r#"{"shape": [2]}"#, r#"["shard(0)"]"#)]);
        let dst = layout(1, 1, &[mesh("w", "[1024, 1024]", r#"{"shape": [1]}"#, r#"["replicate"]"#)]);
        let (got, _) = pipelined(&src, &dst);
        let gather = (bytes / 2) as f64 / LINKS.net_bytes_per_s + LINKS.message_latency_s;
        let want = gather + bytes as f64 / LINKS.net_bytes_per_s + LINKS.message_latency_s + fill(bytes, 1, 0);
        assert!(close(got, want), "{got} vs {want}");
    }

    /// Nothing to send costs nothing.
    #[test]
    fn nothing_to_send_takes_no_time() {
        let model = PipelinedBroadcast::new(3, 3, &LINKS);
        assert_eq!(model.seconds(), 0.0);
        let (got, lower) = pipelined(&layout(2, 1, &[]), &layout(2, 1, &[]));
        assert_eq!((got, lower), (0.0, 0.0));
    }

    /// The example pairs, both ways round: the pipelined estimate is finite
    /// and never below the lower bound.
    #[test]
    fn examples_are_at_or_above_the_lower_bound() {
        let examples = [
            (include_str!("../../examples/tp-to-tp/src.json"), include_str!("../../examples/tp-to-tp/dst.json")),
            (include_str!("../../examples/pp-to-tp/src.json"), include_str!("../../examples/pp-to-tp/dst.json")),
            (include_str!("../../examples/ep-moe/src.json"), include_str!("../../examples/ep-moe/dst.json")),
            (include_str!("../../examples/fsdp-to-tp/src.json"), include_str!("../../examples/fsdp-to-tp/dst.json")),
            (include_str!("../../examples/fused-qkv/src.json"), include_str!("../../examples/fused-qkv/dst.json")),
            (include_str!("../../examples/mixed-2d/src.json"), include_str!("../../examples/mixed-2d/dst.json")),
        ];
        for (s, d) in examples {
            let (s, d) = (parse_layout(s).expect("example"), parse_layout(d).expect("example"));
            for (src, dst) in [(&s, &d), (&d, &s)] {
                for links in [LinkModel::DGX_H100, LinkModel::GB200, LINKS] {
                    let summary = baseline_summary(src, dst, &PlanOptions::default(), &links).expect("summary");
                    let p = summary.pipelined;
                    assert!(p.seconds.is_finite() && p.seconds >= p.lower_bound_seconds, "{p:?}");
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        /// On random pairs (tensors sharded or replicated over random
        /// meshes, random node sizes and links), the pipelined estimate is
        /// finite and at or above the lower bound.
        #[test]
        fn pipelined_estimate_is_at_or_above_the_lower_bound(
            (src_ranks, src_rpn, dst_ranks, dst_rpn) in (1u32..9, 1u32..5, 1u32..13, 1u32..5),
            tensors in proptest::collection::vec((1u64..20, 1u64..20, 0usize..3, 0usize..3, 0u32..13, 0u32..13), 1..5),
            (net, intra, latency) in (1e3f64..1e11, 1e3f64..1e12, 0.0f64..1e-3),
        ) {
            let placement = |p: usize| ["\"replicate\"", "\"shard(0)\"", "\"shard(1)\""][p];
            let (mut s, mut d) = (Vec::new(), Vec::new());
            for (i, &(rows, cols, ps, pd, first, count)) in tensors.iter().enumerate() {
                let shape = format!("[{rows}, {cols}]");
                let src_mesh: Vec<String> = (0..src_ranks).map(|r| ((r + first) % src_ranks).to_string()).collect();
                s.push(mesh(&format!("t{i}"), &shape, &format!(r#"{{"shape": [{src_ranks}], "ranks": [{}]}}"#, src_mesh.join(", ")), &format!("[{}]", placement(ps))));
                let n = count % dst_ranks + 1;
                let dst_mesh: Vec<String> = (0..n).map(|r| ((r + first) % dst_ranks).to_string()).collect();
                d.push(mesh(&format!("t{i}"), &shape, &format!(r#"{{"shape": [{n}], "ranks": [{}]}}"#, dst_mesh.join(", ")), &format!("[{}]", placement(pd))));
            }
            let parse = |ranks: u32, rpn: u32, t: &[String]| {
                parse_layout(&format!(r#"{{"ranks": {ranks}, "ranks_per_node": {rpn}, "tensors": [{}]}}"#, t.join(", "))).ok()
            };
            let (src, dst) = (parse(src_ranks, src_rpn, &s), parse(dst_ranks, dst_rpn, &d));
            prop_assume!(src.is_some() && dst.is_some());
            let (src, dst) = (src.unwrap_or_else(|| layout(1, 1, &[])), dst.unwrap_or_else(|| layout(1, 1, &[])));
            let links = LinkModel { net_bytes_per_s: net, intra_bytes_per_s: intra, message_latency_s: latency };
            let summary = baseline_summary(&src, &dst, &PlanOptions::default(), &links);
            prop_assume!(summary.is_ok());
            if let Ok(summary) = summary {
                let p = summary.pipelined;
                prop_assert!(p.seconds.is_finite(), "{p:?}");
                prop_assert!(p.seconds >= p.lower_bound_seconds * (1.0 - 1e-12), "{p:?}");
                prop_assert_eq!(p.lower_bound_seconds, summary.estimate.lower_bound_seconds);
            }
        }
    }
}
