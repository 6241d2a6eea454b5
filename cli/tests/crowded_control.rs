//! A launcher's control port crowded by strangers while its workers join
//! (loopback only): 300 connections that never say a word arrive in
//! waves while 12 workers join a `refit launch --no-spawn`, as a cluster
//! launcher would start them. Connections still authenticating have a
//! budget of 64 at the rendezvous: a newcomer pushes out one of them, at
//! random among the silent ones, so a worker's handshake can be dropped;
//! the worker then retries with backoff, and every run must complete its
//! refits.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_refit");
const SECRET: &str = "a job secret the strangers do not hold";
/// Silent connections per run: `WAVES` waves of `WAVE`, `WAVE_GAP` apart,
/// from when the workers are started; each wave more than fills the
/// budget of 64.
const WAVES: usize = 4;
const WAVE: usize = 75;
const WAVE_GAP: Duration = Duration::from_millis(60);
const RUNS: usize = 10;
/// Refits per run.
const REFITS: u32 = 2;

/// tp-to-tp: 8 source ranks and 4 destination ranks (12 workers), 8 MiB.
fn layouts() -> (String, String) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples").join("tp-to-tp");
    let p = |f: &str| dir.join(f).to_str().expect("utf-8 path").to_string();
    (p("src.json"), p("dst.json"))
}

fn ranks(path: &str) -> u64 {
    let text = std::fs::read_to_string(path).expect("layout file");
    serde_json::from_str::<serde_json::Value>(&text).expect("layout json")["ranks"].as_u64().expect("ranks")
}

/// What one run saw.
struct Run {
    /// Worker attempts retried after a dropped handshake (from their logs).
    retries: usize,
    /// Silent connections the launcher dropped for newcomers.
    evicted: usize,
    took: Duration,
}

/// One launcher, 12 workers and 300 strangers; panics with the
/// launcher's and workers' output unless every refit committed and
/// verified.
fn run_once(scratch: &Path, run: usize) -> Run {
    let started = Instant::now();
    let (src, dst) = layouts();
    let mut launcher = Command::new(BIN)
        .args(["launch", "--no-spawn", "--verify", "--deadline-s", "60", "--refits", &REFITS.to_string(), "--src", &src, "--dst", &dst])
        .env("REFIT_SECRET", SECRET)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start launcher");
    let mut stdout = BufReader::new(launcher.stdout.take().expect("piped stdout"));
    let mut first = String::new();
    stdout.read_line(&mut first).expect("rendezvous line");
    let addr = first.split_whitespace().nth(3).expect("address in the first line").trim_end_matches(':').to_string();
    // The launcher's log, read as it comes (a full pipe would stall it).
    let mut stderr = launcher.stderr.take().expect("piped stderr");
    let log = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });

    let strangers = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let mut silent = Vec::with_capacity(WAVES * WAVE);
            for _ in 0..WAVES {
                silent.extend((0..WAVE).filter_map(|_| TcpStream::connect(&addr).ok()));
                std::thread::sleep(WAVE_GAP);
            }
            silent
        })
    };
    let logs: Vec<PathBuf> = (0..12).map(|i| scratch.join(format!("run{run}-worker{i}.log"))).collect();
    let groups = [("src", ranks(&src)), ("dst", ranks(&dst))];
    let workers: Vec<Child> = groups
        .iter()
        .flat_map(|&(g, n)| (0..n).map(move |r| (g, r)))
        .zip(&logs)
        .map(|((g, r), log)| {
            Command::new(BIN)
                .args(["worker", "--src", &src, "--dst", &dst, "--group", g, "--rank", &r.to_string(), "--rendezvous", &addr])
                .env("REFIT_SECRET", SECRET)
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(log).expect("worker log file"))
                .spawn()
                .expect("start worker")
        })
        .collect();
    assert_eq!(workers.len(), 12, "the layouts have 12 ranks");

    let silent = strangers.join().expect("stranger thread");
    let mut out = String::new();
    stdout.read_to_string(&mut out).expect("launcher stdout");
    let status = launcher.wait().expect("launcher");
    drop(silent);
    let err = log.join().expect("log thread");
    let mut worker_logs = String::new();
    for (mut w, path) in workers.into_iter().zip(&logs) {
        let status = w.wait().expect("worker");
        let text = std::fs::read_to_string(path).unwrap_or_default();
        worker_logs.push_str(&format!("--- {} ({status})\n{text}", path.display()));
    }
    let context = || format!("run {run}\n--- launcher stdout\n{first}{out}--- launcher stderr\n{err}{worker_logs}");
    assert!(status.success(), "launcher failed\n{}", context());
    let committed = (1..=REFITS).all(|v| out.lines().any(|l| l.starts_with(&format!("refit {v}: ok"))));
    let verified = out.contains(&format!("verify: the committed weights of version {REFITS} match on every destination rank"));
    assert!(committed && verified, "refits did not all commit and verify\n{}", context());
    let retries = worker_logs.lines().filter(|l| l.contains("retrying after a transient failure")).count();
    let evicted = err.lines().filter(|l| l.contains("rejected connection: not authenticated before newer connections")).count();
    Run { retries, evicted, took: started.elapsed() }
}

/// 300 silent connections in waves at a `launch --no-spawn` control port
/// while its 12 workers join, 10 times over: every run completes its
/// refits, committed and verified. A worker whose handshake is dropped
/// for a newcomer retries (logged); the launcher logs each connection it
/// dropped.
#[test]
fn slow_silent_sockets_while_twelve_workers_join_keep_none_out() {
    let scratch = std::env::temp_dir().join(format!("refit-crowded-control-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch directory");
    let mut evicted = 0;
    for run in 0..RUNS {
        let seen = run_once(&scratch, run);
        eprintln!(
            "run {run}: ok in {:.1?}; {} pending connections dropped for newcomers, {} worker retries",
            seen.took, seen.evicted, seen.retries
        );
        evicted += seen.evicted;
    }
    let _ = std::fs::remove_dir_all(&scratch);
    // The strangers did crowd the port: the budget overflowed.
    assert!(evicted > 0, "no connection was ever dropped for a newcomer: the test did not crowd the control port");
}
