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
use crate::cuda::copyplan::{plan_copies, CopyOp, Side};
use crate::cuda::ipc::{within_allocation, BucketLayout, IpcHandle, Mapped, Mappings};
use crate::cuda::kernels::{self, CastBox};
use crate::cuda::quantplan::{CodesLaunch, QuantPlan, ScalesLaunch};
use crate::memory::RankMemory;
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice, PushKernelArg};
use reshard::{Block, BufferSpec, DType, Endpoint, RankProgram, Span};
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use thiserror::Error;

/// Why a device operation failed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum GpuError {
    /// CUDA cannot be used in this process.
    #[error("CUDA unavailable: {0}")]
    Unavailable(String),
    /// A CUDA call failed; `what` names the rank, buffer or piece.
    #[error("{what}: {error}")]
    Driver {
        /// What was being done, naming the rank or buffer.
        what: String,
        /// The CUDA error.
        error: String,
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
    move |e| GpuError::Driver { what, error: e.to_string() }
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_else(|| "panic".into())
}

/// Runs `f`, turning a panic (cudarc's reaction to a missing library or
/// symbol) into an error.
pub(crate) fn no_panic<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(format!("{what} panicked: {}", panic_text(p))))
}

/// Checks that the CUDA driver library loads, initialises and sees a
/// device. Never panics.
pub fn probe_driver() -> Result<(), String> {
    no_panic("CUDA driver probe", || {
        // SAFETY: only tries to open the library.
        if !unsafe { sys::is_culib_present() } {
            return Err("the CUDA driver library (libcuda.so.1) is not loadable: install the NVIDIA driver, or add the directory \
                        holding libcuda.so.1 to LD_LIBRARY_PATH"
                .into());
        }
        result::init().map_err(|e| format!("cuInit failed: {e}"))?;
        let n = result::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e}"))?;
        if n < 1 {
            return Err("no CUDA device is visible (check CUDA_VISIBLE_DEVICES)".into());
        }
        Ok(())
    })
}

/// Whether the work before `event` is done on the device (no event: done).
pub(crate) fn event_progress(event: Option<&CudaEvent>, what: &str) -> Result<Progress, String> {
    match event.map(CudaEvent::try_is_complete) {
        None | Some(Ok(true)) => Ok(Progress::Ready),
        Some(Ok(false)) => Ok(Progress::Pending),
        Some(Err(e)) => Err(format!("{what}: {e}")),
    }
}

/// How many CUDA devices this process sees. Never panics.
pub fn device_count() -> Result<usize, String> {
    probe_driver()?;
    no_panic("counting CUDA devices", || {
        result::device::get_count().map(|n| n.max(0) as usize).map_err(|e| format!("cuDeviceGetCount failed: {e}"))
    })
}

/// Checks with the driver that every region (address, bytes) lies on
/// `dev` and inside one allocation there: memory registered by a user
/// (a framework's tensors, which move) is believed only as far as the
/// driver vouches for it, at each use. The context must be bound.
fn device_ranges(dev: &GpuDevice, owner: Endpoint, regions: &[(u64, usize)], what: &str) -> Result<(), GpuError> {
    for (i, &(addr, len)) in regions.iter().enumerate() {
        if len == 0 {
            continue;
        }
        let invalid = |problem: String| GpuError::Invalid { what: format!("{owner}: {what}, buffer {i}"), problem };
        let mut ordinal: std::ffi::c_int = -1;
        // SAFETY: writes one int through a valid pointer; the driver
        // answers for any address (an error for memory it does not know).
        let known = unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut std::ffi::c_int).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
        }
        .result();
        if known.is_err() || usize::try_from(ordinal).ok() != Some(dev.ordinal) {
            return Err(invalid(match known {
                Err(e) => format!("{addr:#x} is not device memory the driver knows ({e})"),
                Ok(()) => format!("{addr:#x} is memory of device {ordinal}, not of device {}", dev.ordinal),
            }));
        }
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: valid out-parameters; the address was just found to be
        // device memory of this context's device.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) }
            .result()
            .map_err(|e| invalid(format!("the allocation holding {addr:#x}: {e}")))?;
        within_allocation(addr, len as u64, base, size as u64).map_err(invalid)?;
    }
    Ok(())
}

/// Device `ordinal`'s UUID as `nvidia-smi -L` prints it
/// (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`): what tells whether two
/// members, in any processes or on any hosts, use one physical GPU
/// (ordinals are per process: `CUDA_VISIBLE_DEVICES` renumbers them).
/// Opens no context. Never panics.
pub fn device_uuid(ordinal: usize) -> Result<String, String> {
    probe_driver()?;
    no_panic("reading a device's UUID", || {
        let index = i32::try_from(ordinal).map_err(|_| format!("no CUDA device {ordinal}"))?;
        let dev = result::device::get(index).map_err(|e| format!("cuDeviceGet({ordinal}): {e}"))?;
        let id = result::device::get_uuid(dev).map_err(|e| format!("cuDeviceGetUuid({ordinal}): {e}"))?;
        Ok(uuid_text(&id.bytes.map(|b| b as u8)))
    })
}

/// 16 UUID bytes as `GPU-` and the 8-4-4-4-12 hex groups.
pub fn uuid_text(bytes: &[u8; 16]) -> String {
    let hex = |r: std::ops::Range<usize>| bytes[r].iter().map(|b| format!("{b:02x}")).collect::<String>();
    format!("GPU-{}-{}-{}-{}-{}", hex(0..4), hex(4..6), hex(6..8), hex(8..10), hex(10..16))
}

/// The CUDA driver's version as `major.minor` (e.g. `13.0` for driver
/// 580). Never panics.
pub fn driver_version() -> Result<String, String> {
    probe_driver()?;
    no_panic("reading the driver's version", || {
        let mut v = 0;
        // SAFETY: writes one int through a valid pointer.
        unsafe { sys::cuDriverGetVersion(&mut v) }.result().map_err(|e| format!("cuDriverGetVersion: {e}"))?;
        Ok(format!("{}.{}", v / 1000, (v % 1000) / 10))
    })
}

