//! What the orchestrator reports: a refit's outcome ([`RefitReport`]),
//! a plan's ([`PlanReport`]), and the refit in progress, step by step
//! ([`RefitPhase`], [`RefitStep`]).

use reshard::{Figures, Fingerprint, Strategy};
use std::time::Duration;

/// What one refit did.
#[derive(Debug, Clone, PartialEq)]
pub struct RefitReport {
    /// The version now served by every destination.
    pub version: u64,
    /// Every destination already served `version`: nothing was planned or
    /// moved (`bytes` is 0).
    pub already_served: bool,
    /// Reshard or baseline.
    pub mode: Strategy,
    /// The plan that ran (`None` when nothing ran: already served).
    pub fingerprint: Option<Fingerprint>,
    /// Whether this refit had to (re)plan.
    pub replanned: bool,
    /// Wall time of the whole refit.
    pub wall: Duration,
    /// Asking members for their status (and layouts), and (re)planning and
    /// installing if needed.
    pub plan_time: Duration,
    /// Opening this refit's data plane on every member (prepare, and
    /// connect for the node and communicator fabrics), or resuming the
    /// kept one.
    pub connect_time: Duration,
    /// Whether this refit ran on the connections (or communicator) kept
    /// from the previous refit of the same plan
    /// ([`OrchestratorConfig::keep_data_plane`](super::OrchestratorConfig::keep_data_plane)).
    pub resumed: bool,
    /// Moving the bytes: from asking every member to run until the last
    /// one finished.
    pub transfer_time: Duration,
    /// Committing on every destination.
    pub commit_time: Duration,
    /// The digest check before the commit
    /// ([`OrchestratorConfig::digest_check`](super::OrchestratorConfig::digest_check)):
    /// the longest time a member took to read back what its run moved
    /// (part of `transfer_time`: members do it at the end of their run),
    /// plus the orchestrator's comparison. Zero when off.
    pub verify_time: Duration,
    /// Destination ranks every piece of which the digest check compared
    /// with what its senders sent (0 when off).
    pub verified_ranks: u64,
    /// Destination ranks the digest check could not fully compare (device
    /// memory on the communicator fabrics; the baseline's bypassed
    /// scratch); 0 when off.
    pub unverified_ranks: u64,
    /// Bytes moved: the payload of every message between two ranks, in the
    /// dtype it travels in, as the members counted them while sending. It
    /// equals the plan's [`Figures::total_bytes`], the figure `refit plan`,
    /// `run` and `bench` print as "bytes moved" (a difference is logged as
    /// a warning: it would be a bug).
    ///
    /// [`Figures::total_bytes`]: reshard::Figures::total_bytes
    pub bytes: u64,
    /// Messages between two ranks, as the members counted them while
    /// sending: the plan's [`Figures::messages`].
    pub messages: u64,
    /// Control messages the orchestrator sent members for this refit
    /// (status, describe, install, resume or prepare, connect, run,
    /// commit, discard): what its control plane carried.
    pub control_messages: u64,
    /// The figures of the plan that ran (planned, not measured; default
    /// when nothing ran).
    pub figures: Figures,
    /// Replicas of a destination group of replicas that left it during
    /// this refit because their members failed it
    /// ([`ReplicaLoss::Drop`](super::ReplicaLoss::Drop)), in the order
    /// they left, each by its index in the group just before (so removing
    /// them one by one, in this order, from a list of the replicas gives
    /// the group's). They serve what they served before; the others serve
    /// `version`.
    pub dropped_replicas: Vec<u32>,
    /// Source ranks left out of the plan that ran because they were lost
    /// ([`SourceLoss::Replan`](super::SourceLoss::Replan)): during this
    /// refit or an earlier one, and not replaced since.
    pub lost_sources: Vec<u32>,
}

/// What [`OrchestratorMsg::Plan`](super::OrchestratorMsg::Plan) found or made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanReport {
    /// Reshard or baseline.
    pub mode: Strategy,
    /// The plan's fingerprint.
    pub fingerprint: Fingerprint,
    /// Whether it planned now (false: the cached plan was installed
    /// everywhere already).
    pub replanned: bool,
    /// Bytes every refit with this plan moves (as [`RefitReport::bytes`]).
    pub bytes: u64,
    /// Time spent planning (zero when the cached plan was used).
    pub plan_time: Duration,
    /// Time spent deriving the programs of the members that lacked them and
    /// installing them (zero when none lacked them).
    pub install_time: Duration,
    /// Members the plan's programs were installed on.
    pub installed: u64,
    /// Control messages the orchestrator sent members for this (status,
    /// describe, install).
    pub control_messages: u64,
    /// The plan's figures.
    pub figures: Figures,
}

/// Where the refit in progress is, as the orchestrator publishes it
/// ([`Orchestrator::subscribe`](super::Orchestrator::subscribe)): for progress displays, metrics, and tools
/// that act at a given step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RefitStep {
    /// No refit in progress.
    #[default]
    Idle,
    /// Asking members for their layouts and plans; planning, installing.
    Planning,
    /// Members take up the data plane kept from the last refit of the plan.
    Resuming,
    /// Members open their data-plane endpoints.
    Preparing,
    /// Members connect to their peers.
    Connecting,
    /// Members move the bytes; destinations stage.
    Running,
    /// Every destination staged the whole version; destinations flip.
    Committing,
    /// The refit failed; members drop what they staged.
    Discarding,
}

/// The refit in progress and its step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RefitPhase {
    /// The refit's sequence number (counted from 1 by this orchestrator).
    pub refit: u64,
    /// Its step.
    pub step: RefitStep,
}
