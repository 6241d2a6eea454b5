//! The soak in reduced form: consecutive refits on worker processes, each
//! verified element by element before it commits, with no growth of file
//! descriptors or threads and bounded resident memory (the 1000-refit run
//! is `refit soak`, see docs/reliability.md).

use serde_json::Value;
use std::process::Command;

#[test]
fn slow_consecutive_refits_leak_nothing() {
    let out = Command::new(env!("CARGO_BIN_EXE_refit")).args(["soak", "--refits", "30", "--json"]).output().expect("spawn refit");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(&stdout).expect("one JSON object");
    assert_eq!(v["refits"], 30, "{v}");
    assert!(v["verified_elements"].as_u64().is_some_and(|n| n > 0), "{v}");
    let (first, last) = (&v["first"], &v["last"]);
    let get = |x: &Value, k: &str| x[k].as_u64().unwrap_or_else(|| panic!("{k} missing: {v}"));
    // A few descriptors or threads may still be winding down when counted.
    assert!(get(last, "fds") <= get(first, "fds") + 4, "descriptors grew: {v}");
    assert!(get(last, "threads") <= get(first, "threads") + 4, "threads grew: {v}");
    assert!(get(last, "rss_bytes") <= get(first, "rss_bytes") * 3 / 2 + (16 << 20), "resident memory grew: {v}");
}
