//! Planning and installing: one plan per strategy and subset for both
//! groups' layouts, cached while they stay the same, and each member's own
//! program installed on it.

use super::error::{call_error, refused};
use super::members::RunMembers;
use super::members::{describe, Status};
use super::{Orchestrator, OrchestratorError, PlanReport, ReplicaPlan};
use crate::protocol::{MemberMsg, MemberReply, ProgramRole};
use reshard::{
    plan_baseline, plan_reshard, Endpoint, Figures, Fingerprint, Group, Layout, Plan, PlanError, PlanOptions, Programs, RankProgram,
    Strategy, TensorSubset,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the orchestrator keeps of a plan: not the plan or its programs
/// (for a large model they are gigabytes), only what identifies it. Members
/// keep their own program; a member that joins later (a replaced process)
/// makes the orchestrator plan again to build its program.
pub(super) struct CachedPlan {
    /// Layout fingerprints every member of each group reported.
    pub(super) layout_fingerprints: (u64, u64),
    /// The sources it leaves out ([`SourceLoss::Replan`](super::SourceLoss::Replan)).
    pub(super) lost_sources: Vec<u32>,
    pub(super) fingerprint: Fingerprint,
    /// The plan's figures.
    pub(super) figures: Figures,
}

/// What one replica's plan was planned for ([`ReplicaPlan::Derived`]):
/// the source layout's and the replica layout's fingerprints, and the
/// options.
#[derive(PartialEq)]
pub(super) struct TemplateKey {
    src: u64,
    one: u64,
    options: PlanOptions,
}

/// What [`Orchestrator::ensure_plan`] did.
#[derive(Default)]
pub(super) struct PlanWork {
    /// It planned.
    pub(super) replanned: bool,
    /// Time planning.
    pub(super) plan_time: Duration,
    /// Time deriving and installing programs.
    pub(super) install_time: Duration,
    /// Members installed.
    pub(super) installed: u64,
}

/// Programs derived ahead of, or being sent to, members while installing.
const INSTALL_WINDOW: usize = 8;

/// An install call's outcome, whether or not its task ran to the end.
fn flatten(done: Result<Result<(), OrchestratorError>, tokio::task::JoinError>) -> Result<(), OrchestratorError> {
    done.unwrap_or_else(|e| Err(OrchestratorError::Failed { member: "orchestrator".into(), problem: format!("install task: {e}") }))
}

/// The layouts both groups hold, as last described, by fingerprint.
pub(super) struct KnownLayouts {
    pub(super) fingerprints: (u64, u64),
    pub(super) src: Arc<Layout>,
    pub(super) dst: Arc<Layout>,
}

impl Orchestrator {
    /// Makes sure every member has the plan of the current strategy for
    /// both groups' current layouts installed: plans when a layout changed,
    /// installs on members that lack it (new or replaced ones). Returns
    /// what it did.
    pub(super) async fn ensure_plan(&mut self, status: &Status, only: &Option<TensorSubset>) -> Result<PlanWork, OrchestratorError> {
        let t = self.config.control_timeout;
        let mode = self.config.mode;
        let key = (mode, only.clone());
        let current = status.layouts;
        if self.cache.values().any(|c| c.layout_fingerprints != current || c.lost_sources != self.lost_sources) {
            self.cache.clear();
        }
        let cached = self.cache.get(&key).map(|c| c.fingerprint);
        let lacking: Vec<usize> = status
            .installed
            .iter()
            .enumerate()
            .filter(|(i, plans)| !status.absent.contains(i) && !matches!(cached, Some(f) if plans.contains(&f)))
            .map(|(i, _)| i)
            .collect();
        if lacking.is_empty() {
            return Ok(PlanWork::default());
        }
        let started = Instant::now();
        // The layouts travel once: from one member of each group, and only
        // when their fingerprints changed.
        let (src, dst) = match &self.layouts {
            Some(k) if k.fingerprints == current => (k.src.clone(), k.dst.clone()),
            _ => {
                self.layouts = None;
                self.sent(2);
                let src = describe(&self.src, Group::Src, current.0, t).await?;
                let dst = describe(&self.dst, Group::Dst, current.1, t).await?;
                self.layouts = Some(KnownLayouts { fingerprints: current, src: src.clone(), dst: dst.clone() });
                (src, dst)
            }
        };
        let lost_sources = self.lost_sources.clone();
        let options = PlanOptions { only: only.clone(), lost_sources, ..self.config.plan_options() };
        let plan = self.make_plan(&src, &dst, options).await?;
        let (fingerprint, figures) = (plan.fingerprint(), plan.figures().clone());
        // Plans of the other strategy were made for these layouts too, or
        // are gone.
        let lost = &self.lost_sources;
        self.cache.retain(|_, c| c.layout_fingerprints == current && c.lost_sources == *lost);
        if cached != Some(fingerprint) {
            // Not installed anywhere yet (or the layouts changed under it).
            self.cache.remove(&key);
        }
        let which: Vec<usize> = if cached == Some(fingerprint) {
            lacking
        } else {
            (0..status.installed.len()).filter(|i| !status.absent.contains(i)).collect()
        };
        let (plan_time, installing) = (started.elapsed(), Instant::now());
        let installed = which.len() as u64;
        self.install(&self.groups(), ProgramRole::Own, plan, src, dst, which).await?;
        let lost_sources = self.lost_sources.clone();
        self.cache.insert(key, CachedPlan { layout_fingerprints: current, lost_sources, fingerprint, figures });
        Ok(PlanWork { replanned: true, plan_time, install_time: installing.elapsed(), installed })
    }

    /// The plan of the current strategy for these layouts: made by the
    /// planner, or for a group of replicas ([`ReplicaPlan::Derived`])
    /// derived from one replica's plan, which is planned only when the
    /// layouts or options changed. Planning a large model is seconds of
    /// CPU: off the reactor, so the control plane's heartbeats keep
    /// flowing meanwhile.
    async fn make_plan(&mut self, src: &Arc<Layout>, dst: &Arc<Layout>, options: PlanOptions) -> Result<Arc<Plan>, OrchestratorError> {
        let mode = self.config.mode;
        let one = match (&self.config.replica, self.config.replica_plan, mode) {
            (Some(one), ReplicaPlan::Derived, Strategy::Reshard)
                if one.ranks() <= dst.ranks() && one.ranks().is_multiple_of(one.ranks_per_node()) =>
            {
                Some(one.clone())
            }
            _ => None,
        };
        let key = one.as_ref().map(|one| TemplateKey { src: src.fingerprint(), one: one.fingerprint(), options: options.clone() });
        let kept = match (&key, &self.replica_template) {
            (Some(key), Some((have, template))) if have == key => Some(template.clone()),
            _ => None,
        };
        let (s, d) = (src.clone(), dst.clone());
        // (The plan, one replica's plan if it was made now, whether the
        // group was planned whole.)
        type Made = (Arc<Plan>, Option<Arc<Plan>>, bool);
        let planned = tokio::task::spawn_blocking(move || -> Result<Made, PlanError> {
            let whole = |options: &PlanOptions| match mode {
                Strategy::Reshard => plan_reshard(&s, &d, options),
                Strategy::Baseline => plan_baseline(&s, &d, options),
            };
            let Some(one) = one else {
                return Ok((Arc::new(whole(&options)?), None, true));
            };
            let (template, made) = match kept {
                Some(template) => (template, None),
                None => {
                    let template = Arc::new(plan_reshard(&s, &one, &options)?);
                    (template.clone(), Some(template))
                }
            };
            if d.fingerprint() == one.fingerprint() {
                // One replica: its plan is the group's.
                return Ok((template, made, false));
            }
            match template.for_replicas(&s, &one, &d) {
                Ok(plan) => Ok((Arc::new(plan), made, false)),
                // The group is not replicas of the replica's layout (its
                // members were described so): planned whole.
                Err(PlanError::Derive { problem }) => {
                    tracing::warn!(%problem, "a group of replicas planned whole");
                    Ok((Arc::new(whole(&options)?), made, true))
                }
                Err(e) => Err(e),
            }
        })
        .await;
        match planned {
            Ok(Ok((plan, made, whole))) => {
                self.plans_made += u64::from(whole) + u64::from(made.is_some());
                if let (Some(key), Some(template)) = (key, made) {
                    self.replica_template = Some((key, template));
                }
                Ok(plan)
            }
            Ok(Err(e)) => Err(e.into()),
            Err(e) => Err(OrchestratorError::Failed { member: "orchestrator".into(), problem: format!("planning task: {e}") }),
        }
    }

    /// Hands members `which` (indices into sources then destinations)
    /// their own programs, derived one by one on a blocking thread per
    /// core while earlier ones are sent: at most [`INSTALL_WINDOW`] plus
    /// one per thread exist at a time, never all of them.
    pub(super) async fn install(
        &self,
        cast: &RunMembers,
        seat: ProgramRole,
        plan: Arc<Plan>,
        src: Arc<Layout>,
        dst: Arc<Layout>,
        which: Vec<usize>,
    ) -> Result<(), OrchestratorError> {
        let n_src = cast.src.len();
        let fingerprint = plan.fingerprint();
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(usize, RankProgram)>(INSTALL_WINDOW);
        let producer = tokio::task::spawn_blocking(move || -> Result<(), PlanError> {
            let programs = Programs::new(&plan, &src, &dst)?;
            // Thousands of members: their programs are derived in parallel,
            // each thread taking the next member still to do.
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, which.len().max(1));
            let next = std::sync::atomic::AtomicUsize::new(0);
            let derive = || {
                while let Some(&i) = which.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                    let e = if i < n_src { Endpoint::src(i as u32) } else { Endpoint::dst((i - n_src) as u32) };
                    if tx.blocking_send((i, programs.program(e))).is_err() {
                        // The installer gave up (a member failed).
                        break;
                    }
                }
            };
            std::thread::scope(|s| {
                for _ in 1..threads {
                    s.spawn(derive);
                }
                derive();
            });
            Ok(())
        });
        let after = self.config.control_timeout;
        let mut calls = tokio::task::JoinSet::new();
        let mut result = Ok(());
        while let Some((i, program)) = rx.recv().await {
            let member = if i < n_src { cast.src.get(i) } else { cast.dst.get(i - n_src) };
            let Some(member) = member.cloned() else { continue };
            self.sent(1);
            calls.spawn(async move {
                let name = member.name().to_string();
                match member.call_timeout(MemberMsg::Install { program: Box::new(program), fingerprint, seat }, after).await {
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
    pub(super) fn cached(&self, only: &Option<TensorSubset>) -> Result<&CachedPlan, OrchestratorError> {
        // `ensure_plan` caches a plan whenever it returns Ok; `status`
        // refuses empty groups.
        self.cache
            .get(&(self.config.mode, only.clone()))
            .ok_or_else(|| OrchestratorError::Failed { member: "orchestrator".into(), problem: "no plan after planning".into() })
    }

    pub(super) async fn plan(&mut self) -> Result<PlanReport, OrchestratorError> {
        let sent = self.sent_so_far();
        let status = self.status().await?;
        let work = self.ensure_plan(&status, &None).await?;
        let CachedPlan { fingerprint, figures, .. } = self.cached(&None)?;
        Ok(PlanReport {
            mode: self.config.mode,
            fingerprint: *fingerprint,
            replanned: work.replanned,
            bytes: figures.total_bytes,
            plan_time: work.plan_time,
            install_time: work.install_time,
            installed: work.installed,
            control_messages: self.sent_so_far() - sent,
            figures: figures.clone(),
        })
    }
}
