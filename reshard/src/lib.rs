//! Pure reshard planning for weight refits.
//!
//! Given where every tensor lives on the training (source) ranks and where
//! it must go on the inference (destination) ranks, compute which pieces move
//! from which rank to which, in which round, and what each rank's program is.
//!
//! Invariants: this crate does no I/O, spawns no threads and holds no global
//! state; a plan is a pure, deterministic function of both layouts and the
//! options, identical whichever rank computes it.
//!
//! ```
//! use reshard::{parse_layout, plan_reshard, PlanOptions};
//! let src = parse_layout(r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32",
//!     "shape": [4, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#).unwrap();
//! let dst = parse_layout(r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "bf16",
//!     "shape": [4, 4], "mesh": {"shape": [2]}, "placements": ["shard(1)"]}]}"#).unwrap();
//! let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
//! assert_eq!(plan.figures().src_egress_bytes, 16 * 2); // 16 elements as bf16
//! ```

pub mod baseline;
pub mod block;
pub mod builder;
pub mod cost;
pub mod dtype;
pub mod file;
pub mod fingerprint;
pub mod layout;
pub mod overlap;
pub mod plan;
pub mod planner;
pub mod program;
pub mod quant;
pub mod units;

pub use baseline::{baseline_summary, plan_baseline, BaselineSummary};
pub use block::{Block, MAX_DIMS};
pub use builder::{LayoutBuilder, TensorBuilder};
pub use cost::LinkModel;
pub use dtype::DType;
pub use file::{layout_to_json, parse_layout};
pub use fingerprint::Fingerprint;
pub use layout::{
    BlockScale, BufferKey, BufferSpec, Layout, LayoutError, MeshDim, MeshPlacement, Placement, Rank, Region, ShardSpec, Storage,
    TensorLayout,
};
pub use plan::fingerprint as plan_fingerprint;
pub use plan::{Endpoint, Estimate, Figures, Group, Piece, Plan, PlanError, PlanOptions, Strategy, TensorSubset, Transfer};
pub use planner::plan_reshard;
pub use program::{
    LocalCopy, LocalCopyView, Message, Pieces, Programs, RankProgram, RecvPiece, RecvPieceView, Round, SendPiece, Span, Spans,
};
