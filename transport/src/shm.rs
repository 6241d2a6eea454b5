//! Shared-memory links between ranks of one node that are separate
//! processes (the NVLink analogue on a host).
//!
//! Per ordered pair of same-node ranks, the sender makes a **region**: an
//! anonymous memory file (`memfd_create`), sized, mapped read-write by the
//! sender, and then sealed (`F_SEAL_SHRINK | F_SEAL_GROW |
//! F_SEAL_FUTURE_WRITE | F_SEAL_SEAL`): from then on nobody, the sender
//! included, can shrink or grow it, and nobody but the sender's own mapping
//! can write it. The receiver opens it read-only through
//! `/proc/<sender pid>/fd/<fd>` (the handshake announces both and a random
//! token the region's control page holds), checks the seals, the owner,
//! the size and the token, and maps it read-only. The receiver makes an
//! **acknowledgement page** the same way (one page, sealed, written only by
//! the receiver) where it counts what it consumed and released; the
//! handshake's answer announces it and the sender maps it read-only. So a
//! peer can neither make the other take SIGBUS (no region can be
//! truncated once mapped) nor write into memory the other owns, and every
//! count read from the other side is clamped to what this side knows it
//! sent. The files have no name: nothing is left in `/dev/shm`, whatever
//! way a process ends.
//!
//! Mapping a peer's region needs the same effective user (or `CAP_SYS_PTRACE`)
//! and the same process-id namespace; a pair that cannot is refused at its
//! handshake and talks TCP instead (`crate::tcp`).
//!
//! The sender allocates the region's pages before its first message
//! (`posix_fallocate`), so memory too tight for it is an error on that send
//! rather than SIGBUS on first touch, and pairs that never talk cost one
//! page.
//!
//! Region layout: a 4 KiB control page (magic, sizes, token), the *lend
//! area*, the *stream area*. Acknowledgement page: magic, token, the
//! consumed and released counters.
//!
//! * A message that fits the free part of the lend area is packed there in
//!   one gather copy and announced by a `lent` frame (round, sequence
//!   number, offset, length, checksum) on the control stream. The receiver
//!   hands those bytes to the executor in place ([`Payload::Lent`](crate::Payload::Lent)), which
//!   unpacks straight out of the region: one copy on each side. When the
//!   payload is dropped, the receiver advances its released counter (in
//!   order of sequence numbers); the sender reclaims space from it on its
//!   next send.
//! * Any other message is streamed through the stream area in chunks, each
//!   announced by a `chunk` frame. The receiver's reader thread copies each
//!   chunk out at once (into the message's buffer) and advances its
//!   consumed counter, which the sender polls (spin, then sleep) before it
//!   reuses space. The reader thread drains whatever its rank thread is
//!   doing, so two ranks sending each other large messages cannot deadlock.
//!
//! A dead or departed peer is seen on the control stream (end of stream,
//! goodbye, abort): the stream reader marks the peer, and a sender waiting
//! for space gives up with an error instead of waiting; a sender waits at
//! most [`ShmConfig::wait_timeout`] in all.

use crate::copy::store_fence;
use std::collections::{BTreeSet, VecDeque};
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Shared-memory link settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmConfig {
    /// Bytes per ordered pair of same-node ranks for messages handed over
    /// in place (default 256 MiB; the node fabric takes it as a rank's
    /// budget, split among the peers it sends to through shared memory,
    /// each pair at least 1 MiB and at most its largest message rounded up
    /// to a power of two: a message that fits goes over in one copy in and
    /// one out, a larger one in chunks). A pair's region is reserved in full the
    /// first time its sender sends (so memory too tight for it is an error
    /// then, not SIGBUS later); pairs that never talk cost a page.
    pub lend_bytes: u64,
    /// Bytes per pair for streaming messages that do not fit the free lend
    /// space, in chunks of a quarter of it (default 8 MiB).
    pub stream_bytes: u64,
    /// Longest a send waits for stream space before giving up (a live but
    /// stuck receiver; a dead one is noticed at once).
    pub wait_timeout: Duration,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig { lend_bytes: 256 << 20, stream_bytes: 8 << 20, wait_timeout: Duration::from_secs(600) }
    }
}

