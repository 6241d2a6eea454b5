//! The executor's delta glue ([`crate::delta`]): each message of a
//! rank's delta run ([`DeltaRun`]) encoded against its base on the way out
//! and rebuilt on it on the way in.

use super::pack::Unpack;
use super::ExecError;
use crate::delta::{check_encoded_len, decode_kept, encode_kept, unit_of, DeltaRun, KeptMessage};
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
    let (encoded, crc) = encode_kept(base.as_ref(), &dense, unit);
    d.wire_bytes += encoded.len() as u64;
    d.next.sent.insert(key, KeptMessage { bytes: dense, crc });
    Ok(Payload::Bytes(encoded))
}

/// A delta message's whole packed bytes, rebuilt on the base refit's copy
/// (for the caller to keep in this run's memo). The encoding is checked
/// against `msg`, the message this rank expects: its unit, its length, and
/// no more bytes than its densest form ([`crate::delta::HEADER`] plus the
/// message) before any is copied or read, whether it came as bytes, lent
/// memory or a stream.
pub(super) fn delta_decode(
    round: u32,
    peer: Endpoint,
    msg: &Message<RecvPiece>,
    payload: Payload,
    d: &mut DeltaRun,
) -> Result<KeptMessage, Unpack> {
    let len = msg.wire_bytes();
    // Whatever carries it, an encoding longer than the message's densest
    // form is refused on its length, before it is copied or read.
    let fits = |got: u64| check_encoded_len(got, len).map_err(|e| Unpack::Bad(e.to_string()));
    let encoded = match payload {
        Payload::Bytes(b) => {
            fits(b.len() as u64)?;
            b
        }
        Payload::Lent(l) => {
            fits(l.as_slice().len() as u64)?;
            l.as_slice().to_vec()
        }
        Payload::Stream(mut frame) => {
            fits(frame.len())?;
            let mut b = vec![0u8; frame.len() as usize];
            frame.read_exact(&mut b).map_err(|e| Unpack::Broken(format!("in a message: {e}")))?;
            b
        }
        Payload::Pieces(_) | Payload::Segments { .. } => return Err(Unpack::Bad("a dense message in a delta refit".into())),
    };
    let key = (round, peer);
    let base = d.base.as_mut().and_then(|b| b.received.remove(&key));
    decode_kept(base, &encoded, unit_of(msg.pieces.views().map(|p| p.wire())), len).map_err(|e| Unpack::Bad(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{Lent, Release};
    use reshard::{parse_layout, plan_reshard, PlanOptions};

    /// A peer that lends a delta frame far longer than the message planned
    /// (a 64 GiB lend area, as a member announcing one could) is refused on
    /// the frame's length: nothing is copied out of the area. Before, the
    /// receiver copied the lent slice whole and died allocating 64 GiB.
    #[test]
    fn a_lent_delta_frame_longer_than_planned_is_refused_before_any_copy() {
        let src = parse_layout(r#"{"ranks": 1, "tensors": [{"name": "w", "dtype": "f32", "shape": [1024], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}"#).unwrap();
        let dst = parse_layout(r#"{"ranks": 1, "tensors": [{"name": "w", "dtype": "f32", "shape": [1024], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}"#).unwrap();
        let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
        let programs = plan.programs(&src, &dst).unwrap();
        let (round, msg) = programs
            .iter()
            .flat_map(|p| p.rounds.iter().enumerate().flat_map(|(r, round)| round.recvs.iter().map(move |m| (r as u32, m))))
            .next()
            .expect("a received message");
        assert_eq!(msg.wire_bytes(), 4096);
        let area: usize = 64 << 30;
        // SAFETY: a fresh private, read-only anonymous mapping with no
        // swap reserved: valid for reads of `area` bytes (zero pages) until
        // the unmap below, and never written.
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), area, libc::PROT_READ, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE, -1, 0)
        };
        assert_ne!(ptr, libc::MAP_FAILED, "64 GiB of address space");
        // SAFETY: `ptr` is valid for reads of `area` bytes and nobody
        // writes them while the payload lives (it is dropped by the call).
        let lent = unsafe { Lent::new(ptr as *const u8, area, Release::on_drop(|| {})) };
        let mut d = DeltaRun::new(None);
        let result = delta_decode(round, msg.peer, msg, Payload::Lent(lent), &mut d);
        // SAFETY: the mapping made above, no longer lent.
        unsafe { libc::munmap(ptr, area) };
        match result {
            Err(Unpack::Bad(m)) => {
                assert!(m.contains("an encoding of 68719476736 bytes for a message of 4096: at most 4122 expected"), "{m}")
            }
            Err(Unpack::Broken(m)) => panic!("broken: {m}"),
            Err(Unpack::Exec(e)) => panic!("{e}"),
            Ok(v) => panic!("decoded {} bytes", v.bytes.len()),
        }
    }
}
