//! What a demo run reports: every step ([`StepRecord`]), a run's figures
//! ([`RunSummary`], [`RunReport`]) and every run's ([`DemoReport`]), as
//! JSON too.

use super::{DemoConfig, ACTIONS, CONTEXTS, DIM, HIDDEN, ROLLOUT_DP, ROLLOUT_TP, TRAIN_TP};
use reshard::Strategy;
use serde::Serialize;
use serde_json::{json, Value};

/// One step of one run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepRecord {
    /// Step index, from 0.
    pub step: usize,
    /// Mean reward of the step's rollouts.
    pub reward: f64,
    /// Wall time of the refit after this step, in ms (0 without refit).
    pub refit_ms: f64,
    /// Bytes that refit moved between ranks (0 without refit).
    pub refit_bytes: u64,
    /// Weight version the rollout ranks served for this step's samples.
    pub version_served: u64,
}

/// Figures of one run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunSummary {
    /// Mean reward of the first [`SUMMARY_WINDOW`](super::SUMMARY_WINDOW) steps.
    pub reward_start: f64,
    /// Mean reward of the last [`SUMMARY_WINDOW`](super::SUMMARY_WINDOW) steps.
    pub reward_end: f64,
    /// Median refit wall time per step, ms (0 without refit).
    pub median_refit_ms: f64,
    /// Median bytes moved per refit (0 without refit).
    pub median_refit_bytes: u64,
    /// Bytes moved by all per-step refits.
    pub total_refit_bytes: u64,
    /// Wall time of the initial refit (which plans), ms.
    pub initial_refit_ms: f64,
    /// Bytes moved by the initial refit.
    pub initial_refit_bytes: u64,
    /// Plans the orchestrator made during the run.
    pub plans_made: u64,
    /// Wall time of the whole run, s.
    pub wall_s: f64,
}

/// One run of the loop with one strategy.
#[derive(Clone, Debug, PartialEq)]
pub struct RunReport {
    /// The refit strategy.
    pub mode: Strategy,
    /// Per-step records.
    pub steps: Vec<StepRecord>,
    /// Figures.
    pub summary: RunSummary,
    /// The worker processes that held the ranks (empty in process).
    pub processes: Vec<u32>,
}

impl RunReport {
    /// The rewards per step.
    pub fn rewards(&self) -> Vec<f64> {
        self.steps.iter().map(|s| s.reward).collect()
    }

    /// This run as JSON: `{"mode", "steps": [...], "summary": {...}}`.
    pub fn to_json(&self) -> Value {
        json!({"mode": self.mode.to_string(), "steps": self.steps, "summary": self.summary, "processes": self.processes})
    }
}

/// What [`run_demo`](super::run_demo) did: one run per strategy, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct DemoReport {
    /// The settings.
    pub config: DemoConfig,
    /// The runs (reshard first with [`DemoMode::Both`](super::DemoMode::Both)).
    pub runs: Vec<RunReport>,
}

impl DemoReport {
    /// The first run.
    pub fn primary(&self) -> &RunReport {
        &self.runs[0]
    }

    /// The run with this strategy, if any.
    pub fn run(&self, mode: Strategy) -> Option<&RunReport> {
        self.runs.iter().find(|r| r.mode == mode)
    }

    /// Whether every run saw exactly the same reward at every step (the same
    /// weights were delivered, bit for bit, by every strategy).
    pub fn identical_rewards(&self) -> bool {
        self.runs.windows(2).all(|w| w[0].rewards() == w[1].rewards())
    }

    /// One JSON object: the primary run's `steps` and `summary` at the top
    /// level, every run under `runs`.
    pub fn to_json(&self) -> Value {
        let c = &self.config;
        let p = self.primary();
        json!({
            "config": {"steps": c.steps, "batch": c.batch, "lr": c.lr, "seed": c.seed, "refit": c.refit,
                       "processes": c.processes, "mode": format!("{:?}", c.mode).to_lowercase()},
            "task": {"contexts": CONTEXTS, "actions": ACTIONS, "dim": DIM, "hidden": HIDDEN,
                     "train": format!("TP{TRAIN_TP} f32, fused buffer 'params'"),
                     "rollout": format!("TP{ROLLOUT_TP} x DP{ROLLOUT_DP} bf16")},
            "mode": p.mode.to_string(),
            "steps": p.steps,
            "summary": p.summary,
            "processes": self.runs.iter().flat_map(|r| r.processes.iter().copied()).collect::<Vec<_>>(),
            "identical_rewards": self.identical_rewards(),
            "runs": self.runs.iter().map(RunReport::to_json).collect::<Vec<_>>(),
        })
    }
}

pub(super) fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}
