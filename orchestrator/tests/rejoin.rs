//! Live members whose control connection broke come back by themselves.
//! Every member "process" here is a thread with a runtime of its own that
//! joins the rendezvous, so the test can freeze one (its runtime held up,
//! as a busy host or a stopped process holds it up) or cut its connection
//! to the rendezvous (a relay in between) while it lives on.

mod common;

use actors::{ActorGroup, Secret};
use orchestrator::rendezvous::ControlConfig;
use orchestrator::{
    join, member_name, spawn_orchestrator, DstStore, Fabric, JoinConfig, Member, NodeFabric, OrchestratorConfig, OrchestratorError,
    OrchestratorHandle, RefitError, Rendezvous, Role, SrcStore,
};
use reshard::{Endpoint, Group, Layout};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(1);

enum Store {
    Src(Arc<SrcStore>),
    Dst(Arc<DstStore>),
}

/// A member process: a thread running its own runtime, joined to the
/// rendezvous and serving one member.
struct Process {
    store: Store,
    /// Blocks the process's runtime until the sender is dropped (or sent to).
    freeze: tokio::sync::mpsc::UnboundedSender<std::sync::mpsc::Receiver<()>>,
    /// Set once `Joined::closed` returned (the process took the rendezvous for gone).
    left: Arc<AtomicBool>,
}

impl Process {
    fn start(config: JoinConfig, layout: Arc<Layout>, endpoint: Endpoint) -> Process {
        let (ready, ready_rx) = std::sync::mpsc::channel();
        let (freeze, mut frozen) = tokio::sync::mpsc::unbounded_channel::<std::sync::mpsc::Receiver<()>>();
        let left = Arc::new(AtomicBool::new(false));
        let gone = Arc::clone(&left);
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let joined = join(&config).await.unwrap();
                let store = match endpoint.group {
                    Group::Src => {
                        let s = Arc::new(SrcStore::new(&layout, endpoint.rank));
                        joined.serve_member(layout, endpoint.rank, Role::Src(s.clone())).await.unwrap();
                        Store::Src(s)
                    }
                    Group::Dst => {
                        let s = Arc::new(DstStore::new(&layout, endpoint.rank));
                        joined.serve_member(layout, endpoint.rank, Role::Dst(s.clone())).await.unwrap();
                        Store::Dst(s)
                    }
                };
                ready.send(store).unwrap();
                loop {
                    tokio::select! {
                        thaw = frozen.recv() => match thaw {
                            // The whole runtime waits here: nothing of this process runs.
                            Some(thaw) => { let _ = thaw.recv(); }
                            None => break,
                        },
                        _ = joined.closed() => {
                            gone.store(true, Ordering::SeqCst);
                            break;
                        }
                    }
                }
            });
        });
        Process { store: ready_rx.recv().unwrap(), freeze, left }
    }

    /// Holds the process's runtime up until the returned sender is dropped.
    fn freeze(&self) -> std::sync::mpsc::Sender<()> {
        let (thaw, thawed) = std::sync::mpsc::channel();
        self.freeze.send(thawed).unwrap();
        thaw
    }
}

/// A TCP relay to `to`: its connections can be cut (both sockets closed at
/// once, without a word) while it keeps accepting new ones.
struct Relay {
    addr: SocketAddr,
    links: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Relay {
    async fn start(to: SocketAddr) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let links: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let kept = Arc::clone(&links);
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await else { continue };
                let link = tokio::spawn(async move {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                });
                kept.lock().unwrap().push(link.abort_handle());
            }
        });
        Relay { addr, links }
    }

    /// Closes every connection through the relay; returns how many.
    fn cut(&self) -> usize {
        let links: Vec<_> = self.links.lock().unwrap().drain(..).collect();
        links.iter().for_each(tokio::task::AbortHandle::abort);
        links.len()
    }
}

struct Job {
    rendezvous: Rendezvous,
    relay: Relay,
    src: Vec<Process>,
    dst: Vec<Process>,
    src_members: ActorGroup<Member>,
    dst_members: ActorGroup<Member>,
    orchestrator: OrchestratorHandle,
}

