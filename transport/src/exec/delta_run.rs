//! The executor's delta glue ([`crate::delta`]): each message of a
//! rank's delta run ([`DeltaRun`]) encoded against its base on the way out
//! and rebuilt on it on the way in.

use super::pack::Unpack;
use super::ExecError;
use crate::delta::{decode, encode, unit_of, DeltaRun};
use crate::transport::Payload;
use reshard::{Endpoint, Message, RecvPiece, SendPiece};

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
    let unit = unit_of(msg.pieces.views().map(|p| p.wire()));
    let key = (round, msg.peer);
    let base = d.base.as_mut().and_then(|b| b.sent.remove(&key));
    let encoded = encode(base.as_deref(), &dense, unit);
    d.wire_bytes += encoded.len() as u64;
    d.next.sent.insert(key, dense);
    Ok(Payload::Bytes(encoded))
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
    decode(base, &encoded, unit_of(msg.pieces.views().map(|p| p.wire())), len).map_err(|e| Unpack::Bad(e.to_string()))
}
