//! Members joining through a rendezvous, one of them dying and its
//! replacement put in its place (`Rendezvous::recover`). Every member
//! "process" is its own control node here (`join`), so shutting one down is
//! what the orchestrator sees when a member process dies: its connection
//! closes and its member handle stops.

mod common;

use actors::{ActorGroup, Secret};
use orchestrator::rendezvous::ControlConfig;
use orchestrator::{
    join, member_name, spawn_orchestrator, DstStore, Fabric, JoinConfig, JoinError, Joined, NodeFabric, OrchestratorConfig,
    OrchestratorHandle, Rendezvous, Role, SrcStore,
};
use reshard::{Endpoint, Group, Layout};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One member process: its membership and its store.
struct Process {
    joined: Joined,
    store: Store,
}

enum Store {
    Src(Arc<SrcStore>),
    Dst(Arc<DstStore>),
}

struct Job {
    rendezvous: Rendezvous,
    config: JoinConfig,
    layouts: [Arc<Layout>; 2],
    src: Vec<Process>,
    dst: Vec<Process>,
    src_members: ActorGroup<orchestrator::Member>,
    dst_members: ActorGroup<orchestrator::Member>,
    orchestrator: OrchestratorHandle,
}

/// Joins the rendezvous as `endpoint`'s process and serves its member on a
/// fresh store.
async fn start(config: &JoinConfig, layouts: &[Arc<Layout>; 2], endpoint: Endpoint) -> Process {
    let joined = join(config).await.unwrap();
    let layout = layouts[usize::from(endpoint.group == Group::Dst)].clone();
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
    Process { joined, store }
}

async fn job() -> Job {
    let (src, dst) = common::layouts();
    let layouts = [Arc::new(src), Arc::new(dst)];
    let secret = Secret::random().unwrap();
    let control = ControlConfig::default();
    let rendezvous = Rendezvous::bind(secret.clone(), "127.0.0.1:0".parse().unwrap(), &control).await.unwrap();
    let config = JoinConfig { rendezvous: rendezvous.addr(), secret, control };
    let mut procs = Vec::new();
    for e in (0..2).map(Endpoint::src).chain((0..4).map(Endpoint::dst)) {
        procs.push(start(&config, &layouts, e).await);
    }
    let dst_procs = procs.split_off(2);
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
    Job { rendezvous, config, layouts, src: procs, dst: dst_procs, src_members, dst_members, orchestrator }
}

impl Job {
    /// Every source takes an optimizer step to version `version`, every
    /// weight `value`.
    async fn step(&self, version: u64, value: f32) {
        for p in &self.src {
            let Store::Src(s) = &p.store else { unreachable!("sources hold source stores") };
            s.restore(version, |b| b.write_buffer_f32("params", &[value; 28]).unwrap()).await;
        }
    }

    /// The version every destination serves, if all serve one with every
    /// weight `value`.
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

