//! Spawning actors and the per-actor task that runs them.
//!
//! Each actor is one tokio task that owns the actor's state and the receiving
//! end of its bounded mailbox. User code (hooks and handlers) is polled inside
//! `catch_unwind`, so a panic stops only that actor; its pending callers are
//! answered with [`CallError::Stopped`] rather than left hanging.
//!
//! Lifecycle: `Running` → `Stopping(reason)` (mailbox closed, queued messages
//! rejected, `stopped` hook runs) → `Stopped(reason)` (state dropped,
//! supervisors notified). If the task is dropped (runtime shutdown) a drop
//! guard still publishes [`StopReason::Aborted`], so nobody waits forever.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch, Notify};
use uuid::Uuid;

use crate::actor::{Actor, ActorInfo, Context};
use crate::actor_ref::ActorRef;
use crate::error::{ActorError, CallError};
use crate::panic::{catch_sync, panic_message, CatchUnwind};
use crate::supervision::{StopReason, Supervisor, Terminated};

/// Mailbox capacity used unless [`SpawnConfig::mailbox_capacity`] says otherwise.
pub(crate) const DEFAULT_MAILBOX_CAPACITY: usize = 64;

/// Call timeout used unless [`SpawnConfig::call_timeout`] says otherwise.
pub(crate) const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How to spawn an actor (or each member of a group).
#[derive(Debug, Clone)]
#[must_use]
pub struct SpawnConfig {
    name: Option<String>,
    mailbox_capacity: usize,
    call_timeout: Duration,
    supervisors: Vec<Supervisor>,
}

impl Default for SpawnConfig {
    fn default() -> Self {
        Self { name: None, mailbox_capacity: DEFAULT_MAILBOX_CAPACITY, call_timeout: DEFAULT_CALL_TIMEOUT, supervisors: Vec::new() }
    }
}

impl SpawnConfig {
    /// The actor's name; for a group, the base name (members are named
    /// `name[rank]`). Defaults to the actor type's name.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// How many messages may wait in the mailbox (at least 1; 0 is raised
    /// to 1). Senders wait (`tell`, `call`) or fail (`try_tell`) when full.
    pub fn mailbox_capacity(mut self, capacity: usize) -> Self {
        self.mailbox_capacity = capacity.max(1);
        self
    }

    /// Default timeout of [`ActorRef::call`].
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// Links the actor (every member, for a group) to this supervisor from
    /// the start, so even an immediate failure is reported. May be given
    /// more than once.
    pub fn supervisor(mut self, supervisor: &Supervisor) -> Self {
        self.supervisors.push(supervisor.clone());
        self
    }

    /// The mailbox capacity.
    pub(crate) fn capacity(&self) -> usize {
        self.mailbox_capacity
    }

    /// The default call timeout.
    pub(crate) fn default_call_timeout(&self) -> Duration {
        self.call_timeout
    }

    /// The supervisors to link from the start.
    pub(crate) fn supervisors(&self) -> &[Supervisor] {
        &self.supervisors
    }

    pub(crate) fn base_name<A>(&self) -> String {
        match &self.name {
            Some(name) => name.clone(),
            None => short_type_name::<A>(),
        }
    }
}

/// `my_crate::module::Trainer<T>` → `Trainer<T>`.
fn short_type_name<A>() -> String {
    let full = std::any::type_name::<A>();
    let base = full.split('<').next().unwrap_or(full);
    let prefix_len = base.rfind("::").map_or(0, |i| i + 2);
    full[prefix_len..].to_owned()
}

/// Spawns `actor` as a tokio task and returns its first handle.
///
/// # Panics
///
/// Like [`tokio::spawn`], panics when called outside a tokio runtime.
pub fn spawn<A: Actor>(actor: A, config: SpawnConfig) -> ActorRef<A> {
    let name = config.base_name::<A>();
    spawn_named(actor, &config, name, None)
}

