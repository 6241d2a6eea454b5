//! Device buffers and copies (`cuda` feature): a device with its stream,
//! a rank's buffers in device memory, strided piece copies on the device
//! as 1-D/2-D/3-D `cuMemcpy*Async` calls, the cast kernels
//! ([`DeviceKernels`]), and pinned host staging.
//!
//! **Stream ordering is explicit.** cudarc's per-slice event tracking is
//! switched off for the device's context (raw addresses are used in copies
//! and kernels anyway, so its guards could not see those uses). The rules
//! that replace it, kept by every executor here: every buffer is allocated,
//! used and freed on the device's one stream, so the stream orders them;
//! the only other stream that touches device memory is an NCCL
//! communicator's, and only staging buffers: it waits for an event recorded
//! after they were packed, and they are unpacked, reused or freed only
//! after the host saw the group complete (never, if it failed).
//!
//! cudarc loads `libcuda` at run time and panics if it is missing, so
//! every entry point checks presence first ([`probe_driver`]) and catches
//! a panic as a second line of defence.

use crate::cuda::comm::Progress;
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DriverError};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use thiserror::Error;

mod copies;
mod launch;
mod memory;
mod probe;
mod quantize;

pub(crate) use copies::PinnedStaging;
pub(crate) use copies::{issue, Loc};
pub(crate) use launch::{DeviceKernels, KernelError};
pub use memory::DeviceMemory;
pub(crate) use memory::{offer_region, PeerMaps};
pub use probe::{device_count, device_uuid, driver_version, nccl_version_text, probe_nccl};
pub(crate) use probe::{no_panic, probe, probe_driver, Panicked, ProbeError};
pub(crate) use quantize::{quantize_rank_on, QuantizeError, Quantized};

/// Why a device operation failed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum GpuError {
    /// CUDA cannot be used in this process.
    #[error("CUDA unavailable: {0}")]
    Unavailable(#[source] ProbeError),
    /// A CUDA call failed; `what` names the rank, buffer or piece.
    #[error("{what}: {source}")]
    Driver {
        /// What was being done, naming the rank or buffer.
        what: String,
        /// The CUDA error.
        #[source]
        source: DriverError,
    },
    /// A CUDA call panicked (a missing library or symbol).
    #[error(transparent)]
    Panicked(#[from] Panicked),
    /// Bytes a region claims lie outside the allocation the driver reports.
    #[error("{what}: {source}")]
    Allocation {
        /// Whose region.
        what: String,
        /// Where it falls outside.
        #[source]
        source: crate::cuda::ipc::AllocationError,
    },
    /// The cast kernels did not load or launch.
    #[error("{what}: {source}")]
    Kernel {
        /// What was being done.
        what: String,
        /// Why.
        #[source]
        source: KernelError,
    },
    /// A rank's buffers do not lay out as one bucket.
    #[error("{what}: {source}")]
    Layout {
        /// Whose bucket.
        what: String,
        /// Why not.
        #[source]
        source: crate::cuda::ipc::LayoutError,
    },
    /// The request does not fit the memory it names.
    #[error("{what}: {problem}")]
    Invalid {
        /// What was being done.
        what: String,
        /// What is wrong.
        problem: String,
    },
}

fn driver(what: impl Into<String>) -> impl FnOnce(result::DriverError) -> GpuError {
    let what = what.into();
    move |source| GpuError::Driver { what, source }
}

/// Whether the work before `event` is done on the device (no event: done).
pub(crate) fn event_progress(event: Option<&CudaEvent>, what: &str) -> Result<Progress, GpuError> {
    match event.map(CudaEvent::try_is_complete) {
        None | Some(Ok(true)) => Ok(Progress::Ready),
        Some(Ok(false)) => Ok(Progress::Pending),
        Some(Err(e)) => Err(driver(what)(e)),
    }
}

/// One GPU, its primary context, and the stream all copies run on.
#[derive(Debug)]
pub struct GpuDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    max_pitch: u64,
    kernels: OnceLock<Result<DeviceKernels, KernelError>>,
}

impl GpuDevice {
    /// Opens device `ordinal` (checking the driver library first).
    pub fn open(ordinal: usize) -> Result<GpuDevice, GpuError> {
        probe_driver().map_err(GpuError::Unavailable)?;
        let what = format!("opening CUDA device {ordinal}");
        no_panic(&what, || {
            let ctx = CudaContext::new(ordinal).map_err(driver(&what))?;
            // SAFETY: this module orders streams itself, by the rules in
            // the module documentation; no slice of this context object
            // exists yet, so none is left half tracked.
            unsafe { ctx.disable_event_tracking() };
            let stream = ctx.new_stream().map_err(driver(&what))?;
            let max_pitch =
                ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH).map(|p| p.max(1) as u64).unwrap_or(i32::MAX as u64);
            Ok(GpuDevice { ctx, stream, ordinal, max_pitch, kernels: OnceLock::new() })
        })
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Device name (e.g. "NVIDIA H200").
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown".into())
    }

    /// The device's (primary) context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream copies run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Largest row pitch a 2-D/3-D copy may use.
    pub fn max_pitch(&self) -> u64 {
        self.max_pitch
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.stream.synchronize().map_err(driver(format!("synchronizing device {}", self.ordinal)))
    }

    /// `bytes` of device memory (at least one byte is allocated).
    pub fn alloc(&self, bytes: usize, what: &str) -> Result<CudaSlice<u8>, GpuError> {
        // SAFETY: the memory is written before it is read by every user here.
        unsafe { self.stream.alloc::<u8>(bytes.max(1)) }.map_err(driver(format!("{what}: allocating {bytes} bytes")))
    }

    /// An event that records time, recorded now on the stream.
    pub fn mark(&self) -> Result<CudaEvent, GpuError> {
        self.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(driver("recording an event"))
    }

    /// Time between two events from [`GpuDevice::mark`] (waits for the second).
    pub fn elapsed(&self, start: &CudaEvent, end: &CudaEvent) -> Result<Duration, GpuError> {
        let ms = start.elapsed_ms(end).map_err(driver("timing"))?;
        Ok(Duration::from_secs_f64(ms as f64 / 1e3))
    }

    /// Makes the device's context current on this thread (raw driver
    /// calls need it; cudarc's own calls do it themselves).
    pub fn bind(&self) -> Result<(), GpuError> {
        self.ctx.bind_to_thread().map_err(driver(format!("binding device {} to this thread", self.ordinal)))
    }

    /// Whether NVRTC, where it loads, builds kernels this device loads
    /// (the fallback path, tried on its own; the result is dropped).
    pub fn check_nvrtc_kernels(&self) -> Result<String, KernelError> {
        DeviceKernels::from_nvrtc(&self.ctx).map(|k| k.origin)
    }

    /// The cast kernels, loaded on first use (the shipped PTX, or the
    /// source compiled by NVRTC where the driver refuses that PTX); the
    /// error says why neither loaded (dtype changes then go through host
    /// staging).
    pub fn kernels(&self) -> Result<&DeviceKernels, KernelError> {
        self.kernels.get_or_init(|| DeviceKernels::load(&self.ctx)).as_ref().map_err(Clone::clone)
    }

    /// Records an event on the stream (no timing): what another stream
    /// waits for to start after the work queued so far.
    pub fn fence(&self) -> Result<CudaEvent, GpuError> {
        self.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(driver("recording an event"))
    }

    /// A device address usable in raw copies (the slice must outlive its use).
    pub(crate) fn addr(&self, slice: &CudaSlice<u8>) -> u64 {
        let (ptr, _sync) = slice.device_ptr(&self.stream);
        ptr
    }
}
