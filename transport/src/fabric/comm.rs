//! The communicator fabrics (NCCL, IPC, and their simulated planes): a
//! member's rank of one communicator over every member of a refit, and
//! how a run reaches the rank's memory on it (host buffers uploaded to
//! the device, registered memory in place, a registered destination's
//! staging).

use super::endpoint::EndpointState;
use super::error::FabricError;
#[cfg(feature = "cuda")]
use super::registered::StagingMemory;
use super::registered::{current_regions, RegisteredMemory, RegisteredStaging, Residence};
use super::spec::{CommPlane, DataAddr, IpcFabric, NcclFabric, PeerAddr};
use super::{drop_scratch, program_peers, with_scratch, RankRunError, RunFailure, RunMemory, RunOptions, MIN_FRAME_LIMIT};
use crate::cuda::comm::BackendError;
use crate::cuda::{
    comm_rank, run_rank_comm, send_staging_bytes, sim_comm, sim_comm_id, CommConfig, CommHandle, CommId, CommPeers, IpcComm, IpcHandle,
    SimBucket, SimIpc, SimMemory,
};
use crate::Bypass;
use crate::{DeltaRun, HelloKey, NodeTransport, NodeTransportConfig, RankMemory, RankStats, TcpConfig};
use reshard::{Endpoint, Group, RankProgram};
use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An IPC-fabric endpoint between `Prepare` and `Connect`.
pub(super) struct IpcPending {
    /// The listener the peers' doorbells connect to.
    listener: TcpListener,
    /// Settings.
    settings: IpcFabric,
    /// The member's GPU.
    gpu: Option<usize>,
    /// The exported send bucket.
    bucket: Bucket,
    /// The refit's session id.
    session: String,
}

/// A member's exported send bucket on the IPC fabric (it moves to the
/// communicator's thread once connected).
pub(super) enum Bucket {
    /// Host memory of this process.
    Sim(SimIpc),
    /// Device memory, exported through CUDA IPC.
    #[cfg(feature = "cuda")]
    Gpu(Box<crate::cuda::GpuIpc>),
}

impl Bucket {
    fn map_peer(&mut self, peer: u32, owner: Endpoint, handle: &IpcHandle, bytes: u64) -> Result<(), FabricError> {
        match self {
            Bucket::Sim(b) => b.map_peer(peer, handle, bytes).map_err(BackendError::from),
            #[cfg(feature = "cuda")]
            Bucket::Gpu(b) => b.map_peer(peer, owner, handle, bytes).map_err(BackendError::from),
        }
        .map_err(|source| FabricError::MapBucket { owner, source })
    }

    /// What a run packs into.
    fn packs_into(&self) -> PackInto {
        match self {
            Bucket::Sim(b) => PackInto::Sim(b.bucket()),
            #[cfg(feature = "cuda")]
            Bucket::Gpu(b) => {
                use crate::cuda::IpcMemory as _;
                let (base, len) = b.staging();
                PackInto::Gpu { base, len }
            }
        }
    }
}

/// Where an IPC rank's runs pack their messages: its exported bucket.
enum PackInto {
    Sim(Arc<SimBucket>),
    #[cfg(feature = "cuda")]
    Gpu {
        base: u64,
        len: u64,
    },
}

/// A member's rank of a communicator, and what its runs keep.
pub(super) struct CommEnd {
    /// `None` once aborted.
    pub(super) handle: Option<CommHandle>,
    src_ranks: u32,
    nranks: u32,
    plane: CommPlane,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    gpu: Option<usize>,
    /// The IPC fabric's exported bucket (held by the communicator's
    /// thread, which outlives every run).
    packs_into: Option<PackInto>,
    /// The rank's device buffers (NCCL), kept between the runs of this
    /// communicator.
    #[cfg(feature = "cuda")]
    device: Option<(crate::cuda::GpuDevice, crate::cuda::DeviceMemory)>,
    /// Scratch buffers of a program run on registered memory, kept between
    /// the runs of this communicator (every run writes scratch before it
    /// reads it).
    scratch: CommScratch,
    /// The peers on this member's device that read what it offers and
    /// offer what it reads (the IPC fabric; none on NCCL).
    same_device: BTreeSet<Endpoint>,
    /// Their allocations this member mapped, kept between runs.
    #[cfg(feature = "cuda")]
    peer_maps: crate::cuda::device::PeerMaps,
}

