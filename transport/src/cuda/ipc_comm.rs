//! The CUDA IPC communicator: ranks of one node (on one GPU or several)
//! exchange each round's messages through memory they map from each other,
//! behind the same [`CommBackend`] as NCCL, so the one communicator
//! executor ([`run_rank_comm`](crate::cuda::plane::run_rank_comm)) runs
//! them.
//!
//! Every rank exports **one** send-staging bucket per data-plane epoch (one
//! IPC handle per rank, never one per tensor; a new epoch exports a new
//! one), sized for its largest round; its peers map it once. A round:
//!
//! 1. the sender's executor packs the round's messages into the bucket and
//!    records a fence; its group waits (on the host) for the fence, then
//!    rings each receiver's doorbell: *ready* (round, offset, bytes);
//! 2. a receiver, for each ready message it expects, queues a copy from the
//!    sender's mapped bucket into its own receive staging; once the copies
//!    are done it rings the sender's doorbell: *released*;
//! 3. a rank's group is complete when every message it expects has been
//!    copied and every message it sent has been released — so a bucket is
//!    repacked only after its last reader let go.
//!
//! Doorbells are tiny messages over a host [`Transport`] (the node fabric:
//! authenticated TCP, shared memory between ranks of a node), and an abort
//! is that transport's abort: peers waiting on this rank fail at once.
//! What "mapping" and "copying" are is an [`IpcMemory`]: device memory
//! through `cuIpcGetMemHandle`/`cuIpcOpenMemHandle` and device copies
//! (`gpu::GpuIpc`, `cuda` feature), or host memory in this process
//! ([`sim::SimIpc`](crate::cuda::sim::SimIpc)).
//!
//! Invariant: **a bucket a peer may still read is never freed.** After a
//! failed or unfinished group the bucket is given up
//! ([`IpcMemory::abandon`]) instead of freed.

use crate::cuda::comm::{BackendError, CommBackend, GroupError, P2p, Progress};
use crate::transport::{Payload, Transport, TransportError};
use reshard::Endpoint;
use std::time::Instant;
use thiserror::Error;

/// Why the IPC communicator failed: its doorbells, or the buckets it reads.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum IpcCommError {
    /// A doorbell's bytes could not be read (the system's reason).
    #[error("reading a doorbell: {0}")]
    ReadDoorbell(String),
    /// A data message arrived where a doorbell belongs.
    #[error("a data message where a doorbell belongs")]
    NotADoorbell,
    /// A doorbell of the wrong size or kind.
    #[error("a malformed doorbell of {bytes} bytes")]
    MalformedDoorbell {
        /// Its bytes.
        bytes: usize,
    },
    /// A rank of the communicator without an endpoint.
    #[error("rank {rank} has no endpoint")]
    NoEndpoint {
        /// The rank.
        rank: u32,
    },
    /// A doorbell from an endpoint that is no rank of the communicator.
    #[error("a doorbell from {from}, not a rank here")]
    NotARank {
        /// The sender.
        from: Endpoint,
    },
    /// A send outside the exported bucket.
    #[error("a send of {bytes} bytes at {addr:#x} is outside the exported bucket ({len} bytes at {base:#x})")]
    SendOutsideBucket {
        /// Bytes of the send.
        bytes: u64,
        /// Its address.
        addr: u64,
        /// Bytes of the bucket.
        len: u64,
        /// The bucket's address.
        base: u64,
    },
    /// Ringing a peer's doorbell failed.
    #[error("peer rank {peer}: {source}")]
    Ring {
        /// The peer.
        peer: u32,
        /// The transport's error.
        #[source]
        source: TransportError,
    },
    /// A peer's doorbells are gone (it aborted, or its link broke).
    #[error("peer rank {peer} is gone: {source}")]
    PeerGone {
        /// The peer.
        peer: u32,
        /// The transport's error.
        #[source]
        source: TransportError,
    },
    /// The doorbells failed otherwise.
    #[error(transparent)]
    Doorbells(TransportError),
    /// A ready doorbell from a peer this round expects no message from.
    #[error("round {round}: an unexpected message from {from}")]
    Unexpected {
        /// The round.
        round: u32,
        /// The sender.
        from: Endpoint,
    },
    /// A message of another size than expected.
    #[error("round {round}: {from} sent {sent} bytes, {expected} expected")]
    MessageSize {
        /// The round.
        round: u32,
        /// The sender.
        from: Endpoint,
        /// Bytes announced.
        sent: u64,
        /// Bytes expected.
        expected: u64,
    },
    /// A released doorbell for a message this rank did not send.
    #[error("round {round}: {from} released a message it was not sent")]
    NotSent {
        /// The round.
        round: u32,
        /// The peer.
        from: Endpoint,
    },
    /// A peer's bucket is not mapped here.
    #[error("rank {peer}'s bucket is not mapped here")]
    NotMapped {
        /// The peer.
        peer: u32,
    },
    /// A read outside a peer's bucket.
    #[error("rank {peer}: {bytes} bytes at {offset} are outside its {holds}-byte bucket")]
    OutsideBucket {
        /// The peer.
        peer: u32,
        /// Bytes read.
        bytes: u64,
        /// Where.
        offset: u64,
        /// Bytes of the bucket.
        holds: u64,
    },
}

