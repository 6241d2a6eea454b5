//! `refit run`: fill sources with a pattern, run one refit, optionally verify.

use super::report::{
    bytes_json, duration, human, invalid, load, options, pair_summary, plural, rate, say, Failure, Progress, BYTES_LEGEND,
};
use crate::Pair;
use refit::runner::prepare_with;
use reshard::Strategy;
use serde_json::json;
use std::time::Duration;
use transport::{ExecOptions, GpuPlane};

#[cfg(feature = "cuda")]
fn execute_gpu(
    plane: GpuPlane,
    prepared: &mut refit::runner::Prepared,
    deadline: Duration,
) -> Result<transport::ExecReport, refit::runner::RunError> {
    match plane {
        GpuPlane::Device => prepared.execute_cuda(),
        GpuPlane::Nccl => prepared.execute_nccl(deadline),
        // gpu_plane_available() refuses it: the ranks are threads of this process.
        GpuPlane::Ipc => Err(refit::runner::RunError::Gpu("CUDA IPC joins ranks of different processes".into())),
    }
}

#[cfg(not(feature = "cuda"))]
fn execute_gpu(_: GpuPlane, _: &mut refit::runner::Prepared, _: Duration) -> Result<transport::ExecReport, refit::runner::RunError> {
    // gpu_plane_available() already refused: this build has no GPU data plane.
    Err(refit::runner::RunError::Gpu("built without the cuda feature".into()))
}

/// Arguments of `refit run`.
pub(crate) struct RunArgs<'a> {
    pub(crate) pair: &'a Pair,
    pub(crate) baseline: bool,
    pub(crate) verify: bool,
    pub(crate) transport: &'a str,
    pub(crate) deadline_s: u64,
    pub(crate) json: bool,
    /// Write every destination rank's buffers here after the refit.
    pub(crate) dump_dst: Option<&'a std::path::Path>,
    /// Only these destination tensors (empty: all).
    pub(crate) only: &'a [String],
}

pub(crate) fn run(a: &RunArgs<'_>) -> Result<(), Failure> {
    let transport = a.transport;
    let gpu = match transport {
        "local" | "tcp" => None,
        "cuda" => Some(GpuPlane::Device),
        "nccl" => Some(GpuPlane::Nccl),
        "ipc" => Some(GpuPlane::Ipc),
        other => return Err(invalid(format!("--transport {other}: unknown transport (available: local, tcp, cuda, nccl, ipc)"))),
    };
    let pair = a.pair;
    let (src, dst) = (load(&pair.src)?, load(&pair.dst)?);
    if let Some(plane) = gpu {
        transport::gpu_plane_available(plane, src.ranks() + dst.ranks())
            .map_err(|e| invalid(format!("{} transport unavailable: {e}", plane.name().to_uppercase())))?;
    }
    let mut opts = options(pair)?;
    if !a.only.is_empty() {
        opts.only = Some(reshard::TensorSubset::new(a.only.iter().cloned()));
    }
    let strategy = if a.baseline { Strategy::Baseline } else { Strategy::Reshard };
    let progress = Progress::spinner(a.json);
    let mut prepared = prepare_with(&src, &dst, strategy, &opts, |p| progress.phase(p.to_string()))
        .map_err(|e| invalid(format!("{} -> {}: {e}", pair.src.display(), pair.dst.display())))?;
    let f = prepared.plan.figures().clone();
    progress.phase(format!("moving {} over the {transport} transport", human(f.total_bytes)));
    let exec = ExecOptions { deadline: Duration::from_secs(a.deadline_s) };
    // Each data plane checks that it moved the plan's bytes moved
    // (`RunError::Accounting`), so the figures below are the plan's.
    let report = match (gpu, transport) {
        (Some(plane), _) => execute_gpu(plane, &mut prepared, exec.deadline),
        (None, "tcp") => prepared.execute_tcp(&exec),
        _ => prepared.execute(&exec),
    }
    .map_err(|e| Failure { line: e.to_string(), code: 1 })?;
    let verified = if a.verify {
        progress.phase("verifying every destination element");
        Some(prepared.verify(&src, &dst).map_err(|e| Failure { line: e.to_string(), code: 1 })?)
    } else {
        None
    };
    let dumped = match a.dump_dst {
        Some(dir) => {
            progress.phase(format!("writing every destination rank's buffers to {}", dir.display()));
            Some(
                refit::dump::dump_destinations(dir, &dst, prepared.dst_memory())
                    .map_err(|e| Failure { line: format!("--dump-dst: {e}"), code: 1 })?,
            )
        }
        None => None,
    };
    drop(progress);
    if a.json {
        let mut out = json!({
            "strategy": strategy.to_string(),
            "transport": transport,
            "src_ranks": src.ranks(),
            "dst_ranks": dst.ranks(),
            "tensors": dst.tensors().len(),
        });
        if let serde_json::Value::Object(m) = &mut out {
            m.extend(bytes_json(&f));
            m.extend([
                ("messages".to_string(), json!(f.messages)),
                ("rounds".to_string(), json!(f.rounds)),
                ("transfer_s".to_string(), json!(report.elapsed.as_secs_f64())),
                ("plan_s".to_string(), json!(prepared.plan_time.as_secs_f64())),
                ("verified_elements".to_string(), json!(verified)),
                ("dumped_bytes".to_string(), json!(dumped)),
            ]);
        }
        say!("{out}");
        return Ok(());
    }
    say!("{strategy} over the {transport} transport: {}", pair_summary(&src, &dst));
    say!("{:<16}{}", "bytes moved", human(f.total_bytes));
    say!("{:<16}{}", "  from sources", human(f.src_egress_bytes));
    say!("{:<16}{}", "  relayed", human(f.relayed_bytes()));
    say!("{:<16}{} in {}", "messages", f.messages, plural(f.rounds, "round"));
    say!("{:<16}{} ({})", "transfer", duration(report.elapsed), rate(f.total_bytes, report.elapsed));
    say!("{:<16}{} (the plan and every rank's program, in this process)", "planned in", duration(prepared.plan_time));
    say!("{BYTES_LEGEND}");
    if let Some(n) = verified {
        say!("verify: all {n} destination elements match");
    }
    if let (Some(dir), Some(bytes)) = (a.dump_dst, dumped) {
        say!("dumped {} of destination buffers to {} (rank<r>/<buffer>.bin, rank<r>/index.json)", human(bytes), dir.display());
    }
    Ok(())
}
