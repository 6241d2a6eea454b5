//! The orchestrator actor: attaches to a source group and a destination
//! group, plans once per pair of layouts, and refits after every optimizer
//! step.

use crate::fabric::hub;
use crate::member::Member;
use crate::protocol::{Fabric, MemberMsg, MemberReply, PeerAddr, Refusal, Weights, INSTALLED_PLANS};
use actors::{async_trait, Actor, ActorError, ActorGroup, ActorRef, CallError, Context};
use reshard::{
    plan_baseline, plan_reshard, Endpoint, Fingerprint, Group, Layout, Plan, PlanError, PlanOptions, Programs, RankProgram, Strategy,
    TensorSubset,
};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
use transport::local_fabric;

/// Orchestrator settings.
#[derive(Debug, Clone)]
pub struct OrchestratorConfig {
    /// How members reach each other: in process (every member in the
    /// orchestrator's process), or the node fabric (members anywhere).
    pub fabric: Fabric,
    /// Reshard, or the gather-broadcast baseline.
    pub mode: Strategy,
    /// Planner options.
    pub plan: PlanOptions,
    /// Every refit must finish its data movement within this time.
    pub deadline: Duration,
    /// Time allowed for metadata calls (describe, install, commit).
    pub control_timeout: Duration,
    /// Node and communicator fabrics: keep every member's connections (or
    /// communicator) after a refit that commits, and run the next refit of
    /// the same plan on them (no listen, no connect, no shared-memory
    /// setup, no communicator creation), as a job keeps its communicators
    /// between steps. Any failure, a replaced member or
    /// [`OrchestratorMsg::CloseDataPlane`] opens a fresh data plane next
    /// time. Off: every refit opens its own (its own session id).
    pub keep_data_plane: bool,
    /// Delta refits: after a refit of a plan commits, the next refit of
    /// that plan sends each message as what changed since (every member
    /// keeps a copy of what it sent and received in the last committed
    /// refit: memory as large as its share of the bytes moved). Any
    /// failure, a replaced member or a changed layout makes the next refit
    /// dense. Destinations still write every element. Off by default.
    pub delta: bool,
}

impl Default for OrchestratorConfig {
    fn default() -> Self {
        OrchestratorConfig {
            fabric: Fabric::InProcess,
            mode: Strategy::Reshard,
            plan: PlanOptions::default(),
            deadline: transport::DEFAULT_DEADLINE,
            control_timeout: Duration::from_secs(10),
            keep_data_plane: true,
            delta: false,
        }
    }
}

/// What one refit did.
#[derive(Debug, Clone, PartialEq)]
pub struct RefitReport {
    /// The version now served by every destination.
    pub version: u64,
    /// Every destination already served `version`: nothing was planned or
    /// moved (`bytes` is 0).
    pub already_served: bool,
    /// Reshard or baseline.
    pub mode: Strategy,
    /// The plan that ran (`None` when nothing ran: already served).
    pub fingerprint: Option<Fingerprint>,
    /// Whether this refit had to (re)plan.
    pub replanned: bool,
    /// Wall time of the whole refit.
    pub wall: Duration,
    /// Asking members for their status (and layouts), and (re)planning and
    /// installing if needed.
    pub plan_time: Duration,
    /// Opening this refit's data plane on every member (prepare, and
    /// connect for the node and communicator fabrics), or resuming the
    /// kept one.
    pub connect_time: Duration,
    /// Whether this refit ran on the connections (or communicator) kept
    /// from the previous refit of the same plan
    /// ([`OrchestratorConfig::keep_data_plane`]).
    pub resumed: bool,
    /// Moving the bytes: from asking every member to run until the last
    /// one finished.
    pub transfer_time: Duration,
    /// Committing on every destination.
    pub commit_time: Duration,
    /// Bytes moved: the payload of every message between two ranks, in the
    /// dtype it travels in, as the members counted them while sending. It
    /// equals the plan's [`Figures::total_bytes`], the figure `refit plan`,
    /// `run` and `bench` print as "bytes moved" (a difference is logged as
    /// a warning: it would be a bug).
    ///
    /// [`Figures::total_bytes`]: reshard::Figures::total_bytes
    pub bytes: u64,
}

/// What [`OrchestratorMsg::Plan`] found or made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanReport {
    /// Reshard or baseline.
    pub mode: Strategy,
    /// The plan's fingerprint.
    pub fingerprint: Fingerprint,
    /// Whether it planned now (false: the cached plan was installed
    /// everywhere already).
    pub replanned: bool,
    /// Bytes every refit with this plan moves (as [`RefitReport::bytes`]).
    pub bytes: u64,
}

/// Which version a refit delivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefitTarget {
    /// This version, which every source must hold.
    Version(u64),
    /// The newest version every source holds: if a step is under way on
    /// some sources, wait (up to the control timeout) until all hold the
    /// same; if a step lands while the refit reads, start again with it.
    Latest,
}

