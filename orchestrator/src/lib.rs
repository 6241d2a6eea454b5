//! Refit roles and the orchestrator.
//!
//! **Data model.** The two sides of a refit are the **source** group (the
//! training ranks) and the **destination** group (the inference ranks),
//! `src` and `dst` for short, each laid out by a [`Layout`]. Every rank of
//! either group is a [`Member`] actor that shares its rank's weights with
//! the user's own actors through a store:
//!
//! - [`SrcStore`] (source rank): the optimizer writes it with
//!   [`SrcStore::update`]; a refit reads it under the same lock, so no
//!   refit ever reads half an optimizer step (the version fence), and a
//!   failed step keeps the version (and refits refuse weights it changed).
//! - [`DstStore`] (destination rank): a refit writes a staging copy; the
//!   new version becomes visible only when every destination of the group
//!   has staged all of it (two-phase: stage everywhere, then flip
//!   everywhere), by a swap, not a copy. The previous version stays
//!   readable ([`DstStore::snapshot_at`]) so a tensor-parallel group reads
//!   one agreed version while a commit sweeps over it.
//! - [`Buffers`] are a rank's memory; [`Buffers::tensor`] gives a
//!   [`TensorView`] of one tensor's block that knows where the block sits
//!   in the global tensor, with typed reads and writes.
//!
//! The [`Orchestrator`] actor speaks the member protocol ([`protocol`]):
//! it asks the members for their layouts by message, validates them, plans
//! once (cached while neither layout changes), installs each member's own
//! program, and on every [`Refit`](OrchestratorMsg::Refit) has every member
//! open its end of a fresh data plane ([`Fabric`]), connect, run, and then
//! commits on every destination — or, on any failure, discards everywhere.
//!
//! Members are ordinary [`ActorRef`]s: in this process ([`spawn_refit`],
//! the in-process fabric), or in other processes and hosts that joined a
//! [`Rendezvous`] ([`rendezvous`], the node fabric). The orchestrator is
//! the same either way.

pub mod machine;
mod member;
mod orchestrator;
pub mod protocol;
pub mod rendezvous;
mod store;

pub use member::{FaultHook, Member, MemberConfig, Role};
pub use orchestrator::{
    Orchestrator, OrchestratorConfig, OrchestratorError, OrchestratorMsg, OrchestratorReply, PlanReport, RefitPhase, RefitReport,
    RefitStep, RefitTarget, ReplicaLoss, ReplicaPlan, ReplicaReport, SeedReport, SourceLoss,
};
pub use protocol::{
    CommPlane, DataAddr, DigestError, EgressCaps, Fabric, HeldVersion, IpcFabric, LayoutInfo, MemberMsg, MemberReply, NcclFabric,
    NodeFabric, ProgramRole, RankDigest, Refusal, RunDelta, RunRequest, RunStats,
};
pub use rendezvous::{join, member_name, replica_member_name, JoinConfig, JoinError, Joined, Rendezvous};
pub use reshard::TensorSubset;
pub use store::{
    BufferError, Buffers, DstStore, Registered, RegisteredMemory, RegisteredMemoryError, RegisteredVisitError, Residence, Serving,
    Snapshot, SrcStore, TensorView, TensorViewMut, UpdateGuard,
};
/// Work the GPU planes of this process did on the host instead of the
/// device (fallbacks, and dtype pairs no kernel converts): for GPU checks.
pub use transport::cuda::{host_work, HostWork};
pub use transport::fabric::NodeFaults;
pub use transport::Faults;
pub use transport::DEFAULT_DEADLINE;

/// The verification pattern, for tools and tests (feature `testkit`):
/// fill a source rank's weights with the pattern of a version, check what
/// a destination rank holds against it.
#[cfg(feature = "testkit")]
pub mod testkit {
    pub use transport::{fill_source_rank_at, verify_destination_rank_from, Mismatch};

    /// A byte a member flips in the memory its next run wrote, after the
    /// run and before its digest ([`MemberConfig::corrupt`](crate::MemberConfig::corrupt)):
    /// for tests that what changes between a transfer and a commit fails
    /// the refit. Armed once; the run that flips it disarms it.
    #[derive(Debug, Default)]
    pub struct Corrupt(std::sync::Mutex<Option<(u32, u64)>>);

    impl Corrupt {
        /// Flips byte `byte` of buffer `buffer` (the program's buffer
        /// list: the rank's own, then scratch) after the next run.
        pub fn arm(&self, buffer: u32, byte: u64) {
            *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some((buffer, byte));
        }

        /// Whether the armed flip is still to come.
        pub fn armed(&self) -> bool {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).is_some()
        }

        /// The armed flip, disarmed.
        pub(crate) fn take(&self) -> Option<(u32, u64)> {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
        }
    }
}

