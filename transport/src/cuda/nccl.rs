//! NCCL communicators and the NCCL executor (`cuda` feature).
//!
//! [`NcclBackend`] is the real [`CommBackend`]: it lives on its
//! communicator thread (see [`comm`](crate::cuda::comm)), creates the
//! communicator with `ncclCommInitRankConfig` and `blocking = 0`, runs a
//! round as one `ncclGroupStart`/`ncclGroupEnd` group of `ncclSend`/
//! `ncclRecv` on its own stream, polls `ncclCommGetAsyncError` and a CUDA
//! event for completion, and tears down with `ncclCommAbort`. Everything
//! goes through cudarc's `result`/`sys` layers, because cudarc's safe
//! `Comm` creates blocking communicators and panics in `Drop` if abort fails.
//!
//! A rank's program with its buffers on the device runs through the fabric
//! ([`crate::fabric`]): the communicator executor ([`plane`](crate::cuda::plane)) on a
//! [`DevicePlaneMemory`] (device staging, copies and cast kernels on the device's
//! stream, an event ordering each group after the packing).

use crate::copy::fits;
use crate::cuda::comm::{
    BackendError, CommBackend, CommConfig, CommError, CommHandle, Fence, GroupError, P2p, PendingComm, Progress, RawEvent,
};
use crate::cuda::copyplan::CopyOp;
use crate::cuda::device::{
    event_progress, issue, no_panic, offer_region, probe_driver, probe_nccl, DeviceMemory, GpuDevice, GpuError, Loc, PeerMaps,
    PinnedStaging,
};
use crate::cuda::direct::RegionOffer;
use crate::cuda::exec::{convert_on_host, piece_ops, queue_ops, QueueError, SameType};
use crate::cuda::fallback::note;
use crate::cuda::id::CommId;
use crate::cuda::kernels::without_kernel;
use crate::cuda::plane::{staging_span, PlaneError, PlaneMemory, Side, StagingSide};
use crate::cuda::schedule::{Place, Step};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};
use cudarc::nccl::{result, sys};
use reshard::{Block, DType, Endpoint, RankProgram};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// `NCCL_API_MAGIC`: marks an initialised `ncclConfig_t`.
const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`: "use NCCL's default".
const UNDEF_INT: c_int = c_int::MIN;
/// Version of the `ncclConfig_t` layout in cudarc's bindings (NCCL 2.30).
const CONFIG_VERSION: u32 = 23000;

impl CommId {
    /// A new id from `ncclGetUniqueId` (on the member that hosts rank 0).
    /// Checks that NCCL is loadable first; never panics.
    pub fn generate() -> Result<CommId, BackendError> {
        probe_nccl()?;
        let raw =
            no_panic("ncclGetUniqueId", || result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e.0, std::ptr::null_mut())))?;
        let bytes: Vec<u8> = raw.internal.iter().map(|&c| c as u8).collect();
        CommId::from_bytes(&bytes).map_err(BackendError::BadId)
    }

    fn to_nccl(self) -> sys::ncclUniqueId {
        let mut internal = [0 as c_char; 128];
        for (d, &s) in internal.iter_mut().zip(self.as_bytes()) {
            *d = s as c_char;
        }
        sys::ncclUniqueId { internal }
    }
}

/// A group's failure with NCCL result `code`: a peer's where NCCL says
/// the error is remote (a peer failed or went away).
fn group_error(code: sys::ncclResult_t, reason: BackendError) -> GroupError {
    match code {
        sys::ncclResult_t::ncclRemoteError => GroupError::peer(reason),
        _ => GroupError::from(reason),
    }
}

/// NCCL call `call` failed with `code` (on `comm`, where not null).
fn nccl_error(call: impl Into<String>, code: sys::ncclResult_t, comm: sys::ncclComm_t) -> BackendError {
    BackendError::Nccl { call: call.into(), code, detail: nccl_text(code, comm) }
}

/// A CUDA driver call of the backend failed while doing `what`.
fn driver_error(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> BackendError + '_ {
    move |source| BackendError::Driver { what: what.to_string(), source }
}

/// An NCCL result code with NCCL's text and, given a communicator, its
/// last error message.
fn nccl_text(code: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
    // SAFETY: NCCL returns static strings (or null).
    let s = unsafe { sys::ncclGetErrorString(code) };
    let mut out = if s.is_null() { format!("{code:?}") } else { format!("{code:?}: {}", unsafe { CStr::from_ptr(s) }.to_string_lossy()) };
    if !comm.is_null() {
        // SAFETY: comm is a live communicator; NCCL owns the string.
        let last = unsafe { sys::ncclGetLastError(comm) };
        if !last.is_null() {
            let last = unsafe { CStr::from_ptr(last) }.to_string_lossy();
            if !last.is_empty() {
                out.push_str(&format!(" ({last})"));
            }
        }
    }
    out
}

/// The real communicator behind a [`CommHandle`]. Created and used only
/// on its communicator thread (it is not `Send`).
pub(crate) struct NcclBackend {
    /// Boxed so its address stays put while NCCL's creation job runs.
    comm: Box<sys::ncclComm_t>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    done: Option<CudaEvent>,
    enqueued: bool,
    /// Recorded on the stream after an abort that went on in the
    /// background: complete once NCCL's work on the stream has ended.
    teardown: Option<CudaEvent>,
}

impl std::fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclBackend").field("comm", &*self.comm).field("enqueued", &self.enqueued).finish()
    }
}

impl NcclBackend {
    /// Starts creating `rank` of an `nranks` communicator on device
    /// `ordinal` from `id`, without blocking. Call on the thread that will
    /// own it (see [`create_comms`]).
    pub(crate) fn create(ordinal: usize, id: CommId, rank: u32, nranks: u32) -> Result<NcclBackend, BackendError> {
        probe_driver()?;
        probe_nccl()?;
        // Binds the device's primary context to this thread: NCCL uses the
        // current device.
        let ctx = CudaContext::new(ordinal).map_err(driver_error(&format!("opening CUDA device {ordinal}")))?;
        let stream = ctx.new_stream().map_err(driver_error(&format!("creating a stream on device {ordinal}")))?;
        let mut config = sys::ncclConfig_t {
            size: std::mem::size_of::<sys::ncclConfig_t>(),
            magic: CONFIG_MAGIC,
            version: CONFIG_VERSION,
            blocking: 0,
            cgaClusterSize: UNDEF_INT,
            minCTAs: UNDEF_INT,
            maxCTAs: UNDEF_INT,
            netName: std::ptr::null(),
            splitShare: UNDEF_INT,
            trafficClass: UNDEF_INT,
            commName: std::ptr::null(),
            collnetEnable: UNDEF_INT,
            CTAPolicy: UNDEF_INT,
            shrinkShare: UNDEF_INT,
            nvlsCTAs: UNDEF_INT,
            nChannelsPerNetPeer: UNDEF_INT,
            nvlinkCentricSched: UNDEF_INT,
            graphUsageMode: UNDEF_INT,
            numRmaCtx: UNDEF_INT,
            maxP2pPeers: UNDEF_INT,
        };
        let mut comm: Box<sys::ncclComm_t> = Box::new(std::ptr::null_mut());
        // SAFETY: `comm` and `config` are valid for the call (NCCL copies
        // the config; the comm slot is boxed and outlives the communicator).
        let r = unsafe { result::comm_init_rank_config(&mut *comm, nranks as c_int, id.to_nccl(), rank as c_int, &mut config) };
        if let Err(e) = r {
            // A synchronous failure: NCCL has freed what it allocated (or
            // left it to its own cleanup) and may have left the slot set.
            // Nothing here is ours to poll or abort: forget the slot.
            *comm = std::ptr::null_mut();
            return Err(nccl_error(format!("ncclCommInitRankConfig(rank {rank} of {nranks})"), e.0, std::ptr::null_mut()));
        }
        Ok(NcclBackend { comm, ctx, stream, done: None, enqueued: false, teardown: None })
    }

    fn async_state(&self) -> Result<sys::ncclResult_t, BackendError> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: live communicator; state is a valid out-pointer.
        let r = unsafe { sys::ncclCommGetAsyncError(*self.comm, &mut state) };
        if r != sys::ncclResult_t::ncclSuccess {
            return Err(nccl_error("ncclCommGetAsyncError", r, *self.comm));
        }
        Ok(state)
    }

    fn progress(&self) -> Result<Progress, BackendError> {
        self.group_progress().map_err(|e| e.reason)
    }

    /// [`NcclBackend::progress`], a remote error said to be a peer's.
    fn group_progress(&self) -> Result<Progress, GroupError> {
        match self.async_state()? {
            sys::ncclResult_t::ncclSuccess => Ok(Progress::Ready),
            sys::ncclResult_t::ncclInProgress => Ok(Progress::Pending),
            code => Err(group_error(code, BackendError::NcclAsync { code, detail: nccl_text(code, *self.comm) })),
        }
    }
}

impl CommBackend for NcclBackend {
    fn poll_init(&mut self) -> Result<Progress, BackendError> {
        self.progress()
    }

    fn start_group(&mut self, ops: &[P2p], after: u64, _round: u32) -> Result<(), GroupError> {
        self.ctx.bind_to_thread().map_err(driver_error("binding the device"))?;
        self.done = None;
        self.enqueued = false;
        if after != 0 {
            // SAFETY: `after` is a live event of this context (the caller
            // keeps it alive until the group call returns); the wait is
            // queued on our stream and CUDA keeps what it needs of it.
            unsafe { cudarc::driver::sys::cuStreamWaitEvent(self.stream.cu_stream(), after as cudarc::driver::sys::CUevent, 0) }
                .result()
                .map_err(driver_error("cuStreamWaitEvent before the group"))?;
        }
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        let comm = *self.comm;
        result::group_start().map_err(|e| nccl_error("ncclGroupStart", e.0, comm))?;
        let mut first_err = None;
        for op in ops {
            // SAFETY: the caller keeps the memory valid until the group is done.
            let r = unsafe {
                match *op {
                    P2p::Send { peer, addr, bytes } => {
                        result::send(addr as *const c_void, bytes as usize, sys::ncclDataType_t::ncclUint8, peer as c_int, comm, stream)
                    }
                    P2p::Recv { peer, addr, bytes } => {
                        result::recv(addr as *mut c_void, bytes as usize, sys::ncclDataType_t::ncclUint8, peer as c_int, comm, stream)
                    }
                }
            };
            if let Err(e) = r {
                first_err.get_or_insert(nccl_error(format!("{op:?}"), e.0, comm));
            }
        }
        // Always close the group, even after a failed call.
        let end = result::group_end();
        if let Some(e) = first_err {
            return Err(e.into());
        }
        match end {
            Ok(result::NcclStatus::InProgress) => Ok(()),
            Ok(_) => {
                self.done = Some(self.stream.record_event(None).map_err(driver_error("recording the group's event"))?);
                self.enqueued = true;
                Ok(())
            }
            Err(e) => Err(group_error(e.0, nccl_error("ncclGroupEnd", e.0, comm))),
        }
    }

    fn poll_group(&mut self) -> Result<Progress, GroupError> {
        // Enqueueing: the communicator reports in-progress until the calls
        // are on the stream; then wait for the stream's work.
        if !self.enqueued {
            if self.group_progress()? == Progress::Pending {
                return Ok(Progress::Pending);
            }
            self.done = Some(self.stream.record_event(None).map_err(driver_error("recording the group's event"))?);
            self.enqueued = true;
        }
        self.group_progress()?;
        event_progress(self.done.as_ref(), "waiting for the group on the device").map_err(GroupError::from)
    }

    fn check(&mut self) -> Result<(), BackendError> {
        match self.async_state()? {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
            code => Err(BackendError::NcclAsync { code, detail: nccl_text(code, *self.comm) }),
        }
    }

    fn abort(&mut self) -> Result<Progress, BackendError> {
        let comm = std::mem::replace(&mut *self.comm, std::ptr::null_mut());
        if comm.is_null() {
            return Ok(Progress::Ready);
        }
        self.done = None;
        // SAFETY: a communicator we created and nobody uses any more; the
        // slot is cleared first, so it is never aborted twice.
        match unsafe { result::comm_abort(comm) } {
            // A non-blocking communicator tears down in NCCL's own thread,
            // which frees the communicator (never touch it again), and
            // ncclCommAbort may answer success or "in progress" while that
            // goes on: either way the teardown is over for our memory only
            // once the work NCCL queued on our stream has ended, which an
            // event recorded now tells. Success is never taken as done.
            Ok(_) => {
                self.ctx.bind_to_thread().map_err(driver_error("binding the device"))?;
                self.teardown = Some(self.stream.record_event(None).map_err(driver_error("after ncclCommAbort"))?);
                Ok(Progress::Pending)
            }
            Err(e) => Err(nccl_error("ncclCommAbort", e.0, std::ptr::null_mut())),
        }
    }

    fn poll_abort(&mut self) -> Result<Progress, BackendError> {
        Ok(event_progress(self.teardown.as_ref(), "waiting for the aborted communicator's work on the device")?)
    }
}

impl Drop for NcclBackend {
    fn drop(&mut self) {
        // Normally aborted already by the thread; this covers unwinding.
        let _ = self.abort();
    }
}

/// Creates the communicators of every rank this process hosts, all at
/// once: each `(ordinal, rank)` gets its thread and starts its
/// non-blocking creation before any is waited for (NCCL completes a
/// creation only once every rank joined), then all are waited for, each
/// against its own deadline. `config` gives nranks and the timeouts; its
/// rank is replaced by each member's.
pub fn create_comms(members: &[(usize, u32)], id: CommId, config: CommConfig) -> Vec<Result<CommHandle, CommError>> {
    // Every creation is started (collected) before the first is waited for.
    let started: Vec<Result<PendingComm, CommError>> = members
        .iter()
        .map(|&(ordinal, rank)| {
            let config = CommConfig { rank, ..config };
            CommHandle::start(config, &id.tag(), move || NcclBackend::create(ordinal, id, rank, config.nranks))
        })
        .collect();
    started.into_iter().map(|p| p.and_then(PendingComm::wait)).collect()
}

/// A device staging buffer that grows on demand.
struct DeviceStaging {
    buf: Option<CudaSlice<u8>>,
    len: usize,
    addr: u64,
}

impl DeviceStaging {
    fn ensure(&mut self, dev: &GpuDevice, len: usize, what: &str) -> Result<u64, GpuError> {
        if self.buf.is_none() || self.len < len {
            self.buf = None;
            let buf = dev.alloc(len, what)?;
            self.addr = dev.addr(&buf);
            self.buf = Some(buf);
            self.len = len;
        }
        Ok(self.addr)
    }

    /// Gives the buffer up without freeing it; returns its bytes.
    fn abandon(&mut self) -> u64 {
        let bytes = if self.buf.is_some() { self.len as u64 } else { 0 };
        std::mem::forget(self.buf.take());
        (self.len, self.addr) = (0, 0);
        bytes
    }
}

/// A rank's device memory as the communicator executor runs on it: its
/// buffers, send and receive staging on the device, pinned host staging
/// for pieces no kernel converts, and the event that orders a group after
/// the work queued before it.
pub(crate) struct DevicePlaneMemory<'a> {
    dev: &'a GpuDevice,
    memory: &'a mut DeviceMemory,
    addrs: Vec<u64>,
    host: [PinnedStaging; 2],
    send: DeviceStaging,
    recv: DeviceStaging,
    fence: Option<Arc<CudaEvent>>,
    /// An exported send-staging bucket (the IPC communicator's) used
    /// instead of `send`: base and bytes.
    bucket: Option<(u64, usize)>,
    /// Peers' allocations mapped for direct reads (the IPC fabric), and
    /// the regions of them mapped in this run (sides `move_piece` takes).
    peers: Option<&'a mut PeerMaps>,
    peer_regions: Vec<(u64, usize)>,
}

impl<'a> DevicePlaneMemory<'a> {
    /// `memory` (allocated on `dev`) for one run.
    pub(crate) fn new(dev: &'a GpuDevice, memory: &'a mut DeviceMemory) -> DevicePlaneMemory<'a> {
        let addrs = memory.device_addrs().to_vec();
        let staging = || DeviceStaging { buf: None, len: 0, addr: 0 };
        DevicePlaneMemory {
            dev,
            memory,
            addrs,
            host: [PinnedStaging::new(dev), PinnedStaging::new(dev)],
            send: staging(),
            recv: staging(),
            fence: None,
            bucket: None,
            peers: None,
            peer_regions: Vec::new(),
        }
    }

    /// This memory, reading peers on its device directly through `maps`
    /// (kept by the communicator end across runs).
    pub(crate) fn reading_peers(self, maps: &'a mut PeerMaps) -> DevicePlaneMemory<'a> {
        DevicePlaneMemory { peers: Some(maps), ..self }
    }

    /// `memory` for one run whose messages are packed into an exported
    /// bucket of `len` bytes at `base` (the IPC communicator's, whose peers
    /// read them there).
    ///
    /// # Safety
    /// `base..base + len` must be device memory of `dev`'s context that
    /// stays allocated while the value lives (the IPC communicator keeps
    /// its bucket until it is dropped, or for good after a failure).
    pub(crate) unsafe fn with_bucket(dev: &'a GpuDevice, memory: &'a mut DeviceMemory, base: u64, len: u64) -> DevicePlaneMemory<'a> {
        DevicePlaneMemory { bucket: Some((base, len as usize)), ..DevicePlaneMemory::new(dev, memory) }
    }

    /// Whether a side of `block` fits the region its address names: a
    /// buffer of the rank, its staging or its exported bucket.
    fn fits(&self, block: &Block, side: &Side) -> bool {
        let buffers = self.addrs.iter().copied().zip(self.memory.buffer_lens().iter().copied());
        let staging = [&self.send, &self.recv].into_iter().filter(|s| s.buf.is_some()).map(|s| (s.addr, s.len));
        let mut regions = buffers.chain(staging).chain(self.bucket).chain(self.peer_regions.iter().copied());
        regions.any(|(at, len)| at == side.0 && fits(block.extent(), len, side.1.base, &side.1.strides, side.2))
    }
}

impl PlaneMemory for DevicePlaneMemory<'_> {
    fn addrs(&self) -> &[u64] {
        &self.addrs
    }

    fn lens(&self) -> &[usize] {
        self.memory.buffer_lens()
    }

    fn dtypes(&self) -> &[DType] {
        self.memory.dtypes()
    }

    fn staging(&mut self, which: StagingSide, len: usize) -> Result<u64, PlaneError> {
        self.dev.bind()?;
        if let (StagingSide::Send, Some((base, cap))) = (which, self.bucket) {
            return match len <= cap {
                true => Ok(base),
                false => Err(PlaneError::BucketTooSmall { need: len, holds: cap }),
            };
        }
        let (s, what) = match which {
            StagingSide::Send => (&mut self.send, "send staging"),
            StagingSide::Recv => (&mut self.recv, "receive staging"),
        };
        Ok(s.ensure(self.dev, len, what)?)
    }

    fn move_piece(&mut self, block: &Block, from: Side, wire: DType, to: &[Side]) -> Result<(), PlaneError> {
        if let Some(side) = std::iter::once(&from).chain(to).find(|s| !self.fits(block, s)) {
            return Err(PlaneError::outside(block, side, "device buffers and staging"));
        }
        let dev = self.dev;
        let direct = from.2 == wire && to.iter().all(|t| t.2 == wire);
        let (kernels, missing) = match (!direct).then(|| dev.kernels()) {
            Some(Ok(k)) => (Some(k), None),
            Some(Err(e)) => (None, Some(e)),
            None => (None, None),
        };
        if direct || kernels.is_some() {
            // Sender packing (to = wire), receiver unpacking (from = wire)
            // and local copies (wire = to) change the dtype once: no scratch.
            if let Some(ops) = piece_ops(block.extent(), from, wire, to, dev.max_pitch(), None, SameType::Copies) {
                // SAFETY: every side lies in a live allocation of this rank
                // (checked above), which outlives the run; the stream
                // orders the work.
                unsafe { queue_ops(dev, kernels, &ops) }?;
                return Ok(());
            }
        }
        let step = Step {
            round: 0,
            block: *block,
            from: Place { rank: 0, span: from.1, dtype: from.2 },
            wire,
            to: to.iter().map(|t| Place { rank: 0, span: t.1, dtype: t.2 }).collect(),
            local: false,
        };
        let dsts: Vec<u64> = to.iter().map(|t| t.0).collect();
        let to_dtypes: Vec<DType> = to.iter().map(|t| t.2).collect();
        // A dtype pair no kernel converts goes through the host by design;
        // anything else here is a fallback.
        let (why, fallback) = match (missing, without_kernel(from.2, wire, &to_dtypes)) {
            (Some(e), _) => (format!("the cast kernels did not load: {e}"), true),
            (None, Some(no_kernel)) => (no_kernel, false),
            (None, None) => ("the copy kernels do not take this piece's strides".to_string(), true),
        };
        note(self.memory.owner(), "converted a piece", &why, fallback);
        convert_on_host(dev, &mut self.host, &step, from.0, &dsts)?;
        Ok(())
    }

    fn fence(&mut self) -> Result<Option<Fence>, PlaneError> {
        let ev = Arc::new(self.dev.fence()?);
        let raw = RawEvent(ev.cu_event() as u64);
        self.fence = Some(ev.clone());
        Ok(Some(Fence::new(raw, ev)))
    }

    fn abandon_staging(&mut self) -> u64 {
        let bytes = self.send.abandon() + self.recv.abandon();
        LEAKED_STAGING.fetch_add(bytes, Ordering::SeqCst);
        bytes
    }

    fn read_staging(&mut self, which: StagingSide, at: u64, out: &mut [u8]) -> Result<(), PlaneError> {
        let from = self.staging_base(which, at, out.len())?;
        let pinned = self.host[0].ensure(out.len())?;
        let op = linear(out.len() as u64, at, 0);
        // SAFETY: the device side lies in this rank's staging (checked by
        // `staging_base`), alive for the run; the host side is pinned
        // staging of at least `out.len()` bytes held by `self`. The stream
        // is waited for below; if that fails, the copy may still run, so
        // the pinned buffer is given up (never reused or freed).
        let queued = unsafe { issue(&op, Loc::Device(from), Loc::Host(pinned), self.dev.stream().cu_stream()) };
        if let Err(e) = self.dev.synchronize() {
            self.host[0].abandon();
            return Err(e.into());
        }
        queued.map_err(QueueError::Driver)?;
        // SAFETY: the copy into the pinned staging is complete (the stream
        // was waited for); `out` is the caller's and does not overlap it.
        unsafe { std::ptr::copy_nonoverlapping(pinned, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn write_staging(&mut self, which: StagingSide, at: u64, bytes: &[u8]) -> Result<(), PlaneError> {
        let to = self.staging_base(which, at, bytes.len())?;
        let pinned = self.host[1].ensure(bytes.len())?;
        // SAFETY: the pinned staging holds at least `bytes.len()` bytes and
        // no copy uses it now (each call waits for its copy, and one whose
        // wait failed gave its buffer up).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), pinned, bytes.len()) };
        let op = linear(bytes.len() as u64, 0, at);
        // SAFETY: as in `read_staging`, the other way.
        let queued = unsafe { issue(&op, Loc::Host(pinned), Loc::Device(to), self.dev.stream().cu_stream()) };
        if let Err(e) = self.dev.synchronize() {
            self.host[1].abandon();
            return Err(e.into());
        }
        Ok(queued.map_err(QueueError::Driver)?)
    }

    fn finish(&mut self) -> Result<(), PlaneError> {
        self.dev.synchronize()?;
        self.fence = None;
        if let Some(maps) = self.peers.as_deref_mut() {
            // Every copy from a peer's memory is done.
            maps.in_flight = false;
        }
        Ok(())
    }

    fn offer(&mut self, buffer: u32) -> Result<RegionOffer, PlaneError> {
        let i = buffer as usize;
        let (Some(&addr), Some(&len)) = (self.addrs.get(i), self.memory.buffer_lens().get(i)) else {
            return Err(PlaneError::NoBuffer { buffer, buffers: self.addrs.len() });
        };
        Ok(offer_region(self.dev, self.memory.owner(), addr, len)?)
    }

    fn map_offer(&mut self, peer: Endpoint, offer: &RegionOffer) -> Result<u64, PlaneError> {
        let maps = self.peers.as_deref_mut().ok_or(PlaneError::NotDirect)?;
        // SAFETY: the peer offered the region for this round and keeps it
        // alive and unwritten until this rank's done token, which is sent
        // only after `finish` waited for every copy from it.
        let addr = unsafe { maps.map(self.dev, peer, offer) }?;
        let len = usize::try_from(offer.len).map_err(|_| PlaneError::RegionTooLarge { len: offer.len })?;
        // Once per region: every piece's side is looked up among them.
        if !self.peer_regions.contains(&(addr, len)) {
            self.peer_regions.push((addr, len));
        }
        Ok(addr)
    }

    fn quantize(&mut self, program: &RankProgram) -> Result<(), PlaneError> {
        self.finish()?;
        // Block-scaled FP8 tensors: quantized from the boxes a source
        // holds or the whole blocks a destination received, on the device
        // where it can.
        match crate::cuda::device::quantize_rank_on(self.dev, self.memory, program)? {
            crate::cuda::device::Quantized::OnHost(why) => note(program.endpoint, "quantized its block-scaled tensors", &why, true),
            crate::cuda::device::Quantized::OnDevice | crate::cuda::device::Quantized::Nothing => {}
        }
        Ok(())
    }
}

impl DevicePlaneMemory<'_> {
    /// The base of staging `which` (the exported bucket, for sends, where
    /// there is one), if bytes `at..at + len` lie inside it.
    fn staging_base(&self, which: StagingSide, at: u64, len: usize) -> Result<u64, PlaneError> {
        let (base, held) = match (which, self.bucket) {
            (StagingSide::Send, Some(bucket)) => bucket,
            (StagingSide::Send, None) => (self.send.addr, self.send.len),
            (StagingSide::Recv, _) => (self.recv.addr, self.recv.len),
        };
        staging_span(which, held, at, len).map(|_| base)
    }
}

/// One contiguous copy of `bytes` from offset `src` to offset `dst`.
fn linear(bytes: u64, src: u64, dst: u64) -> CopyOp {
    CopyOp { src, dst, width: bytes, height: 1, depth: 1, src_pitch: bytes, src_height: 1, dst_pitch: bytes, dst_height: 1 }
}

static LEAKED_STAGING: AtomicU64 = AtomicU64::new(0);
/// Bytes of device staging this process left allocated on purpose, because
/// an NCCL group failed while it may still have been using them (they stay
/// until the process ends). Grows by each failed refit's staging: restart
/// the process when it matters.
pub fn leaked_staging_bytes() -> u64 {
    LEAKED_STAGING.load(Ordering::SeqCst)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn without_nccl_creation_fails_cleanly() {
        if crate::gpu_probe::cuda_available().is_ok() {
            return; // covered by scripts/gpu-check.sh on a GPU machine
        }
        assert!(CommId::generate().is_err());
        let id = CommId::from_bytes(&[7u8; 128]).unwrap();
        let config = CommConfig { init_timeout: Duration::from_secs(5), ..CommConfig::new(0, 1) };
        let start = Instant::now();
        let err = create_comms(&[(0, 0)], id, config).pop().unwrap().unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(matches!(&err, CommError::InitFailed { rank: 0, nranks: 1, abandoned: false, .. }), "{err}");
    }

    #[test]
    fn ids_convert_byte_for_byte() {
        let id = CommId::from_bytes(&[1u8; 128]).unwrap().to_nccl();
        assert!(id.internal.iter().all(|&c| c == 1));
    }
}
