//! The launcher's side: a [`Cluster`] of worker processes, started here (or
//! by a cluster launcher), whose member actors it drives through refits over
//! the authenticated remote-actor control plane. The launcher is the
//! orchestrator of the multi-process path: it plans once, ships programs,
//! runs each refit step by step under a deadline, aborts a failing refit on
//! every member, and recovers (respawning dead workers) before the next.

use super::wire::{abort_name, AbortMsg, DataPlane, FaultSpec, MemberMsg, MemberReply, Prepare};
use super::worker::{Aborter, Member};
use super::ControlSecret;
use actors::remote::{Node, NodeConfig, Registry, RegistryMsg, RegistryReply};
use actors::{ActorRef, CallError, Supervisor, SupervisorEvents};
use reshard::{plan_baseline, plan_reshard, Endpoint, Group, Layout, Plan, PlanError, PlanOptions, RankProgram, Strategy};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::runtime::Runtime;
use tokio::task::JoinSet;

/// How ranks map onto worker processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PerProcess {
    /// One process per rank; ranks of a node share memory across processes.
    Rank,
    /// One process per node, its ranks as threads.
    Node,
}

/// How to start a cluster and run its refits.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Source layout file (passed to spawned workers).
    pub src_path: PathBuf,
    /// Destination layout file.
    pub dst_path: PathBuf,
    /// Planner options (the staging cap is passed to workers too).
    pub options: PlanOptions,
    /// Where the launcher's control node listens (`127.0.0.1:0` for a local
    /// launch).
    pub bind: SocketAddr,
    /// Start the workers as child processes running this program
    /// (`Some(exe)`), or wait for workers started by someone else (`None`:
    /// a cluster launcher runs `refit worker --rendezvous ADDR` per task).
    pub spawn: Option<PathBuf>,
    /// Ranks per worker process (spawned workers only).
    pub per_process: PerProcess,
    /// The control plane's shared secret (spawned workers get it through
    /// their environment, never on the command line).
    pub secret: ControlSecret,
    /// Time allowed for the rendezvous and for each control step.
    pub setup_timeout: Duration,
    /// Time allowed for the data plane of one refit.
    pub refit_deadline: Duration,
    /// How long an aborted data plane may take to stop before its worker
    /// abandons it.
    pub abort_grace: Duration,
    /// Data-plane settings (checksums, link emulation).
    pub data: DataPlane,
    /// A control connection silent for this long is dead (launcher and
    /// workers; see [`super::HEARTBEAT_TIMEOUT`]).
    pub heartbeat_timeout: Duration,
}

/// Why a cluster operation failed.
#[derive(Debug, Error)]
pub enum ClusterError {
    /// The cluster could not be set up (or a worker could not be replaced).
    #[error("{0}")]
    Setup(String),
    /// A worker runs with other layouts or options than the launcher.
    #[error("{0}")]
    Mismatch(String),
    /// Planning failed.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A worker failed, died or did not answer in time.
    #[error("worker with {who}: {error}")]
    Worker {
        /// The worker's ranks and process.
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
    /// Destination elements verified before the commit (if asked).
    pub verified: Option<u64>,
}

/// The points of a refit at which [`Cluster::refit_with`] calls its hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Every worker has opened its data-plane listeners (attach).
    Prepared,
    /// Every worker has connected its data plane.
    Connected,
    /// Every worker has been told to start moving bytes.
    Started,
    /// Every worker has been told to commit.
    Committing,
}

/// What one worker has committed, as checked element by element.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Committed {
    /// The committed weights version (`None`: nothing committed, a source
    /// worker, or a dead one).
    pub version: Option<u64>,
    /// Destination elements checked.
    pub elements: u64,
    /// The first element that does not match `version`: a torn version.
    pub torn: Option<String>,
}

/// One refit's request.
#[derive(Clone, Debug)]
pub struct RefitRequest {
    /// Reshard or baseline.
    pub strategy: Strategy,
    /// Weights version the sources hold.
    pub version: u64,
    /// Destination ranks check every element before they commit.
    pub verify: bool,
    /// Faults to inject, by worker index (see [`Cluster::workers`]).
    pub faults: HashMap<usize, FaultSpec>,
}

impl RefitRequest {
    /// A refit of `version` with `strategy`, no faults.
    pub fn new(strategy: Strategy, version: u64, verify: bool) -> RefitRequest {
        RefitRequest { strategy, version, verify, faults: HashMap::new() }
    }
}

