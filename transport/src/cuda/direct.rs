//! Direct reads between ranks on one device: where a sender and its
//! receiver share a GPU (colocated training and inference processes on the
//! IPC fabric), the sender packs nothing. Its message is an **offer**: for
//! each piece, in the message's order, where the piece lies in the sender's
//! memory (the allocation's IPC handle, the region's place in it, the
//! piece's span and dtype). The receiver maps the regions and copies every
//! piece straight into its own buffers, converting the dtype on the way:
//! one copy per byte, no bucket, no staging. Then it tells the sender it is
//! done reading (a second, tiny group), and only then may the sender's
//! memory change.
//!
//! An offer is bytes from a peer: every record is decoded and checked
//! (dtype, dimensions, the region inside its allocation, the span inside
//! the region) before anything is read through it. A record has a fixed
//! size ([`RECORD_BYTES`]), so a receiver knows an offer's length from its
//! own program (one record per piece it receives).
//!
//! The executor's steps of a direct read live here too: the sender's offer
//! ([`offer_of`]), the receiver's copies ([`read_directly`]) and the done
//! group ([`done_reading`]).
//!
//! What a handle is belongs to the plane: a CUDA IPC handle on a GPU
//! (`DevicePlaneMemory`), a key of this process's table of offered host
//! regions on the simulated plane ([`SimOffers`]), where every member lives
//! in one process.

use crate::cuda::comm::{CommHandle, P2p};
use crate::cuda::ipc::{IpcHandle, IpcHandleError, IPC_HANDLE_BYTES};
use crate::cuda::plane::{check, done_layout, CommExecError, PeerMissing, PlaneError, PlaneMemory, StagingSide, UnknownPeer};
use reshard::{Block, DType, Endpoint, Span, ALL_DTYPES, MAX_DIMS};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;
use thiserror::Error;

/// Why an offer does not check, or names no region offered here.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum OfferError {
    /// An offer of the wrong length for its pieces.
    #[error("an offer of {bytes} bytes for {pieces} pieces ({RECORD_BYTES} bytes each)")]
    Length {
        /// Bytes of the offer.
        bytes: usize,
        /// Pieces of the message.
        pieces: usize,
    },
    /// One offered piece does not check.
    #[error("offered piece {index} ({block}): {problem}")]
    Piece {
        /// The piece's place in the message.
        index: usize,
        /// The piece.
        block: Box<Block>,
        /// What is wrong with it.
        problem: PieceProblem,
    },
    /// A region no member of this process offered (the simulated plane).
    #[error("a region no member of this process offered")]
    NotOffered,
    /// A region outside the one offered under its key (the simulated plane).
    #[error("{len} bytes at {offset} of an offered region of {holds}")]
    OutsideOffered {
        /// Bytes of the region.
        len: u64,
        /// Its start in the offered region.
        offset: u64,
        /// Bytes offered.
        holds: u64,
    },
}

/// What is wrong with one offered piece ([`OfferError::Piece`]).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PieceProblem {
    /// Its handle does not decode.
    #[error(transparent)]
    Handle(#[from] IpcHandleError),
    /// Its region's end passes `u64`.
    #[error("a region of {len} bytes at {offset} passes u64")]
    RegionPastU64 {
        /// Bytes of the region.
        len: u64,
        /// Its start.
        offset: u64,
    },
    /// A stride on a dimension the piece does not have.
    #[error("a stride on a dimension the piece does not have")]
    ExtraStride,
    /// An unknown dtype code.
    #[error("dtype code {0}")]
    Dtype(u64),
    /// A region larger than this host addresses.
    #[error("a region of {0} bytes")]
    RegionTooLarge(u64),
    /// The span reaches past its region.
    #[error("its span (base {base}, strides {strides:?}) reaches past its {len}-byte region")]
    PastRegion {
        /// The span's first element.
        base: u64,
        /// Its strides (the piece's dimensions).
        strides: Vec<u64>,
        /// Bytes of the region.
        len: usize,
    },
}

