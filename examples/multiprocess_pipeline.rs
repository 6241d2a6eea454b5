//! Trainer processes and rollout processes that each hold their own
//! weights, refit after every optimizer step (docs/pipeline.md, "Several
//! processes and hosts").
//!
//! This one binary plays three parts, chosen by its arguments:
//! - no argument: the **driver**. It opens a rendezvous, starts 2 trainer
//!   processes (TP2, f32, one fused buffer per rank) and 4 rollout processes
//!   (TP2 × DP2, bf16), and runs 5 steps: every trainer takes an optimizer
//!   step, the orchestrator refits, every rollout checks every value it now
//!   serves.
//! - `trainer RANK` / `rollout RANK`: a **member process**. It joins the
//!   rendezvous named in `REFIT_RENDEZVOUS` with the secret in
//!   `REFIT_SECRET`, keeps its rank's weights in a store, and serves the
//!   refit member of its rank next to its own actor.
//!
//! ```sh
//! cargo run --release --example multiprocess_pipeline
//! ```

use actors::{async_trait, spawn, Actor, ActorError, ActorGroup, Context, Secret, SpawnConfig};
use orchestrator::rendezvous::{ControlConfig, RENDEZVOUS_ENV, SECRET_ENV};
use orchestrator::{join, spawn_orchestrator, DstStore, Fabric, JoinConfig, NodeFabric, OrchestratorConfig, Rendezvous, Role, SrcStore};
use reshard::{parse_layout, DType, Group, Layout};
use serde::{Deserialize, Serialize};
use std::process::{Child, Command, ExitCode};
use std::sync::Arc;
use std::time::Duration;

/// Training: `w` [8, 6] and `b` [8], rows split over 2 ranks, both in one
/// fused f32 buffer per rank (w rows first, then b).
const TRAINING: &str = r#"{"ranks": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [8, 6], "shards": [
    {"rank": 0, "offset": [0, 0], "extent": [4, 6], "buffer": "params", "at": 0},
    {"rank": 1, "offset": [4, 0], "extent": [4, 6], "buffer": "params", "at": 0}]},
  {"name": "b", "dtype": "f32", "shape": [8], "shards": [
    {"rank": 0, "offset": [0], "extent": [4], "buffer": "params", "at": 24},
    {"rank": 1, "offset": [4], "extent": [4], "buffer": "params", "at": 24}]}]}"#;

/// Inference: 2 replicas × TP2 (rank = 2·replica + tp), rows split, bf16.
const ROLLOUT: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "bf16", "shape": [8, 6], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]},
  {"name": "b", "dtype": "bf16", "shape": [8], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]}]}"#;

const STEPS: u64 = 5;
const WAIT: Duration = Duration::from_secs(60);

/// The value of the element at global coordinates `at` of tensor `name`
/// after optimizer step `step`.
fn value(step: u64, name: &str, at: &[u64]) -> f32 {
    let index = match name {
        "w" => at[0] * 6 + at[1],
        _ => 48 + at[0],
    };
    step as f32 * 0.5 - index as f32 / 16.0
}

/// `x` as the rollout side stores it (bf16, round to nearest even).
fn as_bf16(x: f32) -> f32 {
    let mut narrow = [0u8; 2];
    reshard::convert_slice(DType::F32, &x.to_le_bytes(), DType::BF16, &mut narrow);
    f32::from_bits(u32::from(u16::from_le_bytes(narrow)) << 16)
}

/// A trainer's message: take optimizer step `n`.
#[derive(Debug, Serialize, Deserialize)]
struct Step(u64);

/// A training rank: writes its weights only through its store.
struct Trainer {
    store: Arc<SrcStore>,
}

#[async_trait]
impl Actor for Trainer {
    type Msg = Step;
    type Reply = u64;

    async fn handle(&mut self, Step(n): Step, _ctx: &mut Context<Self>) -> Result<u64, ActorError> {
        // Each tensor's block knows where it sits in the global tensor.
        let step = self.store.try_update(|buffers| {
            for name in ["w", "b"] {
                buffers.tensor_mut(name)?.map_f32(|at, _| value(n, name, at))?;
            }
            Ok::<(), orchestrator::BufferError>(())
        });
        let (version, ()) = step.await.map_err(|e| ActorError::failed(format!("trainer: {e}")))?;
        Ok(version)
    }
}

/// A rollout's message: check that weights `version` are those of step `step`.
#[derive(Debug, Serialize, Deserialize)]
struct Check {
    version: u64,
    step: u64,
}

/// An inference rank: reads its weights only through its store.
struct Rollout {
    store: Arc<DstStore>,
}

#[async_trait]
impl Actor for Rollout {
    type Msg = Check;
    type Reply = u64;

    async fn handle(&mut self, check: Check, _ctx: &mut Context<Self>) -> Result<u64, ActorError> {
        // The version the whole group agreed on, even while a commit sweeps.
        let snap = self
            .store
            .snapshot_at(check.version)
            .ok_or_else(|| ActorError::failed(format!("version {} is not served here", check.version)))?;
        let mut checked = 0;
        for name in ["w", "b"] {
            let view = snap.buffers.tensor(name).map_err(|e| ActorError::failed(e.to_string()))?;
            let got = view.to_f32().map_err(|e| ActorError::failed(e.to_string()))?;
            let mut wrong = None;
            view.for_each_index(|k, at| {
                let want = as_bf16(value(check.step, name, at));
                if got[k].to_bits() != want.to_bits() && wrong.is_none() {
                    wrong = Some(format!("{name}{at:?} is {}, expected {want} (step {})", got[k], check.step));
                }
            });
            if let Some(wrong) = wrong {
                return Err(ActorError::failed(wrong));
            }
            checked += got.len() as u64;
        }
        Ok(checked)
    }
}

