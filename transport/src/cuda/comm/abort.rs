//! How an abort ends ([`AbortOutcome`]), and the communicator threads
//! abandoned in a hung one: marked, counted process-wide
//! ([`abandoned_comm_threads`]) until they end, and watched
//! ([`ThreadWatch`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How an abort ended.
#[derive(Clone, Debug)]
pub enum AbortOutcome {
    /// The communicator was torn down.
    Aborted {
        /// Time the abort took.
        elapsed: Duration,
    },
    /// The abort call returned an error; the thread has ended.
    Failed {
        /// Time the abort took.
        elapsed: Duration,
        /// The error.
        reason: super::BackendError,
    },
    /// The thread did not answer within the abort timeout: it is left
    /// running and counted by [`abandoned_comm_threads`]. Escalate to a
    /// process restart; create a new communicator with a new id meanwhile.
    Abandoned {
        /// How long the caller waited.
        waited: Duration,
        /// Whether the abandoned thread has ended since.
        watch: ThreadWatch,
    },
    /// Abort had already been done (or the thread abandoned) before.
    AlreadyClosed,
}

impl AbortOutcome {
    /// Whether the member should escalate to a process restart.
    pub fn needs_restart(&self) -> bool {
        matches!(self, AbortOutcome::Abandoned { .. })
    }
}

#[derive(Debug, Default)]
pub(super) struct Mark {
    state: Mutex<MarkState>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum MarkState {
    #[default]
    Running,
    Abandoned,
    Done,
}

static ABANDONED: AtomicUsize = AtomicUsize::new(0);

/// Communicator threads that callers stopped waiting for and that have not
/// ended yet (a hung `ncclCommAbort`, typically). Non-zero for longer than
/// an abort timeout means the process should be restarted.
pub fn abandoned_comm_threads() -> usize {
    ABANDONED.load(Ordering::SeqCst)
}

impl Mark {
    pub(super) fn abandon(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if *s == MarkState::Running {
            *s = MarkState::Abandoned;
            ABANDONED.fetch_add(1, Ordering::SeqCst);
        }
    }

    pub(super) fn done(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if *s == MarkState::Abandoned {
            ABANDONED.fetch_sub(1, Ordering::SeqCst);
        }
        *s = MarkState::Done;
    }
}

/// Tells whether an abandoned communicator thread has ended since.
#[derive(Clone, Debug)]
pub struct ThreadWatch(pub(super) Arc<Mark>);

impl ThreadWatch {
    /// Whether the thread has ended.
    pub fn is_finished(&self) -> bool {
        *self.0.state.lock().unwrap_or_else(|e| e.into_inner()) == MarkState::Done
    }
}

/// Marks the thread done however it ends (return or panic).
pub(super) struct DoneOnDrop(pub(super) Arc<Mark>);

impl Drop for DoneOnDrop {
    fn drop(&mut self) {
        self.0.done();
    }
}
