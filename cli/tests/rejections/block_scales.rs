//! Single file: block scales of FP8 tensors.

use crate::run_single_table;

#[test]
fn rejects_bad_block_scales() {
    let l = |w: &str, s: &str| format!(r#"{{"ranks": 2, "tensors": [{w}, {s}]}}"#);
    let w = |dtype: &str, scale: &str| {
        format!(
            r#"{{"name": "w", "dtype": "{dtype}", "shape": [300, 200], "mesh": {{"shape": [2]}}, "placements": ["shard(0)"], "scale": {scale}}}"#
        )
    };
    let s = |dtype: &str, shape: &str| {
        format!(r#"{{"name": "ws", "dtype": "{dtype}", "shape": {shape}, "mesh": {{"shape": [2]}}, "placements": ["replicate"]}}"#)
    };
    let ok_scale = r#"{"tensor": "ws", "block": [128, 128]}"#;
    let cases: Vec<(&str, String, &[&str])> = vec![
        (
            "scale on bf16",
            l(&w("bf16", ok_scale), &s("f32", "[3, 2]")),
            &["tensors[0].scale", "only f8e4m3 tensors are block-scaled", "bf16"],
        ),
        (
            "unknown scale tensor",
            l(&w("f8e4m3", r#"{"tensor": "nope", "block": [128, 128]}"#), &s("f32", "[3, 2]")),
            &["tensors[0].scale.tensor", "no tensor named 'nope'"],
        ),
        (
            "wrong block rank",
            l(&w("f8e4m3", r#"{"tensor": "ws", "block": [128]}"#), &s("f32", "[3]")),
            &["tensors[0].scale.block", "1 dimensions for a tensor of 2"],
        ),
        (
            "zero block",
            l(&w("f8e4m3", r#"{"tensor": "ws", "block": [128, 0]}"#), &s("f32", "[3, 2]")),
            &["tensors[0].scale.block[1]", "at least 1"],
        ),
        (
            "bf16 scale",
            l(&w("f8e4m3", ok_scale), &s("bf16", "[3, 2]")),
            &["tensors[0].scale.tensor", "scale tensor 'ws' is bf16; scales are f32"],
        ),
        (
            "wrong scale shape",
            l(&w("f8e4m3", ok_scale), &s("f32", "[2, 2]")),
            &["tensors[0].scale.tensor", "has shape [2, 2]", "need [3, 2]"],
        ),
        (
            "own scale",
            l(&w("f8e4m3", r#"{"tensor": "w", "block": [128, 128]}"#), &s("f32", "[3, 2]")),
            &["tensors[0].scale.tensor", "its own scale"],
        ),
        ("missing block", l(&w("f8e4m3", r#"{"tensor": "ws"}"#), &s("f32", "[3, 2]")), &["tensors[0] ('w').scale.block", "missing field"]),
        (
            "unknown field",
            l(&w("f8e4m3", r#"{"tensor": "ws", "block": [128, 128], "kind": "e4m3"}"#), &s("f32", "[3, 2]")),
            &["scale", "kind"],
        ),
        ("scale not an object", l(&w("f8e4m3", r#""ws""#), &s("f32", "[3, 2]")), &["tensors[0] ('w').scale", "expected an object"]),
        (
            "one scale for two tensors",
            format!(
                r#"{{"ranks": 2, "tensors": [{}, {}, {}]}}"#,
                w("f8e4m3", ok_scale),
                s("f32", "[3, 2]"),
                w("f8e4m3", ok_scale).replace(r#""name": "w""#, r#""name": "w2""#)
            ),
            &["tensors[2].scale.tensor", "'ws' is already the scale of 'w'"],
        ),
    ];
    run_single_table(&cases);
}
