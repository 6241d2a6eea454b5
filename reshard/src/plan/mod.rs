//! A plan: the pieces of tensors to move, the transfers that move them
//! (who sends, who receives, in which round), and the figures that describe
//! the traffic. Produced by [`plan_reshard`](crate::plan_reshard) or
//! [`plan_baseline`](crate::plan_baseline); turned into per-rank programs by
//! [`Plan::programs`].

mod budget;
mod endpoint;
mod estimate;
mod figures;
mod options;
mod rounds;
mod subset;

pub(crate) use budget::Budget;
pub use budget::{max_work_for_memory, DEFAULT_MAX_WORK};
pub use endpoint::{Endpoint, Group};
pub(crate) use estimate::lower_bound;
pub use estimate::Estimate;
pub use figures::Figures;
pub use options::PlanOptions;
pub(crate) use rounds::SenderLists;
pub use subset::TensorSubset;

use crate::block::Block;
use crate::dtype::{wire_dtype, DType};
use crate::fingerprint::{fnv64, Fingerprint, Fnv64};
use crate::layout::{Layout, Rank};
use crate::route::Route;
use figures::count_figures;
use rounds::finish_by_sender;
use std::fmt;
use std::hash::{Hash, Hasher};
use thiserror::Error;

/// Which planner made a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Strategy {
    /// Intersect both layouts; send each destination node exactly what it needs.
    Reshard,
    /// Gather each tensor on one source rank, broadcast it whole.
    Baseline,
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Strategy::Reshard => "reshard",
            Strategy::Baseline => "baseline",
        })
    }
}

/// A block of one tensor that moves as a unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Tensor index in the source layout.
    pub src_tensor: u32,
    /// Tensor index in the destination layout.
    pub dst_tensor: u32,
    /// The elements, in global tensor coordinates.
    pub block: Block,
}

/// One piece moving from one rank to another (or copied locally when
/// `from == to`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// Index into [`Plan::pieces`].
    pub piece: u32,
    /// Sender.
    pub from: Endpoint,
    /// Receiver.
    pub to: Endpoint,
    /// Dependency stage: data a rank forwards arrived in an earlier stage.
    pub stage: u16,
    /// Sender reads from the tensor's scratch buffer, not its shards.
    pub from_scratch: bool,
    /// Receiver writes into the tensor's scratch buffer, not its shards.
    pub to_scratch: bool,
    /// Execution round (rounds of one stage follow those of the previous).
    pub round: u32,
}

/// Why planning failed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PlanError {
    /// A subset refit names a tensor the destination layout lacks.
    #[error("tensor '{tensor}' named for a subset refit is not in the destination layout")]
    UnknownSubsetTensor {
        /// The name.
        tensor: String,
    },
    /// A subset refit names no tensor.
    #[error("a subset refit must name at least one tensor")]
    EmptySubset,
    /// A destination tensor does not exist in the source layout.
    #[error("destination tensor '{tensor}' is absent from the source layout")]
    MissingTensor {
        /// Tensor name.
        tensor: String,
    },
    /// Shapes differ between the two layouts.
    #[error("tensor '{tensor}': source shape {src:?} differs from destination shape {dst:?}")]
    ShapeMismatch {
        /// Tensor name.
        tensor: String,
        /// Source shape.
        src: Vec<u64>,
        /// Destination shape.
        dst: Vec<u64>,
    },
    /// The dtypes cannot be converted.
    #[error("tensor '{tensor}': cannot convert {from} to {to} (only f64/f32/bf16/f16 convert among themselves, and to an f8e4m3 destination that has a block scale)")]
    Conversion {
        /// Tensor name.
        tensor: String,
        /// Source dtype.
        from: DType,
        /// Destination dtype.
        to: DType,
    },
    /// A block-scaled destination's source is not a float it quantizes.
    #[error("tensor '{tensor}': cannot quantize {from} to block-scaled f8e4m3 (the source must be f64, f32, bf16 or f16)")]
    Quantize {
        /// Tensor name.
        tensor: String,
        /// Source dtype.
        from: DType,
    },
    /// A source tensor is block-scaled.
    #[error("tensor '{tensor}': block-scaled source tensors are not supported (a scale belongs to a destination layout)")]
    ScaledSource {
        /// Tensor name.
        tensor: String,
    },
    /// Part of what a destination rank needs is held by no source rank.
    #[error("tensor '{tensor}': region {region} needed by dst rank {rank} is not covered by any source shard")]
    NotCovered {
        /// Tensor name.
        tensor: String,
        /// A destination rank that needs it.
        rank: Rank,
        /// The uncovered region.
        region: Box<Block>,
    },
    /// The baseline gathers the whole needed extent of a tensor on one
    /// source rank, but no source shard holds part of it.
    #[error("tensor '{tensor}': the baseline gathers {extent} on one source rank, but region {region} is not covered by any source shard")]
    BaselineNotCovered {
        /// Tensor name.
        tensor: String,
        /// The extent the baseline gathers.
        extent: Box<Block>,
        /// The part no source holds.
        region: Box<Block>,
    },
    /// The plan would need more pieces than supported.
    #[error("tensor '{tensor}': the plan would need more than {limit} pieces; raise the staging limit (--max-staging-mib)")]
    TooManyPieces {
        /// Tensor being planned when the limit was hit.
        tensor: String,
        /// The limit.
        limit: u64,
    },
    /// Planning the pair would take more work than
    /// [`PlanOptions::max_work`] allows (see its doc): refused before that
    /// work is done.
    #[error(
        "{what}: planning this pair would take more than {limit} units of work (pieces, transfers, overlaps, pairs of ranks \
         to schedule), the planner's work limit; refused before doing it. Raise the limit if the layouts are meant: \
         `refit plan --max-plan-work`, `PlanOptions::max_work`"
    )]
    TooMuchWork {
        /// What would have passed the limit (a tensor and a count).
        what: String,
        /// The limit.
        limit: u64,
    },
    /// A plan cannot be derived for replicas ([`Plan::for_replicas`]).
    #[error("cannot derive a plan for replicas: {problem}")]
    Derive {
        /// Why.
        problem: String,
    },
    /// The plan was made for other layouts or options.
    #[error("plan fingerprint {plan} does not match these layouts ({layouts})")]
    FingerprintMismatch {
        /// The plan's fingerprint.
        plan: Fingerprint,
        /// The fingerprint of the layouts given.
        layouts: Fingerprint,
    },
}