/// Why a direct read from a peer on the same device failed
/// ([`CommExecError::Direct`]).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DirectError {
    /// The offer's length does not fit this host.
    #[error("an offer of {0} bytes")]
    OfferTooLarge(u64),
    /// The offer did not check.
    #[error(transparent)]
    Offer(#[from] OfferError),
    /// A region it names could not be mapped.
    #[error(transparent)]
    Map(PlaneError),
    /// Copying a piece failed.
    #[error("piece {block}: {source}")]
    Piece {
        /// The piece.
        block: Box<Block>,
        /// What failed.
        #[source]
        source: PlaneError,
    },
}

/// Bytes of one offered piece: the handle, the region's offset and length
/// in its allocation, the span's base and strides, the dtype.
pub(crate) const RECORD_BYTES: usize = IPC_HANDLE_BYTES + 8 + 8 + 8 + 8 * MAX_DIMS + 8;

/// The group that tells senders their memory was read: the round's number
/// plus this (a tag no dense or delta round reaches).
pub(crate) const DONE_TAG: u32 = 1 << 31;

/// Bytes this process read directly from peers' memory (the sender's
/// dtype), on any plane.
static READ: AtomicU64 = AtomicU64::new(0);

/// Counts `bytes` read directly.
pub(crate) fn count_read(bytes: u64) {
    READ.fetch_add(bytes, Ordering::Relaxed);
}

/// Bytes this process has read directly from the memory of peers on its
/// device since it started: how a check tells a direct refit from one
/// through buckets.
pub fn direct_read_bytes() -> u64 {
    READ.load(Ordering::Relaxed)
}

/// A region of a sender's memory as it offers it: the allocation (by its
/// handle) and the region's bytes in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionOffer {
    /// The allocation's handle.
    pub handle: IpcHandle,
    /// Where the region starts in the allocation, in bytes.
    pub offset: u64,
    /// The region's bytes.
    pub len: u64,
}

/// One piece as offered: its region, and where it lies there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OfferedPiece {
    /// The region holding the piece.
    pub region: RegionOffer,
    /// The piece's first element and strides, in elements of `dtype` from
    /// the region's start (`buffer` is unused: 0).
    pub span: Span,
    /// The sender's dtype of the piece.
    pub dtype: DType,
}

/// Bytes of an offer of `pieces` pieces (`None` past `u64`).
pub(crate) fn offer_bytes(pieces: usize) -> Option<u64> {
    (pieces as u64).checked_mul(RECORD_BYTES as u64)
}

/// Appends the record of `piece` to `out`.
pub(crate) fn encode(piece: &OfferedPiece, out: &mut Vec<u8>) {
    out.extend_from_slice(piece.region.handle.as_bytes());
    out.extend_from_slice(&piece.region.offset.to_le_bytes());
    out.extend_from_slice(&piece.region.len.to_le_bytes());
    out.extend_from_slice(&piece.span.base.to_le_bytes());
    for s in piece.span.strides {
        out.extend_from_slice(&s.to_le_bytes());
    }
    out.extend_from_slice(&u64::from(piece.dtype.index()).to_le_bytes());
}

