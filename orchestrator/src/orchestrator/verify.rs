//! The check before any commit: what every member holds of this refit,
//! read back after its run, is what its senders sent
//! ([`OrchestratorConfig::digest_check`](super::OrchestratorConfig::digest_check)).
//!
//! Each member answers its run with a digest (`transport::fabric::digest`):
//! per receiver, the keyed CRC-32C sum of every piece it sent; per sender,
//! the same sum of every piece it holds, read back from the memory a
//! commit would serve. Here every receiver's sums are compared with its
//! senders'. A member whose memory could not be read back (device memory)
//! or whose pieces went through bypassed scratch is counted unverified,
//! never failed; any difference fails the refit, naming the rank and the
//! sender, before any destination commits.

use super::OrchestratorError;
use crate::protocol::{DigestError, RankDigest};
use reshard::{Endpoint, Group};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// One member's digest, as its run answered it.
#[derive(Debug)]
pub(super) struct MemberDigest {
    /// The member's endpoint.
    pub(super) endpoint: Endpoint,
    /// Its name.
    pub(super) member: String,
    /// Its digest (`None`: it gave none).
    pub(super) digest: Option<Result<RankDigest, DigestError>>,
    /// The time it took.
    pub(super) time: Duration,
}

/// What the check found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Verified {
    /// Destination ranks every piece of which was checked.
    pub(super) ranks: u64,
    /// Destination ranks of which some piece could not be.
    pub(super) unverified: u64,
    /// The longest digest of a member plus the comparison.
    pub(super) time: Duration,
    /// Bytes the members read back.
    pub(super) bytes: u64,
}

/// Checks every member's held sums against its senders' sent sums;
/// destinations for which `commits` is false (replicas that leave) are
/// not checked.
pub(super) fn verify(digests: &[MemberDigest], commits: impl Fn(Endpoint) -> bool) -> Result<Verified, OrchestratorError> {
    let t = Instant::now();
    let longest = digests.iter().map(|d| d.time).max().unwrap_or_default();
    // By receiver, by sender.
    let mut sent: BTreeMap<Endpoint, BTreeMap<Endpoint, u64>> = BTreeMap::new();
    let mut senders: BTreeSet<Endpoint> = BTreeSet::new();
    let mut bytes = 0;
    for d in digests {
        if let Some(Ok(digest)) = &d.digest {
            senders.insert(digest.rank);
            bytes += digest.bytes;
            for &(to, h) in &digest.sent {
                sent.entry(to).or_default().insert(digest.rank, h);
            }
        }
    }
    let mut verified = Verified::default();
    for d in digests.iter().filter(|d| d.endpoint.group == Group::Src || commits(d.endpoint)) {
        let is_dst = d.endpoint.group == Group::Dst;
        let digest = match &d.digest {
            Some(Ok(digest)) => digest,
            Some(Err(DigestError::Inconsistent(problem))) => {
                return Err(OrchestratorError::DigestMismatch {
                    member: d.member.clone(),
                    rank: d.endpoint,
                    from: None,
                    problem: problem.clone(),
                })
            }
            Some(Err(DigestError::Unread(_))) | None => {
                verified.unverified += u64::from(is_dst);
                continue;
            }
        };
        let me = digest.rank;
        let mismatch = |from: Endpoint, problem: String| OrchestratorError::DigestMismatch {
            member: d.member.clone(),
            rank: d.endpoint,
            from: Some(from),
            problem,
        };
        let none = BTreeMap::new();
        let expected = sent.get(&me).unwrap_or(&none);
        let mut whole = digest.unread.is_empty();
        for &(from, held) in &digest.held {
            if !senders.contains(&from) {
                // Its sender's memory was not read back.
                whole = false;
                continue;
            }
            match expected.get(&from) {
                Some(&s) if s == held => {}
                Some(_) => return Err(mismatch(from, format!("what it holds from {from} differs from what {from} sent"))),
                None => return Err(mismatch(from, format!("it holds pieces from {from}, which sent it none"))),
            }
        }
        let held_from: BTreeSet<Endpoint> = digest.held.iter().map(|(from, _)| *from).chain(digest.unread.iter().copied()).collect();
        if let Some(from) = expected.keys().find(|f| !held_from.contains(f)) {
            return Err(mismatch(*from, format!("it holds none of the pieces {from} sent it")));
        }
        if is_dst {
            if whole {
                verified.ranks += 1;
            } else {
                verified.unverified += 1;
            }
        }
    }
    verified.time = longest + t.elapsed();
    verified.bytes = bytes;
    Ok(verified)
}
