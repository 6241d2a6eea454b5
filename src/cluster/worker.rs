//! One worker process: hosts one rank, or every rank of one node, for as
//! many refits as the launcher asks.
//!
//! Per refit the worker fills its source shards with the asked weights
//! version, opens fresh data-plane listeners (a new epoch: nothing of a
//! failed refit can leak into the next), connects to exactly the peers its
//! programs exchange with, runs its ranks as threads and reports. A
//! destination rank writes into staging memory; `Commit` swaps staging and
//! the committed copy, so a failed refit never touches what was committed.

use super::wire::{recv, send, ToLauncher, ToWorker, WorkerReport};
use reshard::{plan_fingerprint, Endpoint, Group, Layout, PlanOptions, RankProgram, Strategy};
use std::collections::{BTreeSet, HashMap};
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};
use transport::tcp::{TcpConfig, TcpTransport};
use transport::{fill_source_rank_at, run_threads, verify_destination_rank_at, ExecOptions, RankMemory};

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

/// What one worker is: which files, which ranks, where to meet.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Which ranks it hosts.
    pub hosted: Hosted,
    /// The rendezvous (launcher control) address.
    pub rendezvous: SocketAddr,
    /// Planner options (must match the launcher's; checked by fingerprint).
    pub options: PlanOptions,
    /// Data-plane deadline of one refit.
    pub deadline: Duration,
    /// Data-plane settings.
    pub tcp: TcpConfig,
}

/// The programs and memory of the worker's ranks under one strategy.
struct Installed {
    programs: Vec<RankProgram>,
    /// Staging memory (what the data plane writes), per rank.
    memory: Vec<RankMemory>,
    /// Weights version in the source shards.
    filled: Option<u64>,
}

/// A refit in progress.
struct Pending {
    seq: u64,
    strategy: Strategy,
    version: u64,
    verify: bool,
    listeners: Vec<TcpListener>,
    transports: Vec<TcpTransport>,
}

struct Worker<'l> {
    config: &'l WorkerConfig,
    src: &'l Layout,
    dst: &'l Layout,
    ranks: Vec<Endpoint>,
    installed: HashMap<Strategy, Installed>,
    pending: Option<Pending>,
    /// Committed destination memory per rank (same order as `ranks`; empty
    /// for source ranks) and its version.
    committed: Vec<RankMemory>,
    committed_version: Option<u64>,
    local_ip: std::net::IpAddr,
}

/// How long a worker waits for its launcher's next message before it
/// concludes the launcher is gone.
const IDLE: Duration = Duration::from_secs(3600);

/// Runs one worker until the launcher says `Shutdown` or goes away.
pub fn run_worker(config: &WorkerConfig, src: &Layout, dst: &Layout) -> Result<(), String> {
    let ranks = config.hosted.endpoints(src, dst)?;
    let mut control =
        TcpStream::connect(config.rendezvous).map_err(|e| format!("cannot reach the rendezvous {}: {e}", config.rendezvous))?;
    control.set_nodelay(true).map_err(|e| e.to_string())?;
    // Listen on the interface that reaches the rendezvous (loopback for a
    // local launch, the node's address on a cluster).
    let local_ip = control.local_addr().map_err(|e| e.to_string())?.ip();
    let fp = |s| plan_fingerprint(src, dst, &config.options, s).0;
    let hello = ToLauncher::Hello { ranks: ranks.clone(), pid: std::process::id(), reshard: fp(Strategy::Reshard), baseline: fp(Strategy::Baseline) };
    send(&mut control, &hello).map_err(|e| format!("rendezvous {}: {e}", config.rendezvous))?;
    let mut worker = Worker {
        config,
        src,
        dst,
        committed: vec![RankMemory::default(); ranks.len()],
        ranks,
        installed: HashMap::new(),
        pending: None,
        committed_version: None,
        local_ip,
    };
    loop {
        let msg = match recv::<ToWorker>(&mut control, IDLE) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err("the launcher went away".into()),
            Err(e) => return Err(format!("control stream: {e}")),
        };
        let reply = match msg {
            ToWorker::Shutdown => return Ok(()),
            ToWorker::Install { strategy, programs } => {
                worker.install(strategy, programs).map(|()| ToLauncher::Ready { seq: 0, addrs: Vec::new() })
            }
            ToWorker::Prepare { seq, strategy, version, verify } => worker.prepare(seq, strategy, version, verify),
            ToWorker::Connect { seq, table } => worker.connect(seq, &table),
            ToWorker::Start { seq } => worker.start(seq),
            ToWorker::Commit { seq } => worker.commit(seq),
            ToWorker::Check { version } => worker.check(version),
        };
        let reply = reply.unwrap_or_else(|(seq, error)| {
            worker.pending = None;
            ToLauncher::Failed { seq, error }
        });
        send(&mut control, &reply).map_err(|e| format!("control stream: {e}"))?;
    }
}