/// The memory side of an IPC communicator.
pub trait IpcMemory: Send {
    /// This rank's exported send-staging bucket: base address and bytes.
    fn staging(&self) -> (u64, u64);
    /// Waits (on the host) until the work before device event `after` is
    /// done (0: none).
    fn wait(&mut self, after: u64) -> Result<(), BackendError>;
    /// Queues a copy of `bytes` at `offset` of `peer`'s mapped bucket into
    /// `dst` (this rank's memory).
    ///
    /// # Safety
    /// `dst` must name `bytes` bytes this rank may write, untouched by
    /// other work until [`IpcMemory::pulled`] reports the copy done.
    unsafe fn pull(&mut self, peer: u32, offset: u64, dst: u64, bytes: u64) -> Result<(), BackendError>;
    /// Whether every copy queued so far is done.
    fn pulled(&mut self) -> Result<Progress, BackendError>;
    /// Gives the bucket up without freeing it (a peer may still read it),
    /// and keeps the peers' buckets mapped for good while this rank's own
    /// copies from them may still run.
    fn abandon(&mut self);
}

/// Doorbell kinds.
const READY: u8 = 1;
const RELEASED: u8 = 2;
/// A doorbell's bytes: kind, offset, length.
const BELL: usize = 17;

fn bell(kind: u8, offset: u64, bytes: u64) -> Payload {
    let mut b = Vec::with_capacity(BELL);
    b.push(kind);
    b.extend_from_slice(&offset.to_le_bytes());
    b.extend_from_slice(&bytes.to_le_bytes());
    Payload::Bytes(b)
}

fn read_bell(payload: Payload) -> Result<(u8, u64, u64), IpcCommError> {
    let b = match payload {
        Payload::Bytes(b) => b,
        Payload::Lent(l) => l.as_slice().to_vec(),
        Payload::Stream(mut f) => {
            let mut b = vec![0u8; f.len().min(BELL as u64 + 1) as usize];
            f.read_exact(&mut b).map_err(|e| IpcCommError::ReadDoorbell(e.to_string()))?;
            b
        }
        Payload::Pieces(_) | Payload::Segments { .. } => return Err(IpcCommError::NotADoorbell),
    };
    if b.len() != BELL || !(b[0] == READY || b[0] == RELEASED) {
        return Err(IpcCommError::MalformedDoorbell { bytes: b.len() });
    }
    let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
    Ok((b[0], word(1), word(9)))
}

/// A receive of the group in progress.
#[derive(Clone, Copy, Debug)]
struct Expected {
    peer: u32,
    addr: u64,
    bytes: u64,
    /// The copy was queued.
    pulling: bool,
}

