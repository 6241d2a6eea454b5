//! The transport trait: how one rank's messages reach its peers.
//!
//! A message is the pieces one rank sends one peer in one round, as strided
//! segments. A transport either hands the segments to the receiver as they
//! are (in-process, shared memory: the receiver copies straight out of the
//! sender's buffers, one copy per byte) or streams them as bytes (TCP).

use crate::copy::{fits, packed_strides, prefetch, StridedRef, PREFETCH_AHEAD};
use crate::memory::RawBuf;
use crate::StagingArea;
use reshard::SendPieceView;
use reshard::MAX_DIMS;
use reshard::{DType, Endpoint, Message, SendPiece};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;
use thiserror::Error;

/// One piece of a message as the sender holds it: a strided view (whose
/// region only `unsafe` code can name, [`StridedRef::new`]) and the
/// piece's extent. Readers check the extent against the view's region
/// before they touch memory.
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    view: StridedRef,
    numel: u64,
    extent: [u64; MAX_DIMS],
    ndim: u8,
}

impl Segment {
    /// A segment for a piece of extent `extent` at `view` (at most
    /// [`MAX_DIMS`] dimensions; more are cut off).
    pub fn new(view: StridedRef, extent: &[u64]) -> Segment {
        let n = extent.len().min(MAX_DIMS);
        let mut e = [0u64; MAX_DIMS];
        e[..n].copy_from_slice(&extent[..n]);
        // Saturating: a count past `u64` matches no piece's.
        Segment { view, numel: e[..n].iter().fold(1u64, |a, &c| a.saturating_mul(c)), extent: e, ndim: n as u8 }
    }

    /// Where the elements are (a buffer of the sender, or its staging).
    pub fn view(&self) -> &StridedRef {
        &self.view
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.numel
    }

    /// The piece's extent.
    pub fn extent(&self) -> &[u64] {
        &self.extent[..self.ndim as usize]
    }
}

/// What travels in one message.
#[derive(Debug)]
pub enum Payload {
    /// Segments in the sender's memory, one per piece; the `Arc`s keep any
    /// staging they point into alive until the receiver drops the payload.
    Segments {
        /// One per piece, in wire order.
        segments: Vec<Segment>,
        /// Staging areas that segments point into.
        keep_alive: Vec<Arc<Vec<u8>>>,
        /// Tells the sender, when dropped, that its memory is free again.
        release: Release,
    },
    /// The sender's message read in place: its pieces as its program lists
    /// them, in its buffers (no list of segments is built). The executor
    /// sends this; every transport reads it with [`SentPieces::pieces`].
    Pieces(SentPieces),
    /// The pieces packed back to back in wire dtype, still on the TCP
    /// stream they arrive on: the receiver reads them straight into place.
    Stream(crate::stream::StreamFrame),
    /// The pieces packed back to back in wire dtype.
    Bytes(Vec<u8>),
    /// The pieces packed back to back in wire dtype, in memory the
    /// transport lends (a shared-memory area, a pooled frame buffer) until
    /// the payload is dropped.
    Lent(Lent),
}

/// Packed bytes lent by a transport: readable until dropped, then handed
/// back through its [`Release`].
#[derive(Debug)]
pub struct Lent {
    ptr: *const u8,
    len: usize,
    _release: Release,
}

impl Lent {
    /// Lends `len` bytes at `ptr`; `release` runs when the payload is done.
    ///
    /// # Safety
    /// `ptr` must be valid for reads of `len` bytes, and those bytes must not
    /// be written, until `release` is dropped.
    pub unsafe fn new(ptr: *const u8, len: usize, release: Release) -> Lent {
        Lent { ptr, len, _release: release }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: valid and unchanging while `self` lives (`Lent::new`).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

// SAFETY: segments point into memory that outlives the executor's threads
// (see `memory::MemView`) or into the `Arc`ed staging carried alongside.
unsafe impl Send for Payload {}

impl Payload {
    /// Whether the payload points into the sender's memory (the receiver
    /// reads the sender's buffers), rather than holding or lending bytes.
    pub fn borrows_sender(&self) -> bool {
        matches!(self, Payload::Segments { .. } | Payload::Pieces(_))
    }
}

/// One message's pieces as its sender holds them: the sender's message
/// (packed pieces, read in place) and its buffers, plus a staging area
/// for the pieces whose wire type differs from their buffer's (converted
/// by the sender, back to back in order, each at an offset aligned to its
/// wire element size) — or, where the transport converts as it copies
/// ([`Transport::converts_on_send`]), no staging: those pieces are read in
/// their buffers' type and converted on their way into the transport's
/// memory.
///
/// Reading it costs no allocation and no list per piece: each piece's
/// view is made, and checked against its region, as it is read.
pub struct SentPieces {
    /// The sender's message.
    message: *const Message<SendPiece>,
    /// The sender's buffers, indexed by a span's buffer.
    regions: *const RawBuf,
    /// Number of regions.
    n_regions: usize,
    /// Converted pieces, in wire type.
    staging: StagingArea,
    /// Pieces to convert are left to the transport (no staging).
    unconverted: bool,
    /// Tells the sender, when dropped, that its memory is free again.
    pub(crate) release: Release,
}

impl std::fmt::Debug for SentPieces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentPieces").field("pieces", &self.len()).field("staging", &self.staging.as_slice().len()).finish()
    }
}

