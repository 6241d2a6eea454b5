//! A training rank ([`Trainer`]): its messages, the forward pass and the
//! SGD step on its shard of the fused buffer, written only through its
//! [`SrcStore`].

use super::model::partial_forward;
use super::{ACTIONS, AT_B1, AT_B2, AT_W1, AT_W2, DIM, HS};
use actors::{async_trait, Actor, ActorError, Context};
use orchestrator::SrcStore;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

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

/// Splits a fused buffer into (w1, b1, w2, b2).
pub(super) fn split_params(p: &[f32]) -> (&[f32], &[f32], &[f32], &[f32]) {
    (&p[AT_W1..AT_B1], &p[AT_B1..AT_W2], &p[AT_W2..AT_B2], &p[AT_B2..])
}

/// One SGD step on a fused buffer for the samples `xs` and `dlogits`.
pub(super) fn sgd_step(p: &mut [f32], xs: &[f32], dlogits: &[f32], lr: f32) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::demo::model::{InitWeights, SplitMix, Task};
    use crate::demo::PARAMS_LEN;

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
