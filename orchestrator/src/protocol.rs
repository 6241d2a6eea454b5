//! The member protocol: the messages between the [`Orchestrator`] and the
//! [`Member`] of every rank, wherever that member runs.
//!
//! Every message is serde, so a member is an ordinary
//! [`ActorRef`](actors::ActorRef) whether it lives in this process or is
//! served by another over the authenticated control plane
//! ([`actors::remote`]); the orchestrator cannot tell and does not care.
//! Nothing here carries a pointer or a live transport: the data plane of
//! every refit is opened by the members themselves, from the
//! [`Fabric`] and the peer addresses the orchestrator hands them.
//!
//! One refit is, for every member at once and step by step:
//! `Prepare` (open this refit's data-plane endpoint) → `Connect` (to the
//! peers in its program) → `Run` (the program; destinations write staging) →
//! `Commit` on every destination once every member ran (the flip), or `Discard`.
//!
//! [`Orchestrator`]: crate::Orchestrator
//! [`Member`]: crate::Member

use reshard::{Endpoint, Fingerprint, Layout, RankProgram};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;

/// The fabric's settings and peer addresses are the data plane's
/// (`transport::fabric`), carried here as they are.
pub use transport::fabric::{CommPlane, DataAddr, EgressCaps, Fabric, IpcFabric, NcclFabric, NodeFabric, PeerAddr};
/// A run's digest is the data plane's (`transport::fabric::digest`),
/// carried here as it is.
pub use transport::fabric::{DigestError, RankDigest};

/// How many installed plans a member keeps (reshard and baseline, say).
pub const INSTALLED_PLANS: usize = 2;

/// What [`MemberMsg::Run`] asks of a member.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRequest {
    /// The refit.
    pub refit: u64,
    /// The weight version being moved.
    pub version: u64,
    /// The plan the orchestrator believes is installed.
    pub fingerprint: Fingerprint,
    /// Time the data movement may take.
    pub deadline: Duration,
    /// Whether the run is a delta refit ([`transport::delta`]).
    pub delta: RunDelta,
    /// After the run, read back what it moved and answer with its
    /// digest ([`RunStats::digest`]), for the orchestrator to check
    /// before any commit ([`OrchestratorConfig::digest_check`](crate::OrchestratorConfig::digest_check)).
    pub verify: bool,
}

/// Whether a run is a delta refit ([`transport::delta`]), and on what.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunDelta {
    /// An ordinary run: every message dense, nothing remembered.
    Off,
    /// A delta refit with no base yet: dense this time, each message
    /// remembered as the base of the next.
    First,
    /// Every message as what changed since the same message of refit
    /// `base` (the last one of this plan that committed).
    Since {
        /// The base refit.
        base: u64,
    },
}

