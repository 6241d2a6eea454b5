//! The launcher's side: a [`Cluster`] of worker processes (started here, or
//! by a cluster launcher such as srun) whose members the one
//! [`orchestrator`] drives. The launcher only starts processes, steps the
//! sources to a weights version, asks the orchestrator to refit, checks the
//! destinations, and replaces processes that died.

mod replicas;

pub use replicas::{RefitAndReplica, ReplicaConfig};

use super::worker::{group_name, pattern_name, FaultSpec, PatternMsg, PatternRank, PatternReply};
use super::{ControlSecret, PerProcess, IDLE_THREAD};
use crate::netns::{Hosts as NetHosts, NetnsConfig, NodeSpec};
use crate::procs::Children;
use actors::{ActorGroup, ActorRef, CallError};
use orchestrator::rendezvous::ControlConfig;
use orchestrator::{
    member_name, spawn_orchestrator, Fabric, Member, MemberMsg, NodeFabric, OrchestratorConfig, OrchestratorHandle, RefitError,
    RefitReport, RefitStep, Rendezvous,
};
use replicas::Replicas;
use reshard::{Endpoint, Group, Layout, PlanOptions, Strategy};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::runtime::Runtime;

/// How to start a cluster and run its refits.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Source layout file (passed to spawned workers).
    pub src_path: PathBuf,
    /// Destination layout file.
    pub dst_path: PathBuf,
    /// Planner options.
    pub options: PlanOptions,
    /// Reshard or the gather-broadcast baseline.
    pub strategy: Strategy,
    /// Where the rendezvous listens (`127.0.0.1:0` for a local launch).
    pub bind: SocketAddr,
    /// Start the workers as child processes running this program
    /// (`Some(exe)`), or wait for workers started by someone else (`None`:
    /// a cluster launcher runs `refit worker` per task).
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
    /// Data-plane settings (checksums, link emulation, connect timeout).
    pub fabric: NodeFabric,
    /// A control connection silent for this long is dead.
    pub heartbeat_timeout: Duration,
    /// Keep members' data-plane connections between refits of one plan
    /// ([`OrchestratorConfig::keep_data_plane`]).
    pub keep_data_plane: bool,
    /// The orchestrator's digest check before every commit
    /// ([`OrchestratorConfig::digest_check`]).
    pub digest_check: bool,
    /// Run every node on an emulated host of its own (a network namespace
    /// whose link the kernel shapes; spawned workers only): the rendezvous
    /// then listens on the hosts' bridge, on `bind`'s port.
    pub netns: Option<NetnsConfig>,
    /// The destination group as replicas of the layout in `dst_path`,
    /// which come and go between refits (`None`: `dst_path` is the whole
    /// group's layout, fixed).
    pub replicas: Option<ReplicaConfig>,
}

/// Why a cluster operation failed.
#[derive(Debug, Error)]
pub enum ClusterError {
    /// The cluster could not be set up (or a worker could not be replaced).
    #[error("{0}")]
    Setup(String),
    /// The refit failed; every destination still serves its last committed version.
    #[error(transparent)]
    Refit(#[from] RefitError),
    /// A source could not be stepped to the refit's version.
    #[error("{who}: {problem}")]
    Step {
        /// The rank.
        who: Endpoint,
        /// What went wrong.
        problem: String,
    },
    /// A destination does not serve exactly the version it should.
    #[error("{who}: {problem}")]
    Check {
        /// The rank.
        who: Endpoint,
        /// What is wrong.
        problem: String,
    },
}

/// What one refit across the cluster did.
#[derive(Debug, Clone)]
pub struct RefitOutcome {
    /// The orchestrator's report.
    pub report: RefitReport,
    /// Destination elements checked after the commit (if asked).
    pub verified: Option<u64>,
}

/// What one destination serves, as checked element by element.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Committed {
    /// The rank.
    pub endpoint: Endpoint,
    /// The committed version (0: nothing committed yet); `None` if the rank
    /// could not be asked (a dead worker).
    pub version: Option<u64>,
    /// Elements checked.
    pub elements: u64,
    /// The first element that does not match `version`: a torn version.
    pub torn: Option<String>,
    /// Why the rank could not be asked, when `version` is `None`.
    pub unreachable: Option<String>,
}

