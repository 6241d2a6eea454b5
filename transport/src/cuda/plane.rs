//! The communicator executor: one rank's program over a communicator
//! ([`CommHandle`]: NCCL, or the simulated one of [`sim`](crate::cuda::sim)),
//! its buffers in memory a [`PlaneMemory`] addresses (device memory, or
//! host memory standing in for it).
//!
//! The program is walked by its cursor ([`RoundCursor`]), a round at a
//! time, which also counts what the rank moves. Per round: the local
//! copies; every outgoing message packed into one contiguous send staging
//! buffer (pieces in wire dtype, back to back at
//! 256-byte boundaries, [`message_layout`]); one group with all the
//! round's sends and receives, ordered after the packing by the memory's
//! fence (a device event, not a synchronisation of the host); then every
//! received message unpacked from the receive staging buffer. A source
//! rank quantizes the block-scaled tensors it sends as codes before its
//! first round; after the last round the memory finishes its queued work
//! and a destination rank quantizes what it received.
//!
//! The same loop runs on a GPU (on a `DevicePlaneMemory`) and, with
//! [`sim::SimMemory`](crate::cuda::sim::SimMemory) and the simulated
//! communicator, on any machine: what the orchestrator does with
//! communicators is tested without a GPU.
//!
//! Invariant: **a group names only staging**, never the rank's own
//! buffers. A group that fails may leave the communicator working on its
//! staging until the communicator is aborted (or forever, if the abort
//! hangs), so the memory gives up its staging instead of reusing or freeing
//! it ([`PlaneMemory::abandon_staging`]); the rank's buffers go back to
//! their owner untouched by the communicator.

use crate::copy::{fits, packed_strides};
use crate::cuda::comm::{CommHandle, Fence, P2p};
use crate::cuda::copyplan::packed_offsets;
use crate::cuda::direct::{self, done_reading, offer_of, read_directly, RegionOffer};
pub use crate::cuda::plane_error::CommExecError;
pub(crate) use crate::cuda::plane_error::{DeltaMessageError, PeerMissing, PlaneError, UnknownPeer};
use crate::cursor::{RankStats, Round, RoundCursor, Unexpected};
use crate::delta::{decode_kept, encode_kept, unit_of, DeltaRun, KeptMessage};
use crate::exec::PieceOutOfBounds;
use reshard::{Block, DType, Endpoint, Group, RankProgram, Span};
use std::time::Instant;

/// One side of a piece: the address of the region it lies in (a buffer of
/// the rank, or staging), its span in that region, its dtype.
pub(crate) type Side = (u64, Span, DType);

/// Which staging buffer of a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StagingSide {
    /// The round's outgoing messages.
    Send,
    /// The round's incoming messages.
    Recv,
}

