//! A member's endpoint in the making: opened, then connected, then run
//! (again, where a run left it clean); the node fabric's connection is
//! here, the communicators' in [`super::comm`].

use super::comm::{CommEnd, IpcPending};
use super::error::FabricError;
use super::hub;
use super::spec::{DataAddr, NcclFabric, NodeFabric, PeerAddr};
use super::Host;
use super::{program_peers, KillSwitch, NodeFaults, MIN_FRAME_LIMIT};
use crate::{HelloKey, LinkEmulation, LocalTransport, NodeTransport, NodeTransportConfig, TcpConfig, Transport};
use reshard::{Endpoint, Group, RankProgram};
use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::time::Duration;

/// One member's data-plane endpoint in the making.
pub(super) enum EndpointState {
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
    /// Communicator fabric: prepared; the id comes with `Connect`.
    CommPrepared {
        /// Settings.
        settings: NcclFabric,
        /// The member's GPU (NCCL).
        gpu: Option<usize>,
    },
    /// IPC fabric: doorbells listening, the send bucket exported.
    IpcPrepared(IpcPending),
    /// Communicator or IPC fabric: this member's rank of the refit's
    /// communicator.
    Comm(Box<CommEnd>),
}

impl EndpointState {
    /// Takes this process's end of an in-process refit.
    pub(super) fn take_local(session: &str, me: Endpoint) -> Result<EndpointState, FabricError> {
        hub::take(session, me).map(EndpointState::Local).ok_or_else(|| FabricError::NoLocalChannel { session: session.to_string(), me })
    }

    /// Listens on `ip` for this refit's peers.
    pub(super) fn listen(ip: IpAddr, settings: NodeFabric, session: String) -> Result<(EndpointState, DataAddr), FabricError> {
        let listener = TcpListener::bind((ip, 0)).map_err(|e| FabricError::Listen { ip, source: e.into() })?;
        let addr = listener.local_addr().map_err(|e| FabricError::ListenerAddr { ip, source: e.into() })?;
        Ok((EndpointState::Listening { listener, settings, session }, DataAddr::Node(addr)))
    }

    /// Connects to the peers of `program` (blocking: run off the reactor).
    pub(super) fn connect(
        self,
        program: &RankProgram,
        table: &[PeerAddr],
        key: HelloKey,
        tweak: &dyn Fn(&mut NodeFaults),
    ) -> Result<EndpointState, FabricError> {
        let (listener, settings, session) = match self {
            EndpointState::Listening { listener, settings, session } => (listener, settings, session),
            EndpointState::CommPrepared { settings, gpu } => return EndpointState::connect_comm(program.endpoint, settings, gpu, table),
            EndpointState::IpcPrepared(pending) => return EndpointState::connect_ipc(program, pending, table, key),
            done => return Ok(done),
        };
        let me = program.endpoint;
        let by_endpoint: HashMap<Endpoint, &PeerAddr> = table.iter().map(|p| (p.endpoint, p)).collect();
        let mine = by_endpoint.get(&me).map(|p| (p.node, p.host)).ok_or(FabricError::NotInTable { me })?;
        let peers = node_peers(program, &by_endpoint)?;
        let sharing = Sharing::of(me, mine, &settings, table, &by_endpoint);
        sharing.say_other_users(&peers);
        let mut config = node_config(program, &settings, session, key, &|e| sharing.key(e));
        let mut tweaks = NodeFaults::default();
        tweak(&mut tweaks);
        if let Some(hook) = tweaks.faults.hook() {
            config.tcp.hook = Some(hook);
        }
        let t = NodeTransport::connect(me, listener, &peers, |e| sharing.key(e), &config)
            .map_err(|e| FabricError::Connect { me, source: e.into() })?;
        Ok(EndpointState::Connected(t))
    }

    /// A switch that tears the node fabric's connections down from any
    /// thread (a send blocked on a peer that stopped reading then fails at
    /// once); `None` for the in-process fabric, whose sends never block.
    pub(super) fn kill_switch(&self) -> Option<KillSwitch> {
        match self {
            EndpointState::Connected(t) => Some(crate::WithAbort::abort_all(t)),
            _ => None,
        }
    }

