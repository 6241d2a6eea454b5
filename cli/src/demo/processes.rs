//! The demo with every rank in a process of its own: the driver's side
//! ([`ProcessCast`]) and a member process's ([`run_demo_member`]).

use super::layout::layouts;
use super::rollout::Rollout;
use super::trainer::Trainer;
use super::{DemoError, ROLLOUT_DP, ROLLOUT_TP, TRAIN_TP};
use actors::{spawn, Actor, ActorGroup, SpawnConfig};
use orchestrator::rendezvous::ControlConfig;
use orchestrator::{
    join, spawn_orchestrator, DstStore, Fabric, JoinConfig, JoinError, Joined, NodeFabric, OrchestratorConfig, OrchestratorHandle,
    Rendezvous, Role, SrcStore,
};
use reshard::{Group, Layout, Strategy};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

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
pub(super) struct ProcessCast {
    // Dropped last: the processes outlive nothing that talks to them.
    pub(super) orchestrator: OrchestratorHandle,
    pub(super) trainers: ActorGroup<Trainer>,
    pub(super) rollouts: ActorGroup<Rollout>,
    _rendezvous: Rendezvous,
    pub(super) children: crate::procs::Children,
}

impl ProcessCast {
    pub(super) async fn start(src: &Layout, dst: &Layout, mode: Strategy) -> Result<ProcessCast, DemoError> {
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
        let joined = join(&JoinConfig::from_env().map_err(join_error)?).await.map_err(join_error)?;
        let name = role.name(rank as usize);
        let (src, dst) = (Arc::new(src), Arc::new(dst));
        match role {
            DemoRole::Trainer => {
                let store = Arc::new(SrcStore::new(&src, rank));
                serve_rank(&joined, src, rank, Role::Src(store.clone()), Trainer::new(rank as usize, store), &name).await?;
            }
            DemoRole::Rollout => {
                let store = Arc::new(DstStore::new(&dst, rank));
                serve_rank(&joined, dst, rank, Role::Dst(store.clone()), Rollout::new(rank as usize, store), &name).await?;
            }
        }
        joined.closed().await;
        joined.shutdown();
        Ok(())
    })
}

/// A demo member's failure to join or serve, as the demo reports it.
fn join_error(e: JoinError) -> DemoError {
    DemoError::Actor(e.to_string())
}

/// Serves rank `rank` of `layout` as a member in `role`, then `model` (the
/// rank's trainer or rollout, which shares the member's store) under `name`.
async fn serve_rank<A>(joined: &Joined, layout: Arc<Layout>, rank: u32, role: Role, model: A, name: &str) -> Result<(), DemoError>
where
    A: Actor,
    A::Msg: DeserializeOwned,
    A::Reply: Serialize,
{
    joined.serve_member(layout, rank, role).await.map_err(join_error)?;
    let model = spawn(model, SpawnConfig::default().name(name.to_string()));
    joined.serve(name, &model).await.map_err(join_error)
}
