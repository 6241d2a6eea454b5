//! The GPU data plane: device buffers, device-side execution of rank
//! programs, and NCCL communicators.
//!
//! The parts that need no GPU compile in every build and are tested
//! without one: the NCCL id codec ([`id`]), the communicator thread with
//! its command channel and deadlines ([`comm`]), the decomposition of
//! strided pieces into 1-D/2-D/3-D copies ([`copyplan`]), the schedule
//! of a same-device reshard ([`schedule`]) and block-scaled FP8
//! quantization as device launches ([`quantplan`]). The parts that call CUDA
//! (`device`, `exec`, `nccl`) need the `cuda` feature, which loads
//! `libcuda` and `libnccl` at run time through cudarc: building needs no
//! CUDA, and a process without the libraries gets an error from
//! [`cuda_available`](crate::gpu_probe::cuda_available), never a panic.
//! See `docs/gpu.md`.

pub mod comm;
pub mod copyplan;
pub mod id;
pub mod ipc;
pub mod ipc_comm;
pub mod kernels;
pub mod plane;
pub mod quantplan;
pub mod schedule;
pub mod sim;

#[cfg(feature = "cuda")]
pub mod device;
#[cfg(feature = "cuda")]
pub mod exec;
#[cfg(feature = "cuda")]
pub mod nccl;
