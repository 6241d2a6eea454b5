//! The orchestrator on the GPU fabrics, simulated (`CommPlane::Simulated`):
//! what it does with NCCL communicators — one per data-plane epoch, created
//! by every member at once from source rank 0's id, kept across the refits
//! of a plan, aborted on failure and replaced by one with a new id — and
//! with CUDA IPC buckets (one exported per member and epoch, mapped by its
//! receivers, doorbells over TCP), tested on any machine, with failures
//! armed where NCCL jobs meet them; and weights registered in place (the
//! user's memory), on those fabrics and on the host fabrics.

use orchestrator::{
    spawn_refit, CommPlane, Fabric, IpcFabric, MemberMsg, MemberReply, NcclFabric, OrchestratorConfig, OrchestratorError, RefitError,
    RefitSystem, Refusal,
};
use reshard::{Endpoint, Strategy};
use std::time::{Duration, Instant};
use transport::cuda::{arm, direct_read_bytes, live_comms, SimFault};

mod common;
use common::layouts;

fn fabric(world: &str) -> NcclFabric {
    NcclFabric {
        plane: CommPlane::Simulated { world: world.to_string() },
        init_timeout: Duration::from_secs(2),
        abort_timeout: Duration::from_secs(1),
    }
}

fn config(world: &str, mode: Strategy) -> OrchestratorConfig {
    OrchestratorConfig {
        mode,
        fabric: Fabric::Nccl(fabric(world)),
        deadline: Duration::from_secs(5),
        control_timeout: Duration::from_secs(5),
        ..OrchestratorConfig::default()
    }
}

async fn system(world: &str, mode: Strategy) -> RefitSystem {
    let (src, dst) = layouts();
    spawn_refit(&src, &dst, config(world, mode)).await.unwrap()
}

/// One optimizer step that sets every weight to `value`.
async fn step(sys: &RefitSystem, value: f32) -> u64 {
    let mut version = 0;
    for s in &sys.src_stores {
        version = s.try_update(|b| b.write_buffer_f32("params", &[value; 28])).await.unwrap().0;
    }
    version
}

