//! The orchestrator actor: attaches to a source group and a sink group,
//! plans once per pair of layouts, and refits after every optimizer step.

use crate::fabric::hub;
use crate::member::Member;
use crate::protocol::{Fabric, MemberMsg, MemberReply, PeerAddr, Refusal};
use actors::{async_trait, Actor, ActorError, ActorGroup, CallError, Context, GroupError};
use reshard::{
    parse_layout, plan_baseline, plan_reshard, Endpoint, Fingerprint, Layout, LayoutError, PlanError, PlanOptions, RankProgram, Strategy,
};
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
}

impl Default for OrchestratorConfig {
    fn default() -> Self {
        OrchestratorConfig {
            fabric: Fabric::InProcess,
            mode: Strategy::Reshard,
            plan: PlanOptions::default(),
            deadline: transport::DEFAULT_DEADLINE,
            control_timeout: Duration::from_secs(10),
        }
    }
}

/// What one refit did.
#[derive(Debug, Clone, PartialEq)]
pub struct RefitReport {
    /// The version now served by every sink.
    pub version: u64,
    /// Reshard or baseline.
    pub mode: Strategy,
    /// The plan's fingerprint.
    pub fingerprint: Fingerprint,
    /// Whether this refit had to (re)plan.
    pub replanned: bool,
    /// Wall time of the whole refit.
    pub wall: Duration,
    /// Asking members for their status (and layouts), and (re)planning and
    /// installing if needed.
    pub plan_time: Duration,
    /// Opening this refit's data plane on every member (prepare, and
    /// connect for the node fabric).
    pub connect_time: Duration,
    /// Moving the bytes: from asking every member to run until the last
    /// one finished.
    pub transfer_time: Duration,
    /// Committing on every sink.
    pub commit_time: Duration,
    /// Bytes moved between ranks.
    pub bytes: u64,
}

/// Why a refit failed. Sinks then still serve their last committed version.
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
        /// `source` or `sink`.
        group: &'static str,
        /// What is wrong.
        problem: String,
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
    /// Members open their data-plane endpoints.
    Preparing,
    /// Members connect to their peers.
    Connecting,
    /// Members move the bytes; sinks stage.
    Running,
    /// Every sink staged the whole version; sinks flip.
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
    /// Refit `version` (the sources' current version) into every sink.
    Refit {
        /// The version.
        version: u64,
    },
    /// Switch between reshard and baseline (plans the other strategy on the
    /// next refit, once).
    SetMode(Strategy),
    /// Replace the groups (a resize, or replaced members); the next refit
    /// replans if their layouts changed and installs on members that lack
    /// the plan.
    Attach {
        /// Training ranks.
        sources: ActorGroup<Member>,
        /// Inference ranks.
        sinks: ActorGroup<Member>,
    },
    /// Forget the cached plan.
    Invalidate,
    /// How many plans have been made so far.
    PlansMade,
}

