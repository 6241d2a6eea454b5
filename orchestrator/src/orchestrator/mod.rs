//! The orchestrator actor: attaches to a source group and a destination
//! group, plans once per pair of layouts, and refits after every optimizer
//! step.

mod data_plane;
mod error;
mod losses;
mod members;
mod messages;
mod plan;
mod refit;
mod replicas;
mod report;
mod verify;

pub use error::OrchestratorError;
pub use messages::{OrchestratorMsg, OrchestratorReply, RefitTarget};
pub use replicas::{ReplicaReport, SeedReport};
// (`ReplicaLoss` is defined here, beside the config it belongs to.)
pub use report::{PlanReport, RefitPhase, RefitReport, RefitStep};

use crate::member::Member;
use crate::protocol::Fabric;
use actors::{async_trait, Actor, ActorError, ActorGroup, ActorRef, Context};
use plan::{CachedPlan, KnownLayouts};
use reshard::{Endpoint, Fingerprint, Group, Layout, Plan, PlanOptions, Strategy, TensorSubset};
use std::sync::Arc;
use std::time::Duration;

/// Orchestrator settings.
#[derive(Debug, Clone)]
pub struct OrchestratorConfig {
    /// How members reach each other: in process (every member in the
    /// orchestrator's process), or the node fabric (members anywhere).
    pub fabric: Fabric,
    /// Reshard, or the gather-broadcast baseline.
    pub mode: Strategy,
    /// Planner options; by default with this machine's work limit
    /// ([`crate::machine::plan_work_limit`]), so a pair that would plan
    /// into an OOM is refused with an error naming the limit.
    pub plan: PlanOptions,
    /// Every refit must finish its data movement within this time.
    pub deadline: Duration,
    /// Time allowed for metadata calls (describe, install, commit).
    pub control_timeout: Duration,
    /// Node and communicator fabrics: keep every member's connections (or
    /// communicator) after a refit that commits, and run the next refit of
    /// the same plan on them (no listen, no connect, no shared-memory
    /// setup, no communicator creation), as a job keeps its communicators
    /// between steps. Any failure, a replaced member or
    /// [`OrchestratorMsg::CloseDataPlane`] opens a fresh data plane next
    /// time. Off: every refit opens its own (its own session id).
    pub keep_data_plane: bool,
    /// Delta refits: after a refit of a plan commits, the next refit of
    /// that plan sends each message as what changed since (every member
    /// keeps a copy of what it sent and received in the last committed
    /// refit: memory as large as its share of the bytes moved). Any
    /// failure, a replaced member or a changed layout makes the next refit
    /// dense. Destinations still write every element. Off by default.
    pub delta: bool,
    /// The layout of one inference replica, when the destination group is
    /// replicas of it: replica `r` on ranks `r * k .. (r + 1) * k`, the
    /// group laid out as [`Layout::replicated`] says. Then
    /// [`OrchestratorMsg::AddReplica`] and [`OrchestratorMsg::RemoveReplica`]
    /// grow and shrink it between refits. `None`: a fixed group.
    pub replica: Option<Arc<Layout>>,
    /// How a reshard of a destination group of replicas is planned.
    pub replica_plan: ReplicaPlan,
    /// What a refit of a destination group of replicas does when members
    /// of some replicas fail it (a replica's node lost, say).
    pub replica_loss: ReplicaLoss,
    /// What a refit does when source members are lost during it (or
    /// before it).
    pub source_loss: SourceLoss,
    /// Check every refit end to end before it commits: each member reads
    /// back what its run moved (a sender what it sent, a receiver what it
    /// holds, from the memory a commit serves) as a digest — CRC-32C of
    /// every piece as its wire values, keyed by sender, receiver, round and
    /// position, summed per pair of ranks — and the orchestrator compares
    /// them; any difference fails the refit
    /// ([`OrchestratorError::DigestMismatch`]) with nothing committed.
    /// Device memory (the communicator fabrics) is not read back: those
    /// ranks count as unverified ([`RefitReport::unverified_ranks`]). On
    /// by default; costs one more read of every byte a rank moved
    /// ([`RefitReport::verify_time`], docs/benchmarks.md).
    pub digest_check: bool,
}

