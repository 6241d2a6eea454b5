//! Queued copies between device and host memory: where each side of a
//! copy is ([`Loc`]), one planned copy op issued as a `cuMemcpy*Async`
//! call ([`issue`]), and the pinned host staging such copies go through
//! ([`PinnedStaging`]).

use super::{driver, GpuDevice, GpuError};
use crate::cuda::copyplan::CopyOp;
use cudarc::driver::{result, sys, CudaContext, PinnedHostSlice};
use std::ffi::c_void;
use std::sync::Arc;

/// Where one side of a copy is.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Loc {
    /// Device address.
    Device(u64),
    /// Host address (pinned for asynchronous copies).
    Host(*mut u8),
}

impl Loc {
    fn at(self, off: u64) -> Loc {
        match self {
            Loc::Device(a) => Loc::Device(a + off),
            // SAFETY-free: only address arithmetic; dereferenced by CUDA.
            Loc::Host(p) => Loc::Host(p.wrapping_add(off as usize)),
        }
    }

    fn kind(self) -> sys::CUmemorytype {
        match self {
            Loc::Device(_) => sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            Loc::Host(_) => sys::CUmemorytype::CU_MEMORYTYPE_HOST,
        }
    }

    fn device(self) -> sys::CUdeviceptr {
        match self {
            Loc::Device(a) => a,
            Loc::Host(_) => 0,
        }
    }

    fn host(self) -> *mut c_void {
        match self {
            Loc::Device(_) => std::ptr::null_mut(),
            Loc::Host(p) => p as *mut c_void,
        }
    }
}

/// Queues one copy op on `stream`.
///
/// # Safety
/// Both sides must be valid for the bytes the op touches until the stream
/// has run it; host sides must be pinned or outlive a synchronisation.
pub(crate) unsafe fn issue(op: &CopyOp, src: Loc, dst: Loc, stream: sys::CUstream) -> Result<(), result::DriverError> {
    let (s, d) = (src.at(op.src), dst.at(op.dst));
    if op.bytes() == 0 {
        return Ok(());
    }
    // SAFETY (all calls): by the caller's contract.
    unsafe {
        if op.height == 1 && op.depth == 1 {
            let n = op.width as usize;
            return match (s, d) {
                (Loc::Device(a), Loc::Device(b)) => sys::cuMemcpyDtoDAsync_v2(b, a, n, stream).result(),
                (Loc::Host(a), Loc::Device(b)) => sys::cuMemcpyHtoDAsync_v2(b, a as *const c_void, n, stream).result(),
                (Loc::Device(a), Loc::Host(b)) => sys::cuMemcpyDtoHAsync_v2(b as *mut c_void, a, n, stream).result(),
                (Loc::Host(_), Loc::Host(_)) => Err(result::DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE)),
            };
        }
        if op.depth == 1 {
            let p = sys::CUDA_MEMCPY2D_st {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: s.kind(),
                srcHost: s.host() as *const c_void,
                srcDevice: s.device(),
                srcArray: std::ptr::null_mut(),
                srcPitch: op.src_pitch as usize,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: d.kind(),
                dstHost: d.host(),
                dstDevice: d.device(),
                dstArray: std::ptr::null_mut(),
                dstPitch: op.dst_pitch as usize,
                WidthInBytes: op.width as usize,
                Height: op.height as usize,
            };
            return sys::cuMemcpy2DAsync_v2(&p, stream).result();
        }
        let p = sys::CUDA_MEMCPY3D_st {
            srcXInBytes: 0,
            srcY: 0,
            srcZ: 0,
            srcLOD: 0,
            srcMemoryType: s.kind(),
            srcHost: s.host() as *const c_void,
            srcDevice: s.device(),
            srcArray: std::ptr::null_mut(),
            reserved0: std::ptr::null_mut(),
            srcPitch: op.src_pitch as usize,
            srcHeight: op.src_height as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstZ: 0,
            dstLOD: 0,
            dstMemoryType: d.kind(),
            dstHost: d.host(),
            dstDevice: d.device(),
            dstArray: std::ptr::null_mut(),
            reserved1: std::ptr::null_mut(),
            dstPitch: op.dst_pitch as usize,
            dstHeight: op.dst_height as usize,
            WidthInBytes: op.width as usize,
            Height: op.height as usize,
            Depth: op.depth as usize,
        };
        sys::cuMemcpy3DAsync_v2(&p, stream).result()
    }
}

/// Page-locked host memory for staging device data (dtype conversion, or
/// a transport that moves host bytes). Grows on demand; not
/// write-combined, since the host reads it.
#[derive(Debug)]
pub struct PinnedStaging {
    ctx: Arc<CudaContext>,
    buf: Option<PinnedHostSlice<u8>>,
}

// SAFETY: the pinned allocation is plain memory owned by this value; it is
// only touched through `&mut self`.
unsafe impl Send for PinnedStaging {}

impl PinnedStaging {
    /// Empty staging for `dev`.
    pub fn new(dev: &GpuDevice) -> PinnedStaging {
        PinnedStaging { ctx: dev.ctx.clone(), buf: None }
    }

    /// A host pointer to at least `len` bytes; waits for earlier copies
    /// that used the staging.
    pub(crate) fn ensure(&mut self, len: usize) -> Result<*mut u8, GpuError> {
        let too_small = match &self.buf {
            Some(b) => b.len() < len,
            None => true,
        };
        if too_small {
            self.buf = None;
            let want = len.max(1).next_power_of_two();
            // SAFETY: bytes are written (by a copy) before they are read.
            let b = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(want, 0) }.map_err(driver(format!("pinning {want} host bytes")))?;
            self.buf = Some(b);
        }
        let b = self.buf.as_mut().ok_or_else(|| GpuError::Invalid { what: "staging".into(), problem: "no buffer".into() })?;
        b.as_mut_ptr().map_err(driver("waiting for staging"))
    }

    /// Gives the buffer up without freeing it: a copy into or out of it
    /// may not have finished (waiting for the stream failed), so it is
    /// never reused or unpinned while the process lives.
    pub(crate) fn abandon(&mut self) {
        std::mem::forget(self.buf.take());
    }
}
