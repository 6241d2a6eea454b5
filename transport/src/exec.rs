//! Runs per-rank programs: for every round, local copies, then pack and
//! post sends, then receive and unpack. [`run_rank`] is transport-agnostic;
//! [`run_local`] runs every rank as a thread of this process.

use crate::bypass::Bypass;
use crate::copy::{
    copy_strided_unfenced, for_each_run_ptr, in_bounds, packed_strides, prefetch, run_bytes, store_fence, StridedRef, PREFETCH_AHEAD,
};
pub use crate::cursor::RankStats;
use crate::cursor::{Action, RankCursor};
use crate::delta::{decode, encode, DeltaMemo};
use crate::frame::SHORT_RUN;
use crate::local::local_fabric;
use crate::memory::{MemView, RankMemory, RawBuf};
use crate::tcp::{tcp_fabric_for, TcpConfig, TcpTransport};
use crate::transport::{Payload, SentPieces, Transport, TransportError, Waiting};
use reshard::quant::QuantError;
use reshard::{Block, DType, Endpoint, LocalCopyView, Message, RankProgram, RecvPiece, RecvPieceView, SendPiece, Span};
use std::time::{Duration, Instant};
use thiserror::Error;

/// The time one refit's data movement may take unless told otherwise: the
/// one default of the executor, the orchestrator and the command line.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(120);

/// Executor options.
#[derive(Clone, Copy, Debug)]
pub struct ExecOptions {
    /// The whole refit must finish within this time.
    pub deadline: Duration,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions { deadline: DEFAULT_DEADLINE }
    }
}

/// Why a rank's program failed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ExecError {
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A message did not match what the program expects.
    #[error("{me}: round {round}: bad message from {peer}: {problem}")]
    BadMessage {
        /// Receiving rank.
        me: Endpoint,
        /// Round.
        round: u32,
        /// Sender.
        peer: Endpoint,
        /// What was wrong.
        problem: String,
    },
    /// A span falls outside its buffer.
    #[error("{me}: piece {block} does not fit buffer {buffer}")]
    OutOfBounds {
        /// Rank.
        me: Endpoint,
        /// Piece.
        block: Box<Block>,
        /// Buffer index.
        buffer: u32,
    },
    /// The memory given does not match the program's buffers.
    #[error("{me}: memory has {got} buffers, program needs {want}")]
    MemoryMismatch {
        /// Rank.
        me: Endpoint,
        /// Buffers given.
        got: usize,
        /// Buffers needed.
        want: usize,
    },
    /// The data plane could not be set up.
    #[error("data plane setup failed: {0}")]
    Setup(String),
    /// A rank's thread could not be started.
    #[error("{me}: cannot start a thread: {error}")]
    Spawn {
        /// Rank.
        me: Endpoint,
        /// The system's reason.
        error: String,
    },
    /// A rank thread panicked.
    #[error("{me}: rank thread panicked")]
    Panicked {
        /// Rank.
        me: Endpoint,
    },
    /// Quantizing a block-scaled tensor failed (NaN or infinity in its
    /// source values, or a program that does not fit the memory).
    #[error("{me}: {error}")]
    Quantize {
        /// Rank.
        me: Endpoint,
        /// Why.
        error: QuantError,
    },
}

/// What a whole run did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExecReport {
    /// Wall time of the data movement (threads started to all done).
    pub elapsed: Duration,
    /// Bytes moved between ranks.
    pub bytes: u64,
    /// Messages.
    pub messages: u64,
}

/// The elements of a piece of `extent` at `span`, checked to lie in its
/// buffer; `block` names the piece if not (decoded only then).
fn view(
    me: Endpoint,
    mem: &MemView,
    span: &Span,
    dtype: DType,
    extent: &[u64],
    block: impl FnOnce() -> Block,
) -> Result<StridedRef, ExecError> {
    let oob = || ExecError::OutOfBounds { me, block: Box::new(block()), buffer: span.buffer };
    let Some(buf) = mem.bufs.get(span.buffer as usize) else { return Err(oob()) };
    // SAFETY: `mem` views a rank's buffers, which outlive every rank thread
    // and every payload of the run (`MemView`'s contract).
    let r = unsafe { StridedRef::new(buf.ptr, buf.len, span.base, span.strides, dtype) };
    if in_bounds(extent, &r) {
        Ok(r)
    } else {
        Err(oob())
    }
}

