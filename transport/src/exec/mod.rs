//! Runs per-rank programs: for every round, local copies, then pack and
//! post sends, then receive and unpack. [`run_rank`] is transport-agnostic;
//! [`run_local`] runs every rank as a thread of this process.

use crate::bypass::Bypass;
use crate::copy::{copy_strided_unfenced, store_fence, StridedRef};
pub use crate::cursor::RankStats;
use crate::cursor::{Action, RankCursor};
use crate::memory::{MemView, RankMemory, RawBuf};
use crate::transport::{Transport, TransportError, Waiting};
use crate::{RecvBuffers, StagingPool};
use reshard::QuantError;
use reshard::{Block, DType, Endpoint, LocalCopyView, RankProgram, Span};
use std::time::{Duration, Instant};
use thiserror::Error;

mod delta_run;
mod pack;
#[cfg(any(test, feature = "testkit"))]
mod threads;

pub(crate) use crate::delta::DeltaRun;
use delta_run::{delta_decode, delta_encode};
use pack::{pack, unpack, unpack_bytes, Convert, Unpack, UnpackTarget};
#[cfg(any(test, feature = "testkit"))]
pub use threads::{run_local, run_local_delta, run_tcp, run_threads, run_threads_delta};

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
    #[error(transparent)]
    OutOfBounds(#[from] PieceOutOfBounds),
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

/// A piece whose span does not fit its buffer (no such buffer, another
/// dtype, or past its end): every executor's check, one error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{me}: piece {block} does not fit buffer {buffer}")]
pub struct PieceOutOfBounds {
    /// Rank.
    pub me: Endpoint,
    /// Piece.
    pub block: Box<Block>,
    /// Buffer index (`u32::MAX`: a packed piece of a message).
    pub buffer: u32,
}

impl PieceOutOfBounds {
    /// Piece `block` of rank `me` in buffer `buffer`.
    pub(crate) fn new(me: Endpoint, block: Block, buffer: u32) -> PieceOutOfBounds {
        PieceOutOfBounds { me, block: Box::new(block), buffer }
    }
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
    mem.strided(span, dtype, extent).ok_or_else(|| PieceOutOfBounds::new(me, block(), span.buffer).into())
}

/// Runs one rank's program over `transport`. On failure it tells every peer
/// (so none waits in vain) and returns the error.
pub fn run_rank<T: Transport>(
    program: &RankProgram,
    memory: &mut RankMemory,
    transport: &mut T,
    options: &ExecOptions,
) -> Result<RankStats, ExecError> {
    run_rank_bypassing(program, &Bypass::of(program), memory, transport, options, &StagingPool::default())
}

/// [`run_rank`] with `program`'s [`Bypass`] (`Bypass::of(program)`) at
/// hand, for a caller that sized `memory` by it: bypassed buffers may be
/// empty.
pub(crate) fn run_rank_bypassing<T: Transport>(
    program: &RankProgram,
    bypass: &Bypass,
    memory: &mut RankMemory,
    transport: &mut T,
    options: &ExecOptions,
    pool: &StagingPool,
) -> Result<RankStats, ExecError> {
    run_on(program, bypass, &memory.view(), transport, options, None, pool)
}

/// [`run_rank_bypassing`] as a delta refit; `stats.sent_bytes` is then
/// what went on the wire ([`DeltaRun::wire_bytes`]).
pub(crate) fn run_rank_delta<T: Transport>(
    program: &RankProgram,
    bypass: &Bypass,
    memory: &mut RankMemory,
    transport: &mut T,
    options: &ExecOptions,
    delta: &mut DeltaRun,
    pool: &StagingPool,
) -> Result<RankStats, ExecError> {
    run_on(program, bypass, &memory.view(), transport, options, Some(delta), pool)
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
pub(crate) unsafe fn run_rank_regions<T: Transport>(
    program: &RankProgram,
    bypass: &Bypass,
    regions: &[(u64, usize)],
    transport: &mut T,
    options: &ExecOptions,
    delta: Option<&mut DeltaRun>,
    pool: &StagingPool,
) -> Result<RankStats, ExecError> {
    let mem = MemView { bufs: regions.iter().map(|&(addr, len)| RawBuf { ptr: addr as *mut u8, len }).collect() };
    run_on(program, bypass, &mem, transport, options, delta, pool)
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
    pool: &StagingPool,
) -> Result<RankStats, ExecError> {
    let deadline = Instant::now() + options.deadline;
    let mut stats = run_rank_inner(program, bypass, mem, transport, deadline, delta.as_deref_mut(), pool)?;
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
    pool: &StagingPool,
) -> Result<RankStats, ExecError> {
    let result = run_rounds(program, bypass, mem, transport, deadline, delta, pool);
    if let Err(e) = &result {
        // Every peer hears of it, also when a peer's abort caused it: one
        // waiting for this rank's messages would otherwise wait for its
        // deadline (a rank that leaves without aborting only says goodbye).
        transport.abort(&e.to_string());
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
    pool: &StagingPool,
) -> Result<RankStats, ExecError> {
    let me = program.endpoint;
    if mem.bufs.len() != program.buffers.len() {
        return Err(ExecError::MemoryMismatch { me, got: mem.bufs.len(), want: program.buffers.len() });
    }
    // A source rank quantizes the block-scaled tensors it sends as codes
    // before it sends anything.
    if program.quantizes_first() {
        quantize_all(program, mem)?;
    }
    let mut cursor = RankCursor::new(program);
    // Where pieces read off a stream with their neighbours wait to be
    // written out (see `unpack_stream`), reused by every message and kept
    // for the plan's next run.
    let mut stage = RecvLease { pool, buffers: pool.take_recv() };
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
                // A delta encoder reads the payload's bytes: converted here.
                let convert = match delta {
                    None if transport.converts_on_send(message.peer) => Convert::OnSend,
                    _ => Convert::Here,
                };
                let payload = pack(me, mem, message, pool, convert)?;
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
                let into = UnpackTarget { me, mem, bypass, routes: &routes };
                let unpacked = match delta.as_deref_mut() {
                    None => unpack(&into, msg, payload, &mut stage.buffers),
                    Some(d) => delta_decode(round, peer, msg, payload, d).and_then(|kept| {
                        let unpacked = unpack_bytes(&into, msg, &kept.bytes);
                        d.next.received.insert((round, peer), kept);
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
                if !program.quantizes_first() {
                    quantize_all(program, mem)?;
                }
                return Ok(stats);
            }
        }
    }
}

/// A run's receive buffers, back to their pool when the run ends (on any
/// path).
struct RecvLease<'a> {
    pool: &'a StagingPool,
    buffers: RecvBuffers,
}

impl Drop for RecvLease<'_> {
    fn drop(&mut self) {
        self.pool.give_recv(std::mem::take(&mut self.buffers));
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

/// Runs a program's quantize steps on its memory: what [`run_rank`] does
/// first on a source rank and last on a destination rank
/// ([`RankProgram::quantizes_first`]), for data planes whose transfers run
/// elsewhere (the GPU ones copy a rank's buffers back, quantize here, and
/// copy the result to the device).
pub fn quantize_rank(program: &RankProgram, memory: &mut RankMemory) -> Result<(), ExecError> {
    // (Every region is checked against its buffer before any is touched.)
    if memory.buffers.len() != program.buffers.len() {
        return Err(ExecError::MemoryMismatch { me: program.endpoint, got: memory.buffers.len(), want: program.buffers.len() });
    }
    let view = memory.view();
    quantize_all(program, &view)
}

/// A source rank's first step or a destination rank's last: its
/// block-scaled tensors quantized ([`reshard::quantize`]) from the boxes it
/// holds or the whole blocks it received.
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
            // (`MemView`'s contract). No thread writes this rank's buffers
            // now: on a destination every receive of the program is done
            // and every send flushed; a source runs this before its first
            // action, and its holdings are read-only during a refit (the
            // store's version fence). This one only reads these.
            Some(unsafe { std::slice::from_raw_parts(buf.ptr, buf.len) })
        };
        let mut outs: Vec<&mut [u8]> = regions
            .iter()
            .map(|&(b, start, end)| {
                let buf = mem.bufs[b as usize];
                // SAFETY: checked above: in bounds of a buffer of this rank
                // that outlives the run, pairwise disjoint, and in no buffer
                // read as staged values. Nothing else reads or writes them
                // while these slices live (to the end of this iteration, on
                // every path): on a destination no plan sends from these
                // regions (a block-scaled tensor quantized there is
                // delivered to its staged buffer only) and all sends were
                // flushed; on a source this runs before its first action,
                // so no message of this run points into them yet, and every
                // earlier run flushed (its receivers let go) before it
                // returned.
                unsafe { std::slice::from_raw_parts_mut(buf.ptr.add(start), end - start) }
            })
            .collect();
        let (weights, scales) = outs.split_at_mut(op.weights.len());
        reshard::quantize(op, &staged, weights, scales).map_err(|error| ExecError::Quantize { me, error })?;
    }
    Ok(())
}
