//! Compose your own pipeline (see `docs/pipeline.md`): two training ranks
//! (TP2, f32) refit one rollout rank (bf16) after every optimizer step.
//!
//! ```sh
//! cargo run --example compose_pipeline
//! ```

use actors::{async_trait, spawn, Actor, ActorError, Context, SpawnConfig};
use orchestrator::{spawn_refit, OrchestratorConfig, SinkStore, SourceStore};
use reshard::{parse_layout, Strategy};
use std::sync::Arc;

/// One tensor `w` [4, 8]; training rank `t` holds rows `2t..2t+2`.
const TRAIN: &str = r#"{"ranks": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [4, 8], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#;
/// The rollout rank holds all of `w`, in bf16.
const ROLLOUT: &str = r#"{"ranks": 1, "tensors": [
  {"name": "w", "dtype": "bf16", "shape": [4, 8], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}"#;

/// A training rank: every step writes its shard through its store.
struct Trainer {
    rank: usize,
    store: Arc<SourceStore>,
}

#[async_trait]
impl Actor for Trainer {
    /// The step number.
    type Msg = u64;
    /// The new weight version.
    type Reply = u64;

    async fn handle(&mut self, step: u64, _ctx: &mut Context<Self>) -> Result<u64, ActorError> {
        let rank = self.rank as f32;
        // A stand-in for an optimizer step, under the version fence.
        let (version, ok) = self
            .store
            .update(|b| {
                let mut w = b.read_f32("w#0").unwrap_or_default();
                w.iter_mut().enumerate().for_each(|(i, x)| *x = 0.5 * *x + step as f32 + rank + i as f32 / 16.0);
                b.write_f32("w#0", &w)
            })
            .await;
        if !ok {
            return Err(ActorError::failed("no buffer 'w#0'"));
        }
        Ok(version)
    }
}

/// A rollout rank: reads one committed snapshot per request.
struct Rollout {
    store: Arc<SinkStore>,
}

#[async_trait]
impl Actor for Rollout {
    type Msg = ();
    /// The version served and a checksum of the weights.
    type Reply = (u64, f64);

    async fn handle(&mut self, _: (), _ctx: &mut Context<Self>) -> Result<(u64, f64), ActorError> {
        let snap = self.store.snapshot();
        let w = snap.buffers.read_f32("w#0").ok_or_else(|| ActorError::failed("no buffer 'w#0'"))?;
        Ok((snap.version, w.iter().map(|&x| x as f64).sum()))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (src, dst) = (parse_layout(TRAIN)?, parse_layout(ROLLOUT)?);
    let system = spawn_refit(&src, &dst, OrchestratorConfig { mode: Strategy::Reshard, ..OrchestratorConfig::default() });
    let trainers =
        actors::spawn_group(2, SpawnConfig::default().name("trainer"), |rank| Trainer { rank, store: system.sources[rank].clone() });
    let rollout = spawn(Rollout { store: system.sinks[0].clone() }, SpawnConfig::default().name("rollout"));

    for step in 0..4 {
        // Every training rank takes exactly one step, so all are at one version.
        let versions = trainers.call_all(|_| step).await?;
        let version = versions[0];
        let report = system.orchestrator.refit(version).await?;
        let (served, checksum) = rollout.call(()).await?;
        // The trainers' own view, for comparison (in f32; the rollout is bf16).
        let mut expected = 0.0;
        for store in &system.sources {
            expected += store.read(|b| b.read_f32("w#0").unwrap_or_default().iter().map(|&x| x as f64).sum::<f64>()).await;
        }
        println!(
            "step {step}: trained v{version}, refit {} B in {:.3} ms, rollout serves v{served}, checksum {checksum:.3} (trainers {expected:.3})",
            report.bytes,
            report.wall.as_secs_f64() * 1e3
        );
    }
    Ok(())
}