use transport::GpuUnavailable;

/// Why the members of this process cannot open a fabric
/// ([`fabric_available`]): the GPU data plane's reason.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(transparent)]
pub struct FabricUnavailable(GpuUnavailable);

/// Whether `members` members of this process can open `fabric` (the CUDA
/// fabrics need the `cuda` feature, CUDA and NCCL at run time, and a GPU
/// per member); why not if not.
pub fn fabric_available(fabric: &Fabric, members: u32) -> Result<(), FabricUnavailable> {
    use transport::{gpu_plane_available, GpuPlane};
    match fabric {
        Fabric::Nccl(NcclFabric { plane: CommPlane::Cuda, .. }) => gpu_plane_available(GpuPlane::Nccl, members),
        Fabric::Ipc(IpcFabric { plane: CommPlane::Cuda, .. }) => gpu_plane_available(GpuPlane::Device, members),
        _ => Ok(()),
    }
    .map_err(FabricUnavailable)
}

use actors::{spawn, spawn_group, spawn_rank, ActorGroup, ActorRef, CallError, SpawnConfig, Supervisor, SupervisorEvents};
use reshard::{Endpoint, Group, Layout, Rank, Strategy};

/// What a pipeline needs, in one `use`: layouts and their builder, the
/// stores and tensor views, the refit system and its errors.
pub mod prelude {
    pub use crate::{
        spawn_refit, BufferError, Buffers, DstStore, HeldVersion, OrchestratorConfig, OrchestratorError, OrchestratorHandle, RefitError,
        RefitReport, RefitSystem, RefitTarget, Snapshot, SrcStore, TensorView, TensorViewMut,
    };
    pub use reshard::{parse_layout, DType, Endpoint, Group, Layout, LayoutBuilder, MeshDim, Rank, Strategy, TensorBuilder, TensorSubset};
}
use std::sync::Arc;
use thiserror::Error;

