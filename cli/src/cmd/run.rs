//! `refit run`: fill sources with a pattern, run one refit, optionally verify.

use super::report::{
    bytes_json, duration, human, invalid, load, options, pair_summary, plural, rate, say, Failure, Progress, BYTES_LEGEND,
};
use crate::Pair;
use refit_cli::runner::{DataPlane, Driver, DriverConfig, RunError};
use reshard::{Figures, Layout, Strategy, TensorSubset};
use serde_json::json;
use std::time::Duration;

/// Arguments of `refit run`.
pub(crate) struct RunArgs<'a> {
    pub(crate) pair: &'a Pair,
    pub(crate) baseline: bool,
    pub(crate) verify: bool,
    /// The orchestrator's digest check before the commit.
    pub(crate) digest_check: bool,
    pub(crate) transport: &'a str,
    pub(crate) deadline_s: u64,
    pub(crate) json: bool,
    /// Write every destination rank's buffers here after the refit.
    pub(crate) dump_dst: Option<&'a std::path::Path>,
    /// Only these destination tensors (empty: all).
    pub(crate) only: &'a [String],
}

/// What one refit left to report: the orchestrator's figures and times,
/// the elements verified (`--verify`) and the bytes dumped (`--dump-dst`).
struct Outcome {
    figures: Figures,
    report: orchestrator::RefitReport,
    verified: Option<u64>,
    dumped: Option<u64>,
}

pub(crate) fn run(a: &RunArgs<'_>) -> Result<(), Failure> {
    let transport = a.transport;
    let plane = data_plane(transport)?;
    let pair = a.pair;
    let (src, dst) = (load(&pair.src)?, load(&pair.dst)?);
    let fabric_check = match plane {
        DataPlane::Nccl => Some(orchestrator::Fabric::Nccl(orchestrator::NcclFabric::new(orchestrator::CommPlane::Cuda))),
        _ => None,
    };
    if let Some(fabric) = fabric_check {
        orchestrator::fabric_available(&fabric, src.ranks() + dst.ranks())
            .map_err(|e| invalid(format!("{} transport unavailable: {e}", transport.to_uppercase())))?;
    }
    let opts = options(pair)?;
    let only = (!a.only.is_empty()).then(|| TensorSubset::new(a.only.iter().cloned()));
    if let Some(subset) = &only {
        // Refused now, before anything starts: names not in the layout.
        subset.mask(&dst).map_err(|e| invalid(format!("--only: {e}")))?;
    }
    let strategy = if a.baseline { Strategy::Baseline } else { Strategy::Reshard };
    let progress = Progress::spinner(a.json);
    let deadline = Duration::from_secs(a.deadline_s);
    let config = DriverConfig { plane, strategy, options: opts, deadline, delta: false, digest_check: a.digest_check };
    let mut driver = Driver::start(&src, &dst, config, |p| progress.phase(p.to_string()))
        .map_err(|e| invalid(format!("{} -> {}: {e}", pair.src.display(), pair.dst.display())))?;
    let outcome = refit_once(a, &mut driver, &dst, only.as_ref(), &progress)?;
    drop(progress);
    if a.json {
        say!("{}", run_json(a, strategy, (&src, &dst), &driver, &outcome));
    } else {
        print_run(a, strategy, (&src, &dst), &driver, &outcome);
    }
    Ok(())
}

/// The data plane `--transport` names, or why it cannot run here.
fn data_plane(transport: &str) -> Result<DataPlane, Failure> {
    match transport {
        "local" => Ok(DataPlane::Local),
        "tcp" => Ok(DataPlane::Tcp),
        "nccl" => Ok(DataPlane::Nccl),
        "ipc" => Err(invalid(
            "IPC transport unavailable: CUDA IPC joins ranks of different processes, and `refit run` runs every rank in this one \
             (`refit launch` runs members in processes; scripts/gpu-check.sh checks IPC between two)"
                .into(),
        )),
        "cuda" => Err(invalid(
            "CUDA transport unavailable: every rank on one GPU is not a data plane members open; \
             scripts/gpu-check.sh --only throughput measures that executor"
                .into(),
        )),
        other => Err(invalid(format!("--transport {other}: unknown transport (available: local, tcp, nccl)"))),
    }
}