/// Two source and four destination processes; each joins the rendezvous
/// through the relay.
async fn job() -> Job {
    let (src, dst) = common::layouts();
    let (src, dst) = (Arc::new(src), Arc::new(dst));
    let secret = Secret::random().unwrap();
    let control = ControlConfig { heartbeat_timeout: HEARTBEAT_TIMEOUT, rejoin_timeout: Duration::from_secs(30) };
    let rendezvous = Rendezvous::bind(secret.clone(), "127.0.0.1:0".parse().unwrap(), &control).await.unwrap();
    let relay = Relay::start(rendezvous.addr()).await;
    let config = JoinConfig { rendezvous: relay.addr, secret, control };
    let src_procs: Vec<Process> = (0..2).map(|r| Process::start(config.clone(), src.clone(), Endpoint::src(r))).collect();
    let dst_procs: Vec<Process> = (0..4).map(|r| Process::start(config.clone(), dst.clone(), Endpoint::dst(r))).collect();
    let src_members = rendezvous.members(Group::Src, 2, Duration::from_secs(10)).await.unwrap();
    let dst_members = rendezvous.members(Group::Dst, 4, Duration::from_secs(10)).await.unwrap();
    let orchestrator = spawn_orchestrator(
        src_members.clone(),
        dst_members.clone(),
        OrchestratorConfig {
            fabric: Fabric::Node(NodeFabric::default()),
            deadline: Duration::from_secs(10),
            control_timeout: Duration::from_secs(5),
            ..OrchestratorConfig::default()
        },
    );
    Job { rendezvous, relay, src: src_procs, dst: dst_procs, src_members, dst_members, orchestrator }
}

impl Job {
    /// Every source takes an optimizer step to `version`, every weight `value`.
    async fn step(&self, version: u64, value: f32) {
        for p in &self.src {
            let Store::Src(s) = &p.store else { unreachable!("sources hold source stores") };
            s.restore(version, |b| b.write_buffer_f32("params", &[value; 28]).unwrap()).await;
        }
    }

    /// The version each destination serves, if it serves one with every weight `value`.
    fn served(&self, value: f32) -> Vec<Option<u64>> {
        self.dst
            .iter()
            .map(|p| {
                let Store::Dst(s) = &p.store else { unreachable!("destinations hold destination stores") };
                let snap = s.snapshot()?;
                let vals: Vec<f32> = ["w", "b"].iter().flat_map(|t| snap.buffers.tensor(t).unwrap().to_f32().unwrap()).collect();
                vals.iter().all(|&x| x == value).then_some(snap.version)
            })
            .collect()
    }

    fn member(&self, endpoint: Endpoint) -> &actors::ActorRef<Member> {
        let members = if endpoint.group == Group::Src { &self.src_members } else { &self.dst_members };
        members.get(endpoint.rank as usize).unwrap()
    }

    /// Waits until the orchestrator's handle to `endpoint`'s member stopped; how long it took.
    async fn lost(&self, endpoint: Endpoint) -> Duration {
        let t = Instant::now();
        while self.member(endpoint).is_alive() {
            assert!(t.elapsed() < HEARTBEAT_TIMEOUT * 20, "{endpoint}'s member handle is still alive");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        t.elapsed()
    }

    async fn reattach(&mut self, within: Duration) -> Vec<Endpoint> {
        self.rendezvous.reattach(&self.orchestrator, &mut self.src_members, &mut self.dst_members, within).await
    }
}

fn died(e: &RefitError, name: &str) -> bool {
    matches!(e, RefitError::Refit(OrchestratorError::MemberDied { member, .. }) if member == name)
}

/// A source process whose runtime is held up past the heartbeat timeout:
/// the orchestrator gives its connection up (the refit then fails at once,
/// every destination keeping its version), and once the process runs
/// again the member is found again as itself — same actor, same node — and
/// put back; the next refit commits. The process never took the
/// rendezvous for gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_stalled_past_the_heartbeat_timeout_is_found_again_and_the_next_refit_commits() {
    let mut job = job().await;
    job.step(1, 1.0).await;
    job.orchestrator.refit(1).await.unwrap();
    assert_eq!(job.served(1.0), vec![Some(1); 4]);

