//! What the two store classes (`SrcStore`, `DstStore`) hold and show
//! alike: their base class `Store` (the rank, its layout, the version,
//! the weights in words, and for an in-place store the objects its
//! weights live in, checked again on demand), and `StoreCore`, the store
//! as made (owned, or by `registration::store`) before it becomes one
//! of the classes.

use crate::errors::RegistrationError;
use crate::layout::PyLayout;
use crate::target::Targets;
use orchestrator::{DstStore, HeldVersion, SrcStore};
use pyo3::prelude::*;
use pyo3::PyClass;
use reshard::{Layout, Rank};
use std::sync::Arc;

/// What the base class reads of either kind of rank store.
pub(crate) trait StoreView: Send + Sync + 'static {
    /// The rank.
    fn rank(&self) -> Rank;
    /// The version readers get (a source: the last step's).
    fn version(&self) -> Option<u64>;
    /// The weights as a refit finds them.
    fn weights(&self) -> HeldVersion;
}

/// Each kind of rank store, read through its own methods.
macro_rules! store_view {
    ($($store:ty),*) => {$(
        impl StoreView for $store {
            fn rank(&self) -> Rank {
                <$store>::rank(self)
            }
            fn version(&self) -> Option<u64> {
                <$store>::version(self)
            }
            fn weights(&self) -> HeldVersion {
                <$store>::weights(self)
            }
        }
    )*};
}

store_view!(SrcStore, DstStore);

/// A rank's store as Python sees either kind (`SrcStore` and `DstStore`
/// extend it).
#[pyclass(module = "refit._refit", name = "Store", subclass, frozen)]
pub(crate) struct PyStore {
    view: Arc<dyn StoreView>,
    /// The layout the store holds its rank of.
    pub(crate) layout: Arc<Layout>,
    /// The objects an in-place store's weights live in (None: the store
    /// holds its own memory).
    targets: Option<Arc<Targets>>,
}

impl PyStore {
    /// Looks every registered object up again: `RegistrationError` names
    /// the buffer and what changed (a store that holds its own memory has
    /// nothing to check).
    pub(crate) fn check_targets(&self, py: Python<'_>) -> PyResult<()> {
        match &self.targets {
            Some(t) => t.check_all(py).map_err(RegistrationError::new_err),
            None => Ok(()),
        }
    }
}

#[pymethods]
impl PyStore {
    /// Looks every registered object up again: `RegistrationError` names
    /// the buffer and what changed.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        self.check_targets(py)
    }

    /// The version (a source: None before the first update or restore; a
    /// destination: the one readers get, None before the first commit).
    #[getter]
    fn version(&self) -> Option<u64> {
        self.view.version()
    }

    /// The weights as a refit finds them, in words.
    #[getter]
    fn weights(&self) -> String {
        self.view.weights().to_string()
    }

    /// This store's rank.
    #[getter]
    fn rank(&self) -> Rank {
        self.view.rank()
    }

    /// The layout.
    #[getter]
    fn layout(&self) -> PyLayout {
        PyLayout { inner: self.layout.clone() }
    }
}

/// A rank's store (`S`: `orchestrator::SrcStore` or `DstStore`) as made,
/// before it becomes a store class (`StoreCore::into_class`).
pub(crate) struct StoreCore<S> {
    inner: Arc<S>,
    layout: Arc<Layout>,
    targets: Option<Arc<Targets>>,
}

impl<S: StoreView> StoreCore<S> {
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
    /// `registration::store`).
    pub(crate) fn registered(inner: Arc<S>, layout: Arc<Layout>, targets: Arc<Targets>) -> Self {
        StoreCore { inner, layout, targets: Some(targets) }
    }

    /// The store class `C` over this store: `class` makes its own part
    /// from the typed store, the base class gets the rest.
    pub(crate) fn into_class<C>(self, class: impl FnOnce(Arc<S>) -> C) -> PyClassInitializer<C>
    where
        C: PyClass<BaseType = PyStore>,
    {
        let base = PyStore { view: self.inner.clone(), layout: self.layout, targets: self.targets };
        PyClassInitializer::from(base).add_subclass(class(self.inner))
    }
}
