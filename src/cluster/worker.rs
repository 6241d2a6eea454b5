//! One worker process: hosts one rank, or every rank of one node, as a
//! *member* actor served to the launcher over the authenticated remote-actor
//! control plane, for as many refits as the launcher asks.
//!
//! Per refit the member fills its source shards with the asked weights
//! version, opens fresh data-plane listeners (a new epoch: nothing of a
//! failed refit leaks into the next), connects to exactly the peers its
//! programs exchange with (shared memory within its node, TCP otherwise),
//! and runs its ranks as threads. Destination ranks write into *staging*
//! memory; `Commit` checks it (if asked) and swaps it with the committed
//! copy, so a failed refit never touches the committed weights, which the
//! rank keeps serving.
//!
//! The data plane runs on a thread of its own that owns the staging memory.
//! A separate *abort* actor can tear the refit down while the member waits
//! for it (shutting the data-plane sockets); if the data plane does not stop
//! within the grace period even then (an abort that hangs), the member
//! abandons that thread with its staging (allocating fresh staging) and
//! reports it: the caller is never blocked by a stuck transport.

use super::wire::{abort_name, member_name, AbortMsg, MemberMsg, MemberReply, Prepare, WorkerReport};
use actors::remote::{Node, NodeConfig, Registration, Registry, RegistryMsg, Secret, REGISTRY_NAME};
use actors::{async_trait, spawn, Actor, ActorError, Context, SpawnConfig};
use reshard::{plan_fingerprint, Endpoint, Fingerprint, Group, Layout, PlanOptions, RankProgram, Strategy};
use std::collections::{BTreeSet, HashMap};
use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use transport::tcp::TcpConfig;
use transport::{
    fill_source_rank_at, run_threads, verify_destination_rank_at, ExecOptions, LinkEmulation, NodeConfig as DataConfig, NodeTransport,
    RankMemory, WithAbort,
};

/// Which ranks a worker hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hosted {
    /// One rank.
    Rank(Endpoint),
    /// Every rank of node `n` of a group (`ranks_per_node` of its layout).
    Node(Group, u32),
}

impl Hosted {
    /// The ranks, checked against the layouts.
    pub fn endpoints(self, src: &Layout, dst: &Layout) -> Result<Vec<Endpoint>, String> {
        let layout = |g: Group| if g == Group::Src { src } else { dst };
        let name = |g: Group| if g == Group::Src { "src" } else { "dst" };
        match self {
            Hosted::Rank(e) if e.rank < layout(e.group).ranks() => Ok(vec![e]),
            Hosted::Rank(e) => Err(format!("{e}: the {} layout has {} ranks", name(e.group), layout(e.group).ranks())),
            Hosted::Node(g, n) => {
                let l = layout(g);
                if n >= l.nodes() {
                    return Err(format!("{} node {n}: the {} layout has {} nodes", name(g), name(g), l.nodes()));
                }
                let first = n * l.ranks_per_node();
                let last = (first + l.ranks_per_node()).min(l.ranks());
                Ok((first..last).map(|r| Endpoint { group: g, rank: r }).collect())
            }
        }
    }
}

/// What one worker is: which ranks, where to meet, how to authenticate.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Which ranks it hosts.
    pub hosted: Hosted,
    /// The launcher's control address (its node, which hosts the registry).
    pub rendezvous: SocketAddr,
    /// Planner options (must match the launcher's; checked by fingerprint).
    pub options: PlanOptions,
    /// The shared secret of the control plane.
    pub secret: Secret,
    /// How long a data plane may take to stop after an abort before it is
    /// abandoned.
    pub abort_grace: Duration,
    /// A control connection silent for this long is dead.
    pub heartbeat_timeout: Duration,
}

/// The programs and staging memory of the worker's ranks under one strategy.
struct Staging {
    programs: Arc<Vec<RankProgram>>,
    /// What the data plane writes, per rank (same order as the programs).
    memory: Vec<RankMemory>,
    /// Weights version in the source shards.
    filled: Option<u64>,
}

