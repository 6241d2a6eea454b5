//! Where a rank's weights live: a [`SourceStore`] on a training rank, a
//! [`SinkStore`] on an inference rank.
//!
//! The source store is the version fence: the optimizer writes it under a
//! write lock ([`SourceStore::update`]) and a refit reads it under the same
//! lock, so a refit never sees half an optimizer step. The sink store is the
//! atomic commit: a refit writes a staging copy, and [`SinkStore::commit`]
//! swaps it in whole; readers take an [`Arc`] snapshot ([`SinkStore::snapshot`])
//! and keep using it however many commits happen meanwhile.

use reshard::{BufferSpec, DType, Layout, Rank};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use transport::RankMemory;

/// A rank's buffers by name, with typed element access.
#[derive(Debug, Clone)]
pub struct Buffers {
    specs: Vec<BufferSpec>,
    memory: RankMemory,
}

impl Buffers {
    /// Zeroed buffers for rank `rank` of `layout`.
    pub fn new(layout: &Layout, rank: Rank) -> Buffers {
        let specs = if rank < layout.ranks() { layout.rank_buffers(rank) } else { Vec::new() };
        let memory = RankMemory::for_buffers(&specs);
        Buffers { specs, memory }
    }

    /// The buffer list (order and sizes the data plane expects).
    pub fn specs(&self) -> &[BufferSpec] {
        &self.specs
    }

    /// Raw memory, in `specs` order.
    pub fn memory(&self) -> &RankMemory {
        &self.memory
    }

    /// Raw memory, mutable.
    pub fn memory_mut(&mut self) -> &mut RankMemory {
        &mut self.memory
    }

    fn index(&self, name: &str) -> Option<usize> {
        self.specs.iter().position(|b| b.name == name)
    }

    /// Bytes of the buffer named `name`.
    pub fn bytes(&self, name: &str) -> Option<&[u8]> {
        self.index(name).map(|i| self.memory.buffers[i].as_slice())
    }

    /// Element type of the buffer named `name`.
    pub fn dtype(&self, name: &str) -> Option<DType> {
        self.index(name).map(|i| self.specs[i].dtype)
    }

