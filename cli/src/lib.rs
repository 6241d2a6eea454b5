//! The `refit` command line and its tools, apart from the library (the
//! `refit` crate, `use refit::prelude::*`): [`runner`] runs a refit on the
//! embedded in-process data plane, [`bench`](mod@bench), [`chaos`] and
//! [`soak`] measure and break it, [`dump`] writes a refit's result out,
//! [`cluster`] starts worker processes (on emulated hosts with [`netns`]),
//! [`presets`] builds the layouts of known models, [`controller`] measures
//! the control plane, and [`demo`] is a small RL loop that learns only
//! because refit delivers fresh weights.
//!
//! The tools check every refit with the verification pattern (the
//! orchestrator's `testkit` feature, which this crate turns on and the
//! library leaves off).

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
