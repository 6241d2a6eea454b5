//! Handles to a running actor: [`ActorRef`] (keeps it alive) and
//! [`WeakActorRef`] (does not).

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::error::{SendError, TrySendError};
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use crate::actor::{Actor, ActorInfo};
use crate::error::{CallError, TellError};
use crate::runtime::{Envelope, Shared};
use crate::supervision::{StopReason, Supervisor};

/// A cloneable handle to a running actor.
///
/// The actor lives as long as some `ActorRef` to it exists (or until it is
/// stopped): when the last one is dropped, the actor handles what is already
/// in its mailbox and stops with [`StopReason::Normal`].
///
/// Equality and hashing go by actor id.
pub struct ActorRef<A: Actor> {
    tx: mpsc::Sender<Envelope<A>>,
    shared: Arc<Shared>,
    call_timeout: Duration,
}

impl<A: Actor> ActorRef<A> {
    pub(crate) fn new(tx: mpsc::Sender<Envelope<A>>, shared: Arc<Shared>, call_timeout: Duration) -> Self {
        Self { tx, shared, call_timeout }
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Queues an envelope, waiting for mailbox space; fails with the stop
    /// reason if the actor no longer accepts messages.
    pub(crate) async fn send_envelope(&self, envelope: Envelope<A>) -> Result<(), StopReason> {
        self.tx.send(envelope).await.map_err(|_| self.shared.closed_reason())
    }

    /// The actor's identity.
    pub fn info(&self) -> &ActorInfo {
        &self.shared.info
    }

    /// The actor's unique id.
    pub fn id(&self) -> Uuid {
        self.shared.info.id
    }

    /// The actor's name.
    pub fn name(&self) -> &str {
        &self.shared.info.name
    }

    /// The actor's rank in its group, if it was spawned in one.
    pub fn rank(&self) -> Option<usize> {
        self.shared.info.rank
    }

    /// The default timeout of [`ActorRef::call`].
    pub fn default_call_timeout(&self) -> Duration {
        self.call_timeout
    }

    /// Sends `msg` and waits for the reply, for at most the default call
    /// timeout (see [`ActorRef::call_timeout`]).
    pub async fn call(&self, msg: A::Msg) -> Result<A::Reply, CallError> {
        self.call_timeout(msg, self.call_timeout).await
    }

    /// Sends `msg` and waits for the reply, for at most `after` (including
    /// the wait for mailbox space).
    ///
    /// Fails fast with [`CallError::Stopped`] if the actor is stopped or
    /// stops before answering, with [`CallError::Handler`] if the handler
    /// returns an error, and with [`CallError::Timeout`] otherwise. On
    /// timeout the message may still be handled later.
    pub async fn call_timeout(&self, msg: A::Msg, after: Duration) -> Result<A::Reply, CallError> {
        match tokio::time::timeout(after, self.call_inner(msg)).await {
            Ok(result) => result,
            Err(_elapsed) => Err(CallError::Timeout { actor: self.info().clone(), after }),
        }
    }

    async fn call_inner(&self, msg: A::Msg) -> Result<A::Reply, CallError> {
        let (reply_tx, reply_rx) = oneshot::channel();
        let envelope = Envelope { msg, reply: Some(reply_tx) };
        if self.tx.send(envelope).await.is_err() {
            return Err(self.stopped_error(self.shared.closed_reason()));
        }
        match reply_rx.await {
            Ok(result) => result,
            // The envelope was dropped unanswered: the task is going away
            // (e.g. dropped with the runtime). Its reason is published
            // promptly; the caller's timeout still bounds this wait.
            Err(_) => {
                let reason = self.shared.wait_stopping().await;
                Err(self.stopped_error(reason))
            }
        }
    }

    fn stopped_error(&self, reason: StopReason) -> CallError {
        CallError::Stopped { actor: self.info().clone(), reason }
    }

    /// Queues `msg` without waiting for it to be handled, waiting for mailbox
    /// space if needed. Fails (handing the message back) only if the actor is
    /// stopped or stopping. A handler error for a told message is logged.
    pub async fn tell(&self, msg: A::Msg) -> Result<(), TellError<A::Msg>> {
        let envelope = Envelope { msg, reply: None };
        self.tx.send(envelope).await.map_err(|SendError(envelope)| TellError::Stopped {
            actor: self.info().clone(),
            reason: self.shared.closed_reason(),
            msg: envelope.msg,
        })
    }

    /// Queues `msg` if the mailbox has room right now; otherwise fails with
    /// [`TellError::Full`] (or [`TellError::Stopped`]), handing it back.
    pub fn try_tell(&self, msg: A::Msg) -> Result<(), TellError<A::Msg>> {
        let envelope = Envelope { msg, reply: None };
        self.tx.try_send(envelope).map_err(|err| match err {
            TrySendError::Full(envelope) => TellError::Full { actor: self.info().clone(), msg: envelope.msg },
            TrySendError::Closed(envelope) => {
                TellError::Stopped { actor: self.info().clone(), reason: self.shared.closed_reason(), msg: envelope.msg }
            }
        })
    }

    /// Asks the actor to stop after the message it is handling, with
    /// [`StopReason::Requested`]; queued messages are rejected (their callers
    /// get [`CallError::Stopped`]). Returns at once; see
    /// [`ActorRef::terminated`] to wait. Idempotent.
    pub fn stop(&self) {
        self.shared.request_stop();
    }

    /// Waits until the actor has fully stopped (its `stopped` hook has run
    /// and supervisors are notified) and returns why.
    ///
    /// This handle keeps the actor alive, so this waits for a stop, a failure
    /// or an abort; to wait for a normal stop, use [`WeakActorRef::terminated`].
    pub async fn terminated(&self) -> StopReason {
        self.shared.wait_stopped().await
    }

    /// `true` until the actor stops accepting messages.
    pub fn is_alive(&self) -> bool {
        self.shared.is_running()
    }

    /// Why the actor stopped, once it has stopped accepting messages.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.shared.stop_reason()
    }

