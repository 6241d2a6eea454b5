//! The launcher's side: a [`Cluster`] of worker processes, started here (or
//! by a cluster launcher), that runs refits on command.

use super::wire::{recv, send, ToLauncher, ToWorker, WorkerReport};
use reshard::{plan_baseline, plan_reshard, Endpoint, Group, Layout, Plan, PlanError, PlanOptions, RankProgram, Strategy};
use std::collections::{HashMap, HashSet};
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use thiserror::Error;

/// How ranks map onto worker processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PerProcess {
    /// One process per rank; ranks of a node talk over loopback sockets.
    Rank,
    /// One process per node, its ranks as threads.
    Node,
}

/// How to start a cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Source layout file (passed to spawned workers).
    pub src_path: PathBuf,
    /// Destination layout file.
    pub dst_path: PathBuf,
    /// Planner options (the staging cap is passed to workers too).
    pub options: PlanOptions,
    /// Where the rendezvous listens (`127.0.0.1:0` for a local launch).
    pub bind: SocketAddr,
    /// Start the workers as child processes running this program
    /// (`Some(exe)`), or wait for workers started by someone else (`None`:
    /// a cluster launcher runs `refit worker --rendezvous ADDR` per task).
    pub spawn: Option<PathBuf>,
    /// Ranks per worker process (spawned workers only).
    pub per_process: PerProcess,
    /// Time allowed for the rendezvous, and for each step of a refit.
    pub deadline: Duration,
    /// Extra arguments for spawned workers (data-plane settings).
    pub worker_args: Vec<String>,
}

/// Why a cluster operation failed.
#[derive(Debug, Error)]
pub enum ClusterError {
    /// The cluster could not be set up.
    #[error("{0}")]
    Setup(String),
    /// Planning failed.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A worker failed or did not answer in time.
    #[error("worker with {who}: {error}")]
    Worker {
        /// The worker's ranks.
        who: String,
        /// What went wrong.
        error: String,
    },
}

/// What one refit across the cluster did.
#[derive(Debug, Clone, Default)]
pub struct RefitOutcome {
    /// The refit's sequence number.
    pub seq: u64,
    /// From telling every worker to start until the last one reported.
    pub wall: Duration,
    /// The slowest worker's own data-plane time.
    pub slowest_worker: Duration,
    /// Bytes sent between ranks.
    pub bytes: u64,
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

struct Link {
    ranks: Vec<Endpoint>,
    pid: u32,
    stream: TcpStream,
}

impl Link {
    fn who(&self) -> String {
        match (self.ranks.first(), self.ranks.last()) {
            (Some(a), Some(b)) if a != b => format!("{a}..{b} (pid {})", self.pid),
            (Some(a), _) => format!("{a} (pid {})", self.pid),
            _ => format!("no ranks (pid {})", self.pid),
        }
    }
}

/// A running set of workers covering every rank of both layouts.
pub struct Cluster<'l> {
    src: &'l Layout,
    dst: &'l Layout,
    config: ClusterConfig,
    links: Vec<Link>,
    children: Children,
    plans: HashMap<Strategy, Plan>,
    installed: HashSet<Strategy>,
    seq: u64,
}

fn group_name(g: Group) -> &'static str {
    if g == Group::Src {
        "src"
    } else {
        "dst"
    }
}

