//! Weights in memory the user owns, registered by address: where they
//! live ([`Residence`]) and the registration ([`Registered`]) that checks
//! what their owner ([`RegisteredMemory`]: fixed addresses, or an
//! embedding's objects looked up before each use) yields against the
//! rank's buffers.

use super::error::some_names;
use super::BufferError;
use reshard::{Layout, Rank};
use std::sync::Arc;
pub use transport::fabric::{RegisteredMemory, RegisteredMemoryError, RegisteredVisitError, Residence};

/// What a registration refuses in an owner's answer: a region that does
/// not fit the rank's buffers, or a visit that skips or reorders them.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
enum RegionError {
    /// The owner answered for a region past the registered buffers.
    #[error("region {index}: the rank has {buffers} buffers")]
    NoSuchRegion { index: usize, buffers: usize },
    /// A region smaller than its buffer, or a null address.
    #[error("buffer '{name}' needs {need} bytes, {len} found at {addr:#x}")]
    TooSmall { name: String, need: usize, len: usize, addr: u64 },
    /// The owner visited regions out of order.
    #[error("region {index} visited out of order (expected {expected})")]
    OutOfOrder { index: usize, expected: usize },
    /// The owner visited fewer regions than registered.
    #[error("{seen} of {buffers} regions visited")]
    Unvisited { seen: usize, buffers: usize },
}

impl From<RegionError> for RegisteredVisitError {
    /// The data plane's view: the owner's answer refused, in words.
    fn from(e: RegionError) -> RegisteredVisitError {
        RegisteredVisitError::Owner(RegisteredMemoryError::new(e.to_string()))
    }
}

/// A rank's weights in memory the user owns: one region per buffer of the
/// rank's buffer list, which a refit reads (a source) or a commit writes
/// (a destination) where it is, no copy into the store. Every region its
/// owner yields is checked to hold its buffer's bytes, in buffer order,
/// before anyone touches it.
#[derive(Clone)]
pub struct Registered {
    /// Where the regions come from, before each use.
    owner: Arc<dyn RegisteredMemory>,
    /// Bytes each buffer needs, in the rank's buffer order.
    needs: Vec<usize>,
    /// The buffers' names, for errors.
    names: Arc<Vec<String>>,
}

impl std::fmt::Debug for Registered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered").field("residence", &self.owner.residence()).field("buffers", &self.needs.len()).finish()
    }
}

impl PartialEq for Registered {
    /// The same owner, for the same buffers.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.owner, &other.owner) && self.needs == other.needs
    }
}

impl Eq for Registered {}

/// Regions at fixed addresses ([`Registered::new`]).
struct FixedRegions {
    residence: Residence,
    regions: Vec<(u64, usize)>,
}

// SAFETY: every region is one `Registered::new`'s caller promised valid
// memory of `residence` for its bytes, unmoved and unfreed while any store
// or refit holds it, written by its owner only outside a source's refits
// and a destination's commits.
unsafe impl RegisteredMemory for FixedRegions {
    fn residence(&self) -> Residence {
        self.residence
    }

    fn buffers(&self) -> usize {
        self.regions.len()
    }

    fn visit(&self, f: &mut dyn FnMut(usize, (u64, usize)) -> Result<(), RegisteredVisitError>) -> Result<(), RegisteredVisitError> {
        self.regions.iter().enumerate().try_for_each(|(i, &r)| f(i, r))
    }
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
        Registered::owned(layout, rank, Arc::new(FixedRegions { residence, regions }))
    }

    /// Registers the memory `owner` holds (one region per buffer of rank
    /// `rank` of `layout`, in [`Layout::rank_buffers`] order), asked for
    /// its regions now and before every use: memory it moved since is
    /// followed, memory it refuses (or that no longer fits) fails the
    /// refit that would have touched it. The owner's
    /// [`RegisteredMemory`] implementation holds the memory's promises.
    pub fn owned(layout: &Layout, rank: Rank, owner: Arc<dyn RegisteredMemory>) -> Result<Registered, BufferError> {
        let bad = |problem: String| BufferError::BadRegistration { rank, problem };
        if rank >= layout.ranks() {
            return Err(bad(format!("the layout has {} ranks", layout.ranks())));
        }
        let specs = layout.rank_buffers(rank);
        if owner.buffers() != specs.len() {
            return Err(bad(format!(
                "{} regions registered for {} buffers ({})",
                owner.buffers(),
                specs.len(),
                some_names(specs.iter().map(|s| s.name.as_str()))
            )));
        }
        let mut needs = Vec::with_capacity(specs.len());
        for spec in &specs {
            let need = spec.elems.checked_mul(spec.dtype.size()).and_then(|n| usize::try_from(n).ok());
            needs.push(need.ok_or_else(|| bad(format!("buffer '{}' is larger than this machine can address", spec.name)))?);
        }
        let names = specs.into_iter().map(|s| s.name).collect();
        let registered = Registered { owner, needs, names: Arc::new(names) };
        registered.check().map_err(|e| bad(e.to_string()))?;
        Ok(registered)
    }

    /// Checks every region as its owner holds it now (before the
    /// destinations commit a version, say): an error names the buffer.
    pub fn check(&self) -> Result<(), RegisteredVisitError> {
        RegisteredMemory::visit(self, &mut |_, _| Ok(()))
    }

    /// Where the regions are.
    pub fn residence(&self) -> Residence {
        self.owner.residence()
    }
}