/// Oldest NCCL with non-blocking communicator creation (`ncclConfig_t`).
pub const MIN_NCCL_VERSION: i32 = 21400;

/// Checks that NCCL loads and is recent enough; returns its version code
/// (e.g. 22304 for 2.23.4). Never panics.
pub fn probe_nccl() -> Result<i32, String> {
    no_panic("NCCL probe", || {
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            // cudarc looks for libnccl.so (and a few versioned names, not
            // libnccl.so.2); say so when only libnccl.so.2 is there.
            // SAFETY: loading NCCL runs no code of ours; it is unloaded at once.
            let only_so2 = unsafe { libloading::Library::new("libnccl.so.2") }.is_ok();
            return Err(if only_so2 {
                "NCCL is installed as libnccl.so.2 only, and the loader looks for libnccl.so: create a symlink libnccl.so -> \
                 libnccl.so.2 in a directory on LD_LIBRARY_PATH (see docs/gpu.md)"
                    .into()
            } else {
                "the NCCL library (libnccl.so) is not loadable: install NCCL (e.g. the nvidia-nccl-cu12 wheel), then put a \
                 libnccl.so -> libnccl.so.2 symlink in a directory on LD_LIBRARY_PATH (see docs/gpu.md)"
                    .into()
            });
        }
        let v = cudarc::nccl::result::get_nccl_version().map_err(|e| format!("ncclGetVersion failed: {:?}", e.0))?;
        if v < MIN_NCCL_VERSION {
            return Err(format!("NCCL {} is too old: non-blocking communicators need NCCL 2.14 or later", nccl_version_text(v)));
        }
        Ok(v)
    })
}

/// `22304` → `2.23.4`.
pub fn nccl_version_text(code: i32) -> String {
    format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
}

/// Both libraries usable (see [`crate::gpu_probe::cuda_available`]).
pub(crate) fn probe() -> Result<(), String> {
    probe_driver()?;
    probe_nccl().map(|_| ())
}

/// One GPU, its primary context, and the stream all copies run on.
#[derive(Debug)]
pub struct GpuDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    max_pitch: u64,
    kernels: OnceLock<Result<DeviceKernels, String>>,
}

impl GpuDevice {
    /// Opens device `ordinal` (checking the driver library first).
    pub fn open(ordinal: usize) -> Result<GpuDevice, GpuError> {
        probe_driver().map_err(GpuError::Unavailable)?;
        let what = format!("opening CUDA device {ordinal}");
        no_panic(&what, || {
            let ctx = CudaContext::new(ordinal).map_err(|e| e.to_string())?;
            // SAFETY: this module orders streams itself, by the rules in
            // the module documentation; no slice of this context object
            // exists yet, so none is left half tracked.
            unsafe { ctx.disable_event_tracking() };
            let stream = ctx.new_stream().map_err(|e| e.to_string())?;
            let max_pitch =
                ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH).map(|p| p.max(1) as u64).unwrap_or(i32::MAX as u64);
            Ok(GpuDevice { ctx, stream, ordinal, max_pitch, kernels: OnceLock::new() })
        })
        .map_err(|error| GpuError::Driver { what, error })
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
    pub fn check_nvrtc_kernels(&self) -> Result<String, String> {
        DeviceKernels::from_nvrtc(&self.ctx).map(|k| k.origin)
    }

    /// The cast kernels, loaded on first use (the shipped PTX, or the
    /// source compiled by NVRTC where the driver refuses that PTX); the
    /// error says why neither loaded (dtype changes then go through host
    /// staging).
    pub fn kernels(&self) -> Result<&DeviceKernels, String> {
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

/// How [`DeviceKernels::origin`] names the shipped PTX.
const SHIPPED_ORIGIN: &str = "shipped PTX";

/// The strided copy-cast kernels of `kernels.cu`, loaded on one device.
pub struct DeviceKernels {
    functions: Vec<(&'static str, CudaFunction)>,
    origin: String,
}

impl std::fmt::Debug for DeviceKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKernels").field("kernels", &self.functions.len()).field("origin", &self.origin).finish()
    }
}

impl DeviceKernels {
    fn from_ptx(ctx: &Arc<CudaContext>, ptx: String, origin: String) -> Result<DeviceKernels, String> {
        no_panic("loading the cast kernels", || {
            let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(|e| e.to_string())?;
            let mut functions = Vec::new();
            for name in kernels::KERNELS {
                functions.push((name, module.load_function(name).map_err(|e| format!("{name}: {e}"))?));
            }
            Ok(DeviceKernels { functions, origin })
        })
    }

    /// The kernels compiled here by NVRTC for `ctx`'s device (the fallback
    /// where the driver refuses the shipped PTX).
    fn from_nvrtc(ctx: &Arc<CudaContext>) -> Result<DeviceKernels, String> {
        let cc = ctx.compute_capability().ok();
        let ptx = kernels::compile(cc)?;
        let arch = cc.map_or("NVRTC's default".to_string(), |(major, minor)| format!("compute_{major}{minor}"));
        DeviceKernels::from_ptx(ctx, ptx, format!("compiled by NVRTC ({arch})"))
    }

    fn load(ctx: &Arc<CudaContext>) -> Result<DeviceKernels, String> {
        let shipped = if kernels::shipped_ptx_is_current() {
            let isa = kernels::shipped_ptx_isa().unwrap_or("?");
            DeviceKernels::from_ptx(ctx, kernels::SHIPPED_PTX.to_string(), format!("{SHIPPED_ORIGIN} (PTX ISA {isa}, compute_80)"))
        } else {
            Err("the shipped PTX is stale".into())
        };
        shipped.or_else(|first| DeviceKernels::from_nvrtc(ctx).map_err(|e| format!("shipped PTX: {first}; NVRTC: {e}")))
    }

