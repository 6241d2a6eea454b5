//! Subset plans (`PlanOptions::only`): a plan of some destination tensors
//! moves exactly what the full plan moves for them, nothing of the others,
//! and its destination programs name the buffers that hold the others.

use reshard::{parse_layout, plan_baseline, plan_reshard, Endpoint, Layout, Plan, PlanError, PlanOptions, Programs, TensorSubset};

/// Source TP2 by rows; destination TP2 by columns on 2 ranks of one node,
/// `a` and `b` fused in one buffer `ab`, `c` in its own.
fn pair() -> (Layout, Layout) {
    let src = r#"{"ranks": 2, "tensors": [
      {"name": "a", "dtype": "f32", "shape": [8, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
      {"name": "b", "dtype": "f32", "shape": [8, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
      {"name": "c", "dtype": "f32", "shape": [16], "mesh": {"shape": [2]}, "placements": ["replicate"]}]}"#;
    let dst = r#"{"ranks": 2, "tensors": [
      {"name": "a", "dtype": "bf16", "shape": [8, 4], "mesh": {"shape": [2]}, "placements": ["shard(1)"], "buffer": "ab", "at": 0},
      {"name": "b", "dtype": "bf16", "shape": [8, 4], "mesh": {"shape": [2]}, "placements": ["shard(1)"], "buffer": "ab", "at": 16},
      {"name": "c", "dtype": "bf16", "shape": [16], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#;
    (parse_layout(src).unwrap(), parse_layout(dst).unwrap())
}

fn only(names: &[&str]) -> PlanOptions {
    PlanOptions { only: Some(TensorSubset::new(names.iter().copied())), ..PlanOptions::default() }
}

/// Bytes the plan delivers into each destination tensor.
fn bytes_by_tensor(plan: &Plan, dst: &Layout) -> Vec<u64> {
    let mut out = vec![0u64; dst.tensors().len()];
    for t in plan.transfers() {
        let p = plan.pieces()[t.piece as usize];
        if t.to.group == reshard::Group::Dst && !t.to_scratch {
            out[p.dst_tensor as usize] += p.block.numel() * 2;
        }
    }
    out
}

#[test]
fn a_subset_plan_moves_its_tensors_only() {
    let (src, dst) = pair();
    for planner in [plan_reshard as fn(&Layout, &Layout, &PlanOptions) -> Result<Plan, PlanError>, plan_baseline] {
        let full = planner(&src, &dst, &PlanOptions::default()).unwrap();
        let all = bytes_by_tensor(&full, &dst);
        for names in [&["a"][..], &["b", "c"], &["c", "c"], &["a", "b", "c"]] {
            let plan = planner(&src, &dst, &only(names)).unwrap();
            let got = bytes_by_tensor(&plan, &dst);
            for (i, t) in dst.tensors().iter().enumerate() {
                let want = if names.contains(&t.name.as_str()) { all[i] } else { 0 };
                assert_eq!(got[i], want, "{names:?}: tensor {}", t.name);
            }
            assert!(plan.pieces().iter().all(|p| names.contains(&dst.tensors()[p.dst_tensor as usize].name.as_str())));
            assert_ne!(plan.fingerprint(), full.fingerprint());
        }
        // The whole set is the full plan's work under another fingerprint.
        let every = planner(&src, &dst, &only(&["a", "b", "c"])).unwrap();
        assert_eq!(every.figures().total_bytes, full.figures().total_bytes);
    }
}

#[test]
fn destination_programs_name_the_buffers_a_subset_refit_keeps() {
    let (src, dst) = pair();
    // Buffer order on a destination rank: `ab`, then `c`'s own.
    let check = |names: &[&str], carried: &[u32]| {
        let plan = plan_reshard(&src, &dst, &only(names)).unwrap();
        let programs = Programs::new(&plan, &src, &dst).unwrap();
        for r in 0..2 {
            let p = programs.program(Endpoint::dst(r));
            assert_eq!(p.buffers[0].name, "ab");
            assert_eq!(p.carried, carried, "{names:?} on dst rank {r}");
            assert!(programs.program(Endpoint::src(r)).carried.is_empty());
        }
    };
    check(&["a"], &[0, 1]); // b shares `ab`; c is left out
    check(&["a", "b"], &[1]);
    check(&["c"], &[0]);
    check(&["a", "b", "c"], &[]);
    let full = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
    let programs = Programs::new(&full, &src, &dst).unwrap();
    assert!(programs.program(Endpoint::dst(0)).carried.is_empty());
}

#[test]
fn a_subset_naming_nothing_or_an_unknown_tensor_is_refused() {
    let (src, dst) = pair();
    let msg = |o: PlanOptions| plan_reshard(&src, &dst, &o).unwrap_err().to_string();
    assert_eq!(msg(only(&[])), "a subset refit must name at least one tensor");
    assert_eq!(msg(only(&["a", "zz"])), "tensor 'zz' named for a subset refit is not in the destination layout");
    assert!(plan_baseline(&src, &dst, &only(&["zz"])).is_err());
}