/// Why a refit failed. Destinations then still serve their last committed
/// version.
#[derive(Debug, Clone, Error)]
pub enum OrchestratorError {
    /// A member did not answer in time.
    #[error("{member}: no answer within {after:?}")]
    Timeout {
        /// The member.
        member: String,
        /// The time allowed.
        after: Duration,
    },
    /// A member is gone.
    #[error("{member} died: {reason}")]
    MemberDied {
        /// The member.
        member: String,
        /// Why it stopped.
        reason: String,
    },
    /// A member runs another plan than the orchestrator's.
    #[error("{member}: plan fingerprint mismatch (installed {installed:?}, asked {asked})")]
    FingerprintMismatch {
        /// The member.
        member: String,
        /// What it had installed.
        installed: Option<Fingerprint>,
        /// What it was asked to run.
        asked: Fingerprint,
    },
    /// A layout reported by a member is invalid, or members of a group
    /// disagree about their layout.
    #[error("{group} group: {problem}")]
    Layout {
        /// The group.
        group: Group,
        /// What is wrong.
        problem: String,
    },
    /// A source has no whole version to send: nothing was written yet, or
    /// its last step failed after changing the weights.
    #[error("{member}: {weights}; every source must hold a whole version (update or restore its store)")]
    NoWeights {
        /// The member.
        member: String,
        /// What it holds.
        weights: Weights,
    },
    /// [`RefitTarget::Latest`]: the sources kept holding different versions
    /// for the whole control timeout.
    #[error("sources hold different versions ({}) for longer than {after:?}", describe_versions(held))]
    VersionsDisagree {
        /// Every source rank's version, by rank.
        held: Vec<u64>,
        /// How long the orchestrator waited.
        after: Duration,
    },
    /// A rank that the group does not have.
    #[error("{endpoint}: the group has {ranks} ranks")]
    NoRank {
        /// The rank asked for.
        endpoint: Endpoint,
        /// The group's size.
        ranks: usize,
    },
    /// A source holds another weight version than the refit asked for.
    #[error("{member}: holds version {held}, the refit asked for {asked}")]
    VersionMismatch {
        /// The member.
        member: String,
        /// The version it holds.
        held: u64,
        /// The version asked for.
        asked: u64,
    },
    /// The two layouts cannot be planned.
    #[error("planning failed: {0}")]
    Plan(#[from] PlanError),
    /// A member refused or failed its part.
    #[error("{member}: {refusal}")]
    Refused {
        /// The member.
        member: String,
        /// Why.
        refusal: Refusal,
    },
    /// A member's handler failed (not a refusal of the protocol).
    #[error("{member}: {problem}")]
    Failed {
        /// The member.
        member: String,
        /// What happened.
        problem: String,
    },
    /// A member answered with a reply that does not belong to the request.
    #[error("{member}: answered {reply} to {request}")]
    Protocol {
        /// The member.
        member: String,
        /// The request.
        request: &'static str,
        /// The reply, as debug text.
        reply: String,
    },
}

/// `version 3 (ranks 0-2), version 4 (rank 3)`.
fn describe_versions(held: &[u64]) -> String {
    let mut runs: Vec<(u64, usize, usize)> = Vec::new();
    for (rank, &v) in held.iter().enumerate() {
        match runs.last_mut() {
            Some((w, _, end)) if *w == v && *end + 1 == rank => *end = rank,
            _ => runs.push((v, rank, rank)),
        }
    }
    let runs: Vec<String> = runs
        .into_iter()
        .map(|(v, a, z)| if a == z { format!("version {v} (rank {a})") } else { format!("version {v} (ranks {a}-{z})") })
        .collect();
    runs.join(", ")
}

/// Where the refit in progress is, as the orchestrator publishes it
/// ([`Orchestrator::subscribe`]): for progress displays, metrics, and tools
/// that act at a given step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RefitStep {
    /// No refit in progress.
    #[default]
    Idle,
    /// Asking members for their layouts and plans; planning, installing.
    Planning,
    /// Members take up the data plane kept from the last refit of the plan.
    Resuming,
    /// Members open their data-plane endpoints.
    Preparing,
    /// Members connect to their peers.
    Connecting,
    /// Members move the bytes; destinations stage.
    Running,
    /// Every destination staged the whole version; destinations flip.
    Committing,
    /// The refit failed; members drop what they staged.
    Discarding,
}

/// The refit in progress and its step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RefitPhase {
    /// The refit's sequence number (counted from 1 by this orchestrator).
    pub refit: u64,
    /// Its step.
    pub step: RefitStep,
}

