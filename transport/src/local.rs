//! The in-process transport: every rank is a thread of this process, and
//! messages are channel sends of segment lists (no payload copy; the
//! receiver copies straight from the sender's buffers). A sender's `flush`
//! waits until its receivers have dropped every payload it posted (a
//! payload still queued when its receiver goes away is dropped with the
//! channel), so a sender never changes memory a receiver may still read.

use crate::transport::{Outstanding, Payload, RoundInbox, Transport, TransportError, WithAbort};
use reshard::Endpoint;
use std::collections::HashMap;
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::Instant;

enum Envelope {
    Data { round: u32, from: Endpoint, payload: Payload },
    Abort { from: Endpoint, reason: String },
}

/// One rank's end of the in-process fabric.
pub struct LocalTransport {
    me: Endpoint,
    /// Every rank's inbox, shared by the fabric's ends (one map, not one
    /// per rank: thousands of ranks would make it quadratic).
    peers: Arc<HashMap<Endpoint, Sender<Envelope>>>,
    inbox: RoundInbox<Envelope>,
    outstanding: Arc<Outstanding>,
}

impl std::fmt::Debug for LocalTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTransport").field("me", &self.me).field("peers", &self.peers.len()).finish()
    }
}

/// Tells every rank of a fabric to give up, on behalf of one of them (for
/// when that rank's thread could not even start).
#[derive(Clone)]
pub struct AbortHandle {
    me: Endpoint,
    peers: Arc<HashMap<Endpoint, Sender<Envelope>>>,
}

impl AbortHandle {
    /// Sends an abort to every other rank.
    pub fn abort(&self, reason: &str) {
        for (peer, tx) in self.peers.iter() {
            if *peer != self.me {
                let _ = tx.send(Envelope::Abort { from: self.me, reason: reason.to_string() });
            }
        }
    }
}

impl LocalTransport {
    /// A handle that aborts on this rank's behalf.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle { me: self.me, peers: self.peers.clone() }
    }
}

/// Connects `endpoints` all-to-all; returns their transports in order.
pub fn local_fabric(endpoints: &[Endpoint]) -> Vec<LocalTransport> {
    let (senders, receivers): (Vec<_>, Vec<_>) = endpoints.iter().map(|_| channel::<Envelope>()).unzip();
    let peers: Arc<HashMap<Endpoint, Sender<Envelope>>> = Arc::new(endpoints.iter().copied().zip(senders).collect());
    endpoints
        .iter()
        .zip(receivers)
        .map(|(&me, inbox)| LocalTransport { me, peers: peers.clone(), inbox: RoundInbox::new(inbox), outstanding: Arc::default() })
        .collect()
}

impl WithAbort for LocalTransport {
    fn abort_all(&self) -> Box<dyn Fn(&str) + Send> {
        let h = self.abort_handle();
        Box::new(move |reason| h.abort(reason))
    }
}

impl Transport for LocalTransport {
    fn me(&self) -> Endpoint {
        self.me
    }

    fn send(&mut self, round: u32, to: Endpoint, mut payload: Payload) -> Result<(), TransportError> {
        let tx = self.peers.get(&to).ok_or(TransportError::Disconnected { peer: to })?;
        match &mut payload {
            Payload::Segments { release, .. } => *release = self.outstanding.post(),
            Payload::Pieces(sent) => sent.release = self.outstanding.post(),
            Payload::Bytes(_) | Payload::Lent(_) | Payload::Stream(_) => {}
        }
        tx.send(Envelope::Data { round, from: self.me, payload }).map_err(|_| TransportError::Disconnected { peer: to })
    }

    fn recv(&mut self, round: u32, deadline: Instant) -> Result<(Endpoint, Payload), TransportError> {
        self.inbox.recv(self.me, round, deadline, |e| match e {
            Envelope::Data { round, from, payload } => Ok((round, from, payload)),
            Envelope::Abort { from, reason } => Err(TransportError::PeerAborted { peer: from, reason }),
        })
    }

    fn flush(&mut self, round: u32, deadline: Instant) -> Result<(), TransportError> {
        if self.outstanding.wait_idle(deadline) {
            Ok(())
        } else {
            Err(TransportError::timeout(self.me, round))
        }
    }

    fn abort(&mut self, reason: &str) {
        self.abort_handle().abort(reason);
    }
}
