//! What the two store classes (`SrcStore`, `DstStore`) hold alike: a
//! rank's store, its layout and, for an in-place store, the objects its
//! weights live in; made, checked and shown the same way for both
//! (an in-place one by `registration::in_place`).

use crate::errors::RegistrationError;
use crate::layout::PyLayout;
use crate::target::Targets;
use pyo3::prelude::*;
use reshard::{Layout, Rank};
use std::sync::Arc;

/// A rank's store (`S`: `orchestrator::SrcStore` or `DstStore`) as a
/// store class holds it.
pub(crate) struct StoreCore<S> {
    /// The rank's store.
    pub(crate) inner: Arc<S>,
    /// The layout the store holds its rank of.
    pub(crate) layout: Arc<Layout>,
    /// The objects an in-place store's weights live in (None: the store
    /// holds its own memory).
    targets: Option<Arc<Targets>>,
}

impl<S> StoreCore<S> {
    /// A store that holds its own memory.
    pub(crate) fn owned(inner: Arc<S>, layout: Arc<Layout>) -> Self {
        StoreCore { inner, layout, targets: None }
    }

    /// Rank `rank`'s store of `layout`, made by `make` (`SrcStore::new`,
    /// `DstStore::new`), holding its own memory.
    pub(crate) fn new(layout: &PyLayout, rank: Rank, make: impl FnOnce(&Arc<Layout>, Rank) -> S) -> PyResult<Self> {
        layout.check_rank(rank)?;
        Ok(StoreCore::owned(Arc::new(make(&layout.inner, rank)), layout.inner.clone()))
    }

    /// A store over the memory of registered objects (made by
    /// `registration::in_place`).
    pub(crate) fn registered(inner: Arc<S>, layout: Arc<Layout>, targets: Arc<Targets>) -> Self {
        StoreCore { inner, layout, targets: Some(targets) }
    }

    /// Looks every registered object up again: `RegistrationError` names
    /// the buffer and what changed (a store that holds its own memory has
    /// nothing to check).
    pub(crate) fn check(&self, py: Python<'_>) -> PyResult<()> {
        match &self.targets {
            Some(t) => t.check_all(py).map_err(RegistrationError::new_err),
            None => Ok(()),
        }
    }

    /// The layout, as Python sees it.
    pub(crate) fn py_layout(&self) -> PyLayout {
        PyLayout { inner: self.layout.clone() }
    }
}
