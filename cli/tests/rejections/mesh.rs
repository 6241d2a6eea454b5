//! Single file: mesh placements.

use crate::{one, run_single_table};

#[test]
fn rejects_bad_mesh_placements() {
    let w = |shape: &str, mesh: &str, placements: &str| {
        one(&format!(r#"{{"name": "w", "dtype": "bf16", "shape": {shape}, "mesh": {mesh}, "placements": {placements}}}"#))
    };
    let cases: Vec<(&str, String, &[&str])> = vec![
        ("mesh not an object", w("[8]", "[4]", r#"["shard(0)"]"#), &["tensors[0] ('w').mesh", "expected an object, got an array"]),
        (
            "unknown mesh field",
            w("[8]", r#"{"shape": [4], "size": 4}"#, r#"["shard(0)"]"#),
            &["tensors[0] ('w').mesh", "unknown field 'size'"],
        ),
        ("mesh without shape", w("[8]", r#"{"ranks": [0, 1]}"#, r#"["shard(0)"]"#), &["tensors[0] ('w').mesh.shape", "missing field"]),
        ("empty mesh shape", w("[8]", r#"{"shape": []}"#, "[]"), &["tensor 'w'", "mesh.shape must have at least one dimension"]),
        ("zero mesh dim", w("[8]", r#"{"shape": [2, 0]}"#, r#"["shard(0)", "replicate"]"#), &["tensor 'w'", "mesh.shape[1] is 0"]),
        (
            "negative mesh dim",
            w("[8]", r#"{"shape": [-2]}"#, r#"["shard(0)"]"#),
            &["tensors[0] ('w').mesh.shape[0]", "expected a non-negative integer, got -2"],
        ),
        (
            "mesh dim too large",
            w("[8]", r#"{"shape": [4294967296]}"#, r#"["shard(0)"]"#),
            &["tensors[0] ('w').mesh.shape[0]", "4294967296 is too large"],
        ),
        (
            "default mesh ranks too many",
            w("[8]", r#"{"shape": [65536, 65536]}"#, r#"["shard(0)", "replicate"]"#),
            &["tensors[0] ('w').mesh.shape", "4294967296 positions", "4 ranks"],
        ),
        (
            "placements length below mesh dims",
            w("[8]", r#"{"shape": [2, 2]}"#, r#"["shard(0)"]"#),
            &["tensor 'w'", "1 placements for a 2-d mesh; need one per mesh dim"],
        ),
        (
            "placements length above mesh dims",
            w("[8]", r#"{"shape": [4]}"#, r#"["shard(0)", "replicate"]"#),
            &["tensor 'w'", "2 placements for a 1-d mesh"],
        ),
        (
            "placements not an array",
            w("[8]", r#"{"shape": [4]}"#, r#""shard(0)""#),
            &["tensors[0] ('w').placements", "expected an array, got a string"],
        ),
        (
            "placement not a string",
            w("[8]", r#"{"shape": [4]}"#, "[0]"),
            &["tensors[0] ('w').placements[0]", "expected a string, got a number"],
        ),
        (
            "unknown placement",
            w("[8]", r#"{"shape": [2, 2]}"#, r#"["replicate", "partial"]"#),
            &["tensors[0] ('w').placements[1]", "unknown placement 'partial'", "\"replicate\" or \"shard(D)\""],
        ),
        (
            "shard without dim",
            w("[8]", r#"{"shape": [4]}"#, r#"["shard"]"#),
            &["tensors[0] ('w').placements[0]", "unknown placement 'shard'"],
        ),
        (
            "negative shard dim",
            w("[8]", r#"{"shape": [4]}"#, r#"["shard(-1)"]"#),
            &["tensors[0] ('w').placements[0]", "unknown placement 'shard(-1)'"],
        ),
        (
            "shard dim out of range",
            w("[8, 4]", r#"{"shape": [2, 2]}"#, r#"["replicate", "shard(2)"]"#),
            &["tensor 'w'", "placements[1]: shard(2) but the tensor has 2 dims"],
        ),
        (
            "shard of a scalar",
            w("[]", r#"{"shape": [4]}"#, r#"["shard(0)"]"#),
            &["tensor 'w'", "placements[0]: shard(0) but the tensor has 0 dims"],
        ),
        (
            "mesh.ranks shorter than the mesh",
            w("[8]", r#"{"shape": [2, 2], "ranks": [0, 1, 2]}"#, r#"["shard(0)", "replicate"]"#),
            &["tensor 'w'", "mesh.ranks has 3 entries but mesh.shape [2, 2] has 4 positions"],
        ),
        (
            "mesh.ranks longer than the mesh",
            w("[8]", r#"{"shape": [2], "ranks": [0, 1, 2]}"#, r#"["shard(0)"]"#),
            &["tensor 'w'", "mesh.ranks has 3 entries but mesh.shape [2] has 2 positions"],
        ),
        (
            "mesh.ranks rank >= ranks",
            w("[8]", r#"{"shape": [2], "ranks": [2, 4]}"#, r#"["shard(0)"]"#),
            &["tensor 'w'", "mesh.ranks: rank 4 >= ranks (4)"],
        ),
        (
            "default mesh ranks >= ranks",
            w("[8]", r#"{"shape": [8]}"#, r#"["shard(0)"]"#),
            &["tensors[0] ('w').mesh.shape", "8 positions", "4 ranks"],
        ),
        (
            "mesh.ranks duplicate rank",
            w("[8]", r#"{"shape": [2, 2], "ranks": [0, 1, 1, 3]}"#, r#"["shard(0)", "replicate"]"#),
            &["tensor 'w'", "mesh.ranks: rank 1 appears twice"],
        ),
        (
            "mesh.ranks negative",
            w("[8]", r#"{"shape": [2], "ranks": [0, -1]}"#, r#"["shard(0)"]"#),
            &["tensors[0] ('w').mesh.ranks[1]", "expected a non-negative integer, got -1"],
        ),
        (
            "mesh.ranks rank too large",
            w("[8]", r#"{"shape": [1], "ranks": [4294967296]}"#, r#"["shard(0)"]"#),
            &["tensors[0] ('w').mesh.ranks[0]", "rank 4294967296 is too large"],
        ),
        (
            "mesh.ranks not an array",
            w("[8]", r#"{"shape": [1], "ranks": 0}"#, r#"["shard(0)"]"#),
            &["tensors[0] ('w').mesh.ranks", "expected an array of integers, got a number"],
        ),
    ];
    run_single_table(&cases);
}
