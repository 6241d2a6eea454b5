//! Block-scaled FP8 destinations through the orchestrator: each refit
//! delivers e4m3 codes and scales computed from the version's values, and a
//! version with a NaN fails, names the tensor, commits nothing, and leaves
//! every destination serving the version before it; the next good version
//! refits.

use orchestrator::{spawn_refit, OrchestratorConfig, RefitSystem};
use reshard::e4m3_from_f32;
use reshard::{parse_layout, Strategy};
use std::time::Duration;

/// Training: f32 TP2 by rows (rows 0..3 and 3..6: block row 0, rows
/// 0..4, spans both ranks).
const SRC: &str = r#"{"ranks": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [6, 10], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#;

/// Training: f32 TP2 by rows 0..4 and 4..6, whole blocks: quantized by
/// the sources.
const SRC_WHOLE_BLOCKS: &str = r#"{"ranks": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [6, 10], "shards": [
    {"rank": 0, "offset": [0, 0], "extent": [4, 10]}, {"rank": 1, "offset": [4, 0], "extent": [2, 10]}]}]}"#;

/// Inference: FP8 in blocks of 4 x 4 (partial at both ends), TP2 by
/// columns (5 each: block column 1 is cut), scales sharded with them, DP2.
const DST: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "f8e4m3", "shape": [6, 10], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(1)"],
   "scale": {"tensor": "w_scale", "block": [4, 4]}},
  {"name": "w_scale", "dtype": "f32", "shape": [2, 3], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(1)"]}]}"#;

/// Element (i, j) of version `k`.
fn value(k: u64, i: u64, j: u64) -> f32 {
    (k as f32 + 1.0) * (i as f32 * 10.0 + j as f32 - 17.0) / 8.0
}

/// Writes version `k` into every source (with a NaN at (4, 9) if asked).
async fn step(sys: &RefitSystem, k: u64, nan: bool) -> u64 {
    let mut version = 0;
    for s in &sys.src_stores {
        let r = s
            .try_update(|b| {
                let mut t = b.tensor_mut("w")?;
                t.map_f32(|idx, _| if nan && idx == [4, 9] { f32::NAN } else { value(k, idx[0], idx[1]) })
            })
            .await
            .unwrap();
        version = r.0;
    }
    version
}

/// The expected codes and scales of version `k`, computed here from the
/// semantics (blocks of 4 x 4 over the global 6 x 10 tensor).
fn expected(k: u64) -> (Vec<u8>, Vec<f32>) {
    let mut scales = [0f32; 6];
    for i in 0..6 {
        for j in 0..10 {
            let b = (i / 4 * 3 + j / 4) as usize;
            scales[b] = scales[b].max(value(k, i, j).abs());
        }
    }
    let scales: Vec<f32> = scales.iter().map(|&a| if a == 0.0 { 1.0 } else { a / 448.0 }).collect();
    let codes = (0..60).map(|e| e4m3_from_f32(value(k, e / 10, e % 10) / scales[(e / 10 / 4 * 3 + e % 10 / 4) as usize])).collect();
    (codes, scales)
}

/// Every destination serves version `version` with the codes and scales
/// of step `k`.
fn serves(sys: &RefitSystem, version: u64, k: u64) {
    let (codes, scales) = expected(k);
    for s in &sys.dst_stores {
        let snap = s.snapshot().expect("a committed version");
        assert_eq!(snap.version, version);
        let w = snap.buffers.tensor("w").unwrap();
        w.for_each_index(|n, idx| assert_eq!(w.bytes()[n], codes[(idx[0] * 10 + idx[1]) as usize], "w{idx:?}"));
        let sc = snap.buffers.tensor("w_scale").unwrap();
        let got = sc.to_f32().unwrap();
        sc.for_each_index(|n, idx| assert_eq!(got[n].to_bits(), scales[(idx[0] * 3 + idx[1]) as usize].to_bits(), "scale{idx:?}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_nan_version_is_refused_and_the_last_one_keeps_serving() {
    for (src, mode) in [(SRC, Strategy::Reshard), (SRC, Strategy::Baseline), (SRC_WHOLE_BLOCKS, Strategy::Reshard)] {
        let (src, dst) = (parse_layout(src).unwrap(), parse_layout(DST).unwrap());
        let config = OrchestratorConfig { mode, deadline: Duration::from_secs(10), ..OrchestratorConfig::default() };
        let sys = spawn_refit(&src, &dst, config).await.unwrap();
        let v1 = step(&sys, 1, false).await;
        sys.orchestrator.refit(v1).await.unwrap();
        serves(&sys, v1, 1);
        let v2 = step(&sys, 2, true).await;
        let err = sys.orchestrator.refit(v2).await.unwrap_err().to_string();
        assert!(err.contains("tensor 'w'") && err.contains("NaN or infinity"), "{mode:?}: {err}");
        serves(&sys, v1, 1);
        let v3 = step(&sys, 3, false).await;
        sys.orchestrator.refit(v3).await.unwrap();
        serves(&sys, v3, 3);
    }
}
