//! The orchestrator (the controller) at thousands of ranks: one
//! orchestrator drives a refit between two scaled-out groups
//! ([`crate::presets::scaled_out`]) whose members all live in this process
//! on the in-process fabric, with tiny weights, so what is measured is the
//! control plane: planning, deriving and installing every member's
//! program, each refit's status, prepare, run and commit, the control
//! messages, and memory. `refit controller-bench` prints it; every
//! refit is verified against the pattern on every destination.

use crate::presets::{scaled_out, Model, PresetError, ScaleOut};
use crate::runner::{Driver, DriverConfig, RunError};
use orchestrator::{PlanReport, RefitReport};
use reshard::{plan_reshard, Endpoint, Figures, Layout, PlanOptions, Programs};
use std::time::{Duration, Instant};
use thiserror::Error;

/// One measurement's settings.
#[derive(Clone, Copy, Debug)]
pub struct ControllerConfig {
    /// The model whose structure the layouts take (`deepseek-v3` or
    /// `kimi-k2`).
    pub model: Model,
    /// Hidden sizes divided by this (large: the weights are tiny, the
    /// tensors as many as the model's).
    pub scale: u64,
    /// Ranks and layers.
    pub shape: ScaleOut,
    /// Refits after the start, each verified.
    pub refits: usize,
}