/// A complete plan for one refit.
#[derive(Clone, Debug)]
pub struct Plan {
    pub(crate) strategy: Strategy,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) options: PlanOptions,
    pub(crate) src_ranks: u32,
    pub(crate) dst_ranks: u32,
    pub(crate) src_rpn: u32,
    pub(crate) dst_rpn: u32,
    pub(crate) pieces: Vec<Piece>,
    pub(crate) transfers: Vec<Transfer>,
    pub(crate) wire: Vec<(DType, DType)>,
    /// Per destination tensor, how its values travel (where block-scaled
    /// tensors are quantized).
    pub(crate) routes: Vec<Route>,
    pub(crate) figures: Figures,
    /// Per destination node: bytes of the union of its ranks' needs.
    pub(crate) needed_node_bytes: Vec<u64>,
    /// Bytes of the union of all destination needs.
    pub(crate) unique_bytes: u64,
    /// Per destination tensor, the block a scratch buffer holds (baseline
    /// only: the bounding box of the destination's needs).
    pub(crate) scratch_blocks: Vec<Block>,
    /// The replicas this plan was derived for from one replica's plan
    /// ([`Plan::for_replicas`]); `None`: a planner made it.
    pub(crate) replicas: Option<u32>,
}

impl Plan {
    /// Which planner made it.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// Fingerprint of both layouts, the options and the strategy.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// The options used.
    pub fn options(&self) -> &PlanOptions {
        &self.options
    }

    /// All pieces.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// All transfers, in stage order.
    pub fn transfers(&self) -> &[Transfer] {
        &self.transfers
    }

    /// How destination tensor `td`'s values travel: plain, or for a
    /// block-scaled FP8 tensor and its scales, where they are quantized.
    ///
    /// # Panics
    /// If `td` is not a tensor of the plan's destination layout.
    pub fn route(&self, td: u32) -> Route {
        self.routes[td as usize]
    }

    /// Traffic figures.
    pub fn figures(&self) -> &Figures {
        &self.figures
    }

    /// Number of source ranks.
    pub fn src_ranks(&self) -> u32 {
        self.src_ranks
    }

    /// Number of destination ranks.
    pub fn dst_ranks(&self) -> u32 {
        self.dst_ranks
    }

    /// Node of an endpoint (source and destination nodes are distinct
    /// machines; both are numbered from 0 within their group).
    pub fn node_of(&self, e: Endpoint) -> (Group, u32) {
        match e.group {
            Group::Src => (Group::Src, e.rank / self.src_rpn),
            Group::Dst => (Group::Dst, e.rank / self.dst_rpn),
        }
    }

    /// Bytes a transfer puts on the wire.
    pub fn wire_bytes(&self, t: &Transfer) -> u64 {
        let p = &self.pieces[t.piece as usize];
        p.block.numel() * self.transfer_wire_dtype(t).size()
    }

    /// The dtype a transfer travels in: the source dtype inside the source
    /// group, else the narrower of source and destination dtypes.
    pub fn transfer_wire_dtype(&self, t: &Transfer) -> DType {
        let (s, d) = self.wire[self.pieces[t.piece as usize].dst_tensor as usize];
        if t.to.group == Group::Src {
            s
        } else {
            wire_dtype(s, d)
        }
    }

    /// Per piece, its bytes on the wire to a destination rank and to a
    /// source rank (see [`wire_bytes`](Self::wire_bytes)).
    fn piece_bytes(&self) -> Vec<(u64, u64)> {
        self.pieces
            .iter()
            .map(|p| {
                let (s, d) = self.wire[p.dst_tensor as usize];
                let numel = p.block.numel();
                (numel * wire_dtype(s, d).size(), numel * s.size())
            })
            .collect()
    }

