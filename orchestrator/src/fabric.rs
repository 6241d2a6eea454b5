//! A member's end of a refit's data plane: opened on `Prepare`, connected
//! on `Connect`, run by `Run`; a node-fabric endpoint that a run left clean
//! may be kept for the next refit of the same plan (`Resume`).
//!
//! Two fabrics, one interface ([`transport::Transport`]):
//! - **in process**: the orchestrator makes the channels of a refit
//!   ([`transport::local_fabric`]) and leaves them in this process's
//!   [`hub`] under the refit's session id; each member takes its own end.
//!   A member in another process finds nothing there and refuses.
//! - **node**: the member listens on its data address; on `Connect` it
//!   connects to the peers its program exchanges with, through shared memory
//!   when the peer is on its node and TCP otherwise
//!   ([`transport::NodeTransport`]).
//! - **communicator** (NCCL, or simulated): on `Prepare` source rank 0
//!   makes the communicator's id and reports it as its address; on
//!   `Connect` every member starts creating its rank of one communicator
//!   over both groups from that id (non-blocking: the members of a
//!   process create theirs at the same time, each on its own thread) and
//!   waits for it; `Run` is the communicator executor
//!   ([`transport::cuda::run_rank_comm`]). A run that fails aborts
//!   the communicator at once (peers then fail instead of waiting), within
//!   the abort timeout; the next refit creates a new one with a new id.
//!   A communicator end dropped unused is aborted on a thread of its own.

use crate::protocol::{CommPlane, IpcFabric, NcclFabric, NodeFabric, PeerAddr};
use crate::store::{Registered, Residence};
use reshard::{Endpoint, Group, RankProgram};
use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport::{
    cuda::{
        comm_rank, run_rank_comm, send_staging_bytes, sim_comm, sim_comm_id, CommConfig, CommHandle, CommId, IpcComm, IpcHandle, SimBucket,
        SimIpc, SimMemory,
    },
    DeltaRun, LinkEmulation, LocalTransport, NodeTransport, NodeTransportConfig, RankMemory, RankStats, TcpConfig, Transport,
};

/// The smallest frame limit a data-plane endpoint sets: room for an abort's
/// reason (64 KiB at most) and the small frames of shared-memory links.
const MIN_FRAME_LIMIT: u64 = 1 << 17;

/// Tears a rank's data plane down from any thread (the reason in words).
pub(crate) type KillSwitch = Box<dyn Fn(&str) + Send>;

/// The ranks `program` sends to or receives from.
fn program_peers(program: &RankProgram) -> BTreeSet<Endpoint> {
    let sends = program.rounds.iter().flat_map(|r| r.sends.iter().map(|m| m.peer));
    sends.chain(program.rounds.iter().flat_map(|r| r.recvs.iter().map(|m| m.peer))).collect()
}

/// One member's data-plane endpoint in the making.
pub(crate) enum Endpointed {
    /// In process: ready as soon as it is taken from the hub.
    Local(LocalTransport),
    /// Node fabric: listening, not yet connected.
    Listening {
        /// The listener peers connect to.
        listener: TcpListener,
        /// Settings.
        settings: NodeFabric,
        /// The refit's session id (names shared-memory regions).
        session: String,
    },
    /// Node fabric: connected.
    Connected(NodeTransport),
    /// Communicator fabric: prepared; the id comes with `Connect`.
    CommPrepared {
        /// Settings.
        settings: NcclFabric,
        /// The member's GPU (NCCL).
        gpu: Option<usize>,
    },
    /// IPC fabric: doorbells listening, the send bucket exported.
    IpcPrepared(IpcPending),
    /// Communicator or IPC fabric: this member's rank of the refit's
    /// communicator.
    Comm(Box<CommEnd>),
}

/// An IPC-fabric endpoint between `Prepare` and `Connect`.
pub(crate) struct IpcPending {
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
pub(crate) enum Bucket {
    /// Host memory of this process.
    Sim(SimIpc),
    /// Device memory, exported through CUDA IPC.
    #[cfg(feature = "cuda")]
    Gpu(Box<transport::cuda::GpuIpc>),
}

impl Bucket {
    fn map_peer(&mut self, peer: u32, owner: Endpoint, handle: &IpcHandle, bytes: u64) -> Result<(), String> {
        match self {
            Bucket::Sim(b) => b.map_peer(peer, handle, bytes),
            #[cfg(feature = "cuda")]
            Bucket::Gpu(b) => b.map_peer(peer, owner, handle, bytes),
        }
        .map_err(|e| format!("mapping {owner}'s bucket: {e}"))
    }

