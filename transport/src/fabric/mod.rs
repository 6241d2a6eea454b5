//! The one fabric interface: a rank's end of one refit's data plane,
//! opened from a [`Fabric`] ([`RankEnd::open`]), connected to the peers
//! of its program ([`RankEnd::connect`]), and run ([`RankEnd::run`]) on
//! the rank's memory — its own host buffers, memory its owner registered
//! by address, or a registered destination's staging — with a deadline,
//! and a delta memo where the refit is a delta. A connected end that a
//! run left clean may run again (the next refit of the same plan).
//!
//! Four fabrics behind it:
//! - **in process**: the channels of a refit are made at once for every
//!   rank ([`open_in_process`]) and left in this process under the
//!   refit's session id; each rank takes its own end. A rank in another
//!   process finds nothing there and refuses.
//! - **node**: the rank listens on its data address; on connect it
//!   connects to the peers its program exchanges with, through shared
//!   memory when the peer is on its node and TCP otherwise.
//! - **NCCL** (or its simulated plane): on open, source rank 0 makes the
//!   communicator's id and reports it as its address; on connect every
//!   rank creates its rank of one communicator over both groups from that
//!   id (the ranks of a process at the same time, each on its own thread)
//!   and waits for it. A run that fails aborts the communicator at once
//!   (peers then fail instead of waiting), within the abort timeout; the
//!   next refit creates a new one. An end dropped unused is aborted on a
//!   thread of its own.
//! - **IPC** (or its simulated plane): each rank exports one send bucket
//!   and maps its peers'; doorbells go over TCP.
//!
//! Every fabric runs a program with the one interpreter (the cursor);
//! this module only reaches the rank's memory where each plane needs it
//! (device memory for the CUDA planes: uploaded, registered in place, or
//! staged).

mod comm;
mod digest;
mod endpoint;
mod error;
mod host;
mod hub;
mod reach;
mod registered;
mod spec;

pub use crate::staging::StagingKept;
#[cfg(feature = "testkit")]
pub use digest::flip_byte;
pub use digest::{digest, DigestError, RankDigest};
pub use error::RegisteredMemoryError;
use error::{FabricError, ProgramMismatch, RegisteredError};
pub use host::{this_host, Host};
pub use hub::{close_in_process, open_in_process};
pub use registered::{RegisteredMemory, RegisteredStaging, RegisteredVisitError, Residence};
pub use spec::{CommPlane, DataAddr, EgressCaps, Fabric, IpcFabric, NcclFabric, NodeFabric, PeerAddr};

use crate::{
    run_rank_bypassing, run_rank_delta, run_rank_regions, Bypass, DeltaRun, ExecError, ExecOptions, Faults, HelloKey, RankMemory,
    RankStats, StagingPool, Transport, TransportError,
};
use endpoint::{EndpointState, Ready};
use registered::current_regions;
use reshard::{Endpoint, RankProgram};
use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

/// The smallest frame limit a data-plane endpoint sets: room for an abort's
/// reason (64 KiB at most) and the small frames of shared-memory links.
const MIN_FRAME_LIMIT: u64 = 1 << 17;

/// Tears a rank's data plane down from any thread (the reason in words).
pub type KillSwitch = Box<dyn Fn(&str) + Send>;

/// The ranks `program` sends to or receives from.
fn program_peers(program: &RankProgram) -> BTreeSet<Endpoint> {
    let sends = program.rounds.iter().flat_map(|r| r.sends.iter().map(|m| m.peer));
    sends.chain(program.rounds.iter().flat_map(|r| r.recvs.iter().map(|m| m.peer))).collect()
}

/// Where a rank's data plane lives: fixed for the rank, whatever the
/// fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Site {
    /// The address peers reach its node-fabric endpoint and IPC doorbells
    /// at.
    pub data_ip: IpAddr,
    /// The CUDA device its rank uses on the NCCL and IPC fabrics
    /// ([`CommPlane::Cuda`]); `None`: those are refused. On the simulated
    /// planes it names the device two ranks would share.
    pub gpu: Option<usize>,
    /// Where the rank's weights are registered, if they are (a store over
    /// memory its owner holds): a fabric that cannot move that memory
    /// refuses the rank at [`RankEnd::open`]. `None`: the store's own host
    /// buffers, which every fabric reaches.
    pub registered: Option<Residence>,
}

/// What tools may change of a node-fabric endpoint just before it
/// connects (emulated hosts, fault injection in tests); production ranks
/// change nothing.
#[derive(Debug, Clone, Default)]
pub struct NodeFaults {
    /// Faults its links inject.
    pub faults: Faults,
}

