//! Whether CUDA and NCCL can be used here, asked without panicking: the
//! driver and NCCL libraries probed, devices counted and named, versions
//! read, and any panic of cudarc's turned into an error ([`no_panic`]).

use cudarc::driver::{result, sys, DriverError};
use std::panic::{catch_unwind, AssertUnwindSafe};
use thiserror::Error;

/// A call into cudarc panicked (its reaction to a missing library or
/// symbol): what was being done, and the panic's message.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{what} panicked: {message}")]
pub struct Panicked {
    /// What was being done.
    pub what: String,
    /// The panic's message.
    pub message: String,
}

/// Why CUDA or NCCL cannot be used here, or a device cannot be named.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ProbeError {
    /// The driver library does not load.
    #[error(
        "the CUDA driver library (libcuda.so.1) is not loadable: install the NVIDIA driver, or add the directory holding \
         libcuda.so.1 to LD_LIBRARY_PATH"
    )]
    NoDriver,
    /// A driver call failed.
    #[error("{call} failed: {source}")]
    Driver {
        /// The call.
        call: &'static str,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// A driver call about one device failed.
    #[error("{call}({ordinal}): {source}")]
    Device {
        /// The call.
        call: &'static str,
        /// The device.
        ordinal: usize,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// The driver sees no device.
    #[error("no CUDA device is visible (check CUDA_VISIBLE_DEVICES)")]
    NoDevice,
    /// An ordinal past what the driver takes.
    #[error("no CUDA device {0}")]
    NoSuchDevice(usize),
    /// NCCL does not load (`only_so2`: only `libnccl.so.2` is there).
    #[error("{}", nccl_missing(*.only_so2))]
    NoNccl {
        /// Only `libnccl.so.2` loads (the loader looks for `libnccl.so`).
        only_so2: bool,
    },
    /// `ncclGetVersion` failed.
    #[error("ncclGetVersion failed: {0:?}")]
    NcclVersion(cudarc::nccl::sys::ncclResult_t),
    /// NCCL is older than non-blocking communicators need.
    #[error("NCCL {} is too old: non-blocking communicators need NCCL 2.14 or later", nccl_version_text(*.0))]
    NcclTooOld(i32),
    /// A probe panicked.
    #[error(transparent)]
    Panicked(#[from] Panicked),
}

fn nccl_missing(only_so2: bool) -> &'static str {
    if only_so2 {
        "NCCL is installed as libnccl.so.2 only, and the loader looks for libnccl.so: create a symlink libnccl.so -> libnccl.so.2 \
         in a directory on LD_LIBRARY_PATH (see docs/gpu.md)"
    } else {
        "the NCCL library (libnccl.so) is not loadable: install NCCL (e.g. the nvidia-nccl-cu12 wheel), then put a libnccl.so -> \
         libnccl.so.2 symlink in a directory on LD_LIBRARY_PATH (see docs/gpu.md)"
    }
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_else(|| "panic".into())
}

/// Runs `f`, turning a panic (cudarc's reaction to a missing library or
/// symbol) into an error.
pub(crate) fn no_panic<T, E: From<Panicked>>(what: &str, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(Panicked { what: what.to_string(), message: panic_text(p) }.into()))
}

/// Checks that the CUDA driver library loads, initialises and sees a
/// device. Never panics.
pub(crate) fn probe_driver() -> Result<(), ProbeError> {
    no_panic("CUDA driver probe", || {
        // SAFETY: only tries to open the library.
        if !unsafe { sys::is_culib_present() } {
            return Err(ProbeError::NoDriver);
        }
        result::init().map_err(|source| ProbeError::Driver { call: "cuInit", source })?;
        let n = result::device::get_count().map_err(|source| ProbeError::Driver { call: "cuDeviceGetCount", source })?;
        if n < 1 {
            return Err(ProbeError::NoDevice);
        }
        Ok(())
    })
}

/// How many CUDA devices this process sees. Never panics.
pub fn device_count() -> Result<usize, ProbeError> {
    probe_driver()?;
    no_panic("counting CUDA devices", || {
        result::device::get_count().map(|n| n.max(0) as usize).map_err(|source| ProbeError::Driver { call: "cuDeviceGetCount", source })
    })
}

