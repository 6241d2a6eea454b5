//! The wire format: frames, frame kinds, sequence numbers and per-frame
//! authentication tags. Every value is encoded through [`crate::codec`].

use std::time::Duration;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt};
use uuid::Uuid;

use super::clock::Clock;
use crate::actor::ActorInfo;
use crate::codec::{self, CodecError, FRAME_HEADER_LEN};
use crate::error::ActorError;
use crate::supervision::StopReason;

pub(crate) type HmacSha256 = Hmac<Sha256>;

/// Length of an HMAC-SHA256 tag.
pub(crate) const TAG_LEN: usize = 32;

/// Room left in a frame for everything but a message's own encoding (the
/// sealed frame's fields, the request's name, ids and lengths).
pub(crate) const FRAME_OVERHEAD: usize = 1024;

/// Longest actor name a node serves (so a request always fits its frame).
pub const MAX_NAME_LEN: usize = 256;

/// The kind byte of an authenticated frame. Any other value is a protocol
/// error that drops the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Liveness only; body `()`.
    Ping = 1,
    /// Resolve a served name; body `(request id, name)`.
    Lookup = 2,
    /// Answer to a lookup; body `(request id, Result<ActorInfo, String>)`.
    Found = 3,
    /// A message for a served actor; body `(Option<request id>, name, actor id, encoded message)`;
    /// no request id for a `tell`, the nil id for "whatever actor has this name".
    Request = 4,
    /// Answer to a request; body `(request id, Result<encoded reply, failure>)`.
    Reply = 5,
    /// A served actor that was looked up on this connection stopped; body `(actor id, StopReason)`.
    Stopped = 6,
    /// The sender closes the connection; body `why: String`.
    Close = 7,
}

impl FrameKind {
    fn from_byte(byte: u8) -> Option<Self> {
        Some(match byte {
            1 => Self::Ping,
            2 => Self::Lookup,
            3 => Self::Found,
            4 => Self::Request,
            5 => Self::Reply,
            6 => Self::Stopped,
            7 => Self::Close,
            _ => return None,
        })
    }
}

/// Why a call on the serving side produced no reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Error)]
pub(crate) enum Failure {
    /// The handler returned this error.
    #[error("{0}")]
    Handler(ActorError),
    /// The actor is stopped.
    #[error("actor stopped: {0}")]
    Stopped(StopReason),
    /// The serving node's call timed out.
    #[error("timed out after {0:?} on the serving node")]
    Timeout(Duration),
    /// No actor is served under this name (with this id).
    #[error("no actor named {0:?} is served")]
    UnknownActor(String),
    /// The message could not be decoded as the actor's message type.
    #[error("undecodable message: {0}")]
    BadMessage(String),
    /// The reply could not be encoded.
    #[error("unencodable reply: {0}")]
    BadReply(String),
}

/// A decoded, authenticated frame.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Message {
    Ping,
    Lookup { req: u64, name: String },
    Found { req: u64, result: Result<ActorInfo, String> },
    Request { req: Option<u64>, name: String, actor: Uuid, msg: Vec<u8> },
    Reply { req: u64, result: Result<Vec<u8>, Failure> },
    Stopped { actor: Uuid, reason: StopReason },
    Close { why: String },
}

impl Message {
    /// Roughly how many bytes the frame will have.
    pub(crate) fn size_hint(&self) -> usize {
        match self {
            Self::Request { msg, .. } => msg.len(),
            Self::Reply { result: Ok(bytes), .. } => bytes.len(),
            _ => 0,
        }
    }

    /// The kind byte and encoded body.
    pub(crate) fn encode(&self, max: usize) -> Result<(FrameKind, Vec<u8>), CodecError> {
        Ok(match self {
            Self::Ping => (FrameKind::Ping, codec::encode_with_max(&(), max)?),
            Self::Lookup { req, name } => (FrameKind::Lookup, codec::encode_with_max(&(req, name), max)?),
            Self::Found { req, result } => (FrameKind::Found, codec::encode_with_max(&(req, result), max)?),
            Self::Request { req, name, actor, msg } => (FrameKind::Request, codec::encode_with_max(&(req, name, actor, msg), max)?),
            Self::Reply { req, result } => (FrameKind::Reply, codec::encode_with_max(&(req, result), max)?),
            Self::Stopped { actor, reason } => (FrameKind::Stopped, codec::encode_with_max(&(actor, reason), max)?),
            Self::Close { why } => (FrameKind::Close, codec::encode_with_max(why, max)?),
        })
    }

