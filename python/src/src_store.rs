//! A training (source) rank's store as Python sees it (`SrcStore`):
//! steps written as `bytes`, host arrays or in place, under the version
//! fence.

use crate::errors::{tensor_err, VersionError};
use crate::layout::PyLayout;
use crate::memory::{read_bytes, write_all, Write};
use crate::registration::{store, Holding};
use crate::runtime::wait;
use crate::store_core::{PyStore, StoreCore};
use crate::target::Access;
use orchestrator::SrcStore;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use reshard::Rank;
use std::sync::{Arc, Mutex};

/// The weights of one training (source) rank, with the version fence:
/// `update` writes them under the store's write lock (waiting for a refit
/// that reads them) and bumps the version.
#[pyclass(module = "refit._refit", name = "SrcStore", extends = PyStore, frozen)]
pub(crate) struct PySrcStore {
    /// The store (its layout and registered objects: the base class's).
    pub(crate) inner: Arc<SrcStore>,
    /// A step begun by `begin_step`, holding the store's write lock.
    stepping: Mutex<Option<orchestrator::UpdateGuard>>,
}

impl PySrcStore {
    /// The class over a store as made.
    pub(crate) fn class(core: StoreCore<SrcStore>) -> PyClassInitializer<Self> {
        core.into_class(|inner| PySrcStore { inner, stepping: Mutex::new(None) })
    }
}

#[pymethods]
impl PySrcStore {
    /// Rank `rank`'s store of `layout`, holding its own memory; with
    /// `objects` (torch tensors, numpy arrays, CUDA arrays, DLPack
    /// tensors, one per buffer of the rank in `Layout.buffers(rank)`
    /// order), over their memory instead: each checked for dtype,
    /// elements, shape (a tensor's block, or flat) and contiguity now, and
    /// looked up again before every refit reads it and every step.
    /// `follow`: memory an object moved to is taken (after the same
    /// checks) instead of refused.
    #[new]
    #[pyo3(signature = (layout, rank, objects=None, follow=false))]
    fn new(
        layout: PyRef<'_, PyLayout>,
        rank: Rank,
        objects: Option<Vec<Bound<'_, PyAny>>>,
        follow: bool,
    ) -> PyResult<PyClassInitializer<Self>> {
        let holding = Holding { objects, access: Access { writable: false, follow } };
        Ok(PySrcStore::class(store(&layout, rank, "src", holding, SrcStore::new, SrcStore::registered)?))
    }

    /// Begins a step written outside the store (in place): waits while a
    /// refit reads, then holds the write lock until `end_step`.
    fn begin_step(&self, py: Python<'_>) -> PyResult<()> {
        if self.stepping.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            return Err(VersionError::new_err(format!("src rank {}: a step is in progress already", self.inner.rank())));
        }
        let store = self.inner.clone();
        let guard = wait(py, async move { Ok(store.begin_update().await) })?;
        *self.stepping.lock().unwrap_or_else(|e| e.into_inner()) = Some(guard);
        Ok(())
    }

    /// Ends the step `begin_step` began: `ok`, the version goes up by one
    /// (returned); otherwise it stays and the store is torn.
    /// A step whose registered memory moved or changed (and is not
    /// followed) fails: the version stays, the store is torn, and
    /// `RegistrationError` says what changed.
    fn end_step(slf: PyRef<'_, Self>, ok: bool) -> PyResult<Option<u64>> {
        let guard = slf.stepping.lock().unwrap_or_else(|e| e.into_inner()).take();
        let guard = guard.ok_or_else(|| VersionError::new_err(format!("src rank {}: no step in progress", slf.inner.rank())))?;
        if !ok {
            return Ok(None);
        }
        if let Err(e) = slf.as_super().check_targets(slf.py()) {
            drop(guard);
            return Err(e);
        }
        Ok(Some(guard.finish()))
    }

    /// One optimizer step: writes `[(name, bytes)]` (each a tensor's block
    /// or a whole buffer, in the layout's dtype) and returns the new
    /// version. Every write is checked before any is made.
    fn update(&self, py: Python<'_>, writes: Vec<(String, Write)>) -> PyResult<u64> {
        let store = self.inner.clone();
        wait(py, async move { store.try_update(|b| write_all(b, &writes)).await.map(|(v, ())| v) })
    }

    /// Loads known weights (initial ones, a checkpoint) as `version`.
    fn restore(&self, py: Python<'_>, version: u64, writes: Vec<(String, Write)>) -> PyResult<()> {
        let store = self.inner.clone();
        wait(py, async move { store.try_restore(version, |b| write_all(b, &writes)).await })
    }

    /// The bytes of `name` (a tensor's block or a buffer) as the store
    /// holds them.
    fn read<'py>(&self, py: Python<'py>, name: String) -> PyResult<Bound<'py, PyBytes>> {
        let store = self.inner.clone();
        let bytes = wait(py, async move { store.read(|b| read_bytes(b, &name)).await.map_err(tensor_err) })?;
        Ok(PyBytes::new(py, &bytes))
    }
}