    /// What a run packs into.
    fn packs_into(&self) -> PackInto {
        match self {
            Bucket::Sim(b) => PackInto::Sim(b.bucket()),
            #[cfg(feature = "cuda")]
            Bucket::Gpu(b) => {
                use transport::cuda::IpcMemory as _;
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
pub(crate) struct CommEnd {
    /// `None` once aborted.
    handle: Option<CommHandle>,
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
    device: Option<(transport::cuda::GpuDevice, transport::cuda::DeviceMemory)>,
    /// Scratch buffers of a program run on registered memory, kept between
    /// the runs of this communicator (every run writes scratch before it
    /// reads it).
    scratch: Scratch,
}

/// Scratch buffers beside registered memory.
#[derive(Default)]
struct Scratch {
    /// Host (simulated plane).
    host: Vec<Vec<u8>>,
    /// On the device, with it.
    #[cfg(feature = "cuda")]
    device: Option<(transport::cuda::GpuDevice, transport::cuda::DeviceMemory)>,
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
    fn connected(handle: CommHandle, ranks: (u32, u32), plane: CommPlane, gpu: Option<usize>, packs_into: Option<PackInto>) -> Endpointed {
        let (src_ranks, nranks) = ranks;
        Endpointed::Comm(Box::new(CommEnd {
            handle: Some(handle),
            src_ranks,
            nranks,
            plane,
            gpu,
            packs_into,
            #[cfg(feature = "cuda")]
            device: None,
            scratch: Scratch::default(),
        }))
    }

    /// Runs `program` on `memory` over the communicator by `deadline`
    /// (with `delta`, as a delta refit).
    pub(crate) fn run(
        &mut self,
        program: &RankProgram,
        memory: &mut RankMemory,
        deadline: Instant,
        delta: Option<&mut DeltaRun>,
    ) -> Result<RankStats, String> {
        let rank_of = self.rank_of();
        let handle = self.handle.as_mut().ok_or("the communicator was aborted")?;
        match &self.plane {
            CommPlane::Simulated { .. } => {
                let mut sim = match &self.packs_into {
                    Some(PackInto::Sim(b)) => SimMemory::with_bucket(memory, b.clone()),
                    _ => SimMemory::new(memory),
                };
                run_rank_comm(&mut sim, program, handle, &rank_of, deadline, delta).map_err(|e| e.to_string())
            }
            #[cfg(feature = "cuda")]
            CommPlane::Cuda => {
                use transport::cuda::{DeviceMemory, GpuDevice};
                let want: Vec<usize> = memory.buffers.iter().map(Vec::len).collect();
                if !matches!(&self.device, Some((_, m)) if m.buffer_lens() == want.as_slice()) {
                    self.device = None;
                    let ordinal = self.gpu.ok_or("no GPU")?;
                    let dev = GpuDevice::open(ordinal).map_err(|e| e.to_string())?;
                    let mem = DeviceMemory::for_buffers(&dev, program.endpoint, &program.buffers).map_err(|e| e.to_string())?;
                    self.device = Some((dev, mem));
                }
                let (dev, mem) = self.device.as_mut().ok_or("no device memory")?;
                // The store's bytes go to the device and a destination's
                // come back: stores live in host memory.
                mem.upload(dev, memory).map_err(|e| e.to_string())?;
                let mut plane = gpu_plane(self.packs_into.as_ref(), dev, mem, program.endpoint)?;
                let stats = run_rank_comm(&mut plane, program, handle, &rank_of, deadline, delta).map_err(|e| e.to_string())?;
                drop(plane);
                if program.endpoint.group == Group::Dst {
                    mem.download_into(dev, memory).map_err(|e| e.to_string())?;
                }
                Ok(stats)
            }
            #[cfg(not(feature = "cuda"))]
            CommPlane::Cuda => Err(unavailable_nccl()),
        }
    }

    /// Runs `program` straight on the user's registered memory (a source
    /// whose weights live in its framework's buffers), by `deadline`;
    /// scratch buffers the program needs beyond the rank's are this end's.
    pub(crate) fn run_registered(
        &mut self,
        program: &RankProgram,
        registered: &Registered,
        deadline: Instant,
        delta: Option<&mut DeltaRun>,
    ) -> Result<RankStats, String> {
        let me = program.endpoint;
        let rank_of = self.rank_of();
        let mut regions = registered_regions(program, registered)?;
        let base = regions.len();
        let bytes = |b: &reshard::BufferSpec| (b.elems * b.dtype.size()) as usize;
        let scratch_specs = &program.buffers[base..];
        let handle = self.handle.as_mut().ok_or("the communicator was aborted")?;
        match (&self.plane, registered.residence()) {
            (CommPlane::Simulated { .. }, Residence::Host) => {
                let host = &mut self.scratch.host;
                if host.len() != scratch_specs.len() || host.iter().zip(scratch_specs).any(|(b, s)| b.len() != bytes(s)) {
                    *host = scratch_specs.iter().map(|s| vec![0; bytes(s)]).collect();
                }
                regions.extend(host.iter_mut().map(|b| (b.as_mut_ptr() as u64, b.len())));
                let dtypes = program.buffers.iter().map(|b| b.dtype).collect();
                // SAFETY: the registered regions are the user's, valid for
                // the store's life and untouched while a refit holds the
                // store's lock (`Registered::new`'s contract); the scratch
                // is this end's, alive past the run.
                let mut sim = unsafe { SimMemory::from_regions(&regions, dtypes) };
                if let Some(PackInto::Sim(b)) = &self.packs_into {
                    sim = sim.packing_into(b.clone());
                }
                run_rank_comm(&mut sim, program, handle, &rank_of, deadline, delta).map_err(|e| e.to_string())
            }
            #[cfg(feature = "cuda")]
            (CommPlane::Cuda, Residence::Device { ordinal }) if Some(ordinal) == self.gpu => {
                use transport::cuda::{DeviceMemory, GpuDevice};
                let want: Vec<usize> = scratch_specs.iter().map(bytes).collect();
                if self.scratch.device.as_ref().is_none_or(|(_, m)| m.buffer_lens() != want.as_slice()) {
                    self.scratch.device = None;
                    let dev = GpuDevice::open(ordinal).map_err(|e| e.to_string())?;
                    let mem = DeviceMemory::for_buffers(&dev, me, scratch_specs).map_err(|e| e.to_string())?;
                    self.scratch.device = Some((dev, mem));
                }
                let (dev, scratch) = self.scratch.device.as_ref().ok_or("no device scratch")?;
                regions.extend(scratch.device_addrs().iter().copied().zip(want));
                // SAFETY: the registered regions are device memory of this
                // GPU (`Registered::new`'s contract); the scratch is this
                // end's allocations, alive past the run.
                let mut mem = unsafe { DeviceMemory::register(dev, me, &program.buffers, &regions) }.map_err(|e| e.to_string())?;
                let mut plane = gpu_plane(self.packs_into.as_ref(), dev, &mut mem, me)?;
                run_rank_comm(&mut plane, program, handle, &rank_of, deadline, delta).map_err(|e| e.to_string())
            }
            (plane, residence) => Err(out_of_reach(me, plane, residence)),
        }
    }

    /// Runs a registered destination's `program` into `staging` (made, or
    /// remade for another plan, on this end's plane; first synced with the
    /// registered memory if a run since the last commit may have written
    /// it), by `deadline`. The registered memory itself is only read here;
    /// the commit copies the staging in ([`RegisteredStaging::commit`]).
    pub(crate) fn run_staged(
        &mut self,
        program: &RankProgram,
        registered: &Registered,
        staging: &mut Option<RegisteredStaging>,
        deadline: Instant,
        delta: Option<&mut DeltaRun>,
    ) -> Result<RankStats, String> {
        let me = program.endpoint;
        match (&self.plane, registered.residence()) {
            (CommPlane::Simulated { .. }, Residence::Host) => {
                // Staging is a rank's own host memory: the ordinary run.
                let memory = RegisteredStaging::host(staging, program, registered, program.buffers.len())?;
                self.run(program, memory, deadline, delta)
            }
            #[cfg(feature = "cuda")]
            (CommPlane::Cuda, Residence::Device { ordinal }) if Some(ordinal) == self.gpu => {
                use transport::cuda::{DeviceMemory, GpuDevice};
                let regions = registered_regions(program, &registered.current()?)?;
                let lens: Vec<usize> = program.buffers.iter().map(|b| (b.elems * b.dtype.size()) as usize).collect();
                let fits = matches!(staging, Some(RegisteredStaging { memory: StagingMemory::Device(_, m), .. })
                    if m.buffer_lens() == lens.as_slice());
                if !fits {
                    *staging = None;
                    let dev = GpuDevice::open(ordinal).map_err(|e| e.to_string())?;
                    let mem = DeviceMemory::for_buffers(&dev, me, &program.buffers).map_err(|e| e.to_string())?;
                    *staging = Some(RegisteredStaging { memory: StagingMemory::Device(dev, mem), synced: false });
                }
                let st = staging.as_mut().ok_or("no staging")?;
                let StagingMemory::Device(dev, mem) = &mut st.memory else { return Err("no device staging".into()) };
                if !st.synced {
                    // SAFETY: the regions are device memory of this GPU
                    // (`Registered::new`'s contract, the residence checked
                    // above), written only by this member's commits.
                    unsafe { mem.copy_from_regions(dev, &regions) }.map_err(|e| e.to_string())?;
                }
                st.synced = false;
                let rank_of = self.rank_of();
                let handle = self.handle.as_mut().ok_or("the communicator was aborted")?;
                let mut plane = gpu_plane(self.packs_into.as_ref(), dev, mem, me)?;
                run_rank_comm(&mut plane, program, handle, &rank_of, deadline, delta).map_err(|e| e.to_string())
            }
            (plane, residence) => Err(out_of_reach(me, plane, residence)),
        }
    }

    /// The communicator rank of each endpoint (sources first).
    fn rank_of(&self) -> impl Fn(Endpoint) -> Option<u32> + Copy {
        let (src_ranks, nranks) = (self.src_ranks, self.nranks);
        move |e: Endpoint| Some(comm_rank(e, src_ranks)).filter(|&r| r < nranks)
    }

    /// Aborts the communicator now (peers waiting on this rank then fail),
    /// waiting at most the abort timeout; says so if its thread hangs.
    pub(crate) fn abort(&mut self) -> Option<String> {
        let outcome = self.handle.take()?.abort();
        outcome.needs_restart().then(|| format!("its communicator's abort hangs ({outcome:?}): restart this process"))
    }
}

/// Device memory `mem` of `dev` as the communicator executor's plane
/// (bound to this thread), packing into the exported IPC bucket where
/// there is one.
#[cfg(feature = "cuda")]
fn gpu_plane<'a>(
    packs_into: Option<&PackInto>,
    dev: &'a transport::cuda::GpuDevice,
    mem: &'a mut transport::cuda::DeviceMemory,
    me: Endpoint,
) -> Result<transport::cuda::DevicePlaneMemory<'a>, String> {
    dev.bind().map_err(|e| format!("{me}: {e}"))?;
    Ok(match packs_into {
        // SAFETY: the bucket is device memory of this GPU, held by the
        // communicator's thread until it is dropped (or for good after a
        // failure), past this run.
        Some(PackInto::Gpu { base, len }) => unsafe { transport::cuda::DevicePlaneMemory::with_bucket(dev, mem, *base, *len) },
        _ => transport::cuda::DevicePlaneMemory::new(dev, mem),
    })
}

/// The rank's buffers' regions of `registered` memory, each cut to its
/// buffer's bytes (the program's first buffers are the rank's).
pub(crate) fn registered_regions(program: &RankProgram, registered: &Registered) -> Result<Vec<(u64, usize)>, String> {
    let me = program.endpoint;
    let base = registered.regions().len();
    if program.buffers.len() < base {
        return Err(format!("{me}: the program has {} buffers, {base} are registered", program.buffers.len()));
    }
    let mut regions = Vec::with_capacity(program.buffers.len());
    for (spec, &(addr, len)) in program.buffers.iter().zip(registered.regions()) {
        let bytes = (spec.elems * spec.dtype.size()) as usize;
        if len < bytes {
            return Err(format!("{me}: buffer '{}' needs {bytes} bytes, {len} are registered", spec.name));
        }
        regions.push((addr, bytes));
    }
    Ok(regions)
}

/// Why a communicator's plane cannot reach a rank's registered memory.
fn out_of_reach(me: Endpoint, plane: &CommPlane, residence: Residence) -> String {
    format!(
        "{me}: its weights are registered {residence} memory, which the {} plane does not reach{}",
        match plane {
            CommPlane::Cuda => "CUDA",
            CommPlane::Simulated { .. } => "simulated",
        },
        match (plane, residence) {
            (CommPlane::Cuda, Residence::Device { .. }) => " (the member's GPU, MemberConfig::gpu, is another device)",
            _ => "",
        }
    )
}

/// A registered destination's staging: the memory its refits write (every
/// buffer of its program, scratch too), on the plane's side (host memory
/// for the simulated plane, a device bucket on the member's GPU for
/// CUDA); the commit copies the rank's buffers into the registered memory.
/// The member keeps it between refits.
pub(crate) struct RegisteredStaging {
    memory: StagingMemory,
    /// The rank's buffers hold what the registered memory holds (after a
    /// commit); a run clears it, and a run that finds it clear first copies
    /// the registered memory in, so bytes no refit writes (gaps in a fused
    /// buffer, the buffers a subset refit carries) are what is served.
    synced: bool,
}

/// Where a [`RegisteredStaging`] is.
enum StagingMemory {
    /// Host memory (the simulated plane).
    Host(RankMemory),
    /// A bucket on the member's GPU.
    #[cfg(feature = "cuda")]
    Device(transport::cuda::GpuDevice, transport::cuda::DeviceMemory),
}

impl StagingMemory {
    fn host(&mut self) -> Option<&mut RankMemory> {
        match self {
            StagingMemory::Host(m) => Some(m),
            #[cfg(feature = "cuda")]
            StagingMemory::Device(..) => None,
        }
    }
}

impl RegisteredStaging {
    /// Host staging for `program` over host `registered` memory, holding the
    /// program's first `buffers` buffers (all of them for a communicator's
    /// run; the rank's own for a host fabric's, whose executor adds the
    /// scratch): made, or remade for another plan; when not synced, first
    /// filled from the registered memory. The caller's run writes it, so
    /// it is no longer synced.
    pub(crate) fn host<'a>(
        staging: &'a mut Option<RegisteredStaging>,
        program: &RankProgram,
        registered: &Registered,
        buffers: usize,
    ) -> Result<&'a mut RankMemory, String> {
        if registered.residence() != Residence::Host {
            return Err(format!("{}: host staging for registered {} memory", program.endpoint, registered.residence()));
        }
        let specs = program.buffers.get(..buffers).ok_or_else(|| format!("{}: the program has no {buffers} buffers", program.endpoint))?;
        let lens = specs.iter().map(|b| (b.elems * b.dtype.size()) as usize);
        let fits =
            matches!(staging, Some(RegisteredStaging { memory: StagingMemory::Host(m), .. }) if m.buffers.iter().map(Vec::len).eq(lens));
        if !fits {
            *staging = Some(RegisteredStaging { memory: StagingMemory::Host(RankMemory::for_buffers(specs)), synced: false });
        }
        let st = staging.as_mut().ok_or("no staging")?;
        let memory = st.memory.host().ok_or("no host staging")?;
        if !st.synced {
            let me = program.endpoint;
            registered
                .visit(&mut |i, (addr, _)| {
                    let to = memory.buffers.get_mut(i).ok_or_else(|| format!("{me}: no staging for registered buffer {i}"))?;
                    let len = to.len();
                    // SAFETY: the owner re-derived this region just now and
                    // `visit` checked it holds the buffer's bytes (at least
                    // `len`, the staging being made for the same buffers) of
                    // host memory (the residence checked above); nothing can
                    // move or free it until this closure returns
                    // (`RegionCheck::visit`), and without a check it is valid
                    // while the store lives (`Registered::new`'s contract).
                    // `to` is our own buffer of `len` bytes.
                    to.copy_from_slice(unsafe { std::slice::from_raw_parts(addr as *const u8, len) });
                    Ok(())
                })
                .map_err(|e| format!("{me}: registered weights: {e}"))?;
        }
        st.synced = false;
        Ok(memory)
    }

