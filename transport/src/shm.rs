//! Shared-memory links between ranks of one node that are separate
//! processes (the NVLink analogue on a host).
//!
//! Per ordered pair of same-node ranks, the sender creates a file under
//! `/dev/shm` (named after a session id the caller gives, both ranks, and
//! the direction), sizes and maps it; the receiver maps it while the pair's
//! control stream (a TCP stream, the same one other-node peers carry data
//! on) is set up, and the sender unlinks it as soon as the receiver has it
//! mapped, so a crash later leaves no file behind.
//!
//! The sender allocates the region's pages before its first message
//! (`posix_fallocate`), so a tmpfs too small for it (a container's
//! `/dev/shm`) is an error on that send rather than SIGBUS on first touch,
//! and pairs that never talk cost one page.
//!
//! Region layout: a 4 KiB control page (magic, sizes, two counters the
//! receiver advances), the *lend area*, the *stream area*.
//!
//! * A message that fits the free part of the lend area is packed there in
//!   one gather copy and announced by a `lent` frame (round, sequence
//!   number, offset, length, checksum) on the control stream. The receiver
//!   hands those bytes to the executor in place ([`Payload::Lent`](crate::Payload::Lent)), which
//!   unpacks straight out of the region: one copy on each side. When the
//!   payload is dropped, the receiver advances the region's released
//!   counter (in order of sequence numbers); the sender reclaims space from
//!   it on its next send. The sender never waits for lend space.
//! * Any other message is streamed through the stream area in chunks, each
//!   announced by a `chunk` frame. The receiver's reader thread copies each
//!   chunk out at once (into the message's buffer) and advances the
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
use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Shared-memory link settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmConfig {
    /// Where region files are created (a tmpfs).
    pub dir: PathBuf,
    /// Bytes per ordered pair of same-node ranks for messages handed over
    /// in place (default 256 MiB; the node fabric takes it as a rank's
    /// budget, split among the peers it sends to through shared memory,
    /// each pair at least 1 MiB and at most its largest message rounded up
    /// to a power of two: a message that fits goes over in one copy in and
    /// one out, a larger one in chunks). A pair's region is reserved in full the
    /// first time its sender sends (so a full tmpfs is an error then, not
    /// SIGBUS later); pairs that never talk cost a page.
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
        ShmConfig { dir: PathBuf::from("/dev/shm"), lend_bytes: 256 << 20, stream_bytes: 8 << 20, wait_timeout: Duration::from_secs(600) }
    }
}

const REGION_MAGIC: u64 = 0x314d_4853_5449_4652; // "RFITSHM1"
const CONTROL: u64 = 4096;
/// Control word: the creating process's id (for [`remove_stale_regions`]).
const OFF_CREATOR: usize = 24;
const OFF_CONSUMED: usize = 64;
const OFF_RELEASED: usize = 128;
/// Largest area accepted from a peer's handshake.
pub(crate) const MAX_AREA: u64 = 1 << 40;

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

/// A mapped region file.
#[derive(Debug)]
pub(crate) struct Region {
    ptr: *mut u8,
    len: usize,
    /// Set while the file still has a name this side should remove.
    path: Option<PathBuf>,
    /// The creator's open file (and its name, for errors), until its
    /// pages are reserved.
    unreserved: Option<(std::fs::File, PathBuf)>,
}