/// The refit (after a full one when only `only` is refit), then the
/// verification and the dump asked for.
fn refit_once(
    a: &RunArgs<'_>,
    driver: &mut Driver,
    dst: &Layout,
    only: Option<&TensorSubset>,
    progress: &Progress,
) -> Result<Outcome, Failure> {
    let fail = |e: RunError| Failure { line: e.to_string(), code: 1 };
    // A subset refit keeps every other tensor from the version each
    // destination serves: a full refit of the version before comes first.
    let base = match only {
        Some(_) => {
            progress.phase("a full refit first: the version a subset refit builds on");
            driver.refit(None).map_err(fail)?;
            Some(driver.version())
        }
        None => None,
    };
    if only.is_some() {
        driver.step().map_err(fail)?;
    }
    progress.phase(format!("moving {} over the {} transport", human(driver.figures().total_bytes), a.transport));
    // The driver checks that the members moved the plan's bytes moved
    // (`RunError::Accounting`), so the figures below are the plan's.
    let report = driver.refit(only).map_err(fail)?;
    let figures = report.figures.clone();
    let verified = if a.verify {
        progress.phase("verifying every destination element");
        let subset = only.zip(base);
        Some(driver.verify(subset).map_err(fail)?)
    } else {
        None
    };
    let dumped = match a.dump_dst {
        Some(dir) => {
            progress.phase(format!("writing every destination rank's buffers to {}", dir.display()));
            let served = driver.served().map_err(fail)?;
            let memory: Vec<&[Vec<u8>]> = served.iter().map(|s| s.buffers.memory().buffers.as_slice()).collect();
            Some(refit_cli::dump::dump_destinations(dir, dst, &memory).map_err(|e| Failure { line: format!("--dump-dst: {e}"), code: 1 })?)
        }
        None => None,
    };
    Ok(Outcome { figures, report, verified, dumped })
}

/// `refit run --json`'s output.
fn run_json(a: &RunArgs<'_>, strategy: Strategy, (src, dst): (&Layout, &Layout), driver: &Driver, o: &Outcome) -> serde_json::Value {
    let (f, report) = (&o.figures, &o.report);
    let mut out = json!({
        "strategy": strategy.to_string(),
        "transport": a.transport,
        "src_ranks": src.ranks(),
        "dst_ranks": dst.ranks(),
        "tensors": dst.tensors().len(),
    });
    if let serde_json::Value::Object(m) = &mut out {
        m.extend(bytes_json(f));
        m.extend([
            ("messages".to_string(), json!(f.messages)),
            ("rounds".to_string(), json!(f.rounds)),
            ("transfer_s".to_string(), json!(report.transfer_time.as_secs_f64())),
            ("verify_s".to_string(), json!(report.verify_time.as_secs_f64())),
            ("digest_verified_ranks".to_string(), json!(report.verified_ranks)),
            ("digest_unverified_ranks".to_string(), json!(report.unverified_ranks)),
            ("plan_s".to_string(), json!(driver.plan_time().as_secs_f64())),
            ("verified_elements".to_string(), json!(o.verified)),
            ("dumped_bytes".to_string(), json!(o.dumped)),
        ]);
    }
    out
}

/// `refit run`'s text output.
fn print_run(a: &RunArgs<'_>, strategy: Strategy, (src, dst): (&Layout, &Layout), driver: &Driver, o: &Outcome) {
    let (f, report, transport) = (&o.figures, &o.report, a.transport);
    say!("{strategy} over the {transport} transport: {}", pair_summary(src, dst));
    say!("{:<16}{}", "bytes moved", human(f.total_bytes));
    say!("{:<16}{}", "  from sources", human(f.src_egress_bytes));
    say!("{:<16}{}", "  relayed", human(f.relayed_bytes()));
    say!("{:<16}{} in {}", "messages", f.messages, plural(f.rounds, "round"));
    say!("{:<16}{} ({})", "transfer", duration(report.transfer_time), rate(f.total_bytes, report.transfer_time));
    if a.digest_check {
        say!(
            "{:<16}{} (digests of {} of {} destination ranks matched their senders' before the commit; part of the transfer)",
            "digest check",
            duration(report.verify_time),
            report.verified_ranks,
            report.verified_ranks + report.unverified_ranks
        );
    }
    say!("{:<16}{} (the plan, every rank's program installed on its member)", "planned in", duration(driver.plan_time()));
    say!("{BYTES_LEGEND}");
    if let Some(n) = o.verified {
        say!("verify: all {n} destination elements match");
    }
    if let (Some(dir), Some(bytes)) = (a.dump_dst, o.dumped) {
        say!("dumped {} of destination buffers to {} (rank<r>/<buffer>.bin, rank<r>/index.json)", human(bytes), dir.display());
    }
}
