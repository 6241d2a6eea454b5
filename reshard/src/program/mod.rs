//! Per-rank programs: what one rank sends, receives and copies locally in
//! every round, with every piece resolved to a strided span of one of its
//! buffers. Every rank derives its program from the same plan, so sender and
//! receiver agree on the order of pieces in each message.

mod derive;
mod pieces;

pub use derive::Programs;
pub use pieces::{Iter, LocalCopyView, Pieces, RecvPieceView, SendPieceView, Spans};

use crate::block::{Block, MAX_DIMS};
use crate::dtype::DType;
use crate::fingerprint::Fingerprint;
use crate::layout::BufferSpec;
use crate::plan::Endpoint;
use crate::quant::Quantize;
use serde::{Deserialize, Serialize};
use std::fmt;

/// A piece's elements inside one buffer: element `i` of the piece (in the
/// piece's row-major order) is at `base + sum(index[d] * strides[d])`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
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
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(bound(serialize = "Pieces<P>: Serialize", deserialize = "Pieces<P>: Deserialize<'de>"))]
pub struct Message<P> {
    /// The other rank.
    pub peer: Endpoint,
    /// Pieces, in the order they travel.
    pub pieces: Pieces<P>,
}

impl<P> fmt::Debug for Message<P>
where
    Pieces<P>: fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Message").field("peer", &self.peer).field("pieces", &self.pieces).finish()
    }
}

impl Message<SendPiece> {
    /// Bytes on the wire.
    pub fn wire_bytes(&self) -> u64 {
        self.pieces.first_dtype_bytes()
    }
}

impl Message<RecvPiece> {
    /// Bytes on the wire.
    pub fn wire_bytes(&self) -> u64 {
        self.pieces.first_dtype_bytes()
    }
}

/// One round of a rank's program: local copies, then sends, then receives.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Round {
    /// Copies within the rank, done first.
    pub locals: Pieces<LocalCopy>,
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
    /// A destination rank's layout buffers (indices into `buffers`) that
    /// hold any tensor the plan leaves out (a subset refit,
    /// [`PlanOptions::only`](crate::PlanOptions::only)): a refit stages
    /// them from the version the rank serves before the program writes the
    /// subset's elements. Empty for a plan of every tensor and for sources.
    pub carried: Vec<u32>,
    /// The rank's quantization of block-scaled FP8 tensors, one per
    /// tensor: a source rank's before its first send, from the boxes it
    /// holds into the buffers it sends codes and scales from
    /// ([`Route::QuantizedAtSource`](crate::Route::QuantizedAtSource)); a
    /// destination rank's after its last receive, from the whole blocks it
    /// received ([`Route::QuantizedAtDestination`](crate::Route::QuantizedAtDestination)).
    /// See [`RankProgram::quantizes_first`].
    pub quantize: Vec<Quantize>,
}

impl RankProgram {
    /// Whether [`RankProgram::quantize`] runs before the rank's first
    /// action (a source rank) rather than after its last receive (a
    /// destination rank).
    pub fn quantizes_first(&self) -> bool {
        self.endpoint.group == crate::plan::Group::Src
    }
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
