//! The runner: every check (`CHECKS`) in a process of its own, within its
//! timeout and the run's budget, and the results recorded; the helpers
//! the checks share.

mod device;
mod executor;
mod ipc;
mod nccl;
mod orchestrated;

use device::{environment, kernels, registered_lies};
use executor::{layout_pairs, throughput};
use ipc::{ipc, ipc_abort_in_flight, ipc_bucket, ipc_exporter};
use nccl::{nccl, nccl_missing_peer};
use orchestrated::{ipc_delta, ipc_members, nccl_same_device, orchestrated_ipc, orchestrated_ipc_in_place, orchestrated_on_gpus};
use reshard::{parse_layout, BufferKey, BufferSpec, DType, Layout};
use serde_json::{json, Value};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};
use transport::cuda::GpuDevice;

fn e2s(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn gbps(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-12) / 1e9
}

fn spec(dtype: DType, elems: u64) -> BufferSpec {
    BufferSpec { key: BufferKey::Named(0), name: "v".into(), dtype, elems }
}

fn load(path: &Path) -> Result<Layout, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_layout(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// What a check runs on: device 0 and the folder that holds
/// `examples/` (given at run time: `--root`, default the current one).
struct Ctx {
    dev: GpuDevice,
    root: PathBuf,
}

type Check = fn(&Ctx) -> Result<(String, Value), String>;

/// One check: its own child process, killed past `timeout_s`;
/// `expected_s` is what it takes on one H200 (the dry run adds them up).
struct Spec {
    name: &'static str,
    timeout_s: u64,
    expected_s: u64,
    run: Check,
}

/// In the order they run: NCCL last (a hang there cannot hold the
/// rest). Expected times as measured on an H200 (2026-12-04; the
/// throughput check fills and verifies 4 GB on the host).
const CHECKS: &[Spec] = &[
    Spec { name: "environment", timeout_s: 60, expected_s: 2, run: environment },
    Spec { name: "kernels", timeout_s: 60, expected_s: 1, run: kernels },
    Spec { name: "layouts", timeout_s: 120, expected_s: 2, run: layout_pairs },
    Spec { name: "ipc", timeout_s: 60, expected_s: 1, run: ipc },
    Spec { name: "throughput", timeout_s: 200, expected_s: 110, run: throughput },
    Spec { name: "orchestrator-ipc", timeout_s: 60, expected_s: 1, run: orchestrated_ipc },
    Spec { name: "orchestrator-ipc-in-place", timeout_s: 60, expected_s: 1, run: orchestrated_ipc_in_place },
    Spec { name: "orchestrator-ipc-delta", timeout_s: 60, expected_s: 2, run: ipc_delta },
    Spec { name: "ipc-abort-in-flight", timeout_s: 60, expected_s: 1, run: ipc_abort_in_flight },
    Spec { name: "registered-lies", timeout_s: 30, expected_s: 1, run: registered_lies },
    Spec { name: "nccl-same-device", timeout_s: 30, expected_s: 1, run: nccl_same_device },
    Spec { name: "nccl-missing-peer", timeout_s: 40, expected_s: 4, run: nccl_missing_peer },
    Spec { name: "nccl", timeout_s: 90, expected_s: 3, run: nccl },
    Spec { name: "orchestrator", timeout_s: 90, expected_s: 1, run: orchestrated_on_gpus },
];

/// A check's result as the runner records it (skipped: `ok` absent).
fn result_json(check: &str, result: Result<(String, Value), String>, seconds: f64) -> Value {
    let fallbacks = transport::cuda::host_fallbacks();
    let mut v = match result {
        Ok((line, fields)) => {
            let mut v = json!({ "check": check, "ok": true, "line": line });
            if let (Value::Object(m), Value::Object(f)) = (&mut v, fields) {
                m.extend(f);
            }
            v
        }
        Err(e) if e.starts_with("SKIP: ") => json!({ "check": check, "skipped": e["SKIP: ".len()..] }),
        Err(e) => json!({ "check": check, "ok": false, "line": e }),
    };
    v["seconds"] = json!(seconds);
    // Correct but slow is a failure here: every piece converted and
    // every tensor quantized on the device.
    v["host_fallbacks"] = json!(fallbacks);
    // Device staging given up after failed groups (kept until the process
    // ends, never freed under a communicator that may still use it).
    v["leaked_staging_bytes"] = json!(transport::cuda::leaked_staging_bytes());
    if fallbacks > 0 && v["ok"] == json!(true) {
        v["ok"] = json!(false);
        v["line"] = json!(format!(
            "{} — but {fallbacks} piece(s) or quantization(s) ran on the host instead of the GPU (the log's first warning says why)",
            v["line"].as_str().unwrap_or_default()
        ));
    }
    v
}

/// `--only NAME`: runs one check in this process, prints its JSON.
fn run_one(name: &str, root: PathBuf) -> ExitCode {
    let Some(spec) = CHECKS.iter().find(|c| c.name == name) else {
        eprintln!("no check {name}");
        return ExitCode::from(2);
    };
    let t = Instant::now();
    let result = GpuDevice::open(0).map_err(e2s).and_then(|dev| (spec.run)(&Ctx { dev, root }));
    let v = result_json(name, result, t.elapsed().as_secs_f64());
    println!("{v}");
    let _ = std::io::stdout().flush();
    if v["ok"] == json!(false) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// Runs `exe --only NAME` with its timeout; its JSON line, or a failure
/// that says how the child ended.
fn run_child(exe: &Path, spec: &Spec, root: &Path, limit: Duration) -> Value {
    let t = Instant::now();
    let failed = |why: String| json!({ "check": spec.name, "ok": false, "line": why, "seconds": t.elapsed().as_secs_f64() });
    let child =
        Command::new(exe).arg("--only").arg(spec.name).arg("--root").arg(root).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return failed(format!("cannot start the check's process: {e}")),
    };
    // The child's output is one line: read it on a thread so that a
    // child that fills the pipe cannot block the wait below.
    let mut out = child.stdout.take();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(o) = out.as_mut() {
            let _ = std::io::Read::read_to_string(o, &mut text);
        }
        text
    });
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if t.elapsed() < limit => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) | Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let text = reader.join().unwrap_or_default();
    let Some(status) = status else {
        return failed(format!("no answer within {:.0} s: the check's process was killed", limit.as_secs_f64()));
    };
    match text.lines().rev().find_map(|l| serde_json::from_str::<Value>(l).ok()) {
        Some(v) => v,
        None => {
            use std::os::unix::process::ExitStatusExt;
            let how = match (status.code(), status.signal()) {
                (_, Some(sig)) => format!("killed by signal {sig}"),
                (Some(code), _) => format!("exited with status {code}"),
                _ => "ended".to_string(),
            };
            failed(format!("the check's process {how} without a result"))
        }
    }
}