/// A worker as the launcher sees it.
#[derive(Clone, Debug)]
pub struct WorkerInfo {
    /// Its ranks.
    pub ranks: Vec<Endpoint>,
    /// Its process id.
    pub pid: u32,
    /// Why it is considered dead, if it is.
    pub dead: Option<String>,
}

struct Link {
    name: String,
    ranks: Vec<Endpoint>,
    pid: u32,
    member: ActorRef<Member>,
    aborter: ActorRef<Aborter>,
    /// Arguments that start this worker again (spawned workers).
    args: Option<Vec<String>>,
    child: Option<Child>,
    dead: Option<String>,
    installed: HashSet<Strategy>,
    /// Layout files the next replacement of this worker starts with,
    /// instead of the cluster's (chaos tests: a member that comes back with
    /// a different layout).
    files: Option<(PathBuf, PathBuf)>,
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

impl Drop for Link {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A running set of workers covering every rank of both layouts.
pub struct Cluster<'l> {
    src: &'l Layout,
    dst: &'l Layout,
    config: ClusterConfig,
    runtime: Runtime,
    node: Node,
    registry: ActorRef<Registry>,
    rendezvous: SocketAddr,
    supervisor: Supervisor,
    events: SupervisorEvents,
    links: Vec<Link>,
    plans: HashMap<Strategy, Plan>,
    seq: u64,
    /// Plan fingerprints (reshard, baseline) of the launcher's layouts.
    fingerprints: (u64, u64),
}

fn group_name(g: Group) -> &'static str {
    if g == Group::Src {
        "src"
    } else {
        "dst"
    }
}

/// Environment variable through which spawned workers get the secret.
pub const SECRET_ENV: &str = "REFIT_SECRET";