/// Scratch buffers beside registered memory.
#[derive(Default)]
struct CommScratch {
    /// Host (simulated plane).
    host: Vec<Vec<u8>>,
    /// On the device, with it.
    #[cfg(feature = "cuda")]
    device: Option<(crate::cuda::GpuDevice, crate::cuda::DeviceMemory)>,
}

impl Drop for CommEnd {
    fn drop(&mut self) {
        if let Some(mut handle) = self.handle.take() {
            // Never block the member on a teardown: abort on a thread of
            // its own (bounded by the abort timeout; a hang is counted by
            // `abandoned_comm_threads`).
            let spawned = std::thread::Builder::new().name("comm-abort".into()).spawn(move || {
                let outcome = handle.abort();
                if outcome.needs_restart() {
                    tracing::warn!(?outcome, "a communicator abort hangs: restart this process before it runs out of GPUs");
                }
            });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot start a thread to abort a communicator; it is left to its own thread");
            }
        }
    }
}

impl CommEnd {
    /// The endpoint of a communicator just made: `ranks` is (source ranks,
    /// all ranks).
    fn connected(
        handle: CommHandle,
        ranks: (u32, u32),
        plane: CommPlane,
        gpu: Option<usize>,
        ipc: Option<(PackInto, BTreeSet<Endpoint>)>,
    ) -> EndpointState {
        let (packs_into, same_device) = ipc.map_or((None, BTreeSet::new()), |(p, s)| (Some(p), s));
        let (src_ranks, nranks) = ranks;
        EndpointState::Comm(Box::new(CommEnd {
            handle: Some(handle),
            src_ranks,
            nranks,
            plane,
            gpu,
            packs_into,
            #[cfg(feature = "cuda")]
            device: None,
            scratch: CommScratch::default(),
            same_device,
            #[cfg(feature = "cuda")]
            peer_maps: Default::default(),
        }))
    }

    /// Runs `program` on `memory` over the communicator by
    /// `options.deadline`: registered memory where it is (this end keeps
    /// the scratch), a registered destination's staging, or the rank's own
    /// host buffers with every scratch buffer allocated (the communicator
    /// executor makes no copies on receipt). A failed run has aborted the
    /// communicator.
    pub(super) fn run_on(
        &mut self,
        program: &RankProgram,
        memory: RunMemory<'_>,
        options: RunOptions<'_>,
    ) -> Result<RankStats, RankRunError> {
        let RunOptions { deadline, delta, scratch } = options;
        let until = Instant::now() + deadline;
        // Taken: a run that fails leaves none.
        let (reuse, pool) = (std::mem::take(&mut scratch.buffers), std::mem::take(&mut scratch.staging));
        let r = match memory {
            RunMemory::Registered(registered) => self.run_registered(program, registered, until, delta),
            RunMemory::Staged { registered, staging } => self.run_staged(program, registered, staging, until, delta),
            RunMemory::Host(memory) => {
                let base = match with_scratch(memory, program, &Bypass::default(), reuse) {
                    Ok(base) => base,
                    Err(e) => {
                        self.abort();
                        return Err(RankRunError::ProgramMismatch(e));
                    }
                };
                let r = self.run(program, memory, until, delta);
                let left = drop_scratch(memory, base);
                if r.is_ok() {
                    scratch.buffers = left;
                }
                r
            }
        };
        if r.is_ok() {
            scratch.staging = pool;
        }
        r.map_err(|failed: CommFailed| {
            let after_peer = failed.after_peer();
            let cause = match failed {
                CommFailed::Run(e) => RunFailure::Comm(e),
                CommFailed::Own(e) => RunFailure::Fabric(e),
            };
            RankRunError::Exec { cause: Box::new(cause), after_peer, hang: self.abort() }
        })
    }

