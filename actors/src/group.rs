//! [`ActorGroup`]: N rank-indexed actors spawned together (a mesh of actors).

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use crate::actor::Actor;
use crate::actor_ref::ActorRef;
use crate::error::{BroadcastError, CallError, GroupError};
use crate::join::{join_all, try_join_all};
use crate::runtime::{spawn_named, SpawnConfig};
use crate::supervision::{StopReason, Supervisor};

/// Spawns `n` actors with ranks `0..n`, built by `make(rank)`. Same as
/// [`ActorGroup::spawn`].
///
/// # Panics
///
/// Like [`tokio::spawn`], panics when called outside a tokio runtime.
pub fn spawn_group<A: Actor>(n: usize, config: SpawnConfig, make: impl FnMut(usize) -> A) -> ActorGroup<A> {
    ActorGroup::spawn(n, config, make)
}

/// A view of consecutive ranks of a group of actors spawned together.
///
/// Ranks are always the original ones: a [slice](ActorGroup::slice) of ranks
/// `2..4` reports `ranks() == 2..4`, and its `call_rank(2, ..)` reaches the
/// actor spawned as rank 2. Cloning or slicing is cheap (shared handles).
///
/// The group holds [`ActorRef`]s, so it keeps its members alive; once every
/// view of it (and every other handle) is dropped, they stop normally.
pub struct ActorGroup<A: Actor> {
    /// All members of the original group, indexed by rank.
    members: Arc<[ActorRef<A>]>,
    /// The ranks this view covers; always within `0..members.len()`.
    ranks: Range<usize>,
}

impl<A: Actor> ActorGroup<A> {
    /// Spawns `n` actors with ranks `0..n`, built by `make(rank)` and named
    /// `name[rank]` (name from `config`, default the actor type's name).
    /// Every member is linked to the supervisors in `config`, so the group's
    /// owner gets a [`Terminated`](crate::Terminated) event (with `rank`) for
    /// each member that stops.
    ///
    /// # Panics
    ///
    /// Like [`tokio::spawn`], panics when called outside a tokio runtime.
    pub fn spawn(n: usize, config: SpawnConfig, mut make: impl FnMut(usize) -> A) -> Self {
        let base = config.base_name::<A>();
        let members: Arc<[ActorRef<A>]> =
            (0..n).map(|rank| spawn_named(make(rank), &config, format!("{base}[{rank}]"), Some(rank))).collect();
        Self { members, ranks: 0..n }
    }

    /// A group of actors obtained elsewhere (looked up on remote nodes, say):
    /// `refs[i]` is rank `i`. Unlike [`spawn`](Self::spawn), nothing is
    /// linked to a supervisor; link the group if you want its events.
    pub fn from_refs(refs: Vec<ActorRef<A>>) -> Self {
        let n = refs.len();
        Self { members: refs.into(), ranks: 0..n }
    }

    /// Number of ranks in this view.
    pub fn len(&self) -> usize {
        self.ranks.len()
    }

    /// `true` if this view has no ranks.
    pub fn is_empty(&self) -> bool {
        self.ranks.is_empty()
    }

    /// The (original) ranks this view covers.
    pub fn ranks(&self) -> Range<usize> {
        self.ranks.clone()
    }

    /// Handles of this view's members; index `i` is rank `ranks().start + i`.
    pub fn refs(&self) -> &[ActorRef<A>] {
        // `ranks` is always within `0..members.len()`; the fallback is unreachable.
        self.members.get(self.ranks.clone()).unwrap_or(&[])
    }

    /// The member with this (original) rank, if it is in this view.
    pub fn get(&self, rank: usize) -> Option<&ActorRef<A>> {
        if self.ranks.contains(&rank) {
            self.members.get(rank)
        } else {
            None
        }
    }

