//! The receiving side of a stream: a reader thread per incoming stream
//! turns its frames into messages for the transport's inbox, tracks what
//! it last saw of the peer ([`PeerStatus`]), and leaves plain data frames
//! on the stream for the executor to read into place
//! ([`StreamFrame`](crate::stream::StreamFrame)).

use super::pool::FramePool;
use crate::frame::{decode_header, ABORT, BYE, CHUNK, DATA, HEADER, MAX_REASON, SHM_INFO};
use crate::stream::StreamFrame;
use crate::tcp::shm_link::ShmReceiver;
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
    finish(&r, stop);
}

/// Records why the stream `r` reads stopped and tells the transport
/// where that is news (a broken or corrupt stream).
pub(super) fn finish(r: &Reader, stop: Stop) {
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
                let frame = StreamFrame::new(Arc::clone(shared) as Arc<dyn crate::stream::FrameStream>, len, done);
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
                    Err(e) => return Stop::Broken(e.to_string()),
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