/// Messages the orchestrator handles.
pub enum OrchestratorMsg {
    /// Refit a version into every destination; nothing moves if every
    /// destination already serves it.
    Refit {
        /// Which version.
        target: RefitTarget,
        /// Only these destination tensors (a subset refit: each
        /// destination keeps every other tensor's bytes from the version it
        /// serves); `None`: every tensor.
        only: Option<TensorSubset>,
    },
    /// Check both groups' layouts, plan (unless cached) and install every
    /// member's program now, rather than at the first refit.
    Plan,
    /// Switch between reshard and baseline (plans the other strategy on the
    /// next refit, once).
    SetMode(Strategy),
    /// Replace the groups (a resize, or replaced members); the next refit
    /// replans if their layouts changed and installs on members that lack
    /// the plan.
    Attach {
        /// Source (training) ranks.
        src: ActorGroup<Member>,
        /// Destination (inference) ranks.
        dst: ActorGroup<Member>,
    },
    /// Replace the member of one rank (one that died) and keep the others;
    /// the next refit installs the plan on it.
    Replace {
        /// The rank.
        endpoint: Endpoint,
        /// Its new member.
        member: ActorRef<Member>,
    },
    /// Forget the cached plan.
    Invalidate,
    /// Drop the node-fabric connections members keep between refits; the
    /// next refit opens a fresh data plane.
    CloseDataPlane,
    /// How many plans have been made so far.
    PlansMade,
}

/// Replies of the orchestrator.
#[derive(Debug, Clone)]
pub enum OrchestratorReply {
    /// The outcome of a refit.
    Refit(Result<RefitReport, OrchestratorError>),
    /// The outcome of `Plan`.
    Planned(Result<PlanReport, OrchestratorError>),
    /// Number of plans made.
    PlansMade(u64),
    /// The outcome of a request that returns nothing.
    Done(Result<(), OrchestratorError>),
}

/// What the orchestrator keeps of a plan: not the plan or its programs
/// (for a large model they are gigabytes), only what identifies it. Members
/// keep their own program; a member that joins later (a replaced process)
/// makes the orchestrator plan again to build its program.
struct CachedPlan {
    /// Layout fingerprints every member of each group reported.
    layout_fingerprints: (u64, u64),
    fingerprint: Fingerprint,
    bytes: u64,
}

/// Programs derived ahead of, or being sent to, members while installing.
const INSTALL_WINDOW: usize = 8;

/// An install call's outcome, whether or not its task ran to the end.
fn flatten(done: Result<Result<(), OrchestratorError>, tokio::task::JoinError>) -> Result<(), OrchestratorError> {
    done.unwrap_or_else(|e| Err(OrchestratorError::Failed { member: "orchestrator".into(), problem: format!("install task: {e}") }))
}

/// The layouts both groups hold, as last described, by fingerprint.
struct KnownLayouts {
    fingerprints: (u64, u64),
    src: Arc<Layout>,
    dst: Arc<Layout>,
}

/// The orchestrator actor.
pub struct Orchestrator {
    src: ActorGroup<Member>,
    dst: ActorGroup<Member>,
    config: OrchestratorConfig,
    /// One plan per strategy and subset, while both layouts stay the same.
    cache: std::collections::HashMap<(Strategy, Option<TensorSubset>), CachedPlan>,
    /// Delta refits: per plan, the last refit of it that committed (every
    /// member keeps what it sent and received then).
    delta_base: std::collections::HashMap<Fingerprint, u64>,
    /// The layouts, kept while members report the same fingerprints (a
    /// replaced member then costs a plan, not a describe).
    layouts: Option<KnownLayouts>,
    plans_made: u64,
    /// Refits started, the data-plane epoch.
    refits: u64,
    /// The sessions whose node-fabric connections every member keeps, by
    /// plan: recorded when a refit commits, forgotten on any failure or
    /// change of members.
    kept: Vec<(Fingerprint, String)>,
    phase: tokio::sync::watch::Sender<RefitPhase>,
}

impl Orchestrator {
    /// An orchestrator for these groups.
    pub fn new(src: ActorGroup<Member>, dst: ActorGroup<Member>, config: OrchestratorConfig) -> Orchestrator {
        Orchestrator {
            src,
            dst,
            config,
            cache: Default::default(),
            delta_base: Default::default(),
            layouts: None,
            plans_made: 0,
            refits: 0,
            kept: Vec::new(),
            phase: tokio::sync::watch::Sender::default(),
        }
    }

    /// Follows the refit in progress, step by step.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<RefitPhase> {
        self.phase.subscribe()
    }

    fn enter(&self, step: RefitStep) {
        self.phase.send_replace(RefitPhase { refit: self.refits, step });
    }

    /// How many times this orchestrator has planned.
    pub fn plans_made(&self) -> u64 {
        self.plans_made
    }
}

fn call_error(member: String, e: CallError, after: Duration) -> OrchestratorError {
    match e {
        CallError::Timeout { .. } => OrchestratorError::Timeout { member, after },
        CallError::Stopped { reason, .. } => OrchestratorError::MemberDied { member, reason: reason.to_string() },
        CallError::Handler { error, .. } => OrchestratorError::Failed { member, problem: error.to_string() },
    }
}

fn refused(member: &str, r: Refusal) -> OrchestratorError {
    let member = member.to_string();
    match r {
        Refusal::FingerprintMismatch { installed, asked } => OrchestratorError::FingerprintMismatch { member, installed, asked },
        Refusal::VersionMismatch { held, asked } => OrchestratorError::VersionMismatch { member, held, asked },
        Refusal::NoWeights(weights) => OrchestratorError::NoWeights { member, weights },
        refusal => OrchestratorError::Refused { member, refusal },
    }
}

