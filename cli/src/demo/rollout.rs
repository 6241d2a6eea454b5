//! An inference rank ([`Rollout`]): partial logits from one snapshot of
//! the version its group agreed on.

use super::model::partial_forward;
use super::{ACTIONS, DIM, RHS, ROLLOUT_TP};
use actors::{async_trait, Actor, ActorError, Context};
use orchestrator::DstStore;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

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