/// One rank of an IPC communicator (a `CommBackend`).
pub struct IpcComm<T: Transport, M: IpcMemory> {
    /// Every communicator rank's endpoint.
    endpoints: Vec<Endpoint>,
    doorbells: T,
    memory: M,
    round: u32,
    expected: Vec<Expected>,
    /// Peers this rank sent a message to in the group in progress that
    /// have not released it yet.
    unreleased: Vec<u32>,
    /// Peers whose doorbells failed (they aborted or went away), and why:
    /// fatal to a group that waits on one of them, and only then (a peer
    /// that finished its program and left owes this rank nothing).
    gone: Vec<IpcCommError>,
    /// A group was started and has not completed cleanly.
    dirty: bool,
}

impl<T: Transport, M: IpcMemory> IpcComm<T, M> {
    /// Rank `endpoints[i]` is communicator rank `i`; `doorbells` reaches
    /// every peer this rank exchanges with, `memory` holds this rank's
    /// bucket and its peers' mapped ones.
    pub fn new(endpoints: Vec<Endpoint>, doorbells: T, memory: M) -> IpcComm<T, M> {
        IpcComm { endpoints, doorbells, memory, round: 0, expected: Vec::new(), unreleased: Vec::new(), gone: Vec::new(), dirty: false }
    }

    fn endpoint(&self, rank: u32) -> Result<Endpoint, IpcCommError> {
        self.endpoints.get(rank as usize).copied().ok_or(IpcCommError::NoEndpoint { rank })
    }

    /// Fails if the group waits on a peer that is gone.
    fn waits_on_gone(&self) -> Result<(), GroupError> {
        let waited = |p: u32| self.expected.iter().any(|e| e.peer == p) || self.unreleased.contains(&p);
        match self.gone.iter().find(|e| matches!(e, IpcCommError::PeerGone { peer, .. } if waited(*peer))) {
            Some(why) => Err(GroupError::peer(why.clone())),
            None => Ok(()),
        }
    }

    fn rank_of(&self, from: Endpoint) -> Result<u32, IpcCommError> {
        self.endpoints.iter().position(|&x| x == from).map(|i| i as u32).ok_or(IpcCommError::NotARank { from })
    }
}

impl<T: Transport, M: IpcMemory> CommBackend for IpcComm<T, M> {
    fn poll_init(&mut self) -> Result<Progress, BackendError> {
        // The doorbells are connected and the peers' buckets mapped before
        // the communicator is made.
        Ok(Progress::Ready)
    }

    fn start_group(&mut self, ops: &[P2p], after: u64, round: u32) -> Result<(), GroupError> {
        self.dirty = true;
        self.round = round;
        self.expected.clear();
        self.unreleased.clear();
        // The packing is done before any peer may read it.
        self.memory.wait(after)?;
        let (base, len) = self.memory.staging();
        for op in ops {
            match *op {
                P2p::Send { peer, addr, bytes } => {
                    let offset = addr.checked_sub(base).filter(|o| o + bytes <= len).ok_or(IpcCommError::SendOutsideBucket {
                        bytes,
                        addr,
                        len,
                        base,
                    })?;
                    let to = self.endpoint(peer)?;
                    self.doorbells
                        .send(round, to, bell(READY, offset, bytes))
                        .map_err(|source| GroupError::peer(IpcCommError::Ring { peer, source }))?;
                    self.unreleased.push(peer);
                }
                P2p::Recv { peer, addr, bytes } => self.expected.push(Expected { peer, addr, bytes, pulling: false }),
            }
        }
        Ok(())
    }