// SAFETY: every region `Registered` yields is its owner's (whose
// `RegisteredMemory` implementation makes the promises), checked here to
// hold its buffer's bytes at a non-null address, in buffer order.
unsafe impl RegisteredMemory for Registered {
    fn residence(&self) -> Residence {
        self.owner.residence()
    }

    fn buffers(&self) -> usize {
        self.needs.len()
    }

    fn visit(&self, f: &mut dyn FnMut(usize, (u64, usize)) -> Result<(), RegisteredVisitError>) -> Result<(), RegisteredVisitError> {
        let buffers = self.needs.len();
        let mut seen = 0;
        self.owner.visit(&mut |i, (addr, len)| {
            if i != seen {
                return Err(RegionError::OutOfOrder { index: i, expected: seen }.into());
            }
            seen += 1;
            let need = *self.needs.get(i).ok_or(RegionError::NoSuchRegion { index: i, buffers })?;
            if addr == 0 || len < need {
                return Err(RegionError::TooSmall { name: self.names[i].clone(), need, len, addr }.into());
            }
            f(i, (addr, len))
        })?;
        if seen != buffers {
            return Err(RegionError::Unvisited { seen, buffers }.into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// An owner that answers with `regions` (changeable), as registered
    /// or lying.
    struct Owner(Mutex<Vec<(usize, (u64, usize))>>);

    // SAFETY: the tests below never read or write the regions it yields
    // (their visitors only look at the addresses).
    unsafe impl RegisteredMemory for Owner {
        fn residence(&self) -> Residence {
            Residence::Host
        }

        fn buffers(&self) -> usize {
            3
        }

        fn visit(&self, f: &mut dyn FnMut(usize, (u64, usize)) -> Result<(), RegisteredVisitError>) -> Result<(), RegisteredVisitError> {
            let regions = self.0.lock().unwrap().clone();
            regions.into_iter().try_for_each(|(i, r)| f(i, r))
        }
    }

    fn refusal(r: Result<(), RegisteredVisitError>) -> String {
        match r {
            Err(RegisteredVisitError::Owner(e)) => e.message,
            other => panic!("not refused as the owner's answer: {other:?}"),
        }
    }

    #[test]
    fn an_owners_answers_are_checked_at_registration_and_before_every_use() {
        let layout = super::super::fixtures::layout();
        let needs: Vec<usize> = layout.rank_buffers(0).iter().map(|s| (s.elems * s.dtype.size()) as usize).collect();
        assert_eq!(needs.len(), 3, "the fixture's rank 0 has three buffers");
        let honest: Vec<_> = needs.iter().enumerate().map(|(i, &n)| (i, (0x1000 * (i as u64 + 1), n))).collect();
        let owner = Arc::new(Owner(Mutex::new(honest.clone())));
        let registered = Registered::owned(&layout, 0, owner.clone()).unwrap();
        assert_eq!(registered.current_regions().unwrap(), honest.iter().map(|(_, r)| *r).collect::<Vec<_>>());

        // Moved: followed.
        let moved: Vec<_> = honest.iter().map(|&(i, (a, n))| (i, (a + 0x10_0000, n))).collect();
        *owner.0.lock().unwrap() = moved.clone();
        assert_eq!(registered.current_regions().unwrap()[2], moved[2].1);

        // Shrunk, null, out of order, missing, one too many: refused by name.
        let mut shrunk = honest.clone();
        shrunk[1].1 .1 -= 1;
        let mut null = honest.clone();
        null[0].1 .0 = 0;
        let cases = [
            (shrunk, format!("needs {} bytes, {} found", needs[1], needs[1] - 1)),
            (null, "found at 0x0".to_string()),
            (vec![honest[1], honest[0], honest[2]], "region 1 visited out of order (expected 0)".to_string()),
            (honest[..2].to_vec(), "2 of 3 regions visited".to_string()),
            ([&honest[..], &[(3, (0x9000, 4))]].concat(), "region 3: the rank has 3 buffers".to_string()),
        ];
        for (answers, says) in cases {
            *owner.0.lock().unwrap() = answers;
            let mut touched = 0;
            let why = refusal(RegisteredMemory::visit(&registered, &mut |_, _| {
                touched += 1;
                Ok(())
            }));
            assert!(why.contains(&says), "{why}");
            assert!(touched < 3 || says.contains("rank has"), "a refused visit went on past the refusal: {why}");
            let refused = Registered::owned(&layout, 0, owner.clone()).expect_err("registered a lying owner");
            assert!(refused.to_string().contains(&says), "{refused}");
        }
    }

    #[test]
    fn fixed_regions_must_fit_the_ranks_buffers() {
        let layout = super::super::fixtures::layout();
        let buffer = vec![0u8; 1 << 10];
        let at = buffer.as_ptr() as u64;
        // SAFETY: nothing reads or writes the registered regions here.
        let few = unsafe { Registered::new(&layout, 0, Residence::Host, vec![(at, 64)]) }.expect_err("one region for three buffers");
        assert!(few.to_string().contains("1 regions registered for 3 buffers"), "{few}");
        // SAFETY: as above.
        let small = unsafe { Registered::new(&layout, 0, Residence::Host, vec![(at, 64), (at, 1), (at, 64)]) }.expect_err("too small");
        assert!(small.to_string().contains("buffer '") && small.to_string().contains("1 found"), "{small}");
        // SAFETY: as above.
        let rank = unsafe { Registered::new(&layout, 7, Residence::Host, vec![]) }.expect_err("no rank 7");
        assert!(rank.to_string().contains("the layout has 2 ranks"), "{rank}");
        drop(buffer);
    }
}