/// The memory a rank's program runs on, as the communicator executor needs
/// it. Implementations check every side they are given against the region
/// it names (a buffer of [`PlaneMemory::addrs`] or the current staging) and
/// refuse one that does not fit, so no call can reach outside them.
pub trait PlaneMemory {
    /// Base address of each of the rank's buffers, in program order.
    fn addrs(&self) -> &[u64];
    /// Bytes of each buffer.
    fn lens(&self) -> &[usize];
    /// Element type of each buffer.
    fn dtypes(&self) -> &[DType];
    /// The address of staging `which` with room for `len` bytes (grown as
    /// needed: an earlier address of the same staging is then stale).
    fn staging(&mut self, which: StagingSide, len: usize) -> Result<u64, PlaneError>;
    /// Moves `block` from `from` through dtype `wire` into each of `to`
    /// (queued in order after everything queued before).
    fn move_piece(&mut self, block: &Block, from: Side, wire: DType, to: &[Side]) -> Result<(), PlaneError>;
    /// Marks everything queued so far; the next group starts after it. The
    /// event (if any) stays alive until the next call of `fence` or
    /// `finish`.
    fn fence(&mut self) -> Result<Option<Fence>, PlaneError>;
    /// A group failed while the communicator may still use the staging:
    /// never reuse or free it. Returns the bytes given up.
    fn abandon_staging(&mut self) -> u64;
    /// Copies `out.len()` bytes from byte `at` of staging `which` (as last
    /// sized) into `out`, after everything queued: a delta refit encodes
    /// a packed message on the host. Refuses a range outside the staging.
    fn read_staging(&mut self, which: StagingSide, at: u64, out: &mut [u8]) -> Result<(), PlaneError>;
    /// Copies `bytes` to byte `at` of staging `which`, done before
    /// anything queued after this call. Refuses a range outside the
    /// staging.
    fn write_staging(&mut self, which: StagingSide, at: u64, bytes: &[u8]) -> Result<(), PlaneError>;
    /// Waits for everything queued.
    fn finish(&mut self) -> Result<(), PlaneError>;
    /// Waits for everything queued, then runs the program's quantize
    /// steps on the rank's buffers (a source's first step, a
    /// destination's last: [`RankProgram::quantizes_first`]).
    fn quantize(&mut self, program: &RankProgram) -> Result<(), PlaneError>;
    /// Offers buffer `buffer` of this rank to a reader on the same device
    /// ([`direct`](crate::cuda::direct)): the region as the peer maps it.
    /// The buffer must stay as it is until the reader says it is done.
    fn offer(&mut self, buffer: u32) -> Result<RegionOffer, PlaneError>;
    /// Maps, for this run, a region `peer` (on the same device) offered:
    /// its address here, which [`PlaneMemory::move_piece`] then takes as
    /// a source side (checked against the region like any other side).
    fn map_offer(&mut self, peer: Endpoint, offer: &RegionOffer) -> Result<u64, PlaneError>;
}

/// The usual rank numbering of one communicator over both groups: source
/// ranks first, then destination ranks.
pub fn comm_rank(endpoint: Endpoint, src_ranks: u32) -> u32 {
    match endpoint.group {
        Group::Src => endpoint.rank,
        Group::Dst => src_ranks + endpoint.rank,
    }
}

/// Byte layout of one message in a contiguous staging buffer: pieces back
/// to back in wire dtype, each at a 256-byte boundary. Both ends of a
/// transfer compute the same layout from the same plan. `None` where the
/// sizes pass `u64` (counts from a program: a wrapped layout would let a
/// group reach past its staging).
pub(crate) fn message_layout(pieces: impl IntoIterator<Item = (Option<u64>, DType)>) -> Option<(Vec<u64>, u64)> {
    let bytes = pieces.into_iter().map(|(numel, wire)| numel?.checked_mul(wire.size())).collect::<Option<Vec<u64>>>()?;
    packed_offsets(&bytes, 256)
}

/// [`message_layout`] of an outgoing message.
fn send_layout(m: &reshard::Message<reshard::SendPiece>) -> Option<(Vec<u64>, u64)> {
    message_layout(m.pieces.views().map(|p| (p.checked_numel(), p.wire())))
}

/// [`message_layout`] of an incoming message.
fn recv_layout(m: &reshard::Message<reshard::RecvPiece>) -> Option<(Vec<u64>, u64)> {
    message_layout(m.pieces.views().map(|p| (p.checked_numel(), p.wire())))
}

/// Bytes `at..at + len` of a staging region of `held` bytes, as offsets
/// into it; an error naming the staging where any of them falls outside
/// (a length or offset from a peer or a program is never trusted: the sum
/// is checked, not wrapped).
pub(crate) fn staging_span(which: StagingSide, held: usize, at: u64, len: usize) -> Result<std::ops::Range<usize>, PlaneError> {
    let span = usize::try_from(at).ok().and_then(|start| Some(start..start.checked_add(len)?));
    span.filter(|s| s.end <= held).ok_or(PlaneError::StagingRange { which, held, at, len })
}

