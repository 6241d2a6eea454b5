//! The weights of one destination (inference) rank: [`DstStore`], its
//! committed [`Snapshot`]s, staging copy and commit, and a reader's hold
//! on registered memory ([`Serving`]).

use super::{Buffers, Registered};
use crate::protocol::HeldVersion;
use reshard::{Layout, Rank};
use std::sync::{Arc, RwLock};

/// One committed version of a destination rank's weights.
#[derive(Debug)]
pub struct Snapshot {
    /// The version.
    pub version: u64,
    /// The weights.
    pub buffers: Buffers,
}

/// The weights of one destination (inference) rank: the committed version
/// readers use, the one before it (so a tensor-parallel group can agree on
/// a version while a commit sweeps over its ranks), and a staging copy that
/// refits write.
///
/// A store over **registered** memory ([`DstStore::registered`]: the
/// inference engine's own device buffers) serves one version, in that
/// memory: a refit writes the member's staging (device memory of the
/// fabric's), and the commit copies it in while no reader holds the
/// store ([`DstStore::serve`]).
#[derive(Debug)]
pub struct DstStore {
    rank: Rank,
    layout: Arc<Layout>,
    live: RwLock<Live>,
    staging: Arc<tokio::sync::Mutex<StagedCopy>>,
    /// The user's memory the weights are served in, if registered.
    registered: Option<Registered>,
    /// Refits write the registered memory in place
    /// ([`DstStore::registered_direct`]).
    direct: bool,
    /// Readers of registered memory hold it shared ([`Serving`]); a
    /// commit into that memory holds it exclusively.
    fence: Arc<tokio::sync::RwLock<()>>,
}

/// The current and the previous committed version (none before the first
/// commit).
#[derive(Debug, Default)]
struct Live {
    current: Option<Arc<Snapshot>>,
    previous: Option<Arc<Snapshot>>,
    /// Registered memory a commit failed to copy into whole: it holds
    /// neither the last committed version nor the new one.
    torn: bool,
    /// The last version committed whole.
    last: Option<u64>,
}

/// A reader's hold on a destination's served weights
/// ([`DstStore::serve`]): while it lives, no commit changes them. Readers
/// of registered memory (an inference engine's device buffers) keep it for
/// as long as their work reads the weights — until that work has finished
/// on the device, not just been queued.
#[derive(Debug)]
pub struct Serving {
    version: Option<u64>,
    _fence: tokio::sync::OwnedRwLockReadGuard<()>,
}

impl Serving {
    /// The version the weights hold while this hold lasts (`None`:
    /// nothing committed yet, or registered memory torn by a failed
    /// commit: not to be used).
    pub fn version(&self) -> Option<u64> {
        self.version
    }
}

/// A commit's exclusive hold on a destination's served weights: taken by
/// the member once its run staged the whole version
/// ([`DstStore::fence_for_commit`]), released by the commit or a discard.
pub(crate) type CommitFence = tokio::sync::OwnedRwLockWriteGuard<()>;

/// The staging copy and which version it holds completely, if any.
#[derive(Debug)]
pub(crate) struct StagedCopy {
    pub(crate) buffers: Buffers,
    pub(crate) complete: Option<u64>,
}

impl DstStore {
    /// A store for rank `rank` of `layout` that serves nothing until the
    /// first refit commits.
    pub fn new(layout: &Arc<Layout>, rank: Rank) -> DstStore {
        let buffers = Buffers::new(layout, rank);
        DstStore::with(layout, rank, buffers, None)
    }

    /// A store that serves its weights in `registered` memory (the
    /// inference engine's own buffers, one region per buffer of the rank):
    /// a refit on the NCCL or IPC fabric writes the member's staging and
    /// the commit copies it into the memory, once every member of both
    /// groups succeeded and no reader [serves](Self::serve) it; a failed
    /// refit never touches it. The store holds none of the bytes (its
    /// snapshots' [`Buffers`] answer [`BufferError::Registered`](super::BufferError::Registered)); readers
    /// use the memory itself, inside [`serve`](Self::serve). Serves nothing
    /// until the first refit commits.
    pub fn registered(layout: &Arc<Layout>, rank: Rank, registered: Registered) -> DstStore {
        let buffers = Buffers::over(layout, rank, registered.clone());
        DstStore::with(layout, rank, buffers, Some(registered))
    }

    /// A store over `registered` host memory that refits write **in
    /// place**: for the usual RL loop, where the engine does not serve
    /// while its weights are updated. No staging copy is kept (the store
    /// holds no memory of the weights' size) and a commit copies nothing.
    /// A refit waits for the readers ([`serve`](Self::serve)) to let go
    /// (within its deadline) and holds them off from its first byte until
    /// its commit; from that first byte the memory holds no whole version:
    /// if the refit fails, the store is torn ([`HeldVersion::Torn`], `serve`
    /// names no version) until the next refit commits. Every destination
    /// of a refit still commits only once all of them ran to the end, so
    /// a group never serves two versions; but a failed refit leaves it
    /// serving none, where [`registered`](Self::registered) leaves it
    /// serving the version before. On the NCCL and IPC fabrics, or over
    /// device memory, refits stage as for `registered`.
    pub fn registered_direct(layout: &Arc<Layout>, rank: Rank, registered: Registered) -> DstStore {
        DstStore { direct: true, ..DstStore::registered(layout, rank, registered) }
    }

