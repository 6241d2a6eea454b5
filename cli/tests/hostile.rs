//! Hostile layout files: a corpus of bad files on disk (`tests/hostile/layouts/`),
//! each read the way the CLI reads a layout (`read_to_string`, then
//! `parse_layout`, errors prefixed with the path) and then run through the
//! real binary. Every file must be rejected with a one-line error naming the
//! file and what is wrong, quickly, and without a panic.
//!
//! The cases here are files (binary garbage, byte-order marks, deep nesting,
//! huge literals, duplicate keys, ...); the rule-by-rule table of rejections
//! lives in `tests/rejections/` and is not repeated.

use reshard::{parse_layout, Layout};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_refit");

/// Longest a single file may take to be rejected (debug build included).
const TIME_LIMIT: Duration = Duration::from_secs(5);

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/hostile/layouts")
}

/// A valid layout to pair with a bad one.
fn good_layout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tp-to-tp/src.json")
}

/// Reads and parses a layout file exactly as `refit` does (`load` in
/// `src/main.rs`): unreadable or non-UTF-8 files fail with `cannot read`,
/// every error is prefixed with the path.
fn load(path: &Path) -> Result<Layout, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    parse_layout(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Every corpus file and the fragments its error must contain (besides the
/// file name, which every error must contain).
const CASES: &[(&str, &[&str])] = &[
    // Not a JSON text at all.
    ("empty.json", &["(file): invalid JSON", "EOF"]),
    ("truncated.json", &["(file): invalid JSON", "EOF"]),
    ("truncated-in-string.json", &["(file): invalid JSON", "EOF while parsing a string"]),
    ("truncated-in-number.json", &["(file): invalid JSON", "EOF"]),
    ("binary-garbage.json", &["cannot read", "valid UTF-8"]),
    ("utf16-bom.json", &["cannot read", "valid UTF-8"]),
    ("utf16be-bom.json", &["cannot read", "valid UTF-8"]),
    ("utf8-bom.json", &["(file): invalid JSON", "starts with a byte-order mark (U+FEFF)"]),
    ("nul-bytes.json", &["(file): invalid JSON", "line 1 column 13"]),
    ("deep-nesting.json", &["(file): invalid JSON", "recursion limit exceeded"]),
    ("deep-nesting-objects.json", &["(file): invalid JSON", "recursion limit exceeded"]),
    ("deep-nesting-unclosed.json", &["(file): invalid JSON", "recursion limit exceeded"]),
    ("nan-shape.json", &["(file): invalid JSON", "expected value"]),
    ("infinity-shape.json", &["(file): invalid JSON", "number out of range"]),
    ("huge-number-literal.json", &["(file): invalid JSON", "number out of range"]),
    ("lone-surrogate.json", &["(file): invalid JSON", "unexpected end of hex escape"]),
    ("invalid-escape.json", &["(file): invalid JSON", "invalid escape"]),
    ("two-documents.json", &["(file): invalid JSON", "trailing characters"]),
    ("comments.json", &["(file): invalid JSON", "expected value at line 1 column 1"]),
    ("single-quotes.json", &["(file): invalid JSON", "key must be a string"]),
    ("duplicate-key.json", &["(file): invalid JSON", "duplicate key 'ranks'"]),
    ("duplicate-key-nested.json", &["(file): invalid JSON", "duplicate key 'flat'"]),
    // JSON, but the wrong shape.
    ("empty-object.json", &["ranks: missing field"]),
    ("top-level-string.json", &["(top level): expected an object, got a string"]),
    ("tensors-of-nulls.json", &["tensors[0]: expected an object, got null"]),
    ("unknown-field.json", &["tensors[1] ('b').shards[2]", "unknown field 'dtype_'"]),
    ("unknown-dtype.json", &["tensors[0] ('w').dtype", "unknown dtype 'bfloat16'"]),
    ("dtype-trailing-space.json", &["tensors[0] ('w').dtype", "unknown dtype 'bf16 '"]),
    ("unicode-name-bad-dtype.json", &["tensors[0] ('\u{202e}weight\u{1F600}\u{e9}').dtype", "unknown dtype 'f\u{e9}32'"]),
    ("control-char-name.json", &["tensors[0].name", r"'w\u{0}x' contains control characters"]),
    ("buffer-name-control-char.json", &["tensor 'q'", r"buffer name 'q\tk' contains control characters"]),
    // Numbers out of range for their field.
    ("negative-rank.json", &["tensors[0] ('w').shards[1].rank", "expected a non-negative integer, got -9.223372036854776e+18"]),
    ("negative-zero-rank.json", &["tensors[0] ('w').shards[0].rank", "expected a non-negative integer, got -0.0"]),
    ("shard-rank-too-large.json", &["tensors[0] ('w').shards[0].rank", "4294967296 is too large"]),
    ("ranks-zero.json", &["ranks: must be at least 1"]),
    ("ranks-huge.json", &["ranks: 4294967295 ranks; at most 1048576 are supported"]),
    ("ranks-just-over-max.json", &["ranks: 1048577 ranks; at most 1048576 are supported"]),
    ("ranks-float-exponent.json", &["ranks: expected a non-negative integer, got 4.0"]),
    ("ranks-per-node-too-large.json", &["ranks_per_node: 4294967296 is too large"]),
    ("huge-shape-overflow.json", &["tensor 'w'", "element count overflows 64 bits"]),
    ("too-many-dims.json", &["tensor 'w'", "100 dims; at most 8 are supported"]),
    ("offset-beyond-buffer.json", &["tensor 'w'", "shards[0]: at 4611686018427387904 + size overflows"]),
    ("placement-shard-dim-huge.json", &["tensors[0] ('w').placements[0]", "unknown placement 'shard(18446744073709551616)'"]),
    // Placement rules.
    ("mesh-rank-out-of-range.json", &["tensor 'w'", "mesh.ranks: rank 7 >= ranks (4)"]),
    ("shard-dim-out-of-range.json", &["tensor 'w'", "placements[1]: shard(5) but the tensor has 2 dims"]),
    ("mesh-huge-explicit-ranks.json", &["tensor 'w'", "mesh.ranks has 2 entries but mesh.shape [65536, 65536] has 4294967296 positions"]),
    (
        "mesh-size-overflows-u64.json",
        &["tensors[0] ('w').mesh.shape", "has more than 18446744073709551615 positions but the layout has 4 ranks"],
    ),
    (
        "mesh-size-overflows-u64-explicit-ranks.json",
        &[
            "tensor 'w'",
            "mesh.ranks has 4 entries but mesh.shape [4294967295, 4294967295, 4294967295] has more than 18446744073709551615 positions",
        ],
    ),
    ("scalar-box-with-dims.json", &["tensor 's'", "shards[0] (rank 0): offset has 1 and extent 1 dims, tensor has 0"]),
    ("uneven-split-overlap.json", &["rank 0: buffer 'flat_param'", "elements 0..6 of tensor 'w' overlap elements 5..9 of tensor 'w'"]),
    ("buffer-overlap.json", &["rank 1: buffer 'gate_up'", "elements 100..124 of tensor 'gate' overlap elements 123..135 of tensor 'up'"]),
];

/// Loads one corpus file under `catch_unwind` and a time limit; returns what
/// is wrong with the outcome, if anything.
fn check(file: &str, expect: &[&str]) -> Option<String> {
    let path = corpus_dir().join(file);
    if !path.is_file() {
        return Some(format!("{} is not in the corpus", path.display()));
    }
    let start = Instant::now();
    let outcome = catch_unwind(AssertUnwindSafe(|| load(&path)));
    let took = start.elapsed();
    let msg = match outcome {
        Err(_) => return Some("panicked".to_string()),
        Ok(Ok(_)) => return Some("accepted".to_string()),
        Ok(Err(msg)) => msg,
    };
    if took > TIME_LIMIT {
        return Some(format!("took {took:?} (limit {TIME_LIMIT:?}): {msg}"));
    }
    if msg.contains('\n') {
        return Some(format!("message spans several lines: {msg:?}"));
    }
    // The file name leads; the fragments must be in what follows it.
    let Some(rest) = msg.strip_prefix(&format!("{}: ", path.display())) else {
        return Some(format!("message {msg:?} does not start with the file path"));
    };
    let missing: Vec<&str> = expect.iter().copied().filter(|f| !rest.contains(f)).collect();
    if !missing.is_empty() {
        return Some(format!("message {msg:?} lacks {missing:?}"));
    }
    None
}

#[test]
fn hostile_layout_corpus_is_rejected_clearly() {
    let failures: Vec<String> = CASES.iter().filter_map(|(file, expect)| check(file, expect).map(|f| format!("{file}: {f}"))).collect();
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), CASES.len(), failures.join("\n"));
}