impl<'l> Cluster<'l> {
    /// Opens the rendezvous (telling `listening` its address), starts the
    /// workers if asked, and waits until every rank has joined with the same
    /// plan fingerprints as this launcher.
    pub fn start(
        config: ClusterConfig,
        src: &'l Layout,
        dst: &'l Layout,
        listening: impl FnOnce(SocketAddr),
    ) -> Result<Cluster<'l>, ClusterError> {
        let setup = ClusterError::Setup;
        let listener = TcpListener::bind(config.bind).map_err(|e| setup(format!("cannot open the rendezvous on {}: {e}", config.bind)))?;
        let rendezvous = listener.local_addr().map_err(|e| setup(e.to_string()))?;
        listening(rendezvous);
        let mut children = Children(Vec::new());
        if let Some(exe) = &config.spawn {
            for (g, l) in [(Group::Src, src), (Group::Dst, dst)] {
                let units: Vec<(&str, u32)> = match config.per_process {
                    PerProcess::Rank => (0..l.ranks()).map(|r| ("--rank", r)).collect(),
                    PerProcess::Node => (0..l.nodes()).map(|n| ("--node", n)).collect(),
                };
                for (flag, n) in units {
                    let mut cmd = Command::new(exe);
                    cmd.arg("worker")
                        .arg("--src")
                        .arg(&config.src_path)
                        .arg("--dst")
                        .arg(&config.dst_path)
                        .args(["--group", group_name(g), flag, &n.to_string(), "--rendezvous", &rendezvous.to_string()])
                        .args(["--max-staging-mib", &(config.options.max_staging_bytes >> 20).to_string()])
                        .args(["--deadline-s", &config.deadline.as_secs().max(1).to_string()])
                        .args(&config.worker_args)
                        .stdin(Stdio::null())
                        .stdout(Stdio::null());
                    children.0.push(cmd.spawn().map_err(|e| setup(format!("cannot start a worker for {} {flag} {n}: {e}", group_name(g))))?);
                }
            }
        }
        let fp = |s| reshard::plan_fingerprint(src, dst, &config.options, s).0;
        let (want_r, want_b) = (fp(Strategy::Reshard), fp(Strategy::Baseline));
        let total = (src.ranks() + dst.ranks()) as usize;
        let mut seen: HashSet<Endpoint> = HashSet::new();
        let mut links = Vec::new();
        listener.set_nonblocking(true).map_err(|e| setup(e.to_string()))?;
        let until = Instant::now() + config.deadline;
        while seen.len() < total {
            match listener.accept() {
                Ok((mut s, peer)) => {
                    s.set_nonblocking(false).map_err(|e| setup(e.to_string()))?;
                    s.set_nodelay(true).map_err(|e| setup(e.to_string()))?;
                    let hello = recv::<ToLauncher>(&mut s, config.deadline).map_err(|e| setup(format!("{peer}: bad hello: {e}")))?;
                    let ToLauncher::Hello { ranks, pid, reshard, baseline } = hello else {
                        return Err(setup(format!("{peer}: expected a hello, got {hello:?}")));
                    };
                    if (reshard, baseline) != (want_r, want_b) {
                        return Err(setup(format!(
                            "worker pid {pid} ({peer}): plan fingerprints {reshard:016x}/{baseline:016x} differ from the launcher's \
                             {want_r:016x}/{want_b:016x}: different layout files or --max-staging-mib"
                        )));
                    }
                    for e in &ranks {
                        let known = if e.group == Group::Src { src.ranks() } else { dst.ranks() };
                        if e.rank >= known || !seen.insert(*e) {
                            return Err(setup(format!("worker pid {pid} ({peer}) claims {e}, which is unknown or taken")));
                        }
                    }
                    links.push(Link { ranks, pid, stream: s });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() > until {
                        return Err(setup(format!(
                            "only {} of {total} ranks reached the rendezvous {rendezvous} within {:?}",
                            seen.len(),
                            config.deadline
                        )));
                    }
                    for c in &mut children.0 {
                        if let Ok(Some(status)) = c.try_wait() {
                            if !status.success() {
                                return Err(setup(format!("a worker (pid {}) exited before the rendezvous ({status})", c.id())));
                            }
                        }
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(setup(format!("rendezvous: {e}"))),
            }
        }
        Ok(Cluster { src, dst, config, links, children, plans: HashMap::new(), installed: HashSet::new(), seq: 0 })
    }

    /// The plan of `strategy` (made on first use).
    pub fn plan(&mut self, strategy: Strategy) -> Result<&Plan, ClusterError> {
        if !self.plans.contains_key(&strategy) {
            let plan = match strategy {
                Strategy::Reshard => plan_reshard(self.src, self.dst, &self.config.options)?,
                Strategy::Baseline => plan_baseline(self.src, self.dst, &self.config.options)?,
            };
            self.plans.insert(strategy, plan);
        }
        Ok(&self.plans[&strategy])
    }

    /// Worker processes and the ranks each hosts.
    pub fn workers(&self) -> Vec<(u32, Vec<Endpoint>)> {
        self.links.iter().map(|l| (l.pid, l.ranks.clone())).collect()
    }

    /// Sends every worker its message, then collects every answer (each
    /// within the deadline). The first error is returned after all answers
    /// are in, root causes before the aborts they caused.
    fn exchange(&mut self, mut msg: impl FnMut(&Link) -> ToWorker) -> Result<Vec<ToLauncher>, ClusterError> {
        let mut errors: Vec<ClusterError> = Vec::new();
        let mut sent = Vec::new();
        for l in &mut self.links {
            let m = msg(l);
            match send(&mut l.stream, &m) {
                Ok(()) => sent.push(true),
                Err(e) => {
                    errors.push(ClusterError::Worker { who: l.who(), error: format!("control stream: {e}") });
                    sent.push(false);
                }
            }
        }
        let deadline = self.config.deadline;
        let mut replies = Vec::new();
        for (l, ok) in self.links.iter_mut().zip(sent) {
            if !ok {
                continue;
            }
            match recv::<ToLauncher>(&mut l.stream, deadline) {
                Ok(ToLauncher::Failed { error, .. }) => errors.push(ClusterError::Worker { who: l.who(), error }),
                Ok(r) => replies.push(r),
                Err(e) => errors.push(ClusterError::Worker { who: l.who(), error: format!("no answer: {e}") }),
            }
        }
        errors.sort_by_key(|e| e.to_string().contains("aborted"));
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(replies),
        }
    }

