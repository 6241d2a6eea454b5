//! One authenticated connection: its reader and writer tasks, heartbeats,
//! dispatch of incoming frames and the tables of what waits on it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch};
use uuid::Uuid;

use super::auth::SessionKeys;
use super::error::RemoteError;
use super::node::NodeInner;
use super::served::{Delivery, Served};
use super::wire::{read_frame_live, Failure, Message, Opener, ReadError, Sealer};
use crate::actor::ActorInfo;
use crate::supervision::StopReason;

/// Frames queued for the writer task.
const OUTBOX_CAPACITY: usize = 1024;

/// How long a closing writer may take to say goodbye.
const GOODBYE_TIMEOUT: Duration = Duration::from_millis(500);

/// How a call waiting on this connection ends.
pub(crate) enum Outcome {
    /// The peer replied.
    Reply(Result<Vec<u8>, Failure>),
    /// No reply will come: the callee is stopped (or unreachable).
    Lost(StopReason),
}

/// Completes a waiting call (decodes the reply for its typed caller).
pub(crate) type Complete = Box<dyn FnOnce(Outcome) + Send>;

struct Pending {
    proxy: u64,
    complete: Complete,
}

struct ProxyEntry {
    actor: Uuid,
    stop: oneshot::Sender<StopReason>,
}

/// How bad a close is, for logging.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CloseKind {
    /// Closed by this side (handle dropped, node shut down).
    Local,
    /// The peer's end closed (end of stream) without a goodbye.
    ByPeer,
    /// The peer said goodbye (a `Close` frame): it closed on purpose.
    Goodbye,
    /// Broken: I/O error, protocol violation, heartbeat timeout.
    Fault,
}

#[derive(Default)]
struct Tables {
    /// Set once, when the connection closes: why.
    closed: Option<String>,
    /// How it closed, set with `closed`.
    closed_kind: Option<CloseKind>,
    /// What to tell the peer when closing, if it is still listening.
    goodbye: Option<String>,
    pending: HashMap<u64, Pending>,
    lookups: HashMap<u64, oneshot::Sender<Result<ActorInfo, String>>>,
    proxies: HashMap<u64, ProxyEntry>,
    /// Served actors whose stop is reported to the peer.
    watched: HashSet<Uuid>,
    /// Remote actors this side looked up, with their stop reason once the
    /// peer reported it (a proxy registering late still learns it). Bounded
    /// by this side's own lookups: reports about other ids are ignored.
    looked_up: HashMap<Uuid, Option<StopReason>>,
}

/// An authenticated connection to a peer (either direction).
pub(crate) struct Conn {
    peer: String,
    node: Arc<NodeInner>,
    out: mpsc::Sender<Message>,
    next_id: AtomicU64,
    tables: Mutex<Tables>,
    closed_tx: watch::Sender<bool>,
}

impl Conn {
    /// Starts the reader and writer tasks of a connection that completed
    /// its handshake.
    pub(crate) fn start(node: Arc<NodeInner>, stream: TcpStream, peer: String, keys: SessionKeys) -> Arc<Self> {
        let (rd, wr) = stream.into_split();
        let (out, out_rx) = mpsc::channel(OUTBOX_CAPACITY);
        let (closed_tx, _) = watch::channel(false);
        let conn = Arc::new(Self { peer, node, out, next_id: AtomicU64::new(1), tables: Mutex::default(), closed_tx });
        tokio::spawn(read_loop(Arc::clone(&conn), rd, Opener::new(keys.recv)));
        tokio::spawn(write_loop(Arc::clone(&conn), wr, Sealer::new(keys.send), out_rx));
        conn
    }

