//! Supervision: why actors stop, and who hears about it.
//!
//! A [`Supervisor`] is the sending side of an event channel; actors are linked
//! to it (at spawn via [`SpawnConfig::supervisor`](crate::SpawnConfig::supervisor),
//! or later via [`ActorRef::link`](crate::ActorRef::link)) and each sends one
//! [`Terminated`] event when it stops. The owner reads the events from
//! [`SupervisorEvents`].

use std::fmt;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use uuid::Uuid;

/// Why an actor stopped.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StopReason {
    /// Every [`ActorRef`](crate::ActorRef) was dropped and the mailbox was drained.
    Normal,
    /// [`ActorRef::stop`](crate::ActorRef::stop) or [`Context::stop`](crate::Context::stop)
    /// was called; queued messages were rejected.
    Requested,
    /// A handler (or `started`) panicked, with this panic message.
    Panicked(String),
    /// A handler returned [`ActorError::Fatal`](crate::ActorError::Fatal) with
    /// this message, or `started` returned an error.
    Fatal(String),
    /// The actor's task was dropped before it could stop on its own, e.g.
    /// because the tokio runtime shut down. The `stopped` hook did not run.
    Aborted,
    /// Only for handles to remote actors: the connection to the node hosting
    /// the actor was lost (closed, broken, protocol violation or heartbeat
    /// timeout), so the actor is unreachable and treated as dead.
    ConnectionLost {
        /// The peer's address.
        peer: String,
        /// What went wrong.
        problem: String,
    },
}

impl StopReason {
    /// `true` for [`StopReason::Panicked`], [`StopReason::Fatal`] and
    /// [`StopReason::ConnectionLost`].
    pub fn is_failure(&self) -> bool {
        matches!(self, Self::Panicked(_) | Self::Fatal(_) | Self::ConnectionLost { .. })
    }

    /// `true` for [`StopReason::ConnectionLost`].
    pub fn is_connection_lost(&self) -> bool {
        matches!(self, Self::ConnectionLost { .. })
    }
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Normal => f.write_str("stopped normally"),
            Self::Requested => f.write_str("stop requested"),
            Self::Panicked(msg) => write!(f, "panicked: {msg}"),
            Self::Fatal(msg) => write!(f, "fatal error: {msg}"),
            Self::Aborted => f.write_str("aborted (task dropped)"),
            Self::ConnectionLost { peer, problem } => write!(f, "connection to {peer} lost: {problem}"),
        }
    }
}

/// Sent to every linked [`Supervisor`] once an actor has fully stopped (its
/// `stopped` hook has run and its state has been dropped).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Terminated {
    /// The actor's id.
    pub id: Uuid,
    /// The actor's name.
    pub name: String,
    /// The actor's rank, if it was spawned in a group.
    pub rank: Option<usize>,
    /// Why it stopped.
    pub reason: StopReason,
}

/// The linking side of a supervision channel: actors linked to it report
/// their termination on it. Cheap to clone.
///
/// The channel is unbounded, but it carries at most one event per link, so
/// it is bounded by the number of linked actors.
#[derive(Debug, Clone)]
pub struct Supervisor {
    tx: mpsc::UnboundedSender<Terminated>,
}

impl Supervisor {
    /// Creates a supervision channel: link actors to the [`Supervisor`], read
    /// their [`Terminated`] events from the [`SupervisorEvents`].
    pub fn channel() -> (Supervisor, SupervisorEvents) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Supervisor { tx }, SupervisorEvents { rx })
    }

    /// Delivers an event; silently dropped if nobody listens any more.
    pub(crate) fn notify(&self, event: Terminated) {
        // An error only means the events receiver is gone: nobody to tell.
        let _ = self.tx.send(event);
    }
}

/// The receiving side of a supervision channel.
#[derive(Debug)]
pub struct SupervisorEvents {
    rx: mpsc::UnboundedReceiver<Terminated>,
}

impl SupervisorEvents {
    /// Waits for the next termination event. Returns `None` once every
    /// [`Supervisor`] clone is gone and every linked actor has reported (or
    /// been dropped without linking).
    pub async fn recv(&mut self) -> Option<Terminated> {
        self.rx.recv().await
    }

    /// Returns an event if one is ready, without waiting.
    pub fn try_recv(&mut self) -> Option<Terminated> {
        self.rx.try_recv().ok()
    }
}
