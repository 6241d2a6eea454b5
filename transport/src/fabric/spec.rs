//! What a fabric is (the settings every member of a refit opens its
//! endpoint from) and where a peer is: plain data, serde, so the member
//! protocol carries them as they are.

use crate::cuda::{CommId, IpcHandle};
use reshard::Endpoint;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

/// How the members of a refit reach each other.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Fabric {
    /// Channels between members of this process; a receiver copies straight
    /// out of the sender's buffers. Only for members that all live in the
    /// orchestrator's process.
    #[default]
    InProcess,
    /// Shared memory between ranks of one node, TCP between nodes: members
    /// in any process, on any host.
    Node(NodeFabric),
    /// One communicator over every member of both groups (sources first,
    /// then destinations), a group of sends and receives per round: NCCL
    /// between GPUs, or the simulated communicator.
    Nccl(NcclFabric),
    /// CUDA IPC between members of one node (one GPU or several): each
    /// member exports one send bucket per data-plane epoch, its receivers
    /// map it and copy out of it, doorbells go over TCP.
    Ipc(IpcFabric),
}

/// Settings of the CUDA IPC fabric.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcFabric {
    /// What the buckets are: device memory through CUDA IPC
    /// ([`CommPlane::Cuda`], each member on its GPU), or host memory of
    /// this process ([`CommPlane::Simulated`]; the world's name is unused).
    pub plane: CommPlane,
    /// Time every member has to connect its doorbells and map its peers'
    /// buckets.
    pub connect_timeout: Duration,
    /// Time an abort may take before its thread is abandoned.
    pub abort_timeout: Duration,
}

impl IpcFabric {
    /// Settings with the default timeouts (30 s to connect, 10 s to abort).
    pub fn new(plane: CommPlane) -> IpcFabric {
        IpcFabric { plane, connect_timeout: Duration::from_secs(30), abort_timeout: Duration::from_secs(10) }
    }
}

/// Settings of the communicator fabric.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NcclFabric {
    /// What the communicators are.
    pub plane: CommPlane,
    /// Time every member's communicator has to be created (all together).
    pub init_timeout: Duration,
    /// Time an abort may take before its thread is abandoned (the member's
    /// process should then be restarted).
    pub abort_timeout: Duration,
}

impl NcclFabric {
    /// Settings with the default timeouts (60 s to create, 10 s to abort).
    pub fn new(plane: CommPlane) -> NcclFabric {
        NcclFabric { plane, init_timeout: Duration::from_secs(60), abort_timeout: Duration::from_secs(10) }
    }
}

/// Where the communicator fabric's communicators live.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CommPlane {
    /// NCCL, each member on its GPU ([`Site::gpu`](super::Site::gpu));
    /// needs the `cuda` feature, CUDA and NCCL at run time, and a GPU per
    /// member.
    Cuda,
    /// The simulated communicator in the named world, over the members'
    /// host memory: every member in one process. For tests and tools:
    /// failures are armed per world ([`crate::cuda::arm`]).
    Simulated {
        /// The world's name.
        world: String,
    },
}

/// Settings of the node fabric.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeFabric {
    /// A CRC-32C on every data frame.
    pub checksum: bool,
    /// Per-rank egress caps, for emulating a cluster's links on one machine.
    pub emulation: EgressCaps,
    /// Time every member has to connect to its peers.
    pub connect_timeout: Duration,
    /// Ranks of one node talk through shared memory (off: TCP between
    /// every pair, as if every rank were a node of its own).
    pub shared_memory: bool,
    /// With `shared_memory`: ranks on one host ([`PeerAddr::host`]) talk
    /// through shared memory too, whatever their group and node (a
    /// training and an inference group on one machine); TCP only between
    /// hosts. Only on hosts of at most 16 of the refit's ranks (each pair
    /// that talks holds a region); on a host with more, ranks share memory
    /// within their node. Off where ranks of one machine stand for
    /// different hosts (links emulated in the senders).
    pub same_host: bool,
}

impl Fabric {
    /// The most bytes a rank should stage in one round of a plan over this
    /// fabric (sends plus receives, what [`PlanOptions::max_staging_bytes`](reshard::PlanOptions::max_staging_bytes)
    /// bounds), where the fabric has a bound of its own: on the node
    /// fabric with shared memory, half a rank's lend budget, so that a
    /// round's messages to the peers it shares memory with are lent (one
    /// copy in, one out) with room for the next round's while they are
    /// read; a message larger than its pair's lend area streams through
    /// a buffer of its size at the receiver.
    pub fn round_bytes(&self) -> Option<u64> {
        match self {
            Fabric::Node(node) if node.shared_memory => Some(crate::ShmConfig::default().lend_bytes / 2),
            _ => None,
        }
    }
}

impl Default for NodeFabric {
    fn default() -> Self {
        NodeFabric {
            checksum: false,
            emulation: EgressCaps::default(),
            connect_timeout: Duration::from_secs(30),
            shared_memory: true,
            same_host: true,
        }
    }
}

/// Caps on each rank's egress in bytes/s (token buckets in its sender);
/// `None`: uncapped. The inter-node one is off when something else shapes
/// the network (emulated hosts, whose links the kernel shapes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressCaps {
    /// Towards ranks of other nodes (TCP).
    pub inter_node_bytes_per_s: Option<u64>,
    /// Towards ranks of its own node (shared memory).
    pub intra_node_bytes_per_s: Option<u64>,
}

/// A peer's data-plane address for one refit (`Connect`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerAddr {
    /// The peer.
    pub endpoint: Endpoint,
    /// Its node within its group (ranks of one node share memory).
    pub node: u32,
    /// Its host and user ([`this_host`](super::this_host)): the node
    /// fabric's ranks on one host, of one user, share memory
    /// ([`NodeFabric::same_host`]).
    pub host: super::Host,
    /// Where its end of the data plane is reached.
    pub addr: DataAddr,
}

/// Where a member's end of one refit's data plane is reached, by fabric.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DataAddr {
    /// The in-process fabric: channels of this process, nothing to reach.
    InProcess,
    /// The node fabric: where it listens.
    Node(SocketAddr),
    /// A rank of one communicator (NCCL, or the simulated one).
    Comm {
        /// The communicator's id, from source rank 0 (NCCL's unique id
        /// names rank 0's bootstrap address); `None` from the others.
        id: Option<CommId>,
        /// The GPU the member's rank is on (its UUID; on the simulated
        /// plane `sim-gpu<n>`, or the endpoint where none is configured):
        /// two ranks of a communicator on one GPU are refused.
        device: String,
    },
    /// A rank of the CUDA IPC fabric.
    Ipc {
        /// Where its doorbells listen.
        doorbells: SocketAddr,
        /// Its exported send bucket, and the bucket's bytes.
        bucket: IpcHandle,
        /// Bytes of the bucket.
        bytes: u64,
        /// Its GPU, as on the communicator fabric: peers on the same one
        /// read each other's memory directly.
        device: String,
    },
}

impl fmt::Display for DataAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataAddr::InProcess => write!(f, "in-process"),
            DataAddr::Node(at) => write!(f, "{at}"),
            DataAddr::Comm { id, device } => write!(f, "communicator {}@{device}", if id.is_some() { "id" } else { "rank" }),
            DataAddr::Ipc { doorbells, bytes, device, .. } => write!(f, "ipc {doorbells} (bucket of {bytes} bytes)@{device}"),
        }
    }
}
