//! `refit run`: fill sources with a pattern, run one refit, optionally verify.

use super::report::{human, invalid, load, options, say, Failure};
use crate::Pair;
use refit::runner::prepare;
use reshard::Strategy;
use std::time::Duration;
use transport::ExecOptions;

#[cfg(feature = "cuda")]
fn execute_cuda(prepared: &mut refit::runner::Prepared) -> Result<transport::ExecReport, refit::runner::RunError> {
    prepared.execute_cuda()
}

#[cfg(not(feature = "cuda"))]
fn execute_cuda(_: &mut refit::runner::Prepared) -> Result<transport::ExecReport, refit::runner::RunError> {
    // cuda_available() already refused: this build has no GPU data plane.
    Err(refit::runner::RunError::Gpu("built without the cuda feature".into()))
}

pub(crate) fn run(pair: &Pair, baseline: bool, verify: bool, transport: &str, deadline_s: u64) -> Result<(), Failure> {
    match transport {
        "local" | "tcp" => {}
        "cuda" => transport::cuda_available().map_err(|e| invalid(format!("CUDA transport unavailable: {e}")))?,
        other => return Err(invalid(format!("--transport {other}: unknown transport (available: local, tcp, cuda)"))),
    }
    let (src, dst) = (load(&pair.src)?, load(&pair.dst)?);
    let opts = options(pair)?;
    let strategy = if baseline { Strategy::Baseline } else { Strategy::Reshard };
    let mut prepared =
        prepare(&src, &dst, strategy, &opts).map_err(|e| invalid(format!("{} -> {}: {e}", pair.src.display(), pair.dst.display())))?;
    let exec = ExecOptions { deadline: Duration::from_secs(deadline_s) };
    let report = match transport {
        "cuda" => execute_cuda(&mut prepared),
        "tcp" => prepared.execute_tcp(&exec),
        _ => prepared.execute(&exec),
    }
    .map_err(|e| Failure { line: e.to_string(), code: 1 })?;
    let secs = report.elapsed.as_secs_f64();
    let f = prepared.plan.figures();
    say!(
        "{strategy}: {} src ranks -> {} dst ranks, {} tensors, {} moved in {} messages, {} rounds",
        src.ranks(),
        dst.ranks(),
        dst.tensors().len(),
        human(report.bytes),
        report.messages,
        f.rounds
    );
    say!(
        "time {:.3} ms, {:.2} GiB/s (plan {:.3} ms)",
        secs * 1e3,
        report.bytes as f64 / secs.max(1e-12) / (1u64 << 30) as f64,
        prepared.plan_time.as_secs_f64() * 1e3
    );
    if verify {
        let n = prepared.verify(&src, &dst).map_err(|e| Failure { line: e.to_string(), code: 1 })?;
        say!("verify: all {n} destination elements match");
    }
    Ok(())
}
