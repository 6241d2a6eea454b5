//! Multi-process refits: `refit launch` starts one `refit worker` process per
//! rank on this machine; the workers meet through a rendezvous address (the
//! launcher's control socket), connect the TCP data plane among themselves,
//! run their own programs and report back. On a cluster the user's launcher
//! (srun, a Kubernetes job) starts `refit worker` directly with the same
//! rendezvous address; see `docs/multiprocess.md`.
//!
//! Control messages go through `actors::codec` (length-prefixed bincode).

use crate::runner::RunError;
use actors::codec;
use reshard::{plan_baseline, plan_reshard, Endpoint, Group, Layout, PlanOptions, Strategy};
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use transport::tcp::{TcpConfig, TcpTransport};
use transport::{fill_source_rank, run_rank, verify_destination_rank, ExecOptions, RankMemory};

/// Largest control message accepted.
const MAX_CONTROL: usize = 16 << 20;

/// A worker's messages to the launcher.
#[derive(Debug, Serialize, Deserialize)]
enum ToLauncher {
    /// Ready: this rank, its data-plane address and its plan fingerprint.
    Hello { group: u8, rank: u32, data_addr: String, fingerprint: u64 },
    /// Finished (or failed).
    Done { group: u8, rank: u32, sent_bytes: u64, recv_bytes: u64, elapsed_ns: u64, verified: Option<u64>, error: Option<String> },
}

/// The launcher's message to every worker.
#[derive(Debug, Serialize, Deserialize)]
struct Peers {
    /// Every rank's data-plane address.
    table: Vec<(u8, u32, String)>,
}

fn group_code(g: Group) -> u8 {
    match g {
        Group::Src => 0,
        Group::Dst => 1,
    }
}

fn endpoint(group: u8, rank: u32) -> io::Result<Endpoint> {
    match group {
        0 => Ok(Endpoint::src(rank)),
        1 => Ok(Endpoint::dst(rank)),
        g => Err(io::Error::new(io::ErrorKind::InvalidData, format!("unknown group {g}"))),
    }
}

fn send<T: Serialize>(stream: &mut TcpStream, value: &T) -> io::Result<()> {
    let mut out = Vec::new();
    codec::encode_frame(&mut out, value).map_err(io::Error::other)?;
    stream.write_all(&out)
}

fn recv<T: for<'de> Deserialize<'de>>(stream: &mut TcpStream) -> io::Result<T> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_CONTROL {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("control frame of {n} bytes exceeds {MAX_CONTROL}")));
    }
    let mut buf = vec![0u8; 4 + n];
    buf[..4].copy_from_slice(&len);
    stream.read_exact(&mut buf[4..])?;
    let (value, rest) = codec::decode_frame(&buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    if !rest.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "trailing bytes in control frame"));
    }
    Ok(value)
}

/// What one worker is: which files, which rank, where to meet.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Source layout file.
    pub src: PathBuf,
    /// Destination layout file.
    pub dst: PathBuf,
    /// This worker's rank.
    pub endpoint: Endpoint,
    /// The rendezvous (launcher control) address.
    pub rendezvous: SocketAddr,
    /// Reshard or baseline.
    pub strategy: Strategy,
    /// Planner options.
    pub options: PlanOptions,
    /// Check this rank's destination elements after the refit.
    pub verify: bool,
    /// Data-plane deadline.
    pub deadline: Duration,
}

fn plan_for(src: &Layout, dst: &Layout, strategy: Strategy, options: &PlanOptions) -> Result<reshard::Plan, RunError> {
    Ok(match strategy {
        Strategy::Reshard => plan_reshard(src, dst, options)?,
        Strategy::Baseline => plan_baseline(src, dst, options)?,
    })
}

