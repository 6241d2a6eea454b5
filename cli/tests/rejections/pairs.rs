//! Pairs: matching source and destination.

use crate::{check_pair, check_single, mesh_layout, run_pair_table};
use reshard::{parse_layout, plan_reshard, PlanOptions};

#[test]
fn rejects_bad_pairs() {
    let src = mesh_layout(2, "w", "bf16", "[8, 4]", "[2]", r#"["shard(0)"]"#);
    let rows_0_4 = r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "bf16", "shape": [8, 4],
        "shards": [{"rank": 0, "offset": [0, 0], "extent": [4, 4]}, {"rank": 1, "offset": [0, 0], "extent": [4, 4]}]}]}"#;
    // `w` block-scaled FP8, its scale replicated.
    let scaled = r#"{"ranks": 2, "tensors": [
        {"name": "w", "dtype": "f8e4m3", "shape": [8, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "scale": {"tensor": "s", "block": [4, 4]}},
        {"name": "s", "dtype": "f32", "shape": [2, 1], "mesh": {"shape": [2]}, "placements": ["replicate"]}]}"#
        .to_string();
    let cases: Vec<(&str, String, String, &[&str])> = vec![
        (
            "destination tensor absent from the source",
            src.clone(),
            r#"{"ranks": 2, "tensors": [
                {"name": "w", "dtype": "bf16", "shape": [8, 4], "mesh": {"shape": [2]}, "placements": ["replicate"]},
                {"name": "lm_head", "dtype": "bf16", "shape": [8, 4], "mesh": {"shape": [2]}, "placements": ["replicate"]}]}"#
                .to_string(),
            &["destination tensor 'lm_head' is absent from the source layout"],
        ),
        (
            "shape transposed",
            src.clone(),
            mesh_layout(2, "w", "bf16", "[4, 8]", "[2]", r#"["shard(0)"]"#),
            &["tensor 'w'", "source shape [8, 4] differs from destination shape [4, 8]"],
        ),
        (
            "shape flattened",
            src.clone(),
            mesh_layout(2, "w", "bf16", "[32]", "[2]", r#"["shard(0)"]"#),
            &["tensor 'w'", "source shape [8, 4] differs from destination shape [32]"],
        ),
        (
            "scalar versus one element",
            mesh_layout(1, "s", "f32", "[]", "[1]", r#"["replicate"]"#),
            mesh_layout(1, "s", "f32", "[1]", "[1]", r#"["replicate"]"#),
            &["tensor 's'", "source shape [] differs from destination shape [1]"],
        ),
        (
            "destination needs rows no source holds",
            rows_0_4.to_string(),
            mesh_layout(2, "w", "bf16", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            &["tensor 'w'", "region [4:8, 0:4]", "not covered by any source shard"],
        ),
        (
            "source holds nothing",
            r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "bf16", "shape": [8, 4], "shards": []}]}"#.to_string(),
            mesh_layout(3, "w", "bf16", "[8, 4]", "[3]", r#"["shard(1)"]"#),
            &["tensor 'w'", "not covered by any source shard"],
        ),
        (
            "source has a hole in the middle of a column",
            r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [8, 4], "shards": [
                {"rank": 0, "flat": [0, 13]}, {"rank": 1, "flat": [14, 18]}]}]}"#
                .to_string(),
            mesh_layout(2, "w", "f32", "[8, 4]", "[2]", r#"["shard(1)"]"#),
            &["tensor 'w'", "region [3:4, 1:2]", "not covered by any source shard"],
        ),
        (
            "bf16 to i32",
            src.clone(),
            mesh_layout(2, "w", "i32", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            &["tensor 'w'", "cannot convert bf16 to i32"],
        ),
        (
            "f32 to i64",
            mesh_layout(2, "w", "f32", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            mesh_layout(2, "w", "i64", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            &["tensor 'w'", "cannot convert f32 to i64"],
        ),
        (
            "i32 to i64",
            mesh_layout(2, "w", "i32", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            mesh_layout(2, "w", "i64", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            &["tensor 'w'", "cannot convert i32 to i64"],
        ),
        (
            "i8 to u8",
            mesh_layout(2, "w", "i8", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            mesh_layout(2, "w", "u8", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            &["tensor 'w'", "cannot convert i8 to u8"],
        ),
        (
            "f8e4m3 to bf16",
            mesh_layout(2, "w", "f8e4m3", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            mesh_layout(2, "w", "bf16", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            &["tensor 'w'", "cannot convert f8e4m3 to bf16"],
        ),
        (
            "f8e4m3 to f8e5m2",
            mesh_layout(2, "w", "f8e4m3", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            mesh_layout(2, "w", "f8e5m2", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            &["tensor 'w'", "cannot convert f8e4m3 to f8e5m2"],
        ),
        (
            "f32 to f8e4m3 without a scale",
            mesh_layout(2, "w", "f32", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            mesh_layout(2, "w", "f8e4m3", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            &["tensor 'w'", "cannot convert f32 to f8e4m3", "block scale"],
        ),
        (
            "i32 to block-scaled f8e4m3",
            mesh_layout(2, "w", "i32", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            scaled.clone(),
            &["tensor 'w'", "cannot quantize i32 to block-scaled f8e4m3"],
        ),
        (
            "block-scaled source",
            scaled.clone(),
            mesh_layout(2, "w", "f8e4m3", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            &["tensor 'w'", "block-scaled source tensors are not supported"],
        ),
        (
            "f16 to f8e5m2",
            mesh_layout(2, "w", "f16", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            mesh_layout(2, "w", "f8e5m2", "[8, 4]", "[2]", r#"["shard(0)"]"#),
            &["tensor 'w'", "cannot convert f16 to f8e5m2"],
        ),
    ];
    run_pair_table(&cases);
}

/// The reshard reports the destination rank that needs an uncovered region.
#[test]
fn not_covered_names_the_needing_rank() {
    let src = r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "bf16", "shape": [8, 4],
        "shards": [{"rank": 0, "offset": [0, 0], "extent": [4, 4]}]}]}"#;
    let dst = mesh_layout(4, "w", "bf16", "[8, 4]", "[4]", r#"["shard(0)"]"#);
    let s = parse_layout(src).unwrap();
    let d = parse_layout(&dst).unwrap();
    let msg = plan_reshard(&s, &d, &PlanOptions::default()).unwrap_err().to_string();
    assert!(msg.contains("needed by dst rank 2") && msg.contains("[4:6, 0:4]"), "{msg}");
    check_pair(src, &dst, &["tensor 'w'", "not covered by any source shard"]);
}

/// A destination overlap inside one named buffer is caught when the
/// destination file is parsed, before any planning.
#[test]
fn destination_buffer_overlap_is_rejected_on_parse() {
    check_single(
        r#"{"ranks": 2, "tensors": [
            {"name": "q", "dtype": "bf16", "shape": [4, 4], "shards": [{"rank": 1, "flat": [0, 16], "buffer": "qkv", "at": 0}]},
            {"name": "k", "dtype": "bf16", "shape": [4, 4], "shards": [{"rank": 1, "flat": [0, 16], "buffer": "qkv", "at": 8}]}]}"#,
        &["rank 1", "buffer 'qkv'", "tensor 'q'", "tensor 'k'", "overlap"],
    );
}
