//! The TCP transport: one stream per ordered pair of ranks, length-prefixed
//! frames ([`crate::frame`]), payload bytes written straight from the
//! sender's buffers (each contiguous run of a piece goes to the socket as
//! it is; no serialisation of payloads). A reader thread per incoming
//! stream turns frames into messages for [`Transport::recv`], in reusable
//! frame buffers lent to the executor ([`Payload::Lent`]; see
//! [`TcpConfig::frame_pool_bytes`]). A pair of ranks on one node moves the
//! bytes through shared memory instead and uses its stream for
//! notifications only ([`crate::shm_link`]).
//!
//! Link emulation paces data frames through the rank's inter-node token
//! bucket (shared-memory links use the intra-node one) in pieces of
//! [`crate::link::PACE_CHUNK`]; a frame hook ([`TcpConfig::hook`], e.g.
//! fault injection for tests) is asked about every data frame, counted
//! over all of a rank's links.

use crate::copy::{copy_strided_unfenced, for_each_run, packed_strides, StridedRef};
use crate::faults::Faults;
use crate::frame::{
    decode_header, decode_hello, for_payload_items, for_payload_runs, header, hello, hello_problem, payload_len, proof_holds, HelloKey,
    Item, ShmAnnounce, ABORT, BYE, CHUNK, DATA, FLAG_CHECKSUM, FLAG_PROOF, FLAG_SHM, HEADER, HELLO, HELLO_CHECKSUM, HELLO_DUPLICATE,
    HELLO_OK, HELLO_PEER, HELLO_PROOF, HELLO_REGION, HELLO_SHM, HELLO_VERSION, MAX_REASON, PROOF, SHM_ANNOUNCE, SHM_INFO, SHORT_RUN,
    VERSION,
};
use crate::link::{FrameAction, FrameHook, LinkEmulation, TokenBucket, PACE_CHUNK};
use crate::shm::ShmOut;
use crate::shm_link::{self, ShmMessage, ShmReceiver, ShmSetup};
pub use crate::sockopt::Congestion;
use crate::sockopt::{choose_congestion, tcp_state};
use crate::transport::{Lent, Payload, Release, RoundInbox, Transport, TransportError};
use reshard::units::human;
use reshard::Endpoint;
use std::collections::{HashMap, HashSet};
use std::io::{self, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// TCP transport settings.
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Largest payload a reader accepts from a peer not in
    /// [`max_frame_bytes_from`](Self::max_frame_bytes_from) (a bigger
    /// length is a protocol error).
    pub max_frame_bytes: u64,
    /// Largest payload a reader accepts from each listed peer (default
    /// none): what the rank's program expects from that peer, so one peer
    /// cannot make the rank hold what another may send.
    pub max_frame_bytes_from: HashMap<Endpoint, u64>,
    /// Send buffer per stream.
    pub write_buffer_bytes: usize,
    /// Time to set up all streams.
    pub connect_timeout: Duration,
    /// Every peer's listener was open before this rank started to connect
    /// (an orchestrator opens all endpoints in one step, then connects
    /// them in the next), so a refused connection means the peer is gone:
    /// fail at once instead of retrying until `connect_timeout` (default
    /// off: peers may still be starting).
    pub peers_listening: bool,
    /// A CRC-32C of every data frame's payload travels with it and is
    /// checked before the bytes are handed on (default off). Both ends must
    /// agree: the handshake refuses a peer with the other setting.
    pub checksum: bool,
    /// Egress rate caps (default off). A plain TCP transport treats every
    /// peer as on another node; see [`crate::node`] for mixed fabrics.
    pub emulation: LinkEmulation,
    /// Asked about every data frame a rank sends and told when it aborts,
    /// for tests and tooling: e.g. [`Faults::hook`] injects faults (default
    /// none, which costs nothing per frame).
    pub hook: Option<Arc<dyn FrameHook>>,
    /// Received frame buffers (of 64 KiB or more) a rank keeps for reuse
    /// once unpacked, in bytes (default 512 MiB; 0: none). Reused buffers
    /// are already mapped, so a fabric kept from one refit to the next
    /// receives without page faults.
    pub frame_pool_bytes: u64,
    /// The key every handshake proves knowledge of ([`HelloKey`]: derived
    /// from the job's secret for this session). With it, a connection
    /// without the proof is refused, logged and dropped while accepting
    /// goes on; without it (default), any connection that names an
    /// expected peer is taken for it.
    pub hello_key: Option<HelloKey>,
    /// The TCP congestion control of the streams this rank sends on
    /// (default [`Congestion::AvoidBbr`]: the system's, unless that is
    /// BBR, whose policer mode makes a refit's last stream crawl; the
    /// environment variable `REFIT_TCP_CONGESTION` changes the default).
    pub congestion: Congestion,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            max_frame_bytes: 1 << 34,
            max_frame_bytes_from: HashMap::new(),
            write_buffer_bytes: 4 << 20,
            connect_timeout: Duration::from_secs(30),
            peers_listening: false,
            checksum: false,
            emulation: LinkEmulation::default(),
            hook: None,
            frame_pool_bytes: 512 << 20,
            hello_key: None,
            congestion: Congestion::from_env(),
        }
    }
}

enum Incoming {
    Data { round: u32, from: Endpoint, payload: Payload },
    Abort { from: Endpoint, reason: String },
    Broken { from: Endpoint, problem: String },
    Corrupt { from: Endpoint, round: u32 },
}

/// What a rank's reader for a peer's stream last saw of that peer, and
/// how many messages it took from it.
#[derive(Debug, Default)]
pub(crate) struct PeerStatus(AtomicU8, AtomicU64);

/// The peer is there.
pub(crate) const ALIVE: u8 = 0;
/// The peer said goodbye.
const GONE: u8 = 1;
/// The peer's stream broke.
pub(crate) const BROKEN: u8 = 2;
/// The peer aborted.
const ABORTED: u8 = 3;

impl PeerStatus {
    fn set(&self, s: u8) {
        self.0.store(s, Ordering::Release);
    }

    pub(crate) fn get(&self) -> u8 {
        self.0.load(Ordering::Acquire)
    }

    /// One more message from the peer handed on.
    fn took(&self) {
        self.1.fetch_add(1, Ordering::Relaxed);
    }

