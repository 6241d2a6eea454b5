//! Per-rank programs: what one rank sends, receives and copies locally in
//! every round, with every piece resolved to a strided span of one of its
//! buffers. Every rank derives its program from the same plan, so sender and
//! receiver agree on the order of pieces in each message.

use crate::block::{Block, MAX_DIMS};
use crate::dtype::DType;
use crate::fingerprint::Fingerprint;
use crate::layout::{BufferKey, BufferSpec, Layout, Loc, Rank};
use crate::plan::{fingerprint, Endpoint, Group, Plan, PlanError, Transfer};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// A piece's elements inside one buffer: element `i` of the piece (in the
/// piece's row-major order) is at `base + sum(index[d] * strides[d])`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// Index into [`RankProgram::buffers`].
    pub buffer: u32,
    /// Element offset of the piece's first element.
    pub base: u64,
    /// Element stride per dimension of the piece.
    pub strides: [u64; MAX_DIMS],
}

/// One piece of an outgoing message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendPiece {
    /// The piece (its extent gives the element counts).
    pub block: Block,
    /// Where to read it.
    pub span: Span,
    /// Type of the buffer read.
    pub dtype: DType,
    /// Type on the wire.
    pub wire: DType,
}

/// One piece of an incoming message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecvPiece {
    /// The piece.
    pub block: Block,
    /// Every place on this rank that holds it (usually one).
    pub spans: Vec<Span>,
    /// Type on the wire.
    pub wire: DType,
    /// Type of the buffers written.
    pub dtype: DType,
}

/// A copy inside one rank (baseline gather onto the root, or keeping a
/// slice of a broadcast tensor).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalCopy {
    /// The piece.
    pub block: Block,
    /// Where to read.
    pub from: Span,
    /// Type read.
    pub from_dtype: DType,
    /// Where to write.
    pub to: Vec<Span>,
    /// Type written.
    pub to_dtype: DType,
}

/// All pieces exchanged with one peer in one round, in wire order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message<P> {
    /// The other rank.
    pub peer: Endpoint,
    /// Pieces, in the order they travel.
    pub pieces: Vec<P>,
}

impl Message<SendPiece> {
    /// Bytes on the wire.
    pub fn wire_bytes(&self) -> u64 {
        self.pieces.iter().map(|p| p.block.numel() * p.wire.size()).sum()
    }
}

impl Message<RecvPiece> {
    /// Bytes on the wire.
    pub fn wire_bytes(&self) -> u64 {
        self.pieces.iter().map(|p| p.block.numel() * p.wire.size()).sum()
    }
}

/// One round of a rank's program: local copies, then sends, then receives.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Round {
    /// Copies within the rank, done first.
    pub locals: Vec<LocalCopy>,
    /// Outgoing messages, one per peer, by peer.
    pub sends: Vec<Message<SendPiece>>,
    /// Incoming messages, one per peer, by peer.
    pub recvs: Vec<Message<RecvPiece>>,
}

/// Everything one rank does in a refit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankProgram {
    /// Which rank.
    pub endpoint: Endpoint,
    /// The plan's fingerprint, for agreement checks.
    pub fingerprint: Fingerprint,
    /// Buffers the rank holds (layout buffers, then any scratch).
    pub buffers: Vec<BufferSpec>,
    /// One entry per plan round (possibly empty).
    pub rounds: Vec<Round>,
}

/// Row-major strides of a stored block, as element strides of `piece`
/// inside it, plus the element offset of the piece's first element.
#[allow(clippy::needless_range_loop)] // parallel arrays indexed by dim
pub fn span_in(buffer: u32, stored: &Block, at: u64, piece: &Block) -> Span {
    let nd = stored.ndim();
    let mut strides = [0u64; MAX_DIMS];
    let mut s = 1u64;
    for d in (0..nd).rev() {
        strides[d] = s;
        s *= stored.extent()[d];
    }
    let mut base = at;
    for d in 0..nd {
        base += (piece.offset()[d] - stored.offset()[d]) * strides[d];
    }
    Span { buffer, base, strides }
}

