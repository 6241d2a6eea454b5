//! The runner: every check (`CHECKS`) in a process of its own, within its
//! timeout and the run's budget, and the results recorded; the helpers
//! the checks share.

mod device;
mod executor;
mod ipc;
mod nccl;
mod orchestrated;

use crate::record::GpuFacts;
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
/// `expected_s` is what it takes on one GPU, `basis` where that comes
/// from (a measured run in docs/gpu-runs/, or an estimate): the dry run
/// adds them up.
struct Spec {
    name: &'static str,
    timeout_s: u64,
    expected_s: u64,
    basis: &'static str,
    run: Check,
}

/// Where an expected time was measured: the H200 runs of 2026-12-04
/// (docs/gpu-runs/2026-12-04-run8, the slowest of the whole-script runs
/// for each check).
const RUN8: &str = "measured: H200, docs/gpu-runs/2026-12-04-run8";
/// Not yet run on a GPU: a guess from the work it does.
const ESTIMATE: &str = "estimate: not yet run on a GPU";

/// In the order they run: NCCL last (a hang there cannot hold the
/// rest). A new check is one line here (its function in a module of
/// `check/`), an estimate until a run measures it.
const CHECKS: &[Spec] = &[
    Spec { name: "environment", timeout_s: 60, expected_s: 2, basis: RUN8, run: environment },
    Spec { name: "kernels", timeout_s: 60, expected_s: 1, basis: RUN8, run: kernels },
    Spec { name: "layouts", timeout_s: 120, expected_s: 2, basis: RUN8, run: layout_pairs },
    Spec { name: "ipc", timeout_s: 60, expected_s: 1, basis: RUN8, run: ipc },
    // Fills and verifies 4 GB on the host: 87-124 s in runs 6-8.
    Spec { name: "throughput", timeout_s: 200, expected_s: 124, basis: RUN8, run: throughput },
    Spec { name: "orchestrator-ipc", timeout_s: 60, expected_s: 1, basis: RUN8, run: orchestrated_ipc },
    Spec { name: "orchestrator-ipc-in-place", timeout_s: 60, expected_s: 1, basis: RUN8, run: orchestrated_ipc_in_place },
    Spec { name: "orchestrator-ipc-delta", timeout_s: 60, expected_s: 3, basis: ESTIMATE, run: ipc_delta },
    Spec { name: "fp8-at-source", timeout_s: 60, expected_s: 3, basis: ESTIMATE, run: fp8_at_source },
    Spec { name: "ipc-abort-in-flight", timeout_s: 60, expected_s: 1, basis: RUN8, run: ipc_abort_in_flight },
    Spec { name: "registered-lies", timeout_s: 30, expected_s: 1, basis: RUN8, run: registered_lies },
    Spec { name: "nccl-same-device", timeout_s: 30, expected_s: 1, basis: RUN8, run: nccl_same_device },
    Spec { name: "nccl-missing-peer", timeout_s: 40, expected_s: 4, basis: RUN8, run: nccl_missing_peer },
    Spec { name: "nccl", timeout_s: 90, expected_s: 3, basis: RUN8, run: nccl },
    Spec { name: "orchestrator", timeout_s: 90, expected_s: 1, basis: RUN8, run: orchestrated_on_gpus },
];

/// The `fp8-at-source` check on the CUDA IPC plane, every member on GPU 0.
fn fp8_at_source(ctx: &Ctx) -> Result<(String, Value), String> {
    crate::fp8_source::fp8_at_source(&ctx.root, orchestrator::CommPlane::Cuda, Some(ctx.dev.ordinal()))
}

/// The GPU's facts for the record (`crate::record`), each a value or why
/// not: device 0 where it opened.
fn gpu_facts(dev: Result<&GpuDevice, &str>) -> GpuFacts {
    use transport::cuda::{device_uuid, driver_version, nccl_version_text, nvrtc_version, probe_nccl};
    let (name, uuid) = match dev {
        Ok(dev) => (Ok(dev.name().to_string()), device_uuid(dev.ordinal()).map_err(|e| e.to_string())),
        Err(e) => (Err(e.to_string()), Err(e.to_string())),
    };
    let text = |e: &dyn std::fmt::Display| e.to_string();
    GpuFacts {
        name,
        uuid,
        cuda_driver_api: driver_version().map_err(|e| text(&e)),
        nvrtc: nvrtc_version().map_err(|e| text(&e)),
        nccl: probe_nccl().map(nccl_version_text).map_err(|e| text(&e)),
    }
}