    /// The peer's address.
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }

    pub(crate) fn node(&self) -> &Arc<NodeInner> {
        &self.node
    }

    fn tables(&self) -> MutexGuard<'_, Tables> {
        // Nothing panics while holding this lock; recover from poison anyway.
        self.tables.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn lost(&self, problem: &str) -> StopReason {
        StopReason::ConnectionLost { peer: self.peer.clone(), problem: problem.to_owned() }
    }

    /// Why the connection closed, once it has.
    pub(crate) fn closed_problem(&self) -> Option<String> {
        self.tables().closed.clone()
    }

    /// How the connection closed, once it has.
    pub(crate) fn closed_kind(&self) -> Option<CloseKind> {
        self.tables().closed_kind
    }

    /// Waits until the connection is closed and returns why.
    pub(crate) async fn wait_closed(&self) -> String {
        let mut rx = self.closed_tx.subscribe();
        // `self` owns the sender, so this cannot fail.
        wait_true(&mut rx).await;
        self.closed_problem().unwrap_or_default()
    }

    /// Queues a frame for the writer. Fails only once the connection is closed.
    pub(crate) async fn send(&self, msg: Message) -> Result<(), RemoteError> {
        self.out.send(msg).await.map_err(|_| self.lost_error())
    }

    fn lost_error(&self) -> RemoteError {
        RemoteError::ConnectionLost { peer: self.peer.clone(), problem: self.closed_problem().unwrap_or_else(|| "closed".to_owned()) }
    }

    /// Closes the connection (first call wins): every proxy on it stops with
    /// [`StopReason::ConnectionLost`], every waiting call and lookup fails.
    pub(crate) fn close(&self, problem: impl Into<String>, kind: CloseKind) {
        let problem = problem.into();
        let (pending, lookups, proxies) = {
            let mut tables = self.tables();
            if tables.closed.is_some() {
                return;
            }
            tables.closed = Some(problem.clone());
            tables.closed_kind = Some(kind);
            if kind == CloseKind::Local {
                tables.goodbye = Some(problem.clone());
            }
            (std::mem::take(&mut tables.pending), std::mem::take(&mut tables.lookups), std::mem::take(&mut tables.proxies))
        };
        match kind {
            CloseKind::Fault => tracing::warn!(peer = %self.peer, %problem, "dropping connection"),
            CloseKind::ByPeer | CloseKind::Goodbye => tracing::info!(peer = %self.peer, %problem, "connection closed by peer"),
            CloseKind::Local => tracing::debug!(peer = %self.peer, %problem, "closing connection"),
        }
        let reason = self.lost(&problem);
        for (_, call) in pending {
            (call.complete)(Outcome::Lost(reason.clone()));
        }
        drop(lookups);
        for (_, proxy) in proxies {
            let _ = proxy.stop.send(reason.clone());
        }
        self.closed_tx.send_replace(true);
    }

    /// Registers a proxy for `actor`; it is told when that actor stops or the
    /// connection closes. Fails with the reason if closed already.
    pub(crate) fn register_proxy(&self, actor: Uuid) -> Result<(u64, oneshot::Receiver<StopReason>), StopReason> {
        let id = self.next_id();
        let (stop, stop_rx) = oneshot::channel();
        let mut tables = self.tables();
        if let Some(problem) = &tables.closed {
            return Err(self.lost(problem));
        }
        if let Some(Some(reason)) = tables.looked_up.get(&actor) {
            return Err(reason.clone());
        }
        tables.proxies.insert(id, ProxyEntry { actor, stop });
        Ok((id, stop_rx))
    }

    /// Forgets a proxy that stopped; fails its calls still waiting.
    pub(crate) fn unregister_proxy(&self, proxy: u64, reason: &StopReason) {
        let calls: Vec<Pending> = {
            let mut tables = self.tables();
            tables.proxies.remove(&proxy);
            let ids: Vec<u64> = tables.pending.iter().filter(|(_, call)| call.proxy == proxy).map(|(id, _)| *id).collect();
            ids.iter().filter_map(|id| tables.pending.remove(id)).collect()
        };
        for call in calls {
            (call.complete)(Outcome::Lost(reason.clone()));
        }
    }

    /// Registers a call awaiting its reply and returns its request id; if
    /// the connection is closed, completes it at once and returns `None`.
    pub(crate) fn register_call(&self, proxy: u64, complete: Complete) -> Option<u64> {
        let id = self.next_id();
        let lost = {
            let mut tables = self.tables();
            match &tables.closed {
                Some(problem) => self.lost(problem),
                None => {
                    tables.pending.insert(id, Pending { proxy, complete });
                    return Some(id);
                }
            }
        };
        complete(Outcome::Lost(lost));
        None
    }

    /// Asks the peer for the actor served under `name`.
    pub(crate) async fn lookup(&self, name: &str, after: Duration) -> Result<ActorInfo, RemoteError> {
        let req = self.next_id();
        let (tx, rx) = oneshot::channel();
        {
            let mut tables = self.tables();
            if tables.closed.is_some() {
                drop(tables);
                return Err(self.lost_error());
            }
            tables.lookups.insert(req, tx);
        }
        self.send(Message::Lookup { req, name: name.to_owned() }).await?;
        match tokio::time::timeout(after, rx).await {
            Ok(Ok(Ok(info))) => Ok(info),
            Ok(Ok(Err(_))) => Err(RemoteError::UnknownActor { peer: self.peer.clone(), name: name.to_owned() }),
            Ok(Err(_)) => Err(self.lost_error()),
            Err(_) => {
                self.tables().lookups.remove(&req);
                Err(RemoteError::Timeout { peer: self.peer.clone(), what: "lookup", after })
            }
        }
    }

    /// Reports the stop of a served actor to the peer (once per actor).
    fn watch(self: &Arc<Self>, served: &Arc<dyn Served>) {
        let shared = served.shared();
        let actor = shared.info.id;
        if !self.tables().watched.insert(actor) {
            return;
        }
        let conn = Arc::clone(self);
        let mut closed = self.closed_tx.subscribe();
        tokio::spawn(async move {
            tokio::select! {
                reason = shared.wait_stopped() => {
                    let _ = conn.send(Message::Stopped { actor, reason }).await;
                }
                () = wait_true(&mut closed) => {}
            }
        });
    }

    /// Handles one incoming frame. `Err` closes the connection.
    async fn dispatch(self: &Arc<Self>, msg: Message) -> Result<(), (String, CloseKind)> {
        match msg {
            Message::Ping => {}
            Message::Lookup { req, name } => {
                let result = match self.node.served(&name) {
                    Some(served) => {
                        self.watch(&served);
                        Ok(served.info().clone())
                    }
                    None => Err(format!("no actor named {name:?}")),
                };
                self.send_or_closed(Message::Found { req, result }).await?;
            }
            Message::Found { req, result } => {
                let waiting = {
                    let mut tables = self.tables();
                    let waiting = tables.lookups.remove(&req);
                    if let (Some(_), Ok(info)) = (&waiting, &result) {
                        tables.looked_up.entry(info.id).or_insert(None);
                    }
                    waiting
                };
                if let Some(tx) = waiting {
                    let _ = tx.send(result);
                }
            }
            Message::Request { req, name, actor, msg } => {
                let served = self.node.served(&name).filter(|served| actor.is_nil() || served.info().id == actor);
                let Some(served) = served else {
                    match req {
                        Some(req) => self.send_or_closed(Message::Reply { req, result: Err(Failure::UnknownActor(name)) }).await?,
                        None => tracing::warn!(peer = %self.peer, name, "message told to an unknown actor dropped"),
                    }
                    return Ok(());
                };
                match (served.deliver(msg, req.is_some(), self.node.max_message_bytes()).await, req) {
                    (Delivery::Pending(reply), Some(req)) => {
                        let conn = Arc::clone(self);
                        tokio::spawn(async move {
                            let result = reply.await;
                            let _ = conn.send(Message::Reply { req, result }).await;
                        });
                    }
                    (Delivery::Failed(failure), Some(req)) => self.send_or_closed(Message::Reply { req, result: Err(failure) }).await?,
                    (Delivery::Failed(failure), None) => {
                        tracing::warn!(peer = %self.peer, actor = %served.info(), %failure, "told message not delivered");
                    }
                    (Delivery::Told | Delivery::Pending(_), _) => {}
                }
            }
            Message::Reply { req, result } => {
                let waiting = self.tables().pending.remove(&req);
                if let Some(call) = waiting {
                    (call.complete)(Outcome::Reply(result));
                }
            }
            Message::Stopped { actor, reason } => {
                let stopped: Vec<ProxyEntry> = {
                    let mut tables = self.tables();
                    match tables.looked_up.get_mut(&actor) {
                        Some(known) => *known = Some(reason.clone()),
                        None => return Ok(()),
                    }
                    let ids: Vec<u64> = tables.proxies.iter().filter(|(_, p)| p.actor == actor).map(|(id, _)| *id).collect();
                    ids.iter().filter_map(|id| tables.proxies.remove(id)).collect()
                };
                for proxy in stopped {
                    let _ = proxy.stop.send(reason.clone());
                }
            }
            Message::Close { why } => return Err((format!("peer closed the connection: {why}"), CloseKind::Goodbye)),
        }
        Ok(())
    }

    async fn send_or_closed(&self, msg: Message) -> Result<(), (String, CloseKind)> {
        self.send(msg).await.map_err(|err| (err.to_string(), CloseKind::Fault))
    }
}

