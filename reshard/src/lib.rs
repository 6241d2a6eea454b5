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

mod baseline;
mod block;
mod builder;
mod cost;
mod dtype;
mod file;
mod fingerprint;
mod layout;
mod overlap;
mod plan;
mod planner;
mod program;
mod quant;
mod rebalance;
mod replica_plan;
mod route;
mod units;

// The crate's face: every module is private; what other crates, the
// examples and the docs use is re-exported here, and nothing else is public
// (tests/layering.rs checks that each name below is used outside).
pub use baseline::{baseline_summary, plan_baseline, BaselineSummary};
pub use block::{Block, MAX_DIMS};
pub use builder::{LayoutBuilder, TensorBuilder};
pub use cost::LinkModel;
pub use dtype::{convert_slice, f32_bits_to_bf16, wire_dtype, DType, ALL_DTYPES};
pub use file::{layout_to_json, parse_layout, parse_mesh_dim};
// Test machinery (feature `testkit`): the parser's two paths compared.
#[cfg(any(test, feature = "testkit"))]
pub use file::cross_check;
pub use fingerprint::{fnv64, Fingerprint};
pub use layout::{
    BlockScale, BufferKey, BufferSpec, Holding, Layout, LayoutError, Loc, MeshDim, MeshPlacement, Placement, Rank, Region, ShardSpec,
    Storage, TensorLayout,
};
pub use plan::{
    max_work_for_memory, Endpoint, Estimate, Figures, Group, Piece, Plan, PlanError, PlanOptions, Strategy, TensorSubset, Transfer,
    DEFAULT_MAX_WORK,
};
pub use planner::plan_reshard;
pub use program::{
    span_in, Iter, LocalCopy, LocalCopyView, Message, Pieces, Programs, RankProgram, RecvPiece, RecvPieceView, Round, SendPiece,
    SendPieceView, Span, Spans,
};
pub use route::{QuantizeAt, Route};
// Block-scaled FP8: the semantics and a destination's quantize steps, for
// the data planes that run them.
pub use quant::{
    block_scale, e4m3_from_f32, elements_of, for_each_cell, for_each_row, grid_of, offset_in, quantize, quantize_value, read_f32,
    QuantError, Quantize, Stored,
};
pub use units::human;