    /// Runs `program` on `memory` over the communicator by `deadline`
    /// (with `delta`, as a delta refit).
    pub(super) fn run(
        &mut self,
        program: &RankProgram,
        memory: &mut RankMemory,
        deadline: Instant,
        delta: Option<&mut DeltaRun>,
    ) -> Result<RankStats, CommFailed> {
        let (rank_of, same) = (self.rank_of(), self.same_device.clone());
        let same_device = |e: Endpoint| same.contains(&e);
        let peers = CommPeers { rank_of: &rank_of, same_device: &same_device };
        let handle = self.handle.as_mut().ok_or(FabricError::Aborted)?;
        match &self.plane {
            CommPlane::Simulated { .. } => {
                let mut sim = match &self.packs_into {
                    Some(PackInto::Sim(b)) => SimMemory::with_bucket(memory, b.clone()),
                    _ => SimMemory::new(memory),
                };
                run_rank_comm(&mut sim, program, handle, &peers, deadline, delta).map_err(CommFailed::Run)
            }
            #[cfg(feature = "cuda")]
            CommPlane::Cuda => {
                use crate::cuda::{DeviceMemory, GpuDevice};
                let want: Vec<usize> = memory.buffers.iter().map(Vec::len).collect();
                if !matches!(&self.device, Some((_, m)) if m.buffer_lens() == want.as_slice()) {
                    self.device = None;
                    let ordinal = self.gpu.ok_or(FabricError::NoGpu { me: program.endpoint, fabric: None })?;
                    let dev = GpuDevice::open(ordinal).map_err(FabricError::from)?;
                    let mem = DeviceMemory::for_buffers(&dev, program.endpoint, &program.buffers).map_err(FabricError::from)?;
                    self.device = Some((dev, mem));
                }
                let (dev, mem) = self.device.as_mut().ok_or(FabricError::Missing("no device memory"))?;
                // The store's bytes go to the device and a destination's
                // come back: stores live in host memory.
                mem.upload(dev, memory).map_err(FabricError::from)?;
                let mut plane = gpu_plane(self.packs_into.as_ref(), dev, mem, program.endpoint)?.reading_peers(&mut self.peer_maps);
                let stats = run_rank_comm(&mut plane, program, handle, &peers, deadline, delta).map_err(CommFailed::Run)?;
                drop(plane);
                if program.endpoint.group == Group::Dst {
                    mem.download_into(dev, memory).map_err(FabricError::from)?;
                }
                Ok(stats)
            }
            #[cfg(not(feature = "cuda"))]
            CommPlane::Cuda => Err(unavailable_nccl().into()),
        }
    }

