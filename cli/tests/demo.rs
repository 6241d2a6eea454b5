//! `refit demo` learns only because refit delivers fresh weights: with a
//! refit after every step the reward rises from chance, without it the
//! rollout ranks keep serving version 1 and the reward stays flat; reshard
//! and the baseline deliver the same weights bit for bit (identical rewards
//! step by step) and the baseline moves more bytes.

use refit_cli::demo::{run_demo, DemoConfig, DemoMode, RunReport, ACTIONS};
use reshard::Strategy;

/// Small and fast (debug build, 2 cores), with margins that hold over 40
/// seeds (end reward ≥ 0.58, start ≤ 0.19, no-refit drift ≤ 0.05).
fn config(seed: u64, mode: DemoMode, refit: bool) -> DemoConfig {
    DemoConfig { steps: 60, batch: 128, lr: 2.0, seed, mode, refit, processes: false }
}

fn check_learns(run: &RunReport) {
    let s = &run.summary;
    assert!(s.reward_start < 0.25, "{}: start reward {} is far from chance {}", run.mode, s.reward_start, 1.0 / ACTIONS as f64);
    assert!(s.reward_end >= 0.5, "{}: end reward {} < 0.5", run.mode, s.reward_end);
    assert!(s.reward_end - s.reward_start >= 0.3, "{}: reward rose only {} -> {}", run.mode, s.reward_start, s.reward_end);
    // A refit after every step: step s samples from version s + 1.
    for (i, r) in run.steps.iter().enumerate() {
        assert_eq!(r.version_served, i as u64 + 1, "{}: step {i}", run.mode);
        assert!(r.refit_bytes > 0, "{}: step {i} refit moved nothing", run.mode);
    }
}

#[test]
fn refit_carries_the_learning_and_both_strategies_agree() {
    for seed in [1, 7] {
        let report = run_demo(config(seed, DemoMode::Both, true), false).expect("demo runs");
        assert_eq!(report.runs.len(), 2);
        let (r, b) = (report.run(Strategy::Reshard).expect("reshard run"), report.run(Strategy::Baseline).expect("baseline run"));
        check_learns(r);
        check_learns(b);
        // Same seed, same weights delivered: identical rewards at every step.
        assert_eq!(r.rewards(), b.rewards(), "seed {seed}: reshard and baseline rewards differ");
        assert!(report.identical_rewards());
        assert!(
            b.summary.median_refit_bytes > r.summary.median_refit_bytes,
            "seed {seed}: baseline moves {} bytes per refit, reshard {}",
            b.summary.median_refit_bytes,
            r.summary.median_refit_bytes
        );
        assert_eq!(r.summary.plans_made, 1, "the plan is cached across refits");
        let json = report.to_json();
        assert_eq!(json["steps"].as_array().map(Vec::len), Some(60));
        assert_eq!(json["runs"].as_array().map(Vec::len), Some(2));
        assert_eq!(json["runs"][1]["mode"], "baseline");
    }
}

#[test]
fn without_refit_the_reward_stays_flat() {
    for seed in [1, 7] {
        let report = run_demo(config(seed, DemoMode::Reshard, false), false).expect("demo runs");
        let run = report.primary();
        let s = &run.summary;
        assert!(
            (s.reward_end - s.reward_start).abs() < 0.1,
            "seed {seed}: reward moved {} -> {} without refit",
            s.reward_start,
            s.reward_end
        );
        assert!(s.reward_end < 0.25, "seed {seed}: end reward {} without refit", s.reward_end);
        for r in &run.steps {
            assert_eq!(r.version_served, 1, "step {}: rollouts must keep serving the initial weights", r.step);
            assert_eq!((r.refit_bytes, r.refit_ms), (0, 0.0));
        }
    }
}

#[test]
fn invalid_settings_are_rejected() {
    for bad in [
        DemoConfig { steps: 0, ..DemoConfig::default() },
        DemoConfig { batch: 7, ..DemoConfig::default() },
        DemoConfig { lr: f32::NAN, ..DemoConfig::default() },
    ] {
        let e = run_demo(bad, false).expect_err("rejected");
        assert!(matches!(e, refit_cli::demo::DemoError::Config(_)), "{e}");
    }
}

/// `refit demo --processes --json`: every rank in an OS process of its own.
fn demo_in_processes(extra: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_refit"))
        .args(["demo", "--processes", "--json", "--mode", "reshard", "--steps", "60"])
        .args(extra)
        .output()
        .expect("refit runs");
    assert!(out.status.success(), "refit demo --processes failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

#[test]
fn slow_in_worker_processes_refit_carries_the_learning() {
    let with = demo_in_processes(&[]);
    let pids: Vec<u64> = with["processes"].as_array().expect("processes").iter().filter_map(|p| p.as_u64()).collect();
    // 4 training ranks and 4 rollout ranks, none of them this process.
    assert_eq!(pids.len(), 8, "{pids:?}");
    assert!(!pids.contains(&u64::from(std::process::id())));
    let s = &with["summary"];
    let (start, end) = (s["reward_start"].as_f64().unwrap(), s["reward_end"].as_f64().unwrap());
    assert!(start < 0.25 && end >= 0.5 && end - start >= 0.3, "reward {start} -> {end}");
    for (i, step) in with["steps"].as_array().unwrap().iter().enumerate() {
        assert_eq!(step["version_served"].as_u64(), Some(i as u64 + 1), "step {i}");
    }
    let without = demo_in_processes(&["--no-refit"]);
    let s = &without["summary"];
    let chance = 1.0 / ACTIONS as f64;
    for k in ["reward_start", "reward_end"] {
        let r = s[k].as_f64().unwrap();
        assert!((r - chance).abs() <= 0.1, "--no-refit: {k} {r} is not chance {chance}");
    }
}
