//! `refit plan-bench`: time planning on a model preset and report peak memory.

use super::report::{duration, human, invalid, pair_summary, preset, preset_label, say, Failure, Progress};
use refit_cli::bench::peak_rss_bytes;
use refit_cli::presets::Model;
use reshard::{baseline_summary, plan_baseline, plan_reshard, PlanOptions};
use std::time::Instant;

pub(crate) fn run(model: Model, scale: u64, ep: Option<u32>, reps: usize, no_baseline: bool) -> Result<(), Failure> {
    let progress = Progress::spinner(false);
    progress.phase(format!("building the {model} layouts"));
    let t = Instant::now();
    let (src, dst) = preset(model, scale, ep)?;
    let build = t.elapsed();
    let opts = PlanOptions::default();
    let reps = reps.max(1);
    let mut times = Vec::new();
    let mut figures = None;
    for rep in 1..=reps {
        progress.phase(format!("rep {rep}/{reps}: planning reshard"));
        let t = Instant::now();
        let plan = plan_reshard(&src, &dst, &opts).map_err(|e| invalid(e.to_string()))?;
        times.push(t.elapsed());
        figures = Some(plan.figures().clone());
        drop(plan);
    }
    times.sort();
    let f = figures.unwrap_or_default();
    let peak = peak_rss_bytes();
    let baseline = if no_baseline {
        None
    } else {
        progress.phase("planning baseline");
        let t = Instant::now();
        let base = plan_baseline(&src, &dst, &opts).map_err(|e| invalid(e.to_string()))?;
        let (plan_time, figures) = (t.elapsed(), base.figures().clone());
        drop(base);
        // What `refit plan` uses: the baseline's figures and estimate
        // without its plan.
        progress.phase("summarizing baseline (figures and estimate, no plan)");
        let t = Instant::now();
        let summary = baseline_summary(&src, &dst, &opts, &opts.links).map_err(|e| invalid(e.to_string()))?;
        Some((plan_time, figures, t.elapsed(), summary.figures))
    };
    drop(progress);
    say!("{}: {} (layouts built in {})", preset_label(model, scale, ep), pair_summary(&src, &dst), duration(build));
    say!(
        "  reshard planning (the plan only, no per-rank programs): median {} over {} reps; {} pieces, {} transfers, {} messages, {} rounds",
        duration(times[times.len() / 2]),
        times.len(),
        f.pieces,
        f.transfers,
        f.messages,
        f.rounds
    );
    say!(
        "  reshard bytes moved {} (from sources {}, relayed {}); {} into the busiest dst node",
        human(f.total_bytes),
        human(f.src_egress_bytes),
        human(f.relayed_bytes()),
        human(f.dst_node_ingress_bytes.iter().copied().max().unwrap_or(0))
    );
    if let Some(peak) = peak {
        say!("  peak resident memory after reshard planning: {}", human(peak));
    }
    if let Some((plan_time, b, summary_time, summary)) = baseline {
        say!(
            "  baseline planning: {}; {} transfers; bytes moved {} (from sources {}, relayed {})",
            duration(plan_time),
            b.transfers,
            human(b.total_bytes),
            human(b.src_egress_bytes),
            human(b.relayed_bytes())
        );
        say!(
            "  baseline summary (figures and estimate, no plan): {}; {} messages in {} rounds",
            duration(summary_time),
            summary.messages,
            summary.rounds
        );
    }
    Ok(())
}

/// `refit plan-bench --replicas N`: the preset's inference layout as one
/// replica of `n`; the whole group planned from scratch beside its plan
/// derived from the one replica's ([`reshard::Plan::for_replicas`]), each
/// timed (median of `reps`), with their figures and modelled times.
pub(crate) fn replicas(model: Model, scale: u64, ep: Option<u32>, reps: usize, n: u32) -> Result<(), Failure> {
    let progress = Progress::spinner(false);
    progress.phase(format!("building the {model} layouts"));
    let (src, one) = preset(model, scale, ep)?;
    let group = one.replicated(n).map_err(|e| invalid(e.to_string()))?;
    let opts = PlanOptions::default();
    let reps = reps.max(1);
    let median = |mut t: Vec<std::time::Duration>| {
        t.sort();
        t[t.len() / 2]
    };
    let (mut whole_t, mut one_t, mut derive_t) = (Vec::new(), Vec::new(), Vec::new());
    let (mut whole, mut derived) = (None, None);
    for rep in 1..=reps {
        progress.phase(format!("rep {rep}/{reps}: planning {n} replicas whole"));
        let t = Instant::now();
        let plan = plan_reshard(&src, &group, &opts).map_err(|e| invalid(e.to_string()))?;
        whole_t.push(t.elapsed());
        whole = Some((plan.figures().clone(), plan.estimate(&opts.links).seconds));
        drop(plan);
        progress.phase(format!("rep {rep}/{reps}: one replica's plan, derived for {n}"));
        let t = Instant::now();
        let base = plan_reshard(&src, &one, &opts).map_err(|e| invalid(e.to_string()))?;
        one_t.push(t.elapsed());
        let t = Instant::now();
        let plan = base.for_replicas(&src, &one, &group).map_err(|e| invalid(e.to_string()))?;
        derive_t.push(t.elapsed());
        derived = Some((plan.figures().clone(), plan.estimate(&opts.links).seconds));
    }
    drop(progress);
    let (Some((wf, we)), Some((df, de))) = (whole, derived) else { return Err(invalid("no repetition ran".into())) };
    say!("{}, {n} replicas of the inference layout: {}", preset_label(model, scale, ep), pair_summary(&src, &group));
    say!(
        "  planned whole: median {} over {reps} reps; derived: one replica's plan {} + deriving {}",
        duration(median(whole_t)),
        duration(median(one_t)),
        duration(median(derive_t))
    );
    for (name, f, est) in [("planned whole", &wf, we), ("derived", &df, de)] {
        say!(
            "  {name}: bytes moved {} (from sources {}, relayed {}); busiest source rank sends {}; {} messages, {} rounds; modelled {:.3} s",
            human(f.total_bytes),
            human(f.src_egress_bytes),
            human(f.relayed_bytes()),
            human(f.src_rank_egress_bytes.iter().copied().max().unwrap_or(0)),
            f.messages,
            f.rounds,
            est
        );
    }
    Ok(())
}
