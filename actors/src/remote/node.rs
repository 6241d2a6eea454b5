//! [`Node`]: a TCP endpoint that serves named actors and connects to other
//! nodes; [`RemotePeer`]: an authenticated connection to one of them.

use std::collections::HashMap;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::{oneshot, watch, Semaphore};

use super::auth;
use super::conn::{wait_true, CloseKind, Conn};
use super::error::RemoteError;
use super::proxy::spawn_proxy;
use super::secret::Secret;
use super::served::Served;
use super::wire::{FRAME_OVERHEAD, MAX_NAME_LEN};
use crate::actor::Actor;
use crate::actor_ref::ActorRef;
use crate::runtime::SpawnConfig;

/// Default [`NodeConfig::heartbeat_interval`].
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_millis(250);
/// Default [`NodeConfig::heartbeat_timeout`].
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(1);
/// Default [`NodeConfig::handshake_timeout`].
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// Default [`NodeConfig::max_frame_bytes`] (16 MiB).
pub const DEFAULT_MAX_FRAME_BYTES: usize = 16 * 1024 * 1024;

/// Settings of a [`Node`]. Peers should agree on `max_frame_bytes`, and
/// each side's `heartbeat_interval` must be well below the other side's
/// `heartbeat_timeout`.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Address to listen on. Default `127.0.0.1:0` (loopback, any port):
    /// listening on other interfaces must be asked for.
    pub bind: SocketAddr,
    /// Address other nodes reach this one at, as announced to a registry.
    /// Default: the bound address.
    pub advertise: Option<SocketAddr>,
    /// A ping is sent on every connection this often (default 250 ms).
    pub heartbeat_interval: Duration,
    /// A connection with no frame from the peer for this long is dead
    /// (default 1 s).
    pub heartbeat_timeout: Duration,
    /// Connecting plus authenticating must finish within this (default 2 s);
    /// a silent or slow client is dropped after it.
    pub handshake_timeout: Duration,
    /// A write blocked this long (peer not reading) breaks the connection
    /// (default 10 s).
    pub write_timeout: Duration,
    /// Largest frame accepted or sent, checked on the length prefix before
    /// anything is allocated (default 16 MiB; at most
    /// [`codec::MAX_SIZE_CEILING`](crate::codec::MAX_SIZE_CEILING) is used).
    /// Messages and replies may use all but 1 KiB of it.
    pub max_frame_bytes: usize,
    /// Most authenticated incoming connections at once; a client that
    /// authenticates beyond it is refused (default 4096; each is a file
    /// descriptor: the process's limit applies too).
    pub max_connections: usize,
    /// Most incoming connections still authenticating at once (default
    /// 64). They have a budget of their own, so connections that never
    /// authenticate cannot keep clients with the secret out: when it is
    /// full, the oldest of them is dropped for the newcomer (a client with
    /// the secret authenticates within a round trip; a silent socket waits
    /// for its `handshake_timeout`).
    pub max_unauthenticated: usize,
    /// How long [`RemotePeer::lookup`] waits for the answer (default 5 s).
    pub lookup_timeout: Duration,
}

impl NodeConfig {
    /// Checks that the settings can work: non-zero durations, a heartbeat
    /// interval below the timeout, frames with room for a message.
    pub fn validate(&self) -> Result<(), RemoteError> {
        let invalid = |problem: String| Err(RemoteError::InvalidConfig { problem });
        for (name, value) in [
            ("heartbeat_interval", self.heartbeat_interval),
            ("heartbeat_timeout", self.heartbeat_timeout),
            ("handshake_timeout", self.handshake_timeout),
            ("write_timeout", self.write_timeout),
            ("lookup_timeout", self.lookup_timeout),
        ] {
            if value.is_zero() {
                return invalid(format!("{name} must not be zero"));
            }
        }
        if self.heartbeat_interval >= self.heartbeat_timeout {
            return invalid(format!(
                "heartbeat_interval ({:?}) must be below heartbeat_timeout ({:?})",
                self.heartbeat_interval, self.heartbeat_timeout
            ));
        }
        if self.max_frame_bytes <= 2 * FRAME_OVERHEAD {
            return invalid(format!("max_frame_bytes ({}) must exceed {} bytes", self.max_frame_bytes, 2 * FRAME_OVERHEAD));
        }
        if self.max_connections == 0 {
            return invalid("max_connections must not be zero".to_owned());
        }
        if self.max_unauthenticated == 0 {
            return invalid("max_unauthenticated must not be zero".to_owned());
        }
        Ok(())
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            bind: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            advertise: None,
            heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
            heartbeat_timeout: DEFAULT_HEARTBEAT_TIMEOUT,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            write_timeout: Duration::from_secs(10),
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            max_connections: 4096,
            max_unauthenticated: 64,
            lookup_timeout: Duration::from_secs(5),
        }
    }
}