/// Runs one rank's program over `transport`. On failure it tells every peer
/// (so none waits in vain) and returns the error.
pub fn run_rank<T: Transport>(
    program: &RankProgram,
    memory: &mut RankMemory,
    transport: &mut T,
    options: &ExecOptions,
) -> Result<RankStats, ExecError> {
    run_rank_bypassing(program, &Bypass::of(program), memory, transport, options)
}

/// [`run_rank`] with `program`'s [`Bypass`] (`Bypass::of(program)`) at
/// hand, for a caller that sized `memory` by it: bypassed buffers may be
/// empty.
pub fn run_rank_bypassing<T: Transport>(
    program: &RankProgram,
    bypass: &Bypass,
    memory: &mut RankMemory,
    transport: &mut T,
    options: &ExecOptions,
) -> Result<RankStats, ExecError> {
    run_on(program, bypass, &memory.view(), transport, options, None)
}

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

/// [`run_rank_bypassing`] as a delta refit; `stats.sent_bytes` is then
/// what went on the wire ([`DeltaRun::wire_bytes`]).
pub fn run_rank_delta<T: Transport>(
    program: &RankProgram,
    bypass: &Bypass,
    memory: &mut RankMemory,
    transport: &mut T,
    options: &ExecOptions,
    delta: &mut DeltaRun,
) -> Result<RankStats, ExecError> {
    run_on(program, bypass, &memory.view(), transport, options, Some(delta))
}

/// [`run_rank_bypassing`] (with `delta`, [`run_rank_delta`]) over memory
/// the caller holds rather than a [`RankMemory`]: `regions[i]` is the
/// address and length in bytes of the program's buffer `i` (a bypassed
/// buffer may be empty), in host memory. The executor reads the rank's
/// source buffers, writes its destination and scratch buffers, and lets
/// peers in this process read what it lends them until they release it.
///
/// # Safety
///
/// For the whole call every region must be valid for reads and writes of
/// its length, be written by nothing but this run, overlap no other region,
/// and hold `program.buffers[i]`'s elements (any bytes are valid values).
pub unsafe fn run_rank_regions<T: Transport>(
    program: &RankProgram,
    bypass: &Bypass,
    regions: &[(u64, usize)],
    transport: &mut T,
    options: &ExecOptions,
    delta: Option<&mut DeltaRun>,
) -> Result<RankStats, ExecError> {
    let mem = MemView { bufs: regions.iter().map(|&(addr, len)| RawBuf { ptr: addr as *mut u8, len }).collect() };
    run_on(program, bypass, &mem, transport, options, delta)
}

/// Runs the program on `mem` by the options' deadline; a delta run's
/// `sent_bytes` are what went on the wire.
fn run_on<T: Transport>(
    program: &RankProgram,
    bypass: &Bypass,
    mem: &MemView,
    transport: &mut T,
    options: &ExecOptions,
    mut delta: Option<&mut DeltaRun>,
) -> Result<RankStats, ExecError> {
    let deadline = Instant::now() + options.deadline;
    let mut stats = run_rank_inner(program, bypass, mem, transport, deadline, delta.as_deref_mut())?;
    if let Some(d) = delta {
        stats.sent_bytes = d.wire_bytes;
    }
    Ok(stats)
}

