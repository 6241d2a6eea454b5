//! The refit sequence: the version to deliver, the plan, the data plane,
//! the transfer, then the commit on every destination, or a discard
//! everywhere.

use super::data_plane::{Moved, StepOutcome};
use super::error::refused;
use super::members::Status;
use super::verify::{verify, Verified};
use super::{Orchestrator, OrchestratorError, RefitReport, RefitStep, RefitTarget, SourceLoss};
use crate::protocol::{Fabric, HeldVersion, MemberMsg, MemberReply, Refusal, INSTALLED_PLANS};
use reshard::{Figures, Fingerprint, Group, PlanError, TensorSubset};
use std::time::{Duration, Instant};
use transport::fabric::{close_in_process, open_in_process};

/// How often [`RefitTarget::Latest`] asks the sources again while they
/// hold different versions.
const AGREE_POLL: Duration = Duration::from_millis(10);

/// How many times [`RefitTarget::Latest`] starts again when a step lands
/// while the refit reads.
const LATEST_ATTEMPTS: usize = 3;

/// How many times a refit runs again after replicas it lost left the
/// destination group ([`ReplicaLoss::Drop`](super::ReplicaLoss::Drop)) or
/// sources it lost were left out ([`SourceLoss::Replan`](super::SourceLoss::Replan)).
const LOST_ATTEMPTS: usize = 2;

