//! What the communicator thread works with: the [`CommBackend`] a
//! communicator implements (NCCL, the simulated one, test fakes), the
//! point-to-point operations of a group ([`P2p`]), and the device event a
//! group waits for ([`Fence`]).

use super::error::BackendError;
use std::sync::Arc;

/// Whether polled work is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Still running.
    Pending,
    /// Done.
    Ready,
}

/// One point-to-point operation of a group: device memory sent to or
/// received from a peer rank of the communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum P2p {
    /// Send `bytes` bytes at device address `addr` to `peer`.
    Send {
        /// Peer rank in the communicator.
        peer: u32,
        /// Device address.
        addr: u64,
        /// Length in bytes.
        bytes: u64,
    },
    /// Receive `bytes` bytes from `peer` into device address `addr`.
    Recv {
        /// Peer rank in the communicator.
        peer: u32,
        /// Device address.
        addr: u64,
        /// Length in bytes.
        bytes: u64,
    },
}

impl P2p {
    /// The peer rank.
    pub fn peer(&self) -> u32 {
        match *self {
            P2p::Send { peer, .. } | P2p::Recv { peer, .. } => peer,
        }
    }
}

/// Why a group failed, as its backend saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupError {
    /// What failed.
    pub reason: BackendError,
    /// A peer failed first (it aborted, went away, or NCCL reports a remote
    /// error): this rank only followed it.
    pub peer_first: bool,
}

impl GroupError {
    /// A failure that began at a peer.
    pub fn peer(reason: impl Into<BackendError>) -> GroupError {
        GroupError { reason: reason.into(), peer_first: true }
    }
}

impl From<BackendError> for GroupError {
    /// A failure of this rank's own.
    fn from(reason: BackendError) -> GroupError {
        GroupError { reason, peer_first: false }
    }
}

/// A failure of this rank's own, from the conversions into [`BackendError`].
macro_rules! own_group_error {
    ($($(#[$m:meta])* $from:ty),*) => {$(
        $(#[$m])*
        impl From<$from> for GroupError {
            fn from(reason: $from) -> GroupError {
                GroupError::from(BackendError::from(reason))
            }
        }
    )*};
}

own_group_error!(
    super::error::SimError,
    super::error::IpcCommError,
    #[cfg(feature = "cuda")]
    crate::cuda::device::GpuError
);

/// What the communicator thread needs from a communicator. Every method
/// but [`CommBackend::abort`] must return promptly (non-blocking NCCL
/// calls); `abort` may hang, and the thread is abandoned if it does.
///
/// A group may be told to wait for an event of another stream first
/// (`after`: the raw `CUevent` of the stream that packed its send buffers,
/// 0 for none), so packing and sending are ordered on the device, not by
/// a full synchronisation of the host.
pub trait CommBackend {
    /// Progress of a non-blocking creation (`ncclCommGetAsyncError`).
    fn poll_init(&mut self) -> Result<Progress, BackendError>;
    /// Issues one group of send/recv operations (`ncclGroupStart` … `ncclGroupEnd`)
    /// on the communicator's stream, after the device event `after` (0:
    /// none), for plan round `round` (every rank's group of a round has the
    /// same number).
    fn start_group(&mut self, ops: &[P2p], after: u64, round: u32) -> Result<(), GroupError>;
    /// Progress of the last group: its calls accepted and its work done on
    /// the device; fails on an asynchronous communicator error.
    fn poll_group(&mut self) -> Result<Progress, GroupError>;
    /// Checks the communicator for an asynchronous error while idle.
    fn check(&mut self) -> Result<(), BackendError>;
    /// Starts tearing the communicator down (`ncclCommAbort`): `Ready` if
    /// the teardown is complete, `Pending` if it goes on (a non-blocking
    /// communicator), to be polled with [`CommBackend::poll_abort`]. May
    /// never return.
    fn abort(&mut self) -> Result<Progress, BackendError>;
    /// Progress of a teardown [`CommBackend::abort`] left pending: `Ready`
    /// once nothing the communicator queued can still touch device memory.
    fn poll_abort(&mut self) -> Result<Progress, BackendError>;
}

/// A raw CUDA event handle (`CUevent`) recorded on a stream whose work a
/// group must wait for. The event must stay alive until the group call that
/// names it returns (CUDA keeps what a queued wait needs after that): a
/// [`Fence`] carries it with what keeps it alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawEvent(pub u64);

/// The event a group waits for ([`CommHandle::group`](super::CommHandle::group)) and what keeps it
/// alive. The communicator's thread holds the keeper until its group call
/// has returned, so a thread that is stuck in the call, and abandoned by
/// its caller, never names an event that was destroyed meanwhile.
#[derive(Clone)]
pub struct Fence {
    pub(super) event: RawEvent,
    /// Held for its lifetime only: the event's owner.
    _keep: Arc<dyn std::any::Any + Send + Sync>,
}

impl Fence {
    /// `event`, alive as long as `keep` is (the event's owner).
    pub fn new(event: RawEvent, keep: Arc<dyn std::any::Any + Send + Sync>) -> Fence {
        Fence { event, _keep: keep }
    }

    /// The raw event.
    pub fn event(&self) -> RawEvent {
        self.event
    }
}

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Fence").field(&self.event).finish()
    }
}
