//! The communicator thread: one OS thread per communicator, driven over a
//! command channel, with every wait bounded by a deadline.
//!
//! NCCL communicators are not `Send` (cudarc's `Comm` is not), and NCCL's
//! teardown (`ncclCommAbort`) has been seen never to return when a peer
//! process died. So each communicator lives on a thread of its own that
//! owns it for its whole life; callers talk to it through a
//! [`CommHandle`], and no call on the handle waits past its deadline:
//!
//! * creation is non-blocking (`ncclCommInitRankConfig` with
//!   `blocking = 0`) and the thread polls it until ready or the deadline;
//! * a round of the plan is one group (`ncclGroupStart`, the round's sends
//!   and receives, `ncclGroupEnd`), polled until its work is done on the
//!   device, checking the communicator's asynchronous error on every poll;
//! * abort asks the thread to abort and waits at most the abort timeout
//!   for the teardown to **finish** (a non-blocking communicator's abort
//!   may answer "in progress": it is polled until its work has left the
//!   device, never taken as done); if the thread does not answer in time,
//!   it is **abandoned**: left running,
//!   counted by [`abandoned_comm_threads`], and reported as
//!   [`AbortOutcome::Abandoned`]. The member should then ask for a process
//!   restart (the stuck thread may hold the GPU), and meanwhile a new
//!   communicator with a new id replaces the old one.
//!
//! The thread works through the small [`CommBackend`] trait: the NCCL
//! backend (with the `cuda` feature) implements it with cudarc's `sys` and
//! `result` layers, and tests implement it with a fake, so the channel and
//! deadline logic here is tested without a GPU.

use std::time::Duration;

mod abort;
mod backend;
mod error;
mod handle;
mod thread;

pub use abort::{abandoned_comm_threads, AbortOutcome};
#[cfg(any(test, feature = "cuda"))]
pub(crate) use backend::RawEvent;
pub(crate) use backend::{CommBackend, Fence, GroupError};
pub use backend::{P2p, Progress};
pub(crate) use error::BackendError;
pub use error::CommError;
pub use handle::{CommHandle, PendingComm};

/// Ranks, deadlines and polling of one communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommConfig {
    /// This member's rank in the communicator.
    pub rank: u32,
    /// Ranks in the communicator.
    pub nranks: u32,
    /// Creation must complete within this time.
    pub init_timeout: Duration,
    /// Abort must return within this time, or the thread is abandoned.
    pub abort_timeout: Duration,
    /// Longest sleep between polls (polling starts faster and backs off).
    pub poll_interval: Duration,
}

impl CommConfig {
    /// Defaults for `rank` of `nranks`: 60 s to create, 10 s to abort, 1 ms polls.
    pub fn new(rank: u32, nranks: u32) -> CommConfig {
        CommConfig {
            rank,
            nranks,
            init_timeout: Duration::from_secs(60),
            abort_timeout: Duration::from_secs(10),
            poll_interval: Duration::from_millis(1),
        }
    }
}
