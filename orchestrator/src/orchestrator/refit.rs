//! The refit sequence: the version to deliver, the plan, the data plane,
//! the transfer, then the commit on every destination, or a discard
//! everywhere.

use super::error::refused;
use super::members::{no_refusal, Status};
use super::{Orchestrator, OrchestratorError, RefitReport, RefitStep, RefitTarget};
use crate::protocol::{Fabric, MemberMsg, Refusal, Weights, INSTALLED_PLANS};
use reshard::{Figures, Group, TensorSubset};
use std::time::{Duration, Instant};
use transport::fabric::{close_in_process, open_in_process};

/// How often [`RefitTarget::Latest`] asks the sources again while they
/// hold different versions.
const AGREE_POLL: Duration = Duration::from_millis(10);

/// How many times [`RefitTarget::Latest`] starts again when a step lands
/// while the refit reads.
const LATEST_ATTEMPTS: usize = 3;

impl Orchestrator {
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

    pub(super) async fn refit(&mut self, target: RefitTarget, only: Option<TensorSubset>) -> Result<RefitReport, OrchestratorError> {
        self.refits += 1;
        self.enter(RefitStep::Planning);
        let start = Instant::now();
        let sent = self.sent_so_far();
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
        r.map(|report| RefitReport { control_messages: self.sent_so_far() - sent, ..report })
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
                messages: 0,
                control_messages: 0,
                figures: Figures::default(),
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
        let replanned = self.ensure_plan(&status, only).await?.replanned;
        let plan_time = start.elapsed();
        let (fingerprint, figures) = self.cached(only).map(|c| (c.fingerprint, c.figures.clone()))?;
        let bytes = figures.total_bytes;
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
                    open_in_process(&session, &self.endpoints());
                }
                (session, false)
            }
        };
        let mut connect_time = t.elapsed();
        let moved = self.transfer(refit, &session, version, fingerprint, resumed, &mut connect_time).await;
        close_in_process(&session);
        let transfer_time = t.elapsed().saturating_sub(connect_time);
        let (sent, messages) = match moved {
            Ok(moved) => moved,
            Err(e) => {
                self.kept.clear();
                self.delta_base.clear();
                // Every destination keeps serving its last committed version;
                // every member drops what it prepared for this refit.
                // A member that is stuck (an abort that hangs) must not hold up
                // the report: the discard is queued, not awaited; each member
                // handles it before anything the next refit asks.
                self.enter(RefitStep::Discarding);
                self.tell_all(|| MemberMsg::Discard);
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
        let committed = self.ask_all(commit, self.config.control_timeout).await;
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
            messages,
            control_messages: 0,
            figures,
        })
    }
}
