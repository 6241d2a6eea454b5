//! One worker process (`refit worker`): hosts one rank, or every rank of
//! one node, of a layout pair whose weights are the verification pattern.
//!
//! Each hosted rank is what a real training or inference process would be:
//! a store with the rank's weights, the orchestrator's [`Member`] over that
//! store ([`Joined::serve_member`]), and an actor of its own that writes or
//! reads the store — here a [`PatternRank`], which writes the pattern of a
//! weights version into a source ("an optimizer step") and checks a destination's
//! committed weights element by element. The test pattern lives only here,
//! in the tooling; the orchestrator moves whatever the stores hold.
//!
//! [`Member`]: orchestrator::Member

use actors::{async_trait, spawn, Actor, ActorError, Context, SpawnConfig};
use orchestrator::testkit::{fill_source_rank_at, verify_destination_rank_from};
use orchestrator::{join, DstStore, JoinConfig, Joined, Role, SrcStore};
use reshard::{DType, Endpoint, Group, Layout};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Faults a worker injects into one rank's data plane for its next refit
/// (chaos testing; through the member's [`orchestrator::FaultHook`]).
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

/// The faults armed for a rank's next refit.
type FaultSlot = Arc<Mutex<Option<FaultSpec>>>;

/// Which ranks a worker hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hosted {
    /// One rank.
    Rank(Endpoint),
    /// Every rank of node `n` of a group (`ranks_per_node` of its layout).
    Node(Group, u32),
}

impl Hosted {
    /// The hosted group.
    pub fn group(self) -> Group {
        match self {
            Hosted::Rank(e) => e.group,
            Hosted::Node(g, _) => g,
        }
    }

    /// The ranks, checked against the hosted group's layout.
    pub fn endpoints(self, layout: &Layout) -> Result<Vec<Endpoint>, String> {
        let g = group_name(self.group());
        match self {
            Hosted::Rank(e) if e.rank < layout.ranks() => Ok(vec![e]),
            Hosted::Rank(e) => Err(format!("{e}: the {g} layout has {} ranks", layout.ranks())),
            Hosted::Node(group, n) => {
                if n >= layout.nodes() {
                    return Err(format!("{g} node {n}: the {g} layout has {} nodes", layout.nodes()));
                }
                let first = n * layout.ranks_per_node();
                let last = (first + layout.ranks_per_node()).min(layout.ranks());
                Ok((first..last).map(|r| Endpoint { group, rank: r }).collect())
            }
        }
    }
}

/// What a worker keeps of the layout pair: the layout of the group it
/// hosts, and (for destinations, whose check converts from the source's values)
/// the source dtype of every tensor. Never the other group's whole layout.
#[derive(Debug)]
pub struct WorkerLayouts {
    /// The hosted group's layout.
    pub layout: Layout,
    /// Source dtype by tensor name (destinations; empty for sources).
    pub source_dtypes: HashMap<String, DType>,
}

/// `src` or `dst`.
pub(crate) fn group_name(g: Group) -> &'static str {
    if g == Group::Src {
        "src"
    } else {
        "dst"
    }
}

/// The name a rank's [`PatternRank`] is served under.
pub(crate) fn pattern_name(e: Endpoint) -> String {
    format!("refit.pattern.{}.{}", group_name(e.group), e.rank)
}

/// The name the [`PatternRank`] of rank `rank` of the replica named
/// `replica` is served under.
pub(crate) fn replica_pattern_name(replica: &str, rank: u32) -> String {
    format!("refit.pattern.replica.{replica}.{rank}")
}

/// Requests to a [`PatternRank`].
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum PatternMsg {
    /// Sources: hold the pattern of weights `version` (a trainer's step,
    /// or a restarted trainer restoring it).
    Fill {
        /// The version.
        version: u64,
    },
    /// Destinations: check every committed element against the pattern of the
    /// committed version.
    Check,
    /// Inject these faults into this rank's data plane in the next refit.
    Arm(FaultSpec),
}

/// Answers of a [`PatternRank`].
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum PatternReply {
    /// Faults armed.
    Armed,
    /// The source holds this version.
    Filled {
        /// The version.
        version: u64,
    },
    /// What a destination serves: its committed version (0: nothing committed
    /// yet), the elements checked, and the first element that does not
    /// match that version, if any (a torn version).
    Checked {
        /// The committed version.
        version: u64,
        /// Elements checked.
        elements: u64,
        /// The first mismatch.
        mismatch: Option<String>,
    },
}

/// The pattern's writer (sources) or checker (destinations) of one rank.
pub(crate) struct PatternRank {
    layout: Arc<Layout>,
    source_dtypes: Arc<HashMap<String, DType>>,
    rank: u32,
    role: Role,
    faults: FaultSlot,
}

#[async_trait]
impl Actor for PatternRank {
    type Msg = PatternMsg;
    type Reply = PatternReply;