/// Why a call to the orchestrator failed.
#[derive(Debug, Clone, Error)]
pub enum RefitError {
    /// The refit itself failed.
    #[error(transparent)]
    Refit(#[from] OrchestratorError),
    /// The orchestrator could not be reached.
    #[error("orchestrator: {0}")]
    Call(#[from] CallError),
}

/// A typed handle to the orchestrator actor.
#[derive(Clone)]
pub struct OrchestratorHandle {
    actor: ActorRef<Orchestrator>,
    phases: tokio::sync::watch::Receiver<RefitPhase>,
}

impl OrchestratorHandle {
    /// Spawns `orchestrator` and wraps it. Must be called inside a tokio
    /// runtime.
    pub fn spawn(orchestrator: Orchestrator, config: SpawnConfig) -> OrchestratorHandle {
        let phases = orchestrator.subscribe();
        OrchestratorHandle { actor: spawn(orchestrator, config), phases }
    }

    /// The refit in progress and its step, as it changes.
    pub fn phases(&self) -> tokio::sync::watch::Receiver<RefitPhase> {
        self.phases.clone()
    }

    /// The actor.
    pub fn actor(&self) -> &ActorRef<Orchestrator> {
        &self.actor
    }

    async fn ask_refit(&self, target: RefitTarget, only: Option<TensorSubset>) -> Result<RefitReport, RefitError> {
        match self.actor.call(OrchestratorMsg::Refit { target, only }).await? {
            OrchestratorReply::Refit(r) => Ok(r?),
            other => unreachable!("Refit answered with {other:?}"),
        }
    }

    async fn ask(&self, msg: OrchestratorMsg) -> Result<(), RefitError> {
        match self.actor.call(msg).await? {
            OrchestratorReply::Done(r) => Ok(r?),
            other => unreachable!("answered with {other:?}"),
        }
    }

    /// Refits `version` into every destination: every source must hold
    /// it. Nothing moves if every destination already serves it. Waits
    /// for any refit in progress.
    pub async fn refit(&self, version: u64) -> Result<RefitReport, RefitError> {
        self.ask_refit(RefitTarget::Version(version), None).await
    }

    /// Refits the newest version every source holds (see
    /// [`RefitTarget::Latest`]): no version to pass, and a step that lands
    /// during the refit makes it deliver the newer weights rather than
    /// fail.
    pub async fn refit_latest(&self) -> Result<RefitReport, RefitError> {
        self.ask_refit(RefitTarget::Latest, None).await
    }

    /// A *subset refit*: refits `target` into every destination for the
    /// tensors in `only` (LoRA adapters, one stage's weights) and nothing
    /// else. Every destination must already serve a committed version:
    /// each keeps all other tensors' bytes from the version it serves, and
    /// after the commit reports `target`'s version for the whole set. That
    /// is right when nothing outside `only` changed at the sources since
    /// that version (a frozen base model); refit every tensor otherwise.
    /// Plans once per subset (cached like the full plan; a member keeps
    /// [`INSTALLED_PLANS`](protocol::INSTALLED_PLANS) plans). Nothing moves
    /// if every destination already serves the version.
    pub async fn refit_only(&self, target: RefitTarget, only: TensorSubset) -> Result<RefitReport, RefitError> {
        self.ask_refit(target, Some(only)).await
    }

    /// Checks both groups' layouts, plans and installs every member's
    /// program now: a pair that cannot be planned fails here, not at the
    /// first refit.
    pub async fn plan(&self) -> Result<PlanReport, RefitError> {
        match self.actor.call(OrchestratorMsg::Plan).await? {
            OrchestratorReply::Planned(r) => Ok(r?),
            other => unreachable!("Plan answered with {other:?}"),
        }
    }

    /// Switches between reshard and baseline.
    pub async fn set_mode(&self, mode: Strategy) -> Result<(), RefitError> {
        self.ask(OrchestratorMsg::SetMode(mode)).await
    }

    /// Drops the node-fabric connections members keep between refits
    /// ([`OrchestratorConfig::keep_data_plane`]): the next refit opens a
    /// fresh data plane.
    pub async fn close_data_plane(&self) -> Result<(), RefitError> {
        self.ask(OrchestratorMsg::CloseDataPlane).await
    }

    /// Replaces both groups (a resize or re-shard); the next refit replans.
    pub async fn attach(&self, src: ActorGroup<Member>, dst: ActorGroup<Member>) -> Result<(), RefitError> {
        self.ask(OrchestratorMsg::Attach { src, dst }).await
    }

    /// Puts `member` in the place of rank `endpoint`'s member (one that
    /// died); the next refit installs the plan on it alone.
    pub async fn replace(&self, endpoint: Endpoint, member: ActorRef<Member>) -> Result<(), RefitError> {
        self.ask(OrchestratorMsg::Replace { endpoint, member }).await
    }

    /// Adds a replica to a destination group of replicas
    /// ([`OrchestratorConfig::replica`]): `members` hold the replica's
    /// layout, rank `j` at index `j`. It is seeded with the newest version
    /// a whole replica serves, from that replica's memory (no source rank
    /// sends anything), and every later refit includes it. Waits for any
    /// refit in progress.
    pub async fn add_replica(&self, members: ActorGroup<Member>) -> Result<ReplicaReport, RefitError> {
        self.ask_replicas(OrchestratorMsg::AddReplica { members }).await
    }

    /// Removes replica `replica` (its index in the group) from a
    /// destination group of replicas: its members keep serving what they
    /// committed and are asked nothing more; later replicas move up one
    /// place. Waits for any refit in progress.
    pub async fn remove_replica(&self, replica: u32) -> Result<ReplicaReport, RefitError> {
        self.ask_replicas(OrchestratorMsg::RemoveReplica { replica }).await
    }

    async fn ask_replicas(&self, msg: OrchestratorMsg) -> Result<ReplicaReport, RefitError> {
        match self.actor.call(msg).await? {
            OrchestratorReply::Replicas(r) => Ok(r?),
            other => unreachable!("a replica request answered with {other:?}"),
        }
    }

    /// Number of plans made so far.
    pub async fn plans_made(&self) -> Result<u64, RefitError> {
        match self.actor.call(OrchestratorMsg::PlansMade).await? {
            OrchestratorReply::PlansMade(n) => Ok(n),
            other => unreachable!("PlansMade answered with {other:?}"),
        }
    }
}

/// Spawns an orchestrator over groups of members found elsewhere (a
/// [`Rendezvous`]). Must be called inside a tokio runtime.
pub fn spawn_orchestrator(src: ActorGroup<Member>, dst: ActorGroup<Member>, config: OrchestratorConfig) -> OrchestratorHandle {
    let timeout = config.call_timeout();
    OrchestratorHandle::spawn(Orchestrator::new(src, dst, config), SpawnConfig::default().name("orchestrator").call_timeout(timeout))
}

/// Everything [`spawn_refit`] made.
pub struct RefitSystem {
    /// The orchestrator.
    pub orchestrator: OrchestratorHandle,
    /// One store per source rank, by rank.
    pub src_stores: Vec<Arc<SrcStore>>,
    /// One store per destination rank, by rank.
    pub dst_stores: Vec<Arc<DstStore>>,
    /// The source group's members.
    pub src_members: ActorGroup<Member>,
    /// The destination group's members.
    pub dst_members: ActorGroup<Member>,
    /// Termination events of every member (named `src[rank]` and
    /// `dst[rank]`).
    pub events: SupervisorEvents,
    /// What planning and installing every member's program at the start
    /// took.
    pub planned: PlanReport,
    src_layout: Arc<Layout>,
    dst_layout: Arc<Layout>,
    /// How members are spawned (call timeout, the supervisor of `events`);
    /// named after their group.
    member_spawn: SpawnConfig,
    /// The fabric (a replaced member's GPU follows from it).
    fabric: Fabric,
}

impl RefitSystem {
    /// Starts a fresh member for one rank, over the same store, in place
    /// of one that stopped (see [`events`](Self::events)); the other
    /// members, their stores and the plan stay. The next refit installs
    /// the plan on the new member alone.
    pub async fn replace_member(&mut self, endpoint: Endpoint) -> Result<(), RefitError> {
        let rank = endpoint.rank as usize;
        let (role, layout, ranks) = match endpoint.group {
            Group::Src => (self.src_stores.get(rank).cloned().map(Role::Src), &self.src_layout, self.src_stores.len()),
            Group::Dst => (self.dst_stores.get(rank).cloned().map(Role::Dst), &self.dst_layout, self.dst_stores.len()),
        };
        let role = role.ok_or(OrchestratorError::NoRank { endpoint, ranks })?;
        let config = self.member_spawn.clone().name(endpoint.group.to_string());
        let member = spawn_rank(Member::with_config(layout.clone(), endpoint.rank, role, self.member_config(endpoint)), config, rank);
        self.orchestrator.replace(endpoint, member.clone()).await?;
        let members = match endpoint.group {
            Group::Src => &mut self.src_members,
            Group::Dst => &mut self.dst_members,
        };
        *members = members.with_member(rank, member).map_err(|_| OrchestratorError::NoRank { endpoint, ranks })?;
        Ok(())
    }
}

/// The settings of an in-process member: on the NCCL and IPC fabrics,
/// rank `i` of the communicator (sources first) uses GPU `i`.
fn in_process_member(endpoint: Endpoint, src_ranks: u32, fabric: &Fabric) -> MemberConfig {
    let gpu = matches!(fabric, Fabric::Nccl(_) | Fabric::Ipc(_)).then(|| transport::cuda::comm_rank(endpoint, src_ranks) as usize);
    MemberConfig { gpu, ..MemberConfig::default() }
}

impl RefitSystem {
    fn member_config(&self, endpoint: Endpoint) -> MemberConfig {
        in_process_member(endpoint, self.src_layout.ranks(), &self.fabric)
    }
}

/// Spawns one store and one member per rank of both layouts, all in this
/// process, and an orchestrator over them; then plans and installs (see
/// [`OrchestratorHandle::plan`]), so that a pair of layouts that cannot be
/// planned fails here. On the NCCL fabric, rank `i` of the communicator
/// (sources first, then destinations) runs on GPU `i`. Must be called
/// inside a tokio runtime.
pub async fn spawn_refit(src: &Layout, dst: &Layout, config: OrchestratorConfig) -> Result<RefitSystem, RefitError> {
    let (src, dst) = (Arc::new(src.clone()), Arc::new(dst.clone()));
    let member_config = |e: Endpoint| in_process_member(e, src.ranks(), &config.fabric);
    let src_stores: Vec<Arc<SrcStore>> = (0..src.ranks()).map(|r| Arc::new(SrcStore::new(&src, r))).collect();
    let dst_stores: Vec<Arc<DstStore>> = (0..dst.ranks()).map(|r| Arc::new(DstStore::new(&dst, r))).collect();
    let (supervisor, events) = Supervisor::channel();
    let member_spawn = SpawnConfig::default().call_timeout(config.deadline + config.control_timeout).supervisor(&supervisor);
    let spawn_config = |g: Group| member_spawn.clone().name(g.to_string());
    let src_members = spawn_group(src_stores.len(), spawn_config(Group::Src), |r| {
        Member::with_config(src.clone(), r as Rank, Role::Src(src_stores[r].clone()), member_config(Endpoint::src(r as Rank)))
    });
    let dst_members = spawn_group(dst_stores.len(), spawn_config(Group::Dst), |r| {
        Member::with_config(dst.clone(), r as Rank, Role::Dst(dst_stores[r].clone()), member_config(Endpoint::dst(r as Rank)))
    });
    let orchestrator = OrchestratorHandle::spawn(
        Orchestrator::new(src_members.clone(), dst_members.clone(), config.clone()),
        SpawnConfig::default().name("orchestrator").call_timeout(config.call_timeout()),
    );
    let planned = orchestrator.plan().await?;
    Ok(RefitSystem {
        planned,
        orchestrator,
        src_stores,
        dst_stores,
        src_members,
        dst_members,
        events,
        src_layout: src,
        dst_layout: dst,
        member_spawn,
        fabric: config.fabric,
    })
}
