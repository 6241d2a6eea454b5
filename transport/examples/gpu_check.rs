//! GPU check (run by `scripts/gpu-check.sh` on a machine with one GPU):
//!
//! 1. a multi-rank reshard whose ranks are separate device buffers on one
//!    GPU, verified bit-exact, timed next to a plain device-to-device copy
//!    of the same bytes (target: reshard at least 0.8 of the copy's rate);
//! 2. a one-rank NCCL communicator: created, used for an empty group and
//!    for a send/receive to itself, aborted, recreated with a new id;
//! 3. the gather-broadcast baseline, verified bit-exact.
//!
//! Prints one line per check and a summary; exits 1 on any failure, 2 if
//! CUDA is unavailable.

use reshard::{parse_layout, plan_baseline, plan_reshard, Layout, Plan, PlanOptions};
use std::process::ExitCode;
use std::time::{Duration, Instant};
use transport::cuda::comm::{AbortOutcome, CommConfig, P2p};
use transport::cuda::device::{nccl_version_text, probe_nccl, DeviceMemory, GpuDevice};
use transport::cuda::exec::{time_plain_copy, DeviceRun};
use transport::cuda::id::CommId;
use transport::cuda::nccl::create_comm;
use transport::{fill_sources, verify_destinations, RankMemory};

/// Same dtype on both sides, rows of 8–16 KiB: the throughput case (~320 MiB).
const BIG_SRC: &str = r#"{"ranks": 4, "tensors": [
  {"name": "w1", "dtype": "bf16", "shape": [8192, 8192], "mesh": {"shape": [4]}, "placements": ["shard(0)"]},
  {"name": "w2", "dtype": "bf16", "shape": [16384, 4096], "mesh": {"shape": [4]}, "placements": ["shard(0)"]},
  {"name": "w3", "dtype": "f32", "shape": [4096, 4096], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]}]}"#;
const BIG_DST: &str = r#"{"ranks": 2, "tensors": [
  {"name": "w1", "dtype": "bf16", "shape": [8192, 8192], "mesh": {"shape": [2]}, "placements": ["shard(1)"]},
  {"name": "w2", "dtype": "bf16", "shape": [16384, 4096], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
  {"name": "w3", "dtype": "f32", "shape": [4096, 4096], "mesh": {"shape": [2]}, "placements": ["shard(1)"]}]}"#;

/// Small, every kind of piece: dtype changes (host-staged), 3-D pieces,
/// replication, odd sizes.
const MIXED_SRC: &str = r#"{"ranks": 4, "tensors": [
  {"name": "a", "dtype": "f32", "shape": [120, 100], "mesh": {"shape": [2, 2]}, "placements": ["shard(0)", "shard(1)"]},
  {"name": "b", "dtype": "bf16", "shape": [6, 70, 50], "mesh": {"shape": [4]}, "placements": ["shard(1)"]},
  {"name": "c", "dtype": "f64", "shape": [9], "mesh": {"shape": [4]}, "placements": ["replicate"]},
  {"name": "d", "dtype": "i32", "shape": [81, 3], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]},
  {"name": "e", "dtype": "f16", "shape": [37, 11, 5], "mesh": {"shape": [2, 2]}, "placements": ["shard(2)", "shard(1)"]}]}"#;
const MIXED_DST: &str = r#"{"ranks": 3, "tensors": [
  {"name": "a", "dtype": "bf16", "shape": [120, 100], "mesh": {"shape": [3]}, "placements": ["shard(1)"]},
  {"name": "b", "dtype": "f32", "shape": [6, 70, 50], "mesh": {"shape": [3]}, "placements": ["shard(2)"]},
  {"name": "c", "dtype": "f64", "shape": [9], "mesh": {"shape": [3]}, "placements": ["shard(0)"]},
  {"name": "d", "dtype": "i32", "shape": [81, 3], "mesh": {"shape": [3]}, "placements": ["replicate"]},
  {"name": "e", "dtype": "f16", "shape": [37, 11, 5], "mesh": {"shape": [3]}, "placements": ["shard(0)"]}]}"#;

const TARGET_RATIO: f64 = 0.8;
const REPS: u32 = 10;

struct Summary {
    lines: Vec<(bool, String)>,
}

impl Summary {
    fn record(&mut self, ok: bool, line: String) {
        println!("{} {line}", if ok { "PASS" } else { "FAIL" });
        self.lines.push((ok, line));
    }
}

