//! A member's end of a refit's data plane: opened on `Prepare`, connected
//! on `Connect`, run by `Run`; a node-fabric endpoint that a run left clean
//! may be kept for the next refit of the same plan (`Resume`).
//!
//! Two fabrics, one interface ([`transport::Transport`]):
//! - **in process**: the orchestrator makes the channels of a refit
//!   ([`transport::local_fabric`]) and leaves them in this process's
//!   [`hub`] under the refit's session id; each member takes its own end.
//!   A member in another process finds nothing there and refuses.
//! - **node**: the member listens on its data address; on `Connect` it
//!   connects to the peers its program exchanges with, through shared memory
//!   when the peer is on its node and TCP otherwise
//!   ([`transport::NodeTransport`]).

use crate::protocol::{NodeFabric, PeerAddr};
use reshard::{Endpoint, Group, RankProgram};
use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::time::Duration;
use transport::tcp::TcpConfig;

/// The smallest frame limit a data-plane endpoint sets: room for an abort's
/// reason (64 KiB at most) and the small frames of shared-memory links.
const MIN_FRAME_LIMIT: u64 = 1 << 17;
use transport::{LinkEmulation, LocalTransport, NodeTransport, NodeTransportConfig, Transport};

/// Tears a rank's data plane down from any thread (the reason in words).
pub(crate) type KillSwitch = Box<dyn Fn(&str) + Send>;

/// One member's data-plane endpoint in the making.
pub(crate) enum Endpointed {
    /// In process: ready as soon as it is taken from the hub.
    Local(LocalTransport),
    /// Node fabric: listening, not yet connected.
    Listening {
        /// The listener peers connect to.
        listener: TcpListener,
        /// Settings.
        settings: NodeFabric,
        /// The refit's session id (names shared-memory regions).
        session: String,
    },
    /// Node fabric: connected.
    Connected(NodeTransport),
}

impl Endpointed {
    /// Takes this process's end of an in-process refit.
    pub(crate) fn take_local(session: &str, me: Endpoint) -> Result<Endpointed, String> {
        hub::take(session, me).map(Endpointed::Local).ok_or_else(|| {
            format!(
                "the in-process fabric of refit session {session} has no channel for {me} in this process \
                 (is this member in another process than the orchestrator? use the node fabric)"
            )
        })
    }

    /// Listens on `ip` for this refit's peers.
    pub(crate) fn listen(ip: IpAddr, settings: NodeFabric, session: String) -> Result<(Endpointed, String), String> {
        let listener = TcpListener::bind((ip, 0)).map_err(|e| format!("cannot listen on {ip}: {e}"))?;
        let addr = listener.local_addr().map_err(|e| format!("listener on {ip}: {e}"))?.to_string();
        Ok((Endpointed::Listening { listener, settings, session }, addr))
    }

