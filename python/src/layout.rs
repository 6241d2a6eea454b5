//! Layouts as Python sees them (`Layout`), and a refit planned between
//! two without running it (`plan_figures`).

use crate::errors::{layout_err, PlanError, RefitError, TensorError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use reshard::{Layout, Rank};
use std::sync::Arc;

/// One block a rank holds: `(tensor, dtype, offset, extent)`.
type BlockInfo = (String, String, Vec<u64>, Vec<u64>);

/// A validated layout: which block of which tensor every rank holds, and
/// where it is stored. `Layout.from_json` reads the layout file format
/// (docs/layout-format.md); `LayoutBuilder` builds one in code.
#[pyclass(module = "refit._refit", name = "Layout", frozen)]
pub(crate) struct PyLayout {
    pub(crate) inner: Arc<Layout>,
}

impl PyLayout {
    pub(crate) fn check_rank(&self, rank: Rank) -> PyResult<()> {
        if rank >= self.inner.ranks() {
            return Err(RefitError::new_err(format!("rank {rank}: the layout has {} ranks", self.inner.ranks())));
        }
        Ok(())
    }
}

#[pymethods]
impl PyLayout {
    /// Parses the layout file format.
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<PyLayout> {
        reshard::parse_layout(text).map(|l| PyLayout { inner: Arc::new(l) }).map_err(layout_err)
    }

    /// The layout in the file format.
    fn to_json(&self) -> PyResult<String> {
        serde_json::to_string_pretty(&reshard::layout_to_json(&self.inner)).map_err(|e| RefitError::new_err(e.to_string()))
    }

    /// Number of ranks.
    #[getter]
    fn ranks(&self) -> u32 {
        self.inner.ranks()
    }

    /// The layout of `n` replicas of this one side by side (replica `r`
    /// on ranks `r * ranks .. (r + 1) * ranks`): a destination group of
    /// inference replicas.
    fn replicated(&self, n: u32) -> PyResult<PyLayout> {
        self.inner.replicated(n).map(|l| PyLayout { inner: Arc::new(l) }).map_err(layout_err)
    }

    /// Ranks per node (machine).
    #[getter]
    fn ranks_per_node(&self) -> u32 {
        self.inner.ranks_per_node()
    }

    /// The layout's fingerprint (equal layouts, equal fingerprints).
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.inner.fingerprint()
    }

    /// Tensor names, in layout order.
    fn tensor_names(&self) -> Vec<String> {
        self.inner.tensors().iter().map(|t| t.name.clone()).collect()
    }

    /// `(dtype, shape)` of tensor `name`.
    fn tensor(&self, name: &str) -> PyResult<(String, Vec<u64>)> {
        let t = self.inner.tensor_index(name).ok_or_else(|| TensorError::new_err(format!("the layout has no tensor '{name}'")))?;
        let t = &self.inner.tensors()[t as usize];
        Ok((t.dtype.name().to_string(), t.shape.clone()))
    }

    /// Every block rank `rank` holds: `(tensor, dtype, offset, extent)`,
    /// in layout order.
    fn blocks(&self, rank: Rank) -> PyResult<Vec<BlockInfo>> {
        self.check_rank(rank)?;
        let mut out = Vec::new();
        for (i, t) in self.inner.tensors().iter().enumerate() {
            for (block, _) in self.inner.rank_holdings(i as u32, rank) {
                out.push((t.name.clone(), t.dtype.name().to_string(), block.offset().to_vec(), block.extent().to_vec()));
            }
        }
        Ok(out)
    }

    /// Rank `rank`'s buffers: `(name, dtype, elements)`.
    fn buffers(&self, rank: Rank) -> PyResult<Vec<(String, String, u64)>> {
        self.check_rank(rank)?;
        Ok(self.inner.rank_buffers(rank).into_iter().map(|b| (b.name, b.dtype.name().to_string(), b.elems)).collect())
    }

    /// Pickles as its JSON (layouts travel to Ray actors and
    /// multiprocessing workers).
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, (String,))> {
        Ok((py.get_type::<PyLayout>().getattr("from_json")?, (self.to_json()?,)))
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.extract::<PyRef<'_, PyLayout>>().is_ok_and(|o| *o.inner == *self.inner)
    }

    fn __repr__(&self) -> String {
        format!(
            "Layout(ranks={}, tensors={}, fingerprint={:016x})",
            self.inner.ranks(),
            self.inner.tensors().len(),
            self.inner.fingerprint()
        )
    }
}

/// Plans a refit from `src` to `dst` without running it (`mode`:
/// `"reshard"` or `"baseline"`) and returns its figures, those `refit plan`
/// prints (dict); a pair that cannot be planned raises `PlanError`.
#[pyfunction]
#[pyo3(signature = (src, dst, mode="reshard"))]
pub(crate) fn plan_figures<'py>(
    py: Python<'py>,
    src: PyRef<'py, PyLayout>,
    dst: PyRef<'py, PyLayout>,
    mode: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let planner = match mode {
        "reshard" => reshard::plan_reshard,
        "baseline" => reshard::plan_baseline,
        other => return Err(PlanError::new_err(format!("mode '{other}': expected 'reshard' or 'baseline'"))),
    };
    let (s, d) = (src.inner.clone(), dst.inner.clone());
    // The work limit of this machine, as the orchestrator's: a pair past
    // it is a PlanError, not minutes and gigabytes.
    let options = reshard::PlanOptions { max_work: orchestrator::machine::plan_work_limit(), ..reshard::PlanOptions::default() };
    let plan = py.detach(move || planner(&s, &d, &options)).map_err(|e| PlanError::new_err(e.to_string()))?;
    let f = plan.figures();
    let out = PyDict::new(py);
    out.set_item("bytes", f.total_bytes)?;
    out.set_item("src_egress_bytes", f.src_egress_bytes)?;
    out.set_item("relayed_bytes", f.relayed_bytes())?;
    out.set_item("cross_node_bytes", f.cross_node_bytes)?;
    out.set_item("dst_node_ingress_bytes", f.dst_node_ingress_bytes.clone())?;
    out.set_item("src_rank_egress_bytes", f.src_rank_egress_bytes.clone())?;
    out.set_item("max_rank_send_bytes", f.max_rank_send_bytes)?;
    out.set_item("max_rank_recv_bytes", f.max_rank_recv_bytes)?;
    out.set_item("messages", f.messages)?;
    out.set_item("rounds", f.rounds)?;
    out.set_item("fingerprint", plan.fingerprint().to_string())?;
    Ok(out)
}