fn gbps(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-12) / 1e9
}

/// Runs a plan on the device: fill sources on the host, upload, run once,
/// run `reps` more times for timing, download, verify. Returns the best
/// device time and the bytes moved between ranks.
fn run_plan(dev: &GpuDevice, src: &Layout, dst: &Layout, plan: &Plan, reps: u32) -> Result<(Duration, u64, u64, u64), String> {
    let programs = plan.programs(src, dst).map_err(|e| e.to_string())?;
    let n_src = src.ranks() as usize;
    let mut host = RankMemory::for_programs(&programs);
    fill_sources(src, &mut host[..n_src]);
    let mut memory = DeviceMemory::for_programs(dev, &programs).map_err(|e| e.to_string())?;
    for (m, h) in memory.iter_mut().zip(&host) {
        m.zero(dev).map_err(|e| e.to_string())?;
        m.upload(dev, h).map_err(|e| e.to_string())?;
    }
    let mut run = DeviceRun::prepare(dev, &programs, &mut memory).map_err(|e| e.to_string())?;
    let first = run.execute().map_err(|e| e.to_string())?;
    let mut best = first.elapsed;
    for _ in 0..reps {
        best = best.min(run.execute().map_err(|e| e.to_string())?.elapsed);
    }
    drop(run);
    let back: Vec<RankMemory> = memory[n_src..].iter().map(|m| m.download(dev)).collect::<Result<_, _>>().map_err(|e| e.to_string())?;
    let checked = verify_destinations(src, dst, &back).map_err(|e| format!("MISMATCH: {e}"))?;
    Ok((best, first.wire_bytes, first.staged_pieces, checked))
}

/// Parses a built-in layout pair.
fn layouts(src: &str, dst: &str) -> Result<(Layout, Layout), String> {
    Ok((
        parse_layout(src).map_err(|e| format!("built-in source layout: {e}"))?,
        parse_layout(dst).map_err(|e| format!("built-in destination layout: {e}"))?,
    ))
}

fn reshard_checks(dev: &GpuDevice, s: &mut Summary) {
    let opts = PlanOptions::default();
    let big = layouts(BIG_SRC, BIG_DST);
    match big
        .and_then(|(src, dst)| plan_reshard(&src, &dst, &opts).map_err(|e| e.to_string()).and_then(|p| run_plan(dev, &src, &dst, &p, REPS)))
    {
        Ok((t, bytes, _, checked)) => {
            s.record(true, format!("reshard 4->2 ranks on one GPU: {checked} elements bit-exact"));
            match time_plain_copy(dev, bytes as usize, REPS) {
                Ok(plain) => {
                    let ratio = plain.as_secs_f64() / t.as_secs_f64().max(1e-12);
                    s.record(
                        ratio >= TARGET_RATIO,
                        format!(
                            "reshard throughput: {:.1} GB/s ({bytes} bytes in {t:?}); plain device copy {:.1} GB/s; ratio {ratio:.2} (target >= {TARGET_RATIO})",
                            gbps(bytes, t),
                            gbps(bytes, plain)
                        ),
                    );
                }
                Err(e) => s.record(false, format!("plain device copy: {e}")),
            }
        }
        Err(e) => s.record(false, format!("reshard 4->2 ranks on one GPU: {e}")),
    }
    let mixed = layouts(MIXED_SRC, MIXED_DST);
    match mixed
        .and_then(|(src, dst)| plan_reshard(&src, &dst, &opts).map_err(|e| e.to_string()).and_then(|p| run_plan(dev, &src, &dst, &p, 1)))
    {
        Ok((_, _, staged, checked)) => {
            s.record(true, format!("reshard mixed dtypes/3-D pieces: {checked} elements bit-exact ({staged} pieces converted via host)"))
        }
        Err(e) => s.record(false, format!("reshard mixed dtypes/3-D pieces: {e}")),
    }
}

fn baseline_checks(dev: &GpuDevice, s: &mut Summary) {
    let opts = PlanOptions::default();
    for (name, a, b, reps) in [("big", BIG_SRC, BIG_DST, 2), ("mixed", MIXED_SRC, MIXED_DST, 1)] {
        let pair = layouts(a, b);
        match pair.and_then(|(src, dst)| {
            plan_baseline(&src, &dst, &opts).map_err(|e| e.to_string()).and_then(|p| run_plan(dev, &src, &dst, &p, reps))
        }) {
            Ok((t, bytes, _, checked)) => {
                s.record(true, format!("baseline (gather-broadcast) {name}: {checked} elements bit-exact; {:.1} GB/s", gbps(bytes, t)))
            }
            Err(e) => s.record(false, format!("baseline (gather-broadcast) {name}: {e}")),
        }
    }
}