/// A refit in progress.
struct Pending {
    req: Prepare,
    listeners: Vec<TcpListener>,
    transports: Vec<NodeTransport>,
}

/// Tells one rank's peers it gave up and stops its transport.
type AbortFn = Box<dyn Fn(&str) + Send>;

/// Aborts the data plane of the refit running now, if any.
#[derive(Default)]
struct AbortSwitch {
    running: Option<(u64, Vec<AbortFn>)>,
}

type SharedSwitch = Arc<Mutex<AbortSwitch>>;

fn lock(s: &SharedSwitch) -> std::sync::MutexGuard<'_, AbortSwitch> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// The member actor: the worker's ranks, their programs and memory.
pub(crate) struct Member {
    src: Arc<Layout>,
    dst: Arc<Layout>,
    /// Plan fingerprints of these layouts (reshard, baseline), computed once.
    fingerprints: [Fingerprint; 2],
    ranks: Vec<Endpoint>,
    local_ip: IpAddr,
    programs: HashMap<Strategy, HashMap<Endpoint, RankProgram>>,
    staging: HashMap<Strategy, Staging>,
    pending: Option<Pending>,
    /// Committed destination memory per rank (same order as `ranks`; empty
    /// for source ranks) and its version.
    committed: Vec<RankMemory>,
    committed_version: Option<u64>,
    switch: SharedSwitch,
    abort_grace: Duration,
    shutdown: tokio::sync::watch::Sender<bool>,
}

fn failed(e: impl std::fmt::Display) -> ActorError {
    ActorError::Failed(e.to_string())
}

#[async_trait]
impl Actor for Member {
    type Msg = MemberMsg;
    type Reply = MemberReply;

    async fn handle(&mut self, msg: MemberMsg, _ctx: &mut Context<Self>) -> Result<MemberReply, ActorError> {
        match msg {
            MemberMsg::Describe => Ok(MemberReply::Hello {
                ranks: self.ranks.clone(),
                pid: std::process::id(),
                reshard: self.fingerprint(Strategy::Reshard).0,
                baseline: self.fingerprint(Strategy::Baseline).0,
            }),
            MemberMsg::Install { strategy, program } => self.install(strategy, *program),
            MemberMsg::Prepare(req) => {
                let r = tokio::task::block_in_place(|| self.prepare(req));
                self.forget_on_error(r)
            }
            MemberMsg::Connect { seq, table } => {
                let r = tokio::task::block_in_place(|| self.connect(seq, &table));
                self.forget_on_error(r)
            }
            MemberMsg::Start { seq, deadline } => {
                let r = self.start(seq, deadline).await;
                self.forget_on_error(r)
            }
            MemberMsg::Commit { seq } => {
                let r = tokio::task::block_in_place(|| self.commit(seq));
                self.forget_on_error(r)
            }
            MemberMsg::Check => tokio::task::block_in_place(|| self.check()),
            MemberMsg::Shutdown => {
                self.shutdown.send_replace(true);
                Ok(MemberReply::Ready { addrs: Vec::new() })
            }
        }
    }
}

impl Member {
    /// A failed step ends the refit in progress on this worker.
    fn forget_on_error(&mut self, r: Result<MemberReply, ActorError>) -> Result<MemberReply, ActorError> {
        if r.is_err() {
            self.pending = None;
        }
        r
    }

    fn fingerprint(&self, strategy: Strategy) -> Fingerprint {
        match strategy {
            Strategy::Reshard => self.fingerprints[0],
            Strategy::Baseline => self.fingerprints[1],
        }
    }

    fn install(&mut self, strategy: Strategy, program: RankProgram) -> Result<MemberReply, ActorError> {
        let want = self.fingerprint(strategy);
        if !self.ranks.contains(&program.endpoint) {
            return Err(failed(format!("a program for {}, which this worker does not host ({:?})", program.endpoint, self.ranks)));
        }
        if program.fingerprint != want {
            return Err(failed(format!(
                "{}: program fingerprint {} differs from this worker's layouts ({want})",
                program.endpoint, program.fingerprint
            )));
        }
        self.programs.entry(strategy).or_default().insert(program.endpoint, program);
        // A new program set replaces the staging built from the old one.
        self.staging.remove(&strategy);
        Ok(MemberReply::Ready { addrs: Vec::new() })
    }