/// Runs one worker: plan, meet, move, verify, report. Errors after the
/// rendezvous are reported to the launcher as well as returned.
pub fn run_worker(config: &WorkerConfig, src: &Layout, dst: &Layout) -> Result<(), String> {
    let plan = plan_for(src, dst, config.strategy, &config.options).map_err(|e| e.to_string())?;
    let programs = plan.programs(src, dst).map_err(|e| e.to_string())?;
    let me = config.endpoint;
    let index = match me.group {
        Group::Src => me.rank as usize,
        Group::Dst => src.ranks() as usize + me.rank as usize,
    };
    let program = programs.into_iter().nth(index).ok_or_else(|| format!("{me}: no such rank in these layouts"))?;
    let mut memory = RankMemory::for_buffers(&program.buffers);
    if me.group == Group::Src {
        fill_source_rank(src, me.rank, &mut memory);
    }
    let mut control =
        TcpStream::connect(config.rendezvous).map_err(|e| format!("{me}: cannot reach the rendezvous {}: {e}", config.rendezvous))?;
    // Listen on the interface that reaches the rendezvous (loopback for a
    // local launch, the node's address on a cluster), and advertise it.
    let local_ip = control.local_addr().map_err(|e| e.to_string())?.ip();
    let listener = TcpListener::bind((local_ip, 0)).map_err(|e| format!("{me}: cannot listen on {local_ip}: {e}"))?;
    let data_addr = listener.local_addr().map_err(|e| e.to_string())?;
    let hello = ToLauncher::Hello {
        group: group_code(me.group),
        rank: me.rank,
        data_addr: data_addr.to_string(),
        fingerprint: plan.fingerprint().0,
    };
    send(&mut control, &hello).map_err(|e| e.to_string())?;
    let peers: Peers = recv(&mut control).map_err(|e| format!("{me}: no peer table from the launcher: {e}"))?;
    let table: Vec<(Endpoint, SocketAddr)> = peers
        .table
        .iter()
        .map(|(g, r, a)| Ok((endpoint(*g, *r)?, a.parse().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{a}: {e}")))?)))
        .collect::<io::Result<_>>()
        .map_err(|e| e.to_string())?;
    let outcome = (|| {
        let mut transport = TcpTransport::connect(me, listener, &table, &TcpConfig::default()).map_err(|e| e.to_string())?;
        let t = Instant::now();
        let stats =
            run_rank(&program, &mut memory, &mut transport, &ExecOptions { deadline: config.deadline }).map_err(|e| e.to_string())?;
        let elapsed = t.elapsed();
        drop(transport);
        let verified = if config.verify && me.group == Group::Dst {
            Some(verify_destination_rank(src, dst, me.rank, &memory).map_err(|e| e.to_string())?)
        } else {
            None
        };
        Ok::<_, String>((stats, elapsed, verified))
    })();
    let done = match &outcome {
        Ok((stats, elapsed, verified)) => ToLauncher::Done {
            group: group_code(me.group),
            rank: me.rank,
            sent_bytes: stats.sent_bytes,
            recv_bytes: stats.recv_bytes,
            elapsed_ns: elapsed.as_nanos() as u64,
            verified: *verified,
            error: None,
        },
        Err(e) => ToLauncher::Done {
            group: group_code(me.group),
            rank: me.rank,
            sent_bytes: 0,
            recv_bytes: 0,
            elapsed_ns: 0,
            verified: None,
            error: Some(e.clone()),
        },
    };
    let _ = send(&mut control, &done);
    outcome.map(|_| ())
}

/// What a launched refit did.
#[derive(Debug, Clone, Default)]
pub struct LaunchReport {
    /// Worker processes started.
    pub workers: usize,
    /// Bytes sent between ranks.
    pub bytes: u64,
    /// The slowest rank's data-plane time.
    pub max_rank_time: Duration,
    /// Destination elements verified (if asked).
    pub verified: Option<u64>,
}

/// Kills every child still running when dropped.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// How to run a launch.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Source layout file (passed to spawned workers).
    pub src_path: PathBuf,
    /// Destination layout file.
    pub dst_path: PathBuf,
    /// Reshard or baseline.
    pub strategy: Strategy,
    /// Staging cap per rank and round, MiB.
    pub max_staging_mib: u64,
    /// Destination workers check every element they hold.
    pub verify: bool,
    /// Time allowed for the rendezvous and for the refit.
    pub deadline: Duration,
    /// Where the rendezvous listens (`127.0.0.1:0` for a local launch).
    pub bind: SocketAddr,
    /// Start the workers as child processes of this program (`Some(exe)`),
    /// or wait for workers started by someone else (`None`: a cluster
    /// launcher runs `refit worker --rendezvous ADDR` on every task).
    pub spawn: Option<PathBuf>,
}

/// Opens the rendezvous, starts the workers (if asked), runs one refit
/// among them. `listening` is told the rendezvous address first.
pub fn launch(config: &LaunchConfig, src: &Layout, dst: &Layout, listening: impl FnOnce(SocketAddr)) -> Result<LaunchReport, String> {
    let (strategy, deadline, verify, max_staging_mib) = (config.strategy, config.deadline, config.verify, config.max_staging_mib);
    let options = PlanOptions { max_staging_bytes: max_staging_mib << 20, ..PlanOptions::default() };
    let fingerprint = plan_for(src, dst, strategy, &options).map_err(|e| e.to_string())?.fingerprint().0;
    let listener = TcpListener::bind(config.bind).map_err(|e| format!("cannot open the rendezvous on {}: {e}", config.bind))?;
    let rendezvous = listener.local_addr().map_err(|e| e.to_string())?;
    listening(rendezvous);
    let endpoints: Vec<Endpoint> = (0..src.ranks()).map(Endpoint::src).chain((0..dst.ranks()).map(Endpoint::dst)).collect();
    let mut children = Children(Vec::new());
    let (src_path, dst_path) = (&config.src_path, &config.dst_path);
    for e in endpoints.iter().filter(|_| config.spawn.is_some()) {
        let Some(exe) = &config.spawn else { break };
        let mut cmd = Command::new(exe);
        cmd.arg("worker")
            .arg("--src")
            .arg(src_path)
            .arg("--dst")
            .arg(dst_path)
            .arg("--group")
            .arg(if e.group == Group::Src { "src" } else { "dst" })
            .arg("--rank")
            .arg(e.rank.to_string())
            .arg("--rendezvous")
            .arg(rendezvous.to_string())
            .arg("--max-staging-mib")
            .arg(max_staging_mib.to_string())
            .arg("--deadline-s")
            .arg(deadline.as_secs().max(1).to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if strategy == Strategy::Baseline {
            cmd.arg("--baseline");
        }
        if verify {
            cmd.arg("--verify");
        }
        children.0.push(cmd.spawn().map_err(|e| format!("cannot start a worker for {e:?}: {e}", e = e))?);
    }
    // Rendezvous: every worker says hello with its address and fingerprint.
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let until = Instant::now() + deadline;
    let mut controls: Vec<(Endpoint, TcpStream)> = Vec::new();
    let mut table = Vec::new();
    while controls.len() < endpoints.len() {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(deadline)).map_err(|e| e.to_string())?;
                match recv::<ToLauncher>(&mut s).map_err(|e| format!("bad hello: {e}"))? {
                    ToLauncher::Hello { group, rank, data_addr, fingerprint: f } => {
                        let e = endpoint(group, rank).map_err(|e| e.to_string())?;
                        if f != fingerprint {
                            return Err(format!("{e}: plan fingerprint {f:016x} differs from the launcher's {fingerprint:016x}"));
                        }
                        table.push((group, rank, data_addr));
                        controls.push((e, s));
                    }
                    other => return Err(format!("expected a hello, got {other:?}")),
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() > until {
                    return Err(format!(
                        "only {} of {} workers reached the rendezvous within {deadline:?}",
                        controls.len(),
                        endpoints.len()
                    ));
                }
                for c in &mut children.0 {
                    if let Ok(Some(status)) = c.try_wait() {
                        if !status.success() {
                            return Err(format!("a worker exited before the rendezvous ({status})"));
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(format!("rendezvous: {e}")),
        }
    }
    let peers = Peers { table };
    for (_, s) in &mut controls {
        send(s, &peers).map_err(|e| e.to_string())?;
    }
    let mut report = LaunchReport { workers: endpoints.len(), ..LaunchReport::default() };
    let mut errors = Vec::new();
    for (e, s) in &mut controls {
        match recv::<ToLauncher>(s) {
            Ok(ToLauncher::Done { sent_bytes, elapsed_ns, verified, error, .. }) => {
                if let Some(err) = error {
                    errors.push(format!("{e}: {err}"));
                }
                report.bytes += sent_bytes;
                report.max_rank_time = report.max_rank_time.max(Duration::from_nanos(elapsed_ns));
                if let Some(v) = verified {
                    report.verified = Some(report.verified.unwrap_or(0) + v);
                }
            }
            Ok(other) => errors.push(format!("{e}: unexpected {other:?}")),
            Err(err) => errors.push(format!("{e}: no report: {err}")),
        }
    }
    for c in &mut children.0 {
        let _ = c.wait();
    }
    children.0.clear();
    // Report the root cause first: a peer's abort is a consequence.
    errors.sort_by_key(|e| e.contains("aborted"));
    match errors.first() {
        Some(e) => Err(e.clone()),
        None => Ok(report),
    }
}
