//! Where a rank's weights live: a [`SrcStore`] on a source (training) rank,
//! a [`DstStore`] on a destination (inference) rank, each holding the
//! rank's [`Buffers`], read and written tensor by tensor through
//! [`TensorView`]s.
//!
//! The source store is the version fence: the optimizer writes it under a
//! write lock ([`SrcStore::update`]) and a refit reads it under the same
//! lock, so a refit never sees half an optimizer step, and a step that
//! fails after writing leaves the store *torn* (refused by refits) rather
//! than passing off changed weights as the old version. The destination
//! store is the atomic commit: a refit writes a staging copy, and
//! [`DstStore::commit`] swaps it in whole; readers take an [`Arc`](std::sync::Arc) snapshot
//! ([`DstStore::snapshot`]) and keep using it however many commits happen
//! meanwhile.

mod buffers;
mod dst_store;
mod error;
mod registered;
mod run_hold;
mod src_store;

pub use buffers::{Buffers, TensorView, TensorViewMut};
pub(crate) use dst_store::CommitFence;
pub use dst_store::{DstStore, Serving, Snapshot};
pub use error::BufferError;
pub use registered::{Registered, RegisteredMemory, RegisteredMemoryError, RegisteredVisitError, Residence};
pub(crate) use run_hold::{RegisteredStagingHold, RunHold};
pub use src_store::{SrcStore, UpdateGuard};

/// The layout the store tests share.
#[cfg(test)]
mod fixtures {
    use reshard::{DType, Layout, MeshDim::Shard, Region, Storage, TensorBuilder};
    use std::sync::Arc;

    pub(super) fn layout() -> Arc<Layout> {
        Arc::new(
            Layout::builder(2)
                .tensor(TensorBuilder::new("w", DType::F32, [4, 3]).mesh([2], [Shard(0)]).buffer("params", 0))
                .tensor(TensorBuilder::new("e", DType::BF16, [2, 2]).mesh([2], [Shard(0)]))
                .tensor(TensorBuilder::new("b", DType::F32, [3]).mesh([2], [Shard(0)]).buffer("params", 6))
                .tensor(TensorBuilder::new("flat", DType::F32, [3, 4]).shard(1, Region::Flat { start: 2, len: 7 }, Storage::Own).shard(
                    0,
                    Region::Flat { start: 0, len: 2 },
                    Storage::Own,
                ))
                .build()
                .unwrap(),
        )
    }
}