const REGION_MAGIC: u64 = 0x324d_4853_5449_4652; // "RFITSHM2"
const ACKS_MAGIC: u64 = 0x3253_4b43_4154_4652; // "RFTACKS2"
/// The control page of a region; the whole of an acknowledgement page.
const CONTROL: u64 = 4096;
/// Control words of a region: magic, lend and stream sizes, token.
const OFF_LEND: usize = 8;
const OFF_STREAM: usize = 16;
const OFF_TOKEN: usize = 24;
/// Words of an acknowledgement page: magic, token, counters (each on a
/// cache line of its own).
const OFF_ACKS_TOKEN: usize = 8;
const OFF_CONSUMED: usize = 64;
const OFF_RELEASED: usize = 128;
/// Largest area accepted from a peer's handshake.
pub(crate) const MAX_AREA: u64 = 1 << 40;
/// The seals every region carries before a peer may map it: its size is
/// fixed for good, and only its creator's mapping writes it.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL;
/// The seals a peer's region must carry for this side to map it: without
/// them the peer could truncate it under our mapping (SIGBUS).
const SEALS_NEEDED: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// Both areas of a region must hold something (a reader divides by their
/// sizes) and stay within [`MAX_AREA`].
fn check_areas(lend: u64, stream: u64) -> io::Result<()> {
    if lend == 0 || stream == 0 || lend > MAX_AREA || stream > MAX_AREA {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("region areas of {lend} and {stream} bytes: each must be 1 to {MAX_AREA} bytes"),
        ));
    }
    Ok(())
}
/// Lent messages start at multiples of this.
const ALIGN: u64 = 64;

/// How a peer finds a region this process made: the process, the
/// descriptor it keeps the region open under, and the random token the
/// region holds (so a reused process id or descriptor number is told from
/// the region announced).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RegionRef {
    pub(crate) pid: u32,
    pub(crate) fd: u32,
    pub(crate) token: u64,
}

