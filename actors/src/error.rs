//! Errors of the actor runtime.
//!
//! Errors that fail to deliver a message hand it back (like tokio's
//! `SendError<T>`): see [`TellError::into_msg`] and [`BroadcastError`].

use std::fmt;
use std::ops::Range;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::actor::ActorInfo;
use crate::supervision::StopReason;

/// What a handler returns on failure. The variant decides whether the actor
/// survives it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Error, Serialize, Deserialize)]
pub enum ActorError {
    /// Recoverable: returned to the caller, the actor keeps running.
    #[error("{0}")]
    Failed(String),
    /// Unrecoverable: returned to the caller, then the actor stops with
    /// [`StopReason::Fatal`].
    #[error("fatal: {0}")]
    Fatal(String),
}

impl ActorError {
    /// A recoverable error with this message.
    pub fn failed(msg: impl fmt::Display) -> Self {
        Self::Failed(msg.to_string())
    }

    /// A fatal error with this message.
    pub fn fatal(msg: impl fmt::Display) -> Self {
        Self::Fatal(msg.to_string())
    }

    /// `true` for [`ActorError::Fatal`].
    pub fn is_fatal(&self) -> bool {
        matches!(self, Self::Fatal(_))
    }

    /// The message, without the variant.
    pub fn message(&self) -> &str {
        match self {
            Self::Failed(msg) | Self::Fatal(msg) => msg,
        }
    }
}

/// Why [`ActorRef::call`](crate::ActorRef::call) produced no reply.
#[derive(Debug, Clone, PartialEq, Eq, Error, Serialize, Deserialize)]
pub enum CallError {
    /// No reply within the timeout (which covers waiting for mailbox space
    /// too). The message may still be handled later; its reply is dropped.
    #[error("call to {actor} timed out after {after:?}")]
    Timeout {
        /// The callee.
        actor: ActorInfo,
        /// The timeout that elapsed.
        after: Duration,
    },
    /// The actor stopped before answering (or had stopped already).
    #[error("actor {actor} is stopped ({reason})")]
    Stopped {
        /// The callee.
        actor: ActorInfo,
        /// Why it stopped.
        reason: StopReason,
    },
    /// The handler returned an error. If it is [`ActorError::Fatal`] the
    /// actor is now stopping.
    #[error("actor {actor} failed: {error}")]
    Handler {
        /// The callee.
        actor: ActorInfo,
        /// The handler's error.
        error: ActorError,
    },
}

impl CallError {
    /// The actor the call was addressed to.
    pub fn actor(&self) -> &ActorInfo {
        match self {
            Self::Timeout { actor, .. } | Self::Stopped { actor, .. } | Self::Handler { actor, .. } => actor,
        }
    }

    /// `true` for [`CallError::Timeout`].
    pub fn is_timeout(&self) -> bool {
        matches!(self, Self::Timeout { .. })
    }

    /// The handler's error, for [`CallError::Handler`].
    pub fn handler_error(&self) -> Option<&ActorError> {
        match self {
            Self::Handler { error, .. } => Some(error),
            _ => None,
        }
    }

    /// The stop reason, for [`CallError::Stopped`].
    pub fn stop_reason(&self) -> Option<&StopReason> {
        match self {
            Self::Stopped { reason, .. } => Some(reason),
            _ => None,
        }
    }
}

/// A fire-and-forget message could not be queued; the message is handed back.
#[derive(Error)]
pub enum TellError<M> {
    /// The mailbox is full (only from [`ActorRef::try_tell`](crate::ActorRef::try_tell)).
    #[error("mailbox of actor {actor} is full")]
    Full {
        /// The addressee.
        actor: ActorInfo,
        /// The undelivered message.
        msg: M,
    },
    /// The actor is stopped or stopping and accepts no more messages.
    #[error("actor {actor} is stopped ({reason})")]
    Stopped {
        /// The addressee.
        actor: ActorInfo,
        /// Why it stopped.
        reason: StopReason,
        /// The undelivered message.
        msg: M,
    },
}

impl<M> TellError<M> {
    /// The undelivered message, by reference.
    pub fn msg(&self) -> &M {
        match self {
            Self::Full { msg, .. } | Self::Stopped { msg, .. } => msg,
        }
    }

    /// Takes back the undelivered message.
    pub fn into_msg(self) -> M {
        match self {
            Self::Full { msg, .. } | Self::Stopped { msg, .. } => msg,
        }
    }

    /// The addressee.
    pub fn actor(&self) -> &ActorInfo {
        match self {
            Self::Full { actor, .. } | Self::Stopped { actor, .. } => actor,
        }
    }

    /// `true` for [`TellError::Full`].
    pub fn is_full(&self) -> bool {
        matches!(self, Self::Full { .. })
    }
}

// Manual so that `M` needs no `Debug` (like tokio's `SendError<T>`).
impl<M> fmt::Debug for TellError<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Full { actor, .. } => f.debug_struct("Full").field("actor", actor).finish_non_exhaustive(),
            Self::Stopped { actor, reason, .. } => {
                f.debug_struct("Stopped").field("actor", actor).field("reason", reason).finish_non_exhaustive()
            }
        }
    }
}

/// Errors of [`ActorGroup`](crate::ActorGroup) operations.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum GroupError {
    /// The call to this rank failed.
    #[error("rank {rank}: {error}")]
    Rank {
        /// The failing rank.
        rank: usize,
        /// Its error.
        error: CallError,
    },
    /// The rank is not part of this group (view).
    #[error("rank {rank} is not in this group (ranks {ranks:?})")]
    NoSuchRank {
        /// The requested rank.
        rank: usize,
        /// The ranks of the group.
        ranks: Range<usize>,
    },
    /// The requested rank range is empty-and-inverted or not within this group.
    #[error("rank range {requested:?} is not within this group (ranks {ranks:?})")]
    InvalidRange {
        /// The requested range.
        requested: Range<usize>,
        /// The ranks of the group.
        ranks: Range<usize>,
    },
}

impl GroupError {
    /// The rank the error is about, if it is about one rank.
    pub fn rank(&self) -> Option<usize> {
        match self {
            Self::Rank { rank, .. } | Self::NoSuchRank { rank, .. } => Some(*rank),
            Self::InvalidRange { .. } => None,
        }
    }
}

/// Some ranks of a group broadcast could not be told; their messages are
/// handed back. The other ranks did get theirs.
#[derive(Error)]
#[error("{} rank(s) could not be told, first: rank {}", .failures.len(), first_rank(.failures))]
pub struct BroadcastError<M> {
    /// `(rank, error)` per failed rank, in rank order.
    pub failures: Vec<(usize, TellError<M>)>,
}

fn first_rank<M>(failures: &[(usize, TellError<M>)]) -> String {
    failures.first().map_or_else(|| "none".to_owned(), |(rank, err)| format!("{rank} ({err})"))
}

// Manual so that `M` needs no `Debug`.
impl<M> fmt::Debug for BroadcastError<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BroadcastError").field("failures", &self.failures).finish()
    }
}
