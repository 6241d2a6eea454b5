//! A destination group made of replicas of one inference layout
//! ([`ClusterConfig::replicas`]): replicas started here (or joining from
//! elsewhere, with `refit worker --replica NAME`) are added between refits,
//! seeded by the orchestrator from a serving replica; replicas leave on
//! request, or when the orchestrator drops them from a refit (their
//! workers are then stopped); a replica whose worker died is replaced by a
//! fresh one.
//!
//! The cluster keeps the group's replicas in the orchestrator's order:
//! replica `i`'s rank `j` is destination rank `i * k + j` (`k` a replica's
//! ranks), renumbered whenever a replica leaves. A replica's workers stay
//! on the emulated hosts of its slot (`--netns`), whatever its place.
//!
//! [`ClusterConfig::replicas`]: super::ClusterConfig::replicas

use super::{group_name, place, setup, worker_args, Cluster, ClusterConfig, ClusterError, Host};
use crate::cluster::worker::{replica_pattern_name, PatternRank};
use crate::netns::Hosts as NetHosts;
use actors::{ActorGroup, ActorRef};
use orchestrator::replica_member_name;
use orchestrator::{Member, RefitStep, Rendezvous, ReplicaReport};
use reshard::{Endpoint, Group, Layout};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The destination group as replicas of the layout in
/// [`ClusterConfig::dst_path`](super::ClusterConfig::dst_path).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaConfig {
    /// Replicas the group starts with (at least 1).
    pub start: u32,
    /// The most replicas at once (at least `start`): emulated hosts are
    /// made for this many.
    pub most: u32,
}

/// What [`Cluster::refit_adding_replica`] did: the refit's outcome, and
/// the replica's.
pub type RefitAndReplica = (Result<super::RefitOutcome, ClusterError>, Result<ReplicaReport, ClusterError>);

/// The replicas of a cluster in replica mode.
pub(super) struct Replicas {
    /// One replica's layout.
    pub(super) one: Arc<Layout>,
    /// The group's replicas, in its order.
    pub(super) live: Vec<Replica>,
    /// The names of the replicas in the group, or starting (a name is
    /// free again once its replica left and its registrations at the
    /// rendezvous are forgotten: a cluster launcher may start it again).
    named: HashSet<String>,
    /// Names given here so far.
    counter: u64,
    most: u32,
    /// The replicas the group should have: those it started with, plus
    /// those added, less those removed on request (not those dropped or
    /// dead: [`Cluster::recover`] replaces them, workers started here).
    wanted: u32,
}

/// One replica of the group.
pub(super) struct Replica {
    name: String,
    /// Its place among the emulated hosts (`0..most`).
    slot: u32,
    /// Its worker processes (indices into the cluster's hosts; none when
    /// started elsewhere).
    workers: Vec<usize>,
    members: Vec<ActorRef<Member>>,
    patterns: Vec<ActorRef<PatternRank>>,
}

impl Replicas {
    /// Checks a replica's layout for a group of up to `config.most`
    /// replicas.
    pub(super) fn new(one: Layout, config: ReplicaConfig) -> Result<Replicas, ClusterError> {
        if config.start == 0 || config.most < config.start {
            return Err(setup(format!("replicas: {} to start with, {} at most: need 1 <= start <= most", config.start, config.most)));
        }
        let (k, rpn) = (one.ranks(), one.ranks_per_node().max(1));
        if !k.is_multiple_of(rpn) {
            return Err(setup(format!(
                "replicas: a replica's layout has {k} ranks, not whole nodes of {rpn} (its ranks_per_node): replicas could share a node"
            )));
        }
        one.replicated(config.most).map_err(|e| setup(format!("replicas: {e}")))?;
        Ok(Replicas { one: Arc::new(one), live: Vec::new(), named: HashSet::new(), counter: 0, most: config.most, wanted: config.start })
    }

    /// The group's layout now.
    pub(super) fn layout(&self) -> Result<Layout, ClusterError> {
        self.one.replicated(self.live.len().max(1) as u32).map_err(|e| setup(format!("replicas: {e}")))
    }

