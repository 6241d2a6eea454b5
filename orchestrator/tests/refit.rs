//! Orchestrator behaviour: refits deliver exactly the sources' version, plans
//! are cached and replanned on layout change, fingerprints are checked, the
//! version fence and atomic commit hold under concurrency, a failed refit
//! leaves every destination on its last committed version, and mistakes
//! (a pair that cannot be planned, unwritten or torn sources, a version
//! already served, a dead member) are met with typed errors or no-ops.

use orchestrator::{
    spawn_refit, Fabric, HeldVersion, MemberMsg, MemberReply, NodeFabric, OrchestratorConfig, OrchestratorError, RefitError, RefitSystem,
    RefitTarget, Refusal, TensorSubset,
};
use reshard::{parse_layout, Endpoint, Fingerprint, Group, Layout, PlanError, Strategy};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

mod common;
use common::{layouts, DST};

fn config(mode: Strategy) -> OrchestratorConfig {
    OrchestratorConfig { mode, deadline: Duration::from_secs(10), control_timeout: Duration::from_secs(5), ..OrchestratorConfig::default() }
}

async fn system(mode: Strategy) -> RefitSystem {
    let (src, dst) = layouts();
    spawn_refit(&src, &dst, config(mode)).await.unwrap()
}

/// One optimizer step that sets every weight to `value`.
async fn step(sys: &RefitSystem, value: f32) -> u64 {
    let mut version = 0;
    for s in &sys.src_stores {
        version = s.try_update(|b| b.write_buffer_f32("params", &[value; 28])).await.unwrap().0;
    }
    version
}

/// Every weight of every destination's committed snapshot, with its
/// version (0 and no weights before the first commit).
fn served(sys: &RefitSystem) -> Vec<(u64, Vec<f32>)> {
    sys.dst_stores
        .iter()
        .map(|s| {
            let Some(snap) = s.snapshot() else { return (0, Vec::new()) };
            let mut all = Vec::new();
            for name in ["w", "b"] {
                all.extend(snap.buffers.tensor(name).unwrap().to_f32().unwrap());
            }
            (snap.version, all)
        })
        .collect()
}

