//! `_refit.host_work()`: the work this process's GPU planes did on the host
//! instead of the device (`orchestrator::host_work`), for the GPU
//! checks written in Python: each kind once, as a dict with `rank`, `what`,
//! `why`, `times` and `fallback` (whether the device had a path for it;
//! dtype pairs no kernel converts, those with f64, are not fallbacks).
//! Empty in a build without the `cuda` feature.

use pyo3::prelude::*;
use pyo3::types::PyDict;

#[pyfunction]
pub(crate) fn host_work(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    orchestrator::host_work()
        .into_iter()
        .map(|w| {
            let d = PyDict::new(py);
            d.set_item("rank", w.rank)?;
            d.set_item("what", w.what)?;
            d.set_item("why", w.why)?;
            d.set_item("times", w.times)?;
            d.set_item("fallback", w.fallback)?;
            Ok(d)
        })
        .collect()
}
