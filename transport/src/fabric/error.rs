//! Why a rank's end of a refit's data plane could not be opened, connected
//! or run ([`FabricError`]), why a program does not fit the rank's memory
//! ([`ProgramMismatch`]), and what registered memory and its staging
//! report ([`RegisteredError`], [`RegisteredMemoryError`]).

use super::{DataAddr, Residence};
use crate::cuda::comm::BackendError;
use crate::cuda::CommError;
use reshard::{DType, Endpoint};
use std::net::IpAddr;
use std::sync::Arc;
use thiserror::Error;

/// An I/O error kept as the cause of an error that is cloned and compared
/// (two are equal when their kind and text are).
#[derive(Clone, Debug)]
pub struct IoCause(Arc<std::io::Error>);

impl From<std::io::Error> for IoCause {
    fn from(e: std::io::Error) -> IoCause {
        IoCause(Arc::new(e))
    }
}

impl PartialEq for IoCause {
    fn eq(&self, other: &IoCause) -> bool {
        self.0.kind() == other.0.kind() && self.0.to_string() == other.0.to_string()
    }
}

impl Eq for IoCause {}

impl std::fmt::Display for IoCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for IoCause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// Why a rank's end of a refit's data plane could not be opened, connected
/// or run.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum FabricError {
    /// The in-process fabric has no channel for this rank.
    #[error(
        "the in-process fabric of refit session {session} has no channel for {me} in this process (is this member in another \
         process than the orchestrator? use the node fabric)"
    )]
    NoLocalChannel {
        /// The refit's session.
        session: String,
        /// This rank.
        me: Endpoint,
    },
    /// The data port could not be opened.
    #[error("cannot listen on {ip}: {source}")]
    Listen {
        /// The address.
        ip: IpAddr,
        /// The system's error.
        #[source]
        source: IoCause,
    },
    /// The listener's address could not be read.
    #[error("listener on {ip}: {source}")]
    ListenerAddr {
        /// The address.
        ip: IpAddr,
        /// The system's error.
        #[source]
        source: IoCause,
    },
    /// The peer table has no entry for this rank.
    #[error("the peer table has no entry for {me}")]
    NotInTable {
        /// This rank.
        me: Endpoint,
    },
    /// The peer table has no address for a peer of this rank.
    #[error("no {fabric} address for {me}'s peer {peer}")]
    NoPeerAddr {
        /// This rank.
        me: Endpoint,
        /// The peer.
        peer: Endpoint,
        /// The kind of address (`data`, `IPC`).
        fabric: &'static str,
    },
    /// A peer's address is of another fabric.
    #[error("{peer}: '{addr}' is no {fabric} address (a member of another refit?)")]
    WrongAddr {
        /// The peer.
        peer: Endpoint,
        /// Its address.
        addr: Box<DataAddr>,
        /// The fabric expected (`node-fabric`, `IPC`, `communicator`).
        fabric: &'static str,
    },
    /// Connecting the node fabric failed.
    #[error("{me}: connect: {source}")]
    Connect {
        /// This rank.
        me: Endpoint,
        /// The system's error.
        #[source]
        source: IoCause,
    },
    /// Connecting the IPC fabric's doorbells failed.
    #[error("{me}: connecting doorbells: {source}")]
    Doorbells {
        /// This rank.
        me: Endpoint,
        /// The system's error.
        #[source]
        source: IoCause,
    },
    /// The end's communicator was aborted.
    #[error("the communicator was aborted")]
    Aborted,
    /// The end was prepared and never connected.
    #[error("the data plane was prepared but never connected")]
    NotConnected,
    /// A CUDA fabric on a member without a GPU.
    #[error("{me} has no GPU (MemberConfig::gpu){}", fabric.map_or(String::new(), |f| format!(" for the {f} fabric")))]
    NoGpu {
        /// This rank.
        me: Endpoint,
        /// The fabric (`NCCL`, `IPC`), where it is said.
        fabric: Option<&'static str>,
    },
    /// A fabric cannot run in this process.
    #[error("{fabric} transport unavailable: {source}")]
    Unavailable {
        /// The fabric (`NCCL`, `IPC`).
        fabric: &'static str,
        /// Why.
        #[source]
        source: Box<FabricError>,
    },
    /// This build has no `cuda` feature.
    #[error("this build has no `cuda` feature")]
    NoCudaFeature,
    /// The GPU data plane cannot run here.
    #[error(transparent)]
    Gpu(#[from] crate::GpuUnavailable),
    /// The member's GPU could not be named.
    #[cfg(feature = "cuda")]
    #[error("{me}'s GPU {ordinal}: {source}")]
    GpuUuid {
        /// This rank.
        me: Endpoint,
        /// The GPU.
        ordinal: usize,
        /// Why.
        #[source]
        source: crate::cuda::device::ProbeError,
    },
    /// The communicator's id could not be made.
    #[error(transparent)]
    CommId(BackendError),
    /// The member's send bucket could not be exported.
    #[cfg(feature = "cuda")]
    #[error("exporting {me}'s bucket: {source}")]
    ExportBucket {
        /// This rank.
        me: Endpoint,
        /// Why.
        #[source]
        source: crate::cuda::device::GpuError,
    },
    /// The peer table has no source rank 0 (which names the communicator).
    #[error("the peer table has no source rank 0")]
    NoRoot,
    /// Source rank 0 named no communicator id.
    #[error("source rank 0 named no communicator id")]
    NoCommId,
    /// Two ranks of one NCCL communicator on one GPU.
    #[error(
        "{first} and {second} are on one GPU ({device}): NCCL cannot put two ranks of a communicator on one device; members \
         that share GPUs (colocated training and inference) take the IPC fabric (Fabric::Ipc, fabric=\"ipc\")"
    )]
    SharedGpu {
        /// The first rank on it.
        first: Endpoint,
        /// The second.
        second: Endpoint,
        /// The GPU.
        device: String,
    },
    /// A rank past the communicator's ranks.
    #[error("{peer} has no rank in a communicator of {nranks}")]
    NoRank {
        /// The rank.
        peer: Endpoint,
        /// Ranks of the communicator.
        nranks: u32,
    },
    /// The peer table misses a rank of the communicator.
    #[error("the peer table misses a rank")]
    MissingRank,
    /// The peer table has no address of this member.
    #[error("the peer table has no address of this member")]
    NoOwnAddr,
    /// The communicator could not be made.
    #[error("{me}: {source}")]
    Comm {
        /// This rank.
        me: Endpoint,
        /// Why.
        #[source]
        source: Box<CommError>,
    },
    /// A peer's bucket could not be mapped.
    #[error("mapping {owner}'s bucket: {source}")]
    MapBucket {
        /// The peer.
        owner: Endpoint,
        /// Why.
        #[source]
        source: BackendError,
    },
    /// The fabric's plane does not reach the registered memory.
    #[error("{me}: its weights are registered {residence} memory, which the {plane} plane does not reach{}", reach_hint(*.cuda, *.residence))]
    OutOfReach {
        /// This rank.
        me: Endpoint,
        /// The plane's name (`CUDA`, `simulated`).
        plane: &'static str,
        /// Whether the plane is CUDA.
        cuda: bool,
        /// Where the memory is.
        residence: Residence,
    },
    /// Registered memory or its staging failed.
    #[error(transparent)]
    Registered(#[from] RegisteredError),
    /// The device failed.
    #[cfg(feature = "cuda")]
    #[error("{0}")]
    Device(#[source] crate::cuda::device::GpuError),
    /// Binding the device for a rank failed.
    #[cfg(feature = "cuda")]
    #[error("{me}: {source}")]
    Bind {
        /// This rank.
        me: Endpoint,
        /// Why.
        #[source]
        source: crate::cuda::device::GpuError,
    },
    /// Something the end made before is gone (`what`).
    #[error("{0}")]
    Missing(&'static str),
}

/// What to change where a CUDA plane does not reach registered memory.
fn reach_hint(cuda: bool, residence: Residence) -> &'static str {
    match (cuda, residence) {
        (true, Residence::Device { .. }) => " (the member's GPU, MemberConfig::gpu, is another device: join with the GPU the memory is on)",
        (true, Residence::Host) => " (register CUDA tensors of the member's GPU, or run the orchestrator on a host fabric: \"node\")",
        _ => "",
    }
}

#[cfg(feature = "cuda")]
impl From<crate::cuda::device::GpuError> for FabricError {
    fn from(e: crate::cuda::device::GpuError) -> FabricError {
        FabricError::Device(e)
    }
}

/// Why a program does not fit the rank's memory.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ProgramMismatch {
    /// The rank holds more buffers than the program has.
    #[error("program has {program} buffers, the rank holds {held}")]
    Buffers {
        /// Buffers of the program.
        program: usize,
        /// Buffers the rank holds.
        held: usize,
    },
    /// A buffer of another size or dtype than the program's.
    #[error("buffer '{name}' is {held_bytes} bytes of {held_dtype} here, the program expects {bytes} bytes of {dtype}")]
    Buffer {
        /// The buffer.
        name: String,
        /// Bytes held.
        held_bytes: usize,
        /// Dtype held.
        held_dtype: DType,
        /// Bytes the program expects.
        bytes: usize,
        /// Dtype the program expects.
        dtype: DType,
    },
    /// More buffers registered than the program has.
    #[error("{me}: the program has {program} buffers, {registered} are registered")]
    Registered {
        /// This rank.
        me: Endpoint,
        /// Buffers of the program.
        program: usize,
        /// Buffers registered.
        registered: usize,
    },
    /// A registered region smaller than its buffer.
    #[error("{me}: buffer '{name}' needs {bytes} bytes, {len} are registered")]
    RegisteredTooSmall {
        /// This rank.
        me: Endpoint,
        /// The buffer.
        name: String,
        /// Bytes it needs.
        bytes: usize,
        /// Bytes registered.
        len: usize,
    },
}