    /// Messages from the peer handed on so far.
    fn messages(&self) -> u64 {
        self.1.load(Ordering::Relaxed)
    }
}

/// Frame buffers a rank's readers reuse: a frame is handed to the executor
/// in place ([`Payload::Lent`]) and its buffer comes back here when the
/// payload is dropped.
pub(crate) struct FramePool {
    kept: Mutex<(Vec<Vec<u8>>, u64)>,
    limit: u64,
}

/// Frames smaller than this are plain allocations.
const POOL_MIN: usize = 64 << 10;

impl FramePool {
    /// A buffer of at least `len` initialized bytes.
    pub(crate) fn take(&self, len: usize) -> Result<Vec<u8>, String> {
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
    pub(crate) fn payload(self: &Arc<Self>, mut buf: Vec<u8>, len: usize) -> Payload {
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

/// A data frame left on its stream for the receiving executor to read
/// straight into its destination spans ([`Payload::Stream`]): no frame
/// buffer, no second copy. The stream's reader thread waits until the
/// frame is dropped, then skips whatever was not read, so frames after it
/// on that stream (later rounds: a sender's frames travel in round order)
/// wait too, held back by TCP's own flow control. Frames with checksums
/// are never left on the stream: they are checked before any byte of
/// them reaches a destination.
pub struct StreamFrame {
    stream: Arc<TcpStream>,
    len: u64,
    read: u64,
    done: Option<std::sync::mpsc::SyncSender<u64>>,
}

impl std::fmt::Debug for StreamFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamFrame").field("len", &self.len).field("read", &self.read).finish()
    }
}

impl StreamFrame {
    /// Bytes of the frame's payload.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes not read yet.
    pub fn left(&self) -> u64 {
        self.len - self.read
    }

    /// Fills `buf` with the next bytes of the payload.
    pub fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        if buf.len() as u64 > self.left() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "read past the end of the frame"));
        }
        (&*self.stream).read_exact(buf)?;
        self.read += buf.len() as u64;
        Ok(())
    }

    /// Reads the next bytes of the payload into the `(pointer, length)`
    /// runs of `runs`, in order (gathered by `readv`).
    ///
    /// # Safety
    /// Every run must be valid for writes of its length, and nothing else
    /// may access those bytes during the call.
    pub(crate) unsafe fn read_runs(&mut self, runs: &mut [libc::iovec]) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let total: u64 = runs.iter().map(|v| v.iov_len as u64).sum();
        if total > self.left() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "read past the end of the frame"));
        }
        let fd = self.stream.as_raw_fd();
        let mut first = 0;
        while first < runs.len() {
            let n = runs.len() - first;
            // SAFETY: the iovecs name memory valid for writes (the caller's
            // contract); `fd` is this frame's open stream.
            let got = unsafe { libc::readv(fd, runs[first..].as_ptr(), n.min(IOV_BATCH) as libc::c_int) };
            if got < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if got == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed in a frame"));
            }
            let mut got = got as usize;
            self.read += got as u64;
            while got > 0 && first < runs.len() {
                let v = &mut runs[first];
                if got >= v.iov_len {
                    got -= v.iov_len;
                    first += 1;
                } else {
                    // SAFETY: still inside the run.
                    v.iov_base = unsafe { (v.iov_base as *mut u8).add(got) } as *mut libc::c_void;
                    v.iov_len -= got;
                    got = 0;
                }
            }
            while first < runs.len() && runs[first].iov_len == 0 {
                first += 1;
            }
        }
        Ok(())
    }
}

impl Drop for StreamFrame {
    /// Hands the stream back to its reader, which skips what was not read.
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            let _ = done.send(self.read);
        }
    }
}

/// The outgoing side of one peer.
struct Link {
    w: BufWriter<TcpStream>,
    shm: Option<ShmOut>,
    status: Arc<PeerStatus>,
}

/// The incoming side of one peer, as far as errors describe it.
struct Inbound {
    /// A handle on the peer's stream (its reader thread owns another).
    stream: Arc<TcpStream>,
    status: Arc<PeerStatus>,
    /// Messages come through shared memory, the stream carries notices.
    shm: bool,
}

/// One rank's end of a TCP fabric (and, built through
/// [`crate::node::NodeTransport`], of shared-memory links to same-node peers).
pub struct TcpTransport {
    me: Endpoint,
    links: HashMap<Endpoint, Link>,
    /// The incoming side of each peer (for [`Transport::link_from`]).
    inbound: HashMap<Endpoint, Inbound>,
    /// Every stream of this rank (both directions), for [`WithAbort`](crate::WithAbort).
    streams: Arc<Mutex<Vec<Arc<TcpStream>>>>,
    inbox: RoundInbox<Incoming>,
    checksum: bool,
    hook: Option<Arc<dyn FrameHook>>,
    /// Data frames sent so far (counted only with a hook).
    frames: u64,
    inter: Option<TokenBucket>,
    intra: Option<TokenBucket>,
    wait_timeout: Duration,
    /// Where short runs of outgoing frames are gathered (see [`Gather`]).
    stage: Vec<u8>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shm = self.links.values().filter(|l| l.shm.is_some()).count();
        f.debug_struct("TcpTransport").field("me", &self.me).field("peers", &self.links.len()).field("shm_peers", &shm).finish()
    }
}

/// How a reader treats one incoming stream.
struct Reader {
    peer: Endpoint,
    max: u64,
    checksum: bool,
    shm: Option<ShmReceiver>,
    status: Arc<PeerStatus>,
    pool: Arc<FramePool>,
    tx: Sender<Incoming>,
}

/// Why a reader stopped.
pub(crate) enum Stop {
    /// A clean goodbye, or our transport is gone.
    Quiet,
    /// The stream is unusable.
    Broken(String),
    /// A frame failed its checksum.
    Corrupt(u32),
}