/// Asks one member of `group` (rank 0) for the group's layout, which
/// every member reported as `fingerprint`.
async fn describe(
    members: &ActorGroup<Member>,
    group: Group,
    fingerprint: u64,
    timeout: Duration,
) -> Result<Arc<Layout>, OrchestratorError> {
    let Some(member) = members.get(0) else {
        return Err(OrchestratorError::Layout { group, problem: "the group has no members".into() });
    };
    let who = member.name().to_string();
    let reply = member.call_timeout(MemberMsg::Describe, timeout).await.map_err(|e| call_error(who.clone(), e, timeout))?;
    let MemberReply::Layout(info) = reply else {
        return Err(OrchestratorError::Protocol { member: who, request: "Describe", reply: format!("{reply:?}") });
    };
    let layout = info.layout;
    let problem = if info.rank != 0 {
        Some(format!("the member at rank 0 says it is rank {}", info.rank))
    } else if layout.ranks() as usize != members.len() {
        Some(format!("layout has {} ranks but the group has {} members", layout.ranks(), members.len()))
    } else if layout.fingerprint() != fingerprint {
        Some(format!("rank 0 describes a layout with fingerprint {:016x} but reported {fingerprint:016x}", layout.fingerprint()))
    } else {
        None
    };
    match problem {
        Some(problem) => Err(OrchestratorError::Layout { group, problem }),
        None => Ok(layout),
    }
}

/// Every member's reply to `msg(group, rank)`, or the first failure.
async fn call_both(
    src: &ActorGroup<Member>,
    dst: &ActorGroup<Member>,
    msg: impl Fn(Group, usize) -> Option<MemberMsg>,
    after: Duration,
) -> Result<Vec<(String, MemberReply)>, OrchestratorError> {
    let mut calls = Vec::new();
    for (g, group) in [(Group::Src, src), (Group::Dst, dst)] {
        for (rank, member) in group.iter() {
            if let Some(m) = msg(g, rank) {
                let member = member.clone();
                calls.push(async move {
                    let name = member.name().to_string();
                    match member.call_timeout(m, after).await {
                        Ok(r) => Ok((name, r)),
                        Err(e) => Err(call_error(name, e, after)),
                    }
                });
            }
        }
    }
    let mut out = Vec::with_capacity(calls.len());
    for r in actors::join_all(calls).await {
        out.push(r?);
    }
    Ok(out)
}

/// Turns the first refusal among `replies` into an error.
fn no_refusal(replies: &[(String, MemberReply)]) -> Result<(), OrchestratorError> {
    for (member, reply) in replies {
        if let MemberReply::Refused(r) = reply {
            return Err(refused(member, r.clone()));
        }
    }
    Ok(())
}

/// What every member reported in `Status`, sources first.
struct Status {
    /// Every member's name.
    names: Vec<String>,
    /// The layout fingerprint of each group.
    layouts: (u64, u64),
    /// The plans each member has installed.
    installed: Vec<Vec<Fingerprint>>,
    /// The weights each member holds or serves.
    weights: Vec<Weights>,
    /// Members of the source group (the rest are destinations).
    n_src: usize,
}

impl Status {
    fn src_weights(&self) -> &[Weights] {
        &self.weights[..self.n_src]
    }

    fn dst_weights(&self) -> &[Weights] {
        &self.weights[self.n_src..]
    }
}

/// How often [`RefitTarget::Latest`] asks the sources again while they
/// hold different versions.
const AGREE_POLL: Duration = Duration::from_millis(10);

/// How many times [`RefitTarget::Latest`] starts again when a step lands
/// while the refit reads.
const LATEST_ATTEMPTS: usize = 3;

impl Orchestrator {
    fn endpoints(&self) -> Vec<Endpoint> {
        (0..self.src.len() as u32).map(Endpoint::src).chain((0..self.dst.len() as u32).map(Endpoint::dst)).collect()
    }

    /// Asks every member for its layout fingerprint, installed plans and
    /// weights; checks that both groups have members and that the members
    /// of each group hold one layout.
    async fn status(&self) -> Result<Status, OrchestratorError> {
        for (group, members) in [(Group::Src, &self.src), (Group::Dst, &self.dst)] {
            if members.is_empty() {
                return Err(OrchestratorError::Layout { group, problem: "the group has no members".into() });
            }
        }
        let replies = call_both(&self.src, &self.dst, |_, _| Some(MemberMsg::Status), self.config.control_timeout).await?;
        let n_src = self.src.len();
        let mut layouts: [Option<u64>; 2] = [None, None];
        let mut status = Status {
            names: Vec::with_capacity(replies.len()),
            layouts: (0, 0),
            installed: Vec::with_capacity(replies.len()),
            weights: Vec::with_capacity(replies.len()),
            n_src,
        };
        for (i, (member, reply)) in replies.into_iter().enumerate() {
            let MemberReply::Status { layout, installed, weights } = reply else {
                return Err(OrchestratorError::Protocol { member, request: "Status", reply: format!("{reply:?}") });
            };
            let (g, group, rank) = if i < n_src { (0, Group::Src, i) } else { (1, Group::Dst, i - n_src) };
            let first = *layouts[g].get_or_insert(layout);
            if first != layout {
                return Err(OrchestratorError::Layout {
                    group,
                    problem: format!("{member} (rank {rank}) holds a different layout ({layout:016x}) than rank 0 ({first:016x})"),
                });
            }
            status.names.push(member);
            status.installed.push(installed);
            status.weights.push(weights);
        }
        status.layouts = (layouts[0].unwrap_or_default(), layouts[1].unwrap_or_default());
        Ok(status)
    }

