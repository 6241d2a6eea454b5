//! The transport trait: how one rank's messages reach its peers.
//!
//! A message is the pieces one rank sends one peer in one round, as strided
//! segments. A transport either hands the segments to the receiver as they
//! are (in-process, shared memory: the receiver copies straight out of the
//! sender's buffers, one copy per byte) or streams them as bytes (TCP).

use crate::copy::StridedRef;
use reshard::Endpoint;
use reshard::MAX_DIMS;
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
        Segment { view, numel: e[..n].iter().product(), extent: e, ndim: n as u8 }
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

/// Messages a sender has posted and its receivers have not finished with.
#[derive(Debug, Default)]
pub struct Outstanding {
    count: Mutex<usize>,
    done: Condvar,
}

impl Outstanding {
    /// Counts one more message in flight and returns its release token.
    pub fn post(self: &Arc<Self>) -> Release {
        *self.count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        Release(Some(self.clone()), None)
    }

    /// Waits until no message is in flight; false if `deadline` passed first.
    pub fn wait_idle(&self, deadline: Instant) -> bool {
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
    /// is handed back some other way than through an [`Outstanding`]).
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
    /// Nothing arrived before the deadline.
    #[error("{me}: timed out waiting for round {round} messages")]
    Timeout {
        /// The waiting rank.
        me: Endpoint,
        /// Round awaited.
        round: u32,
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
            let event = self.rx.recv_timeout(wait).map_err(|_| TransportError::Timeout { me, round })?;
            match open(event)? {
                (r, from, payload) if r == round => return Ok((from, payload)),
                other => self.later.push(other),
            }
        }
    }
}
