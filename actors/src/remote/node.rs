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
use super::clock::Clock;
use super::conn::{wait_true, CloseKind, Conn};
use super::error::RemoteError;
use super::proxy::spawn_proxy;
use super::retry::Retry;
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
/// Default [`NodeConfig::hello_timeout`].
pub const DEFAULT_HELLO_TIMEOUT: Duration = Duration::from_secs(1);
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
    /// A connection with no byte from the peer for this long of the time
    /// this process was running is dead (default 1 s): time this process
    /// could not run (a starved host, measured by the node's clock, which
    /// ticks every `heartbeat_interval`) is not counted.
    pub heartbeat_timeout: Duration,
    /// Connecting plus authenticating must finish within this (default 2 s);
    /// a slow client is dropped after it.
    pub handshake_timeout: Duration,
    /// An incoming connection must send its first handshake frame (`Hello`)
    /// within this (default 1 s; at most `handshake_timeout` applies): a
    /// client sends it right after connecting, so a silent socket is
    /// dropped after this, freeing its place among the connections still
    /// authenticating (`max_unauthenticated`).
    pub hello_timeout: Duration,
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
    /// full, a newcomer is always let in and one of the waiting connections
    /// is dropped for it, chosen **at random** among those that have not
    /// sent their `Hello` yet (silent sockets), or among all of them when
    /// every one has. A client with the secret sends its `Hello` at once
    /// and authenticates within a round trip: once its `Hello` is read,
    /// silent sockets cannot push it out, and before that each newcomer
    /// drops it with probability 1/`max_unauthenticated`. A client that is
    /// dropped anyway retries ([`Node::connect_retrying`], as members
    /// joining a rendezvous do). Silent sockets leave after
    /// `hello_timeout`. Not per address: behind a NAT, or in tests on
    /// loopback, honest clients and strangers share one.
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
            ("hello_timeout", self.hello_timeout),
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
            hello_timeout: DEFAULT_HELLO_TIMEOUT,
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
    /// How long this process could not run (peers' silence meanwhile is
    /// not held against them).
    clock: Arc<Clock>,
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

    pub(crate) fn clock(&self) -> &Clock {
        &self.clock
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
        let clock = Clock::start(config.heartbeat_interval, shutdown.subscribe());
        let inner = Arc::new(NodeInner { config, secret, addr, served: Mutex::default(), shutdown, clock });
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

    /// [`Node::connect`], retried after failures another attempt may not
    /// meet ([`RemoteError::is_transient`]: e.g. the server dropped the
    /// connection before it authenticated, being crowded by others that do
    /// not) with backoff, until `retry.timeout`. Each retry is logged; the
    /// error of the last attempt comes back as [`RemoteError::GaveUp`], one
    /// that retrying cannot help at once.
    pub async fn connect_retrying<A>(&self, addr: A, retry: &Retry) -> Result<RemotePeer, RemoteError>
    where
        A: ToSocketAddrs + fmt::Display + Clone,
    {
        let peer = addr.to_string();
        retry.run(&peer, || self.connect(addr.clone())).await
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

/// Incoming connections that have not authenticated yet: at most `budget`;
/// admitting one more drops one of the others, at random among those that
/// have not said `Hello` yet (all of them if every one has).
struct Unauthenticated {
    budget: usize,
    pending: Mutex<Pending>,
}

struct Pending {
    next_id: u64,
    /// xorshift64* state, seeded from the OS's generator.
    rng: u64,
    waiting: Vec<Waiting>,
}

struct Waiting {
    id: u64,
    said_hello: bool,
    evict: oneshot::Sender<Evicted>,
}

/// Why a waiting connection was dropped for a newcomer.
struct Evicted {
    budget: usize,
    /// It had sent its `Hello` (every waiting connection had).
    said_hello: bool,
}

/// One connection's place among the unauthenticated; leaves on drop.
struct Place {
    pool: Arc<Unauthenticated>,
    id: u64,
}

impl Pending {
    fn random_below(&mut self, n: usize) -> usize {
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        let r = x.wrapping_mul(0x2545_f491_4f6c_dd1d);
        // n is at most the budget: the high bits, scaled, are uniform enough.
        ((u128::from(r) * n as u128) >> 64) as usize
    }
}

impl Unauthenticated {
    fn new(budget: usize) -> Self {
        // Never zero (xorshift's fixed point).
        let seed = (uuid::Uuid::new_v4().as_u128() as u64) | 1;
        Unauthenticated { budget, pending: Mutex::new(Pending { next_id: 0, rng: seed, waiting: Vec::new() }) }
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        // Nothing panics while holding this lock; recover from poison anyway.
        self.pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Admits a newcomer, dropping another if the budget is full; the
    /// receiver fires if the newcomer is dropped in turn.
    fn admit(self: &Arc<Self>) -> (Place, oneshot::Receiver<Evicted>) {
        let (evict, evicted) = oneshot::channel();
        let mut pending = self.lock();
        let id = pending.next_id;
        pending.next_id += 1;
        if pending.waiting.len() >= self.budget {
            let silent = pending.waiting.iter().filter(|w| !w.said_hello).count();
            let victim = if silent > 0 {
                let nth = pending.random_below(silent);
                pending.waiting.iter().enumerate().filter(|(_, w)| !w.said_hello).nth(nth).map(|(i, _)| i)
            } else {
                let n = pending.waiting.len();
                Some(pending.random_below(n))
            };
            if let Some(i) = victim {
                let w = pending.waiting.swap_remove(i);
                let _ = w.evict.send(Evicted { budget: self.budget, said_hello: w.said_hello });
            }
        }
        pending.waiting.push(Waiting { id, said_hello: false, evict });
        (Place { pool: Arc::clone(self), id }, evicted)
    }
}

impl Place {
    /// The connection sent a valid `Hello`: silent newcomers no longer
    /// push it out.
    fn said_hello(&self) {
        if let Some(w) = self.pool.lock().waiting.iter_mut().find(|w| w.id == self.id) {
            w.said_hello = true;
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut pending = self.pool.lock();
        if let Some(i) = pending.waiting.iter().position(|w| w.id == self.id) {
            pending.waiting.swap_remove(i);
        }
    }
}

async fn accept_loop(inner: Arc<NodeInner>, listener: TcpListener) {
    let mut shutdown = inner.shutdown_signal();
    let slots = Arc::new(Semaphore::new(inner.config.max_connections));
    let unauthenticated = Arc::new(Unauthenticated::new(inner.config.max_unauthenticated));
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

/// How an incoming handshake ended without keys.
enum Refused {
    /// No frame (`what`) within `after`.
    Late {
        what: &'static str,
        after: Duration,
    },
    Failed(RemoteError),
}

impl From<RemoteError> for Refused {
    fn from(err: RemoteError) -> Self {
        Refused::Failed(err)
    }
}

/// Authenticates an incoming connection (in the unauthenticated budget),
/// then runs it until it closes (in the authenticated one).
async fn serve_connection(
    inner: Arc<NodeInner>,
    mut stream: TcpStream,
    addr: SocketAddr,
    (place, mut evicted): (Place, oneshot::Receiver<Evicted>),
    slots: Arc<Semaphore>,
) {
    let peer = addr.to_string();
    let _ = stream.set_nodelay(true);
    let after = inner.config.handshake_timeout;
    let hello_after = inner.config.hello_timeout.min(after);
    let started = tokio::time::Instant::now();
    let mut shutdown = inner.shutdown_signal();
    let handshake = async {
        let hello = tokio::time::timeout(hello_after, auth::server_hello(&mut stream, &peer))
            .await
            .map_err(|_| Refused::Late { what: "no Hello", after: hello_after })??;
        place.said_hello();
        let keys = tokio::time::timeout_at(started + after, auth::server_finish(&mut stream, &inner.secret, &peer, hello))
            .await
            .map_err(|_| Refused::Late { what: "not authenticated", after })??;
        Ok::<_, Refused>(keys)
    };
    let handshake = tokio::select! {
        () = wait_true(&mut shutdown) => return,
        Ok(Evicted { budget, said_hello }) = &mut evicted => {
            tracing::warn!(
                %peer, budget, said_hello,
                "rejected connection: not authenticated before newer connections filled the unauthenticated budget \
                 (dropped at random among the waiting ones that had not said Hello, or all when every one had)"
            );
            return;
        }
        handshake = handshake => handshake,
    };
    drop(place);
    let keys = match handshake {
        Ok(keys) => keys,
        Err(Refused::Failed(err)) => {
            tracing::warn!(%peer, error = %err, "rejected connection");
            return;
        }
        Err(Refused::Late { what, after }) => {
            tracing::warn!(%peer, ?after, "rejected connection: no handshake in time ({what})");
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

    /// The identity of the actor the peer serves as `name`, asked within
    /// `after` (no handle made).
    pub(crate) async fn served_info(&self, name: &str, after: Duration) -> Result<crate::actor::ActorInfo, RemoteError> {
        self.link.conn.lookup(name, after).await
    }

    /// `true` until the connection closes.
    pub fn is_connected(&self) -> bool {
        self.link.conn.closed_problem().is_none()
    }

    /// Waits until the connection closes and returns why.
    pub async fn closed(&self) -> String {
        self.link.conn.wait_closed().await
    }

    /// `true` once the connection was closed on purpose: by this side
    /// ([`RemotePeer::close`], the node shut down) or by the peer saying
    /// goodbye (its node shut down, its handles dropped). `false` while it
    /// is open, and when it broke: the peer's end closed without a word (its
    /// process died, or it gave this side up as silent), an I/O or protocol
    /// error, a heartbeat timeout. A connection that broke may be made
    /// again if the peer lives.
    pub fn closed_on_purpose(&self) -> bool {
        matches!(self.link.conn.closed_kind(), Some(CloseKind::Local | CloseKind::Goodbye))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Fills a pool of `budget` with connections; those in `said_hello`
    /// have sent their `Hello`.
    fn filled(budget: usize, said_hello: &[usize]) -> (Arc<Unauthenticated>, Vec<(Place, oneshot::Receiver<Evicted>)>) {
        let pool = Arc::new(Unauthenticated::new(budget));
        let places: Vec<_> = (0..budget).map(|_| pool.admit()).collect();
        for &i in said_hello {
            places[i].0.said_hello();
        }
        (pool, places)
    }

    fn evicted(places: &mut [(Place, oneshot::Receiver<Evicted>)]) -> Vec<usize> {
        let mut gone = Vec::new();
        for (i, (_, rx)) in places.iter_mut().enumerate() {
            if rx.try_recv().is_ok() {
                gone.push(i);
            }
        }
        gone
    }

    #[test]
    fn silent_newcomers_never_push_out_a_connection_that_said_hello() {
        let (pool, mut places) = filled(4, &[0, 2]);
        // 200 silent newcomers, each staying: the budget stays full.
        let mut newcomers = Vec::new();
        for _ in 0..200 {
            newcomers.push(pool.admit());
            assert_eq!(pool.lock().waiting.len(), 4);
        }
        let gone = evicted(&mut places);
        assert_eq!(gone, vec![1, 3], "only the silent ones make way");
        assert!(places[0].1.try_recv().is_err() && places[2].1.try_recv().is_err());
    }

    #[test]
    fn when_every_waiting_connection_said_hello_a_random_one_makes_way() {
        let mut chosen = [0usize; 4];
        for _ in 0..400 {
            let (pool, mut places) = filled(4, &[0, 1, 2, 3]);
            let _newcomer = pool.admit();
            let gone = evicted(&mut places);
            assert_eq!(gone.len(), 1, "exactly one makes way for a newcomer");
            chosen[gone[0]] += 1;
        }
        // Not the oldest every time (as drop-oldest would): each was chosen.
        assert!(chosen.iter().all(|&n| n > 0), "{chosen:?}");
    }

    #[test]
    fn a_place_leaves_the_pool_when_dropped() {
        let (pool, places) = filled(3, &[]);
        drop(places);
        assert!(pool.lock().waiting.is_empty());
        let (_place, mut rx) = pool.admit();
        assert!(rx.try_recv().is_err(), "room again: nobody is dropped");
    }
}