/// How [`RankEnd::connect`] proves and checks the job's key, and what it
/// may change.
pub struct Connecting<'a> {
    /// The data-plane handshake key of the refit's session.
    pub key: HelloKey,
    /// Changes to the node fabric's endpoint (see [`NodeFaults`]).
    pub tweak: &'a dyn Fn(&mut NodeFaults),
}

/// A rank's end of one refit's data plane.
pub struct RankEnd(EndpointState);

/// The rank's memory a run moves.
pub enum RunMemory<'a> {
    /// The rank's own host buffers (a store's); the run adds the scratch
    /// its program needs and takes it off again.
    Host(&'a mut RankMemory),
    /// A source's weights in memory its owner registered, read where they
    /// are, or a destination's written where they are on a host transport
    /// (regions re-derived first; scratch beside them).
    Registered(&'a dyn RegisteredMemory),
    /// A registered destination: the run writes `staging` (made, or
    /// remade for another plan, on the fabric's side; first filled from
    /// the registered memory when a run since the last commit may have
    /// written it). [`RegisteredStaging::commit`] copies it in.
    Staged {
        /// The registered memory (only read here).
        registered: &'a dyn RegisteredMemory,
        /// The staging the rank keeps between refits.
        staging: &'a mut Option<RegisteredStaging>,
    },
}

impl RunMemory<'_> {
    /// The same memory, for another use of it (a run, then its digest).
    pub fn reborrow(&mut self) -> RunMemory<'_> {
        match self {
            RunMemory::Host(m) => RunMemory::Host(m),
            RunMemory::Registered(r) => RunMemory::Registered(*r),
            RunMemory::Staged { registered, staging } => RunMemory::Staged { registered: *registered, staging },
        }
    }
}

/// What a plan's run leaves for the next run of the same plan, which
/// writes it again instead of faulting in fresh pages: scratch buffers
/// (every scratch element a run reads, it wrote first) and the staging
/// areas a sender converts pieces into (every staged byte it sends, it
/// wrote first). A run that fails leaves nothing.
#[derive(Debug, Default)]
pub struct Scratch {
    buffers: Vec<Vec<u8>>,
    staging: StagingPool,
}

impl Scratch {
    /// The staging areas kept for the next run, and how many were made.
    pub fn staging_kept(&self) -> StagingKept {
        self.staging.kept()
    }
}

/// How one run goes.
pub struct RunOptions<'a> {
    /// Time the data movement may take.
    pub deadline: Duration,
    /// A delta run (its memo of the base refit, if this rank has it).
    pub delta: Option<&'a mut DeltaRun>,
    /// What the plan's last clean run left; this run's, if it succeeds
    /// (left empty if it fails).
    pub scratch: &'a mut Scratch,
}

/// Why a run failed; the end has told its peers (a transport's abort
/// frames, a communicator's abort) before this is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RankRunError {
    /// The end cannot run: never connected, aborted, or unable to reach
    /// the rank's memory.
    #[error(transparent)]
    Fabric(Box<FabricError>),
    /// The program does not fit the rank's memory.
    #[error(transparent)]
    ProgramMismatch(ProgramMismatch),
    /// The data movement failed.
    #[error("{cause}{}", hang.as_ref().map_or(String::new(), |h| format!("; {h}")))]
    Exec {
        /// What happened, naming the rank and peer.
        #[source]
        cause: Box<RunFailure>,
        /// A peer failed first (its abort, a broken link).
        after_peer: bool,
        /// The communicator's abort hangs (restart the process), where it
        /// does.
        hang: Option<String>,
    },
}

/// What failed in a run ([`RankRunError::Exec`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunFailure {
    /// The host executor (a transport's run).
    #[error(transparent)]
    Host(ExecError),
    /// The communicator executor.
    #[error(transparent)]
    Comm(crate::cuda::CommExecError),
    /// The end's own part of a communicator's run (its memory, its plane).
    #[error(transparent)]
    Fabric(FabricError),
    /// The owner of registered memory refused a region.
    #[error(transparent)]
    Registered(RegisteredError),
}

impl From<FabricError> for RankRunError {
    fn from(e: FabricError) -> RankRunError {
        RankRunError::Fabric(Box::new(e))
    }
}

