//! Single file: tensor fields.

use crate::{one, run_single_table};

#[test]
fn rejects_bad_tensor_fields() {
    let w = |rest: &str| one(&format!(r#"{{"name": "w", {rest}}}"#));
    let m = r#""mesh": {"shape": [4]}, "placements": ["shard(0)"]"#;
    let cases: Vec<(&str, String, &[&str])> = vec![
        ("tensor not an object", one("3"), &["tensors[0]", "expected an object, got a number"]),
        (
            "unknown tensor field",
            w(&format!(r#""dtpye": "f32", "dtype": "f32", "shape": [8], {m}"#)),
            &["tensors[0]", "unknown field 'dtpye'"],
        ),
        ("missing name", one(&format!(r#"{{"dtype": "f32", "shape": [8], {m}}}"#)), &["tensors[0].name", "missing field"]),
        (
            "name not a string",
            one(&format!(r#"{{"name": 7, "dtype": "f32", "shape": [8], {m}}}"#)),
            &["tensors[0].name", "expected a string, got a number"],
        ),
        ("empty name", one(&format!(r#"{{"name": "", "dtype": "f32", "shape": [8], {m}}}"#)), &["tensors[0].name", "must not be empty"]),
        ("missing dtype", w(&format!(r#""shape": [8], {m}"#)), &["tensors[0] ('w').dtype", "missing field"]),
        (
            "unknown dtype",
            w(&format!(r#""dtype": "fp32", "shape": [8], {m}"#)),
            &["tensors[0] ('w').dtype", "unknown dtype 'fp32'", "f64 f32 bf16 f16 f8e4m3 f8e5m2 i64 i32 i8 u8"],
        ),
        ("dtype in capitals", w(&format!(r#""dtype": "BF16", "shape": [8], {m}"#)), &["tensors[0] ('w').dtype", "unknown dtype 'BF16'"]),
        (
            "dtype not a string",
            w(&format!(r#""dtype": 2, "shape": [8], {m}"#)),
            &["tensors[0] ('w').dtype", "expected a string, got a number"],
        ),
        ("missing shape", w(&format!(r#""dtype": "f32", {m}"#)), &["tensors[0] ('w').shape", "missing field"]),
        (
            "shape not an array",
            w(&format!(r#""dtype": "f32", "shape": 8, {m}"#)),
            &["tensors[0] ('w').shape", "expected an array of integers, got a number"],
        ),
        (
            "negative shape",
            w(&format!(r#""dtype": "f32", "shape": [8, -4], {m}"#)),
            &["tensors[0] ('w').shape[1]", "expected a non-negative integer, got -4"],
        ),
        (
            "fractional shape",
            w(&format!(r#""dtype": "f32", "shape": [8.5], {m}"#)),
            &["tensors[0] ('w').shape[0]", "expected a non-negative integer, got 8.5"],
        ),
        (
            "shape a string",
            w(&format!(r#""dtype": "f32", "shape": ["8"], {m}"#)),
            &["tensors[0] ('w').shape[0]", "expected a non-negative integer, got a string"],
        ),
        (
            "shape 2^64",
            w(&format!(r#""dtype": "f32", "shape": [18446744073709551616], {m}"#)),
            &["tensors[0] ('w').shape[0]", "expected a non-negative integer"],
        ),
        (
            "more than 8 dims",
            w(&format!(r#""dtype": "f32", "shape": [1, 1, 1, 1, 1, 1, 1, 1, 8], {m}"#)),
            &["tensor 'w'", "9 dims; at most 8 are supported"],
        ),
        (
            "element count overflows",
            w(&format!(r#""dtype": "f32", "shape": [4294967296, 4294967296], {m}"#)),
            &["tensor 'w'", "[4294967296, 4294967296]", "element count overflows 64 bits"],
        ),
        (
            "byte count overflows",
            w(&format!(r#""dtype": "f64", "shape": [2305843009213693952, 2], {m}"#)),
            &["tensor 'w'", "overflows 64 bits"],
        ),
        (
            "duplicate tensor names",
            format!(
                r#"{{"ranks": 4, "tensors": [{{"name": "w", "dtype": "f32", "shape": [8], {m}}},
                                            {{"name": "w", "dtype": "f32", "shape": [8], {m}}}]}}"#
            ),
            &["tensors[1].name", "duplicate tensor name 'w'"],
        ),
        (
            "both shards and mesh",
            w(&format!(r#""dtype": "f32", "shape": [8], {m}, "shards": []"#)),
            &["tensors[0] ('w')", "has both 'shards' and 'mesh'/'placements'"],
        ),
        (
            "both shards and placements",
            w(r#""dtype": "f32", "shape": [8], "placements": ["shard(0)"], "shards": []"#),
            &["tensors[0] ('w')", "has both 'shards' and 'mesh'/'placements'"],
        ),
        (
            "neither shards nor mesh",
            w(r#""dtype": "f32", "shape": [8]"#),
            &["tensors[0] ('w')", "has neither 'shards' nor 'mesh'+'placements'"],
        ),
        (
            "placements without mesh",
            w(r#""dtype": "f32", "shape": [8], "placements": ["shard(0)"]"#),
            &["tensors[0] ('w').mesh", "missing field (required with 'placements')"],
        ),
        (
            "mesh without placements",
            w(r#""dtype": "f32", "shape": [8], "mesh": {"shape": [4]}"#),
            &["tensors[0] ('w').placements", "missing field (required with 'mesh')"],
        ),
    ];
    run_single_table(&cases);
}