/// What the node's tasks share.
pub(crate) struct NodeInner {
    config: NodeConfig,
    secret: Secret,
    addr: SocketAddr,
    served: Mutex<HashMap<String, Arc<dyn Served>>>,
    shutdown: watch::Sender<bool>,
}

impl NodeInner {
    pub(crate) fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// Largest encoded message or reply that fits a frame.
    pub(crate) fn max_message_bytes(&self) -> usize {
        self.config.max_frame_bytes.saturating_sub(FRAME_OVERHEAD)
    }

    fn served_table(&self) -> MutexGuard<'_, HashMap<String, Arc<dyn Served>>> {
        // Nothing panics while holding this lock; recover from poison anyway.
        self.served.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn served(&self, name: &str) -> Option<Arc<dyn Served>> {
        self.served_table().get(name).cloned()
    }

    pub(crate) fn shutdown_signal(&self) -> watch::Receiver<bool> {
        self.shutdown.subscribe()
    }

    fn is_shut_down(&self) -> bool {
        *self.shutdown.borrow()
    }
}

/// Shuts the node down when the last [`Node`] handle is dropped.
struct NodeGuard {
    inner: Arc<NodeInner>,
}

impl Drop for NodeGuard {
    fn drop(&mut self) {
        self.inner.shutdown.send_replace(true);
    }
}

/// A TCP endpoint hosting named actors for other nodes, and connecting to
/// other nodes to use theirs. Cheap to clone; the node shuts down (closing
/// all its connections) when [`Node::shutdown`] is called or the last clone
/// is dropped.
#[derive(Clone)]
pub struct Node {
    guard: Arc<NodeGuard>,
}

impl Node {
    /// Binds a listener (see [`NodeConfig::bind`]) and starts accepting
    /// connections authenticated with `secret`. Fails on an invalid config
    /// (see [`NodeConfig::validate`]).
    ///
    /// # Panics
    ///
    /// Like [`tokio::spawn`], panics when called outside a tokio runtime.
    pub async fn bind(secret: Secret, config: NodeConfig) -> Result<Node, RemoteError> {
        config.validate()?;
        let listener =
            TcpListener::bind(config.bind).await.map_err(|source| RemoteError::Bind { addr: config.bind.to_string(), source })?;
        let addr = listener.local_addr().map_err(|source| RemoteError::Bind { addr: config.bind.to_string(), source })?;
        let (shutdown, _) = watch::channel(false);
        let mut config = config;
        config.max_frame_bytes = config.max_frame_bytes.min(crate::codec::MAX_SIZE_CEILING);
        let inner = Arc::new(NodeInner { config, secret, addr, served: Mutex::default(), shutdown });
        tokio::spawn(accept_loop(Arc::clone(&inner), listener));
        tracing::debug!(%addr, "node listening");
        Ok(Node { guard: Arc::new(NodeGuard { inner }) })
    }

    fn inner(&self) -> &Arc<NodeInner> {
        &self.guard.inner
    }