impl RankEnd {
    /// Opens rank `program.endpoint`'s end of `fabric` for the refit
    /// `session`, and says where its peers reach it.
    pub fn open(fabric: Fabric, program: &RankProgram, site: Site, session: &str) -> Result<(RankEnd, DataAddr), FabricError> {
        let me = program.endpoint;
        if let Some(residence) = site.registered {
            reach::check_reach(&fabric, residence, site.gpu, me)?;
        }
        let opened = match fabric {
            Fabric::InProcess => EndpointState::take_local(session, me).map(|e| (e, DataAddr::InProcess)),
            Fabric::Node(settings) => EndpointState::listen(site.data_ip, settings, session.to_string()),
            Fabric::Nccl(settings) => EndpointState::prepare_comm(me, settings, site.gpu),
            Fabric::Ipc(settings) => EndpointState::prepare_ipc(site.data_ip, program, settings, site.gpu, session.to_string()),
        };
        opened.map(|(end, addr)| (RankEnd(end), addr))
    }

    /// Connects to the peers of `program` in `table` (blocking: run off a
    /// reactor; the ranks of one communicator wait for each other).
    pub fn connect(self, program: &RankProgram, table: &[PeerAddr], how: Connecting<'_>) -> Result<RankEnd, FabricError> {
        self.0.connect(program, table, how.key, how.tweak).map(RankEnd)
    }

    /// Whether a run moves host memory through a transport (the
    /// in-process and node fabrics), rather than a communicator.
    pub fn on_host_transport(&mut self) -> bool {
        matches!(self.0.ready(), Ok(Ready::Transport(_)))
    }

    /// Whether the end is connected and can run.
    pub fn ready(&mut self) -> Result<(), FabricError> {
        self.0.ready().map(drop)
    }

    /// A switch that tears the end's connections down from any thread (a
    /// send blocked on a peer that stopped reading then fails at once);
    /// `None` where sends never block.
    pub fn kill_switch(&self) -> Option<KillSwitch> {
        self.0.kill_switch()
    }

    /// Ends this refit's data plane with an error: peers stop waiting for
    /// this rank.
    pub fn abort(&mut self, why: &str) {
        self.0.abort(why)
    }

    /// A connected end worth keeping across refits (node fabric,
    /// communicators).
    pub fn is_connected(&self) -> bool {
        self.0.is_connected()
    }

    /// Runs `program` on `memory` by `options.deadline` on the end's plane
    /// (a host transport, or a communicator), which reaches the memory
    /// where it lives; a failed run has aborted the end.
    pub fn run(&mut self, program: &RankProgram, memory: RunMemory<'_>, options: RunOptions<'_>) -> Result<RankStats, RankRunError> {
        match self.0.ready()? {
            Ready::Transport(t) => run_on_transport(program, memory, t, options),
            Ready::Comm(c) => c.run_on(program, memory, options),
        }
    }
}

/// Runs `program` on `memory` (plus any scratch it needs, from what the
/// plan's last run left where it fits) over a host `transport`; a clean
/// run leaves its scratch and staging areas in `options.scratch` (a run
/// that fails leaves none: its areas go back to a pool nobody keeps, and
/// are freed).
fn run_on_transport(
    program: &RankProgram,
    memory: RunMemory<'_>,
    transport: &mut dyn Transport,
    options: RunOptions<'_>,
) -> Result<RankStats, RankRunError> {
    let RunOptions { deadline, delta, scratch } = options;
    let reuse = std::mem::take(&mut scratch.buffers);
    let pool = std::mem::take(&mut scratch.staging);
    // Scratch whose copies the executor makes on receipt gets no memory.
    let bypass = Bypass::of(program);
    let options = ExecOptions { deadline };
    let refuse = |t: &mut dyn Transport, e: RankRunError| {
        t.abort(&e.to_string());
        (Err(e), Vec::new())
    };
    let mut t: &mut dyn Transport = transport;
    let (r, left) = match memory {
        RunMemory::Host(m) => host_run(program, &bypass, m, &mut t, &options, (delta, &pool), reuse),
        RunMemory::Staged { registered, staging } => {
            // The rank's own buffers staged on the host, the scratch added
            // by the executor.
            match RegisteredStaging::host(staging, program, registered, registered.buffers()) {
                Ok(m) => host_run(program, &bypass, m, &mut t, &options, (delta, &pool), reuse),
                Err(e) => refuse(t, e.into_run_error()),
            }
        }
        RunMemory::Registered(registered) => 'registered: {
            if registered.residence() != Residence::Host {
                let off_host = RegisteredError::OffHost { me: program.endpoint, residence: registered.residence() };
                break 'registered refuse(t, off_host.into_run_error());
            }
            let regions = match current_regions(program, registered) {
                Ok(r) => r,
                Err(e) => break 'registered refuse(t, e.into_run_error()),
            };
            // Registered memory stays as it is, the scratch beside it.
            let mut beside = scratch_for(program, &bypass, regions.len(), reuse);
            let mut all = regions;
            all.extend(beside.iter_mut().map(|b| (b.as_mut_ptr() as u64, b.len())));
            // SAFETY: the registered regions are host memory (checked
            // above), valid for reads and writes and written by nothing
            // else until this run ends (`RegisteredMemory`'s contract: a
            // source's owner writes them only outside refits; a
            // destination written in place holds its readers off for the
            // whole run, and its owner writes them only inside its serving
            // holds); each is cut to its buffer's bytes (`current_regions`);
            // the scratch is ours, alive past the run; no two regions
            // overlap.
            let r = unsafe { run_rank_regions(program, &bypass, &all, &mut t, &options, delta, &pool) };
            (r.map_err(exec_error), beside)
        }
    };
    if r.is_ok() {
        scratch.buffers = left;
        scratch.staging = pool;
    }
    r
}