    /// Copies the rank's buffers into `registered` memory (the commit,
    /// under the store's commit fence: no reader holds it) and waits.
    pub(crate) fn commit(&mut self, program: &RankProgram, registered: &Registered) -> Result<(), String> {
        let me = program.endpoint;
        match &mut self.memory {
            StagingMemory::Host(memory) => {
                if registered.residence() != Residence::Host {
                    return Err(format!("{me}: host staging for registered {} memory", registered.residence()));
                }
                registered
                    .visit(&mut |i, (addr, _)| {
                        let from = memory.buffers.get(i).ok_or_else(|| format!("no staging for registered buffer {i}"))?;
                        let len = from.len();
                        if program.buffers.get(i).map(|b| (b.elems * b.dtype.size()) as usize) != Some(len) {
                            return Err(format!("staging of {len} bytes for buffer {i} of another size"));
                        }
                        // SAFETY: the owner re-derived this region just now
                        // and `visit` checked it holds the buffer's bytes
                        // (`len`, checked above) of host memory (the
                        // residence checked above); nothing can move or
                        // free it until this closure returns
                        // (`RegionCheck::visit`; without a check, valid
                        // while the store lives: `Registered::new`), and
                        // the user does not touch it while the commit fence
                        // is held. `from` is our own buffer, not inside it.
                        unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), addr as *mut u8, len) };
                        Ok(())
                    })
                    .map_err(|e| format!("{me}: registered weights: {e}"))?;
            }
            #[cfg(feature = "cuda")]
            StagingMemory::Device(dev, mem) => {
                let regions = registered_regions(program, &registered.current()?)?;
                if registered.residence() != (Residence::Device { ordinal: dev.ordinal() }) {
                    return Err(format!(
                        "{}: staging on GPU {} for registered {} memory",
                        program.endpoint,
                        dev.ordinal(),
                        registered.residence()
                    ));
                }
                // SAFETY: the regions are device memory of this GPU
                // (checked above; `Registered::new`'s contract), written by
                // nothing else while the commit fence is held; the staging
                // is our own bucket.
                unsafe { mem.copy_to_regions(dev, &regions) }.map_err(|e| e.to_string())?;
            }
        }
        self.synced = true;
        Ok(())
    }
}