/// Frames at least this large are authenticated and decoded off the
/// runtime's reactor threads (see [`off_the_reactor`]).
pub(crate) const LARGE: usize = 256 * 1024;

/// Runs CPU-heavy `work` (sealing or opening a frame of `size` bytes) so
/// that it does not hold up the other connections' heartbeats: on a
/// multi-threaded runtime a large frame's work moves the thread's other
/// tasks elsewhere first (`block_in_place`); small frames, and current-thread
/// runtimes, run it inline.
pub(crate) fn off_the_reactor<T>(size: usize, work: impl FnOnce() -> T) -> T {
    let multi = tokio::runtime::Handle::try_current().is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi && size >= LARGE {
        tokio::task::block_in_place(work)
    } else {
        work()
    }
}

/// Completes once the flag is `true` (or its sender is gone).
pub(crate) async fn wait_true(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|flag| *flag).await;
}

/// Reads, authenticates and dispatches frames until the connection closes;
/// declares the peer dead after `heartbeat_timeout` without a frame.
async fn read_loop(conn: Arc<Conn>, mut rd: OwnedReadHalf, mut opener: Opener) {
    let config = conn.node.config().clone();
    let mut closed = conn.closed_tx.subscribe();
    let mut shutdown = conn.node.shutdown_signal();
    let max = config.max_frame_bytes;
    loop {
        let step = async {
            // The heartbeat deadline runs while no byte arrives: a large
            // frame still arriving is a live peer.
            let payload = match read_frame_live(&mut rd, max, config.heartbeat_timeout, conn.node.clock()).await {
                Err(ReadError::Eof) => return Err((ReadError::Eof.to_string(), CloseKind::ByPeer)),
                Err(err) => return Err((err.to_string(), CloseKind::Fault)),
                Ok(payload) => payload,
            };
            let msg = off_the_reactor(payload.len(), || opener.open(&payload, max)).map_err(|err| (err.to_string(), CloseKind::Fault))?;
            conn.dispatch(msg).await
        };
        tokio::select! {
            () = wait_true(&mut closed) => return,
            () = wait_true(&mut shutdown) => {
                conn.close("node shut down", CloseKind::Local);
                return;
            }
            result = step => if let Err((problem, kind)) = result {
                conn.close(problem, kind);
                return;
            },
        }
    }
}