/// Messages a member handles.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum MemberMsg {
    /// Report the group layout this member holds weights for.
    Describe,
    /// Report a fingerprint of that layout ([`Layout::fingerprint`]), the
    /// plans installed and the weights held (cheap; asked before every
    /// refit).
    Status,
    /// Keep this program for the plan with this fingerprint (a member keeps
    /// the latest [`INSTALLED_PLANS`]).
    Install {
        /// This rank's program.
        program: Box<RankProgram>,
        /// The plan's fingerprint.
        fingerprint: Fingerprint,
        /// Which rank the program is for.
        seat: ProgramRole,
    },
    /// Hold weights for rank `rank` of this group layout from now on (a
    /// destination group that gained or lost a replica): refused unless
    /// the rank's buffers there have the types and sizes of this
    /// member's. Drops the installed plans and kept data planes (they were
    /// for the old layout).
    Relayout {
        /// The group's new layout.
        layout: Arc<Layout>,
        /// This member's rank in it.
        rank: reshard::Rank,
    },
    /// Open this member's data-plane endpoint for refit `refit` of the plan
    /// `fingerprint`: answered with [`MemberReply::Prepared`].
    Prepare {
        /// The refit's sequence number (one data-plane epoch).
        refit: u64,
        /// The plan (installed earlier) this refit runs.
        fingerprint: Fingerprint,
        /// Names this epoch's shared state (shared-memory regions,
        /// in-process channels); fresh for every refit.
        session: String,
        /// The fabric.
        fabric: Fabric,
        /// Keep the node fabric's connections after a run that succeeds,
        /// for later refits of the same plan ([`MemberMsg::Resume`]).
        keep: bool,
    },
    /// Run refit `refit` of plan `fingerprint` on the data plane kept from
    /// session `session` (connected by an earlier `Prepare` with `keep`, and
    /// left clean by a run of the same plan that succeeded here): `Done`, or
    /// [`Refusal::NotKept`] if this member holds no such data plane. A fresh
    /// `Prepare` for the plan, a `Discard`, or the plan's eviction drops it.
    Resume {
        /// The refit's sequence number.
        refit: u64,
        /// The plan.
        fingerprint: Fingerprint,
        /// The session whose connections are kept.
        session: String,
    },
    /// Connect the prepared endpoint to every peer of this member's
    /// program (the table holds every member's address).
    Connect {
        /// The refit.
        refit: u64,
        /// Every member's data-plane address.
        peers: Vec<PeerAddr>,
    },
    /// Run the installed program for weights `version` on the connected
    /// endpoint (destinations write their staging copy).
    Run(RunRequest),
    /// Make staged `version` the one readers get (destinations); the second phase.
    Commit {
        /// The version.
        version: u64,
    },
    /// Drop whatever was staged, prepared or kept; a failed refit (or the
    /// orchestrator closing the data plane).
    Discard,
    /// Report the weights this member holds (sources) or serves
    /// (destinations).
    Version,
}

/// Which rank an installed program is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProgramRole {
    /// The member's own rank of its group: every refit's programs.
    Own,
    /// A rank of a plan between two replicas of the destination group
    /// (seeding a new replica from a serving one): a destination member
    /// runs a source endpoint's program from the version it serves, or a
    /// destination endpoint's into its staging. The program's buffers
    /// must have the types and sizes of the member's own.
    Replica,
}

/// The weights a member holds (a source) or serves (a destination), as it
/// reports them in [`MemberReply::Status`] and [`MemberReply::Version`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum HeldVersion {
    /// Nothing written (a source) or committed (a destination) yet.
    Unwritten,
    /// This version, whole.
    Version(u64),
    /// A source whose last step failed after changing the weights, or a
    /// destination whose commit into registered memory failed midway:
    /// neither the version before it (if any) nor a new one.
    Torn {
        /// The last version written whole.
        after: Option<u64>,
    },
}

impl std::fmt::Display for HeldVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeldVersion::Unwritten => f.write_str("nothing written"),
            HeldVersion::Version(v) => write!(f, "version {v}"),
            HeldVersion::Torn { after: Some(v) } => write!(f, "weights torn by a failed step (or commit) after version {v}"),
            HeldVersion::Torn { after: None } => write!(f, "weights torn by a failed first step (or commit)"),
        }
    }
}