/// A worker process as the launcher sees it.
#[derive(Clone, Debug)]
pub struct WorkerInfo {
    /// Its ranks.
    pub ranks: Vec<Endpoint>,
    /// Its process id (0: not started here, or not running).
    pub pid: u32,
    /// Its node (group, index).
    pub node: (Group, u32),
}

/// Something done to the cluster when a refit reaches a step, a while
/// after (chaos testing).
pub struct Disruption {
    /// The step.
    pub step: RefitStep,
    /// How long after the step began.
    pub after: Duration,
    /// What is done.
    pub action: Disrupt,
}

/// What a [`Disruption`] does.
pub enum Disrupt {
    /// SIGKILL to a worker (its index, [`Cluster::workers`]).
    Kill(usize),
    /// SIGSTOP to a worker: it lives on, but reads and answers nothing.
    Stop(usize),
    /// Anything else (cut a link, partition a host): a short blocking call.
    Run(Box<dyn FnOnce() + Send>),
}

/// The ranks of one worker process.
#[derive(Clone, Debug)]
struct Host {
    /// Its ranks (none once retired).
    ranks: Vec<Endpoint>,
    /// Arguments after `refit` that start it.
    args: Vec<String>,
    /// Its node.
    node: (Group, u32),
    /// The network namespace of its emulated host, if any.
    netns: Option<String>,
    /// The replica it hosts ranks of, and their ranks in the replica.
    replica: Option<(String, Vec<u32>)>,
    /// Stopped for good: its replica left the group.
    retired: bool,
}

/// A running set of workers covering every rank of both layouts, and the
/// orchestrator over their members.
pub struct Cluster {
    config: ClusterConfig,
    src: Layout,
    dst: Layout,
    // Field order is drop order: the orchestrator and handles before the
    // rendezvous, the rendezvous (whose closing ends the workers) before
    // the children are killed, the runtime last.
    orchestrator: OrchestratorHandle,
    members: [Vec<ActorRef<Member>>; 2],
    patterns: Vec<(Endpoint, ActorRef<PatternRank>)>,
    rendezvous: Rendezvous,
    children: Option<Children>,
    /// Emulated hosts, removed once their workers are gone.
    net: Option<NetHosts>,
    hosts: Vec<Host>,
    /// How long the orchestrator took to answer the last refit (`None` if
    /// the last refit failed before asking it).
    last_call: Option<Duration>,
    /// The destination group's replicas ([`ClusterConfig::replicas`]).
    replicas: Option<Replicas>,
    runtime: Runtime,
}

/// `refit worker` and the arguments every worker takes: the layout
/// files, the planner's staging limit, the heartbeat timeout.
fn worker_args(config: &ClusterConfig) -> Vec<String> {
    let mut args = vec!["worker".to_string()];
    args.extend(["--src".into(), config.src_path.display().to_string(), "--dst".into(), config.dst_path.display().to_string()]);
    if config.options.max_staging_bytes != PlanOptions::default().max_staging_bytes {
        args.extend(["--max-staging-mib".into(), (config.options.max_staging_bytes >> 20).to_string()]);
    }
    // Both ends of a control connection must wait as long for a silent
    // peer (dozens of processes on a few cores starve heartbeats).
    args.extend(["--heartbeat-timeout-ms".into(), config.heartbeat_timeout.as_millis().to_string()]);
    args
}

/// The worker hosting `ranks` of `node`: on its emulated host, if any, in
/// whose namespace it runs.
fn place(ranks: Vec<Endpoint>, args: Vec<String>, node: (Group, u32), net: Option<&NetHosts>) -> Host {
    let emulated = net.and_then(|n| n.host(node.0, node.1));
    Host { ranks, args, node, netns: emulated.map(|h| h.netns.clone()), replica: None, retired: false }
}

