//! The simulated communicator and memory: the communicator executor
//! ([`plane`](crate::cuda::plane)) and everything that drives it (the
//! orchestrator's NCCL fabric) run on any machine, deterministically, with
//! faults where a test puts them.
//!
//! * [`SimMemory`] is a rank's host memory ([`RankMemory`]) standing in for
//!   device memory: addresses are host addresses, pieces move with the
//!   host's strided copy kernel (the same conversions as every host
//!   executor), staging is host memory.
//! * [`SimComm`] is a [`CommBackend`] whose communicators meet in this
//!   process by id, inside a named *world* ([`sim_comm`]): creation
//!   completes once every rank joined; a group's sends are copied out at
//!   once into the pair's queue, its receives complete as their messages
//!   arrive (in order per pair, as NCCL matches them); a rank's abort
//!   fails every peer still waiting for a message from it (or for it to
//!   join).
//! * [`arm`] puts [`SimFault`]s on the next communicator of a world: a rank
//!   that never joins, a group that fails or never completes, an abort
//!   that hangs.
//!
//! Test and tooling machinery: nothing in a production path creates a
//! simulated communicator unless a fabric names a simulated world.

use crate::copy::{copy_strided, fits, packed_strides, StridedRef};
use crate::cuda::comm::{BackendError, CommBackend, Fence, GroupError, P2p, Progress};
use crate::cuda::direct::{RegionOffer, SimOffers};
use crate::cuda::id::CommId;
use crate::cuda::ipc::IpcHandle;
use crate::cuda::ipc_comm::IpcCommError;
use crate::cuda::ipc_comm::IpcMemory;
use crate::cuda::plane::PlaneError;
use crate::cuda::plane::{staging_span, PlaneMemory, Side, StagingSide};
use crate::memory::RankMemory;
use reshard::{Block, DType, Endpoint, RankProgram, Span};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use thiserror::Error;

/// Why the simulated communicator refused or failed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum SimError {
    /// A rank joins with a different rank count, or past it.
    #[error("rank {rank} of {nranks} joins a simulated communicator of {size} ranks")]
    WrongSize {
        /// The joining rank.
        rank: u32,
        /// The rank count it names.
        nranks: u32,
        /// The communicator's rank count.
        size: u32,
    },
    /// A rank joined twice.
    #[error("rank {rank} joined the simulated communicator twice")]
    JoinedTwice {
        /// The rank.
        rank: u32,
    },
    /// This rank aborted the communicator.
    #[error("this rank aborted the communicator")]
    Aborted,
    /// A peer aborted before every rank joined.
    #[error("peer rank {peer} aborted before the communicator was complete")]
    PeerAbortedEarly {
        /// The peer.
        peer: u32,
    },
    /// A peer aborted while this rank waited for its message.
    #[error("peer rank {peer} aborted the communicator")]
    PeerAborted {
        /// The peer.
        peer: u32,
    },
    /// A fault a test armed ([`SimFault::GroupFails`]).
    #[error("simulated failure of group {group}")]
    GroupFails {
        /// This rank's group number.
        group: u32,
    },
    /// A message of another size than the receive expects.
    #[error("rank {peer} sent {sent} bytes, rank {me} expected {expected}")]
    MessageSize {
        /// The sender.
        peer: u32,
        /// This rank.
        me: u32,
        /// Bytes sent.
        sent: usize,
        /// Bytes expected.
        expected: u64,
    },
    /// No bucket of this process has the handle.
    #[error("no bucket of that handle in this process (simulated IPC joins ranks of one process)")]
    NoBucket,
    /// A peer's bucket is smaller than it announced.
    #[error("rank {peer}'s bucket holds {holds} bytes, {announced} announced")]
    SmallBucket {
        /// The peer.
        peer: u32,
        /// Bytes the bucket holds.
        holds: usize,
        /// Bytes announced.
        announced: u64,
    },
}

