//! `refit demo`: a small but real RL loop that learns only because refit
//! delivers fresh weights to the rollout ranks after every optimizer step.
//!
//! **Task.** A contextual bandit with a verifiable reward: [`CONTEXTS`] fixed
//! feature vectors of dimension [`DIM`] (drawn from the seed), each with a
//! hidden target action among [`ACTIONS`]; the reward is 1 when the sampled
//! action is the target, else 0. A uniform policy earns `1 / ACTIONS`.
//!
//! **Policy.** A 2-layer MLP: `h = relu(W1 x + b1)`, `logits = W2 h + b2`,
//! softmax; `W1` is `[HIDDEN, DIM]`, `W2` is `[ACTIONS, HIDDEN]`. Trained
//! with REINFORCE (mean-reward baseline) and plain SGD.
//!
//! **Training group** (sources): tensor parallel over [`TRAIN_TP`] ranks
//! (2 per node), f32. Rank `t` owns hidden units `t*HS..(t+1)*HS`
//! (`HS = HIDDEN / TRAIN_TP`) and stores, back to back in one fused buffer
//! `"params"`: its `W1` row block `[HS, DIM]`, its `b1` slice `[HS]`, its
//! `W2` column block `[ACTIONS, HS]` (row-major) and all of `b2`
//! (replicated). See [`training_layout_json`].
//!
//! **Rollout group** (destinations): TP2 × DP2 on 4 ranks (one replica per node),
//! bf16, DTensor-style mesh placements (`W1` and `b1` `shard(0)`, `W2`
//! `shard(1)` over the TP dim, `b2` replicated). See
//! [`rollout_layout_json`].
//!
//! **One step.** The [`Rollout`] actors take one [`DstStore::snapshot`](orchestrator::DstStore::snapshot) per
//! batch and compute partial logits for their hidden slice; the driver sums
//! the two TP ranks of each replica, samples actions (each replica serves
//! half of the batch) and scores them. The [`Trainer`] actors recompute the
//! forward pass on those samples with the training weights, the driver sums
//! their partial logits (the tensor-parallel all-reduce) and sends every
//! trainer the per-sample logit gradients; each trainer computes its shard
//! gradients and applies SGD with [`SrcStore::update`](orchestrator::SrcStore::update) (version `v`).
//! Then the orchestrator refits version `v` into the rollout ranks.
//! Without refit, the rollout ranks keep serving the initial weights and the
//! reward stays flat: the learning is carried by refit alone.

mod driver;
mod layout;
mod model;
mod processes;
mod report;
mod rollout;
mod trainer;

use driver::drive;
use model::Task;
use processes::ProcessCast;

pub use layout::{layouts, rollout_layout_json, training_layout_json};
pub use model::SplitMix;
pub use processes::{run_demo_member, DemoRole};
pub use report::{DemoReport, RunReport, RunSummary, StepRecord};
pub use rollout::{Rollout, RolloutMsg, RolloutReply};
pub use trainer::{Trainer, TrainerMsg, TrainerReply};

use actors::{spawn_group, ActorGroup, SpawnConfig};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use orchestrator::{spawn_refit, OrchestratorConfig, RefitError};
use reshard::Strategy;
use std::time::Instant;
use thiserror::Error;

/// Input feature dimension.
pub const DIM: usize = 16;
/// Hidden units of the policy MLP.
pub const HIDDEN: usize = 32;
/// Number of actions.
pub const ACTIONS: usize = 8;
/// Number of fixed contexts.
pub const CONTEXTS: usize = 32;
/// Training ranks (tensor parallel degree).
pub const TRAIN_TP: usize = 4;
/// Rollout tensor parallel degree.
pub const ROLLOUT_TP: usize = 2;
/// Rollout data parallel degree (replicas).
pub const ROLLOUT_DP: usize = 2;
/// Ranks per node, both groups.
pub const RANKS_PER_NODE: usize = 2;
/// Steps over which the start and end rewards are averaged.
pub const SUMMARY_WINDOW: usize = 5;

/// Hidden units per training rank.
const HS: usize = HIDDEN / TRAIN_TP;
/// Offsets inside a training rank's fused buffer `"params"`.
const AT_W1: usize = 0;
const AT_B1: usize = AT_W1 + HS * DIM;
const AT_W2: usize = AT_B1 + HS;
const AT_B2: usize = AT_W2 + ACTIONS * HS;
/// Elements of a training rank's fused buffer.
const PARAMS_LEN: usize = AT_B2 + ACTIONS;
/// Hidden units per rollout rank.
const RHS: usize = HIDDEN / ROLLOUT_TP;

/// Which refit strategy (or both, one after the other) the demo runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoMode {
    /// Reshard only.
    Reshard,
    /// The gather-broadcast baseline only.
    Baseline,
    /// The whole loop twice from the same seed: reshard, then baseline.
    Both,
}

impl DemoMode {
    /// The strategies to run, in order.
    pub fn strategies(self) -> Vec<Strategy> {
        match self {
            DemoMode::Reshard => vec![Strategy::Reshard],
            DemoMode::Baseline => vec![Strategy::Baseline],
            DemoMode::Both => vec![Strategy::Reshard, Strategy::Baseline],
        }
    }
}

