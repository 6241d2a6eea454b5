//! Valid edge cases: planned, executed and verified with both strategies;
//! mesh placements expanded as `torch.chunk` does.

use crate::{mesh_layout, run_accept_table};
use reshard::parse_layout;

#[test]
fn accepts_valid_edge_cases() {
    let s = |x: &str| x.to_string();
    let cases: Vec<(&str, String, String)> = vec![
        (
            "scalar, every form",
            s(r#"{"ranks": 2, "tensors": [
                {"name": "a", "dtype": "f32", "shape": [], "mesh": {"shape": [2]}, "placements": ["replicate"]},
                {"name": "b", "dtype": "f32", "shape": [], "shards": [{"rank": 1, "offset": [], "extent": []}]},
                {"name": "c", "dtype": "f64", "shape": [], "shards": [{"rank": 0, "flat": [0, 1], "buffer": "s", "at": 3}]}]}"#),
            s(r#"{"ranks": 3, "tensors": [
                {"name": "a", "dtype": "bf16", "shape": [], "shards": [{"rank": 2, "flat": [0, 1]}]},
                {"name": "b", "dtype": "f32", "shape": [], "mesh": {"shape": [3]}, "placements": ["replicate"]},
                {"name": "c", "dtype": "f16", "shape": [], "mesh": {"shape": [1], "ranks": [1]}, "placements": ["replicate"]}]}"#),
        ),
        (
            "destination tensor with an empty shards list; source-only tensor",
            s(r#"{"ranks": 1, "tensors": [
                {"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": [1]}, "placements": ["replicate"]},
                {"name": "optimizer.step", "dtype": "i64", "shape": [], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}"#),
            s(r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [4], "shards": []}]}"#),
        ),
        (
            "mesh tensors in named buffers: fused, uneven local blocks, a gap, shared with a shard",
            s(r#"{"ranks": 3, "ranks_per_node": 2, "tensors": [
                {"name": "q", "dtype": "f32", "shape": [5, 3], "mesh": {"shape": [3]}, "placements": ["shard(0)"], "buffer": "qkv"},
                {"name": "k", "dtype": "f32", "shape": [2, 3], "mesh": {"shape": [3]}, "placements": ["replicate"], "buffer": "qkv", "at": 7},
                {"name": "v", "dtype": "f32", "shape": [2, 3], "shards": [
                    {"rank": 0, "flat": [0, 6], "buffer": "qkv", "at": 13},
                    {"rank": 2, "offset": [0, 0], "extent": [2, 3], "buffer": "qkv", "at": 13}]}]}"#),
            s(r#"{"ranks": 2, "tensors": [
                {"name": "q", "dtype": "bf16", "shape": [5, 3], "mesh": {"shape": [2]}, "placements": ["shard(1)"], "buffer": "qkv_proj", "at": 4},
                {"name": "k", "dtype": "bf16", "shape": [2, 3], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "buffer": "qkv_proj", "at": 0},
                {"name": "v", "dtype": "f64", "shape": [2, 3], "mesh": {"shape": [1, 2]}, "placements": ["replicate", "shard(0)"], "buffer": "v"}]}"#),
        ),
        (
            "sub-meshes (pipeline stages)",
            s(r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
                {"name": "l0", "dtype": "bf16", "shape": [6, 4], "mesh": {"shape": [2], "ranks": [0, 1]}, "placements": ["shard(0)"]},
                {"name": "l1", "dtype": "bf16", "shape": [6, 4], "mesh": {"shape": [2], "ranks": [3, 2]}, "placements": ["shard(1)"]}]}"#),
            s(r#"{"ranks": 2, "tensors": [
                {"name": "l0", "dtype": "bf16", "shape": [6, 4], "mesh": {"shape": [2]}, "placements": ["shard(1)"]},
                {"name": "l1", "dtype": "bf16", "shape": [6, 4], "mesh": {"shape": [1], "ranks": [1]}, "placements": ["replicate"]}]}"#),
        ),
        (
            "uneven chunks with an empty trailing chunk",
            mesh_layout(4, "w", "f32", "[5, 3]", "[4]", r#"["shard(0)"]"#),
            mesh_layout(4, "w", "f32", "[5, 3]", "[2, 2]", r#"["shard(1)", "shard(0)"]"#),
        ),
        (
            "more mesh positions than rows",
            mesh_layout(2, "w", "f32", "[2, 3]", "[2]", r#"["replicate"]"#),
            mesh_layout(8, "w", "f32", "[2, 3]", "[8]", r#"["shard(0)"]"#),
        ),
        (
            "one tensor dim sharded by two mesh dims",
            mesh_layout(6, "w", "u8", "[29, 2]", "[2, 3]", r#"["shard(0)", "shard(0)"]"#),
            mesh_layout(6, "w", "u8", "[29, 2]", "[3, 2]", r#"["shard(0)", "shard(0)"]"#),
        ),
        (
            "ranks_per_node above ranks, null optional fields",
            s(r#"{"ranks": 2, "ranks_per_node": 16, "tensors": [
                {"name": "w", "dtype": "f16", "shape": [4], "mesh": {"shape": [2], "ranks": null}, "placements": ["shard(0)"]}]}"#),
            s(r#"{"ranks": 3, "ranks_per_node": null, "tensors": [
                {"name": "w", "dtype": "f16", "shape": [4], "mesh": {"shape": [3]}, "placements": ["replicate"]}]}"#),
        ),
        (
            "zero-size dims and empty shards",
            s(r#"{"ranks": 2, "tensors": [
                {"name": "e", "dtype": "f32", "shape": [0, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
                {"name": "w", "dtype": "f32", "shape": [4, 4], "shards": [
                    {"rank": 0, "offset": [4, 0], "extent": [0, 4]},
                    {"rank": 0, "flat": [16, 0]},
                    {"rank": 1, "offset": [0, 0], "extent": [4, 4]}]}]}"#),
            s(r#"{"ranks": 2, "tensors": [
                {"name": "e", "dtype": "f32", "shape": [0, 4], "shards": [{"rank": 1, "offset": [0, 0], "extent": [0, 4]}]},
                {"name": "w", "dtype": "f32", "shape": [4, 4], "mesh": {"shape": [2]}, "placements": ["shard(1)"]}]}"#),
        ),
        (
            "overlapping source replicas, several shards per rank",
            s(r#"{"ranks": 3, "tensors": [{"name": "w", "dtype": "i32", "shape": [6, 6], "shards": [
                {"rank": 0, "offset": [0, 0], "extent": [4, 6]},
                {"rank": 1, "offset": [2, 0], "extent": [4, 6]},
                {"rank": 2, "offset": [0, 0], "extent": [6, 3]},
                {"rank": 2, "offset": [0, 3], "extent": [6, 3]}]}]}"#),
            mesh_layout(3, "w", "i32", "[6, 6]", "[3]", r#"["shard(0)"]"#),
        ),
        (
            "destination shards overlapping in their own buffers on one rank",
            mesh_layout(1, "w", "f32", "[6, 6]", "[1]", r#"["replicate"]"#),
            s(r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [6, 6], "shards": [
                {"rank": 0, "offset": [0, 0], "extent": [4, 4]},
                {"rank": 0, "offset": [2, 2], "extent": [4, 4]},
                {"rank": 1, "flat": [5, 20]},
                {"rank": 1, "flat": [5, 20]}]}]}"#),
        ),
        (
            "named buffers: fused, adjacent, with gaps, flat across rows",
            s(r#"{"ranks": 2, "tensors": [
                {"name": "q", "dtype": "bf16", "shape": [4, 3], "shards": [
                    {"rank": 0, "offset": [0, 0], "extent": [2, 3], "buffer": "qkv", "at": 0},
                    {"rank": 1, "offset": [2, 0], "extent": [2, 3], "buffer": "qkv", "at": 0}]},
                {"name": "k", "dtype": "bf16", "shape": [4, 3], "shards": [
                    {"rank": 0, "flat": [0, 5], "buffer": "qkv", "at": 6},
                    {"rank": 1, "flat": [5, 7], "buffer": "qkv", "at": 11}]}]}"#),
            s(r#"{"ranks": 2, "tensors": [
                {"name": "q", "dtype": "f32", "shape": [4, 3], "shards": [
                    {"rank": 0, "flat": [1, 10], "buffer": "flat", "at": 2},
                    {"rank": 1, "offset": [0, 1], "extent": [4, 2], "buffer": "flat"}]},
                {"name": "k", "dtype": "f32", "shape": [4, 3], "shards": [
                    {"rank": 0, "offset": [1, 0], "extent": [3, 3], "buffer": "flat", "at": 20},
                    {"rank": 1, "flat": [0, 12], "buffer": "flat", "at": 8}]}]}"#),
        ),
        (
            "eight dims",
            mesh_layout(2, "w", "f32", "[2, 1, 2, 1, 3, 1, 2, 2]", "[2]", r#"["shard(4)"]"#),
            mesh_layout(2, "w", "f32", "[2, 1, 2, 1, 3, 1, 2, 2]", "[2]", r#"["shard(7)"]"#),
        ),
        (
            "float conversions, exact integer copies",
            s(r#"{"ranks": 1, "tensors": [
                {"name": "a", "dtype": "f32", "shape": [5], "mesh": {"shape": [1]}, "placements": ["replicate"]},
                {"name": "b", "dtype": "bf16", "shape": [5], "mesh": {"shape": [1]}, "placements": ["replicate"]},
                {"name": "c", "dtype": "f16", "shape": [5], "mesh": {"shape": [1]}, "placements": ["replicate"]},
                {"name": "d", "dtype": "f64", "shape": [5], "mesh": {"shape": [1]}, "placements": ["replicate"]},
                {"name": "e", "dtype": "i32", "shape": [5], "mesh": {"shape": [1]}, "placements": ["replicate"]},
                {"name": "f", "dtype": "f8e4m3", "shape": [5], "mesh": {"shape": [1]}, "placements": ["replicate"]},
                {"name": "g", "dtype": "u8", "shape": [5], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}"#),
            s(r#"{"ranks": 2, "tensors": [
                {"name": "a", "dtype": "bf16", "shape": [5], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
                {"name": "b", "dtype": "f16", "shape": [5], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
                {"name": "c", "dtype": "f64", "shape": [5], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
                {"name": "d", "dtype": "f16", "shape": [5], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
                {"name": "e", "dtype": "i32", "shape": [5], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
                {"name": "f", "dtype": "f8e4m3", "shape": [5], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
                {"name": "g", "dtype": "u8", "shape": [5], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#),
        ),
        ("no tensors at all", s(r#"{"ranks": 1, "tensors": []}"#), s(r#"{"ranks": 3, "ranks_per_node": 1, "tensors": []}"#)),
        (
            "block-scaled FP8 from every float, scalar and 1-element blocks included",
            s(r#"{"ranks": 2, "tensors": [
                {"name": "a", "dtype": "f64", "shape": [9, 5], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
                {"name": "b", "dtype": "f16", "shape": [7], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
                {"name": "c", "dtype": "bf16", "shape": [], "mesh": {"shape": [2]}, "placements": ["replicate"]}]}"#),
            s(r#"{"ranks": 3, "tensors": [
                {"name": "a", "dtype": "f8e4m3", "shape": [9, 5], "mesh": {"shape": [3]}, "placements": ["shard(1)"],
                 "scale": {"tensor": "a_s", "block": [4, 1]}},
                {"name": "a_s", "dtype": "f32", "shape": [3, 5], "shards": [{"rank": 2, "offset": [0, 0], "extent": [3, 5]}]},
                {"name": "b", "dtype": "f8e4m3", "shape": [7], "mesh": {"shape": [3]}, "placements": ["shard(0)"],
                 "scale": {"tensor": "b_s", "block": [100]}},
                {"name": "b_s", "dtype": "f32", "shape": [1], "mesh": {"shape": [3]}, "placements": ["replicate"]},
                {"name": "c", "dtype": "f8e4m3", "shape": [], "mesh": {"shape": [3]}, "placements": ["replicate"],
                 "scale": {"tensor": "c_s", "block": []}},
                {"name": "c_s", "dtype": "f32", "shape": [], "shards": [{"rank": 0, "offset": [], "extent": []}]}]}"#),
        ),
    ];
    run_accept_table(&cases);
}

/// `torch.chunk` semantics and the lower-mesh-dim-first rule, checked on the
/// holdings the IR expands a mesh placement into.
#[test]
fn mesh_expansion_follows_torch_chunk() {
    let l = parse_layout(&mesh_layout(4, "w", "f32", "[5]", "[4]", r#"["shard(0)"]"#)).unwrap();
    let got: Vec<(u32, u64, u64)> = l.holdings(0).iter().map(|h| (h.holders[0].rank, h.block.offset()[0], h.block.extent()[0])).collect();
    assert_eq!(got, vec![(0, 0, 2), (1, 2, 2), (2, 4, 1)], "torch.chunk(5, 4) is [2, 2, 1, 0]");

    // [10] on mesh [2, 3], both dims shard(0): split in 5 + 5 first, then 5 into 2, 2, 1.
    let l = parse_layout(&mesh_layout(6, "w", "f32", "[10]", "[2, 3]", r#"["shard(0)", "shard(0)"]"#)).unwrap();
    let mut got: Vec<(u32, u64, u64)> =
        l.holdings(0).iter().map(|h| (h.holders[0].rank, h.block.offset()[0], h.block.extent()[0])).collect();
    got.sort_unstable();
    assert_eq!(got, vec![(0, 0, 2), (1, 2, 2), (2, 4, 1), (3, 5, 2), (4, 7, 2), (5, 9, 1)]);
}