/// A fault of one rank of a simulated communicator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimFault {
    /// The rank's creation never completes (it never joins): every rank's
    /// creation waits out its timeout.
    NeverJoins {
        /// Communicator rank.
        rank: u32,
    },
    /// The rank's `group`-th group (0-based) fails as it starts.
    GroupFails {
        /// Communicator rank.
        rank: u32,
        /// Which group.
        group: u32,
    },
    /// The rank's `group`-th group never completes.
    GroupStalls {
        /// Communicator rank.
        rank: u32,
        /// Which group.
        group: u32,
    },
    /// The rank's abort never returns (its thread is abandoned).
    AbortHangs {
        /// Communicator rank.
        rank: u32,
    },
}

impl SimFault {
    fn rank(&self) -> u32 {
        match *self {
            SimFault::NeverJoins { rank }
            | SimFault::GroupFails { rank, .. }
            | SimFault::GroupStalls { rank, .. }
            | SimFault::AbortHangs { rank } => rank,
        }
    }
}

/// One simulated communicator: its ranks' mailboxes.
struct Comm {
    nranks: u32,
    faults: Vec<SimFault>,
    state: Mutex<CommState>,
}

#[derive(Default)]
struct CommState {
    joined: Vec<bool>,
    /// Messages in flight, by (sender, receiver), oldest first.
    queues: HashMap<(u32, u32), VecDeque<Vec<u8>>>,
    /// Ranks that aborted their end.
    aborted: Vec<u32>,
}

/// A world's armed faults and its live communicators by id.
#[derive(Default)]
struct World {
    armed: Vec<SimFault>,
    comms: HashMap<CommId, Weak<Comm>>,
}

fn worlds() -> MutexGuard<'static, HashMap<String, World>> {
    static WORLDS: OnceLock<Mutex<HashMap<String, World>>> = OnceLock::new();
    WORLDS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

/// Puts `faults` on the next communicator created in `world` (the one after
/// gets none, unless armed again).
pub fn arm(world: &str, faults: Vec<SimFault>) {
    worlds().entry(world.to_string()).or_default().armed.extend(faults);
}

/// Communicators of `world` some rank still holds.
pub fn live_comms(world: &str) -> usize {
    worlds().get(world).map_or(0, |w| w.comms.values().filter(|c| c.strong_count() > 0).count())
}

