//! Packing and unpacking: a message's pieces handed to the transport in
//! place (converted ones through a staging area), and a received payload,
//! whatever its form, written into the rank's memory and the local copies
//! made straight from it.

use super::{view, ExecError, PieceOutOfBounds};
use crate::bypass::Bypass;
use crate::copy::{
    copy_strided_unfenced, for_each_run_ptr, in_bounds, packed_strides, prefetch, run_bytes, store_fence, StridedRef, PREFETCH_AHEAD,
};
use crate::frame::SHORT_RUN;
use crate::memory::MemView;
use crate::transport::{Payload, SentPieces};
use crate::{RecvBuffers, StagingArea, StagingPool};
use reshard::{Endpoint, LocalCopyView, Message, RecvPiece, RecvPieceView, SendPiece};

/// Where a message's pieces whose wire type differs are converted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Convert {
    /// Here, into a staging area carried with the payload.
    Here,
    /// By the transport, as it copies them into its memory
    /// ([`Transport::converts_on_send`](crate::Transport::converts_on_send)):
    /// each converted byte written once.
    OnSend,
}

/// A message's pieces, read in place from this rank's program and buffers
/// by whoever carries the payload. Pieces whose wire type differs are
/// converted into one staging area (carried with the payload), back to
/// back, each at an offset aligned to its wire element size, or left to
/// the transport (`Convert::OnSend`); a message without them costs
/// nothing here, whatever its number of pieces. The staging area comes
/// from `pool` and goes back to it when the payload is dropped: a plan's
/// later runs reuse the first run's areas.
pub(super) fn pack(
    me: Endpoint,
    mem: &MemView,
    msg: &Message<SendPiece>,
    pool: &StagingPool,
    convert: Convert,
) -> Result<Payload, ExecError> {
    let mut staging = StagingArea::default();
    if msg.pieces.converting() > 0 && convert == Convert::OnSend {
        // Each piece checked to lie in this rank's buffers here, so that
        // one that does not is named as this rank's error.
        for p in msg.pieces.views().filter(|p| p.dtype() != p.wire()) {
            view(me, mem, &p.span(), p.dtype(), p.extent(), || p.block())?;
        }
        // SAFETY: as for `SentPieces::new` below.
        return Ok(Payload::Pieces(unsafe { SentPieces::unconverted(msg, &mem.bufs) }));
    }
    if msg.pieces.converting() > 0 {
        // Sized by pieces checked to lie in this rank's buffers first (so
        // bounded by them), the arithmetic checked: a program's extents
        // may be anything.
        let mut staged = 0u64;
        for p in msg.pieces.views().filter(|p| p.dtype() != p.wire()) {
            view(me, mem, &p.span(), p.dtype(), p.extent(), || p.block())?;
            let elem = p.wire().size();
            staged = staged
                .checked_next_multiple_of(elem)
                .and_then(|at| at.checked_add(p.checked_numel()?.checked_mul(elem)?))
                .ok_or_else(|| ExecError::from(PieceOutOfBounds::new(me, p.block(), u32::MAX)))?;
        }
        let staged = usize::try_from(staged).map_err(|_| ExecError::Setup(format!("{me}: {staged} bytes of staging do not fit")))?;
        staging = pool.take(staged);
        let area = staging.as_mut_slice();
        let mut pos = 0u64;
        for p in msg.pieces.views().filter(|p| p.dtype() != p.wire()) {
            let (extent, dtype, wire) = (p.extent(), p.dtype(), p.wire());
            let src = view(me, mem, &p.span(), dtype, extent, || p.block())?;
            let elem = wire.size();
            pos = pos.next_multiple_of(elem);
            // SAFETY: the staging area is ours (borrowed mutably for the
            // loop), and outlives this view (used for this one copy).
            let dst = unsafe { StridedRef::new(area.as_mut_ptr(), area.len(), pos / elem, packed_strides(extent), wire) };
            if !in_bounds(extent, &dst) {
                return Err(PieceOutOfBounds::new(me, p.block(), u32::MAX).into());
            }
            // SAFETY: both in bounds; staging is ours.
            unsafe { copy_strided_unfenced(extent, &src, &dst) };
            pos += p.numel() * elem;
        }
        store_fence();
    }
    // SAFETY: the message is this rank's program's and `mem` this run's
    // view of its buffers: both outlive every payload of the run, since the
    // rank waits for its receivers to release what it sent (`flush`, and on
    // failure `run_rank_inner`) before its run returns; the pieces read are
    // source regions this rank does not write while they are lent.
    Ok(Payload::Pieces(unsafe { SentPieces::new(msg, &mem.bufs, staging) }))
}

