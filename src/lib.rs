//! refit: weight refit for RL post-training. Reshards training weights
//! straight into inference layouts instead of gathering and broadcasting.
//!
//! Depend on this crate and `use refit::prelude::*;`: it brings layouts and
//! their builder ([`reshard`]), the weight stores, tensor views and the
//! refit system ([`orchestrator`]). The README's quickstart is a whole
//! pipeline in 30 lines; `docs/pipeline.md` goes further (your own actors,
//! several processes and hosts).
//!
//! The crates behind it, re-exported whole:
//! - [`reshard`]: layouts, the planner (pure, no I/O);
//! - [`actors`]: the actor runtime (local and remote actors);
//! - [`orchestrator`]: the stores, the refit members and the orchestrator,
//!   which is the one way to the data plane (the `transport` crate: in
//!   process, shared memory and TCP, CUDA) and so is not re-exported.
//!
//! Feature `cuda`: the GPU data plane (device buffers, NCCL; builds without
//! CUDA installed, see `docs/gpu.md`).
//!
//! The `refit` command line and its tools (benchmarks, the chaos suite,
//! the soak, emulated hosts, the RL demo) are another crate, `refit-cli`
//! (`cli/`); so is the verification pattern they check refits with, which
//! this library leaves out.

pub use actors;
pub use orchestrator;
pub use orchestrator::prelude;
pub use reshard;
