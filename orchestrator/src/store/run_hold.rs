//! A rank's memory for one run of its program, as its store lends it for
//! a version in one call: held for as long as the run goes (a source's
//! write fence, a destination's staging), then let go ([`RunHold`]). The
//! store alone decides where the memory is (its own buffers, memory a user
//! registered, a copy of what it serves); the member only runs on it.

use super::dst_store::StagedCopy;
use super::{Buffers, DstStore, Registered, Snapshot, SrcStore};
use crate::protocol::{HeldVersion, Refusal};
use std::sync::Arc;
use transport::fabric::{RegisteredStaging, RunMemory};

/// Memory lent for one run.
pub(crate) trait RunHold: Send + 'static {
    /// Its own work before the run, on the run's thread (a copy that must
    /// not hold up the member's runtime).
    fn prepare(&mut self) {}

    /// The memory the run moves.
    fn memory(&mut self) -> RunMemory<'_>;

    /// After the run (`ok`: it succeeded), before the hold is let go.
    fn ran(&mut self, _ok: bool) {}
}

/// A source's weights under its store's write fence: no step writes them
/// while peers read them.
pub(crate) struct SourceHold(tokio::sync::OwnedRwLockWriteGuard<Buffers>);

impl RunHold for SourceHold {
    fn memory(&mut self) -> RunMemory<'_> {
        // Registered weights are read where their owner holds them (its
        // regions re-derived first: memory it moved or freed since is
        // never read).
        self.0.run_memory()
    }
}

/// The version a destination serves, for a replica it seeds: read where it
/// is served (registered memory: only its member's commits write it, and
/// none comes while it runs) or from a copy of its committed snapshot (the
/// executor takes a rank's host memory mutably; it only reads a source's).
pub(crate) enum ServedHold {
    /// Registered memory, read where it is.
    Registered(Registered),
    /// A copy of the committed snapshot.
    Copy(Buffers),
}

impl RunHold for ServedHold {
    fn memory(&mut self) -> RunMemory<'_> {
        match self {
            ServedHold::Registered(registered) => RunMemory::Registered(registered),
            ServedHold::Copy(buffers) => RunMemory::Host(buffers.memory_mut()),
        }
    }
}

/// A destination's staging copy, holding `version` completely once the run
/// succeeds (its commit then moves it in).
pub(crate) struct StagingHold {
    staged: tokio::sync::OwnedMutexGuard<StagedCopy>,
    version: u64,
    /// The served version whose `carried` buffers go into the staging
    /// first.
    carry: Option<(Arc<Snapshot>, Vec<u32>)>,
}

impl RunHold for StagingHold {
    fn prepare(&mut self) {
        if let Some((base, carried)) = self.carry.take() {
            carry(&carried, &base.buffers, &mut self.staged.buffers);
        }
    }

    fn memory(&mut self) -> RunMemory<'_> {
        RunMemory::Host(self.staged.buffers.memory_mut())
    }

    fn ran(&mut self, ok: bool) {
        if ok {
            self.staged.complete = Some(self.version);
        }
    }
}

/// A registered destination's staging on the fabric's side (device memory
/// on a communicator fabric), which its member keeps between refits; the
/// registered memory is only read here (to fill the staging first).
pub(crate) struct RegisteredStagingHold {
    pub(crate) registered: Registered,
    pub(crate) staging: Option<RegisteredStaging>,
}

impl RunHold for RegisteredStagingHold {
    fn memory(&mut self) -> RunMemory<'_> {
        RunMemory::Staged { registered: &self.registered, staging: &mut self.staging }
    }
}

/// Registered memory written in place (a destination written directly,
/// its readers held off by its commit fence).
impl RunHold for Registered {
    fn memory(&mut self) -> RunMemory<'_> {
        RunMemory::Registered(self)
    }
}

/// Why a rank holding (or serving) `weights` cannot send `version`, if
/// it cannot.
fn not_holding(weights: HeldVersion, version: u64) -> Option<Refusal> {
    match weights {
        HeldVersion::Version(held) if held == version => None,
        HeldVersion::Version(held) => Some(Refusal::VersionMismatch { held, asked: version }),
        other => Some(Refusal::NoWeights(other)),
    }
}

impl SrcStore {
    /// This rank's weights of `version` for a run that sends them, under
    /// the store's write fence; refused unless the store holds `version`.
    pub(crate) async fn hold_for_run(&self, version: u64) -> Result<SourceHold, Refusal> {
        let guard = self.lock().write_owned().await;
        match not_holding(self.weights(), version) {
            Some(refusal) => Err(refusal),
            None => Ok(SourceHold(guard)),
        }
    }
}

impl DstStore {
    /// The served `version`, for a run that seeds a replica with it;
    /// refused unless the store serves `version`.
    pub(crate) fn hold_served(&self, version: u64) -> Result<ServedHold, Refusal> {
        if let Some(refusal) = not_holding(self.weights(), version) {
            return Err(refusal);
        }
        if let Some(registered) = self.registered_memory() {
            return Ok(ServedHold::Registered(registered.clone()));
        }
        match self.snapshot_at(version) {
            Some(snap) => Ok(ServedHold::Copy(snap.buffers.clone())),
            None => Err(Refusal::NoWeights(self.weights())),
        }
    }

    /// The staging copy, for a run that writes `version` into it: emptied
    /// of any earlier complete version, and holding the `carried` buffers
    /// of the version it serves, copied in by [`RunHold::prepare`] (a
    /// subset refit writes the subset's elements over them; refused with
    /// nothing served).
    pub(crate) async fn hold_staging(&self, version: u64, carried: &[u32]) -> Result<StagingHold, Refusal> {
        let base = match (carried.is_empty(), self.snapshot()) {
            (true, _) => None,
            (false, Some(snap)) => Some(snap),
            (false, None) => return Err(Refusal::NoBaseVersion),
        };
        let mut staged = self.staging().lock_owned().await;
        staged.complete = None;
        Ok(StagingHold { staged, version, carry: base.map(|b| (b, carried.to_vec())) })
    }
}

/// Copies the `carried` buffers of a committed version into staging. Both
/// hold the rank's layout buffers, alike.
fn carry(carried: &[u32], from: &Buffers, to: &mut Buffers) {
    let to = to.memory_mut();
    for &i in carried {
        if let (Some(src), Some(dst)) = (from.memory().buffers.get(i as usize), to.buffers.get_mut(i as usize)) {
            if src.len() == dst.len() {
                dst.copy_from_slice(src);
            }
        }
    }
}