/// The send staging `program` needs: its largest round's outgoing
/// messages laid out as the executor lays them out, dense or as a delta
/// refit's encodings and their lengths (`RoundStaging`) — the size of
/// the bucket an IPC communicator exports; `u64::MAX`, which no
/// allocation grants, where a round's messages pass `u64` bytes.
pub fn send_staging_bytes(program: &RankProgram) -> u64 {
    program
        .rounds
        .iter()
        .map(|round| {
            // A message to a reader on the same device is an offer instead
            // of its packed pieces; a rank that read directly sends each
            // sender a done token.
            let lens = round.sends.iter().map(|m| Some(send_layout(m)?.1.max(direct::offer_bytes(m.pieces.len())?)));
            let dense = lens.collect::<Option<Vec<u64>>>().and_then(|l| RoundStaging::new(&l)).map(|s| s.bytes(true));
            let done = done_layout(round.recvs.len()).map(|l| l.1);
            dense.zip(done).map_or(u64::MAX, |(d, t)| d.max(t))
        })
        .max()
        .unwrap_or(0)
}

/// Where `n` done tokens (8 bytes each) lie in a staging buffer.
pub(crate) fn done_layout(n: usize) -> Option<(Vec<u64>, u64)> {
    message_layout(std::iter::repeat_n((Some(8), DType::U8), n))
}

/// Where one direction's messages of a round lie in its staging: dense
/// (each message's packed bytes), and for a delta refit each message's
/// length (8 bytes, little-endian) and its encoding (at most the message
/// plus [`delta::HEADER`](crate::delta::HEADER) bytes). Every message
/// starts at a 256-byte boundary; both ends compute the same layout from
/// the same plan.
struct RoundStaging {
    /// Each message's packed bytes.
    lens: Vec<u64>,
    dense: (Vec<u64>, u64),
    sizes: (Vec<u64>, u64),
    encoded: (Vec<u64>, u64),
}

impl RoundStaging {
    /// `None` where the sizes pass `u64`.
    fn new(lens: &[u64]) -> Option<RoundStaging> {
        let each = |f: &dyn Fn(u64) -> Option<u64>| message_layout(lens.iter().map(|&l| (f(l), DType::U8)));
        Some(RoundStaging {
            lens: lens.to_vec(),
            dense: each(&|l| Some(l))?,
            sizes: each(&|_| Some(8))?,
            encoded: each(&|l| l.checked_add(crate::delta::HEADER as u64))?,
        })
    }

    /// Bytes of staging a run needs (`delta`: a delta refit's).
    fn bytes(&self, delta: bool) -> u64 {
        if delta {
            self.dense.1.max(self.sizes.1).max(self.encoded.1)
        } else {
            self.dense.1
        }
    }
}

pub(crate) fn check(me: Endpoint, memory: &dyn PlaneMemory, span: &Span, dtype: DType, block: &Block) -> Result<u64, CommExecError> {
    let oob = || CommExecError::from(PieceOutOfBounds::new(me, *block, span.buffer));
    let i = span.buffer as usize;
    let len = *memory.lens().get(i).ok_or_else(oob)?;
    if memory.dtypes()[i] != dtype || !fits(block.extent(), len, span.base, &span.strides, dtype) {
        return Err(oob());
    }
    Ok(memory.addrs()[i])
}

/// A packed piece at byte `at` of a staging region.
fn packed(at: u64, wire: DType, block: &Block) -> Span {
    Span { buffer: 0, base: at / wire.size(), strides: packed_strides(block.extent()) }
}

/// Who a rank's peers are on its communicator.
pub struct CommPeers<'a> {
    /// Each endpoint's communicator rank (e.g. [`comm_rank`]).
    pub rank_of: &'a dyn Fn(Endpoint) -> Option<u32>,
    /// Whether a peer is on this rank's device and maps what this rank
    /// offers (the IPC fabric): messages with it are read directly
    /// (docs/gpu.md, "Direct reads on one device"). Never on NCCL.
    pub same_device: &'a dyn Fn(Endpoint) -> bool,
}

