//! Shared-memory links: a pair of ranks on one node moves message bytes
//! through a `/dev/shm` region ([`crate::shm`]) and only small `lent` and
//! `chunk` frames ([`crate::frame`]) over the pair's TCP stream.
//!
//! The sender writes a message into the region's lend area in one piece
//! when it fits (a `lent` frame hands it to the receiver in place), or
//! streams it through the stream area chunk by chunk (a `chunk` frame per
//! chunk, the receiver copies each out and frees its space). Link
//! emulation paces the copies into the region through the rank's
//! intra-node token bucket.

use crate::copy::{copy_strided_unfenced, for_each_run, packed_strides, StridedRef};
use crate::frame::{for_payload_items, header, payload_len, shm_info, Item, ShmAnnounce, CHUNK, LENT, SHM_INFO, SHORT_RUN};
use crate::link::{TokenBucket, PACE_CHUNK};
use crate::shm::{self, OwnRegion, Placement, RegionRef, ShmConfig, ShmIn, ShmOut};
use crate::tcp::{FramePool, PeerStatus, Stop, ALIVE, BROKEN};
use crate::transport::{Lent, Payload, TransportError};
use reshard::Endpoint;
use std::collections::HashSet;
use std::io::{self, BufWriter, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Same-node peers and how to reach them through shared memory.
pub(crate) struct ShmSetup {
    pub(crate) session: String,
    pub(crate) same_node: HashSet<Endpoint>,
    pub(crate) config: ShmConfig,
}

impl ShmSetup {
    /// Fails for a session id that cannot name a region.
    pub(crate) fn check(&self) -> io::Result<()> {
        if shm::valid_session(&self.session) {
            Ok(())
        } else {
            Err(io::Error::new(io::ErrorKind::InvalidInput, format!("session id {:?}: use 1-128 of [A-Za-z0-9_-]", self.session)))
        }
    }

    /// Whether this rank reaches `peer` through shared memory.
    pub(crate) fn shares(&self, peer: Endpoint) -> bool {
        self.same_node.contains(&peer)
    }

    /// The sizes of the regions this rank creates: lend area, stream area
    /// (at least 1 byte), as announced in the handshake.
    pub(crate) fn sizes(&self) -> (u64, u64) {
        (self.config.lend_bytes, self.config.stream_bytes.max(1))
    }

    /// Makes the region for this rank's messages to `peer`, and what the
    /// handshake announces of it.
    pub(crate) fn create(&self, me: Endpoint, peer: Endpoint) -> io::Result<(MadeRegion, ShmAnnounce)> {
        let (lend, stream) = self.sizes();
        let region = shm::create_region(&self.session, me, peer, lend, stream)?;
        let announce = ShmAnnounce { lend, stream, region: region.reference()? };
        Ok((MadeRegion { region, lend, stream }, announce))
    }

    /// Maps the region `peer` made for its messages to this rank, as its
    /// handshake announced it, and makes this side's acknowledgement page
    /// (announced in the answer: [`ShmReceiver::acks`]).
    pub(crate) fn open(&self, me: Endpoint, peer: Endpoint, a: ShmAnnounce) -> io::Result<ShmReceiver> {
        let region = shm::open_region(a.region, a.lend, a.stream)?;
        let acks = shm::create_acks(&self.session, peer, me)?;
        Ok(ShmReceiver { shm: ShmIn::new(region, acks, a.lend, a.stream), partial: None, crc: 0 })
    }
}

/// Says, once per pair and process, that a pair that was to share memory
/// talks TCP, and why (later times at debug level: a fabric made afresh
/// each refit would say it every refit).
pub(crate) fn fell_back(me: Endpoint, peer: Endpoint, why: &str) {
    static SAID: std::sync::OnceLock<std::sync::Mutex<HashSet<(Endpoint, Endpoint)>>> = std::sync::OnceLock::new();
    let first = SAID.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner()).insert((me, peer));
    if first {
        tracing::warn!(%me, %peer, reason = %why, "no shared memory with this peer: the pair talks TCP");
    } else {
        tracing::debug!(%me, %peer, reason = %why, "no shared memory with this peer: the pair talks TCP");
    }
}

