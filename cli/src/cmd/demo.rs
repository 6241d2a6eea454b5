//! `refit demo` (a small RL loop fed by refit) and the hidden `refit demo-member`.

use super::report::{human, invalid, say, seconds, Failure};
use refit_cli::demo::{run_demo, DemoConfig, DemoError, DemoReport, DemoRole};
use reshard::Strategy;
use std::io::IsTerminal as _;

fn print_demo(report: &DemoReport) {
    let c = &report.config;
    say!(
        "refit demo: contextual bandit ({} contexts, {} actions), policy MLP {}-{}-{}",
        refit_cli::demo::CONTEXTS,
        refit_cli::demo::ACTIONS,
        refit_cli::demo::DIM,
        refit_cli::demo::HIDDEN,
        refit_cli::demo::ACTIONS
    );
    say!("  training: TP4 f32 on 4 ranks (2 nodes), fused buffer 'params' -> rollout: TP2 x DP2 bf16 on 4 ranks (2 nodes)");
    say!(
        "  {} steps, batch {}, lr {}, seed {}, {}",
        c.steps,
        c.batch,
        c.lr,
        c.seed,
        if c.refit { "refit after every step" } else { "NO refit after the initial one (control)" }
    );
    say!("");
    say!(
        "  {:<9} {:>12} {:>11} {:>14} {:>13} {:>14}",
        "mode",
        "reward start",
        "reward end",
        "refit median",
        "bytes moved",
        "served at end"
    );
    for run in &report.runs {
        let s = &run.summary;
        let served = run.steps.last().map_or(0, |r| r.version_served);
        let (ms, bytes) =
            if c.refit { (seconds(s.median_refit_ms / 1e3), human(s.median_refit_bytes)) } else { ("-".to_string(), "-".to_string()) };
        say!(
            "  {:<9} {:>12.3} {:>11.3} {:>14} {:>13} {:>14}",
            run.mode.to_string(),
            s.reward_start,
            s.reward_end,
            ms,
            bytes,
            format!("v{served}")
        );
    }
    say!("");
    say!(
        "  reward start/end: mean of the first/last {} steps; chance is {:.3}",
        refit_cli::demo::SUMMARY_WINDOW,
        1.0 / refit_cli::demo::ACTIONS as f64
    );
    if let (true, Some(r), Some(b)) = (c.refit, report.run(Strategy::Reshard), report.run(Strategy::Baseline)) {
        let same = if report.identical_rewards() { "identical" } else { "DIFFERENT" };
        say!("  rewards step by step, reshard vs baseline: {same} (the same weights are delivered)");
        if r.summary.median_refit_bytes > 0 && r.summary.median_refit_ms > 0.0 {
            say!(
                "  baseline / reshard: {:.2}x the bytes, {:.2}x the time per refit",
                b.summary.median_refit_bytes as f64 / r.summary.median_refit_bytes as f64,
                b.summary.median_refit_ms / r.summary.median_refit_ms
            );
        }
    }
    if !c.refit {
        say!("  without refit the rollout ranks keep serving version 1: the policy they sample from never changes");
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn run(config: DemoConfig, as_json: bool) -> Result<(), Failure> {
    // The demo draws its bar on stderr.
    let progress = !as_json && std::io::stderr().is_terminal();
    let report = run_demo(config, progress).map_err(|e| match e {
        DemoError::Config(_) => invalid(e.to_string()),
        other => Failure { line: other.to_string(), code: 1 },
    })?;
    if as_json {
        say!("{}", report.to_json());
    } else {
        print_demo(&report);
    }
    Ok(())
}

/// One rank of `refit demo --processes`.
pub(crate) fn member(role: DemoRole, rank: u32) -> Result<(), Failure> {
    refit_cli::demo::run_demo_member(role, rank).map_err(|e| Failure { line: e.to_string(), code: 1 })
}
