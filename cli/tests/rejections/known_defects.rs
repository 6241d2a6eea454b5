//! Defects once known (the contract's behaviour, not met at the time),
//! each kept as a regression test.

use crate::{check_single, mesh_layout};
use reshard::{parse_layout, plan_baseline, plan_reshard, PlanOptions};

/// A destination that needs only the part of a tensor the source holds is a
/// valid pair (every destination region is covered); the baseline rejects it
/// because it gathers the whole tensor, and names a rank that needs nothing
/// of the reported region.
#[test]

fn baseline_accepts_partially_held_tensor() {
    let src = r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [4, 4],
        "shards": [{"rank": 0, "offset": [0, 0], "extent": [2, 4]}]}]}"#;
    let dst = r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [4, 4],
        "shards": [{"rank": 1, "offset": [0, 0], "extent": [2, 4]}]}]}"#;
    let (s, d) = (parse_layout(src).unwrap(), parse_layout(dst).unwrap());
    plan_reshard(&s, &d, &PlanOptions::default()).expect("the reshard accepts it");
    if let Err(e) = plan_baseline(&s, &d, &PlanOptions::default()) {
        panic!("plan_baseline: {e}");
    }
}

/// `chunk_range` computes `(i + 1) * ceil(n / k)`, which overflows for
/// extents near 2^64: a panic in debug builds, wrong blocks in release.
#[test]

fn mesh_expansion_of_huge_extent_does_not_overflow() {
    let l = parse_layout(&mesh_layout(2, "w", "u8", "[18446744073709551615]", "[2]", r#"["shard(0)"]"#))
        .expect("2^64 - 1 one-byte elements do not overflow");
    let got: Vec<(u64, u64)> = l.holdings(0).iter().map(|h| (h.block.offset()[0], h.block.extent()[0])).collect();
    assert_eq!(got, vec![(0, 1 << 63), (1 << 63, (1 << 63) - 1)]);
}

/// A name holding a newline puts a line break into the error message, so
/// the CLI's error is no longer one line.
#[test]

fn error_messages_stay_on_one_line() {
    check_single(
        r#"{"ranks": 2, "tensors": [{"name": "w\nx", "dtype": "zz", "shape": [4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#,
        &["unknown dtype"],
    );
    check_single(r#"{"ranks": 2, "rank\ns": 1, "tensors": []}"#, &["unknown field"]);
}
