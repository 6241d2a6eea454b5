//! `baseline_summary` against the materialised baseline, and `Plan::estimate`
//! against the per-round implementation it replaced (kept here as the
//! oracle), on the example layout pairs (both ways round) under several
//! staging caps and link models, plus hand-made pairs for the edges:
//! conversions, partial destinations, nothing to send, and the errors.

use reshard::{
    baseline_summary, parse_layout, plan_baseline, plan_reshard, Endpoint, Estimate, Group, Layout, LinkModel, Plan, PlanOptions,
};

/// The example pairs of `examples/`.
const EXAMPLES: [(&str, &str, &str); 6] = [
    ("tp-to-tp", include_str!("../../examples/tp-to-tp/src.json"), include_str!("../../examples/tp-to-tp/dst.json")),
    ("pp-to-tp", include_str!("../../examples/pp-to-tp/src.json"), include_str!("../../examples/pp-to-tp/dst.json")),
    ("ep-moe", include_str!("../../examples/ep-moe/src.json"), include_str!("../../examples/ep-moe/dst.json")),
    ("fsdp-to-tp", include_str!("../../examples/fsdp-to-tp/src.json"), include_str!("../../examples/fsdp-to-tp/dst.json")),
    ("fused-qkv", include_str!("../../examples/fused-qkv/src.json"), include_str!("../../examples/fused-qkv/dst.json")),
    ("mixed-2d", include_str!("../../examples/mixed-2d/src.json"), include_str!("../../examples/mixed-2d/dst.json")),
];

/// Link models to estimate under: the presets, one without message latency
/// and one where latency dominates.
const LINKS: [LinkModel; 4] = [
    LinkModel::DGX_H100,
    LinkModel::GB200,
    LinkModel { net_bytes_per_s: 1e9, intra_bytes_per_s: 3e9, message_latency_s: 0.0 },
    LinkModel { net_bytes_per_s: 7e3, intra_bytes_per_s: 1.1e4, message_latency_s: 1e-3 },
];

/// Staging caps: the default, then small ones that split tensors into many
/// pieces and spread them over many rounds.
const CAPS: [u64; 5] = [256 << 20, 1 << 20, 4096, 256, 64];

/// Cases whose baseline has more transfers than this are left out (they
/// take long in a debug build and add nothing the others lack).
const MOST_TRANSFERS: usize = 40_000;

/// Every example pair, both ways round, under every cap that keeps the
/// baseline small: (name, source, destination, options).
fn cases() -> Vec<(String, Layout, Layout, PlanOptions)> {
    let mut out = Vec::new();
    for (name, src, dst) in pairs() {
        for cap in CAPS {
            let options = PlanOptions { max_staging_bytes: cap, ..PlanOptions::default() };
            if plan_baseline(&src, &dst, &options).expect(&name).transfers().len() <= MOST_TRANSFERS {
                out.push((format!("{name}, cap {cap}"), src.clone(), dst.clone(), options));
            }
        }
    }
    out
}

/// Every example pair, both ways round.
fn pairs() -> Vec<(String, Layout, Layout)> {
    let mut out = Vec::new();
    for (name, s, d) in EXAMPLES {
        let (s, d) = (parse_layout(s).expect(name), parse_layout(d).expect(name));
        out.push((format!("{name} reversed"), d.clone(), s.clone()));
        out.push((name.to_string(), s, d));
    }
    out
}

