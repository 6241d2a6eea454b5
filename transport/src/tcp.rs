//! The TCP transport: one stream per ordered pair of ranks, length-prefixed
//! frames, payload bytes written straight from the sender's buffers (each
//! contiguous run of a piece goes to the socket as it is; no serialisation
//! of payloads). A reader thread per incoming stream turns frames into
//! messages for [`Transport::recv`], in reusable frame buffers lent to the
//! executor ([`Payload::Lent`]; see [`TcpConfig::frame_pool_bytes`]).
//!
//! Frame: magic `RFIT` (u32 LE), kind (u8: 0 data, 1 abort, 2 bye: the
//! sender is done and closes cleanly, 3 lent and 4 chunk: a message in
//! shared memory, see [`crate::shm`]), round (u32 LE), payload length
//! (u64 LE), payload; with checksums on, a data frame ends with the
//! CRC-32C of its payload (u32 LE). A stream starts with a handshake: magic,
//! the sender's group (u8) and rank (u32 LE), protocol version (u8, 2),
//! flags (u8: 1 checksums, 2 shared memory; then the region's lend and
//! stream sizes, u64 LE each); the receiver answers one byte, 0 for
//! accepted or the reason it refuses (other version, other checksum
//! setting, disagreement on sharing a node, region not mappable, unexpected
//! peer), so mismatched configurations fail at connect time on both ends.
//!
//! Link emulation paces data frames through the rank's inter-node token
//! bucket (shared-memory links use the intra-node one) in pieces of
//! [`crate::link::PACE_CHUNK`]; fault hooks ([`TcpConfig::faults`]) act on
//! data frames, counted over all of a rank's links.

use crate::copy::{for_each_run, in_bounds};
use crate::link::{Faults, FrameFault, LinkEmulation, TokenBucket, PACE_CHUNK};
use crate::shm::{self, Placement, Region, ShmConfig, ShmIn, ShmOut};
use crate::transport::{Lent, Payload, Release, RoundInbox, Transport, TransportError};
use reshard::{Endpoint, Group};
use std::collections::{HashMap, HashSet};
use std::io::{self, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MAGIC: u32 = 0x5449_4652; // "RFIT" little-endian
const DATA: u8 = 0;
const ABORT: u8 = 1;
const BYE: u8 = 2;
const LENT: u8 = 3;
const CHUNK: u8 = 4;
const HEADER: usize = 4 + 1 + 4 + 8;
/// Handshake version: 2 added the flags byte, checksums and shared memory.
const VERSION: u8 = 2;
const FLAG_CHECKSUM: u8 = 1;
const FLAG_SHM: u8 = 2;
/// Payload of a `lent` or `chunk` frame: four u64 (LE).
const SHM_INFO: usize = 32;
/// Longest abort reason read.
const MAX_REASON: u64 = 1 << 16;

/// TCP transport settings.
#[derive(Clone, Copy, Debug)]
pub struct TcpConfig {
    /// Largest payload a reader accepts (a bigger length is a protocol error).
    pub max_frame_bytes: u64,
    /// Send buffer per stream.
    pub write_buffer_bytes: usize,
    /// Time to set up all streams.
    pub connect_timeout: Duration,
    /// A CRC-32C of every data frame's payload travels with it and is
    /// checked before the bytes are handed on (default off). Both ends must
    /// agree: the handshake refuses a peer with the other setting.
    pub checksum: bool,
    /// Egress rate caps (default off). A plain TCP transport treats every
    /// peer as on another node; see [`crate::node`] for mixed fabrics.
    pub emulation: LinkEmulation,
    /// Faults to inject, for tests (default none).
    pub faults: Faults,
    /// Received frame buffers (of 64 KiB or more) a rank keeps for reuse
    /// once unpacked, in bytes (default 512 MiB; 0: none). Reused buffers
    /// are already mapped, so a fabric kept from one refit to the next
    /// receives without page faults.
    pub frame_pool_bytes: u64,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            max_frame_bytes: 1 << 34,
            write_buffer_bytes: 4 << 20,
            connect_timeout: Duration::from_secs(30),
            checksum: false,
            emulation: LinkEmulation::default(),
            faults: Faults::default(),
            frame_pool_bytes: 512 << 20,
        }
    }
}

enum Incoming {
    Data { round: u32, from: Endpoint, payload: Payload },
    Abort { from: Endpoint, reason: String },
    Broken { from: Endpoint, problem: String },
    Corrupt { from: Endpoint, round: u32 },
}

/// What a rank's reader for a peer's stream last saw of that peer.
#[derive(Debug, Default)]
struct PeerStatus(AtomicU8);

const ALIVE: u8 = 0;
const GONE: u8 = 1;
const BROKEN: u8 = 2;
const ABORTED: u8 = 3;

impl PeerStatus {
    fn set(&self, s: u8) {
        self.0.store(s, Ordering::Release);
    }

    fn get(&self) -> u8 {
        self.0.load(Ordering::Acquire)
    }
}

/// Frame buffers a rank's readers reuse: a frame is handed to the executor
/// in place ([`Payload::Lent`]) and its buffer comes back here when the
/// payload is dropped.
struct FramePool {
    kept: Mutex<(Vec<Vec<u8>>, u64)>,
    limit: u64,
}

