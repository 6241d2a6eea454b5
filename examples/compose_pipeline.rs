//! Compose your own pipeline (see `docs/pipeline.md`): two training ranks
//! (TP2, f32) refit one rollout rank (bf16) after every optimizer step; the
//! trainer and the rollout are actors of the user's own.
//!
//! ```sh
//! cargo run --example compose_pipeline
//! ```

use actors::{async_trait, spawn, Actor, ActorError, Context, SpawnConfig};
use orchestrator::prelude::*;
use std::sync::Arc;

/// The value training step `step` gives the element of `w` at `at`.
fn value(step: u64, at: &[u64]) -> f32 {
    step as f32 + (at[0] * 8 + at[1]) as f32 / 3.0
}

/// A training rank: every step writes its shard through its store.
struct Trainer {
    store: Arc<SrcStore>,
}

#[async_trait]
impl Actor for Trainer {
    /// The step number.
    type Msg = u64;
    /// The new weight version.
    type Reply = u64;

    async fn handle(&mut self, step: u64, _ctx: &mut Context<Self>) -> Result<u64, ActorError> {
        // A stand-in for an optimizer step, under the version fence; the
        // view knows which rows of `w` this rank holds.
        let update = self.store.try_update(|b| b.tensor_mut("w")?.map_f32(|at, _| value(step, at)));
        let (version, ()) = update.await.map_err(|e| ActorError::failed(e.to_string()))?;
        Ok(version)
    }
}

/// A rollout rank: reads one committed snapshot per request.
struct Rollout {
    store: Arc<DstStore>,
}

#[async_trait]
impl Actor for Rollout {
    /// The step whose weights the rollout should serve.
    type Msg = u64;
    /// The version served and how many values match the step bit for bit.
    type Reply = (u64, usize);

    async fn handle(&mut self, step: u64, _ctx: &mut Context<Self>) -> Result<(u64, usize), ActorError> {
        let snap = self.store.snapshot().ok_or_else(|| ActorError::failed("nothing served yet"))?;
        let w = snap.buffers.tensor("w").map_err(|e| ActorError::failed(e.to_string()))?;
        let got = w.to_f32().map_err(|e| ActorError::failed(e.to_string()))?;
        // The rollout holds bf16: compare with the trainer's f32 value
        // rounded to bf16 (to nearest, ties to even), bit for bit.
        let mut exact = 0;
        w.for_each_index(|i, at| exact += usize::from(got[i].to_bits() == bf16_rounded(value(step, at)).to_bits()));
        Ok((snap.version, exact))
    }
}

/// `x` rounded to bf16 and widened back to f32.
fn bf16_rounded(x: f32) -> f32 {
    f32::from_bits(u32::from(reshard::f32_bits_to_bf16(x.to_bits())) << 16)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // `w` [4, 8]: training rank t holds rows 2t..2t+2 in f32; the rollout
    // rank holds all of it in bf16.
    let train = Layout::builder(2).tensor(TensorBuilder::new("w", DType::F32, [4, 8]).mesh([2], [MeshDim::Shard(0)])).build()?;
    let rollout = Layout::builder(1).tensor(TensorBuilder::new("w", DType::BF16, [4, 8]).mesh([1], [MeshDim::Replicate])).build()?;
    let system = spawn_refit(&train, &rollout, OrchestratorConfig::default()).await?;
    let trainers = actors::spawn_group(2, SpawnConfig::default().name("trainer"), |r| Trainer { store: system.src_stores[r].clone() });
    let rollout = spawn(Rollout { store: system.dst_stores[0].clone() }, SpawnConfig::default().name("rollout"));

    for step in 1..=4 {
        // Every training rank takes exactly one step, so all are at one version.
        trainers.call_all(|_| step).await?;
        let report = system.orchestrator.refit_latest().await?;
        let (served, exact) = rollout.call(step).await?;
        println!(
            "step {step}: refit v{} ({} bytes moved) in {:.2} ms; rollout serves v{served}: {exact}/32 values exact (bf16)",
            report.version,
            report.bytes,
            report.wall.as_secs_f64() * 1e3
        );
    }
    Ok(())
}