    /// Where the kernels came from (shipped PTX or NVRTC).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Whether they are the shipped code (not compiled here by NVRTC).
    pub fn shipped(&self) -> bool {
        self.origin.starts_with(SHIPPED_ORIGIN)
    }

    fn function(&self, name: &str) -> Result<&CudaFunction, String> {
        self.functions.iter().find(|(n, _)| *n == name).map(|(_, f)| f).ok_or_else(|| format!("no kernel {name}"))
    }

    /// Queues one box of the strided kernel `name` on `stream`: elements
    /// read from the buffer at device address `src`, written to the one at
    /// `dst` (as [`CastBox`] places them).
    ///
    /// # Safety
    /// `src` and `dst` must be live device allocations of this context that
    /// hold the box's elements (`CastBox::ends`, in the kernel's element
    /// sizes), stay allocated until the stream has run the kernel, and the
    /// destination elements must not be touched by other work meanwhile.
    pub(crate) unsafe fn launch(&self, stream: &Arc<CudaStream>, name: &str, b: &CastBox, src: u64, dst: u64) -> Result<(), String> {
        let f = self.function(name)?;
        let l = b.launch();
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
            block_dim: (l.block[0], l.block[1], l.block[2]),
            shared_mem_bytes: 0,
        };
        let [c0, c1, c2] = b.counts;
        let [ss0, ss1, ss2] = b.src_strides;
        let [ds0, ds1, ds2] = b.dst_strides;
        let mut args = stream.launch_builder(f);
        args.arg(&src).arg(&dst).arg(&c0).arg(&c1).arg(&c2);
        args.arg(&b.src_base).arg(&ss0).arg(&ss1).arg(&ss2);
        args.arg(&b.dst_base).arg(&ds0).arg(&ds1).arg(&ds2);
        // SAFETY: the kernel's parameters are 2 pointers and 11 u64, passed
        // as 13 u64 in order; the caller guarantees the memory (above).
        unsafe { args.launch(cfg) }.map(|_| ()).map_err(|e| format!("{name}: {e}"))
    }
}

impl DeviceKernels {
    /// Queues a [`ScalesLaunch`] on `stream`: the staged buffer at `staged`,
    /// the scratch scales at `scales`, the error flag at `err`.
    ///
    /// # Safety
    /// The addresses must be live device allocations of this context
    /// holding what the launch reads and writes (the plan checked against
    /// the buffers: [`QuantPlan::fits`]), alive until the stream has run
    /// the kernel, and written by nothing else meanwhile.
    unsafe fn launch_fp8_scales(
        &self,
        stream: &Arc<CudaStream>,
        l: &ScalesLaunch,
        staged: u64,
        scales: u64,
        err: u64,
    ) -> Result<(), String> {
        let name = "refit_fp8_scales";
        let f = self.function(name)?;
        let yz = |c: u64| c.clamp(1, kernels::MAX_BLOCKS_YZ as u64) as u32;
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (l.grid[0].clamp(1, kernels::MAX_BLOCKS_X as u64) as u32, yz(l.grid[1]), yz(l.grid[2])),
            block_dim: (kernels::THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = stream.launch_builder(f);
        args.arg(&staged).arg(&scales).arg(&err).arg(&l.dt);
        for v in [&l.grid, &l.grid_off, &l.block, &l.shape, &l.first] {
            args.arg(&v[0]).arg(&v[1]).arg(&v[2]);
        }
        args.arg(&l.at).arg(&l.strides[0]).arg(&l.strides[1]).arg(&l.strides[2]).arg(&l.base);
        // SAFETY: the kernel takes 3 pointers and 21 u64, passed as 24 u64
        // in order; the caller guarantees the memory (above).
        unsafe { args.launch(cfg) }.map(|_| ()).map_err(|e| format!("{name}: {e}"))
    }

    /// Queues a [`CodesLaunch`] on `stream`.
    ///
    /// # Safety
    /// As [`launch_fp8_scales`](Self::launch_fp8_scales), for the staged
    /// buffer at `staged`, the weights at `weights` and the scales at
    /// `scales`.
    unsafe fn launch_fp8_codes(
        &self,
        stream: &Arc<CudaStream>,
        l: &CodesLaunch,
        staged: u64,
        weights: u64,
        scales: u64,
    ) -> Result<(), String> {
        let name = "refit_fp8_codes";
        let f = self.function(name)?;
        let g = kernels::launch_3d(l.counts);
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (g.grid[0], g.grid[1], g.grid[2]),
            block_dim: (g.block[0], g.block[1], g.block[2]),
            shared_mem_bytes: 0,
        };
        let mut args = stream.launch_builder(f);
        args.arg(&staged).arg(&weights).arg(&scales).arg(&l.dt);
        args.arg(&l.counts[0]).arg(&l.counts[1]).arg(&l.counts[2]);
        args.arg(&l.src_base).arg(&l.src_strides[0]).arg(&l.src_strides[1]).arg(&l.src_strides[2]);
        args.arg(&l.dst_base).arg(&l.dst_strides[0]).arg(&l.dst_strides[1]).arg(&l.dst_strides[2]);
        for v in [&l.first, &l.block, &l.grid_off] {
            args.arg(&v[0]).arg(&v[1]).arg(&v[2]);
        }
        args.arg(&l.grid_strides[1]).arg(&l.grid_strides[2]).arg(&l.base);
        // SAFETY: the kernel takes 3 pointers and 24 u64, passed as 27 u64
        // in order; the caller guarantees the memory (above).
        unsafe { args.launch(cfg) }.map(|_| ()).map_err(|e| format!("{name}: {e}"))
    }
}