    /// Links the actor to `supervisor`, which will receive one
    /// [`Terminated`](crate::Terminated) event when the actor stops
    /// (immediately, if it already has).
    pub fn link(&self, supervisor: &Supervisor) {
        self.shared.link(supervisor);
    }

    /// Free slots in the mailbox right now.
    pub fn mailbox_free(&self) -> usize {
        self.tx.capacity()
    }

    /// A handle that does not keep the actor alive.
    pub fn downgrade(&self) -> WeakActorRef<A> {
        WeakActorRef { tx: self.tx.downgrade(), shared: Arc::clone(&self.shared), call_timeout: self.call_timeout }
    }
}

impl<A: Actor> Clone for ActorRef<A> {
    fn clone(&self) -> Self {
        Self { tx: self.tx.clone(), shared: Arc::clone(&self.shared), call_timeout: self.call_timeout }
    }
}

impl<A: Actor> PartialEq for ActorRef<A> {
    fn eq(&self, other: &Self) -> bool {
        self.id() == other.id()
    }
}

impl<A: Actor> Eq for ActorRef<A> {}

impl<A: Actor> Hash for ActorRef<A> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.id().hash(state);
    }
}

impl<A: Actor> fmt::Debug for ActorRef<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ActorRef").field("actor", self.info()).finish_non_exhaustive()
    }
}

/// A handle that does not keep the actor alive; [`WeakActorRef::upgrade`] it
/// to send messages.
pub struct WeakActorRef<A: Actor> {
    tx: mpsc::WeakSender<Envelope<A>>,
    shared: Arc<Shared>,
    call_timeout: Duration,
}

impl<A: Actor> WeakActorRef<A> {
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// A strong handle, unless every [`ActorRef`] is gone already.
    pub fn upgrade(&self) -> Option<ActorRef<A>> {
        self.tx.upgrade().map(|tx| ActorRef::new(tx, Arc::clone(&self.shared), self.call_timeout))
    }

    /// The actor's identity (its id and name).
    pub fn info(&self) -> &ActorInfo {
        &self.shared.info
    }

    /// Why the actor stopped, once it has stopped accepting messages.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.shared.stop_reason()
    }

    /// Waits until the actor has fully stopped and returns why.
    pub async fn terminated(&self) -> StopReason {
        self.shared.wait_stopped().await
    }
}

impl<A: Actor> Clone for WeakActorRef<A> {
    fn clone(&self) -> Self {
        Self { tx: self.tx.clone(), shared: Arc::clone(&self.shared), call_timeout: self.call_timeout }
    }
}

impl<A: Actor> fmt::Debug for WeakActorRef<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeakActorRef").field("actor", self.info()).finish_non_exhaustive()
    }
}