pub(super) enum Unpack {
    Bad(String),
    /// The stream the message arrived on broke while it was read.
    Broken(String),
    Exec(ExecError),
}

/// Where a message's pieces go: this rank's memory, less bypassed scratch,
/// plus the local copies made straight from a piece.
pub(super) struct UnpackTarget<'a> {
    pub(super) me: Endpoint,
    pub(super) mem: &'a MemView,
    pub(super) bypass: &'a Bypass,
    /// Copies made on receipt, by piece.
    pub(super) routes: &'a [(u32, LocalCopyView<'a>)],
}

impl UnpackTarget<'_> {
    /// Whether piece `i` feeds local copies made on receipt.
    fn feeds_locals(&self, i: usize) -> bool {
        let first = self.routes.partition_point(|(piece, _)| (*piece as usize) < i);
        self.routes.get(first).is_some_and(|(piece, _)| *piece as usize == i)
    }

    /// Writes piece `i`, whose elements `src` views, everywhere it goes.
    fn write(&self, i: usize, p: &RecvPieceView<'_>, src: &StridedRef) -> Result<(), ExecError> {
        let (me, extent) = (self.me, p.extent());
        for span in p.spans().filter(|s| !self.bypass.skips(s.buffer as usize)) {
            let to = view(me, self.mem, &span, p.dtype(), extent, || p.block())?;
            // SAFETY: `src` views memory valid for this call (the caller's
            // contract) that nobody writes now; `to` is this rank's own
            // buffer.
            unsafe { copy_strided_unfenced(extent, src, &to) };
        }
        let first = self.routes.partition_point(|(piece, _)| (*piece as usize) < i);
        for (_, copy) in self.routes[first..].iter().take_while(|(piece, _)| *piece as usize == i) {
            // The copy's source inside the piece: `Bypass` checked that it
            // lies inside, and that the piece's wire type (what `src`
            // holds) converts to the copy's type as the scratch would have.
            let (block, piece) = (copy.block(), p.block());
            let mut base = src.base;
            for d in 0..block.ndim() {
                base += (block.offset()[d] - piece.offset()[d]) * src.strides[d];
            }
            let from = src.at(base, src.strides, src.dtype);
            if !in_bounds(block.extent(), &from) {
                return Err(PieceOutOfBounds::new(me, block, copy.from().buffer).into());
            }
            for span in copy.to() {
                let to = view(me, self.mem, &span, copy.to_dtype(), block.extent(), || block)?;
                // SAFETY: as above; `from` is in bounds of `src`'s region.
                unsafe { copy_strided_unfenced(block.extent(), &from, &to) };
            }
        }
        Ok(())
    }
}

pub(super) fn unpack(into: &UnpackTarget<'_>, msg: &Message<RecvPiece>, payload: Payload, stage: &mut RecvBuffers) -> Result<(), Unpack> {
    let pieces = &msg.pieces;
    match payload {
        Payload::Segments { segments, keep_alive, release } => {
            if segments.len() != pieces.len() {
                return Err(Unpack::Bad(format!("{} segments for {} pieces", segments.len(), pieces.len())));
            }
            for (i, (seg, p)) in segments.iter().zip(pieces.views()).enumerate() {
                let extent = p.extent();
                if seg.numel() != p.numel() || seg.view().dtype != p.wire() || !in_bounds(extent, seg.view()) {
                    return Err(Unpack::Bad(format!("segment for piece {} does not match it", p.block())));
                }
                // The segment is in bounds of memory the sender keeps alive
                // (buffers outlive all rank threads; staging is in
                // `keep_alive`) and nobody writes it now.
                into.write(i, &p, seg.view()).map_err(Unpack::Exec)?;
            }
            drop(keep_alive);
            drop(release);
        }
        Payload::Pieces(sent) => {
            if sent.len() != pieces.len() {
                return Err(Unpack::Bad(format!("{} pieces sent for {} expected", sent.len(), pieces.len())));
            }
            for (i, (s, p)) in sent.pieces().zip(pieces.views()).enumerate() {
                prefetch(p.words_ptr().wrapping_byte_add(PREFETCH_AHEAD));
                let s = s.map_err(|b| Unpack::Bad(format!("sent piece {} does not fit the sender's memory", b.block())))?;
                if s.extent != p.extent() || s.view.dtype != p.wire() {
                    return Err(Unpack::Bad(format!("sent piece for piece {} does not match it", p.block())));
                }
                // The view is in bounds of memory the sender keeps alive
                // and unwritten until `sent` (its release) is dropped.
                into.write(i, &p, &s.view).map_err(Unpack::Exec)?;
            }
            drop(sent);
        }
        Payload::Stream(mut frame) => unpack_stream(into, msg, &mut frame, stage)?,
        Payload::Bytes(bytes) => unpack_bytes(into, msg, &bytes)?,
        Payload::Lent(lent) => unpack_bytes(into, msg, lent.as_slice())?,
    }
    Ok(())
}