/// How a destination rank's block-scaled tensors were quantized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Quantized {
    /// Nothing to quantize.
    Nothing,
    /// On the device, by the `refit_fp8_*` kernels.
    OnDevice,
    /// On the host (the buffers copied back and forth), and why.
    OnHost(String),
}

/// Quantizes `program`'s block-scaled tensors in `memory` (its buffers, on
/// `dev`), after its last receive: on the device where the kernels loaded
/// and every tensor has at most three dimensions, else on the host. A block
/// holding NaN or infinity is an error naming the tensor and the block
/// (found again by the host quantizer, which says which).
pub fn quantize_rank_on(dev: &GpuDevice, memory: &mut DeviceMemory, program: &RankProgram) -> Result<Quantized, String> {
    if program.quantize.is_empty() {
        return Ok(Quantized::Nothing);
    }
    let me = program.endpoint;
    let on_host = |memory: &mut DeviceMemory, why: String| -> Result<Quantized, String> {
        let mut host = memory.download(dev).map_err(|e| e.to_string())?;
        crate::exec::quantize_rank(program, &mut host).map_err(|e| format!("quantizing: {e}"))?;
        memory.upload(dev, &host).map_err(|e| e.to_string())?;
        Ok(Quantized::OnHost(why))
    };
    let plan = match QuantPlan::new(program) {
        Err(e) => return Err(format!("{me}: quantizing: {e}")),
        Ok(Err(host_only)) => return on_host(memory, host_only.to_string()),
        Ok(Ok(plan)) => plan,
    };
    let kernels = match dev.kernels() {
        Ok(k) => k,
        Err(e) => return on_host(memory, format!("the quantize kernels did not load: {e}")),
    };
    plan.fits(&memory.lens, &memory.dtypes).map_err(|e| format!("{me}: quantizing: {e}"))?;
    dev.bind().map_err(|e| e.to_string())?;
    let scratch = dev.alloc(plan.scratch as usize * 4, "quantize scales").map_err(|e| e.to_string())?;
    let err = dev.alloc(4, "quantize error flag").map_err(|e| e.to_string())?;
    let (scales, flag) = (dev.addr(&scratch), dev.addr(&err));
    let stream = &dev.stream;
    let queued = (|| -> Result<(), String> {
        // SAFETY: `flag` is our 4-byte allocation, on the device's stream.
        unsafe { sys::cuMemsetD8Async(flag, 0xff, 4, stream.cu_stream()) }.result().map_err(|e| format!("{me}: {e}"))?;
        let a = &memory.addrs;
        for l in &plan.scales {
            // SAFETY: `fits` checked every launch against these buffers;
            // the scratch holds `plan.scratch` scales; all of it stays
            // allocated until the synchronisation below, and only this
            // stream touches the rank's buffers meanwhile (its receives
            // are done).
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
    let waited = dev.synchronize().map_err(|e| e.to_string());
    queued.and(waited)?;
    let mut bad = [0u8; 4];
    // SAFETY: 4 bytes from our flag into a local array; the stream is idle.
    unsafe { sys::cuMemcpyDtoH_v2(bad.as_mut_ptr().cast(), flag, 4) }
        .result()
        .map_err(|e| format!("{me}: reading the quantize flag: {e}"))?;
    drop((scratch, err));
    if u32::from_le_bytes(bad) != u32::MAX {
        // A block holds NaN or infinity: the host quantizer names it.
        return on_host(memory, "a block holds NaN or infinity".into())
            .and_then(|_| Err(format!("{me}: the device found a non-finite block the host did not")));
    }
    Ok(Quantized::OnDevice)
}

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
}

/// Where a [`DeviceMemory`]'s bytes are.
enum Storage {
    /// One allocation of this process (`cuMemAlloc`, so it can be
    /// exported), freed on drop.
    Bucket { ctx: Arc<CudaContext>, base: u64 },
    /// Memory the user owns (registered without a copy); never freed here.
    User,
    /// A bucket exported by IPC, reached through the process's mapping of
    /// its handle (shared with this process's other imports of it, closed
    /// by the last: [`ipc_mappings`]) or, exported by this process, the
    /// exporter's allocation itself.
    Imported { ctx: Arc<CudaContext>, handle: Box<IpcHandle>, mapped: Mapped<u64> },
}

/// This process's CUDA IPC mappings: CUDA maps a handle once per process
/// and never in its exporter, so every import goes through one table.
fn ipc_mappings() -> &'static Mappings<u64> {
    static MAPPINGS: OnceLock<Mappings<u64>> = OnceLock::new();
    MAPPINGS.get_or_init(Mappings::default)
}

impl Drop for Storage {
    fn drop(&mut self) {
        match self {
            Storage::Bucket { ctx, base } => {
                // Imports of its handle in this process no longer resolve
                // to it.
                ipc_mappings().unexported(*base);
                // SAFETY: `base` is our allocation; cuMemFree waits for
                // work still using it, and nothing names it after this.
                let _ = ctx.bind_to_thread();
                let _ = unsafe { sys::cuMemFree_v2(*base) };
            }
            Storage::Imported { ctx, handle, mapped } => {
                ipc_mappings().release(handle, *mapped, |base| {
                    // SAFETY: `base` came from cuIpcOpenMemHandle in this
                    // process, and this was the last import using it (the
                    // table counts them, and closes under its lock, so no
                    // import can take the mapping meanwhile); closing
                    // waits for nothing but unmaps, and no address inside
                    // it is used after this.
                    let _ = ctx.bind_to_thread();
                    let _ = unsafe { sys::cuIpcCloseMemHandle(base) };
                });
            }
            Storage::User => {}
        }
    }
}

/// Which way [`DeviceMemory::copy_regions`] copies.
#[derive(Clone, Copy)]
enum Towards {
    /// Buffers into the regions.
    Regions,
    /// Regions into the buffers.
    Buffers,
}

/// One rank's buffers in device memory, in its program's buffer order: one
/// bucket of this process (every buffer at its [`BucketLayout`] offset,
/// exportable as one CUDA IPC handle), the user's own device memory
/// (registered, not copied), or another process's bucket mapped by IPC.
pub struct DeviceMemory {
    owner: Endpoint,
    storage: Storage,
    addrs: Vec<u64>,
    lens: Vec<usize>,
    dtypes: Vec<DType>,
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.storage {
            Storage::Bucket { .. } => "bucket",
            Storage::User => "user",
            Storage::Imported { .. } => "imported",
        };
        f.debug_struct("DeviceMemory").field("owner", &self.owner).field("storage", &kind).field("lens", &self.lens).finish()
    }
}