    fn with(layout: &Arc<Layout>, rank: Rank, buffers: Buffers, registered: Option<Registered>) -> DstStore {
        DstStore {
            rank,
            layout: layout.clone(),
            live: RwLock::default(),
            staging: Arc::new(tokio::sync::Mutex::new(StagedCopy { buffers, complete: None })),
            registered,
            direct: false,
            fence: Arc::default(),
        }
    }

    /// Whether refits write the registered memory in place
    /// ([`registered_direct`](Self::registered_direct)).
    pub fn writes_in_place(&self) -> bool {
        self.direct
    }

    /// The registered memory the weights are served in, if any.
    pub fn registered_memory(&self) -> Option<&Registered> {
        self.registered.as_ref()
    }

    /// Holds the served weights for a reader: waits while a commit copies
    /// into registered memory, then no commit changes them until the hold
    /// is dropped (a refit that staged its version meanwhile waits for it,
    /// within its deadline). On a store of host memory, snapshots never
    /// change anyway; the hold only names the version.
    pub async fn serve(&self) -> Serving {
        let fence = self.fence.clone().read_owned().await;
        Serving { version: self.version(), _fence: fence }
    }

    /// The weights as a refit finds them: nothing committed, a version, or
    /// registered memory torn by a commit that failed midway (served again
    /// after the next refit commits).
    pub fn weights(&self) -> HeldVersion {
        let live = self.live();
        match (&live.current, live.torn) {
            (_, true) => HeldVersion::Torn { after: live.last },
            (Some(s), false) => HeldVersion::Version(s.version),
            (None, false) => HeldVersion::Unwritten,
        }
    }

    /// This store's rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    fn live(&self) -> std::sync::RwLockReadGuard<'_, Live> {
        self.live.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The committed weights, `None` before the first refit. Keep the `Arc`
    /// for as long as one rollout needs consistent weights; later commits
    /// do not change it.
    pub fn snapshot(&self) -> Option<Arc<Snapshot>> {
        self.live().current.clone()
    }

    /// The committed weights of `version`, if it is the current or the
    /// previous committed version. The ranks of a tensor-parallel group
    /// agree on a version (the orchestrator's last committed one, say) and
    /// each reads it here: a commit in progress across the group, which
    /// flips ranks one after another, cannot make them read different
    /// versions.
    pub fn snapshot_at(&self, version: u64) -> Option<Arc<Snapshot>> {
        let live = self.live();
        if let Some(current) = live.current.as_ref().filter(|s| s.version == version) {
            return Some(current.clone());
        }
        live.previous.as_ref().filter(|s| s.version == version).cloned()
    }

    /// The version readers currently get; `None` before the first refit.
    pub fn version(&self) -> Option<u64> {
        self.live().current.as_ref().map(|s| s.version)
    }

    pub(crate) fn staging(&self) -> Arc<tokio::sync::Mutex<StagedCopy>> {
        self.staging.clone()
    }

    /// Makes the staged version `version` the committed one, atomically,
    /// by moving the staging buffers in (no copy). The version before the
    /// previous one becomes the next staging copy if no reader holds it any
    /// more (a refit rewrites every element), else staging is allocated
    /// afresh. Fails (changing nothing) unless staging holds all of
    /// `version`.
    pub(crate) async fn commit(&self, version: u64) -> Result<(), Option<u64>> {
        debug_assert!(self.registered.is_none(), "registered stores commit through `publish`");
        let mut staging = self.staging.lock().await;
        if staging.complete != Some(version) {
            return Err(staging.complete);
        }
        let blank = staging.buffers.emptied();
        let buffers = std::mem::replace(&mut staging.buffers, blank);
        let next = Arc::new(Snapshot { version, buffers });
        let retired = {
            let mut live = self.live.write().unwrap_or_else(|e| e.into_inner());
            live.last = Some(version);
            let current = live.current.replace(next);
            std::mem::replace(&mut live.previous, current)
        };
        staging.buffers = match retired.map(Arc::try_unwrap) {
            Some(Ok(old)) => old.buffers,
            _ => staging.buffers.zeroed_like(),
        };
        staging.complete = None;
        Ok(())
    }

    /// Forgets a partly or wholly staged version.
    pub(crate) async fn discard(&self) {
        self.staging.lock().await.complete = None;
    }

    /// The exclusive hold a commit into registered memory needs: waits for
    /// the readers [serving](Self::serve) the weights to let go, at most
    /// `within`; `None` if they did not.
    pub(crate) async fn fence_for_commit(&self, within: std::time::Duration) -> Option<CommitFence> {
        tokio::time::timeout(within, self.fence.clone().write_owned()).await.ok()
    }

    /// Registered memory now holds `version` whole (the commit copied it
    /// in under `_fence`): readers get it from here on.
    pub(crate) fn publish(&self, version: u64, _fence: &CommitFence) {
        if let Some(registered) = &self.registered {
            let buffers = Buffers::over(&self.layout, self.rank, registered.clone());
            let mut live = self.live.write().unwrap_or_else(|e| e.into_inner());
            // Registered memory holds one version: the one before is gone.
            *live = Live { current: Some(Arc::new(Snapshot { version, buffers })), previous: None, torn: false, last: Some(version) };
        }
    }

    /// A commit into registered memory failed midway (under `_fence`): the
    /// memory holds no whole version; nothing is served until the next
    /// refit commits.
    pub(crate) fn tear(&self, _fence: &CommitFence) {
        let mut live = self.live.write().unwrap_or_else(|e| e.into_inner());
        live.current = None;
        live.previous = None;
        live.torn = true;
    }
}