/// Runs one rank's program on `memory` over `comm`: each round is one
/// group of the round's sends and receives; every wait ends by
/// `deadline`. On an error the communicator is unusable: abort it.
///
/// A message with a peer on the same device (`peers.same_device`) is an
/// offer of where its pieces lie in the sender's memory; the receiver
/// copies them from there into its buffers, then a second group (numbered
/// the round plus 2^31) tells each such sender its memory was read.
///
/// With `delta` (every rank of the refit alike), each message goes as its
/// encoding against the same message of the base refit
/// ([`crate::delta`]), through the host: a round is then two groups, the
/// encodings' lengths (numbered `2 * round`), then the encodings
/// (`2 * round + 1`). It saves link bytes at the cost of copying each
/// message between the memory and the host.
pub fn run_rank_comm(
    memory: &mut dyn PlaneMemory,
    program: &RankProgram,
    comm: &mut CommHandle,
    peers: &CommPeers<'_>,
    deadline: Instant,
    delta: Option<&mut DeltaRun>,
) -> Result<RankStats, CommExecError> {
    let me = program.endpoint;
    // (Saturating: a size past `u64` matches no memory's.)
    let want: Vec<usize> = program.buffers.iter().map(|b| b.elems.saturating_mul(b.dtype.size()) as usize).collect();
    if memory.lens() != want.as_slice() {
        return Err(CommExecError::MemoryMismatch { me, got: memory.lens().to_vec(), want });
    }
    let mem_err = |what| move |error| CommExecError::memory(me, what, error);
    // A source rank quantizes the block-scaled tensors it sends as codes
    // before it sends anything.
    if program.quantizes_first() {
        memory.quantize(program).map_err(mem_err("quantizing before the first round"))?;
    }
    // The cursor walks the program (and counts what it moves); a round's
    // messages go in one group.
    let mut cursor = RoundCursor::new(program);
    let bad = |u: Unexpected| CommExecError::Program { me, round: u.round, peer: u.peer, problem: u.problem };
    let mut run = RoundRun { me, memory, comm, peers, deadline, delta };
    while let Some(round) = cursor.next_round().map_err(bad)? {
        run.round(round)?;
    }
    let RoundRun { memory, delta, .. } = run;
    memory.finish().map_err(mem_err("finishing the run"))?;
    if !program.quantizes_first() {
        memory.quantize(program).map_err(mem_err("quantizing after the last round"))?;
    }
    let mut stats = cursor.stats().unwrap_or_default();
    if let Some(d) = delta {
        // What went on the wire: the encodings (as the host executor counts).
        stats.sent_bytes = d.wire_bytes;
    }
    Ok(stats)
}

/// One rank's run over a communicator, a round at a time.
struct RoundRun<'r, 'p, 'd> {
    me: Endpoint,
    memory: &'r mut dyn PlaneMemory,
    comm: &'r mut CommHandle,
    peers: &'r CommPeers<'p>,
    deadline: Instant,
    delta: Option<&'d mut DeltaRun>,
}

/// Where a round's messages lie in staging: each message's piece offsets
/// and bytes (an offer's for a direct one), and both directions' layouts.
struct RoundLayout {
    sends: Vec<(Vec<u64>, u64)>,
    recvs: Vec<(Vec<u64>, u64)>,
    out: RoundStaging,
    into: RoundStaging,
}

