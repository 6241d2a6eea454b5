//! `refit._refit`: the compiled half of the `refit` Python package.
//!
//! Thin bindings over the workspace crates — no second implementation:
//! layouts are `reshard` layouts (parsed, built and validated there), the
//! stores are `orchestrator::SrcStore` / `DstStore`, joining is
//! `orchestrator::join`, and the orchestrator is the Rust actor. The pure
//! Python layer (`refit/__init__.py`) adds registration of arrays and
//! tensors, the DTensor mapping, dataclasses and the exception hierarchy's
//! documentation.
//!
//! Every call that waits (a refit, a join, an update that waits for a refit
//! reading the store) runs on one tokio runtime per process with the GIL
//! released, and polls for signals every 100 ms so Ctrl-C interrupts it
//! (the wait is abandoned; see `wait`). Weights cross the boundary in
//! place for C-contiguous host arrays (numpy, torch CPU: one copy between
//! the array and the store, each array looked up right before its copy,
//! under the GIL) and as `bytes` for anything else, checked for dtype and
//! length against the rank's block either way. In-place stores register
//! objects, never addresses: `target` finds and re-checks their memory
//! before every use (the `unsafe` of this crate is there, in
//! `registration`, and in the copies of `memory` and `dst_store`, each
//! after its check).

mod builder;
mod dst_store;
mod errors;
mod host_work;
mod join;
mod layout;
mod memory;
mod ndarray;
mod orchestrate;
mod registration;
mod runtime;
mod src_store;
mod store_core;
mod target;
mod writable_maps;

use builder::{PyLayoutBuilder, PyTensorBuilder};
use dst_store::PyDstStore;
use errors::{JoinError, LayoutError, MemberError, PlanError, RefitError, RegistrationError, TensorError, VersionError};
use join::PyJoined;
use layout::{plan_figures, PyLayout};
use memory::{is_host_array, memory_of};
use orchestrate::{spawn_local, PyOrchestrator, PySettings};
use pyo3::prelude::*;
use src_store::PySrcStore;

#[pymodule]
fn _refit(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    // Warnings of the control and data planes (a connection dropped and
    // why, a member found again) go to standard error, as every program of
    // the project writes them; `RUST_LOG` adjusts the levels (one it cannot
    // read leaves the default, warnings).
    let logger = actors::log::Logger::from_env()
        .unwrap_or_else(|_| actors::log::Logger::new(actors::log::LogFilter::default(), Box::new(std::io::stderr())));
    logger.install();
    m.add("RefitError", py.get_type::<RefitError>())?;
    m.add("LayoutError", py.get_type::<LayoutError>())?;
    m.add("PlanError", py.get_type::<PlanError>())?;
    m.add("TensorError", py.get_type::<TensorError>())?;
    m.add("VersionError", py.get_type::<VersionError>())?;
    m.add("MemberError", py.get_type::<MemberError>())?;
    m.add("JoinError", py.get_type::<JoinError>())?;
    m.add("RegistrationError", py.get_type::<RegistrationError>())?;
    m.add_function(wrap_pyfunction!(is_host_array, m)?)?;
    m.add_function(wrap_pyfunction!(memory_of, m)?)?;
    m.add_class::<PyLayout>()?;
    m.add_class::<PyTensorBuilder>()?;
    m.add_class::<PyLayoutBuilder>()?;
    m.add_function(wrap_pyfunction!(plan_figures, m)?)?;
    m.add_class::<store_core::PyStore>()?;
    m.add_class::<PySrcStore>()?;
    m.add_class::<PyDstStore>()?;
    m.add_class::<PyJoined>()?;
    m.add_class::<PySettings>()?;
    m.add_class::<PyOrchestrator>()?;
    m.add_function(wrap_pyfunction!(spawn_local, m)?)?;
    m.add_function(wrap_pyfunction!(host_work::host_work, m)?)?;
    Ok(())
}