    /// Connects to the peers of `program` (blocking: run off the reactor).
    pub(crate) fn connect(
        self,
        program: &RankProgram,
        table: &[PeerAddr],
        key: transport::HelloKey,
        tweak: impl FnOnce(&mut NodeTransportConfig),
    ) -> Result<Endpointed, String> {
        let (listener, settings, session) = match self {
            Endpointed::Listening { listener, settings, session } => (listener, settings, session),
            done => return Ok(done),
        };
        let me = program.endpoint;
        let by_endpoint: HashMap<Endpoint, &PeerAddr> = table.iter().map(|p| (p.endpoint, p)).collect();
        let mine = by_endpoint.get(&me).map(|p| p.node).ok_or_else(|| format!("the peer table has no entry for {me}"))?;
        let mut wanted = BTreeSet::new();
        for r in &program.rounds {
            wanted.extend(r.sends.iter().map(|m| m.peer));
            wanted.extend(r.recvs.iter().map(|m| m.peer));
        }
        let mut peers = Vec::with_capacity(wanted.len());
        for e in wanted {
            let p = by_endpoint.get(&e).ok_or_else(|| format!("no data address for {me}'s peer {e}"))?;
            let addr: SocketAddr = p.addr.parse().map_err(|err| format!("{e}: bad data address '{}': {err}", p.addr))?;
            peers.push((e, addr));
        }
        let node_of = |e: Endpoint| -> (Group, u32) {
            let node = if e == me { mine } else { by_endpoint.get(&e).map_or(u32::MAX, |p| p.node) };
            (e.group, node)
        };
        // A pair's lend area is reserved as soon as it talks: size it to the
        // largest message this rank sends inside its node (bigger ones
        // stream), and share the default among the node peers it sends to,
        // or a node of 8 ranks pins gigabytes of shared memory.
        let in_node = program.rounds.iter().flat_map(|r| r.sends.iter()).filter(|m| node_of(m.peer) == node_of(me));
        let largest = in_node.clone().map(|m| m.wire_bytes()).max().unwrap_or(0);
        let in_node_peers = in_node.map(|m| m.peer).collect::<BTreeSet<_>>().len().max(1) as u64;
        // The largest message this rank's program expects from each peer,
        // and from any.
        let mut largest_from: HashMap<Endpoint, u64> = HashMap::new();
        for m in program.rounds.iter().flat_map(|r| r.recvs.iter()) {
            let l = largest_from.entry(m.peer).or_default();
            *l = (*l).max(m.wire_bytes());
        }
        let largest_recv = largest_from.values().copied().max().unwrap_or(0);
        let mut config = NodeTransportConfig {
            session,
            tcp: TcpConfig {
                checksum: settings.checksum,
                connect_timeout: if settings.connect_timeout.is_zero() { Duration::from_secs(30) } else { settings.connect_timeout },
                // Every member opened its listener in `Prepare`, before any
                // `Connect`: a refused connection is a dead peer.
                peers_listening: true,
                emulation: LinkEmulation {
                    inter_node_bytes_per_s: settings.emulation.inter_node_bytes_per_s.map(|r| r.max(1)),
                    intra_node_bytes_per_s: settings.emulation.intra_node_bytes_per_s.map(|r| r.max(1)),
                    burst_bytes: 0,
                },
                // Keep received frames for reuse up to one of the largest
                // this rank receives (a kept fabric holds them between
                // refits), and buffer small writes only, or a rank with a
                // hundred peers holds hundreds of MiB it does not need.
                frame_pool_bytes: largest_recv,
                // No frame from a peer larger than the largest message
                // this rank's program expects from that peer (an abort's
                // reason and shared-memory notices fit in the floor; a
                // peer it expects nothing from gets the floor): a peer
                // cannot make it allocate more.
                max_frame_bytes: MIN_FRAME_LIMIT,
                // (A delta refit's message may be a header longer.)
                max_frame_bytes_from: largest_from
                    .into_iter()
                    .map(|(peer, l)| (peer, (l + transport::delta::HEADER as u64).max(MIN_FRAME_LIMIT)))
                    .collect(),
                // Strangers at the data port are refused and logged.
                hello_key: Some(key),
                write_buffer_bytes: 256 << 10,
                ..TcpConfig::default()
            },
            ..NodeTransportConfig::default()
        };
        let share = (config.shm.lend_bytes / in_node_peers).max(1 << 20);
        config.shm.lend_bytes = largest.next_power_of_two().clamp(1 << 20, share);
        config.shm.stream_bytes = config.shm.stream_bytes.min(1 << 20);
        tweak(&mut config);
        let t = NodeTransport::connect(me, listener, &peers, node_of, &config).map_err(|e| format!("{me}: connect: {e}"))?;
        Ok(Endpointed::Connected(t))
    }

    /// A switch that tears the node fabric's connections down from any
    /// thread (a send blocked on a peer that stopped reading then fails at
    /// once); `None` for the in-process fabric, whose sends never block.
    pub(crate) fn kill_switch(&self) -> Option<KillSwitch> {
        match self {
            Endpointed::Connected(t) => Some(transport::WithAbort::abort_all(t)),
            _ => None,
        }
    }

    /// The connected transport, ready to run (again, once a run that
    /// succeeded left it clean).
    pub(crate) fn transport(&mut self) -> Result<&mut dyn Transport, String> {
        match self {
            Endpointed::Local(t) => Ok(t),
            Endpointed::Connected(t) => Ok(t),
            Endpointed::Listening { .. } => Err("the data plane was prepared but never connected".into()),
        }
    }

    /// A connected node-fabric endpoint (one worth keeping across refits).
    pub(crate) fn is_connected(&self) -> bool {
        matches!(self, Endpointed::Connected(_))
    }
}

/// This process's in-process channels of refits in progress, by session.
pub(crate) mod hub {
    use reshard::Endpoint;
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    use transport::LocalTransport;

    type Sessions = HashMap<String, HashMap<Endpoint, LocalTransport>>;

    fn sessions() -> std::sync::MutexGuard<'static, Sessions> {
        static HUB: OnceLock<Mutex<Sessions>> = OnceLock::new();
        HUB.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Leaves the channels of one refit for its members to take.
    pub(crate) fn deposit(session: &str, ends: Vec<LocalTransport>) {
        use transport::Transport as _;
        let ends = ends.into_iter().map(|t| (t.me(), t)).collect();
        sessions().insert(session.to_string(), ends);
    }

    /// A member's end, once.
    pub(crate) fn take(session: &str, me: Endpoint) -> Option<LocalTransport> {
        sessions().get_mut(session)?.remove(&me)
    }

    /// Drops whatever of the session no member took (the refit is over).
    pub(crate) fn close(session: &str) {
        let left = sessions().remove(session);
        drop(left);
    }
}
