//! A training (source) rank's store as Python sees it (`SrcStore`):
//! steps written as `bytes`, host arrays or in place, under the version
//! fence.

use crate::errors::{tensor_err, VersionError};
use crate::layout::PyLayout;
use crate::memory::{read_bytes, write_all, Write};
use crate::registration::in_place;
use crate::runtime::wait;
use crate::store_core::StoreCore;
use crate::target::Access;
use orchestrator::SrcStore;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use reshard::Rank;
use std::sync::Mutex;

/// The weights of one training (source) rank, with the version fence:
/// `update` writes them under the store's write lock (waiting for a refit
/// that reads them) and bumps the version.
#[pyclass(module = "refit._refit", name = "SrcStore", frozen)]
pub(crate) struct PySrcStore {
    /// The store, its layout and the objects it is registered in.
    pub(crate) core: StoreCore<SrcStore>,
    /// A step begun by `begin_step`, holding the store's write lock.
    stepping: Mutex<Option<orchestrator::UpdateGuard>>,
}

impl From<StoreCore<SrcStore>> for PySrcStore {
    fn from(core: StoreCore<SrcStore>) -> Self {
        PySrcStore { core, stepping: Mutex::new(None) }
    }
}

#[pymethods]
impl PySrcStore {
    #[new]
    fn new(layout: PyRef<'_, PyLayout>, rank: Rank) -> PyResult<Self> {
        Ok(StoreCore::new(&layout, rank, SrcStore::new)?.into())
    }

    /// A store over the memory of `objects` (torch tensors, numpy arrays,
    /// CUDA arrays, DLPack tensors), one per buffer of the rank in
    /// `Layout.buffers(rank)` order: each checked for dtype, elements,
    /// shape (a tensor's block, or flat) and contiguity now, and looked up
    /// again before every refit reads it and every step. `follow`: memory
    /// an object moved to is taken (after the same checks) instead of
    /// refused.
    #[staticmethod]
    #[pyo3(signature = (layout, rank, objects, follow=false))]
    fn in_place(layout: PyRef<'_, PyLayout>, rank: Rank, objects: Vec<Bound<'_, PyAny>>, follow: bool) -> PyResult<Self> {
        let access = Access { writable: false, follow };
        Ok(in_place(&layout, rank, "src", objects, access, SrcStore::registered)?.into())
    }

    /// Looks every registered object up again: `RegistrationError` names
    /// the buffer and what changed.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        self.core.check(py)
    }

    /// Begins a step written outside the store (in place): waits while a
    /// refit reads, then holds the write lock until `end_step`.
    fn begin_step(&self, py: Python<'_>) -> PyResult<()> {
        if self.stepping.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            return Err(VersionError::new_err(format!("src rank {}: a step is in progress already", self.core.inner.rank())));
        }
        let store = self.core.inner.clone();
        let guard = wait(py, async move { Ok(store.begin_update().await) })?;
        *self.stepping.lock().unwrap_or_else(|e| e.into_inner()) = Some(guard);
        Ok(())
    }

    /// Ends the step `begin_step` began: `ok`, the version goes up by one
    /// (returned); otherwise it stays and the store is torn.
    /// A step whose registered memory moved or changed (and is not
    /// followed) fails: the version stays, the store is torn, and
    /// `RegistrationError` says what changed.
    fn end_step(&self, py: Python<'_>, ok: bool) -> PyResult<Option<u64>> {
        let guard = self.stepping.lock().unwrap_or_else(|e| e.into_inner()).take();
        let guard = guard.ok_or_else(|| VersionError::new_err(format!("src rank {}: no step in progress", self.core.inner.rank())))?;
        if !ok {
            return Ok(None);
        }
        if let Err(e) = self.core.check(py) {
            drop(guard);
            return Err(e);
        }
        Ok(Some(guard.finish()))
    }

    /// One optimizer step: writes `[(name, bytes)]` (each a tensor's block
    /// or a whole buffer, in the layout's dtype) and returns the new
    /// version. Every write is checked before any is made.
    fn update(&self, py: Python<'_>, writes: Vec<(String, Write)>) -> PyResult<u64> {
        let store = self.core.inner.clone();
        wait(py, async move { store.try_update(|b| write_all(b, &writes)).await.map(|(v, ())| v) })
    }

    /// Loads known weights (initial ones, a checkpoint) as `version`.
    fn restore(&self, py: Python<'_>, version: u64, writes: Vec<(String, Write)>) -> PyResult<()> {
        let store = self.core.inner.clone();
        wait(py, async move { store.try_restore(version, |b| write_all(b, &writes)).await })
    }

    /// The bytes of `name` (a tensor's block or a buffer) as the store
    /// holds them.
    fn read<'py>(&self, py: Python<'py>, name: String) -> PyResult<Bound<'py, PyBytes>> {
        let store = self.core.inner.clone();
        let bytes = wait(py, async move { store.read(|b| read_bytes(b, &name)).await.map_err(tensor_err) })?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// The version (None before the first update or restore).
    #[getter]
    fn version(&self) -> Option<u64> {
        self.core.inner.version()
    }

    /// The weights as a refit finds them, in words.
    #[getter]
    fn weights(&self) -> String {
        self.core.inner.weights().to_string()
    }

    /// This store's rank.
    #[getter]
    fn rank(&self) -> Rank {
        self.core.inner.rank()
    }

    /// The layout.
    #[getter]
    fn layout(&self) -> PyLayout {
        self.core.py_layout()
    }
}