    fn poll_group(&mut self) -> Result<Progress, GroupError> {
        // Take every doorbell that has rung.
        loop {
            match self.doorbells.recv(self.round, Instant::now()) {
                Ok((from, payload)) => {
                    let peer = self.rank_of(from)?;
                    match read_bell(payload)? {
                        (READY, offset, bytes) => {
                            let e = self
                                .expected
                                .iter_mut()
                                .find(|e| e.peer == peer && !e.pulling)
                                .ok_or(IpcCommError::Unexpected { round: self.round, from })?;
                            if e.bytes != bytes {
                                let (round, expected) = (self.round, e.bytes);
                                return Err(IpcCommError::MessageSize { round, from, sent: bytes, expected }.into());
                            }
                            // SAFETY: `addr` is this rank's receive staging
                            // for the message (the executor's, valid until
                            // the group completes, which waits for the copy).
                            unsafe { self.memory.pull(peer, offset, e.addr, bytes) }?;
                            e.pulling = true;
                        }
                        _ => {
                            let i = self.unreleased.iter().position(|&p| p == peer);
                            let i = i.ok_or(IpcCommError::NotSent { round: self.round, from })?;
                            self.unreleased.swap_remove(i);
                        }
                    }
                }
                Err(TransportError::Timeout { .. }) => break,
                Err(
                    source @ (TransportError::PeerAborted { peer, .. }
                    | TransportError::Broken { peer, .. }
                    | TransportError::Disconnected { peer }),
                ) => {
                    let peer = self.rank_of(peer)?;
                    self.gone.push(IpcCommError::PeerGone { peer, source });
                }
                Err(e) => return Err(IpcCommError::Doorbells(e).into()),
            }
        }
        self.waits_on_gone()?;
        let pulling: Vec<u32> = self.expected.iter().filter(|e| e.pulling).map(|e| e.peer).collect();
        if !pulling.is_empty() && self.memory.pulled()? == Progress::Ready {
            for peer in pulling {
                let to = self.endpoint(peer)?;
                self.doorbells
                    .send(self.round, to, bell(RELEASED, 0, 0))
                    .map_err(|source| GroupError::peer(IpcCommError::Ring { peer, source }))?;
            }
            self.expected.retain(|e| !e.pulling);
        }
        if self.expected.is_empty() && self.unreleased.is_empty() {
            self.dirty = false;
            return Ok(Progress::Ready);
        }
        Ok(Progress::Pending)
    }

    fn check(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    fn abort(&mut self) -> Result<Progress, BackendError> {
        self.doorbells.abort("the IPC communicator was aborted");
        if self.dirty {
            // A peer may still be reading this bucket.
            self.memory.abandon();
        }
        Ok(Progress::Ready)
    }

    fn poll_abort(&mut self) -> Result<Progress, BackendError> {
        Ok(Progress::Ready)
    }
}

/// The device side (`cuda` feature): buckets exported and mapped through
/// CUDA IPC, copies on a stream of the rank's device.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use super::{IpcCommError, IpcMemory};
    use crate::cuda::comm::{BackendError, Progress};
    use crate::cuda::copyplan::CopyOp;
    use crate::cuda::device::{issue, DeviceMemory, GpuDevice, GpuError, Loc};
    use crate::cuda::ipc::IpcHandle;
    use reshard::{BufferKey, BufferSpec, DType, Endpoint};
    use std::collections::HashMap;

    /// The one buffer of a send-staging bucket of `bytes` bytes.
    pub(crate) fn staging_spec(bytes: u64) -> BufferSpec {
        BufferSpec { key: BufferKey::Named(0), name: "ipc send staging".into(), dtype: DType::U8, elems: bytes.max(1) }
    }

    /// A rank's exported bucket and its peers' mapped ones, on its device.
    pub struct GpuIpc {
        dev: GpuDevice,
        bucket: Option<DeviceMemory>,
        base: u64,
        len: u64,
        peers: HashMap<u32, DeviceMemory>,
        done: Option<cudarc::driver::CudaEvent>,
    }

    // SAFETY: the device memory and events are used only by the thread
    // that owns this value (the communicator's); CUDA handles may be used
    // from any thread once the context is bound, which `wait`/`pull` do.
    unsafe impl Send for GpuIpc {}

