//! The `refit` binary: valid pairs plan and run, every example verifies with
//! both strategies, and every bad input ends with exit code 2 and exactly one
//! `error:` line on stderr naming the file (never a panic, exit code 101).
//!

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

const BIN: &str = env!("CARGO_BIN_EXE_refit");

/// A scratch directory under the system temp dir, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("refit-cli-{}-{n}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        Scratch(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    fn write(&self, name: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).expect("write scratch file");
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn refit(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("spawn refit")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn describe(args: &[&str], out: &Output) -> String {
    format!(
        "refit {}\n  exit: {:?}\n  stdout: {}\n  stderr: {}",
        args.join(" "),
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Exit code 2, nothing on stdout, and stderr exactly one line that starts
/// with `error:` and contains every fragment of `names`.
fn rejection_failure(args: &[&str], out: &Output, names: &[&str]) -> Option<String> {
    let err = String::from_utf8_lossy(&out.stderr);
    let problem = if out.status.code() != Some(2) {
        format!("exit code {:?}, want 2", out.status.code())
    } else if !out.stdout.is_empty() {
        "wrote to stdout".to_string()
    } else if !err.starts_with("error:") {
        "stderr does not start with 'error:'".to_string()
    } else if !err.ends_with('\n') || err.trim_end_matches('\n').contains('\n') || err.matches('\n').count() != 1 {
        "stderr is not exactly one line".to_string()
    } else if let Some(n) = names.iter().find(|n| !err.contains(**n)) {
        format!("stderr does not name {n:?}")
    } else {
        return None;
    };
    Some(format!("{problem}\n{}", describe(args, out)))
}

fn assert_ok(args: &[&str]) -> Output {
    let out = refit(args);
    assert_eq!(out.status.code(), Some(0), "{}", describe(args, &out));
    out
}

/// Every `examples/*/` directory with a `src.json` and a `dst.json`.
fn example_pairs() -> Vec<(PathBuf, PathBuf)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut pairs: Vec<(PathBuf, PathBuf)> = std::fs::read_dir(&root)
        .expect("read examples/")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.join("src.json").is_file() && p.join("dst.json").is_file())
        .map(|p| (p.join("src.json"), p.join("dst.json")))
        .collect();
    pairs.sort();
    assert!(!pairs.is_empty(), "no example pairs under {}", root.display());
    pairs
}

const GOOD_SRC: &str = r#"{"ranks": 2, "ranks_per_node": 1, "tensors": [
    {"name": "w", "dtype": "f32", "shape": [4, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#;
const GOOD_DST: &str = r#"{"ranks": 2, "tensors": [
    {"name": "w", "dtype": "bf16", "shape": [4, 4], "mesh": {"shape": [2]}, "placements": ["shard(1)"]}]}"#;

// ---------------------------------------------------------------------------
// Valid input.

#[test]
fn plan_accepts_a_valid_pair() {
    let dir = Scratch::new("plan");
    let (src, dst) = (dir.write("src.json", GOOD_SRC), dir.write("dst.json", GOOD_DST));
    let out = assert_ok(&["plan", "--src", s(&src), "--dst", s(&dst)]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("reshard") && text.contains("baseline"), "{text}");
}

const FIGURE_KEYS: [&str; 13] = [
    "bytes_moved",
    "src_egress_bytes",
    "src_rank_egress_bytes",
    "max_src_rank_egress_bytes",
    "relayed_bytes",
    "total_bytes",
    "dst_node_ingress_bytes",
    "cross_node_bytes",
    "max_rank_send_bytes",
    "max_rank_recv_bytes",
    "messages",
    "max_rank_send_messages",
    "max_rank_recv_messages",
];

/// Parses `refit plan --json` output: one JSON object with `reshard` and
/// `baseline`, each holding every figure with the right type.
fn plan_json(src: &Path, dst: &Path) -> Value {
    let args = ["plan", "--json", "--src", s(src), "--dst", s(dst)];
    let out = assert_ok(&args);
    let text = String::from_utf8(out.stdout).expect("utf-8 stdout");
    assert_eq!(text.trim_end().lines().count(), 1, "one line of JSON expected:\n{text}");
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}"));
    let obj = v.as_object().unwrap_or_else(|| panic!("not an object: {v}"));
    for strategy in ["reshard", "baseline"] {
        let f = obj.get(strategy).and_then(Value::as_object).unwrap_or_else(|| panic!("no '{strategy}' object in {v}"));
        for key in FIGURE_KEYS {
            let x = f.get(key).unwrap_or_else(|| panic!("{strategy} lacks '{key}': {v}"));
            if key == "dst_node_ingress_bytes" || key == "src_rank_egress_bytes" {
                let a = x.as_array().unwrap_or_else(|| panic!("{strategy}.{key} is not an array: {v}"));
                assert!(a.iter().all(|n| n.as_u64().is_some()), "{strategy}.{key}: {v}");
            } else {
                assert!(x.as_u64().is_some(), "{strategy}.{key} is not a non-negative integer: {v}");
            }
        }
    }
    v
}

#[test]
fn plan_json_has_every_figure() {
    let dir = Scratch::new("json");
    let (src, dst) = (dir.write("src.json", GOOD_SRC), dir.write("dst.json", GOOD_DST));
    let v = plan_json(&src, &dst);
    // 16 elements, narrowed to bf16 on the sender; every dst rank needs half
    // of every src rank's rows.
    assert_eq!(v["reshard"]["src_egress_bytes"], 32, "{v}");
    assert_eq!(v["reshard"]["dst_node_ingress_bytes"], serde_json::json!([32]), "{v}");
    assert_eq!(v["reshard"]["messages"], 4, "{v}");
    // Two senders, two receivers: each sends two messages and takes two.
    assert_eq!(
        (v["reshard"]["max_rank_send_messages"].as_u64(), v["reshard"]["max_rank_recv_messages"].as_u64()),
        (Some(2), Some(2)),
        "{v}"
    );
    assert_eq!(v["baseline"]["dst_node_ingress_bytes"].as_array().map(Vec::len), Some(1), "{v}");
}

#[test]
fn plan_json_on_every_example() {
    for (src, dst) in example_pairs() {
        let v = plan_json(&src, &dst);
        let dst_layout: Value = serde_json::from_str(&std::fs::read_to_string(&dst).unwrap()).unwrap();
        let ranks = dst_layout["ranks"].as_u64().unwrap();
        let rpn = dst_layout.get("ranks_per_node").and_then(Value::as_u64).unwrap_or(ranks);
        let nodes = ranks.div_ceil(rpn) as usize;
        for strategy in ["reshard", "baseline"] {
            let got = v[strategy]["dst_node_ingress_bytes"].as_array().unwrap().len();
            assert_eq!(got, nodes, "{}: {strategy}: one ingress figure per destination node", dst.display());
        }
    }
}