/// Whether every destination serves `version`, every weight `value`
/// (bf16 holds the test's values exactly).
fn serves(sys: &RefitSystem, version: u64, value: f32) -> bool {
    sys.dst_stores.iter().all(|s| {
        let Some(snap) = s.snapshot() else { return false };
        snap.version == version && ["w", "b"].iter().all(|t| snap.buffers.tensor(t).unwrap().to_f32().unwrap().iter().all(|&x| x == value))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refits_over_a_communicator_deliver_every_version_on_one_communicator() {
    for (world, mode) in [("deliver/reshard", Strategy::Reshard), ("deliver/baseline", Strategy::Baseline)] {
        let sys = system(world, mode).await;
        for k in 1..=3 {
            let value = k as f32 * 1.5;
            let v = step(&sys, value).await;
            let report = sys.orchestrator.refit(v).await.unwrap();
            assert!(serves(&sys, v, value), "{world}: refit {k}");
            let plan = sys.orchestrator.plan().await.unwrap();
            assert_eq!(report.bytes, plan.bytes, "{world}: the members sent the plan's bytes");
            // The first refit creates the communicator; the next ones run
            // on it.
            assert_eq!(report.resumed, k > 1, "{world}: refit {k}");
            assert_eq!(live_comms(world), 1, "{world}: refit {k}");
        }
    }
}

/// A failure in one member's group fails the refit (every destination
/// keeps its version), at once rather than at the deadline; the next
/// refit runs on a new communicator and delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_group_fails_the_refit_and_the_next_runs_on_a_new_communicator() {
    let world = "group-fails";
    let sys = system(world, Strategy::Reshard).await;
    let v1 = step(&sys, 1.0).await;
    sys.orchestrator.refit(v1).await.unwrap();
    // The next communicator's rank 3 (destination 1) fails its first group.
    sys.orchestrator.close_data_plane().await.unwrap();
    arm(world, vec![SimFault::GroupFails { rank: 3, group: 0 }]);
    let v2 = step(&sys, 2.0).await;
    let t = Instant::now();
    match sys.orchestrator.refit(v2).await {
        Err(RefitError::Refit(OrchestratorError::Refused { member, refusal: Refusal::Exec { why, after_peer: false } })) => {
            assert_eq!(member, "dst[1]");
            assert!(why.contains("simulated failure of group 0"), "{why}");
        }
        other => panic!("expected dst[1]'s failure, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    assert!(serves(&sys, v1, 1.0));
    let report = sys.orchestrator.refit(v2).await.unwrap();
    assert!(!report.resumed);
    assert!(serves(&sys, v2, 2.0));
}

/// A member whose communicator never completes fails the refit within the
/// creation and abort timeouts; the next refit delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rank_that_never_joins_fails_the_refit_within_its_timeouts() {
    let world = "never-joins";
    let sys = system(world, Strategy::Reshard).await;
    arm(world, vec![SimFault::NeverJoins { rank: 4 }]);
    let v = step(&sys, 3.0).await;
    let t = Instant::now();
    match sys.orchestrator.refit(v).await {
        Err(RefitError::Refit(OrchestratorError::Refused { refusal: Refusal::Fabric(why), .. })) => {
            assert!(why.contains("creation"), "{why}")
        }
        other => panic!("expected a creation failure, got {other:?}"),
    }
    let f = fabric(world);
    assert!(t.elapsed() < f.init_timeout + f.abort_timeout + Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(sys.dst_stores.iter().all(|s| s.snapshot().is_none()));
    sys.orchestrator.refit(v).await.unwrap();
    assert!(serves(&sys, v, 3.0));
}

/// An abort that hangs after a failure never holds the refit past its
/// bound; the hung thread is abandoned and the next refit delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_abort_that_hangs_never_holds_the_refit() {
    let world = "abort-hangs";
    let sys = system(world, Strategy::Reshard).await;
    arm(world, vec![SimFault::GroupFails { rank: 0, group: 0 }, SimFault::AbortHangs { rank: 0 }]);
    let v = step(&sys, 4.0).await;
    let t = Instant::now();
    match sys.orchestrator.refit(v).await {
        Err(RefitError::Refit(OrchestratorError::Refused { member, refusal: Refusal::Exec { why, .. } })) => {
            assert_eq!(member, "src[0]");
            assert!(why.contains("restart this process"), "{why}");
        }
        other => panic!("expected src[0]'s failure, got {other:?}"),
    }
    assert!(t.elapsed() < config(world, Strategy::Reshard).call_timeout(), "{:?}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    sys.orchestrator.refit(v).await.unwrap();
    assert!(serves(&sys, v, 4.0));
}

/// NCCL members without a GPU (or a build without CUDA) refuse before
/// anything moves, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nccl_without_a_gpu_is_refused_cleanly() {
    if transport::gpu_plane_available(transport::GpuPlane::Nccl, 1).is_ok() {
        return; // a GPU machine: scripts/gpu-check.sh
    }
    let (src, dst) = layouts();
    let config = OrchestratorConfig { fabric: Fabric::Nccl(NcclFabric::new(CommPlane::Cuda)), ..config("cuda", Strategy::Reshard) };
    let sys = spawn_refit(&src, &dst, config).await.unwrap();
    let v = step(&sys, 6.0).await;
    match sys.orchestrator.refit(v).await {
        Err(RefitError::Refit(OrchestratorError::Refused { refusal: Refusal::Fabric(why), .. })) => {
            assert!(why.contains("unavailable"), "{why}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(sys.dst_stores.iter().all(|s| s.snapshot().is_none()));
}

/// Two ranks of one communicator on one GPU (a trainer and an engine
/// colocated) are refused before any communicator is made, naming both
/// members and the device, at once rather than at the creation timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_ranks_on_one_gpu_are_refused_before_the_communicator() {
    use actors::{spawn, ActorGroup, SpawnConfig};
    use orchestrator::{spawn_orchestrator, DstStore, Member, MemberConfig, Role, SrcStore};
    use std::sync::Arc;
    let world = "one-gpu";
    let (src, dst) = layouts();
    let (src, dst) = (Arc::new(src), Arc::new(dst));
    let config = config(world, Strategy::Reshard);
    // Every member on GPU 0, except that destination 1 is on GPU 1.
    let gpu = |e: Endpoint| MemberConfig { gpu: Some(usize::from(e == Endpoint::dst(1))), ..MemberConfig::default() };
    let spawn_config = SpawnConfig::default().call_timeout(config.deadline + config.control_timeout);
    let src_stores: Vec<_> = (0..src.ranks()).map(|r| Arc::new(SrcStore::new(&src, r))).collect();
    let srcs = (0..src.ranks())
        .map(|r| {
            spawn(
                Member::with_config(src.clone(), r, Role::Src(src_stores[r as usize].clone()), gpu(Endpoint::src(r))),
                spawn_config.clone(),
            )
        })
        .collect();
    let dsts = (0..dst.ranks())
        .map(|r| {
            spawn(
                Member::with_config(dst.clone(), r, Role::Dst(Arc::new(DstStore::new(&dst, r))), gpu(Endpoint::dst(r))),
                spawn_config.clone(),
            )
        })
        .collect();
    let orchestrator = spawn_orchestrator(ActorGroup::from_refs(srcs), ActorGroup::from_refs(dsts), config);
    let mut version = 0;
    for s in &src_stores {
        version = s.try_update(|b| b.write_buffer_f32("params", &[1.0; 28])).await.unwrap().0;
    }
    let t = Instant::now();
    match orchestrator.refit(version).await {
        Err(RefitError::Refit(OrchestratorError::Refused { refusal: Refusal::Fabric(why), .. })) => {
            assert!(why.contains("src rank 0 and src rank 1 are on one GPU (sim-gpu0)"), "{why}");
            assert!(why.contains("IPC fabric"), "{why}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(1), "refused after {:?}", t.elapsed());
    assert_eq!(live_comms(world), 0, "no communicator was made");
}

fn ipc_config(mode: Strategy) -> OrchestratorConfig {
    let fabric = IpcFabric {
        plane: CommPlane::Simulated { world: String::new() },
        connect_timeout: Duration::from_secs(5),
        abort_timeout: Duration::from_secs(1),
    };
    OrchestratorConfig { fabric: Fabric::Ipc(fabric), ..config("", mode) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refits_over_ipc_buckets_deliver_every_version_on_one_epoch() {
    for mode in [Strategy::Reshard, Strategy::Baseline] {
        let (src, dst) = layouts();
        let sys = spawn_refit(&src, &dst, ipc_config(mode)).await.unwrap();
        for k in 1..=3 {
            let value = k as f32 * -0.5;
            let v = step(&sys, value).await;
            let report = sys.orchestrator.refit(v).await.unwrap();
            assert!(serves(&sys, v, value), "{mode:?}: refit {k}");
            assert_eq!(report.bytes, sys.orchestrator.plan().await.unwrap().bytes, "{mode:?}");
            // The buckets and doorbells of the first refit serve the next.
            assert_eq!(report.resumed, k > 1, "{mode:?}: refit {k}");
        }
    }
}

/// A member that dies fails the refit (destinations keep their version);
/// its replacement exports a fresh bucket and the next refit delivers on a
/// new epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_ipc_member_is_replaced_and_a_fresh_epoch_delivers() {
    let (src, dst) = layouts();
    let mut sys = spawn_refit(&src, &dst, ipc_config(Strategy::Reshard)).await.unwrap();
    let v1 = step(&sys, 1.0).await;
    sys.orchestrator.refit(v1).await.unwrap();
    sys.src_members.get(1).unwrap().stop();
    let dead = sys.events.recv().await.unwrap();
    assert_eq!(dead.name, "src[1]");
    let v2 = step(&sys, 2.0).await;
    assert!(matches!(sys.orchestrator.refit(v2).await, Err(RefitError::Refit(OrchestratorError::MemberDied { .. }))));
    assert!(serves(&sys, v1, 1.0));
    sys.replace_member(Endpoint::src(1)).await.unwrap();
    let report = sys.orchestrator.refit(v2).await.unwrap();
    assert!(!report.resumed);
    assert!(serves(&sys, v2, 2.0));
}

/// CUDA IPC members without a GPU (or a build without CUDA) refuse before
/// anything moves, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ipc_without_a_gpu_is_refused_cleanly() {
    if transport::gpu_plane_available(transport::GpuPlane::Device, 1).is_ok() {
        return; // a GPU machine: scripts/gpu-check.sh
    }
    let (src, dst) = layouts();
    let config = OrchestratorConfig { fabric: Fabric::Ipc(IpcFabric::new(CommPlane::Cuda)), ..config("", Strategy::Reshard) };
    let sys = spawn_refit(&src, &dst, config).await.unwrap();
    let v = step(&sys, 6.0).await;
    match sys.orchestrator.refit(v).await {
        Err(RefitError::Refit(OrchestratorError::Refused { refusal: Refusal::Fabric(why), .. })) => {
            assert!(why.contains("IPC transport unavailable"), "{why}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Sources whose weights are the user's own memory, registered in place
/// (host memory standing in for device buffers on the simulated planes),
/// destinations with stores, an orchestrator with a given config. The
/// user's memory is returned with the stores: it must outlive them.
struct Registered {
    orchestrator: orchestrator::OrchestratorHandle,
    src: Vec<std::sync::Arc<orchestrator::SrcStore>>,
    dst: Vec<std::sync::Arc<orchestrator::DstStore>>,
    /// Each source rank's "params" buffer (28 f32).
    memory: Vec<[f32; 28]>,
    /// The source members.
    src_members: Vec<actors::ActorRef<orchestrator::Member>>,
}

/// The memory is said to be in `residence` (the bytes are host memory
/// either way).
fn registered_system(config: OrchestratorConfig, residence: orchestrator::Residence) -> Registered {
    registered_system_on(config, residence, orchestrator::MemberConfig::default())
}

/// [`registered_system`] with every member configured as `member` (its
/// GPU, say).
fn registered_system_on(config: OrchestratorConfig, residence: orchestrator::Residence, member: orchestrator::MemberConfig) -> Registered {
    use orchestrator::SrcStore;
    use std::sync::Arc;
    let (src, dst) = layouts();
    let (src, dst) = (Arc::new(src), Arc::new(dst));
    let mut memory: Vec<[f32; 28]> = vec![[0f32; 28]; 2];
    let mut src_stores = Vec::new();
    for (r, m) in memory.iter_mut().enumerate() {
        let region = vec![(m.as_mut_ptr() as u64, std::mem::size_of::<[f32; 28]>())];
        // SAFETY: each array lives in `Registered::memory` until the test
        // ends (the refits that read it run while the test awaits them),
        // and is written only inside `update`.
        let reg = unsafe { orchestrator::Registered::new(&src, r as u32, residence, region) }.unwrap();
        src_stores.push(Arc::new(SrcStore::registered(&src, r as u32, reg)));
    }
    Registered { memory, ..spawn_registered(&src, &dst, src_stores, config, member) }
}

/// Members over `src_stores` (one per source rank of `src`) and fresh
/// destination stores of `dst`, and their orchestrator.
fn spawn_registered(
    src: &std::sync::Arc<reshard::Layout>,
    dst: &std::sync::Arc<reshard::Layout>,
    src_stores: Vec<std::sync::Arc<orchestrator::SrcStore>>,
    config: OrchestratorConfig,
    member: orchestrator::MemberConfig,
) -> Registered {
    use orchestrator::{DstStore, Member, Role};
    use std::sync::Arc;
    let spawn = actors::SpawnConfig::default().call_timeout(config.deadline + config.control_timeout);
    let src_members: Vec<_> = src_stores
        .iter()
        .enumerate()
        .map(|(r, s)| {
            let role = Role::Src(s.clone());
            actors::spawn(Member::with_config(src.clone(), r as u32, role, member.clone()), spawn.clone())
        })
        .collect();
    let dst_stores: Vec<Arc<DstStore>> = (0..dst.ranks()).map(|r| Arc::new(DstStore::new(dst, r))).collect();
    let dst_members = dst_stores
        .iter()
        .enumerate()
        .map(|(r, s)| actors::spawn(Member::with_config(dst.clone(), r as u32, Role::Dst(s.clone()), member.clone()), spawn.clone()))
        .collect();
    let orchestrator = orchestrator::spawn_orchestrator(
        actors::ActorGroup::from_refs(src_members.clone()),
        actors::ActorGroup::from_refs(dst_members),
        config,
    );
    Registered { orchestrator, src: src_stores, dst: dst_stores, memory: Vec::new(), src_members }
}

impl Registered {
    /// A step that writes `value` into the user's memory of every source.
    async fn step(&mut self, value: f32) -> u64 {
        let mut version = 0;
        for (store, m) in self.src.iter().zip(self.memory.iter_mut()) {
            version = store.update(|_| m.fill(value)).await.0;
        }
        version
    }

    fn serves(&self, version: u64, value: f32) -> bool {
        self.dst.iter().all(|s| {
            let Some(snap) = s.snapshot() else { return false };
            snap.version == version
                && ["w", "b"].iter().all(|t| snap.buffers.tensor(t).unwrap().to_f32().unwrap().iter().all(|&x| x == value))
        })
    }
}

/// A registered source is read where it is, on every fabric, dense and
/// delta: what the user wrote in its own memory
/// inside `update` is what every destination serves, refit after refit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registered_sources_are_read_in_place() {
    let sim = CommPlane::Simulated { world: "registered".into() };
    let ipc = IpcFabric { plane: sim.clone(), connect_timeout: Duration::from_secs(5), abort_timeout: Duration::from_secs(1) };
    let every =
        [Fabric::Nccl(fabric("registered")), Fabric::Ipc(ipc), Fabric::InProcess, Fabric::Node(orchestrator::NodeFabric::default())];
    for (fabric, delta) in every.iter().cloned().map(|f| (f, false)).chain(every.iter().cloned().map(|f| (f, true))) {
        let config = OrchestratorConfig { fabric: fabric.clone(), delta, ..config("registered", Strategy::Reshard) };
        let mut sys = registered_system(config, orchestrator::Residence::Host);
        for k in 1..=3 {
            let value = k as f32 * 0.75;
            let v = sys.step(value).await;
            sys.orchestrator.refit(v).await.unwrap();
            assert!(sys.serves(v, value), "{fabric:?}: refit {k}");
        }
        // A step begun and finished outside a closure (as from Python).
        let mut v = 0;
        for (store, m) in sys.src.iter().zip(sys.memory.iter_mut()) {
            let guard = store.begin_update().await;
            m.fill(-4.0);
            v = guard.finish();
        }
        sys.orchestrator.refit(v).await.unwrap();
        assert!(sys.serves(v, -4.0), "{fabric:?}: begin_update");
        // The store holds no bytes of registered weights.
        let err = sys.src[0].read(|b| b.buffer("params").map(|_| ()).unwrap_err()).await;
        assert!(err.to_string().contains("registered host memory"), "{err}");
    }
}

/// Members colocated on one GPU (simulated: every member names
/// `sim-gpu0`) on the IPC fabric: each destination copies every piece
/// straight from the sources' registered memory (offers, no bucket), and
/// serves what the user wrote there, refit after refit; a delta refit goes
/// through buckets (its encodings cross the host) and delivers the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn colocated_members_read_registered_sources_directly() {
    for delta in [false, true] {
        let world = format!("colocated-{delta}");
        let ipc = IpcFabric {
            plane: CommPlane::Simulated { world: world.clone() },
            connect_timeout: Duration::from_secs(5),
            abort_timeout: Duration::from_secs(1),
        };
        let config = OrchestratorConfig { fabric: Fabric::Ipc(ipc), delta, ..config(&world, Strategy::Reshard) };
        let on_gpu0 = orchestrator::MemberConfig { gpu: Some(0), ..orchestrator::MemberConfig::default() };
        let mut sys = registered_system_on(config, orchestrator::Residence::Host, on_gpu0);
        for k in 1..=3 {
            let value = k as f32 * 1.25;
            let v = sys.step(value).await;
            let before = direct_read_bytes();
            sys.orchestrator.refit(v).await.unwrap();
            assert!(sys.serves(v, value), "delta {delta}: refit {k}");
            // (Other tests of this binary never share a device.)
            assert_eq!(direct_read_bytes() > before, !delta, "delta {delta}: refit {k}: read directly?");
        }
    }
}

/// The host fabrics cannot read registered device memory: refused, naming
/// the rank and the fabric to use; a failed step on registered memory tears the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registered_device_sources_are_refused_on_host_fabrics_and_torn_by_failed_steps() {
    let config = OrchestratorConfig { fabric: Fabric::InProcess, ..config("registered", Strategy::Reshard) };
    let mut sys = registered_system(config, orchestrator::Residence::Device { ordinal: 0 });
    let v = sys.step(1.0).await;
    match sys.orchestrator.refit(v).await {
        Err(RefitError::Refit(OrchestratorError::Refused { refusal: Refusal::Fabric(why), .. })) => {
            assert!(why.starts_with(&format!("{}:", Endpoint::src(0))), "{why}");
            assert!(why.contains("registered device (GPU 0) memory") && why.contains("NCCL and IPC"), "{why}");
            // It says what to change.
            assert!(why.contains("orchestrator on fabric \"ipc\"") && why.contains("\"nccl\" otherwise"), "{why}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(sys.dst.iter().all(|s| s.snapshot().is_none()));
    // Refused when its end opens (`Prepare`), before any peer connects or
    // waits for it: the fabric knows where the memory lives from the start.
    let fingerprint = sys.orchestrator.plan().await.unwrap().fingerprint;
    let prepare = MemberMsg::Prepare { refit: 99, fingerprint, session: "s".into(), fabric: Fabric::InProcess, keep: false };
    match sys.src_members[0].call(prepare).await.unwrap() {
        MemberReply::Refused(Refusal::Fabric(why)) => assert!(why.contains("registered device (GPU 0) memory"), "{why}"),
        other => panic!("expected Prepare refused, got {other:?}"),
    }
    let failed: Result<(u64, ()), &str> = sys.src[0].try_update(|_| Err("the optimizer diverged")).await;
    assert!(failed.is_err());
    assert!(matches!(sys.src[0].weights(), orchestrator::HeldVersion::Torn { after: Some(1) }));
}

/// Destinations that serve their weights in the user's own memory (an
/// inference engine's buffers; host memory standing in for device buffers
/// on the simulated planes), sources with stores, an orchestrator on
/// `fabric`. The user's memory is returned with the stores: it must
/// outlive them.
struct ServedInPlace {
    orchestrator: orchestrator::OrchestratorHandle,
    src: Vec<std::sync::Arc<orchestrator::SrcStore>>,
    dst: Vec<std::sync::Arc<orchestrator::DstStore>>,
    /// Each destination rank's buffers, bf16 bit patterns, boxed so they
    /// never move.
    memory: Vec<Vec<Box<[u16]>>>,
    /// Every member, sources first.
    members: Vec<actors::ActorRef<orchestrator::Member>>,
}

fn served_in_place(fabric: Fabric, deadline: Duration) -> ServedInPlace {
    served_in_place_with(fabric, deadline, orchestrator::MemberConfig::default())
}

fn served_in_place_with(fabric: Fabric, deadline: Duration, dst_config: orchestrator::MemberConfig) -> ServedInPlace {
    let config = OrchestratorConfig { fabric, deadline, ..config("served", Strategy::Reshard) };
    served_in_place_in(config, dst_config, orchestrator::Residence::Host)
}

/// [`served_in_place_with`] with the orchestrator's whole `config`, the
/// memory said to be in `residence` (the bytes are host memory either way).
fn served_in_place_in(
    config: OrchestratorConfig,
    dst_config: orchestrator::MemberConfig,
    residence: orchestrator::Residence,
) -> ServedInPlace {
    served(config, Served { dst_config, residence, direct: false, src_config: orchestrator::MemberConfig::default() })
}

/// How [`served`] builds a system.
struct Served {
    dst_config: orchestrator::MemberConfig,
    residence: orchestrator::Residence,
    /// Destinations written in place (`DstStore::registered_direct`).
    direct: bool,
    src_config: orchestrator::MemberConfig,
}

fn served(config: OrchestratorConfig, how: Served) -> ServedInPlace {
    use orchestrator::{DstStore, Member, Role, SrcStore};
    let Served { dst_config, residence, direct, src_config } = how;
    use std::sync::Arc;
    let (src, dst) = layouts();
    let (src, dst) = (Arc::new(src), Arc::new(dst));
    let spawn = actors::SpawnConfig::default().call_timeout(config.deadline + config.control_timeout);
    let src_stores: Vec<Arc<SrcStore>> = (0..src.ranks()).map(|r| Arc::new(SrcStore::new(&src, r))).collect();
    let src_members: Vec<_> = src_stores
        .iter()
        .enumerate()
        .map(|(r, s)| actors::spawn(Member::with_config(src.clone(), r as u32, Role::Src(s.clone()), src_config.clone()), spawn.clone()))
        .collect();
    let mut memory = Vec::new();
    let mut dst_stores = Vec::new();
    let mut dst_members = Vec::new();
    for r in 0..dst.ranks() {
        // Every buffer starts as a pattern no refit writes (0xdead).
        let mut buffers: Vec<Box<[u16]>> = dst.rank_buffers(r).iter().map(|b| vec![0xdead; b.elems as usize].into_boxed_slice()).collect();
        let regions = buffers.iter_mut().map(|b| (b.as_mut_ptr() as u64, b.len() * 2)).collect();
        // SAFETY: each buffer lives in `ServedInPlace::memory` until the
        // test ends, never moves (boxed), and the test reads it only while
        // it holds `serve()` or no refit is in progress.
        let reg = unsafe { orchestrator::Registered::new(&dst, r, residence, regions) }.unwrap();
        let store = Arc::new(if direct { DstStore::registered_direct(&dst, r, reg) } else { DstStore::registered(&dst, r, reg) });
        let member = Member::with_config(dst.clone(), r, Role::Dst(store.clone()), dst_config.clone());
        dst_members.push(actors::spawn(member, spawn.clone()));
        dst_stores.push(store);
        memory.push(buffers);
    }
    let members = src_members.iter().chain(&dst_members).cloned().collect();
    let orchestrator =
        orchestrator::spawn_orchestrator(actors::ActorGroup::from_refs(src_members), actors::ActorGroup::from_refs(dst_members), config);
    ServedInPlace { orchestrator, src: src_stores, dst: dst_stores, memory, members }
}

impl ServedInPlace {
    /// A step: `w` to `w`, `b` to `b` on every source.
    async fn step(&self, w: f32, b: f32) -> u64 {
        let mut params = [w; 28];
        params[24..].fill(b);
        let mut version = 0;
        for s in &self.src {
            version = s.try_update(|buf| buf.write_buffer_f32("params", &params)).await.unwrap().0;
        }
        version
    }

    /// Whether every destination's own memory holds `w` and `b` (bf16:
    /// exact for the test's values) and the store serves `version`.
    async fn holds(&self, version: u64, w: f32, b: f32) -> bool {
        let bf16 = |x: f32| (x.to_bits() >> 16) as u16;
        let mut all = true;
        for (store, buffers) in self.dst.iter().zip(&self.memory) {
            let serving = store.serve().await;
            all &= serving.version() == Some(version) && store.snapshot().map(|s| s.version) == Some(version);
            // Rank buffers in layout order: "w#0" then "b#0".
            all &= buffers[0].iter().all(|&x| x == bf16(w)) && buffers[1].iter().all(|&x| x == bf16(b));
        }
        all
    }

    /// Every destination's memory, bit for bit.
    fn bits(&self) -> Vec<Vec<Box<[u16]>>> {
        self.memory.clone()
    }
}

fn ipc_fabric(world: &str) -> IpcFabric {
    IpcFabric {
        plane: CommPlane::Simulated { world: world.into() },
        connect_timeout: Duration::from_secs(5),
        abort_timeout: Duration::from_secs(1),
    }
}

/// Destinations registered in place are written by commits only: every
/// refit's version lands in the user's memory, on every fabric, dense and
/// delta; a subset refit keeps the other tensors as served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registered_destinations_receive_every_version_in_place() {
    let every = [
        Fabric::Nccl(fabric("served")),
        Fabric::Ipc(ipc_fabric("served")),
        Fabric::InProcess,
        Fabric::Node(orchestrator::NodeFabric::default()),
    ];
    for (fabric, delta) in every.iter().cloned().map(|f| (f, false)).chain(every.iter().cloned().map(|f| (f, true))) {
        let config =
            OrchestratorConfig { fabric: fabric.clone(), delta, deadline: Duration::from_secs(5), ..config("served", Strategy::Reshard) };
        let sys = served_in_place_in(config, orchestrator::MemberConfig::default(), orchestrator::Residence::Host);
        assert!(sys.dst.iter().all(|s| s.snapshot().is_none() && s.weights() == orchestrator::HeldVersion::Unwritten));
        for k in 1..=3 {
            let (w, b) = (k as f32 * 1.5, -(k as f32));
            let v = sys.step(w, b).await;
            let report = sys.orchestrator.refit(v).await.unwrap();
            assert!(sys.holds(v, w, b).await, "{fabric:?}: refit {k}");
            // Every fabric but the in-process one keeps its data plane.
            assert_eq!(report.resumed, k > 1 && !matches!(fabric, Fabric::InProcess), "{fabric:?}: refit {k}");
        }
        // The store holds none of the bytes: readers use their memory.
        let snap = sys.dst[0].snapshot().unwrap();
        let err = snap.buffers.tensor("w").map(drop).unwrap_err().to_string();
        assert!(err.contains("registered host memory"), "{err}");
        // A subset refit: only `w` moves; `b` stays as served.
        let v = sys.step(7.0, 9.0).await;
        sys.orchestrator.refit_only(orchestrator::RefitTarget::Version(v), reshard::TensorSubset::new(["w"])).await.unwrap();
        assert!(sys.holds(v, 7.0, -3.0).await, "{fabric:?}: subset refit");
    }
}

/// A refit that fails leaves every destination's memory exactly as it
/// was, serving the version before; what the failed refit staged never
/// reaches a later one (a subset refit after it carries the served
/// tensors, not the staged ones); the next refit delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_refit_never_touches_registered_destinations() {
    let world = "served/failed";
    let sys = served_in_place(Fabric::Nccl(fabric(world)), Duration::from_secs(5));
    let v1 = sys.step(2.0, 3.0).await;
    sys.orchestrator.refit(v1).await.unwrap();
    let before = sys.bits();
    let v2 = sys.step(4.0, 5.0).await;
    // The next communicator's rank 3 (destination 1) fails its first group;
    // the other destinations may stage all of v2.
    sys.orchestrator.close_data_plane().await.unwrap();
    arm(world, vec![SimFault::GroupFails { rank: 3, group: 0 }]);
    let t = Instant::now();
    let err = sys.orchestrator.refit(v2).await.unwrap_err().to_string();
    assert!(err.contains("simulated failure of group 0"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert!(sys.holds(v1, 2.0, 3.0).await);
    assert_eq!(sys.bits(), before, "a failed refit wrote the served memory");
    // Readers are not held off after the failure.
    assert_eq!(sys.dst[0].serve().await.version(), Some(v1));
    let v3 = sys.step(6.0, 8.0).await;
    sys.orchestrator.refit_only(orchestrator::RefitTarget::Version(v3), reshard::TensorSubset::new(["w"])).await.unwrap();
    assert!(sys.holds(v3, 6.0, 3.0).await, "the subset refit carried what v2 staged");
    let v4 = sys.step(4.0, 5.0).await;
    sys.orchestrator.refit(v4).await.unwrap();
    assert!(sys.holds(v4, 4.0, 5.0).await);
}

/// A reader serving the weights holds the commit off: the memory keeps
/// its version while the reader holds it, and takes the new one once it
/// lets go; a reader that holds on past the deadline fails the refit, and
/// nothing changes anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readers_serving_registered_weights_hold_the_commit_off() {
    let sys = std::sync::Arc::new(served_in_place(Fabric::Ipc(ipc_fabric("served/readers")), Duration::from_secs(2)));
    let v1 = sys.step(1.0, 1.0).await;
    sys.orchestrator.refit(v1).await.unwrap();
    let v2 = sys.step(2.0, 2.0).await;
    let reading = sys.dst[1].serve().await;
    let s = sys.clone();
    let refit = tokio::spawn(async move { s.orchestrator.refit(v2).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!refit.is_finished());
    assert_eq!(reading.version(), Some(v1));
    assert!(sys.memory[1][0].iter().all(|&x| x == (1f32.to_bits() >> 16) as u16), "the commit wrote under a reader");
    drop(reading);
    refit.await.unwrap().unwrap();
    assert!(sys.holds(v2, 2.0, 2.0).await);
    // Past the deadline: the refit fails, every destination keeps v2.
    let v3 = sys.step(3.0, 3.0).await;
    let before = sys.bits();
    let reading = sys.dst[2].serve().await;
    let err = sys.orchestrator.refit(v3).await.unwrap_err().to_string();
    assert!(err.contains("readers held its registered weights"), "{err}");
    drop(reading);
    assert_eq!(sys.bits(), before);
    assert!(sys.holds(v2, 2.0, 2.0).await);
    sys.orchestrator.refit(v3).await.unwrap();
    assert!(sys.holds(v3, 3.0, 3.0).await);
}

/// The host fabrics cannot write registered device memory: refused,
/// naming the rank and the fabric to use, before anything moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registered_device_destinations_are_refused_on_host_fabrics() {
    let device = orchestrator::Residence::Device { ordinal: 0 };
    let config = OrchestratorConfig { fabric: Fabric::InProcess, ..config("served", Strategy::Reshard) };
    let sys = served_in_place_in(config, orchestrator::MemberConfig::default(), device);
    let v = sys.step(1.0, 2.0).await;
    let before = sys.bits();
    match sys.orchestrator.refit(v).await {
        Err(RefitError::Refit(OrchestratorError::Refused { refusal: Refusal::Fabric(why), .. })) => {
            assert!(why.starts_with(&format!("{}:", Endpoint::dst(0))), "{why}");
            assert!(why.contains("registered device (GPU 0) memory"), "{why}");
            assert!(why.contains("orchestrator on fabric \"ipc\"") && why.contains("\"nccl\" otherwise"), "{why}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(sys.bits(), before);
    assert!(sys.dst.iter().all(|s| s.snapshot().is_none()));
}

/// A registered destination whose commit never comes (the orchestrator
/// went away after the run) lets its readers back in once its hold
/// expires, serving the version before, and refuses a commit that comes
/// later; the next refit delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_that_never_comes_lets_readers_back_in() {
    use orchestrator::protocol::PeerAddr;
    use orchestrator::{MemberConfig, MemberMsg, MemberReply};
    let world = "served/no-commit";
    let (deadline, hold) = (Duration::from_secs(2), Duration::from_millis(500));
    let config = MemberConfig { commit_hold: hold, ..MemberConfig::default() };
    let sys = served_in_place_with(Fabric::Nccl(fabric(world)), deadline, config);
    let v1 = sys.step(1.0, 1.0).await;
    sys.orchestrator.refit(v1).await.unwrap();
    sys.orchestrator.close_data_plane().await.unwrap();
    let fingerprint = sys.orchestrator.plan().await.unwrap().fingerprint;
    let v2 = sys.step(2.0, 2.0).await;
    // The first phase of a refit, as the orchestrator runs it, and no
    // second: every member prepares, connects and runs, nobody commits.
    let refit = 1 << 40;
    let mut peers = Vec::new();
    for m in &sys.members {
        let msg = MemberMsg::Prepare { refit, fingerprint, session: "no-commit".into(), fabric: Fabric::Nccl(fabric(world)), keep: false };
        match m.call(msg).await.unwrap() {
            MemberReply::Prepared { endpoint, node, addr, host } => peers.push(PeerAddr { endpoint, node, addr, host }),
            other => panic!("prepare: {other:?}"),
        }
    }
    let all = |msg: MemberMsg| {
        let calls: Vec<_> = sys
            .members
            .iter()
            .map(|m| {
                let (m, msg) = (m.clone(), msg.clone());
                tokio::spawn(async move { m.call(msg).await.unwrap() })
            })
            .collect();
        async move {
            for c in calls {
                let reply = c.await.unwrap();
                assert!(matches!(reply, MemberReply::Done | MemberReply::Ran(_)), "{reply:?}");
            }
        }
    };
    all(MemberMsg::Connect { refit, peers }).await;
    let t = Instant::now();
    all(MemberMsg::Run(orchestrator::RunRequest {
        refit,
        version: v2,
        fingerprint,
        deadline,
        delta: orchestrator::RunDelta::Off,
        verify: true,
    }))
    .await;
    // v2 is staged everywhere: readers wait for its commit ...
    assert!(tokio::time::timeout(Duration::from_millis(200), sys.dst[0].serve()).await.is_err());
    // ... until the hold expires: the memory still holds v1.
    let serving = tokio::time::timeout(deadline + hold + Duration::from_secs(5), sys.dst[0].serve()).await.unwrap();
    assert!(t.elapsed() >= hold, "{:?}", t.elapsed());
    assert_eq!(serving.version(), Some(v1));
    drop(serving);
    assert!(sys.holds(v1, 1.0, 1.0).await);
    // A commit after that is refused: nothing it staged is served.
    match sys.members[2].call(MemberMsg::Commit { version: v2 }).await.unwrap() {
        MemberReply::Refused(Refusal::Exec { why, .. }) => assert!(why.contains("hold on its readers expired"), "{why}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(sys.holds(v1, 1.0, 1.0).await);
    for m in &sys.members {
        m.call(MemberMsg::Discard).await.unwrap();
    }
    sys.orchestrator.refit(v2).await.unwrap();
    assert!(sys.holds(v2, 2.0, 2.0).await);
}

/// What a lying owner of registered memory says about its region.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Owner {
    /// The region as registered.
    Honest,
    /// Another allocation of the same size (the parameter was moved).
    Moved,
    /// The region, shrunk below the buffer's bytes.
    Shrunk,
    /// A region index it was not asked for.
    OutOfOrder,
    /// No region at all.
    Missing,
}

/// An owner whose answers `mode` chooses, over two allocations it keeps
/// alive (`home` as registered, `moved` elsewhere).
struct LyingOwner {
    mode: std::sync::Arc<std::sync::Mutex<Owner>>,
    home: u64,
    moved: u64,
    bytes: usize,
}

// SAFETY: both allocations it yields live until the test's last refit
// (dropped after it), host memory of at least `bytes` (or a region
// `Registered` must refuse), never written after registration.
unsafe impl orchestrator::RegisteredMemory for LyingOwner {
    fn residence(&self) -> orchestrator::Residence {
        orchestrator::Residence::Host
    }

    fn buffers(&self) -> usize {
        1
    }

    fn visit(
        &self,
        f: &mut dyn FnMut(usize, (u64, usize)) -> Result<(), orchestrator::RegisteredVisitError>,
    ) -> Result<(), orchestrator::RegisteredVisitError> {
        let mode = *self.mode.lock().unwrap();
        match mode {
            Owner::Honest => f(0, (self.home, self.bytes)),
            Owner::Moved => f(0, (self.moved, self.bytes)),
            Owner::Shrunk => f(0, (self.home, 16)),
            Owner::OutOfOrder => f(1, (self.home, self.bytes)),
            Owner::Missing => Ok(()),
        }
    }
}

/// Registered sources whose owner moves, shrinks or lies about their
/// memory, on every fabric: the refit follows memory that moved, refuses
/// (naming the rank) memory that shrank or a visit that skips or reorders
/// regions before a byte is sent, every destination keeps serving the
/// last good version, and the next honest refit recovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registered_sources_whose_owner_lies_are_refused_or_followed() {
    use orchestrator::SrcStore;
    use std::sync::{Arc, Mutex};
    let sim = CommPlane::Simulated { world: "lying".into() };
    let ipc = IpcFabric { plane: sim.clone(), connect_timeout: Duration::from_secs(5), abort_timeout: Duration::from_secs(1) };
    let every = [Fabric::Nccl(fabric("lying")), Fabric::Ipc(ipc), Fabric::InProcess, Fabric::Node(orchestrator::NodeFabric::default())];
    for fabric in every {
        let config = OrchestratorConfig { fabric: fabric.clone(), ..config("lying", Strategy::Reshard) };
        let (src, dst) = layouts();
        let (src, dst) = (Arc::new(src), Arc::new(dst));
        // Per source rank: its memory as registered (1.0) and where it
        // "moved" (2.0); neither is written after this.
        let mut home: Vec<Box<[f32; 28]>> = (0..2).map(|_| Box::new([1.0f32; 28])).collect();
        let mut moved: Vec<Box<[f32; 28]>> = (0..2).map(|_| Box::new([2.0f32; 28])).collect();
        let mode = Arc::new(Mutex::new(Owner::Honest));
        let bytes = std::mem::size_of::<[f32; 28]>();
        let mut src_stores = Vec::new();
        for r in 0..2usize {
            let (h, m) = (home[r].as_mut_ptr() as u64, moved[r].as_mut_ptr() as u64);
            let owner = Arc::new(LyingOwner { mode: mode.clone(), home: h, moved: m, bytes });
            let reg = orchestrator::Registered::owned(&src, r as u32, owner).unwrap();
            src_stores.push(Arc::new(SrcStore::registered(&src, r as u32, reg)));
        }
        let sys = spawn_registered(&src, &dst, src_stores, config, orchestrator::MemberConfig::default());
        let step = || async {
            let mut v = 0;
            for s in &sys.src {
                v = s.update(|_| ()).await.0;
            }
            v
        };
        let v1 = step().await;
        sys.orchestrator.refit(v1).await.unwrap();
        assert!(sys.serves(v1, 1.0), "{fabric:?}: honest");
        *mode.lock().unwrap() = Owner::Moved;
        let v2 = step().await;
        sys.orchestrator.refit(v2).await.unwrap();
        assert!(sys.serves(v2, 2.0), "{fabric:?}: the refit reads where the memory moved");
        for (lie, says) in
            [(Owner::Shrunk, "needs 112 bytes, 16 found"), (Owner::OutOfOrder, "out of order"), (Owner::Missing, "0 of 1 regions visited")]
        {
            *mode.lock().unwrap() = lie;
            let v = step().await;
            let err = sys.orchestrator.refit(v).await.expect_err("a lying owner's memory was read").to_string();
            assert!(err.contains("registered weights") && err.contains(says), "{fabric:?} {lie:?}: {err}");
            assert!(
                err.contains(&Endpoint::src(0).to_string()) || err.contains(&Endpoint::src(1).to_string()),
                "{fabric:?} {lie:?}: {err}"
            );
            assert!(sys.serves(v2, 2.0), "{fabric:?} {lie:?}: destinations keep the last good version");
        }
        *mode.lock().unwrap() = Owner::Honest;
        let v = step().await;
        sys.orchestrator.refit(v).await.unwrap();
        assert!(sys.serves(v, 1.0), "{fabric:?}: the next honest refit recovers");
        drop(sys);
        drop((home, moved));
    }
}

/// Destinations written in place (`DstStore::registered_direct`), on both
/// host fabrics: each refit lands in the served memory with nothing staged;
/// a reader past the deadline fails the refit, its rank untouched (the
/// others were written, and are torn); a refit that fails mid-run leaves
/// every destination torn (nothing served, the readers told so); never a
/// rank serving another version than the group's; the next refit that
/// commits serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn destinations_written_in_place_serve_each_commit_and_are_torn_by_a_failed_refit() {
    let fabrics = [Fabric::InProcess, Fabric::Node(orchestrator::NodeFabric::default()), Fabric::Ipc(ipc_fabric("served/in-place"))];
    for fabric in fabrics {
        let node = matches!(fabric, Fabric::Node(_));
        let ipc = matches!(fabric, Fabric::Ipc(_));
        // On the node fabric, source rank 1 cuts its first data frame in
        // the third refit (every refit connects anew). On the IPC fabric
        // every member is on one GPU: destinations read the sources
        // directly, straight into the served memory.
        let src_config = orchestrator::MemberConfig {
            tweak: Some(std::sync::Arc::new(|refit, t: &mut orchestrator::NodeFaults| {
                if refit == 3 {
                    t.faults.cut_at_frame = Some(0);
                }
            })),
            gpu: ipc.then_some(0),
            ..Default::default()
        };
        let dst_config = orchestrator::MemberConfig { gpu: ipc.then_some(0), ..Default::default() };
        let config =
            OrchestratorConfig { fabric, deadline: Duration::from_secs(2), keep_data_plane: false, ..config("served", Strategy::Reshard) };
        let how = Served { dst_config, residence: orchestrator::Residence::Host, direct: true, src_config };
        let sys = served(config, how);
        assert!(sys.dst.iter().all(|d| d.writes_in_place()));
        let v1 = sys.step(2.0, 3.0).await;
        sys.orchestrator.refit(v1).await.unwrap();
        assert!(sys.holds(v1, 2.0, 3.0).await, "node: {node}");
        // A reader past the deadline: the refit fails; the reader's rank
        // was not written.
        let v2 = sys.step(4.0, 5.0).await;
        let before = sys.memory[2].clone();
        let reading = sys.dst[2].serve().await;
        sys.orchestrator.refit(v2).await.unwrap_err();
        assert_eq!(reading.version(), Some(v1));
        drop(reading);
        assert_eq!(sys.memory[2], before, "node: {node}: written under a reader");
        assert_eq!(sys.dst[2].serve().await.version(), Some(v1));
        let mut torn = 0;
        for d in &sys.dst {
            let v = d.serve().await.version();
            assert!(v == Some(v1) || v.is_none(), "node: {node}: a rank serves {v:?}");
            torn += usize::from(v.is_none());
        }
        // The other ranks were written in place (staged, they would serve v1).
        assert!(torn > 0, "{:?}: nothing was written in place", sys.dst.iter().map(|d| d.weights()).collect::<Vec<_>>());
        if node {
            // The third refit fails mid-run: every destination is torn.
            sys.orchestrator.refit(v2).await.unwrap_err();
            for d in &sys.dst {
                assert_eq!(d.serve().await.version(), None);
                assert!(matches!(d.weights(), orchestrator::HeldVersion::Torn { .. }), "{:?}", d.weights());
            }
        }
        let v3 = sys.step(6.0, 7.0).await;
        sys.orchestrator.refit(v3).await.unwrap();
        assert!(sys.holds(v3, 6.0, 7.0).await, "node: {node}");
    }
}
