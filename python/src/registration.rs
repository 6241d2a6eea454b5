//! In-place stores: a rank's weights registered as the memory of Python
//! objects (never addresses), found and checked now and before every use.

use crate::errors::RegistrationError;
use crate::layout::PyLayout;
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

/// Rank `rank`'s weights in the memory of `objects` (one per buffer, in
/// `Layout.buffers(rank)` order), found and checked now and before every
/// use.
pub(crate) fn in_place(
    layout: &PyLayout,
    rank: Rank,
    side: &str,
    objects: Vec<Bound<'_, PyAny>>,
    access: Access,
) -> PyResult<(orchestrator::Registered, Arc<Targets>)> {
    layout.check_rank(rank)?;
    let what = format!("{side} rank {rank}");
    let targets = Targets::register(what.clone(), access, wants(&layout.inner, rank), objects)?.map_err(RegistrationError::new_err)?;
    let targets = Arc::new(targets);
    let registered = orchestrator::Registered::owned(&layout.inner, rank, targets.clone())
        .map_err(|e| RegistrationError::new_err(format!("{what}: {e}")))?;
    Ok((registered, targets))
}

/// Raises `RegistrationError` if a registered buffer is no longer what
/// was registered.
pub(crate) fn check_targets(py: Python<'_>, targets: &Option<Arc<Targets>>) -> PyResult<()> {
    match targets {
        Some(t) => t.check_all(py).map_err(RegistrationError::new_err),
        None => Ok(()),
    }
}