/// A region made for a peer, until the peer has mapped it.
pub(crate) struct MadeRegion {
    region: OwnRegion,
    lend: u64,
    stream: u64,
}

impl MadeRegion {
    /// The peer mapped the region and its answer named its acknowledgement
    /// page `acks`: the sending end of the link.
    pub(crate) fn attach(self, acks: RegionRef) -> io::Result<ShmOut> {
        let acks = shm::open_acks(acks)?;
        Ok(ShmOut::new(self.region, acks, self.lend, self.stream))
    }
}

/// The receiving end of a shared-memory link: the peer's region and the
/// message being streamed through it.
pub(crate) struct ShmReceiver {
    shm: ShmIn,
    partial: Option<Partial>,
    /// Checksum of the streamed message so far.
    crc: u32,
}

/// A message streamed through shared memory, partly arrived.
struct Partial {
    round: u32,
    total: u64,
    bytes: Vec<u8>,
    filled: usize,
}

impl ShmReceiver {
    /// Where the sender finds this side's acknowledgement page.
    pub(crate) fn acks(&self) -> io::Result<RegionRef> {
        self.shm.acks()
    }

    /// Whether a streamed message is partly arrived (only its chunks, or an
    /// abort, may come next).
    pub(crate) fn mid_message(&self) -> bool {
        self.partial.is_some()
    }

    /// Takes a `lent` or `chunk` frame (`kind`) of `round` with payload
    /// `info`; returns the message once it is whole. `max` bounds a
    /// streamed message's length, `pool` holds the buffers they are
    /// gathered in.
    pub(crate) fn frame(
        &mut self,
        kind: u8,
        round: u32,
        info: &[u8; SHM_INFO],
        checksum: bool,
        max: u64,
        pool: &Arc<FramePool>,
    ) -> Result<Option<Payload>, Stop> {
        let [a, offset, n, sum] = crate::frame::decode_shm_info(info);
        let sum = sum as u32;
        if kind == LENT {
            // (`n` is the peer's: no message from it is longer than what
            // this rank's program expects from it.)
            if n > max {
                return Err(Stop::Broken(format!("a lent message of {n} bytes exceeds the limit of {max}")));
            }
            let (ptr, release) = self.shm.lent(a, offset, n).map_err(|e| Stop::Broken(e.to_string()))?;
            // SAFETY: `ShmIn::lent` checked the range lies in the mapped
            // lend area, which the sender leaves alone until `release` is
            // dropped (also when the checksum fails below: the lent is
            // dropped then, and with it the release).
            let lent = unsafe { Lent::new(ptr, n as usize, release) };
            if checksum && crc32c::crc32c(lent.as_slice()) != sum {
                return Err(Stop::Corrupt(round));
            }
            return Ok(Some(Payload::Lent(lent)));
        }
        // A chunk of a message of `a` bytes.
        let p = match &mut self.partial {
            Some(p) if p.round == round && p.total == a => p,
            Some(_) => return Err(Stop::Broken("chunk of another message in the middle of one".into())),
            None => {
                if a > max {
                    return Err(Stop::Broken(format!("message of {a} bytes exceeds the limit of {max}")));
                }
                let bytes = pool.take(a as usize).map_err(|e| Stop::Broken(e.to_string()))?;
                self.crc = 0;
                self.partial.insert(Partial { round, total: a, bytes, filled: 0 })
            }
        };
        // (`n` is the peer's: checked, never wrapped.)
        if n.checked_add(p.filled as u64).is_none_or(|end| end > p.total) {
            return Err(Stop::Broken(format!("a chunk of {n} bytes overruns its message of {}", p.total)));
        }
        let at = p.filled;
        self.shm.chunk(offset, n, &mut p.bytes[at..at + n as usize]).map_err(|e| Stop::Broken(e.to_string()))?;
        p.filled += n as usize;
        if checksum {
            self.crc = crc32c::crc32c_append(self.crc, &p.bytes[at..p.filled]);
        }
        if (p.filled as u64) < p.total {
            return Ok(None);
        }
        let Some(p) = self.partial.take() else { return Ok(None) };
        if checksum && self.crc != sum {
            return Err(Stop::Corrupt(round));
        }
        Ok(Some(pool.payload(p.bytes, p.filled)))
    }
}

