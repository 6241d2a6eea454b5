//! [`RawPeer`]: a hand-driven client connection for testing how a node
//! copes with misbehaving peers.

use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::auth;
use super::error::RemoteError;
use super::secret::Secret;
use super::wire::{read_frame, Message, Opener, Sealer};
use crate::codec;

/// Largest frame a raw peer reads.
const RAW_MAX_FRAME: usize = 16 * 1024 * 1024;

/// A client connection driven by hand, frame by frame, to test a node
/// against misbehaving peers: send arbitrary bytes, or authenticated frames
/// with arbitrary sequence numbers, kinds and bodies. Sends no heartbeats by
/// itself. Not meant for anything but tests.
#[derive(Debug)]
pub struct RawPeer {
    stream: TcpStream,
    peer: String,
    session: Option<Session>,
}

struct Session {
    sealer: Sealer,
    opener: Opener,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("next_seq", &self.sealer.next_seq()).finish_non_exhaustive()
    }
}

impl RawPeer {
    /// Opens a TCP connection to a node, without authenticating.
    pub async fn connect(addr: std::net::SocketAddr) -> Result<Self, RemoteError> {
        let peer = addr.to_string();
        let stream = TcpStream::connect(addr).await.map_err(|source| RemoteError::Connect { peer: peer.clone(), source })?;
        Ok(Self { stream, peer, session: None })
    }

    /// This end's address (the peer address the node sees and logs).
    pub fn local_addr(&self) -> Result<std::net::SocketAddr, RemoteError> {
        self.stream.local_addr().map_err(|e| self.io_error(e))
    }

    /// Runs the client side of the handshake with `secret`.
    pub async fn handshake(&mut self, secret: &Secret) -> Result<(), RemoteError> {
        let keys = auth::client(&mut self.stream, secret, &self.peer).await?;
        self.session = Some(Session { sealer: Sealer::new(keys.send), opener: Opener::new(keys.recv) });
        Ok(())
    }

    fn session(&mut self) -> Result<&mut Session, RemoteError> {
        let peer = self.peer.clone();
        self.session.as_mut().ok_or_else(|| RemoteError::handshake(&peer, "not authenticated yet"))
    }

    fn io_error(&self, err: impl std::fmt::Display) -> RemoteError {
        RemoteError::ConnectionLost { peer: self.peer.clone(), problem: err.to_string() }
    }

    /// Writes raw bytes.
    pub async fn send_bytes(&mut self, bytes: &[u8]) -> Result<(), RemoteError> {
        self.stream.write_all(bytes).await.map_err(|e| self.io_error(e))
    }

    /// Closes the sending direction (the node reads end-of-stream).
    pub async fn finish_sending(&mut self) -> Result<(), RemoteError> {
        self.stream.shutdown().await.map_err(|e| self.io_error(e))
    }

    /// The sequence number the next correctly numbered frame needs.
    pub fn next_seq(&self) -> u64 {
        self.session.as_ref().map_or(0, |session| session.sealer.next_seq())
    }

    /// Sends an authenticated frame with any sequence number, kind byte and
    /// body (the sequence is not advanced: see [`RawPeer::send_ping`]).
    pub async fn send_sealed(&mut self, seq: u64, kind: u8, body: &[u8]) -> Result<(), RemoteError> {
        let frame = self.session()?.sealer.seal_raw(seq, kind, body.to_vec(), RAW_MAX_FRAME).map_err(|e| self.io_error(e))?;
        self.send_bytes(&frame).await
    }

    /// Sends a correctly numbered ping.
    pub async fn send_ping(&mut self) -> Result<(), RemoteError> {
        self.send_next(&Message::Ping).await
    }

    /// Sends a correctly numbered call to the actor served as `name`
    /// (`msg` is the encoded message), as request `req`.
    pub async fn send_call(&mut self, req: u64, name: &str, msg: &[u8]) -> Result<(), RemoteError> {
        self.send_next(&Message::Request { req: Some(req), name: name.to_owned(), actor: uuid::Uuid::nil(), msg: msg.to_vec() }).await
    }

    /// The body of a [`FrameKind::Ping`](super::FrameKind::Ping) frame, e.g. for [`RawPeer::send_sealed`].
    pub fn ping_body() -> Vec<u8> {
        codec::encode(&()).unwrap_or_default()
    }

    async fn send_next(&mut self, msg: &Message) -> Result<(), RemoteError> {
        let frame = self.session()?.sealer.seal(msg, RAW_MAX_FRAME).map_err(|e| self.io_error(e))?;
        self.send_bytes(&frame).await
    }

    /// Waits (at most `after`) for the reply to a call, skipping pings;
    /// returns its request id and the reply (the encoded value, or the
    /// failure as text).
    pub async fn recv_reply(&mut self, after: Duration) -> Result<(u64, Result<Vec<u8>, String>), RemoteError> {
        let peer = self.peer.clone();
        tokio::time::timeout(after, async {
            loop {
                let payload = read_frame(&mut self.stream, RAW_MAX_FRAME).await.map_err(|e| self.io_error(e))?;
                let msg = self.session()?.opener.open(&payload, RAW_MAX_FRAME).map_err(|e| self.io_error(e))?;
                match msg {
                    Message::Reply { req, result } => return Ok((req, result.map_err(|failure| failure.to_string()))),
                    Message::Close { why } => return Err(self.io_error(format!("closed by the node: {why}"))),
                    _ => {}
                }
            }
        })
        .await
        .map_err(|_| RemoteError::Timeout { peer, what: "raw reply", after })?
    }

    /// Reads (and discards) whatever the node sends until it closes the
    /// connection; `true` if it did so within `after`.
    pub async fn closed_within(&mut self, after: Duration) -> bool {
        let mut buf = vec![0u8; 4096];
        tokio::time::timeout(after, async {
            loop {
                match tokio::io::AsyncReadExt::read(&mut self.stream, &mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await
        .is_ok()
    }
}
