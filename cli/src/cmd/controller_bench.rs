//! `refit controller-bench`: one orchestrator over thousands of members in
//! this process (tiny weights, the model's tensors), at several sizes:
//! plan, derivation and install, each refit's control steps, control
//! messages, memory.

use super::report::{duration, human, invalid, say, Failure, Progress, Table};
use refit_cli::controller::{measure, ControllerConfig, ControllerFigures};
use refit_cli::presets::{Model, ScaleOut};
use serde_json::json;
use std::time::Duration;

pub(crate) struct ControllerArgs<'a> {
    pub(crate) model: Model,
    pub(crate) scale: u64,
    pub(crate) layers: u32,
    pub(crate) ranks: &'a [u32],
    pub(crate) refits: usize,
    pub(crate) json: bool,
}

/// `min..max` of `f` over the refits after the first (all of them if
/// there is one).
fn range(f: &ControllerFigures, of: impl Fn(&refit_cli::controller::RefitFigures) -> Duration) -> String {
    let later = if f.refits.len() > 1 { &f.refits[1..] } else { &f.refits[..] };
    let (lo, hi) = later.iter().map(&of).fold((Duration::MAX, Duration::ZERO), |(lo, hi), d| (lo.min(d), hi.max(d)));
    if later.is_empty() {
        "-".into()
    } else if lo == hi {
        duration(lo)
    } else {
        format!("{}-{}", duration(lo), duration(hi))
    }
}

fn opt_bytes(b: Option<u64>) -> String {
    b.map_or("?".into(), human)
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn figures_json(f: &ControllerFigures) -> serde_json::Value {
    json!({
        "src_ranks": f.src_ranks,
        "dst_ranks": f.dst_ranks,
        "tensors": f.tensors,
        "src_bytes": f.src_bytes,
        "dst_bytes": f.dst_bytes,
        "transfers": f.figures.transfers,
        "data_messages": f.figures.messages,
        "layouts_s": secs(f.layouts),
        "plan_alone_s": secs(f.plan_alone),
        "derive_alone_s": secs(f.derive_alone),
        "orchestrator_peak_bytes": f.orchestrator_peak,
        "start_s": secs(f.start),
        "plan_s": secs(f.planned.plan_time),
        "install_s": secs(f.planned.install_time),
        "install_control_messages": f.planned.control_messages,
        "process_peak_bytes": f.process_peak,
        "refits": f.refits.iter().map(|r| json!({
            "wall_s": secs(r.wall),
            "status_s": secs(r.status),
            "prepare_s": secs(r.prepare),
            "run_s": secs(r.run),
            "commit_s": secs(r.commit),
            "control_messages": r.control_messages,
            "data_messages": r.data_messages,
            "verified_elements": r.verified,
        })).collect::<Vec<_>>(),
    })
}

pub(crate) fn run(args: &ControllerArgs<'_>) -> Result<(), Failure> {
    let progress = Progress::spinner(args.json);
    let mut all = Vec::new();
    for &n in args.ranks {
        let shape = ScaleOut { src_ranks: n, dst_ranks: n, layers: args.layers };
        let config = ControllerConfig { model: args.model, scale: args.scale, shape, refits: args.refits.max(1) };
        let f = measure(config, |p| progress.phase(p.to_string())).map_err(|e| invalid(format!("{n} -> {n} ranks: {e}")))?;
        all.push(f);
    }
    drop(progress);
    if args.json {
        let sizes: Vec<_> = all.iter().map(figures_json).collect();
        let out = json!({"model": args.model.name(), "scale": args.scale, "layers": args.layers, "sizes": sizes});
        println!("{out}");
        return Ok(());
    }
    say!(
        "{} structure, first {} layers, hidden sizes / {}: one orchestrator, every member in this process (in-process fabric); every refit verified on every destination",
        args.model,
        args.layers,
        args.scale
    );
    for f in &all {
        say!(
            "  {} -> {} ranks: {} tensors, {} transfers, {} data messages; sources hold {}, destinations serve {}",
            f.src_ranks,
            f.dst_ranks,
            f.tensors,
            f.figures.transfers,
            f.figures.messages,
            human(f.src_bytes),
            human(f.dst_bytes)
        );
    }
    let mut table = Table::new(&[
        "ranks",
        "plan",
        "derive all",
        "orch. peak",
        "start",
        "plan+install",
        "refit 1",
        "status",
        "prepare",
        "run",
        "commit",
        "ctl msgs",
        "process peak",
    ]);
    for f in &all {
        let first = &f.refits[0];
        table.row(
            &format!("{} -> {}", f.src_ranks, f.dst_ranks),
            [
                duration(f.plan_alone),
                duration(f.derive_alone),
                opt_bytes(f.orchestrator_peak),
                duration(f.start),
                format!("{} + {}", duration(f.planned.plan_time), duration(f.planned.install_time)),
                duration(first.wall),
                range(f, |r| r.status),
                range(f, |r| r.prepare),
                range(f, |r| r.run),
                range(f, |r| r.commit),
                first.control_messages.to_string(),
                opt_bytes(f.process_peak),
            ],
        );
    }
    table.print();
    say!(
        "plan, derive all, orch. peak: the orchestrator's work alone before any member exists (planning; deriving every rank's program one by one; \
         peak resident memory of both over the layouts). start: stores, members, the orchestrator's plan + install (its report), filling the sources. \
         refit 1: the first refit's wall time; status, prepare, run, commit: ranges over the refits after the first (the orchestrator's report). \
         ctl msgs: control messages per refit."
    );
    Ok(())
}