    async fn handle(&mut self, msg: PatternMsg, _ctx: &mut Context<Self>) -> Result<PatternReply, ActorError> {
        match (msg, &self.role) {
            (PatternMsg::Arm(spec), _) => {
                *self.faults.lock().unwrap_or_else(|e| e.into_inner()) = Some(spec);
                Ok(PatternReply::Armed)
            }
            (PatternMsg::Fill { version }, Role::Src(store)) => {
                if store.version() != Some(version) {
                    let (src, rank) = (Arc::clone(&self.layout), self.rank);
                    // Filling is long CPU work: off the reactor, or the
                    // control connection's heartbeats starve.
                    store
                        .restore(version, |b| tokio::task::block_in_place(|| fill_source_rank_at(&src, rank, version, b.memory_mut())))
                        .await;
                }
                Ok(PatternReply::Filled { version })
            }
            (PatternMsg::Check, Role::Dst(store)) => {
                let Some(snap) = store.snapshot() else {
                    return Ok(PatternReply::Checked { version: 0, elements: 0, mismatch: None });
                };
                let (dst, dtypes, rank) = (Arc::clone(&self.layout), Arc::clone(&self.source_dtypes), self.rank);
                let version = snap.version;
                let from = move |name: &str| dtypes.get(name).copied();
                let r = tokio::task::spawn_blocking(move || {
                    verify_destination_rank_from(&dst, rank, version, &from, &|_| true, snap.buffers.memory())
                })
                .await
                .map_err(|e| ActorError::failed(format!("check task: {e}")))?;
                Ok(match r {
                    Ok(elements) => PatternReply::Checked { version, elements, mismatch: None },
                    Err(m) => PatternReply::Checked { version, elements: 0, mismatch: Some(m.to_string()) },
                })
            }
            (msg, _) => Err(ActorError::failed(format!("{msg:?} does not apply to this rank's side"))),
        }
    }
}

/// What one worker is: which ranks, where to meet, how to authenticate.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Which ranks it hosts.
    pub hosted: Hosted,
    /// Where and how to join.
    pub join: JoinConfig,
    /// The destination ranks are those of a replica of this name, joining
    /// a destination group of replicas of their layout
    /// ([`Joined::serve_replica_member`]); `None`: ranks of the group's
    /// own layout.
    pub replica: Option<String>,
}

async fn serve(
    joined: &Joined,
    layout: &Arc<Layout>,
    source_dtypes: &Arc<HashMap<String, DType>>,
    e: Endpoint,
    replica: Option<&str>,
) -> Result<(), String> {
    let role = match e.group {
        Group::Src => Role::Src(Arc::new(SrcStore::new(layout, e.rank))),
        Group::Dst => Role::Dst(Arc::new(DstStore::new(layout, e.rank))),
    };
    let faults = FaultSlot::default();
    let slot = Arc::clone(&faults);
    let mut config = joined.member_config();
    config.tweak = Some(Arc::new(move |_refit, data: &mut orchestrator::NodeFaults| {
        if let Some(f) = slot.lock().unwrap_or_else(|e| e.into_inner()).take() {
            data.faults = orchestrator::Faults {
                corrupt_frame: f.corrupt_frame,
                stall_at_frame: f.stall_at_frame,
                cut_at_frame: f.cut_at_frame,
                abort_hang: f.abort_hang,
            };
        }
    }));
    // A replica's rank checks its pattern against the replica's layout:
    // whichever place the group gives the replica, it holds the same parts.
    let name = match (replica, &role) {
        (Some(replica), Role::Dst(store)) => {
            joined.serve_replica_member(replica, layout.clone(), e.rank, Arc::clone(store), config).await.map_err(|err| err.to_string())?;
            replica_pattern_name(replica, e.rank)
        }
        (Some(_), Role::Src(_)) => return Err(format!("{e}: only destination ranks join as a replica")),
        (None, _) => {
            joined.serve_member_with(layout.clone(), e.rank, role.clone(), config).await.map_err(|err| err.to_string())?;
            pattern_name(e)
        }
    };
    let pattern = PatternRank { layout: Arc::clone(layout), source_dtypes: Arc::clone(source_dtypes), rank: e.rank, role, faults };
    // The launcher bounds every call; a check of a large rank may take minutes.
    let actor = spawn(pattern, SpawnConfig::default().name(name.clone()).call_timeout(Duration::from_secs(7 * 24 * 3600)));
    joined.serve(&name, &actor).await.map_err(|err| err.to_string())
}

/// Runs one worker until the launcher goes away.
pub fn run_worker(config: WorkerConfig, layouts: WorkerLayouts) -> Result<(), String> {
    let ranks = config.hosted.endpoints(&layouts.layout)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_keep_alive(super::IDLE_THREAD)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start tokio: {e}"))?;
    let (layout, dtypes) = (Arc::new(layouts.layout), Arc::new(layouts.source_dtypes));
    runtime.block_on(async move {
        let joined = join(&config.join).await.map_err(|e| e.to_string())?;
        for &e in &ranks {
            serve(&joined, &layout, &dtypes, e, config.replica.as_deref()).await?;
        }
        // The launcher closing the control plane is how a job ends.
        joined.closed().await;
        joined.shutdown();
        Ok(())
    })
}
