//! A rank's buffers in host memory, and the raw view of them that rank
//! threads share while a program runs.

use crate::copy::{in_bounds, StridedRef};
use reshard::{BufferSpec, DType, RankProgram, Span};

/// The buffers of one rank, in the order of its program's buffer list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankMemory {
    /// One byte vector per buffer.
    pub buffers: Vec<Vec<u8>>,
    /// Element type per buffer.
    pub dtypes: Vec<DType>,
}

impl RankMemory {
    /// Zeroed buffers for a program's buffer list.
    pub fn for_buffers(specs: &[BufferSpec]) -> RankMemory {
        RankMemory {
            buffers: specs.iter().map(|b| vec![0u8; (b.elems * b.dtype.size()) as usize]).collect(),
            dtypes: specs.iter().map(|b| b.dtype).collect(),
        }
    }

    /// Zeroed buffers for every program.
    pub fn for_programs(programs: &[RankProgram]) -> Vec<RankMemory> {
        programs.iter().map(|p| RankMemory::for_buffers(&p.buffers)).collect()
    }

    /// Total bytes held.
    pub fn bytes(&self) -> u64 {
        self.buffers.iter().map(|b| b.len() as u64).sum()
    }

    /// A raw view for use while a program runs.
    pub(crate) fn view(&mut self) -> MemView {
        MemView { bufs: self.buffers.iter_mut().map(|b| RawBuf { ptr: b.as_mut_ptr(), len: b.len() }).collect() }
    }
}

/// One buffer as a raw pointer and length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawBuf {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
}

/// Raw views of one rank's buffers.
///
/// Safety contract (upheld by the executors): the memory outlives every
/// thread holding a view; only the owning rank writes its buffers; other
/// ranks read only regions that are not written during the refit (source
/// shards) or that were written in an earlier round of the writer's own
/// program (forwarded destination regions), with a channel send/receive
/// between write and read establishing happens-before.
#[derive(Clone, Debug)]
pub(crate) struct MemView {
    pub(crate) bufs: Vec<RawBuf>,
}

impl MemView {
    /// The elements of a piece of `extent` at `span`, of type `dtype`, if
    /// they lie in their buffer.
    pub(crate) fn strided(&self, span: &Span, dtype: DType, extent: &[u64]) -> Option<StridedRef> {
        let buf = self.bufs.get(span.buffer as usize)?;
        // SAFETY: a `MemView` views a rank's buffers, which outlive every
        // use of the views made of it (its contract above).
        let r = unsafe { StridedRef::new(buf.ptr, buf.len, span.base, span.strides, dtype) };
        in_bounds(extent, &r).then_some(r)
    }
}

// SAFETY: see the contract above; the pointers are only dereferenced
// through bounds-checked copies on disjoint regions.
unsafe impl Send for MemView {}
// SAFETY: as above.
unsafe impl Sync for MemView {}
