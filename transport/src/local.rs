//! The in-process transport: every rank is a thread of this process, and
//! messages are channel sends of segment lists (no payload copy; the
//! receiver copies straight from the sender's buffers). A sender's `flush`
//! waits until its receivers have dropped every payload it posted (a
//! payload still queued when its receiver goes away is dropped with the
//! channel), so a sender never changes memory a receiver may still read.

use crate::transport::{Outstanding, Payload, Transport, TransportError};
use reshard::Endpoint;
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Instant;

enum Envelope {
    Data { round: u32, from: Endpoint, payload: Payload },
    Abort { from: Endpoint, reason: String },
}

/// One rank's end of the in-process fabric.
pub struct LocalTransport {
    me: Endpoint,
    peers: HashMap<Endpoint, Sender<Envelope>>,
    inbox: Receiver<Envelope>,
    stash: Vec<(u32, Endpoint, Payload)>,
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
    peers: HashMap<Endpoint, Sender<Envelope>>,
}

impl AbortHandle {
    /// Sends an abort to every other rank.
    pub fn abort(&self, reason: &str) {
        for (peer, tx) in &self.peers {
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
    let peers: HashMap<Endpoint, Sender<Envelope>> = endpoints.iter().copied().zip(senders).collect();
    endpoints
        .iter()
        .zip(receivers)
        .map(|(&me, inbox)| LocalTransport { me, peers: peers.clone(), inbox, stash: Vec::new(), outstanding: Arc::default() })
        .collect()
}

impl Transport for LocalTransport {
    fn me(&self) -> Endpoint {
        self.me
    }

    fn send(&mut self, round: u32, to: Endpoint, mut payload: Payload) -> Result<(), TransportError> {
        let tx = self.peers.get(&to).ok_or(TransportError::Disconnected { peer: to })?;
        if let Payload::Segments { release, .. } = &mut payload {
            *release = self.outstanding.post();
        }
        tx.send(Envelope::Data { round, from: self.me, payload }).map_err(|_| TransportError::Disconnected { peer: to })
    }

    fn recv(&mut self, round: u32, deadline: Instant) -> Result<(Endpoint, Payload), TransportError> {
        if let Some(i) = self.stash.iter().position(|(r, _, _)| *r == round) {
            let (_, from, payload) = self.stash.swap_remove(i);
            return Ok((from, payload));
        }
        loop {
            let wait = deadline.saturating_duration_since(Instant::now());
            match self.inbox.recv_timeout(wait) {
                Ok(Envelope::Data { round: r, from, payload }) if r == round => return Ok((from, payload)),
                Ok(Envelope::Data { round: r, from, payload }) => self.stash.push((r, from, payload)),
                Ok(Envelope::Abort { from, reason }) => return Err(TransportError::PeerAborted { peer: from, reason }),
                Err(RecvTimeoutError::Timeout) => return Err(TransportError::Timeout { me: self.me, round }),
                // Every sender is gone: nothing can arrive any more.
                Err(RecvTimeoutError::Disconnected) => return Err(TransportError::Timeout { me: self.me, round }),
            }
        }
    }

    fn flush(&mut self, round: u32, deadline: Instant) -> Result<(), TransportError> {
        if self.outstanding.wait_idle(deadline) {
            Ok(())
        } else {
            Err(TransportError::Timeout { me: self.me, round })
        }
    }

    fn abort(&mut self, reason: &str) {
        self.abort_handle().abort(reason);
    }
}