/// A fresh id for a simulated communicator: unique in this process (a
/// counter) and random across processes.
pub fn sim_comm_id() -> CommId {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let mut bytes = [0u8; crate::cuda::id::COMM_ID_BYTES];
    bytes[..8].copy_from_slice(&NEXT.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    bytes[8..16].copy_from_slice(&crate::shm::random_u64().unwrap_or(0).to_le_bytes());
    bytes[16..20].copy_from_slice(&std::process::id().to_le_bytes());
    // The counter starts at 1: never all zeros.
    CommId::from_bytes(&bytes).unwrap_or_else(|_| unreachable!("a non-zero id of the right length"))
}

/// A rank's end of a simulated communicator (a [`CommBackend`]).
pub struct SimComm {
    comm: Arc<Comm>,
    rank: u32,
    groups: u32,
    /// The group in progress: receives not yet arrived, and whether it stalls.
    pending: Vec<(u32, u64, u64)>,
    stalled: bool,
}

/// Joins `rank` of the `nranks` communicator `id` of `world` (creating it,
/// with the world's armed faults, if it is the first rank).
pub fn sim_comm(world: &str, id: CommId, rank: u32, nranks: u32) -> Result<SimComm, SimError> {
    let comm = {
        let mut worlds = worlds();
        let w = worlds.entry(world.to_string()).or_default();
        w.comms.retain(|_, c| c.strong_count() > 0);
        match w.comms.get(&id).and_then(Weak::upgrade) {
            Some(c) => c,
            None => {
                let faults = std::mem::take(&mut w.armed);
                let c = Arc::new(Comm {
                    nranks,
                    faults,
                    state: Mutex::new(CommState { joined: vec![false; nranks as usize], ..CommState::default() }),
                });
                w.comms.insert(id, Arc::downgrade(&c));
                c
            }
        }
    };
    if comm.nranks != nranks || rank >= nranks {
        return Err(SimError::WrongSize { rank, nranks, size: comm.nranks });
    }
    if !comm.faults.contains(&SimFault::NeverJoins { rank }) {
        let mut state = comm.lock();
        if state.joined[rank as usize] {
            return Err(SimError::JoinedTwice { rank });
        }
        state.joined[rank as usize] = true;
    }
    Ok(SimComm { comm, rank, groups: 0, pending: Vec::new(), stalled: false })
}

impl Comm {
    fn lock(&self) -> MutexGuard<'_, CommState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl SimComm {
    fn fault(&self, f: &SimFault) -> bool {
        self.comm.faults.iter().any(|x| x.rank() == self.rank && x == f)
    }

    fn aborted(&self, state: &CommState) -> Result<(), SimError> {
        match state.aborted.contains(&self.rank) {
            true => Err(SimError::Aborted),
            false => Ok(()),
        }
    }
}

impl CommBackend for SimComm {
    fn poll_init(&mut self) -> Result<Progress, BackendError> {
        let state = self.comm.lock();
        self.aborted(&state)?;
        if state.joined.iter().all(|&j| j) {
            return Ok(Progress::Ready);
        }
        // A rank that aborted before everyone joined never completes it.
        match state.aborted.iter().find(|&&r| !state.joined[r as usize]) {
            Some(&peer) => Err(SimError::PeerAbortedEarly { peer }.into()),
            None => Ok(Progress::Pending),
        }
    }

    fn start_group(&mut self, ops: &[P2p], _after: u64, _round: u32) -> Result<(), GroupError> {
        let group = self.groups;
        self.groups += 1;
        if self.fault(&SimFault::GroupFails { rank: self.rank, group }) {
            return Err(SimError::GroupFails { group }.into());
        }
        self.stalled = self.fault(&SimFault::GroupStalls { rank: self.rank, group });
        let mut state = self.comm.lock();
        self.aborted(&state).map_err(GroupError::from)?;
        self.pending.clear();
        for op in ops {
            match *op {
                P2p::Send { peer, addr, bytes } => {
                    // SAFETY: `CommHandle::group`'s contract: the address
                    // names `bytes` bytes of host memory (simulated device
                    // memory) valid until the group is done.
                    let data = unsafe { std::slice::from_raw_parts(addr as *const u8, bytes as usize) }.to_vec();
                    state.queues.entry((self.rank, peer)).or_default().push_back(data);
                }
                P2p::Recv { peer, addr, bytes } => self.pending.push((peer, addr, bytes)),
            }
        }
        Ok(())
    }

    fn poll_group(&mut self) -> Result<Progress, GroupError> {
        let mut state = self.comm.lock();
        self.aborted(&state).map_err(GroupError::from)?;
        if self.stalled {
            return Ok(Progress::Pending);
        }
        let me = self.rank;
        let mut left = Vec::new();
        for &(peer, addr, bytes) in &self.pending {
            match state.queues.get_mut(&(peer, me)).and_then(VecDeque::pop_front) {
                Some(data) if data.len() as u64 == bytes => {
                    // SAFETY: as in `start_group`, for the receive's memory.
                    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
                }
                Some(data) => return Err(SimError::MessageSize { peer, me, sent: data.len(), expected: bytes }.into()),
                // Nothing more will come from a rank that aborted.
                None if state.aborted.contains(&peer) => return Err(GroupError::peer(SimError::PeerAborted { peer })),
                None => left.push((peer, addr, bytes)),
            }
        }
        self.pending = left;
        Ok(if self.pending.is_empty() { Progress::Ready } else { Progress::Pending })
    }

    fn check(&mut self) -> Result<(), BackendError> {
        Ok(self.aborted(&self.comm.lock())?)
    }

    fn abort(&mut self) -> Result<Progress, BackendError> {
        {
            let mut state = self.comm.lock();
            if !state.aborted.contains(&self.rank) {
                state.aborted.push(self.rank);
            }
        }
        if self.fault(&SimFault::AbortHangs { rank: self.rank }) {
            // Never returns, as an abort that hangs on a dead peer.
            let (lock, cv) = (Mutex::new(()), Condvar::new());
            let mut guard = lock.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                guard = cv.wait(guard).unwrap_or_else(|e| e.into_inner());
            }
        }
        self.pending.clear();
        Ok(Progress::Ready)
    }

    fn poll_abort(&mut self) -> Result<Progress, BackendError> {
        Ok(Progress::Ready)
    }
}