fn serves(sys: &RefitSystem, version: u64, value: f32) -> bool {
    served(sys).iter().all(|(v, vals)| *v == version && !vals.is_empty() && vals.iter().all(|&x| x == value))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refit_delivers_every_version_and_plans_once() {
    let sys = system(Strategy::Reshard).await;
    for k in 1..=3u64 {
        let v = step(&sys, k as f32 * 1.5).await;
        let report = sys.orchestrator.refit(v).await.unwrap();
        assert_eq!(report.version, v);
        // Planned when the system was made.
        assert!(!report.replanned && !report.already_served);
        // The bytes the members sent are the bytes the plan moves.
        let plan = sys.orchestrator.plan().await.unwrap();
        assert!(!plan.replanned && report.bytes > 0);
        assert_eq!((report.bytes, report.fingerprint), (plan.bytes, Some(plan.fingerprint)));
        for (version, values) in served(&sys) {
            assert_eq!(version, v);
            assert!(values.iter().all(|&x| x == k as f32 * 1.5), "{values:?}");
        }
    }
    assert_eq!(sys.orchestrator.plans_made().await.unwrap(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scratch_kept_between_refits_never_leaks_an_older_version() {
    // The baseline gathers onto a source rank and relays through every
    // destination: both go through scratch buffers, which members keep
    // from one clean run of a plan to the next. Each refit must deliver
    // its own values, none of the last one's.
    let sys = system(Strategy::Baseline).await;
    for k in 1..=4u64 {
        let v = step(&sys, k as f32 * -2.5).await;
        sys.orchestrator.refit(v).await.unwrap();
        assert!(serves(&sys, v, k as f32 * -2.5), "refit {k}: {:?}", served(&sys));
    }
}

/// Every destination's committed values of tensor `name`.
fn served_tensor(sys: &RefitSystem, name: &str) -> Vec<(u64, Vec<f32>)> {
    sys.dst_stores
        .iter()
        .map(|s| {
            let snap = s.snapshot().expect("a committed version");
            (snap.version, snap.buffers.tensor(name).unwrap().to_f32().unwrap())
        })
        .collect()
}

/// One optimizer step that sets `w` to `w` and `b` to `b`.
async fn step_each(sys: &RefitSystem, w: f32, b: f32) -> u64 {
    let mut version = 0;
    for s in &sys.src_stores {
        let mut all = [w; 28];
        all[24..].fill(b);
        version = s.try_update(|buf| buf.write_buffer_f32("params", &all)).await.unwrap().0;
    }
    version
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_subset_refit_moves_only_its_tensors_and_keeps_the_others() {
    let sys = system(Strategy::Reshard).await;
    let only_b = TensorSubset::new(["b"]);
    // Nothing committed yet: the other tensors would have no bytes.
    let v1 = step_each(&sys, 1.5, 2.5).await;
    let err = sys.orchestrator.refit_only(RefitTarget::Version(v1), only_b.clone()).await.unwrap_err().to_string();
    assert!(err.contains("a subset refit needs a committed version"), "{err}");
    assert!(sys.dst_stores.iter().all(|s| s.version().is_none()));
    let full = sys.orchestrator.refit(v1).await.unwrap();
    // The adapter-style step: only b changes, but w changes at the
    // sources too, to show that the subset refit does not move it.
    let v2 = step_each(&sys, -7.0, 4.0).await;
    let part = sys.orchestrator.refit_only(RefitTarget::Version(v2), only_b.clone()).await.unwrap();
    assert_eq!(part.version, v2);
    // b: 8 elements, bf16 on the wire, on 2 ranks of each of 2 replicas
    // (4 elements each); w: 8 x 6, 24 elements per rank.
    assert_eq!((part.bytes, full.bytes), (4 * 4 * 2, 4 * 4 * 2 + 4 * 24 * 2));
    for (version, b) in served_tensor(&sys, "b") {
        assert_eq!(version, v2);
        assert!(b.iter().all(|&x| x == 4.0), "{b:?}");
    }
    for (_, w) in served_tensor(&sys, "w") {
        assert!(w.iter().all(|&x| x == 1.5), "w moved: {w:?}");
    }
    // Again (the subset's plan is cached; staging recycled from an older
    // version must still get w from the served one).
    for k in [5.0f32, 6.0] {
        let version = step_each(&sys, 100.0, k).await;
        let r = sys.orchestrator.refit_only(RefitTarget::Latest, only_b.clone()).await.unwrap();
        assert!(!r.replanned && r.version == version);
        assert!(served_tensor(&sys, "b").iter().all(|(v, b)| *v == version && b.iter().all(|&x| x == k)));
        assert!(served_tensor(&sys, "w").iter().all(|(_, w)| w.iter().all(|&x| x == 1.5)));
    }
    // A full refit then moves everything again.
    let version = step_each(&sys, 9.0, 9.0).await;
    sys.orchestrator.refit(version).await.unwrap();
    assert!(serves(&sys, version, 9.0));
    // A name the destination does not have is a plan error.
    step_each(&sys, 0.0, 0.0).await;
    let err = sys.orchestrator.refit_only(RefitTarget::Latest, TensorSubset::new(["nope"])).await.unwrap_err().to_string();
    assert!(err.contains("tensor 'nope' named for a subset refit is not in the destination layout"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mode_switch_replans_and_delivers_the_same_bytes() {
    let sys = system(Strategy::Reshard).await;
    let v = step(&sys, 3.0).await;
    let a = sys.orchestrator.refit(v).await.unwrap();
    sys.orchestrator.set_mode(Strategy::Baseline).await.unwrap();
    let v = step(&sys, 4.0).await;
    let b = sys.orchestrator.refit(v).await.unwrap();
    assert!(b.replanned && b.mode == Strategy::Baseline && b.fingerprint != a.fingerprint);
    assert!(b.bytes > a.bytes, "baseline {} bytes, reshard {}", b.bytes, a.bytes);
    assert!(serves(&sys, v, 4.0));
    assert_eq!(sys.orchestrator.plans_made().await.unwrap(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn layout_change_replans() {
    let sys = system(Strategy::Reshard).await;
    let v = step(&sys, 1.0).await;
    sys.orchestrator.refit(v).await.unwrap();
    // The inference group is resized: 2 ranks, TP2.
    let dst2 = parse_layout(&DST.replace(r#""ranks": 4"#, r#""ranks": 2"#).replace(r#""shape": [2, 2]"#, r#""shape": [1, 2]"#)).unwrap();
    let sys2 = spawn_refit(&layouts().0, &dst2, config(Strategy::Reshard)).await.unwrap();
    sys.orchestrator.attach(sys.src_members.clone(), sys2.dst_members.clone()).await.unwrap();
    let v = step(&sys, 2.0).await;
    let report = sys.orchestrator.refit(v).await.unwrap();
    assert!(report.replanned);
    assert_eq!(sys.orchestrator.plans_made().await.unwrap(), 2);
    for s in &sys2.dst_stores {
        let snap = s.snapshot().unwrap();
        assert_eq!(snap.version, v);
        assert!(snap.buffers.tensor("w").unwrap().to_f32().unwrap().iter().all(|&x| x == 2.0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wrong_fingerprint_is_refused() {
    let sys = system(Strategy::Reshard).await;
    let v = step(&sys, 1.0).await;
    let report = sys.orchestrator.refit(v).await.unwrap();
    let installed = report.fingerprint.unwrap();
    let bogus = Fingerprint(installed.0 ^ 1);
    let member = &sys.src_members;
    // A step of a refit that was never prepared here.
    // A run of refit `refit` under a plan nobody installed.
    let run = |refit| {
        MemberMsg::Run(orchestrator::RunRequest {
            refit,
            version: v,
            fingerprint: bogus,
            deadline: SECOND,
            delta: orchestrator::RunDelta::Off,
            verify: true,
        })
    };
    let reply = member.call_rank(0, run(77)).await.unwrap();
    assert_eq!(reply, MemberReply::Refused(Refusal::NotPrepared { refit: 77 }));
    let mismatch = MemberReply::Refused(Refusal::FingerprintMismatch { installed: Some(installed), asked: bogus });
    // A plan that is not installed cannot be prepared...
    let prepare = |fingerprint| MemberMsg::Prepare {
        refit: 78,
        fingerprint,
        session: "t".into(),
        fabric: Fabric::Node(NodeFabric::default()),
        keep: false,
    };
    assert_eq!(member.call_rank(0, prepare(bogus)).await.unwrap(), mismatch);
    // ...nor run under another plan than the one prepared (node fabric: a
    // loopback listener).
    assert!(matches!(member.call_rank(0, prepare(installed)).await.unwrap(), MemberReply::Prepared { .. }));
    let reply = member.call_rank(0, run(78)).await.unwrap();
    assert_eq!(reply, mismatch);
    // The next refit is not disturbed.
    let v = step(&sys, 2.0).await;
    sys.orchestrator.refit(v).await.unwrap();
    assert!(serves(&sys, v, 2.0));
}

const SECOND: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_that_disagree_on_their_layout_are_rejected() {
    let sys = system(Strategy::Reshard).await;
    let (src, dst) = layouts();
    // A destination group whose rank 1 was built from another layout.
    let other = parse_layout(&DST.replace(r#""dtype": "bf16""#, r#""dtype": "f32""#)).unwrap();
    let mixed = spawn_refit(&src, &other, config(Strategy::Reshard)).await.unwrap();
    let dsts = actors::spawn_group(4, actors::SpawnConfig::default(), |r| {
        let (layout, store) = if r == 1 { (&other, mixed.dst_stores[1].clone()) } else { (&dst, sys.dst_stores[r].clone()) };
        orchestrator::Member::new(Arc::new(layout.clone()), r as u32, orchestrator::Role::Dst(store))
    });
    sys.orchestrator.attach(sys.src_members.clone(), dsts).await.unwrap();
    let v = step(&sys, 1.0).await;
    match sys.orchestrator.refit(v).await {
        Err(RefitError::Refit(OrchestratorError::Layout { group: Group::Dst, problem })) => {
            assert!(problem.contains("rank 1"), "{problem}")
        }
        other => panic!("expected a layout error, got {other:?}"),
    }
}

/// A dead member replaced alone (a restarted process) gets the plan
/// installed on the next refit, and the group serves the new version; the
/// others keep theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_member_is_replaced_alone_and_the_refit_goes_on() {
    let mut sys = system(Strategy::Reshard).await;
    let v = step(&sys, 1.0).await;
    let first = sys.orchestrator.refit(v).await.unwrap();
    let others: Vec<_> = [0, 1, 3].iter().map(|&r| sys.dst_members.get(r).unwrap().id()).collect();
    sys.dst_members.get(2).unwrap().stop();
    let dead = sys.events.recv().await.unwrap();
    assert_eq!((dead.rank, dead.name.as_str()), (Some(2), "dst[2]"));
    let v = step(&sys, 2.0).await;
    assert!(matches!(sys.orchestrator.refit(v).await, Err(RefitError::Refit(OrchestratorError::MemberDied { .. }))));
    // Rank 2 gets a fresh member with nothing installed (as fresh as a
    // restarted process); the others are the same actors.
    sys.replace_member(Endpoint::dst(2)).await.unwrap();
    assert_eq!([0, 1, 3].map(|r| sys.dst_members.get(r).unwrap().id()).to_vec(), others);
    assert!(sys.dst_members.get(2).unwrap().is_alive());
    let report = sys.orchestrator.refit(v).await.unwrap();
    // Planned again to build the newcomer's program; the same plan.
    assert!(report.replanned);
    assert_eq!(report.fingerprint, first.fingerprint);
    assert!(serves(&sys, v, 2.0));
    assert!(matches!(sys.replace_member(Endpoint::dst(4)).await, Err(RefitError::Refit(OrchestratorError::NoRank { ranks: 4, .. }))));
    // Everyone has it now: the next refit plans nothing.
    let v = step(&sys, 3.0).await;
    assert!(!sys.orchestrator.refit(v).await.unwrap().replanned);
    assert_eq!(sys.orchestrator.plans_made().await.unwrap(), 2);
}

/// A slow step to the next version on every source: half the weights, a
/// pause, the other half.
fn slow_step(sys: &Arc<RefitSystem>, value: f32) -> tokio::task::JoinHandle<u64> {
    let sys = sys.clone();
    tokio::spawn(async move {
        let mut version = 0;
        for s in &sys.src_stores {
            let step = s.try_update(|b| {
                let mut p = b.buffer_to_f32("params")?;
                p[..14].fill(value);
                b.write_buffer_f32("params", &p)?;
                std::thread::sleep(Duration::from_millis(150));
                p[14..].fill(value);
                b.write_buffer_f32("params", &p)
            });
            version = step.await.unwrap().0;
        }
        version
    })
}

/// A refit never reads half an optimizer step: the step holds the fence
/// while it writes, so the refit waits and then sees all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refit_never_reads_a_half_written_step() {
    let sys = Arc::new(system(Strategy::Reshard).await);
    let v = step(&sys, 1.0).await;
    let slow = slow_step(&sys, 2.0);
    tokio::time::sleep(Duration::from_millis(40)).await;
    // Refitting version 1 now must not read the torn buffer: it waits for
    // the step, then finds the source at another version and fails.
    let early = sys.orchestrator.refit(v).await;
    assert!(matches!(early, Err(RefitError::Refit(OrchestratorError::VersionMismatch { held: 2, asked: 1, .. }))), "{early:?}");
    assert!(sys.dst_stores.iter().all(|s| s.snapshot().is_none()));
    let v2 = slow.await.unwrap();
    sys.orchestrator.refit(v2).await.unwrap();
    assert!(serves(&sys, v2, 2.0));
}

/// `refit_latest` needs no version, and a step that lands while it reads
/// makes it deliver the newer weights instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refit_latest_delivers_the_newest_version_through_a_racing_step() {
    let sys = Arc::new(system(Strategy::Reshard).await);
    step(&sys, 1.0).await;
    // Every source holds version 1 when the refit starts, but the step to 2
    // holds the first source's fence: the refit waits, finds version 2 on
    // that source, and starts again with 2 once every source has it.
    let slow = slow_step(&sys, 2.0);
    tokio::time::sleep(Duration::from_millis(40)).await;
    let report = sys.orchestrator.refit_latest().await.unwrap();
    assert_eq!(report.version, 2);
    assert!(serves(&sys, 2, 2.0));
    assert_eq!(slow.await.unwrap(), 2);
    let v = step(&sys, 3.0).await;
    let report = sys.orchestrator.refit_latest().await.unwrap();
    assert_eq!(report.version, v);
    assert!(serves(&sys, v, 3.0));
}

/// Sources that stay on different versions (a trainer skipped a step) make
/// `refit_latest` fail after the control timeout, naming the versions.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refit_latest_refuses_sources_that_disagree() {
    let (src, dst) = layouts();
    let config = OrchestratorConfig { control_timeout: Duration::from_millis(300), ..config(Strategy::Reshard) };
    let sys = spawn_refit(&src, &dst, config).await.unwrap();
    step(&sys, 1.0).await;
    sys.src_stores[1].update(|_| ()).await;
    match sys.orchestrator.refit_latest().await {
        Err(RefitError::Refit(e @ OrchestratorError::VersionsDisagree { .. })) => {
            assert!(e.to_string().starts_with("sources hold different versions (version 1 (rank 0), version 2 (rank 1))"), "{e}")
        }
        other => panic!("expected VersionsDisagree, got {other:?}"),
    }
}

/// A pair that cannot be planned fails when the system is made, with the
/// planner's error, before any training step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_that_cannot_be_planned_fails_at_creation() {
    let (src, _) = layouts();
    let dst = parse_layout(&DST.replace(r#""shape": [8, 6]"#, r#""shape": [8, 4]"#)).unwrap();
    match spawn_refit(&src, &dst, config(Strategy::Reshard)).await {
        Err(RefitError::Refit(OrchestratorError::Plan(e @ PlanError::ShapeMismatch { .. }))) => {
            assert!(e.to_string().contains("'w'"), "{e}")
        }
        Err(other) => panic!("expected a shape mismatch, got {other:?}"),
        Ok(_) => panic!("a pair with different shapes was accepted"),
    }
}

/// A pair whose plan would take more work than the orchestrator's limit
/// (`PlanOptions::max_work`, by default what this machine's memory holds)
/// fails when the system is made, with the planner's refusal naming the
/// limit and the flag, instead of planning into an OOM; the default limit
/// plans it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_past_the_work_limit_is_refused_with_an_error() {
    let (src, dst) = layouts();
    let mut tight = config(Strategy::Reshard);
    assert!(tight.plan.max_work >= 1 << 20, "the machine's limit: {}", tight.plan.max_work);
    tight.plan.max_work = 4;
    match spawn_refit(&src, &dst, tight).await {
        Err(RefitError::Refit(OrchestratorError::Plan(e @ PlanError::TooMuchWork { limit: 4, .. }))) => {
            let e = e.to_string();
            assert!(e.contains("more than 4 units of work") && e.contains("--max-plan-work") && e.contains("PlanOptions::max_work"), "{e}")
        }
        Err(other) => panic!("expected the work limit, got {other:?}"),
        Ok(_) => panic!("planned past the work limit"),
    }
    assert!(spawn_refit(&src, &dst, config(Strategy::Reshard)).await.is_ok());
}

/// Refits refuse sources with no whole version, before anything moves: a
/// fresh store, and a store torn by a step that failed after writing. A
/// step that fails before writing keeps the store clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unwritten_and_torn_sources_are_refused() {
    let sys = system(Strategy::Reshard).await;
    let refused = |r: Result<orchestrator::RefitReport, RefitError>| match r {
        Err(RefitError::Refit(OrchestratorError::NoWeights { member, weights })) => (member, weights),
        other => panic!("expected NoWeights, got {other:?}"),
    };
    assert_eq!(refused(sys.orchestrator.refit(0).await), ("src[0]".into(), HeldVersion::Unwritten));
    assert_eq!(refused(sys.orchestrator.refit_latest().await).1, HeldVersion::Unwritten);
    let v = step(&sys, 1.0).await;
    // Fails before writing: no harm done.
    let typo = sys.src_stores[0].try_update(|b| b.tensor_mut("W").map(drop)).await;
    assert_eq!(typo.unwrap_err().to_string(), "rank 0: the layout has no tensor 'W'");
    assert_eq!(sys.src_stores[0].version(), Some(v));
    // Fails after writing half: torn, and the version did not move.
    let half = sys.src_stores[1]
        .try_update(|b| {
            b.tensor_mut("w")?.write_f32(&[9.0; 24])?;
            b.tensor_mut("b")?.write_f32(&[9.0; 3])
        })
        .await;
    assert_eq!(half.unwrap_err().to_string(), "tensor 'b': 3 values given for 4 elements");
    assert_eq!(sys.src_stores[1].version(), Some(v));
    assert_eq!(refused(sys.orchestrator.refit(v).await), ("src[1]".into(), HeldVersion::Torn { after: Some(v) }));
    assert!(served(&sys).iter().all(|(ver, _)| *ver == 0));
    // The next good step mends it.
    let v = step(&sys, 2.0).await;
    sys.orchestrator.refit(v).await.unwrap();
    assert!(serves(&sys, v, 2.0));
}

/// A refit of the version every destination already serves moves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refitting_the_served_version_moves_nothing() {
    let sys = system(Strategy::Reshard).await;
    let v = step(&sys, 1.0).await;
    let first = sys.orchestrator.refit(v).await.unwrap();
    let again = sys.orchestrator.refit(v).await.unwrap();
    assert!(!first.already_served && first.bytes > 0);
    assert!(again.already_served && again.bytes == 0 && again.fingerprint.is_none());
    let latest = sys.orchestrator.refit_latest().await.unwrap();
    assert!(latest.already_served && latest.version == v);
    // The snapshots are the very ones the first refit committed.
    let before: Vec<_> = sys.dst_stores.iter().map(|s| s.snapshot().unwrap()).collect();
    sys.orchestrator.refit(v).await.unwrap();
    assert!(sys.dst_stores.iter().zip(&before).all(|(s, b)| Arc::ptr_eq(&s.snapshot().unwrap(), b)));
}

/// Readers never see a mix of two versions, however refits interleave.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readers_never_see_two_versions_at_once() {
    let sys = Arc::new(system(Strategy::Reshard).await);
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (sys, stop) = (sys.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut seen = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for (version, values) in served(&sys) {
                        assert!(values.iter().all(|&x| x == version as f32), "version {version} holds {values:?}");
                        seen += 1;
                    }
                }
                seen
            })
        })
        .collect();
    for _ in 0..20 {
        let next = sys.src_stores[0].version().map_or(1, |v| v + 1);
        let v = step(&sys, next as f32).await;
        assert_eq!(v, next);
        sys.orchestrator.refit(v).await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        assert!(r.join().unwrap() > 0);
    }
}

/// A refit with a dead member fails, and every destination keeps serving
/// the last committed version.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_refit_leaves_destinations_on_their_last_version() {
    let mut sys = system(Strategy::Reshard).await;
    let v = step(&sys, 5.0).await;
    sys.orchestrator.refit(v).await.unwrap();
    sys.dst_members.get(2).unwrap().stop();
    let dead = sys.events.recv().await.unwrap();
    assert_eq!(dead.rank, Some(2));
    let v2 = step(&sys, 6.0).await;
    match sys.orchestrator.refit(v2).await {
        Err(RefitError::Refit(OrchestratorError::MemberDied { member, .. })) => assert_eq!(member, "dst[2]"),
        other => panic!("expected MemberDied, got {other:?}"),
    }
    assert!(serves(&sys, v, 5.0));
}

/// An orchestrator over an empty group refuses to refit (no panic).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_group_is_a_layout_error() {
    let sys = system(Strategy::Reshard).await;
    let empty = actors::ActorGroup::from_refs(Vec::new());
    let o = orchestrator::spawn_orchestrator(sys.src_members.clone(), empty, config(Strategy::Reshard));
    match o.refit(0).await {
        Err(RefitError::Refit(OrchestratorError::Layout { group: Group::Dst, problem })) => {
            assert!(problem.contains("no members"), "{problem}")
        }
        other => panic!("expected a layout error, got {other:?}"),
    }
}

/// The node fabric between members of this process (loopback TCP and
/// shared memory), connections kept between refits or not.
async fn node_system(keep_data_plane: bool) -> RefitSystem {
    let (src, dst) = layouts();
    let config = OrchestratorConfig { fabric: Fabric::Node(NodeFabric::default()), keep_data_plane, ..config(Strategy::Reshard) };
    spawn_refit(&src, &dst, config).await.unwrap()
}

/// Refits `value` and returns whether it ran on kept connections; every
/// destination must serve it.
async fn refit_resumed(sys: &RefitSystem, value: f32) -> bool {
    let v = step(sys, value).await;
    let report = sys.orchestrator.refit(v).await.unwrap();
    assert!(serves(sys, v, value), "refit of {value}");
    report.resumed
}

/// A refit that commits leaves its connections for the next refit of the
/// same plan (one kept data plane per plan); closing, a member that lost
/// its own, or a failed refit and a replaced member bring a fresh one, and
/// every refit delivers the right weights either way. (Failures during a
/// transfer on kept connections: the chaos suite, `cli/tests/chaos.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_fabric_connections_are_kept_between_refits_of_a_plan() {
    let mut sys = node_system(true).await;
    assert!(!refit_resumed(&sys, 1.0).await);
    assert!(refit_resumed(&sys, 2.0).await);
    assert!(refit_resumed(&sys, 3.0).await);
    // The other strategy's plan gets its own; switching back finds each.
    sys.orchestrator.set_mode(Strategy::Baseline).await.unwrap();
    assert!(!refit_resumed(&sys, 4.0).await);
    sys.orchestrator.set_mode(Strategy::Reshard).await.unwrap();
    assert!(refit_resumed(&sys, 5.0).await);
    sys.orchestrator.set_mode(Strategy::Baseline).await.unwrap();
    assert!(refit_resumed(&sys, 6.0).await);
    sys.orchestrator.set_mode(Strategy::Reshard).await.unwrap();
    sys.orchestrator.close_data_plane().await.unwrap();
    assert!(!refit_resumed(&sys, 7.0).await);
    assert!(refit_resumed(&sys, 8.0).await);
    // One member dropped what it kept: the others' kept ends are useless
    // without it, and everyone opens a fresh data plane.
    assert_eq!(sys.dst_members.call_rank(1, MemberMsg::Discard).await.unwrap(), MemberReply::Done);
    assert!(!refit_resumed(&sys, 9.0).await);
    assert!(refit_resumed(&sys, 10.0).await);
    // A dead member: the refit fails, the replacement joins a fresh data
    // plane.
    sys.dst_members.get(3).unwrap().stop();
    assert_eq!(sys.events.recv().await.unwrap().rank, Some(3));
    let v = step(&sys, 11.0).await;
    assert!(sys.orchestrator.refit(v).await.is_err());
    assert!(serves(&sys, v - 1, 10.0));
    sys.replace_member(Endpoint::dst(3)).await.unwrap();
    let report = sys.orchestrator.refit(v).await.unwrap();
    assert!(!report.resumed);
    assert!(serves(&sys, v, 11.0));
    assert!(refit_resumed(&sys, 12.0).await);
}

/// Without `keep_data_plane`, every refit opens its own data plane.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_fabric_without_kept_connections_opens_one_per_refit() {
    let sys = node_system(false).await;
    for value in [1.0, 2.0, 3.0] {
        assert!(!refit_resumed(&sys, value).await);
    }
}

/// Training TP2 by rows (f32) -> inference TP2 by columns x DP2 on 2
/// nodes (bf16): big enough that a delta's headers do not matter.
fn big_layouts() -> (Layout, Layout) {
    let src = r#"{"ranks": 2, "tensors": [
      {"name": "w", "dtype": "f32", "shape": [256, 64], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#;
    let dst = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
      {"name": "w", "dtype": "bf16", "shape": [256, 64], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(1)"]}]}"#;
    (parse_layout(src).unwrap(), parse_layout(dst).unwrap())
}

/// Source values of step `k`: element i is `i`, plus `k` on every
/// `every`-th element.
fn big_value(i: usize, k: u32, every: usize) -> f32 {
    i as f32 + if i.is_multiple_of(every) { k as f32 * 1000.0 } else { 0.0 }
}

async fn big_step(sys: &RefitSystem, k: u32, every: usize) -> u64 {
    let mut version = 0;
    for s in &sys.src_stores {
        version = s
            .try_update(|b| {
                let mut t = b.tensor_mut("w")?;
                let (offset, extent) = (t.offset()[0] as usize, t.extent().to_vec());
                let n = (extent[0] * extent[1]) as usize;
                let values: Vec<f32> = (0..n).map(|j| big_value(offset * 64 + j, k, every)).collect();
                t.write_f32(&values)
            })
            .await
            .unwrap()
            .0;
    }
    version
}

/// Whether every destination serves step `k`'s values (as bf16).
fn big_serves(sys: &RefitSystem, k: u32, every: usize) -> bool {
    sys.dst_stores.iter().all(|s| {
        let snap = s.snapshot().unwrap();
        let t = snap.buffers.tensor("w").unwrap();
        let (off, ext) = (t.offset().to_vec(), t.extent().to_vec());
        let got = t.to_f32().unwrap();
        (0..got.len()).all(|j| {
            let (r, c) = (off[0] as usize + j / ext[1] as usize, off[1] as usize + j % ext[1] as usize);
            let want = big_value(r * 64 + c, k, every);
            // bf16 of `want`, round to nearest even, as the refit narrows.
            let bits = want.to_bits();
            let rounded = f32::from_bits(((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) << 16);
            got[j] == rounded
        })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delta_refits_move_what_changed_and_fall_back_to_dense() {
    check_delta(Fabric::InProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delta_refits_over_the_node_fabric() {
    // Shared memory inside a node, TCP across, connections kept: messages
    // arrive lent, streamed or as frames, and a frame may be a header
    // longer than the plan's message.
    check_delta(Fabric::Node(NodeFabric::default())).await;
}

/// On the communicators (simulated NCCL and IPC), a round is two groups:
/// the encodings' lengths, then the encodings.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delta_refits_over_the_communicators() {
    use orchestrator::{CommPlane, IpcFabric, NcclFabric};
    let plane = CommPlane::Simulated { world: "delta".into() };
    let (init, abort) = (Duration::from_secs(5), Duration::from_secs(1));
    check_delta(Fabric::Nccl(NcclFabric { plane: plane.clone(), init_timeout: init, abort_timeout: abort })).await;
    check_delta(Fabric::Ipc(IpcFabric { plane, connect_timeout: init, abort_timeout: abort })).await;
}

async fn check_delta(fabric: Fabric) {
    let (src, dst) = big_layouts();
    let sys = spawn_refit(&src, &dst, OrchestratorConfig { delta: true, fabric, ..config(Strategy::Reshard) }).await.unwrap();
    let dense = sys.orchestrator.plan().await.unwrap().bytes;
    // No base yet: dense (plus a header per message).
    let v = big_step(&sys, 1, 50).await;
    let first = sys.orchestrator.refit(v).await.unwrap();
    assert!(first.bytes >= dense && first.bytes < dense + 1024, "{} vs {dense}", first.bytes);
    assert!(big_serves(&sys, 1, 50));
    // 2% of the elements change: at most a tenth of the bytes, bit-exact.
    for k in 2..=4 {
        let v = big_step(&sys, k, 50).await;
        let r = sys.orchestrator.refit(v).await.unwrap();
        assert!(r.bytes * 10 <= dense, "step {k}: {} bytes, dense {dense}", r.bytes);
        assert!(big_serves(&sys, k, 50), "step {k}");
    }
    // Every element changes: hardly more than dense.
    let v = big_step(&sys, 5, 1).await;
    let r = sys.orchestrator.refit(v).await.unwrap();
    assert!(r.bytes as f64 <= 1.05 * dense as f64, "{} vs {dense}", r.bytes);
    assert!(big_serves(&sys, 5, 1));
    // After the data plane is dropped (as after a replaced member or a
    // failure), the next refit is dense again, then deltas resume.
    sys.orchestrator.close_data_plane().await.unwrap();
    let v = big_step(&sys, 6, 50).await;
    let r = sys.orchestrator.refit(v).await.unwrap();
    assert!(r.bytes >= dense, "{} vs {dense}", r.bytes);
    assert!(big_serves(&sys, 6, 50));
    let v = big_step(&sys, 7, 50).await;
    let r = sys.orchestrator.refit(v).await.unwrap();
    assert!(r.bytes * 10 <= dense, "{} vs {dense}", r.bytes);
    assert!(big_serves(&sys, 7, 50));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_program_that_resizes_the_ranks_buffers_is_refused() {
    // A program's first buffers are the rank's own: one that claims other
    // sizes (a huge one, say) is refused at install, before anything is
    // sized by it, and the next refit is not disturbed.
    let sys = system(Strategy::Reshard).await;
    let (src, dst) = layouts();
    let plan = reshard::plan_reshard(&src, &dst, &reshard::PlanOptions::default()).unwrap();
    let programs = plan.programs(&src, &dst).unwrap();
    let mut program = programs.into_iter().find(|p| p.endpoint == Endpoint::dst(1)).unwrap();
    let fingerprint = program.fingerprint;
    program.buffers[0].elems = u64::MAX / 2;
    let reply = sys
        .dst_members
        .call_rank(1, MemberMsg::Install { program: Box::new(program), fingerprint, seat: orchestrator::ProgramRole::Own })
        .await
        .unwrap();
    assert!(matches!(&reply, MemberReply::Refused(Refusal::ProgramMismatch(why)) if why.contains("dst rank 1")), "{reply:?}");
    let v = step(&sys, 3.0).await;
    sys.orchestrator.refit(v).await.unwrap();
    assert!(serves(&sys, v, 3.0));
}

/// A member's data-plane address crosses processes as it was made, on
/// every fabric; a handle or id whose hex is damaged is refused as it is
/// read, never taken for another.
#[test]
fn data_addresses_travel_typed_and_are_checked_as_they_arrive() {
    use orchestrator::{DataAddr, MemberReply};
    use transport::cuda::{sim_comm_id, IpcHandle};
    let handle = IpcHandle::from_bytes(&[7u8; 64]).unwrap();
    let every = [
        DataAddr::InProcess,
        DataAddr::Node("10.0.0.2:4100".parse().unwrap()),
        DataAddr::Comm { id: Some(sim_comm_id()), device: "GPU-1234".into() },
        DataAddr::Comm { id: None, device: "sim-gpu0".into() },
        DataAddr::Ipc { doorbells: "127.0.0.1:9".parse().unwrap(), bucket: handle, bytes: 4096, device: "GPU-1234".into() },
    ];
    for addr in every {
        let reply = MemberReply::Prepared { endpoint: Endpoint::dst(3), node: 1, addr: addr.clone(), host: transport::fabric::this_host() };
        let bytes = actors::codec::encode(&reply).unwrap();
        match actors::codec::decode::<MemberReply>(&bytes).unwrap() {
            MemberReply::Prepared { addr: back, .. } => assert_eq!(back, addr),
            other => panic!("{other:?}"),
        }
    }
    // The handle's hex with one digit changed into a non-hex character.
    let reply = MemberReply::Prepared {
        endpoint: Endpoint::dst(3),
        node: 1,
        addr: DataAddr::Ipc { doorbells: "127.0.0.1:9".parse().unwrap(), bucket: handle, bytes: 4096, device: "GPU-1234".into() },
        host: transport::fabric::this_host(),
    };
    let mut bytes = actors::codec::encode(&reply).unwrap();
    let hex = handle.to_hex();
    let at = bytes.windows(hex.len()).position(|w| w == hex.as_bytes()).expect("the handle travels as hex");
    bytes[at + 5] = b'z';
    let err = actors::codec::decode::<MemberReply>(&bytes).unwrap_err().to_string();
    assert!(err.contains("non-hex character at 5"), "{err}");
}
