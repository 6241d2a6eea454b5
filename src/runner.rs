//! One refit on the embedded in-process data plane: plan, build programs,
//! allocate and fill buffers, execute, verify.

use reshard::{plan_baseline, plan_reshard, Layout, Plan, PlanError, PlanOptions, RankProgram, Strategy};
use std::time::{Duration, Instant};
use thiserror::Error;
use transport::{
    fill_sources, run_local, verify_destination_tensors, verify_destinations, ExecError, ExecOptions, ExecReport, Mismatch, RankMemory,
};

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
    /// The data plane moved other bytes or messages than the plan counts:
    /// a bug in the data plane's count or in the plan's figures.
    #[error(
        "bug: the data plane moved {moved} bytes in {messages} messages, the plan counts {planned} bytes in {planned_messages} messages"
    )]
    Accounting {
        /// Bytes the data plane reports.
        moved: u64,
        /// Messages the data plane reports.
        messages: u64,
        /// The plan's bytes moved (`Figures::total_bytes`).
        planned: u64,
        /// The plan's messages.
        planned_messages: u64,
    },
}

/// A prepared refit: plan, programs and memory, ready to execute repeatedly.
pub struct Prepared {
    /// The plan.
    pub plan: Plan,
    /// Per-rank programs (source ranks, then destination ranks).
    pub programs: Vec<RankProgram>,
    /// Per-rank memory, same order.
    pub memory: Vec<RankMemory>,
    /// Time to plan and to derive every rank's program from the plan (what
    /// `refit run` reports as "planned in"); allocating and filling the
    /// buffers is not counted.
    pub plan_time: Duration,
    src_ranks: usize,
}

/// Plans with `strategy`, builds programs, allocates memory and fills the
/// source buffers with the verification pattern.
pub fn prepare(src: &Layout, dst: &Layout, strategy: Strategy, options: &PlanOptions) -> Result<Prepared, RunError> {
    prepare_with(src, dst, strategy, options, |_| {})
}

/// As [`prepare`], telling `phase` what it starts on ("planning reshard",
/// "deriving per-rank programs", "allocating and filling buffers"), for a
/// progress display.
pub fn prepare_with(
    src: &Layout,
    dst: &Layout,
    strategy: Strategy,
    options: &PlanOptions,
    mut phase: impl FnMut(&str),
) -> Result<Prepared, RunError> {
    let t = Instant::now();
    phase(&format!("planning {strategy}"));
    let plan = match strategy {
        Strategy::Reshard => plan_reshard(src, dst, options)?,
        Strategy::Baseline => plan_baseline(src, dst, options)?,
    };
    phase("deriving per-rank programs");
    let programs = plan.programs(src, dst)?;
    let plan_time = t.elapsed();
    phase("allocating and filling buffers");
    with_programs(src, plan, programs, plan_time)
}

/// As [`prepare`], with a plan already made for these layouts (`plan_time`
/// is then zero).
pub fn prepare_plan(src: &Layout, dst: &Layout, plan: Plan) -> Result<Prepared, RunError> {
    let programs = plan.programs(src, dst)?;
    with_programs(src, plan, programs, Duration::ZERO)
}

