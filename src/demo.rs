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
//! **One step.** The [`Rollout`] actors take one [`DstStore::snapshot`] per
//! batch and compute partial logits for their hidden slice; the driver sums
//! the two TP ranks of each replica, samples actions (each replica serves
//! half of the batch) and scores them. The [`Trainer`] actors recompute the
//! forward pass on those samples with the training weights, the driver sums
//! their partial logits (the tensor-parallel all-reduce) and sends every
//! trainer the per-sample logit gradients; each trainer computes its shard
//! gradients and applies SGD with [`SrcStore::update`] (version `v`).
//! Then the orchestrator refits version `v` into the rollout ranks.
//! Without refit, the rollout ranks keep serving the initial weights and the
//! reward stays flat: the learning is carried by refit alone.

use actors::{async_trait, spawn, spawn_group, Actor, ActorError, ActorGroup, Context, GroupError, SpawnConfig};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use orchestrator::rendezvous::ControlConfig;
use orchestrator::{
    join, spawn_orchestrator, spawn_refit, DstStore, Fabric, JoinConfig, NodeFabric, OrchestratorConfig, OrchestratorHandle, RefitError,
    Rendezvous, Role, SrcStore,
};
use reshard::{parse_layout, Group, Layout, Strategy};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
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
    /// Mean reward of the first [`SUMMARY_WINDOW`] steps.
    pub reward_start: f64,
    /// Mean reward of the last [`SUMMARY_WINDOW`] steps.
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

/// What [`run_demo`] did: one run per strategy, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct DemoReport {
    /// The settings.
    pub config: DemoConfig,
    /// The runs (reshard first with [`DemoMode::Both`]).
    pub runs: Vec<RunReport>,
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

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
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

/// A tiny deterministic RNG (splitmix64).
#[derive(Clone, Debug)]
pub struct SplitMix(u64);

