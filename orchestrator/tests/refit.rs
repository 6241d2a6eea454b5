//! Orchestrator behaviour: refits deliver exactly the sources' version, plans
//! are cached and replanned on layout change, fingerprints are checked, the
//! version fence and atomic commit hold under concurrency, and a failed refit
//! leaves every sink on its last committed version.

use orchestrator::{
    spawn_refit, Fabric, MemberMsg, MemberReply, NodeFabric, OrchestratorConfig, OrchestratorError, RefitError, RefitSystem, Refusal,
};
use reshard::{parse_layout, Fingerprint, Layout, Strategy};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Training: two tensors, TP2 (one fused "params" buffer per rank), f32.
const SRC: &str = r#"{"ranks": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [8, 6], "shards": [
    {"rank": 0, "offset": [0, 0], "extent": [4, 6], "buffer": "params", "at": 0},
    {"rank": 1, "offset": [4, 0], "extent": [4, 6], "buffer": "params", "at": 0}]},
  {"name": "b", "dtype": "f32", "shape": [8], "shards": [
    {"rank": 0, "offset": [0], "extent": [4], "buffer": "params", "at": 24},
    {"rank": 1, "offset": [4], "extent": [4], "buffer": "params", "at": 24}]}]}"#;

/// Inference: TP2 column-wise x DP2 on 4 ranks, bf16.
const DST: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "bf16", "shape": [8, 6], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(1)"]},
  {"name": "b", "dtype": "bf16", "shape": [8], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]}]}"#;

fn layouts() -> (Layout, Layout) {
    (parse_layout(SRC).unwrap(), parse_layout(DST).unwrap())
}

fn config(mode: Strategy) -> OrchestratorConfig {
    OrchestratorConfig { mode, deadline: Duration::from_secs(10), control_timeout: Duration::from_secs(5), ..OrchestratorConfig::default() }
}

/// One optimizer step that sets every weight to `value`.
async fn step(sys: &RefitSystem, value: f32) -> u64 {
    let mut version = 0;
    for s in &sys.sources {
        version = s.update(|b| assert!(b.write_f32("params", &[value; 28]))).await.0;
    }
    version
}