#[cfg(not(feature = "cuda"))]
fn unavailable_nccl() -> String {
    "NCCL transport unavailable: this build has no `cuda` feature".into()
}

/// A communicator-fabric address, `<id hex>@<device>`, as (id, device).
fn split_comm_addr(p: &PeerAddr) -> Result<(&str, &str), String> {
    p.addr.rsplit_once('@').filter(|(_, d)| !d.is_empty()).ok_or_else(|| {
        format!("{}: bad communicator address '{}' (want <id>@<device>: a member of another refit version?)", p.endpoint, p.addr)
    })
}

/// Refuses a peer table that puts two ranks of the communicator on one
/// GPU (colocated training and inference members): NCCL does not support
/// it (creation fails or hangs). Such members take the IPC fabric.
fn one_rank_per_device(table: &[PeerAddr]) -> Result<(), String> {
    let mut seen: HashMap<&str, Endpoint> = HashMap::new();
    for p in table {
        let (_, device) = split_comm_addr(p)?;
        if let Some(first) = seen.insert(device, p.endpoint) {
            return Err(format!(
                "{first} and {} are on one GPU ({device}): NCCL cannot put two ranks of a communicator on one device; \
                 members that share GPUs (colocated training and inference) take the IPC fabric (Fabric::Ipc, fabric=\"ipc\")",
                p.endpoint
            ));
        }
    }
    Ok(())
}