/// Reads frames from `peer` until the stream ends, forwarding them.
fn read_loop(stream: TcpStream, mut r: Reader) {
    let stop = read_frames(&Arc::new(stream), &mut r);
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

fn read_frames(shared: &Arc<TcpStream>, r: &mut Reader) -> Stop {
    let mut stream: &TcpStream = shared;
    loop {
        let mut h = [0u8; HEADER];
        if let Err(e) = stream.read_exact(&mut h) {
            return Stop::Broken(if e.kind() == io::ErrorKind::UnexpectedEof { "connection closed".into() } else { e.to_string() });
        }
        let Some(crate::frame::Header { kind, round, len }) = decode_header(&h) else {
            return Stop::Broken(format!("bad frame header {h:02x?}"));
        };
        if len > r.max {
            return Stop::Broken(format!("frame of {len} bytes exceeds the limit of {}", r.max));
        }
        if r.shm.as_ref().is_some_and(|s| s.mid_message()) && kind != CHUNK && kind != ABORT {
            return Stop::Broken("frame in the middle of a streamed message".into());
        }
        let msg = match kind {
            // Left on the stream for the executor to read into place.
            DATA if !r.checksum && len > 0 => {
                let (done, consumed) = std::sync::mpsc::sync_channel(1);
                let frame = StreamFrame { stream: Arc::clone(shared), len, read: 0, done: Some(done) };
                r.status.took();
                if r.tx.send(Incoming::Data { round, from: r.peer, payload: Payload::Stream(frame) }).is_err() {
                    return Stop::Quiet; // the transport is gone
                }
                // The frame comes back when dropped (a dropped transport
                // drops it too).
                let read = consumed.recv().unwrap_or(0);
                if let Err(e) = skip(stream, len.saturating_sub(read)) {
                    return Stop::Broken(format!("truncated frame: {e}"));
                }
                continue;
            }
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
            // `lent` or `chunk`: a message in shared memory.
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
                match shm.frame(kind, round, &info, r.checksum, r.max, &r.pool) {
                    Ok(Some(payload)) => Incoming::Data { round, from: r.peer, payload },
                    Ok(None) => continue,
                    Err(stop) => return stop,
                }
            }
        };
        if matches!(msg, Incoming::Data { .. }) {
            r.status.took();
        }
        if r.tx.send(msg).is_err() {
            return Stop::Quiet; // the transport is gone
        }
    }
}

/// Reads and drops `n` bytes of `stream`.
fn skip(mut stream: &TcpStream, mut n: u64) -> io::Result<()> {
    let mut scratch = [0u8; 8192];
    while n > 0 {
        let k = n.min(scratch.len() as u64) as usize;
        stream.read_exact(&mut scratch[..k])?;
        n -= k as u64;
    }
    Ok(())
}

/// Connects every endpoint to every other over loopback TCP (for running
/// all ranks of a plan as threads of one process over real sockets).
pub fn tcp_fabric(endpoints: &[Endpoint], config: &TcpConfig) -> io::Result<Vec<TcpTransport>> {
    fabric(endpoints, config, |_| None, |_| None, &|_, _| true)
}

/// As [`tcp_fabric`] for the ranks of `programs`, each connected only to
/// the ranks its program exchanges messages with (as the orchestrator's
/// node fabric connects them): a pair that never talks holds no streams and
/// no reader threads (all to all, 192 ranks would need 36,672 streams, more
/// descriptors than a process gets).
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

/// As [`tcp_fabric`], with the faults `faults_of(rank)` injected at each
/// rank instead of `config.hook` (for tests: one failing rank).
pub fn tcp_fabric_with_faults(
    endpoints: &[Endpoint],
    config: &TcpConfig,
    faults_of: impl Fn(Endpoint) -> Faults + Sync,
) -> io::Result<Vec<TcpTransport>> {
    fabric(endpoints, &TcpConfig { hook: None, ..config.clone() }, |e| faults_of(e).hook(), |_| None, &|_, _| true)
}

/// Connects every endpoint to every other it `talks` to (a symmetric
/// relation) over loopback TCP, with the shared-memory setup `shm(rank)`
/// gives each; a rank's frame hook is `config.hook` if set, else
/// `hook_of(rank)`.
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

/// Incoming connections whose handshake is under way, beyond the peers a
/// rank expects, that it holds at once: a newer one drops one of them (a
/// silent one first, the oldest first). Holding one costs a descriptor and
/// a few bytes, no thread.
const MAX_GREETINGS: usize = 64;

/// The longest a rank waits in one `poll` for connections and handshake
/// bytes before it looks at its deadline again.
const POLL_SLICE: Duration = Duration::from_millis(200);

/// What is checked of every incoming handshake.
struct Expect<'a> {
    me: Endpoint,
    deadline: Instant,
    expected: &'a HashSet<Endpoint>,
    checksum: bool,
    shm: Option<&'a ShmSetup>,
    key: Option<&'a HelloKey>,
}

/// Why an incoming connection was not taken: `fatal` when it proved
/// knowledge of the job's secret yet disagrees with this rank (another
/// configuration or plan: the connect fails), else it is only dropped.
/// `answer` is the refusal code the connection is told, if any.
struct Refused {
    why: String,
    fatal: bool,
    answer: Option<u8>,
}

impl Refused {
    fn dropped(why: String) -> Refused {
        Refused { why, fatal: false, answer: None }
    }
}

/// An incoming connection whose handshake is being read, without blocking
/// and without a thread of its own: the accepting thread reads whatever
/// has arrived whenever `poll` says there is more.
struct Greeting {
    stream: TcpStream,
    from: SocketAddr,
    /// The handshake's bytes so far (never more than the handshake: frames
    /// follow only once it is answered).
    got: Vec<u8>,
}

impl Greeting {
    /// How long the handshake is in all, as far as its bytes so far tell:
    /// the fixed part, then the shared-memory sizes and the proof its flags
    /// announce (a handshake of another version ends with its fixed part:
    /// it is refused as such).
    fn needs(&self) -> Result<usize, Refused> {
        let Some(fixed) = self.got.first_chunk::<HELLO>() else { return Ok(HELLO) };
        let (_, version, flags) = decode_hello(fixed).map_err(|e| Refused::dropped(format!("not a refit handshake: {e}")))?;
        if version != VERSION {
            return Ok(HELLO);
        }
        let shm = if flags & FLAG_SHM != 0 { SHM_ANNOUNCE } else { 0 };
        let proof = if flags & FLAG_PROOF != 0 { PROOF } else { 0 };
        Ok(HELLO + shm + proof)
    }

