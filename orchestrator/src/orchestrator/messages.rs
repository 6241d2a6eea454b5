//! What the orchestrator is asked and answers: [`OrchestratorMsg`],
//! [`OrchestratorReply`], and which version a refit delivers
//! ([`RefitTarget`]).

use super::{OrchestratorError, PlanReport, RefitReport, ReplicaReport};
use crate::member::Member;
use actors::{ActorGroup, ActorRef};
use reshard::{Endpoint, Strategy, TensorSubset};

/// Which version a refit delivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefitTarget {
    /// This version, which every source must hold.
    Version(u64),
    /// The newest version every source holds: if a step is under way on
    /// some sources, wait (up to the control timeout) until all hold the
    /// same; if a step lands while the refit reads, start again with it.
    Latest,
}

/// Messages the orchestrator handles.
pub enum OrchestratorMsg {
    /// Refit a version into every destination; nothing moves if every
    /// destination already serves it.
    Refit {
        /// Which version.
        target: RefitTarget,
        /// Only these destination tensors (a subset refit: each
        /// destination keeps every other tensor's bytes from the version it
        /// serves); `None`: every tensor.
        only: Option<TensorSubset>,
    },
    /// Check both groups' layouts, plan (unless cached) and install every
    /// member's program now, rather than at the first refit.
    Plan,
    /// Switch between reshard and baseline (plans the other strategy on the
    /// next refit, once).
    SetMode(Strategy),
    /// Replace the groups (a resize, or replaced members); the next refit
    /// replans if their layouts changed and installs on members that lack
    /// the plan.
    Attach {
        /// Source (training) ranks.
        src: ActorGroup<Member>,
        /// Destination (inference) ranks.
        dst: ActorGroup<Member>,
    },
    /// Replace the member of one rank (one that died) and keep the others;
    /// the next refit installs the plan on it.
    Replace {
        /// The rank.
        endpoint: Endpoint,
        /// Its new member.
        member: ActorRef<Member>,
    },
    /// Add a replica to a destination group of replicas
    /// ([`OrchestratorConfig::replica`](super::OrchestratorConfig::replica)),
    /// as its last: it is seeded with the newest version a whole replica
    /// serves, from that replica (no source rank sends anything), then
    /// planned into every refit. Handled between refits.
    AddReplica {
        /// Its members, rank `j` of the replica's layout at index `j`,
        /// each holding that layout.
        members: ActorGroup<Member>,
    },
    /// Remove replica `replica` (its index in the group) from a destination
    /// group of replicas: its members are asked nothing more and keep
    /// serving what they committed; the replicas after it move up.
    /// Handled between refits.
    RemoveReplica {
        /// The replica's index.
        replica: u32,
    },
    /// Forget the cached plan.
    Invalidate,
    /// Drop the node-fabric connections members keep between refits; the
    /// next refit opens a fresh data plane.
    CloseDataPlane,
    /// How many plans have been made so far.
    PlansMade,
}

/// Replies of the orchestrator.
#[derive(Debug, Clone)]
pub enum OrchestratorReply {
    /// The outcome of a refit.
    Refit(Result<RefitReport, OrchestratorError>),
    /// The outcome of `Plan`.
    Planned(Result<PlanReport, OrchestratorError>),
    /// Number of plans made.
    PlansMade(u64),
    /// The outcome of `AddReplica` or `RemoveReplica`.
    Replicas(Result<ReplicaReport, OrchestratorError>),
    /// The outcome of a request that returns nothing.
    Done(Result<(), OrchestratorError>),
}
