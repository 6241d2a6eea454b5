//! One refit on the embedded in-process data plane: plan, build programs,
//! allocate and fill buffers, execute, verify.

use reshard::{plan_baseline, plan_reshard, Layout, Plan, PlanError, PlanOptions, RankProgram, Strategy};
use std::time::{Duration, Instant};
use thiserror::Error;
use transport::{fill_sources, run_local, verify_destinations, ExecError, ExecOptions, ExecReport, Mismatch, RankMemory};

/// Why a run failed.
#[derive(Debug, Error)]
pub enum RunError {
    /// Planning failed (bad layout pair).
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// Execution failed.
    #[error("execution failed: {0}")]
    Exec(#[from] ExecError),
    /// The buffers would not fit in this machine's memory.
    #[error("the buffers need {needed} bytes but only {available} bytes of memory are available")]
    Memory {
        /// Bytes the buffers need.
        needed: u64,
        /// Bytes available (Linux `MemAvailable`).
        available: u64,
    },
    /// The GPU data plane failed.
    #[error("GPU data plane: {0}")]
    Gpu(String),
    /// Verification found wrong bytes.
    #[error("verification failed: {0}")]
    Verify(#[from] Box<Mismatch>),
}

/// A prepared refit: plan, programs and memory, ready to execute repeatedly.
pub struct Prepared {
    /// The plan.
    pub plan: Plan,
    /// Per-rank programs (source ranks, then destination ranks).
    pub programs: Vec<RankProgram>,
    /// Per-rank memory, same order.
    pub memory: Vec<RankMemory>,
    /// Time to plan.
    pub plan_time: Duration,
    src_ranks: usize,
}

/// Plans with `strategy`, builds programs, allocates memory and fills the
/// source buffers with the verification pattern.
pub fn prepare(src: &Layout, dst: &Layout, strategy: Strategy, options: &PlanOptions) -> Result<Prepared, RunError> {
    let t = Instant::now();
    let plan = match strategy {
        Strategy::Reshard => plan_reshard(src, dst, options)?,
        Strategy::Baseline => plan_baseline(src, dst, options)?,
    };
    let mut prepared = prepare_plan(src, dst, plan)?;
    prepared.plan_time = t.elapsed();
    Ok(prepared)
}

/// As [`prepare`], with a plan already made for these layouts (`plan_time`
/// is then zero).
pub fn prepare_plan(src: &Layout, dst: &Layout, plan: Plan) -> Result<Prepared, RunError> {
    let plan_time = Duration::ZERO;
    let programs = plan.programs(src, dst)?;
    let needed: u64 = programs.iter().flat_map(|p| &p.buffers).map(|b| b.elems.saturating_mul(b.dtype.size())).fold(0, u64::saturating_add);
    if let Some(available) = available_memory() {
        if needed > available {
            return Err(RunError::Memory { needed, available });
        }
    }
    let mut memory = RankMemory::for_programs(&programs);
    fill_sources(src, &mut memory[..src.ranks() as usize]);
    Ok(Prepared { plan, programs, memory, plan_time, src_ranks: src.ranks() as usize })
}

impl Prepared {
    /// Executes every rank's program on the in-process transport.
    pub fn execute(&mut self, options: &ExecOptions) -> Result<ExecReport, RunError> {
        Ok(run_local(&self.programs, &mut self.memory, options)?)
    }

    /// Executes every rank's program as a thread of this process, talking
    /// over loopback TCP streams.
    pub fn execute_tcp(&mut self, options: &ExecOptions) -> Result<ExecReport, RunError> {
        Ok(transport::run_tcp(&self.programs, &mut self.memory, options, &transport::tcp::TcpConfig::default())?)
    }

    /// Executes every rank's program as a thread of this process over
    /// `transports` (one per rank, same order), e.g. a fabric kept across
    /// refits.
    pub fn execute_over<T: transport::Transport + transport::WithAbort>(
        &mut self,
        options: &ExecOptions,
        transports: Vec<T>,
    ) -> Result<ExecReport, RunError> {
        Ok(transport::run_threads(&self.programs, &mut self.memory, options, transports)?)
    }

    /// Checks every destination element; returns how many were checked.
    pub fn verify(&self, src: &Layout, dst: &Layout) -> Result<u64, RunError> {
        Ok(verify_destinations(src, dst, &self.memory[self.src_ranks..])?)
    }

    /// Executes every rank's program on GPU 0, each rank's buffers in its
    /// own device memory, then copies the results back to host memory (so
    /// [`verify`](Self::verify) checks them).
    #[cfg(feature = "cuda")]
    pub fn execute_cuda(&mut self) -> Result<ExecReport, RunError> {
        use transport::cuda::device::{DeviceMemory, GpuDevice};
        use transport::cuda::exec::run_device;
        let gpu = |e: String| RunError::Gpu(e);
        let dev = GpuDevice::open(0).map_err(|e| gpu(e.to_string()))?;
        let mut device = DeviceMemory::for_programs(&dev, &self.programs).map_err(|e| gpu(e.to_string()))?;
        for (d, h) in device.iter_mut().zip(&self.memory) {
            d.upload(&dev, h).map_err(|e| gpu(e.to_string()))?;
        }
        let report = run_device(&dev, &self.programs, &mut device).map_err(|e| gpu(e.to_string()))?;
        for (d, h) in device.iter().zip(self.memory.iter_mut()).skip(self.src_ranks) {
            *h = d.download(&dev).map_err(|e| gpu(e.to_string()))?;
        }
        Ok(ExecReport { elapsed: report.elapsed, bytes: report.wire_bytes, messages: report.messages })
    }

    /// Zeroes destination memory (between repeated runs).
    pub fn clear_destinations(&mut self) {
        for m in &mut self.memory[self.src_ranks..] {
            for b in &mut m.buffers {
                b.fill(0);
            }
        }
    }
}

/// Memory the kernel says is available (Linux `MemAvailable`), if known.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