/// Spawns `actor` as rank `rank` of a group named by `config`: named
/// `name[rank]` and reporting `rank` in its [`Terminated`] event, like the
/// members [`ActorGroup::spawn`](crate::ActorGroup::spawn) makes (a
/// replacement for a member that stopped; see
/// [`ActorGroup::with_member`](crate::ActorGroup::with_member)).
///
/// # Panics
///
/// Like [`tokio::spawn`], panics when called outside a tokio runtime.
pub fn spawn_rank<A: Actor>(actor: A, config: SpawnConfig, rank: usize) -> ActorRef<A> {
    let name = format!("{}[{rank}]", config.base_name::<A>());
    spawn_named(actor, &config, name, Some(rank))
}

/// Spawns with a final name and rank (groups name their members).
pub(crate) fn spawn_named<A: Actor>(actor: A, config: &SpawnConfig, name: String, rank: Option<usize>) -> ActorRef<A> {
    let info = ActorInfo { id: Uuid::new_v4(), name, rank };
    let shared = Arc::new(Shared::new(info, config.supervisors.clone()));
    let (tx, rx) = mpsc::channel(config.mailbox_capacity.max(1));
    let actor_ref = ActorRef::new(tx, Arc::clone(&shared), config.call_timeout);
    let ctx = Context::new(actor_ref.downgrade());
    let mailbox = Mailbox::new(rx, shared);
    tokio::spawn(run(actor, ctx, mailbox));
    actor_ref
}

/// A message in a mailbox, with the reply channel for `call`s.
pub(crate) struct Envelope<A: Actor> {
    pub(crate) msg: A::Msg,
    pub(crate) reply: Option<ReplyTx<A>>,
}

/// Where the answer to a `call` goes.
pub(crate) type ReplyTx<A> = oneshot::Sender<Result<<A as Actor>::Reply, CallError>>;

/// Where an actor is in its life.
#[derive(Debug, Clone)]
enum Lifecycle {
    Running,
    /// No longer accepting messages; hook and cleanup still running.
    Stopping(StopReason),
    /// Fully stopped; supervisors notified.
    Stopped(StopReason),
}

impl Lifecycle {
    fn reason(&self) -> Option<&StopReason> {
        match self {
            Self::Running => None,
            Self::Stopping(reason) | Self::Stopped(reason) => Some(reason),
        }
    }
}

/// State shared by an actor's task and all handles to it (not generic, so
/// one copy of this code serves every actor type).
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) info: ActorInfo,
    lifecycle: watch::Sender<Lifecycle>,
    stop_requested: AtomicBool,
    stop_notify: Notify,
    supervisors: Mutex<Vec<Supervisor>>,
}

impl Shared {
    /// State of a new, running actor linked to `supervisors`.
    pub(crate) fn new(info: ActorInfo, supervisors: Vec<Supervisor>) -> Self {
        let (lifecycle, _) = watch::channel(Lifecycle::Running);
        Self { info, lifecycle, stop_requested: AtomicBool::new(false), stop_notify: Notify::new(), supervisors: Mutex::new(supervisors) }
    }

    /// `true` once a stop was requested (see [`Shared::stop_requested_notified`]).
    pub(crate) fn is_stop_requested(&self) -> bool {
        self.stop_requested.load(Ordering::SeqCst)
    }

    /// Completes when a stop is requested after (or a permit was stored
    /// before) the call; check [`Shared::is_stop_requested`] first.
    pub(crate) async fn stop_requested_notified(&self) {
        self.stop_notify.notified().await;
    }

    /// Asks the actor to stop after its current message.
    pub(crate) fn request_stop(&self) {
        self.stop_requested.store(true, Ordering::SeqCst);
        // Stores a permit if the actor is not waiting right now.
        self.stop_notify.notify_one();
    }

    /// The stop reason once the actor stops accepting messages.
    pub(crate) fn stop_reason(&self) -> Option<StopReason> {
        self.lifecycle.borrow().reason().cloned()
    }