/// Replies of the orchestrator.
#[derive(Debug, Clone)]
pub enum OrchestratorReply {
    /// The outcome of a refit.
    Refit(Result<RefitReport, OrchestratorError>),
    /// Number of plans made.
    PlansMade(u64),
    /// Done.
    Done,
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

/// The orchestrator actor.
pub struct Orchestrator {
    sources: ActorGroup<Member>,
    sinks: ActorGroup<Member>,
    config: OrchestratorConfig,
    /// One plan per strategy, while both layouts stay the same.
    cache: std::collections::HashMap<Strategy, CachedPlan>,
    plans_made: u64,
    /// Refits started, the data-plane epoch.
    refits: u64,
    phase: tokio::sync::watch::Sender<RefitPhase>,
}

impl Orchestrator {
    /// An orchestrator for these groups.
    pub fn new(sources: ActorGroup<Member>, sinks: ActorGroup<Member>, config: OrchestratorConfig) -> Orchestrator {
        Orchestrator {
            sources,
            sinks,
            config,
            cache: Default::default(),
            plans_made: 0,
            refits: 0,
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

fn group_error(group: &ActorGroup<Member>, e: GroupError, after: Duration) -> OrchestratorError {
    match e {
        GroupError::Rank { rank, error } => {
            let member = group.get(rank).map_or_else(|| format!("rank {rank}"), |m| m.name().to_string());
            call_error(member, error, after)
        }
        other => OrchestratorError::Failed { member: "group".into(), problem: other.to_string() },
    }
}

fn refused(member: &str, r: Refusal) -> OrchestratorError {
    match r {
        Refusal::FingerprintMismatch { installed, asked } => {
            OrchestratorError::FingerprintMismatch { member: member.to_string(), installed, asked }
        }
        Refusal::VersionMismatch { held, asked } => OrchestratorError::VersionMismatch { member: member.to_string(), held, asked },
        refusal => OrchestratorError::Refused { member: member.to_string(), refusal },
    }
}

/// Asks every member of `group` for its layout; all must agree.
async fn describe(group: &ActorGroup<Member>, name: &'static str, timeout: Duration) -> Result<String, OrchestratorError> {
    let replies = group.call_all_timeout(|_| MemberMsg::Describe, timeout).await.map_err(|e| group_error(group, e, timeout))?;
    let mut layout: Option<String> = None;
    for (rank, reply) in replies.into_iter().enumerate() {
        let MemberReply::Layout(info) = reply else {
            return Err(OrchestratorError::Layout { group: name, problem: format!("rank {rank} answered {reply:?} to Describe") });
        };
        if info.rank as usize != rank {
            return Err(OrchestratorError::Layout { group: name, problem: format!("member at rank {rank} says it is rank {}", info.rank) });
        }
        match &layout {
            None => layout = Some(info.layout_json),
            Some(l) if *l != info.layout_json => {
                return Err(OrchestratorError::Layout {
                    group: name,
                    problem: format!("rank {rank} reports a different layout than rank 0"),
                });
            }
            Some(_) => {}
        }
    }
    layout.ok_or(OrchestratorError::Layout { group: name, problem: "the group is empty".into() })
}

fn parse(group: &'static str, json: &str, members: usize) -> Result<Layout, OrchestratorError> {
    let layout = parse_layout(json).map_err(|e: LayoutError| OrchestratorError::Layout { group, problem: e.to_string() })?;
    if layout.ranks() as usize != members {
        return Err(OrchestratorError::Layout {
            group,
            problem: format!("layout has {} ranks but the group has {members} members", layout.ranks()),
        });
    }
    Ok(layout)
}

/// Every member's reply to `msg(group, rank)`, or the first failure.
async fn call_both(
    sources: &ActorGroup<Member>,
    sinks: &ActorGroup<Member>,
    msg: impl Fn(reshard::Group, usize) -> Option<MemberMsg>,
    after: Duration,
) -> Result<Vec<(String, MemberReply)>, OrchestratorError> {
    let mut calls = Vec::new();
    for (g, group) in [(reshard::Group::Src, sources), (reshard::Group::Dst, sinks)] {
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

impl Orchestrator {
    fn endpoints(&self) -> Vec<Endpoint> {
        (0..self.sources.len() as u32).map(Endpoint::src).chain((0..self.sinks.len() as u32).map(Endpoint::dst)).collect()
    }

    /// Makes sure every member has the plan of the current strategy for
    /// both groups' current layouts installed: plans when a layout changed,
    /// installs on members that lack it (new or replaced ones). Returns
    /// whether it planned.
    async fn ensure_plan(&mut self) -> Result<bool, OrchestratorError> {
        let t = self.config.control_timeout;
        let mode = self.config.mode;
        for (group, members) in [("source", &self.sources), ("sink", &self.sinks)] {
            if members.is_empty() {
                return Err(OrchestratorError::Layout { group, problem: "the group has no members".into() });
            }
        }
        // Cheap check first: every member's layout fingerprint and plans.
        let status = call_both(&self.sources, &self.sinks, |_, _| Some(MemberMsg::Status), t).await?;
        let mut layouts: [Option<u64>; 2] = [None, None];
        let mut agree = true;
        let mut installed = Vec::with_capacity(status.len());
        for (i, (member, reply)) in status.into_iter().enumerate() {
            let MemberReply::Status { layout, installed: plans } = reply else {
                return Err(OrchestratorError::Protocol { member, request: "Status", reply: format!("{reply:?}") });
            };
            let g = usize::from(i >= self.sources.len());
            agree &= *layouts[g].get_or_insert(layout) == layout;
            installed.push(plans);
        }
        let current = layouts[0].zip(layouts[1]).filter(|_| agree);
        if current.is_none() || self.cache.values().any(|c| Some(c.layout_fingerprints) != current) {
            self.cache.clear();
        }
        let cached = self.cache.get(&mode).map(|c| c.fingerprint);
        let lacking: Vec<usize> =
            installed.iter().enumerate().filter(|(_, plans)| !matches!(cached, Some(f) if plans.contains(&f))).map(|(i, _)| i).collect();
        if lacking.is_empty() {
            return Ok(false);
        }
        // Plan (again, for members that lack a cached plan), build the
        // programs, hand each member that needs it its own, drop the rest.
        let src_json = describe(&self.sources, "source", t).await?;
        let dst_json = describe(&self.sinks, "sink", t).await?;
        // Parsing and planning a large model is seconds of CPU: off the
        // reactor, so the control plane's heartbeats keep flowing meanwhile.
        let (options, n_src, n_dst) = (self.config.plan, self.sources.len(), self.sinks.len());
        let (src_fp, dst_fp) = (reshard::fingerprint::fnv64(&src_json), reshard::fingerprint::fnv64(&dst_json));
        let planned = tokio::task::spawn_blocking(move || -> Result<_, OrchestratorError> {
            let src = parse("source", &src_json, n_src)?;
            let dst = parse("sink", &dst_json, n_dst)?;
            let plan = match mode {
                Strategy::Reshard => plan_reshard(&src, &dst, &options)?,
                Strategy::Baseline => plan_baseline(&src, &dst, &options)?,
            };
            Ok((plan.fingerprint(), plan.figures().total_bytes, plan.programs(&src, &dst)?))
        })
        .await;
        let (fingerprint, bytes, programs) = match planned {
            Ok(r) => r?,
            Err(e) => return Err(OrchestratorError::Failed { member: "orchestrator".into(), problem: format!("planning task: {e}") }),
        };
        self.plans_made += 1;
        let layout_fingerprints = (src_fp, dst_fp);
        // Plans of the other strategy were made for these layouts too, or
        // are gone.
        self.cache.retain(|_, c| c.layout_fingerprints == layout_fingerprints);
        if cached != Some(fingerprint) {
            // Not installed anywhere yet (or the layouts changed under it).
            self.cache.remove(&mode);
        }
        let which: Vec<usize> = if cached == Some(fingerprint) { lacking } else { (0..programs.len()).collect() };
        self.install(programs, &which, fingerprint).await?;
        self.cache.insert(mode, CachedPlan { layout_fingerprints, fingerprint, bytes });
        Ok(true)
    }

    /// Hands members `which` (indices into sources then sinks) their
    /// programs (moved, not copied).
    async fn install(&self, programs: Vec<RankProgram>, which: &[usize], fingerprint: Fingerprint) -> Result<(), OrchestratorError> {
        let n_src = self.sources.len();
        let slots: std::sync::Mutex<Vec<Option<RankProgram>>> = std::sync::Mutex::new(programs.into_iter().map(Some).collect());
        let msg = |g: reshard::Group, rank: usize| {
            let i = if g == reshard::Group::Src { rank } else { n_src + rank };
            if which.binary_search(&i).is_err() {
                return None;
            }
            let program = slots.lock().unwrap_or_else(|e| e.into_inner()).get_mut(i)?.take()?;
            Some(MemberMsg::Install { program: Box::new(program), fingerprint })
        };
        let replies = call_both(&self.sources, &self.sinks, msg, self.config.control_timeout).await?;
        no_refusal(&replies)
    }

    async fn refit(&mut self, version: u64) -> Result<RefitReport, OrchestratorError> {
        let r = self.refit_steps(version).await;
        self.enter(RefitStep::Idle);
        r
    }

    async fn refit_steps(&mut self, version: u64) -> Result<RefitReport, OrchestratorError> {
        self.refits += 1;
        self.enter(RefitStep::Planning);
        let start = Instant::now();
        let replanned = self.ensure_plan().await?;
        let plan_time = start.elapsed();
        let Some(&CachedPlan { fingerprint, bytes, .. }) = self.cache.get(&self.config.mode) else {
            // `ensure_plan` caches a plan whenever it returns Ok with members
            // in both groups; it refuses empty groups.
            return Err(OrchestratorError::Failed { member: "orchestrator".into(), problem: "no plan after planning".into() });
        };
        let refit = self.refits;
        // A fresh data-plane epoch for every refit.
        let session = uuid::Uuid::new_v4().simple().to_string();
        if self.config.fabric == Fabric::InProcess {
            hub::deposit(&session, local_fabric(&self.endpoints()));
        }
        let t = Instant::now();
        let mut connect_time = Duration::ZERO;
        let moved = self.transfer(refit, &session, version, fingerprint, &mut connect_time).await;
        hub::close(&session);
        let transfer_time = t.elapsed().saturating_sub(connect_time);
        if let Err(e) = moved {
            // Every sink keeps serving its last committed version; every
            // member drops what it prepared for this refit.
            // A member that is stuck (an abort that hangs) must not hold up
            // the report: the discard is queued, not awaited; each member
            // handles it before anything the next refit asks.
            self.enter(RefitStep::Discarding);
            for (_, m) in self.sources.iter().chain(self.sinks.iter()) {
                let _ = m.try_tell(MemberMsg::Discard);
            }
            return Err(e);
        }
        // The second phase: every sink has staged the whole version; flip.
        self.enter(RefitStep::Committing);
        let t = Instant::now();
        let commit = |g, _| (g == reshard::Group::Dst).then_some(MemberMsg::Commit { version });
        no_refusal(&call_both(&self.sources, &self.sinks, commit, self.config.control_timeout).await?)?;
        Ok(RefitReport {
            version,
            mode: self.config.mode,
            fingerprint,
            replanned,
            wall: start.elapsed(),
            plan_time,
            connect_time,
            transfer_time,
            commit_time: t.elapsed(),
            bytes,
        })
    }

    /// Prepare, connect and run on every member: the first phase.
    async fn transfer(
        &self,
        refit: u64,
        session: &str,
        version: u64,
        fingerprint: Fingerprint,
        connect_time: &mut Duration,
    ) -> Result<(), OrchestratorError> {
        let t = Instant::now();
        let control = self.config.control_timeout;
        let fabric = self.config.fabric.clone();
        let prepare = |_, _| Some(MemberMsg::Prepare { refit, fingerprint, session: session.to_string(), fabric: fabric.clone() });
        self.enter(RefitStep::Preparing);
        let prepared = call_both(&self.sources, &self.sinks, prepare, control).await?;
        no_refusal(&prepared)?;
        let mut peers = Vec::with_capacity(prepared.len());
        for (member, reply) in prepared {
            let MemberReply::Prepared { endpoint, node, addr } = reply else {
                return Err(OrchestratorError::Protocol { member, request: "Prepare", reply: format!("{reply:?}") });
            };
            peers.push(PeerAddr { endpoint, node, addr });
        }
        if let Fabric::Node(settings) = &fabric {
            let connect = |_, _| Some(MemberMsg::Connect { refit, peers: peers.clone() });
            self.enter(RefitStep::Connecting);
            let connected = call_both(&self.sources, &self.sinks, connect, settings.connect_timeout + control).await?;
            no_refusal(&connected)?;
        }
        *connect_time = t.elapsed();
        let deadline = self.config.deadline;
        let run = |_, _| Some(MemberMsg::Run { refit, version, fingerprint, deadline });
        self.enter(RefitStep::Running);
        let ran = call_both(&self.sources, &self.sinks, run, deadline + control).await?;
        no_refusal(&ran)
    }
}

#[async_trait]
impl Actor for Orchestrator {
    type Msg = OrchestratorMsg;
    type Reply = OrchestratorReply;

    async fn handle(&mut self, msg: OrchestratorMsg, _ctx: &mut Context<Self>) -> Result<OrchestratorReply, ActorError> {
        match msg {
            OrchestratorMsg::Refit { version } => Ok(OrchestratorReply::Refit(self.refit(version).await)),
            OrchestratorMsg::PlansMade => Ok(OrchestratorReply::PlansMade(self.plans_made)),
            OrchestratorMsg::SetMode(mode) => {
                // Plans are kept per strategy: switching back is free.
                self.config.mode = mode;
                Ok(OrchestratorReply::Done)
            }
            OrchestratorMsg::Attach { sources, sinks } => {
                // Cached plans stay valid while the members report the same
                // layouts; members that lack the plan get it installed.
                self.sources = sources;
                self.sinks = sinks;
                Ok(OrchestratorReply::Done)
            }
            OrchestratorMsg::Invalidate => {
                self.cache.clear();
                Ok(OrchestratorReply::Done)
            }
        }
    }
}
