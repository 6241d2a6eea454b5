//! Asking the members: every member's status ([`Status`]), a group's
//! layout, and one message to every member of both groups at once.

use super::error::{call_error, refused};
use super::{Orchestrator, OrchestratorError};
use crate::member::Member;
use crate::protocol::{HeldVersion, MemberMsg, MemberReply};
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

/// One member's answer to a call: its endpoint, name and reply (or why
/// there is none).
pub(super) type Answer = (Endpoint, String, Result<MemberReply, OrchestratorError>);

/// Every asked member's answer to `msg(group, rank)`, sources first, by rank.
async fn call_each(
    cast: &RunMembers,
    msg: impl Fn(Group, usize) -> Option<MemberMsg>,
    after: Duration,
    sent: impl FnOnce(usize),
) -> Vec<Answer> {
    let mut calls = Vec::new();
    for (g, group) in [(Group::Src, &cast.src), (Group::Dst, &cast.dst)] {
        for (rank, member) in group.iter() {
            let endpoint = Endpoint { group: g, rank: rank as u32 };
            if cast.absent.contains(&endpoint) {
                continue;
            }
            if let Some(m) = msg(g, rank) {
                let member = member.clone();
                calls.push(async move {
                    let name = member.name().to_string();
                    match member.call_timeout(m, after).await {
                        Ok(r) => (endpoint, name, Ok(r)),
                        Err(e) => (endpoint, name.clone(), Err(call_error(name, e, after))),
                    }
                });
            }
        }
    }
    sent(calls.len());
    actors::join_all(calls).await
}

/// Every member's reply to `msg(group, rank)`, or the first failure.
async fn call_both(
    cast: &RunMembers,
    msg: impl Fn(Group, usize) -> Option<MemberMsg>,
    after: Duration,
    sent: impl FnOnce(usize),
) -> Result<Vec<(String, MemberReply)>, OrchestratorError> {
    call_each(cast, msg, after, sent).await.into_iter().map(|(_, name, r)| r.map(|r| (name, r))).collect()
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
    pub(super) weights: Vec<HeldVersion>,
    /// Members of the source group (the rest are destinations).
    pub(super) n_src: usize,
    /// Lost sources, by rank: not asked (see
    /// [`SourceLoss::Replan`](super::SourceLoss::Replan)); their entries
    /// repeat the first present source's.
    pub(super) absent: Vec<usize>,
}

impl Status {
    pub(super) fn src_weights(&self) -> &[HeldVersion] {
        &self.weights[..self.n_src]
    }

    pub(super) fn dst_weights(&self) -> &[HeldVersion] {
        &self.weights[self.n_src..]
    }
}

/// The members of one run of a plan: those standing for its source
/// endpoints and those standing for its destination endpoints, by rank. A
/// refit's cast is both groups; seeding a replica's is a serving replica's
/// members (as sources) and the new replica's (as destinations).
#[derive(Clone)]
pub(super) struct RunMembers {
    pub(super) src: ActorGroup<Member>,
    pub(super) dst: ActorGroup<Member>,
    /// Members not asked anything: lost sources (see
    /// [`SourceLoss::Replan`](super::SourceLoss::Replan)).
    pub(super) absent: Vec<Endpoint>,
}

impl RunMembers {
    /// Every member of `src` and `dst`.
    pub(super) fn of(src: ActorGroup<Member>, dst: ActorGroup<Member>) -> RunMembers {
        RunMembers { src, dst, absent: Vec::new() }
    }

    /// Every endpoint of the plan the cast runs.
    pub(super) fn endpoints(&self) -> Vec<Endpoint> {
        (0..self.src.len() as u32).map(Endpoint::src).chain((0..self.dst.len() as u32).map(Endpoint::dst)).collect()
    }
}

impl Orchestrator {
    /// The cast of a refit: both groups.
    pub(super) fn groups(&self) -> RunMembers {
        let absent = self.lost_sources.iter().map(|&r| Endpoint::src(r)).collect();
        RunMembers { src: self.src.clone(), dst: self.dst.clone(), absent }
    }