    /// Runs `program` straight on the user's registered memory (a source
    /// whose weights live in its framework's buffers), by `deadline`;
    /// scratch buffers the program needs beyond the rank's are this end's.
    pub(super) fn run_registered(
        &mut self,
        program: &RankProgram,
        registered: &dyn RegisteredMemory,
        deadline: Instant,
        delta: Option<&mut DeltaRun>,
    ) -> Result<RankStats, CommFailed> {
        let me = program.endpoint;
        let (rank_of, same) = (self.rank_of(), self.same_device.clone());
        let same_device = |e: Endpoint| same.contains(&e);
        let peers = CommPeers { rank_of: &rank_of, same_device: &same_device };
        // The regions as their owner holds them now (memory it moved or
        // freed since is never read).
        let mut regions = current_regions(program, registered).map_err(FabricError::from)?;
        // (`current_regions` checked the program has these buffers.)
        let base = regions.len();
        let bytes = |b: &reshard::BufferSpec| (b.elems * b.dtype.size()) as usize;
        let scratch_specs = &program.buffers[base..];
        let handle = self.handle.as_mut().ok_or(FabricError::Aborted)?;
        match (&self.plane, registered.residence()) {
            (CommPlane::Simulated { .. }, Residence::Host) => {
                let host = &mut self.scratch.host;
                if host.len() != scratch_specs.len() || host.iter().zip(scratch_specs).any(|(b, s)| b.len() != bytes(s)) {
                    *host = scratch_specs.iter().map(|s| vec![0; bytes(s)]).collect();
                }
                regions.extend(host.iter_mut().map(|b| (b.as_mut_ptr() as u64, b.len())));
                let dtypes = program.buffers.iter().map(|b| b.dtype).collect();
                // SAFETY: the registered regions are host memory (the
                // residence matched above) as their owner holds them now,
                // valid and written by nothing else until this run ends
                // (`RegisteredMemory`'s contract for current regions), each
                // cut to its buffer's bytes (`current_regions`); the
                // scratch is this end's, alive past the run. On error the
                // run returns before the regions are dropped.
                let mut sim = unsafe { SimMemory::from_regions(&regions, dtypes) };
                if let Some(PackInto::Sim(b)) = &self.packs_into {
                    sim = sim.packing_into(b.clone());
                }
                run_rank_comm(&mut sim, program, handle, &peers, deadline, delta).map_err(CommFailed::Run)
            }
            #[cfg(feature = "cuda")]
            (CommPlane::Cuda, Residence::Device { ordinal }) if Some(ordinal) == self.gpu => {
                use crate::cuda::{DeviceMemory, GpuDevice};
                let want: Vec<usize> = scratch_specs.iter().map(bytes).collect();
                if self.scratch.device.as_ref().is_none_or(|(_, m)| m.buffer_lens() != want.as_slice()) {
                    self.scratch.device = None;
                    let dev = GpuDevice::open(ordinal).map_err(FabricError::from)?;
                    let mem = DeviceMemory::for_buffers(&dev, me, scratch_specs).map_err(FabricError::from)?;
                    self.scratch.device = Some((dev, mem));
                }
                let (dev, scratch) = self.scratch.device.as_ref().ok_or(FabricError::Missing("no device scratch"))?;
                regions.extend(scratch.device_addrs().iter().copied().zip(want));
                // SAFETY: the registered regions are device memory of this
                // GPU (the residence matched above) as their owner holds
                // them now, valid until this run ends (`RegisteredMemory`'s
                // contract for current regions), each cut to its buffer's
                // bytes; the scratch is this end's allocations, alive past
                // the run.
                let mut mem = unsafe { DeviceMemory::register(dev, me, &program.buffers, &regions) }.map_err(FabricError::from)?;
                let mut plane = gpu_plane(self.packs_into.as_ref(), dev, &mut mem, me)?.reading_peers(&mut self.peer_maps);
                run_rank_comm(&mut plane, program, handle, &peers, deadline, delta).map_err(CommFailed::Run)
            }
            (plane, residence) => Err(out_of_reach(me, plane, residence).into()),
        }
    }

    /// Runs a registered destination's `program` into `staging` (made, or
    /// remade for another plan, on this end's plane; first synced with the
    /// registered memory if a run since the last commit may have written
    /// it), by `deadline`. The registered memory itself is only read here;
    /// the commit copies the staging in ([`RegisteredStaging::commit`]).
    pub(super) fn run_staged(
        &mut self,
        program: &RankProgram,
        registered: &dyn RegisteredMemory,
        staging: &mut Option<RegisteredStaging>,
        deadline: Instant,
        delta: Option<&mut DeltaRun>,
    ) -> Result<RankStats, CommFailed> {
        let me = program.endpoint;
        match (&self.plane, registered.residence()) {
            (CommPlane::Simulated { .. }, Residence::Host) => {
                // Staging is a rank's own host memory: the ordinary run.
                let memory = RegisteredStaging::host(staging, program, registered, program.buffers.len()).map_err(FabricError::from)?;
                self.run(program, memory, deadline, delta)
            }
            #[cfg(feature = "cuda")]
            (CommPlane::Cuda, Residence::Device { ordinal }) if Some(ordinal) == self.gpu => {
                use crate::cuda::{DeviceMemory, GpuDevice};
                let regions = current_regions(program, registered).map_err(FabricError::from)?;
                let lens: Vec<usize> = program.buffers.iter().map(|b| (b.elems * b.dtype.size()) as usize).collect();
                let fits = matches!(staging, Some(RegisteredStaging { memory: StagingMemory::Device(_, m), .. })
                    if m.buffer_lens() == lens.as_slice());
                if !fits {
                    *staging = None;
                    let dev = GpuDevice::open(ordinal).map_err(FabricError::from)?;
                    let mem = DeviceMemory::for_buffers(&dev, me, &program.buffers).map_err(FabricError::from)?;
                    *staging = Some(RegisteredStaging { memory: StagingMemory::Device(dev, mem), synced: false });
                }
                let st = staging.as_mut().ok_or(FabricError::Registered(super::error::RegisteredError::NoStaging))?;
                let StagingMemory::Device(dev, mem) = &mut st.memory else { return Err(FabricError::Missing("no device staging").into()) };
                if !st.synced {
                    // SAFETY: the regions are device memory of this GPU (the
                    // residence checked above) as their owner holds them
                    // now, valid during this copy and written only by this
                    // member's commits (`RegisteredMemory`'s contract).
                    unsafe { mem.copy_from_regions(dev, &regions) }.map_err(FabricError::from)?;
                }
                st.synced = false;
                let (rank_of, same) = (self.rank_of(), self.same_device.clone());
                let same_device = |e: Endpoint| same.contains(&e);
                let peers = CommPeers { rank_of: &rank_of, same_device: &same_device };
                let handle = self.handle.as_mut().ok_or(FabricError::Aborted)?;
                let mut plane = gpu_plane(self.packs_into.as_ref(), dev, mem, me)?.reading_peers(&mut self.peer_maps);
                run_rank_comm(&mut plane, program, handle, &peers, deadline, delta).map_err(CommFailed::Run)
            }
            (plane, residence) => Err(out_of_reach(me, plane, residence).into()),
        }
    }

