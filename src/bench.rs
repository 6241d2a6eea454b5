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
    /// The data plane measured.
    pub transport: BenchTransport,
    /// Bytes the reshard moves between ranks.
    pub reshard_bytes: u64,
    /// Bytes the baseline moves between ranks.
    pub baseline_bytes: u64,
    /// Median reshard time.
    pub reshard: Duration,
    /// Median baseline time.
    pub baseline: Duration,
    /// Median time of the reference copy of `reshard_bytes`: a plain
    /// multi-threaded memcpy (local) or a raw socket copy (tcp).
    pub memcpy: Duration,
    /// Threads (local) or streams (tcp) used by the reference copy.
    pub memcpy_threads: usize,
    /// Repetitions measured (after one warm-up).
    pub reps: usize,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// The data plane a benchmark runs on, and its reference copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchTransport {
    /// In-process; compared with a plain multi-threaded memcpy.
    Local,
    /// Every rank a thread, over loopback TCP; compared with a raw socket
    /// copy of the same bytes over as many streams as there are cores.
    Tcp,
}

/// Sends `src` over loopback TCP, one stream per destination buffer (each
/// gets a copy of its share; 4 MiB writes, a reader thread per stream),
/// once. Connection setup is not timed.
fn socket_copy_once(src: &[u8], dst: &mut [Vec<u8>]) -> std::io::Result<Duration> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut pairs = Vec::new();
    for _ in 0..dst.len() {
        let out = std::net::TcpStream::connect(addr)?;
        let (inc, _) = listener.accept()?;
        out.set_nodelay(true)?;
        pairs.push((out, inc));
    }
    let t = Instant::now();
    let results: Vec<std::io::Result<()>> = std::thread::scope(|s| {
        let mut handles = Vec::new();
        for ((mut out, mut inc), buf) in pairs.into_iter().zip(dst.iter_mut()) {
            let n = buf.len();
            handles.push(s.spawn(move || src[..n].chunks(4 << 20).try_for_each(|c| out.write_all(c))));
            handles.push(s.spawn(move || inc.read_exact(buf)));
        }
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(std::io::Error::other("copy thread panicked")))).collect()
    });
    results.into_iter().collect::<std::io::Result<()>>()?;
    Ok(t.elapsed())
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
pub fn exec_bench(
    src: &Layout,
    dst: &Layout,
    options: &PlanOptions,
    reps: usize,
    transport: BenchTransport,
) -> Result<ExecBench, RunError> {
    let reps = reps.max(1);
    let exec = ExecOptions::default();
    let mut reshard = prepare(src, dst, Strategy::Reshard, options)?;
    let mut baseline = prepare(src, dst, Strategy::Baseline, options)?;
    // Reference copy: as many threads as cores (memcpy), or one stream per
    // destination rank (socket copy, like the reshard's receivers).
    let threads = match transport {
        BenchTransport::Local => std::thread::available_parallelism().map_or(2, |n| n.get()),
        BenchTransport::Tcp => dst.ranks().max(1) as usize,
    };
    let bytes = reshard.plan.figures().total_bytes as usize;
    let per = bytes.div_ceil(threads);
    let msrc: Vec<Vec<u8>> = (0..threads).map(|i| vec![(i + 1) as u8; per]).collect();
    let mut mdst: Vec<Vec<u8>> = (0..threads).map(|_| vec![0u8; per]).collect();
    let (mut tr, mut tb, mut tm) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..=reps {
        let run = |p: &mut crate::runner::Prepared| match transport {
            BenchTransport::Local => p.execute(&exec),
            BenchTransport::Tcp => p.execute_tcp(&exec),
        };
        reshard.clear_destinations();
        let r = run(&mut reshard)?;
        baseline.clear_destinations();
        let b = run(&mut baseline)?;
        let m = match transport {
            BenchTransport::Local => memcpy_once(&msrc, &mut mdst),
            BenchTransport::Tcp => {
                socket_copy_once(&msrc[0], &mut mdst).map_err(|e| RunError::Exec(transport::ExecError::Setup(e.to_string())))?
            }
        };
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
        transport,
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