/// Settings of a demo run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DemoConfig {
    /// Optimizer steps (after the initial refit).
    pub steps: usize,
    /// Samples per step (even: each rollout replica does half).
    pub batch: usize,
    /// SGD learning rate.
    pub lr: f32,
    /// Seeds the task, the initial weights and the sampling.
    pub seed: u64,
    /// Reshard, baseline, or both.
    pub mode: DemoMode,
    /// Refit after every step (false: only the initial refit happens).
    pub refit: bool,
    /// Every training and rollout rank in an OS process of its own (actors
    /// over the authenticated control plane, weights over the node fabric),
    /// instead of all in this process.
    pub processes: bool,
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig { steps: 200, batch: 128, lr: 2.0, seed: 1, mode: DemoMode::Both, refit: true, processes: false }
    }
}

/// Why the demo failed.
#[derive(Debug, Error)]
pub enum DemoError {
    /// Invalid settings.
    #[error("invalid demo settings: {0}")]
    Config(String),
    /// A refit failed (the rollout ranks keep serving the last version).
    #[error("refit of version {version} failed: {source}")]
    Refit {
        /// The version.
        version: u64,
        /// Why.
        source: RefitError,
    },
    /// The refit system could not be set up (its layouts cannot be
    /// planned, say).
    #[error("refit setup: {0}")]
    Setup(#[from] RefitError),
    /// A trainer or rollout actor failed or could not be reached.
    #[error("{0}")]
    Actor(String),
    /// The demo's own invariants were violated.
    #[error("{0}")]
    Inconsistent(String),
    /// The tokio runtime could not be built.
    #[error("tokio runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

/// Checks the settings.
pub fn validate(config: &DemoConfig) -> Result<(), DemoError> {
    if config.steps == 0 || config.steps > 1_000_000 {
        return Err(DemoError::Config(format!("steps must be between 1 and 1000000, got {}", config.steps)));
    }
    if config.batch < ROLLOUT_DP || !config.batch.is_multiple_of(ROLLOUT_DP) || config.batch > 1 << 20 {
        return Err(DemoError::Config(format!("batch must be a positive multiple of {ROLLOUT_DP} up to 2^20, got {}", config.batch)));
    }
    if !(config.lr.is_finite() && config.lr > 0.0) {
        return Err(DemoError::Config(format!("lr must be a positive number, got {}", config.lr)));
    }
    Ok(())
}

/// Runs the demo on a fresh multi-threaded tokio runtime. Must not be called
/// from inside a tokio runtime (use [`run_demo_async`] there). With
/// `progress`, draws a progress bar on stderr while running.
pub fn run_demo(config: DemoConfig, progress: bool) -> Result<DemoReport, DemoError> {
    validate(&config)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(run_demo_async(config, progress))
}

/// [`run_demo`] inside an existing tokio runtime.
pub async fn run_demo_async(config: DemoConfig, progress: bool) -> Result<DemoReport, DemoError> {
    validate(&config)?;
    let mut runs = Vec::new();
    for mode in config.mode.strategies() {
        let bar = progress.then(|| {
            let bar = ProgressBar::with_draw_target(Some(config.steps as u64), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template("{prefix:>8} [{bar:32.cyan/blue}] {pos}/{len} steps  {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
            bar.set_style(style);
            bar.set_prefix(mode.to_string());
            bar
        });
        let run = run_once(&config, mode, bar.as_ref()).await;
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        runs.push(run?);
    }
    Ok(DemoReport { config, runs })
}

async fn run_once(config: &DemoConfig, mode: Strategy, bar: Option<&ProgressBar>) -> Result<RunReport, DemoError> {
    let started = Instant::now();
    let (src, dst) = layouts()?;
    let task = Task::new(config.seed);
    let (steps, mut summary, orchestrator, processes) = if config.processes {
        let cast = ProcessCast::start(&src, &dst, mode).await?;
        let result = drive(config, mode, &task, &cast.orchestrator, &cast.trainers, &cast.rollouts, bar).await;
        let (steps, summary) = result?;
        let plans = cast.orchestrator.plans_made().await.map_err(|e| DemoError::Actor(e.to_string()))?;
        (steps, RunSummary { plans_made: plans, ..summary }, None, cast.children.pids())
    } else {
        let system = spawn_refit(&src, &dst, OrchestratorConfig { mode, ..OrchestratorConfig::default() }).await?;
        let trainers: ActorGroup<Trainer> =
            spawn_group(TRAIN_TP, SpawnConfig::default().name("trainer"), |r| Trainer::new(r, system.src_stores[r].clone()));
        let rollouts: ActorGroup<Rollout> =
            spawn_group(ROLLOUT_DP * ROLLOUT_TP, SpawnConfig::default().name("rollout"), |r| Rollout::new(r, system.dst_stores[r].clone()));
        let result = drive(config, mode, &task, &system.orchestrator, &trainers, &rollouts, bar).await;
        trainers.stop();
        rollouts.stop();
        system.src_members.stop();
        system.dst_members.stop();
        let (steps, summary) = result?;
        (steps, summary, Some(system.orchestrator), Vec::new())
    };
    if let Some(o) = orchestrator {
        summary.plans_made = o.plans_made().await.map_err(|e| DemoError::Actor(e.to_string()))?;
        o.actor().stop();
    }
    summary.wall_s = started.elapsed().as_secs_f64();
    Ok(RunReport { mode, steps, summary, processes })
}