    /// Shuts down the process of `endpoint`, as its death looks to the
    /// orchestrator, and waits until its member handle has stopped.
    async fn kill(&mut self, endpoint: Endpoint) {
        let procs = if endpoint.group == Group::Src { &self.src } else { &self.dst };
        procs[endpoint.rank as usize].joined.node().shutdown();
        let members = if endpoint.group == Group::Src { &self.src_members } else { &self.dst_members };
        let t = Instant::now();
        while members.get(endpoint.rank as usize).unwrap().is_alive() {
            assert!(t.elapsed() < Duration::from_secs(10), "{endpoint}'s member handle is still alive");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A new process for `endpoint`, in the dead one's place.
    async fn restart(&mut self, endpoint: Endpoint) {
        let p = start(&self.config, &self.layouts, endpoint).await;
        let procs = if endpoint.group == Group::Src { &mut self.src } else { &mut self.dst };
        procs[endpoint.rank as usize] = p;
    }

    async fn recover(&mut self, within: Duration) -> Result<Vec<Endpoint>, JoinError> {
        self.rendezvous.recover(&self.orchestrator, &mut self.src_members, &mut self.dst_members, within).await
    }
}

/// A destination process dies: the refit fails and no destination moves
/// off the version it serves; recovering before a replacement joins fails
/// naming the rank, and once one has joined puts it in place, and the
/// next refit delivers to all four. A source process dies and its
/// replacement registers before `recover` is called: the replacement is
/// found (the dead one's registration alone is forgotten), restored to the
/// version its peers hold, and the refit delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_process_that_died_is_replaced_by_the_one_that_rejoins() {
    let mut job = job().await;
    job.step(1, 1.0).await;
    job.orchestrator.refit(1).await.unwrap();
    assert_eq!(job.served(1.0), vec![Some(1); 4]);
    assert_eq!(job.recover(Duration::from_secs(1)).await.unwrap(), vec![], "every member is alive");

    job.kill(Endpoint::dst(1)).await;
    job.step(2, 2.0).await;
    assert!(job.orchestrator.refit(2).await.is_err());
    let kept = job.served(1.0);
    assert_eq!([kept[0], kept[2], kept[3]], [Some(1); 3], "{kept:?}");
    match job.recover(Duration::from_millis(300)).await {
        Err(JoinError::Missing { name, .. }) => assert_eq!(name, member_name(Group::Dst, 1)),
        other => panic!("expected dst 1 missing, got {other:?}"),
    }
    job.restart(Endpoint::dst(1)).await;
    assert_eq!(job.recover(Duration::from_secs(10)).await.unwrap(), vec![Endpoint::dst(1)]);
    assert_eq!(job.recover(Duration::from_secs(1)).await.unwrap(), vec![]);
    job.orchestrator.refit(2).await.unwrap();
    assert_eq!(job.served(2.0), vec![Some(2); 4]);

    job.kill(Endpoint::src(0)).await;
    job.restart(Endpoint::src(0)).await;
    assert_eq!(job.recover(Duration::from_secs(10)).await.unwrap(), vec![Endpoint::src(0)]);
    job.step(3, 3.0).await;
    job.orchestrator.refit(3).await.unwrap();
    assert_eq!(job.served(3.0), vec![Some(3); 4]);
    job.rendezvous.node().shutdown();
}

/// A second process joining under a name a live process serves — a rank
/// of the group, or a replica's rank — is refused with an error naming
/// it, and the serving one keeps its place (the next refit delivers to
/// it); once the holder's process is gone, the name is taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_process_under_a_serving_name_is_refused_by_name() {
    let job = job().await;
    let layout = job.layouts[1].clone();
    let store = || Arc::new(DstStore::new(&layout, 1));

    let intruder = join(&job.config).await.unwrap();
    let err = intruder.serve_member(layout.clone(), 1, Role::Dst(store())).await.unwrap_err();
    match &err {
        JoinError::NameHeld { name, .. } => assert_eq!(name, &member_name(Group::Dst, 1)),
        other => panic!("expected the name refused, got {other:?}"),
    }
    assert!(err.to_string().contains("'refit.member.dst.1' is already served by the live process at"), "{err}");
    job.step(1, 1.0).await;
    job.orchestrator.refit(1).await.unwrap();
    assert_eq!(job.served(1.0), vec![Some(1); 4]);

    let config = orchestrator::MemberConfig::default();
    let first = join(&job.config).await.unwrap();
    first.serve_replica_member("r1", layout.clone(), 1, store(), config.clone()).await.unwrap();
    let err = intruder.serve_replica_member("r1", layout.clone(), 1, store(), config.clone()).await.unwrap_err();
    assert!(matches!(&err, JoinError::NameHeld { name, .. } if name == "refit.member.replica.r1.1"), "{err:?}");
    // Another replica name is free.
    intruder.serve_replica_member("r2", layout.clone(), 1, store(), config.clone()).await.unwrap();
    // The holder's process gone: its name is taken over.
    first.node().shutdown();
    intruder.serve_replica_member("r1", layout.clone(), 1, store(), config).await.unwrap();
    job.rendezvous.node().shutdown();
}

/// The secret shows in no join setting and in no failed join's error,
/// whether the joiner's secret is wrong or the rendezvous is gone.
#[tokio::test]
async fn the_secret_never_shows_in_a_join_config_or_a_failed_join() {
    let right = "rendezvous-secret-never-printed-0123";
    let wrong = "another-secret-never-printed-456789";
    let control = ControlConfig::default();
    let rendezvous = Rendezvous::bind(Secret::from_bytes(right).unwrap(), "127.0.0.1:0".parse().unwrap(), &control).await.unwrap();
    let addr = rendezvous.addr();
    for (secret, gone) in [(wrong, false), (right, true)] {
        if gone {
            rendezvous.node().shutdown();
        }
        let config = JoinConfig { rendezvous: addr, secret: Secret::from_bytes(secret).unwrap(), control: control.clone() };
        let shown = format!("{config:?}");
        assert!(!shown.contains(secret), "{shown}");
        let err = join(&config).await.map(drop).unwrap_err();
        let shown = format!("{err} {err:?}");
        assert!(!shown.contains(right) && !shown.contains(wrong), "{shown}");
    }
}