    /// The layout the emulated hosts are made for: the most replicas.
    pub(super) fn most_layout(&self) -> Result<Layout, ClusterError> {
        self.one.replicated(self.most).map_err(|e| setup(format!("replicas: {e}")))
    }

    /// Takes `name` (a replica started elsewhere).
    pub(super) fn take_name(&mut self, name: &str) {
        self.named.insert(name.to_string());
    }

    /// A fresh name.
    pub(super) fn fresh_name(&mut self) -> String {
        loop {
            let name = format!("r{}", self.counter);
            self.counter += 1;
            if self.named.insert(name.clone()) {
                return name;
            }
        }
    }

    /// A slot no replica holds, if any.
    fn free_slot(&self) -> Option<u32> {
        (0..self.most).find(|s| self.live.iter().all(|r| r.slot != *s))
    }

    /// The names of the group's replicas, in order.
    pub(super) fn names(&self) -> Vec<String> {
        self.live.iter().map(|r| r.name.clone()).collect()
    }
}

/// The worker processes of replica `name` in `slot`: every rank of `one`
/// (one process per rank or per node), on the emulated hosts of the slot.
pub(super) fn replica_hosts(config: &ClusterConfig, one: &Layout, name: &str, slot: u32, net: Option<&NetHosts>) -> Vec<Host> {
    let rpn = one.ranks_per_node().max(1);
    let first_node = slot * one.nodes();
    let replica = |mut args: Vec<String>| {
        args.extend(["--replica".into(), name.to_string()]);
        args
    };
    let mut out = Vec::new();
    let mut add = |locals: Vec<u32>, args: Vec<String>, node: u32| {
        let mut h = place(Vec::new(), replica(args), (Group::Dst, first_node + node), net);
        h.replica = Some((name.to_string(), locals));
        out.push(h);
    };
    match config.per_process {
        super::PerProcess::Rank => {
            for j in 0..one.ranks() {
                let mut args = worker_args(config);
                args.extend(["--group".into(), group_name(Group::Dst).into(), "--rank".into(), j.to_string()]);
                add(vec![j], args, j / rpn);
            }
        }
        super::PerProcess::Node => {
            for n in 0..one.nodes() {
                let first = n * rpn;
                let last = (first + rpn).min(one.ranks());
                let mut args = worker_args(config);
                args.extend(["--group".into(), group_name(Group::Dst).into(), "--node".into(), n.to_string()]);
                add((first..last).collect(), args, n);
            }
        }
    }
    out
}

/// Looks up the members and pattern actors of replica `name` (`k`
/// ranks), waiting up to `within`.
pub(super) async fn join_replica(
    rendezvous: &Rendezvous,
    name: &str,
    k: u32,
    slot: u32,
    workers: Vec<usize>,
    within: Duration,
) -> Result<Replica, ClusterError> {
    let until = Instant::now() + within;
    let members = rendezvous.replica_members(name, k, within).await.map_err(setup)?;
    let mut patterns = Vec::new();
    for j in 0..k {
        let left = until.saturating_duration_since(Instant::now());
        patterns.push(rendezvous.lookup::<PatternRank>(&replica_pattern_name(name, j), left).await.map_err(setup)?);
    }
    Ok(Replica { name: name.to_string(), slot, workers, members: members.refs().to_vec(), patterns })
}

