//! Plans derived for replicas ([`Plan::for_replicas`]): a destination
//! group of `n` replicas of one inference layout gets one replica's plan
//! copied onto each replica, run bit-exact, its source sends spread over
//! the data-parallel source replicas, never from a lost source.

use reshard::{parse_layout, plan_baseline, plan_reshard, Group, Layout, Plan, PlanError, PlanOptions};
use std::time::Duration;
use transport::{fill_sources, run_local, verify_destinations, ExecOptions, RankMemory};

/// Training: DP2 x TP2 in f32 on two nodes of two ranks (ranks 0-1 one
/// data-parallel replica, 2-3 the other); uneven rows, a replicated norm.
const SRC: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "q", "dtype": "f32", "shape": [9, 6], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]},
  {"name": "k", "dtype": "f32", "shape": [5, 6], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]},
  {"name": "up", "dtype": "f32", "shape": [6, 14], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(1)"]},
  {"name": "norm", "dtype": "f32", "shape": [6], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "replicate"]}]}"#;

/// One inference replica: TP4 in bf16 over two nodes of two ranks, q and
/// k fused in one buffer per rank, `up` by rows, the norm replicated.
const ONE: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "q", "dtype": "bf16", "shape": [9, 6], "mesh": {"shape": [4]}, "placements": ["shard(1)"], "buffer": "qk", "at": 0},
  {"name": "k", "dtype": "bf16", "shape": [5, 6], "mesh": {"shape": [4]}, "placements": ["shard(1)"], "buffer": "qk", "at": 18},
  {"name": "up", "dtype": "bf16", "shape": [6, 14], "mesh": {"shape": [4]}, "placements": ["shard(0)"]},
  {"name": "norm", "dtype": "bf16", "shape": [6], "mesh": {"shape": [4]}, "placements": ["replicate"]}]}"#;

fn layouts() -> (Layout, Layout) {
    (parse_layout(SRC).unwrap(), parse_layout(ONE).unwrap())
}

/// Runs `plan` over in-process channels and checks every destination
/// element against the sources' pattern; returns the bytes it moved.
fn run_and_verify(plan: &Plan, src: &Layout, dst: &Layout) -> u64 {
    let programs = plan.programs(src, dst).unwrap();
    let mut memory = RankMemory::for_programs(&programs);
    let n_src = src.ranks() as usize;
    fill_sources(src, &mut memory[..n_src]);
    for m in &mut memory[n_src..] {
        for b in &mut m.buffers {
            b.fill(0xee);
        }
    }
    let report = run_local(&programs, &mut memory, &ExecOptions { deadline: Duration::from_secs(30) }).unwrap();
    assert_eq!(report.bytes, plan.figures().total_bytes, "bytes moved as planned");
    let checked = verify_destinations(src, dst, &memory[n_src..]).unwrap();
    assert!(checked > 0);
    report.bytes
}

/// Bytes each source rank sends.
fn source_egress(plan: &Plan) -> Vec<u64> {
    let mut out = vec![0u64; plan.src_ranks() as usize];
    for t in plan.transfers().iter().filter(|t| t.from.group == Group::Src) {
        out[t.from.rank as usize] += plan.wire_bytes(t);
    }
    out
}

#[test]
fn a_plan_derived_for_replicas_delivers_every_replica_bit_exact() {
    let (src, one) = layouts();
    let options = PlanOptions::default();
    let base = plan_reshard(&src, &one, &options).unwrap();
    let one_bytes = run_and_verify(&base, &src, &one);
    assert_eq!(base.derived_for_replicas(), None);
    for n in 1..=4u32 {
        let dst = one.replicated(n).unwrap();
        let derived = base.for_replicas(&src, &one, &dst).unwrap();
        let bytes = run_and_verify(&derived, &src, &dst);
        assert_eq!(bytes, one_bytes * n as u64, "{n} replicas: each gets what one replica's plan moves");
        if n == 1 {
            assert_eq!(derived.fingerprint(), base.fingerprint(), "one replica's plan is itself");
            continue;
        }
        assert_eq!(derived.derived_for_replicas(), Some(n));
        // Not the plan a planner makes for the same layouts, and not taken
        // for it: its programs derive only as the derived plan's.
        let planned = plan_reshard(&src, &dst, &options).unwrap();
        assert_ne!(derived.fingerprint(), planned.fingerprint());
        run_and_verify(&planned, &src, &dst);
        // The data-parallel source replicas take turns: every source rank
        // sends, and none more than half again the mean.
        let egress = source_egress(&derived);
        let mean = egress.iter().sum::<u64>() / egress.len() as u64;
        assert!(egress.iter().all(|&b| b > 0 && b <= mean + mean / 2), "{n} replicas: source egress {egress:?}");
        // Every transfer into replica r comes from a source or from a rank
        // of replica r: no replica relays to another.
        let k = one.ranks();
        for t in derived.transfers().iter().filter(|t| t.from.group == Group::Dst) {
            assert_eq!(t.from.rank / k, t.to.rank / k, "{n} replicas: {t:?} crosses replicas");
        }
    }
}

#[test]
fn a_lost_source_sends_nothing_in_a_derived_plan() {
    let (src, one) = layouts();
    for lost in [vec![0], vec![3], vec![1, 2]] {
        let options = PlanOptions { lost_sources: lost.clone(), ..PlanOptions::default() };
        let base = plan_reshard(&src, &one, &options).unwrap();
        let dst = one.replicated(3).unwrap();
        let derived = base.for_replicas(&src, &one, &dst).unwrap();
        assert!(derived.transfers().iter().all(|t| !(t.from.group == Group::Src && lost.contains(&t.from.rank))), "lost {lost:?}");
        run_and_verify(&derived, &src, &dst);
    }
}

#[test]
fn what_cannot_be_derived_is_refused_with_why() {
    let (src, one) = layouts();
    let options = PlanOptions::default();
    let base = plan_reshard(&src, &one, &options).unwrap();
    let two = one.replicated(2).unwrap();
    let problem = |r: Result<Plan, PlanError>| match r {
        Err(e @ (PlanError::Derive { .. } | PlanError::FingerprintMismatch { .. })) => e.to_string(),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("derived"),
    };
    // A baseline plan; a plan already derived; a plan of other layouts.
    let baseline = plan_baseline(&src, &one, &options).unwrap();
    assert!(problem(baseline.for_replicas(&src, &one, &two)).contains("only a reshard plan"));
    let derived = base.for_replicas(&src, &one, &two).unwrap();
    assert!(problem(derived.for_replicas(&src, &one, &one.replicated(3).unwrap())).contains("itself derived"));
    assert!(problem(base.for_replicas(&src, &two, &two)).contains("does not match"));
    // A destination that is not replicas of the replica's layout.
    let other = parse_layout(&ONE.replace(r#""placements": ["replicate"]"#, r#""placements": ["shard(0)"]"#)).unwrap();
    let other_two = other.replicated(2).unwrap();
    assert!(problem(base.for_replicas(&src, &one, &other_two)).contains("not 2 replicas"));
    // Replicas that would share nodes.
    let odd = parse_layout(&ONE.replace(r#""ranks_per_node": 2"#, r#""ranks_per_node": 8"#)).unwrap();
    let odd_base = plan_reshard(&src, &odd, &options).unwrap();
    let e = problem(odd_base.for_replicas(&src, &odd, &odd.replicated(2).unwrap()));
    assert!(e.contains("whole nodes"), "{e}");
}