/// Writes the results so far to `DIR/gpu-check.json` (after every
/// check: a run cut short still leaves what it found).
fn write_results(dir: &Path, results: &[Value], totals: &Value) -> Result<(), String> {
    let path = dir.join("gpu-check.json");
    let text = serde_json::to_string_pretty(&json!({ "checks": results, "totals": totals })).map_err(e2s)?;
    std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&path, text)).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// The runner: every check in its own process (each within its timeout
/// and what is left of `budget`), one line (or JSON object) each, the
/// results in `OUT/gpu-check.json` with `--out`.
fn run_all(root: &Path, out: Option<&Path>, json_lines: bool, budget: Duration) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("cannot find this program: {e}");
            return ExitCode::from(2);
        }
    };
    let start = Instant::now();
    let mut results = Vec::new();
    let (mut passed, mut failed, mut skipped) = (0u32, 0u32, 0u32);
    let totals = |p: u32, f: u32, s: u32| json!({ "passed": p, "failed": f, "skipped": s, "seconds": start.elapsed().as_secs_f64() });
    for spec in CHECKS {
        let left = budget.saturating_sub(start.elapsed());
        let v = if left < Duration::from_secs(1) {
            json!({ "check": spec.name, "ok": false, "line": format!("not run: the run's budget of {budget:?} is spent"), "seconds": 0.0 })
        } else {
            run_child(&exe, spec, root, Duration::from_secs(spec.timeout_s).min(left))
        };
        match v["ok"].as_bool() {
            Some(true) => passed += 1,
            Some(false) => failed += 1,
            None => skipped += 1,
        }
        if json_lines {
            println!("{v}");
        } else {
            let word = match v["ok"].as_bool() {
                Some(true) => "PASS",
                Some(false) => "FAIL",
                None => "SKIP",
            };
            let line = v["line"].as_str().or(v["skipped"].as_str()).unwrap_or_default();
            println!("{word} {} ({:.1} s): {line}", spec.name, v["seconds"].as_f64().unwrap_or_default());
        }
        let _ = std::io::stdout().flush();
        results.push(v);
        if let Some(dir) = out {
            if let Err(e) = write_results(dir, &results, &totals(passed, failed, skipped)) {
                eprintln!("{e}");
                return ExitCode::from(2);
            }
        }
    }
    let total = totals(passed, failed, skipped);
    if json_lines {
        println!("{total}");
    } else {
        println!("{passed} passed, {failed} failed, {skipped} skipped ({:.1} s)", start.elapsed().as_secs_f64());
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

pub(crate) fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let root = value("--root").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    if args.iter().any(|a| a == "--ipc-members") {
        return match ipc_members() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ipc members: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if let Some(dir) = value("--ipc-exporter") {
        return match ipc_exporter(Path::new(&dir)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ipc exporter: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if let Some(bytes) = value("--ipc-bucket") {
        return match ipc_bucket(&bytes) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ipc bucket: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if args.iter().any(|a| a == "--list") {
        // The dry run's table: name, timeout and expected seconds.
        for c in CHECKS {
            println!("{}\t{}\t{}", c.name, c.timeout_s, c.expected_s);
        }
        return ExitCode::SUCCESS;
    }
    if let Err(e) = transport::cuda_available() {
        eprintln!("CUDA transport unavailable: {e}");
        return ExitCode::from(2);
    }
    if let Some(name) = value("--only") {
        return run_one(&name, root);
    }
    let budget = match value("--budget").map(|b| b.parse::<u64>()) {
        None => Duration::from_secs(CHECKS.iter().map(|c| c.timeout_s).sum()),
        Some(Ok(s)) => Duration::from_secs(s),
        Some(Err(e)) => {
            eprintln!("--budget: {e}");
            return ExitCode::from(2);
        }
    };
    run_all(&root, value("--out").as_deref().map(Path::new), args.iter().any(|a| a == "--json"), budget)
}
