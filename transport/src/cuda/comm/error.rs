//! Why a communicator operation failed ([`CommError`]): every error names
//! this rank, the communicator's tag and the peers involved.

use std::time::Duration;
use thiserror::Error;

/// Why a communicator operation failed. Every variant names this rank (and
/// the peers involved where there are any) and the communicator's tag.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum CommError {
    /// Creation did not complete before the deadline.
    #[error("rank {rank}/{nranks} comm {comm}: creation did not complete within {waited:?}{}", cleanup_note(*.abandoned))]
    InitTimeout {
        /// This rank.
        rank: u32,
        /// Ranks in the communicator.
        nranks: u32,
        /// Communicator tag.
        comm: String,
        /// How long it waited.
        waited: Duration,
        /// Whether the cleanup abort hung and the thread was abandoned.
        abandoned: bool,
    },
    /// Creation failed.
    #[error("rank {rank}/{nranks} comm {comm}: creation failed: {reason}{}", cleanup_note(*.abandoned))]
    InitFailed {
        /// This rank.
        rank: u32,
        /// Ranks in the communicator.
        nranks: u32,
        /// Communicator tag.
        comm: String,
        /// What failed.
        reason: String,
        /// Whether the cleanup abort hung and the thread was abandoned.
        abandoned: bool,
    },
    /// A group did not complete before the deadline.
    #[error("rank {rank} comm {comm}: round {round}: group with peers {peers:?} did not complete within {waited:?}")]
    GroupTimeout {
        /// This rank.
        rank: u32,
        /// Communicator tag.
        comm: String,
        /// Plan round.
        round: u32,
        /// Peers of the group's operations.
        peers: Vec<u32>,
        /// How long it waited.
        waited: Duration,
    },
    /// A group failed (an NCCL call or an asynchronous error).
    #[error("rank {rank} comm {comm}: round {round}: group with peers {peers:?} failed: {reason}")]
    GroupFailed {
        /// This rank.
        rank: u32,
        /// Communicator tag.
        comm: String,
        /// Plan round.
        round: u32,
        /// Peers of the group's operations.
        peers: Vec<u32>,
        /// What failed.
        reason: String,
        /// A peer failed first (this rank only followed it).
        peer_first: bool,
    },
    /// The communicator reported an asynchronous error while idle.
    #[error("rank {rank} comm {comm}: asynchronous error: {reason}")]
    Async {
        /// This rank.
        rank: u32,
        /// Communicator tag.
        comm: String,
        /// The error.
        reason: String,
    },
    /// An operation names a peer outside the communicator.
    #[error("rank {rank} comm {comm}: peer {peer} is not one of the {nranks} ranks")]
    BadPeer {
        /// This rank.
        rank: u32,
        /// Communicator tag.
        comm: String,
        /// The peer named.
        peer: u32,
        /// Ranks in the communicator.
        nranks: u32,
    },
    /// The communicator failed earlier, or was aborted; abort it (if not
    /// yet) and create a new one with a new id.
    #[error("rank {rank} comm {comm}: communicator is unusable ({state})")]
    Unusable {
        /// This rank.
        rank: u32,
        /// Communicator tag.
        comm: String,
        /// Why.
        state: String,
    },
    /// The communicator thread ended unexpectedly (it panicked).
    #[error("rank {rank} comm {comm}: communicator thread ended unexpectedly")]
    ThreadGone {
        /// This rank.
        rank: u32,
        /// Communicator tag.
        comm: String,
    },
}

fn cleanup_note(abandoned: bool) -> &'static str {
    if abandoned {
        "; its abort hung and the thread was abandoned (restart the process)"
    } else {
        ""
    }
}

impl CommError {
    /// Whether a peer failed first and this rank only followed it (the
    /// group failed because a peer aborted, went away, or NCCL reported a
    /// remote error).
    pub fn peer_first(&self) -> bool {
        matches!(self, CommError::GroupFailed { peer_first: true, .. })
    }
}
