//! The GPU data plane: device buffers, device-side execution of rank
//! programs, and NCCL communicators.
//!
//! The parts that need no GPU compile in every build and are tested
//! without one: the NCCL id codec (`id`), the communicator thread with
//! its command channel and deadlines (`comm`), the decomposition of
//! strided pieces into 1-D/2-D/3-D copies (`copyplan`), the schedule
//! of a same-device reshard (`schedule`) and block-scaled FP8
//! quantization as device launches (`quantplan`), and the record of work
//! done on the host instead of the device (`fallback`). The parts that call CUDA
//! (`device`, `exec`, `nccl`) need the `cuda` feature, which loads
//! `libcuda` and `libnccl` at run time through cudarc: building needs no
//! CUDA, and a process without the libraries gets an error from
//! [`cuda_available`](crate::gpu_probe::cuda_available), never a panic.
//! See `docs/gpu.md`.

//!
//! Every submodule is private; the names below are the GPU plane's face
//! (`tests/layering.rs` checks each is used outside the crate).

pub(crate) mod comm;
pub(crate) mod copyplan;
pub(crate) mod direct;
pub(crate) mod fallback;
pub(crate) mod id;
pub(crate) mod ipc;
pub(crate) mod ipc_comm;
pub(crate) mod kernels;
pub(crate) mod plane;
pub(crate) mod plane_error;
pub(crate) mod quantplan;
pub(crate) mod schedule;
pub(crate) mod sim;

#[cfg(feature = "cuda")]
pub(crate) mod device;
#[cfg(feature = "cuda")]
pub(crate) mod exec;
#[cfg(feature = "cuda")]
pub(crate) mod nccl;

pub use comm::{abandoned_comm_threads, AbortOutcome, CommConfig, CommError, CommHandle, P2p, PendingComm, Progress};
pub use direct::direct_read_bytes;
pub use fallback::{host_work, HostWork};
pub use id::CommId;
pub use ipc::IpcHandle;
pub use ipc_comm::{IpcComm, IpcMemory};
pub use kernels::shipped_ptx_isa;
pub use plane::{comm_rank, run_rank_comm, send_staging_bytes, CommExecError, CommPeers};
pub use plane_error::{PeerMissing, UnknownPeer};
pub use quantplan::QuantPlan;
pub use schedule::ScheduleError;
pub use sim::{abandoned_staging_bytes, arm, live_comms, sim_comm, sim_comm_id, SimBucket, SimFault, SimIpc, SimMemory};

#[cfg(feature = "cuda")]
pub use device::{device_count, device_uuid, driver_version, nccl_version_text, probe_nccl, DeviceMemory, GpuDevice};
#[cfg(feature = "cuda")]
pub use exec::{time_plain_copy, DeviceExecError, DeviceReport, DeviceRun, DeviceRunOptions};
#[cfg(feature = "cuda")]
pub use ipc_comm::gpu::GpuIpc;
#[cfg(feature = "cuda")]
pub use kernels::nvrtc_version;
#[cfg(feature = "cuda")]
pub use nccl::{create_comms, leaked_staging_bytes};
#[cfg(feature = "cuda")]
pub(crate) use nccl::{DevicePlaneMemory, NcclBackend};