/// Frames smaller than this are plain allocations.
const POOL_MIN: usize = 64 << 10;

impl FramePool {
    /// A buffer of at least `len` initialized bytes.
    fn take(&self, len: usize) -> Result<Vec<u8>, String> {
        if len >= POOL_MIN && self.limit > 0 {
            let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
            // The smallest that fits, if not more than twice too large.
            let best = kept
                .0
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= len && b.len() / 2 <= len)
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i);
            if let Some(i) = best {
                let b = kept.0.swap_remove(i);
                kept.1 -= b.len() as u64;
                return Ok(b);
            }
        }
        zeroed(len).ok_or_else(|| format!("cannot allocate a frame of {len} bytes"))
    }

    /// The first `len` bytes of `buf` as a payload.
    fn payload(self: &Arc<Self>, mut buf: Vec<u8>, len: usize) -> Payload {
        if buf.len() < POOL_MIN || self.limit == 0 {
            buf.truncate(len);
            return Payload::Bytes(buf);
        }
        let ptr = buf.as_ptr();
        let pool = self.clone();
        let release = Release::on_drop(move || pool.give(buf));
        // SAFETY: `ptr` is the heap block of `buf` (moving a `Vec` does
        // not move its block), which the release owns and nobody writes
        // until the release runs; `len` <= its length.
        Payload::Lent(unsafe { Lent::new(ptr, len, release) })
    }

    fn give(&self, buf: Vec<u8>) {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        if kept.1 + buf.len() as u64 <= self.limit {
            kept.1 += buf.len() as u64;
            kept.0.push(buf);
        }
    }
}

/// `len` zero bytes, or `None` if they cannot be allocated. Zeroed
/// allocation (calloc) gets large blocks as fresh zero pages from the
/// system without writing them, where `resize` would write every byte
/// once before the socket read writes it again.
fn zeroed(len: usize) -> Option<Vec<u8>> {
    if len == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len).ok()?;
    // SAFETY: the layout has a non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return None;
    }
    // SAFETY: allocated by the global allocator with exactly this layout
    // (capacity `len`), and all `len` bytes are initialized (zero).
    Some(unsafe { Vec::from_raw_parts(p, len, len) })
}

/// The outgoing side of one peer.
struct Link {
    w: BufWriter<TcpStream>,
    shm: Option<ShmOut>,
    status: Arc<PeerStatus>,
}

/// Same-node peers and how to reach them through shared memory.
pub(crate) struct ShmSetup {
    pub(crate) session: String,
    pub(crate) same_node: HashSet<Endpoint>,
    pub(crate) config: ShmConfig,
}

/// One rank's end of a TCP fabric (and, built through
/// [`crate::node::NodeTransport`], of shared-memory links to same-node peers).
pub struct TcpTransport {
    me: Endpoint,
    links: HashMap<Endpoint, Link>,
    /// Every stream of this rank (both directions), for [`WithAbort`].
    streams: Arc<Mutex<Vec<TcpStream>>>,
    inbox: RoundInbox<Incoming>,
    checksum: bool,
    faults: Faults,
    frames: u64,
    inter: Option<TokenBucket>,
    intra: Option<TokenBucket>,
    wait_timeout: Duration,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shm = self.links.values().filter(|l| l.shm.is_some()).count();
        f.debug_struct("TcpTransport").field("me", &self.me).field("peers", &self.links.len()).field("shm_peers", &shm).finish()
    }
}

fn encode_endpoint(e: Endpoint) -> [u8; 5] {
    let mut b = [0u8; 5];
    b[0] = match e.group {
        Group::Src => 0,
        Group::Dst => 1,
    };
    b[1..].copy_from_slice(&e.rank.to_le_bytes());
    b
}

fn decode_endpoint(b: &[u8; 5]) -> io::Result<Endpoint> {
    let rank = u32::from_le_bytes([b[1], b[2], b[3], b[4]]);
    match b[0] {
        0 => Ok(Endpoint::src(rank)),
        1 => Ok(Endpoint::dst(rank)),
        g => Err(io::Error::new(io::ErrorKind::InvalidData, format!("unknown group {g} in handshake"))),
    }
}

fn header(kind: u8, round: u32, len: u64) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4] = kind;
    h[5..9].copy_from_slice(&round.to_le_bytes());
    h[9..].copy_from_slice(&len.to_le_bytes());
    h
}