impl<'l> Cluster<'l> {
    /// Opens the control node and registry (telling `listening` its
    /// address), starts the workers if asked, and waits until every rank has
    /// joined with the same plan fingerprints as this launcher.
    pub fn start(
        config: ClusterConfig,
        src: &'l Layout,
        dst: &'l Layout,
        listening: impl FnOnce(SocketAddr),
    ) -> Result<Cluster<'l>, ClusterError> {
        let setup = ClusterError::Setup;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| setup(format!("cannot start tokio: {e}")))?;
        let (node, registry) = runtime.block_on(async {
            let secret = config.secret.secret().map_err(setup)?;
            let node = Node::bind(
                secret,
                NodeConfig {
                    bind: config.bind,
                    max_frame_bytes: 128 << 20,
                    heartbeat_timeout: config.heartbeat_timeout,
                    ..NodeConfig::default()
                },
            )
            .await
            .map_err(|e| setup(format!("cannot open the rendezvous on {}: {e}", config.bind)))?;
            let registry = node.host_registry().map_err(|e| setup(e.to_string()))?;
            Ok::<_, ClusterError>((node, registry))
        })?;
        let rendezvous = node.local_addr();
        listening(rendezvous);
        let (supervisor, events) = Supervisor::channel();
        let mut cluster = Cluster {
            src,
            dst,
            config,
            runtime,
            node,
            registry,
            rendezvous,
            supervisor,
            events,
            links: Vec::new(),
            plans: HashMap::new(),
            seq: 0,
            fingerprints: (0, 0),
        };
        let fp = |s| reshard::plan_fingerprint(src, dst, &cluster.config.options, s).0;
        cluster.fingerprints = (fp(Strategy::Reshard), fp(Strategy::Baseline));
        let mut spawned: HashMap<String, (Vec<String>, Child)> = HashMap::new();
        if cluster.config.spawn.is_some() {
            for (g, l) in [(Group::Src, src), (Group::Dst, dst)] {
                let units: Vec<(&str, u32)> = match cluster.config.per_process {
                    PerProcess::Rank => (0..l.ranks()).map(|r| ("--rank", r)).collect(),
                    PerProcess::Node => (0..l.nodes()).map(|n| ("--node", n)).collect(),
                };
                for (flag, n) in units {
                    let hosted = match flag {
                        "--rank" => super::Hosted::Rank(Endpoint { group: g, rank: n }),
                        _ => super::Hosted::Node(g, n),
                    };
                    let name = super::wire::member_name(&hosted.endpoints(src, dst).map_err(setup)?);
                    let args = vec![group_name(g).to_string(), flag.to_string(), n.to_string()];
                    let child = cluster.spawn_worker(&args, None)?;
                    spawned.insert(name, (args, child));
                }
            }
        }
        let total = (src.ranks() + dst.ranks()) as usize;
        let until = Instant::now() + cluster.config.setup_timeout;
        loop {
            let covered: usize = cluster.links.iter().map(|l| l.ranks.len()).sum();
            if covered == total {
                break;
            }
            for (_, (_, c)) in spawned.iter_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    return Err(setup(format!("a worker (pid {}) exited before the rendezvous ({status})", c.id())));
                }
            }
            if Instant::now() > until {
                return Err(setup(format!(
                    "only {covered} of {total} ranks reached the rendezvous {rendezvous} within {:?}",
                    cluster.config.setup_timeout
                )));
            }
            for (name, addr) in cluster.registrations()? {
                if cluster.links.iter().any(|l| l.name == name) {
                    continue;
                }
                let mut link = cluster.attach(&name, addr)?;
                if let Some((args, child)) = spawned.remove(&name) {
                    link.args = Some(args);
                    link.child = Some(child);
                }
                for e in &link.ranks {
                    if cluster.links.iter().any(|l| l.ranks.contains(e)) {
                        return Err(setup(format!("worker {} claims {e}, which another worker hosts", link.who())));
                    }
                }
                cluster.links.push(link);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        cluster.links.sort_by_key(|l| l.ranks.first().copied());
        Ok(cluster)
    }

    fn spawn_worker(&self, args: &[String], files: Option<&(PathBuf, PathBuf)>) -> Result<Child, ClusterError> {
        let Some(exe) = &self.config.spawn else {
            return Err(ClusterError::Setup("this launcher does not start workers".into()));
        };
        let (src, dst) = files.map_or((&self.config.src_path, &self.config.dst_path), |(s, d)| (s, d));
        let mut cmd = Command::new(exe);
        cmd.arg("worker")
            .arg("--src")
            .arg(src)
            .arg("--dst")
            .arg(dst)
            .args(["--group", &args[0], &args[1], &args[2], "--rendezvous", &self.rendezvous.to_string()])
            .args(["--max-staging-mib", &(self.config.options.max_staging_bytes >> 20).to_string()])
            .args(["--abort-grace-ms", &self.config.abort_grace.as_millis().to_string()])
            .args(["--heartbeat-timeout-ms", &self.config.heartbeat_timeout.as_millis().to_string()])
            .env(SECRET_ENV, self.config.secret.text())
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        cmd.spawn().map_err(|e| ClusterError::Setup(format!("cannot start a worker ({} {} {}): {e}", args[0], args[1], args[2])))
    }

    /// Every registration in the registry, by name.
    fn registrations(&self) -> Result<Vec<(String, SocketAddr)>, ClusterError> {
        let reply = self.runtime.block_on(self.registry.call(RegistryMsg::List)).map_err(|e| ClusterError::Setup(e.to_string()))?;
        let RegistryReply::Listed(list) = reply else { return Ok(Vec::new()) };
        Ok(list
            .into_iter()
            .filter(|r| r.name.starts_with("refit.member.") && !r.name.ends_with(".abort"))
            .map(|r| (r.name, r.addr))
            .collect())
    }

    /// Connects to a registered worker, checks who it is and its plan
    /// fingerprints.
    fn attach(&self, name: &str, addr: SocketAddr) -> Result<Link, ClusterError> {
        let setup = ClusterError::Setup;
        let (src, dst) = (self.src, self.dst);
        let (want_r, want_b) = self.fingerprints;
        let timeout = self.config.setup_timeout;
        self.runtime.block_on(async {
            let peer = self.node.connect(addr).await.map_err(|e| setup(format!("worker {name} at {addr}: {e}")))?;
            let member = peer.lookup::<Member>(name).await.map_err(|e| setup(format!("worker {name} at {addr}: {e}")))?;
            let aborter = peer.lookup::<Aborter>(&abort_name(name)).await.map_err(|e| setup(format!("worker {name} at {addr}: {e}")))?;
            let hello = member.call_timeout(MemberMsg::Describe, timeout).await.map_err(|e| setup(format!("worker {name}: {e}")))?;
            let MemberReply::Hello { ranks, pid, reshard, baseline } = hello else {
                return Err(setup(format!("worker {name}: unexpected answer {hello:?}")));
            };
            if (reshard, baseline) != (want_r, want_b) {
                return Err(ClusterError::Mismatch(format!(
                    "worker {name} (pid {pid}): plan fingerprints {reshard:016x}/{baseline:016x} differ from the launcher's \
                     {want_r:016x}/{want_b:016x}: different layout files or --max-staging-mib"
                )));
            }
            for e in &ranks {
                let known = if e.group == Group::Src { src.ranks() } else { dst.ranks() };
                if e.rank >= known {
                    return Err(setup(format!("worker {name} (pid {pid}) claims {e}, which these layouts do not have")));
                }
            }
            member.link(&self.supervisor);
            Ok(Link {
                name: name.to_string(),
                ranks,
                pid,
                member,
                aborter,
                args: None,
                child: None,
                dead: None,
                installed: HashSet::new(),
                files: None,
            })
        })
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

    /// Uses `plan`, made elsewhere for this cluster's layouts and options,
    /// instead of planning again.
    pub fn adopt_plan(&mut self, plan: Plan) -> Result<(), ClusterError> {
        let strategy = plan.strategy();
        let want = match strategy {
            Strategy::Reshard => self.fingerprints.0,
            Strategy::Baseline => self.fingerprints.1,
        };
        if plan.fingerprint().0 != want {
            return Err(ClusterError::Setup(format!(
                "a {strategy} plan with fingerprint {} was made for other layouts",
                plan.fingerprint()
            )));
        }
        self.plans.insert(strategy, plan);
        Ok(())
    }

    /// The workers, in rank order, with what is known of their health.
    pub fn workers(&mut self) -> Vec<WorkerInfo> {
        self.notice_deaths();
        self.links.iter().map(|l| WorkerInfo { ranks: l.ranks.clone(), pid: l.pid, dead: l.dead.clone() }).collect()
    }

    /// The launcher's configuration.
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// Marks workers dead whose connection was lost (heartbeats, end of
    /// stream) or whose process exited; returns how many are dead.
    pub fn notice_deaths(&mut self) -> usize {
        while let Some(t) = self.events.try_recv() {
            if let Some(l) = self.links.iter_mut().find(|l| l.member.id() == t.id) {
                l.dead.get_or_insert_with(|| format!("{}", t.reason));
            }
        }
        for l in &mut self.links {
            if let Some(c) = &mut l.child {
                if let Ok(Some(status)) = c.try_wait() {
                    l.dead.get_or_insert_with(|| format!("process exited ({status})"));
                }
            }
            if l.dead.is_none() && !l.member.is_alive() {
                l.dead = Some(l.member.stop_reason().map_or("stopped".into(), |r| r.to_string()));
            }
        }
        self.links.iter().filter(|l| l.dead.is_some()).count()
    }

    /// Waits until a worker is known dead or `within` passes; returns the
    /// time it took to learn of it.
    pub fn wait_for_death(&mut self, within: Duration) -> Option<Duration> {
        let t = Instant::now();
        while t.elapsed() < within {
            if self.notice_deaths() > 0 {
                return Some(t.elapsed());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    }

    /// Replaces dead workers: kills what is left of each, starts it again,
    /// waits for it to register, checks it and reinstalls its programs.
    /// Workers started by someone else must be restarted by them; until then
    /// this fails.
    pub fn recover(&mut self) -> Result<usize, ClusterError> {
        self.notice_deaths();
        let dead: Vec<usize> = (0..self.links.len()).filter(|&i| self.links[i].dead.is_some()).collect();
        for &i in &dead {
            let (name, args, old_id, files) = {
                let l = &mut self.links[i];
                if let Some(c) = &mut l.child {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                l.child = None;
                (l.name.clone(), l.args.clone(), l.member.id(), l.files.clone())
            };
            let child = match &args {
                Some(a) => Some(self.spawn_worker(a, files.as_ref())?),
                None => None,
            };
            // Wait for a registration of this name by a new actor.
            let until = Instant::now() + self.config.setup_timeout;
            let mut child = child;
            let link = loop {
                if let Some(c) = &mut child {
                    if let Ok(Some(status)) = c.try_wait() {
                        return Err(ClusterError::Setup(format!("the replacement for {name} exited at once ({status})")));
                    }
                }
                if Instant::now() > until {
                    return Err(ClusterError::Setup(format!(
                        "{name} is dead ({}) and no replacement registered within {:?}",
                        self.links[i].dead.clone().unwrap_or_default(),
                        self.config.setup_timeout
                    )));
                }
                let regs = self.registrations()?;
                if let Some((_, addr)) = regs.into_iter().find(|(n, _)| *n == name) {
                    match self.attach(&name, addr) {
                        Ok(l) if l.member.id() != old_id => break l,
                        Ok(_) => {}
                        // A stale entry (the dead worker's) fails to connect.
                        Err(e @ ClusterError::Mismatch(_)) => {
                            if let Some(c) = &mut child {
                                let _ = c.kill();
                                let _ = c.wait();
                            }
                            return Err(e);
                        }
                        Err(_) => {}
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            let mut link = link;
            link.args = args;
            link.child = child;
            link.files = files;
            if link.ranks != self.links[i].ranks {
                return Err(ClusterError::Setup(format!("the replacement for {name} hosts {:?}", link.ranks)));
            }
            self.links[i] = link;
        }
        Ok(dead.len())
    }

    /// Kills worker `index` (SIGKILL, by its process id) so the next refit
    /// replaces it; the replacement starts with `files` (source, destination
    /// layout files) if given, else with the cluster's. For chaos tests.
    pub fn restart_worker(&mut self, index: usize, files: Option<(PathBuf, PathBuf)>) -> Result<(), ClusterError> {
        let l = self.links.get_mut(index).ok_or_else(|| ClusterError::Setup(format!("no worker {index}")))?;
        kill_pid(l.pid);
        l.files = files;
        l.dead.get_or_insert_with(|| "restarted on request".into());
        Ok(())
    }

    /// Calls every live member concurrently; answers in link order.
    fn call_all(&self, msg: impl Fn(usize) -> MemberMsg, timeout: Duration) -> Vec<Answer> {
        self.runtime.block_on(async {
            let mut set = JoinSet::new();
            for (i, l) in self.links.iter().enumerate() {
                let (m, r) = (msg(i), l.member.clone());
                set.spawn(async move { (i, r.call_timeout(m, timeout).await) });
            }
            collect(set, self.links.len()).await
        })
    }

    fn first_error(&self, results: &[Answer]) -> Option<ClusterError> {
        let mut errors: Vec<ClusterError> = results
            .iter()
            .zip(&self.links)
            .filter_map(|(r, l)| r.as_ref().err().map(|e| ClusterError::Worker { who: l.who(), error: e.clone() }))
            .collect();
        // Root causes before the aborts they caused.
        errors.sort_by_key(|e| {
            let t = e.to_string();
            (t.contains("aborted") || t.contains("broke") || t.contains("timed out waiting")) as u8
        });
        errors.into_iter().next()
    }

    /// Plans `strategy` if needed and ships every worker that lacks them its
    /// ranks' programs.
    pub fn install(&mut self, strategy: Strategy) -> Result<(), ClusterError> {
        if self.links.iter().all(|l| l.installed.contains(&strategy)) {
            return Ok(());
        }
        // Programs of large models take gigabytes: build them when a worker
        // needs them and drop them once shipped.
        self.plan(strategy)?;
        let all = self.plans[&strategy].programs(self.src, self.dst)?;
        let ns = self.src.ranks() as usize;
        let index = |e: &Endpoint| if e.group == Group::Src { e.rank as usize } else { ns + e.rank as usize };
        let timeout = self.config.setup_timeout;
        let programs = &all;
        let jobs: Vec<(usize, Box<RankProgram>)> = self
            .links
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.installed.contains(&strategy))
            .flat_map(|(i, l)| l.ranks.iter().map(move |e| (i, Box::new(programs[index(e)].clone()))))
            .collect();
        let refs: Vec<ActorRef<Member>> = self.links.iter().map(|l| l.member.clone()).collect();
        // One program at a time: programs of large models are megabytes
        // each, and encoding hundreds at once would crowd out heartbeats.
        let results = self.runtime.block_on(async {
            let mut out = Vec::new();
            for (i, program) in jobs {
                out.push((i, refs[i].call_timeout(MemberMsg::Install { strategy, program }, timeout).await));
            }
            out
        });
        for (i, r) in &results {
            if let Err(e) = r {
                return Err(ClusterError::Worker { who: self.links[*i].who(), error: call_error(e) });
            }
        }
        for l in &mut self.links {
            l.installed.insert(strategy);
        }
        Ok(())
    }

    /// Runs one refit of weights version `version` with `strategy` and
    /// commits it on every destination rank (see [`Cluster::refit_with`]).
    pub fn refit(&mut self, strategy: Strategy, version: u64, verify: bool) -> Result<RefitOutcome, ClusterError> {
        self.refit_with(&RefitRequest::new(strategy, version, verify), |_, _| {})
    }

    /// Runs one refit: recovers dead workers first, then prepare (fresh
    /// listeners, a new session), connect, start (under the refit deadline)
    /// and commit. If any worker fails or dies while the data moves, every
    /// worker's refit is aborted at once and nothing is committed; the
    /// destinations keep their committed weights. `hook` is called at each
    /// [`Phase`] with the workers' process ids (chaos tests kill them).
    pub fn refit_with(&mut self, req: &RefitRequest, mut hook: impl FnMut(Phase, &[u32])) -> Result<RefitOutcome, ClusterError> {
        self.recover()?;
        self.install(req.strategy)?;
        self.seq += 1;
        let seq = self.seq;
        let session = format!("refit-{}-{seq}", std::process::id());
        let pids: Vec<u32> = self.links.iter().map(|l| l.pid).collect();
        let setup = self.config.setup_timeout;
        let (strategy, version, verify) = (req.strategy, req.version, req.verify);
        let data = |i: usize| DataPlane { faults: req.faults.get(&i).cloned().unwrap_or_default(), ..self.config.data.clone() };
        let ready = self
            .call_all(|i| MemberMsg::Prepare(Prepare { seq, strategy, version, verify, data: data(i), session: session.clone() }), setup);
        if let Some(e) = self.first_error(&ready) {
            return Err(e);
        }
        let mut table = Vec::new();
        for r in ready.into_iter().flatten() {
            if let MemberReply::Ready { addrs } = r {
                table.extend(addrs);
            }
        }
        hook(Phase::Prepared, &pids);
        let connected = self.call_all(|_| MemberMsg::Connect { seq, table: table.clone() }, setup);
        if let Some(e) = self.first_error(&connected) {
            self.abort_all(seq, "a worker could not connect");
            return Err(e);
        }
        hook(Phase::Connected, &pids);
        let t = Instant::now();
        let deadline = self.config.refit_deadline;
        let limit = deadline + self.config.abort_grace + setup;
        let refs: Vec<(ActorRef<Member>, ActorRef<Aborter>)> = self.links.iter().map(|l| (l.member.clone(), l.aborter.clone())).collect();
        let mut set = JoinSet::new();
        let _guard = self.runtime.enter();
        for (i, (m, _)) in refs.iter().enumerate() {
            let m = m.clone();
            set.spawn(async move { (i, m.call_timeout(MemberMsg::Start { seq, deadline }, limit).await) });
        }
        hook(Phase::Started, &pids);
        let n = refs.len();
        let started = self.runtime.block_on(async {
            let mut out: Vec<Option<Answer>> = (0..n).map(|_| None).collect();
            let mut aborted = false;
            while let Some(joined) = set.join_next().await {
                let Ok((i, r)) = joined else { continue };
                if r.is_err() && !aborted {
                    // One member failed or died: stop everyone's data plane
                    // now rather than at the deadline.
                    aborted = true;
                    for (_, a) in &refs {
                        let _ = a.try_tell(AbortMsg::Abort { seq, reason: "another member failed".into() });
                    }
                }
                out[i] = Some(r.map_err(|e| call_error(&e)));
            }
            out.into_iter().map(|r| r.unwrap_or_else(|| Err(format!("no answer within {limit:?}")))).collect::<Vec<_>>()
        });
        let wall = t.elapsed();
        if let Some(e) = self.first_error(&started) {
            self.notice_deaths();
            return Err(e);
        }
        let mut outcome = RefitOutcome { seq, wall, ..RefitOutcome::default() };
        for r in started.into_iter().flatten() {
            if let MemberReply::Done(w) = r {
                outcome.bytes += w.sent_bytes;
                outcome.slowest_worker = outcome.slowest_worker.max(Duration::from_nanos(w.elapsed_ns));
            }
        }
        let committing = {
            let _guard = self.runtime.enter();
            let mut set = JoinSet::new();
            for (i, (m, _)) in refs.iter().enumerate() {
                let m = m.clone();
                set.spawn(async move { (i, m.call_timeout(MemberMsg::Commit { seq }, setup).await) });
            }
            set
        };
        hook(Phase::Committing, &pids);
        let committed = self.runtime.block_on(collect(committing, n));
        if let Some(e) = self.first_error(&committed) {
            self.notice_deaths();
            return Err(e);
        }
        for r in committed.into_iter().flatten() {
            if let MemberReply::Done(w) = r {
                if let Some(v) = w.verified {
                    outcome.verified = Some(outcome.verified.unwrap_or(0) + v);
                }
            }
        }
        Ok(outcome)
    }

    fn abort_all(&self, seq: u64, reason: &str) {
        for l in &self.links {
            let _ = l.aborter.try_tell(AbortMsg::Abort { seq, reason: reason.into() });
        }
    }

    /// Checks every worker's committed weights, element by element, against
    /// the version each says it committed (source workers and dead workers
    /// report nothing committed).
    pub fn check(&mut self) -> Result<Vec<Committed>, ClusterError> {
        self.notice_deaths();
        let results = self.call_all(|_| MemberMsg::Check, self.config.setup_timeout);
        let mut out = Vec::new();
        for (r, l) in results.into_iter().zip(&self.links) {
            match r {
                Ok(MemberReply::Checked { version, elements, mismatch }) => out.push(Committed { version, elements, torn: mismatch }),
                Ok(other) => return Err(ClusterError::Worker { who: l.who(), error: format!("unexpected answer {other:?}") }),
                // A dead worker serves nothing, torn or not.
                Err(_) if l.dead.is_some() => out.push(Committed::default()),
                Err(e) => return Err(ClusterError::Worker { who: l.who(), error: e }),
            }
        }
        Ok(out)
    }

    /// Checks that every destination holds exactly weights version
    /// `version`; returns the elements checked.
    pub fn expect_committed(&mut self, version: u64) -> Result<u64, ClusterError> {
        let checked = self.check()?;
        for (c, l) in checked.iter().zip(&self.links) {
            let holds_weights = l.ranks.iter().any(|e| e.group == Group::Dst);
            if let Some(torn) = &c.torn {
                return Err(ClusterError::Worker { who: l.who(), error: format!("committed weights are torn: {torn}") });
            }
            if holds_weights && c.version != Some(version) {
                return Err(ClusterError::Worker { who: l.who(), error: format!("committed version {:?}, not {version}", c.version) });
            }
        }
        Ok(checked.iter().map(|c| c.elements).sum())
    }

    /// Tells every worker to exit and waits for the spawned ones.
    pub fn shutdown(mut self) {
        let _ = self.call_all(|_| MemberMsg::Shutdown, Duration::from_secs(2));
        let until = Instant::now() + Duration::from_secs(5);
        for l in &mut self.links {
            if let Some(c) = &mut l.child {
                while Instant::now() < until {
                    if let Ok(Some(_)) = c.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        self.node.shutdown();
        // Dropping the links kills whatever did not exit in time.
    }
}

type Answer = Result<MemberReply, String>;

/// Sends SIGKILL to process `pid` (through `kill -9`, no libc binding).
pub fn kill_pid(pid: u32) {
    let _ = Command::new("kill").arg("-9").arg(pid.to_string()).stdout(Stdio::null()).stderr(Stdio::null()).status();
}

async fn collect(mut set: JoinSet<(usize, Result<MemberReply, CallError>)>, n: usize) -> Vec<Answer> {
    let mut out: Vec<Option<Answer>> = (0..n).map(|_| None).collect();
    while let Some(joined) = set.join_next().await {
        if let Ok((i, r)) = joined {
            out[i] = Some(r.map_err(|e| call_error(&e)));
        }
    }
    out.into_iter().map(|r| r.unwrap_or_else(|| Err("the call's task was lost".into()))).collect()
}

/// A call error in words: the handler's message as it is, otherwise what
/// happened to the call.
fn call_error(e: &CallError) -> String {
    match e {
        CallError::Handler { error, .. } => error.to_string(),
        CallError::Stopped { reason, .. } => format!("died ({reason})"),
        CallError::Timeout { after, .. } => format!("no answer within {after:?}"),
    }
}
