//! Why a rank's buffers or tensors cannot be read or written as asked:
//! [`BufferError`], and the name lists its messages quote.

use super::Residence;
use reshard::{DType, Rank};
use thiserror::Error;

/// Why a buffer or a tensor of a rank cannot be read or written as asked.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BufferError {
    /// No buffer of that name on this rank.
    #[error("rank {rank}: no buffer '{name}' (this rank's buffers: {known})")]
    NoBuffer {
        /// The rank.
        rank: Rank,
        /// The name asked for.
        name: String,
        /// Some of the rank's buffer names.
        known: String,
    },
    /// The layout has no tensor of that name.
    #[error("rank {rank}: the layout has no tensor '{name}'{hint}")]
    NoTensor {
        /// The rank.
        rank: Rank,
        /// The name asked for.
        name: String,
        /// A suggestion, if one is close.
        hint: String,
    },
    /// The tensor exists but this rank holds no part of it (another
    /// pipeline stage or expert group holds it).
    #[error("rank {rank} holds no part of tensor '{name}'")]
    NotHeld {
        /// The rank.
        rank: Rank,
        /// The tensor.
        name: String,
    },
    /// The rank holds the tensor in several blocks (a flat shard that
    /// spans rows, or several explicit shards); address them one by one.
    #[error("rank {rank} holds tensor '{name}' in {blocks} blocks: use tensor_blocks / tensor_block_mut")]
    SeveralBlocks {
        /// The rank.
        rank: Rank,
        /// The tensor.
        name: String,
        /// How many blocks.
        blocks: usize,
    },
    /// A block index past the rank's blocks of the tensor.
    #[error("rank {rank} holds {blocks} blocks of tensor '{name}', not block {index}")]
    NoBlock {
        /// The rank.
        rank: Rank,
        /// The tensor.
        name: String,
        /// The index asked for.
        index: usize,
        /// How many blocks it holds.
        blocks: usize,
    },
    /// A buffer holds fewer bytes than the layout places in it (memory
    /// replaced through [`Buffers::memory_mut`](super::Buffers::memory_mut)).
    #[error("rank {rank}: buffer '{buffer}' holds {bytes} bytes, the layout places data up to byte {needed}")]
    Truncated {
        /// The rank.
        rank: Rank,
        /// The buffer.
        buffer: String,
        /// Bytes it holds.
        bytes: usize,
        /// Bytes the layout needs.
        needed: usize,
    },
    /// The element type does not allow the access.
    #[error("{what}: holds {dtype}, which cannot be {access}")]
    DType {
        /// The tensor or buffer.
        what: String,
        /// Its element type.
        dtype: DType,
        /// The access asked for.
        access: &'static str,
    },
    /// The rank's weights are registered memory (device buffers, say):
    /// the store does not hold their bytes.
    #[error("rank {rank}: the weights are registered {residence} memory, not bytes of the store (write them in place inside `update`)")]
    Registered {
        /// The rank.
        rank: Rank,
        /// Where they are.
        residence: Residence,
    },
    /// Registered memory does not match the rank's buffer list.
    #[error("rank {rank}: {problem}")]
    BadRegistration {
        /// The rank.
        rank: Rank,
        /// What does not match.
        problem: String,
    },
    /// A write of the wrong number of elements.
    #[error("{what}: {given} values given for {expected} elements")]
    Length {
        /// The tensor or buffer.
        what: String,
        /// Elements it holds.
        expected: u64,
        /// Values given.
        given: u64,
    },
}

/// Up to five names and how many more, for error messages.
pub(super) fn some_names<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let all: Vec<&str> = names.collect();
    let mut text = all.iter().take(5).map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ");
    if all.len() > 5 {
        text.push_str(&format!(" and {} more", all.len() - 5));
    }
    if all.is_empty() {
        text.push_str("none");
    }
    text
}
