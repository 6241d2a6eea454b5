//! The frame buffer pool: received frames handed to the executor in
//! place, their buffers kept for reuse once unpacked
//! ([`TcpConfig::frame_pool_bytes`](super::TcpConfig::frame_pool_bytes)).

use crate::transport::{Lent, Payload, Release};
use std::sync::{Arc, Mutex};

/// Frame buffers a rank's readers reuse: a frame is handed to the executor
/// in place ([`Payload::Lent`]) and its buffer comes back here when the
/// payload is dropped.
pub(crate) struct FramePool {
    pub(super) kept: Mutex<(Vec<Vec<u8>>, u64)>,
    pub(super) limit: u64,
}

/// A frame's buffer could not be allocated.
#[derive(Debug, thiserror::Error)]
#[error("cannot allocate a frame of {len} bytes")]
pub(crate) struct FrameAllocError {
    /// The frame's length.
    len: usize,
}

/// Frames smaller than this are plain allocations.
const POOL_MIN: usize = 64 << 10;

impl FramePool {
    /// A buffer of at least `len` initialized bytes.
    pub(crate) fn take(&self, len: usize) -> Result<Vec<u8>, FrameAllocError> {
        if len >= POOL_MIN && self.limit > 0 {
            let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
            // The smallest that fits, if not more than twice too large.
            let best = kept
                .0
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= len && b.len() / 2 <= len)
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i);
            if let Some(i) = best {
                let b = kept.0.swap_remove(i);
                kept.1 -= b.len() as u64;
                return Ok(b);
            }
        }
        zeroed(len).ok_or(FrameAllocError { len })
    }

    /// The first `len` bytes of `buf` as a payload.
    pub(crate) fn payload(self: &Arc<Self>, mut buf: Vec<u8>, len: usize) -> Payload {
        if buf.len() < POOL_MIN || self.limit == 0 {
            buf.truncate(len);
            return Payload::Bytes(buf);
        }
        let ptr = buf.as_ptr();
        let pool = self.clone();
        let release = Release::on_drop(move || pool.give(buf));
        // SAFETY: `ptr` is the heap block of `buf` (moving a `Vec` does
        // not move its block), which the release owns and nobody writes
        // until the release runs; `len` <= its length.
        Payload::Lent(unsafe { Lent::new(ptr, len, release) })
    }

    fn give(&self, buf: Vec<u8>) {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        if kept.1 + buf.len() as u64 <= self.limit {
            kept.1 += buf.len() as u64;
            kept.0.push(buf);
        }
    }
}

/// `len` zero bytes, or `None` if they cannot be allocated. Zeroed
/// allocation (calloc) gets large blocks as fresh zero pages from the
/// system without writing them, where `resize` would write every byte
/// once before the socket read writes it again.
fn zeroed(len: usize) -> Option<Vec<u8>> {
    if len == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len).ok()?;
    // SAFETY: the layout has a non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return None;
    }
    // SAFETY: allocated by the global allocator with exactly this layout
    // (capacity `len`), and all `len` bytes are initialized (zero).
    Some(unsafe { Vec::from_raw_parts(p, len, len) })
}