    let before = job.member(Endpoint::src(0)).id();
    let thaw = job.src[0].freeze();
    job.lost(Endpoint::src(0)).await;
    job.step(2, 2.0).await;
    let err = job.orchestrator.refit(2).await.unwrap_err();
    assert!(died(&err, &member_name(Group::Src, 0)), "{err}");
    assert_eq!(job.served(1.0), vec![Some(1); 4], "every destination keeps version 1");

    drop(thaw);
    assert_eq!(job.reattach(Duration::from_secs(20)).await, vec![Endpoint::src(0)]);
    assert_eq!(job.member(Endpoint::src(0)).id(), before, "the same member, found again");
    assert_eq!(job.reattach(Duration::from_secs(1)).await, vec![], "every member is back");
    job.orchestrator.refit(2).await.unwrap();
    assert_eq!(job.served(2.0), vec![Some(2); 4]);
    assert!(job.src.iter().chain(&job.dst).all(|p| !p.left.load(Ordering::SeqCst)), "no process left the rendezvous");
    job.rendezvous.node().shutdown();
}

/// A process that truly stops (its runtime held up for good) is declared
/// dead within the heartbeat timeout and is not found again while it
/// stays stopped: the refit fails naming it. Once it runs again, it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_that_stops_is_declared_dead_and_found_again_only_once_it_runs() {
    let mut job = job().await;
    job.step(1, 1.0).await;
    job.orchestrator.refit(1).await.unwrap();

    let thaw = job.dst[1].freeze();
    let after = job.lost(Endpoint::dst(1)).await;
    // The timeout, plus a heartbeat interval and scheduling: well under twice it.
    assert!(after < HEARTBEAT_TIMEOUT * 2 + Duration::from_millis(500), "declared dead after {after:?}");
    assert_eq!(job.reattach(Duration::from_secs(3)).await, vec![], "a stopped process is not found again");
    job.step(2, 2.0).await;
    let err = job.orchestrator.refit(2).await.unwrap_err();
    assert!(died(&err, &member_name(Group::Dst, 1)), "{err}");

    drop(thaw);
    assert_eq!(job.reattach(Duration::from_secs(20)).await, vec![Endpoint::dst(1)]);
    job.orchestrator.refit(2).await.unwrap();
    assert_eq!(job.served(2.0), vec![Some(2); 4]);
    job.rendezvous.node().shutdown();
}

/// Every member process's connection to the rendezvous is cut (closed
/// without a goodbye) after the registry forgot their names: each
/// process joins again by itself and registers its names again as the
/// same holder, none takes the rendezvous for gone, and refits go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_whose_connection_to_the_rendezvous_is_cut_join_again_with_their_registrations() {
    let job = job().await;
    job.step(1, 1.0).await;
    job.orchestrator.refit(1).await.unwrap();

    let names: Vec<String> = (0..2).map(|r| member_name(Group::Src, r)).chain((0..4).map(|r| member_name(Group::Dst, r))).collect();
    for name in &names {
        job.rendezvous.forget(name).await.unwrap();
        assert!(job.rendezvous.lookup::<Member>(name, Duration::ZERO).await.is_err(), "{name} is forgotten");
    }
    assert!(job.relay.cut() >= 6, "one connection per member process, at least");
    for (name, member) in names.iter().zip(job.src_members.refs().iter().chain(job.dst_members.refs())) {
        let found = job.rendezvous.lookup::<Member>(name, Duration::from_secs(20)).await.unwrap();
        assert_eq!(found.id(), member.id(), "{name} registered again by the same member");
    }
    assert!(job.src.iter().chain(&job.dst).all(|p| !p.left.load(Ordering::SeqCst)), "no process left the rendezvous");
    job.step(2, 2.0).await;
    job.orchestrator.refit(2).await.unwrap();
    assert_eq!(job.served(2.0), vec![Some(2); 4]);

    // The rendezvous going away for good is still seen: every process leaves.
    job.rendezvous.node().shutdown();
    let t = Instant::now();
    while !job.src.iter().chain(&job.dst).all(|p| p.left.load(Ordering::SeqCst)) {
        assert!(t.elapsed() < Duration::from_secs(20), "a process still waits for the rendezvous that shut down");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
