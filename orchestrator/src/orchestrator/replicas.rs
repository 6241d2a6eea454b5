//! Elastic destination groups: a destination group made of replicas of
//! one inference layout ([`OrchestratorConfig::replica`]) gains a replica
//! between refits, seeded with the version the others serve from a
//! serving replica (a plan between two replicas: no source rank takes
//! part), and loses one; the next refit is planned for the group as it is.
//!
//! [`OrchestratorConfig::replica`]: super::OrchestratorConfig::replica

use super::data_plane::StepOutcome;
use super::members::{no_refusal, RunMembers};
use super::{Orchestrator, OrchestratorError, RefitStep, ReplicaLoss};
use crate::member::Member;
use crate::protocol::{Fabric, HeldVersion, MemberMsg, MemberReply, ProgramRole};
use actors::{ActorGroup, ActorRef};
use reshard::{plan_reshard, Endpoint, Figures, Fingerprint, Group, Layout, Plan, PlanOptions};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport::fabric::{close_in_process, open_in_process};

/// What adding or removing a replica did.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaReport {
    /// Replicas in the destination group now.
    pub replicas: u32,
    /// How the added replica was seeded; `None` when no replica served a
    /// whole version to seed it from (it then serves nothing until the
    /// next refit), or a replica was removed.
    pub seeded: Option<SeedReport>,
}

/// Seeding a new replica from a serving one.
#[derive(Debug, Clone, PartialEq)]
pub struct SeedReport {
    /// The version it serves now (the one the serving replica served).
    pub version: u64,
    /// The replica it was seeded from (its index in the group before).
    pub from_replica: u32,
    /// The plan between the two replicas (its sources are the serving
    /// replica's ranks: no source rank of the refit group sends anything).
    pub fingerprint: Fingerprint,
    /// The plan's figures.
    pub figures: Figures,
    /// Bytes the serving replica's ranks sent, as they counted them.
    pub bytes: u64,
    /// Wall time: plan, install, data plane, commit.
    pub wall: Duration,
}

impl Orchestrator {
    /// One replica's layout, its ranks and the replicas the destination
    /// group has now.
    fn replica_shape(&self) -> Result<(Arc<Layout>, usize, usize), OrchestratorError> {
        let problem = |p: String| OrchestratorError::Replicas { problem: p };
        let Some(one) = self.config.replica.clone() else {
            return Err(problem("the destination group is not made of replicas (OrchestratorConfig::replica is not set)".into()));
        };
        let k = one.ranks() as usize;
        if !self.dst.len().is_multiple_of(k) {
            return Err(problem(format!("the destination group has {} members, not a multiple of a replica's {k} ranks", self.dst.len())));
        }
        Ok((one, k, self.dst.len() / k))
    }

    /// Adds the replica whose rank `j` is `members`' rank `j` (members
    /// holding the replica's layout): seeds it from a serving replica,
    /// then makes it the group's last replica.
    pub(super) async fn add_replica(&mut self, members: ActorGroup<Member>) -> Result<ReplicaReport, OrchestratorError> {
        let (one, k, n) = self.replica_shape()?;
        let problem = |p: String| OrchestratorError::Replicas { problem: p };
        if members.len() != k {
            return Err(problem(format!("the new replica has {} members; a replica has {k} ranks", members.len())));
        }
        let members = ActorGroup::from_refs(members.refs().to_vec());
        // The new members hold the replica's layout, and the group's
        // members one layout (checked by `status`).
        let joining = RunMembers::of(ActorGroup::from_refs(Vec::new()), members.clone());
        let replies = self.ask_cast(&joining, |_, _| Some(MemberMsg::Status), self.config.control_timeout).await?;
        for (member, reply) in &replies {
            match reply {
                MemberReply::Status { layout, .. } if *layout == one.fingerprint() => {}
                MemberReply::Status { layout, .. } => {
                    return Err(problem(format!(
                        "{member} holds a layout ({layout:016x}) other than the replica's ({:016x})",
                        one.fingerprint()
                    )))
                }
                other => {
                    return Err(OrchestratorError::Protocol { member: member.clone(), request: "Status", reply: format!("{other:?}") })
                }
            }
        }
        let status = self.status().await?;
        // The newest version a whole replica serves; replicas serving it
        // take turns.
        let per_replica: Vec<Option<u64>> = status
            .dst_weights()
            .chunks(k)
            .map(|ws| match ws[0] {
                HeldVersion::Version(v) if ws.iter().all(|w| *w == HeldVersion::Version(v)) => Some(v),
                _ => None,
            })
            .collect();
        let seeded = match per_replica.iter().flatten().max().copied() {
            Some(version) => {
                let serving: Vec<usize> = (0..n).filter(|&r| per_replica[r] == Some(version)).collect();
                let from = serving[self.seeded as usize % serving.len()];
                self.seeded += 1;
                Some(self.seed(&one, &members, from, version).await?)
            }
            None => None,
        };
        let mut all = self.dst.refs().to_vec();
        all.extend(members.refs().iter().cloned());
        self.regroup(&one, all, n).await?;
        Ok(ReplicaReport { replicas: (n + 1) as u32, seeded })
    }