fn layouts() -> Result<(Layout, Layout), String> {
    let parse = |what, json| parse_layout(json).map_err(|e| format!("{what} layout: {e}"));
    Ok((parse("training", TRAINING)?, parse("rollout", ROLLOUT)?))
}

/// A member process: join, hold the weights, serve until the driver leaves.
async fn member_process(role: &str, rank: u32) -> Result<(), String> {
    let (training, rollout) = layouts()?;
    let joined = join(&JoinConfig::from_env().map_err(|e| e.to_string())?).await.map_err(|e| e.to_string())?;
    match role {
        "trainer" => {
            let training = Arc::new(training);
            let store = Arc::new(SrcStore::new(&training, rank));
            joined.serve_member(training, rank, Role::Src(store.clone())).await.map_err(|e| e.to_string())?;
            let trainer = spawn(Trainer { store }, SpawnConfig::default());
            joined.serve(&format!("trainer.{rank}"), &trainer).await.map_err(|e| e.to_string())?;
        }
        _ => {
            let rollout = Arc::new(rollout);
            let store = Arc::new(DstStore::new(&rollout, rank));
            joined.serve_member(rollout, rank, Role::Dst(store.clone())).await.map_err(|e| e.to_string())?;
            let actor = spawn(Rollout { store }, SpawnConfig::default());
            joined.serve(&format!("rollout.{rank}"), &actor).await.map_err(|e| e.to_string())?;
        }
    }
    joined.closed().await;
    joined.shutdown();
    Ok(())
}

/// Kills the member processes however the driver ends.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn driver() -> Result<(), String> {
    let (training, rollout) = layouts()?;
    let secret_text = format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
    let secret = Secret::from_bytes(secret_text.as_bytes().to_vec()).map_err(|e| e.to_string())?;
    let rendezvous = Rendezvous::bind(secret, "127.0.0.1:0".parse().map_err(|_| "address")?, &ControlConfig::default())
        .await
        .map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children = Children(Vec::new());
    for (role, n) in [("trainer", training.ranks()), ("rollout", rollout.ranks())] {
        for rank in 0..n {
            let child = Command::new(&exe)
                .args([role, &rank.to_string()])
                .env(RENDEZVOUS_ENV, rendezvous.addr().to_string())
                .env(SECRET_ENV, &secret_text)
                .spawn()
                .map_err(|e| format!("cannot start {role} {rank}: {e}"))?;
            children.0.push(child);
        }
    }
    let src_members = rendezvous.members(Group::Src, training.ranks(), WAIT).await.map_err(|e| e.to_string())?;
    let dst_members = rendezvous.members(Group::Dst, rollout.ranks(), WAIT).await.map_err(|e| e.to_string())?;
    let mut trainers = Vec::new();
    for r in 0..training.ranks() {
        trainers.push(rendezvous.lookup::<Trainer>(&format!("trainer.{r}"), WAIT).await.map_err(|e| e.to_string())?);
    }
    let mut rollouts = Vec::new();
    for r in 0..rollout.ranks() {
        rollouts.push(rendezvous.lookup::<Rollout>(&format!("rollout.{r}"), WAIT).await.map_err(|e| e.to_string())?);
    }
    let (trainers, rollouts) = (ActorGroup::from_refs(trainers), ActorGroup::from_refs(rollouts));
    let config = OrchestratorConfig { fabric: Fabric::Node(NodeFabric::default()), ..OrchestratorConfig::default() };
    let orchestrator = spawn_orchestrator(src_members, dst_members, config);
    // Check both groups' layouts and install every member's program now, so
    // that a pair that cannot be planned fails before the first step.
    let plan = orchestrator.plan().await.map_err(|e| format!("plan: {e}"))?;
    let pids: Vec<u32> = children.0.iter().map(Child::id).collect();
    println!(
        "driver {}: trainers and rollouts in processes {pids:?}; plan {} moves {} bytes",
        std::process::id(),
        plan.fingerprint,
        plan.bytes
    );
    for step in 1..=STEPS {
        let versions = trainers.call_all(|_| Step(step)).await.map_err(|e| format!("step {step}: {e}"))?;
        let version = versions[0];
        if versions.iter().any(|&v| v != version) {
            return Err(format!("step {step}: trainers disagree on the version: {versions:?}"));
        }
        let report = orchestrator.refit(version).await.map_err(|e| format!("refit of version {version}: {e}"))?;
        let checked = rollouts.call_all(|_| Check { version, step }).await.map_err(|e| format!("step {step}: check: {e}"))?;
        println!(
            "step {step}: refit version {version} in {:.1} ms ({} bytes); rollouts checked {checked:?} values: all exact",
            report.wall.as_secs_f64() * 1e3,
            report.bytes
        );
    }
    println!("{STEPS} steps: every rollout process served every step's weights bit-exact");
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start tokio: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match args.as_slice() {
        [] => runtime.block_on(driver()),
        [role, rank] if role == "trainer" || role == "rollout" => match rank.parse::<u32>() {
            Ok(rank) => runtime.block_on(member_process(role, rank)),
            Err(_) => Err(format!("bad rank '{rank}'")),
        },
        _ => Err("usage: multiprocess_pipeline [trainer RANK | rollout RANK]".into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