/// A shared mapping of a whole memory file.
#[derive(Debug)]
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; every access goes through
// raw pointers under the protocol above or through atomics.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps all `len` bytes of `file`, writable or not.
    fn new(file: &File, len: u64, writable: bool) -> io::Result<Mapping> {
        let len = usize::try_from(len).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "region too large"))?;
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: a fresh shared mapping of a file we hold open; the kernel
        // checks the arguments. The file's size is sealed (checked by the
        // callers before mapping a peer's), so no page of it can vanish.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, file.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr: ptr.cast(), len })
    }

    /// The word at `offset` of the first page.
    fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset + 8 <= CONTROL as usize && offset.is_multiple_of(8));
        // SAFETY: within the first page of a live, page-aligned mapping of
        // at least a page; 8-byte aligned; only ever accessed atomically.
        unsafe { &*(self.ptr.add(offset) as *const AtomicU64) }
    }

    /// Raw pointer to byte `offset`.
    fn at(&self, offset: u64) -> *mut u8 {
        debug_assert!(offset <= self.len as u64);
        // SAFETY: within the mapping (callers check offsets).
        unsafe { self.ptr.add(offset as usize) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once; nothing borrows it any
        // more (lent payloads hold an `Arc` of the region).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A region this process made: mapped read-write here, sealed, its memory
/// file kept open (a peer opens it through `/proc`) until the peer has it.
#[derive(Debug)]
pub(crate) struct OwnRegion {
    map: Mapping,
    /// The open memory file, until the peer mapped it and its pages are
    /// reserved.
    file: Option<File>,
    /// Whether every page is allocated yet.
    reserved: bool,
    /// Whether the peer mapped it.
    handed: bool,
    token: u64,
}

impl OwnRegion {
    /// Makes a sealed memory file of `len` bytes named `name` (shown in
    /// `/proc/<pid>/fd`), maps it read-write, and lets `init` write its
    /// first page (the token at `token_at` is written here) before the
    /// seals close it to other writers.
    fn create(name: &str, len: u64, token_at: usize, init: impl FnOnce(&Mapping)) -> io::Result<OwnRegion> {
        let cname =
            CString::new(format!("refit-{name}")).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "region name with a NUL"))?;
        let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
        // SAFETY: `cname` is a valid NUL-terminated string; the call has no
        // other preconditions and returns a new descriptor or -1.
        let mut fd = unsafe { libc::memfd_create(cname.as_ptr(), flags | libc::MFD_NOEXEC_SEAL) };
        if fd < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
            // A kernel before 6.3 knows no MFD_NOEXEC_SEAL.
            // SAFETY: as above.
            fd = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
        }
        if fd < 0 {
            return Err(io::Error::other(format!("cannot make a shared-memory region: {}", io::Error::last_os_error())));
        }
        // SAFETY: `fd` is a descriptor we just made and own alone.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(len)?;
        // The first page now (it is written below), the rest on first use
        // (`reserve_all`).
        reserve(&file, CONTROL).map_err(|e| full(CONTROL, e))?;
        let map = Mapping::new(&file, len, true)?;
        let token = random_u64()?;
        map.word(token_at).store(token, Ordering::Relaxed);
        init(&map);
        // SAFETY: plain fcntl on a descriptor we own.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
            return Err(io::Error::other(format!("cannot seal a shared-memory region: {}", io::Error::last_os_error())));
        }
        Ok(OwnRegion { map, file: Some(file), reserved: len <= CONTROL, handed: false, token })
    }

    /// How a peer finds this region (until it was handed over).
    pub(crate) fn reference(&self) -> io::Result<RegionRef> {
        let file = self.file.as_ref().filter(|_| !self.handed).ok_or_else(|| io::Error::other("a region handed over already"))?;
        Ok(RegionRef { pid: std::process::id(), fd: file.as_raw_fd() as u32, token: self.token })
    }

    /// The peer has it mapped: the descriptor can go once the pages are
    /// reserved (the memory stays while anyone maps it).
    pub(crate) fn handed_over(&mut self) {
        self.handed = true;
        if self.reserved {
            self.file = None;
        }
    }

    /// Allocates every page (once), so that memory too tight for the
    /// region is an error here rather than SIGBUS on first touch.
    pub(crate) fn reserve_all(&mut self) -> io::Result<()> {
        if !self.reserved {
            let file = self.file.as_ref().ok_or_else(|| io::Error::other("a region's file closed before its pages were reserved"))?;
            reserve(file, self.map.len as u64).map_err(|e| full(self.map.len as u64, e))?;
            self.reserved = true;
            if self.handed {
                self.file = None;
            }
        }
        Ok(())
    }
}

/// A peer's region, mapped read-only.
#[derive(Debug)]
pub(crate) struct PeerRegion {
    map: Mapping,
}

impl PeerRegion {
    /// Opens the region `r` names (read-only, through `/proc`) and maps it,
    /// once it is this user's, sealed against shrinking and growing, of
    /// `len` bytes, with the token at `token_at` and `magic` first.
    fn open(r: RegionRef, len: u64, magic: u64, token_at: usize) -> io::Result<PeerRegion> {
        let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
        let path = format!("/proc/{}/fd/{}", r.pid, r.fd);
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot open the peer's region {path}: {e}")))?;
        let meta = file.metadata()?;
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        let owner = std::os::unix::fs::MetadataExt::uid(&meta);
        if owner != me || !meta.is_file() {
            return Err(bad(format!("{path} is not a region of this user's (owner {owner})")));
        }
        // SAFETY: plain fcntl on a descriptor we own.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & SEALS_NEEDED != SEALS_NEEDED {
            return Err(bad(format!("{path} is not sealed against resizing (seals {seals:#x})")));
        }
        let size = meta.len();
        if size != len {
            return Err(bad(format!("{path} has {size} bytes, expected {len}")));
        }
        let map = Mapping::new(&file, len, false)?;
        if map.word(0).load(Ordering::Acquire) != magic || map.word(token_at).load(Ordering::Relaxed) != r.token {
            return Err(bad(format!("{path} is not the region announced")));
        }
        Ok(PeerRegion { map })
    }
}

fn full(len: u64, e: io::Error) -> io::Error {
    io::Error::new(
        e.kind(),
        format!("cannot reserve {len} bytes of shared memory ({e}): make ShmConfig::lend_bytes/stream_bytes smaller or give the job more memory"),
    )
}