fn shm_info(a: u64, b: u64, c: u64, d: u64) -> [u8; SHM_INFO] {
    let mut i = [0u8; SHM_INFO];
    for (k, v) in [a, b, c, d].into_iter().enumerate() {
        i[k * 8..k * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    i
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// How a reader treats one incoming stream.
struct Reader {
    peer: Endpoint,
    max: u64,
    checksum: bool,
    shm: Option<ShmIn>,
    status: Arc<PeerStatus>,
    pool: Arc<FramePool>,
    tx: Sender<Incoming>,
}

/// A message streamed through shared memory, partly arrived.
struct Partial {
    round: u32,
    total: u64,
    bytes: Vec<u8>,
    filled: usize,
}

/// Why a reader stopped.
enum Stop {
    /// A clean goodbye, or our transport is gone.
    Quiet,
    /// The stream is unusable.
    Broken(String),
    /// A frame failed its checksum.
    Corrupt(u32),
}

/// Reads frames from `peer` until the stream ends, forwarding them.
fn read_loop(mut stream: TcpStream, mut r: Reader) {
    let stop = read_frames(&mut stream, &mut r);
    let (peer, tx) = (r.peer, &r.tx);
    match stop {
        Stop::Quiet => {
            if r.status.get() == ALIVE {
                r.status.set(GONE);
            }
        }
        Stop::Broken(problem) => {
            r.status.set(BROKEN);
            let _ = tx.send(Incoming::Broken { from: peer, problem });
        }
        Stop::Corrupt(round) => {
            r.status.set(BROKEN);
            let _ = tx.send(Incoming::Corrupt { from: peer, round });
        }
    }
}

fn read_frames(stream: &mut TcpStream, r: &mut Reader) -> Stop {
    let mut partial: Option<Partial> = None;
    let mut crc = 0u32;
    loop {
        let mut h = [0u8; HEADER];
        if let Err(e) = stream.read_exact(&mut h) {
            return Stop::Broken(if e.kind() == io::ErrorKind::UnexpectedEof { "connection closed".into() } else { e.to_string() });
        }
        let magic = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
        let kind = h[4];
        let round = u32::from_le_bytes([h[5], h[6], h[7], h[8]]);
        let len = u64::from_le_bytes([h[9], h[10], h[11], h[12], h[13], h[14], h[15], h[16]]);
        if magic != MAGIC || kind > CHUNK {
            return Stop::Broken(format!("bad frame header {h:02x?}"));
        }
        if len > r.max {
            return Stop::Broken(format!("frame of {len} bytes exceeds the limit of {}", r.max));
        }
        if partial.is_some() && kind != CHUNK && kind != ABORT {
            return Stop::Broken("frame in the middle of a streamed message".into());
        }
        let msg = match kind {
            DATA => {
                let mut bytes = match r.pool.take(len as usize) {
                    Ok(b) => b,
                    Err(e) => return Stop::Broken(e),
                };
                if let Err(e) = stream.read_exact(&mut bytes[..len as usize]) {
                    return Stop::Broken(format!("truncated frame: {e}"));
                }
                if r.checksum {
                    let mut sum = [0u8; 4];
                    if let Err(e) = stream.read_exact(&mut sum) {
                        return Stop::Broken(format!("truncated frame: {e}"));
                    }
                    if crc32c::crc32c(&bytes[..len as usize]) != u32::from_le_bytes(sum) {
                        return Stop::Corrupt(round);
                    }
                }
                Incoming::Data { round, from: r.peer, payload: r.pool.payload(bytes, len as usize) }
            }
            ABORT => {
                if len > MAX_REASON {
                    return Stop::Broken(format!("abort reason of {len} bytes"));
                }
                let mut bytes = vec![0u8; len as usize];
                if let Err(e) = stream.read_exact(&mut bytes) {
                    return Stop::Broken(format!("truncated frame: {e}"));
                }
                r.status.set(ABORTED);
                Incoming::Abort { from: r.peer, reason: String::from_utf8_lossy(&bytes).into_owned() }
            }
            // A clean end: nothing more will come, and that is no error.
            BYE => return Stop::Quiet,
            _ => {
                let Some(shm) = r.shm.as_mut() else {
                    return Stop::Broken("shared-memory frame on a plain TCP stream".into());
                };
                let mut info = [0u8; SHM_INFO];
                if len != SHM_INFO as u64 {
                    return Stop::Broken(format!("shared-memory frame of {len} bytes"));
                }
                if let Err(e) = stream.read_exact(&mut info) {
                    return Stop::Broken(format!("truncated frame: {e}"));
                }
                let (a, offset, n, sum) = (u64_at(&info, 0), u64_at(&info, 8), u64_at(&info, 16), u64_at(&info, 24) as u32);
                if kind == LENT {
                    let (ptr, release) = match shm.lent(a, offset, n) {
                        Ok(x) => x,
                        Err(p) => return Stop::Broken(p),
                    };
                    // SAFETY: `ShmIn::lent` checked the range lies in the
                    // mapped lend area, which the sender leaves alone
                    // until `release` is dropped.
                    let lent = unsafe { Lent::new(ptr, n as usize, release) };
                    if r.checksum && crc32c::crc32c(lent.as_slice()) != sum {
                        return Stop::Corrupt(round);
                    }
                    Incoming::Data { round, from: r.peer, payload: Payload::Lent(lent) }
                } else {
                    // A chunk of a message of `a` bytes.
                    let p = match &mut partial {
                        Some(p) if p.round == round && p.total == a => p,
                        Some(_) => return Stop::Broken("chunk of another message in the middle of one".into()),
                        None => {
                            if a > r.max {
                                return Stop::Broken(format!("message of {a} bytes exceeds the limit of {}", r.max));
                            }
                            let bytes = match r.pool.take(a as usize) {
                                Ok(b) => b,
                                Err(e) => return Stop::Broken(e),
                            };
                            crc = 0;
                            partial.insert(Partial { round, total: a, bytes, filled: 0 })
                        }
                    };
                    if p.filled as u64 + n > p.total {
                        return Stop::Broken("chunks overrun their message".into());
                    }
                    let at = p.filled;
                    if let Err(e) = shm.chunk(offset, n, &mut p.bytes[at..at + n as usize]) {
                        return Stop::Broken(e);
                    }
                    p.filled += n as usize;
                    if r.checksum {
                        crc = crc32c::crc32c_append(crc, &p.bytes[at..p.filled]);
                    }
                    if (p.filled as u64) < p.total {
                        continue;
                    }
                    let Some(p) = partial.take() else { continue };
                    if r.checksum && crc != sum {
                        return Stop::Corrupt(round);
                    }
                    Incoming::Data { round, from: r.peer, payload: r.pool.payload(p.bytes, p.filled) }
                }
            }
        };
        if r.tx.send(msg).is_err() {
            return Stop::Quiet; // the transport is gone
        }
    }
}

/// Connects every endpoint to every other over loopback TCP (for running
/// all ranks of a plan as threads of one process over real sockets).
pub fn tcp_fabric(endpoints: &[Endpoint], config: &TcpConfig) -> io::Result<Vec<TcpTransport>> {
    fabric(endpoints, config, |_| Faults::default(), |_| None)
}

/// As [`tcp_fabric`], with the faults `faults_of(rank)` injected at each
/// rank instead of `config.faults` (for tests: one failing rank).
pub fn tcp_fabric_with_faults(
    endpoints: &[Endpoint],
    config: &TcpConfig,
    faults_of: impl Fn(Endpoint) -> Faults + Sync,
) -> io::Result<Vec<TcpTransport>> {
    fabric(endpoints, &TcpConfig { faults: Faults::default(), ..*config }, faults_of, |_| None)
}

/// Connects every endpoint to every other over loopback TCP, with the
/// shared-memory setup `shm(rank)` gives each; a rank's faults are
/// `config.faults` if any is set, else `faults_of(rank)`.
pub(crate) fn fabric(
    endpoints: &[Endpoint],
    config: &TcpConfig,
    faults_of: impl Fn(Endpoint) -> Faults + Sync,
    shm: impl Fn(Endpoint) -> Option<ShmSetup> + Sync,
) -> io::Result<Vec<TcpTransport>> {
    let listeners: Vec<TcpListener> = endpoints.iter().map(|_| TcpListener::bind("127.0.0.1:0")).collect::<io::Result<_>>()?;
    let addrs: Vec<(Endpoint, SocketAddr)> =
        endpoints.iter().zip(&listeners).map(|(e, l)| l.local_addr().map(|a| (*e, a))).collect::<io::Result<_>>()?;
    std::thread::scope(|s| {
        let (addrs, shm, faults_of) = (&addrs, &shm, &faults_of);
        let handles: Vec<_> = endpoints
            .iter()
            .zip(listeners)
            .map(|(&me, l)| {
                s.spawn(move || {
                    let faults = if config.faults == Faults::default() { faults_of(me) } else { config.faults };
                    TcpTransport::connect_with(me, l, addrs, &TcpConfig { faults, ..*config }, shm(me))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(io::Error::other("connect thread panicked")))).collect()
    })
}

/// Handshake answers.
const HELLO_OK: u8 = 0;
const HELLO_VERSION: u8 = 1;
const HELLO_CHECKSUM: u8 = 2;
const HELLO_SHM: u8 = 3;
const HELLO_REGION: u8 = 4;
const HELLO_PEER: u8 = 5;

fn hello_problem(code: u8) -> &'static str {
    match code {
        HELLO_VERSION => "speaks another protocol version",
        HELLO_CHECKSUM => "has the other checksum setting (TcpConfig::checksum must match on all ranks)",
        HELLO_SHM => "disagrees on whether we share a node (shared memory on one side only)",
        HELLO_REGION => "could not map our shared-memory region",
        HELLO_PEER => "is not (or no longer) expected",
        _ => "refused the handshake",
    }
}

/// Accepts one connection, waiting until `deadline` at most (a peer that
/// died before connecting must not block the rank forever).
fn accept_until(me: Endpoint, listener: &TcpListener, deadline: Instant) -> io::Result<TcpStream> {
    listener.set_nonblocking(true)?;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                return Ok(stream);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, format!("{me}: a peer did not connect in time")));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Accepts one stream and checks its handshake; returns the peer, the
/// stream and the peer's region (for shared-memory peers).
fn accept_one(
    me: Endpoint,
    listener: &TcpListener,
    deadline: Instant,
    expected: &HashSet<Endpoint>,
    checksum: bool,
    shm: Option<&ShmSetup>,
) -> io::Result<(Endpoint, TcpStream, Option<ShmIn>)> {
    let mut stream = accept_until(me, listener, deadline)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))?;
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let mut hello = [0u8; 11];
    stream.read_exact(&mut hello)?;
    if u32::from_le_bytes([hello[0], hello[1], hello[2], hello[3]]) != MAGIC {
        return Err(bad("bad handshake".into()));
    }
    let peer = decode_endpoint(&[hello[4], hello[5], hello[6], hello[7], hello[8]])?;
    let refuse = |mut stream: TcpStream, code: u8| {
        let _ = stream.write_all(&[code]);
        Err(bad(format!("{me}: refused the handshake of {peer}: it {}", hello_problem(code))))
    };
    let (version, flags) = (hello[9], hello[10]);
    if version != VERSION {
        return refuse(stream, HELLO_VERSION);
    }
    if !expected.contains(&peer) {
        return refuse(stream, HELLO_PEER);
    }
    if (flags & FLAG_CHECKSUM != 0) != checksum {
        return refuse(stream, HELLO_CHECKSUM);
    }
    let shared = shm.filter(|s| s.same_node.contains(&peer));
    if (flags & FLAG_SHM != 0) != shared.is_some() {
        return refuse(stream, HELLO_SHM);
    }
    let inbound = match shared {
        None => None,
        Some(s) => {
            let mut sizes = [0u8; 16];
            stream.read_exact(&mut sizes)?;
            let (lend, streamed) = (u64_at(&sizes, 0), u64_at(&sizes, 8));
            match Region::open(&shm::region_path(&s.config.dir, &s.session, peer, me), lend, streamed) {
                Ok(region) => Some(ShmIn::new(region, lend, streamed)),
                Err(e) => {
                    let _ = stream.write_all(&[HELLO_REGION]);
                    return Err(io::Error::new(e.kind(), format!("{me}: shared memory from {peer}: {e}")));
                }
            }
        }
    };
    stream.write_all(&[HELLO_OK])?;
    stream.set_read_timeout(None)?;
    Ok((peer, stream, inbound))
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
            if !shm::valid_session(&s.session) {
                return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("session id {:?}: use 1-128 of [A-Za-z0-9_-]", s.session)));
            }
        }
        let statuses: HashMap<Endpoint, Arc<PeerStatus>> = others.iter().map(|(e, _)| (*e, Arc::default())).collect();
        let streams: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (tx, inbox) = channel();
        let (max, checksum) = (config.max_frame_bytes, config.checksum);
        let shm = shm.map(Arc::new);
        let pool = Arc::new(FramePool { kept: Mutex::default(), limit: config.frame_pool_bytes });
        // Accept in the background while this thread connects out.
        let acceptor = {
            let (statuses, shm, streams, pool) = (statuses.clone(), shm.clone(), Arc::clone(&streams), pool.clone());
            let expected: HashSet<Endpoint> = statuses.keys().copied().collect();
            std::thread::spawn(move || -> io::Result<()> {
                for _ in 0..expected.len() {
                    let (peer, stream, inbound) = accept_one(me, &listener, deadline, &expected, checksum, shm.as_deref())?;
                    streams.lock().unwrap_or_else(|e| e.into_inner()).push(stream.try_clone()?);
                    let status = statuses.get(&peer).cloned().unwrap_or_default();
                    let reader = Reader { peer, max, checksum, shm: inbound, status, pool: pool.clone(), tx: tx.clone() };
                    std::thread::Builder::new().name(format!("refit-read-{peer}")).spawn(move || read_loop(stream, reader))?;
                }
                Ok(())
            })
        };
        let mut links = HashMap::new();
        for (peer, addr) in others {
            let mut stream = loop {
                match TcpStream::connect(addr) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() < deadline => {
                        let _ = e;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(io::Error::new(e.kind(), format!("{me}: cannot connect to {peer} at {addr}: {e}"))),
                }
            };
            stream.set_nodelay(true)?;
            streams.lock().unwrap_or_else(|e| e.into_inner()).push(stream.try_clone()?);
            let shared = shm.as_deref().filter(|s| s.same_node.contains(&peer));
            let mut out = match shared {
                None => None,
                Some(s) => {
                    let (lend, streamed) = (s.config.lend_bytes, s.config.stream_bytes.max(1));
                    let region = Region::create(&shm::region_path(&s.config.dir, &s.session, me, peer), lend, streamed)?;
                    Some(ShmOut::new(region, lend, streamed))
                }
            };
            let mut hello = Vec::with_capacity(27);
            hello.extend_from_slice(&MAGIC.to_le_bytes());
            hello.extend_from_slice(&encode_endpoint(me));
            hello.push(VERSION);
            hello.push(if checksum { FLAG_CHECKSUM } else { 0 } | if out.is_some() { FLAG_SHM } else { 0 });
            if let Some(s) = shared {
                hello.extend_from_slice(&s.config.lend_bytes.to_le_bytes());
                hello.extend_from_slice(&s.config.stream_bytes.max(1).to_le_bytes());
            }
            stream.write_all(&hello)?;
            stream.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))?;
            let mut answer = [0u8; 1];
            stream.read_exact(&mut answer).map_err(|e| io::Error::new(e.kind(), format!("{me}: no handshake answer from {peer}: {e}")))?;
            if answer[0] != HELLO_OK {
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{me}: {peer} {}", hello_problem(answer[0]))));
            }
            stream.set_read_timeout(None)?;
            // The receiver has it mapped: the name can go.
            if let Some(o) = &mut out {
                o.region.unlink();
            }
            let status = statuses.get(&peer).cloned().unwrap_or_default();
            links.insert(peer, Link { w: BufWriter::with_capacity(config.write_buffer_bytes, stream), shm: out, status });
        }
        acceptor.join().map_err(|_| io::Error::other("accept thread panicked"))??;
        Ok(TcpTransport {
            me,
            links,
            streams,
            inbox: RoundInbox::new(inbox),
            checksum,
            faults: config.faults,
            frames: 0,
            inter: config.emulation.inter_node(),
            intra: config.emulation.intra_node(),
            wait_timeout: shm.as_ref().map_or(Duration::from_secs(600), |s| s.config.wait_timeout),
        })
    }

    /// A switch that tears this rank's data plane down from any thread:
    /// every stream (both directions) is shut down, so a send or receive
    /// blocked on it fails at once and the peers see the links break.
    pub fn kill_switch(&self) -> impl Fn() + Send + Sync + 'static {
        let streams = Arc::clone(&self.streams);
        move || {
            for s in streams.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    /// The peers reached through shared memory.
    pub fn shm_peers(&self) -> Vec<Endpoint> {
        let mut v: Vec<Endpoint> = self.links.iter().filter(|(_, l)| l.shm.is_some()).map(|(e, _)| *e).collect();
        v.sort();
        v
    }
}