/// The names of the first `start` replicas of `k` ranks started elsewhere
/// to have joined, by name order, waiting up to `within` for them.
pub(super) async fn wait_for_replicas(rendezvous: &Rendezvous, k: u32, start: u32, within: Duration) -> Result<Vec<String>, ClusterError> {
    let until = Instant::now() + within;
    loop {
        let joined = rendezvous.joined_replicas(k).await.map_err(setup)?;
        if joined.len() >= start as usize {
            return Ok(joined.into_iter().take(start as usize).collect());
        }
        if Instant::now() >= until {
            return Err(setup(format!(
                "{} of {start} replicas joined within {within:?} (start their workers with `refit worker --replica NAME`)",
                joined.len()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Cluster {
    fn replicas_mut(&mut self) -> Result<&mut Replicas, ClusterError> {
        self.replicas.as_mut().ok_or_else(|| setup("the destination group is not made of replicas (no --replicas)"))
    }

    /// The names of the destination group's replicas, in its order
    /// (`None`: the group is not made of replicas).
    pub fn replica_names(&self) -> Option<Vec<String>> {
        self.replicas.as_ref().map(Replicas::names)
    }

    /// The workers of replica `index` (its place in the group; none when
    /// started elsewhere, or no such replica), by index into
    /// [`workers`](Self::workers).
    pub fn replica_workers(&self, index: usize) -> Vec<usize> {
        self.replicas.as_ref().and_then(|r| r.live.get(index)).map_or_else(Vec::new, |r| r.workers.clone())
    }

    /// Starts the workers of a new replica in a free slot (workers started
    /// here only) and waits until its members joined; it is not in the
    /// group yet.
    pub(super) fn start_replica(&mut self) -> Result<Replica, ClusterError> {
        let r = self.replicas_mut()?;
        let most = r.most;
        let slot = r.free_slot().ok_or_else(|| setup(format!("replicas: the group has its most, {most}")))?;
        self.start_replica_in(slot)
    }

    /// [`start_replica`](Self::start_replica) in `slot`.
    fn start_replica_in(&mut self, slot: u32) -> Result<Replica, ClusterError> {
        if self.children.is_none() {
            return Err(setup("workers are not started here: start a replica's workers with `refit worker --replica NAME`"));
        }
        let r = self.replicas_mut()?;
        let (name, one) = (r.fresh_name(), Arc::clone(&r.one));
        let hosts = replica_hosts(&self.config, &one, &name, slot, self.net.as_ref());
        let mut workers = Vec::new();
        for h in hosts {
            if let Some(children) = &mut self.children {
                let i = children.spawn_in(h.args.clone(), h.netns.clone()).map_err(setup)?;
                debug_assert_eq!(i, self.hosts.len());
            }
            workers.push(self.hosts.len());
            self.hosts.push(h);
        }
        let joined = self.join_replica(&name, slot, workers.clone());
        if joined.is_err() {
            self.retire(&workers);
        }
        joined
    }

    /// Looks up the members and pattern actors of replica `name`, waiting
    /// up to the setup timeout.
    fn join_replica(&self, name: &str, slot: u32, workers: Vec<usize>) -> Result<Replica, ClusterError> {
        let k = self.replicas.as_ref().map_or(0, |r| r.one.ranks());
        self.runtime.block_on(join_replica(&self.rendezvous, name, k, slot, workers, self.config.setup_timeout))
    }

    /// Adds a replica, started here: its workers start, it is seeded with
    /// the version the others serve (from one of them), and it becomes the
    /// group's last replica.
    pub fn add_replica(&mut self) -> Result<ReplicaReport, ClusterError> {
        let replica = self.start_replica()?;
        let report = self.admit(replica)?;
        self.replicas_mut()?.wanted += 1;
        Ok(report)
    }

    /// Hands `replica` to the orchestrator (seeded, then the group's last)
    /// and keeps it; its workers are stopped if the orchestrator refuses.
    pub(super) fn admit(&mut self, replica: Replica) -> Result<ReplicaReport, ClusterError> {
        let members = ActorGroup::from_refs(replica.members.clone());
        match self.runtime.block_on(self.orchestrator.add_replica(members)) {
            Ok(report) => {
                self.replicas_mut()?.live.push(replica);
                self.renumber()?;
                Ok(report)
            }
            Err(e) => {
                self.retire_replica(&replica);
                Err(e.into())
            }
        }
    }

    /// Removes replica `index` (its place in the group) and stops its
    /// workers; the replicas after it move up.
    pub fn remove_replica(&mut self, index: u32) -> Result<ReplicaReport, ClusterError> {
        let report = self.leave(index)?;
        let r = self.replicas_mut()?;
        r.wanted = r.wanted.saturating_sub(1).max(1);
        Ok(report)
    }

    /// Replica `index` leaves the group; its workers stop.
    fn leave(&mut self, index: u32) -> Result<ReplicaReport, ClusterError> {
        let n = self.replicas_mut()?.live.len();
        if index as usize >= n {
            return Err(setup(format!("replicas: no replica {index}: the group has {n}")));
        }
        let report = self.runtime.block_on(self.orchestrator.remove_replica(index))?;
        let gone = self.replicas_mut()?.live.remove(index as usize);
        self.retire_replica(&gone);
        self.renumber()?;
        Ok(report)
    }

    /// Adds a replica while a refit runs: its workers start and join
    /// first, then the refit of `version` begins and the replica is handed
    /// to the orchestrator once the refit reached `step`. The orchestrator
    /// takes it after the refit (one request at a time), seeded with
    /// what the refit committed. Returns the refit's outcome and the
    /// replica's.
    pub fn refit_adding_replica(&mut self, version: u64, verify: bool, step: RefitStep) -> Result<RefitAndReplica, ClusterError> {
        let replica = self.start_replica()?;
        let members = ActorGroup::from_refs(replica.members.clone());
        let (handle, mut phases) = (self.orchestrator.clone(), self.orchestrator.phases());
        let before = phases.borrow().refit;
        let adding = self.runtime.spawn(async move {
            // Once the refit reached the step, or ended (it may pass the
            // step between two looks at the phases).
            let _ = phases.wait_for(|p| p.refit > before && (p.step == step || p.step == RefitStep::Idle)).await;
            handle.add_replica(members).await
        });
        let refit = self.refit(version, false);
        if self.last_call.is_none() {
            // The orchestrator was never asked (a source could not be
            // stepped): no refit will pass the step.
            adding.abort();
        }
        let added = match self.runtime.block_on(adding) {
            Ok(r) => r.map_err(ClusterError::from),
            Err(e) => Err(setup(format!("adding the replica: {e}"))),
        };
        match &added {
            Ok(_) => {
                let r = self.replicas_mut()?;
                r.live.push(replica);
                r.wanted += 1;
                self.renumber()?;
            }
            Err(_) => self.retire_replica(&replica),
        }
        let refit = match (refit, verify) {
            (Ok(mut o), true) => self.verify(version).map(|n| {
                o.verified = Some(n);
                o
            }),
            (r, _) => r,
        };
        Ok((refit, added))
    }

    /// Replicas started elsewhere (`refit worker --replica NAME`, no
    /// launcher starting workers) whose every rank has joined since: each
    /// is added, seeded from a serving replica. Returns how many.
    pub(super) fn adopt_joined(&mut self) -> Result<usize, ClusterError> {
        let Some(r) = &self.replicas else { return Ok(0) };
        if self.children.is_some() {
            return Ok(0);
        }
        let k = r.one.ranks();
        let joined = self.runtime.block_on(self.rendezvous.joined_replicas(k)).map_err(setup)?;
        let fresh: Vec<String> = joined.into_iter().filter(|n| !r.named.contains(n)).collect();
        let mut added = 0;
        for name in fresh {
            self.replicas_mut()?.named.insert(name.clone());
            let replica = self.join_replica(&name, 0, Vec::new())?;
            self.admit(replica)?;
            added += 1;
        }
        Ok(added)
    }

    /// The replicas `dropped` left the group during a refit (indices as the
    /// orchestrator reports them: removing them one by one, in order,
    /// leaves the group): their workers stop.
    pub(super) fn forget_dropped(&mut self, dropped: &[u32]) -> Result<(), ClusterError> {
        for &i in dropped {
            let r = self.replicas_mut()?;
            if (i as usize) < r.live.len() {
                let gone = r.live.remove(i as usize);
                self.retire_replica(&gone);
            }
        }
        self.renumber()
    }

    /// Replaces the replicas that dead workers `dead` belong to: each
    /// leaves the group (its other workers stop); the group's only replica
    /// is replaced at once by a fresh one, unseeded (the next refit fills
    /// it), where workers are started here.
    pub(super) fn replace_replicas_of(&mut self, dead: &[usize]) -> Result<(), ClusterError> {
        let mut names: Vec<String> = dead.iter().filter_map(|&i| self.hosts[i].replica.as_ref().map(|(n, _)| n.clone())).collect();
        names.dedup();
        for name in names {
            let Some(index) = self.replicas_mut()?.live.iter().position(|r| r.name == name) else { continue };
            if self.replicas_mut()?.live.len() > 1 {
                self.leave(index as u32)?;
                continue;
            }
            if self.children.is_none() {
                return Err(setup(format!("replica {name}, the group's only one, is gone: start it again with `refit worker --replica`")));
            }
            let gone = self.replicas_mut()?.live.remove(0);
            self.retire_replica(&gone);
            let fresh = self.start_replica()?;
            let (src, dst) = (ActorGroup::from_refs(self.members[0].clone()), ActorGroup::from_refs(fresh.members.clone()));
            self.runtime.block_on(self.orchestrator.attach(src, dst))?;
            self.replicas_mut()?.live.push(fresh);
            self.renumber()?;
        }
        Ok(())
    }

    /// Adds fresh replicas (workers started here), each seeded from a
    /// serving one, until the group has the replicas it should: those
    /// dropped from refits or dead are replaced. Returns how many.
    pub(super) fn top_up(&mut self) -> Result<usize, ClusterError> {
        let Some(r) = &self.replicas else { return Ok(0) };
        if self.children.is_none() {
            return Ok(0);
        }
        let missing = (r.wanted as usize).saturating_sub(r.live.len());
        for _ in 0..missing {
            let replica = self.start_replica()?;
            self.admit(replica)?;
        }
        Ok(missing)
    }

    /// Replica `gone` is out of the group for good: its workers stop, and
    /// its names at the rendezvous are forgotten, so that a replica started
    /// again under its name (by a cluster launcher) is taken as new.
    fn retire_replica(&mut self, gone: &Replica) {
        self.retire(&gone.workers);
        let names = (0..gone.members.len() as u32).flat_map(|j| [replica_member_name(&gone.name, j), replica_pattern_name(&gone.name, j)]);
        for name in names {
            // Fails only when the rendezvous's own registry is gone, and
            // then every later call says so.
            let _ = self.runtime.block_on(self.rendezvous.forget(&name));
        }
        if let Some(r) = &mut self.replicas {
            r.named.remove(&gone.name);
        }
    }

    /// Stops workers `workers` for good.
    fn retire(&mut self, workers: &[usize]) {
        for &w in workers {
            if let Some(children) = &mut self.children {
                children.stop(w);
            }
            if let Some(h) = self.hosts.get_mut(w) {
                h.retired = true;
                h.ranks.clear();
            }
        }
    }

    /// Brings the destination members, pattern actors, hosts' ranks and
    /// layout in line with the replicas' order.
    pub(super) fn renumber(&mut self) -> Result<(), ClusterError> {
        let Some(r) = &self.replicas else { return Ok(()) };
        let k = r.one.ranks();
        let dst = r.layout()?;
        let at = |i: usize, j: u32| Endpoint { group: Group::Dst, rank: i as u32 * k + j };
        self.members[1] = r.live.iter().flat_map(|x| x.members.iter().cloned()).collect();
        self.patterns.retain(|(e, _)| e.group == Group::Src);
        for (i, x) in r.live.iter().enumerate() {
            self.patterns.extend(x.patterns.iter().enumerate().map(|(j, p)| (at(i, j as u32), p.clone())));
        }
        for h in &mut self.hosts {
            if let Some((name, locals)) = &h.replica {
                if let Some(i) = r.live.iter().position(|x| &x.name == name) {
                    h.ranks = locals.iter().map(|&j| at(i, j)).collect();
                }
            }
        }
        self.dst = dst;
        Ok(())
    }
}