impl SplitMix {
    /// A generator for `seed` (`stream` separates independent streams).
    pub fn new(seed: u64, stream: u64) -> SplitMix {
        let mut r = SplitMix(seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
        r.next_u64();
        r
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[-a, a)`.
    pub fn symmetric(&mut self, a: f32) -> f32 {
        ((self.unit() * 2.0 - 1.0) * a as f64) as f32
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.unit() * n as f64) as usize % n
    }
}

/// The bandit: contexts and their target actions.
#[derive(Clone, Debug)]
struct Task {
    /// `CONTEXTS × DIM`, row-major.
    contexts: Vec<f32>,
    targets: Vec<usize>,
}

impl Task {
    fn new(seed: u64) -> Task {
        let mut rng = SplitMix::new(seed, 1);
        let contexts = (0..CONTEXTS * DIM).map(|_| rng.symmetric(1.0)).collect();
        let targets = (0..CONTEXTS).map(|_| rng.below(ACTIONS)).collect();
        Task { contexts, targets }
    }

    fn context(&self, k: usize) -> &[f32] {
        &self.contexts[k * DIM..(k + 1) * DIM]
    }
}

/// Full (unsharded) initial weights.
struct InitWeights {
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
}

impl InitWeights {
    fn new(seed: u64) -> InitWeights {
        let mut rng = SplitMix::new(seed, 2);
        let bound = (6.0 / DIM as f32).sqrt();
        let w1 = (0..HIDDEN * DIM).map(|_| rng.symmetric(bound)).collect();
        let b1 = (0..HIDDEN).map(|_| rng.symmetric(0.1)).collect();
        // Small output weights: the initial policy is close to uniform.
        let w2 = (0..ACTIONS * HIDDEN).map(|_| rng.symmetric(0.01)).collect();
        let b2 = vec![0.0; ACTIONS];
        InitWeights { w1, b1, w2, b2 }
    }

    /// Training rank `t`'s fused buffer.
    fn fused(&self, t: usize) -> Vec<f32> {
        let mut p = vec![0.0; PARAMS_LEN];
        p[AT_W1..AT_B1].copy_from_slice(&self.w1[t * HS * DIM..(t + 1) * HS * DIM]);
        p[AT_B1..AT_W2].copy_from_slice(&self.b1[t * HS..(t + 1) * HS]);
        for a in 0..ACTIONS {
            p[AT_W2 + a * HS..AT_W2 + (a + 1) * HS].copy_from_slice(&self.w2[a * HIDDEN + t * HS..a * HIDDEN + (t + 1) * HS]);
        }
        p[AT_B2..].copy_from_slice(&self.b2);
        p
    }
}

/// The training group's layout (layout file format): TP4 in f32, each rank's
/// shards fused in its buffer `"params"`.
pub fn training_layout_json() -> String {
    let shards = |offset: &dyn Fn(usize) -> Vec<usize>, extent: Vec<usize>, at: usize| -> Value {
        (0..TRAIN_TP)
            .map(|t| json!({"rank": t, "offset": offset(t), "extent": extent, "buffer": "params", "at": at}))
            .collect::<Vec<_>>()
            .into()
    };
    json!({
        "ranks": TRAIN_TP, "ranks_per_node": RANKS_PER_NODE,
        "tensors": [
            {"name": "w1", "dtype": "f32", "shape": [HIDDEN, DIM], "shards": shards(&|t| vec![t * HS, 0], vec![HS, DIM], AT_W1)},
            {"name": "b1", "dtype": "f32", "shape": [HIDDEN], "shards": shards(&|t| vec![t * HS], vec![HS], AT_B1)},
            {"name": "w2", "dtype": "f32", "shape": [ACTIONS, HIDDEN], "shards": shards(&|t| vec![0, t * HS], vec![ACTIONS, HS], AT_W2)},
            {"name": "b2", "dtype": "f32", "shape": [ACTIONS], "shards": shards(&|_| vec![0], vec![ACTIONS], AT_B2)},
        ]
    })
    .to_string()
}

/// The rollout group's layout (layout file format): a `[dp, tp]` = `[2, 2]`
/// mesh, 2 ranks per node, bf16.
pub fn rollout_layout_json() -> String {
    let mesh = json!({"shape": [ROLLOUT_DP, ROLLOUT_TP]});
    json!({
        "ranks": ROLLOUT_DP * ROLLOUT_TP, "ranks_per_node": RANKS_PER_NODE,
        "tensors": [
            {"name": "w1", "dtype": "bf16", "shape": [HIDDEN, DIM], "mesh": mesh, "placements": ["replicate", "shard(0)"]},
            {"name": "b1", "dtype": "bf16", "shape": [HIDDEN], "mesh": mesh, "placements": ["replicate", "shard(0)"]},
            {"name": "w2", "dtype": "bf16", "shape": [ACTIONS, HIDDEN], "mesh": mesh, "placements": ["replicate", "shard(1)"]},
            {"name": "b2", "dtype": "bf16", "shape": [ACTIONS], "mesh": mesh, "placements": ["replicate", "replicate"]},
        ]
    })
    .to_string()
}

/// Both layouts, parsed.
pub fn layouts() -> Result<(Layout, Layout), DemoError> {
    let src = parse_layout(&training_layout_json()).map_err(|e| DemoError::Inconsistent(format!("training layout: {e}")))?;
    let dst = parse_layout(&rollout_layout_json()).map_err(|e| DemoError::Inconsistent(format!("rollout layout: {e}")))?;
    Ok((src, dst))
}

/// Partial logits of one tensor-parallel rank for `xs` (`n × DIM`):
/// `W2_t relu(W1_t x + b1_t)` over its `hs` hidden units, plus `b2` if given.
/// `w2` is `[ACTIONS, hs]` row-major. Also returns the pre-activations.
fn partial_forward(xs: &[f32], w1: &[f32], b1: &[f32], w2: &[f32], b2: Option<&[f32]>, hs: usize) -> (Vec<f32>, Vec<f32>) {
    let n = xs.len() / DIM;
    let mut z = vec![0.0f32; n * hs];
    let mut logits = vec![0.0f32; n * ACTIONS];
    for i in 0..n {
        let x = &xs[i * DIM..(i + 1) * DIM];
        let zi = &mut z[i * hs..(i + 1) * hs];
        for j in 0..hs {
            zi[j] = b1[j] + w1[j * DIM..(j + 1) * DIM].iter().zip(x).map(|(w, x)| w * x).sum::<f32>();
        }
        for a in 0..ACTIONS {
            let row = &w2[a * hs..(a + 1) * hs];
            let mut s = b2.map_or(0.0, |b| b[a]);
            for j in 0..hs {
                s += row[j] * zi[j].max(0.0);
            }
            logits[i * ACTIONS + a] = s;
        }
    }
    (logits, z)
}

fn softmax(logits: &[f32]) -> Vec<f64> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|v| v / s).collect()
}

fn add_into(acc: &mut [f32], part: &[f32]) -> Result<(), DemoError> {
    if acc.len() != part.len() {
        return Err(DemoError::Inconsistent(format!("partial logits of {} values, expected {}", part.len(), acc.len())));
    }
    acc.iter_mut().zip(part).for_each(|(a, p)| *a += p);
    Ok(())
}

/// Messages of a [`Trainer`].
#[derive(Debug, Serialize, Deserialize)]
pub enum TrainerMsg {
    /// Write the initial weights (one optimizer "step" from zero).
    Init(Arc<Vec<f32>>),
    /// Partial logits for the samples `xs` (`n × DIM`) with the training weights.
    Forward(Arc<Vec<f32>>),
    /// Compute this rank's gradients for `dlogits` (`n × ACTIONS`, the
    /// gradient of the loss w.r.t. the all-reduced logits) at `xs`, and take
    /// one SGD step.
    Step {
        /// The samples' contexts.
        xs: Arc<Vec<f32>>,
        /// Loss gradient per sample and action.
        dlogits: Arc<Vec<f32>>,
        /// Learning rate.
        lr: f32,
    },
}

/// Replies of a [`Trainer`].
#[derive(Debug, Serialize, Deserialize)]
pub enum TrainerReply {
    /// The weights' new version.
    Version(u64),
    /// Partial logits, `n × ACTIONS`.
    Logits(Vec<f32>),
}

/// A training rank: owns hidden units `rank*HS..(rank+1)*HS` and writes its
/// weights only through its [`SrcStore`].
pub struct Trainer {
    rank: usize,
    store: Arc<SrcStore>,
}

impl Trainer {
    /// The trainer of training rank `rank`.
    pub fn new(rank: usize, store: Arc<SrcStore>) -> Trainer {
        Trainer { rank, store }
    }
}

/// Splits a fused buffer into (w1, b1, w2, b2).
fn split_params(p: &[f32]) -> (&[f32], &[f32], &[f32], &[f32]) {
    (&p[AT_W1..AT_B1], &p[AT_B1..AT_W2], &p[AT_W2..AT_B2], &p[AT_B2..])
}

/// One SGD step on a fused buffer for the samples `xs` and `dlogits`.
fn sgd_step(p: &mut [f32], xs: &[f32], dlogits: &[f32], lr: f32) {
    let n = xs.len() / DIM;
    let (w1, b1, w2, _) = split_params(p);
    let (_, z) = partial_forward(xs, w1, b1, w2, None, HS);
    let mut gw1 = vec![0.0f32; HS * DIM];
    let mut gb1 = vec![0.0f32; HS];
    let mut gw2 = vec![0.0f32; ACTIONS * HS];
    let mut gb2 = vec![0.0f32; ACTIONS];
    for i in 0..n {
        let x = &xs[i * DIM..(i + 1) * DIM];
        let zi = &z[i * HS..(i + 1) * HS];
        let g = &dlogits[i * ACTIONS..(i + 1) * ACTIONS];
        for a in 0..ACTIONS {
            gb2[a] += g[a];
            for j in 0..HS {
                gw2[a * HS + j] += g[a] * zi[j].max(0.0);
            }
        }
        for j in 0..HS {
            if zi[j] <= 0.0 {
                continue;
            }
            let dz: f32 = (0..ACTIONS).map(|a| g[a] * w2[a * HS + j]).sum();
            gb1[j] += dz;
            for d in 0..DIM {
                gw1[j * DIM + d] += dz * x[d];
            }
        }
    }
    let apply = |dst: &mut [f32], g: &[f32]| dst.iter_mut().zip(g).for_each(|(w, g)| *w -= lr * g);
    apply(&mut p[AT_W1..AT_B1], &gw1);
    apply(&mut p[AT_B1..AT_W2], &gb1);
    apply(&mut p[AT_W2..AT_B2], &gw2);
    apply(&mut p[AT_B2..], &gb2);
}

#[async_trait]
impl Actor for Trainer {
    type Msg = TrainerMsg;
    type Reply = TrainerReply;

    async fn handle(&mut self, msg: TrainerMsg, _ctx: &mut Context<Self>) -> Result<TrainerReply, ActorError> {
        match msg {
            TrainerMsg::Init(values) => {
                let (v, ()) = self
                    .store
                    .try_update(|b| b.write_buffer_f32("params", &values))
                    .await
                    .map_err(|e| ActorError::failed(format!("trainer {}: {e}", self.rank)))?;
                Ok(TrainerReply::Version(v))
            }
            TrainerMsg::Forward(xs) => {
                let p = self.store.read(|b| b.buffer_to_f32("params")).await;
                let p = p.map_err(|e| ActorError::failed(format!("trainer {}: {e}", self.rank)))?;
                let (w1, b1, w2, b2) = split_params(&p);
                // The bias b2 is replicated; rank 0 adds it once.
                let (logits, _) = partial_forward(&xs, w1, b1, w2, (self.rank == 0).then_some(b2), HS);
                Ok(TrainerReply::Logits(logits))
            }
            TrainerMsg::Step { xs, dlogits, lr } => {
                let (v, ()) = self
                    .store
                    .try_update(|b| {
                        let mut p = b.buffer_to_f32("params")?;
                        sgd_step(&mut p, &xs, &dlogits, lr);
                        b.write_buffer_f32("params", &p)
                    })
                    .await
                    .map_err(|e| ActorError::failed(format!("trainer {}: {e}", self.rank)))?;
                Ok(TrainerReply::Version(v))
            }
        }
    }
}

/// Messages of a [`Rollout`] actor.
#[derive(Debug, Serialize, Deserialize)]
pub struct RolloutMsg {
    /// The committed version the whole inference group agreed to serve.
    pub version: u64,
    /// Contexts of this replica's samples, `n × DIM`.
    pub xs: Arc<Vec<f32>>,
}

/// Reply of a [`Rollout`] actor.
#[derive(Debug, Serialize, Deserialize)]
pub struct RolloutReply {
    /// The committed version the logits were computed with.
    pub version: u64,
    /// Partial logits, `n × ACTIONS`.
    pub logits: Vec<f32>,
}

/// An inference rank at mesh position `(dp, tp)`: reads its weights only
/// through [`DstStore::snapshot_at`], one snapshot of the agreed version
/// per batch.
pub struct Rollout {
    tp: usize,
    store: Arc<DstStore>,
}

impl Rollout {
    /// The rollout actor of inference rank `rank` (`dp = rank / 2`, `tp = rank % 2`).
    pub fn new(rank: usize, store: Arc<DstStore>) -> Rollout {
        Rollout { tp: rank % ROLLOUT_TP, store }
    }
}

#[async_trait]
impl Actor for Rollout {
    type Msg = RolloutMsg;
    type Reply = RolloutReply;

    async fn handle(&mut self, msg: RolloutMsg, _ctx: &mut Context<Self>) -> Result<RolloutReply, ActorError> {
        // The version the group agreed on, for the whole batch, whatever
        // commits meanwhile.
        let snap = self
            .store
            .snapshot_at(msg.version)
            .ok_or_else(|| ActorError::failed(format!("rollout: version {} is not served here", msg.version)))?;
        let read = |name: &str, len: usize| -> Result<Vec<f32>, ActorError> {
            match snap.buffers.tensor(name).and_then(|t| t.to_f32()) {
                Ok(v) if v.len() == len => Ok(v),
                Ok(v) => Err(ActorError::failed(format!("rollout tensor '{name}' has {} values here, expected {len}", v.len()))),
                Err(e) => Err(ActorError::failed(format!("rollout: {e}"))),
            }
        };
        let (w1, b1, w2, b2) = (read("w1", RHS * DIM)?, read("b1", RHS)?, read("w2", ACTIONS * RHS)?, read("b2", ACTIONS)?);
        let (logits, _) = partial_forward(&msg.xs, &w1, &b1, &w2, (self.tp == 0).then_some(&b2[..]), RHS);
        Ok(RolloutReply { version: snap.version, logits })
    }
}

fn actor_error(what: &str, e: GroupError) -> DemoError {
    DemoError::Actor(format!("{what}: {e}"))
}

fn same_version(what: &str, versions: impl IntoIterator<Item = u64>) -> Result<u64, DemoError> {
    let versions: Vec<u64> = versions.into_iter().collect();
    match versions.first() {
        Some(&v) if versions.iter().all(|&w| w == v) => Ok(v),
        _ => Err(DemoError::Inconsistent(format!("{what}: ranks disagree on the version: {versions:?}"))),
    }
}

fn trainer_versions(replies: Vec<TrainerReply>) -> Result<Vec<u64>, DemoError> {
    replies
        .into_iter()
        .map(|r| match r {
            TrainerReply::Version(v) => Ok(v),
            other => Err(DemoError::Inconsistent(format!("trainer answered {other:?}, expected a version"))),
        })
        .collect()
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

/// Which part a demo member process plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoRole {
    /// A training rank: a [`Trainer`] and its source member.
    Trainer,
    /// An inference rank: a [`Rollout`] and its destination member.
    Rollout,
}

impl DemoRole {
    fn name(self, rank: usize) -> String {
        match self {
            DemoRole::Trainer => format!("demo.trainer.{rank}"),
            DemoRole::Rollout => format!("demo.rollout.{rank}"),
        }
    }
}

const JOIN_WITHIN: Duration = Duration::from_secs(60);

/// The demo with every rank in a process of its own.
struct ProcessCast {
    // Dropped last: the processes outlive nothing that talks to them.
    orchestrator: OrchestratorHandle,
    trainers: ActorGroup<Trainer>,
    rollouts: ActorGroup<Rollout>,
    _rendezvous: Rendezvous,
    children: crate::procs::Children,
}

impl ProcessCast {
    async fn start(src: &Layout, dst: &Layout, mode: Strategy) -> Result<ProcessCast, DemoError> {
        let actor = |e: orchestrator::JoinError| DemoError::Actor(e.to_string());
        let control_secret = crate::cluster::ControlSecret::random();
        let secret = control_secret.secret().map_err(DemoError::Actor)?;
        let secret_text = control_secret.text();
        let bind = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let rendezvous = Rendezvous::bind(secret, bind, &ControlConfig::default()).await.map_err(actor)?;
        let exe = std::env::current_exe()?;
        let mut children = crate::procs::Children::new(&exe, rendezvous.addr(), secret_text, false);
        for (role, n) in [(DemoRole::Trainer, TRAIN_TP), (DemoRole::Rollout, ROLLOUT_DP * ROLLOUT_TP)] {
            for rank in 0..n {
                let role = format!("{role:?}").to_lowercase();
                children
                    .spawn(vec!["demo-member".into(), "--role".into(), role, "--rank".into(), rank.to_string()])
                    .map_err(DemoError::Actor)?;
            }
        }
        let src_members = rendezvous.members(Group::Src, src.ranks(), JOIN_WITHIN).await.map_err(actor)?;
        let dst_members = rendezvous.members(Group::Dst, dst.ranks(), JOIN_WITHIN).await.map_err(actor)?;
        let mut trainers = Vec::new();
        for r in 0..TRAIN_TP {
            trainers.push(rendezvous.lookup::<Trainer>(&DemoRole::Trainer.name(r), JOIN_WITHIN).await.map_err(actor)?);
        }
        let mut rollouts = Vec::new();
        for r in 0..ROLLOUT_DP * ROLLOUT_TP {
            rollouts.push(rendezvous.lookup::<Rollout>(&DemoRole::Rollout.name(r), JOIN_WITHIN).await.map_err(actor)?);
        }
        let config = OrchestratorConfig { mode, fabric: Fabric::Node(NodeFabric::default()), ..OrchestratorConfig::default() };
        Ok(ProcessCast {
            orchestrator: spawn_orchestrator(src_members, dst_members, config),
            trainers: ActorGroup::from_refs(trainers),
            rollouts: ActorGroup::from_refs(rollouts),
            _rendezvous: rendezvous,
            children,
        })
    }
}

/// A demo member process (`refit demo-member`): joins the rendezvous in
/// `REFIT_RENDEZVOUS` with the secret in `REFIT_SECRET`, holds one rank's
/// weights, serves that rank's refit member and its trainer or rollout
/// actor, until the demo's driver goes away.
pub fn run_demo_member(role: DemoRole, rank: u32) -> Result<(), DemoError> {
    let (src, dst) = layouts()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async move {
        let actor = |e: orchestrator::JoinError| DemoError::Actor(e.to_string());
        let joined = join(&JoinConfig::from_env().map_err(actor)?).await.map_err(actor)?;
        let name = role.name(rank as usize);
        match role {
            DemoRole::Trainer => {
                let src = Arc::new(src);
                let store = Arc::new(SrcStore::new(&src, rank));
                joined.serve_member(src, rank, Role::Src(store.clone())).await.map_err(actor)?;
                let trainer = spawn(Trainer::new(rank as usize, store), SpawnConfig::default().name(name.clone()));
                joined.serve(&name, &trainer).await.map_err(actor)?;
            }
            DemoRole::Rollout => {
                let dst = Arc::new(dst);
                let store = Arc::new(DstStore::new(&dst, rank));
                joined.serve_member(dst, rank, Role::Dst(store.clone())).await.map_err(actor)?;
                let rollout = spawn(Rollout::new(rank as usize, store), SpawnConfig::default().name(name.clone()));
                joined.serve(&name, &rollout).await.map_err(actor)?;
            }
        }
        joined.closed().await;
        joined.shutdown();
        Ok(())
    })
}

async fn drive(
    config: &DemoConfig,
    mode: Strategy,
    task: &Task,
    orchestrator: &OrchestratorHandle,
    trainers: &ActorGroup<Trainer>,
    rollouts: &ActorGroup<Rollout>,
    bar: Option<&ProgressBar>,
) -> Result<(Vec<StepRecord>, RunSummary), DemoError> {
    // Version 1: the seeded initial weights, refit once so that rollouts
    // start from the same policy as the trainers.
    let init = InitWeights::new(config.seed);
    let fused: Vec<Arc<Vec<f32>>> = (0..TRAIN_TP).map(|t| Arc::new(init.fused(t))).collect();
    let replies = trainers.call_all(|r| TrainerMsg::Init(fused[r].clone())).await.map_err(|e| actor_error("init", e))?;
    let mut version = same_version("init", trainer_versions(replies)?)?;
    let first = orchestrator.refit(version).await.map_err(|source| DemoError::Refit { version, source })?;
    // The version every rollout rank reads: the last one committed.
    let mut agreed = version;

    let mut rng = SplitMix::new(config.seed, 3);
    let batch = config.batch;
    let half = batch / ROLLOUT_DP;
    let mut records = Vec::with_capacity(config.steps);
    for step in 0..config.steps {
        // Rollouts with the committed weights; replica d serves samples d*half..(d+1)*half.
        let picks: Vec<usize> = (0..batch).map(|_| rng.below(CONTEXTS)).collect();
        let xs: Vec<f32> = picks.iter().flat_map(|&k| task.context(k).iter().copied()).collect();
        let per_replica: Vec<Arc<Vec<f32>>> =
            (0..ROLLOUT_DP).map(|d| Arc::new(xs[d * half * DIM..(d + 1) * half * DIM].to_vec())).collect();
        let replies = rollouts
            .call_all(|r| RolloutMsg { version: agreed, xs: per_replica[r / ROLLOUT_TP].clone() })
            .await
            .map_err(|e| actor_error("rollout", e))?;
        let served = same_version("rollout", replies.iter().map(|r| r.version))?;
        let mut logits = vec![0.0f32; batch * ACTIONS];
        for (r, reply) in replies.iter().enumerate() {
            let d = r / ROLLOUT_TP;
            add_into(&mut logits[d * half * ACTIONS..(d + 1) * half * ACTIONS], &reply.logits)?;
        }
        let mut actions = Vec::with_capacity(batch);
        let mut rewards = Vec::with_capacity(batch);
        for (i, &k) in picks.iter().enumerate() {
            let p = softmax(&logits[i * ACTIONS..(i + 1) * ACTIONS]);
            let u = rng.unit();
            let mut acc = 0.0;
            let a = p.iter().position(|&q| {
                acc += q;
                u < acc
            });
            let a = a.unwrap_or(ACTIONS - 1);
            actions.push(a);
            rewards.push(if a == task.targets[k] { 1.0 } else { 0.0 });
        }
        let reward = mean(&rewards);

        // Trainers: forward on the same samples with the training weights;
        // the sum of their partial logits is the tensor-parallel all-reduce.
        let xs = Arc::new(xs);
        let replies = trainers.call_all(|_| TrainerMsg::Forward(xs.clone())).await.map_err(|e| actor_error("trainer forward", e))?;
        let mut logits = vec![0.0f32; batch * ACTIONS];
        for reply in replies {
            match reply {
                TrainerReply::Logits(part) => add_into(&mut logits, &part)?,
                other => return Err(DemoError::Inconsistent(format!("trainer answered {other:?} to Forward"))),
            }
        }
        // REINFORCE with a mean-reward baseline: loss = -1/B Σ (r - b) log π(a|x),
        // so dloss/dlogits = (r - b) / B · (π - onehot(a)).
        let mut dlogits = vec![0.0f32; batch * ACTIONS];
        for i in 0..batch {
            let p = softmax(&logits[i * ACTIONS..(i + 1) * ACTIONS]);
            let adv = (rewards[i] - reward) / batch as f64;
            for a in 0..ACTIONS {
                let onehot = if a == actions[i] { 1.0 } else { 0.0 };
                dlogits[i * ACTIONS + a] = (adv * (p[a] - onehot)) as f32;
            }
        }
        let dlogits = Arc::new(dlogits);
        let replies = trainers
            .call_all(|_| TrainerMsg::Step { xs: xs.clone(), dlogits: dlogits.clone(), lr: config.lr })
            .await
            .map_err(|e| actor_error("trainer step", e))?;
        version = same_version("step", trainer_versions(replies)?)?;

        let (refit_ms, refit_bytes) = if config.refit {
            let report = orchestrator.refit(version).await.map_err(|source| DemoError::Refit { version, source })?;
            if report.mode != mode {
                return Err(DemoError::Inconsistent(format!("refit ran {} instead of {mode}", report.mode)));
            }
            agreed = report.version;
            (report.wall.as_secs_f64() * 1e3, report.bytes)
        } else {
            (0.0, 0)
        };
        records.push(StepRecord { step, reward, refit_ms, refit_bytes, version_served: served });
        if let Some(bar) = bar {
            let recent = &records[records.len().saturating_sub(SUMMARY_WINDOW)..];
            bar.set_message(format!("reward {:.3}  served v{served}", mean(&recent.iter().map(|r| r.reward).collect::<Vec<_>>())));
            bar.inc(1);
        }
    }

    let rewards: Vec<f64> = records.iter().map(|r| r.reward).collect();
    let w = SUMMARY_WINDOW.min(rewards.len());
    let mut ms: Vec<f64> = records.iter().filter(|_| config.refit).map(|r| r.refit_ms).collect();
    ms.sort_by(f64::total_cmp);
    let mut bytes: Vec<u64> = records.iter().filter(|_| config.refit).map(|r| r.refit_bytes).collect();
    bytes.sort_unstable();
    let summary = RunSummary {
        reward_start: mean(&rewards[..w]),
        reward_end: mean(&rewards[rewards.len() - w..]),
        median_refit_ms: ms.get(ms.len() / 2).copied().unwrap_or(0.0),
        median_refit_bytes: bytes.get(bytes.len() / 2).copied().unwrap_or(0),
        total_refit_bytes: bytes.iter().sum(),
        initial_refit_ms: first.wall.as_secs_f64() * 1e3,
        initial_refit_bytes: first.bytes,
        plans_made: 0,
        wall_s: 0.0,
    };
    Ok((records, summary))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sharded forward pass equals the unsharded one, and the fused
    /// buffers hold exactly the layout's shards.
    #[test]
    fn sharded_forward_matches_full() {
        let init = InitWeights::new(5);
        let task = Task::new(5);
        let xs = task.contexts[..4 * DIM].to_vec();
        let (full, _) = partial_forward(&xs, &init.w1, &init.b1, &init.w2, Some(&init.b2), HIDDEN);
        let mut sum = vec![0.0f32; full.len()];
        for t in 0..TRAIN_TP {
            let p = init.fused(t);
            let (w1, b1, w2, b2) = split_params(&p);
            let (part, _) = partial_forward(&xs, w1, b1, w2, (t == 0).then_some(b2), HS);
            add_into(&mut sum, &part).unwrap();
        }
        for (a, b) in full.iter().zip(&sum) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        let (src, dst) = layouts().unwrap();
        assert_eq!(src.ranks(), 4);
        assert_eq!(dst.ranks(), 4);
    }

    /// The SGD step follows the gradient of `Σ dlogits · logits` (checked
    /// against finite differences on one training shard).
    #[test]
    fn gradient_matches_finite_differences() {
        let init = InitWeights::new(9);
        let task = Task::new(9);
        let xs = task.contexts[..3 * DIM].to_vec();
        let mut rng = SplitMix::new(9, 7);
        let g: Vec<f32> = (0..3 * ACTIONS).map(|_| rng.symmetric(1.0)).collect();
        let p0 = init.fused(1);
        let loss = |p: &[f32]| -> f64 {
            let (w1, b1, w2, b2) = split_params(p);
            let (l, _) = partial_forward(&xs, w1, b1, w2, Some(b2), HS);
            l.iter().zip(&g).map(|(l, g)| (*l as f64) * (*g as f64)).sum()
        };
        let lr = 1e-3;
        let mut p1 = p0.clone();
        sgd_step(&mut p1, &xs, &g, lr);
        for i in (0..PARAMS_LEN).step_by(7) {
            let grad = (p0[i] - p1[i]) as f64 / lr as f64;
            let h = 1e-2;
            let (mut up, mut down) = (p0.clone(), p0.clone());
            up[i] += h;
            down[i] -= h;
            let numeric = (loss(&up) - loss(&down)) / (2.0 * h as f64);
            assert!((grad - numeric).abs() < 2e-2 * (1.0 + numeric.abs()), "param {i}: {grad} vs {numeric}");
        }
    }
}
