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
use orchestrator::{
    join, spawn_orchestrator, Fabric, JoinConfig, NodeFabric, OrchestratorConfig, Rendezvous, Role, SinkStore, SourceStore,
};
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

/// The value of element `index` (flat, global) of tensor `w` (or `b`,
/// offset by 48) after optimizer step `step`.
fn value(step: u64, index: u64) -> f32 {
    step as f32 * 0.5 - index as f32 / 16.0
}

/// `x` as the rollout side stores it (bf16, round to nearest even).
fn as_bf16(x: f32) -> f32 {
    let mut narrow = [0u8; 2];
    reshard::dtype::convert_slice(DType::F32, &x.to_le_bytes(), DType::BF16, &mut narrow);
    f32::from_bits(u32::from(u16::from_le_bytes(narrow)) << 16)
}

/// A trainer's message: take optimizer step `n`.
#[derive(Debug, Serialize, Deserialize)]
struct Step(u64);

/// A training rank: writes its weights only through its store.
struct Trainer {
    rank: u64,
    store: Arc<SourceStore>,
}

#[async_trait]
impl Actor for Trainer {
    type Msg = Step;
    type Reply = u64;

    async fn handle(&mut self, Step(n): Step, _ctx: &mut Context<Self>) -> Result<u64, ActorError> {
        // Rows 4·rank .. 4·rank+4 of w, then entries of b.
        let w = (0..24).map(|k| value(n, self.rank * 24 + k));
        let b = (0..4).map(|k| value(n, 48 + self.rank * 4 + k));
        let params: Vec<f32> = w.chain(b).collect();
        let (version, ok) = self.store.update(|buffers| buffers.write_f32("params", &params)).await;
        if !ok {
            return Err(ActorError::failed("trainer: no 28-element float buffer 'params'"));
        }
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
    tp: u64,
    store: Arc<SinkStore>,
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
        for (name, first, len) in [("w#0", self.tp * 24, 24), ("b#0", 48 + self.tp * 4, 4)] {
            let got = snap.buffers.read_f32(name).ok_or_else(|| ActorError::failed(format!("no float buffer '{name}'")))?;
            if got.len() as u64 != len {
                return Err(ActorError::failed(format!("buffer '{name}' has {} values, expected {len}", got.len())));
            }
            for (k, &x) in got.iter().enumerate() {
                let want = as_bf16(value(check.step, first + k as u64));
                if x.to_bits() != want.to_bits() {
                    return Err(ActorError::failed(format!("{name}[{k}] is {x}, expected {want} (step {})", check.step)));
                }
                checked += 1;
            }
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
            let store = Arc::new(SourceStore::new(&training, rank));
            joined.serve_member(Arc::new(training), rank, Role::Source(store.clone())).await.map_err(|e| e.to_string())?;
            let trainer = spawn(Trainer { rank: rank.into(), store }, SpawnConfig::default());
            joined.serve(&format!("trainer.{rank}"), &trainer).await.map_err(|e| e.to_string())?;
        }
        _ => {
            let store = Arc::new(SinkStore::new(&rollout, rank));
            joined.serve_member(Arc::new(rollout), rank, Role::Sink(store.clone())).await.map_err(|e| e.to_string())?;
            let actor = spawn(Rollout { tp: (rank % 2).into(), store }, SpawnConfig::default());
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
    let sources = rendezvous.members(Group::Src, training.ranks(), WAIT).await.map_err(|e| e.to_string())?;
    let sinks = rendezvous.members(Group::Dst, rollout.ranks(), WAIT).await.map_err(|e| e.to_string())?;
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
    let orchestrator = spawn_orchestrator(sources, sinks, config);
    let pids: Vec<u32> = children.0.iter().map(Child::id).collect();
    println!("driver {}: trainers and rollouts in processes {pids:?}", std::process::id());
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
