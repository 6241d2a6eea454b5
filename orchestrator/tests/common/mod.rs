//! What the orchestrator's integration tests share: one pair of layouts.

use reshard::{parse_layout, Layout};

/// Training: two tensors, TP2 (one fused "params" buffer per rank), f32.
pub(crate) const SRC: &str = r#"{"ranks": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [8, 6], "shards": [
    {"rank": 0, "offset": [0, 0], "extent": [4, 6], "buffer": "params", "at": 0},
    {"rank": 1, "offset": [4, 0], "extent": [4, 6], "buffer": "params", "at": 0}]},
  {"name": "b", "dtype": "f32", "shape": [8], "shards": [
    {"rank": 0, "offset": [0], "extent": [4], "buffer": "params", "at": 24},
    {"rank": 1, "offset": [4], "extent": [4], "buffer": "params", "at": 24}]}]}"#;

/// Inference: TP2 column-wise x DP2 on 4 ranks, bf16.
pub(crate) const DST: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "bf16", "shape": [8, 6], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(1)"]},
  {"name": "b", "dtype": "bf16", "shape": [8], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]}]}"#;

/// Both layouts, parsed.
pub(crate) fn layouts() -> (Layout, Layout) {
    (parse_layout(SRC).unwrap(), parse_layout(DST).unwrap())
}