    fn decode(kind: FrameKind, body: &[u8], max: usize) -> Result<Self, CodecError> {
        Ok(match kind {
            FrameKind::Ping => {
                codec::decode_with_max::<()>(body, max)?;
                Self::Ping
            }
            FrameKind::Lookup => {
                let (req, name) = codec::decode_with_max(body, max)?;
                Self::Lookup { req, name }
            }
            FrameKind::Found => {
                let (req, result) = codec::decode_with_max(body, max)?;
                Self::Found { req, result }
            }
            FrameKind::Request => {
                let (req, name, actor, msg) = codec::decode_with_max(body, max)?;
                Self::Request { req, name, actor, msg }
            }
            FrameKind::Reply => {
                let (req, result) = codec::decode_with_max(body, max)?;
                Self::Reply { req, result }
            }
            FrameKind::Stopped => {
                let (actor, reason) = codec::decode_with_max(body, max)?;
                Self::Stopped { actor, reason }
            }
            FrameKind::Close => Self::Close { why: codec::decode_with_max(body, max)? },
        })
    }
}

/// Why a frame was rejected; any of these drops the connection.
#[derive(Debug, Error)]
pub(crate) enum ProtocolError {
    #[error("malformed frame: {0}")]
    Malformed(CodecError),
    #[error("frame authentication tag does not verify")]
    BadTag,
    #[error("out-of-sequence frame (replayed or reordered): expected #{expected}, got #{got}")]
    Sequence { expected: u64, got: u64 },
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("undecodable {kind:?} frame body: {error}")]
    Body { kind: FrameKind, error: CodecError },
}

/// What is on the wire after the length prefix of an authenticated frame.
type SealedFrame = (u64, u8, Vec<u8>, [u8; TAG_LEN]);

fn tag(key: &HmacSha256, seq: u64, kind: u8, body: &[u8]) -> HmacSha256 {
    let mut mac = key.clone();
    mac.update(&seq.to_le_bytes());
    mac.update(&[kind]);
    mac.update(body);
    mac
}

/// Numbers and tags outgoing frames of one direction of a connection.
pub(crate) struct Sealer {
    key: HmacSha256,
    next: u64,
}

impl Sealer {
    pub(crate) fn new(key: HmacSha256) -> Self {
        Self { key, next: 0 }
    }

    /// The next frame's sequence number.
    pub(crate) fn next_seq(&self) -> u64 {
        self.next
    }

    /// Seals `msg` as one complete frame (length prefix included).
    pub(crate) fn seal(&mut self, msg: &Message, max_frame: usize) -> Result<Vec<u8>, CodecError> {
        let (kind, body) = msg.encode(max_frame)?;
        let frame = self.seal_raw(self.next, kind as u8, body, max_frame)?;
        self.next += 1;
        Ok(frame)
    }

    /// Seals an arbitrary kind and body under an arbitrary sequence number
    /// (for [`RawPeer`](super::RawPeer)); does not advance the sequence.
    pub(crate) fn seal_raw(&self, seq: u64, kind: u8, body: Vec<u8>, max_frame: usize) -> Result<Vec<u8>, CodecError> {
        let tag: [u8; TAG_LEN] = tag(&self.key, seq, kind, &body).finalize().into_bytes().into();
        let payload = codec::encode_with_max(&(seq, kind, body, tag), max_frame)?;
        let mut frame = Vec::with_capacity(FRAME_HEADER_LEN + payload.len());
        codec::write_frame(&mut frame, &payload, max_frame)?;
        Ok(frame)
    }
}

/// Checks incoming frames of one direction of a connection: tag, sequence
/// number, kind and body, in that order.
pub(crate) struct Opener {
    key: HmacSha256,
    next: u64,
}

impl Opener {
    pub(crate) fn new(key: HmacSha256) -> Self {
        Self { key, next: 0 }
    }

    pub(crate) fn open(&mut self, payload: &[u8], max_frame: usize) -> Result<Message, ProtocolError> {
        let (seq, kind, body, received): SealedFrame = codec::decode_with_max(payload, max_frame).map_err(ProtocolError::Malformed)?;
        tag(&self.key, seq, kind, &body).verify_slice(&received).map_err(|_| ProtocolError::BadTag)?;
        if seq != self.next {
            return Err(ProtocolError::Sequence { expected: self.next, got: seq });
        }
        self.next += 1;
        let kind = FrameKind::from_byte(kind).ok_or(ProtocolError::UnknownKind(kind))?;
        Message::decode(kind, &body, max_frame).map_err(|error| ProtocolError::Body { kind, error })
    }
}