/// Calls `f` with every contiguous byte run of a payload, in wire order.
///
/// # Safety
/// The memory the payload's segments point into must stay valid and
/// unwritten while the payload lives (the executor's contract).
unsafe fn for_payload_runs<'a>(payload: &'a Payload, mut f: impl FnMut(&'a [u8])) -> io::Result<()> {
    match payload {
        Payload::Bytes(b) => f(b),
        Payload::Lent(l) => f(l.as_slice()),
        Payload::Segments { segments, .. } => {
            for s in segments {
                if !in_bounds(s.extent(), s.view()) {
                    return Err(io::Error::new(io::ErrorKind::InvalidInput, "segment out of bounds"));
                }
            }
            for s in segments {
                // SAFETY: in bounds (checked); valid while the payload
                // lives (the caller's contract), so the runs may borrow it.
                unsafe { for_each_run(s.extent(), s.view(), |run| f(std::slice::from_raw_parts(run.as_ptr(), run.len()))) };
            }
        }
    }
    Ok(())
}

/// Bytes a payload puts on the wire.
fn payload_len(payload: &Payload) -> u64 {
    match payload {
        Payload::Bytes(b) => b.len() as u64,
        Payload::Lent(l) => l.as_slice().len() as u64,
        Payload::Segments { segments, .. } => segments.iter().map(|s| s.numel() * s.view().dtype.size()).sum(),
    }
}