    /// The address the node listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner().addr
    }

    /// The address announced to registries ([`NodeConfig::advertise`], or
    /// the listening address).
    pub fn advertised_addr(&self) -> SocketAddr {
        self.inner().config.advertise.unwrap_or(self.inner().addr)
    }

    /// The node's settings.
    pub fn config(&self) -> &NodeConfig {
        &self.inner().config
    }

    /// Serves `actor` under `name` to every connected peer. The node keeps
    /// the actor alive until [`Node::unserve`] or shutdown. Peers cannot
    /// stop it; they only see it stop.
    pub fn serve<A>(&self, name: impl Into<String>, actor: &ActorRef<A>) -> Result<(), RemoteError>
    where
        A: Actor,
        A::Msg: DeserializeOwned,
        A::Reply: Serialize,
    {
        let name = valid_name(name.into())?;
        let mut served = self.inner().served_table();
        if served.contains_key(&name) {
            return Err(RemoteError::NameTaken { name });
        }
        served.insert(name, Arc::new(actor.clone()));
        Ok(())
    }

    /// Stops serving `name`; `true` if it was served. Peers' handles to it
    /// stay alive but their messages fail as sent to an unknown actor.
    pub fn unserve(&self, name: &str) -> bool {
        self.inner().served_table().remove(name).is_some()
    }

    /// Identity of the actor served as `name`.
    pub(crate) fn served_info(&self, name: &str) -> Option<crate::actor::ActorInfo> {
        self.inner().served(name).map(|served| served.info().clone())
    }

    /// The names this node serves, sorted.
    pub fn served_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.inner().served_table().keys().cloned().collect();
        names.sort();
        names
    }

    /// Connects to the node at `addr` and authenticates (mutually), within
    /// [`NodeConfig::handshake_timeout`].
    pub async fn connect(&self, addr: impl ToSocketAddrs + fmt::Display) -> Result<RemotePeer, RemoteError> {
        let inner = self.inner();
        if inner.is_shut_down() {
            return Err(RemoteError::NodeShutDown);
        }
        let peer = addr.to_string();
        let after = inner.config.handshake_timeout;
        let timed_out = || RemoteError::Timeout { peer: peer.clone(), what: "connect and handshake", after };
        let attempt = async {
            let mut stream = TcpStream::connect(addr).await.map_err(|source| RemoteError::Connect { peer: peer.clone(), source })?;
            let _ = stream.set_nodelay(true);
            let keys = auth::client(&mut stream, &inner.secret, &peer).await?;
            Ok::<_, RemoteError>((stream, keys))
        };
        let (stream, keys) = tokio::time::timeout(after, attempt).await.map_err(|_| timed_out())??;
        let conn = Conn::start(Arc::clone(inner), stream, peer, keys);
        Ok(RemotePeer { link: Arc::new(Link { conn }) })
    }

    /// Closes every connection (peers see their proxies stop with
    /// [`StopReason::ConnectionLost`](crate::StopReason::ConnectionLost)) and
    /// stops listening. Idempotent.
    pub fn shutdown(&self) {
        self.inner().shutdown.send_replace(true);
    }

    /// `true` once [`Node::shutdown`] was called.
    pub fn is_shut_down(&self) -> bool {
        self.inner().is_shut_down()
    }
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node").field("addr", &self.local_addr()).field("served", &self.served_names()).finish_non_exhaustive()
    }
}

fn valid_name(name: String) -> Result<String, RemoteError> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(RemoteError::InvalidName { name, max: MAX_NAME_LEN });
    }
    Ok(name)
}

/// Incoming connections that have not authenticated yet, oldest first: at
/// most `budget`; admitting one more drops the oldest.
struct Unauthenticated {
    budget: usize,
    waiting: Mutex<Waiting>,
}

/// The next id, and each waiting connection's id and eviction signal.
type Waiting = (u64, std::collections::VecDeque<(u64, oneshot::Sender<usize>)>);

/// One connection's place among the unauthenticated; leaves on drop.
struct Admitted {
    pool: Arc<Unauthenticated>,
    id: u64,
    /// Fires (with the budget) when a newer connection takes the place.
    evicted: oneshot::Receiver<usize>,
}

impl Unauthenticated {
    fn lock(&self) -> MutexGuard<'_, Waiting> {
        // Nothing panics while holding this lock; recover from poison anyway.
        self.waiting.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn admit(self: &Arc<Self>) -> Admitted {
        let (tx, evicted) = oneshot::channel();
        let mut waiting = self.lock();
        let (next, queue) = &mut *waiting;
        let id = *next;
        *next += 1;
        if queue.len() >= self.budget {
            if let Some((_, oldest)) = queue.pop_front() {
                let _ = oldest.send(self.budget);
            }
        }
        queue.push_back((id, tx));
        Admitted { pool: Arc::clone(self), id, evicted }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.pool.lock().1.retain(|(id, _)| *id != self.id);
    }
}