    /// The communicator rank of each endpoint (sources first).
    fn rank_of(&self) -> impl Fn(Endpoint) -> Option<u32> + Copy {
        let (src_ranks, nranks) = (self.src_ranks, self.nranks);
        move |e: Endpoint| Some(comm_rank(e, src_ranks)).filter(|&r| r < nranks)
    }

    /// Aborts the communicator now (peers waiting on this rank then fail),
    /// waiting at most the abort timeout; says so if its thread hangs.
    pub(super) fn abort(&mut self) -> Option<String> {
        let outcome = self.handle.take()?.abort();
        outcome.needs_restart().then(|| format!("its communicator's abort hangs ({outcome:?}): restart this process"))
    }
}

/// Why a communicator end's run failed.
#[derive(Debug, thiserror::Error)]
pub(super) enum CommFailed {
    /// The communicator executor failed (naming the rank, and the peer
    /// where one failed).
    #[error(transparent)]
    Run(crate::cuda::CommExecError),
    /// This end could not run (its memory, its plane).
    #[error(transparent)]
    Own(#[from] FabricError),
}

impl CommFailed {
    /// Whether a peer failed first (its abort or departure broke a group).
    pub(super) fn after_peer(&self) -> bool {
        matches!(self, CommFailed::Run(e) if e.after_peer())
    }
}

/// Device memory `mem` of `dev` as the communicator executor's plane
/// (bound to this thread), packing into the exported IPC bucket where
/// there is one.
#[cfg(feature = "cuda")]
fn gpu_plane<'a>(
    packs_into: Option<&PackInto>,
    dev: &'a crate::cuda::GpuDevice,
    mem: &'a mut crate::cuda::DeviceMemory,
    me: Endpoint,
) -> Result<crate::cuda::DevicePlaneMemory<'a>, FabricError> {
    dev.bind().map_err(|source| FabricError::Bind { me, source })?;
    Ok(match packs_into {
        // SAFETY: the bucket is device memory of this GPU, held by the
        // communicator's thread until it is dropped (or for good after a
        // failure), past this run.
        Some(PackInto::Gpu { base, len }) => unsafe { crate::cuda::DevicePlaneMemory::with_bucket(dev, mem, *base, *len) },
        _ => crate::cuda::DevicePlaneMemory::new(dev, mem),
    })
}

/// Why a communicator's plane cannot reach a rank's registered memory.
pub(super) fn out_of_reach(me: Endpoint, plane: &CommPlane, residence: Residence) -> FabricError {
    let (plane, cuda) = match plane {
        CommPlane::Cuda => ("CUDA", true),
        CommPlane::Simulated { .. } => ("simulated", false),
    };
    FabricError::OutOfReach { me, plane, cuda, residence }
}

