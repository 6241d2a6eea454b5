//! Why a communicator run failed ([`CommExecError`]), and what the
//! memory it runs on reported ([`PlaneError`]), kept as the cause.

use crate::cuda::comm::CommError;
use crate::cuda::direct::{DirectError, OfferError};
use crate::cuda::plane::{Side, StagingSide};
use crate::delta::DeltaError;
use crate::exec::{ExecError, PieceOutOfBounds};
use reshard::{Block, Endpoint};
use thiserror::Error;

/// Why a communicator run of a rank's program failed. On any error, abort
/// the communicator (peers then fail instead of waiting) and create a new
/// one with a new id before the next refit.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum CommExecError {
    /// The communicator failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The rank's memory does not hold the program's buffers.
    #[error("{me}: memory holds buffers of {got:?} bytes, the program needs {want:?}")]
    MemoryMismatch {
        /// This rank.
        me: Endpoint,
        /// Bytes per buffer held.
        got: Vec<usize>,
        /// Bytes per buffer the program needs.
        want: Vec<usize>,
    },
    /// A peer has no rank in the communicator.
    #[error(transparent)]
    UnknownPeer(#[from] UnknownPeer),
    /// A piece does not fit this rank's memory.
    #[error(transparent)]
    OutOfBounds(#[from] PieceOutOfBounds),
    /// Packing or unpacking a piece failed.
    #[error("{me}: round {round}: piece {block} with {peer}: {error}")]
    Copy {
        /// This rank.
        me: Endpoint,
        /// The other rank.
        peer: Endpoint,
        /// Round.
        round: u32,
        /// Piece.
        block: Box<Block>,
        /// What failed.
        #[source]
        error: Box<PlaneError>,
    },
    /// The program expects what no exchange can deliver (one peer twice in
    /// a round).
    #[error("{me}: round {round}: message from {peer}: {problem}")]
    Program {
        /// This rank.
        me: Endpoint,
        /// Round.
        round: u32,
        /// The peer.
        peer: Endpoint,
        /// Why.
        problem: &'static str,
    },
    /// A delta message could not be sent or rebuilt (see [`crate::delta`]).
    #[error("{me}: round {round}: delta message with {peer}: {error}")]
    Delta {
        /// This rank.
        me: Endpoint,
        /// The other rank.
        peer: Endpoint,
        /// Round.
        round: u32,
        /// What failed.
        #[source]
        error: DeltaMessageError,
    },
    /// A direct read from a peer on the same device failed: its offer did
    /// not check, a region could not be mapped, or a copy failed.
    #[error("{me}: reading directly from {peer}: {error}")]
    Direct {
        /// This rank.
        me: Endpoint,
        /// The sender.
        peer: Endpoint,
        /// What failed.
        #[source]
        error: Box<DirectError>,
    },
    /// Staging, ordering, finishing or quantizing on the rank's memory failed.
    #[error("{me}: {what}: {error}")]
    Memory {
        /// This rank.
        me: Endpoint,
        /// What it was doing.
        what: &'static str,
        /// What failed.
        #[source]
        error: Box<PlaneError>,
    },
    /// The round's messages or groups cannot be laid out (sizes or numbers
    /// past what the layout holds).
    #[error("{me}: {what}: {problem}")]
    Layout {
        /// This rank.
        me: Endpoint,
        /// What it was laying out.
        what: &'static str,
        /// What does not fit.
        problem: String,
    },
}

/// A message names a peer the run does not know: every plane's and the
/// same-device schedule's check, one error.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{me}: round {round}: peer {peer} has no {missing}")]
pub struct UnknownPeer {
    /// The rank naming it.
    pub me: Endpoint,
    /// The unknown peer.
    pub peer: Endpoint,
    /// Round.
    pub round: u32,
    /// What the peer lacks.
    pub missing: PeerMissing,
}

/// What an [`UnknownPeer`] lacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerMissing {
    /// No rank in the communicator.
    CommRank,
    /// No program in the same-device schedule.
    Program,
}