    /// The version every source holds, asking again while they differ (a
    /// step under way), for at most the control timeout.
    async fn agreed_version(&self, mut status: Status) -> Result<(u64, Status), OrchestratorError> {
        let deadline = tokio::time::Instant::now() + self.config.control_timeout;
        loop {
            let mut held = Vec::with_capacity(status.n_src);
            for (i, w) in status.src_weights().iter().enumerate() {
                match *w {
                    Weights::Version(v) => held.push(v),
                    weights => return Err(OrchestratorError::NoWeights { member: status.names[i].clone(), weights }),
                }
            }
            if held.iter().all(|&v| v == held[0]) {
                return Ok((held[0], status));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(OrchestratorError::VersionsDisagree { held, after: self.config.control_timeout });
            }
            tokio::time::sleep(AGREE_POLL).await;
            status = self.status().await?;
        }
    }

    /// Makes sure every member has the plan of the current strategy for
    /// both groups' current layouts installed: plans when a layout changed,
    /// installs on members that lack it (new or replaced ones). Returns
    /// whether it planned.
    async fn ensure_plan(&mut self, status: &Status, only: &Option<TensorSubset>) -> Result<bool, OrchestratorError> {
        let t = self.config.control_timeout;
        let mode = self.config.mode;
        let key = (mode, only.clone());
        let current = status.layouts;
        if self.cache.values().any(|c| c.layout_fingerprints != current) {
            self.cache.clear();
        }
        let cached = self.cache.get(&key).map(|c| c.fingerprint);
        let lacking: Vec<usize> = status
            .installed
            .iter()
            .enumerate()
            .filter(|(_, plans)| !matches!(cached, Some(f) if plans.contains(&f)))
            .map(|(i, _)| i)
            .collect();
        if lacking.is_empty() {
            return Ok(false);
        }
        // The layouts travel once: from one member of each group, and only
        // when their fingerprints changed.
        let (src, dst) = match &self.layouts {
            Some(k) if k.fingerprints == current => (k.src.clone(), k.dst.clone()),
            _ => {
                self.layouts = None;
                let src = describe(&self.src, Group::Src, current.0, t).await?;
                let dst = describe(&self.dst, Group::Dst, current.1, t).await?;
                self.layouts = Some(KnownLayouts { fingerprints: current, src: src.clone(), dst: dst.clone() });
                (src, dst)
            }
        };
        // Planning a large model is seconds of CPU: off the reactor, so the
        // control plane's heartbeats keep flowing meanwhile.
        let options = PlanOptions { only: only.clone(), ..self.config.plan.clone() };
        let (s, d) = (src.clone(), dst.clone());
        let planned = tokio::task::spawn_blocking(move || match mode {
            Strategy::Reshard => plan_reshard(&s, &d, &options),
            Strategy::Baseline => plan_baseline(&s, &d, &options),
        })
        .await;
        let plan = match planned {
            Ok(r) => Arc::new(r?),
            Err(e) => return Err(OrchestratorError::Failed { member: "orchestrator".into(), problem: format!("planning task: {e}") }),
        };
        let (fingerprint, bytes) = (plan.fingerprint(), plan.figures().total_bytes);
        self.plans_made += 1;
        // Plans of the other strategy were made for these layouts too, or
        // are gone.
        self.cache.retain(|_, c| c.layout_fingerprints == current);
        if cached != Some(fingerprint) {
            // Not installed anywhere yet (or the layouts changed under it).
            self.cache.remove(&key);
        }
        let which: Vec<usize> = if cached == Some(fingerprint) { lacking } else { (0..status.installed.len()).collect() };
        self.install(plan, src, dst, which).await?;
        self.cache.insert(key, CachedPlan { layout_fingerprints: current, fingerprint, bytes });
        Ok(true)
    }