impl Orchestrator {
    /// The version every source holds, asking again while they differ (a
    /// step under way), for at most the control timeout.
    async fn agreed_version(&self, mut status: Status) -> Result<(u64, Status), OrchestratorError> {
        let deadline = tokio::time::Instant::now() + self.config.control_timeout;
        loop {
            let mut held = Vec::with_capacity(status.n_src);
            for (i, w) in status.src_weights().iter().enumerate() {
                match *w {
                    HeldVersion::Version(v) => held.push(v),
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

    pub(super) async fn refit(&mut self, target: RefitTarget, only: Option<TensorSubset>) -> Result<RefitReport, OrchestratorError> {
        self.refits += 1;
        self.enter(RefitStep::Planning);
        let start = Instant::now();
        let sent = self.sent_so_far();
        let mut attempts = 0;
        let mut again = 0;
        self.dropped.clear();
        // Sources left out during this refit, with why.
        let mut left_out: Vec<(Vec<u32>, OrchestratorError)> = Vec::new();
        let r = loop {
            attempts += 1;
            match self.refit_once(target, &only, start).await {
                Err(OrchestratorError::SourcesLost { ranks, cause }) if again < LOST_ATTEMPTS => {
                    again += 1;
                    left_out.push((ranks, *cause));
                    self.enter(RefitStep::Planning);
                }
                Err(OrchestratorError::Plan(PlanError::NotCovered { .. })) if !left_out.is_empty() => {
                    // Nobody else holds what the lost sources held: they
                    // are not left out after all, and the refit fails for
                    // what lost them.
                    let (ranks, cause) = left_out.swap_remove(0);
                    for (more, _) in &left_out {
                        self.lost_sources.retain(|r| !more.contains(r));
                    }
                    self.lost_sources.retain(|r| !ranks.contains(r));
                    break Err(cause);
                }
                Err(OrchestratorError::VersionMismatch { .. }) if target == RefitTarget::Latest && attempts < LATEST_ATTEMPTS => {
                    // A step landed between the status and the read: refit
                    // the newer version.
                    self.enter(RefitStep::Planning);
                }
                Err(OrchestratorError::ReplicasLost { .. }) if again < LOST_ATTEMPTS => {
                    // The lost replicas left the group: the rest again.
                    again += 1;
                    self.enter(RefitStep::Planning);
                }
                r => break r,
            }
        };
        self.enter(RefitStep::Idle);
        let dropped_replicas = std::mem::take(&mut self.dropped);
        let lost_sources = self.lost_sources.clone();
        match r {
            Ok(report) => Ok(RefitReport { control_messages: self.sent_so_far() - sent, dropped_replicas, lost_sources, ..report }),
            Err(cause) if dropped_replicas.is_empty() => Err(cause),
            // The drops stand: the caller must hear of them.
            Err(cause) => Err(OrchestratorError::ReplicasDropped { dropped: dropped_replicas, cause: Box::new(cause) }),
        }
    }

    /// One attempt at the refit: its steps in order, each failure handled
    /// by the step that meets it.
    async fn refit_once(
        &mut self,
        target: RefitTarget,
        only: &Option<TensorSubset>,
        start: Instant,
    ) -> Result<RefitReport, OrchestratorError> {
        let (version, status) = match self.version_to_deliver(target, only).await? {
            Deliver::AlreadyServed(version) => return Ok(RefitReport::already_served(version, self.config.mode, start.elapsed())),
            Deliver::Version(version, status) => (version, status),
        };
        let replanned = self.ensure_plan(&status, only).await?.replanned;
        let plan_time = start.elapsed();
        let (fingerprint, figures) = self.cached(only).map(|c| (c.fingerprint, c.figures.clone()))?;
        let bytes = figures.total_bytes;
        let refit = self.refits;
        let t = Instant::now();
        let (session, resumed) = self.data_plane_session(refit, fingerprint).await?;
        let mut connect_time = t.elapsed();
        let moved = self.transfer(&self.groups(), refit, &session, version, fingerprint, resumed, &mut connect_time).await;
        close_in_process(&session);
        let transfer_time = t.elapsed().saturating_sub(connect_time);
        let (moved, lost) = match moved {
            Ok(moved) => (moved, Vec::new()),
            Err((e, blame)) => self.after_failed_transfer(e, blame).await?,
        };
        if moved.sent != bytes && !self.config.delta {
            tracing::warn!(sent = moved.sent, planned = bytes, "members sent another number of bytes than the plan moves");
        }
        let verified = self.verified(&moved, &lost).await?;
        let t = Instant::now();
        let lost = self.commit(version, lost).await?;
        self.keep_for_next(refit, fingerprint, session, &lost);
        Ok(RefitReport {
            version,
            already_served: false,
            mode: self.config.mode,
            fingerprint: Some(fingerprint),
            replanned,
            wall: start.elapsed(),
            plan_time,
            connect_time,
            resumed,
            transfer_time,
            commit_time: t.elapsed(),
            verify_time: verified.time,
            verified_ranks: verified.ranks,
            unverified_ranks: verified.unverified,
            bytes: moved.sent,
            messages: moved.messages,
            control_messages: 0,
            dropped_replicas: Vec::new(),
            lost_sources: Vec::new(),
            figures,
        })
    }

    /// The version this refit delivers, with the members' status: refused
    /// here, before anything is planned or moved, where a source holds
    /// another (`Run` checks again under each source's lock) or a subset
    /// refit's destination serves none to keep the other tensors from.
    async fn version_to_deliver(&mut self, target: RefitTarget, only: &Option<TensorSubset>) -> Result<Deliver, OrchestratorError> {
        let status = match self.status().await {
            Err(e @ (OrchestratorError::MemberDied { .. } | OrchestratorError::Timeout { .. })) => return Err(self.lose_silent(e).await),
            r => r?,
        };
        let (version, status) = match target {
            RefitTarget::Version(v) => (v, status),
            RefitTarget::Latest => self.agreed_version(status).await?,
        };
        if status.dst_weights().iter().all(|w| *w == HeldVersion::Version(version)) {
            return Ok(Deliver::AlreadyServed(version));
        }
        for (i, w) in status.src_weights().iter().enumerate() {
            match *w {
                HeldVersion::Version(held) if held == version => {}
                HeldVersion::Version(held) => {
                    return Err(OrchestratorError::VersionMismatch { member: status.names[i].clone(), held, asked: version })
                }
                weights => return Err(OrchestratorError::NoWeights { member: status.names[i].clone(), weights }),
            }
        }
        if only.is_some() {
            if let Some(i) = status.dst_weights().iter().position(|w| !matches!(w, HeldVersion::Version(_))) {
                return Err(refused(&status.names[status.n_src + i], Refusal::NoBaseVersion));
            }
        }
        Ok(Deliver::Version(version, status))
    }

    /// The kept connections of this plan (`true`: resumed), or a fresh
    /// data-plane epoch's session.
    async fn data_plane_session(&mut self, refit: u64, fingerprint: Fingerprint) -> Result<(String, bool), OrchestratorError> {
        if let Some(i) = self.kept.iter().position(|(f, _)| *f == fingerprint) {
            let (_, session) = self.kept.remove(i);
            match self.resume(refit, fingerprint, &session).await {
                Ok(true) => return Ok((session, true)),
                Ok(false) => {}
                Err(e) => {
                    self.forget_data_plane(true);
                    return Err(e);
                }
            }
        }
        let session = uuid::Uuid::new_v4().simple().to_string();
        if self.config.fabric == Fabric::InProcess {
            open_in_process(&session, &self.endpoints());
        }
        Ok((session, false))
    }

    /// What a failed transfer comes to: lost sources left out (the refit
    /// runs again without them), lost replicas leaving the group (the
    /// others commit what they staged, or run again), or a discard
    /// everywhere — every destination keeps serving its last committed
    /// version. `Ok`: what the replicas that ran moved, and the lost ones.
    async fn after_failed_transfer(
        &mut self,
        e: OrchestratorError,
        mut blame: StepOutcome,
    ) -> Result<(Moved, Vec<u32>), OrchestratorError> {
        self.kept.clear();
        self.delta_base.clear();
        if blame.gone.is_empty() && self.config.source_loss == SourceLoss::Replan {
            // Every member answered: a source that sent all it had and
            // died before its peers read it shows only now.
            blame.gone = self.unanswering().await.into_iter().filter(|g| g.group == Group::Src).collect();
        }
        if let Some(ranks) = self.lost_sources_of(&blame) {
            // Every member drops what it prepared; the refit runs again
            // without them.
            self.enter(RefitStep::Discarding);
            return Err(self.leave_out_sources(ranks, e));
        }
        match self.lost_replicas(&blame) {
            Some((lost, true)) => {
                // The other replicas staged the whole version: they commit
                // it, without the lost ones.
                tracing::warn!(?lost, error = %e, "replicas failed the refit and leave the group; the others commit");
                Ok((blame.moved, lost))
            }
            Some((lost, false)) => {
                tracing::warn!(?lost, error = %e, "replicas failed the refit and leave the group; refitting the others");
                self.enter(RefitStep::Discarding);
                self.tell_all(|| MemberMsg::Discard);
                self.drop_replicas(&lost).await?;
                Err(OrchestratorError::ReplicasLost { replicas: lost, cause: Box::new(e) })
            }
            None => {
                // A member that is stuck (an abort that hangs) must not
                // hold up the report: the discard is queued, not awaited;
                // each member handles it before anything the next refit
                // asks.
                self.enter(RefitStep::Discarding);
                self.tell_all(|| MemberMsg::Discard);
                Err(e)
            }
        }
    }

    /// The digest check: nothing commits that does not match what its
    /// senders sent (lost replicas aside); on a mismatch, a discard
    /// everywhere.
    async fn verified(&mut self, moved: &Moved, lost: &[u32]) -> Result<Verified, OrchestratorError> {
        if !self.config.digest_check {
            return Ok(Verified::default());
        }
        let k = self.replica_ranks();
        match verify(&moved.digests, |e| !lost.contains(&((e.rank as usize / k) as u32))) {
            Ok(v) => Ok(v),
            Err(e) => {
                tracing::warn!(error = %e, "the digest check failed; nothing is committed");
                self.kept.clear();
                self.delta_base.clear();
                self.enter(RefitStep::Discarding);
                self.tell_all(|| MemberMsg::Discard);
                if !lost.is_empty() {
                    self.drop_replicas(lost).await?;
                }
                Err(e)
            }
        }
    }

    /// The second phase: every destination (of the replicas not lost) has
    /// staged the whole version; each commits it. A group of replicas goes
    /// on without those that did not commit (while some are left);
    /// otherwise the refit fails with the first refusal. `Ok`: every
    /// replica lost, which leaves the group here.
    async fn commit(&mut self, version: u64, mut lost: Vec<u32>) -> Result<Vec<u32>, OrchestratorError> {
        self.enter(RefitStep::Committing);
        let k = self.replica_ranks();
        let commit = |g, rank: usize| (g == Group::Dst && !lost.contains(&((rank / k) as u32))).then_some(MemberMsg::Commit { version });
        let committed = self.ask_each(&self.groups(), commit, self.config.control_timeout).await;
        let failed: Vec<_> = committed
            .iter()
            .filter(|(_, _, r)| !matches!(r, Ok(reply) if !matches!(reply, MemberReply::Refused(_))))
            .map(|(e, ..)| *e)
            .collect();
        if !failed.is_empty() {
            self.kept.clear();
            self.delta_base.clear();
            // Their other members may have committed; the replica leaves
            // the group either way.
            match self.lost_replicas(&StepOutcome { failed, ..StepOutcome::default() }) {
                Some((more, _)) if more.iter().chain(&lost).collect::<std::collections::BTreeSet<_>>().len() < self.dst.len() / k => {
                    tracing::warn!(replicas = ?more, "replicas failed the commit and leave the group");
                    lost.extend(more);
                    lost.sort_unstable();
                    lost.dedup();
                }
                _ => {
                    let error = committed.into_iter().find_map(|(_, member, r)| match r {
                        Err(e) => Some(e),
                        Ok(MemberReply::Refused(refusal)) => Some(refused(&member, refusal)),
                        Ok(_) => None,
                    });
                    return Err(error
                        .unwrap_or_else(|| OrchestratorError::Failed { member: "orchestrator".into(), problem: "commit failed".into() }));
                }
            }
        }
        if !lost.is_empty() {
            // Their members drop what they staged; the group goes on
            // without them (and forgets this refit's data plane).
            self.drop_replicas(&lost).await?;
        }
        Ok(lost)
    }

    /// After a commit: what every member keeps for this plan's next refit
    /// (when no replica was lost) — the base of a delta refit, and the
    /// endpoints of `session`.
    fn keep_for_next(&mut self, refit: u64, fingerprint: Fingerprint, session: String, lost: &[u32]) {
        if !lost.is_empty() {
            return;
        }
        if self.config.delta {
            // Every member ran this refit clean and keeps what it sent and
            // received.
            self.delta_base.insert(fingerprint, refit);
        }
        if self.keeps_data_plane() {
            self.kept.retain(|(f, _)| *f != fingerprint);
            if self.kept.len() == INSTALLED_PLANS {
                self.kept.remove(0);
            }
            self.kept.push((fingerprint, session));
        }
    }

    /// Ranks per destination replica (1 without replicas).
    fn replica_ranks(&self) -> usize {
        self.config.replica.as_ref().map_or(1, |one| one.ranks() as usize)
    }
}

/// What a refit delivers.
enum Deliver {
    /// Every destination serves this version already.
    AlreadyServed(u64),
    /// This version, with the members' status.
    Version(u64, Status),
}

impl RefitReport {
    /// The report of a refit that found every destination serving
    /// `version` already.
    fn already_served(version: u64, mode: reshard::Strategy, took: Duration) -> RefitReport {
        RefitReport {
            version,
            already_served: true,
            mode,
            fingerprint: None,
            replanned: false,
            wall: took,
            plan_time: took,
            connect_time: Duration::ZERO,
            resumed: false,
            transfer_time: Duration::ZERO,
            commit_time: Duration::ZERO,
            verify_time: Duration::ZERO,
            verified_ranks: 0,
            unverified_ranks: 0,
            bytes: 0,
            messages: 0,
            control_messages: 0,
            dropped_replicas: Vec::new(),
            lost_sources: Vec::new(),
            figures: Figures::default(),
        }
    }
}