    /// Removes replica `replica` (by its index in the group): its members
    /// drop what they prepared and are asked nothing more; the replicas
    /// after it move up.
    pub(super) async fn remove_replica(&mut self, replica: u32) -> Result<ReplicaReport, OrchestratorError> {
        let (one, k, n) = self.replica_shape()?;
        let r = replica as usize;
        if r >= n {
            return Err(OrchestratorError::Replicas { problem: format!("no replica {replica}: the group has {n}") });
        }
        if n == 1 {
            return Err(OrchestratorError::Replicas { problem: "replica 0 is the group's last one; it cannot be removed".into() });
        }
        let leaving =
            RunMembers::of(ActorGroup::from_refs(Vec::new()), ActorGroup::from_refs(self.dst.refs()[r * k..(r + 1) * k].to_vec()));
        let mut all = self.dst.refs().to_vec();
        all.drain(r * k..(r + 1) * k);
        self.regroup(&one, all, n).await?;
        self.tell_cast(&leaving, || MemberMsg::Discard);
        Ok(ReplicaReport { replicas: (n - 1) as u32, seeded: None })
    }

    /// The replicas whose members failed a refit, if the group may go
    /// on without them ([`ReplicaLoss::Drop`]): every member whose own
    /// part failed is a destination, and some replica had none. With
    /// them, whether every other member (each source, each destination
    /// of the other replicas) ran its program to the end, so the others
    /// may commit now.
    pub(super) fn lost_replicas(&self, blame: &StepOutcome) -> Option<(Vec<u32>, bool)> {
        if self.config.replica_loss != ReplicaLoss::Drop || blame.failed.is_empty() {
            return None;
        }
        let (_, k, n) = self.replica_shape().ok()?;
        if blame.failed.iter().any(|e| e.group != Group::Dst) {
            return None;
        }
        let replica = |e: &Endpoint| e.rank / k as u32;
        let mut lost: Vec<u32> = blame.failed.iter().map(replica).collect();
        lost.sort_unstable();
        lost.dedup();
        if lost.len() >= n {
            return None;
        }
        let others_ran = self.endpoints().iter().all(|e| blame.ran.contains(e) || (e.group == Group::Dst && lost.contains(&replica(e))));
        Some((lost, others_ran))
    }

    /// Takes replicas `lost` (indices now) out of the group, recorded in
    /// this refit's report.
    pub(super) async fn drop_replicas(&mut self, lost: &[u32]) -> Result<(), OrchestratorError> {
        let (one, k, n) = self.replica_shape()?;
        let members: Vec<ActorRef<Member>> =
            self.dst.refs().iter().enumerate().filter(|(i, _)| !lost.contains(&((i / k) as u32))).map(|(_, m)| m.clone()).collect();
        self.regroup(&one, members, n).await?;
        // Highest first: removing them one by one in the reported order
        // from a list of the group's replicas leaves the group.
        self.dropped.extend(lost.iter().rev());
        Ok(())
    }

