//! Planner options: the staging limit per round, the link model, the
//! smallest split of a piece, where FP8 destinations are quantized, and an
//! optional subset of tensors to plan.

use super::TensorSubset;
use crate::cost::LinkModel;
use crate::route::QuantizeAt;
use std::hash::{Hash, Hasher};

/// Planner options.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanOptions {
    /// Most bytes a rank stages (sends plus receives) in one round.
    pub max_staging_bytes: u64,
    /// Link bandwidths used to choose senders and relays.
    pub links: LinkModel,
    /// Least bytes of each part when the reshard planner splits a piece
    /// among several source ranks that hold it (replicas, or holdings cut
    /// differently): a piece is split only into parts at least this large
    /// (so only pieces of at least twice this), which bounds how many more
    /// pieces and transfers splitting makes. `u64::MAX`: never split.
    pub min_split_bytes: u64,
    /// Plan only these destination tensors (a *subset refit*: LoRA
    /// adapters, one stage's weights); `None`: every tensor. The plan moves
    /// nothing of the others, and its programs name the destination
    /// buffers that hold any of them ([`RankProgram::carried`](crate::RankProgram::carried)), whose bytes
    /// a refit must keep from the version the destination serves.
    pub only: Option<TensorSubset>,
    /// Where the reshard quantizes block-scaled FP8 destination tensors
    /// (the baseline always quantizes at the destination, as the
    /// frameworks it stands for do).
    pub quantize_at: QuantizeAt,
    /// Source ranks that send nothing (lost during a refit, say): the
    /// reshard takes every piece from the other holders of it, and fails
    /// with [`PlanError::NotCovered`](crate::PlanError::NotCovered) where
    /// only these hold some part. Sorted, without repeats. The baseline
    /// ignores it.
    pub lost_sources: Vec<crate::Rank>,
    /// Most units of work planning may take (pieces, transfers, overlaps
    /// compared, broadcast hops, pairs of ranks the round packer weighs;
    /// `plan/budget.rs`): a pair that would take more is refused with
    /// [`PlanError::TooMuchWork`](crate::PlanError::TooMuchWork), counted
    /// before the work is done, so a small layout file describing a huge
    /// expansion costs neither minutes nor gigabytes.
    /// [`DEFAULT_MAX_WORK`](crate::DEFAULT_MAX_WORK) by default; callers
    /// bound it by the machine ([`max_work_for_memory`](crate::max_work_for_memory)).
    /// Not part of the fingerprint: it decides whether a plan is made,
    /// never what it is.
    pub max_work: u64,
}

/// The default of [`PlanOptions::min_split_bytes`]: 64 KiB per part.
pub(crate) const DEFAULT_MIN_SPLIT_BYTES: u64 = 64 << 10;

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            max_staging_bytes: 256 << 20,
            links: LinkModel::default(),
            min_split_bytes: DEFAULT_MIN_SPLIT_BYTES,
            only: None,
            quantize_at: QuantizeAt::Source,
            lost_sources: Vec::new(),
            max_work: super::DEFAULT_MAX_WORK,
        }
    }
}

impl Hash for PlanOptions {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.max_staging_bytes.hash(h);
        self.min_split_bytes.hash(h);
        self.links.net_bytes_per_s.to_bits().hash(h);
        self.links.intra_bytes_per_s.to_bits().hash(h);
        self.links.message_latency_s.to_bits().hash(h);
        self.only.hash(h);
        self.quantize_at.hash(h);
        if !self.lost_sources.is_empty() {
            // Plans without lost sources keep their fingerprints.
            self.lost_sources.hash(h);
        }
    }
}
