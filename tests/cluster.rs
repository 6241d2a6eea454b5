//! The multi-process path end to end: `refit launch` starts real worker
//! processes (per rank or per node), runs several refits of changing
//! weights versions, and every destination rank checks every element before
//! each commit; `refit bench --transport process` runs reshard and baseline
//! side by side in the same workers.

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_refit");

fn refit(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("spawn refit")
}

fn example(name: &str) -> (String, String) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples").join(name);
    let p = |f: &str| dir.join(f).to_str().expect("utf-8 path").to_string();
    (p("src.json"), p("dst.json"))
}

/// Runs `refit launch` and checks it verified every refit and the
/// committed weights of the last version.
fn check_launch(name: &str, extra: &[&str]) {
    let (src, dst) = example(name);
    let mut args = vec!["launch", "--verify", "--refits", "2", "--deadline-s", "60", "--src", &src, "--dst", &dst];
    args.extend_from_slice(extra);
    let out = refit(&args);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "refit {}\n{stdout}\n{stderr}", args.join(" "));
    assert!(stdout.contains("2 refit(s)") && stdout.contains("committed weights of version 2 match"), "{name} {extra:?}: {stdout}");
}

/// Every example pair (fused buffers, pipeline stages, experts, FSDP flat
/// shards, dtype conversion, relays) is bit-exact over the multi-process
/// data plane with both strategies, with a process per node (ranks of a
/// node share memory) and with a process per rank.
#[test]
fn every_example_is_bit_exact_across_processes() {
    for name in ["tp-to-tp", "pp-to-tp", "ep-moe", "fsdp-to-tp", "fused-qkv", "mixed-2d"] {
        check_launch(name, &["--per-process", "node"]);
        check_launch(name, &["--per-process", "node", "--baseline"]);
    }
    for name in ["fused-qkv", "mixed-2d"] {
        check_launch(name, &["--per-process", "rank"]);
        check_launch(name, &["--per-process", "rank", "--baseline"]);
    }
}

/// `refit bench --transport process --json` reports both strategies, the
/// bytes per link and writes both traffic heat maps.
#[test]
fn process_bench_reports_both_strategies_and_links() {
    let (src, dst) = example("mixed-2d");
    let svg = std::env::temp_dir().join(format!("refit-cluster-bench-{}.svg", std::process::id()));
    let svg_s = svg.to_str().expect("utf-8 path");
    let out = refit(&["bench", "--transport", "process", "--reps", "1", "--json", "--svg", svg_s, "--src", &src, "--dst", &dst]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    for k in ["reshard", "baseline"] {
        assert!(v[k]["median_s"].as_f64().is_some_and(|t| t > 0.0), "{v}");
        assert!(v[k]["bytes"].as_u64().is_some_and(|b| b > 0), "{v}");
        assert!(v["links"][k]["inter_node_bytes"].as_u64().is_some(), "{v}");
    }
    assert!(v["baseline_over_reshard"].as_f64().is_some_and(|r| r > 0.0), "{v}");
    for p in [svg.clone(), svg.with_extension("baseline.svg")] {
        let text = std::fs::read_to_string(&p).expect("svg written");
        assert!(text.starts_with("<svg") && text.contains("<rect"), "{}", p.display());
        let _ = std::fs::remove_file(&p);
    }
}
