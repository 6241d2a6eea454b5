//! The link model: per-rank network and intra-node bandwidths, used by the
//! planner to choose senders and relays and by [`estimate`](crate::Plan::estimate)
//! to predict refit time.

/// Bandwidths of one rank's links, in bytes per second, per direction.
///
/// A transfer between ranks on different nodes uses the sender's network
/// egress and the receiver's network ingress; one inside a node uses the
/// intra-node link (NVLink) of both. Source and destination groups are on
/// different nodes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkModel {
    /// Network bandwidth of one rank (its NIC), each direction.
    pub net_bytes_per_s: f64,
    /// Intra-node bandwidth of one rank, each direction.
    pub intra_bytes_per_s: f64,
    /// Fixed cost per message, in seconds.
    pub message_latency_s: f64,
}

impl LinkModel {
    /// DGX H100: one 400 Gb/s NIC per GPU, NVLink 4 at 900 GB/s per GPU
    /// (450 GB/s each direction).
    pub const DGX_H100: LinkModel = LinkModel { net_bytes_per_s: 50e9, intra_bytes_per_s: 450e9, message_latency_s: 10e-6 };
    /// GB200 NVL72: one 800 Gb/s NIC per GPU, NVLink 5 at 1.8 TB/s per GPU.
    pub const GB200: LinkModel = LinkModel { net_bytes_per_s: 100e9, intra_bytes_per_s: 900e9, message_latency_s: 10e-6 };
}

impl Default for LinkModel {
    fn default() -> Self {
        LinkModel::DGX_H100
    }
}