    /// The stop reason, for when the mailbox was observed closed (the reason
    /// is always published before the mailbox closes; `Aborted` is only a
    /// fallback that keeps this total).
    pub(crate) fn closed_reason(&self) -> StopReason {
        self.stop_reason().unwrap_or(StopReason::Aborted)
    }

    /// Waits until the actor stops accepting messages.
    pub(crate) async fn wait_stopping(&self) -> StopReason {
        let mut rx = self.lifecycle.subscribe();
        let reason = match rx.wait_for(|l| l.reason().is_some()).await {
            Ok(lifecycle) => lifecycle.reason().cloned(),
            // Unreachable: `self` owns the sender.
            Err(_) => None,
        };
        reason.unwrap_or(StopReason::Aborted)
    }

    /// Waits until the actor has fully stopped.
    pub(crate) async fn wait_stopped(&self) -> StopReason {
        let mut rx = self.lifecycle.subscribe();
        let reason = match rx.wait_for(|l| matches!(l, Lifecycle::Stopped(_))).await {
            Ok(lifecycle) => lifecycle.reason().cloned(),
            // Unreachable: `self` owns the sender.
            Err(_) => None,
        };
        reason.unwrap_or(StopReason::Aborted)
    }

    /// `true` until the actor stops accepting messages.
    pub(crate) fn is_running(&self) -> bool {
        matches!(*self.lifecycle.borrow(), Lifecycle::Running)
    }

    fn supervisors(&self) -> MutexGuard<'_, Vec<Supervisor>> {
        // Nothing panics while holding this lock; recover from poison anyway.
        self.supervisors.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Links a supervisor; if the actor has already stopped, reports at once.
    pub(crate) fn link(&self, supervisor: &Supervisor) {
        let mut supervisors = self.supervisors();
        // Checked under the lock that `finish` holds while publishing, so the
        // event is neither lost nor sent twice.
        if let Lifecycle::Stopped(reason) = &*self.lifecycle.borrow() {
            supervisor.notify(self.event(reason.clone()));
        } else {
            supervisors.push(supervisor.clone());
        }
    }

    fn event(&self, reason: StopReason) -> Terminated {
        Terminated { id: self.info.id, name: self.info.name.clone(), rank: self.info.rank, reason }
    }

    /// Publishes the stop reason (first one wins).
    pub(crate) fn begin_stop(&self, reason: &StopReason) {
        self.lifecycle.send_if_modified(|lifecycle| {
            if matches!(lifecycle, Lifecycle::Running) {
                *lifecycle = Lifecycle::Stopping(reason.clone());
                true
            } else {
                false
            }
        });
    }

    /// Marks the actor fully stopped and notifies its supervisors.
    pub(crate) fn finish(&self, reason: &StopReason) {
        let supervisors = {
            let mut supervisors = self.supervisors();
            self.lifecycle.send_replace(Lifecycle::Stopped(reason.clone()));
            std::mem::take(&mut *supervisors)
        };
        for supervisor in supervisors {
            supervisor.notify(self.event(reason.clone()));
        }
    }
}

/// The receiving end of the mailbox of an actor's task (or of a remote
/// actor's proxy), doubling as a drop guard: if the task is dropped before
/// finishing, the reason is published *before* the receiver closes, so
/// senders always find a reason.
pub(crate) struct Mailbox<A: Actor> {
    pub(crate) rx: mpsc::Receiver<Envelope<A>>,
    pub(crate) shared: Arc<Shared>,
    /// The task published its reason and finished ([`Mailbox::finish`]).
    finished: bool,
}

impl<A: Actor> Mailbox<A> {
    /// The receiving end of `rx`, whose actor's state is `shared`.
    pub(crate) fn new(rx: mpsc::Receiver<Envelope<A>>, shared: Arc<Shared>) -> Mailbox<A> {
        Mailbox { rx, shared, finished: false }
    }

    /// Stops accepting messages, then rejects whatever is still queued
    /// with `reason`.
    pub(crate) fn stop_accepting(&mut self, reason: &StopReason) {
        self.shared.begin_stop(reason);
        self.rx.close();
        while let Ok(envelope) = self.rx.try_recv() {
            if let Some(reply) = envelope.reply {
                // The caller may have given up already; nothing to do then.
                let _ = reply.send(Err(CallError::Stopped { actor: self.shared.info.clone(), reason: reason.clone() }));
            }
        }
    }