fn nccl_checks(dev: &GpuDevice, s: &mut Summary) {
    match probe_nccl() {
        Ok(v) => println!("NCCL {}", nccl_version_text(v)),
        Err(e) => {
            s.record(false, format!("NCCL: {e}"));
            return;
        }
    }
    let config = CommConfig { init_timeout: Duration::from_secs(60), abort_timeout: Duration::from_secs(20), ..CommConfig::new(0, 1) };
    let bytes = 64usize << 20;
    for attempt in ["create", "recreate with a new id"] {
        let id = match CommId::generate() {
            Ok(id) => id,
            Err(e) => return s.record(false, format!("NCCL unique id: {e}")),
        };
        let t = Instant::now();
        let mut comm = match create_comm(dev.ordinal(), id, config) {
            Ok(c) => c,
            Err(e) => return s.record(false, format!("NCCL {attempt}: {e}")),
        };
        let created = t.elapsed();
        let t = Instant::now();
        let empty = comm.group(0, Vec::new(), None, Instant::now() + Duration::from_secs(30));
        let empty_t = t.elapsed();
        // Send to and receive from itself, then compare on the host.
        let self_check = (|| -> Result<Duration, String> {
            let a = dev.alloc(bytes, "nccl send").map_err(|e| e.to_string())?;
            let b = dev.alloc(bytes, "nccl recv").map_err(|e| e.to_string())?;
            let data: Vec<u8> = (0..bytes).map(|i| (i * 31 + 7) as u8).collect();
            let mut a = a;
            dev.stream().memcpy_htod(data.as_slice(), &mut a).map_err(|e| e.to_string())?;
            dev.synchronize().map_err(|e| e.to_string())?;
            use cudarc::driver::DevicePtr;
            let (pa, _ra) = a.device_ptr(dev.stream());
            let (pb, _rb) = b.device_ptr(dev.stream());
            let ops = vec![P2p::Send { peer: 0, addr: pa, bytes: bytes as u64 }, P2p::Recv { peer: 0, addr: pb, bytes: bytes as u64 }];
            let t = Instant::now();
            comm.group(1, ops, None, Instant::now() + Duration::from_secs(30)).map_err(|e| e.to_string())?;
            let took = t.elapsed();
            let back = dev.stream().clone_dtoh(&b).map_err(|e| e.to_string())?;
            if back != data {
                return Err("MISMATCH: received bytes differ from sent bytes".into());
            }
            Ok(took)
        })();
        let t = Instant::now();
        let outcome = comm.abort();
        let aborted = t.elapsed();
        let ok = empty.is_ok() && self_check.is_ok() && matches!(outcome, AbortOutcome::Aborted { .. });
        s.record(
            ok,
            format!(
                "NCCL 1-rank {attempt} (comm {}): init {created:?}; empty group {empty_t:?} {}; self send/recv 64 MiB {}; abort {aborted:?} {outcome:?}",
                id.tag(),
                empty.as_ref().map_or_else(|e| format!("FAILED {e}"), |_| "ok".into()),
                self_check.as_ref().map_or_else(|e| format!("FAILED {e}"), |t| format!("{t:?}")),
            ),
        );
    }
}

fn main() -> ExitCode {
    if let Err(e) = transport::cuda_available() {
        eprintln!("CUDA transport unavailable: {e}");
        return ExitCode::from(2);
    }
    let dev = match GpuDevice::open(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("CUDA transport unavailable: {e}");
            return ExitCode::from(2);
        }
    };
    println!("device 0: {} (max pitch {} bytes)", dev.name(), dev.max_pitch());
    let mut s = Summary { lines: Vec::new() };
    let t = Instant::now();
    reshard_checks(&dev, &mut s);
    nccl_checks(&dev, &mut s);
    baseline_checks(&dev, &mut s);
    let failed = s.lines.iter().filter(|(ok, _)| !ok).count();
    println!("\nsummary: {} checks, {failed} failed, {:.1} s", s.lines.len(), t.elapsed().as_secs_f64());
    for (ok, line) in &s.lines {
        println!("  [{}] {line}", if *ok { "ok" } else { "FAIL" });
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
