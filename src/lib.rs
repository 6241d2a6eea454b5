//! refit: weight refit for RL post-training. Reshards training weights
//! straight into inference layouts instead of gathering and broadcasting.
//!
//! This crate is the command-line front end and the glue that runs a refit
//! on the embedded in-process data plane; the planner lives in [`reshard`]
//! and the data plane in [`transport`]. [`demo`] is a small RL loop on the
//! [`orchestrator`] that learns only because refit delivers fresh weights.

pub mod bench;
pub mod chaos;
pub mod cluster;
pub mod demo;
pub mod presets;
pub mod procs;
pub mod runner;
pub mod soak;
pub mod svg;
pub mod units;