/// Why a member refused a request (a normal reply, not a failure of the actor).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Refusal {
    /// The fingerprint does not match the installed program's.
    FingerprintMismatch {
        /// What the member has installed (if anything).
        installed: Option<Fingerprint>,
        /// What it was asked to run.
        asked: Fingerprint,
    },
    /// The program does not fit this rank (other rank, other buffers).
    ProgramMismatch(String),
    /// The source holds another version than the one asked for.
    VersionMismatch {
        /// Held.
        held: u64,
        /// Asked.
        asked: u64,
    },
    /// The source has nothing whole to send: never written, or torn by a
    /// failed step.
    NoWeights(HeldVersion),
    /// The data plane could not be opened or connected.
    Fabric(String),
    /// A step came for another refit than the one prepared.
    NotPrepared {
        /// The refit asked for.
        refit: u64,
    },
    /// `Resume` of a data plane this member does not keep.
    NotKept {
        /// The session asked for.
        session: String,
    },
    /// The data plane failed while moving bytes.
    Exec {
        /// What failed.
        why: String,
        /// The failure came from a peer (it aborted, or went away): the
        /// root cause is another member's.
        after_peer: bool,
    },
    /// A subset refit on a destination that serves no committed version
    /// (the tensors outside the subset would have no bytes to keep).
    NoBaseVersion,
    /// Commit without the whole version staged.
    NotStaged {
        /// What is staged completely, if anything.
        staged: Option<u64>,
    },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::FingerprintMismatch { installed: Some(i), asked } => write!(f, "plan {asked} asked, {i} installed"),
            Refusal::FingerprintMismatch { installed: None, asked } => write!(f, "plan {asked} asked, none installed"),
            Refusal::ProgramMismatch(why) => write!(f, "program does not fit this rank: {why}"),
            Refusal::VersionMismatch { held, asked } => write!(f, "holds version {held}, the refit asked for {asked}"),
            Refusal::NoWeights(w) => write!(f, "nothing to send: {w}"),
            Refusal::Fabric(why) => write!(f, "data plane: {why}"),
            Refusal::NotPrepared { refit } => write!(f, "refit {refit} was not prepared (or not connected) here"),
            Refusal::NotKept { session } => write!(f, "no data plane of session {session} is kept here"),
            Refusal::Exec { why, .. } => write!(f, "{why}"),
            Refusal::NoBaseVersion => {
                write!(f, "a subset refit needs a committed version here to keep the other tensors from (refit every tensor first)")
            }
            Refusal::NotStaged { staged: Some(v) } => write!(f, "commit refused: version {v} is staged"),
            Refusal::NotStaged { staged: None } => write!(f, "commit refused: nothing is staged"),
        }
    }
}

/// What a member says about itself when asked ([`MemberMsg::Describe`]).
/// The orchestrator asks one member per group (every member reports the
/// layout's fingerprint in `Status`), so the layout travels once, in the
/// control plane's binary encoding, and is validated again on arrival.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutInfo {
    /// The member's rank in its group.
    pub rank: u32,
    /// The whole group's layout.
    pub layout: Arc<Layout>,
    /// The process the member runs in.
    pub pid: u32,
}

/// What one rank's data plane did in one refit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunStats {
    /// Bytes sent to other ranks (wire dtype).
    pub sent_bytes: u64,
    /// Bytes received.
    pub recv_bytes: u64,
    /// Messages sent.
    pub messages: u64,
    /// What the run moved, read back from the rank's memory after it
    /// (asked for by `Run { verify: true }`; `None` when not asked).
    pub digest: Option<Result<RankDigest, DigestError>>,
    /// Time the digest took.
    pub digest_time: Duration,
}

/// Replies of a member.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemberReply {
    /// Answer to `Describe`.
    Layout(LayoutInfo),
    /// Answer to `Status`.
    Status {
        /// Fingerprint of the layout the member holds.
        layout: u64,
        /// The plans installed (the latest few, e.g. reshard and baseline).
        installed: Vec<Fingerprint>,
        /// The weights held (a source) or served (a destination).
        weights: HeldVersion,
    },
    /// Answer to `Prepare`: where this member's endpoint listens.
    Prepared {
        /// The endpoint.
        endpoint: Endpoint,
        /// Its node within its group.
        node: u32,
        /// Where its end of the data plane is reached.
        addr: DataAddr,
        /// Its host and user ([`PeerAddr::host`]).
        host: transport::fabric::Host,
    },
    /// The request was done.
    Done,
    /// Answer to `Run`.
    Ran(RunStats),
    /// Answer to `Version`.
    Version(HeldVersion),
    /// The request was refused.
    Refused(Refusal),
}
