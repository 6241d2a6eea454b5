//! Whether the GPU data plane can run in this process: built with the
//! `cuda` feature, and the CUDA driver and NCCL libraries loadable. Always
//! compiled, so the CLI can ask in every build.

use thiserror::Error;

/// Why the GPU data plane cannot run here.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum GpuUnavailable {
    /// This build has no `cuda` feature.
    #[error("built without the cuda feature")]
    NoFeature,
    /// The CUDA driver or NCCL does not load, or sees no device.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Probe(#[from] crate::cuda::device::ProbeError),
    /// Fewer GPUs than NCCL needs (one per rank).
    #[error("{ranks} ranks need {ranks} GPUs (NCCL puts one rank on a GPU), this process sees {seen}")]
    TooFewGpus {
        /// Ranks of the refit.
        ranks: u32,
        /// GPUs this process sees.
        seen: usize,
    },
    /// CUDA IPC asked of ranks of one process.
    #[error("CUDA IPC joins ranks of different processes, not ranks of this one")]
    IpcInOneProcess,
}

/// `Ok(())` if the GPU data plane can run here; otherwise why not, as one
/// line (print it as `CUDA transport unavailable: {reason}`).
///
/// Without the `cuda` feature this is always
/// `Err("built without the cuda feature")`. With it, it checks that the
/// CUDA driver library (`libcuda.so`) and NCCL are loadable and that the
/// driver initialises, without panicking: cudarc panics when a library is
/// missing, so presence is checked first and a panic is caught as a second
/// line of defence. It does not open a device.
pub fn cuda_available() -> Result<(), GpuUnavailable> {
    #[cfg(feature = "cuda")]
    {
        Ok(crate::cuda::device::probe()?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(GpuUnavailable::NoFeature)
    }
}

/// A GPU data plane, as the command line names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuPlane {
    /// Every rank's buffers on one GPU, copies between them on the device
    /// (`--transport cuda`).
    Device,
    /// One NCCL communicator over all ranks, one GPU per rank
    /// (`--transport nccl`).
    Nccl,
    /// CUDA IPC between processes on one node (`--transport ipc`).
    Ipc,
}

impl GpuPlane {
    /// The plane's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            GpuPlane::Device => "cuda",
            GpuPlane::Nccl => "nccl",
            GpuPlane::Ipc => "ipc",
        }
    }
}

/// `Ok(())` if `plane` can run a refit of `ranks` ranks (all of them
/// threads of this process), otherwise why not, as one line: built without
/// the feature, no driver, no NCCL, too few GPUs (NCCL takes one GPU per
/// rank), or a plane that joins processes. Never panics.
pub fn gpu_plane_available(plane: GpuPlane, ranks: u32) -> Result<(), GpuUnavailable> {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (plane, ranks);
        Err(GpuUnavailable::NoFeature)
    }
    #[cfg(feature = "cuda")]
    {
        use crate::cuda::device::{device_count, probe_driver, probe_nccl};
        probe_driver()?;
        match plane {
            GpuPlane::Device => Ok(()),
            GpuPlane::Nccl => {
                probe_nccl()?;
                let n = device_count()?;
                if (n as u64) < ranks as u64 {
                    return Err(GpuUnavailable::TooFewGpus { ranks, seen: n });
                }
                Ok(())
            }
            GpuPlane::Ipc => Err(GpuUnavailable::IpcInOneProcess),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn never_panics_and_explains() {
        match super::cuda_available() {
            Ok(()) => {}
            Err(e) => {
                let e = e.to_string();
                assert!(!e.is_empty());
                #[cfg(not(feature = "cuda"))]
                assert_eq!(e, "built without the cuda feature");
            }
        }
        for plane in [super::GpuPlane::Device, super::GpuPlane::Nccl, super::GpuPlane::Ipc] {
            if let Err(e) = super::gpu_plane_available(plane, 4).map_err(|e| e.to_string()) {
                assert!(!e.is_empty() && !e.contains('\n'), "{e}");
            }
        }
    }
}