/// Seals and writes queued frames, and a ping every `heartbeat_interval`.
async fn write_loop(conn: Arc<Conn>, mut wr: OwnedWriteHalf, mut sealer: Sealer, mut rx: mpsc::Receiver<Message>) {
    let config = conn.node.config().clone();
    let mut ticker = tokio::time::interval(config.heartbeat_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut closed = conn.closed_tx.subscribe();
    loop {
        let msg = tokio::select! {
            biased;
            () = wait_true(&mut closed) => break,
            msg = rx.recv() => match msg {
                Some(msg) => msg,
                None => break,
            },
            _ = ticker.tick() => Message::Ping,
        };
        if let Err(problem) = write_one(&conn, &mut wr, &mut sealer, &msg, config.write_timeout).await {
            conn.close(problem, CloseKind::Fault);
            break;
        }
    }
    let goodbye = conn.tables().goodbye.take();
    if let Some(why) = goodbye {
        let _ = write_one(&conn, &mut wr, &mut sealer, &Message::Close { why }, GOODBYE_TIMEOUT).await;
    }
    let _ = tokio::time::timeout(GOODBYE_TIMEOUT, wr.shutdown()).await;
}

async fn write_one(conn: &Conn, wr: &mut OwnedWriteHalf, sealer: &mut Sealer, msg: &Message, after: Duration) -> Result<(), String> {
    let max = conn.node.config().max_frame_bytes;
    let frame = match off_the_reactor(msg.size_hint(), || sealer.seal(msg, max)) {
        Ok(frame) => frame,
        Err(err) => {
            tracing::warn!(peer = %conn.peer, error = %err, "frame not sent: cannot encode it");
            // A caller waits for a reply: tell it why there is none.
            let Message::Reply { req, .. } = msg else { return Ok(()) };
            let substitute = Message::Reply { req: *req, result: Err(Failure::BadReply(err.to_string())) };
            match sealer.seal(&substitute, max) {
                Ok(frame) => frame,
                Err(_) => return Ok(()),
            }
        }
    };
    match tokio::time::timeout(after, wr.write_all(&frame)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(err)) => Err(format!("write failed: {err}")),
        Err(_) => Err(format!("write stalled for {after:?}")),
    }
}