/// The pieces of an offer for `blocks` (the receiver's pieces, in order),
/// each checked: the right length, a known dtype, no stride on a dimension
/// the block does not have, the span inside its region, the region's end
/// inside `u64`.
pub(crate) fn decode(bytes: &[u8], blocks: &[Block]) -> Result<Vec<OfferedPiece>, OfferError> {
    if Some(bytes.len() as u64) != offer_bytes(blocks.len()) {
        return Err(OfferError::Length { bytes: bytes.len(), pieces: blocks.len() });
    }
    let mut pieces = Vec::with_capacity(blocks.len());
    for (i, (record, block)) in bytes.chunks_exact(RECORD_BYTES).zip(blocks).enumerate() {
        let bad = |problem: PieceProblem| OfferError::Piece { index: i, block: Box::new(*block), problem };
        let word = |at: usize| u64::from_le_bytes(record[at..at + 8].try_into().unwrap_or_default());
        let handle = IpcHandle::from_bytes(&record[..IPC_HANDLE_BYTES]).map_err(|e| bad(e.into()))?;
        let at = IPC_HANDLE_BYTES;
        let region = RegionOffer { handle, offset: word(at), len: word(at + 8) };
        if region.offset.checked_add(region.len).is_none() {
            return Err(bad(PieceProblem::RegionPastU64 { len: region.len, offset: region.offset }));
        }
        let mut strides = [0u64; MAX_DIMS];
        for (d, s) in strides.iter_mut().enumerate() {
            *s = word(at + 24 + 8 * d);
        }
        if strides[block.ndim()..].iter().any(|&s| s != 0) {
            return Err(bad(PieceProblem::ExtraStride));
        }
        let code = word(at + 24 + 8 * MAX_DIMS);
        let dtype = usize::try_from(code).ok().and_then(|c| ALL_DTYPES.get(c)).copied();
        let dtype = dtype.ok_or_else(|| bad(PieceProblem::Dtype(code)))?;
        let span = Span { buffer: 0, base: word(at + 16), strides };
        let len = usize::try_from(region.len).map_err(|_| bad(PieceProblem::RegionTooLarge(region.len)))?;
        if !crate::copy::fits(block.extent(), len, span.base, &span.strides, dtype) {
            return Err(bad(PieceProblem::PastRegion { base: span.base, strides: strides[..block.ndim()].to_vec(), len }));
        }
        pieces.push(OfferedPiece { region, span, dtype });
    }
    Ok(pieces)
}

/// The offer of message `m` to a reader on the same device: each piece's
/// region (its buffer, as the memory offers it) and span.
pub(crate) fn offer_of(
    me: Endpoint,
    memory: &mut dyn PlaneMemory,
    m: &reshard::Message<reshard::SendPiece>,
) -> Result<Vec<u8>, CommExecError> {
    let mut regions: Vec<(u32, RegionOffer)> = Vec::new();
    let mut bytes = Vec::with_capacity(m.pieces.len() * RECORD_BYTES);
    for p in m.pieces.iter() {
        check(me, memory, &p.span, p.dtype, &p.block)?;
        let region = match regions.iter().find(|(b, _)| *b == p.span.buffer) {
            Some(&(_, region)) => region,
            None => {
                let region = memory.offer(p.span.buffer).map_err(|e| CommExecError::memory(me, "offering a buffer", e))?;
                regions.push((p.span.buffer, region));
                region
            }
        };
        encode(&OfferedPiece { region, span: Span { buffer: 0, ..p.span }, dtype: p.dtype }, &mut bytes);
    }
    Ok(bytes)
}

/// Copies every piece of message `m` straight from the sender's memory, as
/// its offer (at `offer.0` of the receive staging, `offer.1` bytes) says
/// where: each record checked, each region mapped and checked, each piece
/// converted on the way from the sender's dtype through the wire dtype
/// into every place this rank holds it (exactly what packing and
/// unpacking would have written).
pub(crate) fn read_directly(
    me: Endpoint,
    memory: &mut dyn PlaneMemory,
    m: &reshard::Message<reshard::RecvPiece>,
    (at, len): (u64, u64),
) -> Result<(), CommExecError> {
    let peer = m.peer;
    let bad = |error: DirectError| CommExecError::Direct { me, peer, error: Box::new(error) };
    let mut bytes = vec![0u8; usize::try_from(len).map_err(|_| bad(DirectError::OfferTooLarge(len)))?];
    memory.read_staging(StagingSide::Recv, at, &mut bytes).map_err(|error| CommExecError::Memory {
        me,
        what: "reading an offer",
        error: Box::new(error),
    })?;
    let blocks: Vec<Block> = m.pieces.views().map(|p| p.block()).collect();
    let offered = decode(&bytes, &blocks).map_err(|e| bad(e.into()))?;
    let mut mapped: Vec<(RegionOffer, u64)> = Vec::new();
    for (p, o) in m.pieces.views().zip(offered) {
        let (block, wire, dtype) = (p.block(), p.wire(), p.dtype());
        let addr = match mapped.iter().find(|(r, _)| *r == o.region) {
            Some(&(_, addr)) => addr,
            None => {
                let addr = memory.map_offer(peer, &o.region).map_err(|e| bad(DirectError::Map(e)))?;
                mapped.push((o.region, addr));
                addr
            }
        };
        let mut to = Vec::new();
        for s in p.spans() {
            to.push((check(me, memory, &s, dtype, &block)?, s, dtype));
        }
        memory
            .move_piece(&block, (addr, o.span, o.dtype), wire, &to)
            .map_err(|source| bad(DirectError::Piece { block: Box::new(block), source }))?;
        count_read(block.numel().saturating_mul(o.dtype.size()));
    }
    Ok(())
}