fn run_examples(extra: &[&str]) {
    for (src, dst) in example_pairs() {
        let mut args = vec!["run"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--verify", "--src", s(&src), "--dst", s(&dst)]);
        let out = assert_ok(&args);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("match"), "{}", describe(&args, &out));
    }
}

#[test]
fn run_verifies_every_example() {
    run_examples(&[]);
}

#[test]
fn run_baseline_verifies_every_example() {
    run_examples(&["--baseline"]);
}

#[test]
fn run_with_explicit_local_transport() {
    let dir = Scratch::new("local");
    let (src, dst) = (dir.write("src.json", GOOD_SRC), dir.write("dst.json", GOOD_DST));
    let out = assert_ok(&["run", "--transport", "local", "--verify", "--src", s(&src), "--dst", s(&dst)]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("match"));
}

// ---------------------------------------------------------------------------
// One meaning of "bytes moved", units, names, and output without progress.

/// The figure on the first line of `text` that starts with `bytes moved`
/// (after any indent): the cell in `column` (0 = the first after the label).
fn bytes_moved_cell(text: &str, column: usize) -> Option<String> {
    let line = text.lines().find(|l| l.trim_start().starts_with("bytes moved "))?;
    let cells: Vec<&str> = line.trim_start()["bytes moved".len()..].split_whitespace().collect();
    // A cell is a number and its unit: `13.50 KiB`, `0 B`.
    cells.chunks(2).nth(column).map(|c| c.join(" "))
}

/// `refit run --json` with `extra`, parsed; nothing on stderr.
fn run_json(src: &Path, dst: &Path, extra: &[&str]) -> Value {
    let mut args = vec!["run", "--json", "--src", s(src), "--dst", s(dst)];
    args.extend_from_slice(extra);
    let out = assert_ok(&args);
    assert!(out.stderr.is_empty(), "{}", describe(&args, &out));
    let text = String::from_utf8(out.stdout).expect("utf-8 stdout");
    assert_eq!(text.trim_end().lines().count(), 1, "one line of JSON expected:\n{text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}"))
}

/// For one example pair and strategy: what `refit plan` and `refit run`
/// say about the bytes moved, in JSON and in text, and whether they agree.
fn check_bytes_moved(src: &Path, dst: &Path, strategy: &str) -> Option<String> {
    let baseline = strategy == "baseline";
    let plan = plan_json(src, dst);
    let run = run_json(src, dst, if baseline { &["--baseline"][..] } else { &[] });
    let planned = &plan[strategy];
    let plan_text = String::from_utf8_lossy(&assert_ok(&["plan", "--src", s(src), "--dst", s(dst)]).stdout).into_owned();
    let mut run_args = vec!["run", "--src", s(src), "--dst", s(dst)];
    if baseline {
        run_args.push("--baseline");
    }
    let run_text = String::from_utf8_lossy(&assert_ok(&run_args).stdout).into_owned();
    let sum = |v: &Value| v["src_egress_bytes"].as_u64().zip(v["relayed_bytes"].as_u64()).map(|(a, b)| a + b);
    let problem = if planned["bytes_moved"] != run["bytes_moved"] {
        format!("plan --json says {}, run --json {}", planned["bytes_moved"], run["bytes_moved"])
    } else if planned["total_bytes"] != planned["bytes_moved"] {
        format!("plan --json: total_bytes {} is not bytes_moved {}", planned["total_bytes"], planned["bytes_moved"])
    } else if sum(planned) != planned["bytes_moved"].as_u64() || sum(&run) != run["bytes_moved"].as_u64() {
        format!("bytes_moved is not src_egress_bytes + relayed_bytes: plan {planned}, run {run}")
    } else if (&planned["src_egress_bytes"], &planned["relayed_bytes"]) != (&run["src_egress_bytes"], &run["relayed_bytes"]) {
        format!("plan and run split the bytes differently: plan {planned}, run {run}")
    } else if bytes_moved_cell(&plan_text, usize::from(baseline)).is_none()
        || bytes_moved_cell(&plan_text, usize::from(baseline)) != bytes_moved_cell(&run_text, 0)
    {
        format!("the 'bytes moved' lines differ:\nplan:\n{plan_text}\nrun:\n{run_text}")
    } else {
        return None;
    };
    Some(format!("{} ({strategy}): {problem}", src.parent().unwrap_or(src).display()))
}

/// `refit plan` and `refit run` report one figure as "bytes moved" for
/// every example pair and both strategies, in JSON and in text, and it is
/// what the sources send plus what destinations relay.
#[test]
fn bytes_moved_is_the_same_figure_in_plan_and_run() {
    let failures: Vec<String> = example_pairs()
        .iter()
        .flat_map(|(src, dst)| ["reshard", "baseline"].map(|strategy| check_bytes_moved(src, dst, strategy)))
        .flatten()
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// `refit run --json` is one object with every field; `verified_elements`
/// is null without `--verify`.
#[test]
fn run_json_has_every_field() {
    let dir = Scratch::new("runjson");
    let (src, dst) = (dir.write("src.json", GOOD_SRC), dir.write("dst.json", GOOD_DST));
    for (extra, verified) in
        [(&["--verify"][..], Some(16)), (&[][..], None), (&["--baseline", "--transport", "tcp", "--verify"][..], Some(16))]
    {
        let v = run_json(&src, &dst, extra);
        for key in ["src_ranks", "dst_ranks", "tensors", "bytes_moved", "src_egress_bytes", "relayed_bytes", "messages", "rounds"] {
            assert!(v[key].as_u64().is_some(), "{extra:?}: {key} is not a count: {v}");
        }
        for key in ["transfer_s", "plan_s"] {
            assert!(v[key].as_f64().is_some_and(|t| t >= 0.0), "{extra:?}: {key} is not seconds: {v}");
        }
        let strategy = if extra.contains(&"--baseline") { "baseline" } else { "reshard" };
        assert_eq!(v["strategy"], strategy, "{v}");
        assert_eq!(v["verified_elements"].as_u64(), verified, "{extra:?}: {v}");
        assert_eq!((v["src_ranks"].as_u64(), v["dst_ranks"].as_u64(), v["tensors"].as_u64()), (Some(2), Some(2), Some(1)), "{v}");
    }
}

/// Presets print as typed on the command line (`llama3-8b`), never as the
/// Rust names (`Llama3_8b`), in text and JSON.
#[test]
fn preset_names_print_as_typed() {
    let cases: [&[&str]; 3] = [
        &["plan", "--model", "llama3-8b", "--scale", "64"],
        &["plan-bench", "--model", "llama3-8b", "--scale", "64", "--reps", "1", "--no-baseline"],
        &["bench", "--model", "llama3-8b", "--scale", "64", "--reps", "1", "--json"],
    ];
    for args in cases {
        let out = assert_ok(args);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("llama3-8b scale 64") && !text.contains("Llama3"), "{}", describe(args, &out));
    }
}