    /// The buffer named `name` as `f32` values (converted from its dtype;
    /// f32, f64, bf16 and f16 buffers only).
    pub fn read_f32(&self, name: &str) -> Option<Vec<f32>> {
        let i = self.index(name)?;
        let dtype = self.specs[i].dtype;
        if !dtype.is_convertible_float() {
            return None;
        }
        let raw = &self.memory.buffers[i];
        let mut out = vec![0u8; raw.len() / dtype.size() as usize * 4];
        reshard::dtype::convert_slice(dtype, raw, DType::F32, &mut out);
        Some(out.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// Overwrites the buffer named `name` with `values` (converted to its
    /// dtype). False if there is no such float buffer of that length.
    pub fn write_f32(&mut self, name: &str, values: &[f32]) -> bool {
        let Some(i) = self.index(name) else { return false };
        let dtype = self.specs[i].dtype;
        if !dtype.is_convertible_float() || self.specs[i].elems != values.len() as u64 {
            return false;
        }
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        reshard::dtype::convert_slice(DType::F32, &raw, dtype, &mut self.memory.buffers[i]);
        true
    }
}

/// The weights of one training rank, with a version fence.
#[derive(Debug)]
pub struct SourceStore {
    rank: Rank,
    buffers: Arc<tokio::sync::RwLock<Buffers>>,
    version: AtomicU64,
}

impl SourceStore {
    /// Zeroed weights at version 0 for rank `rank` of `layout`.
    pub fn new(layout: &Layout, rank: Rank) -> SourceStore {
        SourceStore { rank, buffers: Arc::new(tokio::sync::RwLock::new(Buffers::new(layout, rank))), version: AtomicU64::new(0) }
    }

    /// This store's rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The version of the weights (bumped by every [`update`](Self::update)).
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Runs an optimizer step: `f` mutates the weights under the write lock
    /// (waiting for any refit reading them), then the version is bumped.
    /// Returns the new version and `f`'s result.
    pub async fn update<R>(&self, f: impl FnOnce(&mut Buffers) -> R) -> (u64, R) {
        let mut guard = self.buffers.write().await;
        let r = f(&mut guard);
        let v = self.version.fetch_add(1, Ordering::AcqRel) + 1;
        (v, r)
    }

    /// Replaces the weights with a known `version` (a trainer restarted from
    /// a checkpoint of that step): `f` writes them under the write lock, then
    /// the store holds `version`.
    pub async fn restore<R>(&self, version: u64, f: impl FnOnce(&mut Buffers) -> R) -> R {
        let mut guard = self.buffers.write().await;
        let r = f(&mut guard);
        self.version.store(version, Ordering::Release);
        r
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

/// One committed version of an inference rank's weights.
#[derive(Debug)]
pub struct Snapshot {
    /// The version.
    pub version: u64,
    /// The weights.
    pub buffers: Buffers,
}

/// The weights of one inference rank: the committed version readers use,
/// the one before it (so a tensor-parallel group can agree on a version
/// while a commit sweeps over its ranks), and a staging copy that refits
/// write.
#[derive(Debug)]
pub struct SinkStore {
    rank: Rank,
    live: RwLock<Live>,
    staging: Arc<tokio::sync::Mutex<Staging>>,
}

/// The current and the previous committed version.
#[derive(Debug)]
struct Live {
    current: Arc<Snapshot>,
    previous: Option<Arc<Snapshot>>,
}

/// The staging copy and which version it holds completely, if any.
#[derive(Debug)]
pub(crate) struct Staging {
    pub(crate) buffers: Buffers,
    pub(crate) complete: Option<u64>,
}

impl SinkStore {
    /// Zeroed weights at version 0 for rank `rank` of `layout`.
    pub fn new(layout: &Layout, rank: Rank) -> SinkStore {
        let buffers = Buffers::new(layout, rank);
        // Fresh zeroed memory, not a clone: untouched pages cost nothing
        // until a refit writes them.
        let current = Buffers { memory: RankMemory::for_buffers(&buffers.specs), specs: buffers.specs.clone() };
        SinkStore {
            rank,
            live: RwLock::new(Live { current: Arc::new(Snapshot { version: 0, buffers: current }), previous: None }),
            staging: Arc::new(tokio::sync::Mutex::new(Staging { buffers, complete: None })),
        }
    }

    /// This store's rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    fn live(&self) -> std::sync::RwLockReadGuard<'_, Live> {
        self.live.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The committed weights. Keep the `Arc` for as long as one rollout
    /// needs consistent weights; later commits do not change it.
    pub fn snapshot(&self) -> Arc<Snapshot> {
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
        if live.current.version == version {
            return Some(live.current.clone());
        }
        live.previous.as_ref().filter(|p| p.version == version).cloned()
    }

    /// The version readers currently get.
    pub fn version(&self) -> u64 {
        self.live().current.version
    }

    pub(crate) fn staging(&self) -> Arc<tokio::sync::Mutex<Staging>> {
        self.staging.clone()
    }

    /// Makes the staged version `version` the committed one, atomically,
    /// by moving the staging buffers in (no copy). The version before the
    /// previous one becomes the next staging copy if no reader holds it any
    /// more (a refit rewrites every element), else staging is allocated
    /// afresh. Fails (changing nothing) unless staging holds all of
    /// `version`.
    pub(crate) async fn commit(&self, version: u64) -> Result<(), Option<u64>> {
        let mut staging = self.staging.lock().await;
        if staging.complete != Some(version) {
            return Err(staging.complete);
        }
        let blank = Buffers { specs: staging.buffers.specs.clone(), memory: RankMemory::default() };
        let buffers = std::mem::replace(&mut staging.buffers, blank);
        let next = Arc::new(Snapshot { version, buffers });
        let retired = {
            let mut live = self.live.write().unwrap_or_else(|e| e.into_inner());
            let current = std::mem::replace(&mut live.current, next);
            live.previous.replace(current)
        };
        staging.buffers = match retired.map(Arc::try_unwrap) {
            Some(Ok(old)) => old.buffers,
            _ => {
                let specs = staging.buffers.specs.clone();
                Buffers { memory: RankMemory::for_buffers(&specs), specs }
            }
        };
        staging.complete = None;
        Ok(())
    }

    /// Forgets a partly or wholly staged version.
    pub(crate) async fn discard(&self) {
        self.staging.lock().await.complete = None;
    }
}
