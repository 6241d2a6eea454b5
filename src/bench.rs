//! Benchmarks measured side by side in one run: reshard, the gather-broadcast
//! baseline and a plain multi-threaded memcpy of the same bytes; and plan
//! time and peak memory on model-sized layouts.

use crate::runner::{prepare, RunError};
use reshard::{Layout, PlanOptions, Strategy};
use std::time::{Duration, Instant};
use transport::ExecOptions;

/// Medians of one side-by-side benchmark.
#[derive(Clone, Debug)]
pub struct ExecBench {
    /// Bytes the reshard moves between ranks.
    pub reshard_bytes: u64,
    /// Bytes the baseline moves between ranks.
    pub baseline_bytes: u64,
    /// Median reshard time.
    pub reshard: Duration,
    /// Median baseline time.
    pub baseline: Duration,
    /// Median time of a plain multi-threaded memcpy of `reshard_bytes`.
    pub memcpy: Duration,
    /// Threads used by the memcpy.
    pub memcpy_threads: usize,
    /// Repetitions measured (after one warm-up).
    pub reps: usize,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Copies `total` bytes with `threads` threads (each its own slice), once.
fn memcpy_once(src: &[Vec<u8>], dst: &mut [Vec<u8>]) -> Duration {
    let t = Instant::now();
    std::thread::scope(|s| {
        for (a, b) in src.iter().zip(dst.iter_mut()) {
            s.spawn(move || b.copy_from_slice(a));
        }
    });
    t.elapsed()
}

/// Runs reshard, baseline and memcpy alternately, `reps` times after a
/// warm-up, verifying the first reshard and baseline runs bit-exact.
pub fn exec_bench(src: &Layout, dst: &Layout, options: &PlanOptions, reps: usize) -> Result<ExecBench, RunError> {
    let reps = reps.max(1);
    let exec = ExecOptions::default();
    let mut reshard = prepare(src, dst, Strategy::Reshard, options)?;
    let mut baseline = prepare(src, dst, Strategy::Baseline, options)?;
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let bytes = reshard.plan.figures().total_bytes as usize;
    let per = bytes.div_ceil(threads);
    let msrc: Vec<Vec<u8>> = (0..threads).map(|i| vec![(i + 1) as u8; per]).collect();
    let mut mdst: Vec<Vec<u8>> = (0..threads).map(|_| vec![0u8; per]).collect();
    let (mut tr, mut tb, mut tm) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..=reps {
        reshard.clear_destinations();
        let r = reshard.execute(&exec)?;
        baseline.clear_destinations();
        let b = baseline.execute(&exec)?;
        let m = memcpy_once(&msrc, &mut mdst);
        if i == 0 {
            reshard.verify(src, dst)?;
            baseline.verify(src, dst)?;
            continue;
        }
        tr.push(r.elapsed);
        tb.push(b.elapsed);
        tm.push(m);
    }
    Ok(ExecBench {
        reshard_bytes: bytes as u64,
        baseline_bytes: baseline.plan.figures().total_bytes,
        reshard: median(tr),
        baseline: median(tb),
        memcpy: median(tm),
        memcpy_threads: threads,
        reps,
    })
}

/// Peak resident memory of this process so far (Linux `VmHWM`), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