/// Allocates every rank's buffers for `programs` (if this machine has the
/// memory) and fills the sources with the verification pattern.
fn with_programs(src: &Layout, plan: Plan, programs: Vec<RankProgram>, plan_time: Duration) -> Result<Prepared, RunError> {
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
    /// The destination ranks' memory (rank order; each rank's layout
    /// buffers first, then any scratch its program adds).
    pub fn dst_memory(&self) -> &[RankMemory] {
        &self.memory[self.src_ranks..]
    }

    /// Executes every rank's program on the in-process transport.
    pub fn execute(&mut self, options: &ExecOptions) -> Result<ExecReport, RunError> {
        let report = run_local(&self.programs, &mut self.memory, options)?;
        self.checked(report)
    }

    /// Executes every rank's program as a thread of this process, talking
    /// over loopback TCP streams.
    pub fn execute_tcp(&mut self, options: &ExecOptions) -> Result<ExecReport, RunError> {
        let report = transport::run_tcp(&self.programs, &mut self.memory, options, &transport::TcpConfig::default())?;
        self.checked(report)
    }

    /// Executes every rank's program as a thread of this process over
    /// `transports` (one per rank, same order), e.g. a fabric kept across
    /// refits.
    pub fn execute_over<T: transport::Transport + transport::WithAbort>(
        &mut self,
        options: &ExecOptions,
        transports: Vec<T>,
    ) -> Result<ExecReport, RunError> {
        let report = transport::run_threads(&self.programs, &mut self.memory, options, transports)?;
        self.checked(report)
    }

    /// `report` if the data plane moved exactly the plan's bytes moved
    /// (`Figures::total_bytes`) in the plan's messages, else
    /// [`RunError::Accounting`]: every command reports the plan's figure
    /// under "bytes moved", so the two must agree.
    fn checked(&self, report: ExecReport) -> Result<ExecReport, RunError> {
        let f = self.plan.figures();
        if (report.bytes, report.messages) == (f.total_bytes, f.messages) {
            Ok(report)
        } else {
            Err(RunError::Accounting {
                moved: report.bytes,
                messages: report.messages,
                planned: f.total_bytes,
                planned_messages: f.messages,
            })
        }
    }

    /// Checks every destination element the plan moves (every element,
    /// or those of a subset plan's tensors); returns how many were checked.
    pub fn verify(&self, src: &Layout, dst: &Layout) -> Result<u64, RunError> {
        let memory = &self.memory[self.src_ranks..];
        match &self.plan.options().only {
            None => Ok(verify_destinations(src, dst, memory)?),
            Some(only) => {
                let mask = only.mask(dst)?;
                Ok(verify_destination_tensors(src, dst, memory, &|t| mask.get(t as usize).copied().unwrap_or(false))?)
            }
        }
    }

    /// Executes every rank's program on GPU 0, each rank's buffers in its
    /// own device memory, then copies the results back to host memory (so
    /// [`verify`](Self::verify) checks them).
    #[cfg(feature = "cuda")]
    pub fn execute_cuda(&mut self) -> Result<ExecReport, RunError> {
        use transport::cuda::run_device;
        use transport::cuda::{DeviceMemory, GpuDevice};
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
        self.checked(ExecReport { elapsed: report.elapsed, bytes: report.wire_bytes, messages: report.messages })
    }

    /// Executes every rank's program on its own GPU (rank `i` of the
    /// communicator, sources first, on device `i`) over one NCCL
    /// communicator, every rank a thread; all communicators are created
    /// together, and every wait ends by `deadline`. The results are copied
    /// back to host memory (so [`verify`](Self::verify) checks them).
    #[cfg(feature = "cuda")]
    pub fn execute_nccl(&mut self, deadline: Duration) -> Result<ExecReport, RunError> {
        use transport::cuda::comm_rank;
        use transport::cuda::CommConfig;
        use transport::cuda::CommId;
        use transport::cuda::{create_comms, run_rank_nccl};
        use transport::cuda::{DeviceMemory, GpuDevice};
        let gpu = |e: String| RunError::Gpu(e);
        let src_ranks = self.src_ranks as u32;
        let nranks = self.programs.len() as u32;
        let id = CommId::generate().map_err(gpu)?;
        let members: Vec<(usize, u32)> = self.programs.iter().map(|p| comm_rank(p.endpoint, src_ranks)).map(|r| (r as usize, r)).collect();
        let config = CommConfig { init_timeout: deadline, ..CommConfig::new(0, nranks) };
        let comms = create_comms(&members, id, config);
        let mut handles = Vec::with_capacity(comms.len());
        for c in comms {
            handles.push(c.map_err(|e| gpu(e.to_string()))?);
        }
        let until = Instant::now() + deadline;
        let rank_of = move |e: reshard::Endpoint| -> Option<u32> {
            let r = comm_rank(e, src_ranks);
            (r < nranks).then_some(r)
        };
        let results: Vec<Result<NcclRank, String>> = std::thread::scope(|scope| {
            let threads: Vec<_> = self
                .programs
                .iter()
                .zip(&self.memory)
                .zip(handles)
                .map(|((program, host), mut comm)| {
                    scope.spawn(move || {
                        let ordinal = comm.rank() as usize;
                        let mut run = || -> Result<NcclRank, String> {
                            let dev = GpuDevice::open(ordinal).map_err(|e| e.to_string())?;
                            let mut memory =
                                DeviceMemory::for_buffers(&dev, program.endpoint, &program.buffers).map_err(|e| e.to_string())?;
                            memory.upload(&dev, host).map_err(|e| e.to_string())?;
                            let start = Instant::now();
                            let stats =
                                run_rank_nccl(&dev, program, &mut memory, &mut comm, &rank_of, until, None).map_err(|e| e.to_string())?;
                            let took = start.elapsed();
                            let back = match program.endpoint.group {
                                reshard::Group::Dst => Some(memory.download(&dev).map_err(|e| e.to_string())?),
                                reshard::Group::Src => None,
                            };
                            Ok((stats, took, back))
                        };
                        let r = run();
                        // On failure the abort makes peers fail instead of
                        // waiting out the deadline; it never blocks past its
                        // own timeout.
                        let outcome = comm.abort();
                        if outcome.needs_restart() {
                            return Err(format!("{}: {outcome:?} (restart the process)", program.endpoint));
                        }
                        r
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap_or_else(|_| Err("a rank thread panicked".into()))).collect()
        });
        let (mut bytes, mut messages, mut elapsed) = (0, 0, Duration::ZERO);
        for (i, r) in results.into_iter().enumerate() {
            let (stats, took, back) = r.map_err(gpu)?;
            bytes += stats.sent_bytes;
            messages += stats.messages;
            elapsed = elapsed.max(took);
            if let Some(m) = back {
                self.memory[i] = m;
            }
        }
        self.checked(ExecReport { elapsed, bytes, messages })
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

/// What one rank's NCCL run did: its counters, its time, and (a
/// destination's) memory copied back from the device.
#[cfg(feature = "cuda")]
type NcclRank = (transport::RankStats, Duration, Option<RankMemory>);

/// Memory the kernel says is available (Linux `MemAvailable`), if known.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