    impl GpuIpc {
        /// Allocates this rank's send-staging bucket of `bytes` on device
        /// `ordinal` and exports it: the bucket and its handle.
        pub fn export(ordinal: usize, me: Endpoint, bytes: u64) -> Result<(GpuIpc, IpcHandle), GpuError> {
            let dev = GpuDevice::open(ordinal)?;
            let bucket = DeviceMemory::for_buffers(&dev, me, &[staging_spec(bytes)])?;
            let handle = bucket.export_ipc(&dev)?;
            let base = bucket.device_addrs()[0];
            Ok((GpuIpc { dev, bucket: Some(bucket), base, len: bytes, peers: HashMap::new(), done: None }, handle))
        }

        /// Maps communicator rank `peer`'s bucket of `bytes` from its handle.
        pub fn map_peer(&mut self, peer: u32, owner: Endpoint, handle: &IpcHandle, bytes: u64) -> Result<(), GpuError> {
            // SAFETY: the handle is the peer's exported bucket of one buffer
            // of `bytes` (its own spec, sent with it); it stays exported for
            // the epoch, and is only read (by `pull`).
            let mem = unsafe { DeviceMemory::import_ipc(&self.dev, owner, &[staging_spec(bytes)], handle) }?;
            self.peers.insert(peer, mem);
            Ok(())
        }
    }

    impl IpcMemory for GpuIpc {
        fn staging(&self) -> (u64, u64) {
            (self.base, self.len)
        }

        fn wait(&mut self, after: u64) -> Result<(), BackendError> {
            if after == 0 {
                return Ok(());
            }
            self.dev.bind()?;
            // SAFETY: `after` is a live event of this device's context (the
            // executor keeps it until its next fence).
            unsafe { cudarc::driver::sys::cuEventSynchronize(after as cudarc::driver::sys::CUevent) }
                .result()
                .map_err(|source| BackendError::Driver { what: "waiting for the packing".into(), source })
        }

        unsafe fn pull(&mut self, peer: u32, offset: u64, dst: u64, bytes: u64) -> Result<(), BackendError> {
            let src = self.peers.get(&peer).ok_or(IpcCommError::NotMapped { peer })?;
            let len = src.buffer_lens()[0] as u64;
            if offset.checked_add(bytes).is_none_or(|end| end > len) {
                return Err(IpcCommError::OutsideBucket { peer, bytes, offset, holds: len }.into());
            }
            let op = CopyOp {
                src: 0,
                dst: 0,
                width: bytes,
                height: 1,
                depth: 1,
                src_pitch: bytes,
                src_height: 1,
                dst_pitch: bytes,
                dst_height: 1,
            };
            self.dev.bind()?;
            // SAFETY: the source lies in the peer's mapped bucket (checked
            // above); the destination is the caller's guarantee.
            unsafe { issue(&op, Loc::Device(src.device_addrs()[0] + offset), Loc::Device(dst), self.dev.stream().cu_stream()) }
                .map_err(|source| BackendError::Driver { what: format!("copying from rank {peer}'s bucket"), source })?;
            self.done = Some(self.dev.fence()?);
            Ok(())
        }

        fn pulled(&mut self) -> Result<Progress, BackendError> {
            Ok(crate::cuda::device::event_progress(self.done.as_ref(), "waiting for the copies from mapped buckets")?)
        }

        fn abandon(&mut self) {
            // Never unmapped or freed: a peer may still read it.
            std::mem::forget(self.bucket.take());
            // Copies this rank queued from peers' mapped buckets may still
            // run: closing those mappings under them would fault the
            // context (which the framework's own work shares). Unless the
            // last copy is known to be done, keep them mapped for good.
            if !matches!(self.pulled(), Ok(Progress::Ready)) {
                std::mem::forget(std::mem::take(&mut self.peers));
            }
        }
    }
}
