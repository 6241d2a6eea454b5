//! The GPU check: `scripts/gpu-check.sh` builds it (`--build`, with the
//! `cuda` feature) and runs it on a machine with one NVIDIA GPU and no Rust
//! toolchain. The runner starts every check as a process of its own
//! (`gpu_check --only NAME --root DIR`) with its own timeout, so a fault or
//! a hang in one cannot void the rest, NCCL last; it prints one line per
//! check (`--json`: one JSON object), writes them all to
//! `OUT/gpu-check.json` after each check (`--out OUT`), and stops starting
//! checks when `--budget S` seconds are spent. Every result records what
//! ran (`run`: the commit from `BUILD_INFO.json` beside the program, the
//! GPU and its UUID, the driver, CUDA driver API, NVRTC and NCCL versions;
//! `record`), and a check that converted a piece or quantized a tensor on
//! the host where the device has a path for it fails, naming each
//! (`verdict`; dtype pairs no kernel converts, those with f64, are listed).
//! Exit code 0 if every check passed, 1 if one failed, 2 if CUDA is
//! unavailable. `--list`: each check's name, timeout, expected seconds and
//! where that comes from (measured, or an estimate). `--record`: what ran,
//! as one JSON object (for the Python checks' files; answers without a
//! GPU too). `--root` is the folder holding `examples/` (paths are given at
//! run time, never compiled in).
//!
//! - `environment`: driver, NCCL and NVRTC versions, the device and its
//!   UUID; passes when the cast kernels are the shipped PTX (NVRTC's build
//!   for the device is tried and reported);
//! - `kernels`: the cast kernels on the device against the host
//!   conversion, over every 16-bit value and a million f32 values;
//! - `layouts`: every example layout pair (`examples/*/`), reshard and
//!   baseline, run on the device (ranks as separate buckets of the one GPU;
//!   dtype changes by the cast kernels) and byte-compared with the host
//!   executor's result;
//! - `ipc`: a colocated refit between two processes on one GPU: a child
//!   process holds the source ranks and exports each rank's bucket as one
//!   CUDA IPC handle; this process maps them, runs the refit into its own
//!   buckets, verifies every destination element, and lets the child go;
//! - `throughput`: a device refit of `llama3-8b --scale 2` (verified)
//!   against a `cuMemcpyDtoD` of the same bytes in the same run; passes at
//!   a ratio of at least 0.7;
//! - `orchestrator-ipc`: a colocated refit through the orchestrator on the
//!   CUDA IPC fabric: a child process serves two source members (f32, row
//!   shards) on GPU 0 through a rendezvous, this process two destination
//!   members (bf16, column shards) on the same GPU; every destination
//!   element checked;
//! - `orchestrator-ipc-in-place`: the same with each destination serving
//!   its weights in device buffers of this process registered in place
//!   (`DstStore::registered`): the refit stages on the GPU and its commit
//!   copies into them; checked by reading them back inside `serve`;
//! - `orchestrator-ipc-delta`: three delta refits on the IPC fabric, every
//!   member in this process on GPU 0, every element checked, the later
//!   ones a small fraction of the bytes;
//! - `fp8-at-source`: `examples/fp8-source-quantized/` through the
//!   orchestrator on the IPC fabric, every member on GPU 0: the sources
//!   quantize block-scaled FP8 on the device before sending codes and
//!   scales; every destination byte equals the host quantizer's
//!   (`fp8_source`, also run on the simulated plane by its test);
//! - `ipc-abort-in-flight`: an IPC rank gives up while its 8 GiB copy
//!   from another process's bucket runs; the context still copies and
//!   casts afterwards (the peer's mapping was kept, not closed under it);
//! - `registered-lies`: registered device regions past their allocation,
//!   or in host memory, refused by the driver's checks; honest ones taken;
//! - `nccl-same-device`: four members on one GPU through the orchestrator
//!   on the NCCL fabric: refused before any communicator, within seconds;
//! - `nccl-missing-peer`: a communicator of two with one rank and a 3 s
//!   creation timeout: answered within the creation and abort timeouts
//!   (aborted, or its thread counted as abandoned);
//! - `nccl`: a one-rank NCCL communicator created (non-blocking, polled),
//!   an empty group, a 64 MiB send/receive to itself (verified), an abort
//!   that returns within its deadline, then the same with a new id;
//! - `orchestrator` (2 GPUs or more; skipped on one, where NCCL cannot
//!   put two ranks of a communicator): refits through the orchestrator
//!   on the NCCL fabric, one source rank (f32) and a destination rank
//!   (bf16, row shards) per further GPU, three versions on one
//!   communicator, every destination element checked.

#[cfg(feature = "cuda")]
fn main() -> std::process::ExitCode {
    check::main()
}

#[cfg(not(feature = "cuda"))]
fn main() -> std::process::ExitCode {
    if std::env::args().any(|a| a == "--record") {
        // What ran, as far as a build without CUDA can tell.
        let gpu = record::GpuFacts::unavailable("built without the cuda feature");
        println!("{}", record::gather(&record::program_dir(), &gpu));
        return std::process::ExitCode::SUCCESS;
    }
    eprintln!("CUDA transport unavailable: built without the cuda feature (cargo run -p refit-cli --example gpu_check --features cuda)");
    std::process::ExitCode::from(2)
}

#[cfg(feature = "cuda")]
mod check;
#[cfg(any(feature = "cuda", test))]
mod delta;
#[cfg(any(feature = "cuda", test))]
mod fp8_source;
#[cfg(any(feature = "cuda", test))]
mod ipc_layouts;
mod record;
#[cfg(any(feature = "cuda", test))]
mod verdict;
