//! The layouts the orchestrator's IPC checks refit (`orchestrator-ipc`,
//! `-in-place`, `-delta`, `nccl-same-device`), their values, and the
//! element-by-element check of what a destination serves.

/// Checks every element of tensor `w` in `buffers` against `want(coords)`:
/// the elements checked, or the first that differs (or why the tensor
/// could not be read).
pub(crate) fn checked_w(buffers: &orchestrator::Buffers, want: impl Fn(&[u64]) -> f32) -> Result<u64, String> {
    let view = buffers.tensor("w").map_err(|e| e.to_string())?;
    let got = view.to_f32().map_err(|e| e.to_string())?;
    let mut bad = None;
    view.for_each_index(|i, at| {
        if bad.is_none() && got[i] != want(at) {
            bad = Some(format!("MISMATCH: element {at:?}"));
        }
    });
    bad.map_or(Ok(got.len() as u64), Err)
}

/// The layouts of the `orchestrator-ipc` checks (f32 row shards to bf16
/// column shards, two ranks each).
pub(crate) const IPC_SRC: &str = r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [2048, 1024], "shards": [
        {"rank": 0, "offset": [0, 0], "extent": [1024, 1024], "buffer": "params", "at": 0},
        {"rank": 1, "offset": [1024, 0], "extent": [1024, 1024], "buffer": "params", "at": 0}]}]}"#;
pub(crate) const IPC_DST: &str = r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "bf16", "shape": [2048, 1024],
        "mesh": {"shape": [2]}, "placements": ["shard(1)"]}]}"#;

/// Integers below 256: exact in bf16.
pub(crate) fn ipc_value(at: &[u64]) -> f32 {
    ((at[0] * 1024 + at[1]) % 251) as f32
}