/// Reads pieces packed back to back in wire dtype off their stream: a
/// piece stored once in its wire type, in a buffer that exists, with rows
/// of at least [`SHORT_RUN`] bytes goes straight from the socket into its
/// span (runs gathered by `readv`); any other (short rows, converted,
/// several places, bypassed scratch, feeding local copies) is read into
/// `stage` with its neighbours, by the same `readv`, and written from
/// there; one larger than the stage is read on its own into a buffer
/// first (`buffers.large`, kept like the stage).
fn unpack_stream(
    into: &UnpackTarget<'_>,
    msg: &Message<RecvPiece>,
    frame: &mut crate::stream::StreamFrame,
    buffers: &mut RecvBuffers,
) -> Result<(), Unpack> {
    let RecvBuffers { stage, large } = buffers;
    // (`wire_bytes` saturates: a message of more than `u64` bytes is
    // none, whatever length a peer claims for it.)
    let want = msg.wire_bytes();
    if frame.len() != want || want == u64::MAX {
        return Err(Unpack::Bad(format!("{} bytes, expected {want}", frame.len())));
    }
    if stage.len() < STAGE_BYTES {
        stage.resize(STAGE_BYTES, 0);
    }
    let mut batch = ReadBatch { stage: stage.as_mut_ptr(), runs: Vec::new(), staged: Vec::new(), used: 0, batched: 0 };
    for (i, p) in msg.pieces.views().enumerate() {
        let (extent, wire) = (p.extent(), p.wire());
        if let Some(to) = direct_target(into, i, &p)?.filter(|to| run_bytes(extent, to) >= SHORT_RUN) {
            // SAFETY: `to` is in bounds (checked by `view`).
            unsafe {
                for_each_run_ptr(extent, &to, |ptr, len| {
                    batch.runs.push(libc::iovec { iov_base: ptr as *mut libc::c_void, iov_len: len });
                    batch.batched += len;
                })
            };
        } else {
            let n = (p.numel() * wire.size()) as usize;
            if n > STAGE_BYTES {
                batch.flush(frame, into)?;
                if large.len() < n {
                    large.resize(n, 0);
                }
                let piece = &mut large[..n];
                frame.read_exact(piece).map_err(broken)?;
                // SAFETY: `piece` lives, unchanged, until the end of this
                // iteration, the view's scope.
                let src = unsafe { StridedRef::new(piece.as_ptr(), piece.len(), 0, packed_strides(extent), wire) };
                into.write(i, &p, &src).map_err(Unpack::Exec)?;
                continue;
            }
            batch.stage_piece(frame, into, i, p, n)?;
        }
        if batch.runs.len() >= 512 || batch.batched >= 4 << 20 {
            batch.flush(frame, into)?;
        }
    }
    batch.flush(frame, into)
}

/// A stream read gone wrong.
fn broken(e: std::io::Error) -> Unpack {
    Unpack::Broken(format!("in a message: {e}"))
}

/// Where piece `i` (`p`) goes straight from the socket, if it can: stored
/// once in its wire type, in a buffer that exists, feeding no local copy.
fn direct_target(into: &UnpackTarget<'_>, i: usize, p: &RecvPieceView<'_>) -> Result<Option<StridedRef>, Unpack> {
    let mut spans = p.spans();
    match (spans.next(), spans.next()) {
        (Some(span), None) if p.wire() == p.dtype() && !into.bypass.skips(span.buffer as usize) && !into.feeds_locals(i) => {
            Ok(Some(view(into.me, into.mem, &span, p.wire(), p.extent(), || p.block()).map_err(Unpack::Exec)?))
        }
        _ => Ok(None),
    }
}