fn abandoned() -> MutexGuard<'static, Vec<Vec<u8>>> {
    static ABANDONED: OnceLock<Mutex<Vec<Vec<u8>>>> = OnceLock::new();
    ABANDONED.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

/// Bytes of simulated staging given up after failed groups (kept until the
/// process ends, as the GPU's are: `nccl::leaked_staging_bytes`).
pub fn abandoned_staging_bytes() -> u64 {
    abandoned().iter().map(|b| b.len() as u64).sum()
}

/// A region of a [`SimMemory`]: its base address and length.
#[derive(Clone, Copy)]
struct Region {
    at: u64,
    len: usize,
}

/// A rank's host memory as the communicator executor's memory.
pub struct SimMemory<'a> {
    /// The rank's memory, if it is a `RankMemory` (else raw regions).
    memory: Option<&'a mut RankMemory>,
    dtypes: Vec<DType>,
    addrs: Vec<u64>,
    lens: Vec<usize>,
    send: Vec<u8>,
    recv: Vec<u8>,
    /// An exported send-staging bucket used instead of `send`.
    bucket: Option<Arc<SimBucket>>,
    /// Regions peers of this process offered, mapped for this run.
    peers: Vec<Region>,
}

impl<'a> SimMemory<'a> {
    /// `memory` for one run.
    pub fn new(memory: &'a mut RankMemory) -> SimMemory<'a> {
        let addrs = memory.buffers.iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
        let lens = memory.buffers.iter().map(Vec::len).collect();
        let dtypes = memory.dtypes.clone();
        SimMemory { memory: Some(memory), dtypes, addrs, lens, send: Vec::new(), recv: Vec::new(), bucket: None, peers: Vec::new() }
    }

    /// Raw host regions (address, bytes) holding buffers of `dtypes`, for
    /// one run: memory the user registered in place.
    ///
    /// # Safety
    /// Every region must be host memory valid for reads and writes of its
    /// bytes, touched by nothing else, while the value lives.
    pub unsafe fn from_regions(regions: &[(u64, usize)], dtypes: Vec<DType>) -> SimMemory<'a> {
        SimMemory {
            memory: None,
            dtypes,
            addrs: regions.iter().map(|r| r.0).collect(),
            lens: regions.iter().map(|r| r.1).collect(),
            send: Vec::new(),
            recv: Vec::new(),
            bucket: None,
            peers: Vec::new(),
        }
    }

    /// This memory, packing its messages into an exported bucket
    /// ([`SimIpc::bucket`]).
    pub fn packing_into(self, bucket: Arc<SimBucket>) -> SimMemory<'a> {
        SimMemory { bucket: Some(bucket), ..self }
    }

    /// `memory` for one run whose messages are packed into an exported
    /// bucket ([`SimIpc::bucket`]; the IPC communicator's peers read them
    /// there).
    pub fn with_bucket(memory: &'a mut RankMemory, bucket: Arc<SimBucket>) -> SimMemory<'a> {
        SimMemory::new(memory).packing_into(bucket)
    }

    /// The region `side` names (a buffer of the rank, its staging or its
    /// exported bucket), if the piece fits it.
    /// Bytes `at..at + len` of staging `which` (the exported bucket, for
    /// sends, where there is one); an error naming the staging if they
    /// are not all inside it.
    fn staging_bytes(&mut self, which: StagingSide, at: u64, len: usize) -> Result<&mut [u8], PlaneError> {
        let all: &mut [u8] = match (which, &self.bucket) {
            // SAFETY: the bucket is this rank's, alive while `self` holds
            // its `Arc`; peers read it only inside a group (between a ready
            // and a released doorbell), and this is called between groups —
            // never after a failed one, whose run ends there — so nothing
            // else touches it while the slice lives (this call).
            (StagingSide::Send, Some(b)) => unsafe { std::slice::from_raw_parts_mut(b.ptr, b.len) },
            (StagingSide::Send, None) => &mut self.send,
            (StagingSide::Recv, _) => &mut self.recv,
        };
        let span = staging_span(which, all.len(), at, len)?;
        Ok(&mut all[span])
    }

    fn region_of(&mut self, block: &Block, side: &Side) -> Option<Region> {
        let buffers = self.addrs.iter().zip(&self.lens).map(|(&at, &len)| Region { at, len });
        let staging = [&mut self.send, &mut self.recv].into_iter().map(|s| Region { at: s.as_mut_ptr() as u64, len: s.len() });
        let bucket = self.bucket.iter().map(|b| Region { at: b.ptr as u64, len: b.len });
        let mut regions = buffers.chain(staging).chain(bucket).chain(self.peers.iter().copied());
        regions.find(|r| r.at == side.0 && fits(block.extent(), r.len, side.1.base, &side.1.strides, side.2))
    }
}

