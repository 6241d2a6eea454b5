//! Members a refit lost, and whether it goes on without them: sources left
//! out of the plan ([`SourceLoss::Replan`]) and replicas of a destination
//! group of replicas dropped ([`ReplicaLoss::Drop`], `replicas.rs`),
//! decided from who failed ([`StepOutcome`]).

use super::data_plane::StepOutcome;
use super::{Orchestrator, OrchestratorError, ReplicaLoss, SourceLoss};
use crate::protocol::MemberMsg;
use reshard::{Endpoint, Group, Strategy};

impl Orchestrator {
    /// The source ranks a failed step lost, if the refit may go on
    /// without them ([`SourceLoss::Replan`], a reshard): every member that
    /// did not answer is a source, and some source is left. Other members'
    /// failures are taken for the consequences (a receiver that timed out
    /// waiting for a dead sender cannot tell); one that was not fails the
    /// refit when it runs again.
    pub(super) fn lost_sources_of(&self, blame: &StepOutcome) -> Option<Vec<u32>> {
        if self.config.source_loss != SourceLoss::Replan || self.config.mode != Strategy::Reshard || blame.gone.is_empty() {
            return None;
        }
        if blame.gone.iter().any(|e| e.group != Group::Src) {
            return None;
        }
        let mut ranks: Vec<u32> = blame.gone.iter().map(|e| e.rank).collect();
        ranks.sort_unstable();
        ranks.dedup();
        (self.lost_sources.len() + ranks.len() < self.src.len()).then_some(ranks)
    }

    /// Leaves source ranks `ranks` out of every plan until they are
    /// replaced; the error that makes the refit run again.
    pub(super) fn leave_out_sources(&mut self, ranks: Vec<u32>, cause: OrchestratorError) -> OrchestratorError {
        tracing::warn!(?ranks, error = %cause, "source ranks lost; planning around them");
        // Every member drops what it prepared (the peers change).
        self.forget_data_plane(true);
        self.lost_sources.extend(&ranks);
        self.lost_sources.sort_unstable();
        self.lost_sources.dedup();
        OrchestratorError::SourcesLost { ranks, cause: Box::new(cause) }
    }

    /// The members that do not answer a status request now (asked after a
    /// step failed with every member answering: one that finished its part
    /// and died before its peers had all of it is seen only now).
    pub(super) async fn unanswering(&self) -> Vec<Endpoint> {
        let answers = self.ask_each(&self.groups(), |_, _| Some(MemberMsg::Status), self.config.control_timeout).await;
        answers.into_iter().filter(|(_, _, r)| r.is_err()).map(|(e, ..)| e).collect()
    }

    /// A member did not answer before a refit (`e`): if the ones that do
    /// not are sources the refit may go on without, they are left out;
    /// if they are destinations of replicas the group may go on without
    /// ([`ReplicaLoss::Drop`]), their replicas leave it. Either way the
    /// refit is to run again (the error says so); else `e`.
    pub(super) async fn lose_silent(&mut self, e: OrchestratorError) -> OrchestratorError {
        let gone = self.unanswering().await;
        let blame = StepOutcome { failed: gone.clone(), gone, ..StepOutcome::default() };
        if let Some(ranks) = self.lost_sources_of(&blame) {
            return self.leave_out_sources(ranks, e);
        }
        if self.config.replica_loss != ReplicaLoss::Drop || self.config.replica.is_none() {
            return e;
        }
        let Some((lost, _)) = self.lost_replicas(&blame) else { return e };
        tracing::warn!(?lost, error = %e, "replicas do not answer and leave the group");
        match self.drop_replicas(&lost).await {
            Ok(()) => OrchestratorError::ReplicasLost { replicas: lost, cause: Box::new(e) },
            Err(e) => e,
        }
    }
}