/// Why a measurement failed.
#[derive(Debug, Error)]
pub enum ControllerError {
    /// The layouts cannot be built.
    #[error(transparent)]
    Preset(#[from] PresetError),
    /// Planning failed.
    #[error("planning: {0}")]
    Plan(String),
    /// The refit system failed, or a destination holds wrong bytes.
    #[error(transparent)]
    Run(#[from] RunError),
}

/// What one refit took, from the orchestrator's report.
#[derive(Clone, Debug)]
pub struct RefitFigures {
    /// The whole refit.
    pub wall: Duration,
    /// Every member's status (programs already installed: no planning).
    pub status: Duration,
    /// Every member opening its data-plane endpoint (`Prepare`; the
    /// in-process fabric has no `Connect`).
    pub prepare: Duration,
    /// `Run` on every member: the data plane and its control messages.
    pub run: Duration,
    /// `Commit` on every destination.
    pub commit: Duration,
    /// Control messages the orchestrator sent.
    pub control_messages: u64,
    /// Data-plane messages between ranks.
    pub data_messages: u64,
    /// Destination elements checked against the pattern.
    pub verified: u64,
}

impl RefitFigures {
    fn of(report: &RefitReport, verified: u64) -> RefitFigures {
        RefitFigures {
            wall: report.wall,
            status: report.plan_time,
            prepare: report.connect_time,
            run: report.transfer_time,
            commit: report.commit_time,
            control_messages: report.control_messages,
            data_messages: report.messages,
            verified,
        }
    }

    /// The control traffic of the refit: everything but the data plane's
    /// run.
    pub fn control(&self) -> Duration {
        self.status + self.prepare + self.commit
    }
}

/// What one measurement found.
#[derive(Clone, Debug)]
pub struct ControllerFigures {
    /// Training ranks.
    pub src_ranks: u32,
    /// Inference ranks.
    pub dst_ranks: u32,
    /// Tensors of the model (as many on both sides).
    pub tensors: usize,
    /// Bytes every source rank holds, in all.
    pub src_bytes: u64,
    /// Bytes every destination rank serves, in all (each holds it twice:
    /// staging and served).
    pub dst_bytes: u64,
    /// Building both layouts.
    pub layouts: Duration,
    /// The orchestrator's work alone, in this process before any member
    /// exists: planning.
    pub plan_alone: Duration,
    /// ... then deriving every rank's program, one at a time, as the
    /// orchestrator does while installing.
    pub derive_alone: Duration,
    /// Peak resident memory of the orchestrator's work alone (plan and
    /// derivation, over what the layouts took), in bytes.
    pub orchestrator_peak: Option<u64>,
    /// The plan's figures.
    pub figures: Figures,
    /// Starting every store and member, planning and installing every
    /// member's program (the orchestrator's first `Plan`), filling the
    /// sources.
    pub start: Duration,
    /// The orchestrator's report of that first `Plan`.
    pub planned: PlanReport,
    /// Every refit, in order.
    pub refits: Vec<RefitFigures>,
    /// Peak resident memory of the process over the whole system
    /// (stores, members, their programs, the orchestrator), in bytes.
    pub process_peak: Option<u64>,
}

/// Hands the memory freed so far back to the system (glibc's
/// `malloc_trim`), then resets this process's peak resident memory
/// (`VmHWM`) to its current size (Linux: `5` into
/// `/proc/self/clear_refs`), so the next peak is what grows from here;
/// false where it cannot.
fn reset_peak_rss() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` takes no pointer and touches no memory the
    // program holds: it returns free pages of glibc's arenas to the system,
    // and may run at any time from any thread. Its result (whether anything
    // was released) is not needed, so no path depends on it.
    unsafe {
        libc::malloc_trim(0);
    }
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Bytes every rank of `layout` holds, in all.
fn held(layout: &Layout) -> u64 {
    layout.buffers().iter().flatten().map(|b| b.elems.saturating_mul(b.dtype.size())).fold(0, u64::saturating_add)
}

/// Builds the layouts, measures the orchestrator's own work alone, then
/// starts the whole system in this process and runs `config.refits`
/// refits, each verified on every destination. `phase` is told what
/// starts.
pub fn measure(config: ControllerConfig, mut phase: impl FnMut(&str)) -> Result<ControllerFigures, ControllerError> {
    let ScaleOut { src_ranks, dst_ranks, .. } = config.shape;
    phase(&format!("{src_ranks} -> {dst_ranks}: building the layouts"));
    let t = Instant::now();
    let (src, dst) = scaled_out(config.model, config.scale, config.shape)?;
    let layouts = t.elapsed();

    // The orchestrator's work alone: the plan, then every program derived
    // and dropped one at a time (as `install` streams them out).
    phase(&format!("{src_ranks} -> {dst_ranks}: planning and deriving every program, alone"));
    let reset = reset_peak_rss();
    let before = crate::procs::status_number("self", "VmRSS:").map(|kib| kib * 1024);
    let t = Instant::now();
    let plan = plan_reshard(&src, &dst, &PlanOptions::default()).map_err(|e| ControllerError::Plan(e.to_string()))?;
    let plan_alone = t.elapsed();
    let t = Instant::now();
    {
        let programs = Programs::new(&plan, &src, &dst).map_err(|e| ControllerError::Plan(e.to_string()))?;
        for e in (0..src_ranks).map(Endpoint::src).chain((0..dst_ranks).map(Endpoint::dst)) {
            drop(std::hint::black_box(programs.program(e)));
        }
    }
    let derive_alone = t.elapsed();
    let figures = plan.figures().clone();
    drop(plan);
    let orchestrator_peak = match (reset, before, crate::bench::peak_rss_bytes()) {
        (true, Some(before), Some(peak)) => Some(peak.saturating_sub(before)),
        _ => None,
    };

    phase(&format!("{src_ranks} -> {dst_ranks}: starting {} members, planning and installing", src_ranks + dst_ranks));
    let t = Instant::now();
    let mut driver = Driver::start(&src, &dst, DriverConfig::default(), |_| {})?;
    let start = t.elapsed();
    let planned = driver.planned().clone();
    let mut refits = Vec::with_capacity(config.refits);
    for i in 0..config.refits {
        if i > 0 {
            driver.step()?;
        }
        phase(&format!("{src_ranks} -> {dst_ranks}: refit {}/{}", i + 1, config.refits));
        let report = driver.refit(None)?;
        let verified = driver.verify(None)?;
        refits.push(RefitFigures::of(&report, verified));
    }
    let process_peak = crate::bench::peak_rss_bytes();
    Ok(ControllerFigures {
        src_ranks,
        dst_ranks,
        tensors: src.tensors().len(),
        src_bytes: held(&src),
        dst_bytes: held(&dst),
        layouts,
        plan_alone,
        derive_alone,
        orchestrator_peak,
        figures,
        start,
        planned,
        refits,
        process_peak,
    })
}

/// Control messages one refit of a system of these groups sends when its
/// programs are installed, on the in-process fabric: `Status`, `Prepare`
/// and `Run` to every member, `Commit` to every destination.
pub fn control_messages_per_refit(src_ranks: u32, dst_ranks: u32) -> u64 {
    let members = (src_ranks + dst_ranks) as u64;
    3 * members + dst_ranks as u64
}
