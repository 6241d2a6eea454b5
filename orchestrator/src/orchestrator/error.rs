//! Why a refit failed ([`OrchestratorError`]), and how a member's failed
//! call or refusal becomes one.

use crate::protocol::{HeldVersion, Refusal};
use actors::CallError;
use reshard::{Endpoint, Fingerprint, Group, PlanError};
use std::time::Duration;
use thiserror::Error;

/// Why a refit failed. Destinations then still serve their last committed
/// version.
#[derive(Debug, Clone, Error)]
pub enum OrchestratorError {
    /// A member did not answer in time.
    #[error("{member}: no answer within {after:?}")]
    Timeout {
        /// The member.
        member: String,
        /// The time allowed.
        after: Duration,
    },
    /// A member is gone.
    #[error("{member} died: {reason}")]
    MemberDied {
        /// The member.
        member: String,
        /// Why it stopped.
        reason: String,
    },
    /// A member runs another plan than the orchestrator's.
    #[error("{member}: plan fingerprint mismatch (installed {installed:?}, asked {asked})")]
    FingerprintMismatch {
        /// The member.
        member: String,
        /// What it had installed.
        installed: Option<Fingerprint>,
        /// What it was asked to run.
        asked: Fingerprint,
    },
    /// A layout reported by a member is invalid, or members of a group
    /// disagree about their layout.
    #[error("{group} group: {problem}")]
    Layout {
        /// The group.
        group: Group,
        /// What is wrong.
        problem: String,
    },
    /// A source has no whole version to send: nothing was written yet, or
    /// its last step failed after changing the weights.
    #[error("{member}: {weights}; every source must hold a whole version (update or restore its store)")]
    NoWeights {
        /// The member.
        member: String,
        /// What it holds.
        weights: HeldVersion,
    },
    /// [`RefitTarget::Latest`](super::RefitTarget::Latest): the sources kept holding different versions
    /// for the whole control timeout.
    #[error("sources hold different versions ({}) for longer than {after:?}", describe_versions(held))]
    VersionsDisagree {
        /// Every source rank's version, by rank.
        held: Vec<u64>,
        /// How long the orchestrator waited.
        after: Duration,
    },
    /// A rank that the group does not have.
    #[error("{endpoint}: the group has {ranks} ranks")]
    NoRank {
        /// The rank asked for.
        endpoint: Endpoint,
        /// The group's size.
        ranks: usize,
    },
    /// A source holds another weight version than the refit asked for.
    #[error("{member}: holds version {held}, the refit asked for {asked}")]
    VersionMismatch {
        /// The member.
        member: String,
        /// The version it holds.
        held: u64,
        /// The version asked for.
        asked: u64,
    },
    /// The two layouts cannot be planned.
    #[error("planning failed: {0}")]
    Plan(#[from] PlanError),
    /// A member refused or failed its part.
    #[error("{member}: {refusal}")]
    Refused {
        /// The member.
        member: String,
        /// Why.
        refusal: Refusal,
    },
    /// A member's handler failed (not a refusal of the protocol).
    #[error("{member}: {problem}")]
    Failed {
        /// The member.
        member: String,
        /// What happened.
        problem: String,
    },
    /// Members of these replicas failed the refit before the others had
    /// the version (see [`ReplicaLoss::Drop`](super::ReplicaLoss::Drop)):
    /// they left the group, and the refit runs again without them.
    #[error("replicas {replicas:?} failed the refit and left the group: {cause}")]
    ReplicasLost {
        /// The replicas, by their index in the group as it was.
        replicas: Vec<u32>,
        /// What failed.
        cause: Box<OrchestratorError>,
    },
    /// Sources were lost during (or before) the refit (see
    /// [`SourceLoss::Replan`](super::SourceLoss::Replan)): they are left
    /// out, and the refit runs again from the others.
    #[error("source ranks {ranks:?} were lost: {cause}")]
    SourcesLost {
        /// Their ranks.
        ranks: Vec<u32>,
        /// What failed.
        cause: Box<OrchestratorError>,
    },
    /// The refit failed after replicas had left the group during it
    /// (see [`ReplicaLoss::Drop`](super::ReplicaLoss::Drop)): they stay
    /// out, as a report's
    /// [`dropped_replicas`](crate::RefitReport::dropped_replicas) would
    /// have said, and the others serve what they served before.
    #[error("{cause} (replicas {dropped:?} left the destination group during the refit)")]
    ReplicasDropped {
        /// The replicas, as [`RefitReport::dropped_replicas`](crate::RefitReport::dropped_replicas) lists them.
        dropped: Vec<u32>,
        /// Why the refit failed.
        cause: Box<OrchestratorError>,
    },
    /// A replica cannot be added or removed.
    #[error("replicas: {problem}")]
    Replicas {
        /// Why.
        problem: String,
    },
    /// What a member holds of the refit, read back after its run, is not
    /// what its senders sent ([`OrchestratorConfig::digest_check`](super::OrchestratorConfig::digest_check)),
    /// or its memory disagrees with itself (a piece's copies, a local
    /// copy, an element that is no widened wire value). Checked before any
    /// commit: nothing was committed, and every destination serves what
    /// it served before.
    #[error("{member} ({rank}): the digest check failed: {problem}; nothing was committed")]
    DigestMismatch {
        /// The member.
        member: String,
        /// Its rank.
        rank: Endpoint,
        /// The sender whose pieces differ, where one does.
        from: Option<Endpoint>,
        /// What differs.
        problem: String,
    },
    /// A member answered with a reply that does not belong to the request.
    #[error("{member}: answered {reply} to {request}")]
    Protocol {
        /// The member.
        member: String,
        /// The request.
        request: &'static str,
        /// The reply, as debug text.
        reply: String,
    },
}

impl OrchestratorError {
    /// The replicas that left the destination group during the failed
    /// refit (highest index first, as
    /// [`RefitReport::dropped_replicas`](crate::RefitReport::dropped_replicas)
    /// lists them): a caller that keeps its own list of replicas removes
    /// these, failed refit or not.
    pub fn dropped_replicas(&self) -> &[u32] {
        match self {
            OrchestratorError::ReplicasDropped { dropped, .. } => dropped,
            _ => &[],
        }
    }