    /// Reads what has arrived of the handshake: whether all of it is in.
    fn read(&mut self) -> Result<bool, Refused> {
        let mut buf = [0u8; HELLO + SHM_ANNOUNCE + PROOF];
        loop {
            let needs = self.needs()?;
            let want = needs - self.got.len();
            if want == 0 {
                return Ok(true);
            }
            match (&self.stream).read(&mut buf[..want]) {
                Ok(0) => {
                    return Err(Refused::dropped(format!("closed after {} of the handshake's {needs} bytes", self.got.len())));
                }
                Ok(n) => self.got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Refused::dropped(format!("no handshake: {e}"))),
            }
        }
    }
}

/// Checks a whole handshake (`got`, as [`Greeting::read`] collected it).
/// Returns the peer and the receiving end of the peer's region (for
/// shared-memory peers); a refusal says what to answer.
fn check_hello(got: &[u8], x: &Expect<'_>) -> Result<(Endpoint, Option<ShmReceiver>), Refused> {
    let fixed = got.first_chunk::<HELLO>().ok_or_else(|| Refused::dropped("short handshake".into()))?;
    let (peer, version, flags) = decode_hello(fixed).map_err(|e| Refused::dropped(format!("not a refit handshake: {e}")))?;
    let refuse = |code: u8, authentic: bool| Refused {
        why: format!("claimed to be {peer}; {}", hello_problem(code)),
        fatal: authentic,
        answer: Some(code),
    };
    if version != VERSION {
        return Err(refuse(HELLO_VERSION, false));
    }
    let truncated = || Refused::dropped(format!("claimed to be {peer}; truncated handshake"));
    let shm_len = if flags & FLAG_SHM != 0 { SHM_ANNOUNCE } else { 0 };
    let proof_len = if flags & FLAG_PROOF != 0 { PROOF } else { 0 };
    if got.len() != HELLO + shm_len + proof_len {
        return Err(truncated());
    }
    // What the proof covers: the fixed part and the sizes.
    let (sent, proof) = got.split_at(HELLO + shm_len);
    let proof = (proof_len > 0).then_some(proof);
    let sizes: [u8; SHM_ANNOUNCE] = match sent[HELLO..].try_into() {
        Ok(sizes) => sizes,
        Err(_) if shm_len == 0 => [0; SHM_ANNOUNCE],
        Err(_) => return Err(truncated()),
    };
    // With a key, only a valid proof makes a peer; without one, nothing
    // does, and a problem drops the connection rather than failing.
    let authentic = match (x.key, proof) {
        (Some(key), Some(proof)) if proof_holds(key, sent, x.me, proof) => true,
        (Some(_), _) | (None, Some(_)) => return Err(refuse(HELLO_PROOF, false)),
        (None, None) => false,
    };
    if !x.expected.contains(&peer) {
        return Err(refuse(HELLO_PEER, authentic));
    }
    if (flags & FLAG_CHECKSUM != 0) != x.checksum {
        return Err(refuse(HELLO_CHECKSUM, authentic));
    }
    let shared = x.shm.filter(|s| s.shares(peer));
    if (flags & FLAG_SHM != 0) != shared.is_some() {
        return Err(refuse(HELLO_SHM, authentic));
    }
    let inbound = match shared {
        None => None,
        Some(s) => match s.open(x.me, peer, ShmAnnounce::decode(&sizes)) {
            Ok(receiver) => Some(receiver),
            Err(e) => return Err(Refused { why: format!("shared memory from {peer}: {e}"), fatal: authentic, answer: Some(HELLO_REGION) }),
        },
    };
    Ok((peer, inbound))
}