fn run_rank_inner<T: Transport>(
    program: &RankProgram,
    bypass: &Bypass,
    mem: &MemView,
    transport: &mut T,
    deadline: Instant,
    delta: Option<&mut DeltaRun>,
) -> Result<RankStats, ExecError> {
    let result = run_rounds(program, bypass, mem, transport, deadline, delta);
    if let Err(e) = &result {
        if !matches!(e, ExecError::Transport(TransportError::PeerAborted { .. })) {
            transport.abort(&e.to_string());
        }
        // Receivers may still read what this rank lent them (in process, a
        // payload points into this rank's buffers): the buffers must not be
        // handed back to their owner, who may write them, until every
        // receiver let go. Aborted receivers drop what they hold at once.
        let _ = transport.flush(u32::MAX, deadline.max(Instant::now() + RELEASE_GRACE));
    }
    result
}

/// How long a failed rank waits, beyond its deadline if need be, for its
/// receivers to release what it lent them.
const RELEASE_GRACE: Duration = Duration::from_secs(10);

fn run_rounds<T: Transport>(
    program: &RankProgram,
    bypass: &Bypass,
    mem: &MemView,
    transport: &mut T,
    deadline: Instant,
    mut delta: Option<&mut DeltaRun>,
) -> Result<RankStats, ExecError> {
    let me = program.endpoint;
    if mem.bufs.len() != program.buffers.len() {
        return Err(ExecError::MemoryMismatch { me, got: mem.bufs.len(), want: program.buffers.len() });
    }
    let mut cursor = RankCursor::new(program);
    // Where pieces read off a stream with their neighbours wait to be
    // written out (see `unpack_stream`), reused by every message.
    let mut stage: Vec<u8> = Vec::new();
    loop {
        match cursor.next_action() {
            Action::Locals { round, copies } => {
                let early = bypass.done_early(round);
                for (i, l) in copies.views().enumerate() {
                    if early.get(i).copied().unwrap_or(false) {
                        continue;
                    }
                    let extent = l.extent();
                    let from = view(me, mem, &l.from(), l.from_dtype(), extent, || l.block())?;
                    for to in l.to() {
                        let to = view(me, mem, &to, l.to_dtype(), extent, || l.block())?;
                        // SAFETY: both in bounds; scratch and shard buffers are
                        // distinct; only this thread writes this rank's buffers.
                        unsafe { copy_strided_unfenced(extent, &from, &to) };
                    }
                }
                // Streaming stores reach memory before anyone is told.
                store_fence();
            }
            Action::Send { round, message } => {
                let payload = pack(me, mem, message)?;
                let payload = match delta.as_deref_mut() {
                    None => payload,
                    Some(d) => delta_encode(me, round, message, payload, d)?,
                };
                transport.send(round, message.peer, payload)?;
            }
            Action::Recv { round } => {
                let (peer, payload) = transport.recv(round, deadline).map_err(|e| awaiting(e, &cursor, transport))?;
                let bad = |problem: String| ExecError::BadMessage { me, round, peer, problem };
                let msg = cursor.arrived(peer).map_err(|u| bad(u.problem.to_string()))?;
                let routes: Vec<(u32, LocalCopyView<'_>)> = bypass.routes(round, peer).collect();
                let into = Into { me, mem, bypass, routes: &routes };
                let unpacked = match delta.as_deref_mut() {
                    None => unpack(&into, msg, payload, &mut stage),
                    Some(d) => delta_decode(round, peer, msg, payload, d).and_then(|dense| {
                        let unpacked = unpack_bytes(&into, msg, &dense);
                        d.next.received.insert((round, peer), dense);
                        unpacked
                    }),
                };
                // Streaming stores reach memory before anyone is told.
                store_fence();
                unpacked.map_err(|e| match e {
                    Unpack::Bad(p) => bad(p),
                    Unpack::Broken(problem) => ExecError::Transport(TransportError::Broken { peer, problem }),
                    Unpack::Exec(e) => e,
                })?;
            }
            // Receivers may still read what this rank sent: wait for them.
            Action::Flush { round } => transport.flush(round, deadline)?,
            Action::Done(stats) => {
                quantize_all(program, mem)?;
                return Ok(stats);
            }
        }
    }
}

/// A receive's error, with the peers whose message of the round had not
/// come yet when it was a timeout, and what the transport knew of their
/// links.
fn awaiting<T: Transport>(e: TransportError, cursor: &RankCursor<'_>, transport: &T) -> TransportError {
    match e {
        TransportError::Timeout { me, round, waiting, closed } if waiting.is_empty() => {
            let waiting = cursor.awaited().map(|peer| Waiting { peer, link: transport.link_from(peer) }).collect();
            TransportError::Timeout { me, round, waiting, closed }
        }
        e => e,
    }
}

/// Runs a destination program's quantize steps on its memory, after every
/// receive: what [`run_rank`] does last, for data planes whose transfers
/// ran elsewhere (the GPU ones copy a rank's buffers back, quantize here,
/// and copy the result to the device).
pub fn quantize_rank(program: &RankProgram, memory: &mut RankMemory) -> Result<(), ExecError> {
    // (Every region is checked against its buffer before any is touched.)
    if memory.buffers.len() != program.buffers.len() {
        return Err(ExecError::MemoryMismatch { me: program.endpoint, got: memory.buffers.len(), want: program.buffers.len() });
    }
    let view = memory.view();
    quantize_all(program, &view)
}

/// A destination rank's last step: its block-scaled tensors quantized from
/// the whole blocks it received ([`reshard::quant`]).
fn quantize_all(program: &RankProgram, mem: &MemView) -> Result<(), ExecError> {
    let me = program.endpoint;
    for op in &program.quantize {
        let oob = |what| ExecError::Quantize { me, error: QuantError::OutOfBounds { tensor: op.tensor.clone(), what } };
        // Output regions: in bounds, pairwise disjoint, outside every
        // buffer read as staged values.
        let mut regions: Vec<(u32, usize, usize)> = Vec::with_capacity(op.weights.len() + op.scales.len());
        for (list, size, what) in [(&op.weights, 1u64, "weight"), (&op.scales, 4, "scale")] {
            for st in list.iter() {
                let buf = mem.bufs.get(st.buffer as usize).ok_or_else(|| oob(what))?;
                let start = st.at.checked_mul(size).ok_or_else(|| oob(what))?;
                let end = st
                    .block
                    .checked_numel()
                    .and_then(|n| n.checked_mul(size))
                    .and_then(|n| n.checked_add(start))
                    .ok_or_else(|| oob(what))?;
                if end > buf.len as u64 || op.staged.iter().any(|s| s.buffer == st.buffer) {
                    return Err(oob(what));
                }
                regions.push((st.buffer, start as usize, end as usize));
            }
        }
        let mut sorted = regions.clone();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2) {
            return Err(oob("overlapping"));
        }
        let staged = |b: u32| -> Option<&[u8]> {
            if !op.staged.iter().any(|s| s.buffer == b) {
                return None;
            }
            let buf = mem.bufs.get(b as usize)?;
            // SAFETY: `mem` views this rank's buffers, alive for the run
            // (`MemView`'s contract). Every receive of the program is done
            // and every send flushed, so no thread writes this rank's
            // buffers now; this one only reads these.
            Some(unsafe { std::slice::from_raw_parts(buf.ptr, buf.len) })
        };
        let mut outs: Vec<&mut [u8]> = regions
            .iter()
            .map(|&(b, start, end)| {
                let buf = mem.bufs[b as usize];
                // SAFETY: checked above: in bounds of a buffer of this rank
                // that outlives the run, pairwise disjoint, and in no buffer
                // read as staged values; no plan sends from these regions
                // (a block-scaled tensor is delivered to its staged buffer
                // only) and all sends were flushed, so nothing else reads
                // or writes them while these slices live (to the end of
                // this iteration, on every path).
                unsafe { std::slice::from_raw_parts_mut(buf.ptr.add(start), end - start) }
            })
            .collect();
        let (weights, scales) = outs.split_at_mut(op.weights.len());
        reshard::quant::quantize(op, &staged, weights, scales).map_err(|error| ExecError::Quantize { me, error })?;
    }
    Ok(())
}