    /// Every member's reply to `msg(group, rank)` (`None`: that member is
    /// not asked), or the first failure; the calls are counted.
    pub(super) async fn ask_all(
        &self,
        msg: impl Fn(Group, usize) -> Option<MemberMsg>,
        after: Duration,
    ) -> Result<Vec<(String, MemberReply)>, OrchestratorError> {
        call_both(&self.groups(), msg, after, |n| self.sent(n)).await
    }

    /// [`ask_all`](Self::ask_all) of the members of `cast`.
    pub(super) async fn ask_cast(
        &self,
        cast: &RunMembers,
        msg: impl Fn(Group, usize) -> Option<MemberMsg>,
        after: Duration,
    ) -> Result<Vec<(String, MemberReply)>, OrchestratorError> {
        call_both(cast, msg, after, |n| self.sent(n)).await
    }

    /// Every asked member of `cast`'s answer, failed or not; counted.
    pub(super) async fn ask_each(
        &self,
        cast: &RunMembers,
        msg: impl Fn(Group, usize) -> Option<MemberMsg>,
        after: Duration,
    ) -> Vec<Answer> {
        call_each(cast, msg, after, |n| self.sent(n)).await
    }

    /// Tells every member `msg` without waiting (queued behind what it
    /// handles now); counted.
    pub(super) fn tell_all(&self, msg: impl Fn() -> MemberMsg) {
        self.tell_cast(&self.groups(), msg);
    }

    /// [`tell_all`](Self::tell_all) to the members of `cast`.
    pub(super) fn tell_cast(&self, cast: &RunMembers, msg: impl Fn() -> MemberMsg) {
        for (_, m) in cast.src.iter().chain(cast.dst.iter()) {
            let _ = m.try_tell(msg());
        }
        self.sent(cast.src.len() + cast.dst.len());
    }

    pub(super) fn endpoints(&self) -> Vec<Endpoint> {
        self.groups().endpoints()
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
        let cast = self.groups();
        let answers = self.ask_each(&cast, |_, _| Some(MemberMsg::Status), self.config.control_timeout).await;
        let n_src = self.src.len();
        let n = n_src + self.dst.len();
        let mut layouts: [Option<u64>; 2] = [None, None];
        let mut status = Status {
            names: self.src.refs().iter().chain(self.dst.refs()).map(|m| m.name().to_string()).collect(),
            layouts: (0, 0),
            installed: vec![Vec::new(); n],
            weights: vec![HeldVersion::Unwritten; n],
            n_src,
            absent: cast.absent.iter().map(|e| e.rank as usize).collect(),
        };
        for (e, member, reply) in answers {
            let MemberReply::Status { layout, installed, weights } = reply? else {
                return Err(OrchestratorError::Protocol { member, request: "Status", reply: "not a status".into() });
            };
            let (g, i) = match e.group {
                Group::Src => (0, e.rank as usize),
                Group::Dst => (1, n_src + e.rank as usize),
            };
            let first = *layouts[g].get_or_insert(layout);
            if first != layout {
                return Err(OrchestratorError::Layout {
                    group: e.group,
                    problem: format!("{member} (rank {}) holds a different layout ({layout:016x}) than the first ({first:016x})", e.rank),
                });
            }
            status.installed[i] = installed;
            status.weights[i] = weights;
        }
        // A lost source is not asked: it stands as the first present one
        // (the version checks then hold for the sources that will send).
        if let Some(present) = (0..n_src).find(|i| !status.absent.contains(i)) {
            for &i in &status.absent {
                status.weights[i] = status.weights[present];
                status.installed[i] = status.installed[present].clone();
            }
        }
        status.layouts = (layouts[0].unwrap_or_default(), layouts[1].unwrap_or_default());
        Ok(status)
    }
}
