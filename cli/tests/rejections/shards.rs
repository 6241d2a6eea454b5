//! Single file: explicit shards and named buffers.

use crate::{check_single, one, run_single_table};

#[test]
fn rejects_bad_shards() {
    // q is [8, 4] (32 elements) on 4 ranks.
    let q = |shards: &str| one(&format!(r#"{{"name": "q", "dtype": "bf16", "shape": [8, 4], "shards": {shards}}}"#));
    let cases: Vec<(&str, String, &[&str])> = vec![
        ("shards not an array", q("{}"), &["tensors[0] ('q').shards", "expected an array, got an object"]),
        ("shards null", q("null"), &["tensors[0] ('q').shards", "expected an array, got null"]),
        ("shard not an object", q("[1]"), &["tensors[0] ('q').shards[0]", "expected an object, got a number"]),
        ("unknown shard field", q(r#"[{"rank": 0, "flat": [0, 4], "size": 4}]"#), &["tensors[0] ('q').shards[0]", "unknown field 'size'"]),
        ("shard without rank", q(r#"[{"flat": [0, 4]}]"#), &["tensors[0] ('q').shards[0].rank", "missing field"]),
        (
            "shard rank negative",
            q(r#"[{"rank": -1, "flat": [0, 4]}]"#),
            &["tensors[0] ('q').shards[0].rank", "expected a non-negative integer, got -1"],
        ),
        (
            "shard rank >= ranks",
            q(r#"[{"rank": 0, "flat": [0, 4]}, {"rank": 4, "flat": [4, 4]}]"#),
            &["tensor 'q'", "shards[1]: rank 4 >= ranks (4)"],
        ),
        (
            "box and flat",
            q(r#"[{"rank": 0, "offset": [0, 0], "extent": [4, 4], "flat": [0, 16]}]"#),
            &["tensors[0] ('q').shards[0]", "has both 'offset'/'extent' and 'flat'"],
        ),
        ("neither box nor flat", q(r#"[{"rank": 0}]"#), &["tensors[0] ('q').shards[0]", "needs 'offset'+'extent' or 'flat'"]),
        ("offset without extent", q(r#"[{"rank": 0, "offset": [0, 0]}]"#), &["tensors[0] ('q').shards[0].extent", "missing field"]),
        ("extent without offset", q(r#"[{"rank": 0, "extent": [4, 4]}]"#), &["tensors[0] ('q').shards[0].offset", "missing field"]),
        (
            "negative offset",
            q(r#"[{"rank": 0, "offset": [-1, 0], "extent": [4, 4]}]"#),
            &["tensors[0] ('q').shards[0].offset[0]", "expected a non-negative integer, got -1"],
        ),
        (
            "negative extent",
            q(r#"[{"rank": 2, "offset": [0, 0], "extent": [4, -4]}]"#),
            &["tensors[0] ('q').shards[0].extent[1]", "expected a non-negative integer, got -4"],
        ),
        (
            "box out of bounds",
            q(r#"[{"rank": 0, "offset": [0, 0], "extent": [8, 4]}, {"rank": 1, "offset": [4, 2], "extent": [4, 4]}]"#),
            &["tensor 'q'", "shards[1] (rank 1): dim 1: 2..6 is outside 0..4"],
        ),
        (
            "empty box past the end",
            q(r#"[{"rank": 3, "offset": [9, 0], "extent": [0, 4]}]"#),
            &["tensor 'q'", "shards[0] (rank 3): dim 0: 9..9 is outside 0..8"],
        ),
        (
            "box end overflows",
            q(r#"[{"rank": 0, "offset": [18446744073709551615, 0], "extent": [2, 4]}]"#),
            &["tensor 'q'", "shards[0] (rank 0): dim 0", "is outside 0..8"],
        ),
        (
            "offset has too few dims",
            q(r#"[{"rank": 0, "offset": [0], "extent": [4, 4]}]"#),
            &["tensor 'q'", "shards[0] (rank 0): offset has 1 and extent 2 dims, tensor has 2"],
        ),
        (
            "extent has too many dims",
            q(r#"[{"rank": 0, "offset": [0, 0], "extent": [4, 4, 1]}]"#),
            &["tensor 'q'", "shards[0] (rank 0): offset has 2 and extent 3 dims, tensor has 2"],
        ),
        (
            "flat with three numbers",
            q(r#"[{"rank": 0, "flat": [0, 4, 8]}]"#),
            &["tensors[0] ('q').shards[0].flat", "expected [start, len], got 3 numbers"],
        ),
        (
            "flat not an array",
            q(r#"[{"rank": 0, "flat": "0..4"}]"#),
            &["tensors[0] ('q').shards[0].flat", "expected an array of integers, got a string"],
        ),
        (
            "flat out of bounds",
            q(r#"[{"rank": 0, "flat": [0, 16]}, {"rank": 1, "flat": [16, 24]}]"#),
            &["tensor 'q'", "shards[1] (rank 1): flat 16..40 is outside 0..32"],
        ),
        (
            "flat end overflows",
            q(r#"[{"rank": 2, "flat": [1, 18446744073709551615]}]"#),
            &["tensor 'q'", "shards[0] (rank 2): flat 1..", "is outside 0..32"],
        ),
        (
            "at without buffer",
            q(r#"[{"rank": 0, "flat": [0, 16], "at": 4}]"#),
            &["tensors[0] ('q').shards[0].at", "given without 'buffer'"],
        ),
        (
            "buffer not a string",
            q(r#"[{"rank": 0, "flat": [0, 16], "buffer": 1, "at": 0}]"#),
            &["tensors[0] ('q').shards[0].buffer", "expected a string, got a number"],
        ),
        (
            "empty buffer name",
            q(r#"[{"rank": 0, "flat": [0, 16], "buffer": "", "at": 0}]"#),
            &["tensor 'q'", "shards[0]: buffer name must not be empty"],
        ),
        (
            "negative at",
            q(r#"[{"rank": 0, "flat": [0, 16], "buffer": "b", "at": -16}]"#),
            &["tensors[0] ('q').shards[0].at", "expected a non-negative integer, got -16"],
        ),
        (
            "at + size overflows",
            q(r#"[{"rank": 0, "flat": [0, 16], "buffer": "b", "at": 18446744073709551615}]"#),
            &["tensor 'q'", "shards[0]: at 18446744073709551615 + size overflows"],
        ),
    ];
    run_single_table(&cases);
}

#[test]
fn rejects_bad_named_buffers() {
    let cases: Vec<(&str, String, &[&str])> = vec![
        (
            "one buffer, two dtypes",
            r#"{"ranks": 2, "tensors": [
                {"name": "q", "dtype": "bf16", "shape": [4, 4], "shards": [{"rank": 0, "flat": [0, 16], "buffer": "qkv", "at": 0}]},
                {"name": "k", "dtype": "f32", "shape": [4, 4], "shards": [{"rank": 0, "flat": [0, 16], "buffer": "qkv", "at": 16}]}]}"#
                .to_string(),
            &["tensor 'k'", "buffer 'qkv'", "tensor 'q'", "bf16", "f32", "one buffer has one dtype"],
        ),
        (
            "one buffer name, two dtypes on different ranks",
            r#"{"ranks": 2, "tensors": [
                {"name": "q", "dtype": "bf16", "shape": [4, 4], "shards": [{"rank": 0, "flat": [0, 16], "buffer": "b", "at": 0}]},
                {"name": "k", "dtype": "f16", "shape": [4, 4], "shards": [{"rank": 1, "flat": [0, 16], "buffer": "b", "at": 0}]}]}"#
                .to_string(),
            &["tensor 'k'", "buffer 'b'", "one buffer has one dtype"],
        ),
        (
            "two tensors overlap in one buffer",
            r#"{"ranks": 2, "tensors": [
                {"name": "q", "dtype": "bf16", "shape": [4, 4], "shards": [{"rank": 1, "offset": [0, 0], "extent": [4, 4], "buffer": "qkv", "at": 0}]},
                {"name": "k", "dtype": "bf16", "shape": [2, 4], "shards": [{"rank": 1, "flat": [0, 8], "buffer": "qkv", "at": 12}]}]}"#
                .to_string(),
            &["rank 1", "buffer 'qkv'", "elements 0..16 of tensor 'q'", "elements 12..20 of tensor 'k'", "overlap"],
        ),
        (
            "two shards of one tensor overlap in one buffer",
            r#"{"ranks": 2, "tensors": [
                {"name": "w", "dtype": "f32", "shape": [8], "shards": [
                    {"rank": 0, "flat": [0, 4], "buffer": "flat", "at": 0},
                    {"rank": 0, "flat": [4, 4], "buffer": "flat", "at": 3}]}]}"#
                .to_string(),
            &["rank 0", "buffer 'flat'", "tensor 'w'", "overlap"],
        ),
        (
            "identical shard listed twice in one buffer",
            r#"{"ranks": 2, "tensors": [
                {"name": "w", "dtype": "f32", "shape": [8], "shards": [
                    {"rank": 1, "flat": [0, 8], "buffer": "b", "at": 0},
                    {"rank": 1, "flat": [0, 8], "buffer": "b", "at": 0}]}]}"#
                .to_string(),
            &["rank 1", "buffer 'b'", "elements 0..8 of tensor 'w'", "overlap"],
        ),
        (
            "implicit at 0 overlaps an explicit at",
            r#"{"ranks": 2, "tensors": [
                {"name": "a", "dtype": "f32", "shape": [8], "shards": [{"rank": 0, "flat": [0, 8], "buffer": "b"}]},
                {"name": "c", "dtype": "f32", "shape": [8], "shards": [{"rank": 0, "flat": [0, 8], "buffer": "b", "at": 7}]}]}"#
                .to_string(),
            &["rank 0", "buffer 'b'", "tensor 'a'", "tensor 'c'", "overlap"],
        ),
    ];
    run_single_table(&cases);
}

/// Named buffers on mesh-form tensors: `buffer` and `at` next to `mesh` and
/// `placements`, every rank's local block at `at` of its buffer. The rules of
/// named buffers apply to them as to shards.
#[test]
fn rejects_bad_mesh_named_buffers() {
    let cases: Vec<(&str, String, &[&str])> = vec![
        (
            "mesh block overlaps another tensor in one buffer",
            // q: [8, 4] split 2 ways, 16 elements per rank at 0; k at 12 overlaps on both ranks, rank 0 first.
            r#"{"ranks": 2, "tensors": [
                {"name": "q", "dtype": "bf16", "shape": [8, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "buffer": "qkv", "at": 0},
                {"name": "k", "dtype": "bf16", "shape": [4, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "buffer": "qkv", "at": 12}]}"#
                .to_string(),
            &["rank 0", "buffer 'qkv'", "elements 0..16 of tensor 'q'", "elements 12..20 of tensor 'k'", "overlap"],
        ),
        (
            "mesh block overlaps an explicit shard in one buffer",
            r#"{"ranks": 2, "tensors": [
                {"name": "q", "dtype": "f32", "shape": [4, 4], "shards": [{"rank": 1, "flat": [0, 16], "buffer": "qkv", "at": 0}]},
                {"name": "k", "dtype": "f32", "shape": [4, 2], "mesh": {"shape": [2]}, "placements": ["shard(1)"], "buffer": "qkv", "at": 15}]}"#
                .to_string(),
            &["rank 1", "buffer 'qkv'", "elements 0..16 of tensor 'q'", "elements 15..19 of tensor 'k'", "overlap"],
        ),
        (
            "uneven mesh blocks: the largest one overlaps",
            // [5] over 2 ranks: 3 and 2 elements; b at 2 overlaps rank 0's 0..3 only.
            r#"{"ranks": 2, "tensors": [
                {"name": "a", "dtype": "u8", "shape": [5], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "buffer": "b"},
                {"name": "c", "dtype": "u8", "shape": [2], "mesh": {"shape": [2]}, "placements": ["replicate"], "buffer": "b", "at": 2}]}"#
                .to_string(),
            &["rank 0", "buffer 'b'", "elements 0..3 of tensor 'a'", "elements 2..4 of tensor 'c'", "overlap"],
        ),
        (
            "mesh at without buffer",
            one(r#"{"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "at": 4}"#),
            &["tensors[0] ('w').at", "given without 'buffer'"],
        ),
        (
            "mesh empty buffer name",
            one(r#"{"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "buffer": "", "at": 0}"#),
            &["tensor 'w'", "buffer name must not be empty"],
        ),
        (
            "mesh buffer not a string",
            one(r#"{"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "buffer": ["qkv"]}"#),
            &["tensors[0] ('w').buffer", "expected a string, got an array"],
        ),
        (
            "mesh negative at",
            one(r#"{"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "buffer": "b", "at": -2}"#),
            &["tensors[0] ('w').at", "expected a non-negative integer"],
        ),
        (
            "mesh at + local block overflows",
            one(r#"{"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "buffer": "b",
                   "at": 4611686018427387903}"#),
            &["tensor 'w'", "at 4611686018427387903 + local block size overflows"],
        ),
        (
            "mesh buffer dtype clash with another mesh tensor",
            r#"{"ranks": 2, "tensors": [
                {"name": "gate", "dtype": "bf16", "shape": [4, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "buffer": "gate_up"},
                {"name": "up", "dtype": "f32", "shape": [4, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "buffer": "gate_up", "at": 8}]}"#
                .to_string(),
            &["tensor 'up'", "buffer 'gate_up'", "tensor 'gate'", "bf16", "f32", "one buffer has one dtype"],
        ),
        (
            "mesh buffer dtype clash with a shard, on other ranks, every block empty",
            r#"{"ranks": 4, "tensors": [
                {"name": "q", "dtype": "bf16", "shape": [4], "shards": [{"rank": 0, "flat": [0, 4], "buffer": "b"}]},
                {"name": "e", "dtype": "i32", "shape": [0, 3], "mesh": {"shape": [2], "ranks": [2, 3]}, "placements": ["shard(0)"], "buffer": "b"}]}"#
                .to_string(),
            &["tensor 'e'", "rank 2", "buffer 'b'", "tensor 'q'", "one buffer has one dtype"],
        ),
        (
            "tensor-level buffer with the shards form",
            one(r#"{"name": "w", "dtype": "f32", "shape": [4], "shards": [{"rank": 0, "flat": [0, 4]}], "buffer": "b"}"#),
            &["tensors[0] ('w').buffer", "belongs to the mesh form", "per shard"],
        ),
    ];
    run_single_table(&cases);
}

/// Every error of one file names where it is: at least one of a field path
/// (`tensors[..]`, a top-level key), a tensor (`tensor '..'`) or a rank.
#[test]
fn single_file_messages_name_their_subject() {
    check_single(
        r#"{"ranks": 2, "tensors": [{"name": "ok", "dtype": "u8", "shape": [2], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
            {"name": "bad", "dtype": "u8", "shape": [2], "mesh": {"shape": [2], "ranks": [0, 2]}, "placements": ["shard(0)"]}]}"#,
        &["tensor 'bad'", "rank 2"],
    );
    check_single(
        r#"{"ranks": 2, "tensors": [{"name": "x", "dtype": "u8", "shape": [2], "shards": [{"rank": 0, "flat": [0, 3]}]}]}"#,
        &["tensor 'x'", "rank 0", "flat 0..3"],
    );
}