    /// `(rank, handle)` for each member, in rank order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &ActorRef<A>)> + '_ {
        self.ranks.clone().zip(self.refs())
    }

    /// This group with the member of (original) rank `rank` replaced by
    /// `actor` (a replacement for one that stopped; the others are shared,
    /// and this view is unchanged).
    pub fn with_member(&self, rank: usize, actor: ActorRef<A>) -> Result<Self, GroupError> {
        if !self.ranks.contains(&rank) {
            return Err(GroupError::NoSuchRank { rank, ranks: self.ranks() });
        }
        let mut members = self.members.to_vec();
        members[rank] = actor;
        Ok(Self { members: members.into(), ranks: self.ranks.clone() })
    }

    /// A view of the (original) ranks `ranks`, which must lie within this
    /// view. An empty range gives an empty view.
    pub fn slice(&self, ranks: Range<usize>) -> Result<Self, GroupError> {
        let within = ranks.start <= ranks.end && ranks.start >= self.ranks.start && ranks.end <= self.ranks.end;
        if !within {
            return Err(GroupError::InvalidRange { requested: ranks, ranks: self.ranks() });
        }
        Ok(Self { members: Arc::clone(&self.members), ranks })
    }

    fn member(&self, rank: usize) -> Result<&ActorRef<A>, GroupError> {
        self.get(rank).ok_or_else(|| GroupError::NoSuchRank { rank, ranks: self.ranks() })
    }

    /// Calls the member with this (original) rank.
    pub async fn call_rank(&self, rank: usize, msg: A::Msg) -> Result<A::Reply, GroupError> {
        self.member(rank)?.call(msg).await.map_err(|error| GroupError::Rank { rank, error })
    }

    /// Calls every member concurrently with `msg_for_rank(rank)` and returns
    /// the replies in rank order (whatever order they arrive in).
    ///
    /// Fails fast: the first failure to occur, naming its rank, is returned
    /// as soon as it happens and the other calls are abandoned (their
    /// messages may still be handled). See [`ActorGroup::call_all_results`]
    /// to get every rank's outcome.
    pub async fn call_all(&self, msg_for_rank: impl FnMut(usize) -> A::Msg) -> Result<Vec<A::Reply>, GroupError> {
        self.call_all_inner(msg_for_rank, None).await
    }

    /// [`ActorGroup::call_all`] with an explicit per-call timeout instead of
    /// each member's default.
    pub async fn call_all_timeout(&self, msg_for_rank: impl FnMut(usize) -> A::Msg, after: Duration) -> Result<Vec<A::Reply>, GroupError> {
        self.call_all_inner(msg_for_rank, Some(after)).await
    }

    async fn call_all_inner(
        &self,
        mut msg_for_rank: impl FnMut(usize) -> A::Msg,
        after: Option<Duration>,
    ) -> Result<Vec<A::Reply>, GroupError> {
        let calls = self.iter().map(|(rank, actor)| {
            let msg = msg_for_rank(rank);
            async move {
                let result = match after {
                    Some(after) => actor.call_timeout(msg, after).await,
                    None => actor.call(msg).await,
                };
                result.map_err(|error| GroupError::Rank { rank, error })
            }
        });
        try_join_all(calls).await
    }

    /// Calls every member concurrently with `msg_for_rank(rank)` and waits
    /// for all of them; entry `i` is the outcome for rank `ranks().start + i`.
    pub async fn call_all_results(&self, mut msg_for_rank: impl FnMut(usize) -> A::Msg) -> Vec<Result<A::Reply, CallError>> {
        let calls = self.iter().map(|(rank, actor)| {
            let msg = msg_for_rank(rank);
            async move { actor.call(msg).await }
        });
        join_all(calls).await
    }

    /// Tells every member `msg_for_rank(rank)` concurrently (waiting for
    /// mailbox space where needed). Every reachable member gets its message;
    /// the messages of members that are stopped are handed back.
    pub async fn tell_all(&self, mut msg_for_rank: impl FnMut(usize) -> A::Msg) -> Result<(), BroadcastError<A::Msg>> {
        let tells = self.iter().map(|(rank, actor)| {
            let msg = msg_for_rank(rank);
            async move { actor.tell(msg).await.map_err(|err| (rank, err)) }
        });
        let failures: Vec<_> = join_all(tells).await.into_iter().filter_map(Result::err).collect();
        if failures.is_empty() {
            Ok(())
        } else {
            Err(BroadcastError { failures })
        }
    }

    /// Tells every member a clone of `msg`; see [`ActorGroup::tell_all`].
    pub async fn broadcast(&self, msg: A::Msg) -> Result<(), BroadcastError<A::Msg>>
    where
        A::Msg: Clone,
    {
        self.tell_all(|_| msg.clone()).await
    }

    /// Links every member of this view to `supervisor`.
    pub fn link(&self, supervisor: &Supervisor) {
        for actor in self.refs() {
            actor.link(supervisor);
        }
    }

    /// Asks every member of this view to stop (see [`ActorRef::stop`]).
    pub fn stop(&self) {
        for actor in self.refs() {
            actor.stop();
        }
    }

    /// Waits until every member of this view has stopped; reasons in rank
    /// order. Like [`ActorRef::terminated`], this does not wait for a normal
    /// stop, as the group keeps its members alive.
    pub async fn terminated(&self) -> Vec<StopReason> {
        join_all(self.refs().iter().map(ActorRef::terminated)).await
    }
}

impl<A: Actor> Clone for ActorGroup<A> {
    fn clone(&self) -> Self {
        Self { members: Arc::clone(&self.members), ranks: self.ranks() }
    }
}

impl<A: Actor> fmt::Debug for ActorGroup<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ActorGroup").field("ranks", &self.ranks).field("members", &self.refs()).finish()
    }
}