/// An executor's error as a run's.
fn exec_error(e: ExecError) -> RankRunError {
    // A peer that aborted, went away, or whose stream broke failed first.
    let after_peer = matches!(
        e,
        ExecError::Transport(TransportError::PeerAborted { .. } | TransportError::Disconnected { .. } | TransportError::Broken { .. })
    );
    RankRunError::Exec { cause: Box::new(RunFailure::Host(e)), after_peer, hang: None }
}

/// A run over a host transport on the rank's own buffers (scratch
/// appended, then taken off again).
fn host_run(
    program: &RankProgram,
    bypass: &Bypass,
    memory: &mut RankMemory,
    t: &mut &mut dyn Transport,
    options: &ExecOptions,
    (delta, pool): (Option<&mut DeltaRun>, &StagingPool),
    reuse: Vec<Vec<u8>>,
) -> (Result<RankStats, RankRunError>, Vec<Vec<u8>>) {
    let base = match with_scratch(memory, program, bypass, reuse) {
        Ok(base) => base,
        Err(e) => {
            t.abort(&e.to_string());
            return (Err(RankRunError::ProgramMismatch(e)), Vec::new());
        }
    };
    let r = match delta {
        None => run_rank_bypassing(program, bypass, memory, t, options, pool),
        Some(d) => run_rank_delta(program, bypass, memory, t, options, d, pool),
    };
    (r.map_err(exec_error), drop_scratch(memory, base))
}

/// Appends scratch buffers a program needs beyond the rank's weights
/// (none for those `bypass` skips), taking them from `reuse` (what an
/// earlier run of the same program left) where the sizes match.
fn with_scratch(memory: &mut RankMemory, program: &RankProgram, bypass: &Bypass, reuse: Vec<Vec<u8>>) -> Result<usize, ProgramMismatch> {
    let base = memory.buffers.len();
    if program.buffers.len() < base {
        return Err(ProgramMismatch::Buffers { program: program.buffers.len(), held: base });
    }
    for (i, spec) in program.buffers.iter().enumerate().take(base) {
        let bytes = if bypass.skips(i) { 0 } else { (spec.elems * spec.dtype.size()) as usize };
        if memory.buffers[i].len() != bytes || memory.dtypes[i] != spec.dtype {
            return Err(ProgramMismatch::Buffer {
                name: spec.name.clone(),
                held_bytes: memory.buffers[i].len(),
                held_dtype: memory.dtypes[i],
                bytes,
                dtype: spec.dtype,
            });
        }
    }
    memory.buffers.extend(scratch_for(program, bypass, base, reuse));
    memory.dtypes.extend(program.buffers[base..].iter().map(|b| b.dtype));
    Ok(base)
}

/// The scratch buffers of `program` past the rank's `base` buffers (empty
/// for those `bypass` skips), taken from `reuse` (what an earlier run of
/// the same program left) where the sizes match.
fn scratch_for(program: &RankProgram, bypass: &Bypass, base: usize, reuse: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    let mut reuse = reuse.into_iter();
    let sizes =
        program.buffers.iter().enumerate().skip(base).map(|(i, b)| if bypass.skips(i) { 0 } else { (b.elems * b.dtype.size()) as usize });
    sizes.map(|bytes| reuse.next().filter(|b| b.len() == bytes).unwrap_or_else(|| vec![0; bytes])).collect()
}

/// Takes the scratch buffers (those past `base`) back out of `memory`.
fn drop_scratch(memory: &mut RankMemory, base: usize) -> Vec<Vec<u8>> {
    memory.dtypes.truncate(base);
    memory.buffers.split_off(base)
}