    /// Hands members `which` (indices into sources then destinations)
    /// their own programs, derived one by one in a blocking task while
    /// earlier ones are sent: at most [`INSTALL_WINDOW`] programs exist at
    /// a time, never all of them.
    async fn install(&self, plan: Arc<Plan>, src: Arc<Layout>, dst: Arc<Layout>, which: Vec<usize>) -> Result<(), OrchestratorError> {
        let n_src = self.src.len();
        let fingerprint = plan.fingerprint();
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(usize, RankProgram)>(INSTALL_WINDOW);
        let producer = tokio::task::spawn_blocking(move || -> Result<(), PlanError> {
            let programs = Programs::new(&plan, &src, &dst)?;
            for i in which {
                let e = if i < n_src { Endpoint::src(i as u32) } else { Endpoint::dst((i - n_src) as u32) };
                if tx.blocking_send((i, programs.program(e))).is_err() {
                    // The installer gave up (a member failed).
                    break;
                }
            }
            Ok(())
        });
        let after = self.config.control_timeout;
        let mut calls = tokio::task::JoinSet::new();
        let mut result = Ok(());
        while let Some((i, program)) = rx.recv().await {
            let member = if i < n_src { self.src.get(i) } else { self.dst.get(i - n_src) };
            let Some(member) = member.cloned() else { continue };
            calls.spawn(async move {
                let name = member.name().to_string();
                match member.call_timeout(MemberMsg::Install { program: Box::new(program), fingerprint }, after).await {
                    Ok(MemberReply::Refused(r)) => Err(refused(&name, r)),
                    Ok(_) => Ok(()),
                    Err(e) => Err(call_error(name, e, after)),
                }
            });
            while calls.len() >= INSTALL_WINDOW {
                if let Some(done) = calls.join_next().await {
                    result = flatten(done);
                }
                if result.is_err() {
                    break;
                }
            }
            if result.is_err() {
                break;
            }
        }
        drop(rx);
        while result.is_ok() {
            match calls.join_next().await {
                Some(done) => result = flatten(done),
                None => break,
            }
        }
        calls.abort_all();
        let produced = producer.await;
        result?;
        match produced {
            Ok(r) => Ok(r?),
            Err(e) => Err(OrchestratorError::Failed { member: "orchestrator".into(), problem: format!("program task: {e}") }),
        }
    }

    /// The plan of the current strategy for `only`, installed everywhere.
    fn cached(&self, only: &Option<TensorSubset>) -> Result<&CachedPlan, OrchestratorError> {
        // `ensure_plan` caches a plan whenever it returns Ok; `status`
        // refuses empty groups.
        self.cache
            .get(&(self.config.mode, only.clone()))
            .ok_or_else(|| OrchestratorError::Failed { member: "orchestrator".into(), problem: "no plan after planning".into() })
    }

    async fn plan(&mut self) -> Result<PlanReport, OrchestratorError> {
        let status = self.status().await?;
        let replanned = self.ensure_plan(&status, &None).await?;
        let &CachedPlan { fingerprint, bytes, .. } = self.cached(&None)?;
        Ok(PlanReport { mode: self.config.mode, fingerprint, replanned, bytes })
    }

    async fn refit(&mut self, target: RefitTarget, only: Option<TensorSubset>) -> Result<RefitReport, OrchestratorError> {
        self.refits += 1;
        self.enter(RefitStep::Planning);
        let start = Instant::now();
        let mut attempts = 0;
        let r = loop {
            attempts += 1;
            match self.refit_once(target, &only, start).await {
                Err(OrchestratorError::VersionMismatch { .. }) if target == RefitTarget::Latest && attempts < LATEST_ATTEMPTS => {
                    // A step landed between the status and the read: refit
                    // the newer version.
                    self.enter(RefitStep::Planning);
                }
                r => break r,
            }
        };
        self.enter(RefitStep::Idle);
        r
    }

