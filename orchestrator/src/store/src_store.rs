//! The weights of one source (training) rank: [`SrcStore`], the version
//! fence optimizer steps write under, and [`UpdateGuard`], a step in
//! progress.

use super::{Buffers, Registered, Residence};
use crate::protocol::HeldVersion;
use reshard::{Layout, Rank};
use std::sync::{Arc, Mutex};

/// The version state of a source store.
#[derive(Debug, Clone, Copy, Default)]
struct SrcState {
    /// The last version written whole (None: nothing written yet).
    version: Option<u64>,
    /// A step failed (or panicked) after writing: the weights are neither
    /// `version` nor a new one.
    torn: bool,
}

/// Marks a store torn if the step it guards unwinds.
struct TornOnUnwind<'a>(&'a Mutex<SrcState>);

impl Drop for TornOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).torn = true;
        }
    }
}

/// The weights of one source (training) rank, with a version fence.
///
/// A step that can fail: [`try_update`](Self::try_update) keeps the version
/// when it fails, and refits refuse weights a failed step changed.
#[derive(Debug)]
pub struct SrcStore {
    rank: Rank,
    buffers: Arc<tokio::sync::RwLock<Buffers>>,
    state: Mutex<SrcState>,
    /// Where registered weights live (`None`: the store's own buffers).
    residence: Option<Residence>,
}

impl SrcStore {
    /// Zeroed weights for rank `rank` of `layout`, with no version: a refit
    /// refuses the store until [`update`](Self::update) or
    /// [`restore`](Self::restore) writes it.
    pub fn new(layout: &Arc<Layout>, rank: Rank) -> SrcStore {
        let buffers = Arc::new(tokio::sync::RwLock::new(Buffers::new(layout, rank)));
        SrcStore { rank, buffers, state: Mutex::default(), residence: None }
    }

    /// A store over weights the user holds in `registered` memory (device
    /// buffers a framework's optimizer writes in place): a refit on the
    /// NCCL or IPC fabric reads them where they are, with no copy; the
    /// store keeps the version and the fence. Steps write the memory with
    /// the user's own code inside [`update`](Self::update) (the buffers
    /// passed to it hold no bytes); a step that fails leaves the store torn,
    /// since the store cannot tell whether it wrote. No version until the
    /// first `update` or `restore`.
    pub fn registered(layout: &Arc<Layout>, rank: Rank, registered: Registered) -> SrcStore {
        let residence = Some(registered.residence());
        let buffers = Arc::new(tokio::sync::RwLock::new(Buffers::over(layout, rank, registered)));
        SrcStore { rank, buffers, state: Mutex::default(), residence }
    }

    /// Where the weights are registered, for a store over registered
    /// memory ([`SrcStore::registered`]).
    pub fn registered_residence(&self) -> Option<Residence> {
        self.residence
    }

    /// This store's rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    fn state(&self) -> std::sync::MutexGuard<'_, SrcState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The version of the weights: the last successful
    /// [`update`](Self::update) or [`restore`](Self::restore); `None`
    /// before the first.
    pub fn version(&self) -> Option<u64> {
        self.state().version
    }

    /// The weights as a refit finds them: unwritten, a version, or torn by
    /// a failed step (refits refuse this rank until the next successful
    /// `update` or `restore`).
    pub fn weights(&self) -> HeldVersion {
        match *self.state() {
            SrcState { torn: true, version } => HeldVersion::Torn { after: version },
            SrcState { version: Some(v), .. } => HeldVersion::Version(v),
            SrcState { version: None, .. } => HeldVersion::Unwritten,
        }
    }

    /// Runs one optimizer step: `step` changes the weights under the write
    /// lock (waiting for any refit reading them), then the version goes up
    /// by one (to 1 for the first step). Returns the new version and the
    /// step's value. A step that can fail: [`try_update`](Self::try_update).
    pub async fn update<R>(&self, step: impl FnOnce(&mut Buffers) -> R) -> (u64, R) {
        let done = self.write(|v| v.map_or(1, |v| v + 1), |b| Ok::<R, std::convert::Infallible>(step(b))).await;
        done.unwrap_or_else(|never| match never {})
    }

    /// [`update`](Self::update) for a step that can fail. On `Ok` the
    /// version goes up by one; on `Err` it stays, and if the step had
    /// already written (any mutable access to the buffers) the store
    /// becomes torn: refits refuse it until a later step or a restore
    /// succeeds, so no refit passes changed weights off as the old version.
    pub async fn try_update<T, E>(&self, step: impl FnOnce(&mut Buffers) -> Result<T, E>) -> Result<(u64, T), E> {
        self.write(|v| v.map_or(1, |v| v + 1), step).await
    }

    /// Replaces the weights with a known `version` (initial weights, or a
    /// trainer restarted from a checkpoint of that step): `write` fills
    /// them under the write lock, then the store holds `version`.
    pub async fn restore<R>(&self, version: u64, write: impl FnOnce(&mut Buffers) -> R) -> R {
        let done = self.write(|_| version, |b| Ok::<R, std::convert::Infallible>(write(b))).await;
        done.map(|(_, r)| r).unwrap_or_else(|never| match never {})
    }