impl RoundRun<'_, '_, '_> {
    /// Whether messages with `peer` are read directly: a peer on this
    /// device, not in a delta refit (whose encodings go through the host).
    fn direct(&self, peer: Endpoint) -> bool {
        self.delta.is_none() && (self.peers.same_device)(peer)
    }

    fn copy_err(&self, round: u32, peer: Endpoint, block: &Block) -> impl FnOnce(PlaneError) -> CommExecError {
        let (me, block) = (self.me, Box::new(*block));
        move |error| CommExecError::Copy { me, peer, round, block, error: Box::new(error) }
    }

    fn mem_err(&self, what: &'static str) -> impl FnOnce(PlaneError) -> CommExecError {
        let me = self.me;
        move |error| CommExecError::memory(me, what, error)
    }

    /// The round: its local copies, then its messages packed (or offered),
    /// one group, and what arrived unpacked (or read directly); then, if
    /// any message was read directly, the done group.
    fn round(&mut self, round: Round<'_>) -> Result<(), CommExecError> {
        let Round { round: r, locals, sends, recvs } = round;
        let me = self.me;
        for l in locals.into_iter().flat_map(|l| l.views()) {
            let (block, from, from_dtype, to_dtype) = (l.block(), l.from(), l.from_dtype(), l.to_dtype());
            let at = check(me, self.memory, &from, from_dtype, &block)?;
            let mut to = Vec::new();
            for s in l.to() {
                to.push((check(me, self.memory, &s, to_dtype, &block)?, s, to_dtype));
            }
            self.memory.move_piece(&block, (at, from, from_dtype), to_dtype, &to).map_err(self.copy_err(r, me, &block))?;
        }
        if sends.is_empty() && recvs.is_empty() {
            return Ok(());
        }
        let layout = self.layout(&sends, recvs)?;
        let sbase = self
            .memory
            .staging(StagingSide::Send, layout.out.bytes(self.delta.is_some()) as usize)
            .map_err(self.mem_err("send staging"))?;
        let rbase = self
            .memory
            .staging(StagingSide::Recv, layout.into.bytes(self.delta.is_some()) as usize)
            .map_err(self.mem_err("receive staging"))?;
        let ops = self.pack(r, &sends, recvs, &layout, (sbase, rbase))?;
        let grouped = match self.delta.as_deref_mut() {
            None => {
                // The group starts after everything queued so far: this
                // round's packing and the last round's unpacking (which
                // read the receive staging the group is about to
                // overwrite).
                let after = self.memory.fence().map_err(self.mem_err("ordering the group after packing"))?;
                // SAFETY: every address is inside the send or receive
                // staging (offsets from the round's own layout, whose
                // totals the staging was sized to), which the memory keeps
                // until the next `staging` call; if the group fails it is
                // abandoned below, never reused.
                unsafe { self.comm.group(r, ops, after, self.deadline) }.map_err(CommExecError::from)
            }
            Some(d) => {
                let round = DeltaRound { me, round: r, sends: &sends, recvs, dense: &ops };
                let staging = ((sbase, &layout.out), (rbase, &layout.into));
                exchange_delta(self.memory, self.comm, &round, staging, d, self.deadline)
            }
        };
        if let Err(e) = grouped {
            // The communicator may still use the staging.
            self.memory.abandon_staging();
            return Err(e);
        }
        self.unpack(r, recvs, &layout, rbase)?;
        let read_from: Vec<Endpoint> = recvs.iter().map(|m| m.peer).filter(|&p| self.direct(p)).collect();
        let read_by: Vec<Endpoint> = sends.iter().map(|m| m.peer).filter(|&p| self.direct(p)).collect();
        if read_from.is_empty() && read_by.is_empty() {
            return Ok(());
        }
        let done = done_reading(self.memory, self.comm, (me, r), (&read_from, &read_by), self.peers.rank_of, self.deadline);
        if done.is_err() {
            self.memory.abandon_staging();
        }
        done
    }

    /// Where the round's messages lie in staging.
    fn layout(
        &self,
        sends: &[&reshard::Message<reshard::SendPiece>],
        recvs: &[reshard::Message<reshard::RecvPiece>],
    ) -> Result<RoundLayout, CommExecError> {
        let me = self.me;
        let too_large =
            || CommExecError::Layout { me, what: "laying out the round's messages", problem: "their pieces pass u64 bytes".into() };
        let offer = |peer: Endpoint, pieces: usize| self.direct(peer).then(|| Some((Vec::new(), direct::offer_bytes(pieces)?)));
        let sends: Vec<(Vec<u64>, u64)> = sends
            .iter()
            .map(|m| offer(m.peer, m.pieces.len()).unwrap_or_else(|| send_layout(m)))
            .collect::<Option<_>>()
            .ok_or_else(too_large)?;
        let recvs: Vec<(Vec<u64>, u64)> = recvs
            .iter()
            .map(|m| offer(m.peer, m.pieces.len()).unwrap_or_else(|| recv_layout(m)))
            .collect::<Option<_>>()
            .ok_or_else(too_large)?;
        let out = RoundStaging::new(&sends.iter().map(|s| s.1).collect::<Vec<_>>()).ok_or_else(too_large)?;
        let into = RoundStaging::new(&recvs.iter().map(|s| s.1).collect::<Vec<_>>()).ok_or_else(too_large)?;
        Ok(RoundLayout { sends, recvs, out, into })
    }

    /// Packs (or offers) every outgoing message into the send staging at
    /// `sbase`: the round's group, its sends and its receives (into the
    /// receive staging at `rbase`).
    fn pack(
        &mut self,
        r: u32,
        sends: &[&reshard::Message<reshard::SendPiece>],
        recvs: &[reshard::Message<reshard::RecvPiece>],
        layout: &RoundLayout,
        (sbase, rbase): (u64, u64),
    ) -> Result<Vec<P2p>, CommExecError> {
        let me = self.me;
        let (send_at, recv_at) = (&layout.out.dense.0, &layout.into.dense.0);
        let mut ops = Vec::new();
        for (i, m) in sends.iter().enumerate() {
            let peer = (self.peers.rank_of)(m.peer).ok_or(UnknownPeer { me, peer: m.peer, round: r, missing: PeerMissing::CommRank })?;
            if self.direct(m.peer) {
                let bytes = offer_of(me, self.memory, m)?;
                self.memory.write_staging(StagingSide::Send, send_at[i], &bytes).map_err(self.mem_err("writing an offer"))?;
            } else {
                for (p, &off) in m.pieces.iter().zip(&layout.sends[i].0) {
                    let at = check(me, self.memory, &p.span, p.dtype, &p.block)?;
                    let into = (sbase, packed(send_at[i] + off, p.wire, &p.block), p.wire);
                    self.memory.move_piece(&p.block, (at, p.span, p.dtype), p.wire, &[into]).map_err(self.copy_err(r, m.peer, &p.block))?;
                }
            }
            ops.push(P2p::Send { peer, addr: sbase + send_at[i], bytes: layout.sends[i].1 });
        }
        for (i, m) in recvs.iter().enumerate() {
            let peer = (self.peers.rank_of)(m.peer).ok_or(UnknownPeer { me, peer: m.peer, round: r, missing: PeerMissing::CommRank })?;
            ops.push(P2p::Recv { peer, addr: rbase + recv_at[i], bytes: layout.recvs[i].1 });
        }
        Ok(ops)
    }

    /// Unpacks every message that arrived in the receive staging at
    /// `rbase`, or reads it directly from its sender's memory.
    fn unpack(
        &mut self,
        r: u32,
        recvs: &[reshard::Message<reshard::RecvPiece>],
        layout: &RoundLayout,
        rbase: u64,
    ) -> Result<(), CommExecError> {
        let me = self.me;
        let recv_at = &layout.into.dense.0;
        for (i, m) in recvs.iter().enumerate() {
            if self.direct(m.peer) {
                if let Err(e) = read_directly(me, self.memory, m, (recv_at[i], layout.recvs[i].1)) {
                    // Copies from the peer's memory may be queued.
                    self.memory.abandon_staging();
                    return Err(e);
                }
                continue;
            }
            for (p, &off) in m.pieces.views().zip(&layout.recvs[i].0) {
                let (block, wire, dtype) = (p.block(), p.wire(), p.dtype());
                let mut to = Vec::new();
                for s in p.spans() {
                    to.push((check(me, self.memory, &s, dtype, &block)?, s, dtype));
                }
                let from = (rbase, packed(recv_at[i] + off, wire, &block), wire);
                self.memory.move_piece(&block, from, wire, &to).map_err(self.copy_err(r, m.peer, &block))?;
            }
        }
        Ok(())
    }
}