/// Device `ordinal`'s UUID as `nvidia-smi -L` prints it
/// (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`): what tells whether two
/// members, in any processes or on any hosts, use one physical GPU
/// (ordinals are per process: `CUDA_VISIBLE_DEVICES` renumbers them).
/// Opens no context. Never panics.
pub fn device_uuid(ordinal: usize) -> Result<String, ProbeError> {
    probe_driver()?;
    no_panic("reading a device's UUID", || {
        let index = i32::try_from(ordinal).map_err(|_| ProbeError::NoSuchDevice(ordinal))?;
        let dev = result::device::get(index).map_err(|source| ProbeError::Device { call: "cuDeviceGet", ordinal, source })?;
        let id = result::device::get_uuid(dev).map_err(|source| ProbeError::Device { call: "cuDeviceGetUuid", ordinal, source })?;
        Ok(uuid_text(&id.bytes.map(|b| b as u8)))
    })
}

/// 16 UUID bytes as `GPU-` and the 8-4-4-4-12 hex groups.
pub(super) fn uuid_text(bytes: &[u8; 16]) -> String {
    let hex = |r: std::ops::Range<usize>| bytes[r].iter().map(|b| format!("{b:02x}")).collect::<String>();
    format!("GPU-{}-{}-{}-{}-{}", hex(0..4), hex(4..6), hex(6..8), hex(8..10), hex(10..16))
}

/// The CUDA driver's version as `major.minor` (e.g. `13.0` for driver
/// 580). Never panics.
pub fn driver_version() -> Result<String, ProbeError> {
    probe_driver()?;
    no_panic("reading the driver's version", || {
        let mut v = 0;
        // SAFETY: writes one int through a valid pointer.
        unsafe { sys::cuDriverGetVersion(&mut v) }.result().map_err(|source| ProbeError::Driver { call: "cuDriverGetVersion", source })?;
        Ok(format!("{}.{}", v / 1000, (v % 1000) / 10))
    })
}

/// Oldest NCCL with non-blocking communicator creation (`ncclConfig_t`).
pub(super) const MIN_NCCL_VERSION: i32 = 21400;

/// Checks that NCCL loads and is recent enough; returns its version code
/// (e.g. 22304 for 2.23.4). Never panics.
pub fn probe_nccl() -> Result<i32, ProbeError> {
    no_panic("NCCL probe", || {
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            // cudarc looks for libnccl.so (and a few versioned names, not
            // libnccl.so.2); say so when only libnccl.so.2 is there.
            // SAFETY: loading NCCL runs no code of ours; it is unloaded at once.
            let only_so2 = unsafe { libloading::Library::new("libnccl.so.2") }.is_ok();
            return Err(ProbeError::NoNccl { only_so2 });
        }
        let v = cudarc::nccl::result::get_nccl_version().map_err(|e| ProbeError::NcclVersion(e.0))?;
        if v < MIN_NCCL_VERSION {
            return Err(ProbeError::NcclTooOld(v));
        }
        Ok(v)
    })
}

/// `22304` → `2.23.4`.
pub fn nccl_version_text(code: i32) -> String {
    format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
}

/// Both libraries usable (see [`crate::gpu_probe::cuda_available`]).
pub(crate) fn probe() -> Result<(), ProbeError> {
    probe_driver()?;
    probe_nccl().map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::device::{GpuDevice, GpuError};

    /// On a machine without CUDA (CI), every entry point reports an error
    /// instead of panicking; with CUDA, they work.
    #[test]
    fn missing_libraries_are_errors_not_panics() {
        let probe = crate::gpu_probe::cuda_available();
        match GpuDevice::open(0) {
            Ok(dev) => assert!(probe_driver().is_ok() && !dev.name().is_empty()),
            Err(GpuError::Unavailable(why)) => {
                let why = why.to_string();
                assert!(probe.is_err());
                assert!(why.contains("libcuda") || why.contains("device") || why.contains("cuInit"), "{why}");
            }
            Err(e) => panic!("unexpected {e}"),
        }
        if let Err(why) = probe_nccl().map_err(|e| e.to_string()) {
            assert!(why.contains("NCCL") || why.contains("nccl"), "{why}");
        }
        assert_eq!(nccl_version_text(22304), "2.23.4");
    }
}
