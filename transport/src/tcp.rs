//! The TCP transport: one stream per ordered pair of ranks, length-prefixed
//! frames, payload bytes written straight from the sender's buffers (each
//! contiguous run of a piece goes to the socket as it is; no serialisation
//! of payloads). A reader thread per incoming stream turns frames into
//! messages for [`Transport::recv`].
//!
//! Frame: magic `RFIT` (u32 LE), kind (u8: 0 data, 1 abort, 2 bye: the
//! sender is done and closes cleanly), round (u32 LE),
//! payload length (u64 LE), payload. A stream starts with a handshake:
//! magic, then the sender's group (u8) and rank (u32 LE).

use crate::copy::{for_each_run, in_bounds};
use crate::transport::{Payload, RoundInbox, Transport, TransportError};
use reshard::{Endpoint, Group};
use std::collections::HashMap;
use std::io::{self, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{channel, Sender};
use std::time::{Duration, Instant};

const MAGIC: u32 = 0x5449_4652; // "RFIT" little-endian
const DATA: u8 = 0;
const ABORT: u8 = 1;
const BYE: u8 = 2;
const HEADER: usize = 4 + 1 + 4 + 8;

/// TCP transport settings.
#[derive(Clone, Copy, Debug)]
pub struct TcpConfig {
    /// Largest payload a reader accepts (a bigger length is a protocol error).
    pub max_frame_bytes: u64,
    /// Send buffer per stream.
    pub write_buffer_bytes: usize,
    /// Time to set up all streams.
    pub connect_timeout: Duration,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig { max_frame_bytes: 1 << 34, write_buffer_bytes: 4 << 20, connect_timeout: Duration::from_secs(30) }
    }
}

enum Incoming {
    Data { round: u32, from: Endpoint, bytes: Vec<u8> },
    Abort { from: Endpoint, reason: String },
    Broken { from: Endpoint, problem: String },
}

/// One rank's end of a TCP fabric.
pub struct TcpTransport {
    me: Endpoint,
    writers: HashMap<Endpoint, BufWriter<TcpStream>>,
    inbox: RoundInbox<Incoming>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport").field("me", &self.me).field("peers", &self.writers.len()).finish()
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

/// Reads frames from `peer` until the stream ends, forwarding them.
fn read_loop(mut stream: TcpStream, peer: Endpoint, max: u64, tx: Sender<Incoming>) {
    let broken = |problem: String| Incoming::Broken { from: peer, problem };
    loop {
        let mut h = [0u8; HEADER];
        if let Err(e) = stream.read_exact(&mut h) {
            let _ = tx.send(broken(if e.kind() == io::ErrorKind::UnexpectedEof { "connection closed".into() } else { e.to_string() }));
            return;
        }
        let magic = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
        let round = u32::from_le_bytes([h[5], h[6], h[7], h[8]]);
        let len = u64::from_le_bytes([h[9], h[10], h[11], h[12], h[13], h[14], h[15], h[16]]);
        if magic != MAGIC || h[4] > BYE {
            let _ = tx.send(broken(format!("bad frame header {h:02x?}")));
            return;
        }
        if len > max {
            let _ = tx.send(broken(format!("frame of {len} bytes exceeds the limit of {max}")));
            return;
        }
        let mut bytes = Vec::new();
        if bytes.try_reserve_exact(len as usize).is_err() {
            let _ = tx.send(broken(format!("cannot allocate a frame of {len} bytes")));
            return;
        }
        bytes.resize(len as usize, 0);
        if let Err(e) = stream.read_exact(&mut bytes) {
            let _ = tx.send(broken(format!("truncated frame: {e}")));
            return;
        }
        let msg = match h[4] {
            DATA => Incoming::Data { round, from: peer, bytes },
            ABORT => Incoming::Abort { from: peer, reason: String::from_utf8_lossy(&bytes).into_owned() },
            // A clean end: nothing more will come, and that is no error.
            _ => return,
        };
        if tx.send(msg).is_err() {
            return; // the transport is gone
        }
    }
}

/// Connects every endpoint to every other over loopback TCP (for running
/// all ranks of a plan as threads of one process over real sockets).
pub fn tcp_fabric(endpoints: &[Endpoint], config: &TcpConfig) -> io::Result<Vec<TcpTransport>> {
    let listeners: Vec<TcpListener> = endpoints.iter().map(|_| TcpListener::bind("127.0.0.1:0")).collect::<io::Result<_>>()?;
    let addrs: Vec<(Endpoint, SocketAddr)> =
        endpoints.iter().zip(&listeners).map(|(e, l)| l.local_addr().map(|a| (*e, a))).collect::<io::Result<_>>()?;
    std::thread::scope(|s| {
        let addrs = &addrs;
        let handles: Vec<_> =
            endpoints.iter().zip(listeners).map(|(&me, l)| s.spawn(move || TcpTransport::connect(me, l, addrs, config))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(io::Error::other("connect thread panicked")))).collect()
    })
}