#[cfg(not(feature = "cuda"))]
fn unavailable_nccl() -> FabricError {
    FabricError::Unavailable { fabric: "NCCL", source: Box::new(FabricError::NoCudaFeature) }
}

/// The device a member names in its communicator-fabric address: its GPU's
/// UUID (on the simulated plane `sim-gpu<n>`, or the endpoint where no GPU
/// is configured, which no other member shares).
fn comm_device(me: Endpoint, plane: &CommPlane, gpu: Option<usize>) -> Result<String, FabricError> {
    match plane {
        CommPlane::Simulated { .. } => Ok(gpu.map_or_else(|| format!("sim-{me}"), |g| format!("sim-gpu{g}"))),
        #[cfg(feature = "cuda")]
        CommPlane::Cuda => {
            let ordinal = gpu.ok_or(FabricError::NoGpu { me, fabric: None })?;
            crate::cuda::device_uuid(ordinal).map_err(|source| FabricError::GpuUuid { me, ordinal, source })
        }
        #[cfg(not(feature = "cuda"))]
        CommPlane::Cuda => Err(FabricError::NoCudaFeature),
    }
}

/// A communicator-fabric address as (id, device).
fn comm_addr(p: &PeerAddr) -> Result<(Option<CommId>, &str), FabricError> {
    match &p.addr {
        DataAddr::Comm { id, device } if !device.is_empty() => Ok((*id, device)),
        other => Err(FabricError::WrongAddr { peer: p.endpoint, addr: Box::new(other.clone()), fabric: "communicator" }),
    }
}

/// Refuses a peer table that puts two ranks of the communicator on one
/// GPU (colocated training and inference members): NCCL does not support
/// it (creation fails or hangs). Such members take the IPC fabric.
fn one_rank_per_device(table: &[PeerAddr]) -> Result<(), FabricError> {
    let mut seen: HashMap<&str, Endpoint> = HashMap::new();
    for p in table {
        let (_, device) = comm_addr(p)?;
        if let Some(first) = seen.insert(device, p.endpoint) {
            return Err(FabricError::SharedGpu { first, second: p.endpoint, device: device.to_string() });
        }
    }
    Ok(())
}

impl EndpointState {
    /// Prepares this member's rank of a communicator. Its address
    /// ([`DataAddr::Comm`]): source rank 0 makes the communicator's id
    /// (the others have none), and every member names the GPU it would put
    /// its rank on, so that two ranks on one device are refused before any
    /// communicator is made.
    pub(super) fn prepare_comm(me: Endpoint, settings: NcclFabric, gpu: Option<usize>) -> Result<(EndpointState, DataAddr), FabricError> {
        let unavailable = |e: FabricError| FabricError::Unavailable { fabric: "NCCL", source: Box::new(e) };
        #[cfg(feature = "cuda")]
        if let CommPlane::Cuda = &settings.plane {
            crate::gpu_plane_available(crate::GpuPlane::Nccl, 1).map_err(|e| unavailable(e.into()))?;
        }
        let device = comm_device(me, &settings.plane, gpu).map_err(unavailable)?;
        let id = if me == Endpoint::src(0) {
            let id = match &settings.plane {
                CommPlane::Simulated { .. } => sim_comm_id(),
                #[cfg(feature = "cuda")]
                CommPlane::Cuda => CommId::generate().map_err(|e| unavailable(FabricError::CommId(e)))?,
                #[cfg(not(feature = "cuda"))]
                CommPlane::Cuda => return Err(unavailable_nccl()),
            };
            Some(id)
        } else {
            None
        };
        Ok((EndpointState::CommPrepared { settings, gpu }, DataAddr::Comm { id, device }))
    }