/// Writes one data frame on a TCP stream: header, runs gathered by writev
/// straight from the sender's memory, checksum trailer.
fn write_tcp(
    w: &mut BufWriter<TcpStream>,
    round: u32,
    payload: &Payload,
    checksum: bool,
    corrupt: bool,
    mut bucket: Option<&mut TokenBucket>,
) -> io::Result<()> {
    let len = payload_len(payload);
    if corrupt {
        // Fault injection: gather, sum, then flip a byte (or the sum).
        let mut bytes = Vec::with_capacity(len as usize);
        // SAFETY: the executor's contract (see `Transport::send`).
        unsafe { for_payload_runs(payload, |r| bytes.extend_from_slice(r))? };
        let mut sum = crc32c::crc32c(&bytes);
        match bytes.get_mut(len as usize / 2) {
            Some(b) => *b ^= 0x40,
            None => sum ^= 1,
        }
        w.write_all(&header(DATA, round, len))?;
        w.write_all(&bytes)?;
        if checksum {
            w.write_all(&sum.to_le_bytes())?;
        }
        return w.flush();
    }
    w.write_all(&header(DATA, round, len))?;
    w.flush()?;
    let stream = w.get_mut();
    let piece = if bucket.is_some() { PACE_CHUNK as usize } else { usize::MAX };
    let mut batch: Vec<io::IoSlice<'_>> = Vec::with_capacity(IOV_BATCH);
    let mut batch_bytes = 0usize;
    let mut sum = 0u32;
    let mut result = Ok(());
    // Runs go to the socket as they lie in memory, gathered by writev (no
    // copy into a user-space buffer).
    // SAFETY: the executor's contract: the sender's memory is not written
    // while it sends, and the slices do not outlive this call.
    unsafe {
        for_payload_runs(payload, |run| {
            for part in run.chunks(piece) {
                if result.is_err() {
                    return;
                }
                if checksum {
                    sum = crc32c::crc32c_append(sum, part);
                }
                batch.push(io::IoSlice::new(part));
                batch_bytes += part.len();
                if batch.len() == IOV_BATCH || batch_bytes >= piece {
                    if let Some(b) = bucket.as_deref_mut() {
                        b.pace(batch_bytes as u64);
                    }
                    result = write_all_vectored(stream, &mut batch);
                    batch.clear();
                    batch_bytes = 0;
                }
            }
        })?
    };
    result?;
    if let Some(b) = bucket {
        b.pace(batch_bytes as u64);
    }
    write_all_vectored(stream, &mut batch)?;
    if checksum {
        stream.write_all(&sum.to_le_bytes())?;
    }
    Ok(())
}