    async fn refit_once(
        &mut self,
        target: RefitTarget,
        only: &Option<TensorSubset>,
        start: Instant,
    ) -> Result<RefitReport, OrchestratorError> {
        let status = self.status().await?;
        let (version, status) = match target {
            RefitTarget::Version(v) => (v, status),
            RefitTarget::Latest => self.agreed_version(status).await?,
        };
        let mode = self.config.mode;
        if status.dst_weights().iter().all(|w| *w == Weights::Version(version)) {
            return Ok(RefitReport {
                version,
                already_served: true,
                mode,
                fingerprint: None,
                replanned: false,
                wall: start.elapsed(),
                plan_time: start.elapsed(),
                connect_time: Duration::ZERO,
                resumed: false,
                transfer_time: Duration::ZERO,
                commit_time: Duration::ZERO,
                bytes: 0,
            });
        }
        // Refused here, before anything is planned or moved; `Run` checks
        // again under each source's lock.
        for (i, w) in status.src_weights().iter().enumerate() {
            match *w {
                Weights::Version(held) if held == version => {}
                Weights::Version(held) => {
                    return Err(OrchestratorError::VersionMismatch { member: status.names[i].clone(), held, asked: version })
                }
                weights => return Err(OrchestratorError::NoWeights { member: status.names[i].clone(), weights }),
            }
        }
        // A subset refit keeps every other tensor from the version each
        // destination serves: one that serves none is refused here, before
        // anything moves (its member checks again).
        if only.is_some() {
            if let Some(i) = status.dst_weights().iter().position(|w| !matches!(w, Weights::Version(_))) {
                return Err(refused(&status.names[status.n_src + i], Refusal::NoBaseVersion));
            }
        }
        let replanned = self.ensure_plan(&status, only).await?;
        let plan_time = start.elapsed();
        let &CachedPlan { fingerprint, bytes, .. } = self.cached(only)?;
        let refit = self.refits;
        let t = Instant::now();
        // The kept connections of this plan, or a fresh data-plane epoch.
        let resumed = match self.kept.iter().position(|(f, _)| *f == fingerprint) {
            Some(i) => {
                let (_, session) = self.kept.remove(i);
                match self.resume(refit, fingerprint, &session).await {
                    Ok(all) => all.then_some(session),
                    Err(e) => {
                        self.forget_data_plane(true);
                        return Err(e);
                    }
                }
            }
            None => None,
        };
        let (session, resumed) = match resumed {
            Some(session) => (session, true),
            None => {
                let session = uuid::Uuid::new_v4().simple().to_string();
                if self.config.fabric == Fabric::InProcess {
                    hub::deposit(&session, local_fabric(&self.endpoints()));
                }
                (session, false)
            }
        };
        let mut connect_time = t.elapsed();
        let moved = self.transfer(refit, &session, version, fingerprint, resumed, &mut connect_time).await;
        hub::close(&session);
        let transfer_time = t.elapsed().saturating_sub(connect_time);
        let sent = match moved {
            Ok(sent) => sent,
            Err(e) => {
                self.kept.clear();
                self.delta_base.clear();
                // Every destination keeps serving its last committed version;
                // every member drops what it prepared for this refit.
                // A member that is stuck (an abort that hangs) must not hold up
                // the report: the discard is queued, not awaited; each member
                // handles it before anything the next refit asks.
                self.enter(RefitStep::Discarding);
                for (_, m) in self.src.iter().chain(self.dst.iter()) {
                    let _ = m.try_tell(MemberMsg::Discard);
                }
                return Err(e);
            }
        };
        if sent != bytes && !self.config.delta {
            tracing::warn!(sent, planned = bytes, "members sent another number of bytes than the plan moves");
        }
        // The second phase: every destination has staged the whole
        // version; flip.
        self.enter(RefitStep::Committing);
        let t = Instant::now();
        let commit = |g, _| (g == Group::Dst).then_some(MemberMsg::Commit { version });
        let committed = call_both(&self.src, &self.dst, commit, self.config.control_timeout).await;
        if let Err(e) = committed.and_then(|c| no_refusal(&c)) {
            self.kept.clear();
            self.delta_base.clear();
            return Err(e);
        }
        if self.config.delta {
            // Every member ran this refit clean and keeps what it sent and
            // received: the base of this plan's next one.
            self.delta_base.insert(fingerprint, refit);
        }
        if self.keeps_data_plane() {
            // Every member ran clean and keeps its endpoint of `session`.
            self.kept.retain(|(f, _)| *f != fingerprint);
            if self.kept.len() == INSTALLED_PLANS {
                self.kept.remove(0);
            }
            self.kept.push((fingerprint, session));
        }
        Ok(RefitReport {
            version,
            already_served: false,
            mode,
            fingerprint: Some(fingerprint),
            replanned,
            wall: start.elapsed(),
            plan_time,
            connect_time,
            resumed,
            transfer_time,
            commit_time: t.elapsed(),
            bytes: sent,
        })
    }

    /// Prepare, connect and run on every member: the first phase. Returns
    /// the bytes the members sent, as they counted them.
    async fn transfer(
        &self,
        refit: u64,
        session: &str,
        version: u64,
        fingerprint: Fingerprint,
        resumed: bool,
        connect_time: &mut Duration,
    ) -> Result<u64, OrchestratorError> {
        let t = Instant::now();
        let control = self.config.control_timeout;
        if !resumed {
            self.open(refit, session, fingerprint).await?;
        }
        *connect_time += t.elapsed();
        let deadline = self.config.deadline;
        let delta = self.config.delta.then(|| self.delta_base.get(&fingerprint).copied());
        let run = |_, _| Some(MemberMsg::Run { refit, version, fingerprint, deadline, delta });
        self.enter(RefitStep::Running);
        let ran = call_both(&self.src, &self.dst, run, deadline + control).await?;
        // The member whose own run failed (or that refused to run), rather
        // than one that failed because a peer aborted or went away.
        let root = ran
            .iter()
            .find(|(_, r)| matches!(r, MemberReply::Refused(refusal) if !matches!(refusal, Refusal::Exec { after_peer: true, .. })));
        if let Some((member, MemberReply::Refused(r))) = root {
            return Err(refused(member, r.clone()));
        }
        no_refusal(&ran)?;
        let mut sent = 0;
        for (member, reply) in ran {
            let MemberReply::Ran(stats) = reply else {
                return Err(OrchestratorError::Protocol { member, request: "Run", reply: format!("{reply:?}") });
            };
            sent += stats.sent_bytes;
        }
        Ok(sent)
    }

    /// Whether members keep their node-fabric connections after a refit.
    fn keeps_data_plane(&self) -> bool {
        self.config.keep_data_plane && matches!(self.config.fabric, Fabric::Node(_) | Fabric::Nccl(_) | Fabric::Ipc(_))
    }