/// Accepts until every expected peer is connected (or `deadline`). One
/// thread checks every incoming handshake: the listener and the
/// connections whose handshake is under way are polled together, and each
/// handshake is read as its bytes arrive, so thousands of connections at
/// once cost descriptors, not threads, and a silent or slow one holds up
/// nothing. A bad or duplicate one is refused, logged and dropped, and
/// accepting goes on; past [`MAX_GREETINGS`] unfinished handshakes beyond
/// the expected peers, a newer connection drops a silent one (a peer
/// speaks as soon as it connects, and retries if dropped before its
/// answer). `accepted` gets each peer's stream, blocking again.
fn accept_all(
    listener: &TcpListener,
    x: &Expect<'_>,
    mut accepted: impl FnMut(Endpoint, TcpStream, Option<ShmReceiver>) -> io::Result<()>,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let me = x.me;
    let mut waiting: HashSet<Endpoint> = x.expected.clone();
    let most = x.expected.len() + MAX_GREETINGS;
    let mut greeting: std::collections::VecDeque<Greeting> = Default::default();
    // The last error `accept` gave that accepting survives (out of
    // descriptors, say): named if the deadline passes.
    let mut trouble: Option<io::Error> = None;
    listener.set_nonblocking(true)?;
    // A whole handshake: taken, refused (told so), or the connect fails.
    let mut settle = |g: Greeting, waiting: &mut HashSet<Endpoint>| -> io::Result<()> {
        let Greeting { mut stream, from, got } = g;
        match check_hello(&got, x) {
            Ok((peer, inbound)) if waiting.contains(&peer) => {
                let answered =
                    stream.set_nonblocking(false).and_then(|()| stream.set_nodelay(true)).and_then(|()| stream.write_all(&[HELLO_OK]));
                if let Err(e) = answered {
                    // Gone before its answer: the peer connects again.
                    tracing::warn!(%me, %peer, %from, error = %e, "a data-plane connection closed before its handshake was answered");
                    return Ok(());
                }
                waiting.remove(&peer);
                accepted(peer, stream, inbound)
            }
            Ok((peer, _)) => {
                let _ = stream.write_all(&[HELLO_DUPLICATE]);
                tracing::warn!(%me, %peer, %from, "refused a data-plane connection: that endpoint is connected already");
                Ok(())
            }
            Err(Refused { why, fatal, answer }) => {
                if let Some(code) = answer {
                    let _ = stream.write_all(&[code]);
                }
                if fatal {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{me}: {from}: {why}")));
                }
                tracing::warn!(%me, %from, reason = %why, "refused a data-plane connection");
                Ok(())
            }
        }
    };
    let dropped = |from: SocketAddr, why: &str| tracing::warn!(%me, %from, reason = %why, "refused a data-plane connection");
    let mut fds: Vec<libc::pollfd> = Vec::new();
    while !waiting.is_empty() {
        let now = Instant::now();
        if now >= x.deadline {
            let mut missing: Vec<String> = waiting.iter().map(|e| e.to_string()).collect();
            missing.sort();
            let also = trouble.as_ref().map(|e| format!(" (accepting failed meanwhile: {e})")).unwrap_or_default();
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{me}: peers did not connect in time: {}{also}", missing.join(", ")),
            ));
        }
        fds.clear();
        let pollfd = |fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        fds.push(pollfd(listener.as_raw_fd()));
        fds.extend(greeting.iter().map(|g| pollfd(g.stream.as_raw_fd())));
        let wait = x.deadline.saturating_duration_since(now).min(POLL_SLICE).as_millis().max(1) as libc::c_int;
        // SAFETY: `fds` is a live, initialised array of `fds.len()` pollfd
        // structures, which `poll` writes the `revents` of and nothing else.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait) };
        if ready < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(io::Error::new(e.kind(), format!("{me}: waiting for data-plane connections: {e}")));
        }
        // Handshakes with news, back to front (removing one leaves the
        // places of those before it).
        for i in (0..greeting.len()).rev() {
            if fds[i + 1].revents == 0 {
                continue;
            }
            match greeting[i].read() {
                Ok(false) => {}
                Ok(true) => {
                    if let Some(g) = greeting.remove(i) {
                        settle(g, &mut waiting)?;
                    }
                }
                Err(r) => {
                    if let Some(g) = greeting.remove(i) {
                        dropped(g.from, &r.why);
                    }
                }
            }
        }
        if fds[0].revents == 0 {
            continue;
        }
        // New connections: each handshake is read at once as far as it has
        // come (a peer writes it right after connecting).
        loop {
            let (stream, from) = match listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted) => continue,
                Err(e) => {
                    // Out of descriptors or memory, say: the connection
                    // waits in the backlog; try again shortly.
                    tracing::warn!(%me, error = %e, "accepting a data-plane connection failed; retrying");
                    trouble = Some(e);
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            };
            if let Err(e) = stream.set_nonblocking(true) {
                dropped(from, &format!("socket setup: {e}"));
                continue;
            }
            let mut g = Greeting { stream, from, got: Vec::new() };
            match g.read() {
                Ok(true) => settle(g, &mut waiting)?,
                Ok(false) => greeting.push_back(g),
                Err(r) => dropped(from, &r.why),
            }
            // Too many unfinished: drop the oldest of those from which
            // nothing has come even now (else the oldest).
            while greeting.len() > most && !waiting.is_empty() {
                let mut silent = None;
                let mut i = 0;
                while i < greeting.len() {
                    if greeting[i].got.is_empty() {
                        match greeting[i].read() {
                            Ok(false) if greeting[i].got.is_empty() => {
                                silent = Some(i);
                                break;
                            }
                            Ok(false) => {}
                            Ok(true) => {
                                if let Some(g) = greeting.remove(i) {
                                    settle(g, &mut waiting)?;
                                }
                                continue;
                            }
                            Err(r) => {
                                if let Some(g) = greeting.remove(i) {
                                    dropped(g.from, &r.why);
                                }
                                continue;
                            }
                        }
                    }
                    i += 1;
                }
                if greeting.len() > most {
                    if let Some(g) = greeting.remove(silent.unwrap_or(0)) {
                        tracing::debug!(%me, from = %g.from, "dropped an unfinished data-plane handshake to make room");
                    }
                }
            }
            if waiting.is_empty() {
                break;
            }
        }
    }
    // Handshakes still under way are strangers' (or duplicates'): dropping
    // them closes them.
    Ok(())
}

/// Why one connection to a peer was not made: `again` when a new one may
/// yet be taken (the peer closed it unanswered, or did not take it).
struct Dialed {
    error: io::Error,
    again: bool,
}

/// Connects to `peer` at `addr`, chooses the stream's congestion control
/// (`config.congestion`) and makes the handshake `hello`: the stream once
/// the peer accepted it, blocking, without a read timeout, and the
/// congestion control it runs.
fn dial(
    me: Endpoint,
    peer: Endpoint,
    addr: SocketAddr,
    hello: &[u8],
    deadline: Instant,
    config: &TcpConfig,
) -> Result<(TcpStream, String), Dialed> {
    let peers_listening = config.peers_listening;
    let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let again = |what: String, e: io::Error| Dialed { error: io::Error::new(e.kind(), format!("{me}: {what}: {e}")), again: true };
    let mut stream = match TcpStream::connect_timeout(&addr, left()) {
        Ok(s) => s,
        Err(e) if peers_listening && e.kind() == io::ErrorKind::ConnectionRefused => {
            let error = io::Error::new(e.kind(), format!("{me}: {peer} at {addr} refused the connection: it is gone"));
            return Err(Dialed { error, again: false });
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
        return Err(Dialed { error, again: closed });
    }
    if answer[0] != HELLO_OK {
        let error = io::Error::new(io::ErrorKind::InvalidData, format!("{me}: {peer} {}", hello_problem(answer[0])));
        return Err(Dialed { error, again: false });
    }
    stream
        .set_read_timeout(None)
        .map_err(|e| Dialed { error: io::Error::new(e.kind(), format!("{me}: connection to {peer}: {e}")), again: false })?;
    Ok((stream, congestion))
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
                accept_all(&listener, &x, |peer, stream, shm_in| {
                    let ms = started.elapsed().as_millis() as u64;
                    tracing::debug!(%me, %peer, ms, shm = shm_in.is_some(), "data-plane stream from a peer accepted");
                    let handle = Arc::new(stream.try_clone()?);
                    streams.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::clone(&handle));
                    let status = statuses.get(&peer).cloned().unwrap_or_default();
                    inbound.insert(peer, Inbound { stream: handle, status: status.clone(), shm: shm_in.is_some() });
                    let max = limits.get(&peer).copied().unwrap_or(default_limit);
                    let reader = Reader { peer, max, checksum, shm: shm_in, status, pool: pool.clone(), tx: tx.clone() };
                    std::thread::Builder::new().name(format!("refit-read-{peer}")).spawn(move || read_loop(stream, reader))?;
                    Ok(())
                })?;
                Ok(inbound)
            })
        };
        let mut links = HashMap::new();
        for (peer, addr) in others {
            let shared = shm.as_deref().filter(|s| s.shares(peer));
            let made = shared.map(|s| s.create(me, peer)).transpose()?;
            let announce = made.as_ref().map(|(_, a)| *a);
            let mut out = made.map(|(o, _)| o);
            let hello = hello(me, peer, checksum, announce, config.hello_key.as_ref());
            // A connection dropped before its handshake was answered (the
            // peer not listening yet, a full backlog, a peer's acceptor
            // making room) is made again, until the deadline.
            let mut pause = Duration::from_millis(20);
            let mut tries = 1u32;
            let dialing = Instant::now();
            let stream = loop {
                match dial(me, peer, addr, &hello, deadline, config) {
                    Ok((s, congestion)) => {
                        let ms = dialing.elapsed().as_millis() as u64;
                        tracing::debug!(%me, %peer, %addr, tries, ms, %congestion, "data-plane stream to a peer connected");
                        break s;
                    }
                    Err(Dialed { error, again: true }) if Instant::now() < deadline => {
                        tracing::debug!(%me, %peer, %addr, %error, tries, "data-plane connection not taken; trying again");
                        std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
                        pause = (pause * 2).min(Duration::from_millis(500));
                        tries += 1;
                    }
                    Err(Dialed { error, again }) if again && tries > 1 => {
                        return Err(io::Error::new(error.kind(), format!("{error} (the last of {tries} tries)")));
                    }
                    Err(Dialed { error, .. }) => return Err(error),
                }
            };
            streams.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::new(stream.try_clone()?));
            if let Some(o) = &mut out {
                shm_link::mapped_by_peer(o);
            }
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

    /// The peers this rank has streams to, in order.
    pub fn peers(&self) -> Vec<Endpoint> {
        let mut v: Vec<Endpoint> = self.links.keys().copied().collect();
        v.sort();
        v
    }

    /// The peers reached through shared memory.
    pub fn shm_peers(&self) -> Vec<Endpoint> {
        let mut v: Vec<Endpoint> = self.links.iter().filter(|(_, l)| l.shm.is_some()).map(|(e, _)| *e).collect();
        v.sort();
        v
    }
}