/// Slices per `writev` call (below every system's IOV_MAX).
const IOV_BATCH: usize = 512;

/// Writes every slice, however many calls it takes.
fn write_all_vectored(stream: &mut TcpStream, bufs: &mut [io::IoSlice<'_>]) -> io::Result<()> {
    let mut bufs = bufs;
    io::IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match stream.write_vectored(bufs) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "connection closed while sending")),
            Ok(n) => io::IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes a `lent` or `chunk` frame and pushes it out.
fn write_shm_frame(w: &mut BufWriter<TcpStream>, kind: u8, round: u32, info: [u8; SHM_INFO]) -> io::Result<()> {
    w.write_all(&header(kind, round, SHM_INFO as u64))?;
    w.write_all(&info)?;
    w.flush()
}

/// Copies `src` to `dst`, pacing every [`PACE_CHUNK`] bytes.
///
/// # Safety
/// `dst` valid for writes of `src.len()` bytes, not overlapping `src`.
unsafe fn copy_paced(src: &[u8], dst: *mut u8, bucket: &mut Option<&mut TokenBucket>) {
    match bucket {
        None => {
            // SAFETY: by the caller's contract.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
        }
        Some(b) => {
            for (i, part) in src.chunks(PACE_CHUNK as usize).enumerate() {
                b.pace(part.len() as u64);
                // SAFETY: by the caller's contract.
                unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), dst.add(i * PACE_CHUNK as usize), part.len()) }
            }
        }
    }
}

