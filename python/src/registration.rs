//! In-place stores: a rank's weights registered as the memory of Python
//! objects (never addresses), found and checked now and before every use.

use crate::errors::RegistrationError;
use crate::layout::PyLayout;
use crate::store_core::{StoreCore, StoreView};
use crate::target::{Access, Targets, Want};
use pyo3::prelude::*;
use reshard::{Layout, Rank};
use std::sync::Arc;

/// Rank `rank`'s buffers, and the block each is where it is one
/// tensor's only block on the rank.
fn wants(layout: &Layout, rank: Rank) -> Vec<Want> {
    layout
        .rank_buffers(rank)
        .into_iter()
        .map(|spec| {
            let shape = spec.name.rsplit_once('#').and_then(|(tensor, _)| {
                let t = layout.tensor_index(tensor)?;
                let held: Vec<_> = layout.rank_holdings(t, rank).into_iter().map(|(b, _)| b.extent().to_vec()).collect();
                match held.as_slice() {
                    [extent] if extent.iter().product::<u64>() == spec.elems => Some(extent.clone()),
                    _ => None,
                }
            });
            Want { name: spec.name, dtype: spec.dtype, elems: spec.elems, shape }
        })
        .collect()
}

/// The memory a store class is asked to hold its weights in, and how.
pub(crate) struct Holding<'py> {
    /// The objects, one per buffer in `Layout.buffers(rank)` order (None:
    /// the store holds its own memory).
    pub(crate) objects: Option<Vec<Bound<'py, PyAny>>>,
    /// How they are used.
    pub(crate) access: Access,
}

/// Rank `rank`'s store (`side`: `"src"` or `"dst"`): over the memory of
/// `holding`'s objects, found and checked now and before every use, made
/// by `registered` (`SrcStore::registered`, `DstStore::registered`,
/// `DstStore::registered_direct`); without objects, holding its own,
/// made by `owned` (`SrcStore::new`, `DstStore::new`).
pub(crate) fn store<S: StoreView>(
    layout: &PyLayout,
    rank: Rank,
    side: &str,
    holding: Holding<'_>,
    owned: impl FnOnce(&Arc<Layout>, Rank) -> S,
    registered: impl FnOnce(&Arc<Layout>, Rank, orchestrator::Registered) -> S,
) -> PyResult<StoreCore<S>> {
    let Some(objects) = holding.objects else { return StoreCore::new(layout, rank, owned) };
    layout.check_rank(rank)?;
    let what = format!("{side} rank {rank}");
    let targets =
        Targets::register(what.clone(), holding.access, wants(&layout.inner, rank), objects)?.map_err(RegistrationError::new_err)?;
    let targets = Arc::new(targets);
    let memory = orchestrator::Registered::owned(&layout.inner, rank, targets.clone())
        .map_err(|e| RegistrationError::new_err(format!("{what}: {e}")))?;
    Ok(StoreCore::registered(Arc::new(registered(&layout.inner, rank, memory)), layout.inner.clone(), targets))
}