    /// The connected endpoint, ready to run (again, once a run that
    /// succeeded left it clean).
    pub(super) fn ready(&mut self) -> Result<Ready<'_>, FabricError> {
        match self {
            EndpointState::Local(t) => Ok(Ready::Transport(t)),
            EndpointState::Connected(t) => Ok(Ready::Transport(t)),
            EndpointState::Comm(c) if c.handle.is_some() => Ok(Ready::Comm(c)),
            EndpointState::Comm(_) => Err(FabricError::Aborted),
            EndpointState::Listening { .. } | EndpointState::CommPrepared { .. } | EndpointState::IpcPrepared(_) => {
                Err(FabricError::NotConnected)
            }
        }
    }

    /// Ends this refit's data plane with an error: peers stop waiting for
    /// this rank (a transport's abort frames; a communicator's abort).
    pub(super) fn abort(&mut self, why: &str) {
        match self.ready() {
            Ok(Ready::Transport(t)) => t.abort(why),
            Ok(Ready::Comm(c)) => {
                if let Some(hang) = c.abort() {
                    tracing::warn!(why, "{hang}");
                }
            }
            Err(_) => {}
        }
    }

    /// A connected endpoint worth keeping across refits (node fabric,
    /// communicator).
    pub(super) fn is_connected(&self) -> bool {
        match self {
            EndpointState::Connected(_) => true,
            EndpointState::Comm(c) => c.handle.is_some(),
            _ => false,
        }
    }
}

/// A connected endpoint.
pub(super) enum Ready<'a> {
    /// A host transport, for the one executor.
    Transport(&'a mut dyn Transport),
    /// A communicator, for the communicator executor.
    Comm(&'a mut CommEnd),
}

/// The node-fabric addresses of the peers of `program` in the peer table.
fn node_peers(program: &RankProgram, by_endpoint: &HashMap<Endpoint, &PeerAddr>) -> Result<Vec<(Endpoint, SocketAddr)>, FabricError> {
    let me = program.endpoint;
    let wanted = program_peers(program);
    let mut peers = Vec::with_capacity(wanted.len());
    for e in wanted {
        let p = by_endpoint.get(&e).ok_or(FabricError::NoPeerAddr { me, peer: e, fabric: "data" })?;
        let DataAddr::Node(addr) = p.addr else {
            return Err(FabricError::WrongAddr { peer: e, addr: Box::new(p.addr.clone()), fabric: "node-fabric" });
        };
        peers.push((e, addr));
    }
    Ok(peers)
}

/// Which ranks share memory with this one: ranks of one host (when known,
/// asked for, and the host has few enough: each pair that talks holds a
/// region), else ranks of one node of a group; without shared memory
/// every rank is a node of its own. Every rank derives its pairs' keys
/// from the same table, so both ends of a pair agree.
struct Sharing<'a> {
    me: Endpoint,
    /// This rank's node and host.
    mine: (u32, Host),
    shared_memory: bool,
    same_host: bool,
    /// Ranks on each machine.
    on_host: HashMap<u64, usize>,
    by_endpoint: &'a HashMap<Endpoint, &'a PeerAddr>,
}