    /// Publishes `reason` as the actor's last word: the task is done.
    pub(crate) fn finish(&mut self, reason: &StopReason) {
        self.shared.finish(reason);
        self.finished = true;
    }
}

impl<A: Actor> Drop for Mailbox<A> {
    fn drop(&mut self) {
        if !self.finished {
            tracing::debug!(actor = %self.shared.info, "actor task dropped before stopping");
            self.shared.begin_stop(&StopReason::Aborted);
            self.shared.finish(&StopReason::Aborted);
        }
        // `rx` is dropped after this, rejecting anything still queued.
    }
}

/// The actor's task.
async fn run<A: Actor>(mut actor: A, mut ctx: Context<A>, mut mailbox: Mailbox<A>) {
    let reason = live(&mut actor, &mut ctx, &mut mailbox).await;
    let shared = Arc::clone(&mailbox.shared);
    let info = &shared.info;
    match &reason {
        StopReason::Panicked(_) | StopReason::Fatal(_) => {
            tracing::error!(actor = %info, %reason, "actor stopped");
        }
        _ => tracing::debug!(actor = %info, %reason, "actor stopped"),
    }

    mailbox.stop_accepting(&reason);

    if let Err(payload) = CatchUnwind(actor.stopped(&reason)).await {
        let msg = panic_message(&*payload);
        tracing::error!(actor = %info, panic = %msg, "`stopped` hook panicked");
    }
    drop(ctx);
    if let Err(msg) = catch_sync(move || drop(actor)) {
        tracing::error!(actor = %info, panic = %msg, "dropping actor state panicked");
    }

    mailbox.finish(&reason);
}

/// Runs `started`, then handles messages until a reason to stop.
async fn live<A: Actor>(actor: &mut A, ctx: &mut Context<A>, mailbox: &mut Mailbox<A>) -> StopReason {
    match CatchUnwind(actor.started(ctx)).await {
        Err(payload) => return StopReason::Panicked(panic_message(&*payload)),
        Ok(Err(err)) => return StopReason::Fatal(err.message().to_owned()),
        Ok(Ok(())) => {}
    }
    let shared = Arc::clone(&mailbox.shared);
    loop {
        if shared.stop_requested.load(Ordering::SeqCst) {
            return StopReason::Requested;
        }
        let envelope = tokio::select! {
            biased;
            () = shared.stop_notify.notified() => return StopReason::Requested,
            envelope = mailbox.rx.recv() => match envelope {
                Some(envelope) => envelope,
                // Every `ActorRef` is gone and the mailbox is drained.
                None => return StopReason::Normal,
            },
        };
        let Envelope { msg, reply } = envelope;
        match CatchUnwind(actor.handle(msg, ctx)).await {
            Ok(Ok(value)) => {
                if let Some(reply) = reply {
                    // The caller may have timed out; its loss.
                    let _ = reply.send(Ok(value));
                }
            }
            Ok(Err(error)) => {
                let fatal = match &error {
                    ActorError::Fatal(msg) => Some(StopReason::Fatal(msg.clone())),
                    ActorError::Failed(_) => None,
                };
                match reply {
                    Some(reply) => {
                        let _ = reply.send(Err(CallError::Handler { actor: shared.info.clone(), error }));
                    }
                    None if fatal.is_none() => {
                        tracing::warn!(actor = %shared.info, %error, "handler failed");
                    }
                    None => {}
                }
                if let Some(reason) = fatal {
                    return reason;
                }
            }
            Err(payload) => {
                let reason = StopReason::Panicked(panic_message(&*payload));
                if let Some(reply) = reply {
                    let _ = reply.send(Err(CallError::Stopped { actor: shared.info.clone(), reason: reason.clone() }));
                }
                return reason;
            }
        }
    }
}