/// One message to send through a shared-memory link.
pub(crate) struct ShmMessage<'a> {
    pub(crate) me: Endpoint,
    pub(crate) to: Endpoint,
    pub(crate) round: u32,
    pub(crate) payload: &'a Payload,
    /// Sum the bytes (CRC-32C) for the receiver to check.
    pub(crate) checksum: bool,
    /// Flip a byte after the checksum (fault injection through the link's
    /// frame hook).
    pub(crate) corrupt: bool,
    /// How long to wait for stream space before giving up.
    pub(crate) wait: Duration,
}

/// Sends a message through the region `out` for the peer, notifying it on
/// its stream `w`; `status` tells whether the peer is still there, `bucket`
/// paces the copies.
pub(crate) fn send(
    out: &mut ShmOut,
    w: &mut BufWriter<TcpStream>,
    status: &PeerStatus,
    bucket: Option<&mut TokenBucket>,
    m: ShmMessage<'_>,
) -> Result<(), TransportError> {
    let len = payload_len(m.payload);
    out.ready().map_err(|e| TransportError::Broken { peer: m.to, problem: e.to_string() })?;
    match place(out, len, status, m.to)? {
        Placement::Lent { seq, offset } => send_lent(out, w, bucket, &m, (seq, offset, len)),
        Placement::Stream => send_streamed(out, w, status, bucket, &m, len),
    }
}

/// Copies a message whole into the lend area at `offset` (its placement
/// `(seq, offset, len)`) and tells the peer where it lies.
fn send_lent(
    out: &mut ShmOut,
    w: &mut BufWriter<TcpStream>,
    mut bucket: Option<&mut TokenBucket>,
    m: &ShmMessage<'_>,
    (seq, offset, len): (u64, u64, u64),
) -> Result<(), TransportError> {
    let to = m.to;
    let dst = out.at(offset);
    let mut pos = 0usize;
    // SAFETY: the placement reserved `len` bytes at `dst` for this
    // sender, and no run or packed piece is copied past them (each
    // is checked to end by `len`; a packed piece's view covers
    // exactly its `n` bytes); the executor's contract for the
    // payload (its memory valid, in bounds and unwritten).
    unsafe {
        for_payload_items(m.payload, SHORT_RUN, |item| match item {
            Item::Run(run) => {
                if pos + run.len() <= len as usize {
                    copy_paced(run, dst.add(pos), &mut bucket);
                }
                pos += run.len();
            }
            // A piece of short rows, or one to convert: packed by
            // one strided copy (converting into its wire type).
            Item::Short { counts, view: from @ StridedRef { dtype: wire, .. } } | Item::Convert { counts, view: from, wire } => {
                let n = (counts.iter().product::<u64>() * wire.size()) as usize;
                if pos + n <= len as usize {
                    if let Some(b) = bucket.as_deref_mut() {
                        b.pace(n as u64);
                    }
                    let to = StridedRef::new(dst.add(pos), n, 0, packed_strides(counts), wire);
                    copy_strided_unfenced(counts, &from, &to);
                }
                pos += n;
            }
        })
    }
    .map_err(|e| TransportError::Broken { peer: to, problem: e.to_string() })?;
    // SAFETY: as above; `len` bytes, now written.
    let bytes = unsafe { std::slice::from_raw_parts_mut(dst, len as usize) };
    let sum = if m.checksum { crc32c::crc32c(bytes) } else { 0 };
    if m.corrupt {
        if let Some(b) = bytes.get_mut(len as usize / 2) {
            *b ^= 0x40;
        }
    }
    shm::publish();
    write_shm_frame(w, LENT, m.round, shm_info(seq, offset, len, sum as u64)).map_err(|_| TransportError::Disconnected { peer: to })
}