// SAFETY: the addresses are device memory, usable from any thread with the
// context bound; the storage frees or unmaps them once, on drop.
unsafe impl Send for DeviceMemory {}

impl DeviceMemory {
    /// Device buffers (contents undefined) for a rank's buffer list: one
    /// bucket, each buffer at its [`BucketLayout`] offset.
    pub fn for_buffers(dev: &GpuDevice, owner: Endpoint, specs: &[BufferSpec]) -> Result<DeviceMemory, GpuError> {
        let layout =
            BucketLayout::of(specs).map_err(|problem| GpuError::Invalid { what: format!("{owner}: laying out a bucket"), problem })?;
        dev.bind()?;
        let what = format!("{owner}: allocating a bucket of {} bytes for {} buffers", layout.bytes, specs.len());
        // SAFETY: a plain allocation; freed by `Storage::Bucket` on drop.
        let base = no_panic(&what, || unsafe { result::malloc_sync(layout.bytes as usize) }.map_err(|e| e.to_string()))
            .map_err(|error| GpuError::Driver { what, error })?;
        Ok(DeviceMemory::laid_out(owner, Storage::Bucket { ctx: dev.ctx.clone(), base }, base, &layout, specs))
    }

    fn laid_out(owner: Endpoint, storage: Storage, base: u64, layout: &BucketLayout, specs: &[BufferSpec]) -> DeviceMemory {
        DeviceMemory {
            owner,
            storage,
            addrs: layout.offsets.iter().map(|o| base + o).collect(),
            lens: layout.lens.iter().map(|&l| l as usize).collect(),
            dtypes: specs.iter().map(|b| b.dtype).collect(),
        }
    }

    /// The user's own device buffers, registered without a copy: buffer `i`
    /// of `specs` is the `len` bytes at device address `addr` of
    /// `regions[i]` (a raw `cudaMalloc`/PyTorch pointer, or one from a
    /// DLPack capsule). Lengths must match the specs.
    ///
    /// # Safety
    /// Every region must be device memory of the context of the device the
    /// refit runs on, at least its length long, stay allocated for as long as the returned value lives,
    /// and not be written by other work while a refit reads or writes it.
    pub unsafe fn register(
        dev: &GpuDevice,
        owner: Endpoint,
        specs: &[BufferSpec],
        regions: &[(u64, usize)],
    ) -> Result<DeviceMemory, GpuError> {
        let what = || format!("{owner}: registering device buffers");
        if regions.len() != specs.len() {
            return Err(GpuError::Invalid { what: what(), problem: format!("{} regions for {} buffers", regions.len(), specs.len()) });
        }
        for (i, (b, &(addr, len))) in specs.iter().zip(regions).enumerate() {
            let want = b.elems.checked_mul(b.dtype.size()).and_then(|n| usize::try_from(n).ok());
            if Some(len) != want {
                let want = want.map_or_else(|| "more than this machine addresses".to_string(), |w| w.to_string());
                return Err(GpuError::Invalid {
                    what: what(),
                    problem: format!("buffer {i} '{}': {len} bytes, the layout needs {want}", b.name),
                });
            }
            if addr == 0 && len > 0 {
                return Err(GpuError::Invalid { what: what(), problem: format!("buffer {i} '{}': null address", b.name) });
            }
            if addr % b.dtype.size() != 0 {
                return Err(GpuError::Invalid {
                    what: what(),
                    problem: format!("buffer {i} '{}': address {addr:#x} not aligned to {}", b.name, b.dtype),
                });
            }
        }
        dev.bind()?;
        device_ranges(dev, owner, regions, "registering device buffers")?;
        Ok(DeviceMemory {
            owner,
            storage: Storage::User,
            addrs: regions.iter().map(|r| r.0).collect(),
            lens: regions.iter().map(|r| r.1).collect(),
            dtypes: specs.iter().map(|b| b.dtype).collect(),
        })
    }

    /// Exports this rank's bucket for another process of the node (one
    /// handle for every buffer; the importer derives the offsets from the
    /// same buffer list). Registered and imported memory is not exportable.
    pub fn export_ipc(&self, dev: &GpuDevice) -> Result<IpcHandle, GpuError> {
        let Storage::Bucket { base, .. } = self.storage else {
            return Err(GpuError::Invalid {
                what: format!("{}: exporting by CUDA IPC", self.owner),
                problem: "only a bucket this process allocated can be exported".into(),
            });
        };
        dev.bind()?;
        let what = format!("{}: cuIpcGetMemHandle", self.owner);
        let mut raw = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `base` is the start of a live cuMemAlloc allocation; `raw`
        // is a valid out-parameter.
        no_panic(&what, || unsafe { sys::cuIpcGetMemHandle(&mut raw, base) }.result().map_err(|e| e.to_string()))
            .map_err(|error| GpuError::Driver { what: what.clone(), error })?;
        let bytes: Vec<u8> = raw.reserved.iter().map(|&c| c as u8).collect();
        let handle = IpcHandle::from_bytes(&bytes).map_err(|e| GpuError::Invalid { what, problem: e.to_string() })?;
        ipc_mappings().exported(handle, base);
        Ok(handle)
    }