    fn staging(&mut self, strategy: Strategy) -> Result<&mut Staging, ActorError> {
        match self.staging.entry(strategy) {
            std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(slot) => {
                let set = self.programs.get(&strategy).ok_or_else(|| failed(format!("no {strategy} programs installed")))?;
                let programs: Vec<RankProgram> = self
                    .ranks
                    .iter()
                    .map(|e| set.get(e).cloned().ok_or_else(|| failed(format!("no {strategy} program installed for {e}"))))
                    .collect::<Result<_, _>>()?;
                Ok(slot.insert(Staging { memory: fresh(&programs), programs: Arc::new(programs), filled: None }))
            }
        }
    }

    fn prepare(&mut self, req: Prepare) -> Result<MemberReply, ActorError> {
        let (strategy, version, verify) = (req.strategy, req.version, req.verify);
        let (src, ranks) = (Arc::clone(&self.src), self.ranks.clone());
        let st = self.staging(strategy)?;
        if st.filled != Some(version) {
            for (e, m) in ranks.iter().zip(&mut st.memory).filter(|(e, _)| e.group == Group::Src) {
                fill_source_rank_at(&src, e.rank, version, m);
            }
            st.filled = Some(version);
        }
        if verify {
            // Nothing of an earlier refit may pass for this one's result.
            for (_, m) in ranks.iter().zip(&mut st.memory).filter(|(e, _)| e.group == Group::Dst) {
                m.buffers.iter_mut().for_each(|b| b.fill(0));
            }
        }
        let mut listeners = Vec::new();
        let mut addrs = Vec::new();
        for &e in &ranks {
            let l =
                TcpListener::bind((self.local_ip, 0)).map_err(|err| failed(format!("{e}: cannot listen on {}: {err}", self.local_ip)))?;
            addrs.push((e, l.local_addr().map_err(failed)?.to_string()));
            listeners.push(l);
        }
        self.pending = Some(Pending { req, listeners, transports: Vec::new() });
        Ok(MemberReply::Ready { addrs })
    }

    fn pending(&mut self, seq: u64) -> Result<&mut Pending, ActorError> {
        match &mut self.pending {
            Some(p) if p.req.seq == seq => Ok(p),
            _ => Err(failed(format!("refit {seq} was not prepared on this worker"))),
        }
    }

    fn data_config(p: &Pending) -> DataConfig {
        let (data, f) = (&p.req.data, &p.req.data.faults);
        let tcp = TcpConfig {
            checksum: data.checksum,
            emulation: match data.emulation {
                Some((inter, intra)) => {
                    LinkEmulation { inter_node_bytes_per_s: Some(inter.max(1)), intra_node_bytes_per_s: Some(intra.max(1)), burst_bytes: 0 }
                }
                None => LinkEmulation::default(),
            },
            faults: transport::Faults {
                corrupt_frame: f.corrupt_frame,
                stall_at_frame: f.stall_at_frame,
                cut_at_frame: f.cut_at_frame,
                abort_hang: f.abort_hang,
            },
            connect_timeout: if data.connect_timeout.is_zero() { Duration::from_secs(5) } else { data.connect_timeout },
            ..TcpConfig::default()
        };
        DataConfig { session: p.req.session.clone(), tcp, ..DataConfig::default() }
    }

