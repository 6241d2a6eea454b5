//! The executor's delta glue ([`crate::delta`]): a rank's delta run (the
//! base refit's memo and this run's), and each message encoded against
//! its base on the way out and rebuilt on it on the way in.

use super::pack::Unpack;
use super::ExecError;
use crate::delta::{decode, encode, DeltaMemo};
use crate::transport::Payload;
use reshard::{DType, Endpoint, Message, RecvPiece, SendPiece};

/// A delta refit on one rank ([`crate::delta`]): every message goes as
/// what changed since the same message of the base refit (`base`, this
/// rank's memo of it; `None`: dense this time), and the run leaves its own
/// memo for the next one. Every destination element is still written.
pub struct DeltaRun {
    /// The memo of the base refit, if this rank has it (used up as the
    /// run goes: each message's base is patched into this run's memo).
    pub base: Option<DeltaMemo>,
    /// This run's memo (filled as messages go and come).
    pub next: DeltaMemo,
    /// Bytes this rank put on the wire (encodings, headers included).
    pub wire_bytes: u64,
}

impl DeltaRun {
    /// A delta run on `base`.
    pub fn new(base: Option<DeltaMemo>) -> DeltaRun {
        DeltaRun { base, next: DeltaMemo::default(), wire_bytes: 0 }
    }
}

/// A message's packed bytes, encoded against the same message of the base
/// refit (see [`crate::delta`]); the packed bytes go into this run's memo.
pub(super) fn delta_encode(
    me: Endpoint,
    round: u32,
    msg: &Message<SendPiece>,
    payload: Payload,
    d: &mut DeltaRun,
) -> Result<Payload, ExecError> {
    // (Reserved, not assumed: the pieces are checked against their buffers
    // as they are read below, so a program's claim may still be refused.)
    let mut dense = Vec::new();
    let want = usize::try_from(msg.wire_bytes()).unwrap_or(usize::MAX);
    dense.try_reserve_exact(want).map_err(|e| ExecError::Setup(format!("{me}: {want} bytes for a delta message: {e}")))?;
    // SAFETY: the payload was just packed from this rank's buffers, which
    // nobody writes during the run; the runs are copied out here.
    unsafe { crate::frame::for_payload_runs(&payload, |r| dense.extend_from_slice(r)) }
        .map_err(|e| ExecError::Setup(format!("{me}: packing a delta message: {e}")))?;
    drop(payload);
    let unit = delta_unit(msg.pieces.views().map(|p| p.wire()));
    let key = (round, msg.peer);
    let base = d.base.as_mut().and_then(|b| b.sent.remove(&key));
    let encoded = encode(base.as_deref(), &dense, unit);
    d.wire_bytes += encoded.len() as u64;
    d.next.sent.insert(key, dense);
    Ok(Payload::Bytes(encoded))
}

/// The unit a delta message of pieces of these wire types is encoded in:
/// the smallest element size among them, so a unit never straddles two
/// elements.
fn delta_unit(wires: impl Iterator<Item = DType>) -> usize {
    wires.map(|w| w.size() as usize).min().unwrap_or(1)
}

/// A delta message's whole packed bytes, rebuilt on the base refit's copy
/// (for the caller to keep in this run's memo). The encoding is checked
/// against `msg`, the message this rank expects: its unit, its length, and
/// no more bytes than its densest form ([`crate::delta::HEADER`] plus the
/// message) before any is read.
pub(super) fn delta_decode(
    round: u32,
    peer: Endpoint,
    msg: &Message<RecvPiece>,
    payload: Payload,
    d: &mut DeltaRun,
) -> Result<Vec<u8>, Unpack> {
    let len = msg.wire_bytes();
    let most = len.saturating_add(crate::delta::HEADER as u64);
    let encoded = match payload {
        Payload::Bytes(b) => b,
        Payload::Lent(l) => l.as_slice().to_vec(),
        Payload::Stream(mut frame) => {
            if frame.len() > most {
                return Err(Unpack::Bad(format!("a delta message of {} bytes, at most {most} expected", frame.len())));
            }
            let mut b = vec![0u8; frame.len() as usize];
            frame.read_exact(&mut b).map_err(|e| Unpack::Broken(format!("in a message: {e}")))?;
            b
        }
        Payload::Pieces(_) | Payload::Segments { .. } => return Err(Unpack::Bad("a dense message in a delta refit".into())),
    };
    let key = (round, peer);
    let base = d.base.as_mut().and_then(|b| b.received.remove(&key));
    decode(base, &encoded, delta_unit(msg.pieces.views().map(|p| p.wire())), len).map_err(|e| Unpack::Bad(e.to_string()))
}