impl Endpointed {
    /// Takes this process's end of an in-process refit.
    pub(crate) fn take_local(session: &str, me: Endpoint) -> Result<Endpointed, String> {
        hub::take(session, me).map(Endpointed::Local).ok_or_else(|| {
            format!(
                "the in-process fabric of refit session {session} has no channel for {me} in this process \
                 (is this member in another process than the orchestrator? use the node fabric)"
            )
        })
    }

    /// Prepares this member's rank of a communicator. Its address is
    /// `<id>@<device>`: source rank 0 makes the communicator's id (hex; the
    /// others leave it empty), and every member names the GPU it would put
    /// its rank on (the device's UUID; on the simulated plane `sim-gpu<n>`,
    /// or the endpoint where no GPU is configured), so that two ranks on
    /// one device are refused before any communicator is made.
    pub(crate) fn prepare_comm(me: Endpoint, settings: NcclFabric, gpu: Option<usize>) -> Result<(Endpointed, String), String> {
        let device = match &settings.plane {
            CommPlane::Simulated { .. } => gpu.map_or_else(|| format!("sim-{me}"), |g| format!("sim-gpu{g}")),
            #[cfg(feature = "cuda")]
            CommPlane::Cuda => {
                transport::gpu_plane_available(transport::GpuPlane::Nccl, 1).map_err(|e| format!("NCCL transport unavailable: {e}"))?;
                let ordinal = gpu.ok_or_else(|| format!("{me} has no GPU (MemberConfig::gpu) for the NCCL fabric"))?;
                transport::cuda::device_uuid(ordinal).map_err(|e| format!("NCCL transport unavailable: {me}'s GPU {ordinal}: {e}"))?
            }
            #[cfg(not(feature = "cuda"))]
            CommPlane::Cuda => return Err(unavailable_nccl()),
        };
        let id = if me == Endpoint::src(0) {
            let id = match &settings.plane {
                CommPlane::Simulated { .. } => sim_comm_id(),
                #[cfg(feature = "cuda")]
                CommPlane::Cuda => CommId::generate().map_err(|e| format!("NCCL transport unavailable: {e}"))?,
                #[cfg(not(feature = "cuda"))]
                CommPlane::Cuda => return Err(unavailable_nccl()),
            };
            id.to_hex()
        } else {
            String::new()
        };
        Ok((Endpointed::CommPrepared { settings, gpu }, format!("{id}@{device}")))
    }