/// One piece of [`SentPieces`] as read: its elements and its extent.
#[derive(Clone, Copy, Debug)]
pub struct SentPiece<'a> {
    /// Where its elements are (checked to be in bounds of the region it
    /// names): in wire type, but for a piece left to the transport to
    /// convert, in its buffer's.
    pub view: StridedRef,
    /// Its extent.
    pub extent: &'a [u64],
    /// The type it travels in.
    pub wire: DType,
}

impl SentPieces {
    /// The pieces of `message` in the buffers `regions`, with `staging`
    /// holding the converted ones (as [`SentPieces`] describes).
    ///
    /// # Safety
    /// `message` and `regions` (and the memory each region names) must stay
    /// valid, and the regions' bytes that the pieces read unwritten, until
    /// the payload is dropped: the sender waits for its release before it
    /// touches them again (and so before its program and buffer list go).
    pub(crate) unsafe fn new(message: &Message<SendPiece>, regions: &[RawBuf], staging: StagingArea) -> SentPieces {
        SentPieces {
            message,
            regions: regions.as_ptr(),
            n_regions: regions.len(),
            staging,
            unconverted: false,
            release: Release::default(),
        }
    }

    /// The pieces of `message` in the buffers `regions`, those to convert
    /// left to the transport: read in their buffers' type, converted as
    /// they are copied into its memory.
    ///
    /// # Safety
    /// As [`SentPieces::new`].
    pub(crate) unsafe fn unconverted(message: &Message<SendPiece>, regions: &[RawBuf]) -> SentPieces {
        // SAFETY: the caller's contract is `new`'s.
        SentPieces { unconverted: true, ..unsafe { SentPieces::new(message, regions, StagingArea::default()) } }
    }

    /// Whether some pieces are still in their buffers' type, for the
    /// transport to convert (such a payload cannot go out as its bytes).
    pub fn leaves_conversion(&self) -> bool {
        self.unconverted && self.message().pieces.converting() > 0
    }

    fn message(&self) -> &Message<SendPiece> {
        // SAFETY: valid while `self` lives (`SentPieces::new`).
        unsafe { &*self.message }
    }

    /// Number of pieces.
    pub fn len(&self) -> usize {
        self.message().pieces.len()
    }

    /// Whether there is no piece.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes on the wire.
    pub fn wire_bytes(&self) -> u64 {
        self.message().wire_bytes()
    }

    /// The pieces in wire order: each one's view (in wire type, or in its
    /// buffer's where the conversion is left to the transport), or, for a
    /// piece that does not lie inside its region, the piece as the sender
    /// lists it.
    pub fn pieces(&self) -> impl Iterator<Item = Result<SentPiece<'_>, SendPieceView<'_>>> + '_ {
        let mut pos = 0u64;
        self.message().pieces.views().map(move |p| self.piece(&p, &mut pos))
    }

    fn piece<'a>(&'a self, p: &SendPieceView<'a>, pos: &mut u64) -> Result<SentPiece<'a>, SendPieceView<'a>> {
        prefetch(p.words_ptr().wrapping_byte_add(PREFETCH_AHEAD));
        let (extent, dtype, wire) = (p.extent(), p.dtype(), p.wire());
        if dtype == wire || self.unconverted {
            let span = p.span();
            let region = (span.buffer as usize) < self.n_regions;
            if region {
                // SAFETY: index checked; the list is valid while `self`
                // lives (`SentPieces::new`).
                let buf = unsafe { *self.regions.add(span.buffer as usize) };
                if fits(extent, buf.len, span.base, &span.strides, dtype) {
                    // SAFETY: the region is valid while `self` lives
                    // (`SentPieces::new`); the offsets are in bounds.
                    let view = unsafe { StridedRef::new(buf.ptr, buf.len, span.base, span.strides, dtype) };
                    return Ok(SentPiece { view, extent, wire });
                }
            }
            Err(*p)
        } else {
            let elem = wire.size();
            // (`pos` is `u64::MAX` after a piece past `u64`: so is `at`,
            // and nothing after it fits.)
            let at = pos.checked_next_multiple_of(elem).unwrap_or(u64::MAX);
            let numel = extent.iter().try_fold(1u64, |a, &e| a.checked_mul(e));
            let end = numel.and_then(|n| n.checked_mul(elem)).and_then(|b| b.checked_add(at));
            *pos = end.unwrap_or(u64::MAX);
            let strides = packed_strides(extent);
            let staging = self.staging.as_slice();
            if fits(extent, staging.len(), at / elem, &strides, wire) {
                // SAFETY: the staging area lives, unchanged, as long as
                // `self` (it goes back to its pool only when `self` is
                // dropped); the offsets are in bounds.
                let view = unsafe { StridedRef::new(staging.as_ptr(), staging.len(), at / elem, strides, wire) };
                return Ok(SentPiece { view, extent, wire });
            }
            Err(*p)
        }
    }
}

