//! Why a communicator operation failed ([`CommError`]): every error names
//! this rank, the communicator's tag and the peers involved; and what the
//! communicator behind it reported ([`BackendError`]), kept as the cause.

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
        reason: Box<BackendError>,
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
        reason: Box<BackendError>,
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
        reason: Box<BackendError>,
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

/// What a communicator backend reported: the NCCL library or the device
/// under it, the simulated communicator ([`SimError`]), the IPC
/// communicator ([`IpcCommError`]), or the thread that runs it.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum BackendError {
    /// The thread was told to stop (an abort was requested) while it waited.
    #[error("stopped: abort requested")]
    Stopped,
    /// A backend call panicked; the panic's message.
    #[error("panicked: {0}")]
    Panicked(String),
    /// The communicator thread could not be started (the system's reason).
    #[error("cannot start thread: {0}")]
    Spawn(String),
    /// The communicator thread ended without reporting.
    #[error("communicator thread ended unexpectedly")]
    ThreadEnded,
    /// The thread did not answer a check in time.
    #[error("no answer within {0:?}")]
    NoAnswer(Duration),
    /// An NCCL call failed: `call` names it (with its arguments where
    /// they help), `detail` is NCCL's text for the code and its last error.
    #[cfg(feature = "cuda")]
    #[error("{call}: {detail}")]
    Nccl {
        /// The call (e.g. `ncclGroupEnd`).
        call: String,
        /// NCCL's result code.
        code: cudarc::nccl::sys::ncclResult_t,
        /// NCCL's text for the code, and its last error message.
        detail: String,
    },
    /// NCCL reported an asynchronous error on the communicator.
    #[cfg(feature = "cuda")]
    #[error("{detail}")]
    NcclAsync {
        /// NCCL's result code.
        code: cudarc::nccl::sys::ncclResult_t,
        /// NCCL's text for the code, and its last error message.
        detail: String,
    },
    /// A CUDA driver call of the backend failed.
    #[cfg(feature = "cuda")]
    #[error("{what}: {source}")]
    Driver {
        /// What was being done.
        what: String,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// A CUDA or NCCL call panicked (a missing library or symbol).
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    CallPanicked(#[from] crate::cuda::device::Panicked),
    /// NCCL's unique id did not decode.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    BadId(crate::cuda::id::CommIdError),
    /// The device (opening it, its memory) failed.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Device(#[from] crate::cuda::device::GpuError),
    /// CUDA or NCCL cannot be used in this process.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Unavailable(#[from] crate::cuda::device::ProbeError),
    /// The simulated communicator refused or failed.
    #[error(transparent)]
    Sim(#[from] SimError),
    /// The IPC communicator (doorbells, mapped buckets) failed.
    #[error(transparent)]
    Ipc(#[from] IpcCommError),
    /// A test's fake backend failed (its words).
    #[cfg(test)]
    #[error("{0}")]
    Fake(String),
}

pub(crate) use crate::cuda::ipc_comm::IpcCommError;
pub(crate) use crate::cuda::sim::SimError;
