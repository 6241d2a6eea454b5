//! Single file: syntax, top level, types.

use crate::run_single_table;

#[test]
fn rejects_bad_json_and_top_level() {
    let s = |x: &str| x.to_string();
    let cases: Vec<(&str, String, &[&str])> = vec![
        ("bad JSON", s(r#"{"ranks": 4, "tensors": [}"#), &["(file)", "invalid JSON"]),
        ("empty file", s(""), &["(file)", "invalid JSON"]),
        ("only whitespace", s("  \n "), &["(file)", "invalid JSON"]),
        ("truncated", s(r#"{"ranks": 4, "tensors": [{"name": "w", "dty"#), &["(file)", "invalid JSON"]),
        ("trailing garbage", s(r#"{"ranks": 4, "tensors": []} x"#), &["(file)", "invalid JSON"]),
        ("trailing comma", s(r#"{"ranks": 4, "tensors": [],}"#), &["(file)", "invalid JSON"]),
        ("nested too deep", "[".repeat(5000) + &"]".repeat(5000), &["(file)", "invalid JSON"]),
        ("top level array", s("[]"), &["(top level)", "expected an object, got an array"]),
        ("top level null", s("null"), &["(top level)", "expected an object, got null"]),
        (
            "unknown top-level field",
            s(r#"{"ranks": 4, "rank_per_node": 2, "tensors": []}"#),
            &["(top level)", "unknown field 'rank_per_node'"],
        ),
        ("missing ranks", s(r#"{"tensors": []}"#), &["ranks", "missing field"]),
        ("missing tensors", s(r#"{"ranks": 4}"#), &["tensors", "missing field"]),
        ("tensors not an array", s(r#"{"ranks": 4, "tensors": {}}"#), &["tensors", "expected an array, got an object"]),
        ("tensors null", s(r#"{"ranks": 4, "tensors": null}"#), &["tensors", "expected an array, got null"]),
        ("ranks a string", s(r#"{"ranks": "4", "tensors": []}"#), &["ranks", "expected a non-negative integer, got a string"]),
        ("ranks negative", s(r#"{"ranks": -1, "tensors": []}"#), &["ranks", "expected a non-negative integer, got -1"]),
        ("ranks fractional", s(r#"{"ranks": 4.5, "tensors": []}"#), &["ranks", "expected a non-negative integer, got 4.5"]),
        ("ranks 1e30", s(r#"{"ranks": 1e30, "tensors": []}"#), &["ranks", "expected a non-negative integer"]),
        ("ranks 2^64", s(r#"{"ranks": 18446744073709551616, "tensors": []}"#), &["ranks", "expected a non-negative integer"]),
        ("ranks 2^32", s(r#"{"ranks": 4294967296, "tensors": []}"#), &["ranks", "4294967296 is too large"]),
        ("ranks 0", s(r#"{"ranks": 0, "tensors": []}"#), &["ranks", "must be at least 1"]),
        ("ranks_per_node 0", s(r#"{"ranks": 4, "ranks_per_node": 0, "tensors": []}"#), &["ranks_per_node", "must be at least 1"]),
        (
            "ranks_per_node negative",
            s(r#"{"ranks": 4, "ranks_per_node": -2, "tensors": []}"#),
            &["ranks_per_node", "expected a non-negative integer, got -2"],
        ),
        (
            "ranks_per_node a boolean",
            s(r#"{"ranks": 4, "ranks_per_node": true, "tensors": []}"#),
            &["ranks_per_node", "expected a non-negative integer, got a boolean"],
        ),
    ];
    run_single_table(&cases);
}
