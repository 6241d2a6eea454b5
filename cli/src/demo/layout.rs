//! The two groups' layouts: the training group's (TP4, f32, one fused
//! buffer per rank) and the rollout group's (TP2 x DP2 mesh, bf16).

use super::{DemoError, ACTIONS, AT_B1, AT_B2, AT_W1, AT_W2, DIM, HIDDEN, HS, RANKS_PER_NODE, ROLLOUT_DP, ROLLOUT_TP, TRAIN_TP};
use reshard::{parse_layout, Layout};
use serde_json::{json, Value};

/// The training group's layout (layout file format): TP4 in f32, each rank's
/// shards fused in its buffer `"params"`.
pub fn training_layout_json() -> String {
    let shards = |offset: &dyn Fn(usize) -> Vec<usize>, extent: Vec<usize>, at: usize| -> Value {
        (0..TRAIN_TP)
            .map(|t| json!({"rank": t, "offset": offset(t), "extent": extent, "buffer": "params", "at": at}))
            .collect::<Vec<_>>()
            .into()
    };
    json!({
        "ranks": TRAIN_TP, "ranks_per_node": RANKS_PER_NODE,
        "tensors": [
            {"name": "w1", "dtype": "f32", "shape": [HIDDEN, DIM], "shards": shards(&|t| vec![t * HS, 0], vec![HS, DIM], AT_W1)},
            {"name": "b1", "dtype": "f32", "shape": [HIDDEN], "shards": shards(&|t| vec![t * HS], vec![HS], AT_B1)},
            {"name": "w2", "dtype": "f32", "shape": [ACTIONS, HIDDEN], "shards": shards(&|t| vec![0, t * HS], vec![ACTIONS, HS], AT_W2)},
            {"name": "b2", "dtype": "f32", "shape": [ACTIONS], "shards": shards(&|_| vec![0], vec![ACTIONS], AT_B2)},
        ]
    })
    .to_string()
}

/// The rollout group's layout (layout file format): a `[dp, tp]` = `[2, 2]`
/// mesh, 2 ranks per node, bf16.
pub fn rollout_layout_json() -> String {
    let mesh = json!({"shape": [ROLLOUT_DP, ROLLOUT_TP]});
    json!({
        "ranks": ROLLOUT_DP * ROLLOUT_TP, "ranks_per_node": RANKS_PER_NODE,
        "tensors": [
            {"name": "w1", "dtype": "bf16", "shape": [HIDDEN, DIM], "mesh": mesh, "placements": ["replicate", "shard(0)"]},
            {"name": "b1", "dtype": "bf16", "shape": [HIDDEN], "mesh": mesh, "placements": ["replicate", "shard(0)"]},
            {"name": "w2", "dtype": "bf16", "shape": [ACTIONS, HIDDEN], "mesh": mesh, "placements": ["replicate", "shard(1)"]},
            {"name": "b2", "dtype": "bf16", "shape": [ACTIONS], "mesh": mesh, "placements": ["replicate", "replicate"]},
        ]
    })
    .to_string()
}

/// Both layouts, parsed.
pub fn layouts() -> Result<(Layout, Layout), DemoError> {
    let src = parse_layout(&training_layout_json()).map_err(|e| DemoError::Inconsistent(format!("training layout: {e}")))?;
    let dst = parse_layout(&rollout_layout_json()).map_err(|e| DemoError::Inconsistent(format!("rollout layout: {e}")))?;
    Ok((src, dst))
}
