//! The `refit` commands, one module each, and the reporting helpers they share.

pub(crate) mod bench;
pub(crate) mod chaos;
pub(crate) mod controller_bench;
pub(crate) mod demo;
pub(crate) mod emit;
pub(crate) mod launch;
pub(crate) mod netns;
pub(crate) mod plan;
pub(crate) mod plan_bench;
pub(crate) mod report;
pub(crate) mod run;
pub(crate) mod soak;