    /// The error itself, or for [`ReplicasDropped`](Self::ReplicasDropped)
    /// what made the refit fail.
    pub fn cause(&self) -> &OrchestratorError {
        match self {
            OrchestratorError::ReplicasDropped { cause, .. } => cause.cause(),
            other => other,
        }
    }
}

/// `version 3 (ranks 0-2), version 4 (rank 3)`.
fn describe_versions(held: &[u64]) -> String {
    let mut runs: Vec<(u64, usize, usize)> = Vec::new();
    for (rank, &v) in held.iter().enumerate() {
        match runs.last_mut() {
            Some((w, _, end)) if *w == v && *end + 1 == rank => *end = rank,
            _ => runs.push((v, rank, rank)),
        }
    }
    let runs: Vec<String> = runs
        .into_iter()
        .map(|(v, a, z)| if a == z { format!("version {v} (rank {a})") } else { format!("version {v} (ranks {a}-{z})") })
        .collect();
    runs.join(", ")
}

pub(super) fn call_error(member: String, e: CallError, after: Duration) -> OrchestratorError {
    match e {
        CallError::Timeout { .. } => OrchestratorError::Timeout { member, after },
        CallError::Stopped { reason, .. } => OrchestratorError::MemberDied { member, reason: reason.to_string() },
        CallError::Handler { error, .. } => OrchestratorError::Failed { member, problem: error.to_string() },
    }
}

pub(super) fn refused(member: &str, r: Refusal) -> OrchestratorError {
    let member = member.to_string();
    match r {
        Refusal::FingerprintMismatch { installed, asked } => OrchestratorError::FingerprintMismatch { member, installed, asked },
        Refusal::VersionMismatch { held, asked } => OrchestratorError::VersionMismatch { member, held, asked },
        Refusal::NoWeights(weights) => OrchestratorError::NoWeights { member, weights },
        refusal => OrchestratorError::Refused { member, refusal },
    }
}