/// How a reshard to a destination group of replicas
/// ([`OrchestratorConfig::replica`]) is planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplicaPlan {
    /// One replica's plan, planned once per layouts and options and kept,
    /// copied onto every replica ([`Plan::for_replicas`]): a replica that
    /// joins or leaves costs a derivation, not a plan of the whole group.
    /// No replica relays to another, so one lost mid-refit starves no
    /// other; each replica's bytes leave the sources (spread over their
    /// data-parallel holders). Where a replica does not fill whole nodes,
    /// the group is planned whole.
    #[default]
    Derived,
    /// The whole group planned at once: a piece may leave the sources
    /// once and be relayed from replica to replica (fewer source bytes,
    /// more stages; a replica's loss can fail the others' transfer).
    Whole,
}

/// What a reshard refit does when source members die or stop answering
/// (and every member whose own part failed is such a source).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SourceLoss {
    /// The lost sources are left out: the refit is planned again with
    /// every piece from another source that holds it (a data-parallel
    /// replica) and runs again (twice at most), committing the same
    /// version; where only lost sources hold some part, it fails as
    /// [`Fail`](SourceLoss::Fail) would. They stay out (and are not asked
    /// anything) until replaced ([`OrchestratorMsg::Replace`]) or the
    /// groups are attached again.
    #[default]
    Replan,
    /// The refit fails; every destination keeps the version it served.
    Fail,
}

/// What a refit of a destination group of replicas
/// ([`OrchestratorConfig::replica`]) does when destination members fail
/// it and every source did its part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplicaLoss {
    /// The replicas of the failed members leave the group (as
    /// [`OrchestratorMsg::RemoveReplica`] would) and the others get the
    /// version: committed at once if each of their members ran its
    /// program to the end, else the refit runs again without the lost
    /// replicas (twice at most). A replica serves the new version whole
    /// or keeps the one it served; never a mix. With no replica left, the
    /// refit fails.
    #[default]
    Drop,
    /// The refit fails; every destination keeps the version it served.
    Fail,
}

impl OrchestratorConfig {
    /// The planner options of a refit: [`OrchestratorConfig::plan`], its
    /// staging per round at most what the fabric bounds a round to
    /// ([`Fabric::round_bytes`]).
    pub(crate) fn plan_options(&self) -> PlanOptions {
        let mut options = self.plan.clone();
        if let Some(cap) = self.fabric.round_bytes() {
            options.max_staging_bytes = options.max_staging_bytes.min(cap);
        }
        options
    }

    /// How long a caller waits for the orchestrator's answer to one refit:
    /// the data plane's deadline plus every control step's.
    pub fn call_timeout(&self) -> Duration {
        let connect = match &self.fabric {
            Fabric::Node(n) => n.connect_timeout,
            // Creation, and the cleanup of a creation that failed.
            Fabric::Nccl(n) => n.init_timeout + n.abort_timeout,
            Fabric::Ipc(n) => n.connect_timeout + n.abort_timeout,
            Fabric::InProcess => Duration::ZERO,
        };
        self.deadline + connect + 8 * self.control_timeout
    }
}

impl Default for OrchestratorConfig {
    fn default() -> Self {
        OrchestratorConfig {
            fabric: Fabric::InProcess,
            mode: Strategy::Reshard,
            plan: PlanOptions { max_work: crate::machine::plan_work_limit(), ..PlanOptions::default() },
            deadline: transport::DEFAULT_DEADLINE,
            control_timeout: Duration::from_secs(10),
            keep_data_plane: true,
            delta: false,
            replica: None,
            replica_plan: ReplicaPlan::Derived,
            replica_loss: ReplicaLoss::Drop,
            source_loss: SourceLoss::Replan,
            digest_check: true,
        }
    }
}

/// The orchestrator actor.
pub struct Orchestrator {
    src: ActorGroup<Member>,
    dst: ActorGroup<Member>,
    config: OrchestratorConfig,
    /// One plan per strategy and subset, while both layouts stay the same.
    cache: std::collections::HashMap<(Strategy, Option<TensorSubset>), CachedPlan>,
    /// Delta refits: per plan, the last refit of it that committed (every
    /// member keeps what it sent and received then).
    delta_base: std::collections::HashMap<Fingerprint, u64>,
    /// The layouts, kept while members report the same fingerprints (a
    /// replaced member then costs a plan, not a describe).
    layouts: Option<KnownLayouts>,
    plans_made: u64,
    /// Refits started, the data-plane epoch.
    refits: u64,
    /// The sessions whose node-fabric connections every member keeps, by
    /// plan: recorded when a refit commits, forgotten on any failure or
    /// change of members.
    kept: Vec<(Fingerprint, String)>,
    phase: tokio::sync::watch::Sender<RefitPhase>,
    /// Control messages sent to members so far (calls and tells).
    sent: std::sync::atomic::AtomicU64,
    /// Replicas seeded so far (serving replicas take turns).
    seeded: u64,
    /// The plan between two replicas, by the replica layout's fingerprint.
    seed_plan: Option<(u64, Arc<Plan>)>,
    /// One replica's plan, the one every plan of the group of replicas
    /// derives from ([`ReplicaPlan::Derived`]), by what it was planned for.
    replica_template: Option<(plan::TemplateKey, Arc<Plan>)>,
    /// Replicas dropped by the refit in progress (see
    /// [`ReplicaLoss::Drop`]).
    dropped: Vec<u32>,
    /// Source ranks lost and left out of plans until replaced (see
    /// [`SourceLoss::Replan`]), sorted.
    lost_sources: Vec<u32>,
}