/// Why no frame could be read.
#[derive(Debug, Error)]
pub(crate) enum ReadError {
    #[error("connection closed by peer")]
    Eof,
    #[error("connection closed by peer in the middle of a frame")]
    Truncated,
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("read failed: {0}")]
    Io(std::io::Error),
    #[error("no byte for {0:?} while this process ran (heartbeat timeout)")]
    Idle(std::time::Duration),
}

/// As [`read_frame`], but fails with [`ReadError::Idle`] only when no byte
/// at all arrives for `idle` of the time this process was running (by
/// `clock`): a large frame that keeps arriving is progress, not a dead
/// peer, and neither is a peer whose frames are late while this process
/// could not run either (a busy host).
pub(crate) async fn read_frame_live<R: AsyncRead + Unpin>(
    reader: &mut R,
    max: usize,
    idle: std::time::Duration,
    clock: &Clock,
) -> Result<Vec<u8>, ReadError> {
    let mut header = [0u8; FRAME_HEADER_LEN];
    read_live(reader, &mut header, idle, clock, true).await?;
    let len = usize::try_from(u32::from_le_bytes(header)).unwrap_or(usize::MAX);
    if len > max {
        return Err(ReadError::TooLarge { len, max });
    }
    let mut payload = vec![0; len];
    read_live(reader, &mut payload, idle, clock, false).await?;
    Ok(payload)
}

/// Fills `buf`, allowing at most `idle` of this process's running time
/// between two reads that make progress. `at_start`: an end of stream
/// before the first byte is a clean close, not a truncation.
async fn read_live<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut [u8],
    idle: std::time::Duration,
    clock: &Clock,
    at_start: bool,
) -> Result<(), ReadError> {
    let mut filled = 0;
    while filled < buf.len() {
        let (started, stalled) = (tokio::time::Instant::now(), clock.stalled());
        let mut left = idle;
        let n = loop {
            match tokio::time::timeout(left, reader.read(&mut buf[filled..])).await {
                Ok(r) => break r.map_err(ReadError::Io)?,
                Err(_) => {
                    // `read` is cancel-safe: nothing was read.
                    let ran = clock.ran_since(started, stalled);
                    if ran >= idle {
                        return Err(ReadError::Idle(idle));
                    }
                    left = idle - ran;
                }
            }
        };
        if n == 0 {
            return Err(if at_start && filled == 0 { ReadError::Eof } else { ReadError::Truncated });
        }
        filled += n;
    }
    Ok(())
}

/// Reads one frame's payload, checking the length prefix against `max`
/// before allocating anything.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(reader: &mut R, max: usize) -> Result<Vec<u8>, ReadError> {
    let mut header = [0u8; FRAME_HEADER_LEN];
    let mut filled = 0;
    while filled < FRAME_HEADER_LEN {
        let n = reader.read(&mut header[filled..]).await.map_err(ReadError::Io)?;
        if n == 0 {
            return Err(if filled == 0 { ReadError::Eof } else { ReadError::Truncated });
        }
        filled += n;
    }
    let len = usize::try_from(u32::from_le_bytes(header)).unwrap_or(usize::MAX);
    if len > max {
        return Err(ReadError::TooLarge { len, max });
    }
    let mut payload = vec![0; len];
    reader.read_exact(&mut payload).await.map_err(|err| match err.kind() {
        std::io::ErrorKind::UnexpectedEof => ReadError::Truncated,
        _ => ReadError::Io(err),
    })?;
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(k: &[u8]) -> HmacSha256 {
        HmacSha256::new_from_slice(k).unwrap()
    }

    #[test]
    fn sealed_frames_open_in_order_only() {
        let mut sealer = Sealer::new(key(b"k"));
        let mut opener = Opener::new(key(b"k"));
        let a = sealer.seal(&Message::Ping, 1 << 20).unwrap();
        let b = sealer.seal(&Message::Lookup { req: 7, name: "x".into() }, 1 << 20).unwrap();
        assert_eq!(opener.open(&a[4..], 1 << 20).unwrap(), Message::Ping);
        assert!(matches!(opener.open(&a[4..], 1 << 20), Err(ProtocolError::Sequence { expected: 1, got: 0 })));
        assert_eq!(opener.open(&b[4..], 1 << 20).unwrap(), Message::Lookup { req: 7, name: "x".into() });
    }

    #[test]
    fn wrong_key_fails_the_tag() {
        let mut sealer = Sealer::new(key(b"k"));
        let frame = sealer.seal(&Message::Ping, 1 << 20).unwrap();
        assert!(matches!(Opener::new(key(b"other")).open(&frame[4..], 1 << 20), Err(ProtocolError::BadTag)));
    }
}