/// Writes one data frame on a TCP stream: header, runs gathered by writev
/// straight from the sender's memory (short runs copied into `stage` and
/// written with their neighbours as one slice), checksum trailer.
fn write_tcp(
    w: &mut BufWriter<TcpStream>,
    stage: &mut Vec<u8>,
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
    // Whatever `w` buffered goes first (usually nothing: no system call);
    // the header then travels in the payload's first `writev`, not in a
    // segment of its own.
    w.flush()?;
    let stream = w.get_mut();
    let piece = if bucket.is_some() { PACE_CHUNK as usize } else { usize::MAX };
    let mut gather = Gather::new(stage);
    gather.stage_bytes(&header(DATA, round, len));
    let mut sum = 0u32;
    let mut result = Ok(());
    let mut write = |g: &mut Gather<'_, '_>| {
        if let Some(b) = bucket.as_deref_mut() {
            b.pace(g.bytes as u64);
        }
        g.write(stream)
    };
    // Runs go to the socket as they lie in memory, gathered by writev (no
    // copy into a user-space buffer), except short ones: a writev slice
    // costs the kernel about as much as copying a few hundred bytes, so
    // runs under `COPY_RUN` are copied into the stage first, and a piece
    // of rows a few elements wide (a column slice) is packed into it by
    // one strided copy.
    // SAFETY: the executor's contract: the sender's memory is not written
    // while it sends, and the slices do not outlive this call.
    unsafe {
        for_payload_items(payload, SHORT_RUN, |item| {
            if result.is_err() {
                return;
            }
            match item {
                Item::Run(run) => {
                    for part in run.chunks(piece) {
                        if checksum {
                            sum = crc32c::crc32c_append(sum, part);
                        }
                        result = gather.add(part, piece, &mut write);
                        if result.is_err() {
                            return;
                        }
                    }
                }
                // SAFETY: an `Item::Short` view is in bounds of the
                // sender's memory, unwritten while it sends.
                Item::Short { counts, view } => {
                    result = gather.add_short(counts, &view, piece, &mut write, |packed| {
                        if checksum {
                            sum = crc32c::crc32c_append(sum, packed);
                        }
                    })
                }
            }
        })?
    };
    result?;
    // The trailer goes with the last slices.
    if checksum {
        if gather.stage.len() + 4 > STAGE_BYTES {
            write(&mut gather)?;
        }
        gather.stage_bytes(&sum.to_le_bytes());
    }
    write(&mut gather)
}

/// Slices per `writev` call (below every system's IOV_MAX).
const IOV_BATCH: usize = 512;

/// Runs shorter than this are copied into the sender's stage rather than
/// handed to `writev` one slice each (at 512 bytes and more the slice is
/// cheaper than the copy: Llama 3 8B / 8's rows of 512 bytes went 10%
/// slower staged).
const COPY_RUN: usize = SHORT_RUN as usize;

/// Size of a sender's stage (one per rank, reused by every frame).
const STAGE_BYTES: usize = 256 << 10;

/// The slices of one `writev`: runs of the sender's memory and ranges of
/// its stage, in wire order.
struct Gather<'s, 'a> {
    stage: &'s mut Vec<u8>,
    parts: Vec<Part<'a>>,
    /// Bytes gathered since the last write.
    bytes: usize,
}

enum Part<'a> {
    /// Bytes `from..to` of the stage.
    Staged(usize, usize),
    Mem(&'a [u8]),
}

impl<'s, 'a> Gather<'s, 'a> {
    fn new(stage: &'s mut Vec<u8>) -> Self {
        stage.clear();
        if stage.capacity() < STAGE_BYTES {
            stage.reserve_exact(STAGE_BYTES);
        }
        Gather { stage, parts: Vec::with_capacity(IOV_BATCH), bytes: 0 }
    }