impl std::fmt::Display for PeerMissing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PeerMissing::CommRank => "rank in the communicator",
            PeerMissing::Program => "program",
        })
    }
}

impl CommExecError {
    /// [`CommExecError::Memory`]: `what` this rank was doing on its memory.
    pub(crate) fn memory(me: Endpoint, what: &'static str, error: PlaneError) -> CommExecError {
        CommExecError::Memory { me, what, error: Box::new(error) }
    }

    /// Whether a peer failed first and this rank's run failed because of
    /// it (a group that a peer's abort or departure broke).
    pub fn after_peer(&self) -> bool {
        matches!(self, CommExecError::Comm(e) if e.peer_first())
    }
}

/// What a [`PlaneMemory`](crate::cuda::plane::PlaneMemory) reported:
/// a range outside its staging or buffers, an offer it cannot map, or the
/// device (or host) work under it.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PlaneError {
    /// Bytes outside the staging they name.
    #[error("{len} bytes at {at} of the {which:?} staging, which holds {held}")]
    StagingRange {
        /// Which staging.
        which: StagingSide,
        /// Bytes it holds.
        held: usize,
        /// Where the range starts.
        at: u64,
        /// Bytes of the range.
        len: usize,
    },
    /// The round's messages do not fit the exported send bucket.
    #[error("the round's messages need {need} bytes, the exported bucket holds {holds}")]
    BucketTooSmall {
        /// Bytes needed.
        need: usize,
        /// Bytes the bucket holds.
        holds: usize,
    },
    /// A side of a piece lies outside every region of the memory.
    #[error("{:?} of {side:?} is outside this rank's {within}", .block.extent())]
    Outside {
        /// The piece.
        block: Box<Block>,
        /// The side.
        side: Box<Side>,
        /// The regions it was looked for in.
        within: &'static str,
    },
    /// A buffer index past the rank's buffers.
    #[error("buffer {buffer} is not one of this rank's {buffers}")]
    NoBuffer {
        /// The index.
        buffer: u32,
        /// Buffers the rank has.
        buffers: usize,
    },
    /// A direct read on a memory that maps no peer's.
    #[error("this rank reads no peer's memory directly (not the IPC fabric)")]
    NotDirect,
    /// A region larger than this host addresses.
    #[error("a region of {len} bytes")]
    RegionTooLarge {
        /// Its bytes.
        len: u64,
    },
    /// Quantizing asked of registered regions (quantizing needs the rank's
    /// own memory).
    #[error("block-scaled tensors are quantized in a rank's own memory, not in registered regions")]
    QuantizeRegions,
    /// Quantizing on the host failed.
    #[error(transparent)]
    HostQuantize(#[from] ExecError),
    /// An offered region could not be mapped.
    #[error(transparent)]
    Offer(#[from] OfferError),
    /// The device failed.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Gpu(#[from] crate::cuda::device::GpuError),
    /// Device work could not be queued.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Queue(#[from] crate::cuda::exec::QueueError),
    /// Quantizing on the device failed.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Quantize(#[from] crate::cuda::device::QuantizeError),
}

impl PlaneError {
    /// [`PlaneError::Outside`]: `side` of `block` lies in none of the
    /// memory's regions (`within` names them).
    pub(crate) fn outside(block: &Block, side: &Side, within: &'static str) -> PlaneError {
        PlaneError::Outside { block: Box::new(*block), side: Box::new(*side), within }
    }
}

/// Why a delta message could not be sent or rebuilt
/// ([`CommExecError::Delta`]).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DeltaMessageError {
    /// A message larger than this host addresses.
    #[error("a message of {0} bytes does not fit this host")]
    TooLarge(u64),
    /// A peer announced a longer encoding than the message allows.
    #[error("an encoding of {len} bytes announced, at most {most} expected")]
    Announced {
        /// Bytes announced.
        len: u64,
        /// Most bytes expected.
        most: u64,
    },
    /// The encoding does not decode.
    #[error(transparent)]
    Decode(#[from] DeltaError),
}
