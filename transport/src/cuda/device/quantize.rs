//! Quantizing a rank's block-scaled tensors (a source's before its first
//! send, a destination's after its last receive): on the device by the
//! FP8 kernels where they can, else on the host (the buffers copied back
//! and forth).

use super::{DeviceMemory, GpuDevice, GpuError, KernelError};
use crate::cuda::quantplan::{FitError, QuantPlan};
use cudarc::driver::{sys, DriverError};
use reshard::{Endpoint, QuantError, RankProgram};
use thiserror::Error;

/// Why quantizing a rank's block-scaled tensors failed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum QuantizeError {
    /// The program's quantize steps do not plan.
    #[error("{me}: quantizing: {source}")]
    Plan {
        /// The rank.
        me: Endpoint,
        /// Why not.
        #[source]
        source: QuantError,
    },
    /// The planned launches do not fit the rank's buffers.
    #[error("{me}: quantizing: {source}")]
    Fit {
        /// The rank.
        me: Endpoint,
        /// Why not.
        #[source]
        source: FitError,
    },
    /// Quantizing on the host failed (a block holds NaN or infinity).
    #[error("quantizing: {0}")]
    Host(#[source] crate::exec::ExecError),
    /// A kernel did not launch.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A driver call failed.
    #[error("{me}: {what}{source}")]
    Driver {
        /// The rank.
        me: Endpoint,
        /// What was being done (with its separator), or nothing.
        what: &'static str,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// The device flagged a non-finite block the host quantizer did not find.
    #[error("{me}: the device found a non-finite block the host did not")]
    Disagree {
        /// The rank.
        me: Endpoint,
    },
    /// The device failed (memory, synchronisation).
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// How a destination rank's block-scaled tensors were quantized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Quantized {
    /// Nothing to quantize.
    Nothing,
    /// On the device, by the `refit_fp8_*` kernels.
    OnDevice,
    /// On the host (the buffers copied back and forth), and why.
    OnHost(String),
}

/// Quantizes `program`'s block-scaled tensors in `memory` (its buffers, on
/// `dev`), before a source's first send or after a destination's last
/// receive (`RankProgram::quantizes_first`): on the device where the kernels loaded
/// and every tensor has at most three dimensions, else on the host. A block
/// holding NaN or infinity is an error naming the tensor and the block
/// (found again by the host quantizer, which says which).
pub(crate) fn quantize_rank_on(dev: &GpuDevice, memory: &mut DeviceMemory, program: &RankProgram) -> Result<Quantized, QuantizeError> {
    if program.quantize.is_empty() {
        return Ok(Quantized::Nothing);
    }
    let me = program.endpoint;
    let on_host = |memory: &mut DeviceMemory, why: String| -> Result<Quantized, QuantizeError> {
        let mut host = memory.download(dev)?;
        crate::exec::quantize_rank(program, &mut host).map_err(QuantizeError::Host)?;
        memory.upload(dev, &host)?;
        Ok(Quantized::OnHost(why))
    };
    let plan = match QuantPlan::new(program) {
        Err(source) => return Err(QuantizeError::Plan { me, source }),
        Ok(Err(host_only)) => return on_host(memory, host_only.to_string()),
        Ok(Ok(plan)) => plan,
    };
    let kernels = match dev.kernels() {
        Ok(k) => k,
        Err(e) => return on_host(memory, format!("the quantize kernels did not load: {e}")),
    };
    plan.fits(&memory.lens, &memory.dtypes).map_err(|source| QuantizeError::Fit { me, source })?;
    dev.bind()?;
    let scratch = dev.alloc(plan.scratch as usize * 4, "quantize scales")?;
    let err = dev.alloc(4, "quantize error flag")?;
    let (scales, flag) = (dev.addr(&scratch), dev.addr(&err));
    let stream = &dev.stream;
    let queued = (|| -> Result<(), QuantizeError> {
        // SAFETY: `flag` is our 4-byte allocation, on the device's stream.
        unsafe { sys::cuMemsetD8Async(flag, 0xff, 4, stream.cu_stream()) }.result().map_err(|source| QuantizeError::Driver {
            me,
            what: "",
            source,
        })?;
        let a = &memory.addrs;
        for l in &plan.scales {
            // SAFETY: `fits` checked every launch against these buffers;
            // the scratch holds `plan.scratch` scales; all of it stays
            // allocated until the synchronisation below, and only this
            // stream touches the rank's buffers meanwhile (a source's sends
            // have not begun, a destination's receives are done).
            unsafe { kernels.launch_fp8_scales(stream, l, a[l.staged as usize], scales, flag) }?;
        }
        for l in &plan.codes {
            // SAFETY: as above.
            unsafe { kernels.launch_fp8_codes(stream, l, a[l.staged as usize], a[l.weights as usize], scales) }?;
        }
        for o in &plan.outs {
            // SAFETY: as above (the copy's source is the scratch array).
            unsafe { kernels.launch(stream, "refit_strided_copy32", &o.copy, scales, a[o.scales as usize]) }?;
        }
        Ok(())
    })();
    // Whatever was queued finishes before the scratch is freed.
    let waited = dev.synchronize().map_err(QuantizeError::from);
    queued.and(waited)?;
    let mut bad = [0u8; 4];
    // SAFETY: 4 bytes from our flag into a local array; the stream is idle.
    unsafe { sys::cuMemcpyDtoH_v2(bad.as_mut_ptr().cast(), flag, 4) }.result().map_err(|source| QuantizeError::Driver {
        me,
        what: "reading the quantize flag: ",
        source,
    })?;
    drop((scratch, err));
    if u32::from_le_bytes(bad) != u32::MAX {
        // A block holds NaN or infinity: the host quantizer names it.
        return on_host(memory, "a block holds NaN or infinity".into()).and(Err(QuantizeError::Disagree { me }));
    }
    Ok(Quantized::OnDevice)
}