/// Messages a sender has posted and its receivers have not finished with.
#[derive(Debug, Default)]
pub(crate) struct Outstanding {
    count: Mutex<usize>,
    done: Condvar,
}

impl Outstanding {
    /// Counts one more message in flight and returns its release token.
    pub(crate) fn post(self: &Arc<Self>) -> Release {
        *self.count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        Release(Some(self.clone()), None)
    }

    /// Waits until no message is in flight; false if `deadline` passed first.
    pub(crate) fn wait_idle(&self, deadline: Instant) -> bool {
        let mut n = self.count.lock().unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            n = self.done.wait_timeout(n, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        true
    }
}

/// Dropped by the receiver once it is done with a payload (or by whoever
/// discards it), so the sender may touch the memory the payload points into.
#[derive(Default)]
pub struct Release(Option<Arc<Outstanding>>, Option<Box<dyn FnOnce() + Send>>);

impl Release {
    /// A token that runs `done` when dropped (for transports whose memory
    /// is handed back some other way than through an `Outstanding`).
    pub fn on_drop(done: impl FnOnce() + Send + 'static) -> Release {
        Release(None, Some(Box::new(done)))
    }
}

impl std::fmt::Debug for Release {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Release").field("outstanding", &self.0).field("callback", &self.1.is_some()).finish()
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        if let Some(o) = self.0.take() {
            let mut n = o.count.lock().unwrap_or_else(|e| e.into_inner());
            *n = n.saturating_sub(1);
            o.done.notify_all();
        }
        if let Some(f) = self.1.take() {
            f();
        }
    }
}

/// Why a transport operation failed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum TransportError {
    /// Nothing arrived before the deadline, or nothing more can (every
    /// stream to this rank ended).
    #[error("{me}: {}", timeout_words(*round, waiting, *closed))]
    Timeout {
        /// The waiting rank.
        me: Endpoint,
        /// Round awaited.
        round: u32,
        /// The peers whose message of the round had not arrived, and what
        /// the transport knew of their links then (empty: not known, as
        /// where the waiting was not for messages).
        waiting: Vec<Waiting>,
        /// Every stream to this rank had ended: no message could arrive,
        /// so the rank stopped waiting before its deadline.
        closed: bool,
    },
    /// A peer gave up and told us.
    #[error("{peer} aborted: {reason}")]
    PeerAborted {
        /// Who aborted.
        peer: Endpoint,
        /// Why.
        reason: String,
    },
    /// The stream from a peer broke (closed without a goodbye, or sent
    /// something that is not a valid frame).
    #[error("stream from {peer} broke: {problem}")]
    Broken {
        /// The peer.
        peer: Endpoint,
        /// What went wrong.
        problem: String,
    },
    /// A frame from a peer failed its checksum; its bytes were dropped.
    #[error("frame from {peer} for round {round} failed its checksum")]
    Corrupt {
        /// The peer.
        peer: Endpoint,
        /// Round of the frame.
        round: u32,
    },
    /// The peer is gone (its end of the channel or connection closed).
    #[error("{peer} is unreachable")]
    Disconnected {
        /// The peer.
        peer: Endpoint,
    },
}

impl TransportError {
    /// The deadline passed while `me` waited in `round` (for messages,
    /// or for its own to be taken).
    pub fn timeout(me: Endpoint, round: u32) -> TransportError {
        TransportError::Timeout { me, round, waiting: Vec::new(), closed: false }
    }
}

/// A peer whose message a rank still waited for when it gave up, and what
/// its transport could tell of the link from that peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waiting {
    /// The peer.
    pub peer: Endpoint,
    /// The link from it, in words ([`Transport::link_from`]; `None`: the
    /// transport cannot tell).
    pub link: Option<String>,
}