/// The estimate as `Plan::estimate` computed it before it was made linear:
/// per round, a load vector over every rank, and the round's messages
/// cloned, sorted and deduplicated.
fn old_estimate(plan: &Plan, links: &LinkModel) -> Estimate {
    let rounds = plan.figures().rounds as usize;
    let n = (plan.src_ranks() + plan.dst_ranks()) as usize;
    let idx = |e: Endpoint| match e.group {
        Group::Src => e.rank as usize,
        Group::Dst => plan.src_ranks() as usize + e.rank as usize,
    };
    let mut per_round: Vec<Vec<[u64; 4]>> = vec![Vec::new(); rounds];
    let mut msgs: Vec<Vec<(Endpoint, Endpoint)>> = vec![Vec::new(); rounds];
    for t in plan.transfers() {
        if t.from == t.to {
            continue;
        }
        let r = t.round as usize;
        if per_round[r].is_empty() {
            per_round[r] = vec![[0; 4]; n];
        }
        let b = plan.wire_bytes(t);
        let cross = plan.node_of(t.from) != plan.node_of(t.to);
        let (o, i) = if cross { (0, 1) } else { (2, 3) };
        per_round[r][idx(t.from)][o] += b;
        per_round[r][idx(t.to)][i] += b;
        msgs[r].push((t.from, t.to));
    }
    let mut seconds = 0.0;
    for (r, loads) in per_round.iter().enumerate() {
        let mut m = msgs[r].clone();
        m.sort_unstable();
        m.dedup();
        let mut per_rank_msgs = vec![0u64; n];
        for (f, _) in &m {
            per_rank_msgs[idx(*f)] += 1;
        }
        let worst = loads
            .iter()
            .enumerate()
            .map(|(k, l)| {
                let net = l[0].max(l[1]) as f64 / links.net_bytes_per_s;
                let intra = l[2].max(l[3]) as f64 / links.intra_bytes_per_s;
                net.max(intra) + per_rank_msgs[k] as f64 * links.message_latency_s
            })
            .fold(0.0, f64::max);
        seconds += worst;
    }
    Estimate { seconds, lower_bound_seconds: plan.lower_bound(links) }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

/// The summary of `src -> dst` equals the materialised baseline's figures
/// exactly and its estimate within 1e-9 relative, under every link model;
/// both fail alike.
fn check_summary(what: &str, src: &Layout, dst: &Layout, options: &PlanOptions) {
    let plan = plan_baseline(src, dst, options);
    for links in &LINKS {
        let summary = baseline_summary(src, dst, options, links);
        let (plan, summary) = match (&plan, summary) {
            (Ok(p), Ok(s)) => (p, s),
            (Err(a), Err(b)) => {
                assert_eq!(a, &b, "{what}: the summary fails otherwise");
                return;
            }
            (p, s) => panic!("{what}: plan {:?} but summary {:?}", p.as_ref().err(), s.err()),
        };
        assert_eq!(&summary.figures, plan.figures(), "{what}: figures");
        let want = plan.estimate(links);
        assert!(
            close(summary.estimate.seconds, want.seconds),
            "{what}: estimate {} vs the plan's {}",
            summary.estimate.seconds,
            want.seconds
        );
        assert!(close(summary.estimate.lower_bound_seconds, want.lower_bound_seconds), "{what}: lower bound");
    }
}

/// `Plan::estimate` gives exactly what the per-round implementation gave.
fn check_estimate(what: &str, plan: &Plan) {
    for links in &LINKS {
        let (got, want) = (plan.estimate(links), old_estimate(plan, links));
        assert_eq!(got, want, "{what}: estimate under {links:?}");
    }
}

#[test]
fn summary_matches_the_baseline_plan_on_the_examples() {
    let cases = cases();
    assert!(cases.len() >= 50, "{} cases", cases.len());
    for (what, src, dst, options) in cases {
        check_summary(&what, &src, &dst, &options);
    }
}

#[test]
fn estimate_matches_the_per_round_oracle_on_the_examples() {
    for (what, src, dst, options) in cases() {
        let reshard = plan_reshard(&src, &dst, &options).expect(&what);
        check_estimate(&format!("{what}: reshard"), &reshard);
        let baseline = plan_baseline(&src, &dst, &options).expect(&what);
        check_estimate(&format!("{what}: baseline"), &baseline);
    }
}

/// A layout of `ranks` ranks (`rpn` a node) with the given tensors (JSON).
fn layout(ranks: u32, rpn: u32, tensors: &[String]) -> Layout {
    parse_layout(&format!(r#"{{"ranks": {ranks}, "ranks_per_node": {rpn}, "tensors": [{}]}}"#, tensors.join(", "))).expect("valid layout")
}

fn shards(name: &str, dtype: &str, shape: &str, shards: &[(u32, &str, &str)]) -> String {
    let list: Vec<String> = shards.iter().map(|(r, off, ext)| format!(r#"{{"rank": {r}, "offset": {off}, "extent": {ext}}}"#)).collect();
    format!(r#"{{"name": "{name}", "dtype": "{dtype}", "shape": {shape}, "shards": [{}]}}"#, list.join(", "))
}

fn mesh(name: &str, dtype: &str, shape: &str, mesh: &str, placements: &str) -> String {
    format!(r#"{{"name": "{name}", "dtype": "{dtype}", "shape": {shape}, "mesh": {mesh}, "placements": {placements}}}"#)
}

#[test]
fn summary_matches_on_edge_cases() {
    // Conversions (f32 -> bf16 narrows on the wire, bf16 -> f32 does not),
    // a gather from several ranks and nodes, a destination holding part of
    // a tensor (the baseline sends its bounding box), a tensor the
    // destination holds nowhere (mesh over no rank), a scalar, and
    // destination trees that differ from tensor to tensor.
    let src = layout(
        8,
        2,
        &[
            mesh("a", "f32", "[64, 32]", r#"{"shape": [4, 2], "ranks": [7, 6, 5, 4, 3, 2, 1, 0]}"#, r#"["shard(0)", "shard(1)"]"#),
            mesh("b", "bf16", "[48]", r#"{"shape": [8]}"#, r#"["shard(0)"]"#),
            shards("c", "f32", "[8, 8]", &[(1, "[0, 0]", "[4, 8]"), (6, "[4, 0]", "[4, 8]")]),
            mesh("d", "f16", "[]", r#"{"shape": [8]}"#, r#"["replicate"]"#),
            mesh("e", "f32", "[16, 4]", r#"{"shape": [2], "ranks": [3, 4]}"#, r#"["shard(0)"]"#),
            mesh("f", "f32", "[3]", r#"{"shape": [8]}"#, r#"["replicate"]"#),
        ],
    );
    let dst = layout(
        6,
        2,
        &[
            mesh("a", "bf16", "[64, 32]", r#"{"shape": [3, 2]}"#, r#"["replicate", "shard(1)"]"#),
            mesh("b", "f32", "[48]", r#"{"shape": [2], "ranks": [5, 2]}"#, r#"["shard(0)"]"#),
            shards("c", "bf16", "[8, 8]", &[(4, "[2, 2]", "[3, 3]"), (0, "[5, 1]", "[2, 2]")]),
            mesh("d", "f16", "[]", r#"{"shape": [3], "ranks": [1, 3, 5]}"#, r#"["replicate"]"#),
            mesh("e", "f32", "[16, 4]", r#"{"shape": [1], "ranks": [2]}"#, r#"["replicate"]"#),
            shards("f", "f32", "[3]", &[]),
        ],
    );
    for cap in [1 << 20, 512, 100, 8, 1] {
        let options = PlanOptions { max_staging_bytes: cap, ..PlanOptions::default() };
        check_summary(&format!("edges, cap {cap}"), &src, &dst, &options);
        check_summary(&format!("edges reversed, cap {cap}"), &dst, &src, &options);
        check_estimate(&format!("edges, cap {cap}: baseline"), &plan_baseline(&src, &dst, &options).expect("edges"));
        check_estimate(&format!("edges, cap {cap}: reshard"), &plan_reshard(&src, &dst, &options).expect("edges"));
    }
    // Many destination nodes, so that doubling takes several stages and
    // the groups of ranks alike repeat; one rank a node, and uneven nodes.
    for (ranks, rpn) in [(40, 4), (9, 1), (13, 3)] {
        let src = layout(
            4,
            2,
            &[
                mesh("w", "bf16", "[40, 8]", r#"{"shape": [4]}"#, r#"["shard(0)"]"#),
                mesh("v", "f32", "[7]", r#"{"shape": [4]}"#, r#"["replicate"]"#),
            ],
        );
        let dst = layout(
            ranks,
            rpn,
            &[
                mesh("w", "bf16", "[40, 8]", &format!(r#"{{"shape": [{ranks}]}}"#), r#"["shard(1)"]"#),
                mesh("v", "f32", "[7]", &format!(r#"{{"shape": [{ranks}]}}"#), r#"["replicate"]"#),
            ],
        );
        for cap in [1 << 20, 64, 16, 4] {
            let options = PlanOptions { max_staging_bytes: cap, ..PlanOptions::default() };
            check_summary(&format!("{ranks} ranks by {rpn}, cap {cap}"), &src, &dst, &options);
            check_estimate(&format!("{ranks} ranks by {rpn}, cap {cap}"), &plan_baseline(&src, &dst, &options).expect("fan-out"));
        }
    }
    // Nothing to send: an empty destination.
    let empty = layout(2, 1, &[]);
    check_summary("empty destination", &src, &empty, &PlanOptions::default());
}

#[test]
fn summary_fails_as_the_plan_does() {
    let options = PlanOptions::default();
    // The baseline gathers the bounding box of rows 0 and 3; rows 1 and 2
    // are nowhere.
    let src = layout(2, 1, &[shards("w", "f32", "[4, 4]", &[(0, "[0, 0]", "[1, 4]"), (1, "[3, 0]", "[1, 4]")])]);
    let dst = layout(2, 1, &[shards("w", "f32", "[4, 4]", &[(1, "[0, 0]", "[1, 4]"), (0, "[3, 0]", "[1, 4]")])]);
    let err = baseline_summary(&src, &dst, &options, &LinkModel::default()).expect_err("rows 1 and 2 are not held");
    assert!(err.to_string().contains("baseline gathers"), "{err}");
    check_summary("not covered", &src, &dst, &options);
    // Too many pieces: 2^28 one-byte elements at a one-byte cap.
    let src = layout(1, 1, &[mesh("w", "u8", "[268435456]", r#"{"shape": [1]}"#, r#"["replicate"]"#)]);
    let dst = layout(1, 1, &[mesh("w", "u8", "[268435456]", r#"{"shape": [1]}"#, r#"["replicate"]"#)]);
    let tiny = PlanOptions { max_staging_bytes: 1, ..PlanOptions::default() };
    let err = baseline_summary(&src, &dst, &tiny, &LinkModel::default()).expect_err("too many pieces");
    assert!(err.to_string().contains("pieces"), "{err}");
    check_summary("too many pieces", &src, &dst, &tiny);
    // A missing tensor and a shape mismatch.
    let a = layout(1, 1, &[mesh("w", "f32", "[4]", r#"{"shape": [1]}"#, r#"["replicate"]"#)]);
    let b = layout(1, 1, &[mesh("x", "f32", "[4]", r#"{"shape": [1]}"#, r#"["replicate"]"#)]);
    let c = layout(1, 1, &[mesh("w", "f32", "[5]", r#"{"shape": [1]}"#, r#"["replicate"]"#)]);
    check_summary("missing tensor", &a, &b, &options);
    check_summary("shape mismatch", &a, &c, &options);
}