    /// Adds `run`, calling `write` first if the stage has no room for it,
    /// and after if the batch is full or holds `flush_at` bytes.
    fn add(&mut self, run: &'a [u8], flush_at: usize, write: &mut impl FnMut(&mut Self) -> io::Result<()>) -> io::Result<()> {
        if run.len() < COPY_RUN && self.stage.len() + run.len() > STAGE_BYTES {
            write(self)?;
        }
        self.push(run);
        if self.parts.len() == IOV_BATCH || self.bytes >= flush_at {
            write(self)?;
        }
        Ok(())
    }

    /// Adds the elements of a piece of short runs (`counts` elements of
    /// `view`), packed into the stage by one strided copy, and shows `seen`
    /// the packed bytes; a piece larger than the stage goes run by run.
    ///
    /// # Safety
    /// `view` must be in bounds ([`crate::copy::in_bounds`]) of memory
    /// valid for reads and unwritten during the call.
    unsafe fn add_short(
        &mut self,
        counts: &[u64],
        view: &StridedRef,
        flush_at: usize,
        write: &mut impl FnMut(&mut Self) -> io::Result<()>,
        mut seen: impl FnMut(&[u8]),
    ) -> io::Result<()> {
        let len = (counts.iter().product::<u64>() * view.dtype.size()) as usize;
        if len > STAGE_BYTES {
            let mut result = Ok(());
            // SAFETY: the view is in bounds and its memory valid and
            // unwritten during the call (the caller's contract); each run
            // is copied into the stage before this call returns.
            unsafe {
                for_each_run(counts, view, |run| {
                    // Runs are shorter than `SHORT_RUN`, far below the stage.
                    if result.is_err() {
                        return;
                    }
                    seen(run);
                    if self.stage.len() + run.len() > STAGE_BYTES {
                        result = write(self);
                        if result.is_err() {
                            return;
                        }
                    }
                    self.bytes += run.len();
                    self.stage_bytes(run);
                    if self.parts.len() == IOV_BATCH || self.bytes >= flush_at {
                        result = write(self);
                    }
                })
            };
            return result;
        }
        if self.stage.len() + len > STAGE_BYTES {
            write(self)?;
        }
        let from = self.stage.len();
        debug_assert!(self.stage.capacity() - from >= len);
        // SAFETY: the stage has room for `len` more bytes (its capacity is
        // `STAGE_BYTES`, checked above), which the packed view covers
        // exactly; `view` is in bounds and unwritten during the call (the
        // caller's contract) and does not overlap the stage. Every byte is
        // written before the length covers it.
        unsafe {
            let to = StridedRef::new(self.stage.as_mut_ptr().add(from), len, 0, packed_strides(counts), view.dtype);
            copy_strided_unfenced(counts, view, &to);
            self.stage.set_len(from + len);
        }
        seen(&self.stage[from..]);
        self.bytes += len;
        self.note_staged(from);
        if self.parts.len() == IOV_BATCH || self.bytes >= flush_at {
            write(self)?;
        }
        Ok(())
    }

    /// Copies `run` to the end of the stage (which has room for it).
    fn stage_bytes(&mut self, run: &[u8]) {
        let from = self.stage.len();
        self.stage.extend_from_slice(run);
        self.note_staged(from);
    }

    /// Records that the stage grew from `from` to its length.
    fn note_staged(&mut self, from: usize) {
        match self.parts.last_mut() {
            Some(Part::Staged(_, to)) if *to == from => *to = self.stage.len(),
            _ => self.parts.push(Part::Staged(from, self.stage.len())),
        }
    }

    fn push(&mut self, run: &'a [u8]) {
        self.bytes += run.len();
        if run.len() >= COPY_RUN {
            self.parts.push(Part::Mem(run));
            return;
        }
        self.stage_bytes(run);
    }

    /// Writes what was gathered and starts over.
    fn write(&mut self, stream: &mut TcpStream) -> io::Result<()> {
        let mut slices: Vec<io::IoSlice<'_>> = self
            .parts
            .iter()
            .map(|p| match *p {
                Part::Staged(from, to) => io::IoSlice::new(&self.stage[from..to]),
                Part::Mem(m) => io::IoSlice::new(m),
            })
            .collect();
        let result = write_all_vectored(stream, &mut slices);
        self.parts.clear();
        self.stage.clear();
        self.bytes = 0;
        result
    }
}

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

impl TcpTransport {
    /// The incoming side of `peer` in words: what its reader last saw,
    /// the messages taken from it, and the kernel's count of the bytes in
    /// and of the time since the last.
    fn describe_inbound(&self, peer: Endpoint) -> Option<String> {
        let i = self.inbound.get(&peer)?;
        let mut words = vec![match i.status.get() {
            ALIVE => "stream up".to_string(),
            GONE => "it said goodbye".to_string(),
            BROKEN => "its stream broke".to_string(),
            _ => "it aborted".to_string(),
        }];
        let n = i.status.messages();
        words.push(format!("{n} message{} taken from it on this data plane", if n == 1 { "" } else { "s" }));
        if let Some(k) = tcp_state(&i.stream) {
            let via = if i.shm { " (notices; messages in shared memory)" } else { "" };
            words.push(format!(
                "{} received on the stream{via}, the last {:.2} s ago",
                human(k.bytes_received),
                k.last_data_recv.as_secs_f64()
            ));
            if k.state != 1 {
                words.push(format!("TCP state {}", k.state));
            }
        }
        Some(words.join(", "))
    }

    /// What the kernel still holds of the messages sent to each peer (for
    /// a log line when the data plane goes away with bytes undelivered).
    fn undelivered(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (peer, l) in &self.links {
            let Some(k) = tcp_state(l.w.get_ref()) else { continue };
            let unacked = k.bytes_sent.saturating_sub(k.bytes_retrans).saturating_sub(k.bytes_acked.saturating_sub(1));
            let left = unacked + k.notsent + l.w.buffer().len() as u64;
            if left == 0 || k.bytes_sent == 0 {
                continue;
            }
            let cc = crate::sockopt::congestion(l.w.get_ref()).unwrap_or_default();
            out.push(format!(
                "to {peer}: {} not yet delivered, {} retransmitted, {} retransmission timeouts, {cc} pacing at {}/s",
                human(left),
                human(k.bytes_retrans),
                k.rtos,
                human(k.pacing_rate)
            ));
        }
        out.sort();
        out
    }
}