/// `refit plan`, `run` and `bench` print their figures under a header row
/// naming the columns, with the rows `bytes moved`, `from sources` and
/// `relayed`, and the one-line legend of what they mean.
#[test]
fn figures_come_as_tables_with_a_header_and_a_legend() {
    let dir = Scratch::new("tables");
    let (src, dst) = (dir.write("src.json", GOOD_SRC), dir.write("dst.json", GOOD_DST));
    let cases: [(&[&str], &[&str]); 3] = [
        (&["plan"], &["reshard", "baseline"]),
        (&["bench", "--reps", "1"], &["bytes moved", "from sources", "relayed", "median time", "rate"]),
        (&["bench", "--reps", "1", "--transport", "tcp"], &["bytes moved", "from sources", "relayed", "median time", "rate"]),
    ];
    for (cmd, header) in cases {
        let mut args = cmd.to_vec();
        args.extend_from_slice(&["--src", s(&src), "--dst", s(&dst)]);
        let out = assert_ok(&args);
        let text = String::from_utf8_lossy(&out.stdout);
        let what = describe(&args, &out);
        assert!(text.lines().any(|l| header.iter().all(|h| l.contains(h))), "no header row {header:?}: {what}");
        if cmd == ["plan"] {
            for row in ["bytes moved ", "from sources ", "relayed "] {
                assert!(text.lines().any(|l| l.trim_start().starts_with(row)), "no row {row:?}: {what}");
            }
        }
        let legend = text.lines().filter(|l| l.starts_with("bytes moved:")).collect::<Vec<_>>();
        assert!(legend.len() == 1 && ["from sources", "relayed"].iter().all(|w| legend[0].contains(w)), "legend: {what}");
    }
}

/// With stderr not a terminal (as here) no progress is drawn: stderr stays
/// empty, and stdout holds only the output (one JSON line with `--json`).
#[test]
fn no_progress_when_stderr_is_not_a_terminal() {
    let dir = Scratch::new("quiet");
    let (src, dst) = (dir.write("src.json", GOOD_SRC), dir.write("dst.json", GOOD_DST));
    let out_dir = dir.path("emitted");
    let pair = ["--src", s(&src), "--dst", s(&dst)];
    let with_pair = |cmd: &[&'static str]| -> Vec<String> { cmd.iter().copied().chain(pair).map(str::to_string).collect() };
    let cases: Vec<(Vec<String>, bool)> = vec![
        (with_pair(&["plan", "--estimate"]), false),
        (with_pair(&["plan", "--json"]), true),
        (with_pair(&["run", "--verify"]), false),
        (with_pair(&["run", "--json"]), true),
        (with_pair(&["bench", "--reps", "1"]), false),
        (with_pair(&["bench", "--reps", "1", "--json"]), true),
        (["emit", "--model", "llama3-8b", "--scale", "64", "--out", s(&out_dir)].map(str::to_string).to_vec(), false),
    ];
    for (args, json) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = assert_ok(&args);
        assert!(out.stderr.is_empty(), "{}", describe(&args, &out));
        if json {
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(text.trim_end().lines().count() == 1 && serde_json::from_str::<Value>(&text).is_ok(), "{}", describe(&args, &out));
        }
    }
}

// ---------------------------------------------------------------------------
// Invalid input.

#[test]
fn unknown_transport_is_rejected() {
    let dir = Scratch::new("transport");
    let (src, dst) = (dir.write("src.json", GOOD_SRC), dir.write("dst.json", GOOD_DST));
    let args = ["run", "--transport", "rdma", "--verify", "--src", s(&src), "--dst", s(&dst)];
    let out = refit(&args);
    if let Some(f) = rejection_failure(&args, &out, &["rdma"]) {
        panic!("{f}");
    }
}

/// `refit plan --svg` draws both traffic matrices, and `--estimate` adds the
/// modelled times.
#[test]
fn plan_draws_traffic_and_estimates() {
    let dir = Scratch::new("svg");
    let (src, dst) = (dir.write("src.json", GOOD_SRC), dir.write("dst.json", GOOD_DST));
    let svg = dir.path("traffic.svg");
    let out = refit(&["plan", "--estimate", "--svg", s(&svg), "--src", s(&src), "--dst", s(&dst)]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("lower bound"));
    for p in [svg.clone(), svg.with_extension("baseline.svg")] {
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text.starts_with("<svg") && text.contains("<rect") && text.trim_end().ends_with("</svg>"), "{}", p.display());
    }
    let out = refit(&["plan", "--topology", "nope.json", "--src", s(&src), "--dst", s(&dst)]);
    assert_eq!(out.status.code(), Some(2));
}