/// One round's messages as a delta exchange needs them.
struct DeltaRound<'p> {
    me: Endpoint,
    round: u32,
    sends: &'p [&'p reshard::Message<reshard::SendPiece>],
    recvs: &'p [reshard::Message<reshard::RecvPiece>],
    /// The round's dense group (its sends, then its receives, in the
    /// messages' order): the peers the delta groups go to and come from.
    dense: &'p [P2p],
}

/// A delta refit's round, after its messages were packed dense into the
/// send staging: each is read to the host and encoded against the base
/// refit's; one group sends the encodings' lengths, a second the
/// encodings; each received encoding is rebuilt on the base refit's copy
/// and written back dense where the unpacking reads it. Both memos are
/// kept in `d`. The groups name only staging.
fn exchange_delta(
    memory: &mut dyn PlaneMemory,
    comm: &mut CommHandle,
    x: &DeltaRound<'_>,
    ((sbase, out), (rbase, into)): ((u64, &RoundStaging), (u64, &RoundStaging)),
    d: &mut DeltaRun,
    deadline: Instant,
) -> Result<(), CommExecError> {
    let (me, r) = (x.me, x.round);
    let to_peers: Vec<u32> = x.dense.iter().filter(|&op| matches!(op, P2p::Send { .. })).map(P2p::peer).collect();
    let from_peers: Vec<u32> = x.dense.iter().filter(|&op| matches!(op, P2p::Recv { .. })).map(P2p::peer).collect();
    let mem_err = |what| move |error| CommExecError::memory(me, what, error);
    let delta_err = |peer: Endpoint| move |error: DeltaMessageError| CommExecError::Delta { me, peer, round: r, error };
    let first = r.checked_mul(2).ok_or_else(|| CommExecError::Layout {
        me,
        what: "numbering the round's groups",
        problem: format!("round {r} passes u32 groups"),
    })?;
    let host_len = |len: u64| usize::try_from(len).map_err(|_| DeltaMessageError::TooLarge(len));
    // Encode every outgoing message (its dense bytes go to the memo).
    let mut encoded = Vec::with_capacity(x.sends.len());
    for (i, m) in x.sends.iter().enumerate() {
        let mut dense = vec![0u8; host_len(out.lens[i]).map_err(delta_err(m.peer))?];
        memory.read_staging(StagingSide::Send, out.dense.0[i], &mut dense).map_err(mem_err("reading a packed message"))?;
        let unit = unit_of(m.pieces.views().map(|p| p.wire()));
        let key = (r, m.peer);
        let base = d.base.as_mut().and_then(|b| b.sent.remove(&key));
        let (e, crc) = encode_kept(base.as_ref(), &dense, unit);
        d.wire_bytes = d.wire_bytes.saturating_add(e.len() as u64);
        d.next.sent.insert(key, KeptMessage { bytes: dense, crc });
        encoded.push(e);
    }
    // Group 1: the lengths.
    let mut ops = Vec::new();
    for (i, e) in encoded.iter().enumerate() {
        let at = out.sizes.0[i];
        memory.write_staging(StagingSide::Send, at, &(e.len() as u64).to_le_bytes()).map_err(mem_err("writing a message's length"))?;
        ops.push(P2p::Send { peer: to_peers[i], addr: sbase + at, bytes: 8 });
    }
    for (i, &peer) in from_peers.iter().enumerate() {
        ops.push(P2p::Recv { peer, addr: rbase + into.sizes.0[i], bytes: 8 });
    }
    let after = memory.fence().map_err(mem_err("ordering the group after packing"))?;
    // SAFETY: as for the dense group: every address lies in the send or
    // receive staging, inside the round's layout that sized it; on any
    // error from here on the caller abandons the staging, never reusing
    // or freeing it under a communicator that may still write it.
    unsafe { comm.group(first, ops, after, deadline) }?;
    let mut lens = Vec::with_capacity(x.recvs.len());
    for (i, m) in x.recvs.iter().enumerate() {
        let mut word = [0u8; 8];
        memory.read_staging(StagingSide::Recv, into.sizes.0[i], &mut word).map_err(mem_err("reading a message's length"))?;
        let len = u64::from_le_bytes(word);
        let most = into.lens[i].saturating_add(crate::delta::HEADER as u64);
        if len > most {
            return Err(delta_err(m.peer)(DeltaMessageError::Announced { len, most }));
        }
        lens.push(len);
    }
    // Group 2: the encodings.
    let mut ops = Vec::new();
    for (i, e) in encoded.iter().enumerate() {
        let at = out.encoded.0[i];
        memory.write_staging(StagingSide::Send, at, e).map_err(mem_err("writing an encoded message"))?;
        ops.push(P2p::Send { peer: to_peers[i], addr: sbase + at, bytes: e.len() as u64 });
    }
    for (i, &peer) in from_peers.iter().enumerate() {
        ops.push(P2p::Recv { peer, addr: rbase + into.encoded.0[i], bytes: lens[i] });
    }
    let after = memory.fence().map_err(mem_err("ordering the group after encoding"))?;
    // SAFETY: as above; each receive's length was checked to fit its slot.
    unsafe { comm.group(first + 1, ops, after, deadline) }?;
    // Rebuild every received message, then write them back dense (the
    // dense layout overlaps the encodings').
    let mut rebuilt = Vec::with_capacity(x.recvs.len());
    for (i, m) in x.recvs.iter().enumerate() {
        let mut e = vec![0u8; host_len(lens[i]).map_err(delta_err(m.peer))?];
        memory.read_staging(StagingSide::Recv, into.encoded.0[i], &mut e).map_err(mem_err("reading an encoded message"))?;
        let unit = unit_of(m.pieces.views().map(|p| p.wire()));
        let key = (r, m.peer);
        let base = d.base.as_mut().and_then(|b| b.received.remove(&key));
        let kept = decode_kept(base, &e, unit, into.lens[i]).map_err(|e| delta_err(m.peer)(e.into()))?;
        rebuilt.push((key, kept));
    }
    for (i, (key, kept)) in rebuilt.into_iter().enumerate() {
        memory.write_staging(StagingSide::Recv, into.dense.0[i], &kept.bytes).map_err(mem_err("writing a rebuilt message"))?;
        d.next.received.insert(key, kept);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranges a lying peer or program could name are refused, whatever
    /// wraps; ranges that fit are taken exactly.
    #[test]
    fn staging_spans_outside_their_staging_are_refused() {
        assert_eq!(staging_span(StagingSide::Recv, 64, 0, 64), Ok(0..64));
        assert_eq!(staging_span(StagingSide::Recv, 64, 64, 0), Ok(64..64));
        assert_eq!(staging_span(StagingSide::Send, 64, 56, 8), Ok(56..64));
        for (at, len) in [(57, 8), (65, 0), (0, 65), (u64::MAX, 1), (u64::MAX, 0), (8, usize::MAX), (1 << 63, 1 << 62)] {
            let e = staging_span(StagingSide::Recv, 64, at, len).unwrap_err();
            assert!(e.to_string().contains("Recv staging, which holds 64"), "{e}");
        }
        assert!(staging_span(StagingSide::Send, 0, 0, 1).is_err(), "no staging yet");
    }

    #[test]
    fn message_layouts_past_u64_are_none() {
        assert_eq!(message_layout([(Some(3), DType::BF16), (Some(1), DType::F32)]), Some((vec![0, 256], 260)));
        // An element count that passed u64 (checked by the caller).
        assert_eq!(message_layout([(Some(3), DType::BF16), (None, DType::F32)]), None);
        // Elements whose bytes pass u64.
        assert_eq!(message_layout([(Some(u64::MAX / 2), DType::F32)]), None);
        // Pieces whose bytes together pass u64.
        assert_eq!(message_layout([(Some(1 << 63), DType::U8), (Some(1 << 63), DType::U8)]), None);
    }
}