async fn accept_loop(inner: Arc<NodeInner>, listener: TcpListener) {
    let mut shutdown = inner.shutdown_signal();
    let slots = Arc::new(Semaphore::new(inner.config.max_connections));
    let unauthenticated =
        Arc::new(Unauthenticated { budget: inner.config.max_unauthenticated, waiting: Mutex::new((0, Default::default())) });
    loop {
        let accepted = tokio::select! {
            () = wait_true(&mut shutdown) => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, addr) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                // E.g. out of file descriptors: back off instead of spinning.
                tracing::warn!(error = %err, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let admitted = unauthenticated.admit();
        let (inner, slots) = (Arc::clone(&inner), Arc::clone(&slots));
        tokio::spawn(serve_connection(inner, stream, addr, admitted, slots));
    }
    tracing::debug!(addr = %inner.addr, "node stopped listening");
}

/// Authenticates an incoming connection (in the unauthenticated budget),
/// then runs it until it closes (in the authenticated one).
async fn serve_connection(inner: Arc<NodeInner>, mut stream: TcpStream, addr: SocketAddr, mut admitted: Admitted, slots: Arc<Semaphore>) {
    let peer = addr.to_string();
    let _ = stream.set_nodelay(true);
    let after = inner.config.handshake_timeout;
    let mut shutdown = inner.shutdown_signal();
    let handshake = tokio::select! {
        () = wait_true(&mut shutdown) => return,
        Ok(budget) = &mut admitted.evicted => {
            tracing::warn!(%peer, budget, "rejected connection: not authenticated before newer connections filled the unauthenticated budget");
            return;
        }
        handshake = tokio::time::timeout(after, auth::server(&mut stream, &inner.secret, &peer)) => handshake,
    };
    drop(admitted);
    let keys = match handshake {
        Ok(Ok(keys)) => keys,
        Ok(Err(err)) => {
            tracing::warn!(%peer, error = %err, "rejected connection");
            return;
        }
        Err(_) => {
            tracing::warn!(%peer, ?after, "rejected connection: no handshake in time");
            return;
        }
    };
    let Ok(slot) = slots.try_acquire_owned() else {
        tracing::warn!(%peer, max = inner.config.max_connections, "rejected connection: too many authenticated connections");
        return;
    };
    tracing::debug!(%peer, "peer authenticated");
    let conn = Conn::start(inner, stream, peer, keys);
    conn.wait_closed().await;
    drop(slot);
}

/// Keeps a client connection open; closes it when dropped. Held by the
/// [`RemotePeer`] handles and by every proxy on the connection.
pub(crate) struct Link {
    conn: Arc<Conn>,
}

impl Link {
    pub(crate) fn conn(&self) -> &Arc<Conn> {
        &self.conn
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.conn.close("connection no longer used", CloseKind::Local);
    }
}

/// An authenticated connection to another node, to look up the actors it
/// serves. Cheap to clone. The connection stays open while a clone of this
/// or a handle obtained through it exists (or until [`RemotePeer::close`]).
#[derive(Clone)]
pub struct RemotePeer {
    link: Arc<Link>,
}

impl RemotePeer {
    /// The peer's address.
    pub fn addr(&self) -> &str {
        self.link.conn.peer()
    }

    /// A handle to the actor the peer serves as `name`, used exactly like a
    /// local one. Its mailbox capacity and call timeout are the
    /// [`SpawnConfig`] defaults; see [`RemotePeer::lookup_with`].
    ///
    /// The handle's actor is stopped once the remote actor stops (same
    /// reason) or the connection is lost
    /// ([`StopReason::ConnectionLost`](crate::StopReason::ConnectionLost));
    /// [`ActorRef::stop`] stops only the handle, never the remote actor.
    pub async fn lookup<A>(&self, name: &str) -> Result<ActorRef<A>, RemoteError>
    where
        A: Actor,
        A::Msg: Serialize,
        A::Reply: DeserializeOwned,
    {
        self.lookup_with(name, SpawnConfig::default()).await
    }

    /// Like [`RemotePeer::lookup`], with the local handle's mailbox
    /// capacity, call timeout and supervisors from `config` (its name is
    /// ignored: the handle carries the remote actor's identity).
    pub async fn lookup_with<A>(&self, name: &str, config: SpawnConfig) -> Result<ActorRef<A>, RemoteError>
    where
        A: Actor,
        A::Msg: Serialize,
        A::Reply: DeserializeOwned,
    {
        let conn = &self.link.conn;
        let name = match valid_name(name.to_owned()) {
            Ok(name) => name,
            Err(_) => return Err(RemoteError::UnknownActor { peer: conn.peer().to_owned(), name: name.to_owned() }),
        };
        let info = conn.lookup(&name, conn.node().config().lookup_timeout).await?;
        Ok(spawn_proxy::<A>(Arc::clone(&self.link), name, info, &config))
    }

    /// `true` until the connection closes.
    pub fn is_connected(&self) -> bool {
        self.link.conn.closed_problem().is_none()
    }

    /// Waits until the connection closes and returns why.
    pub async fn closed(&self) -> String {
        self.link.conn.wait_closed().await
    }

    /// Closes the connection now; handles obtained through it stop with
    /// [`StopReason::ConnectionLost`](crate::StopReason::ConnectionLost).
    pub fn close(&self) {
        self.link.conn.close("closed locally", CloseKind::Local);
    }
}

impl fmt::Debug for RemotePeer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemotePeer").field("addr", &self.addr()).field("connected", &self.is_connected()).finish()
    }
}