/// The table and the directory agree: no untested file, no missing file.
#[test]
fn hostile_layout_corpus_matches_the_table() {
    let mut on_disk: Vec<String> = std::fs::read_dir(corpus_dir())
        .expect("read corpus dir")
        .map(|e| e.expect("dir entry").file_name().into_string().expect("utf-8 file name"))
        .collect();
    on_disk.sort();
    let mut in_table: Vec<String> = CASES.iter().map(|(f, _)| f.to_string()).collect();
    in_table.sort();
    in_table.dedup();
    assert_eq!(on_disk, in_table, "corpus files and CASES differ");
    assert!(on_disk.len() >= 30, "only {} corpus files", on_disk.len());
}

/// Runs `refit` under a 4 GiB address-space limit (unix), so that a runaway
/// allocation fails fast instead of exhausting the machine.
fn refit_limited(args: &[&str]) -> Output {
    if cfg!(unix) {
        Command::new("sh").arg("-c").arg("ulimit -v 4194304; exec \"$@\"").arg("sh").arg(BIN).args(args).output().expect("spawn sh")
    } else {
        Command::new(BIN).args(args).output().expect("spawn refit")
    }
}

/// Exit code 2, nothing on stdout, one `error:` line on stderr holding every
/// fragment of `names`.
fn cli_failure(args: &[&str], out: &Output, names: &[&str]) -> Option<String> {
    let err = String::from_utf8_lossy(&out.stderr);
    let problem = if out.status.code() != Some(2) {
        format!("exit code {:?}, want 2", out.status.code())
    } else if !out.stdout.is_empty() {
        "wrote to stdout".to_string()
    } else if !err.starts_with("error:") || err.matches('\n').count() != 1 || !err.ends_with('\n') {
        "stderr is not exactly one 'error:' line".to_string()
    } else if let Some(n) = names.iter().find(|n| !err.contains(**n)) {
        format!("stderr does not name {n:?}")
    } else {
        return None;
    };
    Some(format!("{problem}\n  refit {}\n  exit: {:?}\n  stderr: {err}", args.join(" "), out.status.code()))
}