impl<'a> Sharing<'a> {
    fn of(
        me: Endpoint,
        mine: (u32, Host),
        settings: &NodeFabric,
        table: &[PeerAddr],
        by_endpoint: &'a HashMap<Endpoint, &'a PeerAddr>,
    ) -> Sharing<'a> {
        let mut on_host: HashMap<u64, usize> = HashMap::new();
        for p in table {
            *on_host.entry(p.host.machine).or_default() += 1;
        }
        Sharing { me, mine, shared_memory: settings.shared_memory, same_host: settings.same_host, on_host, by_endpoint }
    }

    /// Whether ranks on `host` share memory host-wide.
    fn same_host(&self, host: Host) -> bool {
        self.same_host && host.machine != 0 && self.on_host.get(&host.machine).copied().unwrap_or(0) <= SAME_HOST_MOST_RANKS
    }

    /// The key of rank `e`: equal keys share memory.
    fn key(&self, e: Endpoint) -> ShareKey {
        let (node, host) =
            if e == self.me { self.mine } else { self.by_endpoint.get(&e).map_or((u32::MAX, Host::UNKNOWN), |p| (p.node, p.host)) };
        match (self.shared_memory, self.same_host(host)) {
            (false, _) => ShareKey::Rank(e),
            (true, true) => ShareKey::Host(host),
            (true, false) => ShareKey::Node(e.group, node),
        }
    }

    /// Says, once and on both ends, which peers on this machine cannot
    /// share memory with this rank (another user).
    fn say_other_users(&self, peers: &[(Endpoint, SocketAddr)]) {
        let (me, mine) = (self.me, self.mine.1);
        if !(self.shared_memory && self.same_host(mine)) {
            return;
        }
        for &(peer, _) in peers {
            let theirs = self.by_endpoint.get(&peer).map_or(Host::UNKNOWN, |p| p.host);
            if theirs.machine == mine.machine && theirs.user != mine.user {
                let why = format!("{peer} runs as user {} and {me} as user {}: neither can map the other's memory", theirs.user, mine.user);
                crate::tcp::fell_back(me, peer, &why);
            }
        }
    }
}

/// The node transport's settings for `program`'s rank: frame limits from
/// what each peer sends it, and a lend area sized to two of the largest
/// messages it sends inside its node (`share_key` says who is).
fn node_config(
    program: &RankProgram,
    settings: &NodeFabric,
    session: String,
    key: HelloKey,
    share_key: &dyn Fn(Endpoint) -> ShareKey,
) -> NodeTransportConfig {
    let me = program.endpoint;
    // A pair's lend area is reserved as soon as it talks: size it to
    // two of the largest messages this rank sends inside its node (the
    // next round's is lent while the receiver reads the last; bigger
    // ones stream), and share the default among the node peers it
    // sends to, or a node of 8 ranks pins gigabytes of shared memory.
    let in_node = program.rounds.iter().flat_map(|r| r.sends.iter()).filter(|m| share_key(m.peer) == share_key(me));
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
    let mut config =
        NodeTransportConfig { session, tcp: node_tcp(settings, key, largest_from, largest_recv), ..NodeTransportConfig::default() };
    let share = (config.shm.lend_bytes / in_node_peers).max(1 << 20);
    config.shm.lend_bytes = largest.next_power_of_two().saturating_mul(2).clamp(1 << 20, share);
    config.shm.stream_bytes = config.shm.stream_bytes.min(1 << 20);
    config
}

/// The TCP settings of a node-fabric rank that receives at most
/// `largest_from` bytes in one message from each peer (`largest_recv`
/// from any).
fn node_tcp(settings: &NodeFabric, key: HelloKey, largest_from: HashMap<Endpoint, u64>, largest_recv: u64) -> TcpConfig {
    TcpConfig {
        checksum: settings.checksum,
        connect_timeout: if settings.connect_timeout.is_zero() { Duration::from_secs(30) } else { settings.connect_timeout },
        // Every member opened its listener in `Prepare`, before any
        // `Connect`: a refused connection is a peer whose process
        // exited or whose connect ended (tried again until the
        // deadline all the same).
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
            .map(|(peer, l)| (peer, (l + crate::delta::HEADER as u64).max(MIN_FRAME_LIMIT)))
            .collect(),
        // Strangers at the data port are refused and logged.
        hello_key: Some(key),
        write_buffer_bytes: 256 << 10,
        ..TcpConfig::default()
    }
}

/// The most ranks a host may hold for all of them to share memory
/// ([`NodeFabric::same_host`]); a host with more shares it only within
/// nodes (every pair that talks holds a region of at least 2 MiB).
const SAME_HOST_MOST_RANKS: usize = 16;

/// What decides whether two ranks of the node fabric share memory: equal
/// keys do.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ShareKey {
    /// Every rank on one host of one user.
    Host(Host),
    /// The ranks of one node of a group.
    Node(Group, u32),
    /// One rank alone (no shared memory).
    Rank(Endpoint),
}