type Step = Result<ToLauncher, (u64, String)>;

impl Worker<'_> {
    fn install(&mut self, strategy: Strategy, programs: Vec<RankProgram>) -> Result<(), (u64, String)> {
        let fail = |e: String| (0, e);
        let want = plan_fingerprint(self.src, self.dst, &self.config.options, strategy);
        let got: Vec<Endpoint> = programs.iter().map(|p| p.endpoint).collect();
        if got != self.ranks {
            return Err(fail(format!("programs for {got:?}, but this worker hosts {:?}", self.ranks)));
        }
        if let Some(p) = programs.iter().find(|p| p.fingerprint != want) {
            return Err(fail(format!("{}: program fingerprint {} differs from this worker's layouts ({want})", p.endpoint, p.fingerprint)));
        }
        let memory = programs.iter().map(|p| RankMemory::for_buffers(&p.buffers)).collect();
        self.installed.insert(strategy, Installed { programs, memory, filled: None });
        Ok(())
    }

    fn prepare(&mut self, seq: u64, strategy: Strategy, version: u64, verify: bool) -> Step {
        let fail = |e: String| (seq, e);
        let (src, ranks) = (self.src, &self.ranks);
        let inst = self.installed.get_mut(&strategy).ok_or_else(|| fail(format!("no {strategy} programs installed")))?;
        if inst.filled != Some(version) {
            for (e, m) in ranks.iter().zip(&mut inst.memory).filter(|(e, _)| e.group == Group::Src) {
                fill_source_rank_at(src, e.rank, version, m);
            }
            inst.filled = Some(version);
        }
        if verify {
            // Nothing of an earlier refit may pass for this one's result.
            for (_, m) in ranks.iter().zip(&mut inst.memory).filter(|(e, _)| e.group == Group::Dst) {
                m.buffers.iter_mut().for_each(|b| b.fill(0));
            }
        }
        let mut listeners = Vec::new();
        let mut addrs = Vec::new();
        for &e in ranks {
            let l = TcpListener::bind((self.local_ip, 0)).map_err(|err| fail(format!("{e}: cannot listen on {}: {err}", self.local_ip)))?;
            addrs.push((e, l.local_addr().map_err(|err| fail(err.to_string()))?.to_string()));
            listeners.push(l);
        }
        self.pending = Some(Pending { seq, strategy, version, verify, listeners, transports: Vec::new() });
        Ok(ToLauncher::Ready { seq, addrs })
    }

    fn pending(&mut self, seq: u64) -> Result<&mut Pending, (u64, String)> {
        match &mut self.pending {
            Some(p) if p.seq == seq => Ok(p),
            _ => Err((seq, format!("refit {seq} was not prepared"))),
        }
    }

    fn connect(&mut self, seq: u64, table: &[(Endpoint, String)]) -> Step {
        let fail = |e: String| (seq, e);
        let mut addrs = HashMap::new();
        for (e, a) in table {
            addrs.insert(*e, a.parse::<SocketAddr>().map_err(|err| fail(format!("{e}: bad data address {a}: {err}")))?);
        }
        let pending = self.pending(seq)?;
        let strategy = pending.strategy;
        let listeners = std::mem::take(&mut pending.listeners);
        let programs = &self.installed[&strategy].programs;
        // Each rank connects to exactly the peers its program exchanges
        // with, all ranks at once (they may be each other's peers).
        let mut wanted = Vec::new();
        for p in programs {
            let mut peers = BTreeSet::new();
            for r in &p.rounds {
                peers.extend(r.sends.iter().map(|m| m.peer));
                peers.extend(r.recvs.iter().map(|m| m.peer));
            }
            let list: Vec<(Endpoint, SocketAddr)> = peers
                .into_iter()
                .map(|e| addrs.get(&e).map(|a| (e, *a)).ok_or_else(|| fail(format!("{}: no data address for its peer {e}", p.endpoint))))
                .collect::<Result<_, _>>()?;
            wanted.push(list);
        }
        let tcp = self.config.tcp;
        let results: Vec<io::Result<TcpTransport>> = std::thread::scope(|s| {
            let handles: Vec<_> = programs
                .iter()
                .zip(listeners)
                .zip(&wanted)
                .map(|((p, l), peers)| s.spawn(move || TcpTransport::connect(p.endpoint, l, peers, &tcp)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(io::Error::other("connect thread panicked")))).collect()
        });
        let transports = results.into_iter().collect::<io::Result<Vec<_>>>().map_err(|e| fail(format!("data plane: {e}")))?;
        self.pending(seq)?.transports = transports;
        Ok(ToLauncher::Ready { seq, addrs: Vec::new() })
    }

    fn start(&mut self, seq: u64) -> Step {
        let fail = |e: String| (seq, e);
        let p = self.pending(seq)?;
        let strategy = p.strategy;
        let transports = std::mem::take(&mut p.transports);
        let inst = self.installed.get_mut(&strategy).ok_or_else(|| fail("not installed".into()))?;
        let t = Instant::now();
        let report = run_threads(&inst.programs, &mut inst.memory, &ExecOptions { deadline: self.config.deadline }, transports)
            .map_err(|e| fail(e.to_string()))?;
        let elapsed = t.elapsed();
        Ok(ToLauncher::Done(Box::new(WorkerReport { seq, sent_bytes: report.bytes, elapsed_ns: elapsed.as_nanos() as u64, verified: None })))
    }

    /// Makes refit `seq`'s destination memory the committed version (after
    /// checking every element, if the refit was prepared with `verify`):
    /// the staging buffers and the committed ones swap (the old committed
    /// buffers become staging, fully rewritten by the next refit).
    fn commit(&mut self, seq: u64) -> Step {
        let fail = |e: String| (seq, e);
        let p = self.pending.take().filter(|p| p.seq == seq).ok_or_else(|| fail(format!("refit {seq} is not the one in progress")))?;
        let inst = self.installed.get_mut(&p.strategy).ok_or_else(|| fail("not installed".to_string()))?;
        let mut verified = None;
        if p.verify {
            let mut n = 0;
            for (e, m) in self.ranks.iter().zip(&inst.memory).filter(|(e, _)| e.group == Group::Dst) {
                n += verify_destination_rank_at(self.src, self.dst, e.rank, p.version, m).map_err(|err| fail(err.to_string()))?;
            }
            verified = Some(n);
        }
        for ((e, staging), committed) in self.ranks.iter().zip(&mut inst.memory).zip(&mut self.committed) {
            if e.group == Group::Dst {
                // Layout buffers come first and are the same under every
                // strategy; scratch buffers (baseline) are not weights.
                let n = self.dst.buffers()[e.rank as usize].len();
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
        Ok(ToLauncher::Done(Box::new(WorkerReport { seq, verified, ..WorkerReport::default() })))
    }

    /// Checks that every committed destination element is exactly that of
    /// weights version `version`.
    fn check(&mut self, version: u64) -> Step {
        let fail = |e: String| (0, e);
        if self.ranks.iter().any(|e| e.group == Group::Dst) && self.committed_version != Some(version) {
            return Err(fail(format!("committed version is {:?}, not {version}", self.committed_version)));
        }
        let mut n = 0;
        for (e, m) in self.ranks.iter().zip(&self.committed).filter(|(e, _)| e.group == Group::Dst) {
            n += verify_destination_rank_at(self.src, self.dst, e.rank, version, m).map_err(|err| fail(err.to_string()))?;
        }
        Ok(ToLauncher::Done(Box::new(WorkerReport { verified: Some(n), ..WorkerReport::default() })))
    }
}
