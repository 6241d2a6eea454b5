//! Setting up the streams: a rank dials every peer it talks to (retrying
//! until its deadline) while it accepts theirs, which makes its
//! [`TcpTransport`]; whole loopback fabrics of ranks are connected the
//! same way, a thread per rank.

use super::accept::{accept_all, Expect};
use super::pool::FramePool;
use super::reader::{PeerStatus, Reader};
use super::watch::watch;
use super::{Inbound, Link, TcpConfig, TcpTransport};
use crate::frame::{decode_region_ref, hello, hello_problem, ShmAnnounce, HELLO_OK, HELLO_REGION, REGION_REF};
#[cfg(any(test, feature = "testkit"))]
use crate::link::FrameHook;
use crate::shm::RegionRef;
use crate::sockopt::choose_congestion;
use crate::tcp::shm_link::{self, MadeRegion, ShmSetup};
use crate::transport::RoundInbox;
use reshard::Endpoint;
use std::collections::{HashMap, HashSet};
use std::io::{self, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Connects every endpoint to every other over loopback TCP (for running
/// all ranks of a plan as threads of one process over real sockets).
#[cfg(any(test, feature = "testkit"))]
pub fn tcp_fabric(endpoints: &[Endpoint], config: &TcpConfig) -> io::Result<Vec<TcpTransport>> {
    fabric(endpoints, config, |_| None, |_| None, &|_, _| true)
}

/// As [`tcp_fabric`] for the ranks of `programs`, each connected only to
/// the ranks its program exchanges messages with (as the orchestrator's
/// node fabric connects them): a pair that never talks holds no streams and
/// no reader threads (all to all, 192 ranks would need 36,672 streams, more
/// descriptors than a process gets).
#[cfg(any(test, feature = "testkit"))]
pub fn tcp_fabric_for(programs: &[reshard::RankProgram], config: &TcpConfig) -> io::Result<Vec<TcpTransport>> {
    let endpoints: Vec<Endpoint> = programs.iter().map(|p| p.endpoint).collect();
    let mut talks: HashSet<(Endpoint, Endpoint)> = HashSet::new();
    for p in programs {
        for m in p.rounds.iter().flat_map(|r| r.sends.iter()) {
            talks.insert((p.endpoint, m.peer));
            talks.insert((m.peer, p.endpoint));
        }
    }
    fabric(&endpoints, config, |_| None, |_| None, &|a, b| talks.contains(&(a, b)))
}

/// Connects every endpoint to every other it `talks` to (a symmetric
/// relation) over loopback TCP, with the shared-memory setup `shm(rank)`
/// gives each; a rank's frame hook is `config.hook` if set, else
/// `hook_of(rank)`.
#[cfg(any(test, feature = "testkit"))]
pub(crate) fn fabric(
    endpoints: &[Endpoint],
    config: &TcpConfig,
    hook_of: impl Fn(Endpoint) -> Option<Arc<dyn FrameHook>> + Sync,
    shm: impl Fn(Endpoint) -> Option<ShmSetup> + Sync,
    talks: &(dyn Fn(Endpoint, Endpoint) -> bool + Sync),
) -> io::Result<Vec<TcpTransport>> {
    let listeners: Vec<TcpListener> = endpoints.iter().map(|_| TcpListener::bind("127.0.0.1:0")).collect::<io::Result<_>>()?;
    let addrs: Vec<(Endpoint, SocketAddr)> =
        endpoints.iter().zip(&listeners).map(|(e, l)| l.local_addr().map(|a| (*e, a))).collect::<io::Result<_>>()?;
    std::thread::scope(|s| {
        let (addrs, shm, hook_of) = (&addrs, &shm, &hook_of);
        let handles: Vec<_> = endpoints
            .iter()
            .zip(listeners)
            .map(|(&me, l)| {
                s.spawn(move || {
                    let hook = config.hook.clone().or_else(|| hook_of(me));
                    let mine: Vec<(Endpoint, SocketAddr)> = addrs.iter().copied().filter(|&(e, _)| e == me || talks(me, e)).collect();
                    TcpTransport::connect_with(me, l, &mine, &TcpConfig { hook, ..config.clone() }, shm(me))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(io::Error::other("connect thread panicked")))).collect()
    })
}

/// Why one connection to a peer was not made: `again` when a new one may
/// yet be taken (the peer closed it unanswered, or did not take it);
/// `no_region` when the peer could not map our shared-memory region (a
/// new one without shared memory will be taken).
struct Dialed {
    error: io::Error,
    again: bool,
    no_region: bool,
}

/// An accepted connection: the stream, the congestion control it runs,
/// and, for a shared-memory pair, where the peer's acknowledgement page is.
struct DialedOk {
    stream: TcpStream,
    congestion: String,
    acks: Option<RegionRef>,
}

/// Connects to `peer` at `addr`, chooses the stream's congestion control
/// (`config.congestion`) and makes the handshake `hello` (announcing a
/// shared-memory region if `shared`): the stream once the peer accepted
/// it, blocking, without a read timeout.
fn dial(
    me: Endpoint,
    peer: Endpoint,
    addr: SocketAddr,
    hello: &[u8],
    shared: bool,
    deadline: Instant,
    config: &TcpConfig,
) -> Result<DialedOk, Dialed> {
    let peers_listening = config.peers_listening;
    let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let again = |what: String, e: io::Error| Dialed {
        error: io::Error::new(e.kind(), format!("{me}: {what}: {e}")),
        again: true,
        no_region: false,
    };
    let mut stream = match TcpStream::connect_timeout(&addr, left()) {
        Ok(s) => s,
        // Nothing listens there (yet, or any more): tried again until the
        // deadline, since only then is the peer known not to come.
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            let why = if peers_listening {
                "nothing listens there: its process exited, or its own connect ended"
            } else {
                "nothing listens there (yet)"
            };
            let error = io::Error::new(e.kind(), format!("{me}: {peer} at {addr} refused the connection: {why}"));
            return Err(Dialed { error, again: true, no_region: false });
        }
        Err(e) => return Err(again(format!("cannot connect to {peer} at {addr}"), e)),
    };
    let setup = |s: &TcpStream| {
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(left()))
    };
    setup(&stream).map_err(|e| again(format!("connection to {peer} at {addr}"), e))?;
    // Before any byte of ours is sent, so the stream starts with it.
    let congestion = choose_congestion(&stream, &config.congestion);
    stream.write_all(hello).map_err(|e| again(format!("handshake to {peer} at {addr} not sent"), e))?;
    let mut answer = [0u8; 1];
    if let Err(e) = stream.read_exact(&mut answer) {
        use io::ErrorKind::*;
        let closed = matches!(e.kind(), UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe);
        let error = io::Error::new(e.kind(), format!("{me}: no handshake answer from {peer} at {addr}: {e}"));
        return Err(Dialed { error, again: closed, no_region: false });
    }
    if answer[0] != HELLO_OK {
        let error = io::Error::new(io::ErrorKind::InvalidData, format!("{me}: {peer} {}", hello_problem(answer[0])));
        return Err(Dialed { error, again: false, no_region: shared && answer[0] == HELLO_REGION });
    }
    let fail = |e: io::Error| Dialed {
        error: io::Error::new(e.kind(), format!("{me}: connection to {peer}: {e}")),
        again: false,
        no_region: false,
    };
    let acks = if shared {
        let mut r = [0u8; REGION_REF];
        stream.read_exact(&mut r).map_err(fail)?;
        Some(decode_region_ref(&r))
    } else {
        None
    };
    stream.set_read_timeout(None).map_err(fail)?;
    Ok(DialedOk { stream, congestion, acks })
}

/// Dials `peer` (with a shared-memory region if the pair `shared`s one)
/// until it answers or `deadline`. A connection refused (nothing
/// listening), slow (a full backlog drops the peer's SYNs) or dropped
/// before its handshake was answered (a peer's acceptor making room) is
/// made again, with backoff; a peer that cannot map the region is dialed
/// again without one. Returns the stream and the region it took, if any.
fn dial_until_deadline(
    me: Endpoint,
    peer: Endpoint,
    addr: SocketAddr,
    shared: Option<&ShmSetup>,
    deadline: Instant,
    config: &TcpConfig,
) -> io::Result<(DialedOk, Option<(MadeRegion, ShmAnnounce)>)> {
    let checksum = config.checksum;
    let mut made = shared.map(|s| s.create(me, peer)).transpose()?;
    let mut hello = hello(me, peer, checksum, made.as_ref().map(|(_, a)| *a), config.hello_key.as_ref());
    let mut pause = Duration::from_millis(20);
    let mut tries = 1u32;
    let dialing = Instant::now();
    loop {
        match dial(me, peer, addr, &hello, made.is_some(), deadline, config) {
            Ok(d) => {
                let ms = dialing.elapsed().as_millis() as u64;
                tracing::debug!(%me, %peer, %addr, tries, ms, congestion = %d.congestion, "data-plane stream to a peer connected");
                return Ok((d, made));
            }
            Err(Dialed { error, no_region: true, .. }) => {
                // The peer cannot map our region (another user, another
                // process namespace): TCP for this pair.
                shm_link::fell_back(me, peer, &error.to_string());
                made = None;
                hello = crate::frame::hello(me, peer, checksum, None, config.hello_key.as_ref());
            }
            Err(Dialed { error, again: true, .. }) if Instant::now() < deadline => {
                tracing::debug!(%me, %peer, %addr, %error, tries, "data-plane connection not taken; trying again");
                std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
                pause = (pause * 2).min(Duration::from_millis(500));
                tries += 1;
            }
            Err(Dialed { error, again, .. }) if again && tries > 1 => {
                let s = dialing.elapsed().as_secs_f64();
                return Err(io::Error::new(error.kind(), format!("{error} (the last of {tries} tries in {s:.1} s)")));
            }
            Err(Dialed { error, .. }) => return Err(error),
        }
    }
}

impl TcpTransport {
    /// Joins a fabric: accepts a stream from every other peer on `listener`
    /// and opens one to every other peer's address in `peers`.
    pub fn connect(me: Endpoint, listener: TcpListener, peers: &[(Endpoint, SocketAddr)], config: &TcpConfig) -> io::Result<TcpTransport> {
        TcpTransport::connect_with(me, listener, peers, config, None)
    }

    /// As [`TcpTransport::connect`], with shared-memory links to the peers
    /// of `shm.same_node`.
    pub(crate) fn connect_with(
        me: Endpoint,
        listener: TcpListener,
        peers: &[(Endpoint, SocketAddr)],
        config: &TcpConfig,
        shm: Option<ShmSetup>,
    ) -> io::Result<TcpTransport> {
        let deadline = Instant::now() + config.connect_timeout;
        let others: Vec<(Endpoint, SocketAddr)> = peers.iter().copied().filter(|(e, _)| *e != me).collect();
        if let Some(s) = &shm {
            s.check()?;
        }
        let statuses: HashMap<Endpoint, Arc<PeerStatus>> = others.iter().map(|(e, _)| (*e, Arc::default())).collect();
        let streams: Arc<Mutex<Vec<Arc<TcpStream>>>> = Arc::default();
        let (tx, inbox) = channel();
        let checksum = config.checksum;
        let limits = Arc::new(config.max_frame_bytes_from.clone());
        let default_limit = config.max_frame_bytes;
        let shm = shm.map(Arc::new);
        let pool = Arc::new(FramePool { kept: Mutex::default(), limit: config.frame_pool_bytes });
        let started = Instant::now();
        // Accept in the background while this thread connects out.
        let acceptor = {
            let (statuses, shm, streams, pool) = (statuses.clone(), shm.clone(), Arc::clone(&streams), pool.clone());
            let expected: HashSet<Endpoint> = statuses.keys().copied().collect();
            let key = config.hello_key.clone();
            std::thread::spawn(move || -> io::Result<HashMap<Endpoint, Inbound>> {
                let x = Expect { me, deadline, expected: &expected, checksum, shm: shm.as_deref(), key: key.as_ref() };
                let mut inbound = HashMap::new();
                // Every incoming stream waits on the rank's watcher until a
                // frame comes that needs a reader thread of its own.
                let mut parked = Vec::new();
                let accepted = accept_all(&listener, &x, |peer, stream, shm_in| {
                    let ms = started.elapsed().as_millis() as u64;
                    tracing::debug!(%me, %peer, ms, shm = shm_in.is_some(), "data-plane stream from a peer accepted");
                    let handle = Arc::new(stream.try_clone()?);
                    streams.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::clone(&handle));
                    let status = statuses.get(&peer).cloned().unwrap_or_default();
                    inbound.insert(peer, Inbound { stream: handle, status: status.clone(), shm: shm_in.is_some() });
                    let max = limits.get(&peer).copied().unwrap_or(default_limit);
                    let reader = Reader { peer, max, checksum, shm: shm_in, status, pool: pool.clone(), tx: tx.clone() };
                    parked.push((stream, reader));
                    Ok(())
                })
                .and_then(|()| {
                    watch(me, parked).map_err(|e| io::Error::new(e.kind(), format!("{me}: no thread to watch its streams: {e}")))
                });
                if let Err(e) = &accepted {
                    // Said now: the listener closes with this thread, and
                    // peers still connecting are refused from here on.
                    tracing::warn!(%me, error = %e, "accepting data-plane connections failed");
                }
                accepted.map(|()| inbound)
            })
        };
        let mut links = HashMap::new();
        for (peer, addr) in others {
            let shared = shm.as_deref().filter(|s| s.shares(peer));
            let (dialed, made) = dial_until_deadline(me, peer, addr, shared, deadline, config)?;
            let DialedOk { stream, acks, .. } = dialed;
            streams.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::new(stream.try_clone()?));
            let out = match (made, acks) {
                (Some((region, _)), Some(acks)) => Some(
                    region.attach(acks).map_err(|e| io::Error::new(e.kind(), format!("{me}: the acknowledgement page of {peer}: {e}")))?,
                ),
                _ => None,
            };
            let status = statuses.get(&peer).cloned().unwrap_or_default();
            links.insert(peer, Link { w: BufWriter::with_capacity(config.write_buffer_bytes, stream), shm: out, status });
        }
        let inbound = acceptor.join().map_err(|_| io::Error::other("accept thread panicked"))??;
        tracing::debug!(%me, peers = links.len(), ms = started.elapsed().as_millis() as u64, "data plane connected");
        Ok(TcpTransport {
            me,
            links,
            inbound,
            streams,
            inbox: RoundInbox::new(inbox),
            checksum,
            hook: config.hook.clone(),
            frames: 0,
            inter: config.emulation.inter_node(),
            intra: config.emulation.intra_node(),
            wait_timeout: shm.as_ref().map_or(Duration::from_secs(600), |s| s.config.wait_timeout),
            stage: Vec::new(),
        })
    }
}