/// Derives rank programs from one plan, one rank at a time: built once
/// per plan (it checks the layouts are the plan's and indexes the transfers
/// by rank), it makes any rank's program from that rank's transfers and
/// holdings alone, so a coordinator can hand programs out one by one
/// without ever holding all of them.
pub struct Programs<'a> {
    plan: &'a Plan,
    src: &'a Layout,
    dst: &'a Layout,
    /// Per endpoint (sources, then destinations): indices of the transfers
    /// it sends, receives or copies, ascending.
    by_endpoint: Vec<Vec<u32>>,
}

impl<'a> Programs<'a> {
    /// Prepares to derive `plan`'s programs. Fails if the layouts are not
    /// the plan's.
    pub fn new(plan: &'a Plan, src: &'a Layout, dst: &'a Layout) -> Result<Programs<'a>, PlanError> {
        let fp = fingerprint(src, dst, &plan.options, plan.strategy);
        if fp != plan.fingerprint {
            return Err(PlanError::FingerprintMismatch { plan: plan.fingerprint, layouts: fp });
        }
        let n_src = src.ranks() as usize;
        let mut by_endpoint: Vec<Vec<u32>> = vec![Vec::new(); n_src + dst.ranks() as usize];
        let idx = |e: Endpoint| match e.group {
            Group::Src => e.rank as usize,
            Group::Dst => n_src + e.rank as usize,
        };
        for (i, t) in plan.transfers.iter().enumerate() {
            by_endpoint[idx(t.from)].push(i as u32);
            if t.to != t.from {
                by_endpoint[idx(t.to)].push(i as u32);
            }
        }
        Ok(Programs { plan, src, dst, by_endpoint })
    }

    /// Every endpoint of the plan: source ranks by rank, then destination ranks.
    pub fn endpoints(&self) -> impl Iterator<Item = Endpoint> {
        (0..self.src.ranks()).map(Endpoint::src).chain((0..self.dst.ranks()).map(Endpoint::dst))
    }

    /// The program of one rank. Sender and receiver of every message list
    /// its pieces in the same order (destination tensor, then transfer), so
    /// they agree without exchanging it.
    ///
    /// # Panics
    /// If `e` is not a rank of the plan's layouts.
    pub fn program(&self, e: Endpoint) -> RankProgram {
        let plan = self.plan;
        let (layout, slot) = match e.group {
            Group::Src => (self.src, e.rank as usize),
            Group::Dst => (self.dst, self.src.ranks() as usize + e.rank as usize),
        };
        let mut mine = self.by_endpoint[slot].clone();
        // Stable: transfers of one tensor stay in plan order.
        mine.sort_by_key(|&i| plan.pieces[plan.transfers[i as usize].piece as usize].dst_tensor);
        let mut side = Side::new(layout, e.rank);
        let mut sends: Builder<SendPiece> = BTreeMap::new();
        let mut recvs: Builder<RecvPiece> = BTreeMap::new();
        let mut locals: BTreeMap<u32, Vec<LocalCopy>> = BTreeMap::new();
        let mut k = 0;
        while k < mine.len() {
            let td = plan.pieces[plan.transfers[mine[k] as usize].piece as usize].dst_tensor;
            let end =
                k + mine[k..].iter().take_while(|&&i| plan.pieces[plan.transfers[i as usize].piece as usize].dst_tensor == td).count();
            let ts = plan.pieces[plan.transfers[mine[k] as usize].piece as usize].src_tensor;
            // This rank's tensor, and its holdings of it.
            let tensor = if e.group == Group::Src { ts } else { td };
            let held = layout.rank_holdings(tensor, e.rank);
            let my_dtype = layout.tensors()[tensor as usize].dtype;
            let (src_dtype, dst_dtype) = (self.src.tensors()[ts as usize].dtype, self.dst.tensors()[td as usize].dtype);
            let dtype_of = |g: Group| if g == Group::Src { src_dtype } else { dst_dtype };
            for &ti in &mine[k..end] {
                let t: &Transfer = &plan.transfers[ti as usize];
                let piece = plan.pieces[t.piece as usize].block;
                let scratch = plan.scratch_blocks.get(td as usize).copied().unwrap_or(piece);
                let span_here = |side: &mut Side<'_>, from_scratch: bool| -> Vec<Span> {
                    if from_scratch {
                        let b = side.scratch(tensor, &scratch);
                        vec![span_in(b, &scratch, 0, &piece)]
                    } else {
                        side.spans(&held, &piece)
                    }
                };
                if t.from == e {
                    let from = match span_here(&mut side, t.from_scratch).first() {
                        Some(s) => *s,
                        None => unreachable!("planner chose {} which does not hold {piece}", t.from),
                    };
                    if t.to == e {
                        let to = span_here(&mut side, t.to_scratch);
                        locals.entry(t.round).or_default().push(LocalCopy {
                            block: piece,
                            from,
                            from_dtype: my_dtype,
                            to,
                            to_dtype: my_dtype,
                        });
                        continue;
                    }
                    let wire = plan.transfer_wire_dtype(t);
                    sends.entry((t.round, t.to)).or_default().push(SendPiece { block: piece, span: from, dtype: my_dtype, wire });
                } else {
                    let spans = span_here(&mut side, t.to_scratch);
                    let wire = plan.transfer_wire_dtype(t);
                    recvs.entry((t.round, t.from)).or_default().push(RecvPiece { block: piece, spans, wire, dtype: dtype_of(t.to.group) });
                }
            }
            k = end;
        }
        let mut rounds: Vec<Round> = vec![Round::default(); plan.figures.rounds as usize];
        for ((r, peer), pieces) in sends {
            rounds[r as usize].sends.push(Message { peer, pieces });
        }
        for ((r, peer), pieces) in recvs {
            rounds[r as usize].recvs.push(Message { peer, pieces });
        }
        for (r, l) in locals {
            rounds[r as usize].locals = l;
        }
        RankProgram { endpoint: e, fingerprint: plan.fingerprint, buffers: side.buffers, rounds }
    }
}