impl TcpTransport {
    /// Joins a fabric: accepts a stream from every other peer on `listener`
    /// and opens one to every other peer's address in `peers`.
    pub fn connect(me: Endpoint, listener: TcpListener, peers: &[(Endpoint, SocketAddr)], config: &TcpConfig) -> io::Result<TcpTransport> {
        let deadline = Instant::now() + config.connect_timeout;
        let others: Vec<(Endpoint, SocketAddr)> = peers.iter().copied().filter(|(e, _)| *e != me).collect();
        let (tx, inbox) = channel();
        let expected = others.len();
        let max = config.max_frame_bytes;
        // Accept in the background while this thread connects out.
        let acceptor = {
            let tx = tx.clone();
            std::thread::spawn(move || -> io::Result<()> {
                for _ in 0..expected {
                    let (mut stream, _) = listener.accept()?;
                    stream.set_nodelay(true)?;
                    let mut hello = [0u8; 9];
                    stream.read_exact(&mut hello)?;
                    if u32::from_le_bytes([hello[0], hello[1], hello[2], hello[3]]) != MAGIC {
                        return Err(io::Error::new(io::ErrorKind::InvalidData, "bad handshake"));
                    }
                    let peer = decode_endpoint(&[hello[4], hello[5], hello[6], hello[7], hello[8]])?;
                    let tx = tx.clone();
                    std::thread::spawn(move || read_loop(stream, peer, max, tx));
                }
                Ok(())
            })
        };
        let mut writers = HashMap::new();
        for (peer, addr) in others {
            let stream = loop {
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
            let mut w = BufWriter::with_capacity(config.write_buffer_bytes, stream);
            w.write_all(&MAGIC.to_le_bytes())?;
            w.write_all(&encode_endpoint(me))?;
            w.flush()?;
            writers.insert(peer, w);
        }
        acceptor.join().map_err(|_| io::Error::other("accept thread panicked"))??;
        Ok(TcpTransport { me, writers, inbox: RoundInbox::new(inbox) })
    }

    fn write_message(&mut self, round: u32, to: Endpoint, payload: &Payload) -> io::Result<()> {
        let w = self.writers.get_mut(&to).ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no stream to {to}")))?;
        match payload {
            Payload::Bytes(b) => {
                w.write_all(&header(DATA, round, b.len() as u64))?;
                w.write_all(b)?;
            }
            Payload::Segments { segments, .. } => {
                let len: u64 = segments.iter().map(|s| s.numel * s.view.dtype.size()).sum();
                w.write_all(&header(DATA, round, len))?;
                w.flush()?;
                // Runs go to the socket as they lie in memory, gathered by
                // writev (no copy into a user-space buffer).
                let stream = w.get_mut();
                let mut batch: Vec<io::IoSlice<'_>> = Vec::with_capacity(IOV_BATCH);
                let mut result = Ok(());
                for s in segments {
                    if !in_bounds(s.extent(), &s.view) {
                        return Err(io::Error::new(io::ErrorKind::InvalidInput, "segment out of bounds"));
                    }
                    // SAFETY: in bounds (checked); the sender's memory is not
                    // written while it sends (the executor's contract), and
                    // the slices do not outlive this call.
                    unsafe {
                        for_each_run(s.extent(), &s.view, |run| {
                            if result.is_ok() {
                                batch.push(io::IoSlice::new(std::slice::from_raw_parts(run.as_ptr(), run.len())));
                                if batch.len() == IOV_BATCH {
                                    result = write_all_vectored(stream, &mut batch);
                                    batch.clear();
                                }
                            }
                        })
                    };
                    result.as_ref().map_err(|e| io::Error::new(e.kind(), e.to_string()))?;
                }
                write_all_vectored(stream, &mut batch)?;
                return Ok(());
            }
        }
        w.flush()
    }
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

impl Drop for TcpTransport {
    /// Says goodbye on every stream, so peers can tell a finished rank from
    /// a crashed one (whose streams just end).
    fn drop(&mut self) {
        for w in self.writers.values_mut() {
            let _ = w.write_all(&header(BYE, 0, 0)).and_then(|_| w.flush());
        }
    }
}

impl Transport for TcpTransport {
    fn me(&self) -> Endpoint {
        self.me
    }

    fn send(&mut self, round: u32, to: Endpoint, payload: Payload) -> Result<(), TransportError> {
        // Once written, the bytes are the kernel's: the payload (and its
        // release token) can go.
        self.write_message(round, to, &payload).map_err(|_| TransportError::Disconnected { peer: to })
    }

    fn recv(&mut self, round: u32, deadline: Instant) -> Result<(Endpoint, Payload), TransportError> {
        self.inbox.recv(self.me, round, deadline, |e| match e {
            Incoming::Data { round, from, bytes } => Ok((round, from, Payload::Bytes(bytes))),
            Incoming::Abort { from, reason } => Err(TransportError::PeerAborted { peer: from, reason }),
            Incoming::Broken { from, problem } => Err(TransportError::Broken { peer: from, problem }),
        })
    }

    fn flush(&mut self, _round: u32, _deadline: Instant) -> Result<(), TransportError> {
        // `send` returns only after the bytes left the sender's memory.
        Ok(())
    }

    fn abort(&mut self, reason: &str) {
        let reason = reason.as_bytes();
        for w in self.writers.values_mut() {
            let _ = w.write_all(&header(ABORT, 0, reason.len() as u64)).and_then(|_| w.write_all(reason)).and_then(|_| w.flush());
        }
    }
}