/// After a round with direct reads: this rank waits for its copies from
/// peers' memory, then one group (numbered the round plus [`DONE_TAG`])
/// carries a done token from every reader to every sender it read — a
/// sender's memory may change only once its group completes.
pub(crate) fn done_reading(
    memory: &mut dyn PlaneMemory,
    comm: &mut CommHandle,
    (me, r): (Endpoint, u32),
    (read_from, read_by): (&[Endpoint], &[Endpoint]),
    rank_of: &dyn Fn(Endpoint) -> Option<u32>,
    deadline: Instant,
) -> Result<(), CommExecError> {
    let mem_err = |what| move |error| CommExecError::memory(me, what, error);
    if !read_from.is_empty() {
        memory.finish().map_err(mem_err("finishing the copies from peers' memory"))?;
    }
    let tag = r.checked_add(DONE_TAG).ok_or_else(|| CommExecError::Layout {
        me,
        what: "numbering the done group",
        problem: format!("round {r} is too large"),
    })?;
    let too_large = || CommExecError::Layout { me, what: "laying out done tokens", problem: "too many".into() };
    let (send_at, send_total) = done_layout(read_from.len()).ok_or_else(too_large)?;
    let (recv_at, recv_total) = done_layout(read_by.len()).ok_or_else(too_large)?;
    let sbase = memory.staging(StagingSide::Send, send_total as usize).map_err(mem_err("send staging"))?;
    let rbase = memory.staging(StagingSide::Recv, recv_total as usize).map_err(mem_err("receive staging"))?;
    let mut ops = Vec::new();
    for (&peer, &at) in read_from.iter().zip(&send_at) {
        memory.write_staging(StagingSide::Send, at, &u64::from(r).to_le_bytes()).map_err(mem_err("writing a done token"))?;
        let rank = rank_of(peer).ok_or(UnknownPeer { me, peer, round: r, missing: PeerMissing::CommRank })?;
        ops.push(P2p::Send { peer: rank, addr: sbase + at, bytes: 8 });
    }
    for (&peer, &at) in read_by.iter().zip(&recv_at) {
        let rank = rank_of(peer).ok_or(UnknownPeer { me, peer, round: r, missing: PeerMissing::CommRank })?;
        ops.push(P2p::Recv { peer: rank, addr: rbase + at, bytes: 8 });
    }
    let after = memory.fence().map_err(mem_err("ordering the done group"))?;
    // SAFETY: every address lies in the send or receive staging, inside the
    // layout that sized it; on an error the caller abandons the staging.
    unsafe { comm.group(tag, ops, after, deadline) }.map_err(CommExecError::from)
}

/// The simulated plane's offered regions: host memory of this process
/// under keys that stand in for IPC handles, so that an offer names only a
/// region a member of this process offered (every member of a simulated
/// fabric is in one process).
pub(crate) struct SimOffers;

/// Offered host regions: key -> (address, bytes).
fn sim_offers() -> &'static Mutex<HashMap<IpcHandle, (u64, u64)>> {
    static OFFERS: OnceLock<Mutex<HashMap<IpcHandle, (u64, u64)>>> = OnceLock::new();
    OFFERS.get_or_init(Default::default)
}