fn timeout_words(round: u32, waiting: &[Waiting], closed: bool) -> String {
    let mut s = if closed {
        format!("no more round {round} messages can arrive: every stream to this rank ended")
    } else {
        format!("timed out waiting for round {round} messages")
    };
    for (i, w) in waiting.iter().enumerate() {
        s.push_str(if i == 0 { " from " } else { "; " });
        s.push_str(&w.peer.to_string());
        if let Some(link) = &w.link {
            s.push_str(&format!(" ({link})"));
        }
    }
    s
}

/// Moves one rank's messages. One instance per rank.
pub trait Transport: Send {
    /// This rank.
    fn me(&self) -> Endpoint;
    /// Posts a message for `to` in `round`; does not wait for delivery.
    fn send(&mut self, round: u32, to: Endpoint, payload: Payload) -> Result<(), TransportError>;
    /// Waits until `deadline` for the next message of `round` from any peer.
    fn recv(&mut self, round: u32, deadline: Instant) -> Result<(Endpoint, Payload), TransportError>;
    /// Waits until `deadline` for every message sent so far to be consumed
    /// by its receiver, so the memory it pointed into may change again.
    fn flush(&mut self, round: u32, deadline: Instant) -> Result<(), TransportError>;
    /// Tells every peer this rank failed, so none waits for it in vain.
    fn abort(&mut self, reason: &str);
    /// What this rank's end knows of the link from `peer`, in words (for
    /// errors: is it up, is anything arriving on it); `None` if nothing.
    fn link_from(&self, _peer: Endpoint) -> Option<String> {
        None
    }
    /// Whether this transport copies the messages it sends `to` into
    /// memory of its own (a shared-memory area), converting as it copies:
    /// then the sender leaves its pieces unconverted ([`SentPieces`]) and
    /// each converted byte is written once, not into staging first.
    fn converts_on_send(&self, _to: Endpoint) -> bool {
        false
    }
}

/// A transport borrowed for one run, so one fabric can serve many refits.
impl<T: Transport + ?Sized> Transport for &mut T {
    fn me(&self) -> Endpoint {
        (**self).me()
    }

    fn send(&mut self, round: u32, to: Endpoint, payload: Payload) -> Result<(), TransportError> {
        (**self).send(round, to, payload)
    }

    fn recv(&mut self, round: u32, deadline: Instant) -> Result<(Endpoint, Payload), TransportError> {
        (**self).recv(round, deadline)
    }

    fn flush(&mut self, round: u32, deadline: Instant) -> Result<(), TransportError> {
        (**self).flush(round, deadline)
    }

    fn abort(&mut self, reason: &str) {
        (**self).abort(reason)
    }

    fn link_from(&self, peer: Endpoint) -> Option<String> {
        (**self).link_from(peer)
    }

    fn converts_on_send(&self, to: Endpoint) -> bool {
        (**self).converts_on_send(to)
    }
}

/// Messages arriving on a channel, some for later rounds: the receive loop
/// both channel transports share.
pub(crate) struct RoundInbox<E> {
    rx: std::sync::mpsc::Receiver<E>,
    later: Vec<(u32, Endpoint, Payload)>,
}

impl<E> RoundInbox<E> {
    pub(crate) fn new(rx: std::sync::mpsc::Receiver<E>) -> RoundInbox<E> {
        RoundInbox { rx, later: Vec::new() }
    }

    /// The next message of `round`, keeping those of other rounds for
    /// later; `open` turns an event into a message (`round`, sender,
    /// payload) or an error.
    pub(crate) fn recv(
        &mut self,
        me: Endpoint,
        round: u32,
        deadline: Instant,
        open: impl Fn(E) -> Result<(u32, Endpoint, Payload), TransportError>,
    ) -> Result<(Endpoint, Payload), TransportError> {
        if let Some(i) = self.later.iter().position(|(r, _, _)| *r == round) {
            let (_, from, payload) = self.later.swap_remove(i);
            return Ok((from, payload));
        }
        loop {
            let wait = deadline.saturating_duration_since(Instant::now());
            // A timeout, or every sender gone: nothing more will arrive.
            let event = self.rx.recv_timeout(wait).map_err(|e| TransportError::Timeout {
                me,
                round,
                waiting: Vec::new(),
                closed: e == std::sync::mpsc::RecvTimeoutError::Disconnected,
            })?;
            match open(event)? {
                (r, from, payload) if r == round => return Ok((from, payload)),
                other => self.later.push(other),
            }
        }
    }
}

/// A transport that can hand out a way to abort all its peers from any
/// thread (a kill switch: for a rank whose thread cannot even start, or a
/// watchdog past the deadline).
pub trait WithAbort {
    /// A function that tells every peer this rank gave up.
    fn abort_all(&self) -> Box<dyn Fn(&str) + Send>;
}

impl<T: WithAbort + ?Sized> WithAbort for &mut T {
    fn abort_all(&self) -> Box<dyn Fn(&str) + Send> {
        (**self).abort_all()
    }
}
