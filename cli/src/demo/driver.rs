//! The loop itself: every step's rollouts, rewards, the trainers' forward
//! pass and SGD step, then the refit of the new version.

use super::model::{add_into, softmax, InitWeights, SplitMix, Task};
use super::report::{mean, RunSummary, StepRecord};
use super::rollout::{Rollout, RolloutMsg};
use super::trainer::{Trainer, TrainerMsg, TrainerReply};
use super::{DemoConfig, DemoError, ACTIONS, CONTEXTS, DIM, ROLLOUT_DP, ROLLOUT_TP, SUMMARY_WINDOW, TRAIN_TP};
use actors::{ActorGroup, GroupError};
use indicatif::ProgressBar;
use orchestrator::OrchestratorHandle;
use reshard::Strategy;
use std::sync::Arc;

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

pub(super) async fn drive(
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
        let (actions, rewards) = sample_actions(&mut rng, task, &picks, &logits);
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
        let dlogits = Arc::new(reinforce_gradient(&logits, &actions, &rewards));
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

    let summary = summarize(&records, config.refit, &first);
    Ok((records, summary))
}

/// Samples an action per sample from the rollouts' logits (picks[i]: the
/// context of sample i), and its reward: 1 for the context's target.
fn sample_actions(rng: &mut SplitMix, task: &Task, picks: &[usize], logits: &[f32]) -> (Vec<usize>, Vec<f64>) {
    let mut actions = Vec::with_capacity(picks.len());
    let mut rewards = Vec::with_capacity(picks.len());
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
    (actions, rewards)
}

/// REINFORCE with a mean-reward baseline: loss = -1/B Σ (r - b) log π(a|x),
/// so dloss/dlogits = (r - b) / B · (π - onehot(a)), from the trainers' logits.
fn reinforce_gradient(logits: &[f32], actions: &[usize], rewards: &[f64]) -> Vec<f32> {
    let batch = rewards.len();
    let reward = mean(rewards);
    let mut dlogits = vec![0.0f32; batch * ACTIONS];
    for i in 0..batch {
        let p = softmax(&logits[i * ACTIONS..(i + 1) * ACTIONS]);
        let adv = (rewards[i] - reward) / batch as f64;
        for a in 0..ACTIONS {
            let onehot = if a == actions[i] { 1.0 } else { 0.0 };
            dlogits[i * ACTIONS + a] = (adv * (p[a] - onehot)) as f32;
        }
    }
    dlogits
}

/// The run's summary: rewards at the start and end (over the last
/// [`SUMMARY_WINDOW`] steps), the refits' median time and bytes (`refit`:
/// whether the steps refit), and the initial refit's.
fn summarize(records: &[StepRecord], refit: bool, first: &orchestrator::RefitReport) -> RunSummary {
    let rewards: Vec<f64> = records.iter().map(|r| r.reward).collect();
    let w = SUMMARY_WINDOW.min(rewards.len());
    let mut ms: Vec<f64> = records.iter().filter(|_| refit).map(|r| r.refit_ms).collect();
    ms.sort_by(f64::total_cmp);
    let mut bytes: Vec<u64> = records.iter().filter(|_| refit).map(|r| r.refit_bytes).collect();
    bytes.sort_unstable();
    RunSummary {
        reward_start: mean(&rewards[..w]),
        reward_end: mean(&rewards[rewards.len() - w..]),
        median_refit_ms: ms.get(ms.len() / 2).copied().unwrap_or(0.0),
        median_refit_bytes: bytes.get(bytes.len() / 2).copied().unwrap_or(0),
        total_refit_bytes: bytes.iter().sum(),
        initial_refit_ms: first.wall.as_secs_f64() * 1e3,
        initial_refit_bytes: first.bytes,
        plans_made: 0,
        wall_s: 0.0,
    }
}