    /// Plans `strategy` if needed and ships every worker its ranks' programs.
    pub fn install(&mut self, strategy: Strategy) -> Result<(), ClusterError> {
        if self.installed.contains(&strategy) {
            return Ok(());
        }
        self.plan(strategy)?;
        let programs: Vec<RankProgram> = self.plans[&strategy].programs(self.src, self.dst)?;
        let ns = self.src.ranks() as usize;
        let index = |e: &Endpoint| if e.group == Group::Src { e.rank as usize } else { ns + e.rank as usize };
        self.exchange(|l| ToWorker::Install { strategy, programs: l.ranks.iter().map(|e| programs[index(e)].clone()).collect() })?;
        self.installed.insert(strategy);
        Ok(())
    }

    /// Runs one refit of weights version `version` with `strategy` and
    /// commits it on every destination rank; with `verify`, destination
    /// ranks check every element before they commit (outside the timed
    /// part).
    pub fn refit(&mut self, strategy: Strategy, version: u64, verify: bool) -> Result<RefitOutcome, ClusterError> {
        self.install(strategy)?;
        self.seq += 1;
        let seq = self.seq;
        let ready = self.exchange(|_| ToWorker::Prepare { seq, strategy, version, verify })?;
        let mut table = Vec::new();
        for r in ready {
            if let ToLauncher::Ready { addrs, .. } = r {
                table.extend(addrs);
            }
        }
        self.exchange(|_| ToWorker::Connect { seq, table: table.clone() })?;
        let t = Instant::now();
        let done = self.exchange(|_| ToWorker::Start { seq })?;
        let wall = t.elapsed();
        let mut outcome = RefitOutcome { seq, wall, ..RefitOutcome::default() };
        for d in done {
            if let ToLauncher::Done(r) = d {
                let WorkerReport { sent_bytes, elapsed_ns, .. } = *r;
                outcome.bytes += sent_bytes;
                outcome.slowest_worker = outcome.slowest_worker.max(Duration::from_nanos(elapsed_ns));
            }
        }
        for d in self.exchange(|_| ToWorker::Commit { seq })? {
            if let ToLauncher::Done(r) = d {
                if let Some(v) = r.verified {
                    outcome.verified = Some(outcome.verified.unwrap_or(0) + v);
                }
            }
        }
        Ok(outcome)
    }

    /// Checks every destination rank's committed weights against version
    /// `version`; returns the number of elements checked.
    pub fn check(&mut self, version: u64) -> Result<u64, ClusterError> {
        let replies = self.exchange(|_| ToWorker::Check { version })?;
        Ok(replies.iter().filter_map(|r| if let ToLauncher::Done(w) = r { w.verified } else { None }).sum())
    }

    /// Tells every worker to exit and waits for the spawned ones.
    pub fn shutdown(mut self) {
        for l in &mut self.links {
            let _ = send(&mut l.stream, &ToWorker::Shutdown);
        }
        let until = Instant::now() + Duration::from_secs(5);
        for c in &mut self.children.0 {
            while Instant::now() < until {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        // Drop kills whatever did not exit in time.
    }

    /// The launcher's configuration.
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }
}
