//! A refit's data plane: opened fresh on every member (prepare, connect)
//! or resumed from the last refit of the plan, the bytes moved over it,
//! and the kept planes forgotten.

use super::error::refused;
use super::members::no_refusal;
use super::{Orchestrator, OrchestratorError, RefitStep};
use crate::protocol::{Fabric, MemberMsg, MemberReply, PeerAddr, Refusal};
use reshard::Fingerprint;
use std::time::{Duration, Instant};

impl Orchestrator {
    /// Prepare, connect and run on every member: the first phase. Returns
    /// the bytes and messages the members sent, as they counted them.
    pub(super) async fn transfer(
        &self,
        refit: u64,
        session: &str,
        version: u64,
        fingerprint: Fingerprint,
        resumed: bool,
        connect_time: &mut Duration,
    ) -> Result<(u64, u64), OrchestratorError> {
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
        let ran = self.ask_all(run, deadline + control).await?;
        // The member whose own run failed (or that refused to run), rather
        // than one that failed because a peer aborted or went away.
        let root = ran
            .iter()
            .find(|(_, r)| matches!(r, MemberReply::Refused(refusal) if !matches!(refusal, Refusal::Exec { after_peer: true, .. })));
        if let Some((member, MemberReply::Refused(r))) = root {
            return Err(refused(member, r.clone()));
        }
        no_refusal(&ran)?;
        let (mut sent, mut messages) = (0, 0);
        for (member, reply) in ran {
            let MemberReply::Ran(stats) = reply else {
                return Err(OrchestratorError::Protocol { member, request: "Run", reply: format!("{reply:?}") });
            };
            sent += stats.sent_bytes;
            messages += stats.messages;
        }
        Ok((sent, messages))
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

    /// Opens a fresh data plane for this refit on every member: prepare,
    /// and connect for the node fabric.
    async fn open(&self, refit: u64, session: &str, fingerprint: Fingerprint) -> Result<(), OrchestratorError> {
        let control = self.config.control_timeout;
        let fabric = self.config.fabric.clone();
        let keep = self.keeps_data_plane();
        let prepare = |_, _| Some(MemberMsg::Prepare { refit, fingerprint, session: session.to_string(), fabric: fabric.clone(), keep });
        self.enter(RefitStep::Preparing);
        let prepared = self.ask_all(prepare, control).await?;
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
            let connected = self.ask_all(connect, timeout + control).await?;
            no_refusal(&connected)?;
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