/// `refit plan --estimate` says its times are modelled: in JSON
/// (`modelled: true`, what each model is, a finite positive baseline /
/// reshard ratio) and in text (the row label and a legend line). A preset
/// with a published measurement quotes it as a reference with its source;
/// a pair of files has none.
#[test]
fn plan_estimates_are_labelled_modelled_with_the_measured_reference() {
    let args = ["plan", "--model", "deepseek-v3", "--scale", "64", "--estimate", "--json"];
    let out = assert_ok(&args);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", describe(&args, &out)));
    let e = &v["estimate"];
    assert_eq!(e["modelled"], true, "{e}");
    assert_eq!(e["baseline_model"], "pipelined chunked broadcast", "{e}");
    let (r, b, lb) = (e["reshard_s"].as_f64(), e["baseline_s"].as_f64(), e["lower_bound_s"].as_f64());
    let (Some(r), Some(b), Some(lb)) = (r, b, lb) else { panic!("reshard_s, baseline_s and lower_bound_s are numbers: {e}") };
    let ratio = b / r;
    assert!(ratio.is_finite() && ratio > 0.0, "baseline / reshard {ratio}: {e}");
    assert_eq!(e["ratio"].as_f64(), Some(ratio), "{e}");
    assert!(r >= lb && b >= lb, "an estimate below the lower bound: {e}");
    let reference = &e["reference_ratio"];
    assert_eq!(reference["measured"], true, "{e}");
    assert!(reference["ratio"].as_f64().is_some_and(|x| (x - 14.9 / 2.6).abs() < 1e-9), "{e}");
    assert!(reference["source"].as_str().is_some_and(|s| s.contains("NVIDIA")), "{e}");
    // Per source rank, the bytes it sends off its node, for both strategies.
    for strategy in ["reshard", "baseline"] {
        let per_rank = v[strategy]["src_rank_egress_bytes"].as_array().map(|a| a.iter().filter_map(Value::as_u64).collect::<Vec<_>>());
        let per_rank = per_rank.unwrap_or_else(|| panic!("{strategy}: no src_rank_egress_bytes"));
        assert_eq!(per_rank.len(), 256, "{strategy}: one entry per source rank");
        assert_eq!(v[strategy]["max_src_rank_egress_bytes"].as_u64(), per_rank.iter().copied().max(), "{strategy}");
    }
    // In text: the row says modelled, a legend line says what is modelled,
    // and the reference is NVIDIA's measurement, not ours.
    let args = ["plan", "--model", "qwen3-235b", "--scale", "64", "--estimate"];
    let out = assert_ok(&args);
    let text = String::from_utf8_lossy(&out.stdout);
    let what = describe(&args, &out);
    assert!(text.lines().any(|l| l.starts_with("estimate (modelled, dgx-h100)")), "{what}");
    assert!(text.lines().any(|l| l.starts_with("most sent off-node by a src rank")), "{what}");
    assert!(text.lines().any(|l| l.starts_with("estimate: modelled") && l.contains("pipelined chunked broadcast")), "{what}");
    let reference: Vec<&str> = text.lines().filter(|l| l.starts_with("reference, measured by NVIDIA")).collect();
    assert!(reference.len() == 1 && reference[0].contains("3.4x") && reference[0].contains("not by refit"), "{what}");
    // A pair of files: modelled, with no reference.
    let dir = Scratch::new("estimate");
    let (src, dst) = (dir.write("src.json", GOOD_SRC), dir.write("dst.json", GOOD_DST));
    let args = ["plan", "--estimate", "--json", "--src", s(&src), "--dst", s(&dst)];
    let out = assert_ok(&args);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", describe(&args, &out)));
    assert!(v["estimate"]["modelled"] == true && v["estimate"].get("reference_ratio").is_none(), "{v}");
    let args = ["plan", "--estimate", "--src", s(&src), "--dst", s(&dst)];
    let out = assert_ok(&args);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("estimate (modelled, dgx-h100)") && !text.contains("reference"), "{}", describe(&args, &out));
}

/// `refit launch` runs one process per rank, meeting at a rendezvous and
/// moving bytes over TCP, bit-exact in both modes.
#[test]
fn launch_runs_one_process_per_rank_bit_exact() {
    let dir = Scratch::new("launch");
    let (src, dst) = (dir.write("src.json", GOOD_SRC), dir.write("dst.json", GOOD_DST));
    for mode in [&[][..], &["--baseline"][..]] {
        let mut args = vec!["launch", "--verify", "--deadline-s", "60", "--src", s(&src), "--dst", s(&dst)];
        args.extend_from_slice(mode);
        let out = refit(&args);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("worker processes") && stdout.contains("match"), "{stdout}");
    }
    // A worker that cannot reach its rendezvous fails cleanly; one without
    // the control-plane secret refuses to start.
    let worker = ["worker", "--src", s(&src), "--dst", s(&dst), "--group", "src", "--rank", "0", "--rendezvous", "127.0.0.1:1"];
    let out = Command::new(BIN).args(worker).env("REFIT_SECRET", "a secret of at least sixteen bytes").output().expect("spawn refit");
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("rendezvous"));
    let out = Command::new(BIN).args(worker).env_remove("REFIT_SECRET").output().expect("spawn refit");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("REFIT_SECRET"));
}

/// The cluster path: `refit launch --no-spawn` only runs the rendezvous;
/// workers started by someone else (here: this test, as a cluster launcher
/// would) join it with `refit worker --rendezvous ADDR`.
#[test]
fn launch_without_spawning_waits_for_external_workers() {
    use std::io::{BufRead, BufReader};
    let dir = Scratch::new("nospawn");
    let (src, dst) = (dir.write("src.json", GOOD_SRC), dir.write("dst.json", GOOD_DST));
    const SECRET: &str = "shared by the launcher and its workers";
    let mut launcher = Command::new(BIN)
        .args(["launch", "--no-spawn", "--verify", "--deadline-s", "60", "--src", s(&src), "--dst", s(&dst)])
        .env("REFIT_SECRET", SECRET)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start launcher");
    let mut out = BufReader::new(launcher.stdout.take().expect("piped stdout"));
    let mut first = String::new();
    out.read_line(&mut first).expect("rendezvous line");
    let addr = first.split_whitespace().nth(3).expect("address in the first line").trim_end_matches(':').to_string();
    let (s_ranks, d_ranks) = (parse_layout_ranks(GOOD_SRC), parse_layout_ranks(GOOD_DST));
    let workers: Vec<_> = (0..s_ranks)
        .map(|r| ("src", r))
        .chain((0..d_ranks).map(|r| ("dst", r)))
        .map(|(g, r)| {
            Command::new(BIN)
                .args(["worker", "--src", s(&src), "--dst", s(&dst), "--group", g, "--rank", &r.to_string(), "--rendezvous", &addr])
                .env("REFIT_SECRET", SECRET)
                .spawn()
                .expect("start worker")
        })
        .collect();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert!(launcher.wait().unwrap().success(), "{first}{rest}");
    assert!(rest.contains("match"), "{rest}");
    for mut w in workers {
        assert!(w.wait().unwrap().success());
    }
}

fn parse_layout_ranks(json: &str) -> u32 {
    serde_json::from_str::<serde_json::Value>(json).unwrap()["ranks"].as_u64().unwrap() as u32
}

/// The TCP data plane is bit-exact end to end; the CUDA one, on a machine
/// without CUDA (or a build without the feature), is refused cleanly.
#[test]
fn tcp_transport_runs_and_gpu_transports_are_refused_cleanly() {
    let dir = Scratch::new("transports");
    let (src, dst) = (dir.write("src.json", GOOD_SRC), dir.write("dst.json", GOOD_DST));
    for mode in [&[][..], &["--baseline"][..]] {
        let mut args = vec!["run", "--transport", "tcp", "--verify", "--src", s(&src), "--dst", s(&dst)];
        args.extend_from_slice(mode);
        let out = refit(&args);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("match"));
    }
    for (name, upper) in [("cuda", "CUDA"), ("nccl", "NCCL"), ("ipc", "IPC")] {
        let args = ["run", "--transport", name, "--src", s(&src), "--dst", s(&dst)];
        let out = refit(&args);
        if std::env::var_os("REFIT_HAS_GPU").is_none() || name == "ipc" {
            assert_eq!(out.status.code(), Some(2), "{name}");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.starts_with(&format!("error: {upper} transport unavailable: ")) && err.lines().count() == 1, "{err}");
        }
    }
}

