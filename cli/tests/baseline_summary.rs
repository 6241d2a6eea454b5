//! `baseline_summary` (what `refit plan` reports for the baseline) against
//! the materialised `plan_baseline` on the model presets at small scale:
//! the figures exactly, the estimate within 1e-9 relative, under two link
//! models and two staging caps. The larger models keep a few layers (a
//! dense one, a MoE one, one from the last pipeline stage) so that a debug
//! build plans them quickly; their placements are the presets' own.

use refit_cli::presets::{layouts, Model};
use reshard::{baseline_summary, plan_baseline, Layout, LinkModel, PlanOptions};

/// `layout` with only the tensors outside the layers, and those of the
/// layers in `keep`.
fn some_layers(layout: &Layout, keep: &[u32]) -> Layout {
    let tensors = layout
        .tensors()
        .iter()
        .filter(|t| match t.name.strip_prefix("model.layers.") {
            None => true,
            Some(rest) => rest.split('.').next().and_then(|n| n.parse().ok()).is_some_and(|n: u32| keep.contains(&n)),
        })
        .cloned()
        .collect();
    Layout::new(layout.ranks(), Some(layout.ranks_per_node()), tensors).expect("a subset of a valid layout is valid")
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

#[test]
fn summary_matches_the_baseline_plan_on_the_presets() {
    let cases: [(Model, u64, Option<&[u32]>); 3] =
        [(Model::Llama3_8b, 8, None), (Model::Qwen3_235b, 64, Some(&[0, 1, 93])), (Model::DeepseekV3, 64, Some(&[0, 3, 60]))];
    for (model, scale, keep) in cases {
        let (src, dst) = layouts(model, scale).expect("preset layouts");
        let (src, dst) = match keep {
            Some(k) => (some_layers(&src, k), some_layers(&dst, k)),
            None => (src, dst),
        };
        assert!(dst.tensors().len() > 20, "{model:?}: {} tensors", dst.tensors().len());
        for cap in [256 << 20, 64 << 10] {
            let options = PlanOptions { max_staging_bytes: cap, ..PlanOptions::default() };
            let plan = plan_baseline(&src, &dst, &options).expect("baseline plan");
            assert!(plan.figures().rounds > 1, "{model:?}, cap {cap}: one round only");
            for links in [LinkModel::DGX_H100, LinkModel::GB200] {
                let what = format!("{model:?} scale {scale}, cap {cap}, {links:?}");
                let summary = baseline_summary(&src, &dst, &options, &links).expect("baseline summary");
                assert_eq!(&summary.figures, plan.figures(), "{what}: figures");
                let want = plan.estimate(&links);
                assert!(close(summary.estimate.seconds, want.seconds), "{what}: {} vs {}", summary.estimate.seconds, want.seconds);
                assert!(close(summary.estimate.lower_bound_seconds, want.lower_bound_seconds), "{what}: lower bound");
            }
        }
    }
}
