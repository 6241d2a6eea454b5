//! The one driver of `refit run` and `refit bench`: a refit system in this
//! process — a store and a member per rank of both layouts, the
//! orchestrator over them — on any data plane the members open
//! (in-process channels, the node fabric over loopback, NCCL), its
//! sources filled with the verification pattern of each weights version
//! and its destinations checked against it. Every time it reports is the
//! orchestrator's [`RefitReport`]'s.

use orchestrator::testkit::{fill_source_rank_at, verify_destination_rank_from, Mismatch};
use orchestrator::{
    spawn_refit, Buffers, CommPlane, Fabric, NcclFabric, NodeFabric, OrchestratorConfig, PlanReport, RefitError, RefitPhase, RefitReport,
    RefitSystem, RefitTarget, Snapshot,
};
use reshard::{DType, Figures, Layout, PlanOptions, Strategy, TensorSubset};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;

/// Why a run failed.
#[derive(Debug, Error)]
pub enum RunError {
    /// The layouts, the subset or the settings cannot be refitted.
    #[error("{0}")]
    Setup(String),
    /// A refit failed (planning, the data plane, a member).
    #[error(transparent)]
    Refit(#[from] RefitError),
    /// The stores would not fit in this machine's memory.
    #[error(
        "the stores need {needed} bytes (every source rank's weights, every destination rank's twice: staging and served) \
         but only {available} bytes of memory are available"
    )]
    Memory {
        /// Bytes the stores need.
        needed: u64,
        /// Bytes available (Linux `MemAvailable`).
        available: u64,
    },
    /// Verification found wrong bytes.
    #[error("verification failed: {0}")]
    Verify(#[from] Box<Mismatch>),
    /// The members moved other bytes or messages than the plan counts:
    /// a bug in the data plane's count or in the plan's figures.
    #[error(
        "bug: the data plane moved {moved} bytes in {messages} messages, the plan counts {planned} bytes in {planned_messages} messages"
    )]
    Accounting {
        /// Bytes the members report.
        moved: u64,
        /// Messages the members report.
        messages: u64,
        /// The plan's bytes moved (`Figures::total_bytes`).
        planned: u64,
        /// The plan's messages.
        planned_messages: u64,
    },
}

/// The data plane the members of a driven refit open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataPlane {
    /// In-process channels: a receiver copies straight out of the
    /// sender's buffers.
    Local,
    /// The node fabric over loopback TCP, every rank on its own (no
    /// shared memory).
    Tcp,
    /// One NCCL communicator over every rank, rank `i` (sources first) on
    /// GPU `i`.
    Nccl,
}

impl DataPlane {
    /// The fabric its members open.
    fn fabric(self) -> Fabric {
        match self {
            DataPlane::Local => Fabric::InProcess,
            DataPlane::Tcp => Fabric::Node(NodeFabric { shared_memory: false, ..NodeFabric::default() }),
            DataPlane::Nccl => Fabric::Nccl(NcclFabric::new(CommPlane::Cuda)),
        }
    }
}

/// How a driven refit system runs.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// The data plane.
    pub plane: DataPlane,
    /// Reshard or the gather-broadcast baseline (see
    /// [`Driver::set_strategy`]).
    pub strategy: Strategy,
    /// Planner options (a subset refit's tensors go to [`Driver::refit`]).
    pub options: PlanOptions,
    /// Every refit's data movement must end within this time.
    pub deadline: Duration,
    /// Delta refits (see `OrchestratorConfig::delta`).
    pub delta: bool,
    /// The digest check before every commit (see
    /// `OrchestratorConfig::digest_check`).
    pub digest_check: bool,
}

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig {
            plane: DataPlane::Local,
            strategy: Strategy::Reshard,
            options: PlanOptions::default(),
            deadline: orchestrator::DEFAULT_DEADLINE,
            delta: false,
            digest_check: true,
        }
    }
}

/// A refit system in this process, driven version by version.
pub struct Driver {
    runtime: tokio::runtime::Runtime,
    system: RefitSystem,
    src: Arc<Layout>,
    dst: Arc<Layout>,
    /// The current plan's figures.
    figures: Figures,
    /// Starting every member and the orchestrator, planning and installing
    /// every rank's program.
    plan_time: Duration,
    /// The version the sources hold.
    version: u64,
    /// Refits go by delta (their bytes are what changed).
    delta: bool,
}

impl Driver {
    /// Starts the system (if this machine has the memory for its stores),
    /// plans and installs, and fills the sources with the pattern of
    /// version 1. `phase` is told what starts, for a progress display.
    pub fn start(src: &Layout, dst: &Layout, config: DriverConfig, mut phase: impl FnMut(&str)) -> Result<Driver, RunError> {
        let held = |l: &Layout| -> u64 {
            l.buffers().iter().flatten().map(|b| b.elems.saturating_mul(b.dtype.size())).fold(0, u64::saturating_add)
        };
        let needed = held(src).saturating_add(held(dst).saturating_mul(2));
        if let Some(available) = orchestrator::machine::available_memory() {
            if needed > available {
                return Err(RunError::Memory { needed, available });
            }
        }
        // Every member runs its rank on a blocking thread, and a source's
        // run waits for its receivers: with fewer threads than ranks the
        // runs queued behind waiting ones would never start.
        let ranks = (src.ranks() + dst.ranks()) as usize;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(ranks.max(512) + 64)
            .enable_all()
            .build()
            .map_err(|e| RunError::Setup(format!("cannot start tokio: {e}")))?;
        let orchestrator = OrchestratorConfig {
            fabric: config.plane.fabric(),
            mode: config.strategy,
            plan: config.options,
            deadline: config.deadline,
            delta: config.delta,
            digest_check: config.digest_check,
            ..OrchestratorConfig::default()
        };
        phase(&format!("planning {} and installing every rank's program", config.strategy));
        let t = Instant::now();
        let system = runtime.block_on(spawn_refit(src, dst, orchestrator))?;
        let planned = runtime.block_on(system.orchestrator.plan())?;
        let plan_time = t.elapsed();
        let mut driver = Driver {
            runtime,
            system,
            src: Arc::new(src.clone()),
            dst: Arc::new(dst.clone()),
            figures: planned.figures,
            plan_time,
            version: 0,
            delta: config.delta,
        };
        phase("filling the sources");
        driver.step()?;
        Ok(driver)
    }

