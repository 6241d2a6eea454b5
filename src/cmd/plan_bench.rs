//! `refit plan-bench`: time planning on a model preset and report peak memory.

use super::report::{human, invalid, preset, preset_label, say, Failure};
use refit::bench::peak_rss_bytes;
use refit::presets::Model;
use reshard::{baseline_summary, plan_baseline, plan_reshard, PlanOptions};
use std::time::Instant;

pub(crate) fn run(model: Model, scale: u64, ep: Option<u32>, reps: usize, no_baseline: bool) -> Result<(), Failure> {
    let t = Instant::now();
    let (src, dst) = preset(model, scale, ep)?;
    let build = t.elapsed();
    let opts = PlanOptions::default();
    let mut times = Vec::new();
    let mut figures = None;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let plan = plan_reshard(&src, &dst, &opts).map_err(|e| invalid(e.to_string()))?;
        times.push(t.elapsed());
        figures = Some(plan.figures().clone());
        drop(plan);
    }
    times.sort();
    let f = figures.unwrap_or_default();
    say!(
        "{}: {} tensors, {} src ranks -> {} dst ranks (layouts built in {:.3} s)",
        preset_label(model, scale, ep),
        dst.tensors().len(),
        src.ranks(),
        dst.ranks(),
        build.as_secs_f64()
    );
    say!(
        "  reshard plan: median {:.3} s over {} reps; {} pieces, {} transfers, {} messages, {} rounds",
        times[times.len() / 2].as_secs_f64(),
        times.len(),
        f.pieces,
        f.transfers,
        f.messages,
        f.rounds
    );
    say!(
        "  reshard moves {} ({} into the busiest dst node)",
        human(f.total_bytes),
        human(f.dst_node_ingress_bytes.iter().copied().max().unwrap_or(0))
    );
    if let Some(peak) = peak_rss_bytes() {
        say!("  peak resident memory after reshard planning: {}", human(peak));
    }
    if !no_baseline {
        let t = Instant::now();
        let base = plan_baseline(&src, &dst, &opts).map_err(|e| invalid(e.to_string()))?;
        say!(
            "  baseline plan: {:.3} s; {} transfers, moves {}",
            t.elapsed().as_secs_f64(),
            base.figures().transfers,
            human(base.figures().total_bytes)
        );
        drop(base);
        // What `refit plan` uses: the baseline's figures and estimate
        // without its plan.
        let t = Instant::now();
        let summary = baseline_summary(&src, &dst, &opts, &opts.links).map_err(|e| invalid(e.to_string()))?;
        say!(
            "  baseline summary (figures and estimate, no plan): {:.3} s; {} messages in {} rounds",
            t.elapsed().as_secs_f64(),
            summary.figures.messages,
            summary.figures.rounds
        );
    }
    Ok(())
}
