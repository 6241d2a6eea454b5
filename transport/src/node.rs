//! The node transport: shared memory to peers on this rank's node, TCP to
//! the others, behind one [`Transport`].
//!
//! Every pair of ranks has a TCP stream per direction. For a pair on one
//! node the stream only carries small control frames, and the message
//! bytes go through a shared-memory region (see [`crate::shm`]); for other
//! pairs the bytes go on the stream. Link emulation ([`TcpConfig::emulation`])
//! caps each rank's egress with two token buckets: the inter-node one for
//! TCP peers, the intra-node one for shared-memory peers. Checksums and
//! the frame hook, e.g. fault injection ([`TcpConfig::checksum`],
//! [`TcpConfig::hook`]), apply to both kinds of link.

use crate::shm::ShmConfig;
use crate::tcp::shm_link::ShmSetup;
use crate::tcp::{TcpConfig, TcpTransport};
use crate::transport::{Payload, Transport, TransportError, WithAbort};
use reshard::Endpoint;
use std::collections::HashSet;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::time::Instant;
// The thread drivers' fabrics (test and tooling machinery).
#[cfg(any(test, feature = "testkit"))]
use {
    crate::exec::{run_threads, ExecError, ExecOptions, ExecReport},
    crate::faults::Faults,
    crate::memory::RankMemory,
    crate::tcp::fabric,
    reshard::RankProgram,
    std::sync::atomic::{AtomicU64, Ordering},
};

/// Node transport settings.
#[derive(Clone, Debug)]
pub struct NodeTransportConfig {
    /// Names this fabric's shared-memory regions; every rank of one run
    /// must use the same id, and concurrent runs on a node different ones
    /// (1-128 characters of `[A-Za-z0-9_-]`). Default: `refit`.
    pub session: String,
    /// The TCP side, plus checksums, link emulation and the frame hook
    /// (e.g. faults) for both kinds of link.
    pub tcp: TcpConfig,
    /// The shared-memory side.
    pub shm: ShmConfig,
}

impl Default for NodeTransportConfig {
    fn default() -> Self {
        NodeTransportConfig { session: "refit".into(), tcp: TcpConfig::default(), shm: ShmConfig::default() }
    }
}

/// One rank's end of a node fabric.
#[derive(Debug)]
pub struct NodeTransport {
    inner: TcpTransport,
}

fn same_node<N: PartialEq>(me: Endpoint, peers: impl Iterator<Item = Endpoint>, node_of: &impl Fn(Endpoint) -> N) -> HashSet<Endpoint> {
    let mine = node_of(me);
    peers.filter(|p| *p != me && node_of(*p) == mine).collect()
}

impl NodeTransport {
    /// Joins a fabric from a separate process: accepts a stream from every
    /// other peer on `listener`, opens one to every other peer's address in
    /// `peers`, and maps shared memory with every peer `node_of` puts on
    /// this rank's node. All ranks must pass the same `peers`, `node_of`
    /// and `config.session` (exchanged through the caller's rendezvous).
    pub fn connect<N: PartialEq>(
        me: Endpoint,
        listener: TcpListener,
        peers: &[(Endpoint, SocketAddr)],
        node_of: impl Fn(Endpoint) -> N,
        config: &NodeTransportConfig,
    ) -> io::Result<NodeTransport> {
        let setup = ShmSetup {
            session: config.session.clone(),
            same_node: same_node(me, peers.iter().map(|p| p.0), &node_of),
            config: config.shm.clone(),
        };
        Ok(NodeTransport { inner: TcpTransport::connect_with(me, listener, peers, &config.tcp, Some(setup))? })
    }

    /// The peers reached through shared memory.
    pub fn shm_peers(&self) -> Vec<Endpoint> {
        self.inner.shm_peers()
    }
}

/// Connects `endpoints` all-to-all as threads of this process: loopback
/// TCP between nodes, shared memory within (as `node_of` says). The
/// regions are named after `config.session`, this process and a counter,
/// so fabrics of concurrent tests do not collide.
#[cfg(any(test, feature = "testkit"))]
pub fn node_fabric<N: PartialEq>(
    endpoints: &[Endpoint],
    node_of: impl Fn(Endpoint) -> N + Sync,
    config: &NodeTransportConfig,
) -> io::Result<Vec<NodeTransport>> {
    node_fabric_with_faults(endpoints, node_of, config, |_| Faults::default())
}

/// As [`node_fabric`], with the faults `faults_of(rank)` injected at each
/// rank unless `config.tcp.hook` is set (for tests: one failing rank).
#[cfg(any(test, feature = "testkit"))]
pub fn node_fabric_with_faults<N: PartialEq>(
    endpoints: &[Endpoint],
    node_of: impl Fn(Endpoint) -> N + Sync,
    config: &NodeTransportConfig,
    faults_of: impl Fn(Endpoint) -> Faults + Sync,
) -> io::Result<Vec<NodeTransport>> {
    static FABRICS: AtomicU64 = AtomicU64::new(0);
    let session = format!("{}-{}-{}", config.session, std::process::id(), FABRICS.fetch_add(1, Ordering::Relaxed));
    let transports = fabric(
        endpoints,
        &config.tcp,
        |me| faults_of(me).hook(),
        |me| {
            Some(ShmSetup {
                session: session.clone(),
                same_node: same_node(me, endpoints.iter().copied(), &node_of),
                config: config.shm.clone(),
            })
        },
        &|_, _| true,
    )?;
    Ok(transports.into_iter().map(|inner| NodeTransport { inner }).collect())
}

/// Runs all programs as threads of this process over a node fabric
/// (shared memory within a node, loopback TCP between nodes, as `node_of`
/// says; e.g. `|e| plan.node_of(e)`).
#[cfg(any(test, feature = "testkit"))]
pub fn run_node<N: PartialEq>(
    programs: &[RankProgram],
    memory: &mut [RankMemory],
    options: &ExecOptions,
    node_of: impl Fn(Endpoint) -> N + Sync,
    config: &NodeTransportConfig,
) -> Result<ExecReport, ExecError> {
    let endpoints: Vec<Endpoint> = programs.iter().map(|p| p.endpoint).collect();
    let transports = node_fabric(&endpoints, node_of, config).map_err(|e| ExecError::Setup(e.to_string()))?;
    run_threads(programs, memory, options, transports)
}

impl Transport for NodeTransport {
    fn me(&self) -> Endpoint {
        self.inner.me()
    }

    fn send(&mut self, round: u32, to: Endpoint, payload: Payload) -> Result<(), TransportError> {
        self.inner.send(round, to, payload)
    }

    fn recv(&mut self, round: u32, deadline: Instant) -> Result<(Endpoint, Payload), TransportError> {
        self.inner.recv(round, deadline)
    }

    fn flush(&mut self, round: u32, deadline: Instant) -> Result<(), TransportError> {
        self.inner.flush(round, deadline)
    }

    fn abort(&mut self, reason: &str) {
        self.inner.abort(reason)
    }

    fn link_from(&self, peer: Endpoint) -> Option<String> {
        self.inner.link_from(peer)
    }

    fn converts_on_send(&self, to: Endpoint) -> bool {
        self.inner.converts_on_send(to)
    }
}

impl WithAbort for NodeTransport {
    fn abort_all(&self) -> Box<dyn Fn(&str) + Send> {
        self.inner.abort_all()
    }
}
