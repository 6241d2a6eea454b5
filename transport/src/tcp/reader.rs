//! The receiving side of a stream: a reader thread per incoming stream
//! turns its frames into messages for the transport's inbox, tracks what
//! it last saw of the peer ([`PeerStatus`]), and leaves plain data frames
//! on the stream for the executor to read into place ([`StreamFrame`]).

use super::pool::FramePool;
use super::writer::IOV_BATCH;
use crate::frame::{decode_header, ABORT, BYE, CHUNK, DATA, HEADER, MAX_REASON, SHM_INFO};
use crate::shm_link::ShmReceiver;
use crate::transport::Payload;
use reshard::Endpoint;
use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;

pub(super) enum Incoming {
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
pub(super) const GONE: u8 = 1;
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
    pub(super) fn messages(&self) -> u64 {
        self.1.load(Ordering::Relaxed)
    }
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

/// How a reader treats one incoming stream.
pub(super) struct Reader {
    pub(super) peer: Endpoint,
    pub(super) max: u64,
    pub(super) checksum: bool,
    pub(super) shm: Option<ShmReceiver>,
    pub(super) status: Arc<PeerStatus>,
    pub(super) pool: Arc<FramePool>,
    pub(super) tx: Sender<Incoming>,
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
pub(super) fn read_loop(stream: TcpStream, mut r: Reader) {
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
