//! Tests of the round assignment.

use super::*;
use crate::{parse_layout, plan_baseline, plan_reshard, Layout, PlanOptions, Strategy};
use std::collections::{HashMap, HashSet};

/// Checks what the round assignment promises: every stage's rounds
/// after the previous stage's, local copies in their stage's first
/// round, no rank staging more than the cap in a round unless one
/// transfer alone, and message figures that count (sender, receiver,
/// round) triples.
fn check_rounds(plan: &Plan) {
    let f = plan.figures();
    let cap = plan.options().max_staging_bytes;
    let mut spans: HashMap<u16, (u32, u32)> = HashMap::new();
    let mut staged: HashMap<(Endpoint, u32), (u64, u32)> = HashMap::new();
    let mut messages: HashSet<(Endpoint, Endpoint, u32)> = HashSet::new();
    for t in plan.transfers() {
        let span = spans.entry(t.stage).or_insert((u32::MAX, 0));
        *span = (span.0.min(t.round), span.1.max(t.round));
        assert!(t.round < f.rounds, "round {} of {}", t.round, f.rounds);
        if t.from == t.to {
            continue;
        }
        for e in [t.from, t.to] {
            let s = staged.entry((e, t.round)).or_insert((0, 0));
            *s = (s.0 + plan.wire_bytes(t), s.1 + 1);
        }
        messages.insert((t.from, t.to, t.round));
    }
    let mut stages: Vec<(u16, (u32, u32))> = spans.into_iter().collect();
    stages.sort_unstable();
    for w in stages.windows(2) {
        assert!(w[0].1 .1 < w[1].1 .0, "stage {} ends in round {}, stage {} begins in round {}", w[0].0, w[0].1 .1, w[1].0, w[1].1 .0);
    }
    for t in plan.transfers().iter().filter(|t| t.from == t.to) {
        assert_eq!(Some(t.round), stages.iter().find(|s| s.0 == t.stage).map(|s| s.1 .0), "local copy not in its stage's first round");
    }
    for ((e, round), (bytes, count)) in &staged {
        assert!(*bytes <= cap || *count == 1, "{e} stages {bytes} bytes in {count} transfers in round {round} (cap {cap})");
    }
    assert_eq!(f.messages, messages.len() as u64);
    let per_rank = |side: fn(&(Endpoint, Endpoint, u32)) -> Endpoint| {
        let mut n: HashMap<Endpoint, u64> = HashMap::new();
        for m in &messages {
            *n.entry(side(m)).or_default() += 1;
        }
        n.into_values().max().unwrap_or(0)
    };
    assert_eq!(f.max_rank_send_messages, per_rank(|m| m.0));
    assert_eq!(f.max_rank_recv_messages, per_rank(|m| m.1));
}

/// TP4 over two nodes (f32) to DP2 x TP2 over two nodes (bf16), with a
/// replicated vector and a scalar: the reshard relays and fans out, the
/// baseline gathers onto source ranks and copies locally.
fn layouts() -> (Layout, Layout) {
    let tensor = |name: &str, shape: &str, placements: &str| {
        format!(r#"{{"name": "{name}", "dtype": "DT", "shape": {shape}, "mesh": {{"shape": MESH}}, "placements": {placements}}}"#)
    };
    let mut src = Vec::new();
    let mut dst = Vec::new();
    for i in 0..6 {
        src.push(tensor(&format!("w{i}"), "[32, 24]", r#"["shard(0)"]"#));
        dst.push(tensor(&format!("w{i}"), "[32, 24]", r#"["replicate", "shard(1)"]"#));
    }
    src.push(tensor("norm", "[24]", r#"["replicate"]"#));
    dst.push(tensor("norm", "[24]", r#"["replicate", "replicate"]"#));
    src.push(tensor("scale", "[]", r#"["replicate"]"#));
    dst.push(tensor("scale", "[]", r#"["replicate", "replicate"]"#));
    let file = |tensors: Vec<String>, dtype: &str, mesh: &str| {
        format!(r#"{{"ranks": 4, "ranks_per_node": 2, "tensors": [{}]}}"#, tensors.join(", ")).replace("DT", dtype).replace("MESH", mesh)
    };
    (parse_layout(&file(src, "f32", "[4]")).unwrap(), parse_layout(&file(dst, "bf16", "[2, 2]")).unwrap())
}

#[test]
fn rounds_keep_the_cap_and_the_stage_order() {
    let (src, dst) = layouts();
    // From one round for everything down to one byte (every transfer
    // then travels alone).
    for cap in [1 << 20, 1000, 200, 7, 1] {
        let options = PlanOptions { max_staging_bytes: cap, ..PlanOptions::default() };
        for plan in [plan_reshard(&src, &dst, &options).unwrap(), plan_baseline(&src, &dst, &options).unwrap()] {
            check_rounds(&plan);
            let again = match plan.strategy() {
                Strategy::Reshard => plan_reshard(&src, &dst, &options).unwrap(),
                Strategy::Baseline => plan_baseline(&src, &dst, &options).unwrap(),
            };
            assert_eq!(plan.transfers(), again.transfers(), "{} with cap {cap}: not deterministic", plan.strategy());
        }
    }
}

#[test]
fn a_pair_takes_as_few_rounds_as_the_cap_allows() {
    // One sender and one receiver, 12 tensors of 512 bytes (bf16), a cap
    // of 4 tensors: 3 rounds, one message each, not 12.
    let tensors = |dtype: &str| {
        (0..12)
            .map(|i| {
                format!(
                    r#"{{"name": "t{i}", "dtype": "{dtype}", "shape": [16, 16], "mesh": {{"shape": [1]}}, "placements": ["replicate"]}}"#
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let src = parse_layout(&format!(r#"{{"ranks": 1, "tensors": [{}]}}"#, tensors("f32"))).unwrap();
    let dst = parse_layout(&format!(r#"{{"ranks": 1, "tensors": [{}]}}"#, tensors("bf16"))).unwrap();
    let options = PlanOptions { max_staging_bytes: 4 * 512, ..PlanOptions::default() };
    let plan = plan_reshard(&src, &dst, &options).unwrap();
    check_rounds(&plan);
    let f = plan.figures();
    assert_eq!((f.rounds, f.messages, f.max_rank_send_messages), (3, 3, 3), "{f:?}");
}
