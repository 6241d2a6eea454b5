//! Asking the members: every member's status ([`Status`]), a group's
//! layout, and one message to every member of both groups at once.

use super::error::{call_error, refused};
use super::{Orchestrator, OrchestratorError};
use crate::member::Member;
use crate::protocol::{MemberMsg, MemberReply, Weights};
use actors::ActorGroup;
use reshard::{Endpoint, Fingerprint, Group, Layout};
use std::sync::Arc;
use std::time::Duration;

/// Asks one member of `group` (rank 0) for the group's layout, which
/// every member reported as `fingerprint`.
pub(super) async fn describe(
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
    sent: impl FnOnce(usize),
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
    sent(calls.len());
    let mut out = Vec::with_capacity(calls.len());
    for r in actors::join_all(calls).await {
        out.push(r?);
    }
    Ok(out)
}

/// Turns the first refusal among `replies` into an error.
pub(super) fn no_refusal(replies: &[(String, MemberReply)]) -> Result<(), OrchestratorError> {
    for (member, reply) in replies {
        if let MemberReply::Refused(r) = reply {
            return Err(refused(member, r.clone()));
        }
    }
    Ok(())
}

/// What every member reported in `Status`, sources first.
pub(super) struct Status {
    /// Every member's name.
    pub(super) names: Vec<String>,
    /// The layout fingerprint of each group.
    pub(super) layouts: (u64, u64),
    /// The plans each member has installed.
    pub(super) installed: Vec<Vec<Fingerprint>>,
    /// The weights each member holds or serves.
    pub(super) weights: Vec<Weights>,
    /// Members of the source group (the rest are destinations).
    pub(super) n_src: usize,
}

impl Status {
    pub(super) fn src_weights(&self) -> &[Weights] {
        &self.weights[..self.n_src]
    }

    pub(super) fn dst_weights(&self) -> &[Weights] {
        &self.weights[self.n_src..]
    }
}

impl Orchestrator {
    /// Every member's reply to `msg(group, rank)` (`None`: that member is
    /// not asked), or the first failure; the calls are counted.
    pub(super) async fn ask_all(
        &self,
        msg: impl Fn(Group, usize) -> Option<MemberMsg>,
        after: Duration,
    ) -> Result<Vec<(String, MemberReply)>, OrchestratorError> {
        call_both(&self.src, &self.dst, msg, after, |n| self.sent(n)).await
    }

    /// Tells every member `msg` without waiting (queued behind what it
    /// handles now); counted.
    pub(super) fn tell_all(&self, msg: impl Fn() -> MemberMsg) {
        for (_, m) in self.src.iter().chain(self.dst.iter()) {
            let _ = m.try_tell(msg());
        }
        self.sent(self.src.len() + self.dst.len());
    }

    pub(super) fn endpoints(&self) -> Vec<Endpoint> {
        (0..self.src.len() as u32).map(Endpoint::src).chain((0..self.dst.len() as u32).map(Endpoint::dst)).collect()
    }

    /// Asks every member for its layout fingerprint, installed plans and
    /// weights; checks that both groups have members and that the members
    /// of each group hold one layout.
    pub(super) async fn status(&self) -> Result<Status, OrchestratorError> {
        for (group, members) in [(Group::Src, &self.src), (Group::Dst, &self.dst)] {
            if members.is_empty() {
                return Err(OrchestratorError::Layout { group, problem: "the group has no members".into() });
            }
        }
        let replies = self.ask_all(|_, _| Some(MemberMsg::Status), self.config.control_timeout).await?;
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
}