/// Streams a message of `len` bytes through the region's stream area, a
/// chunk at a time, as the peer frees room.
fn send_streamed(
    out: &mut ShmOut,
    w: &mut BufWriter<TcpStream>,
    status: &PeerStatus,
    bucket: Option<&mut TokenBucket>,
    m: &ShmMessage<'_>,
    len: u64,
) -> Result<(), TransportError> {
    let mut sink = StreamSink {
        out,
        w,
        status,
        bucket,
        me: m.me,
        to: m.to,
        round: m.round,
        total: len,
        checksum: m.checksum,
        corrupt: m.corrupt,
        sum: 0,
        sent: 0,
        chunk: (0, 0, 0),
        deadline: Instant::now() + m.wait,
        err: None,
    };
    // Pieces left unconverted are converted a few KiB at a time
    // into a buffer in cache and put from there.
    let mut bounce = Vec::new();
    // SAFETY: the executor's contract for the payload (a converted
    // piece's view is in bounds of the sender's memory, checked by
    // `for_payload_items`).
    unsafe {
        for_payload_items(m.payload, 0, |item| match item {
            Item::Run(run) => sink.put(run),
            Item::Short { counts, view } => for_each_run(counts, &view, |run| sink.put(run)),
            Item::Convert { counts, view, wire } => for_each_run(counts, &view, |run| {
                let (from, to) = (view.dtype.size() as usize, wire.size() as usize);
                for part in run.chunks(BOUNCE_ELEMS * from) {
                    bounce.resize(part.len() / from * to, 0);
                    reshard::convert_slice(view.dtype, part, wire, &mut bounce);
                    sink.put(&bounce);
                }
            }),
        })
    }
    .map_err(|e| TransportError::Broken { peer: m.to, problem: e.to_string() })?;
    if let Some(e) = sink.err.take() {
        return Err(e);
    }
    if len == 0 {
        sink.next_chunk()?;
        sink.emit()?;
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
                // SAFETY: by the caller's contract (each part lies inside
                // `src`, so inside the `src.len()` bytes at `dst`).
                unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), dst.add(i * PACE_CHUNK as usize), part.len()) }
            }
        }
    }
}

/// Elements converted at a time into the bounce buffer of a streamed
/// message's unconverted pieces (a few KiB: it stays in cache).
const BOUNCE_ELEMS: usize = 2048;

/// Longest a sender waits for lend space to come back for a message that
/// fits its pair's lend area, before it streams the message instead: the
/// receiver gives space back as soon as it has read the message before
/// (a few milliseconds), and a message streamed costs its receiver a
/// buffer of its size. Bounded, so that two ranks sending each other
/// (each waiting for the other to read) go on.
const LEND_WAIT: Duration = Duration::from_millis(50);

/// Where a message of `len` bytes goes: lent as soon as there is room in
/// the pair's lend area (within [`LEND_WAIT`], while the peer is there),
/// else streamed.
fn place(out: &mut ShmOut, len: u64, status: &PeerStatus, to: Endpoint) -> Result<Placement, TransportError> {
    let until = Instant::now() + LEND_WAIT;
    let mut tries = 0u32;
    loop {
        let placed = out.place(len);
        if matches!(placed, Placement::Lent { .. }) || !out.fits(len) || Instant::now() >= until {
            return Ok(placed);
        }
        match status.get() {
            ALIVE => {}
            BROKEN => return Err(TransportError::Broken { peer: to, problem: "peer went away while we waited to lend to it".into() }),
            _ => return Err(TransportError::Disconnected { peer: to }),
        }
        tries += 1;
        if tries < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(50));
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
            // SAFETY: inside the chunk the sender owns in the stream area
            // (`n` <= the room left in it).
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
                return Err(TransportError::timeout(self.me, self.round));
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
