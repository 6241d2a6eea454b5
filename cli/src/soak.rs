//! The soak: many consecutive refits on the multi-process path, every one
//! verified element by element before it commits, watching the launcher's
//! and every worker's resident memory, open file descriptors and threads
//! for growth.

use crate::cluster::{Cluster, ClusterConfig, ClusterError};
use crate::procs::status_number;
use reshard::Layout;
use std::time::{Duration, Instant};

/// Resources of the launcher and its workers, summed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    /// Resident memory, bytes.
    pub rss_bytes: u64,
    /// Open file descriptors.
    pub fds: u64,
    /// Threads.
    pub threads: u64,
}

/// What a soak showed.
#[derive(Clone, Debug)]
pub struct SoakReport {
    /// Refits run (all verified and committed).
    pub refits: u64,
    /// Worker processes.
    pub workers: usize,
    /// Resources after the first refit.
    pub first: Resources,
    /// Resources after the last refit.
    pub last: Resources,
    /// Median refit time.
    pub median: Duration,
    /// Slowest refit.
    pub slowest: Duration,
    /// Whole soak.
    pub elapsed: Duration,
    /// Destination elements verified over the whole soak.
    pub verified: u64,
}

/// Resources of process `pid` (Linux `/proc`; zeros elsewhere).
pub fn process_resources(pid: u32) -> Resources {
    Resources {
        rss_bytes: status_number(&pid.to_string(), "VmRSS:").unwrap_or(0) * 1024,
        fds: std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64),
        threads: status_number(&pid.to_string(), "Threads:").unwrap_or(0),
    }
}

fn total(cluster: &Cluster) -> Resources {
    // Let the threads and sockets of the refit just finished wind down
    // (idle blocking threads leave after `IDLE_THREAD`).
    std::thread::sleep(crate::cluster::IDLE_THREAD + Duration::from_millis(500));
    let mut r = process_resources(std::process::id());
    for w in cluster.workers() {
        let p = process_resources(w.pid);
        r.rss_bytes += p.rss_bytes;
        r.fds += p.fds;
        r.threads += p.threads;
    }
    r
}

/// Runs `refits` consecutive refits (weights versions 1..=refits), each
/// verified before it commits; the committed weights are checked at the
/// end. `progress` is told after each refit.
pub fn run_soak(
    config: ClusterConfig,
    src: Layout,
    dst: Layout,
    refits: u64,
    mut progress: impl FnMut(u64),
) -> Result<SoakReport, ClusterError> {
    let t = Instant::now();
    let mut cluster = Cluster::start(config, src, dst, |_| {})?;
    let refits = refits.max(2);
    let mut times = Vec::new();
    let mut verified = 0;
    let mut first = Resources::default();
    for version in 1..=refits {
        let o = cluster.refit(version, true)?;
        verified += o.verified.unwrap_or(0);
        times.push(o.report.wall);
        if version == 1 {
            first = total(&cluster);
        }
        progress(version);
    }
    let last = total(&cluster);
    let workers = cluster.workers().len();
    cluster.shutdown();
    times.sort();
    Ok(SoakReport {
        refits,
        workers,
        first,
        last,
        median: times[times.len() / 2],
        slowest: times[times.len() - 1],
        elapsed: t.elapsed(),
        verified,
    })
}