    /// [`restore`](Self::restore) for a `write` that can fail; on `Err` as
    /// for [`try_update`](Self::try_update).
    pub async fn try_restore<T, E>(&self, version: u64, write: impl FnOnce(&mut Buffers) -> Result<T, E>) -> Result<T, E> {
        self.write(|_| version, write).await.map(|(_, r)| r)
    }

    /// Runs `f` under the write lock; on `Ok` the store holds version
    /// `next(current)`, whole; on `Err` (or a panic) it keeps its version
    /// and is torn if `f` had written.
    async fn write<T, E>(
        &self,
        next: impl FnOnce(Option<u64>) -> u64,
        f: impl FnOnce(&mut Buffers) -> Result<T, E>,
    ) -> Result<(u64, T), E> {
        let mut guard = self.buffers.write().await;
        guard.written = false;
        let unwinding = TornOnUnwind(&self.state);
        let result = f(&mut guard);
        drop(unwinding);
        let mut state = self.state();
        match result {
            Ok(value) => {
                let v = next(state.version);
                *state = SrcState { version: Some(v), torn: false };
                Ok((v, value))
            }
            Err(e) => {
                // Registered memory may have been written without a trace.
                state.torn |= guard.written || guard.registered.is_some();
                Err(e)
            }
        }
    }

    /// Starts a step that runs outside a closure (a Python optimizer step
    /// between two calls, say): waits for the write lock and holds it until
    /// the guard is [finished](UpdateGuard::finish) (the version goes up by
    /// one) or dropped (the step failed: the version stays, and the store
    /// is torn if the step wrote — always, for registered memory).
    pub async fn begin_update(self: &Arc<Self>) -> UpdateGuard {
        let mut guard = self.buffers.clone().write_owned().await;
        guard.written = false;
        UpdateGuard { store: self.clone(), guard: Some(guard) }
    }

    /// Reads the weights (shared with other readers, excluded from updates).
    pub async fn read<R>(&self, f: impl FnOnce(&Buffers) -> R) -> R {
        f(&*self.buffers.read().await)
    }

    /// The lock a refit holds while it reads this rank's weights.
    pub(crate) fn lock(&self) -> Arc<tokio::sync::RwLock<Buffers>> {
        self.buffers.clone()
    }
}

/// A step in progress on a [`SrcStore`], holding its write lock
/// ([`SrcStore::begin_update`]).
pub struct UpdateGuard {
    store: Arc<SrcStore>,
    /// `None` once finished.
    guard: Option<tokio::sync::OwnedRwLockWriteGuard<Buffers>>,
}

impl std::fmt::Debug for UpdateGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpdateGuard").field("rank", &self.store.rank).finish_non_exhaustive()
    }
}

impl UpdateGuard {
    /// The buffers the step writes (no bytes for registered memory, which
    /// the step writes in place).
    pub fn buffers(&mut self) -> Option<&mut Buffers> {
        self.guard.as_deref_mut()
    }

    /// The step succeeded: the store holds the next version, whole.
    /// Returns it.
    pub fn finish(mut self) -> u64 {
        let mut state = self.store.state();
        let v = state.version.map_or(1, |v| v + 1);
        *state = SrcState { version: Some(v), torn: false };
        drop(state);
        self.guard = None;
        v
    }
}

impl Drop for UpdateGuard {
    fn drop(&mut self) {
        if let Some(guard) = self.guard.take() {
            // Not finished: the step failed.
            self.store.state().torn |= guard.written || guard.registered.is_some();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fixtures::layout;
    use crate::store::BufferError;

    #[tokio::test]
    async fn failed_steps_keep_the_version() {
        let store = SrcStore::new(&layout(), 0);
        assert_eq!((store.version(), store.weights()), (None, HeldVersion::Unwritten));
        let (v, ()) = store.try_update(|b| b.tensor_mut("b")?.write_f32(&[1.0, 2.0])).await.unwrap();
        assert_eq!((v, store.weights()), (1, HeldVersion::Version(1)));
        // Fails before writing: nothing changed, the store stays clean.
        assert!(store.try_update(|b| b.tensor_mut("nope").map(drop)).await.is_err());
        assert_eq!(store.weights(), HeldVersion::Version(1));
        // Fails after writing: torn until the next good step.
        let failed: Result<_, BufferError> = store
            .try_update(|b| {
                b.tensor_mut("b")?.write_f32(&[3.0, 4.0])?;
                b.tensor_mut("w")?.write_f32(&[0.0])
            })
            .await;
        assert!(failed.is_err());
        assert_eq!((store.version(), store.weights()), (Some(1), HeldVersion::Torn { after: Some(1) }));
        store.try_restore(7, |b| b.tensor_mut("b")?.write_f32(&[1.0, 2.0])).await.unwrap();
        assert_eq!(store.weights(), HeldVersion::Version(7));
        let (v, ()) = store.update(|_| ()).await;
        assert_eq!(v, 8);
        store.restore(3, |_| ()).await;
        assert_eq!(store.weights(), HeldVersion::Version(3));
        // A panicking step tears the store too.
        let store = Arc::new(store);
        let s = store.clone();
        let panicked = tokio::spawn(async move { s.update(|b| b.tensor_mut("b").map(|_| panic!("step failed"))).await }).await;
        assert!(panicked.is_err());
        assert_eq!(store.weights(), HeldVersion::Torn { after: Some(3) });
        store.restore(7, |_| ()).await;
        assert_eq!(store.weights(), HeldVersion::Version(7));
    }
}
