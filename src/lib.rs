//! refit: weight refit for RL post-training. Reshards training weights
//! straight into inference layouts instead of gathering and broadcasting.
//!
//! **As a library**, depend on this crate and `use refit::prelude::*;`: it
//! brings layouts and their builder ([`reshard`]), the weight stores, tensor
//! views and the refit system ([`orchestrator`]). The README's quickstart is
//! a whole pipeline in 30 lines; `docs/pipeline.md` goes further (your own
//! actors, several processes and hosts).
//!
//! The crates behind it, re-exported whole:
//! - [`reshard`]: layouts, the planner (pure, no I/O);
//! - [`actors`]: the actor runtime (local and remote actors);
//! - [`orchestrator`]: the stores, the refit members and the orchestrator,
//!   which is the one way to the data plane (the `transport` crate: in
//!   process, shared memory and TCP, CUDA) and so is not re-exported.
//!
//! The rest of this crate is the `refit` command line's: [`runner`] runs a
//! refit on the embedded in-process data plane, [`bench`](mod@bench), [`chaos`] and
//! [`soak`] measure and break it, [`dump`] writes a refit's result out,
//! [`cluster`] starts worker processes (on emulated hosts with [`netns`]),
//! and
//! [`demo`] is a small RL loop that learns only because refit delivers fresh
//! weights.

pub use actors;
pub use orchestrator;
pub use orchestrator::prelude;
pub use reshard;

pub mod bench;
pub mod chaos;
pub mod cluster;
pub mod controller;
pub mod demo;
pub mod dump;
pub mod netns;
pub mod presets;
pub mod procs;
pub mod runner;
pub mod soak;
pub mod svg;
pub mod units;