    /// Asks every member to take up its endpoint of the kept `session` for
    /// this refit: `Ok(true)` if all did; `Ok(false)` if any keeps none (a
    /// fresh data plane replaces the rest); an error if a member is gone.
    async fn resume(&self, refit: u64, fingerprint: Fingerprint, session: &str) -> Result<bool, OrchestratorError> {
        self.enter(RefitStep::Resuming);
        let resume = |_, _| Some(MemberMsg::Resume { refit, fingerprint, session: session.to_string() });
        let replies = call_both(&self.src, &self.dst, resume, self.config.control_timeout).await?;
        if let Some((member, _)) = replies.iter().find(|(_, r)| matches!(r, MemberReply::Refused(Refusal::NotKept { .. }))) {
            tracing::info!(%member, "no kept data plane; opening a fresh one");
            return Ok(false);
        }
        no_refusal(&replies)?;
        Ok(true)
    }

    /// Opens a fresh data plane for this refit on every member: prepare,
    /// and connect for the node fabric.
    async fn open(&self, refit: u64, session: &str, fingerprint: Fingerprint) -> Result<(), OrchestratorError> {
        let control = self.config.control_timeout;
        let fabric = self.config.fabric.clone();
        let keep = self.keeps_data_plane();
        let prepare = |_, _| Some(MemberMsg::Prepare { refit, fingerprint, session: session.to_string(), fabric: fabric.clone(), keep });
        self.enter(RefitStep::Preparing);
        let prepared = call_both(&self.src, &self.dst, prepare, control).await?;
        no_refusal(&prepared)?;
        let mut peers = Vec::with_capacity(prepared.len());
        for (member, reply) in prepared {
            let MemberReply::Prepared { endpoint, node, addr } = reply else {
                return Err(OrchestratorError::Protocol { member, request: "Prepare", reply: format!("{reply:?}") });
            };
            peers.push(PeerAddr { endpoint, node, addr });
        }
        let connect_timeout = match &fabric {
            Fabric::InProcess => None,
            Fabric::Node(settings) => Some(settings.connect_timeout),
            // Every member creates its rank of the communicator at once;
            // a creation that fails is cleaned up within the abort timeout.
            Fabric::Nccl(settings) => Some(settings.init_timeout + settings.abort_timeout),
            Fabric::Ipc(settings) => Some(settings.connect_timeout + settings.abort_timeout),
        };
        if let Some(timeout) = connect_timeout {
            let connect = |_, _| Some(MemberMsg::Connect { refit, peers: peers.clone() });
            self.enter(RefitStep::Connecting);
            let connected = call_both(&self.src, &self.dst, connect, timeout + control).await?;
            no_refusal(&connected)?;
        }
        Ok(())
    }

    /// Forgets the kept data planes; with `tell`, members drop theirs now
    /// (a queued `Discard`: between refits it only drops what is kept).
    fn forget_data_plane(&mut self, tell: bool) {
        self.kept.clear();
        // A replaced member holds no base: the next refit is dense.
        self.delta_base.clear();
        if tell {
            for (_, m) in self.src.iter().chain(self.dst.iter()) {
                let _ = m.try_tell(MemberMsg::Discard);
            }
        }
    }

    /// Puts `member` in place of rank `endpoint`'s.
    fn replace(&mut self, endpoint: Endpoint, member: ActorRef<Member>) -> Result<(), OrchestratorError> {
        let group = match endpoint.group {
            Group::Src => &mut self.src,
            Group::Dst => &mut self.dst,
        };
        let ranks = group.len();
        *group = group.with_member(endpoint.rank as usize, member).map_err(|_| OrchestratorError::NoRank { endpoint, ranks })?;
        Ok(())
    }
}

#[async_trait]
impl Actor for Orchestrator {
    type Msg = OrchestratorMsg;
    type Reply = OrchestratorReply;

    async fn handle(&mut self, msg: OrchestratorMsg, _ctx: &mut Context<Self>) -> Result<OrchestratorReply, ActorError> {
        Ok(match msg {
            OrchestratorMsg::Refit { target, only } => OrchestratorReply::Refit(self.refit(target, only).await),
            OrchestratorMsg::Plan => OrchestratorReply::Planned(self.plan().await),
            OrchestratorMsg::PlansMade => OrchestratorReply::PlansMade(self.plans_made),
            OrchestratorMsg::SetMode(mode) => {
                // Plans are kept per strategy: switching back is free.
                self.config.mode = mode;
                OrchestratorReply::Done(Ok(()))
            }
            OrchestratorMsg::Attach { src, dst } => {
                // Cached plans stay valid while the members report the same
                // layouts; members that lack the plan get it installed.
                self.forget_data_plane(true);
                self.src = src;
                self.dst = dst;
                OrchestratorReply::Done(Ok(()))
            }
            OrchestratorMsg::Replace { endpoint, member } => {
                // The other members' peers change: all reconnect.
                self.forget_data_plane(true);
                OrchestratorReply::Done(self.replace(endpoint, member))
            }
            OrchestratorMsg::CloseDataPlane => {
                self.forget_data_plane(true);
                OrchestratorReply::Done(Ok(()))
            }
            OrchestratorMsg::Invalidate => {
                self.forget_data_plane(true);
                self.cache.clear();
                self.layouts = None;
                OrchestratorReply::Done(Ok(()))
            }
        })
    }
}
