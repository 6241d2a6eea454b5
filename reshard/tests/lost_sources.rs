//! Plans without lost source ranks: every piece comes from another holder,
//! or the plan says what only lost ranks hold.

use reshard::{parse_layout, plan_reshard, Group, PlanError, PlanOptions};

/// Training DP2 x TP2 (ranks 0-1 one replica, 2-3 the other), inference
/// TP2 by columns.
const SRC: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [8, 6], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]},
  {"name": "b", "dtype": "f32", "shape": [6], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "replicate"]}]}"#;
const DST: &str = r#"{"ranks": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [8, 6], "mesh": {"shape": [2]}, "placements": ["shard(1)"]},
  {"name": "b", "dtype": "f32", "shape": [6], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#;

#[test]
fn a_lost_source_sends_nothing_and_its_replica_covers_it() {
    let (src, dst) = (parse_layout(SRC).unwrap(), parse_layout(DST).unwrap());
    let whole = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
    for lost in [vec![0], vec![1], vec![0, 3], vec![1, 2]] {
        let options = PlanOptions { lost_sources: lost.clone(), ..PlanOptions::default() };
        let plan = plan_reshard(&src, &dst, &options).unwrap();
        assert!(plan.transfers().iter().all(|t| !(t.from.group == Group::Src && lost.contains(&t.from.rank))), "lost {lost:?}");
        // The same bytes arrive.
        assert_eq!(plan.figures().total_bytes, whole.figures().total_bytes, "lost {lost:?}");
        assert_ne!(plan.fingerprint(), whole.fingerprint());
    }
    // No lost source: the fingerprint of a plan made without the option.
    assert_eq!(
        plan_reshard(&src, &dst, &PlanOptions { lost_sources: Vec::new(), ..PlanOptions::default() }).unwrap().fingerprint(),
        whole.fingerprint()
    );
}

#[test]
fn what_only_lost_sources_hold_is_named() {
    let (src, dst) = (parse_layout(SRC).unwrap(), parse_layout(DST).unwrap());
    // Ranks 0 and 2 are both holders of rows 0-3 of w.
    let options = PlanOptions { lost_sources: vec![0, 2], ..PlanOptions::default() };
    match plan_reshard(&src, &dst, &options) {
        Err(PlanError::NotCovered { tensor, .. }) => assert_eq!(tensor, "w"),
        other => panic!("expected NotCovered, got {:?}", other.map(|p| p.fingerprint())),
    }
}
