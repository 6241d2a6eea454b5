//! Per-rank programs: what one rank sends, receives and copies locally in
//! every round, with every piece resolved to a strided span of one of its
//! buffers. Every rank derives its program from the same plan, so sender and
//! receiver agree on the order of pieces in each message.

use crate::block::{Block, MAX_DIMS};
use crate::dtype::DType;
use crate::fingerprint::Fingerprint;
use crate::layout::{BufferKey, BufferSpec, Holding, Layout, Rank};
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

struct Side<'a> {
    layout: &'a Layout,
    buffers: Vec<Vec<BufferSpec>>,
    index: Vec<HashMap<BufferKey, u32>>,
}

impl<'a> Side<'a> {
    fn new(layout: &'a Layout) -> Side<'a> {
        let buffers = layout.buffers();
        let index = buffers.iter().map(|l| l.iter().enumerate().map(|(i, b)| (b.key, i as u32)).collect()).collect();
        Side { layout, buffers, index }
    }

    fn scratch(&mut self, rank: Rank, tensor: u32, block: &Block) -> u32 {
        let key = BufferKey::Scratch { tensor };
        let r = rank as usize;
        if let Some(&i) = self.index[r].get(&key) {
            return i;
        }
        let t = &self.layout.tensors()[tensor as usize];
        let i = self.buffers[r].len() as u32;
        self.buffers[r].push(BufferSpec { key, name: self.layout.buffer_name(key), dtype: t.dtype, elems: block.numel() });
        self.index[r].insert(key, i);
        i
    }

    /// Spans on `rank` holding all of `piece`.
    fn spans(&self, holdings: &[Holding], rank: Rank, piece: &Block) -> Vec<Span> {
        let mut out = Vec::new();
        for h in holdings {
            if !h.block.contains(piece) {
                continue;
            }
            for l in h.holders.iter().filter(|l| l.rank == rank) {
                let b = self.index[rank as usize][&l.buffer];
                out.push(span_in(b, &h.block, l.at, piece));
            }
        }
        out
    }
}

type Builder<P> = BTreeMap<(u32, Endpoint), Vec<P>>;

impl Plan {
    /// Builds every rank's program: source ranks first (by rank), then
    /// destination ranks. Fails if the layouts are not the plan's.
    pub fn programs(&self, src: &Layout, dst: &Layout) -> Result<Vec<RankProgram>, PlanError> {
        let fp = fingerprint(src, dst, &self.options, self.strategy);
        if fp != self.fingerprint {
            return Err(PlanError::FingerprintMismatch { plan: self.fingerprint, layouts: fp });
        }
        let mut sides = [Side::new(src), Side::new(dst)];
        let n_src = src.ranks() as usize;
        let n = n_src + dst.ranks() as usize;
        let idx = |e: Endpoint| match e.group {
            Group::Src => e.rank as usize,
            Group::Dst => n_src + e.rank as usize,
        };
        let mut sends: Vec<Builder<SendPiece>> = vec![BTreeMap::new(); n];
        let mut recvs: Vec<Builder<RecvPiece>> = vec![BTreeMap::new(); n];
        let mut locals: Vec<BTreeMap<u32, Vec<LocalCopy>>> = vec![BTreeMap::new(); n];
        // Bucket transfers by destination tensor so holdings are built once.
        let mut by_tensor: Vec<Vec<u32>> = vec![Vec::new(); dst.tensors().len()];
        for (i, t) in self.transfers.iter().enumerate() {
            by_tensor[self.pieces[t.piece as usize].dst_tensor as usize].push(i as u32);
        }
        for (td, list) in by_tensor.iter().enumerate() {
            let Some(&first) = list.first() else { continue };
            let ts = self.pieces[self.transfers[first as usize].piece as usize].src_tensor;
            let holdings = [src.holdings(ts), dst.holdings(td as u32)];
            let tensor_of = |g: Group| if g == Group::Src { ts } else { td as u32 };
            for &ti in list {
                let t: &Transfer = &self.transfers[ti as usize];
                let piece = self.pieces[t.piece as usize].block;
                let side = |g: Group| if g == Group::Src { 0 } else { 1 };
                let (fs, tsd) = (side(t.from.group), side(t.to.group));
                let from_dtype = sides[fs].layout.tensors()[tensor_of(t.from.group) as usize].dtype;
                let to_dtype = sides[tsd].layout.tensors()[tensor_of(t.to.group) as usize].dtype;
                let scratch = self.scratch_blocks.get(td).copied().unwrap_or(piece);
                let from_span = if t.from_scratch {
                    let b = sides[fs].scratch(t.from.rank, tensor_of(t.from.group), &scratch);
                    span_in(b, &scratch, 0, &piece)
                } else {
                    match sides[fs].spans(&holdings[fs], t.from.rank, &piece).first() {
                        Some(s) => *s,
                        None => unreachable!("planner chose {} which does not hold {piece}", t.from),
                    }
                };
                let to_spans = if t.to_scratch {
                    let b = sides[tsd].scratch(t.to.rank, tensor_of(t.to.group), &scratch);
                    vec![span_in(b, &scratch, 0, &piece)]
                } else {
                    sides[tsd].spans(&holdings[tsd], t.to.rank, &piece)
                };
                if t.from == t.to {
                    locals[idx(t.from)].entry(t.round).or_default().push(LocalCopy {
                        block: piece,
                        from: from_span,
                        from_dtype,
                        to: to_spans,
                        to_dtype,
                    });
                    continue;
                }
                let wire = self.transfer_wire_dtype(t);
                sends[idx(t.from)].entry((t.round, t.to)).or_default().push(SendPiece {
                    block: piece,
                    span: from_span,
                    dtype: from_dtype,
                    wire,
                });
                recvs[idx(t.to)].entry((t.round, t.from)).or_default().push(RecvPiece {
                    block: piece,
                    spans: to_spans,
                    wire,
                    dtype: to_dtype,
                });
            }
        }
        let rounds = self.figures.rounds as usize;
        let [src_side, dst_side] = sides;
        let mut all_buffers: Vec<Vec<BufferSpec>> = src_side.buffers;
        all_buffers.extend(dst_side.buffers);
        let mut out = Vec::with_capacity(n);
        for (i, buffers) in all_buffers.into_iter().enumerate() {
            let endpoint = if i < n_src { Endpoint::src(i as Rank) } else { Endpoint::dst((i - n_src) as Rank) };
            let mut rs: Vec<Round> = vec![Round::default(); rounds];
            for ((r, peer), pieces) in std::mem::take(&mut sends[i]) {
                rs[r as usize].sends.push(Message { peer, pieces });
            }
            for ((r, peer), pieces) in std::mem::take(&mut recvs[i]) {
                rs[r as usize].recvs.push(Message { peer, pieces });
            }
            for (r, l) in std::mem::take(&mut locals[i]) {
                rs[r as usize].locals = l;
            }
            out.push(RankProgram { endpoint, fingerprint: self.fingerprint, buffers, rounds: rs });
        }
        Ok(out)
    }
}
