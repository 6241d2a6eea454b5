//! The [`Actor`] trait and the [`Context`] its handlers receive.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::actor_ref::WeakActorRef;
use crate::error::ActorError;
use crate::runtime::Shared;
use crate::supervision::StopReason;

/// A unit of state with a mailbox, run as its own tokio task.
///
/// An actor handles one message type ([`Actor::Msg`], typically an enum) and
/// answers with one reply type ([`Actor::Reply`], often an enum too). Messages
/// are handled one at a time, in mailbox order, with exclusive access to
/// `self`.
///
/// Error semantics of [`Actor::handle`]:
/// - `Ok(reply)` goes back to the caller of [`ActorRef::call`](crate::ActorRef::call).
/// - [`ActorError::Failed`] is recoverable: it is returned to the caller and
///   the actor keeps running (for a fire-and-forget message it is logged).
/// - [`ActorError::Fatal`] is returned to the caller, then the actor stops with
///   [`StopReason::Fatal`].
/// - A panic stops the actor with [`StopReason::Panicked`]; the caller gets
///   [`CallError::Stopped`](crate::CallError::Stopped). The process survives.
///
/// A handler must not `call` its own actor (it would wait for itself until the
/// call times out); use [`Context::myself`] with `tell`/`try_tell` instead.
#[async_trait]
pub trait Actor: Send + Sized + 'static {
    /// The message type this actor handles.
    type Msg: Send + 'static;
    /// The reply type of [`Actor::handle`].
    type Reply: Send + 'static;

    /// Handles one message.
    async fn handle(&mut self, msg: Self::Msg, ctx: &mut Context<Self>) -> Result<Self::Reply, ActorError>;

    /// Runs once, before the first message is handled. Any error (or panic)
    /// stops the actor before it handles anything: an error with
    /// [`StopReason::Fatal`], a panic with [`StopReason::Panicked`].
    async fn started(&mut self, _ctx: &mut Context<Self>) -> Result<(), ActorError> {
        Ok(())
    }

    /// Runs once when the actor stops, for any reason other than its task
    /// being dropped ([`StopReason::Aborted`]), including after a panic (in
    /// which case the state may be inconsistent). Messages still queued have
    /// already been handled ([`StopReason::Normal`]) or rejected (otherwise).
    async fn stopped(&mut self, _reason: &StopReason) {}
}

/// Identity of an actor: a unique id, a human name and, for group members,
/// the rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ActorInfo {
    /// Unique id, fixed at spawn.
    pub id: Uuid,
    /// Human-readable name, e.g. `trainer[3]`. Not necessarily unique.
    pub name: String,
    /// Rank within the [`ActorGroup`](crate::ActorGroup) it was spawned in.
    pub rank: Option<usize>,
}

impl fmt::Display for ActorInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

/// What a handler knows about the actor it runs in.
pub struct Context<A: Actor> {
    myself: WeakActorRef<A>,
}

impl<A: Actor> Context<A> {
    pub(crate) fn new(myself: WeakActorRef<A>) -> Self {
        Self { myself }
    }

    fn shared(&self) -> &Arc<Shared> {
        self.myself.shared()
    }

    /// This actor's identity.
    pub fn info(&self) -> &ActorInfo {
        &self.shared().info
    }

    /// This actor's unique id.
    pub fn id(&self) -> Uuid {
        self.info().id
    }

    /// This actor's name.
    pub fn name(&self) -> &str {
        &self.info().name
    }

    /// This actor's rank in its group, if it was spawned in one.
    pub fn rank(&self) -> Option<usize> {
        self.info().rank
    }

    /// A weak handle to this actor, e.g. to send itself messages. It is weak
    /// so that the actor does not keep itself alive: once every
    /// [`ActorRef`](crate::ActorRef) is gone it still stops.
    pub fn myself(&self) -> WeakActorRef<A> {
        self.myself.clone()
    }

    /// Stops the actor after the current message, with
    /// [`StopReason::Requested`]. Queued messages are rejected.
    pub fn stop(&self) {
        self.shared().request_stop();
    }
}

impl<A: Actor> fmt::Debug for Context<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context").field("actor", self.info()).finish()
    }
}