/// What ran (`crate::record`), with the GPU's facts from `dev`.
fn run_record(dev: Result<&GpuDevice, &str>) -> Value {
    crate::record::gather(&crate::record::program_dir(), &gpu_facts(dev))
}

/// A check's result as the runner records it (skipped: `ok` absent), with
/// what ran (`run`) and the host work of this process judged: a check that
/// fell back to the host fails.
fn result_json(check: &str, result: Result<(String, Value), String>, seconds: f64, run: Value) -> Value {
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
    crate::verdict::judge_host_work(&mut v, &transport::cuda::host_work());
    // Device staging given up after failed groups (kept until the process
    // ends, never freed under a communicator that may still use it).
    v["leaked_staging_bytes"] = json!(transport::cuda::leaked_staging_bytes());
    v["run"] = run;
    v
}

/// `--only NAME`: runs one check in this process, prints its JSON.
fn run_one(name: &str, root: PathBuf) -> ExitCode {
    let Some(spec) = CHECKS.iter().find(|c| c.name == name) else {
        eprintln!("no check {name}");
        return ExitCode::from(2);
    };
    let t = Instant::now();
    let (result, run) = match GpuDevice::open(0).map_err(e2s) {
        Ok(dev) => {
            let ctx = Ctx { dev, root };
            ((spec.run)(&ctx), run_record(Ok(&ctx.dev)))
        }
        Err(e) => (Err(e.clone()), run_record(Err(&e))),
    };
    let v = result_json(name, result, t.elapsed().as_secs_f64(), run);
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
/// check: a run cut short still leaves what it found), what ran (`run`:
/// the first check's record; a check whose record differs keeps its own)
/// at the top.
fn write_results(dir: &Path, results: &[Value], totals: &Value) -> Result<(), String> {
    let path = dir.join("gpu-check.json");
    let text = serde_json::to_string_pretty(&results_file(results, totals)).map_err(e2s)?;
    std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&path, text)).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// The contents of `gpu-check.json`: what ran, the checks, the totals.
fn results_file(results: &[Value], totals: &Value) -> Value {
    let same_run = |a: &Value, b: &Value| {
        let strip = |v: &Value| {
            let mut v = v.clone();
            if let Some(m) = v.as_object_mut() {
                m.remove("recorded_unix_s");
            }
            v
        };
        strip(a) == strip(b)
    };
    let run = results.iter().find_map(|r| r.get("run")).cloned().unwrap_or_else(|| json!("no check recorded what ran"));
    let checks: Vec<Value> = results
        .iter()
        .map(|r| {
            let mut r = r.clone();
            if let Some(m) = r.as_object_mut() {
                if m.get("run").is_some_and(|own| same_run(own, &run)) {
                    m.remove("run");
                }
            }
            r
        })
        .collect();
    json!({ "run": run, "checks": checks, "totals": totals })
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
        // The dry run's table: name, timeout and expected seconds, basis.
        for c in CHECKS {
            println!("{}\t{}\t{}\t{}", c.name, c.timeout_s, c.expected_s, c.basis);
        }
        return ExitCode::SUCCESS;
    }
    if args.iter().any(|a| a == "--record") {
        // What ran, for the Python checks' files (scripts/gpu_record.py):
        // printed whether or not a GPU answers.
        let record = match transport::cuda_available() {
            Err(e) => crate::record::gather(&crate::record::program_dir(), &GpuFacts::unavailable(&format!("CUDA unavailable: {e}"))),
            Ok(()) => match GpuDevice::open(0) {
                Ok(dev) => run_record(Ok(&dev)),
                Err(e) => run_record(Err(&e.to_string())),
            },
        };
        println!("{record}");
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