    /// Creates this member's rank of the communicator whose id source rank
    /// 0 reported, and waits for it (blocking: run off the reactor; the
    /// members of a process all wait at once).
    fn connect_comm(me: Endpoint, settings: NcclFabric, gpu: Option<usize>, table: &[PeerAddr]) -> Result<Endpointed, String> {
        let root = table.iter().find(|p| p.endpoint == Endpoint::src(0)).ok_or("the peer table has no source rank 0")?;
        let (id, _) = split_comm_addr(root)?;
        let id = CommId::from_hex(id).map_err(|e| format!("source rank 0's communicator id: {e}"))?;
        one_rank_per_device(table)?;
        let nranks = table.len() as u32;
        let src_ranks = table.iter().filter(|p| p.endpoint.group == Group::Src).count() as u32;
        if let Some(p) = table.iter().find(|p| comm_rank(p.endpoint, src_ranks) >= nranks) {
            return Err(format!("{} has no rank in a communicator of {nranks}", p.endpoint));
        }
        let rank = comm_rank(me, src_ranks);
        let config =
            CommConfig { init_timeout: settings.init_timeout, abort_timeout: settings.abort_timeout, ..CommConfig::new(rank, nranks) };
        let started = match &settings.plane {
            CommPlane::Simulated { world } => {
                let world = world.clone();
                CommHandle::start(config, &id.tag(), move || sim_comm(&world, id, rank, nranks))
            }
            #[cfg(feature = "cuda")]
            CommPlane::Cuda => {
                let ordinal = gpu.ok_or_else(|| format!("{me} has no GPU (MemberConfig::gpu) for the NCCL fabric"))?;
                CommHandle::start(config, &id.tag(), move || transport::cuda::NcclBackend::create(ordinal, id, rank, nranks))
            }
            #[cfg(not(feature = "cuda"))]
            CommPlane::Cuda => return Err(unavailable_nccl()),
        };
        let handle = started.and_then(|p| p.wait()).map_err(|e| format!("{me}: {e}"))?;
        Ok(CommEnd::connected(handle, (src_ranks, nranks), settings.plane, gpu, None))
    }

    /// Prepares this member's end of the IPC fabric: exports its send
    /// bucket (sized for its largest round) and listens for its peers'
    /// doorbells; its address is `ip:port/<handle hex>/<bytes>`.
    pub(crate) fn prepare_ipc(
        ip: IpAddr,
        program: &RankProgram,
        settings: IpcFabric,
        gpu: Option<usize>,
        session: String,
    ) -> Result<(Endpointed, String), String> {
        let bytes = send_staging_bytes(program);
        let (bucket, handle) = match &settings.plane {
            CommPlane::Simulated { .. } => {
                let (b, h) = SimIpc::export(bytes);
                (Bucket::Sim(b), h)
            }
            #[cfg(feature = "cuda")]
            CommPlane::Cuda => {
                let me = program.endpoint;
                transport::gpu_plane_available(transport::GpuPlane::Device, 1).map_err(|e| format!("IPC transport unavailable: {e}"))?;
                let ordinal = gpu.ok_or_else(|| format!("{me} has no GPU (MemberConfig::gpu) for the IPC fabric"))?;
                let (b, h) = transport::cuda::GpuIpc::export(ordinal, me, bytes)
                    .map_err(|e| format!("IPC transport unavailable: exporting {me}'s bucket: {e}"))?;
                (Bucket::Gpu(Box::new(b)), h)
            }
            #[cfg(not(feature = "cuda"))]
            CommPlane::Cuda => return Err("IPC transport unavailable: this build has no `cuda` feature".into()),
        };
        let listener = TcpListener::bind((ip, 0)).map_err(|e| format!("cannot listen on {ip}: {e}"))?;
        let at = listener.local_addr().map_err(|e| format!("listener on {ip}: {e}"))?;
        let addr = format!("{at}/{}/{bytes}", handle.to_hex());
        Ok((Endpointed::IpcPrepared(IpcPending { listener, settings, gpu, bucket, session }), addr))
    }