/// Streams one message through a stream area, chunk by chunk.
struct StreamSink<'a> {
    out: &'a mut ShmOut,
    w: &'a mut BufWriter<TcpStream>,
    status: &'a PeerStatus,
    bucket: Option<&'a mut TokenBucket>,
    me: Endpoint,
    to: Endpoint,
    round: u32,
    total: u64,
    checksum: bool,
    corrupt: bool,
    sum: u32,
    /// Bytes announced so far.
    sent: u64,
    /// The chunk being filled: region offset, capacity, bytes in it.
    chunk: (u64, u64, u64),
    deadline: Instant,
    err: Option<TransportError>,
}

impl StreamSink<'_> {
    fn put(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() && self.err.is_none() {
            if self.chunk.2 == self.chunk.1 {
                if let Err(e) = self.next_chunk() {
                    self.err = Some(e);
                    return;
                }
            }
            let (off, cap, fill) = self.chunk;
            let n = (bytes.len() as u64).min(cap - fill) as usize;
            // SAFETY: inside the chunk the sender owns in the stream area.
            unsafe { copy_paced(&bytes[..n], self.out.at(off + fill), &mut self.bucket) };
            self.chunk.2 += n as u64;
            bytes = &bytes[n..];
            if self.chunk.2 == cap {
                if let Err(e) = self.emit() {
                    self.err = Some(e);
                }
            }
        }
    }

    /// Waits for stream space for the next chunk.
    fn next_chunk(&mut self) -> Result<(), TransportError> {
        let want = (self.out.stream_bytes() / 4).clamp(1, 4 << 20).min(self.total - self.sent);
        let mut tries = 0u32;
        loop {
            let (off, n) = self.out.stream_space(want);
            if n > 0 || want == 0 {
                self.chunk = (off, n, 0);
                return Ok(());
            }
            match self.status.get() {
                ALIVE => {}
                BROKEN => return Err(TransportError::Broken { peer: self.to, problem: "peer went away while we streamed to it".into() }),
                _ => return Err(TransportError::Disconnected { peer: self.to }),
            }
            if Instant::now() >= self.deadline {
                return Err(TransportError::Timeout { me: self.me, round: self.round });
            }
            tries += 1;
            if tries < 64 {
                std::hint::spin_loop();
            } else if tries < 128 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros((20u64 << ((tries - 128) / 16).min(6)).min(1000)));
            }
        }
    }

    /// Announces the chunk filled so far.
    fn emit(&mut self) -> Result<(), TransportError> {
        let (off, _, fill) = self.chunk;
        let last = self.sent + fill == self.total;
        // SAFETY: the chunk lies in the stream area and holds `fill`
        // bytes written by this sender.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.out.at(off), fill as usize) };
        if self.checksum {
            self.sum = crc32c::crc32c_append(self.sum, bytes);
        }
        if self.corrupt && last {
            match bytes.last_mut() {
                Some(b) => *b ^= 0x40,
                None => self.sum ^= 1,
            }
        }
        shm::publish();
        self.out.streamed(fill);
        self.sent += fill;
        self.chunk = (0, 0, 0);
        write_shm_frame(self.w, CHUNK, self.round, shm_info(self.total, off, fill, if last { self.sum as u64 } else { 0 }))
            .map_err(|_| TransportError::Disconnected { peer: self.to })
    }
}

