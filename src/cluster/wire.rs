//! The messages between the launcher and its workers' member actors. They
//! travel as remote-actor calls (`actors::remote`: authenticated frames,
//! heartbeats, encoded by `actors::codec`).

use reshard::{Endpoint, RankProgram, Strategy};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Name a worker's member actor is served and registered under.
pub(crate) fn member_name(ranks: &[Endpoint]) -> String {
    match (ranks.first(), ranks.last()) {
        (Some(a), Some(b)) => format!("refit.member.{}{}-{}", group_tag(a.group), a.rank, b.rank),
        _ => "refit.member.none".into(),
    }
}

/// Name of the abort actor next to a member actor.
pub(crate) fn abort_name(member: &str) -> String {
    format!("{member}.abort")
}

fn group_tag(g: reshard::Group) -> &'static str {
    if g == reshard::Group::Src {
        "src"
    } else {
        "dst"
    }
}

/// Data-plane settings of one refit, chosen by the launcher.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DataPlane {
    /// CRC-32C on every data frame.
    pub checksum: bool,
    /// Per-rank egress limits (bytes/s) between nodes and inside a node.
    pub emulation: Option<(u64, u64)>,
    /// Fault injection for this refit on this worker (chaos testing).
    pub faults: FaultSpec,
    /// Time to connect the data plane (a peer that is gone fails the
    /// connect step after this; zero: 5 s). Hundreds of ranks on a few
    /// cores need tens of seconds.
    pub connect_timeout: Duration,
}

/// Faults a worker injects into its own data plane for one refit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultSpec {
    /// Flip a byte in this data frame (counted per link from 0) after its
    /// checksum is computed.
    pub corrupt_frame: Option<u64>,
    /// Stop sending (without closing) before this data frame.
    pub stall_at_frame: Option<u64>,
    /// Cut the connection before this data frame.
    pub cut_at_frame: Option<u64>,
    /// Make `abort` itself hang this long.
    pub abort_hang: Option<Duration>,
}

/// Requests to a member actor.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum MemberMsg {
    /// Who are you? Answered with `Hello`.
    Describe,
    /// The program of one of this worker's ranks under `strategy`.
    Install { strategy: Strategy, program: Box<RankProgram> },
    /// Get ready for a refit: the weights version in the sources, fresh
    /// data-plane listeners; answered with `Ready` and their addresses.
    Prepare(Prepare),
    /// Connect the data plane of refit `seq` to these peers.
    Connect { seq: u64, table: Vec<(Endpoint, String)> },
    /// Run refit `seq`, within `deadline`; answered with `Done`.
    Start { seq: u64, deadline: Duration },
    /// Check refit `seq`'s destination elements (if prepared with `verify`)
    /// and make them the committed weights; answered with `Done`.
    Commit { seq: u64 },
    /// Check the committed weights against their version; answered with
    /// `Checked`.
    Check,
    /// Exit the process.
    Shutdown,
}

/// What a member needs to know of one refit.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Prepare {
    /// The refit's sequence number.
    pub(crate) seq: u64,
    /// Reshard or baseline.
    pub(crate) strategy: Strategy,
    /// Weights version the sources hold.
    pub(crate) version: u64,
    /// Destinations check every element before they commit.
    pub(crate) verify: bool,
    /// Data-plane settings for this worker.
    pub(crate) data: DataPlane,
    /// Names this refit's shared-memory regions (a new epoch).
    pub(crate) session: String,
}

/// Answers of a member actor.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum MemberReply {
    /// Its ranks, process id and the fingerprints of both plans for the
    /// layouts it loaded.
    Hello { ranks: Vec<Endpoint>, pid: u32, reshard: u64, baseline: u64 },
    /// Done; for `Prepare`, the data-plane addresses of its ranks.
    Ready { addrs: Vec<(Endpoint, String)> },
    /// What the worker's ranks did in a refit (`Start`, `Commit`).
    Done(WorkerReport),
    /// The committed version (`None` before the first commit), the
    /// destination elements checked against it, and the first element that
    /// does not match it, if any (a torn version).
    Checked { version: Option<u64>, elements: u64, mismatch: Option<String> },
}

/// What one worker did in one refit.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct WorkerReport {
    /// Bytes its ranks sent to other ranks.
    pub(crate) sent_bytes: u64,
    /// Its data-plane time.
    pub(crate) elapsed_ns: u64,
    /// Destination elements checked, if asked.
    pub(crate) verified: Option<u64>,
}

/// Requests to a worker's abort actor (a separate mailbox, so an abort is
/// handled while the member actor is busy running a refit).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum AbortMsg {
    /// Abort refit `seq` (if it is the one running) for `reason`.
    Abort { seq: u64, reason: String },
}