impl Drop for TcpTransport {
    /// Says goodbye on every stream, so peers can tell a finished rank from
    /// a crashed one (whose streams just end).
    fn drop(&mut self) {
        if tracing::enabled!(tracing::Level::DEBUG) {
            let left = self.undelivered();
            if !left.is_empty() {
                tracing::debug!(me = %self.me, streams = %left.join("; "), "data plane closed while the kernel still held bytes of it to deliver");
            }
        }
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
        let action = match &self.hook {
            None => FrameAction::Pass,
            Some(hook) => {
                let index = self.frames;
                self.frames += 1;
                hook.data_frame(index)
            }
        };
        let Some(link) = self.links.get_mut(&to) else { return Err(TransportError::Disconnected { peer: to }) };
        match action {
            FrameAction::Stall => return Ok(()),
            FrameAction::Cut => {
                let _ = link.w.get_ref().shutdown(Shutdown::Both);
                return Err(TransportError::Disconnected { peer: to });
            }
            FrameAction::Pass | FrameAction::Corrupt => {}
        }
        let corrupt = action == FrameAction::Corrupt;
        // Once written (to the socket or the region), the bytes are out of
        // the sender's memory: the payload (and its release token) can go.
        match &mut link.shm {
            Some(out) => {
                let m = ShmMessage { me: self.me, to, round, payload: &payload, checksum: self.checksum, corrupt, wait: self.wait_timeout };
                shm_link::send(out, &mut link.w, &link.status, self.intra.as_mut(), m)
            }
            None => write_tcp(&mut link.w, &mut self.stage, round, &payload, self.checksum, corrupt, self.inter.as_mut())
                .map_err(|_| TransportError::Disconnected { peer: to }),
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

    fn link_from(&self, peer: Endpoint) -> Option<String> {
        self.describe_inbound(peer)
    }

    fn abort(&mut self, reason: &str) {
        if let Some(hook) = &self.hook {
            hook.before_abort();
        }
        let reason = &reason.as_bytes()[..reason.len().min(MAX_REASON as usize)];
        for l in self.links.values_mut() {
            let _ = l.w.write_all(&header(ABORT, 0, reason.len() as u64)).and_then(|_| l.w.write_all(reason)).and_then(|_| l.w.flush());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connected loopback stream, and the thread that reads everything
    /// sent on it until it closes.
    fn loopback() -> (TcpStream, std::thread::JoinHandle<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let reader = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            got
        });
        (TcpStream::connect(addr).unwrap(), reader)
    }

    /// Short and long runs, staged and not, with writes forced by the
    /// stage, the batch and the byte limit: the stream carries exactly
    /// their bytes in order.
    #[test]
    fn gathered_runs_arrive_in_order() {
        let mut runs: Vec<Vec<u8>> = Vec::new();
        let lens = [1usize, 7, COPY_RUN - 1, COPY_RUN, 5, 3 * STAGE_BYTES, 2, 100];
        for k in 0..3000 {
            let len = lens[k % lens.len()] + k % 3;
            runs.push((0..len).map(|i| (i * 31 + k * 7) as u8).collect());
        }
        let want: Vec<u8> = runs.concat();
        let (mut stream, reader) = loopback();
        let mut stage = Vec::new();
        let mut writes = 0;
        for flush_at in [usize::MAX, 64 << 10] {
            let mut gather = Gather::new(&mut stage);
            let mut write = |g: &mut Gather<'_, '_>| {
                writes += 1;
                g.write(&mut stream)
            };
            for r in &runs {
                gather.add(r, flush_at, &mut write).unwrap();
            }
            write(&mut gather).unwrap();
        }
        drop(stream);
        let got = reader.join().unwrap();
        assert!(writes > 10, "{writes} writes");
        assert_eq!(got.len(), 2 * want.len());
        assert!(got[..want.len()] == want[..] && got[want.len()..] == want[..]);
    }

    /// Column slices of a row-major matrix packed by `add_short`, one
    /// that fits the stage and one larger than it, between plain runs:
    /// the stream carries the columns' elements row by row, and `seen`
    /// is shown exactly those bytes.
    #[test]
    fn short_pieces_are_packed_in_order() {
        let (rows, cols) = (70_000u64, 32u64);
        let matrix: Vec<u8> = (0..rows * cols * 2).map(|i| (i * 7 % 251) as u8).collect();
        let column_slice = |first: u64, width: u64, n_rows: u64| -> Vec<u8> {
            let mut v = Vec::new();
            for r in 0..n_rows {
                let at = ((r * cols + first) * 2) as usize;
                v.extend_from_slice(&matrix[at..at + (width * 2) as usize]);
            }
            v
        };
        // SAFETY: `matrix` outlives the views and is never written.
        let view = |first: u64| unsafe {
            let mut strides = [0u64; reshard::MAX_DIMS];
            strides[0] = cols;
            strides[1] = 1;
            StridedRef::new(matrix.as_ptr(), matrix.len(), first, strides, reshard::DType::BF16)
        };
        let head: Vec<u8> = vec![9; 10];
        let (mut stream, reader) = loopback();
        let mut stage = Vec::new();
        let mut seen = Vec::new();
        let mut gather = Gather::new(&mut stage);
        let mut write = |g: &mut Gather<'_, '_>| g.write(&mut stream);
        gather.add(&head, usize::MAX, &mut write).unwrap();
        // SAFETY (both): the views lie inside `matrix` (rows 0..500 and
        // 0..rows, columns 5..8 and 30..32), which nothing writes.
        unsafe { gather.add_short(&[500, 3], &view(5), usize::MAX, &mut write, |b| seen.extend_from_slice(b)) }.unwrap();
        gather.add(&head, usize::MAX, &mut write).unwrap();
        unsafe { gather.add_short(&[rows, 2], &view(30), 64 << 10, &mut write, |b| seen.extend_from_slice(b)) }.unwrap();
        write(&mut gather).unwrap();
        drop(stream);
        let got = reader.join().unwrap();
        let (small, large) = (column_slice(5, 3, 500), column_slice(30, 2, rows));
        assert!(large.len() > STAGE_BYTES);
        assert_eq!(seen, [&small[..], &large[..]].concat());
        assert_eq!(got, [&head[..], &small[..], &head[..], &large[..]].concat());
    }
}