/// Every weight of every sink's committed snapshot, with its version.
fn served(sys: &RefitSystem) -> Vec<(u64, Vec<f32>)> {
    sys.sinks
        .iter()
        .map(|s| {
            let snap = s.snapshot();
            let mut all = Vec::new();
            for spec in snap.buffers.specs() {
                all.extend(snap.buffers.read_f32(&spec.name).unwrap());
            }
            (snap.version, all)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refit_delivers_every_version_and_plans_once() {
    let (src, dst) = layouts();
    let sys = spawn_refit(&src, &dst, config(Strategy::Reshard));
    for k in 1..=3u64 {
        let v = step(&sys, k as f32 * 1.5).await;
        let report = sys.orchestrator.refit(v).await.unwrap();
        assert_eq!(report.version, v);
        assert_eq!(report.replanned, k == 1);
        assert!(report.bytes > 0);
        for (version, values) in served(&sys) {
            assert_eq!(version, v);
            assert!(values.iter().all(|&x| x == k as f32 * 1.5), "{values:?}");
        }
    }
    assert_eq!(sys.orchestrator.plans_made().await.unwrap(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mode_switch_replans_and_delivers_the_same_bytes() {
    let (src, dst) = layouts();
    let sys = spawn_refit(&src, &dst, config(Strategy::Reshard));
    let v = step(&sys, 3.0).await;
    let a = sys.orchestrator.refit(v).await.unwrap();
    sys.orchestrator.set_mode(Strategy::Baseline).await.unwrap();
    let v = step(&sys, 4.0).await;
    let b = sys.orchestrator.refit(v).await.unwrap();
    assert!(b.replanned && b.mode == Strategy::Baseline && b.fingerprint != a.fingerprint);
    assert!(b.bytes > a.bytes, "baseline {} bytes, reshard {}", b.bytes, a.bytes);
    assert!(served(&sys).iter().all(|(ver, vals)| *ver == v && vals.iter().all(|&x| x == 4.0)));
    assert_eq!(sys.orchestrator.plans_made().await.unwrap(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn layout_change_replans() {
    let (src, dst) = layouts();
    let sys = spawn_refit(&src, &dst, config(Strategy::Reshard));
    let v = step(&sys, 1.0).await;
    sys.orchestrator.refit(v).await.unwrap();
    // The inference group is resized: 2 ranks, TP2.
    let dst2 = parse_layout(&DST.replace(r#""ranks": 4"#, r#""ranks": 2"#).replace(r#""shape": [2, 2]"#, r#""shape": [1, 2]"#)).unwrap();
    let sys2 = spawn_refit(&src, &dst2, config(Strategy::Reshard));
    sys.orchestrator.attach(sys.source_members.clone(), sys2.sink_members.clone()).await.unwrap();
    let v = step(&sys, 2.0).await;
    let report = sys.orchestrator.refit(v).await.unwrap();
    assert!(report.replanned);
    assert_eq!(sys.orchestrator.plans_made().await.unwrap(), 2);
    for s in &sys2.sinks {
        let snap = s.snapshot();
        assert_eq!(snap.version, v);
        assert!(snap.buffers.read_f32("w#0").unwrap().iter().all(|&x| x == 2.0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wrong_fingerprint_is_refused() {
    let (src, dst) = layouts();
    let sys = spawn_refit(&src, &dst, config(Strategy::Reshard));
    let v = step(&sys, 1.0).await;
    let report = sys.orchestrator.refit(v).await.unwrap();
    let bogus = Fingerprint(report.fingerprint.0 ^ 1);
    let member = &sys.source_members;
    // A step of a refit that was never prepared here.
    let reply = member.call_rank(0, MemberMsg::Run { refit: 77, version: v, fingerprint: bogus, deadline: SECOND }).await.unwrap();
    assert_eq!(reply, MemberReply::Refused(Refusal::NotPrepared { refit: 77 }));
    let mismatch = MemberReply::Refused(Refusal::FingerprintMismatch { installed: Some(report.fingerprint), asked: bogus });
    // A plan that is not installed cannot be prepared...
    let prepare =
        |fingerprint| MemberMsg::Prepare { refit: 78, fingerprint, session: "t".into(), fabric: Fabric::Node(NodeFabric::default()) };
    assert_eq!(member.call_rank(0, prepare(bogus)).await.unwrap(), mismatch);
    // ...nor run under another plan than the one prepared (node fabric: a
    // loopback listener).
    assert!(matches!(member.call_rank(0, prepare(report.fingerprint)).await.unwrap(), MemberReply::Prepared { .. }));
    let reply = member.call_rank(0, MemberMsg::Run { refit: 78, version: v, fingerprint: bogus, deadline: SECOND }).await.unwrap();
    assert_eq!(reply, mismatch);
    // The next refit is not disturbed.
    let v = step(&sys, 2.0).await;
    sys.orchestrator.refit(v).await.unwrap();
    assert!(served(&sys).iter().all(|(ver, vals)| *ver == v && vals.iter().all(|&x| x == 2.0)));
}

const SECOND: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_that_disagree_on_their_layout_are_rejected() {
    let (src, dst) = layouts();
    let sys = spawn_refit(&src, &dst, config(Strategy::Reshard));
    // A sink group whose rank 1 was built from another layout.
    let other = parse_layout(&DST.replace(r#""dtype": "bf16""#, r#""dtype": "f32""#)).unwrap();
    let mixed = spawn_refit(&src, &other, config(Strategy::Reshard));
    let sinks = actors::spawn_group(4, actors::SpawnConfig::default(), |r| {
        let (layout, store) = if r == 1 { (&other, mixed.sinks[1].clone()) } else { (&dst, sys.sinks[r].clone()) };
        orchestrator::Member::new(std::sync::Arc::new(layout.clone()), r as u32, orchestrator::Role::Sink(store))
    });
    sys.orchestrator.attach(sys.source_members.clone(), sinks).await.unwrap();
    let v = step(&sys, 1.0).await;
    match sys.orchestrator.refit(v).await {
        Err(RefitError::Refit(OrchestratorError::Layout { group: "sink", problem })) => assert!(problem.contains("rank 1"), "{problem}"),
        other => panic!("expected a layout error, got {other:?}"),
    }
}

/// A member replaced by a new one (a restarted process) gets the plan
/// installed on the next refit, and the group serves the new version; the
/// others keep theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replaced_member_gets_its_program_and_the_refit_goes_on() {
    let (src, dst) = layouts();
    let sys = spawn_refit(&src, &dst, config(Strategy::Reshard));
    let v = step(&sys, 1.0).await;
    let first = sys.orchestrator.refit(v).await.unwrap();
    // Rank 2's member is replaced by a new one with nothing installed (as
    // fresh as a restarted process); the others are the same actors.
    let fresh = actors::spawn(
        orchestrator::Member::new(std::sync::Arc::new(dst.clone()), 2, orchestrator::Role::Sink(sys.sinks[2].clone())),
        actors::SpawnConfig::default(),
    );
    let refs: Vec<_> = (0..4).map(|r| if r == 2 { fresh.clone() } else { sys.sink_members.get(r).unwrap().clone() }).collect();
    let sinks = actors::ActorGroup::from_refs(refs);
    sys.orchestrator.attach(sys.source_members.clone(), sinks).await.unwrap();
    let v = step(&sys, 2.0).await;
    let report = sys.orchestrator.refit(v).await.unwrap();
    // Planned again to build the newcomer's program; the same plan.
    assert!(report.replanned);
    assert_eq!(report.fingerprint, first.fingerprint);
    assert!(served(&sys).iter().all(|(ver, vals)| *ver == v && vals.iter().all(|&x| x == 2.0)));
    // Everyone has it now: the next refit plans nothing.
    let v = step(&sys, 3.0).await;
    assert!(!sys.orchestrator.refit(v).await.unwrap().replanned);
    assert_eq!(sys.orchestrator.plans_made().await.unwrap(), 2);
}

/// A refit never reads half an optimizer step: the step holds the fence
/// while it writes, so the refit waits and then sees all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refit_never_reads_a_half_written_step() {
    let (src, dst) = layouts();
    let sys = Arc::new(spawn_refit(&src, &dst, config(Strategy::Reshard)));
    let v = step(&sys, 1.0).await;
    sys.orchestrator.refit(v).await.unwrap();
    // A slow step to version 2: half the weights, a pause, the other half.
    let slow = {
        let sys = sys.clone();
        tokio::spawn(async move {
            let mut version = 0;
            for s in &sys.sources {
                version = s
                    .update(|b| {
                        let mut p = b.read_f32("params").unwrap();
                        p[..14].fill(2.0);
                        assert!(b.write_f32("params", &p));
                        std::thread::sleep(Duration::from_millis(150));
                        p[14..].fill(2.0);
                        assert!(b.write_f32("params", &p));
                    })
                    .await
                    .0;
            }
            version
        })
    };
    tokio::time::sleep(Duration::from_millis(40)).await;
    // Refitting the old version now must not read the torn buffer: it waits
    // for the step, then finds the source at another version and fails.
    let early = sys.orchestrator.refit(v).await;
    assert!(matches!(early, Err(RefitError::Refit(OrchestratorError::VersionMismatch { held: 2, asked: 1, .. }))), "{early:?}");
    assert!(served(&sys).iter().all(|(ver, vals)| *ver == v && vals.iter().all(|&x| x == 1.0)));
    let v2 = slow.await.unwrap();
    sys.orchestrator.refit(v2).await.unwrap();
    assert!(served(&sys).iter().all(|(ver, vals)| *ver == v2 && vals.iter().all(|&x| x == 2.0)));
}

/// Readers never see a mix of two versions, however refits interleave.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readers_never_see_two_versions_at_once() {
    let (src, dst) = layouts();
    let sys = Arc::new(spawn_refit(&src, &dst, config(Strategy::Reshard)));
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (sys, stop) = (sys.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut seen = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for (version, values) in served(&sys) {
                        let want = if version == 0 { 0.0 } else { version as f32 };
                        assert!(values.iter().all(|&x| x == want), "version {version} holds {values:?}");
                        seen += 1;
                    }
                }
                seen
            })
        })
        .collect();
    for _ in 0..20 {
        let next = sys.sources[0].version() + 1;
        let v = step(&sys, next as f32).await;
        assert_eq!(v, next);
        sys.orchestrator.refit(v).await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        assert!(r.join().unwrap() > 0);
    }
}

/// A refit with a dead member fails, and every sink keeps serving the last
/// committed version.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_refit_leaves_sinks_on_their_last_version() {
    let (src, dst) = layouts();
    let mut sys = spawn_refit(&src, &dst, config(Strategy::Reshard));
    let v = step(&sys, 5.0).await;
    sys.orchestrator.refit(v).await.unwrap();
    sys.sink_members.get(2).unwrap().stop();
    let dead = sys.events.recv().await.unwrap();
    assert_eq!(dead.rank, Some(2));
    let v2 = step(&sys, 6.0).await;
    match sys.orchestrator.refit(v2).await {
        Err(RefitError::Refit(OrchestratorError::MemberDied { member, .. })) => assert!(member.contains("[2]"), "{member}"),
        other => panic!("expected MemberDied, got {other:?}"),
    }
    for (i, (version, values)) in served(&sys).into_iter().enumerate() {
        assert_eq!(version, v, "sink {i}");
        assert!(values.iter().all(|&x| x == 5.0), "sink {i}: {values:?}");
    }
}

/// An orchestrator over an empty group refuses to refit (no panic).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_group_is_a_layout_error() {
    let (src, dst) = layouts();
    let sys = spawn_refit(&src, &dst, config(Strategy::Reshard));
    let empty = actors::ActorGroup::from_refs(Vec::new());
    let o = orchestrator::spawn_orchestrator(sys.source_members.clone(), empty, config(Strategy::Reshard));
    match o.refit(0).await {
        Err(RefitError::Refit(OrchestratorError::Layout { group: "sink", problem })) => {
            assert!(problem.contains("no members"), "{problem}")
        }
        other => panic!("expected a layout error, got {other:?}"),
    }
}