/// Allocates every page of the file now, so that memory too tight for it
/// fails here with an error instead of killing the process with SIGBUS on
/// first touch later.
fn reserve(file: &File, len: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "region too large"))?;
    // SAFETY: plain system call on a file descriptor we own.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// 64 random bits from the kernel.
pub(crate) fn random_u64() -> io::Result<u64> {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most `b.len()` bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        return Err(io::Error::other(format!("no random bytes for a region token: {}", io::Error::last_os_error())));
    }
    Ok(u64::from_le_bytes(b))
}

/// The name a region from `from` to `to` shows in `/proc/<pid>/fd`.
fn region_name(session: &str, from: reshard::Endpoint, to: reshard::Endpoint) -> String {
    let tag = |e: reshard::Endpoint| match e.group {
        reshard::Group::Src => format!("s{}", e.rank),
        reshard::Group::Dst => format!("d{}", e.rank),
    };
    format!("{session}-{}-{}", tag(from), tag(to))
}

/// Makes the region for messages `from` → `to` in `session`, of the given
/// areas.
pub(crate) fn create_region(
    session: &str,
    from: reshard::Endpoint,
    to: reshard::Endpoint,
    lend: u64,
    stream: u64,
) -> io::Result<OwnRegion> {
    check_areas(lend, stream)?;
    OwnRegion::create(&region_name(session, from, to), CONTROL + lend + stream, OFF_TOKEN, |map| {
        map.word(OFF_LEND).store(lend, Ordering::Relaxed);
        map.word(OFF_STREAM).store(stream, Ordering::Relaxed);
        map.word(0).store(REGION_MAGIC, Ordering::Release);
    })
}

/// Maps the region a peer made for its messages to this rank, as its
/// handshake announced it (areas checked: an empty or huge area is an
/// error, not a division by zero later).
pub(crate) fn open_region(r: RegionRef, lend: u64, stream: u64) -> io::Result<PeerRegion> {
    check_areas(lend, stream)?;
    let region = PeerRegion::open(r, CONTROL + lend + stream, REGION_MAGIC, OFF_TOKEN)?;
    let (l, s) = (region.map.word(OFF_LEND).load(Ordering::Relaxed), region.map.word(OFF_STREAM).load(Ordering::Relaxed));
    if (l, s) != (lend, stream) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the peer's region has areas of {l} and {s} bytes, announced {lend} and {stream}"),
        ));
    }
    Ok(region)
}

/// Makes the acknowledgement page of the receiver of messages `from` →
/// `to`.
pub(crate) fn create_acks(session: &str, from: reshard::Endpoint, to: reshard::Endpoint) -> io::Result<OwnRegion> {
    OwnRegion::create(&format!("{}-acks", region_name(session, from, to)), CONTROL, OFF_ACKS_TOKEN, |map| {
        map.word(0).store(ACKS_MAGIC, Ordering::Release);
    })
}

/// Maps the acknowledgement page a receiver announced.
pub(crate) fn open_acks(r: RegionRef) -> io::Result<PeerRegion> {
    PeerRegion::open(r, CONTROL, ACKS_MAGIC, OFF_ACKS_TOKEN)
}