// SAFETY: the mapping is plain shared memory; every access goes through
// raw pointers under the protocol above or through atomics.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    fn map(file: &std::fs::File, len: u64) -> io::Result<*mut u8> {
        use std::os::fd::AsRawFd;
        let len = usize::try_from(len).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "region too large"))?;
        // SAFETY: a fresh shared mapping of a file we hold open; the kernel
        // checks the arguments.
        let ptr =
            unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, file.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(ptr as *mut u8)
    }

    /// Creates and maps a new region file of `lend + stream` bytes of areas.
    pub(crate) fn create(path: &Path, lend: u64, stream: u64) -> io::Result<Region> {
        check_areas(lend, stream)?;
        let len = CONTROL + lend + stream;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot create {}: {e}", path.display())))?;
        let region = (|| {
            file.set_len(len)?;
            // The control page now (it is written below), the areas on
            // first use (`reserve_all`).
            reserve(&file, CONTROL).map_err(|e| Region::full(path, CONTROL, e))?;
            let ptr = Region::map(&file, len)?;
            Ok(Region { ptr, len: len as usize, path: Some(path.to_path_buf()), unreserved: Some((file, path.to_path_buf())) })
        })();
        let region = match region {
            Ok(r) => r,
            Err(e) => {
                let _ = std::fs::remove_file(path);
                return Err(e);
            }
        };
        region.word(8).store(lend, Ordering::Relaxed);
        region.word(16).store(stream, Ordering::Relaxed);
        region.word(OFF_CREATOR).store(u64::from(std::process::id()), Ordering::Relaxed);
        region.word(0).store(REGION_MAGIC, Ordering::Release);
        Ok(region)
    }

    /// Creates a region under `path(name)` for a fresh `name` from
    /// `names`: a name someone else took already (a file put there before
    /// us, to block or to watch the pair) is passed over for the next, so
    /// knowing the session does not let anyone stop a refit; after
    /// [`NAME_TRIES`] taken names, the error names the last. Returns the
    /// region and its name.
    pub(crate) fn create_named(
        path: impl Fn(u64) -> PathBuf,
        lend: u64,
        stream: u64,
        mut names: impl FnMut() -> io::Result<u64>,
    ) -> io::Result<(Region, u64)> {
        let mut last = None;
        for _ in 0..NAME_TRIES {
            let name = names()?;
            match Region::create(&path(name), lend, stream) {
                Ok(r) => return Ok((r, name)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    tracing::warn!(path = %path(name).display(), "a shared-memory region's name was taken; trying another");
                    last = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no region name tried")))
    }

    /// Maps an existing region file that should hold areas of these sizes
    /// (as a peer announced them: checked, an empty or huge area is an
    /// error, not a division by zero later).
    pub(crate) fn open(path: &Path, lend: u64, stream: u64) -> io::Result<Region> {
        let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
        check_areas(lend, stream)?;
        let len = CONTROL + lend + stream;
        // Never through a symbolic link, and only a file of this user's:
        // the peer that creates a region runs as the same user, so one
        // owned by anybody else was put there by someone else.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot open {}: {e}", path.display())))?;
        let meta = file.metadata()?;
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        if std::os::unix::fs::MetadataExt::uid(&meta) != me || !meta.is_file() {
            return Err(bad(format!(
                "{} is not a region of this user's (owner {})",
                path.display(),
                std::os::unix::fs::MetadataExt::uid(&meta)
            )));
        }
        let size = meta.len();
        if size != len {
            return Err(bad(format!("{} has {size} bytes, expected {len}", path.display())));
        }
        let ptr = Region::map(&file, len)?;
        let region = Region { ptr, len: len as usize, path: None, unreserved: None };
        if region.word(0).load(Ordering::Acquire) != REGION_MAGIC
            || region.word(8).load(Ordering::Relaxed) != lend
            || region.word(16).load(Ordering::Relaxed) != stream
        {
            return Err(bad(format!("{} is not a region of this session", path.display())));
        }
        Ok(region)
    }

    fn full(path: &Path, len: u64, e: io::Error) -> io::Error {
        let dir = path.parent().unwrap_or(path).display();
        io::Error::new(
            e.kind(),
            format!("cannot reserve {len} bytes in {dir} ({e}): make ShmConfig::lend_bytes/stream_bytes smaller or the tmpfs larger"),
        )
    }

    /// Allocates every page of the creator's region (once), so that a full
    /// tmpfs is an error here rather than SIGBUS on first touch.
    pub(crate) fn reserve_all(&mut self) -> io::Result<()> {
        if let Some((file, path)) = &self.unreserved {
            reserve(file, self.len as u64).map_err(|e| Region::full(path, self.len as u64, e))?;
            self.unreserved = None;
        }
        Ok(())
    }

    /// Removes the file's name (both sides keep their mappings).
    pub(crate) fn unlink(&mut self) {
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_file(p);
        }
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset + 8 <= CONTROL as usize && offset.is_multiple_of(8));
        // SAFETY: within the control page of a live, page-aligned mapping;
        // 8-byte aligned; only ever accessed atomically.
        unsafe { &*(self.ptr.add(offset) as *const AtomicU64) }
    }

    /// Raw pointer to byte `offset` of the region.
    fn at(&self, offset: u64) -> *mut u8 {
        debug_assert!(offset <= self.len as u64);
        // SAFETY: within the mapping (callers check offsets).
        unsafe { self.ptr.add(offset as usize) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        self.unlink();
        // SAFETY: our own mapping, unmapped once; nothing borrows it any
        // more (lent payloads hold an `Arc` of the region).
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// Allocates every page of the file now, so that a full tmpfs (a small
/// `/dev/shm` in a container) fails here with an error instead of killing
/// the process with SIGBUS on first touch later.
fn reserve(file: &std::fs::File, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "region too large"))?;
    // SAFETY: plain system call on a file descriptor we own.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// The file name of the region for messages `from` → `to` in `session`,
/// with the random part `name` (announced in the handshake).
pub(crate) fn region_path(dir: &Path, session: &str, from: reshard::Endpoint, to: reshard::Endpoint, name: u64) -> PathBuf {
    let tag = |e: reshard::Endpoint| match e.group {
        reshard::Group::Src => format!("s{}", e.rank),
        reshard::Group::Dst => format!("d{}", e.rank),
    };
    dir.join(format!("refit-{session}-{}-{}-{name:016x}", tag(from), tag(to)))
}

/// 64 random bits from the kernel (for a region's name).
pub(crate) fn random_name() -> io::Result<u64> {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most `b.len()` bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        return Err(io::Error::other(format!("no random bytes for a region name: {}", io::Error::last_os_error())));
    }
    Ok(u64::from_le_bytes(b))
}

/// How many names [`Region::create_named`] tries.
const NAME_TRIES: usize = 8;

/// Removes region files in `dir` that this user's processes created and
/// that outlived their creator (a process killed between creating a region
/// and its peer mapping it, when the name is normally removed); returns how
/// many. Files of other users, of live processes, or not regions are left.
pub fn remove_stale_regions(dir: &Path) -> usize {
    use std::io::Read;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let mut removed = 0;
    for entry in entries.flatten() {
        let path = entry.path();
        if !entry.file_name().to_str().is_some_and(|n| n.starts_with("refit-")) {
            continue;
        }
        let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
        if !meta.is_file() || meta.uid() != me || meta.len() < CONTROL {
            continue;
        }
        let mut head = [0u8; OFF_CREATOR + 8];
        let read = OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&path).and_then(|mut f| f.read_exact(&mut head));
        if read.is_err() {
            continue;
        }
        let word = |at: usize| u64::from_ne_bytes(head[at..at + 8].try_into().unwrap_or([0; 8]));
        let Ok(pid) = libc::pid_t::try_from(word(OFF_CREATOR)) else { continue };
        if word(0) != REGION_MAGIC || pid <= 0 {
            continue;
        }
        // SAFETY: signal 0 only checks that the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone && std::fs::remove_file(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Whether a session id is safe in a file name.
pub(crate) fn valid_session(session: &str) -> bool {
    !session.is_empty() && session.len() <= 128 && session.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// The sender's side of a pair's region.
#[derive(Debug)]
pub(crate) struct ShmOut {
    pub(crate) region: Region,
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
    pub(crate) fn new(region: Region, lend: u64, stream: u64) -> ShmOut {
        ShmOut { region, lend, stream, head: 0, live: VecDeque::new(), next_seq: 0, written: 0 }
    }

    /// Allocates the region's pages before its first message.
    pub(crate) fn ready(&mut self) -> io::Result<()> {
        self.region.reserve_all()
    }

    /// Chooses where a message of `len` bytes goes, reserving lend space.
    pub(crate) fn place(&mut self, len: u64) -> Placement {
        let released = self.region.word(OFF_RELEASED).load(Ordering::Acquire);
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
        self.region.at(offset)
    }

    /// Free stream space: (region offset, contiguous bytes) where the next
    /// chunk may go, at most `max` bytes; 0 bytes when the area is full.
    pub(crate) fn stream_space(&self, max: u64) -> (u64, u64) {
        let consumed = self.region.word(OFF_CONSUMED).load(Ordering::Acquire);
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

/// The receiver's side of a pair's region.
#[derive(Debug)]
pub(crate) struct ShmIn {
    region: Arc<Region>,
    lend: u64,
    stream: u64,
    releases: Arc<Mutex<Releases>>,
    /// Next lent sequence number expected.
    next_seq: u64,
    /// Stream area: bytes consumed so far (monotonic).
    consumed: u64,
}

impl ShmIn {
    pub(crate) fn new(region: Region, lend: u64, stream: u64) -> ShmIn {
        ShmIn { region: Arc::new(region), lend, stream, releases: Arc::default(), next_seq: 0, consumed: 0 }
    }

    /// Checks a lent frame and returns the bytes' address and a token that
    /// releases them when dropped.
    pub(crate) fn lent(&mut self, seq: u64, offset: u64, len: u64) -> Result<(*const u8, crate::transport::Release), String> {
        if seq != self.next_seq {
            return Err(format!("lent message {seq}, expected {}", self.next_seq));
        }
        if offset < CONTROL || offset.checked_add(len).is_none_or(|end| end > CONTROL + self.lend) {
            return Err(format!("lent message of {len} bytes at {offset} is outside the lend area"));
        }
        self.next_seq += 1;
        std::sync::atomic::fence(Ordering::Acquire);
        let region = self.region.clone();
        let releases = self.releases.clone();
        let release = crate::transport::Release::on_drop(move || {
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
                region.word(OFF_RELEASED).store(r.next, Ordering::Release);
            }
        });
        Ok((self.region.at(offset) as *const u8, release))
    }

    /// Copies a chunk of the stream area out into `into` (of its length),
    /// then frees it.
    pub(crate) fn chunk(&mut self, offset: u64, len: u64, into: &mut [u8]) -> Result<(), String> {
        let want = CONTROL + self.lend + self.consumed % self.stream;
        if offset != want || len > self.stream - self.consumed % self.stream || len != into.len() as u64 {
            return Err(format!("chunk of {len} bytes at {offset}, expected one at {want}"));
        }
        std::sync::atomic::fence(Ordering::Acquire);
        // SAFETY: inside the stream area (checked); the sender does not
        // write this chunk until `consumed` passes it.
        into.copy_from_slice(unsafe { std::slice::from_raw_parts(self.region.at(offset), len as usize) });
        self.consumed += len;
        self.region.word(OFF_CONSUMED).store(self.consumed, Ordering::Release);
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

    fn temp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("refit-unit-{}-{name}", std::process::id()))
    }

    #[test]
    fn regions_of_dead_creators_are_swept_and_others_kept() {
        let dir = temp("sweep");
        std::fs::create_dir_all(&dir).unwrap();
        let (live, dead, other) = (dir.join("refit-a-s0-s1"), dir.join("refit-b-s0-s1"), dir.join("refit-notes"));
        let keep = Region::create(&live, 64, 64).unwrap();
        let orphan = Region::create(&dead, 64, 64).unwrap();
        // A process that has exited: its id names no process now.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        orphan.word(OFF_CREATOR).store(u64::from(pid), Ordering::Relaxed);
        std::fs::write(&other, vec![0u8; CONTROL as usize]).unwrap();
        assert_eq!(remove_stale_regions(&dir), 1);
        assert!(live.exists() && !dead.exists() && other.exists());
        drop((keep, orphan));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn lend_area_wraps_and_reclaims_in_order() {
        let path = temp("lend");
        let region = Region::create(&path, 1024, 256).unwrap();
        let mut inbound = ShmIn::new(Region::open(&path, 1024, 256).unwrap(), 1024, 256);
        let mut out = ShmOut::new(region, 1024, 256);
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
        let path = temp("front");
        let region = Region::create(&path, 1 << 20, 256).unwrap();
        let mut inbound = ShmIn::new(Region::open(&path, 1 << 20, 256).unwrap(), 1 << 20, 256);
        let mut out = ShmOut::new(region, 1 << 20, 256);
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
        let path = temp("stream");
        let region = Region::create(&path, 64, 100).unwrap();
        let mut inbound = ShmIn::new(Region::open(&path, 64, 100).unwrap(), 64, 100);
        let mut out = ShmOut::new(region, 64, 100);
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

    #[test]
    fn empty_or_huge_areas_are_refused() {
        let path = temp("empty");
        for (lend, stream) in [(0, 64), (64, 0), (0, 0), (MAX_AREA + 1, 64)] {
            let Err(e) = Region::open(&path, lend, stream) else { panic!("{lend} {stream}: opened") };
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{lend} {stream}: {e}");
            assert!(Region::create(&path, lend, stream).is_err(), "{lend} {stream}");
        }
        assert!(!path.exists());
    }

    #[test]
    fn opening_a_wrong_region_fails_cleanly() {
        let path = temp("wrong");
        let _region = Region::create(&path, 64, 64).unwrap();
        assert!(Region::open(&path, 128, 64).is_err());
        assert!(Region::open(&temp("missing"), 64, 64).is_err());
        assert!(Region::create(&path, 64, 64).is_err());
        assert!(valid_session("abc-1_2") && !valid_session("../x") && !valid_session(""));
        // A link put where a region is expected is not followed, even to a
        // real region.
        let link = temp("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        let Err(e) = Region::open(&link, 64, 64) else { panic!("opened through a link") };
        assert!(e.to_string().contains("cannot open"), "{e}");
        let _ = std::fs::remove_file(&link);
    }

    /// A region's name taken before us (by anyone: a file, a link) is
    /// passed over for the next random one, and the peer opens the region
    /// by the name that worked; only names taken every time fail, naming
    /// the last.
    #[test]
    fn a_taken_region_name_is_passed_over() {
        let (from, to) = (reshard::Endpoint::src(0), reshard::Endpoint::dst(1));
        let dir = std::env::temp_dir();
        let session = format!("taken{}", std::process::id());
        let path = |name| region_path(&dir, &session, from, to, name);
        // Someone made the first two names the creator will draw.
        std::fs::write(path(1), b"not a region").unwrap();
        std::os::unix::fs::symlink("/dev/null", path(2)).unwrap();
        let mut drawn = [1u64, 2, 3].into_iter();
        let (region, name) = Region::create_named(path, 64, 64, || Ok(drawn.next().unwrap_or(99))).unwrap();
        assert_eq!(name, 3);
        assert!(Region::open(&path(3), 64, 64).is_ok());
        assert_eq!(std::fs::read(path(1)).unwrap(), b"not a region");
        drop(region);
        let e = Region::create_named(path, 64, 64, || Ok(1)).map(|(_, n)| n).unwrap_err();
        assert!(e.to_string().contains(&path(1).display().to_string()), "{e}");
        for n in [1, 2, 3] {
            let _ = std::fs::remove_file(path(n));
        }
        // Real names are random and distinct.
        assert_ne!(random_name().unwrap(), random_name().unwrap());
        assert!(region_path(&dir, "s", from, to, 0xab).to_string_lossy().ends_with("refit-s-s0-d1-00000000000000ab"));
    }
}