/// The workers of both groups (of the sources only when the destination
/// group is made of replicas: those are started replica by replica).
fn hosts(config: &ClusterConfig, src: &Layout, dst: &Layout, net: Option<&NetHosts>) -> Vec<Host> {
    let host = |ranks, args, node| place(ranks, args, node, net);
    let groups: &[(Group, &Layout)] =
        if config.replicas.is_some() { &[(Group::Src, src)] } else { &[(Group::Src, src), (Group::Dst, dst)] };
    let mut out = Vec::new();
    for &(g, l) in groups {
        let rpn = l.ranks_per_node().max(1);
        match config.per_process {
            PerProcess::Rank => {
                for r in 0..l.ranks() {
                    let mut args = worker_args(config);
                    args.extend(["--group".into(), group_name(g).into(), "--rank".into(), r.to_string()]);
                    out.push(host(vec![Endpoint { group: g, rank: r }], args, (g, r / rpn)));
                }
            }
            PerProcess::Node => {
                for n in 0..l.nodes() {
                    let first = n * rpn;
                    let last = (first + rpn).min(l.ranks());
                    let mut args = worker_args(config);
                    args.extend(["--group".into(), group_name(g).into(), "--node".into(), n.to_string()]);
                    out.push(host((first..last).map(|r| Endpoint { group: g, rank: r }).collect(), args, (g, n)));
                }
            }
        }
    }
    out
}

/// The emulated hosts `config.netns` asks for, if any: a namespace per
/// node of `src` and of `dst` (with replicas, of the most replicas the
/// group may have).
fn emulated_hosts(
    config: &ClusterConfig,
    src: &Layout,
    dst: &Layout,
    replicas: Option<&Replicas>,
) -> Result<Option<NetHosts>, ClusterError> {
    let hosted_dst = match replicas {
        Some(r) => r.most_layout()?,
        None => dst.clone(),
    };
    match &config.netns {
        Some(_) if config.spawn.is_none() => Err(setup("emulated hosts (--netns) need workers started here")),
        Some(n) => Ok(Some(NetHosts::create(n, &NodeSpec::of(src, &hosted_dst)).map_err(setup)?)),
        None => Ok(None),
    }
}

/// Starts a worker process per host when `config` asks for workers started
/// here; `None` when they join from elsewhere.
fn spawn_workers(config: &ClusterConfig, rendezvous: SocketAddr, hosts: &[Host]) -> Result<Option<Children>, ClusterError> {
    let Some(exe) = &config.spawn else { return Ok(None) };
    let mut c = Children::new(exe, rendezvous, config.secret.text(), false);
    for h in hosts {
        c.spawn_in(h.args.clone(), h.netns.clone()).map_err(setup)?;
    }
    Ok(Some(c))
}

/// The orchestrator's configuration for the cluster's refits.
fn orchestrator_config(config: &ClusterConfig, replicas: Option<&Replicas>) -> OrchestratorConfig {
    OrchestratorConfig {
        fabric: Fabric::Node(config.fabric.clone()),
        mode: config.strategy,
        plan: config.options.clone(),
        deadline: config.refit_deadline,
        control_timeout: config.setup_timeout,
        keep_data_plane: config.keep_data_plane,
        digest_check: config.digest_check,
        delta: false,
        replica: replicas.map(|r| Arc::clone(&r.one)),
        ..OrchestratorConfig::default()
    }
}

fn setup(e: impl std::fmt::Display) -> ClusterError {
    ClusterError::Setup(e.to_string())
}

