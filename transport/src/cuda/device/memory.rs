//! A rank's buffers in device memory ([`DeviceMemory`]): one bucket this
//! process allocated (exportable by CUDA IPC), the user's own memory
//! registered without a copy (checked with the driver at each use), or
//! another process's bucket mapped by IPC; and the copies in and out of
//! them (whole buffers, registered regions, strided pieces).

use super::{driver, issue, no_panic, GpuDevice, GpuError, Loc, PinnedStaging};
use crate::cuda::copyplan::{plan_copies, CopyOp, Side};
use crate::cuda::direct::RegionOffer;
use crate::cuda::ipc::{within_allocation, BucketLayout, IpcHandle, Mapped, Mappings};
use crate::cuda::kernels;
use crate::memory::RankMemory;
use cudarc::driver::{result, sys, CudaContext};
use reshard::{Block, BufferSpec, DType, Endpoint, RankProgram, Span};
use std::sync::{Arc, OnceLock};

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
        within_allocation(addr, len as u64, base, size as u64)
            .map_err(|source| GpuError::Allocation { what: format!("{owner}: {what}, buffer {i}"), source })?;
    }
    Ok(())
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

/// Queues `queue((index, item))` for each of `items` on the device's
/// stream, stopping at the first that fails, then waits for the stream
/// whatever happened: what was queued has run before the memory it reads
/// or writes can go. The first error, queueing's or the wait's.
fn queue_each_then_wait<T>(
    dev: &GpuDevice,
    items: impl IntoIterator<Item = T>,
    queue: impl FnMut((usize, T)) -> Result<(), GpuError>,
) -> Result<(), GpuError> {
    let queued = items.into_iter().enumerate().try_for_each(queue);
    let waited = dev.synchronize();
    queued.and(waited)
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
    pub(super) addrs: Vec<u64>,
    pub(super) lens: Vec<usize>,
    pub(super) dtypes: Vec<DType>,
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
            BucketLayout::of(specs).map_err(|source| GpuError::Layout { what: format!("{owner}: laying out a bucket"), source })?;
        dev.bind()?;
        let what = format!("{owner}: allocating a bucket of {} bytes for {} buffers", layout.bytes, specs.len());
        // SAFETY: a plain allocation; freed by `Storage::Bucket` on drop.
        let base = no_panic(&what, || unsafe { result::malloc_sync(layout.bytes as usize) }.map_err(driver(&what)))?;
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
        no_panic(&what, || unsafe { sys::cuIpcGetMemHandle(&mut raw, base) }.result().map_err(driver(&what)))?;
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
            BucketLayout::of(specs).map_err(|source| GpuError::Layout { what: format!("{owner}: laying out a bucket"), source })?;
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
            no_panic(&what, || unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, raw, flags) }.result().map_err(driver(&what)))?;
            Ok::<_, GpuError>(base)
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
            .map_err(|source| GpuError::Allocation { what: format!("{owner}: a CUDA IPC bucket"), source })?;
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
        queue_each_then_wait(dev, self.addrs.iter().zip(&host.buffers), |(i, (&addr, h))| {
            if h.is_empty() {
                return Ok(());
            }
            // SAFETY: the device buffer holds h.len() bytes (checked); the
            // host bytes are borrowed for the whole call, and the driver
            // copies pageable memory to its staging before this returns;
            // the stream's work is waited for after the copies, on the
            // error path too (a failed wait means a failed context, which
            // runs nothing more).
            unsafe { sys::cuMemcpyHtoDAsync_v2(addr, h.as_ptr().cast(), h.len(), dev.stream.cu_stream()) }
                .result()
                .map_err(driver(format!("{} buffer {i}: upload", self.owner)))
        })
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
        queue_each_then_wait(dev, self.addrs.iter().zip(regions), |(i, (&addr, &(region, len)))| {
            let (to, from) = match towards {
                Towards::Regions => (region, addr),
                Towards::Buffers => (addr, region),
            };
            // SAFETY: `len` bytes on both sides (checked: buffer `i` holds
            // `len`, the caller lends the region); on the device's stream,
            // waited for after the copies whatever happens.
            unsafe { sys::cuMemcpyDtoDAsync_v2(to, from, len, dev.stream.cu_stream()) }
                .result()
                .map_err(driver(format!("{} buffer {i}: {what}", self.owner)))
        })
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
        let kernel_error = |source| GpuError::Kernel { what: what(), source };
        let k = dev.kernels().map_err(kernel_error)?;
        let flat = crate::cuda::copyplan::Side { base: 0, strides: crate::copy::packed_strides(&[n]) };
        for b in kernels::plan_casts(&[n], &flat, &flat) {
            // SAFETY: both buffers are live allocations of this device
            // holding n elements of their dtypes (checked above); we wait
            // for the kernel before returning, and `&mut dst` keeps other
            // users away meanwhile.
            unsafe { k.launch(&dev.stream, kernel, &b, self.addrs[from], dst.addrs[to]) }.map_err(kernel_error)?;
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

/// The region `addr..addr + len` of device memory on `dev` as a reader on
/// the same device maps it (a direct read, [`crate::cuda::direct`]): the
/// IPC handle of the allocation holding it, checked with the driver, and
/// its place there. Memory the driver cannot export (PyTorch's expandable
/// segments, `cuMemCreate` allocations) is refused, naming it.
pub(crate) fn offer_region(dev: &GpuDevice, owner: Endpoint, addr: u64, len: usize) -> Result<RegionOffer, GpuError> {
    let what = format!("{owner}: offering {len} bytes at {addr:#x} to a reader on this device");
    dev.bind()?;
    device_ranges(dev, owner, &[(addr, len.max(1))], "offering a buffer to a reader on this device")?;
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-parameters; the address was just found to be device
    // memory of this context's device.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) }.result().map_err(driver(what.clone()))?;
    let mut raw = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: `base` is the start of a live allocation (the driver's own
    // answer above); `raw` is a valid out-parameter.
    let export = format!("{what} (cuIpcGetMemHandle: memory CUDA IPC cannot export, e.g. PyTorch's expandable segments?)");
    no_panic(&what, || unsafe { sys::cuIpcGetMemHandle(&mut raw, base) }.result().map_err(driver(export)))?;
    let bytes: Vec<u8> = raw.reserved.iter().map(|&c| c as u8).collect();
    let handle = IpcHandle::from_bytes(&bytes).map_err(|e| GpuError::Invalid { what: what.clone(), problem: e.to_string() })?;
    // A reader in this process reaches the allocation itself.
    ipc_mappings().exported(handle, base);
    Ok(RegionOffer { handle, offset: addr - base, len: len as u64 })
}

/// Allocations of peers on this device, mapped for direct reads and kept
/// across the runs of one communicator end (mapping costs far more than a
/// refit's copies). While copies from them may still run (a run that
/// failed before its copies finished), they are never closed: dropped then,
/// they stay mapped for good.
#[derive(Default)]
pub(crate) struct PeerMaps {
    /// Handle -> the mapping, and its allocation's bytes (the driver's).
    maps: std::collections::HashMap<IpcHandle, (DeviceMemory, u64)>,
    /// Copies from a mapping were queued and not yet waited for.
    pub(crate) in_flight: bool,
}

impl PeerMaps {
    /// The address of the region `peer` offered, its allocation mapped
    /// first where it is not yet (checked with the driver: the region must
    /// lie inside the allocation the handle opens).
    ///
    /// # Safety
    /// The peer must keep the allocation alive and unwritten while this
    /// rank reads it (until it receives this rank's done token).
    pub(crate) unsafe fn map(&mut self, dev: &GpuDevice, peer: Endpoint, offer: &RegionOffer) -> Result<u64, GpuError> {
        let what = || format!("{peer}: a region it offered");
        if let std::collections::hash_map::Entry::Vacant(slot) = self.maps.entry(offer.handle) {
            dev.bind()?;
            let mut raw = sys::CUipcMemHandle { reserved: [0; 64] };
            for (d, &b) in raw.reserved.iter_mut().zip(offer.handle.as_bytes()) {
                *d = b as std::ffi::c_char;
            }
            let open = format!("{peer}: cuIpcOpenMemHandle");
            let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint;
            let mapped = ipc_mappings().acquire(&offer.handle, || {
                let mut base: sys::CUdeviceptr = 0;
                // SAFETY: valid out-parameter; the handle is bytes CUDA checks.
                no_panic(&open, || unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, raw, flags) }.result().map_err(driver(&open)))?;
                Ok::<_, GpuError>(base)
            })?;
            let storage = Storage::Imported { ctx: dev.ctx.clone(), handle: Box::new(offer.handle), mapped };
            // Made before the check, so that an error drops it (its share
            // of the mapping released).
            let mut memory = DeviceMemory { owner: peer, storage, addrs: vec![mapped.base()], lens: vec![0], dtypes: vec![DType::U8] };
            let (mut range_base, mut range_size): (sys::CUdeviceptr, usize) = (0, 0);
            // SAFETY: valid out-parameters; `mapped.base()` is an address the
            // driver gave this process, held by `memory`.
            unsafe { sys::cuMemGetAddressRange_v2(&mut range_base, &mut range_size, mapped.base()) }
                .result()
                .map_err(driver(format!("{peer}: the mapped allocation")))?;
            if range_base != mapped.base() {
                return Err(GpuError::Invalid {
                    what: what(),
                    problem: "the handle opens memory that is not an allocation's start".into(),
                });
            }
            memory.lens[0] = range_size;
            slot.insert((memory, range_size as u64));
        }
        let (memory, size) =
            self.maps.get(&offer.handle).ok_or_else(|| GpuError::Invalid { what: what(), problem: "not mapped".into() })?;
        within_allocation(offer.offset, offer.len, 0, *size).map_err(|source| GpuError::Allocation { what: what(), source })?;
        self.in_flight = true;
        Ok(memory.addrs[0] + offer.offset)
    }
}

impl Drop for PeerMaps {
    fn drop(&mut self) {
        if self.in_flight {
            // Copies from them may still run: closing the mappings under
            // them would fault the context.
            std::mem::forget(std::mem::take(&mut self.maps));
        }
    }
}
