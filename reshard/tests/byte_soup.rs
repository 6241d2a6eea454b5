//! Byte soup for the layout-file parser: arbitrary bytes, random JSON built
//! from the format's own vocabulary, and mutations of the valid example
//! files all go into `parse_layout`. Whatever comes in, the parser returns
//! `Ok` or `Err` and never panics; an error is one non-empty line, an
//! accepted layout survives a round trip through `layout_to_json`, and the
//! parser's fast path and its reference walker agree (`file::cross_check`).

use proptest::prelude::*;
use reshard::{layout_to_json, parse_layout};
use serde_json::{Map, Value};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The valid example files, mutated by `prop_mutated_examples`.
const EXAMPLES: [&str; 12] = [
    include_str!("../../examples/tp-to-tp/src.json"),
    include_str!("../../examples/tp-to-tp/dst.json"),
    include_str!("../../examples/pp-to-tp/src.json"),
    include_str!("../../examples/pp-to-tp/dst.json"),
    include_str!("../../examples/ep-moe/src.json"),
    include_str!("../../examples/ep-moe/dst.json"),
    include_str!("../../examples/fsdp-to-tp/src.json"),
    include_str!("../../examples/fsdp-to-tp/dst.json"),
    include_str!("../../examples/fused-qkv/src.json"),
    include_str!("../../examples/fused-qkv/dst.json"),
    include_str!("../../examples/mixed-2d/src.json"),
    include_str!("../../examples/mixed-2d/dst.json"),
];

/// Parses `text` under `catch_unwind`; fails the property on a panic, a
/// multi-line or empty error, an accepted layout that does not round-trip,
/// or a disagreement between the two parsing paths.
fn parse_never_panics(text: &str) -> Result<(), TestCaseError> {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        reshard::cross_check(text)?;
        judge(text)
    }));
    match outcome {
        Err(_) => Err(TestCaseError::fail(format!("parse_layout panicked on {text:?}"))),
        Ok(Err(why)) => Err(TestCaseError::fail(format!("{why}\n  input: {text:?}"))),
        Ok(Ok(())) => Ok(()),
    }
}

/// Parses `text`: an accepted layout must round-trip through
/// `layout_to_json`, and an error must be one non-empty line.
fn judge(text: &str) -> Result<(), String> {
    match parse_layout(text) {
        Ok(layout) => {
            let written = layout_to_json(&layout).to_string();
            match parse_layout(&written) {
                Ok(again) if again == layout => Ok(()),
                Ok(_) => Err(format!("layout_to_json round trip changed the layout: {written}")),
                Err(e) => Err(format!("layout_to_json output rejected: {e}: {written}")),
            }
        }
        Err(e) => {
            let msg = e.to_string();
            if msg.is_empty() || msg.contains('\n') || msg.contains('\r') {
                Err(format!("error is not one non-empty line: {msg:?}"))
            } else {
                Ok(())
            }
        }
    }
}

/// Numbers that sit on the edges the parser checks.
fn edge_number() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..10).prop_map(|n| n.to_string()),
        Just("-1".to_string()),
        Just("-0".to_string()),
        Just("0.5".to_string()),
        Just("1e30".to_string()),
        Just("4294967295".to_string()),
        Just("4294967296".to_string()),
        Just("1048576".to_string()),
        Just("1048577".to_string()),
        Just("9223372036854775807".to_string()),
        Just("18446744073709551615".to_string()),
        Just("18446744073709551616".to_string()),
        Just("-9223372036854775809".to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
    ]
}

const KEYS: &[&str] = &[
    "ranks",
    "ranks_per_node",
    "tensors",
    "name",
    "dtype",
    "shape",
    "mesh",
    "placements",
    "shards",
    "rank",
    "offset",
    "extent",
    "flat",
    "buffer",
    "at",
    "x",
];

const STRINGS: &[&str] =
    &["w", "q", "", "bf16", "f32", "u8", "f8e4m3", "fp32", "replicate", "shard(0)", "shard(1)", "shard(9)", "shard(-1)", "qkv", "a\nb"];

/// A JSON value built from the format's keys, strings and edge numbers, so
/// that most inputs get past the JSON syntax into the field checks.
fn vocab_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        edge_number().prop_map(|n| serde_json::from_str(&n).unwrap_or(Value::Null)),
        proptest::sample::select(STRINGS).prop_map(Value::from),
    ];
    leaf.prop_recursive(5, 64, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec((proptest::sample::select(KEYS), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect::<Map<_, _>>())),
        ]
    })
}