/// The runs [`unpack_stream`] reads by one `readv`: straight into spans,
/// or into the stage for the pieces written from there afterwards.
struct ReadBatch<'m> {
    /// The stage, [`STAGE_BYTES`] long, alive and unused elsewhere while
    /// the batch is.
    stage: *mut u8,
    runs: Vec<libc::iovec>,
    /// Pieces read into the stage since the last `readv`: (index, piece,
    /// byte offset in the stage).
    staged: Vec<(usize, RecvPieceView<'m>, usize)>,
    /// Bytes of the stage in use.
    used: usize,
    /// Bytes the runs name.
    batched: usize,
}

impl<'m> ReadBatch<'m> {
    /// Reads what the runs name, then writes the staged pieces out.
    fn flush(&mut self, frame: &mut crate::stream::StreamFrame, into: &UnpackTarget<'_>) -> Result<(), Unpack> {
        // SAFETY: every run lies inside a span checked to be in bounds of
        // this rank's own buffer, which only this thread writes, or inside
        // the stage, which nothing else uses during the call; a message's
        // pieces do not overlap (the program's invariant: each destination
        // element arrives once), and an overlap would only make two runs of
        // one `readv` write the same bytes in turn.
        unsafe { frame.read_runs(&mut self.runs) }.map_err(broken)?;
        self.runs.clear();
        for (i, p, at) in self.staged.drain(..) {
            let n = (p.numel() * p.wire().size()) as usize;
            // SAFETY: bytes `at..at + n` of the stage were just filled and
            // are not written again before this view's last use (the end
            // of this iteration); `at` is a multiple of the element size.
            let src = unsafe { StridedRef::new(self.stage.add(at), n, 0, packed_strides(p.extent()), p.wire()) };
            into.write(i, &p, &src).map_err(Unpack::Exec)?;
        }
        self.used = 0;
        self.batched = 0;
        Ok(())
    }

    /// Adds piece `i` (`p`, `n <= STAGE_BYTES` bytes on the wire) to the
    /// stage, reading what is batched first if the stage is full.
    fn stage_piece(
        &mut self,
        frame: &mut crate::stream::StreamFrame,
        into: &UnpackTarget<'_>,
        i: usize,
        p: RecvPieceView<'m>,
        n: usize,
    ) -> Result<(), Unpack> {
        // Element-aligned, so the staged piece is a view of its type.
        let mut at = self.used.next_multiple_of(p.wire().size() as usize);
        if at + n > STAGE_BYTES {
            self.flush(frame, into)?;
            at = 0;
        }
        // SAFETY: `at + n <= STAGE_BYTES`, the stage's length.
        let ptr = unsafe { self.stage.add(at) };
        match self.runs.last_mut() {
            Some(last) if (last.iov_base as usize) + last.iov_len == ptr as usize => last.iov_len += n,
            _ => self.runs.push(libc::iovec { iov_base: ptr as *mut libc::c_void, iov_len: n }),
        }
        self.staged.push((i, p, at));
        self.used = at + n;
        self.batched += n;
        Ok(())
    }
}

/// Bytes of a receiving rank's stage ([`unpack_stream`]).
const STAGE_BYTES: usize = 256 << 10;