/// An exported bucket of host memory (the simulated IPC allocation).
pub struct SimBucket {
    ptr: *mut u8,
    len: usize,
    _mem: Box<[u8]>,
}

// SAFETY: the bucket is written by its owner's executor (packing) and read
// by peers only between a *ready* doorbell and their *released* one, which
// the doorbell transport orders (a channel or socket: happens-before).
unsafe impl Send for SimBucket {}
// SAFETY: as above.
unsafe impl Sync for SimBucket {}

fn buckets() -> MutexGuard<'static, HashMap<IpcHandle, Weak<SimBucket>>> {
    static BUCKETS: OnceLock<Mutex<HashMap<IpcHandle, Weak<SimBucket>>>> = OnceLock::new();
    BUCKETS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

/// The simulated [`IpcMemory`]: an exported bucket of host memory, and the
/// peers' buckets mapped by handle (in this process: a bucket lives as long
/// as its owner or a peer that mapped it holds it).
pub struct SimIpc {
    bucket: Arc<SimBucket>,
    peers: HashMap<u32, Arc<SimBucket>>,
}

impl SimIpc {
    /// A bucket of `bytes` exported under a fresh handle.
    pub fn export(bytes: u64) -> (SimIpc, IpcHandle) {
        let mut mem = vec![0u8; bytes as usize].into_boxed_slice();
        let bucket = Arc::new(SimBucket { ptr: mem.as_mut_ptr(), len: mem.len(), _mem: mem });
        let mut raw = [0u8; crate::cuda::ipc::IPC_HANDLE_BYTES];
        raw.copy_from_slice(&[sim_comm_id().as_bytes()[..32].to_vec(), sim_comm_id().as_bytes()[..32].to_vec()].concat());
        let handle = IpcHandle::from_bytes(&raw).unwrap_or_else(|_| unreachable!("a non-zero handle of the right length"));
        let mut all = buckets();
        all.retain(|_, b| b.strong_count() > 0);
        all.insert(handle, Arc::downgrade(&bucket));
        (SimIpc { bucket, peers: HashMap::new() }, handle)
    }

    /// The exported bucket, for the executor to pack into
    /// ([`SimMemory::with_bucket`]).
    pub fn bucket(&self) -> Arc<SimBucket> {
        self.bucket.clone()
    }

    /// Maps communicator rank `peer`'s bucket of `bytes` by its handle.
    pub fn map_peer(&mut self, peer: u32, handle: &IpcHandle, bytes: u64) -> Result<(), SimError> {
        let b = buckets().get(handle).and_then(Weak::upgrade).ok_or(SimError::NoBucket)?;
        if (b.len as u64) < bytes {
            return Err(SimError::SmallBucket { peer, holds: b.len, announced: bytes });
        }
        self.peers.insert(peer, b);
        Ok(())
    }
}

impl IpcMemory for SimIpc {
    fn staging(&self) -> (u64, u64) {
        (self.bucket.ptr as u64, self.bucket.len as u64)
    }

    fn wait(&mut self, _after: u64) -> Result<(), BackendError> {
        // Host copies are done when they return.
        Ok(())
    }