#[test]
fn usage_errors_exit_2() {
    for args in
        [&["plan", "--src", "a.json"][..], &["run", "--dst", "b.json"], &["plan", "--src", "a", "--dst", "b", "--bogus"], &["frobnicate"]]
    {
        let out = refit(args);
        assert_eq!(out.status.code(), Some(2), "{}", describe(args, &out));
    }
}

#[test]
fn bad_staging_limit_is_rejected() {
    let dir = Scratch::new("staging");
    let (src, dst) = (dir.write("src.json", GOOD_SRC), dir.write("dst.json", GOOD_DST));
    for mib in ["0", "18446744073709551615"] {
        let args = ["plan", "--max-staging-mib", mib, "--src", s(&src), "--dst", s(&dst)];
        let out = refit(&args);
        if let Some(f) = rejection_failure(&args, &out, &["--max-staging-mib"]) {
            panic!("{f}");
        }
    }
}

/// One bad layout file: its name and its bytes (`None`: the file is missing).
fn bad_single_files() -> Vec<(&'static str, Option<Vec<u8>>)> {
    let t = |tensor: &str| Some(format!(r#"{{"ranks": 2, "tensors": [{tensor}]}}"#).into_bytes());
    let b = |text: &str| Some(text.as_bytes().to_vec());
    let truncated = GOOD_SRC.as_bytes()[..GOOD_SRC.len() / 2].to_vec();
    vec![
        ("bad-json", b(r#"{"ranks": 2, "tensors": [}"#)),
        ("truncated", Some(truncated)),
        ("empty", b("")),
        ("missing", None),
        ("not-utf8", Some(vec![0xff, 0xfe, b'{', 0x80, b'}'])),
        ("binary-garbage", Some(vec![0, 1, 2, 3, b'{', 0, b'}'])),
        ("byte-order-mark", Some([&[0xef, 0xbb, 0xbf][..], GOOD_SRC.as_bytes()].concat())),
        ("top-level-array", b("[1, 2, 3]")),
        ("tensor-null", b(r#"{"ranks": 2, "tensors": [null]}"#)),
        ("ranks-string", b(r#"{"ranks": "two", "tensors": []}"#)),
        ("ranks-1e30", b(r#"{"ranks": 1e30, "tensors": []}"#)),
        ("ranks-2-64", b(r#"{"ranks": 18446744073709551616, "tensors": []}"#)),
        ("ranks-negative", b(r#"{"ranks": -4, "tensors": []}"#)),
        ("ranks-zero", b(r#"{"ranks": 0, "tensors": []}"#)),
        ("ranks-per-node-zero", b(r#"{"ranks": 2, "ranks_per_node": 0, "tensors": []}"#)),
        ("shape-1e30", t(r#"{"name": "w", "dtype": "f32", "shape": [1e30], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}"#)),
        (
            "shape-2-64",
            t(r#"{"name": "w", "dtype": "f32", "shape": [18446744073709551616], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}"#),
        ),
        (
            "numel-overflow",
            t(r#"{"name": "w", "dtype": "f32", "shape": [4294967296, 4294967296], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}"#),
        ),
        ("offset-negative", t(r#"{"name": "w", "dtype": "f32", "shape": [4], "shards": [{"rank": 0, "offset": [-1], "extent": [4]}]}"#)),
        ("deeply-nested", Some(("[".repeat(100_000) + &"]".repeat(100_000)).into_bytes())),
        (
            "nested-garbage",
            t(r#"{"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": {"a": [[{"b": null}]]}}, "placements": ["shard(0)"]}"#),
        ),
        ("unknown-dtype", t(r#"{"name": "w", "dtype": "float32", "shape": [4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}"#)),
        (
            "unknown-field",
            t(r#"{"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "stride": [1]}"#),
        ),
        ("missing-dtype", t(r#"{"name": "w", "shape": [4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}"#)),
        (
            "both-forms",
            t(r#"{"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "shards": []}"#),
        ),
        ("neither-form", t(r#"{"name": "w", "dtype": "f32", "shape": [4]}"#)),
        ("placements-length", t(r#"{"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": [1, 2]}, "placements": ["shard(0)"]}"#)),
        ("shard-dim", t(r#"{"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": [2]}, "placements": ["shard(1)"]}"#)),
        (
            "mesh-ranks-length",
            t(r#"{"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": [2], "ranks": [0]}, "placements": ["shard(0)"]}"#),
        ),
        ("rank-out-of-range", t(r#"{"name": "w", "dtype": "f32", "shape": [4], "shards": [{"rank": 2, "flat": [0, 4]}]}"#)),
        ("box-out-of-bounds", t(r#"{"name": "w", "dtype": "f32", "shape": [4], "shards": [{"rank": 0, "offset": [2], "extent": [4]}]}"#)),
        (
            "duplicate-tensor",
            b(r#"{"ranks": 2, "tensors": [
                {"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
                {"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#),
        ),
        (
            "buffer-overlap",
            b(r#"{"ranks": 2, "tensors": [
                {"name": "q", "dtype": "f32", "shape": [4], "shards": [{"rank": 0, "flat": [0, 4], "buffer": "qkv", "at": 0}]},
                {"name": "k", "dtype": "f32", "shape": [4], "shards": [{"rank": 0, "flat": [0, 4], "buffer": "qkv", "at": 2}]}]}"#),
        ),
    ]
}

#[test]
fn bad_files_exit_2_with_one_line() {
    let dir = Scratch::new("bad");
    let good_src = dir.write("good-src.json", GOOD_SRC);
    let good_dst = dir.write("good-dst.json", GOOD_DST);
    let corpus = bad_single_files();
    assert!(corpus.len() >= 25);
    let mut failures = Vec::new();
    let mut runs = 0;
    for (name, bytes) in &corpus {
        let file = format!("bad-{name}.json");
        let path = match bytes {
            Some(b) => dir.write(&file, b),
            None => dir.0.join(&file),
        };
        for (src, dst) in [(&path, &good_dst), (&good_src, &path)] {
            for cmd in [&["plan"][..], &["plan", "--json"], &["run", "--verify"], &["run", "--baseline", "--verify"]] {
                let mut args: Vec<&str> = cmd.to_vec();
                args.extend_from_slice(&["--src", s(src), "--dst", s(dst)]);
                let out = refit(&args);
                runs += 1;
                if let Some(f) = rejection_failure(&args, &out, &[&file]) {
                    failures.push(format!("[{name}] {f}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} of {runs} invocations failed:\n{}", failures.len(), failures.join("\n\n"));
}

#[test]
fn a_directory_is_not_a_layout_file() {
    let dir = Scratch::new("dir");
    let good_dst = dir.write("good-dst.json", GOOD_DST);
    let sub = dir.0.join("layout.json");
    std::fs::create_dir_all(&sub).unwrap();
    let args = ["plan", "--src", s(&sub), "--dst", s(&good_dst)];
    if let Some(f) = rejection_failure(&args, &refit(&args), &["layout.json"]) {
        panic!("{f}");
    }
}

/// Each file is valid on its own; the pair is not.
#[test]
fn bad_pairs_exit_2_with_one_line() {
    let dir = Scratch::new("pairs");
    let src = dir.write("pair-src.json", GOOD_SRC);
    let cases: [(&str, &str, &[&str]); 5] = [
        (
            "absent",
            r#"{"ranks": 2, "tensors": [{"name": "lm_head", "dtype": "f32", "shape": [4, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#,
            &["lm_head", "absent"],
        ),
        (
            "shape",
            r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [4, 5], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#,
            &["'w'", "[4, 5]"],
        ),
        (
            "convert",
            r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "i32", "shape": [4, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#,
            &["'w'", "cannot convert f32 to i32"],
        ),
        (
            "convert-f8",
            r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f8e4m3", "shape": [4, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#,
            &["'w'", "cannot convert f32 to f8e4m3"],
        ),
        (
            "scalar",
            r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [], "mesh": {"shape": [2]}, "placements": ["replicate"]}]}"#,
            &["'w'", "differs"],
        ),
    ];
    let mut failures = Vec::new();
    for (name, dst_text, names) in cases {
        let file = format!("pair-dst-{name}.json");
        let dst = dir.write(&file, dst_text);
        let mut want: Vec<&str> = names.to_vec();
        want.extend_from_slice(&["pair-src.json", &file]);
        for cmd in [&["plan"][..], &["run", "--verify"], &["run", "--baseline", "--verify"]] {
            let mut args: Vec<&str> = cmd.to_vec();
            args.extend_from_slice(&["--src", s(&src), "--dst", s(&dst)]);
            if let Some(f) = rejection_failure(&args, &refit(&args), &want) {
                failures.push(format!("[{name}] {f}"));
            }
        }
    }
    // Not covered: the source holds rows 0..2 only; both strategies refuse.
    let partial = dir.write(
        "pair-src-partial.json",
        r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [4, 4], "shards": [{"rank": 0, "offset": [0, 0], "extent": [2, 4]}]}]}"#,
    );
    let dst = dir.write("pair-dst-full.json", GOOD_DST);
    for cmd in [&["plan"][..], &["run", "--verify"], &["run", "--baseline", "--verify"]] {
        let mut args: Vec<&str> = cmd.to_vec();
        args.extend_from_slice(&["--src", s(&partial), "--dst", s(&dst)]);
        if let Some(f) = rejection_failure(&args, &refit(&args), &["'w'", "not covered", "pair-src-partial.json"]) {
            failures.push(format!("[not covered] {f}"));
        }
    }
    assert!(failures.is_empty(), "{} failed:\n{}", failures.len(), failures.join("\n\n"));
}

// ---------------------------------------------------------------------------
// Known defects: the contract's behaviour, currently not met.

/// Runs refit under a 4 GiB address-space limit, so that a runaway
/// allocation fails fast instead of exhausting the machine.
#[cfg(unix)]
fn refit_limited(args: &[&str]) -> Output {
    Command::new("sh").arg("-c").arg("ulimit -v 4194304; exec \"$@\"").arg("sh").arg(BIN).args(args).output().expect("spawn sh")
}

/// Valid-looking sizes that parse but make planning allocate without bound
/// (abort, exit 134) or overflow (panic, exit 101 in debug builds).
#[cfg(unix)]
#[test]

fn huge_sizes_are_rejected_not_aborted() {
    let dir = Scratch::new("huge");
    let cases = [
        (
            "ranks",
            r#"{"ranks": 4000000000, "tensors": [{"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#,
        ),
        (
            "mesh",
            r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [4], "mesh": {"shape": [50000, 50000]}, "placements": ["shard(0)", "replicate"]}]}"#,
        ),
        (
            "extent",
            r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "u8", "shape": [18446744073709551615], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#,
        ),
        (
            "numel",
            r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "u8", "shape": [9223372036854775807, 2], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}"#,
        ),
    ];
    let mut failures = Vec::new();
    for (name, text) in cases {
        let file = format!("huge-{name}.json");
        let path = dir.write(&file, text);
        let args = ["plan", "--src", s(&path), "--dst", s(&path)];
        if let Some(f) = rejection_failure(&args, &refit_limited(&args), &[&file]) {
            failures.push(format!("[{name}] {f}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// A tensor name with a line break makes the error two lines.
#[test]

fn error_is_one_line_whatever_the_names() {
    let dir = Scratch::new("newline");
    let good_dst = dir.write("good-dst.json", GOOD_DST);
    let bad = dir.write(
        "bad-name.json",
        r#"{"ranks": 2, "tensors": [{"name": "w\nx", "dtype": "zz", "shape": [4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#,
    );
    let args = ["plan", "--src", s(&bad), "--dst", s(&good_dst)];
    if let Some(f) = rejection_failure(&args, &refit(&args), &["bad-name.json"]) {
        panic!("{f}");
    }
}

/// The reshard handles a destination that needs only what the source holds;
/// `refit plan` must not fail because the baseline cannot gather the rest.
#[test]

fn plan_accepts_partially_held_tensor() {
    let dir = Scratch::new("partial");
    let src = dir.write(
        "src.json",
        r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [4, 4], "shards": [{"rank": 0, "offset": [0, 0], "extent": [2, 4]}]}]}"#,
    );
    let dst = dir.write(
        "dst.json",
        r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [4, 4], "shards": [{"rank": 1, "offset": [0, 0], "extent": [2, 4]}]}]}"#,
    );
    assert_ok(&["run", "--verify", "--src", s(&src), "--dst", s(&dst)]);
    assert_ok(&["plan", "--src", s(&src), "--dst", s(&dst)]);
}

/// `--emit-layouts` writes a preset's layouts as files that plan to the same
/// fingerprint as the preset itself.
#[test]
fn emitted_preset_layouts_plan_the_same() {
    let dir = Scratch::new("emit");
    let out = assert_ok(&["plan", "--model", "llama3-8b", "--scale", "16", "--emit-layouts", s(&dir.0)]);
    let fingerprint = |text: &str| text.lines().find_map(|l| l.split("fingerprint ").nth(1).map(str::to_string));
    let preset = fingerprint(&String::from_utf8_lossy(&out.stdout)).expect("fingerprint line");
    let again = assert_ok(&["plan", "--src", s(&dir.path("src.json")), "--dst", s(&dir.path("dst.json"))]);
    assert_eq!(fingerprint(&String::from_utf8_lossy(&again.stdout)), Some(preset));
}

/// The files `--dump-dst` wrote for destination rank `rank`, read back as
/// that rank's memory in the order `index.json` lists them.
fn read_dump(dir: &Path, rank: u32) -> transport::RankMemory {
    let folder = dir.join(format!("rank{rank}"));
    let index: Value = serde_json::from_str(&std::fs::read_to_string(folder.join("index.json")).expect("index.json")).expect("json");
    assert_eq!(index["rank"], rank);
    let mut memory = transport::RankMemory { buffers: Vec::new(), dtypes: Vec::new() };
    for b in index["buffers"].as_array().expect("buffers") {
        let bytes = std::fs::read(folder.join(b["file"].as_str().expect("file"))).expect("buffer file");
        assert_eq!(bytes.len() as u64, b["bytes"].as_u64().expect("bytes"), "{b}");
        memory.buffers.push(bytes);
        memory.dtypes.push(reshard::DType::from_name(b["dtype"].as_str().expect("dtype")).expect("a dtype name"));
    }
    memory
}

#[test]
fn dumped_destination_buffers_hold_the_refit_result() {
    // Every example pair, both strategies: the dump, read back file by
    // file, is what the sources' pattern says every destination element
    // must be; one flipped byte in one file is found.
    for (src, dst) in example_pairs() {
        for strategy in [&[][..], &["--baseline"][..]] {
            let scratch = Scratch::new("dump");
            let dir = scratch.path("out");
            let mut args = vec!["run", "--src", s(&src), "--dst", s(&dst), "--json", "--dump-dst", s(&dir)];
            args.extend_from_slice(strategy);
            let out = refit(&args);
            assert!(out.status.success(), "{}", describe(&args, &out));
            let report: Value = serde_json::from_slice(&out.stdout).expect("json");
            let layout = |p: &Path| reshard::parse_layout(&std::fs::read_to_string(p).expect("layout file")).expect("layout");
            let (src_l, dst_l) = (layout(&src), layout(&dst));
            let mut memory: Vec<transport::RankMemory> = (0..dst_l.ranks()).map(|r| read_dump(&dir, r)).collect();
            let dumped: u64 = memory.iter().map(|m| m.bytes()).sum();
            assert_eq!(report["dumped_bytes"].as_u64(), Some(dumped), "{}", describe(&args, &out));
            let elements =
                transport::verify_destinations(&src_l, &dst_l, &memory).unwrap_or_else(|m| panic!("{}: {m}", describe(&args, &out)));
            assert!(elements > 0);
            let last = memory.iter_mut().rev().find_map(|m| m.buffers.iter_mut().find(|b| !b.is_empty())).expect("a buffer");
            last[0] ^= 0x01;
            assert!(transport::verify_destinations(&src_l, &dst_l, &memory).is_err(), "a flipped byte went unnoticed: {}", dst.display());
        }
    }
}

#[test]
fn a_dump_that_cannot_be_written_is_an_error_naming_the_path() {
    let scratch = Scratch::new("dump-bad");
    let file = scratch.write("taken", "not a folder");
    let (src, dst) = example_pairs().into_iter().next().expect("an example");
    let args = ["run", "--src", s(&src), "--dst", s(&dst), "--dump-dst", s(&file)];
    let out = refit(&args);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&args, &out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--dump-dst") && err.contains(s(&file)), "{}", describe(&args, &out));
}

#[test]
fn a_subset_run_moves_and_checks_only_the_named_tensors() {
    // Every example, one tensor at a time: each subset refit verifies, the
    // checked elements of all of them add up to the full refit's, and none
    // moves more than the full refit.
    for (src, dst) in example_pairs() {
        let run = |extra: &[&str]| -> Value {
            let mut args = vec!["run", "--src", s(&src), "--dst", s(&dst), "--verify", "--json"];
            args.extend_from_slice(extra);
            let out = refit(&args);
            assert!(out.status.success(), "{}", describe(&args, &out));
            serde_json::from_slice(&out.stdout).expect("json")
        };
        let full = run(&[]);
        let layout = reshard::parse_layout(&std::fs::read_to_string(&dst).expect("dst")).expect("layout");
        let (mut elements, mut most) = (0u64, 0u64);
        for (i, t) in layout.tensors().iter().enumerate() {
            if let Some(w) = layout.scale_for(i as u32) {
                // A scale tensor moves with its block-scaled tensor: naming
                // either refits both.
                let (a, b) = (run(&["--only", &t.name]), run(&["--only", &layout.tensors()[w as usize].name]));
                assert_eq!(a["verified_elements"], b["verified_elements"], "{}: {}", dst.display(), t.name);
                assert_eq!(a["bytes_moved"], b["bytes_moved"], "{}: {}", dst.display(), t.name);
                continue;
            }
            let part = run(&["--only", &t.name]);
            elements += part["verified_elements"].as_u64().expect("verified");
            most = most.max(part["bytes_moved"].as_u64().expect("bytes"));
            assert!(part["bytes_moved"].as_u64() > Some(0), "{}: {}", dst.display(), t.name);
        }
        assert_eq!(Some(elements), full["verified_elements"].as_u64(), "{}", dst.display());
        assert!(Some(most) <= full["bytes_moved"].as_u64(), "{}", dst.display());
    }
    let (src, dst) = example_pairs().into_iter().next().expect("an example");
    let args = ["run", "--src", s(&src), "--dst", s(&dst), "--only", "no.such.tensor"];
    let out = refit(&args);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&args, &out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("tensor 'no.such.tensor' named for a subset refit"), "{}", describe(&args, &out));
}

/// `refit bench --fp8-dst` and `--delta-fraction` report bytes and times
/// against the dense refit of the same pair, in JSON with the keys the docs
/// name; the FP8 run is verified, and bad combinations exit 2.
#[test]
fn bench_reports_fp8_and_delta_refits_against_the_dense_one() {
    let args = ["bench", "--model", "llama3-8b", "--scale", "64", "--reps", "1", "--fp8-dst", "--json"];
    let out = assert_ok(&args);
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    let (fp8, dense) = (v["fp8_bytes"].as_u64().expect("fp8_bytes"), v["dense_bytes"].as_u64().expect("dense_bytes"));
    // The preset's destination is bf16: FP8 moves the same bf16 values,
    // plus whole blocks where shards cut them.
    assert!(fp8 >= dense && fp8 < dense * 2, "{v}");
    assert!(v["fp8_s"].as_f64() > Some(0.0) && v["dense_s"].as_f64() > Some(0.0), "{v}");
    assert!(v["verified_elements"].as_u64() > Some(0) && v["fp8_tensors"].as_u64() > Some(0), "{v}");
    assert!(v["fp8_held_bytes"].as_u64() < Some(dense), "{v}");
    let args = ["bench", "--model", "llama3-8b", "--scale", "64", "--reps", "1", "--delta-fraction", "0.02", "--json"];
    let out = assert_ok(&args);
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    let (delta, dense) = (v["delta_bytes"].as_u64().expect("delta_bytes"), v["dense_bytes"].as_u64().expect("dense_bytes"));
    assert!(delta * 10 <= dense, "2% changed moves at most a tenth: {v}");
    assert!(v["delta_s"].as_f64() > Some(0.0) && v["dense_s"].as_f64() > Some(0.0), "{v}");
    for bad in [
        &["bench", "--model", "llama3-8b", "--scale", "64", "--fp8-dst", "--transport", "tcp"][..],
        &["bench", "--model", "llama3-8b", "--scale", "64", "--fp8-dst", "--fp8-block", "0"],
        &["bench", "--model", "llama3-8b", "--scale", "64", "--delta-fraction", "1.5"],
    ] {
        let out = refit(bad);
        assert_eq!(out.status.code(), Some(2), "{}", describe(bad, &out));
    }
}

/// Kimi-K2 into FP8 is quoted beside Perplexity's measurement (a refit
/// time, no baseline), labelled as theirs; the same pair without FP8 has
/// no reference.
#[test]
fn kimi_k2_fp8_estimate_quotes_perplexity_as_a_measurement() {
    let args = ["plan", "--model", "kimi-k2", "--scale", "64", "--fp8-dst", "128", "--estimate", "--json"];
    let out = assert_ok(&args);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", describe(&args, &out)));
    let r = &v["estimate"]["reference_ratio"];
    assert!(r["by"] == "Perplexity" && r["measured"] == true && r["reshard_s"].as_f64() == Some(1.3), "{v}");
    assert!(r["ratio"].is_null() && r["baseline_s"].is_null(), "{v}");
    let args = ["plan", "--model", "kimi-k2", "--scale", "64", "--fp8-dst", "128", "--estimate"];
    let out = assert_ok(&args);
    let text = String::from_utf8_lossy(&out.stdout);
    let line: Vec<&str> = text.lines().filter(|l| l.starts_with("reference, measured by Perplexity, not by refit")).collect();
    assert!(line.len() == 1 && line[0].contains("refit 1.3 s"), "{}", describe(&args, &out));
    let args = ["plan", "--model", "kimi-k2", "--scale", "64", "--estimate", "--json"];
    let out = assert_ok(&args);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", describe(&args, &out)));
    assert!(v["estimate"].get("reference_ratio").is_none(), "{v}");
}

/// `--setup` plans an anchor's own layouts, and `--estimate` quotes the
/// anchor's measurement labelled as theirs, measured on the setup these
/// layouts model, beside refit's modelled reshard, baseline and bound; in
/// JSON too (`measured: true`, the setup, what was assumed).
#[test]
fn anchor_setups_quote_their_measurement_beside_the_model() {
    for (model, setup, by, measured, baseline) in [
        ("deepseek-v3", "nemo-rl", "NVIDIA", "2.39-2.83 s", None),
        ("kimi-k2", "vllm-rdt", "vLLM", "7.53 s", None),
        ("qwen3-235b", "vllm-rdt", "vLLM", "3.49 s", Some(64.72)),
    ] {
        let args = ["plan", "--model", model, "--setup", setup, "--scale", "64", "--estimate", "--json"];
        let out = assert_ok(&args);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", describe(&args, &out)));
        let (e, r) = (&v["estimate"], &v["estimate"]["reference_ratio"]);
        assert!(e["modelled"] == true && e["reshard_s"].as_f64() > Some(0.0) && e["lower_bound_s"].as_f64() > Some(0.0), "{v}");
        assert!(r["measured"] == true && r["by"] == by && r["setup"] == setup && r["on_these_layouts"] == true, "{v}");
        assert!(r["source"].as_str().is_some_and(|s| !s.is_empty()) && r["assumed"].as_str().is_some(), "{v}");
        assert_eq!(r["baseline_s"].as_f64(), baseline, "{v}");
        let args = ["plan", "--model", model, "--setup", setup, "--scale", "64", "--estimate"];
        let out = assert_ok(&args);
        let text = String::from_utf8_lossy(&out.stdout);
        let what = describe(&args, &out);
        assert!(text.starts_with(&format!("{model} {setup} scale 64: ")), "{what}");
        let head = format!("reference, measured by {by}, on the {setup} setup these layouts model, not by refit: ");
        let quoted: Vec<&str> = text.lines().filter(|l| l.starts_with(&head)).collect();
        assert!(quoted.len() == 1 && quoted[0].contains(measured) && quoted[0].contains("source: "), "{what}");
        assert!(text.lines().any(|l| l.starts_with("  not published by them, assumed in these layouts: ")), "{what}");
        let side = format!("side by side: measured by {by} {measured} | modelled by refit (dgx-h100): reshard ");
        assert!(text.lines().any(|l| l.starts_with(&side) && l.contains(", baseline ") && l.contains(", lower bound ")), "{what}");
    }
}

/// A setup the preset lacks, an unknown one, or one with `--ep`: exit 2
/// and one line naming the setups the preset has; `refit emit` takes the
/// flag too.
#[test]
fn bad_setups_are_rejected_naming_the_valid_ones() {
    for (args, names) in [
        (&["plan", "--model", "kimi-k2", "--setup", "nemo-rl", "--scale", "64"][..], &["--setup nemo-rl", "kimi-k2", "vllm-rdt"][..]),
        (&["plan", "--model", "deepseek-v3", "--setup", "vllm", "--scale", "64"], &["--setup vllm", "no such setup", "nemo-rl"]),
        (&["plan", "--model", "llama3-8b", "--setup", "vllm-rdt", "--scale", "64"], &["llama3-8b", "none"]),
        (&["plan", "--model", "kimi-k2", "--setup", "vllm-rdt", "--ep", "16", "--scale", "64"], &["--setup vllm-rdt", "EP"]),
        (&["emit", "--model", "qwen3-235b", "--setup", "nemo-rl", "--scale", "64", "--out", "/nonexistent"], &["qwen3-235b", "vllm-rdt"]),
    ] {
        if let Some(f) = rejection_failure(args, &refit(args), names) {
            panic!("{f}");
        }
    }
    let dir = Scratch::new("emit-setup");
    let out = dir.path("qwen");
    let args = ["emit", "--model", "qwen3-235b", "--setup", "vllm-rdt", "--scale", "64", "--out", s(&out)];
    assert_ok(&args);
    let src: Value = serde_json::from_str(&std::fs::read_to_string(out.join("src.json")).unwrap()).unwrap();
    let dst: Value = serde_json::from_str(&std::fs::read_to_string(out.join("dst.json")).unwrap()).unwrap();
    assert!(src["ranks"] == 16 && dst["ranks"] == 16, "the setup's 16 -> 16 ranks");
}