/// A message's pieces, read in place from this rank's program and buffers
/// by whoever carries the payload. Pieces whose wire type differs are
/// converted into one staging area (carried with the payload), back to
/// back, each at an offset aligned to its wire element size; a message
/// without them costs nothing here, whatever its number of pieces.
fn pack(me: Endpoint, mem: &MemView, msg: &Message<SendPiece>) -> Result<Payload, ExecError> {
    let mut staging = Vec::new();
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
                .ok_or_else(|| ExecError::OutOfBounds { me, block: Box::new(p.block()), buffer: u32::MAX })?;
        }
        let staged = usize::try_from(staged).map_err(|_| ExecError::Setup(format!("{me}: {staged} bytes of staging do not fit")))?;
        staging = vec![0u8; staged];
        let mut pos = 0u64;
        for p in msg.pieces.views().filter(|p| p.dtype() != p.wire()) {
            let (extent, dtype, wire) = (p.extent(), p.dtype(), p.wire());
            let src = view(me, mem, &p.span(), dtype, extent, || p.block())?;
            let elem = wire.size();
            pos = pos.next_multiple_of(elem);
            // SAFETY: the staging vector is ours, and its heap buffer outlives
            // this view (used for this one copy).
            let dst = unsafe { StridedRef::new(staging.as_mut_ptr(), staging.len(), pos / elem, packed_strides(extent), wire) };
            if !in_bounds(extent, &dst) {
                return Err(ExecError::OutOfBounds { me, block: Box::new(p.block()), buffer: u32::MAX });
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

/// A message's packed bytes, encoded against the same message of the base
/// refit (see [`crate::delta`]); the packed bytes go into this run's memo.
fn delta_encode(me: Endpoint, round: u32, msg: &Message<SendPiece>, payload: Payload, d: &mut DeltaRun) -> Result<Payload, ExecError> {
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
fn delta_decode(round: u32, peer: Endpoint, msg: &Message<RecvPiece>, payload: Payload, d: &mut DeltaRun) -> Result<Vec<u8>, Unpack> {
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

enum Unpack {
    Bad(String),
    /// The stream the message arrived on broke while it was read.
    Broken(String),
    Exec(ExecError),
}

/// Where a message's pieces go: this rank's memory, less bypassed scratch,
/// plus the local copies made straight from a piece.
struct Into<'a> {
    me: Endpoint,
    mem: &'a MemView,
    bypass: &'a Bypass,
    /// Copies made on receipt, by piece.
    routes: &'a [(u32, LocalCopyView<'a>)],
}

impl Into<'_> {
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
                return Err(ExecError::OutOfBounds { me, block: Box::new(block), buffer: copy.from().buffer });
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

fn unpack(into: &Into<'_>, msg: &Message<RecvPiece>, payload: Payload, stage: &mut Vec<u8>) -> Result<(), Unpack> {
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
/// first.
fn unpack_stream(
    into: &Into<'_>,
    msg: &Message<RecvPiece>,
    frame: &mut crate::tcp::StreamFrame,
    stage: &mut Vec<u8>,
) -> Result<(), Unpack> {
    // (`wire_bytes` saturates: a message of more than `u64` bytes is
    // none, whatever length a peer claims for it.)
    let want = msg.wire_bytes();
    if frame.len() != want || want == u64::MAX {
        return Err(Unpack::Bad(format!("{} bytes, expected {want}", frame.len())));
    }
    let broken = |e: std::io::Error| Unpack::Broken(format!("in a message: {e}"));
    if stage.len() < STAGE_BYTES {
        stage.resize(STAGE_BYTES, 0);
    }
    let stage_ptr = stage.as_mut_ptr();
    let mut runs: Vec<libc::iovec> = Vec::new();
    let mut batched = 0usize;
    // Pieces read into the stage since the last `readv`: (index, piece,
    // byte offset in the stage).
    let mut staged: Vec<(usize, RecvPieceView<'_>, usize)> = Vec::new();
    let mut used = 0usize;
    // Reads what `runs` names, then writes the staged pieces out.
    let flush = |frame: &mut crate::tcp::StreamFrame,
                 runs: &mut Vec<libc::iovec>,
                 staged: &mut Vec<(usize, RecvPieceView<'_>, usize)>,
                 used: &mut usize| {
        // SAFETY: every run lies inside a span checked to be in bounds of
        // this rank's own buffer, which only this thread writes, or inside
        // the stage, which nothing else uses during the call; a message's
        // pieces do not overlap (the program's invariant: each destination
        // element arrives once), and an overlap would only make two runs of
        // one `readv` write the same bytes in turn.
        unsafe { frame.read_runs(runs) }.map_err(broken)?;
        runs.clear();
        for (i, p, at) in staged.drain(..) {
            let n = (p.numel() * p.wire().size()) as usize;
            // SAFETY: bytes `at..at + n` of the stage were just filled and
            // are not written again before this view's last use (the end
            // of this iteration); `at` is a multiple of the element size.
            let src = unsafe { StridedRef::new(stage_ptr.add(at), n, 0, packed_strides(p.extent()), p.wire()) };
            into.write(i, &p, &src).map_err(Unpack::Exec)?;
        }
        *used = 0;
        Ok::<(), Unpack>(())
    };
    let mut tmp: Vec<u8> = Vec::new();
    for (i, p) in msg.pieces.views().enumerate() {
        let (extent, wire) = (p.extent(), p.wire());
        let mut spans = p.spans();
        let direct = match (spans.next(), spans.next()) {
            (Some(span), None) if wire == p.dtype() && !into.bypass.skips(span.buffer as usize) && !into.feeds_locals(i) => Some(span),
            _ => None,
        };
        let to = match direct {
            Some(span) => Some(view(into.me, into.mem, &span, wire, extent, || p.block()).map_err(Unpack::Exec)?),
            None => None,
        };
        if let Some(to) = to.filter(|to| run_bytes(extent, to) >= SHORT_RUN) {
            // SAFETY: `to` is in bounds (checked by `view`).
            unsafe {
                for_each_run_ptr(extent, &to, |ptr, len| {
                    runs.push(libc::iovec { iov_base: ptr as *mut libc::c_void, iov_len: len });
                    batched += len;
                })
            };
        } else {
            let n = (p.numel() * wire.size()) as usize;
            if n > STAGE_BYTES {
                flush(frame, &mut runs, &mut staged, &mut used)?;
                batched = 0;
                tmp.clear();
                tmp.resize(n, 0);
                frame.read_exact(&mut tmp).map_err(broken)?;
                // SAFETY: `tmp` lives, unchanged, until the end of this
                // iteration, the view's scope.
                let src = unsafe { StridedRef::new(tmp.as_ptr(), tmp.len(), 0, packed_strides(extent), wire) };
                into.write(i, &p, &src).map_err(Unpack::Exec)?;
                continue;
            }
            // Element-aligned, so the staged piece is a view of its type.
            let mut at = used.next_multiple_of(wire.size() as usize);
            if at + n > STAGE_BYTES {
                flush(frame, &mut runs, &mut staged, &mut used)?;
                batched = 0;
                at = 0;
            }
            // SAFETY: `at + n <= STAGE_BYTES`, the stage's length.
            let ptr = unsafe { stage_ptr.add(at) };
            match runs.last_mut() {
                Some(last) if (last.iov_base as usize) + last.iov_len == ptr as usize => last.iov_len += n,
                _ => runs.push(libc::iovec { iov_base: ptr as *mut libc::c_void, iov_len: n }),
            }
            staged.push((i, p, at));
            used = at + n;
            batched += n;
        }
        if runs.len() >= 512 || batched >= 4 << 20 {
            flush(frame, &mut runs, &mut staged, &mut used)?;
            batched = 0;
        }
    }
    flush(frame, &mut runs, &mut staged, &mut used)?;
    Ok(())
}

/// Bytes of a receiving rank's stage ([`unpack_stream`]).
const STAGE_BYTES: usize = 256 << 10;

/// Unpacks pieces packed back to back in wire dtype.
fn unpack_bytes(into: &Into<'_>, msg: &Message<RecvPiece>, bytes: &[u8]) -> Result<(), Unpack> {
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

/// Runs all programs, one thread per rank with work, over the in-process
/// transport. `memory[i]` belongs to `programs[i]`. Returns the first root
/// cause if any rank fails (other ranks then stop on the abort).
pub fn run_local(programs: &[RankProgram], memory: &mut [RankMemory], options: &ExecOptions) -> Result<ExecReport, ExecError> {
    let endpoints: Vec<Endpoint> = programs.iter().map(|p| p.endpoint).collect();
    run_threads(programs, memory, options, local_fabric(&endpoints))
}

/// Runs all programs as threads of this process over loopback TCP streams
/// (one per ordered pair of ranks): the TCP data plane end to end, without
/// separate processes.
pub fn run_tcp(
    programs: &[RankProgram],
    memory: &mut [RankMemory],
    options: &ExecOptions,
    config: &TcpConfig,
) -> Result<ExecReport, ExecError> {
    let transports = tcp_fabric_for(programs, config).map_err(|e| ExecError::Setup(e.to_string()))?;
    run_threads(programs, memory, options, transports)
}

/// Runs `programs[i]` on `memory[i]` over `transports[i]`, a thread per rank
/// with work; returns the first root cause if any rank fails.
pub fn run_threads<T: Transport + WithAbort>(
    programs: &[RankProgram],
    memory: &mut [RankMemory],
    options: &ExecOptions,
    transports: Vec<T>,
) -> Result<ExecReport, ExecError> {
    run_threads_inner(programs, memory, options, transports, None).map(|(report, _)| report)
}

/// [`run_threads`] as a delta refit ([`run_rank_delta`]): `bases[i]` is
/// rank `i`'s memo of the base refit (`None`: dense). Returns the report
/// (`bytes`: what went on the wire) and every rank's memo of this run.
pub fn run_threads_delta<T: Transport + WithAbort>(
    programs: &[RankProgram],
    memory: &mut [RankMemory],
    options: &ExecOptions,
    transports: Vec<T>,
    bases: Vec<Option<DeltaMemo>>,
) -> Result<(ExecReport, Vec<DeltaMemo>), ExecError> {
    if bases.len() != programs.len() {
        return Err(ExecError::Setup(format!("{} delta bases for {} programs", bases.len(), programs.len())));
    }
    run_threads_inner(programs, memory, options, transports, Some(bases))
}

/// [`run_threads_delta`] over the in-process transport.
pub fn run_local_delta(
    programs: &[RankProgram],
    memory: &mut [RankMemory],
    options: &ExecOptions,
    bases: Vec<Option<DeltaMemo>>,
) -> Result<(ExecReport, Vec<DeltaMemo>), ExecError> {
    let endpoints: Vec<Endpoint> = programs.iter().map(|p| p.endpoint).collect();
    run_threads_delta(programs, memory, options, local_fabric(&endpoints), bases)
}

/// One thread per rank with work, ordinary or (with `bases`) delta runs.
fn run_threads_inner<T: Transport + WithAbort>(
    programs: &[RankProgram],
    memory: &mut [RankMemory],
    options: &ExecOptions,
    transports: Vec<T>,
    bases: Option<Vec<Option<DeltaMemo>>>,
) -> Result<(ExecReport, Vec<DeltaMemo>), ExecError> {
    let views: Vec<MemView> = memory.iter_mut().map(|m| m.view()).collect();
    let delta = bases.is_some();
    let mut bases: Vec<Option<Option<DeltaMemo>>> = match bases {
        Some(b) => b.into_iter().map(Some).collect(),
        None => vec![None; programs.len()],
    };
    let start = Instant::now();
    let deadline = start + options.deadline;
    // One thread per rank with work. (Running send-only ranks on this
    // thread instead would deadlock: a sender waits in `flush` for a
    // receiver that waits for a sender not yet started.)
    type Ran = (Result<RankStats, ExecError>, DeltaMemo);
    let mut results: Vec<Option<Ran>> = (0..programs.len()).map(|_| None).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = programs
            .iter()
            .zip(transports)
            .zip(&views)
            .zip(bases.iter_mut().map(Option::take))
            .enumerate()
            .filter(|(_, (((p, _), _), _))| p.rounds.iter().any(|r| !(r.sends.is_empty() && r.recvs.is_empty() && r.locals.is_empty())))
            .map(|(i, (((p, mut t), v), base))| {
                let abort = t.abort_all();
                let spawned = std::thread::Builder::new().spawn_scoped(scope, move || {
                    let mut run = base.map(DeltaRun::new);
                    let r = run_rank_inner(p, &Bypass::of(p), v, &mut t, deadline, run.as_mut());
                    match run {
                        Some(d) => (r.map(|s| RankStats { sent_bytes: d.wire_bytes, ..s }), d.next),
                        None => (r, DeltaMemo::default()),
                    }
                });
                if let Err(e) = &spawned {
                    abort(&format!("could not start a thread: {e}"));
                }
                (i, p.endpoint, spawned)
            })
            .collect();
        for (i, me, h) in handles {
            results[i] = Some(match h {
                Ok(h) => h.join().unwrap_or((Err(ExecError::Panicked { me }), DeltaMemo::default())),
                Err(e) => (Err(ExecError::Spawn { me, error: e.to_string() }), DeltaMemo::default()),
            });
        }
    });
    let elapsed = start.elapsed();
    let mut first_err = None;
    let mut report = ExecReport { elapsed, ..ExecReport::default() };
    let mut memos = Vec::with_capacity(if delta { programs.len() } else { 0 });
    for (r, memo) in results.into_iter().map(|r| r.unwrap_or((Ok(RankStats::default()), DeltaMemo::default()))) {
        match r {
            Ok(s) => {
                report.bytes += s.sent_bytes;
                report.messages += s.messages;
            }
            Err(e) => {
                // A peer that aborted, or whose end is gone, is the
                // consequence of another rank's failure: that one is the
                // root cause.
                let secondary = |e: &ExecError| {
                    matches!(e, ExecError::Transport(TransportError::PeerAborted { .. } | TransportError::Disconnected { .. }))
                };
                match &first_err {
                    None => first_err = Some(e),
                    Some(f) if secondary(f) && !secondary(&e) => first_err = Some(e),
                    _ => {}
                }
            }
        }
        if delta {
            memos.push(memo);
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok((report, memos)),
    }
}

/// A transport that can hand out a way to abort all its peers, for when
/// its rank's thread cannot even start.
pub trait WithAbort {
    /// A function that tells every peer this rank gave up.
    fn abort_all(&self) -> Box<dyn Fn(&str) + Send>;
}

impl<T: WithAbort + ?Sized> WithAbort for &mut T {
    fn abort_all(&self) -> Box<dyn Fn(&str) + Send> {
        (**self).abort_all()
    }
}

impl WithAbort for crate::local::LocalTransport {
    fn abort_all(&self) -> Box<dyn Fn(&str) + Send> {
        let h = self.abort_handle();
        Box::new(move |reason| h.abort(reason))
    }
}

impl WithAbort for TcpTransport {
    fn abort_all(&self) -> Box<dyn Fn(&str) + Send> {
        // Shutting every stream down fails whatever this rank is blocked
        // on, and its peers see the links break (no goodbye).
        let kill = self.kill_switch();
        Box::new(move |_| kill())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
                    matches!(err, ExecError::OutOfBounds { .. } | ExecError::BadMessage { .. }),
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