    /// Connects this member's doorbells to the peers of its program, maps
    /// the buckets of the peers it receives from, and makes its rank of the
    /// IPC communicator (blocking: run off the reactor).
    fn connect_ipc(program: &RankProgram, pending: IpcPending, table: &[PeerAddr], key: transport::HelloKey) -> Result<Endpointed, String> {
        let IpcPending { listener, settings, gpu, mut bucket, session } = pending;
        let me = program.endpoint;
        let nranks = table.len() as u32;
        let src_ranks = table.iter().filter(|p| p.endpoint.group == Group::Src).count() as u32;
        let mut endpoints = vec![None; nranks as usize];
        let mut addrs: HashMap<Endpoint, (SocketAddr, IpcHandle, u64)> = HashMap::new();
        for p in table {
            let bad = |what: &str| format!("{}: bad IPC address '{}': {what}", p.endpoint, p.addr);
            let mut parts = p.addr.split('/');
            let (Some(at), Some(handle), Some(bytes), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
                return Err(bad("not ip:port/handle/bytes"));
            };
            let at: SocketAddr = at.parse().map_err(|e| bad(&format!("{e}")))?;
            let handle = IpcHandle::from_hex(handle).map_err(|e| bad(&e.to_string()))?;
            let bytes: u64 = bytes.parse().map_err(|e| bad(&format!("bucket bytes: {e}")))?;
            let slot = endpoints.get_mut(comm_rank(p.endpoint, src_ranks) as usize).ok_or_else(|| bad("no rank in the communicator"))?;
            *slot = Some(p.endpoint);
            addrs.insert(p.endpoint, (at, handle, bytes));
        }
        let endpoints: Vec<Endpoint> = endpoints.into_iter().collect::<Option<_>>().ok_or("the peer table misses a rank")?;
        let wanted = program_peers(program);
        let mut peers = Vec::with_capacity(wanted.len());
        for e in wanted {
            let (at, ..) = addrs.get(&e).ok_or_else(|| format!("no IPC address for {me}'s peer {e}"))?;
            peers.push((e, *at));
        }
        for e in program.rounds.iter().flat_map(|r| r.recvs.iter()).map(|m| m.peer).collect::<BTreeSet<_>>() {
            let (_, handle, bytes) = addrs.get(&e).ok_or_else(|| format!("no IPC address for {me}'s peer {e}"))?;
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
            NodeTransport::connect(me, listener, &peers, |e| e, &config).map_err(|e| format!("{me}: connecting doorbells: {e}"))?;
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
        let handle = started.and_then(|p| p.wait()).map_err(|e| format!("{me}: {e}"))?;
        Ok(CommEnd::connected(handle, (src_ranks, nranks), settings.plane, gpu, Some(packs_into)))
    }

    /// Listens on `ip` for this refit's peers.
    pub(crate) fn listen(ip: IpAddr, settings: NodeFabric, session: String) -> Result<(Endpointed, String), String> {
        let listener = TcpListener::bind((ip, 0)).map_err(|e| format!("cannot listen on {ip}: {e}"))?;
        let addr = listener.local_addr().map_err(|e| format!("listener on {ip}: {e}"))?.to_string();
        Ok((Endpointed::Listening { listener, settings, session }, addr))
    }

    /// Connects to the peers of `program` (blocking: run off the reactor).
    pub(crate) fn connect(
        self,
        program: &RankProgram,
        table: &[PeerAddr],
        key: transport::HelloKey,
        tweak: impl FnOnce(&mut NodeTransportConfig),
    ) -> Result<Endpointed, String> {
        let (listener, settings, session) = match self {
            Endpointed::Listening { listener, settings, session } => (listener, settings, session),
            Endpointed::CommPrepared { settings, gpu } => return Endpointed::connect_comm(program.endpoint, settings, gpu, table),
            Endpointed::IpcPrepared(pending) => return Endpointed::connect_ipc(program, pending, table, key),
            done => return Ok(done),
        };
        let me = program.endpoint;
        let by_endpoint: HashMap<Endpoint, &PeerAddr> = table.iter().map(|p| (p.endpoint, p)).collect();
        let mine = by_endpoint.get(&me).map(|p| p.node).ok_or_else(|| format!("the peer table has no entry for {me}"))?;
        let wanted = program_peers(program);
        let mut peers = Vec::with_capacity(wanted.len());
        for e in wanted {
            let p = by_endpoint.get(&e).ok_or_else(|| format!("no data address for {me}'s peer {e}"))?;
            let addr: SocketAddr = p.addr.parse().map_err(|err| format!("{e}: bad data address '{}': {err}", p.addr))?;
            peers.push((e, addr));
        }
        let node_of = |e: Endpoint| -> (Group, u32) {
            let node = if e == me { mine } else { by_endpoint.get(&e).map_or(u32::MAX, |p| p.node) };
            (e.group, node)
        };
        // A pair's lend area is reserved as soon as it talks: size it to the
        // largest message this rank sends inside its node (bigger ones
        // stream), and share the default among the node peers it sends to,
        // or a node of 8 ranks pins gigabytes of shared memory.
        let in_node = program.rounds.iter().flat_map(|r| r.sends.iter()).filter(|m| node_of(m.peer) == node_of(me));
        let largest = in_node.clone().map(|m| m.wire_bytes()).max().unwrap_or(0);
        let in_node_peers = in_node.map(|m| m.peer).collect::<BTreeSet<_>>().len().max(1) as u64;
        // The largest message this rank's program expects from each peer,
        // and from any.
        let mut largest_from: HashMap<Endpoint, u64> = HashMap::new();
        for m in program.rounds.iter().flat_map(|r| r.recvs.iter()) {
            let l = largest_from.entry(m.peer).or_default();
            *l = (*l).max(m.wire_bytes());
        }
        let largest_recv = largest_from.values().copied().max().unwrap_or(0);
        let mut config = NodeTransportConfig {
            session,
            tcp: TcpConfig {
                checksum: settings.checksum,
                connect_timeout: if settings.connect_timeout.is_zero() { Duration::from_secs(30) } else { settings.connect_timeout },
                // Every member opened its listener in `Prepare`, before any
                // `Connect`: a refused connection is a dead peer.
                peers_listening: true,
                emulation: LinkEmulation {
                    inter_node_bytes_per_s: settings.emulation.inter_node_bytes_per_s.map(|r| r.max(1)),
                    intra_node_bytes_per_s: settings.emulation.intra_node_bytes_per_s.map(|r| r.max(1)),
                    burst_bytes: 0,
                },
                // Keep received frames for reuse up to one of the largest
                // this rank receives (a kept fabric holds them between
                // refits), and buffer small writes only, or a rank with a
                // hundred peers holds hundreds of MiB it does not need.
                frame_pool_bytes: largest_recv,
                // No frame from a peer larger than the largest message
                // this rank's program expects from that peer (an abort's
                // reason and shared-memory notices fit in the floor; a
                // peer it expects nothing from gets the floor): a peer
                // cannot make it allocate more.
                max_frame_bytes: MIN_FRAME_LIMIT,
                // (A delta refit's message may be a header longer.)
                max_frame_bytes_from: largest_from
                    .into_iter()
                    .map(|(peer, l)| (peer, (l + transport::delta::HEADER as u64).max(MIN_FRAME_LIMIT)))
                    .collect(),
                // Strangers at the data port are refused and logged.
                hello_key: Some(key),
                write_buffer_bytes: 256 << 10,
                ..TcpConfig::default()
            },
            ..NodeTransportConfig::default()
        };
        let share = (config.shm.lend_bytes / in_node_peers).max(1 << 20);
        config.shm.lend_bytes = largest.next_power_of_two().clamp(1 << 20, share);
        config.shm.stream_bytes = config.shm.stream_bytes.min(1 << 20);
        tweak(&mut config);
        let t = NodeTransport::connect(me, listener, &peers, node_of, &config).map_err(|e| format!("{me}: connect: {e}"))?;
        Ok(Endpointed::Connected(t))
    }

    /// A switch that tears the node fabric's connections down from any
    /// thread (a send blocked on a peer that stopped reading then fails at
    /// once); `None` for the in-process fabric, whose sends never block.
    pub(crate) fn kill_switch(&self) -> Option<KillSwitch> {
        match self {
            Endpointed::Connected(t) => Some(transport::WithAbort::abort_all(t)),
            _ => None,
        }
    }

    /// The connected endpoint, ready to run (again, once a run that
    /// succeeded left it clean).
    pub(crate) fn ready(&mut self) -> Result<Ready<'_>, String> {
        match self {
            Endpointed::Local(t) => Ok(Ready::Transport(t)),
            Endpointed::Connected(t) => Ok(Ready::Transport(t)),
            Endpointed::Comm(c) if c.handle.is_some() => Ok(Ready::Comm(c)),
            Endpointed::Comm(_) => Err("the communicator was aborted".into()),
            Endpointed::Listening { .. } | Endpointed::CommPrepared { .. } | Endpointed::IpcPrepared(_) => {
                Err("the data plane was prepared but never connected".into())
            }
        }
    }