    /// What planning and installing every member's program at the start
    /// took (the orchestrator's report).
    pub fn planned(&self) -> &PlanReport {
        &self.system.planned
    }

    /// The refit in progress and its step, as the orchestrator publishes
    /// it.
    pub fn phases(&self) -> tokio::sync::watch::Receiver<RefitPhase> {
        self.system.orchestrator.phases()
    }

    /// The runtime the system runs on (to follow [`Driver::phases`]).
    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.runtime
    }

    /// The current plan's figures (what a full refit moves).
    pub fn figures(&self) -> &Figures {
        &self.figures
    }

    /// Time to start the members and the orchestrator, plan and install
    /// every rank's program.
    pub fn plan_time(&self) -> Duration {
        self.plan_time
    }

    /// The version the sources hold.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Switches between reshard and baseline; plans and installs now.
    pub fn set_strategy(&mut self, strategy: Strategy) -> Result<&Figures, RunError> {
        let o = &self.system.orchestrator;
        let planned = self.runtime.block_on(async {
            o.set_mode(strategy).await?;
            o.plan().await
        })?;
        self.figures = planned.figures;
        Ok(&self.figures)
    }

    /// The next weights version: every source rank holds the pattern of
    /// it. Returns the version.
    pub fn step(&mut self) -> Result<u64, RunError> {
        let (src, pattern) = (self.src.clone(), pattern_of(self.version + 1));
        self.step_with(|rank, b| fill_source_rank_at(&src, rank, pattern, b.memory_mut()))
    }

    /// The next weights version, made by `change(rank, buffers)` on every
    /// source rank's current weights (a training step). Returns the
    /// version.
    pub fn step_with(&mut self, change: impl Fn(u32, &mut Buffers) + Sync) -> Result<u64, RunError> {
        let version = self.version + 1;
        self.runtime.block_on(async {
            for store in &self.system.src_stores {
                let rank = store.rank();
                store.restore(version, |b| tokio::task::block_in_place(|| change(rank, b))).await;
            }
        });
        self.version = version;
        Ok(version)
    }

    /// Refits the sources' version into every destination (only the
    /// tensors of `only`, if given: every destination must serve a version
    /// already), and checks that the members moved exactly what the plan
    /// counts.
    pub fn refit(&mut self, only: Option<&TensorSubset>) -> Result<RefitReport, RunError> {
        let o = &self.system.orchestrator;
        let target = RefitTarget::Version(self.version);
        let report = self.runtime.block_on(async {
            match only {
                None => o.refit(self.version).await,
                Some(subset) => o.refit_only(target, subset.clone()).await,
            }
        })?;
        let f = &report.figures;
        // A delta refit moves what changed, in the plan's messages.
        let bytes_differ = report.bytes != f.total_bytes && !self.delta;
        if bytes_differ || report.messages != f.messages {
            return Err(RunError::Accounting {
                moved: report.bytes,
                messages: report.messages,
                planned: f.total_bytes,
                planned_messages: f.messages,
            });
        }
        Ok(report)
    }

    /// Checks every element every destination serves against the pattern
    /// of the version it serves: the sources' version, or after a subset
    /// refit, for the tensors of `only`, and `base` (the version before)
    /// for those it carried. Returns how many elements of the refitted
    /// tensors were checked (the carried ones are checked, not counted).
    pub fn verify(&self, only: Option<(&TensorSubset, u64)>) -> Result<u64, RunError> {
        let dtypes: HashMap<String, DType> = self.src.tensors().iter().map(|t| (t.name.clone(), t.dtype)).collect();
        let source_dtype = |name: &str| dtypes.get(name).copied();
        let mask = match only {
            Some((subset, _)) => Some(subset.mask(&self.dst).map_err(|e| RunError::Setup(e.to_string()))?),
            None => None,
        };
        let in_subset = |t: u32| mask.as_ref().is_none_or(|m| m.get(t as usize).copied().unwrap_or(false));
        let mut checked = 0;
        for snap in self.served()? {
            let rank = snap.buffers.rank();
            let memory = snap.buffers.memory();
            checked += verify_destination_rank_from(&self.dst, rank, pattern_of(self.version), &source_dtype, &in_subset, memory)?;
            if let Some((_, base)) = only {
                verify_destination_rank_from(&self.dst, rank, pattern_of(base), &source_dtype, &|t| !in_subset(t), memory)?;
            }
        }
        Ok(checked)
    }

    /// What every destination rank serves, by rank.
    pub fn served(&self) -> Result<Vec<Arc<Snapshot>>, RunError> {
        let stores = &self.system.dst_stores;
        stores
            .iter()
            .map(|s| s.snapshot().ok_or_else(|| RunError::Setup(format!("destination rank {} serves no version", s.rank()))))
            .collect()
    }
}

/// The pattern a driven weights version holds: version 1, the first a
/// driver refits, holds the pattern's step 0 (what `refit run --dump-dst`
/// readers check against), each later version the next step.
fn pattern_of(version: u64) -> u64 {
    version.saturating_sub(1)
}