    /// Makes `members` the destination group (member `i` rank `i` of
    /// `n'` replicas of `one`, `n'` their number over `one`'s ranks):
    /// every member takes its rank of the new layout. If one refuses, the
    /// members of the `before` replicas in the group now are put back.
    async fn regroup(&mut self, one: &Arc<Layout>, members: Vec<ActorRef<Member>>, before: usize) -> Result<(), OrchestratorError> {
        let k = one.ranks() as usize;
        let layout =
            Arc::new(one.replicated((members.len() / k) as u32).map_err(|e| OrchestratorError::Replicas { problem: e.to_string() })?);
        let cast = RunMembers::of(ActorGroup::from_refs(Vec::new()), ActorGroup::from_refs(members));
        let relayout = |layout: Arc<Layout>| move |_, rank: usize| Some(MemberMsg::Relayout { layout: layout.clone(), rank: rank as u32 });
        let moved = self.ask_cast(&cast, relayout(layout), self.config.control_timeout).await.and_then(|r| no_refusal(&r));
        // Whatever happened, the members' peers and layouts changed.
        self.forget_data_plane(true);
        self.layouts = None;
        if let Err(e) = moved {
            let old = Arc::new(one.replicated(before as u32).map_err(|e| OrchestratorError::Replicas { problem: e.to_string() })?);
            let back = self.groups();
            let _ = self
                .ask_cast(&RunMembers::of(ActorGroup::from_refs(Vec::new()), back.dst), relayout(old), self.config.control_timeout)
                .await;
            return Err(e);
        }
        self.dst = cast.dst;
        Ok(())
    }

    /// Seeds `members` (a replica) with `version`, served by replica
    /// `from` of the group: plan between two replicas, install, run,
    /// commit on the new members (or discard on both).
    async fn seed(
        &mut self,
        one: &Arc<Layout>,
        members: &ActorGroup<Member>,
        from: usize,
        version: u64,
    ) -> Result<SeedReport, OrchestratorError> {
        let start = Instant::now();
        let k = one.ranks() as usize;
        let serving = ActorGroup::from_refs(self.dst.refs()[from * k..(from + 1) * k].to_vec());
        let cast = RunMembers::of(serving, members.clone());
        let plan = match &self.seed_plan {
            Some((f, plan)) if *f == one.fingerprint() => plan.clone(),
            _ => {
                let (s, d) = (one.clone(), one.clone());
                let options = PlanOptions { only: None, ..self.config.plan_options() };
                let planned = tokio::task::spawn_blocking(move || plan_reshard(&s, &d, &options)).await;
                let plan: Arc<Plan> = match planned {
                    Ok(r) => Arc::new(r?),
                    Err(e) => {
                        return Err(OrchestratorError::Failed { member: "orchestrator".into(), problem: format!("planning task: {e}") })
                    }
                };
                self.plans_made += 1;
                self.seed_plan = Some((one.fingerprint(), plan.clone()));
                plan
            }
        };
        let (fingerprint, figures) = (plan.fingerprint(), plan.figures().clone());
        self.install(&cast, ProgramRole::Replica, plan, one.clone(), one.clone(), (0..2 * k).collect()).await?;
        self.refits += 1;
        let refit = self.refits;
        let session = uuid::Uuid::new_v4().simple().to_string();
        if self.config.fabric == Fabric::InProcess {
            open_in_process(&session, &cast.endpoints());
        }
        let mut connect_time = Duration::ZERO;
        let moved = self.transfer(&cast, refit, &session, version, fingerprint, false, &mut connect_time).await;
        close_in_process(&session);
        // A joining replica, too, commits only what matches what the
        // serving one sent.
        let checked = |moved: super::data_plane::Moved| match self.config.digest_check {
            true => super::verify::verify(&moved.digests, |_| true).map(|_| moved.sent),
            false => Ok(moved.sent),
        };
        let committed = match moved.map_err(|(e, _)| e).and_then(checked) {
            Ok(bytes) => {
                self.enter(RefitStep::Committing);
                let commit = |g, _| (g == Group::Dst).then_some(MemberMsg::Commit { version });
                self.ask_cast(&cast, commit, self.config.control_timeout).await.and_then(|c| no_refusal(&c)).map(|()| bytes)
            }
            Err(e) => Err(e),
        };
        self.enter(RefitStep::Idle);
        match committed {
            Ok(bytes) => Ok(SeedReport { version, from_replica: from as u32, fingerprint, figures, bytes, wall: start.elapsed() }),
            Err(e) => {
                self.enter(RefitStep::Discarding);
                self.tell_cast(&cast, || MemberMsg::Discard);
                self.enter(RefitStep::Idle);
                Err(e)
            }
        }
    }
}
