//! The data plane of refit: runs the per-rank programs of a
//! [`reshard::Plan`] (pack, transfer, unpack).
//!
//! A rank's end of a refit's data plane is one type behind one interface,
//! [`fabric::RankEnd`]: opened from a [`fabric::Fabric`] (in process, the
//! node fabric, NCCL, CUDA IPC, or their simulated planes), connected to
//! the peers of its program, run on the rank's memory. Every fabric runs a
//! program with the one interpreter (the cursor). The host fabrics
//! implement [`Transport`]: in process, receivers copy straight out of
//! senders' buffers, so each byte is copied once (twice when the sender
//! narrows its dtype); the node transport puts shared memory between ranks
//! of one node and TCP between nodes, with optional link emulation,
//! checksums and fault injection. With the `testkit` feature, thread
//! drivers run every rank of a plan as a thread of one process over a
//! fabric they make (`run_local`, `run_tcp`, `run_node`), for tests and
//! the GPU checks.
//!
//! The face is deliberate: every module is private but three, and the
//! crate's items are the `pub use` list below. [`fabric`] is what the
//! orchestrator opens and runs, [`cuda`] the GPU data plane (its own list
//! of names), [`delta`] the delta-message codec.
//! `tests/layering.rs` checks that each name here is used outside the
//! crate.

mod bypass;
mod copy;
pub mod cuda;
mod cursor;
pub mod delta;
mod digest;
mod exec;
pub mod fabric;
mod faults;
mod frame;
mod gpu_probe;
mod link;
mod local;
mod memory;
mod node;
#[cfg(any(test, feature = "testkit"))]
mod pattern;
mod shm;
mod sockopt;
mod staging;
mod stream;
mod tcp;
mod transport;

pub(crate) use bypass::Bypass;
pub use copy::{packed_strides, StridedRef};
pub use delta::{DeltaMemo, DeltaRun};
pub use exec::{quantize_rank, run_rank, ExecError, ExecOptions, ExecReport, PieceOutOfBounds, RankStats, DEFAULT_DEADLINE};
// The thread drivers (every rank of a plan a thread of this process, over
// a fabric they make): test and tooling machinery.
#[cfg(any(test, feature = "testkit"))]
pub use exec::{run_local, run_local_delta, run_tcp, run_threads, run_threads_delta};
pub use faults::Faults;
// The fabric's runs; outside, runs go through it.
pub(crate) use exec::{run_rank_bypassing, run_rank_delta, run_rank_regions};
pub use frame::HelloKey;
pub use gpu_probe::{cuda_available, gpu_plane_available, GpuPlane, GpuUnavailable};
pub use link::{FrameAction, FrameHook, LinkEmulation};
pub use local::{local_fabric, LocalTransport};
pub use memory::RankMemory;
#[cfg(any(test, feature = "testkit"))]
pub use node::{node_fabric, node_fabric_with_faults, run_node};
pub use node::{NodeTransport, NodeTransportConfig};
#[cfg(any(test, feature = "testkit"))]
pub use pattern::{
    fill_source_rank, fill_source_rank_at, fill_sources, pattern_value, tensor_seed, verify_destination_rank, verify_destination_rank_from,
    verify_destinations, Mismatch,
};
pub use shm::ShmConfig;
pub use sockopt::Congestion;
pub(crate) use staging::{RecvBuffers, StagingArea, StagingPool};
#[cfg(any(test, feature = "testkit"))]
pub use tcp::{tcp_fabric, tcp_fabric_for};
pub use tcp::{TcpConfig, TcpTransport};
pub use transport::{Lent, Payload, Release, Segment, SentPiece, SentPieces, Transport, TransportError, Waiting, WithAbort};
