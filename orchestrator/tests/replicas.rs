//! Elastic destination groups: replicas of one inference layout added
//! while refits go on (seeded from a serving replica, no source rank
//! involved) and removed; every served value checked after every change.

use actors::{spawn_group, ActorGroup, SpawnConfig};
use orchestrator::{spawn_refit, DstStore, Member, OrchestratorConfig, OrchestratorError, RefitError, ReplicaPlan, Role, SeedReport};
use reshard::{parse_layout, Layout};
use std::sync::Arc;
use std::time::Duration;

/// Training: TP2, a fused buffer, and a tensor in explicit flat shards.
const SRC: &str = r#"{"ranks": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [8, 6], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "buffer": "params", "at": 0},
  {"name": "b", "dtype": "f32", "shape": [6], "mesh": {"shape": [2]}, "placements": ["replicate"], "buffer": "params", "at": 24},
  {"name": "f", "dtype": "f32", "shape": [10], "shards": [{"rank": 0, "flat": [0, 6]}, {"rank": 1, "flat": [6, 4]}]}]}"#;

/// One inference replica: TP2 the other way, explicit shards cut
/// elsewhere (their own buffers are named by shard index, which differs
/// from replica to replica in the group's layout).
const REPLICA: &str = r#"{"ranks": 2, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [8, 6], "mesh": {"shape": [2]}, "placements": ["shard(1)"]},
  {"name": "b", "dtype": "f32", "shape": [6], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
  {"name": "f", "dtype": "f32", "shape": [10], "shards": [{"rank": 0, "flat": [0, 3]}, {"rank": 1, "flat": [3, 7]}]}]}"#;

mod values;
use values::{reached, serves, step};

fn config(one: &Layout) -> OrchestratorConfig {
    OrchestratorConfig {
        deadline: Duration::from_secs(10),
        control_timeout: Duration::from_secs(5),
        replica: Some(Arc::new(one.clone())),
        ..OrchestratorConfig::default()
    }
}

/// A replica's stores and members (rank `j` of the replica's layout).
fn replica(one: &Arc<Layout>) -> (Vec<Arc<DstStore>>, ActorGroup<Member>) {
    let stores: Vec<Arc<DstStore>> = (0..one.ranks()).map(|j| Arc::new(DstStore::new(one, j))).collect();
    let members = spawn_group(stores.len(), SpawnConfig::default().name("joining"), |j| {
        Member::new(one.clone(), j as u32, Role::Dst(stores[j].clone()))
    });
    (stores, members)
}

