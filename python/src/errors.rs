//! The exception hierarchy refit raises (`RefitError` and its
//! subclasses), and the conversions of the crates' errors into it.

use orchestrator::{BufferError, OrchestratorError, RefitError as RustRefitError};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use std::time::Duration;

create_exception!(_refit, RefitError, PyException, "Base class of every error refit raises.");
create_exception!(_refit, LayoutError, RefitError, "A layout is invalid (the message names the tensor and field).");
create_exception!(_refit, PlanError, RefitError, "The two layouts cannot be planned (a tensor missing, shapes differ, ...).");
create_exception!(_refit, TensorError, RefitError, "A tensor or buffer of a rank cannot be read or written as asked.");
create_exception!(_refit, VersionError, RefitError, "No whole version to refit, the sources disagree, or a version is not served.");
create_exception!(_refit, MemberError, RefitError, "A member timed out, died, or refused its part of a refit.");
create_exception!(_refit, JoinError, RefitError, "Joining or opening a rendezvous failed.");
create_exception!(
    _refit,
    RegistrationError,
    TensorError,
    "Memory registered in place is no longer what was registered (moved, freed, resized, another dtype), or cannot be registered."
);

pub(crate) fn layout_err(e: impl std::fmt::Display) -> PyErr {
    LayoutError::new_err(e.to_string())
}

pub(crate) fn tensor_err(e: BufferError) -> PyErr {
    TensorError::new_err(e.to_string())
}

/// The exception for `e`, of the class its cause calls for. Every
/// exception from a refit carries `dropped_replicas`: the replicas that
/// left the destination group during the failed refit (highest index
/// first; usually none).
pub(crate) fn refit_err(e: RustRefitError) -> PyErr {
    let text = e.to_string();
    let (err, dropped) = match e {
        RustRefitError::Refit(o) => {
            let err = match o.cause() {
                OrchestratorError::Plan(_) => PlanError::new_err(text),
                OrchestratorError::Layout { .. } => LayoutError::new_err(text),
                OrchestratorError::NoWeights { .. }
                | OrchestratorError::VersionMismatch { .. }
                | OrchestratorError::VersionsDisagree { .. } => VersionError::new_err(text),
                _ => MemberError::new_err(text),
            };
            (err, o.dropped_replicas().to_vec())
        }
        RustRefitError::Call(_) => (RefitError::new_err(text), Vec::new()),
    };
    Python::attach(|py| {
        // Setting an attribute on a fresh exception instance fails only
        // without memory; the exception is raised either way.
        let _ = err.value(py).setattr("dropped_replicas", dropped);
    });
    err
}

pub(crate) fn join_err(e: orchestrator::JoinError) -> PyErr {
    JoinError::new_err(e.to_string())
}

pub(crate) fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| RefitError::new_err(format!("{what}: {s} is not a number of seconds >= 0")))
}