/// Every corpus file through the real binary, as the source (`plan`) and
/// for a few as the destination (`plan`, `run`).
#[test]
fn hostile_layouts_through_the_cli() {
    let good = good_layout();
    let good = good.to_str().expect("utf-8 path");
    let mut failures = Vec::new();
    let mut runs = 0;
    for (i, (file, expect)) in CASES.iter().enumerate() {
        let path = corpus_dir().join(file);
        let bad = path.to_str().expect("utf-8 path");
        let mut names = vec![*file];
        names.extend_from_slice(expect);
        let mut invocations: Vec<Vec<&str>> = vec![vec!["plan", "--src", bad, "--dst", good]];
        if i % 8 == 0 {
            invocations.push(vec!["plan", "--src", good, "--dst", bad]);
            invocations.push(vec!["run", "--verify", "--src", good, "--dst", bad]);
        }
        for args in invocations {
            let start = Instant::now();
            let out = refit_limited(&args);
            runs += 1;
            if let Some(f) = cli_failure(&args, &out, &names) {
                failures.push(format!("[{file}] {f}"));
            } else if start.elapsed() > TIME_LIMIT {
                failures.push(format!("[{file}] took {:?}", start.elapsed()));
            }
        }
    }
    assert!(failures.is_empty(), "{} of {runs} invocations failed:\n{}", failures.len(), failures.join("\n\n"));
}

/// A mesh without `mesh.ranks` is expanded to `0..product` when parsed, so
/// a ~100-byte tensor on a `[1048576]` mesh costs 4 MiB: a 230 KB file of
/// 2000 such tensors would take 8 GiB. The parser caps the implied
/// positions of a file (the planner's `MAX_IMPLIED_POSITIONS`), so `refit`
/// rejects it with exit code 2 (naming the field), within 2 GiB.
#[cfg(unix)]
#[test]
fn default_mesh_ranks_do_not_amplify_memory() {
    let tensor = |i: usize| {
        format!(r#"{{"name": "w{i}", "dtype": "u8", "shape": [1048576], "mesh": {{"shape": [1048576]}}, "placements": ["shard(0)"]}}"#)
    };
    let text = format!(r#"{{"ranks": 1048576, "tensors": [{}]}}"#, (0..2000).map(tensor).collect::<Vec<_>>().join(", "));
    let path = std::env::temp_dir().join(format!("refit-hostile-amplify-{}.json", std::process::id()));
    std::fs::write(&path, text).expect("write temp file");
    let p = path.to_str().expect("utf-8 path");
    let out = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 2097152; exec \"$@\"")
        .arg("sh")
        .arg(BIN)
        .args(["plan", "--src", p, "--dst", p])
        .output()
        .expect("spawn sh");
    let _ = std::fs::remove_file(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("mesh.shape") && stderr.contains("mesh.ranks"), "{stderr}");
}