/// Whether a session id is safe in a region's name.
pub(crate) fn valid_session(session: &str) -> bool {
    !session.is_empty() && session.len() <= 128 && session.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// The sender's side of a pair's region: the region it writes, the
/// receiver's acknowledgement page it reads.
#[derive(Debug)]
pub(crate) struct ShmOut {
    pub(crate) region: OwnRegion,
    acks: PeerRegion,
    lend: u64,
    stream: u64,
    /// Lend area: next free position (monotonic), live messages.
    head: u64,
    live: VecDeque<(u64, u64)>, // (seq, start position)
    next_seq: u64,
    /// Stream area: bytes written so far (monotonic).
    written: u64,
}

/// Where a message goes.
pub(crate) enum Placement {
    /// In the lend area: sequence number and region offset.
    Lent { seq: u64, offset: u64 },
    /// Through the stream area.
    Stream,
}

impl ShmOut {
    /// The sending end of `region` (of these areas), once the receiver
    /// mapped it and announced its acknowledgement page `acks`.
    pub(crate) fn new(mut region: OwnRegion, acks: PeerRegion, lend: u64, stream: u64) -> ShmOut {
        region.handed_over();
        ShmOut { region, acks, lend, stream, head: 0, live: VecDeque::new(), next_seq: 0, written: 0 }
    }

    /// Allocates the region's pages before its first message.
    pub(crate) fn ready(&mut self) -> io::Result<()> {
        self.region.reserve_all()
    }

    /// Chooses where a message of `len` bytes goes, reserving lend space.
    pub(crate) fn place(&mut self, len: u64) -> Placement {
        // The receiver's count, never past what was lent (a receiver that
        // claims more only loses its own messages).
        let released = self.acks.map.word(OFF_RELEASED).load(Ordering::Acquire).min(self.next_seq);
        while self.live.front().is_some_and(|&(seq, _)| seq < released) {
            self.live.pop_front();
        }
        if !self.fits(len) {
            return Placement::Stream;
        }
        if self.live.is_empty() {
            // Everything lent came back: start over at the front, so the
            // pages a refit writes are the ones the last one wrote (already
            // mapped), not the next ones round the ring.
            self.head = 0;
        }
        let tail = self.live.front().map_or(self.head, |&(_, start)| start);
        let mut start = self.head.next_multiple_of(ALIGN);
        if start % self.lend + len > self.lend {
            start = start.next_multiple_of(self.lend);
        }
        if start + len - tail > self.lend {
            return Placement::Stream;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.live.push_back((seq, start));
        self.head = start + len;
        Placement::Lent { seq, offset: CONTROL + start % self.lend }
    }

    /// Whether a message of `len` bytes could be lent at all (the lend
    /// area empty).
    pub(crate) fn fits(&self, len: u64) -> bool {
        len != 0 && len <= self.lend
    }

    /// Pointer to region offset `offset`.
    pub(crate) fn at(&self, offset: u64) -> *mut u8 {
        self.region.map.at(offset)
    }

    /// Free stream space: (region offset, contiguous bytes) where the next
    /// chunk may go, at most `max` bytes; 0 bytes when the area is full.
    pub(crate) fn stream_space(&self, max: u64) -> (u64, u64) {
        // The receiver's count, never past what was written.
        let consumed = self.acks.map.word(OFF_CONSUMED).load(Ordering::Acquire).min(self.written);
        let free = self.stream - (self.written - consumed).min(self.stream);
        let off = self.written % self.stream;
        (CONTROL + self.lend + off, free.min(self.stream - off).min(max))
    }

    /// Records a chunk of `n` bytes written at the stream position.
    pub(crate) fn streamed(&mut self, n: u64) {
        self.written += n;
    }

    /// The stream area size.
    pub(crate) fn stream_bytes(&self) -> u64 {
        self.stream
    }
}

/// Which lent messages the receiver is done with.
#[derive(Debug, Default)]
struct Releases {
    /// Every sequence number below this is released.
    next: u64,
    /// Released above `next`.
    done: BTreeSet<u64>,
}

/// The receiver's side of a pair's region: the sender's region it reads,
/// its own acknowledgement page it writes.
#[derive(Debug)]
pub(crate) struct ShmIn {
    region: Arc<PeerRegion>,
    acks: Arc<OwnRegion>,
    lend: u64,
    stream: u64,
    releases: Arc<Mutex<Releases>>,
    /// Next lent sequence number expected.
    next_seq: u64,
    /// Stream area: bytes consumed so far (monotonic).
    consumed: u64,
}

/// Why a frame of a shared-memory link names bytes it may not.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ShmFrameError {
    #[error("lent message {seq}, expected {expected}")]
    LentOutOfOrder { seq: u64, expected: u64 },
    #[error("lent message of {len} bytes at {offset} is outside the lend area")]
    OutsideLendArea { len: u64, offset: u64 },
    #[error("chunk of {len} bytes at {offset}, expected one at {want}")]
    UnexpectedChunk { len: u64, offset: u64, want: u64 },
}

impl ShmIn {
    pub(crate) fn new(region: PeerRegion, acks: OwnRegion, lend: u64, stream: u64) -> ShmIn {
        ShmIn { region: Arc::new(region), acks: Arc::new(acks), lend, stream, releases: Arc::default(), next_seq: 0, consumed: 0 }
    }

    /// How the sender finds this side's acknowledgement page.
    pub(crate) fn acks(&self) -> io::Result<RegionRef> {
        self.acks.reference()
    }

    /// Checks a lent frame and returns the bytes' address and a token that
    /// releases them when dropped.
    pub(crate) fn lent(&mut self, seq: u64, offset: u64, len: u64) -> Result<(*const u8, crate::transport::Release), ShmFrameError> {
        if seq != self.next_seq {
            return Err(ShmFrameError::LentOutOfOrder { seq, expected: self.next_seq });
        }
        if offset < CONTROL || offset.checked_add(len).is_none_or(|end| end > CONTROL + self.lend) {
            return Err(ShmFrameError::OutsideLendArea { len, offset });
        }
        self.next_seq += 1;
        std::sync::atomic::fence(Ordering::Acquire);
        // The release holds the region mapped: the payload reads it until
        // the release is dropped, whatever becomes of this link meanwhile.
        let region = self.region.clone();
        let acks = self.acks.clone();
        let releases = self.releases.clone();
        let release = crate::transport::Release::on_drop(move || {
            let _mapped = &region;
            let mut r = releases.lock().unwrap_or_else(|e| e.into_inner());
            r.done.insert(seq);
            let mut advanced = false;
            loop {
                let next = r.next;
                if !r.done.remove(&next) {
                    break;
                }
                r.next += 1;
                advanced = true;
            }
            if advanced {
                acks.map.word(OFF_RELEASED).store(r.next, Ordering::Release);
            }
        });
        Ok((self.region.map.at(offset) as *const u8, release))
    }

    /// Copies a chunk of the stream area out into `into` (of its length),
    /// then frees it.
    pub(crate) fn chunk(&mut self, offset: u64, len: u64, into: &mut [u8]) -> Result<(), ShmFrameError> {
        let want = CONTROL + self.lend + self.consumed % self.stream;
        if offset != want || len > self.stream - self.consumed % self.stream || len != into.len() as u64 {
            return Err(ShmFrameError::UnexpectedChunk { len, offset, want });
        }
        std::sync::atomic::fence(Ordering::Acquire);
        // SAFETY: inside the stream area (checked) of a mapping whose size
        // is sealed; the sender does not write this chunk until `consumed`
        // passes it (one that does only garbles its own message).
        into.copy_from_slice(unsafe { std::slice::from_raw_parts(self.region.map.at(offset), len as usize) });
        self.consumed += len;
        self.acks.map.word(OFF_CONSUMED).store(self.consumed, Ordering::Release);
        Ok(())
    }
}

/// Orders the sender's writes to a region before the frame announcing them.
pub(crate) fn publish() {
    store_fence();
    std::sync::atomic::fence(Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard::Endpoint;

    const FROM: Endpoint = Endpoint::src(0);
    const TO: Endpoint = Endpoint::dst(1);

    /// Both ends of a pair's link, in this process, as the handshake sets
    /// them up.
    fn pair(lend: u64, stream: u64) -> (ShmOut, ShmIn) {
        let region = create_region("unit", FROM, TO, lend, stream).unwrap();
        let theirs = open_region(region.reference().unwrap(), lend, stream).unwrap();
        let acks = create_acks("unit", FROM, TO).unwrap();
        let acks_theirs = open_acks(acks.reference().unwrap()).unwrap();
        (ShmOut::new(region, acks_theirs, lend, stream), ShmIn::new(theirs, acks, lend, stream))
    }

    #[test]
    fn lend_area_wraps_and_reclaims_in_order() {
        let (mut out, mut inbound) = pair(1024, 256);
        out.ready().unwrap();
        let Placement::Lent { seq: 0, offset: a } = out.place(600) else { panic!() };
        assert_eq!(a, CONTROL);
        // 600 + 600 > 1024: no room until the first is released.
        assert!(matches!(out.place(600), Placement::Stream));
        assert!(matches!(out.place(2000), Placement::Stream));
        let (_, r0) = inbound.lent(0, a, 600).unwrap();
        let Placement::Lent { seq: 1, offset: b } = out.place(300) else { panic!() };
        assert_eq!(b, CONTROL + 640);
        let (_, r1) = inbound.lent(1, b, 300).unwrap();
        // Releasing out of order frees nothing until the older one goes.
        drop(r1);
        assert!(matches!(out.place(600), Placement::Stream));
        drop(r0);
        // Everything is free: the next message starts at the front again.
        let Placement::Lent { seq: 2, offset: c } = out.place(600) else { panic!() };
        assert_eq!(c, CONTROL);
        assert!(inbound.lent(5, c, 600).is_err());
        assert!(inbound.lent(2, CONTROL + 1000, 600).is_err());
        // With the first still lent, the next that does not fit before
        // the end wraps to the start, behind it only if there is room.
        let (_, r2) = inbound.lent(2, c, 600).unwrap();
        let Placement::Lent { seq: 3, offset: d } = out.place(300) else { panic!() };
        assert_eq!(d, CONTROL + 640);
        let (_, r3) = inbound.lent(3, d, 300).unwrap();
        drop(r2);
        let Placement::Lent { seq: 4, offset: e } = out.place(500) else { panic!() };
        assert_eq!(e, CONTROL);
        drop(r3);
    }

    #[test]
    fn an_idle_lend_area_is_reused_from_the_front() {
        let (mut out, mut inbound) = pair(1 << 20, 256);
        // Refit after refit of one small message each: always the same
        // bytes at the front, not a walk round the whole area.
        for seq in 0..10 {
            let Placement::Lent { seq: s, offset } = out.place(4096) else { panic!() };
            assert_eq!((s, offset), (seq, CONTROL));
            drop(inbound.lent(seq, offset, 4096).unwrap());
        }
    }

    #[test]
    fn stream_area_flows() {
        let (mut out, mut inbound) = pair(64, 100);
        out.ready().unwrap();
        let (off, n) = out.stream_space(70);
        assert_eq!((off, n), (CONTROL + 64, 70));
        // SAFETY: inside the stream area.
        unsafe { std::ptr::write_bytes(out.at(off), 7, 70) };
        out.streamed(70);
        assert_eq!(out.stream_space(70).1, 30);
        let mut got = [0u8; 100];
        inbound.chunk(off, 70, &mut got[..70]).unwrap();
        assert_eq!(got[..70], [7; 70]);
        // The next chunk stops at the end of the area, then wraps.
        assert_eq!(out.stream_space(1000), (CONTROL + 64 + 70, 30));
        out.streamed(30);
        assert!(inbound.chunk(CONTROL + 64, 10, &mut got[70..80]).is_err());
        inbound.chunk(CONTROL + 64 + 70, 30, &mut got[70..]).unwrap();
        assert_eq!(out.stream_space(1000), (CONTROL + 64, 100));
    }

    /// A receiver that writes nonsense into its acknowledgement page (more
    /// released or consumed than was ever sent) makes its sender neither
    /// panic nor wrap a count: the sender trusts it only up to what it sent.
    #[test]
    fn counts_from_the_receiver_are_clamped_to_what_was_sent() {
        let (mut out, inbound) = pair(1024, 256);
        out.ready().unwrap();
        inbound.acks.map.word(OFF_RELEASED).store(u64::MAX, Ordering::Release);
        inbound.acks.map.word(OFF_CONSUMED).store(u64::MAX, Ordering::Release);
        assert_eq!(out.stream_space(1000), (CONTROL + 1024, 256));
        out.streamed(200);
        assert_eq!(out.stream_space(1000), (CONTROL + 1024 + 200, 56));
        let Placement::Lent { seq: 0, .. } = out.place(600) else { panic!() };
        let Placement::Lent { seq: 1, .. } = out.place(300) else { panic!() };
    }

    #[test]
    fn empty_or_huge_areas_are_refused() {
        let (out, _inbound) = pair(64, 64);
        let r = out.region.reference();
        assert!(r.is_err(), "a region handed over is not announced again");
        for (lend, stream) in [(0, 64), (64, 0), (0, 0), (MAX_AREA + 1, 64)] {
            let Err(e) = create_region("unit", FROM, TO, lend, stream) else { panic!("{lend} {stream}: made") };
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{lend} {stream}: {e}");
            let fresh = create_region("unit", FROM, TO, 64, 64).unwrap();
            let Err(e) = open_region(fresh.reference().unwrap(), lend, stream) else { panic!("{lend} {stream}: opened") };
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{lend} {stream}: {e}");
        }
    }

    /// What a peer announces is checked before anything is mapped: sizes,
    /// token, that the file is a sealed region at all.
    #[test]
    fn opening_a_wrong_region_fails_cleanly() {
        let region = create_region("unit", FROM, TO, 64, 64).unwrap();
        let r = region.reference().unwrap();
        let err = |r: RegionRef, lend: u64| open_region(r, lend, 64).map(drop).unwrap_err().to_string();
        assert!(err(r, 128).contains("expected"), "{}", err(r, 128));
        assert!(err(RegionRef { token: r.token ^ 1, ..r }, 64).contains("not the region announced"));
        assert!(err(RegionRef { fd: 99_999, ..r }, 64).contains("cannot open"));
        assert!(err(RegionRef { pid: 0x7fff_fff0, ..r }, 64).contains("cannot open"));
        // An ordinary file of the right size, announced as a region: not
        // sealed, refused before it is mapped.
        let plain = tempfile_of(CONTROL + 128);
        let e = err(RegionRef { fd: plain.as_raw_fd() as u32, ..r }, 64);
        assert!(e.contains("not sealed"), "{e}");
        // The acknowledgement page is not a region, nor the reverse.
        let acks = create_acks("unit", FROM, TO).unwrap();
        assert!(open_region(acks.reference().unwrap(), 64, 64).is_err());
        assert!(open_acks(r).is_err());
        assert!(valid_session("abc-1_2") && !valid_session("../x") && !valid_session(""));
    }

    fn tempfile_of(len: u64) -> File {
        let path = std::env::temp_dir().join(format!("refit-unit-plain-{}", std::process::id()));
        let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        f.set_len(len).unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }

    /// Nobody can shrink, grow or write a region but its creator's own
    /// mapping: not the creator through its descriptor, not anyone who
    /// opens it through `/proc` with write access (the same user can).
    /// So a peer that truncates cannot make the other take SIGBUS.
    #[test]
    fn regions_cannot_be_resized_or_written_by_anyone_else() {
        let (mut out, mut inbound) = pair(4096, 4096);
        // Opened with write access before the sender lets its descriptor go.
        let region_fd = out.region.file.as_ref().map(|f| f.as_raw_fd()).unwrap();
        let paths = [format!("/proc/self/fd/{region_fd}"), format!("/proc/self/fd/{}", inbound.acks().unwrap().fd)];
        let opened: Vec<File> = paths.iter().map(|p| OpenOptions::new().read(true).write(true).open(p).unwrap()).collect();
        out.ready().unwrap();
        assert!(out.region.file.is_none(), "the descriptor stays open after the peer mapped the region");
        for (path, f) in paths.iter().zip(&opened) {
            let len = f.metadata().unwrap().len();
            assert!(f.set_len(len / 2).is_err(), "{path}: shrunk");
            assert!(f.set_len(len * 2).is_err(), "{path}: grown");
            assert!(std::io::Write::write(&mut &*f, b"x").is_err(), "{path}: written");
            assert!(Mapping::new(f, len, true).is_err(), "{path}: mapped writable");
            assert_eq!(f.metadata().unwrap().len(), len);
        }
        // The creators' own mappings still work: a message goes through.
        let Placement::Lent { seq, offset } = out.place(8) else { panic!() };
        // SAFETY: the 8 bytes the placement reserved.
        unsafe { std::ptr::copy_nonoverlapping(b"refitted".as_ptr(), out.at(offset), 8) };
        publish();
        let (ptr, release) = inbound.lent(seq, offset, 8).unwrap();
        // SAFETY: checked inside the lend area, not reused before `release`.
        assert_eq!(unsafe { std::slice::from_raw_parts(ptr, 8) }, b"refitted");
        drop(release);
        assert_eq!(out.acks.map.word(OFF_RELEASED).load(Ordering::Acquire), 1);
    }
}