    unsafe fn pull(&mut self, peer: u32, offset: u64, dst: u64, bytes: u64) -> Result<(), BackendError> {
        let b = self.peers.get(&peer).ok_or(IpcCommError::NotMapped { peer })?;
        if offset.checked_add(bytes).is_none_or(|end| end > b.len as u64) {
            return Err(IpcCommError::OutsideBucket { peer, bytes, offset, holds: b.len as u64 }.into());
        }
        // SAFETY: the source lies in the peer's live bucket (checked, and
        // held by the `Arc`), written by nobody until this rank releases
        // it; the destination is the caller's guarantee.
        unsafe { std::ptr::copy_nonoverlapping(b.ptr.add(offset as usize), dst as *mut u8, bytes as usize) };
        Ok(())
    }

    fn pulled(&mut self) -> Result<Progress, BackendError> {
        Ok(Progress::Ready)
    }

    fn abandon(&mut self) {
        // Peers that mapped the bucket hold it alive themselves.
    }
}

fn view(r: Region, side: &Side) -> StridedRef {
    // SAFETY: `r` is a live region of this memory (a buffer the run
    // borrows mutably, or staging it owns) of `r.len` bytes; every reader
    // checks the view's offsets against that length.
    unsafe { StridedRef::new(r.at as *const u8, r.len, side.1.base, side.1.strides, side.2) }
}