/// Unpacks pieces packed back to back in wire dtype.
pub(super) fn unpack_bytes(into: &UnpackTarget<'_>, msg: &Message<RecvPiece>, bytes: &[u8]) -> Result<(), Unpack> {
    let want = msg.wire_bytes();
    if bytes.len() as u64 != want {
        return Err(Unpack::Bad(format!("{} bytes, expected {want}", bytes.len())));
    }
    let mut pos = 0u64;
    for (i, p) in msg.pieces.views().enumerate() {
        let (extent, wire) = (p.extent(), p.wire());
        let elem = wire.size();
        // SAFETY: `bytes` is borrowed for this whole function; the view does
        // not leave it.
        let src = unsafe { StridedRef::new(bytes.as_ptr(), bytes.len(), pos / elem, packed_strides(extent), wire) };
        if !pos.is_multiple_of(elem) {
            // Keep element alignment of offsets: copy to an aligned temporary.
            let n = (p.numel() * elem) as usize;
            let tmp = bytes[pos as usize..pos as usize + n].to_vec();
            // SAFETY: `tmp` lives until the end of this block, the view's scope.
            let src = unsafe { StridedRef::new(tmp.as_ptr(), tmp.len(), 0, src.strides, src.dtype) };
            into.write(i, &p, &src).map_err(Unpack::Exec)?;
        } else {
            // `src` is in bounds (total size checked) of `bytes`, borrowed
            // for this whole function.
            into.write(i, &p, &src).map_err(Unpack::Exec)?;
        }
        pos += p.numel() * elem;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::{run_local, run_tcp, ExecOptions};
    use crate::memory::RankMemory;
    use crate::tcp::TcpConfig;
    use crate::{fill_sources, verify_destinations};
    use reshard::{parse_layout, plan_reshard, Group, PlanOptions};

    const SRC: &str = r#"{"ranks": 2, "tensors": [
      {"name": "w", "dtype": "f32", "shape": [16, 12], "mesh": {"shape": [2]}, "placements": ["shard(1)"]},
      {"name": "v", "dtype": "bf16", "shape": [40], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
      {"name": "u", "dtype": "bf16", "shape": [6, 10], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#;
    const DST: &str = r#"{"ranks": 3, "tensors": [
      {"name": "w", "dtype": "bf16", "shape": [16, 12], "mesh": {"shape": [3]}, "placements": ["shard(0)"]},
      {"name": "v", "dtype": "bf16", "shape": [40], "mesh": {"shape": [3]}, "placements": ["replicate"]},
      {"name": "u", "dtype": "f32", "shape": [6, 10], "mesh": {"shape": [3]}, "placements": ["shard(1)"]}]}"#;

    /// In process, a receiver reads the sender's pieces in place: converted
    /// ones from the sender's staging, the others from its buffers. Every
    /// element arrives; a sender whose buffer is too short for its pieces
    /// fails the run with an error (no read outside the buffer, no panic).
    #[test]
    fn pieces_read_in_place_arrive_and_short_buffers_are_errors() {
        let (src, dst) = (parse_layout(SRC).unwrap(), parse_layout(DST).unwrap());
        for cap in [1 << 20, 64] {
            let plan = plan_reshard(&src, &dst, &PlanOptions { max_staging_bytes: cap, ..PlanOptions::default() }).unwrap();
            let programs = plan.programs(&src, &dst).unwrap();
            assert!(programs.iter().flat_map(|p| &p.rounds).flat_map(|r| &r.sends).any(|m| m.pieces.converting() > 0));
            let n_src = programs.iter().filter(|p| p.endpoint.group == Group::Src).count();
            let mut memory = RankMemory::for_programs(&programs);
            fill_sources(&src, &mut memory[..n_src]);
            run_local(&programs, &mut memory, &ExecOptions::default()).unwrap();
            verify_destinations(&src, &dst, &memory[n_src..]).unwrap();

            for (b, keep) in [(0usize, 8usize), (1, 0), (2, 3)] {
                let mut memory = RankMemory::for_programs(&programs);
                fill_sources(&src, &mut memory[..n_src]);
                memory[0].buffers[b].truncate(keep);
                let err = run_local(&programs, &mut memory, &ExecOptions::default()).unwrap_err();
                assert!(
                    matches!(err, ExecError::OutOfBounds(_) | ExecError::BadMessage { .. }),
                    "cap {cap}, buffer {b} cut to {keep} bytes: {err}"
                );
            }
        }
    }

    /// Over TCP without checksums, receivers read frames off the stream
    /// straight into place, except pieces they convert, keep in several
    /// places or feed to local copies (the baseline's bypassed scratch),
    /// which go through a small buffer: every element arrives, over many
    /// rounds too.
    #[test]
    fn frames_read_off_the_stream_into_place_are_bit_exact() {
        use reshard::plan_baseline;
        let (src, dst) = (parse_layout(SRC).unwrap(), parse_layout(DST).unwrap());
        for cap in [1 << 20, 64] {
            let options = PlanOptions { max_staging_bytes: cap, ..PlanOptions::default() };
            for plan in [plan_reshard(&src, &dst, &options).unwrap(), plan_baseline(&src, &dst, &options).unwrap()] {
                let programs = plan.programs(&src, &dst).unwrap();
                let n_src = programs.iter().filter(|p| p.endpoint.group == Group::Src).count();
                let mut memory = RankMemory::for_programs(&programs);
                fill_sources(&src, &mut memory[..n_src]);
                run_tcp(&programs, &mut memory, &ExecOptions::default(), &TcpConfig::default()).unwrap();
                verify_destinations(&src, &dst, &memory[n_src..]).unwrap();
            }
        }
    }
}
