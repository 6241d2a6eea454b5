//! The kernels of `kernels.cu` loaded on one device ([`DeviceKernels`]:
//! the shipped PTX, or NVRTC's build of the source), and their launches:
//! strided copy-casts and the FP8 quantize kernels.

use super::no_panic;
use crate::cuda::kernels::{self, CastBox, Launch};
use crate::cuda::quantplan::{CodesLaunch, ScalesLaunch};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DriverError, LaunchArgs, LaunchConfig, PushKernelArg};
use std::sync::Arc;
use thiserror::Error;

/// Why the cast kernels did not load, or one did not launch.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum KernelError {
    /// NVRTC does not load.
    #[error(
        "NVRTC (libnvrtc.so or libnvrtc.so.12) is not loadable: install the CUDA toolkit's nvrtc, or put a libnvrtc.so symlink \
         to the installed one (libnvrtc.so.13 of CUDA 13) in a directory on LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    /// NVRTC did not compile the source.
    #[error("NVRTC: {0}")]
    Compile(#[source] cudarc::nvrtc::CompileError),
    /// An NVRTC call failed.
    #[error("{call}: {code:?}")]
    Nvrtc {
        /// The call.
        call: &'static str,
        /// NVRTC's result.
        code: cudarc::nvrtc::sys::nvrtcResult,
    },
    /// The shipped PTX is older than the kernels' source.
    #[error("the shipped PTX is stale")]
    Stale,
    /// The driver refused the module.
    #[error("{0}")]
    Module(#[source] DriverError),
    /// A kernel of the module is missing.
    #[error("{name}: {source}")]
    Function {
        /// The kernel.
        name: &'static str,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// Neither the shipped PTX nor NVRTC's build loaded.
    #[error("shipped PTX: {shipped}; NVRTC: {nvrtc}")]
    Neither {
        /// Why the shipped PTX did not.
        shipped: Box<KernelError>,
        /// Why NVRTC's build did not.
        nvrtc: Box<KernelError>,
    },
    /// No kernel of that name was loaded.
    #[error("no kernel {0}")]
    NoKernel(String),
    /// A launch failed.
    #[error("{name}: {source}")]
    Launch {
        /// The kernel.
        name: String,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// Loading panicked (a missing library or symbol).
    #[error(transparent)]
    Panicked(#[from] super::Panicked),
}

/// How [`DeviceKernels::origin`] names the shipped PTX.
const SHIPPED_ORIGIN: &str = "shipped PTX";

/// The strided copy-cast kernels of `kernels.cu`, loaded on one device.
pub struct DeviceKernels {
    functions: Vec<(&'static str, CudaFunction)>,
    pub(super) origin: String,
    /// Whether they are the shipped PTX (not NVRTC's build).
    shipped: bool,
}

impl std::fmt::Debug for DeviceKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKernels").field("kernels", &self.functions.len()).field("origin", &self.origin).finish()
    }
}

impl DeviceKernels {
    fn from_ptx(ctx: &Arc<CudaContext>, ptx: String, origin: String, shipped: bool) -> Result<DeviceKernels, KernelError> {
        no_panic("loading the cast kernels", || {
            let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(KernelError::Module)?;
            let mut functions = Vec::new();
            for name in kernels::KERNELS {
                functions.push((name, module.load_function(name).map_err(|source| KernelError::Function { name, source })?));
            }
            Ok(DeviceKernels { functions, origin, shipped })
        })
    }

    /// The kernels compiled here by NVRTC for `ctx`'s device (the fallback
    /// where the driver refuses the shipped PTX).
    pub(super) fn from_nvrtc(ctx: &Arc<CudaContext>) -> Result<DeviceKernels, KernelError> {
        let cc = ctx.compute_capability().ok();
        let ptx = kernels::compile(cc)?;
        let arch = cc.map_or("NVRTC's default".to_string(), |(major, minor)| format!("compute_{major}{minor}"));
        DeviceKernels::from_ptx(ctx, ptx, format!("compiled by NVRTC ({arch})"), false)
    }

    pub(super) fn load(ctx: &Arc<CudaContext>) -> Result<DeviceKernels, KernelError> {
        let shipped = if kernels::shipped_ptx_is_current() {
            let isa = kernels::shipped_ptx_isa().unwrap_or("?");
            let origin = format!("{SHIPPED_ORIGIN} (PTX ISA {isa}, compute_80)");
            DeviceKernels::from_ptx(ctx, kernels::SHIPPED_PTX.to_string(), origin, true)
        } else {
            Err(KernelError::Stale)
        };
        shipped.or_else(|first| {
            DeviceKernels::from_nvrtc(ctx).map_err(|e| KernelError::Neither { shipped: Box::new(first), nvrtc: Box::new(e) })
        })
    }

    /// Where the kernels came from (shipped PTX or NVRTC).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Whether they are the shipped code (not compiled here by NVRTC).
    pub fn shipped(&self) -> bool {
        self.shipped
    }

    fn function(&self, name: &str) -> Result<&CudaFunction, KernelError> {
        self.functions.iter().find(|(n, _)| *n == name).map(|(_, f)| f).ok_or_else(|| KernelError::NoKernel(name.to_string()))
    }

    /// Queues kernel `name` on `stream` over the grid and blocks of
    /// `shape`, with the parameters `push` gives it.
    ///
    /// # Safety
    /// `push` must give the kernel's parameters in order and of its types,
    /// and the memory they address must be as the launch that calls this
    /// promises its caller (live device allocations of this context, large
    /// enough, alive and untouched by other work until the stream has run
    /// the kernel).
    unsafe fn queue<'a>(
        &'a self,
        stream: &'a Arc<CudaStream>,
        name: &str,
        shape: Launch,
        push: impl FnOnce(&mut LaunchArgs<'a>),
    ) -> Result<(), KernelError> {
        let mut args = stream.launch_builder(self.function(name)?);
        push(&mut args);
        let ([gx, gy, gz], [bx, by, bz]) = (shape.grid, shape.block);
        let cfg = LaunchConfig { grid_dim: (gx, gy, gz), block_dim: (bx, by, bz), shared_mem_bytes: 0 };
        // SAFETY: the caller passes the kernel's parameters as it takes
        // them and guarantees the memory (above).
        unsafe { args.launch(cfg) }.map(|_| ()).map_err(|source| KernelError::Launch { name: name.to_string(), source })
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
    pub(crate) unsafe fn launch(&self, stream: &Arc<CudaStream>, name: &str, b: &CastBox, src: u64, dst: u64) -> Result<(), KernelError> {
        let [c0, c1, c2] = b.counts;
        let [ss0, ss1, ss2] = b.src_strides;
        let [ds0, ds1, ds2] = b.dst_strides;
        // SAFETY: the kernel's parameters are 2 pointers and 11 u64, passed
        // as 13 u64 in order; the caller guarantees the memory (above).
        unsafe {
            self.queue(stream, name, b.launch(), |args| {
                args.arg(&src).arg(&dst).arg(&c0).arg(&c1).arg(&c2);
                args.arg(&b.src_base).arg(&ss0).arg(&ss1).arg(&ss2);
                args.arg(&b.dst_base).arg(&ds0).arg(&ds1).arg(&ds2);
            })
        }
    }
}

impl DeviceKernels {
    /// Queues a [`ScalesLaunch`] on `stream`: the staged buffer at `staged`,
    /// the scratch scales at `scales`, the error flag at `err`.
    ///
    /// # Safety
    /// The addresses must be live device allocations of this context
    /// holding what the launch reads and writes (the plan checked against
    /// the buffers: [`QuantPlan::fits`](crate::cuda::quantplan::QuantPlan::fits)), alive until the stream has run
    /// the kernel, and written by nothing else meanwhile.
    pub(super) unsafe fn launch_fp8_scales(
        &self,
        stream: &Arc<CudaStream>,
        l: &ScalesLaunch,
        staged: u64,
        scales: u64,
        err: u64,
    ) -> Result<(), KernelError> {
        let yz = |c: u64| c.clamp(1, kernels::MAX_BLOCKS_YZ as u64) as u32;
        let shape = Launch {
            grid: [l.grid[0].clamp(1, kernels::MAX_BLOCKS_X as u64) as u32, yz(l.grid[1]), yz(l.grid[2])],
            block: [kernels::THREADS, 1, 1],
        };
        // SAFETY: the kernel takes 3 pointers and 21 u64, passed as 24 u64
        // in order; the caller guarantees the memory (above).
        unsafe {
            self.queue(stream, "refit_fp8_scales", shape, |args| {
                args.arg(&staged).arg(&scales).arg(&err).arg(&l.dt);
                for v in [&l.grid, &l.grid_off, &l.block, &l.shape, &l.first] {
                    args.arg(&v[0]).arg(&v[1]).arg(&v[2]);
                }
                args.arg(&l.at).arg(&l.strides[0]).arg(&l.strides[1]).arg(&l.strides[2]).arg(&l.base);
            })
        }
    }

    /// Queues a [`CodesLaunch`] on `stream`.
    ///
    /// # Safety
    /// As [`launch_fp8_scales`](Self::launch_fp8_scales), for the staged
    /// buffer at `staged`, the weights at `weights` and the scales at
    /// `scales`.
    pub(super) unsafe fn launch_fp8_codes(
        &self,
        stream: &Arc<CudaStream>,
        l: &CodesLaunch,
        staged: u64,
        weights: u64,
        scales: u64,
    ) -> Result<(), KernelError> {
        // SAFETY: the kernel takes 3 pointers and 24 u64, passed as 27 u64
        // in order; the caller guarantees the memory (above).
        unsafe {
            self.queue(stream, "refit_fp8_codes", kernels::launch_3d(l.counts), |args| {
                args.arg(&staged).arg(&weights).arg(&scales).arg(&l.dt);
                args.arg(&l.counts[0]).arg(&l.counts[1]).arg(&l.counts[2]);
                args.arg(&l.src_base).arg(&l.src_strides[0]).arg(&l.src_strides[1]).arg(&l.src_strides[2]);
                args.arg(&l.dst_base).arg(&l.dst_strides[0]).arg(&l.dst_strides[1]).arg(&l.dst_strides[2]);
                for v in [&l.first, &l.block, &l.grid_off] {
                    args.arg(&v[0]).arg(&v[1]).arg(&v[2]);
                }
                args.arg(&l.grid_strides[1]).arg(&l.grid_strides[2]).arg(&l.base);
            })
        }
    }
}
