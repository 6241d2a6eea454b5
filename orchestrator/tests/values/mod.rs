//! Weights whose every value says which element of which tensor and which
//! version it is: an optimizer step writes them on every source, a check
//! reads a destination's committed snapshot back against them.

use orchestrator::{DstStore, RefitPhase, RefitStep, RefitSystem};
use tokio::sync::watch::Receiver;

/// Waits until the refit after refit `before` (`phases`' refit count
/// when it was asked for) reaches `step`, or has ended: a refit may pass
/// a step between two looks at the phases (a watch shows the latest
/// only), and then must not be waited for forever. Whether the step was
/// seen.
pub(crate) async fn reached(phases: &mut Receiver<RefitPhase>, before: u64, step: RefitStep) -> bool {
    let seen = phases.wait_for(|p| p.refit > before && (p.step == step || p.step == RefitStep::Idle)).await;
    seen.is_ok_and(|p| p.step == step)
}

pub(crate) const TENSORS: [&str; 3] = ["w", "b", "f"];

/// The value of element `flat` of tensor `t` at `version`: exact in f32.
pub(crate) fn value(t: usize, flat: u64, version: u64) -> f32 {
    (version * 10_000 + t as u64 * 1_000 + flat) as f32
}

/// Flat indices of a block of a tensor of `shape`, row-major.
pub(crate) fn flat_indices(shape: &[u64], offset: &[u64], extent: &[u64]) -> Vec<u64> {
    let n: u64 = extent.iter().product();
    (0..n)
        .map(|mut i| {
            let mut flat = 0;
            let mut stride = 1;
            for d in (0..shape.len()).rev() {
                let c = offset[d] + i % extent[d];
                i /= extent[d];
                flat += c * stride;
                stride *= shape[d];
            }
            flat
        })
        .collect()
}

/// One optimizer step writing `version`'s values on every source rank.
pub(crate) async fn step(sys: &RefitSystem, version: u64) {
    for s in &sys.src_stores {
        let v = s
            .try_update(|b| {
                for (t, name) in TENSORS.iter().enumerate() {
                    for i in 0..b.tensor_blocks(name)?.len() {
                        let mut view = b.tensor_block_mut(name, i)?;
                        let (shape, offset, extent) = (view.shape().to_vec(), view.offset().to_vec(), view.extent().to_vec());
                        let values: Vec<f32> = flat_indices(&shape, &offset, &extent).into_iter().map(|f| value(t, f, version)).collect();
                        view.write_f32(&values)?;
                    }
                }
                Ok::<_, orchestrator::BufferError>(())
            })
            .await
            .unwrap()
            .0;
        assert_eq!(v, version);
    }
}

/// Whether `store` serves `version`, every value of it exactly.
pub(crate) fn serves(store: &DstStore, version: u64) -> Result<(), String> {
    let snap = store.snapshot_at(version).ok_or_else(|| format!("serves {:?}, not version {version}", store.version()))?;
    if store.version() != Some(version) {
        return Err(format!("serves {:?}, not version {version}", store.version()));
    }
    let mut checked = 0;
    for (t, name) in TENSORS.iter().enumerate() {
        for view in snap.buffers.tensor_blocks(name).map_err(|e| e.to_string())? {
            let got = view.to_f32().map_err(|e| e.to_string())?;
            let want: Vec<f32> =
                flat_indices(view.shape(), view.offset(), view.extent()).into_iter().map(|f| value(t, f, version)).collect();
            if got != want {
                return Err(format!("tensor {name} block at {:?}: {got:?}, want {want:?}", view.offset()));
            }
            checked += got.len();
        }
    }
    if checked == 0 {
        return Err("holds nothing".into());
    }
    Ok(())
}