    /// Creates this member's rank of the communicator whose id source rank
    /// 0 reported, and waits for it (blocking: run off the reactor; the
    /// members of a process all wait at once).
    pub(super) fn connect_comm(
        me: Endpoint,
        settings: NcclFabric,
        gpu: Option<usize>,
        table: &[PeerAddr],
    ) -> Result<EndpointState, FabricError> {
        let root = table.iter().find(|p| p.endpoint == Endpoint::src(0)).ok_or(FabricError::NoRoot)?;
        let (id, _) = comm_addr(root)?;
        let id = id.ok_or(FabricError::NoCommId)?;
        one_rank_per_device(table)?;
        let nranks = table.len() as u32;
        let src_ranks = table.iter().filter(|p| p.endpoint.group == Group::Src).count() as u32;
        if let Some(p) = table.iter().find(|p| comm_rank(p.endpoint, src_ranks) >= nranks) {
            return Err(FabricError::NoRank { peer: p.endpoint, nranks });
        }
        let rank = comm_rank(me, src_ranks);
        let config =
            CommConfig { init_timeout: settings.init_timeout, abort_timeout: settings.abort_timeout, ..CommConfig::new(rank, nranks) };
        let started = match &settings.plane {
            CommPlane::Simulated { world } => {
                let world = world.clone();
                CommHandle::start(config, &id.tag(), move || Ok(sim_comm(&world, id, rank, nranks)?))
            }
            #[cfg(feature = "cuda")]
            CommPlane::Cuda => {
                let ordinal = gpu.ok_or(FabricError::NoGpu { me, fabric: Some("NCCL") })?;
                CommHandle::start(config, &id.tag(), move || crate::cuda::NcclBackend::create(ordinal, id, rank, nranks))
            }
            #[cfg(not(feature = "cuda"))]
            CommPlane::Cuda => return Err(unavailable_nccl()),
        };
        let handle = started.and_then(|p| p.wait()).map_err(|e| FabricError::Comm { me, source: Box::new(e) })?;
        Ok(CommEnd::connected(handle, (src_ranks, nranks), settings.plane, gpu, None))
    }

    /// Prepares this member's end of the IPC fabric: exports its send
    /// bucket (sized for its largest round) and listens for its peers'
    /// doorbells; its address is `ip:port/<handle hex>/<bytes>/<device>`
    /// (the device as on the NCCL fabric: peers on the same one read each
    /// other's memory directly).
    pub(super) fn prepare_ipc(
        ip: IpAddr,
        program: &RankProgram,
        settings: IpcFabric,
        gpu: Option<usize>,
        session: String,
    ) -> Result<(EndpointState, DataAddr), FabricError> {
        let bytes = send_staging_bytes(program);
        let (bucket, handle) = match &settings.plane {
            CommPlane::Simulated { .. } => {
                let (b, h) = SimIpc::export(bytes);
                (Bucket::Sim(b), h)
            }
            #[cfg(feature = "cuda")]
            CommPlane::Cuda => {
                let me = program.endpoint;
                let unavailable = |e: FabricError| FabricError::Unavailable { fabric: "IPC", source: Box::new(e) };
                crate::gpu_plane_available(crate::GpuPlane::Device, 1).map_err(|e| unavailable(e.into()))?;
                let ordinal = gpu.ok_or(FabricError::NoGpu { me, fabric: Some("IPC") })?;
                let (b, h) = crate::cuda::GpuIpc::export(ordinal, me, bytes)
                    .map_err(|source| unavailable(FabricError::ExportBucket { me, source }))?;
                (Bucket::Gpu(Box::new(b)), h)
            }
            #[cfg(not(feature = "cuda"))]
            CommPlane::Cuda => return Err(FabricError::Unavailable { fabric: "IPC", source: Box::new(FabricError::NoCudaFeature) }),
        };
        let device = comm_device(program.endpoint, &settings.plane, gpu)?;
        let listener = TcpListener::bind((ip, 0)).map_err(|e| FabricError::Listen { ip, source: e.into() })?;
        let doorbells = listener.local_addr().map_err(|e| FabricError::ListenerAddr { ip, source: e.into() })?;
        let addr = DataAddr::Ipc { doorbells, bucket: handle, bytes, device };
        Ok((EndpointState::IpcPrepared(IpcPending { listener, settings, gpu, bucket, session }), addr))
    }