impl PlaneMemory for SimMemory<'_> {
    fn addrs(&self) -> &[u64] {
        &self.addrs
    }

    fn lens(&self) -> &[usize] {
        &self.lens
    }

    fn dtypes(&self) -> &[DType] {
        &self.dtypes
    }

    fn staging(&mut self, which: StagingSide, len: usize) -> Result<u64, PlaneError> {
        if let (StagingSide::Send, Some(b)) = (which, &self.bucket) {
            return match len <= b.len {
                true => Ok(b.ptr as u64),
                false => Err(PlaneError::BucketTooSmall { need: len, holds: b.len }),
            };
        }
        let s = match which {
            StagingSide::Send => &mut self.send,
            StagingSide::Recv => &mut self.recv,
        };
        if s.len() < len {
            *s = vec![0; len];
        }
        Ok(s.as_mut_ptr() as u64)
    }

    fn move_piece(&mut self, block: &Block, from: Side, wire: DType, to: &[Side]) -> Result<(), PlaneError> {
        let mut find = |side: &Side| self.region_of(block, side).ok_or_else(|| PlaneError::outside(block, side, "memory and staging"));
        let src = view(find(&from)?, &from);
        let counts = block.extent();
        let mut through = Vec::new();
        let src = if from.2 != wire && to.iter().any(|t| t.2 != wire) {
            // Both conversions happen: through the wire dtype, as a sender
            // and a receiver would.
            // (The source was found to fit a region: its element count
            // is bounded by that region's.)
            through = vec![0u8; block.numel().saturating_mul(wire.size()) as usize];
            let side: Side = (through.as_mut_ptr() as u64, Span { buffer: 0, base: 0, strides: packed_strides(counts) }, wire);
            let packed = view(Region { at: side.0, len: through.len() }, &side);
            // SAFETY: both views name live, disjoint regions (a region of
            // this memory that `region_of` found the piece to fit — or a
            // region a peer of this process offered, which it keeps alive
            // and unwritten until this rank's done token, sent only after
            // this copy returned, and never if this run fails first — and
            // `through`, owned here and sized to the packed piece).
            unsafe { copy_strided(counts, &src, &packed) };
            packed
        } else {
            src
        };
        for t in to {
            let dst = view(find(t)?, t);
            // SAFETY: as above; the destination is a buffer or staging of
            // this rank that no other thread touches now, and never the
            // piece's own source (the executor moves a piece between
            // different places).
            unsafe { copy_strided(counts, &src, &dst) };
        }
        drop(through);
        Ok(())
    }

    fn fence(&mut self) -> Result<Option<Fence>, PlaneError> {
        // Host copies are done when `move_piece` returns.
        Ok(None)
    }

    fn abandon_staging(&mut self) -> u64 {
        let bytes = (self.send.len() + self.recv.len()) as u64;
        // The communicator may still write them: never free them (kept
        // reachable, and counted, until the process ends).
        let mut kept = abandoned();
        kept.push(std::mem::take(&mut self.send));
        kept.push(std::mem::take(&mut self.recv));
        bytes
    }

    fn read_staging(&mut self, which: StagingSide, at: u64, out: &mut [u8]) -> Result<(), PlaneError> {
        let from = self.staging_bytes(which, at, out.len())?;
        out.copy_from_slice(from);
        Ok(())
    }

    fn write_staging(&mut self, which: StagingSide, at: u64, bytes: &[u8]) -> Result<(), PlaneError> {
        self.staging_bytes(which, at, bytes.len())?.copy_from_slice(bytes);
        Ok(())
    }

    fn finish(&mut self) -> Result<(), PlaneError> {
        Ok(())
    }

    fn quantize(&mut self, program: &RankProgram) -> Result<(), PlaneError> {
        match &mut self.memory {
            Some(memory) => Ok(crate::exec::quantize_rank(program, memory)?),
            None if program.quantize.is_empty() => Ok(()),
            None => Err(PlaneError::QuantizeRegions),
        }
    }

    fn offer(&mut self, buffer: u32) -> Result<RegionOffer, PlaneError> {
        let i = buffer as usize;
        match (self.addrs.get(i), self.lens.get(i)) {
            (Some(&at), Some(&len)) => Ok(SimOffers::offer(at, len as u64)),
            _ => Err(PlaneError::NoBuffer { buffer, buffers: self.addrs.len() }),
        }
    }

    fn map_offer(&mut self, _peer: Endpoint, offer: &RegionOffer) -> Result<u64, PlaneError> {
        let at = SimOffers::map(offer)?;
        let len = usize::try_from(offer.len).map_err(|_| PlaneError::RegionTooLarge { len: offer.len })?;
        // Read (by `move_piece`) only while the offering member waits for
        // this rank's done token, writing nothing.
        // Once per region: every piece's side is looked up among them.
        if !self.peers.iter().any(|r| r.at == at && r.len == len) {
            self.peers.push(Region { at, len });
        }
        Ok(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Staging reads and writes outside the staging (a length a peer
    /// announced, an offset past the end, sums that wrap) are refused and
    /// touch nothing; the exported bucket is bounded the same way.
    #[test]
    fn staging_reads_and_writes_outside_the_staging_are_refused() {
        let mut rank = RankMemory { buffers: vec![vec![7u8; 16]], dtypes: vec![DType::U8] };
        let (ipc, _) = SimIpc::export(64);
        let mut memory = SimMemory::with_bucket(&mut rank, ipc.bucket());
        memory.staging(StagingSide::Recv, 32).unwrap();
        memory.write_staging(StagingSide::Recv, 24, &[1; 8]).unwrap();
        let mut out = [0u8; 8];
        memory.read_staging(StagingSide::Recv, 24, &mut out).unwrap();
        assert_eq!(out, [1; 8]);
        for (at, len) in [(25, 8), (32, 1), (u64::MAX, 8), (1 << 40, 0)] {
            let mut out = vec![9u8; len];
            assert!(memory.read_staging(StagingSide::Recv, at, &mut out).is_err(), "read of {len} at {at}");
            assert!(out.iter().all(|&b| b == 9), "a refused read wrote");
            assert!(memory.write_staging(StagingSide::Recv, at, &vec![5u8; len]).is_err(), "write of {len} at {at}");
        }
        // The bucket: 64 bytes, whatever the send staging was asked for.
        memory.write_staging(StagingSide::Send, 56, &[3; 8]).unwrap();
        assert!(memory.write_staging(StagingSide::Send, 57, &[3; 8]).is_err());
        assert!(memory.read_staging(StagingSide::Send, 0, &mut [0u8; 65]).is_err());
        let mut back = [0u8; 8];
        memory.read_staging(StagingSide::Recv, 24, &mut back).unwrap();
        assert_eq!(back, [1; 8], "refused writes left the staging as it was");
        drop(memory);
        assert_eq!(rank.buffers[0], vec![7u8; 16], "the rank's buffers were never touched");
    }
}
