//! Refit roles and the orchestrator.
//!
//! **Data model.** A training group and an inference group are each a group
//! of [`Member`] actors, one per rank, that share their rank's weights with
//! the user's own actors through a store:
//!
//! - [`SourceStore`] (training rank): the optimizer writes it with
//!   [`SourceStore::update`]; a refit reads it under the same lock, so no
//!   refit ever reads half an optimizer step (the version fence).
//! - [`SinkStore`] (inference rank): a refit writes a staging copy; the new
//!   version becomes visible only when every sink of the group has staged
//!   all of it (two-phase: stage everywhere, then flip everywhere), by a
//!   swap, not a copy. The previous version stays readable
//!   ([`SinkStore::snapshot_at`]) so a tensor-parallel group reads one
//!   agreed version while a commit sweeps over it.
//!
//! The [`Orchestrator`] actor speaks the member protocol ([`protocol`]):
//! it asks the members for their layouts by message, validates them, plans
//! once (cached while neither layout changes), installs each member's own
//! program, and on every [`Refit`](OrchestratorMsg::Refit) has every member
//! open its end of a fresh data plane ([`Fabric`]), connect, run, and then
//! commits on every sink — or, on any failure, discards everywhere.
//!
//! Members are ordinary [`ActorRef`]s: in this process ([`spawn_refit`],
//! the in-process fabric), or in other processes and hosts that joined a
//! [`Rendezvous`] ([`rendezvous`], the node fabric). The orchestrator is
//! the same either way.

mod fabric;
mod member;
mod orchestrator;
pub mod protocol;
pub mod rendezvous;
mod store;

pub use member::{FabricTweak, Member, MemberConfig, Role};
pub use orchestrator::{
    Orchestrator, OrchestratorConfig, OrchestratorError, OrchestratorMsg, OrchestratorReply, RefitPhase, RefitReport, RefitStep,
};
pub use protocol::{Fabric, LayoutInfo, MemberMsg, MemberReply, NodeFabric, Refusal};
pub use rendezvous::{join, member_name, JoinConfig, JoinError, Joined, Rendezvous};
pub use store::{Buffers, SinkStore, Snapshot, SourceStore};
pub use transport::DEFAULT_DEADLINE;

use actors::{spawn, spawn_group, ActorGroup, ActorRef, CallError, SpawnConfig, Supervisor, SupervisorEvents};
use reshard::{Layout, Strategy};
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

    /// Refits `version` into every sink; waits for any refit in progress.
    pub async fn refit(&self, version: u64) -> Result<RefitReport, RefitError> {
        match self.actor.call(OrchestratorMsg::Refit { version }).await? {
            OrchestratorReply::Refit(r) => Ok(r?),
            other => unreachable!("Refit answered with {other:?}"),
        }
    }

    /// Switches between reshard and baseline.
    pub async fn set_mode(&self, mode: Strategy) -> Result<(), RefitError> {
        self.actor.call(OrchestratorMsg::SetMode(mode)).await?;
        Ok(())
    }

    /// Replaces both groups (a resize or re-shard); the next refit replans.
    pub async fn attach(&self, sources: ActorGroup<Member>, sinks: ActorGroup<Member>) -> Result<(), RefitError> {
        self.actor.call(OrchestratorMsg::Attach { sources, sinks }).await?;
        Ok(())
    }

    /// Number of plans made so far.
    pub async fn plans_made(&self) -> Result<u64, RefitError> {
        match self.actor.call(OrchestratorMsg::PlansMade).await? {
            OrchestratorReply::PlansMade(n) => Ok(n),
            other => unreachable!("PlansMade answered with {other:?}"),
        }
    }
}

/// How long a caller waits for the orchestrator's answer to one refit: the
/// data plane's deadline plus every control step's.
pub fn orchestrator_call_timeout(config: &OrchestratorConfig) -> std::time::Duration {
    let connect = match &config.fabric {
        Fabric::Node(n) => n.connect_timeout,
        Fabric::InProcess => std::time::Duration::ZERO,
    };
    config.deadline + connect + 8 * config.control_timeout
}

/// Spawns an orchestrator over groups of members found elsewhere (a
/// [`Rendezvous`]). Must be called inside a tokio runtime.
pub fn spawn_orchestrator(sources: ActorGroup<Member>, sinks: ActorGroup<Member>, config: OrchestratorConfig) -> OrchestratorHandle {
    let timeout = orchestrator_call_timeout(&config);
    OrchestratorHandle::spawn(Orchestrator::new(sources, sinks, config), SpawnConfig::default().name("orchestrator").call_timeout(timeout))
}

/// Everything [`spawn_refit`] made.
pub struct RefitSystem {
    /// The orchestrator.
    pub orchestrator: OrchestratorHandle,
    /// One store per training rank.
    pub sources: Vec<Arc<SourceStore>>,
    /// One store per inference rank.
    pub sinks: Vec<Arc<SinkStore>>,
    /// The training group's members.
    pub source_members: ActorGroup<Member>,
    /// The inference group's members.
    pub sink_members: ActorGroup<Member>,
    /// Termination events of every member.
    pub events: SupervisorEvents,
}

/// Spawns stores and members for both layouts, all in this process, and an
/// orchestrator over them. Must be called inside a tokio runtime.
pub fn spawn_refit(src: &Layout, dst: &Layout, config: OrchestratorConfig) -> RefitSystem {
    let sources: Vec<Arc<SourceStore>> = (0..src.ranks()).map(|r| Arc::new(SourceStore::new(src, r))).collect();
    let sinks: Vec<Arc<SinkStore>> = (0..dst.ranks()).map(|r| Arc::new(SinkStore::new(dst, r))).collect();
    let (supervisor, events) = Supervisor::channel();
    let member_config = |name: &str| SpawnConfig::default().name(name).call_timeout(config.deadline + config.control_timeout);
    let (src_layout, dst_layout) = (Arc::new(src.clone()), Arc::new(dst.clone()));
    let source_members = spawn_group(sources.len(), member_config("source"), |r| {
        Member::new(src_layout.clone(), r as u32, Role::Source(sources[r].clone()))
    });
    let sink_members =
        spawn_group(sinks.len(), member_config("sink"), |r| Member::new(dst_layout.clone(), r as u32, Role::Sink(sinks[r].clone())));
    source_members.link(&supervisor);
    sink_members.link(&supervisor);
    let orchestrator = OrchestratorHandle::spawn(
        Orchestrator::new(source_members.clone(), sink_members.clone(), config.clone()),
        SpawnConfig::default().name("orchestrator").call_timeout(orchestrator_call_timeout(&config)),
    );
    RefitSystem { orchestrator, sources, sinks, source_members, sink_members, events }
}