/// One rank's buffers while its program is derived: the layout's, then
/// scratch buffers as the program needs them.
struct Side<'a> {
    layout: &'a Layout,
    buffers: Vec<BufferSpec>,
    index: HashMap<BufferKey, u32>,
}

impl<'a> Side<'a> {
    fn new(layout: &'a Layout, rank: Rank) -> Side<'a> {
        let buffers = layout.rank_buffers(rank);
        let index = buffers.iter().enumerate().map(|(i, b)| (b.key, i as u32)).collect();
        Side { layout, buffers, index }
    }

    fn scratch(&mut self, tensor: u32, block: &Block) -> u32 {
        let key = BufferKey::Scratch { tensor };
        if let Some(&i) = self.index.get(&key) {
            return i;
        }
        let t = &self.layout.tensors()[tensor as usize];
        let i = self.buffers.len() as u32;
        self.buffers.push(BufferSpec { key, name: self.layout.buffer_name(key), dtype: t.dtype, elems: block.numel() });
        self.index.insert(key, i);
        i
    }

    /// Spans on this rank holding all of `piece`.
    fn spans(&self, held: &[(Block, Loc)], piece: &Block) -> Vec<Span> {
        held.iter().filter(|(b, _)| b.contains(piece)).map(|(b, l)| span_in(self.index[&l.buffer], b, l.at, piece)).collect()
    }
}

type Builder<P> = BTreeMap<(u32, Endpoint), Vec<P>>;

impl Plan {
    /// Builds every rank's program: source ranks first (by rank), then
    /// destination ranks. Fails if the layouts are not the plan's. Holds
    /// them all at once; see [`Programs`] to derive them one by one.
    pub fn programs(&self, src: &Layout, dst: &Layout) -> Result<Vec<RankProgram>, PlanError> {
        let p = Programs::new(self, src, dst)?;
        Ok(p.endpoints().map(|e| p.program(e)).collect())
    }
}