/// A layout-shaped object: `ranks` and `tensors` with vocabulary tensors.
fn layout_shaped() -> impl Strategy<Value = String> {
    (edge_number(), proptest::collection::vec(vocab_value(), 0..4))
        .prop_map(|(ranks, tensors)| format!(r#"{{"ranks": {ranks}, "tensors": {}}}"#, Value::Array(tensors)))
}

/// One edit of a file's bytes.
#[derive(Debug, Clone)]
enum Mutation {
    /// Flip one bit of the byte at (position modulo length).
    Flip(usize, u8),
    /// Insert a byte.
    Insert(usize, u8),
    /// Delete up to `n` bytes.
    Delete(usize, usize),
    /// Replace the run of digits (and sign) around a position by a number.
    SpliceNumber(usize, String),
    /// Duplicate a slice of the file somewhere else.
    Duplicate(usize, usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let interesting = prop_oneof![any::<u8>(), proptest::sample::select(&b"{}[]:,\"\\-.e0123456789 \n\t"[..]), Just(0u8), Just(0xffu8),];
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(p, b)| Mutation::Flip(p, b)),
        (any::<usize>(), interesting).prop_map(|(p, b)| Mutation::Insert(p, b)),
        (any::<usize>(), 1usize..16).prop_map(|(p, n)| Mutation::Delete(p, n)),
        (any::<usize>(), edge_number()).prop_map(|(p, n)| Mutation::SpliceNumber(p, n)),
        (any::<usize>(), 1usize..64, any::<usize>()).prop_map(|(p, n, q)| Mutation::Duplicate(p, n, q)),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let len = bytes.len();
    if len == 0 {
        if let Mutation::Insert(_, b) = m {
            bytes.push(*b);
        }
        return;
    }
    match m {
        Mutation::Flip(p, bit) => bytes[p % len] ^= 1 << bit,
        Mutation::Insert(p, b) => bytes.insert(p % (len + 1), *b),
        Mutation::Delete(p, n) => {
            let start = p % len;
            bytes.drain(start..(start + n).min(len));
        }
        Mutation::SpliceNumber(p, n) => {
            // The number nearest at or after p, else anywhere.
            let is_num = |b: u8| b.is_ascii_digit() || b == b'-';
            let Some(start) = (p % len..len).chain(0..p % len).find(|&i| bytes[i].is_ascii_digit()) else { return };
            let mut a = start;
            while a > 0 && is_num(bytes[a - 1]) {
                a -= 1;
            }
            let mut b = start;
            while b < len && is_num(bytes[b]) {
                b += 1;
            }
            bytes.splice(a..b, n.bytes());
        }
        Mutation::Duplicate(p, n, q) => {
            let start = p % len;
            let piece: Vec<u8> = bytes[start..(start + n).min(len)].to_vec();
            let at = q % (len + 1);
            bytes.splice(at..at, piece);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn prop_arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        parse_never_panics(&String::from_utf8_lossy(&bytes))?;
    }

    #[test]
    fn prop_vocabulary_json_never_panics(text in layout_shaped()) {
        parse_never_panics(&text)?;
    }

    #[test]
    fn prop_vocabulary_soup_never_panics(value in vocab_value()) {
        parse_never_panics(&value.to_string())?;
    }

    #[test]
    fn prop_mutated_examples_never_panic(
        which in 0..EXAMPLES.len(),
        mutations in proptest::collection::vec(mutation(), 1..8),
    ) {
        let mut bytes = EXAMPLES[which].as_bytes().to_vec();
        for m in &mutations {
            apply(&mut bytes, m);
        }
        parse_never_panics(&String::from_utf8_lossy(&bytes))?;
    }

    #[test]
    fn prop_truncated_examples_never_panic(which in 0..EXAMPLES.len(), cut in any::<usize>()) {
        let text = EXAMPLES[which];
        let cut = cut % (text.len() + 1);
        parse_never_panics(&String::from_utf8_lossy(&text.as_bytes()[..cut]))?;
    }
}

/// The examples themselves are accepted and round-trip (so the mutations
/// start from valid files).
#[test]
fn examples_parse_and_round_trip() {
    for (i, text) in EXAMPLES.iter().enumerate() {
        parse_layout(text).unwrap_or_else(|e| panic!("example {i}: {e}"));
        parse_never_panics(text).unwrap_or_else(|e| panic!("example {i}: {e}"));
    }
}