    fn connect(&mut self, seq: u64, table: &[(Endpoint, String)]) -> Result<MemberReply, ActorError> {
        let mut addrs = HashMap::new();
        for (e, a) in table {
            addrs.insert(*e, a.parse::<SocketAddr>().map_err(|err| failed(format!("{e}: bad data address {a}: {err}")))?);
        }
        let pending = self.pending(seq)?;
        let (strategy, config) = (pending.req.strategy, Self::data_config(pending));
        let listeners = std::mem::take(&mut pending.listeners);
        let programs = Arc::clone(&self.staging(strategy)?.programs);
        // Each rank connects to exactly the peers its program exchanges
        // with, all ranks at once (they may be each other's peers).
        let mut wanted = Vec::new();
        for p in programs.iter() {
            let mut peers = BTreeSet::new();
            for r in &p.rounds {
                peers.extend(r.sends.iter().map(|m| m.peer));
                peers.extend(r.recvs.iter().map(|m| m.peer));
            }
            let list: Vec<(Endpoint, SocketAddr)> = peers
                .into_iter()
                .map(|e| addrs.get(&e).map(|a| (e, *a)).ok_or_else(|| failed(format!("{}: no data address for its peer {e}", p.endpoint))))
                .collect::<Result<_, _>>()?;
            wanted.push(list);
        }
        let (src, dst) = (&self.src, &self.dst);
        let node_of = |e: Endpoint| match e.group {
            Group::Src => (Group::Src, src.node_of(e.rank)),
            Group::Dst => (Group::Dst, dst.node_of(e.rank)),
        };
        // A shared-memory region's lend area is reserved in memory as soon
        // as its pair talks: size it to the largest message this worker
        // sends inside its node (bigger ones stream through), not to the
        // default, or a node of 8 ranks would pin gigabytes.
        let largest = programs
            .iter()
            .flat_map(|p| {
                let home = node_of(p.endpoint);
                p.rounds.iter().flat_map(move |r| r.sends.iter().filter(move |m| node_of(m.peer) == home))
            })
            .map(|m| m.wire_bytes())
            .max()
            .unwrap_or(0);
        let mut config = config;
        config.shm.lend_bytes = largest.next_power_of_two().clamp(1 << 20, config.shm.lend_bytes);
        config.shm.stream_bytes = config.shm.stream_bytes.min(1 << 20);
        let results: Vec<io::Result<NodeTransport>> = std::thread::scope(|s| {
            let handles: Vec<_> = programs
                .iter()
                .zip(listeners)
                .zip(&wanted)
                .map(|((p, l), peers)| {
                    let config = &config;
                    s.spawn(move || NodeTransport::connect(p.endpoint, l, peers, node_of, config))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(io::Error::other("connect thread panicked")))).collect()
        });
        let transports = results.into_iter().collect::<io::Result<Vec<_>>>().map_err(|e| failed(format!("data plane: {e}")))?;
        self.pending(seq)?.transports = transports;
        Ok(MemberReply::Ready { addrs: Vec::new() })
    }

    async fn start(&mut self, seq: u64, deadline: Duration) -> Result<MemberReply, ActorError> {
        let p = self.pending(seq)?;
        let strategy = p.req.strategy;
        let transports = std::mem::take(&mut p.transports);
        let aborts: Vec<AbortFn> = transports.iter().map(|t| t.abort_all()).collect();
        let st = self.staging.remove(&strategy).ok_or_else(|| failed("no staging memory"))?;
        let (programs, mut memory, filled) = (st.programs, st.memory, st.filled);
        lock(&self.switch).running = Some((seq, aborts));
        let (tx, rx) = tokio::sync::oneshot::channel();
        let progs = Arc::clone(&programs);
        let spawned = std::thread::Builder::new().name(format!("refit-{seq}")).spawn(move || {
            let t = Instant::now();
            let r = run_threads(&progs, &mut memory, &ExecOptions { deadline }, transports);
            let _ = tx.send((r, t.elapsed(), memory));
        });
        if let Err(e) = spawned {
            lock(&self.switch).running = None;
            self.staging.insert(strategy, Staging { memory: fresh(&programs), programs, filled: None });
            return Err(failed(format!("cannot start the data plane: {e}")));
        }
        // The data plane stops by itself at its deadline; wait a grace
        // period beyond it, then abort it, then abandon it.
        let rx = Box::pin(rx);
        let outcome = match tokio::time::timeout(deadline + self.abort_grace, rx).await {
            Ok(r) => r.ok(),
            Err(_) => None,
        };
        let running = lock(&self.switch).running.take();
        match outcome {
            Some((result, elapsed, memory)) => {
                self.staging.insert(strategy, Staging { programs, memory, filled });
                let report = result.map_err(failed)?;
                Ok(MemberReply::Done(WorkerReport { sent_bytes: report.bytes, elapsed_ns: elapsed.as_nanos() as u64, verified: None }))
            }
            None => {
                if let Some((_, aborts)) = running {
                    // Abort from a thread of its own: an abort may hang.
                    let _ = std::thread::Builder::new().name("refit-abort".into()).spawn(move || aborts.iter().for_each(|a| a("deadline")));
                }
                self.staging.insert(strategy, Staging { memory: fresh(&programs), programs, filled: None });
                Err(failed(format!(
                    "the data plane of refit {seq} did not stop within {:?} of its deadline even after an abort; \
                     it was abandoned with its staging memory (the committed weights are untouched)",
                    self.abort_grace
                )))
            }
        }
    }

