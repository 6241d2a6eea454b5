//! An inference (destination) rank's store as Python sees it
//! (`DstStore`): committed versions read as `bytes` or into host arrays,
//! and readers' holds on weights served in place.

use crate::errors::{tensor_err, TensorError, VersionError};
use crate::layout::PyLayout;
use crate::memory::{host_array, read_bytes, source_bytes, target_len};
use crate::registration::{store, Holding};
use crate::runtime::wait;
use crate::store_core::{PyStore, StoreCore};
use crate::target::{self, Access, Device};
use orchestrator::DstStore;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use reshard::Rank;
use std::sync::{Arc, Mutex};

/// The weights of one inference (destination) rank: the committed
/// version, the one before it, and a staging copy refits write; a refit
/// commits on every rank of the group only once all have staged it.
#[pyclass(module = "refit._refit", name = "DstStore", extends = PyStore, frozen)]
pub(crate) struct PyDstStore {
    /// The store (its layout and registered objects: the base class's).
    pub(crate) inner: Arc<DstStore>,
    /// Holds taken by `begin_serving` (one per reader in a `serving()`
    /// block), released by `end_serving`.
    serving: Mutex<Vec<orchestrator::Serving>>,
}

impl PyDstStore {
    /// The class over a store as made.
    pub(crate) fn class(core: StoreCore<DstStore>) -> PyClassInitializer<Self> {
        core.into_class(|inner| PyDstStore { inner, serving: Mutex::default() })
    }

    /// The committed version to read: the current one, or `version` if it
    /// is the current or the previous one.
    fn snapshot(&self, version: Option<u64>) -> PyResult<Arc<orchestrator::Snapshot>> {
        let rank = self.inner.rank();
        match version {
            None => self.inner.snapshot().ok_or_else(|| VersionError::new_err(format!("dst rank {rank}: no refit has committed yet"))),
            Some(v) => self.inner.snapshot_at(v).ok_or_else(|| {
                let serving = self.inner.version().map_or("nothing yet".to_string(), |c| format!("version {c}"));
                VersionError::new_err(format!(
                    "dst rank {rank}: version {v} is not served (serving {serving}; the previous committed version is kept too)"
                ))
            }),
        }
    }
}

#[pymethods]
impl PyDstStore {
    /// Rank `rank`'s store of `layout`, holding its own memory; with
    /// `objects`, serving its weights in their memory (as `SrcStore`'s,
    /// and writable: read-only memory is refused): a refit's commit looks
    /// each up again and copies the version in, under one hold of the GIL
    /// per buffer. `follow`: as for sources. `direct`: refits write the
    /// memory in place (no staging copy; a failed refit leaves it torn:
    /// `DstStore::registered_direct`).
    #[new]
    #[pyo3(signature = (layout, rank, objects=None, follow=false, direct=false))]
    fn new(
        layout: PyRef<'_, PyLayout>,
        rank: Rank,
        objects: Option<Vec<Bound<'_, PyAny>>>,
        follow: bool,
        direct: bool,
    ) -> PyResult<PyClassInitializer<Self>> {
        let holding = Holding { objects, access: Access { writable: true, follow } };
        let registered = if direct { DstStore::registered_direct } else { DstStore::registered };
        Ok(PyDstStore::class(store(&layout, rank, "dst", holding, DstStore::new, registered)?))
    }

    /// Takes a reader's hold on the served weights (waiting while a commit
    /// copies into registered memory): no commit changes them until
    /// `end_serving`. Returns the version they hold (None: nothing
    /// committed yet, or torn by a failed commit).
    fn begin_serving(slf: PyRef<'_, Self>) -> PyResult<Option<u64>> {
        let store = slf.inner.clone();
        let hold = wait(slf.py(), async move { Ok(store.serve().await) })?;
        // What the readers will read must still be what was registered.
        slf.as_super().check_targets(slf.py())?;
        let version = hold.version();
        slf.serving.lock().unwrap_or_else(|e| e.into_inner()).push(hold);
        Ok(version)
    }

    /// Releases a hold `begin_serving` took.
    fn end_serving(&self) -> PyResult<()> {
        match self.serving.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            Some(_) => Ok(()),
            None => Err(VersionError::new_err(format!("dst rank {}: not serving", self.inner.rank()))),
        }
    }

    /// Whether the weights are served in registered memory.
    #[getter]
    fn is_in_place(&self) -> bool {
        self.inner.registered_memory().is_some()
    }

    /// `(version, [bytes of each name])` from one committed version: the
    /// current one, or `version` if it is the current or the previous one.
    #[pyo3(signature = (names, version=None))]
    fn read<'py>(&self, py: Python<'py>, names: Vec<String>, version: Option<u64>) -> PyResult<(u64, Vec<Bound<'py, PyBytes>>)> {
        let snap = self.snapshot(version)?;
        let mut out = Vec::with_capacity(names.len());
        for name in &names {
            let bytes = read_bytes(&snap.buffers, name).map_err(tensor_err)?;
            out.push(PyBytes::new(py, &bytes));
        }
        Ok((snap.version, out))
    }

    /// Copies one committed version (as `read`) into `targets`
    /// (`[(name, array)]`): straight into each C-contiguous host array
    /// (numpy, torch CPU) of the block's dtype and bytes, writable, looked
    /// up again right before its copy; for any other target, its bytes are
    /// returned for the caller to copy. Every target is checked before any
    /// is written. Returns `(version, [None or bytes per target])`.
    #[pyo3(signature = (targets, version=None))]
    fn load_into<'py>(
        &self,
        py: Python<'py>,
        targets: Vec<(String, Bound<'py, PyAny>)>,
        version: Option<u64>,
    ) -> PyResult<(u64, Vec<Option<Bound<'py, PyBytes>>>)> {
        let rank = self.inner.rank();
        let snap = self.snapshot(version)?;
        let mut in_place = Vec::with_capacity(targets.len());
        for (name, target) in &targets {
            let (dt, len) = target_len(&snap.buffers, name).map_err(tensor_err)?;
            let host = matches!(target::find(target)?, Ok(f) if f.device == Device::Host);
            if host {
                drop(host_array(target, &format!("dst rank {rank}: '{name}'"), dt, len, true)?);
            }
            in_place.push(host);
        }
        let mut out = Vec::with_capacity(targets.len());
        for ((name, target), host) in targets.iter().zip(in_place) {
            if !host {
                out.push(Some(PyBytes::new(py, &read_bytes(&snap.buffers, name).map_err(tensor_err)?)));
                continue;
            }
            let (dt, len) = target_len(&snap.buffers, name).map_err(tensor_err)?;
            let found = host_array(target, &format!("dst rank {rank}: '{name}'"), dt, len, true)?;
            let bytes = source_bytes(&snap.buffers, name).map_err(tensor_err)?;
            if bytes.len() != found.nbytes {
                return Err(TensorError::new_err(format!(
                    "dst rank {rank}: '{name}': {} bytes served for {} registered",
                    bytes.len(),
                    found.nbytes
                )));
            }
            if found.nbytes > 0 {
                // SAFETY: `found` was looked up just now, under this GIL
                // hold, with no Python code since: `nbytes` bytes of
                // writable host memory (the object's flag and the process's
                // mappings checked) at `addr`, alive (its keeper is held);
                // `bytes` is the snapshot's (refit's own memory), of the
                // same length, not inside it.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), found.addr as *mut u8, bytes.len()) };
            }
            out.push(None);
        }
        Ok((snap.version, out))
    }
}
