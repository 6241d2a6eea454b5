//! A refit that loses training ranks: data-parallel replicas of what they
//! held send it instead and the same version commits, bit-exact; where
//! nobody else holds it, the refit fails and every destination keeps its
//! version.

use orchestrator::{spawn_refit, OrchestratorConfig, OrchestratorError, RefitError, RefitStep, SourceLoss};
use reshard::{parse_layout, Endpoint};
use std::time::Duration;

mod values;
use values::{reached, serves, step};

/// Training DP2 x TP2: ranks 0-1 one replica, 2-3 the other.
const SRC: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [8, 6], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"], "buffer": "params", "at": 0},
  {"name": "b", "dtype": "f32", "shape": [6], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "replicate"], "buffer": "params", "at": 24},
  {"name": "f", "dtype": "f32", "shape": [10], "shards": [
    {"rank": 0, "flat": [0, 6]}, {"rank": 1, "flat": [6, 4]}, {"rank": 2, "flat": [0, 6]}, {"rank": 3, "flat": [6, 4]}]}]}"#;

/// Inference TP2 by columns on another node.
const DST: &str = r#"{"ranks": 2, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [8, 6], "mesh": {"shape": [2]}, "placements": ["shard(1)"]},
  {"name": "b", "dtype": "f32", "shape": [6], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
  {"name": "f", "dtype": "f32", "shape": [10], "shards": [{"rank": 0, "flat": [0, 3]}, {"rank": 1, "flat": [3, 7]}]}]}"#;

/// A receiver in this process waits for a stopped sender until the
/// deadline (a dead process's connections would close at once): short.
fn config() -> OrchestratorConfig {
    OrchestratorConfig { deadline: Duration::from_secs(2), control_timeout: Duration::from_secs(5), ..OrchestratorConfig::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sources_lost_between_refits_are_planned_around_until_nobody_holds_a_part() {
    let (src, dst) = (parse_layout(SRC).unwrap(), parse_layout(DST).unwrap());
    let mut sys = spawn_refit(&src, &dst, config()).await.unwrap();
    step(&sys, 1).await;
    assert!(sys.orchestrator.refit(1).await.unwrap().lost_sources.is_empty());
    sys.src_members.get(1).unwrap().stop();
    step(&sys, 2).await;
    let report = sys.orchestrator.refit(2).await.unwrap();
    assert_eq!(report.lost_sources, vec![1]);
    for s in &sys.dst_stores {
        serves(s, 2).unwrap();
    }
    // One more from the other replica: ranks 2 and 3 hold everything.
    sys.src_members.get(0).unwrap().stop();
    step(&sys, 3).await;
    assert_eq!(sys.orchestrator.refit(3).await.unwrap().lost_sources, vec![0, 1]);
    for s in &sys.dst_stores {
        serves(s, 3).unwrap();
    }
    // Rank 2 too: rows 0-3 of w are held by nobody left. The refit fails
    // for the member it lost, and again at the next try.
    sys.src_members.get(2).unwrap().stop();
    step(&sys, 4).await;
    for _ in 0..2 {
        match sys.orchestrator.refit(4).await {
            Err(RefitError::Refit(OrchestratorError::MemberDied { member, .. })) => assert_eq!(member, "src[2]"),
            other => panic!("expected src[2]'s death, got {other:?}"),
        }
    }
    for s in &sys.dst_stores {
        serves(s, 3).unwrap();
    }
    // Replaced ranks take part again.
    for r in [0, 1, 2] {
        sys.replace_member(Endpoint::src(r)).await.unwrap();
    }
    step(&sys, 5).await;
    assert!(sys.orchestrator.refit(5).await.unwrap().lost_sources.is_empty());
    for s in &sys.dst_stores {
        serves(s, 5).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_source_lost_mid_refit_is_planned_around_and_the_version_commits() {
    let (src, dst) = (parse_layout(SRC).unwrap(), parse_layout(DST).unwrap());
    for (round, victim) in [3u32, 0, 2, 1].into_iter().enumerate() {
        let sys = spawn_refit(&src, &dst, config()).await.unwrap();
        step(&sys, 1).await;
        sys.orchestrator.refit(1).await.unwrap();
        step(&sys, 2).await;
        let mut phases = sys.orchestrator.phases();
        let before = phases.borrow().refit;
        let orch = sys.orchestrator.clone();
        let refit = tokio::spawn(async move { orch.refit(2).await });
        reached(&mut phases, before, RefitStep::Running).await;
        sys.src_members.get(victim as usize).unwrap().stop();
        let report = refit.await.unwrap().unwrap_or_else(|e| panic!("round {round}: {e}"));
        // Lost during the run (planned around), or after it finished (the
        // refit did not need it; the next one leaves it out).
        assert!(report.lost_sources == vec![victim] || report.lost_sources.is_empty(), "{report:?}");
        for s in &sys.dst_stores {
            serves(s, 2).unwrap();
        }
        step(&sys, 3).await;
        assert_eq!(sys.orchestrator.refit(3).await.unwrap().lost_sources, vec![victim]);
        for s in &sys.dst_stores {
            serves(s, 3).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_source_loss_fail_a_lost_source_fails_the_refit() {
    let (src, dst) = (parse_layout(SRC).unwrap(), parse_layout(DST).unwrap());
    let sys = spawn_refit(&src, &dst, OrchestratorConfig { source_loss: SourceLoss::Fail, ..config() }).await.unwrap();
    step(&sys, 1).await;
    sys.orchestrator.refit(1).await.unwrap();
    sys.src_members.get(1).unwrap().stop();
    step(&sys, 2).await;
    assert!(matches!(sys.orchestrator.refit(2).await, Err(RefitError::Refit(OrchestratorError::MemberDied { .. }))));
    for s in &sys.dst_stores {
        serves(s, 1).unwrap();
    }
}