    /// Makes refit `seq`'s destination memory the committed version (after
    /// checking every element, if the refit was prepared with `verify`):
    /// the staging buffers and the committed ones swap (the old committed
    /// buffers become staging, fully rewritten by the next refit).
    fn commit(&mut self, seq: u64) -> Result<MemberReply, ActorError> {
        let p =
            self.pending.take().filter(|p| p.req.seq == seq).ok_or_else(|| failed(format!("refit {seq} is not the one in progress")))?.req;
        let (src, dst) = (Arc::clone(&self.src), Arc::clone(&self.dst));
        let st = self.staging.get_mut(&p.strategy).ok_or_else(|| failed("no staging memory"))?;
        let mut verified = None;
        if p.verify {
            let mut n = 0;
            for (e, m) in self.ranks.iter().zip(&st.memory).filter(|(e, _)| e.group == Group::Dst) {
                n += verify_destination_rank_at(&src, &dst, e.rank, p.version, m).map_err(failed)?;
            }
            verified = Some(n);
        }
        for ((e, staging), committed) in self.ranks.iter().zip(&mut st.memory).zip(&mut self.committed) {
            if e.group == Group::Dst {
                // Layout buffers come first and are the same under every
                // strategy; scratch buffers (baseline) are not weights.
                let n = dst.buffers()[e.rank as usize].len();
                if committed.buffers.len() != n {
                    *committed = RankMemory { buffers: staging.buffers[..n].to_vec(), dtypes: staging.dtypes[..n].to_vec() };
                } else {
                    for (c, s) in committed.buffers.iter_mut().zip(&mut staging.buffers) {
                        std::mem::swap(c, s);
                    }
                }
            }
        }
        self.committed_version = Some(p.version);
        Ok(MemberReply::Done(WorkerReport { verified, ..WorkerReport::default() }))
    }

    /// Checks that every committed destination element is exactly that of
    /// the committed version.
    fn check(&mut self) -> Result<MemberReply, ActorError> {
        let Some(version) = self.committed_version else {
            return Ok(MemberReply::Checked { version: None, elements: 0, mismatch: None });
        };
        let mut elements = 0;
        for (e, m) in self.ranks.iter().zip(&self.committed).filter(|(e, _)| e.group == Group::Dst) {
            match verify_destination_rank_at(&self.src, &self.dst, e.rank, version, m) {
                Ok(n) => elements += n,
                Err(bad) => return Ok(MemberReply::Checked { version: Some(version), elements, mismatch: Some(bad.to_string()) }),
            }
        }
        Ok(MemberReply::Checked { version: Some(version), elements, mismatch: None })
    }
}

fn fresh(programs: &[RankProgram]) -> Vec<RankMemory> {
    programs.iter().map(|p| RankMemory::for_buffers(&p.buffers)).collect()
}

/// The abort actor: aborts the running refit's data plane.
pub(crate) struct Aborter {
    switch: SharedSwitch,
}

#[async_trait]
impl Actor for Aborter {
    type Msg = AbortMsg;
    type Reply = bool;

