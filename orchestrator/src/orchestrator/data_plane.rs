//! A refit's data plane: opened fresh on every member (prepare, connect)
//! or resumed from the last refit of the plan, the bytes moved over it,
//! and the kept planes forgotten.

use super::error::refused;
use super::members::{no_refusal, Answer, RunMembers};
use super::verify::MemberDigest;
use super::{Orchestrator, OrchestratorError, RefitStep};
use crate::protocol::{Fabric, MemberMsg, MemberReply, PeerAddr, Refusal, RunDelta, RunRequest};
use reshard::{Endpoint, Fingerprint};
use std::time::{Duration, Instant};

impl Orchestrator {
    /// Prepare, connect and run on every member of `cast`: the first
    /// phase. Returns the bytes and messages the members sent, as they
    /// counted them, and their digests; or why it failed, and who failed.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn transfer(
        &self,
        cast: &RunMembers,
        refit: u64,
        session: &str,
        version: u64,
        fingerprint: Fingerprint,
        resumed: bool,
        connect_time: &mut Duration,
    ) -> Result<Moved, (OrchestratorError, StepOutcome)> {
        let t = Instant::now();
        let control = self.config.control_timeout;
        if !resumed {
            self.open(cast, refit, session, fingerprint).await?;
        }
        *connect_time += t.elapsed();
        let deadline = self.config.deadline;
        let delta = match (self.config.delta, self.delta_base.get(&fingerprint)) {
            (false, _) => RunDelta::Off,
            (true, None) => RunDelta::First,
            (true, Some(&base)) => RunDelta::Since { base },
        };
        let verify = self.config.digest_check;
        let run = |_, _| Some(MemberMsg::Run(RunRequest { refit, version, fingerprint, deadline, delta, verify }));
        self.enter(RefitStep::Running);
        let ran = self.ask_each(cast, run, deadline + control).await;
        if StepOutcome::any(&ran) {
            let blame = StepOutcome::of(&ran);
            tracing::debug!(failed = ?blame.failed, gone = ?blame.gone, ran = blame.ran.len(), answers = ?ran, "the run failed");
            return Err((first_failure(&ran, "Run"), blame));
        }
        let mut moved = Moved::default();
        for (endpoint, member, reply) in ran {
            match reply {
                Ok(MemberReply::Ran(stats)) => {
                    moved.sent += stats.sent_bytes;
                    moved.messages += stats.messages;
                    moved.digests.push(MemberDigest { endpoint, member, digest: stats.digest, time: stats.digest_time });
                }
                other => {
                    let error = OrchestratorError::Protocol { member, request: "Run", reply: format!("{other:?}") };
                    return Err((error, StepOutcome::default()));
                }
            }
        }
        Ok(moved)
    }

    /// Whether members keep their node-fabric connections after a refit.
    pub(super) fn keeps_data_plane(&self) -> bool {
        self.config.keep_data_plane && matches!(self.config.fabric, Fabric::Node(_) | Fabric::Nccl(_) | Fabric::Ipc(_))
    }

    /// Asks every member to take up its endpoint of the kept `session` for
    /// this refit: `Ok(true)` if all did; `Ok(false)` if any keeps none (a
    /// fresh data plane replaces the rest); an error if a member is gone.
    pub(super) async fn resume(&self, refit: u64, fingerprint: Fingerprint, session: &str) -> Result<bool, OrchestratorError> {
        self.enter(RefitStep::Resuming);
        let resume = |_, _| Some(MemberMsg::Resume { refit, fingerprint, session: session.to_string() });
        let replies = self.ask_all(resume, self.config.control_timeout).await?;
        if let Some((member, _)) = replies.iter().find(|(_, r)| matches!(r, MemberReply::Refused(Refusal::NotKept { .. }))) {
            tracing::info!(%member, "no kept data plane; opening a fresh one");
            return Ok(false);
        }
        no_refusal(&replies)?;
        Ok(true)
    }

    /// Opens a fresh data plane for this refit on every member of `cast`:
    /// prepare, and connect for the node fabric.
    async fn open(
        &self,
        cast: &RunMembers,
        refit: u64,
        session: &str,
        fingerprint: Fingerprint,
    ) -> Result<(), (OrchestratorError, StepOutcome)> {
        let control = self.config.control_timeout;
        let fabric = self.config.fabric.clone();
        let keep = self.keeps_data_plane();
        let prepare = |_, _| Some(MemberMsg::Prepare { refit, fingerprint, session: session.to_string(), fabric: fabric.clone(), keep });
        self.enter(RefitStep::Preparing);
        let prepared = self.ask_each(cast, prepare, control).await;
        if StepOutcome::any(&prepared) {
            return Err((first_failure(&prepared, "Prepare"), StepOutcome::of(&prepared)));
        }
        let mut peers = Vec::with_capacity(prepared.len());
        for (_, member, reply) in prepared {
            let Ok(MemberReply::Prepared { endpoint, node, addr, host }) = reply else {
                let error = OrchestratorError::Protocol { member, request: "Prepare", reply: format!("{reply:?}") };
                return Err((error, StepOutcome::default()));
            };
            peers.push(PeerAddr { endpoint, node, addr, host });
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
            let connected = self.ask_each(cast, connect, timeout + control).await;
            if StepOutcome::any(&connected) {
                return Err((first_failure(&connected, "Connect"), StepOutcome::of(&connected)));
            }
        }
        Ok(())
    }

    /// Forgets the kept data planes; with `tell`, members drop theirs now
    /// (a queued `Discard`: between refits it only drops what is kept).
    pub(super) fn forget_data_plane(&mut self, tell: bool) {
        self.kept.clear();
        // A replaced member holds no base: the next refit is dense.
        self.delta_base.clear();
        if tell {
            self.tell_all(|| MemberMsg::Discard);
        }
    }
}