/// What the owner of registered memory says when it refuses a region (a
/// tensor it freed or moved, a size that no longer fits): its words.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{message}")]
pub struct RegisteredMemoryError {
    /// The owner's words, naming the buffer.
    pub message: String,
}

impl RegisteredMemoryError {
    /// The owner's refusal, in `message`.
    pub fn new(message: impl Into<String>) -> RegisteredMemoryError {
        RegisteredMemoryError { message: message.into() }
    }
}

/// Why a run could not use registered memory, or its staging could not be
/// filled or committed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum RegisteredError {
    /// The owner refused a region.
    #[error("{me}: registered weights: {source}")]
    Owner {
        /// This rank.
        me: Endpoint,
        /// The owner's words.
        #[source]
        source: RegisteredMemoryError,
    },
    /// The registered regions do not fit the program.
    #[error(transparent)]
    Mismatch(#[from] ProgramMismatch),
    /// A host fabric and registered device memory.
    #[error(
        "{me}: its weights are registered {residence} memory, which moves on the NCCL and IPC fabrics only (run the \
         orchestrator on fabric \"ipc\" where trainers and engines share the GPUs, \"nccl\" otherwise, or register host memory)"
    )]
    OffHost {
        /// This rank.
        me: Endpoint,
        /// Where the memory is.
        residence: Residence,
    },
    /// Staging asked for more buffers than the program has.
    #[error("{me}: the program has no {buffers} buffers")]
    NoBuffers {
        /// This rank.
        me: Endpoint,
        /// Buffers asked for.
        buffers: usize,
    },
    /// The owner named a buffer the staging does not have.
    #[error("no staging for registered buffer {0}")]
    NoStagingFor(usize),
    /// Staging of another size than its buffer.
    #[error("staging of {len} bytes for buffer {buffer} of another size")]
    StagingSize {
        /// Bytes of the staging.
        len: usize,
        /// The buffer.
        buffer: usize,
    },
    /// Host staging for memory that is not on the host.
    #[error("{me}: host staging for registered {residence} memory")]
    HostStaging {
        /// This rank.
        me: Endpoint,
        /// Where the memory is.
        residence: Residence,
    },
    /// Staging on one GPU for memory elsewhere.
    #[error("{me}: staging on GPU {ordinal} for registered {residence} memory")]
    DeviceStaging {
        /// This rank.
        me: Endpoint,
        /// The staging's GPU.
        ordinal: usize,
        /// Where the memory is.
        residence: Residence,
    },
    /// The staging was never made.
    #[error("no staging")]
    NoStaging,
    /// The device failed.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Device(#[from] crate::cuda::device::GpuError),
}

impl RegisteredError {
    /// This error as a run's: an owner's refusal fails the run, regions
    /// that do not fit the program are a mismatch, the rest is the
    /// fabric's.
    pub(super) fn into_run_error(self) -> super::RankRunError {
        match self {
            RegisteredError::Owner { .. } => {
                super::RankRunError::Exec { cause: Box::new(super::RunFailure::Registered(self)), after_peer: false, hang: None }
            }
            RegisteredError::Mismatch(m) => super::RankRunError::ProgramMismatch(m),
            other => super::RankRunError::Fabric(Box::new(FabricError::Registered(other))),
        }
    }
}