    async fn handle(&mut self, msg: AbortMsg, _ctx: &mut Context<Self>) -> Result<bool, ActorError> {
        let AbortMsg::Abort { seq, reason } = msg;
        let mut s = lock(&self.switch);
        match s.running.take() {
            Some((running, aborts)) if running == seq => {
                drop(s);
                // Shutting the sockets down returns at once, but a faulty
                // transport's abort may hang: never on this task's thread.
                let _ = std::thread::Builder::new().name("refit-abort".into()).spawn(move || aborts.iter().for_each(|a| a(&reason)));
                Ok(true)
            }
            other => {
                s.running = other;
                Ok(false)
            }
        }
    }
}

/// The address of this machine's interface that reaches `to` (no packet is
/// sent).
fn local_ip_towards(to: SocketAddr) -> io::Result<IpAddr> {
    let any = if to.is_ipv4() { IpAddr::from([0u8; 4]) } else { IpAddr::from([0u16; 8]) };
    let any = SocketAddr::new(any, 0);
    let probe = std::net::UdpSocket::bind(any)?;
    probe.connect(to)?;
    Ok(probe.local_addr()?.ip())
}

/// Runs one worker until the launcher says `Shutdown` or goes away.
pub fn run_worker(config: WorkerConfig, src: Layout, dst: Layout) -> Result<(), String> {
    let ranks = config.hosted.endpoints(&src, &dst)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start tokio: {e}"))?;
    runtime.block_on(async move {
        let ip = local_ip_towards(config.rendezvous).map_err(|e| format!("no route to the rendezvous {}: {e}", config.rendezvous))?;
        let node = Node::bind(
            config.secret.clone(),
            NodeConfig {
                bind: SocketAddr::new(ip, 0),
                max_frame_bytes: 128 << 20,
                heartbeat_timeout: config.heartbeat_timeout,
                ..NodeConfig::default()
            },
        )
        .await
        .map_err(|e| e.to_string())?;
        let switch = SharedSwitch::default();
        let (shutdown, mut stop) = tokio::sync::watch::channel(false);
        let name = member_name(&ranks);
        let fp = |s| plan_fingerprint(&src, &dst, &config.options, s);
        let fingerprints = [fp(Strategy::Reshard), fp(Strategy::Baseline)];
        let member = Member {
            fingerprints,
            committed: vec![RankMemory::default(); ranks.len()],
            src: Arc::new(src),
            dst: Arc::new(dst),
            ranks,
            local_ip: ip,
            programs: HashMap::new(),
            staging: HashMap::new(),
            pending: None,
            committed_version: None,
            switch: Arc::clone(&switch),
            abort_grace: config.abort_grace,
            shutdown,
        };
        // Remote calls to a served actor wait for the reply at most its
        // default call timeout: the launcher bounds every call itself (a
        // refit may run for minutes), so this side must not cut it short.
        let member = spawn(member, SpawnConfig::default().name(name.clone()).call_timeout(Duration::from_secs(7 * 24 * 3600)));
        let aborter = spawn(Aborter { switch }, SpawnConfig::default().name(abort_name(&name)));
        node.serve(name.clone(), &member).map_err(|e| e.to_string())?;
        node.serve(abort_name(&name), &aborter).map_err(|e| e.to_string())?;
        let peer = node.connect(config.rendezvous).await.map_err(|e| format!("rendezvous {}: {e}", config.rendezvous))?;
        let registry = peer.lookup::<Registry>(REGISTRY_NAME).await.map_err(|e| format!("rendezvous {}: {e}", config.rendezvous))?;
        let registration = Registration { name: name.clone(), addr: node.advertised_addr(), info: member.info().clone() };
        registry.call(RegistryMsg::Register(registration)).await.map_err(|e| format!("rendezvous {}: {e}", config.rendezvous))?;
        // Serve until told to stop, or until the launcher goes away.
        let result = tokio::select! {
            _ = stop.wait_for(|s| *s) => Ok(()),
            why = peer.closed() => Err(format!("lost the launcher at {}: {why}", config.rendezvous)),
        };
        // Let the answer to `Shutdown` leave before the node closes.
        tokio::time::sleep(Duration::from_millis(50)).await;
        node.shutdown();
        result
    })
}