/// What every member's run moved, as they counted it.
#[derive(Debug, Default)]
pub(super) struct Moved {
    /// Bytes sent.
    pub(super) sent: u64,
    /// Messages sent.
    pub(super) messages: u64,
    /// Every member's digest.
    pub(super) digests: Vec<MemberDigest>,
}

/// Who failed a step of a refit's data plane (what a destination group of
/// replicas needs to go on without theirs).
#[derive(Debug, Default)]
pub(super) struct StepOutcome {
    /// The members whose own part failed: they refused the step, failed
    /// it themselves (not because a peer did) or did not answer (gone,
    /// or too late). Empty when the failure is the orchestrator's.
    pub(super) failed: Vec<Endpoint>,
    /// Of those, the members that did not answer (gone, or too late).
    pub(super) gone: Vec<Endpoint>,
    /// The members that ran their program to the end (the step was the
    /// run): a destination's staging holds the whole version.
    pub(super) ran: Vec<Endpoint>,
    /// Bytes and messages the members that ran sent, as they counted
    /// them, and their digests.
    pub(super) moved: Moved,
}

impl StepOutcome {
    fn of(answers: &[Answer]) -> StepOutcome {
        let mut blame = StepOutcome::default();
        for (e, member, r) in answers {
            match r {
                Err(_) => {
                    blame.failed.push(*e);
                    blame.gone.push(*e);
                }
                Ok(MemberReply::Refused(Refusal::Exec { after_peer: true, .. })) => {}
                Ok(MemberReply::Refused(_)) => blame.failed.push(*e),
                Ok(MemberReply::Ran(stats)) => {
                    blame.ran.push(*e);
                    blame.moved.sent += stats.sent_bytes;
                    blame.moved.messages += stats.messages;
                    let digest =
                        MemberDigest { endpoint: *e, member: member.clone(), digest: stats.digest.clone(), time: stats.digest_time };
                    blame.moved.digests.push(digest);
                }
                Ok(_) => {}
            }
        }
        blame
    }

    /// Whether the step failed for someone (`answers`: its answers).
    fn any(answers: &[Answer]) -> bool {
        answers.iter().any(|(_, _, r)| !matches!(r, Ok(reply) if !matches!(reply, MemberReply::Refused(_))))
    }
}

/// The error of a failed step: the first member that did not answer;
/// else the first whose own part failed (not because a peer did); else
/// the first refusal.
fn first_failure(answers: &[Answer], request: &'static str) -> OrchestratorError {
    if let Some((_, _, Err(e))) = answers.iter().find(|(_, _, r)| r.is_err()) {
        return e.clone();
    }
    let refusals = || {
        answers.iter().filter_map(|(_, member, r)| match r {
            Ok(MemberReply::Refused(refusal)) => Some((member, refusal)),
            _ => None,
        })
    };
    let root = refusals().find(|(_, r)| !matches!(r, Refusal::Exec { after_peer: true, .. })).or_else(|| refusals().next());
    match root {
        Some((member, r)) => refused(member, r.clone()),
        None => OrchestratorError::Failed { member: "orchestrator".into(), problem: format!("{request} failed without a refusal") },
    }
}