    /// Maps a bucket exported by [`DeviceMemory::export_ipc`] for rank
    /// `owner` with buffer list `specs` (the exporter's). Every import of
    /// one handle in this process shares one mapping, closed when the last
    /// of them is dropped; a handle this process exported is the exporter's
    /// own allocation (CUDA opens neither twice nor in the exporter).
    ///
    /// # Safety
    /// The exporter must keep the bucket allocated while the mapping lives,
    /// and not write the buffers while a refit reads them (the version
    /// fence of its store), nor read those a refit writes.
    pub unsafe fn import_ipc(dev: &GpuDevice, owner: Endpoint, specs: &[BufferSpec], handle: &IpcHandle) -> Result<DeviceMemory, GpuError> {
        let layout =
            BucketLayout::of(specs).map_err(|problem| GpuError::Invalid { what: format!("{owner}: laying out a bucket"), problem })?;
        dev.bind()?;
        let what = format!("{owner}: cuIpcOpenMemHandle");
        let mut raw = sys::CUipcMemHandle { reserved: [0; 64] };
        for (d, &b) in raw.reserved.iter_mut().zip(handle.as_bytes()) {
            *d = b as std::ffi::c_char;
        }
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint;
        let mapped = ipc_mappings().acquire(handle, || {
            let mut base: sys::CUdeviceptr = 0;
            // SAFETY: valid out-parameter; the handle is bytes CUDA checks.
            no_panic(&what, || unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, raw, flags) }.result().map_err(|e| e.to_string()))
                .map_err(|error| GpuError::Driver { what: what.clone(), error })?;
            Ok(base)
        })?;
        let storage = Storage::Imported { ctx: dev.ctx.clone(), handle: Box::new(*handle), mapped };
        // Made before the check, so that an error drops it (its share of
        // the mapping released).
        let memory = DeviceMemory::laid_out(owner, storage, mapped.base(), &layout, specs);
        // The bucket's size comes from the peer: believe the driver's
        // allocation instead.
        let (mut range_base, mut range_size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: valid out-parameters; `mapped.base()` is an address the
        // driver gave this process (mapped or its own), held by `memory`.
        unsafe { sys::cuMemGetAddressRange_v2(&mut range_base, &mut range_size, mapped.base()) }
            .result()
            .map_err(driver(format!("{owner}: the mapped bucket's allocation")))?;
        within_allocation(mapped.base(), layout.bytes, range_base, range_size as u64)
            .map_err(|problem| GpuError::Invalid { what: format!("{owner}: a CUDA IPC bucket"), problem })?;
        Ok(memory)
    }

    /// Device buffers for every program (contents undefined).
    pub fn for_programs(dev: &GpuDevice, programs: &[RankProgram]) -> Result<Vec<DeviceMemory>, GpuError> {
        programs.iter().map(|p| DeviceMemory::for_buffers(dev, p.endpoint, &p.buffers)).collect()
    }

    /// The rank these buffers belong to.
    pub fn owner(&self) -> Endpoint {
        self.owner
    }

    /// Bytes per buffer.
    pub fn buffer_lens(&self) -> &[usize] {
        &self.lens
    }

    /// Element type per buffer.
    pub fn dtypes(&self) -> &[DType] {
        &self.dtypes
    }

    /// Total bytes held.
    pub fn bytes(&self) -> u64 {
        self.lens.iter().map(|&l| l as u64).sum()
    }

    /// Copies host buffers of the same sizes to the device (waits).
    ///
    /// The copies are queued on the device's stream, so they follow every
    /// earlier use of the buffers there and precede every later one (a
    /// plain `cuMemcpyHtoD` runs on the legacy stream, which the device's
    /// non-blocking stream is not ordered against, and may return before a
    /// pageable copy reached the device).
    pub fn upload(&mut self, dev: &GpuDevice, host: &RankMemory) -> Result<(), GpuError> {
        self.check_host(host)?;
        dev.bind()?;
        let mut queued = Ok(());
        for (i, (&addr, h)) in self.addrs.iter().zip(&host.buffers).enumerate() {
            if !h.is_empty() {
                // SAFETY: the device buffer holds h.len() bytes (checked);
                // the host bytes are borrowed for the whole call, and the
                // driver copies pageable memory to its staging before this
                // returns; the stream's work is waited for below, on the
                // error path too (a failed wait means a failed context,
                // which runs nothing more).
                queued = unsafe { sys::cuMemcpyHtoDAsync_v2(addr, h.as_ptr().cast(), h.len(), dev.stream.cu_stream()) }
                    .result()
                    .map_err(driver(format!("{} buffer {i}: upload", self.owner)));
                if queued.is_err() {
                    break;
                }
            }
        }
        // Whatever was queued has read the host bytes before they can go.
        let waited = dev.synchronize();
        queued.and(waited)
    }

    /// Copies the buffers back to the host (waits).
    pub fn download(&self, dev: &GpuDevice) -> Result<RankMemory, GpuError> {
        let mut host = RankMemory { buffers: self.lens.iter().map(|&len| vec![0u8; len]).collect(), dtypes: self.dtypes.clone() };
        self.download_into(dev, &mut host)?;
        Ok(host)
    }

    /// Copies every buffer into `host`'s buffers of the same sizes (waits
    /// for the device first), reusing their memory.
    pub fn download_into(&self, dev: &GpuDevice, host: &mut RankMemory) -> Result<(), GpuError> {
        self.check_host(host)?;
        dev.synchronize()?;
        for (i, (&addr, h)) in self.addrs.iter().zip(&mut host.buffers).enumerate() {
            if !h.is_empty() {
                // SAFETY: `h.len()` bytes on both sides (checked above); the
                // call waits.
                unsafe { sys::cuMemcpyDtoH_v2(h.as_mut_ptr().cast(), addr, h.len()) }
                    .result()
                    .map_err(driver(format!("{} buffer {i}: download", self.owner)))?;
            }
        }
        Ok(())
    }

    /// Copies the first `regions.len()` buffers, whole, into `regions`
    /// (address and bytes of device memory of this device each, as long
    /// as its buffer) on the device's stream, and waits: a registered
    /// destination's commit, staging into the user's buffers.
    ///
    /// # Safety
    /// Every region must be device memory of this device's context,
    /// writable for its bytes, not overlapping these buffers, and neither
    /// read nor written by other work until this returns (on an error too:
    /// the copies queued before it are waited for).
    pub unsafe fn copy_to_regions(&self, dev: &GpuDevice, regions: &[(u64, usize)]) -> Result<(), GpuError> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.copy_regions(dev, regions, Towards::Regions) }
    }

    /// Copies `regions` (as [`copy_to_regions`](Self::copy_to_regions)
    /// takes them) into the first `regions.len()` buffers, and waits.
    ///
    /// # Safety
    /// Every region must be device memory of this device's context,
    /// readable for its bytes, and not written by other work until this
    /// returns (on an error too).
    pub unsafe fn copy_from_regions(&mut self, dev: &GpuDevice, regions: &[(u64, usize)]) -> Result<(), GpuError> {
        // SAFETY: the caller's promise, passed on; `&mut self` keeps other
        // users of these buffers away.
        unsafe { self.copy_regions(dev, regions, Towards::Buffers) }
    }

    /// One copy per region, between it and the buffer of the same index,
    /// on the device's stream; waits for whatever was queued, error or not.
    ///
    /// # Safety
    /// As [`copy_to_regions`](Self::copy_to_regions) for
    /// [`Towards::Regions`], [`copy_from_regions`](Self::copy_from_regions)
    /// for [`Towards::Buffers`] (whose caller holds `&mut self`).
    unsafe fn copy_regions(&self, dev: &GpuDevice, regions: &[(u64, usize)], towards: Towards) -> Result<(), GpuError> {
        let what = match towards {
            Towards::Regions => "copy to the registered buffers",
            Towards::Buffers => "copy from the registered buffers",
        };
        self.check_regions(regions, what)?;
        dev.bind()?;
        device_ranges(dev, self.owner, regions, what)?;
        let mut queued = Ok(());
        for (i, (&addr, &(region, len))) in self.addrs.iter().zip(regions).enumerate() {
            let (to, from) = match towards {
                Towards::Regions => (region, addr),
                Towards::Buffers => (addr, region),
            };
            // SAFETY: `len` bytes on both sides (checked: buffer `i` holds
            // `len`, the caller lends the region); on the device's stream,
            // waited for below whatever happens.
            queued = unsafe { sys::cuMemcpyDtoDAsync_v2(to, from, len, dev.stream.cu_stream()) }
                .result()
                .map_err(driver(format!("{} buffer {i}: {what}", self.owner)));
            if queued.is_err() {
                break;
            }
        }
        let waited = dev.synchronize();
        queued.and(waited)
    }

    fn check_regions(&self, regions: &[(u64, usize)], what: &str) -> Result<(), GpuError> {
        let invalid = |problem: String| GpuError::Invalid { what: format!("{}: {what}", self.owner), problem };
        if regions.len() > self.lens.len() {
            return Err(invalid(format!("{} regions for {} buffers", regions.len(), self.lens.len())));
        }
        for (i, (&(addr, len), &have)) in regions.iter().zip(&self.lens).enumerate() {
            if len != have || (addr == 0 && len > 0) {
                return Err(invalid(format!("buffer {i}: {have} bytes, a region of {len} bytes at {addr:#x}")));
            }
        }
        Ok(())
    }

    /// Sets every byte to zero (waits).
    pub fn zero(&mut self, dev: &GpuDevice) -> Result<(), GpuError> {
        dev.bind()?;
        for (i, (&addr, &len)) in self.addrs.iter().zip(&self.lens).enumerate() {
            // SAFETY: `len` bytes of this buffer, on the device's stream.
            unsafe { sys::cuMemsetD8Async(addr, 0, len, dev.stream.cu_stream()) }
                .result()
                .map_err(driver(format!("{} buffer {i}: zero", self.owner)))?;
        }
        dev.synchronize()
    }

    /// Converts every element of buffer `from` into buffer `to` of `dst`
    /// on the device, with the cast kernels (the two buffers hold as many
    /// elements; a dtype pair without a kernel is an error), and waits.
    pub fn cast_into(&self, dev: &GpuDevice, from: usize, dst: &mut DeviceMemory, to: usize) -> Result<(), GpuError> {
        let what = || format!("{} buffer {from} -> {} buffer {to}: cast", self.owner, dst.owner);
        let invalid = |problem: String| GpuError::Invalid { what: what(), problem };
        let (Some(&fd), Some(&td)) = (self.dtypes.get(from), dst.dtypes.get(to)) else {
            return Err(invalid("no such buffer".into()));
        };
        let n = self.lens[from] as u64 / fd.size();
        if dst.lens[to] as u64 / td.size() != n {
            return Err(invalid(format!("{n} elements into {}", dst.lens[to] as u64 / td.size())));
        }
        let kernel = kernels::strided_kernel(fd, td).ok_or_else(|| invalid(format!("no kernel converts {fd} to {td}")))?;
        let k = dev.kernels().map_err(invalid)?;
        let flat = crate::cuda::copyplan::Side { base: 0, strides: crate::copy::packed_strides(&[n]) };
        for b in kernels::plan_casts(&[n], &flat, &flat) {
            // SAFETY: both buffers are live allocations of this device
            // holding n elements of their dtypes (checked above); we wait
            // for the kernel before returning, and `&mut dst` keeps other
            // users away meanwhile.
            unsafe { k.launch(&dev.stream, kernel, &b, self.addrs[from], dst.addrs[to]) }.map_err(invalid)?;
        }
        dev.synchronize()
    }

    fn check_host(&self, host: &RankMemory) -> Result<(), GpuError> {
        let lens: Vec<usize> = host.buffers.iter().map(Vec::len).collect();
        if lens != self.lens {
            return Err(GpuError::Invalid {
                what: format!("{}: host copy", self.owner),
                problem: format!("host buffers of {lens:?} bytes for device buffers of {:?}", self.lens),
            });
        }
        Ok(())
    }

    /// Device addresses of the buffers, in order (valid while `self`
    /// lives): for raw device work such as an NCCL group.
    pub fn device_addrs(&self) -> &[u64] {
        &self.addrs
    }

    fn piece_ops(&self, dev: &GpuDevice, span: &Span, dtype: DType, block: &Block, to_device: bool) -> Result<Vec<CopyOp>, GpuError> {
        let what = || format!("{}: piece {block} in buffer {}", self.owner, span.buffer);
        let len =
            *self.lens.get(span.buffer as usize).ok_or_else(|| GpuError::Invalid { what: what(), problem: "no such buffer".into() })?;
        if self.dtypes[span.buffer as usize] != dtype {
            return Err(GpuError::Invalid {
                what: what(),
                problem: format!("buffer holds {}, not {dtype}", self.dtypes[span.buffer as usize]),
            });
        }
        let elem = dtype.size();
        let counts = block.extent();
        // Checked before any copy is planned (their number grows with the
        // piece): the piece's elements and offsets lie in the buffer.
        if !crate::copy::fits(counts, len, span.base, &span.strides, dtype) {
            return Err(GpuError::Invalid { what: what(), problem: format!("reaches past the buffer's {len} bytes") });
        }
        let side = Side { base: span.base, strides: span.strides };
        let packed = Side { base: 0, strides: crate::copy::packed_strides(counts) };
        let ops = if to_device {
            plan_copies(counts, &packed, &side, elem, dev.max_pitch)
        } else {
            plan_copies(counts, &side, &packed, elem, dev.max_pitch)
        };
        let end = ops.iter().map(|o| if to_device { o.dst_end() } else { o.src_end() }).max().unwrap_or(0);
        if end > len as u64 {
            return Err(GpuError::Invalid { what: what(), problem: format!("reaches byte {end} of {len}") });
        }
        Ok(ops)
    }

    /// Packs one piece (a strided span of one buffer) into pinned host
    /// staging, back to back in the buffer's dtype, and returns the bytes
    /// (waits for the copies). For transports that move host bytes.
    pub fn read_piece<'s>(
        &self,
        dev: &GpuDevice,
        staging: &'s mut PinnedStaging,
        span: &Span,
        dtype: DType,
        block: &Block,
    ) -> Result<&'s [u8], GpuError> {
        dev.bind()?;
        let ops = self.piece_ops(dev, span, dtype, block, false)?;
        // (`piece_ops` checked the piece against its buffer: its bytes fit.)
        let n = block.numel().saturating_mul(dtype.size()) as usize;
        let host = staging.ensure(n)?;
        let base = self.addrs[span.buffer as usize];
        for op in &ops {
            // SAFETY: ops are in bounds of the buffer (checked) and of the
            // n staging bytes (packed); we wait before returning.
            unsafe { issue(op, Loc::Device(base), Loc::Host(host), dev.stream.cu_stream()) }
                .map_err(driver(format!("{}: reading piece {block}", self.owner)))?;
        }
        dev.synchronize()?;
        // SAFETY: n bytes of the staging were just written and the stream is idle.
        Ok(unsafe { std::slice::from_raw_parts(host, n) })
    }

    /// Writes one piece, given packed in the buffer's dtype, into a strided
    /// span of one buffer through pinned staging (waits).
    pub fn write_piece(
        &mut self,
        dev: &GpuDevice,
        staging: &mut PinnedStaging,
        span: &Span,
        dtype: DType,
        block: &Block,
        bytes: &[u8],
    ) -> Result<(), GpuError> {
        let n = match block.checked_numel().and_then(|n| n.checked_mul(dtype.size())).and_then(|n| usize::try_from(n).ok()) {
            Some(n) if n == bytes.len() => n,
            n => {
                let n = n.map_or_else(|| "more than this machine addresses".to_string(), |n| n.to_string());
                return Err(GpuError::Invalid {
                    what: format!("{}: writing piece {block}", self.owner),
                    problem: format!("{} bytes for {n}", bytes.len()),
                });
            }
        };
        dev.bind()?;
        let ops = self.piece_ops(dev, span, dtype, block, true)?;
        let host = staging.ensure(n)?;
        // SAFETY: the staging holds at least n bytes and no copy uses it now.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), host, n) };
        let base = self.addrs[span.buffer as usize];
        for op in &ops {
            // SAFETY: as in read_piece.
            unsafe { issue(op, Loc::Host(host), Loc::Device(base), dev.stream.cu_stream()) }
                .map_err(driver(format!("{}: writing piece {block}", self.owner)))?;
        }
        dev.synchronize()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without CUDA (CI), every entry point reports an error
    /// instead of panicking; with CUDA, they work.
    #[test]
    fn missing_libraries_are_errors_not_panics() {
        let probe = crate::gpu_probe::cuda_available();
        match GpuDevice::open(0) {
            Ok(dev) => assert!(probe_driver().is_ok() && !dev.name().is_empty()),
            Err(GpuError::Unavailable(why)) => {
                assert!(probe.is_err());
                assert!(why.contains("libcuda") || why.contains("device") || why.contains("cuInit"), "{why}");
            }
            Err(e) => panic!("unexpected {e}"),
        }
        if let Err(why) = probe_nccl() {
            assert!(why.contains("NCCL") || why.contains("nccl"), "{why}");
        }
        assert_eq!(nccl_version_text(22304), "2.23.4");
    }
}
