//! The orchestrator actor: attaches to a source group and a sink group,
//! plans once per pair of layouts, and refits after every optimizer step.

use crate::member::{Member, MemberMsg, MemberReply, Refusal};
use actors::{async_trait, Actor, ActorError, ActorGroup, CallError, Context, GroupError};
use reshard::{
    parse_layout, plan_baseline, plan_reshard, Endpoint, Fingerprint, Layout, LayoutError, PlanError, PlanOptions, RankProgram, Strategy,
};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
use transport::local_fabric;

/// Orchestrator settings.
#[derive(Debug, Clone, Copy)]
pub struct OrchestratorConfig {
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
    #[error("{member}: {problem}")]
    Member {
        /// The member.
        member: String,
        /// What happened.
        problem: String,
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
}

/// The orchestrator actor.
pub struct Orchestrator {
    sources: ActorGroup<Member>,
    sinks: ActorGroup<Member>,
    config: OrchestratorConfig,
    cache: Option<CachedPlan>,
    plans_made: u64,
}

impl Orchestrator {
    /// An orchestrator for these groups.
    pub fn new(sources: ActorGroup<Member>, sinks: ActorGroup<Member>, config: OrchestratorConfig) -> Orchestrator {
        Orchestrator { sources, sinks, config, cache: None, plans_made: 0 }
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
        CallError::Handler { error, .. } => OrchestratorError::Member { member, problem: error.to_string() },
    }
}

fn group_error(group: &ActorGroup<Member>, e: GroupError, after: Duration) -> OrchestratorError {
    match e {
        GroupError::Rank { rank, error } => {
            let member = group.get(rank).map_or_else(|| format!("rank {rank}"), |m| m.name().to_string());
            call_error(member, error, after)
        }
        other => OrchestratorError::Member { member: "group".into(), problem: other.to_string() },
    }
}

fn refused(member: &str, r: Refusal) -> OrchestratorError {
    match r {
        Refusal::FingerprintMismatch { installed, asked } => {
            OrchestratorError::FingerprintMismatch { member: member.to_string(), installed, asked }
        }
        Refusal::VersionMismatch { held, asked } => OrchestratorError::VersionMismatch { member: member.to_string(), held, asked },
        other => OrchestratorError::Member { member: member.to_string(), problem: format!("{other:?}") },
    }
}

/// The layout fingerprint all members of `group` report, or `None` if they
/// disagree (a full `describe` then says who differs).
async fn layout_fingerprint(group: &ActorGroup<Member>, timeout: Duration) -> Result<Option<u64>, OrchestratorError> {
    let replies = group.call_all_timeout(|_| MemberMsg::LayoutFingerprint, timeout).await.map_err(|e| group_error(group, e, timeout))?;
    let mut fps = replies.into_iter().map(|r| match r {
        MemberReply::LayoutFingerprint(f) => Some(f),
        _ => None,
    });
    let first = fps.next().flatten();
    Ok(if fps.all(|f| f == first) { first } else { None })
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

impl Orchestrator {
    /// Makes sure the cached plan matches both groups' current layouts.
    async fn ensure_plan(&mut self) -> Result<bool, OrchestratorError> {
        let t = self.config.control_timeout;
        // Cheap check first: if every member reports the layout fingerprint
        // the cached plan was made for, nothing changed.
        let fps = (layout_fingerprint(&self.sources, t).await?, layout_fingerprint(&self.sinks, t).await?);
        if let Some(c) = &self.cache {
            if Some(c.layout_fingerprints) == fps.0.zip(fps.1) && c.key.2 == self.config.mode {
                return Ok(false);
            }
        }
        let src_json = describe(&self.sources, "source", t).await?;
        let dst_json = describe(&self.sinks, "sink", t).await?;
        let key = (src_json, dst_json, self.config.mode);
        if self.cache.as_ref().is_some_and(|c| c.key == key) {
            return Ok(false);
        }
        self.cache = None;
        let src = parse("source", &key.0, self.sources.len())?;
        let dst = parse("sink", &key.1, self.sinks.len())?;
        let plan = match self.config.mode {
            Strategy::Reshard => plan_reshard(&src, &dst, &self.config.plan)?,
            Strategy::Baseline => plan_baseline(&src, &dst, &self.config.plan)?,
        };
        let programs: Vec<Arc<RankProgram>> = plan.programs(&src, &dst)?.into_iter().map(Arc::new).collect();
        let fingerprint = plan.fingerprint();
        let n_src = self.sources.len();
        let (a, b) = tokio::join!(
            self.sources.call_all_timeout(|r| MemberMsg::Install { program: programs[r].clone(), fingerprint }, t),
            self.sinks.call_all_timeout(|r| MemberMsg::Install { program: programs[n_src + r].clone(), fingerprint }, t),
        );
        for (group, replies) in [(&self.sources, a), (&self.sinks, b)] {
            for (rank, reply) in replies.map_err(|e| group_error(group, e, t))?.into_iter().enumerate() {
                if let MemberReply::Refused(r) = reply {
                    return Err(refused(group.get(rank).map_or("?", |m| m.name()), r));
                }
            }
        }
        self.plans_made += 1;
        let layout_fingerprints = (reshard::fingerprint::fnv64(&key.0), reshard::fingerprint::fnv64(&key.1));
        self.cache = Some(CachedPlan { key, layout_fingerprints, fingerprint, bytes: plan.figures().total_bytes });
        Ok(true)
    }

    async fn refit(&mut self, version: u64) -> Result<RefitReport, OrchestratorError> {
        let start = Instant::now();
        let replanned = self.ensure_plan().await?;
        let plan_time = start.elapsed();
        let (fingerprint, bytes) = match &self.cache {
            Some(c) => (c.fingerprint, c.bytes),
            None => unreachable!("ensure_plan leaves a plan cached"),
        };
        // A fresh data-plane epoch for every refit.
        let endpoints: Vec<Endpoint> =
            (0..self.sources.len() as u32).map(Endpoint::src).chain((0..self.sinks.len() as u32).map(Endpoint::dst)).collect();
        let mut transports: Vec<Option<_>> = local_fabric(&endpoints).into_iter().map(Some).collect();
        let (src_t, dst_t) = transports.split_at_mut(self.sources.len());
        let deadline = self.config.deadline;
        let after = deadline + self.config.control_timeout;
        let t = Instant::now();
        let run = |slot: &mut Option<transport::LocalTransport>| MemberMsg::Run {
            version,
            fingerprint,
            transport: slot.take().unwrap_or_else(|| unreachable!("one transport per member")),
            deadline,
        };
        let (a, b) = tokio::join!(
            self.sources.call_all_timeout(|r| run(&mut src_t[r]), after),
            self.sinks.call_all_timeout(|r| run(&mut dst_t[r]), after),
        );
        let outcome = (|| {
            for (group, replies) in [(&self.sources, a), (&self.sinks, b)] {
                for (rank, reply) in replies.map_err(|e| group_error(group, e, after))?.into_iter().enumerate() {
                    if let MemberReply::Refused(r) = reply {
                        return Err(refused(group.get(rank).map_or("?", |m| m.name()), r));
                    }
                }
            }
            Ok(())
        })();
        let transfer_time = t.elapsed();
        if let Err(e) = outcome {
            // Every sink keeps serving its last committed version.
            let _ = self.sinks.call_all_timeout(|_| MemberMsg::Discard, self.config.control_timeout).await;
            return Err(e);
        }
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