    /// The block held by the scratch buffer of destination tensor `t`
    /// (baseline plans only).
    pub fn scratch_block(&self, t: u32) -> Option<&Block> {
        self.scratch_blocks.get(t as usize)
    }

    /// Per destination node, bytes of the union of what its ranks need (in
    /// wire dtype): the least that must enter the node.
    pub fn needed_node_bytes(&self) -> &[u64] {
        &self.needed_node_bytes
    }
}

/// Transfers with their rounds, as a planner that assigns rounds itself
/// made them.
pub(crate) struct Scheduled {
    /// All transfers, in stage order.
    pub(crate) transfers: Vec<Transfer>,
    /// Number of rounds.
    pub(crate) rounds: u32,
    /// Number of stages.
    pub(crate) stages: u32,
}

/// What a planner produced, before rounds and figures.
pub(crate) struct PlanParts {
    pub(crate) pieces: Vec<Piece>,
    pub(crate) wire: Vec<(DType, DType)>,
    pub(crate) routes: Vec<Route>,
    pub(crate) needed_node_bytes: Vec<u64>,
    pub(crate) unique_bytes: u64,
    pub(crate) scratch_blocks: Vec<Block>,
}

impl Plan {
    /// Builds a plan from a planner's parts and its transfers grouped by
    /// stage and pair of ranks: assigns rounds, lays the transfers out by
    /// stage and pair, and computes the figures.
    pub(crate) fn assemble_by_sender(
        strategy: Strategy,
        src: &Layout,
        dst: &Layout,
        options: &PlanOptions,
        parts: PlanParts,
        lists: SenderLists,
    ) -> Plan {
        let mut plan = Plan::skeleton(strategy, src, dst, options, parts);
        finish_by_sender(&mut plan, lists);
        plan
    }

    /// Builds a plan from a planner's parts and its transfers with their
    /// rounds already assigned: computes the figures.
    pub(crate) fn assemble_in_rounds(
        strategy: Strategy,
        src: &Layout,
        dst: &Layout,
        options: &PlanOptions,
        parts: PlanParts,
        scheduled: Scheduled,
    ) -> Plan {
        let Scheduled { transfers, rounds, stages } = scheduled;
        let mut plan = Plan::skeleton(strategy, src, dst, options, parts);
        plan.transfers = transfers;
        let piece_bytes = plan.piece_bytes();
        plan.figures = count_figures(&plan, &piece_bytes, rounds, stages);
        plan
    }

    /// A plan without transfers or figures yet.
    fn skeleton(strategy: Strategy, src: &Layout, dst: &Layout, options: &PlanOptions, parts: PlanParts) -> Plan {
        Plan {
            strategy,
            fingerprint: fingerprint(src, dst, options, strategy),
            options: options.clone(),
            src_ranks: src.ranks(),
            dst_ranks: dst.ranks(),
            src_rpn: src.ranks_per_node(),
            dst_rpn: dst.ranks_per_node(),
            pieces: parts.pieces,
            transfers: Vec::new(),
            wire: parts.wire,
            routes: parts.routes,
            figures: Figures::default(),
            needed_node_bytes: parts.needed_node_bytes,
            unique_bytes: parts.unique_bytes,
            scratch_blocks: parts.scratch_blocks,
            replicas: None,
        }
    }
}

/// Most pieces one plan may have.
pub(crate) const MAX_PIECES: u64 = 1 << 28;

/// The fingerprint `plan` must have if made for `src` and `dst`.
pub(crate) fn expected_fingerprint(plan: &Plan, src: &Layout, dst: &Layout) -> Fingerprint {
    let problem = fingerprint(src, dst, &plan.options, plan.strategy);
    match plan.replicas {
        Some(_) => derived_fingerprint(problem),
        None => problem,
    }
}

/// The fingerprint of a plan derived for replicas
/// ([`Plan::for_replicas`]) whose planning problem's fingerprint (layouts,
/// options, strategy) is `problem`: not that of the plan a planner makes
/// for the same layouts (the two differ).
pub(crate) fn derived_fingerprint(problem: Fingerprint) -> Fingerprint {
    Fingerprint(problem.0 ^ fnv64("refit-plan-for-replicas"))
}

/// The fingerprint of a planning problem.
pub(crate) fn fingerprint(src: &Layout, dst: &Layout, options: &PlanOptions, strategy: Strategy) -> Fingerprint {
    let mut h = Fnv64::default();
    src.ranks().hash(&mut h);
    src.ranks_per_node().hash(&mut h);
    src.tensors().hash(&mut h);
    dst.ranks().hash(&mut h);
    dst.ranks_per_node().hash(&mut h);
    dst.tensors().hash(&mut h);
    options.hash(&mut h);
    strategy.hash(&mut h);
    Fingerprint(h.finish() ^ fnv64("refit-plan-v1"))
}
