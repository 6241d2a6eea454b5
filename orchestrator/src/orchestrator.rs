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
            deadline: Duration::from_secs(60),
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
    /// Asking members for their layouts, and (re)planning if needed.
    pub plan_time: Duration,
    /// Moving the bytes.
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

/// Messages the orchestrator handles.
pub enum OrchestratorMsg {
    /// Refit `version` (the sources' current version) into every sink.
    Refit {
        /// The version.
        version: u64,
    },
    /// Switch between reshard and baseline (replans on the next refit).
    SetMode(Strategy),
    /// Replace the groups (e.g. after a resize); replans on the next refit.
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

struct CachedPlan {
    key: (String, String, Strategy),
    /// Layout fingerprints every member of each group reported.
    layout_fingerprints: (u64, u64),
    fingerprint: Fingerprint,
    bytes: u64,
    /// Every rank's program (sources, then sinks), for members that join
    /// later (a replaced process).
    programs: Vec<RankProgram>,
}

/// The orchestrator actor.
pub struct Orchestrator {
    sources: ActorGroup<Member>,
    sinks: ActorGroup<Member>,
    config: OrchestratorConfig,
    cache: Option<CachedPlan>,
    plans_made: u64,
    /// Refits started, the data-plane epoch.
    refits: u64,
}

impl Orchestrator {
    /// An orchestrator for these groups.
    pub fn new(sources: ActorGroup<Member>, sinks: ActorGroup<Member>, config: OrchestratorConfig) -> Orchestrator {
        Orchestrator { sources, sinks, config, cache: None, plans_made: 0, refits: 0 }
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

    /// Makes sure every member has the plan for both groups' current
    /// layouts installed: plans when a layout changed, installs on members
    /// that lack it (new or replaced ones).
    async fn ensure_plan(&mut self) -> Result<bool, OrchestratorError> {
        let t = self.config.control_timeout;
        // Cheap check first: every member's layout fingerprint and plan.
        let status = call_both(&self.sources, &self.sinks, |_, _| Some(MemberMsg::Status), t).await?;
        let mut layouts: [Option<u64>; 2] = [None, None];
        let mut agree = true;
        let mut lacking = Vec::new();
        for (i, (member, reply)) in status.iter().enumerate() {
            let MemberReply::Status { layout, installed } = reply else {
                return Err(OrchestratorError::Protocol { member: member.clone(), request: "Status", reply: format!("{reply:?}") });
            };
            let g = usize::from(i >= self.sources.len());
            agree &= *layouts[g].get_or_insert(*layout) == *layout;
            lacking.push((i, *installed));
        }
        if let Some(c) = &self.cache {
            if agree && Some(c.layout_fingerprints) == layouts[0].zip(layouts[1]) && c.key.2 == self.config.mode {
                let fingerprint = c.fingerprint;
                lacking.retain(|(_, installed)| *installed != Some(fingerprint));
                if lacking.is_empty() {
                    return Ok(false);
                }
                let todo: Vec<usize> = lacking.iter().map(|(i, _)| *i).collect();
                self.install(&todo).await?;
                return Ok(false);
            }
        }
        let src_json = describe(&self.sources, "source", t).await?;
        let dst_json = describe(&self.sinks, "sink", t).await?;
        let key = (src_json, dst_json, self.config.mode);
        self.cache = None;
        let src = parse("source", &key.0, self.sources.len())?;
        let dst = parse("sink", &key.1, self.sinks.len())?;
        let plan = match self.config.mode {
            Strategy::Reshard => plan_reshard(&src, &dst, &self.config.plan)?,
            Strategy::Baseline => plan_baseline(&src, &dst, &self.config.plan)?,
        };
        let programs = plan.programs(&src, &dst)?;
        self.plans_made += 1;
        let layout_fingerprints = (reshard::fingerprint::fnv64(&key.0), reshard::fingerprint::fnv64(&key.1));
        self.cache =
            Some(CachedPlan { key, layout_fingerprints, fingerprint: plan.fingerprint(), bytes: plan.figures().total_bytes, programs });
        let all: Vec<usize> = (0..self.sources.len() + self.sinks.len()).collect();
        if let Err(e) = self.install(&all).await {
            // Installed nowhere for sure: plan again next time.
            self.cache = None;
            return Err(e);
        }
        Ok(true)
    }

    /// Installs the cached plan's programs on members `which` (indices into
    /// sources then sinks).
    async fn install(&self, which: &[usize]) -> Result<(), OrchestratorError> {
        let Some(c) = &self.cache else { return Ok(()) };
        let n_src = self.sources.len();
        let fingerprint = c.fingerprint;
        let msg = |g: reshard::Group, rank: usize| {
            let i = if g == reshard::Group::Src { rank } else { n_src + rank };
            which.contains(&i).then(|| MemberMsg::Install { program: Box::new(c.programs[i].clone()), fingerprint })
        };
        let replies = call_both(&self.sources, &self.sinks, msg, self.config.control_timeout).await?;
        no_refusal(&replies)
    }

    async fn refit(&mut self, version: u64) -> Result<RefitReport, OrchestratorError> {
        let start = Instant::now();
        let replanned = self.ensure_plan().await?;
        let plan_time = start.elapsed();
        let (fingerprint, bytes) = match &self.cache {
            Some(c) => (c.fingerprint, c.bytes),
            None => unreachable!("ensure_plan leaves a plan cached"),
        };
        self.refits += 1;
        let refit = self.refits;
        // A fresh data-plane epoch for every refit.
        let session = uuid::Uuid::new_v4().simple().to_string();
        if self.config.fabric == Fabric::InProcess {
            hub::deposit(&session, local_fabric(&self.endpoints()));
        }
        let t = Instant::now();
        let moved = self.transfer(refit, &session, version, fingerprint).await;
        hub::close(&session);
        let transfer_time = t.elapsed();
        if let Err(e) = moved {
            // Every sink keeps serving its last committed version; every
            // member drops what it prepared for this refit.
            let _ = call_both(&self.sources, &self.sinks, |_, _| Some(MemberMsg::Discard), self.config.control_timeout).await;
            return Err(e);
        }
        // The second phase: every sink has staged the whole version; flip.
        let t = Instant::now();
        let timeout = self.config.control_timeout;
        let replies = self
            .sinks
            .call_all_timeout(|_| MemberMsg::Commit { version }, timeout)
            .await
            .map_err(|e| group_error(&self.sinks, e, timeout))?;
        for (rank, reply) in replies.into_iter().enumerate() {
            if let MemberReply::Refused(r) = reply {
                return Err(refused(self.sinks.get(rank).map_or("?", |m| m.name()), r));
            }
        }
        Ok(RefitReport {
            version,
            mode: self.config.mode,
            fingerprint,
            replanned,
            wall: start.elapsed(),
            plan_time,
            transfer_time,
            commit_time: t.elapsed(),
            bytes,
        })
    }

    /// Prepare, connect and run on every member: the first phase.
    async fn transfer(&self, refit: u64, session: &str, version: u64, fingerprint: Fingerprint) -> Result<(), OrchestratorError> {
        let control = self.config.control_timeout;
        let fabric = self.config.fabric.clone();
        let prepare = |_, _| Some(MemberMsg::Prepare { refit, session: session.to_string(), fabric: fabric.clone() });
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
            let connected = call_both(&self.sources, &self.sinks, connect, settings.connect_timeout + control).await?;
            no_refusal(&connected)?;
        }
        let deadline = self.config.deadline;
        let run = |_, _| Some(MemberMsg::Run { refit, version, fingerprint, deadline });
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
                self.config.mode = mode;
                self.cache = None;
                Ok(OrchestratorReply::Done)
            }
            OrchestratorMsg::Attach { sources, sinks } => {
                self.sources = sources;
                self.sinks = sinks;
                self.cache = None;
                Ok(OrchestratorReply::Done)
            }
            OrchestratorMsg::Invalidate => {
                self.cache = None;
                Ok(OrchestratorReply::Done)
            }
        }
    }
}