    /// Connects this member's doorbells to the peers of its program, maps
    /// the buckets of the peers it receives from, and makes its rank of the
    /// IPC communicator (blocking: run off the reactor).
    pub(super) fn connect_ipc(
        program: &RankProgram,
        pending: IpcPending,
        table: &[PeerAddr],
        key: HelloKey,
    ) -> Result<EndpointState, FabricError> {
        let IpcPending { listener, settings, gpu, mut bucket, session } = pending;
        let me = program.endpoint;
        let nranks = table.len() as u32;
        let src_ranks = table.iter().filter(|p| p.endpoint.group == Group::Src).count() as u32;
        let mut endpoints = vec![None; nranks as usize];
        let mut addrs: HashMap<Endpoint, (SocketAddr, IpcHandle, u64)> = HashMap::new();
        let mut devices: HashMap<Endpoint, &str> = HashMap::new();
        for p in table {
            let DataAddr::Ipc { doorbells, bucket, bytes, device } = &p.addr else {
                return Err(FabricError::WrongAddr { peer: p.endpoint, addr: Box::new(p.addr.clone()), fabric: "IPC" });
            };
            devices.insert(p.endpoint, device.as_str());
            let slot = endpoints.get_mut(comm_rank(p.endpoint, src_ranks) as usize);
            *slot.ok_or(FabricError::NoRank { peer: p.endpoint, nranks })? = Some(p.endpoint);
            addrs.insert(p.endpoint, (*doorbells, *bucket, *bytes));
        }
        let endpoints: Vec<Endpoint> = endpoints.into_iter().collect::<Option<_>>().ok_or(FabricError::MissingRank)?;
        let wanted = program_peers(program);
        let mut peers = Vec::with_capacity(wanted.len());
        for &e in &wanted {
            let (at, ..) = addrs.get(&e).ok_or(FabricError::NoPeerAddr { me, peer: e, fabric: "IPC" })?;
            peers.push((e, *at));
        }
        // Peers on this device read what this member offers, or offer what
        // it reads; the rest exchange through buckets.
        let mine = devices.get(&me).copied().ok_or(FabricError::NoOwnAddr)?;
        let same_device: BTreeSet<Endpoint> = wanted.iter().copied().filter(|e| devices.get(e) == Some(&mine)).collect();
        // Buckets mapped: those of the peers this member receives from, and
        // of those on its device it sends to (their done tokens).
        let senders = program.rounds.iter().flat_map(|r| r.recvs.iter()).map(|m| m.peer);
        for e in senders.chain(same_device.iter().copied()).collect::<BTreeSet<_>>() {
            let (_, handle, bytes) = addrs.get(&e).ok_or(FabricError::NoPeerAddr { me, peer: e, fabric: "IPC" })?;
            bucket.map_peer(comm_rank(e, src_ranks), e, handle, *bytes)?;
        }
        // Doorbells: a few bytes each, over TCP only (every peer its own
        // "node", so no shared-memory regions are set up).
        let config = NodeTransportConfig {
            session,
            tcp: TcpConfig {
                connect_timeout: if settings.connect_timeout.is_zero() { Duration::from_secs(30) } else { settings.connect_timeout },
                peers_listening: true,
                max_frame_bytes: MIN_FRAME_LIMIT,
                hello_key: Some(key),
                ..TcpConfig::default()
            },
            ..NodeTransportConfig::default()
        };
        let doorbells =
            NodeTransport::connect(me, listener, &peers, |e| e, &config).map_err(|e| FabricError::Doorbells { me, source: e.into() })?;
        let packs_into = bucket.packs_into();
        let rank = comm_rank(me, src_ranks);
        let config =
            CommConfig { init_timeout: settings.connect_timeout, abort_timeout: settings.abort_timeout, ..CommConfig::new(rank, nranks) };
        let tag = format!("ipc-{me}");
        let started = match bucket {
            Bucket::Sim(b) => CommHandle::start(config, &tag, move || Ok(IpcComm::new(endpoints, doorbells, b))),
            #[cfg(feature = "cuda")]
            Bucket::Gpu(b) => CommHandle::start(config, &tag, move || Ok(IpcComm::new(endpoints, doorbells, *b))),
        };
        let handle = started.and_then(|p| p.wait()).map_err(|e| FabricError::Comm { me, source: Box::new(e) })?;
        Ok(CommEnd::connected(handle, (src_ranks, nranks), settings.plane, gpu, Some((packs_into, same_device))))
    }
}
