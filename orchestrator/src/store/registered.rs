//! Weights in memory the user owns, registered by address: where they
//! live ([`Residence`]), the regions ([`Registered`]), and the owner that
//! re-derives them before each use ([`RegionCheck`]).

use super::error::some_names;
use super::BufferError;
use reshard::{Layout, Rank};
use std::sync::Arc;
pub use transport::fabric::Residence;
use transport::fabric::{RegisteredMemory, RegisteredMemoryError, RegisteredVisitError};

/// Why a visit of registered regions stopped: the owner refused a region
/// (its words), what it answered does not fit the registration, or the
/// visitor failed on a region (carried through the owner's visit as it is).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    /// The owner refused a region (a buffer it freed or moved), in its
    /// words, naming the buffer.
    #[error("{0}")]
    Refused(String),
    /// The owner answered for a region past the registered buffers.
    #[error("region {index}: the rank has {buffers} buffers")]
    NoSuchRegion {
        /// The region's index.
        index: usize,
        /// Buffers registered.
        buffers: usize,
    },
    /// A region smaller than its buffer, or a null address.
    #[error("buffer '{name}' needs {need} bytes, {len} found at {addr:#x}")]
    TooSmall {
        /// The buffer.
        name: String,
        /// Bytes it needs.
        need: usize,
        /// Bytes found.
        len: usize,
        /// Where.
        addr: u64,
    },
    /// The owner visited regions out of order.
    #[error("region {index} visited out of order (expected {expected})")]
    OutOfOrder {
        /// The region visited.
        index: usize,
        /// The region expected.
        expected: usize,
    },
    /// The owner visited fewer regions than registered.
    #[error("{seen} of {buffers} regions visited")]
    Unvisited {
        /// Regions visited.
        seen: usize,
        /// Buffers registered.
        buffers: usize,
    },
    /// The visitor failed on a region.
    #[error(transparent)]
    Visitor(VisitorError),
}

impl RegionError {
    /// The owner's refusal of a region, in `words` (naming the buffer).
    pub fn refused(words: impl Into<String>) -> RegionError {
        RegionError::Refused(words.into())
    }
}

/// A visitor's failure on a region, carried through the owner's
/// [`RegionCheck::visit`] unchanged (an owner passes it on with `?`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(transparent)]
pub struct VisitorError(RegisteredVisitError);

impl From<RegionError> for RegisteredVisitError {
    /// The data plane's view: a visitor's failure as it was, anything
    /// else the owner's refusal (in words).
    fn from(e: RegionError) -> RegisteredVisitError {
        match e {
            RegionError::Visitor(VisitorError(e)) => e,
            other => RegisteredVisitError::Owner(RegisteredMemoryError::new(other.to_string())),
        }
    }
}

/// A rank's weights in memory the user owns, registered by address: one
/// region per buffer of the rank's buffer list, which a refit reads where
/// it is (no copy into the store). Made by the `unsafe`
/// [`Registered::new`], whose caller promises the regions stay valid.
#[derive(Clone)]
pub struct Registered {
    residence: Residence,
    /// (address, bytes) per buffer, in the rank's buffer order.
    regions: Vec<(u64, usize)>,
    /// Bytes each buffer needs, in the same order.
    needs: Vec<usize>,
    /// What re-derives the regions from their owner before each use.
    check: Option<Arc<dyn RegionCheck>>,
    /// The buffers' names, for errors.
    names: Arc<Vec<String>>,
}

impl std::fmt::Debug for Registered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered")
            .field("residence", &self.residence)
            .field("regions", &self.regions)
            .field("checked", &self.check.is_some())
            .finish()
    }
}

impl PartialEq for Registered {
    fn eq(&self, other: &Self) -> bool {
        let same_check = match (&self.check, &other.check) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        self.residence == other.residence && self.regions == other.regions && same_check
    }
}

impl Eq for Registered {}

/// The owner of registered memory (an embedding's objects: a Python
/// tensor, say), asked for each region right before a refit touches it, so
/// memory the owner moved or freed since it was registered is never read
/// or written.
///
/// [`Registered::visit`] calls [`RegionCheck::visit`] before a source's
/// refit reads its regions and around a destination's commit (and the
/// staging's first sync), which do their copies inside it.
pub trait RegionCheck: Send + Sync {
    /// Re-derives region `index` of every buffer from its owner, in buffer
    /// order, and calls `f(index, (address, bytes))` on each right after
    /// its check — with nothing able to move or free it in between (for
    /// Python objects: the GIL held from the look-up through `f`). An
    /// error names the buffer and what changed; nothing after it is
    /// visited.
    fn visit(&self, f: &mut dyn FnMut(usize, (u64, usize)) -> Result<(), RegionError>) -> Result<(), RegionError>;
}