    /// Ends this refit's data plane with an error: peers stop waiting for
    /// this rank (a transport's abort frames; a communicator's abort).
    pub(crate) fn abort(&mut self, why: &str) {
        match self.ready() {
            Ok(Ready::Transport(t)) => t.abort(why),
            Ok(Ready::Comm(c)) => {
                if let Some(hang) = c.abort() {
                    tracing::warn!(why, "{hang}");
                }
            }
            Err(_) => {}
        }
    }

    /// A connected endpoint worth keeping across refits (node fabric,
    /// communicator).
    pub(crate) fn is_connected(&self) -> bool {
        match self {
            Endpointed::Connected(_) => true,
            Endpointed::Comm(c) => c.handle.is_some(),
            _ => false,
        }
    }
}

/// A connected endpoint.
pub(crate) enum Ready<'a> {
    /// A host transport, for the one executor.
    Transport(&'a mut dyn Transport),
    /// A communicator, for the communicator executor.
    Comm(&'a mut CommEnd),
}

/// This process's in-process channels of refits in progress, by session.
pub(crate) mod hub {
    use reshard::Endpoint;
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    use transport::LocalTransport;

    type Sessions = HashMap<String, HashMap<Endpoint, LocalTransport>>;

    fn sessions() -> std::sync::MutexGuard<'static, Sessions> {
        static HUB: OnceLock<Mutex<Sessions>> = OnceLock::new();
        HUB.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Leaves the channels of one refit for its members to take.
    pub(crate) fn deposit(session: &str, ends: Vec<LocalTransport>) {
        use transport::Transport as _;
        let ends = ends.into_iter().map(|t| (t.me(), t)).collect();
        sessions().insert(session.to_string(), ends);
    }

    /// A member's end, once.
    pub(crate) fn take(session: &str, me: Endpoint) -> Option<LocalTransport> {
        sessions().get_mut(session)?.remove(&me)
    }

    /// Drops whatever of the session no member took (the refit is over).
    pub(crate) fn close(session: &str) {
        let left = sessions().remove(session);
        drop(left);
    }
}