impl Orchestrator {
    /// An orchestrator for these groups.
    pub fn new(src: ActorGroup<Member>, dst: ActorGroup<Member>, config: OrchestratorConfig) -> Orchestrator {
        Orchestrator {
            src,
            dst,
            config,
            cache: Default::default(),
            delta_base: Default::default(),
            layouts: None,
            plans_made: 0,
            refits: 0,
            kept: Vec::new(),
            phase: tokio::sync::watch::Sender::default(),
            sent: Default::default(),
            seeded: 0,
            seed_plan: None,
            replica_template: None,
            dropped: Vec::new(),
            lost_sources: Vec::new(),
        }
    }

    /// Follows the refit in progress, step by step.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<RefitPhase> {
        self.phase.subscribe()
    }

    fn enter(&self, step: RefitStep) {
        self.phase.send_replace(RefitPhase { refit: self.refits, step });
    }

    /// Counts `n` control messages sent to members.
    fn sent(&self, n: usize) {
        self.sent.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// Control messages sent to members so far.
    fn sent_so_far(&self) -> u64 {
        self.sent.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many times this orchestrator has planned (a plan derived for
    /// replicas from a kept replica's plan is not counted: only planning).
    pub fn plans_made(&self) -> u64 {
        self.plans_made
    }
}

impl Orchestrator {
    /// Puts `member` in place of rank `endpoint`'s.
    fn replace(&mut self, endpoint: Endpoint, member: ActorRef<Member>) -> Result<(), OrchestratorError> {
        let group = match endpoint.group {
            Group::Src => &mut self.src,
            Group::Dst => &mut self.dst,
        };
        let ranks = group.len();
        *group = group.with_member(endpoint.rank as usize, member).map_err(|_| OrchestratorError::NoRank { endpoint, ranks })?;
        Ok(())
    }
}

#[async_trait]
impl Actor for Orchestrator {
    type Msg = OrchestratorMsg;
    type Reply = OrchestratorReply;

    async fn handle(&mut self, msg: OrchestratorMsg, _ctx: &mut Context<Self>) -> Result<OrchestratorReply, ActorError> {
        Ok(match msg {
            OrchestratorMsg::Refit { target, only } => OrchestratorReply::Refit(self.refit(target, only).await),
            OrchestratorMsg::Plan => OrchestratorReply::Planned(self.plan().await),
            OrchestratorMsg::PlansMade => OrchestratorReply::PlansMade(self.plans_made),
            OrchestratorMsg::SetMode(mode) => {
                // Plans are kept per strategy: switching back is free.
                self.config.mode = mode;
                OrchestratorReply::Done(Ok(()))
            }
            OrchestratorMsg::Attach { src, dst } => {
                // Cached plans stay valid while the members report the same
                // layouts; members that lack the plan get it installed.
                self.forget_data_plane(true);
                self.lost_sources.clear();
                self.src = src;
                self.dst = dst;
                OrchestratorReply::Done(Ok(()))
            }
            OrchestratorMsg::Replace { endpoint, member } => {
                // The other members' peers change: all reconnect.
                self.forget_data_plane(true);
                if endpoint.group == Group::Src {
                    self.lost_sources.retain(|&r| r != endpoint.rank);
                }
                OrchestratorReply::Done(self.replace(endpoint, member))
            }
            OrchestratorMsg::AddReplica { members } => OrchestratorReply::Replicas(self.add_replica(members).await),
            OrchestratorMsg::RemoveReplica { replica } => OrchestratorReply::Replicas(self.remove_replica(replica).await),
            OrchestratorMsg::CloseDataPlane => {
                self.forget_data_plane(true);
                OrchestratorReply::Done(Ok(()))
            }
            OrchestratorMsg::Invalidate => {
                self.forget_data_plane(true);
                self.cache.clear();
                self.layouts = None;
                OrchestratorReply::Done(Ok(()))
            }
        })
    }
}