impl Registered {
    /// Registers `regions` (address and bytes, one per buffer of rank
    /// `rank` of `layout`, in [`Layout::rank_buffers`] order) as the rank's
    /// weights; each must hold at least its buffer's bytes.
    ///
    /// # Safety
    /// Every region must be memory of `residence` valid for reads and
    /// writes of its bytes for as long as any store or refit holds this
    /// value, and never freed or moved meanwhile (reallocating a parameter
    /// means registering again). For a [`SrcStore`](super::SrcStore) it is written only
    /// inside the store's `update` (or `restore`); for a [`DstStore`](super::DstStore) only
    /// its commits write it, and the user touches it only inside
    /// [`DstStore::serve`](super::DstStore::serve).
    pub unsafe fn new(layout: &Layout, rank: Rank, residence: Residence, regions: Vec<(u64, usize)>) -> Result<Registered, BufferError> {
        let bad = |problem: String| BufferError::BadRegistration { rank, problem };
        if rank >= layout.ranks() {
            return Err(bad(format!("the layout has {} ranks", layout.ranks())));
        }
        let specs = layout.rank_buffers(rank);
        if regions.len() != specs.len() {
            return Err(bad(format!(
                "{} regions registered for {} buffers ({})",
                regions.len(),
                specs.len(),
                some_names(specs.iter().map(|s| s.name.as_str()))
            )));
        }
        let mut needs = Vec::with_capacity(specs.len());
        for (spec, &(addr, len)) in specs.iter().zip(&regions) {
            let need = spec.elems.checked_mul(spec.dtype.size()).and_then(|n| usize::try_from(n).ok());
            let need = need.ok_or_else(|| bad(format!("buffer '{}' is larger than this machine can address", spec.name)))?;
            if addr == 0 || len < need {
                return Err(bad(format!("buffer '{}' needs {need} bytes, {len} registered at {addr:#x}", spec.name)));
            }
            needs.push(need);
        }
        let names = specs.iter().map(|s| s.name.clone()).collect();
        Ok(Registered { residence, regions, needs, check: None, names: Arc::new(names) })
    }

    /// The same registration, its regions re-derived by `check` before
    /// every use ([`Registered::visit`]).
    ///
    /// # Safety
    /// As [`Registered::new`] for every region `check` yields: memory of
    /// this residence, valid for its bytes while `check`'s visit runs the
    /// caller's closure on it (for a source's refit, until the refit's run
    /// ends).
    pub unsafe fn with_check(mut self, check: Arc<dyn RegionCheck>) -> Registered {
        self.check = Some(check);
        self
    }

    /// Calls `f(index, (address, bytes))` on every region, in buffer
    /// order: the registered ones, or, with a [`RegionCheck`], each as its
    /// owner holds it now, checked to hold its buffer's bytes. An error
    /// (the owner's, or a region too small) names the buffer.
    pub fn visit(&self, f: &mut dyn FnMut(usize, (u64, usize)) -> Result<(), RegionError>) -> Result<(), RegionError> {
        let mut checked = |i: usize, (addr, len): (u64, usize)| {
            let need = *self.needs.get(i).ok_or(RegionError::NoSuchRegion { index: i, buffers: self.needs.len() })?;
            if addr == 0 || len < need {
                return Err(RegionError::TooSmall { name: self.names[i].clone(), need, len, addr });
            }
            f(i, (addr, len))
        };
        match &self.check {
            Some(check) => {
                let mut seen = 0;
                check.visit(&mut |i, r| {
                    if i != seen {
                        return Err(RegionError::OutOfOrder { index: i, expected: seen });
                    }
                    seen += 1;
                    checked(i, r)
                })?;
                if seen != self.needs.len() {
                    return Err(RegionError::Unvisited { seen, buffers: self.needs.len() });
                }
                Ok(())
            }
            None => self.regions.iter().enumerate().try_for_each(|(i, &r)| checked(i, r)),
        }
    }

    /// This registration with its regions as their owner holds them now
    /// ([`Registered::visit`]), for a use that cannot run inside the visit
    /// (a source's refit, a device copy).
    pub fn current(&self) -> Result<Registered, RegionError> {
        if self.check.is_none() {
            return Ok(self.clone());
        }
        let mut regions = Vec::with_capacity(self.needs.len());
        self.visit(&mut |_, r| {
            regions.push(r);
            Ok(())
        })?;
        Ok(Registered { regions, ..self.clone() })
    }

    /// Where the regions are.
    pub fn residence(&self) -> Residence {
        self.residence
    }

    /// (address, bytes) per buffer.
    pub fn regions(&self) -> &[(u64, usize)] {
        &self.regions
    }
}

// SAFETY: every region `Registered` yields is one `Registered::new`'s (or
// `with_check`'s) caller promised valid memory of its residence for its
// bytes, unmoved and unfreed while any store or refit holds it, written
// by its owner only outside a source's refits and a destination's commits;
// `visit` and `current` check each holds its buffer's bytes.
unsafe impl RegisteredMemory for Registered {
    fn residence(&self) -> Residence {
        self.residence
    }

    fn buffers(&self) -> usize {
        self.needs.len()
    }

    fn visit(&self, f: &mut dyn FnMut(usize, (u64, usize)) -> Result<(), RegisteredVisitError>) -> Result<(), RegisteredVisitError> {
        Ok(Registered::visit(self, &mut |i, r| f(i, r).map_err(|e| RegionError::Visitor(VisitorError(e))))?)
    }

    fn current_regions(&self) -> Result<Vec<(u64, usize)>, RegisteredMemoryError> {
        self.current().map(|r| r.regions).map_err(|e| RegisteredMemoryError::new(e.to_string()))
    }
}