impl SimOffers {
    /// The offer of the `len` bytes at `addr` (host memory the offering
    /// member keeps alive and unwritten until its readers are done).
    pub(crate) fn offer(addr: u64, len: u64) -> RegionOffer {
        let mut key = [0u8; IPC_HANDLE_BYTES];
        key[..8].copy_from_slice(&addr.to_le_bytes());
        key[8..16].copy_from_slice(&len.to_le_bytes());
        key[16] = 0x5a;
        // (Not all zeros: `from_bytes` refuses only that and a wrong length.)
        let handle = IpcHandle::from_bytes(&key).unwrap_or_else(|_| unreachable!("a 64-byte key with a set byte"));
        let mut offers = sim_offers().lock().unwrap_or_else(|p| p.into_inner());
        offers.insert(handle, (addr, len));
        RegionOffer { handle, offset: 0, len }
    }

    /// The address of an offered region, checked against what was offered
    /// under its key.
    pub(crate) fn map(offer: &RegionOffer) -> Result<u64, OfferError> {
        let offers = sim_offers().lock().unwrap_or_else(|p| p.into_inner());
        let &(addr, holds) = offers.get(&offer.handle).ok_or(OfferError::NotOffered)?;
        match offer.offset.checked_add(offer.len) {
            Some(end) if end <= holds => Ok(addr + offer.offset),
            _ => Err(OfferError::OutsideOffered { len: offer.len, offset: offer.offset, holds }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(block: &Block, dtype: DType, base: u64) -> OfferedPiece {
        let data = vec![0u8; 4096];
        let region = SimOffers::offer(data.as_ptr() as u64, data.len() as u64);
        std::mem::forget(data);
        let mut strides = [0u64; MAX_DIMS];
        strides[0] = block.extent()[1];
        strides[1] = 1;
        OfferedPiece { region, span: Span { buffer: 0, base, strides }, dtype }
    }

    #[test]
    fn offers_decode_to_what_was_encoded_and_lies_are_refused() {
        let block = Block::new(&[0, 0], &[4, 8]);
        let p = piece(&block, DType::F32, 16);
        let mut bytes = Vec::new();
        encode(&p, &mut bytes);
        assert_eq!(bytes.len(), RECORD_BYTES);
        assert_eq!(decode(&bytes, &[block]).unwrap(), vec![p]);
        // Wrong length for the receiver's pieces.
        assert!(decode(&bytes, &[block, block]).unwrap_err().to_string().contains("for 2 pieces"));
        // A span past its region: 4 KiB hold 1024 f32, the piece reaches 16 + 32.
        let mut far = p;
        far.span.base = 1000;
        let mut lie = Vec::new();
        encode(&far, &mut lie);
        assert!(decode(&lie, &[block]).unwrap_err().to_string().contains("reaches past"), "{:?}", decode(&lie, &[block]));
        // An unknown dtype code.
        let mut code = bytes.clone();
        code[RECORD_BYTES - 8] = 200;
        assert!(decode(&code, &[block]).unwrap_err().to_string().contains("dtype code 200"));
        // A stride past the block's dimensions.
        let mut wide = p;
        wide.span.strides[5] = 1;
        let mut lie = Vec::new();
        encode(&wide, &mut lie);
        assert!(decode(&lie, &[block]).unwrap_err().to_string().contains("does not have"));
        // A region whose end passes u64.
        let mut huge = p;
        huge.region.offset = u64::MAX;
        let mut lie = Vec::new();
        encode(&huge, &mut lie);
        assert!(decode(&lie, &[block]).unwrap_err().to_string().contains("passes u64"));
    }

    #[test]
    fn simulated_offers_map_only_what_was_offered() {
        let data = vec![7u8; 256];
        let offer = SimOffers::offer(data.as_ptr() as u64, 256);
        assert_eq!(SimOffers::map(&offer), Ok(data.as_ptr() as u64));
        let inner = RegionOffer { offset: 128, len: 128, ..offer };
        assert_eq!(SimOffers::map(&inner), Ok(data.as_ptr() as u64 + 128));
        let past = RegionOffer { offset: 129, len: 128, ..offer };
        assert!(SimOffers::map(&past).is_err());
        let mut key = [1u8; IPC_HANDLE_BYTES];
        key[0] = 9;
        let forged = RegionOffer { handle: IpcHandle::from_bytes(&key).unwrap(), offset: 0, len: 1 };
        assert!(SimOffers::map(&forged).unwrap_err().to_string().contains("no member"));
    }
}