impl Cluster {
    /// Opens the rendezvous (telling `listening` its address), starts the
    /// workers if asked, waits until every rank has joined, and starts the
    /// orchestrator over their members. With
    /// [`ClusterConfig::replicas`], `dst` is one replica's layout.
    pub fn start(config: ClusterConfig, src: Layout, dst: Layout, listening: impl FnOnce(SocketAddr)) -> Result<Cluster, ClusterError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_keep_alive(IDLE_THREAD)
            .enable_all()
            .build()
            .map_err(|e| setup(format!("tokio: {e}")))?;
        let secret = config.secret.secret().map_err(setup)?;
        let control = ControlConfig { heartbeat_timeout: config.heartbeat_timeout, ..ControlConfig::default() };
        let mut replicas = config.replicas.map(|r| Replicas::new(dst.clone(), r)).transpose()?;
        let net = emulated_hosts(&config, &src, &dst, replicas.as_ref())?;
        let bind = net.as_ref().map_or(config.bind, |n| SocketAddr::new(n.gateway().into(), config.bind.port()));
        let rendezvous = runtime.block_on(Rendezvous::bind(secret, bind, &control)).map_err(setup)?;
        listening(rendezvous.addr());
        let mut hosts = hosts(&config, &src, &dst, net.as_ref());
        // The first replicas, in slots 0.., when started here.
        let mut names = Vec::new();
        if let (Some(r), Some(start), Some(_)) = (&mut replicas, config.replicas.map(|c| c.start), &config.spawn) {
            for slot in 0..start {
                let name = r.fresh_name();
                hosts.extend(replicas::replica_hosts(&config, &dst, &name, slot, net.as_ref()));
                names.push(name);
            }
        }
        let children = spawn_workers(&config, rendezvous.addr(), &hosts)?;
        let within = config.setup_timeout;
        let (members, patterns, mut joined) = runtime.block_on(async {
            let src_members = rendezvous.members(Group::Src, src.ranks(), within).await.map_err(setup)?;
            let mut joined = Vec::new();
            let dst_members = match (&mut replicas, config.replicas) {
                (Some(r), Some(c)) => {
                    let k = dst.ranks();
                    if names.is_empty() {
                        names = replicas::wait_for_replicas(&rendezvous, k, c.start, within).await?;
                        names.iter().for_each(|n| r.take_name(n));
                    }
                    for (slot, name) in names.iter().enumerate() {
                        let workers = (0..hosts.len()).filter(|&i| hosts[i].replica.as_ref().is_some_and(|(n, _)| n == name)).collect();
                        joined.push(replicas::join_replica(&rendezvous, name, k, slot as u32, workers, within).await?);
                    }
                    // The group starts as the first; the others are added.
                    rendezvous.replica_members(&names[0], k, within).await.map_err(setup)?
                }
                _ => rendezvous.members(Group::Dst, dst.ranks(), within).await.map_err(setup)?,
            };
            let mut patterns = Vec::new();
            for e in hosts.iter().flat_map(|h| h.ranks.iter().copied()) {
                patterns.push((e, rendezvous.lookup::<PatternRank>(&pattern_name(e), within).await.map_err(setup)?));
            }
            Ok::<_, ClusterError>(([src_members.refs().to_vec(), dst_members.refs().to_vec()], patterns, joined))
        })?;
        let orchestrator = {
            let _guard = runtime.enter();
            let oc = orchestrator_config(&config, replicas.as_ref());
            spawn_orchestrator(ActorGroup::from_refs(members[0].clone()), ActorGroup::from_refs(members[1].clone()), oc)
        };
        let mut cluster = Cluster {
            config,
            src,
            dst,
            orchestrator,
            members,
            patterns,
            rendezvous,
            children,
            net,
            hosts,
            last_call: None,
            replicas,
            runtime,
        };
        if !joined.is_empty() {
            let first = joined.remove(0);
            if let Some(r) = &mut cluster.replicas {
                r.live.push(first);
            }
            cluster.renumber()?;
            for replica in joined {
                cluster.admit(replica)?;
            }
        }
        Ok(cluster)
    }

    /// How long the orchestrator took to answer the last refit, failed or
    /// not (not counting stepping the sources or checking the
    /// destinations); `None` if the last refit failed before asking it.
    pub fn last_refit_call(&self) -> Option<Duration> {
        self.last_call
    }

    /// The layouts.
    pub fn layouts(&self) -> (&Layout, &Layout) {
        (&self.src, &self.dst)
    }

    /// The settings.
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// The orchestrator (to switch strategy, say).
    pub fn orchestrator(&self) -> &OrchestratorHandle {
        &self.orchestrator
    }

    /// Switches between reshard and baseline for the next refits.
    pub fn set_strategy(&mut self, strategy: Strategy) -> Result<(), ClusterError> {
        self.runtime.block_on(self.orchestrator.set_mode(strategy))?;
        self.config.strategy = strategy;
        Ok(())
    }

    /// The worker processes (pids only for those started here; a worker
    /// of a replica that left the group keeps its index, with no rank and
    /// pid 0).
    pub fn workers(&self) -> Vec<WorkerInfo> {
        let pids = self.children.as_ref().map(Children::pids).unwrap_or_default();
        self.hosts
            .iter()
            .enumerate()
            .map(|(i, h)| WorkerInfo {
                ranks: h.ranks.clone(),
                pid: pids.get(i).copied().filter(|_| !h.retired).unwrap_or(0),
                node: h.node,
            })
            .collect()
    }

    /// The emulated hosts the workers run on (`--netns`), if any.
    pub fn emulated_hosts(&self) -> Option<&NetHosts> {
        self.net.as_ref()
    }

    /// The largest peak resident memory among the running workers started
    /// here (`None` if there are none, or `/proc` does not tell).
    pub fn worker_peak_rss(&self) -> Option<u64> {
        self.workers().iter().filter(|w| w.pid != 0).filter_map(|w| crate::procs::peak_rss_of(&w.pid.to_string())).max()
    }

    /// Steps every source to the pattern of `version` (an optimizer step),
    /// refits it, and with `verify` checks every destination element of
    /// every destination afterwards.
    pub fn refit(&mut self, version: u64, verify: bool) -> Result<RefitOutcome, ClusterError> {
        self.refit_with(version, verify, &[], None)
    }

    /// [`refit`](Self::refit), with faults armed on some ranks' data plane
    /// for this refit, and a disruption (a worker killed, say) at a step.
    pub fn refit_with(
        &mut self,
        version: u64,
        verify: bool,
        faults: &[(Endpoint, FaultSpec)],
        disruption: Option<Disruption>,
    ) -> Result<RefitOutcome, ClusterError> {
        let timeout = self.config.setup_timeout;
        // Faults are armed in a fresh data plane's settings, and a
        // disruption while members open one needs one opened.
        let opens = disruption.as_ref().is_some_and(|d| matches!(d.step, RefitStep::Preparing | RefitStep::Connecting));
        if !faults.is_empty() || opens {
            self.runtime
                .block_on(self.orchestrator.close_data_plane())
                .map_err(|err| ClusterError::Setup(format!("closing the kept data plane: {err}")))?;
        }
        for (e, spec) in faults {
            let p = self.patterns.iter().find(|(x, _)| x == e).map(|(_, p)| p.clone());
            let p = p.ok_or_else(|| ClusterError::Setup(format!("no rank {e}")))?;
            self.runtime
                .block_on(p.call_timeout(PatternMsg::Arm(spec.clone()), timeout))
                .map_err(|err| ClusterError::Step { who: *e, problem: call_error(&err) })?;
        }
        let killer = disruption.and_then(|d| {
            let pid = |worker: usize| self.workers().get(worker).map(|w| w.pid).filter(|&p| p != 0);
            let action: Box<dyn FnOnce() + Send> = match d.action {
                Disrupt::Kill(worker) => {
                    let pid = pid(worker)?;
                    Box::new(move || kill_pid(pid))
                }
                Disrupt::Stop(worker) => {
                    let pid = pid(worker)?;
                    Box::new(move || signal_pid(pid, "STOP"))
                }
                Disrupt::Run(f) => f,
            };
            let mut phases = self.orchestrator.phases();
            let (step, after) = (d.step, d.after);
            Some(self.runtime.spawn(async move {
                if phases.wait_for(|p| p.step == step).await.is_ok() {
                    tokio::time::sleep(after).await;
                    // Inline (a few milliseconds of `kill` or `ip`): once
                    // begun it ends before the task does.
                    action();
                }
            }))
        });
        let r = self.refit_inner(version, verify);
        if let Some(k) = killer {
            k.abort();
            // Not pending afterwards: the caller may undo what it did.
            let _ = self.runtime.block_on(k);
        }
        r
    }

    fn refit_inner(&mut self, version: u64, verify: bool) -> Result<RefitOutcome, ClusterError> {
        self.last_call = None;
        let timeout = self.config.setup_timeout;
        let runtime = &self.runtime;
        runtime.block_on(async {
            let fills = self.patterns.iter().filter(|(e, _)| e.group == Group::Src).map(|(e, p)| async move {
                match p.call_timeout(PatternMsg::Fill { version }, timeout).await {
                    Ok(PatternReply::Filled { version: v }) if v == version => Ok(()),
                    Ok(other) => Err(ClusterError::Step { who: *e, problem: format!("answered {other:?}") }),
                    Err(err) => Err(ClusterError::Step { who: *e, problem: call_error(&err) }),
                }
            });
            for r in actors::join_all(fills).await {
                r?;
            }
            Ok::<_, ClusterError>(())
        })?;
        let asked = Instant::now();
        let report = self.runtime.block_on(self.orchestrator.refit(version));
        self.last_call = Some(asked.elapsed());
        // Replicas that left the group during the refit, committed or not.
        let dropped = match &report {
            Ok(r) => r.dropped_replicas.clone(),
            Err(RefitError::Refit(e)) => e.dropped_replicas().to_vec(),
            Err(_) => Vec::new(),
        };
        if !dropped.is_empty() {
            self.forget_dropped(&dropped)?;
        }
        let report = report?;
        let verified = if verify { Some(self.verify(version)?) } else { None };
        Ok(RefitOutcome { report, verified })
    }

    /// Checks that every destination serves exactly `version`; the
    /// elements checked.
    pub fn verify(&self, version: u64) -> Result<u64, ClusterError> {
        let mut n = 0;
        for c in self.check() {
            match (c.version, c.torn) {
                (_, Some(torn)) => return Err(ClusterError::Check { who: c.endpoint, problem: torn }),
                (Some(v), None) if v == version => n += c.elements,
                (None, None) => {
                    let why = c.unreachable.unwrap_or_default();
                    return Err(ClusterError::Check { who: c.endpoint, problem: format!("could not be checked: {why}") });
                }
                (Some(v), None) => {
                    return Err(ClusterError::Check { who: c.endpoint, problem: format!("serves version {v}, not {version}") })
                }
            }
        }
        Ok(n)
    }

    /// What every destination serves, checked element by element.
    pub fn check(&self) -> Vec<Committed> {
        let timeout = self.config.setup_timeout;
        self.runtime.block_on(async {
            let checks = self.patterns.iter().filter(|(e, _)| e.group == Group::Dst).map(|(e, p)| async move {
                match p.call_timeout(PatternMsg::Check, timeout).await {
                    Ok(PatternReply::Checked { version, elements, mismatch }) => {
                        Committed { endpoint: *e, version: Some(version), elements, torn: mismatch, unreachable: None }
                    }
                    Ok(other) => {
                        Committed { endpoint: *e, version: None, elements: 0, torn: None, unreachable: Some(format!("answered {other:?}")) }
                    }
                    Err(err) => Committed { endpoint: *e, version: None, elements: 0, torn: None, unreachable: Some(call_error(&err)) },
                }
            });
            actors::join_all(checks).await
        })
    }

    /// Indices of workers that are gone: exited, unreachable, or not
    /// answering within `within`.
    fn dead_workers(&mut self, within: Duration) -> Vec<usize> {
        let mut dead: Vec<usize> = self.children.as_mut().map(Children::exited).unwrap_or_default();
        let members = &self.members;
        let hosts = &self.hosts;
        let alive: Vec<bool> = self.runtime.block_on(async {
            // A retired worker has no rank: alive as far as this goes.
            let pings = hosts.iter().map(|h| async move {
                for e in &h.ranks {
                    let m = &members[usize::from(e.group == Group::Dst)][e.rank as usize];
                    if !m.is_alive() || m.call_timeout(MemberMsg::Version, within).await.is_err() {
                        return false;
                    }
                }
                true
            });
            actors::join_all(pings).await
        });
        dead.extend(alive.iter().enumerate().filter(|(_, a)| !**a).map(|(i, _)| i));
        dead.retain(|&i| !hosts[i].retired);
        dead.sort_unstable();
        dead.dedup();
        dead
    }

    /// Replaces every worker that died or stopped answering (restarting it
    /// when it was started here, else waiting for its replacement to join)
    /// and hands the orchestrator the new members; returns how many. A
    /// replica with a dead worker is replaced whole, by a fresh replica
    /// seeded from a serving one (workers started here), and replicas
    /// started elsewhere that joined since are added.
    pub fn recover(&mut self) -> Result<usize, ClusterError> {
        let dead = self.dead_workers(Duration::from_secs(2));
        // Sources (and fixed destinations) first: seeding a replica asks
        // every member of the groups for its status.
        let (of_replicas, rest): (Vec<usize>, Vec<usize>) = dead.iter().partition(|&&i| self.hosts[i].replica.is_some());
        if !rest.is_empty() {
            let ranks: Vec<Endpoint> = rest.iter().flat_map(|&i| self.hosts[i].ranks.iter().copied()).collect();
            if let Some(children) = &mut self.children {
                for &i in &rest {
                    children.restart(i).map_err(setup)?;
                }
            }
            self.rejoin(&ranks)?;
        }
        if !of_replicas.is_empty() {
            self.replace_replicas_of(&of_replicas)?;
        }
        self.adopt_joined()?;
        self.top_up()?;
        Ok(dead.len())
    }

    /// Waits up to `within` until some member is seen dead (its
    /// connection lost); how long that took.
    pub fn wait_for_death(&self, within: Duration) -> Option<Duration> {
        let t = Instant::now();
        while t.elapsed() < within {
            if self.members.iter().flatten().any(|m| !m.is_alive()) {
                return Some(t.elapsed());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    }

    /// Restarts worker `index`, with other layout files if given (chaos: a
    /// member that comes back wrong), and hands the orchestrator the new
    /// members.
    pub fn restart_worker(&mut self, index: usize, files: Option<(PathBuf, PathBuf)>) -> Result<(), ClusterError> {
        let host = self.hosts.get(index).cloned().ok_or_else(|| setup(format!("no worker {index}")))?;
        let mut args = host.args.clone();
        if let Some((s, d)) = &files {
            for (flag, path) in [("--src", s), ("--dst", d)] {
                if let Some(i) = args.iter().position(|a| a == flag) {
                    args[i + 1] = path.display().to_string();
                }
            }
        }
        if self.children.is_none() {
            return Err(setup("workers not started here cannot be restarted"));
        }
        if let Some(children) = &mut self.children {
            children.restart_with(index, args).map_err(setup)?;
        }
        self.rejoin(&host.ranks)
    }

    /// Looks up the members of `ranks` again (their replacements: the dead
    /// ones' registrations are forgotten, a replacement's that came first
    /// is kept) and hands the orchestrator the groups.
    fn rejoin(&mut self, ranks: &[Endpoint]) -> Result<(), ClusterError> {
        let within = self.config.setup_timeout;
        let rendezvous = &self.rendezvous;
        let found = self.runtime.block_on(async {
            let mut found = Vec::new();
            for e in ranks {
                let m = rendezvous.rejoin::<Member>(&member_name(e.group, e.rank), within).await.map_err(setup)?;
                let p = rendezvous.rejoin::<PatternRank>(&pattern_name(*e), within).await.map_err(setup)?;
                found.push((*e, m, p));
            }
            Ok::<_, ClusterError>(found)
        })?;
        for (e, m, p) in found {
            self.members[usize::from(e.group == Group::Dst)][e.rank as usize] = m;
            if let Some(slot) = self.patterns.iter_mut().find(|(x, _)| *x == e) {
                slot.1 = p;
            }
        }
        let (src_members, dst_members) = (ActorGroup::from_refs(self.members[0].clone()), ActorGroup::from_refs(self.members[1].clone()));
        self.runtime.block_on(self.orchestrator.attach(src_members, dst_members))?;
        Ok(())
    }

    /// Kills worker `index` with SIGKILL; its pid.
    pub fn kill_worker(&mut self, index: usize) -> Option<u32> {
        let pid = self.workers().get(index).map(|w| w.pid).filter(|&p| p != 0)?;
        kill_pid(pid);
        Some(pid)
    }

    /// Stops the orchestrator and the workers.
    pub fn shutdown(self) {
        let Cluster { orchestrator, members, patterns, rendezvous, children, net, runtime, .. } = self;
        orchestrator.actor().stop();
        drop((members, patterns));
        rendezvous.node().shutdown();
        if let Some(mut c) = children {
            // Workers leave by themselves once the rendezvous is gone.
            let until = Instant::now() + Duration::from_secs(2);
            while Instant::now() < until && c.exited().len() < c.pids().len() {
                std::thread::sleep(Duration::from_millis(10));
            }
            drop(c);
        }
        drop(rendezvous);
        drop(net);
        runtime.shutdown_timeout(Duration::from_secs(1));
    }
}

/// Sends SIGKILL to process `pid`.
pub fn kill_pid(pid: u32) {
    signal_pid(pid, "KILL");
}

/// Sends signal `name` (`KILL`, `STOP`) to process `pid` (through `kill`).
fn signal_pid(pid: u32, name: &str) {
    let _ = Command::new("kill").arg(format!("-{name}")).arg(pid.to_string()).stdout(Stdio::null()).stderr(Stdio::null()).status();
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