impl TcpTransport {
    /// Sends a message through the shared-memory link to `to`.
    fn send_shm(&mut self, round: u32, to: Endpoint, payload: &Payload, corrupt: bool) -> Result<(), TransportError> {
        let (me, checksum, wait) = (self.me, self.checksum, self.wait_timeout);
        let Some(link) = self.links.get_mut(&to) else { return Err(TransportError::Disconnected { peer: to }) };
        let Link { w, shm: Some(out), status } = link else { return Err(TransportError::Disconnected { peer: to }) };
        let mut bucket = self.intra.as_mut();
        let disconnected = |_| TransportError::Disconnected { peer: to };
        let len = payload_len(payload);
        out.ready().map_err(|e| TransportError::Broken { peer: to, problem: e.to_string() })?;
        match out.place(len) {
            Placement::Lent { seq, offset } => {
                let dst = out.at(offset);
                let mut pos = 0usize;
                // SAFETY: the placement reserved `len` bytes at `dst` for
                // this sender; the executor's contract for the payload.
                unsafe {
                    for_payload_runs(payload, |run| {
                        if pos + run.len() <= len as usize {
                            copy_paced(run, dst.add(pos), &mut bucket);
                        }
                        pos += run.len();
                    })
                }
                .map_err(|e| TransportError::Broken { peer: to, problem: e.to_string() })?;
                // SAFETY: as above; `len` bytes, now written.
                let bytes = unsafe { std::slice::from_raw_parts_mut(dst, len as usize) };
                let sum = if checksum { crc32c::crc32c(bytes) } else { 0 };
                if corrupt {
                    if let Some(b) = bytes.get_mut(len as usize / 2) {
                        *b ^= 0x40;
                    }
                }
                shm::publish();
                write_shm_frame(w, LENT, round, shm_info(seq, offset, len, sum as u64)).map_err(disconnected)
            }
            Placement::Stream => {
                let mut sink = StreamSink {
                    out,
                    w,
                    status,
                    bucket,
                    me,
                    to,
                    round,
                    total: len,
                    checksum,
                    corrupt,
                    sum: 0,
                    sent: 0,
                    chunk: (0, 0, 0),
                    deadline: Instant::now() + wait,
                    err: None,
                };
                // SAFETY: the executor's contract for the payload.
                unsafe { for_payload_runs(payload, |run| sink.put(run)) }
                    .map_err(|e| TransportError::Broken { peer: to, problem: e.to_string() })?;
                if let Some(e) = sink.err.take() {
                    return Err(e);
                }
                if len == 0 {
                    sink.next_chunk()?;
                    sink.emit()?;
                }
                Ok(())
            }
        }
    }
}

impl Drop for TcpTransport {
    /// Says goodbye on every stream, so peers can tell a finished rank from
    /// a crashed one (whose streams just end).
    fn drop(&mut self) {
        for l in self.links.values_mut() {
            let _ = l.w.write_all(&header(BYE, 0, 0)).and_then(|_| l.w.flush());
        }
    }
}

impl Transport for TcpTransport {
    fn me(&self) -> Endpoint {
        self.me
    }

    fn send(&mut self, round: u32, to: Endpoint, payload: Payload) -> Result<(), TransportError> {
        let fault = if self.faults.any() { self.faults.frame(self.frames) } else { FrameFault::None };
        self.frames += 1;
        let Some(link) = self.links.get_mut(&to) else { return Err(TransportError::Disconnected { peer: to }) };
        match fault {
            FrameFault::Stall => return Ok(()),
            FrameFault::Cut => {
                let _ = link.w.get_ref().shutdown(Shutdown::Both);
                return Err(TransportError::Disconnected { peer: to });
            }
            _ => {}
        }
        let corrupt = fault == FrameFault::Corrupt;
        // Once written (to the socket or the region), the bytes are out of
        // the sender's memory: the payload (and its release token) can go.
        if link.shm.is_some() {
            self.send_shm(round, to, &payload, corrupt)
        } else {
            write_tcp(&mut link.w, round, &payload, self.checksum, corrupt, self.inter.as_mut())
                .map_err(|_| TransportError::Disconnected { peer: to })
        }
    }

    fn recv(&mut self, round: u32, deadline: Instant) -> Result<(Endpoint, Payload), TransportError> {
        self.inbox.recv(self.me, round, deadline, |e| match e {
            Incoming::Data { round, from, payload } => Ok((round, from, payload)),
            Incoming::Abort { from, reason } => Err(TransportError::PeerAborted { peer: from, reason }),
            Incoming::Broken { from, problem } => Err(TransportError::Broken { peer: from, problem }),
            Incoming::Corrupt { from, round } => Err(TransportError::Corrupt { peer: from, round }),
        })
    }

    fn flush(&mut self, _round: u32, _deadline: Instant) -> Result<(), TransportError> {
        // `send` returns only after the bytes left the sender's memory.
        Ok(())
    }

    fn abort(&mut self, reason: &str) {
        if let Some(d) = self.faults.abort_hang {
            std::thread::sleep(d);
        }
        let reason = &reason.as_bytes()[..reason.len().min(MAX_REASON as usize)];
        for l in self.links.values_mut() {
            let _ = l.w.write_all(&header(ABORT, 0, reason.len() as u64)).and_then(|_| l.w.write_all(reason)).and_then(|_| l.w.flush());
        }
    }
}