fn seeded(r: &orchestrator::ReplicaReport) -> &SeedReport {
    r.seeded.as_ref().expect("the new replica was seeded")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_join_seeded_from_a_serving_one_and_leave_between_refits() {
    let src = parse_layout(SRC).unwrap();
    let one = Arc::new(parse_layout(REPLICA).unwrap());
    let sys = spawn_refit(&src, &one.replicated(2).unwrap(), config(&one)).await.unwrap();
    let orch = &sys.orchestrator;

    step(&sys, 1).await;
    orch.refit(1).await.unwrap();
    let mut serving: Vec<Arc<DstStore>> = sys.dst_stores.clone();
    for s in &serving {
        serves(s, 1).unwrap();
    }

    // A third replica joins: it serves version 1 at once, moved from a
    // serving replica's memory by a plan whose sources are that
    // replica's two ranks.
    let (third, members) = replica(&one);
    let added = orch.add_replica(members).await.unwrap();
    assert_eq!(added.replicas, 3);
    let seed = seeded(&added);
    assert_eq!(seed.version, 1);
    assert!(seed.from_replica < 2);
    // Every element of the replica, once, f32 to f32 (7 * 8 + ... = 64).
    let elements: u64 = 8 * 6 + 6 + 10;
    assert_eq!(seed.figures.total_bytes, elements * 4);
    assert_eq!(seed.bytes, elements * 4);
    for s in &third {
        serves(s, 1).unwrap();
    }
    // The sources were not asked: they still hold only version 1, and
    // a step to 2 and a refit deliver 2 to all three replicas.
    serving.extend(third.iter().cloned());
    step(&sys, 2).await;
    let r = orch.refit(2).await.unwrap();
    assert!(r.replanned, "three replicas are a new layout");
    for (i, s) in serving.iter().enumerate() {
        serves(s, 2).map_err(|e| format!("store {i}: {e}")).unwrap();
    }

    // Replica 1 leaves: the others take version 3, it keeps 2.
    let removed = orch.remove_replica(1).await.unwrap();
    assert_eq!((removed.replicas, removed.seeded.is_none()), (2, true));
    let left: Vec<Arc<DstStore>> = serving.drain(2..4).collect();
    step(&sys, 3).await;
    orch.refit(3).await.unwrap();
    for (i, s) in serving.iter().enumerate() {
        serves(s, 3).map_err(|e| format!("store {i}: {e}")).unwrap();
    }
    for s in &left {
        serves(s, 2).unwrap();
    }

    // Another joins, seeded with 3 by one of the two; then version 4
    // everywhere.
    let (fourth, members) = replica(&one);
    let added = orch.add_replica(members).await.unwrap();
    assert_eq!((added.replicas, seeded(&added).version), (3, 3));
    serving.extend(fourth.iter().cloned());
    for s in &serving {
        serves(s, 3).unwrap();
    }
    step(&sys, 4).await;
    orch.refit(4).await.unwrap();
    for (i, s) in serving.iter().enumerate() {
        serves(s, 4).map_err(|e| format!("store {i}: {e}")).unwrap();
    }
}

/// Refits versions 1 to 3 of a group of two replicas, removing one after
/// the first and adding one after the second: each refit's bytes moved,
/// and the plans made after each.
async fn plans_through_replica_changes(replica_plan: ReplicaPlan) -> (Vec<u64>, Vec<u64>) {
    let src = parse_layout(SRC).unwrap();
    let one = Arc::new(parse_layout(REPLICA).unwrap());
    let config = OrchestratorConfig { replica_plan, ..config(&one) };
    let sys = spawn_refit(&src, &one.replicated(2).unwrap(), config).await.unwrap();
    let orch = &sys.orchestrator;
    let (mut bytes, mut plans) = (Vec::new(), Vec::new());
    let (third, members) = replica(&one);
    for v in 1..=3u64 {
        step(&sys, v).await;
        let r = orch.refit(v).await.unwrap();
        // (The group of the first was planned when it was attached.)
        assert!(v == 1 || r.replanned, "{replica_plan:?}: refit {v} is of a group that changed");
        bytes.push(r.bytes);
        plans.push(orch.plans_made().await.unwrap());
        match v {
            1 => {
                orch.remove_replica(1).await.unwrap();
            }
            2 => {
                orch.add_replica(members.clone()).await.unwrap();
            }
            _ => {}
        }
    }
    for s in sys.dst_stores[..2].iter().chain(&third) {
        serves(s, 3).unwrap();
    }
    (bytes, plans)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_group_of_replicas_plans_one_replica_once_and_derives_the_rest() {
    let (bytes, plans) = plans_through_replica_changes(ReplicaPlan::Derived).await;
    // One replica's plan, made for the first refit, serves the group of
    // one and of two again; the seeding plan of the replica that joined
    // is the only other plan made.
    assert_eq!(plans, [1, 1, 2]);
    // Each replica gets one replica's bytes.
    assert_eq!(bytes, [2 * bytes[1], bytes[1], 2 * bytes[1]]);
    // Planned whole, each group is planned anew.
    let (whole, plans) = plans_through_replica_changes(ReplicaPlan::Whole).await;
    assert_eq!(plans, [1, 2, 4]);
    assert_eq!(whole[1], bytes[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_joining_before_any_refit_is_filled_by_the_next() {
    let src = parse_layout(SRC).unwrap();
    let one = Arc::new(parse_layout(REPLICA).unwrap());
    let sys = spawn_refit(&src, &one, config(&one)).await.unwrap();
    let (second, members) = replica(&one);
    let added = sys.orchestrator.add_replica(members).await.unwrap();
    assert_eq!((added.replicas, added.seeded), (2, None));
    step(&sys, 1).await;
    sys.orchestrator.refit(1).await.unwrap();
    for s in sys.dst_stores.iter().chain(&second) {
        serves(s, 1).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wrong_replica_requests_are_errors_that_change_nothing() {
    let src = parse_layout(SRC).unwrap();
    let one = Arc::new(parse_layout(REPLICA).unwrap());
    let sys = spawn_refit(&src, &one.replicated(2).unwrap(), config(&one)).await.unwrap();
    let orch = &sys.orchestrator;
    let replicas_error = |r: Result<orchestrator::ReplicaReport, RefitError>| match r {
        Err(RefitError::Refit(OrchestratorError::Replicas { problem })) => problem,
        other => panic!("expected a replicas error, got {other:?}"),
    };
    assert!(replicas_error(orch.remove_replica(2).await).contains("no replica 2"));
    // Members of another layout (the training one) cannot join.
    let stores: Vec<Arc<DstStore>> = (0..2).map(|j| Arc::new(DstStore::new(&Arc::new(src.clone()), j))).collect();
    let strangers = spawn_group(2, SpawnConfig::default(), |j| Member::new(Arc::new(src.clone()), j as u32, Role::Dst(stores[j].clone())));
    assert!(replicas_error(orch.add_replica(strangers).await).contains("other than the replica's"));
    // A group of one replica keeps it.
    orch.remove_replica(1).await.unwrap();
    assert!(replicas_error(orch.remove_replica(0).await).contains("last one"));
    step(&sys, 1).await;
    orch.refit(1).await.unwrap();
    serves(&sys.dst_stores[0], 1).unwrap();
    serves(&sys.dst_stores[1], 1).unwrap();
}

/// Which version each replica's stores serve (two stores a replica; both
/// must serve one version, whole).
fn served_by_replica(stores: &[Arc<DstStore>], versions: &[u64]) -> Vec<u64> {
    stores
        .chunks(2)
        .enumerate()
        .map(|(r, pair)| {
            let v = versions.iter().copied().find(|&v| pair.iter().all(|s| serves(s, v).is_ok())).unwrap_or_else(|| {
                panic!("replica {r} serves none of {versions:?} whole: {:?}", pair.iter().map(|s| s.version()).collect::<Vec<_>>())
            });
            v
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_lost_between_refits_leaves_and_the_others_take_the_version() {
    let src = parse_layout(SRC).unwrap();
    let one = Arc::new(parse_layout(REPLICA).unwrap());
    let sys = spawn_refit(&src, &one.replicated(3).unwrap(), config(&one)).await.unwrap();
    step(&sys, 1).await;
    sys.orchestrator.refit(1).await.unwrap();
    sys.dst_members.get(3).unwrap().stop();
    step(&sys, 2).await;
    let report = sys.orchestrator.refit(2).await.unwrap();
    assert_eq!(report.dropped_replicas, vec![1]);
    assert_eq!(served_by_replica(&sys.dst_stores, &[1, 2]), vec![2, 1, 2]);
    // The group is two replicas now: the next refit reaches both.
    step(&sys, 3).await;
    let report = sys.orchestrator.refit(3).await.unwrap();
    assert!(report.dropped_replicas.is_empty());
    assert_eq!(served_by_replica(&sys.dst_stores, &[1, 2, 3]), vec![3, 1, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_replica_loss_fail_a_lost_replica_fails_the_refit_and_nothing_changes() {
    let src = parse_layout(SRC).unwrap();
    let one = Arc::new(parse_layout(REPLICA).unwrap());
    let config = OrchestratorConfig { replica_loss: orchestrator::ReplicaLoss::Fail, ..config(&one) };
    let sys = spawn_refit(&src, &one.replicated(2).unwrap(), config).await.unwrap();
    step(&sys, 1).await;
    sys.orchestrator.refit(1).await.unwrap();
    sys.dst_members.get(2).unwrap().stop();
    step(&sys, 2).await;
    assert!(matches!(sys.orchestrator.refit(2).await, Err(RefitError::Refit(OrchestratorError::MemberDied { .. }))));
    assert_eq!(served_by_replica(&sys.dst_stores, &[1, 2]), vec![1, 1]);
}

/// A member of one replica stops while the refit runs: each replica ends
/// on the new version whole or keeps the old one, the refit reports the
/// replicas that left, and the next refit reaches every one still in.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_lost_mid_refit_never_leaves_a_torn_or_mixed_replica() {
    let src = parse_layout(SRC).unwrap();
    let one = Arc::new(parse_layout(REPLICA).unwrap());
    let sys = spawn_refit(&src, &one.replicated(3).unwrap(), config(&one)).await.unwrap();
    step(&sys, 1).await;
    sys.orchestrator.refit(1).await.unwrap();
    // Refits until one is seen running when the member stops (a refit
    // may finish between two looks at its phases).
    let mut version = 1;
    let report = loop {
        version += 1;
        assert!(version < 8, "no refit was seen running");
        step(&sys, version).await;
        let mut phases = sys.orchestrator.phases();
        let before = phases.borrow().refit;
        let orch = sys.orchestrator.clone();
        let refit = tokio::spawn(async move { orch.refit(version).await });
        if reached(&mut phases, before, orchestrator::RefitStep::Running).await {
            sys.dst_members.get(2).unwrap().stop();
            break refit.await.unwrap().unwrap();
        }
        refit.await.unwrap().unwrap();
    };
    let (old, new) = (version - 1, version);
    assert!(!report.dropped_replicas.is_empty(), "{report:?}");
    // Replica 1 left: its live member serves one version whole (it may
    // have committed the new one if its peer stopped after running,
    // before the commit); every other replica serves one version whole.
    for (i, s) in sys.dst_stores.iter().enumerate().filter(|(i, _)| *i != 2) {
        assert!(serves(s, old).is_ok() || serves(s, new).is_ok(), "store {i}: {:?}", s.version());
    }
    let others = [&sys.dst_stores[0..2], &sys.dst_stores[4..6]].concat();
    let served = served_by_replica(&others, &[old, new]);
    let staying = served.iter().filter(|&&v| v == new).count();
    assert!(staying >= 1, "{served:?}");
    step(&sys, new + 1).await;
    sys.orchestrator.refit(new + 1).await.unwrap();
    let after = served_by_replica(&others, &[old, new, new + 1]);
    assert_eq!(after.iter().filter(|&&v| v == new + 1).count(), staying, "{after:?}");
}
