//! Runs a whole plan on one GPU (`cuda` feature): every rank's buffers are
//! separate device allocations on the same device, and every transfer is a
//! device-to-device copy straight from the sender's buffer into the
//! receiver's (one copy per byte, as the in-process host transport does).
//! Steps run in [`schedule`](crate::cuda::schedule) order on the device's
//! stream, so rounds keep their meaning without any host synchronisation.
//!
//! Pieces that change dtype are converted on the device by the cast
//! kernels (`kernels.cu`, one launch per [`CastBox`]; through a device
//! scratch buffer where both the sender's and the receiver's side change
//! it). Only dtype pairs without a kernel (f64), or a device
//! whose kernels did not load, go through pinned host staging (device →
//! host, convert on the host, host → device), which is correct but slow;
//! the report counts those.

use crate::copy::{copy_strided, packed_strides, StridedRef};
use crate::cuda::copyplan::{plan_copies, CopyOp, Side};
use crate::cuda::device::{issue, DeviceKernels, DeviceMemory, GpuDevice, GpuError, KernelError, Loc, PinnedStaging, QuantizeError};
use crate::cuda::kernels::{copy_as_box, plan_casts, strided_kernel, without_kernel, CastBox};
use crate::cuda::schedule::{same_device_schedule, ScheduleError, Step};
use cudarc::driver::DriverError;
use reshard::{Block, DType, Endpoint, RankProgram};
use std::time::Duration;
use thiserror::Error;

/// Why a device run failed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DeviceExecError {
    /// The programs do not form a consistent schedule.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// The device memory given does not match a program's buffers.
    #[error("{me}: device memory has {got} buffers of {got_bytes:?} bytes, program needs {want} of {want_bytes:?}")]
    MemoryMismatch {
        /// Rank.
        me: Endpoint,
        /// Buffers given.
        got: usize,
        /// Their sizes.
        got_bytes: Vec<usize>,
        /// Buffers needed.
        want: usize,
        /// Their sizes.
        want_bytes: Vec<usize>,
    },
    /// A copy could not be queued or failed on the device.
    #[error("{from} -> {to}: round {round}: piece {block}: {error}")]
    Copy {
        /// Sending rank.
        from: Endpoint,
        /// Receiving rank.
        to: Endpoint,
        /// Round.
        round: u32,
        /// The piece.
        block: Box<Block>,
        /// The CUDA error.
        #[source]
        error: QueueError,
    },
    /// A device operation failed.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// Quantizing a rank's block-scaled tensors failed.
    #[error(transparent)]
    Quantize(#[from] QuantizeError),
}

/// Why device work (copies, kernel launches, a piece through host
/// staging) could not be queued or run.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum QueueError {
    /// A copy or stream call failed.
    #[error("{0}")]
    Driver(#[source] DriverError),
    /// A cast was queued without the kernels.
    #[error("the cast kernels are not loaded")]
    NoKernels,
    /// A kernel did not launch.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The device failed (staging, synchronisation).
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// What a device run did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceReport {
    /// Device time from the first copy to the last (CUDA events).
    pub elapsed: Duration,
    /// Bytes between ranks (wire dtype), as the host executors count them.
    pub wire_bytes: u64,
    /// Messages between ranks.
    pub messages: u64,
    /// Copy calls queued (1-D, 2-D and 3-D).
    pub copy_calls: u64,
    /// Kernel launches queued (pieces whose dtype changes on the device).
    pub kernel_launches: u64,
    /// Pieces converted through host staging (dtype pairs without a
    /// kernel, or kernels that did not load; each run also noted in
    /// [`host_work`](crate::cuda::host_work), the latter as fallbacks).
    pub staged_pieces: u64,
    /// Why pieces went through host staging, if any did.
    pub staged_because: Option<String>,
    /// Ranks whose block-scaled tensors were quantized on the host (their
    /// buffers copied back and forth once: a tensor of more
    /// than three dimensions, or kernels that did not load), each a host
    /// fallback ([`host_work`](crate::cuda::host_work)).
    pub quantized_on_host: u64,
    /// Ranks whose block-scaled tensors were quantized on the device
    /// (sources before the copies, destinations after).
    pub quantized_on_device: u64,
    /// The copies and kernels ran as one CUDA graph launch.
    pub graph: bool,
}

/// How a [`DeviceRun`] issues its work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRunOptions {
    /// Multi-row copies of narrow rows by the strided copy kernels, where
    /// they load ([`copy_as_box`]); otherwise copy calls.
    pub narrow_rows_by_kernel: bool,
    /// Capture the run's device work once, at prepare time, as one CUDA
    /// graph that every run replays (one launch instead of a call per
    /// copy), where the whole run is device work.
    pub graph: bool,
    /// Streams a graph spreads each round's independent pieces over (its
    /// branches run concurrently; 1: one chain, in order). Rounds stay in
    /// order, and so do a rank's local copies before its receives and
    /// every piece that goes through the scratch buffer.
    pub lanes: usize,
}

impl Default for DeviceRunOptions {
    /// One graph over 8 lanes; narrow rows by the copy kernel (on the
    /// H200 a llama3-8b reshard took 4.8 ms this way against 6.5 ms with
    /// copy calls: docs/gpu.md, "What ran").
    fn default() -> DeviceRunOptions {
        DeviceRunOptions { narrow_rows_by_kernel: true, graph: true, lanes: 8 }
    }
}

/// One queued piece of device work.
#[derive(Clone, Copy, Debug)]
pub(crate) enum DeviceOp {
    /// A device-to-device copy (same dtype on both sides).
    Copy {
        /// The copy, in bytes from each side's base.
        op: CopyOp,
        /// Source buffer address.
        src: u64,
        /// Destination buffer address.
        dst: u64,
    },
    /// A strided copy-cast kernel.
    Cast {
        /// The kernel.
        kernel: &'static str,
        /// Its box, in elements from each side's base.
        b: CastBox,
        /// Source buffer address.
        src: u64,
        /// Destination buffer address.
        dst: u64,
    },
}

/// One side of a piece on the device: buffer address, span, dtype.
pub(crate) use crate::cuda::plane::Side as DevSide;

/// Whether copying `from` through `wire` into `to` dtypes needs a scratch
/// buffer of the piece in `wire` (both conversions happen).
pub(crate) fn needs_scratch(from: DType, wire: DType, to: DType) -> bool {
    from != wire && wire != to
}

/// How [`piece_ops`] moves bytes whose dtype does not change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SameType {
    /// Copy calls only (the kernels are not loaded).
    Copies,
    /// Copy calls, except multi-row copies of narrow rows, which the
    /// strided copy kernels run ([`copy_as_box`]).
    NarrowRowsByKernel,
}

/// The device work that moves a piece of `counts` elements from `from`
/// through dtype `wire` into each of `to`: copies where no dtype changes
/// (narrow rows by a kernel as `same` says), kernels where one does, two
/// kernels through `scratch` (an address with room for the packed piece in
/// `wire`) where both do. `None` if a dtype pair has no kernel, or scratch
/// is needed and not given: the host converts such a piece.
pub(crate) fn piece_ops(
    counts: &[u64],
    from: DevSide,
    wire: DType,
    to: &[DevSide],
    max_pitch: u64,
    scratch: Option<u64>,
    same: SameType,
) -> Option<Vec<DeviceOp>> {
    let side = |s: &reshard::Span| Side { base: s.base, strides: s.strides };
    let packed = Side { base: 0, strides: packed_strides(counts) };
    let mut ops = Vec::new();
    let cast = |ops: &mut Vec<DeviceOp>, a: (u64, Side, DType), b: (u64, Side, DType)| -> Option<()> {
        if a.2 == b.2 {
            for op in plan_copies(counts, &a.1, &b.1, a.2.size(), max_pitch) {
                match copy_as_box(&op, a.0, b.0).filter(|_| same == SameType::NarrowRowsByKernel) {
                    Some((kernel, bx)) => ops.push(DeviceOp::Cast { kernel, b: bx, src: a.0, dst: b.0 }),
                    None => ops.push(DeviceOp::Copy { op, src: a.0, dst: b.0 }),
                }
            }
        } else {
            let kernel = strided_kernel(a.2, b.2)?;
            for bx in plan_casts(counts, &a.1, &b.1) {
                ops.push(DeviceOp::Cast { kernel, b: bx, src: a.0, dst: b.0 });
            }
        }
        Some(())
    };
    let src = (from.0, side(&from.1), from.2);
    for t in to {
        let dst = (t.0, side(&t.1), t.2);
        if needs_scratch(from.2, wire, t.2) {
            let at = scratch?;
            cast(&mut ops, src, (at, packed, wire))?;
            cast(&mut ops, (at, packed, wire), dst)?;
        } else {
            cast(&mut ops, src, dst)?;
        }
    }
    Some(ops)
}

/// Queues device work on `dev`'s stream; returns (copy calls, kernel launches).
///
/// # Safety
/// Every address must be a live allocation of `dev` that holds what its op
/// reads or writes (checked against the buffers by the caller) and stays
/// allocated until the stream has run it.
pub(crate) unsafe fn queue_ops(dev: &GpuDevice, kernels: Option<&DeviceKernels>, ops: &[DeviceOp]) -> Result<(u64, u64), QueueError> {
    // SAFETY: the caller's guarantee.
    unsafe { queue_ops_on(dev.stream(), kernels, ops) }
}

/// [`queue_ops`] on `stream` (a stream of the device's context).
///
/// # Safety
/// As for [`queue_ops`].
unsafe fn queue_ops_on(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    kernels: Option<&DeviceKernels>,
    ops: &[DeviceOp],
) -> Result<(u64, u64), QueueError> {
    let (mut copies, mut launches) = (0, 0);
    for op in ops {
        match op {
            DeviceOp::Copy { op, src, dst } => {
                // SAFETY: the caller's guarantee.
                unsafe { issue(op, Loc::Device(*src), Loc::Device(*dst), stream.cu_stream()) }.map_err(QueueError::Driver)?;
                copies += 1;
            }
            DeviceOp::Cast { kernel, b, src, dst } => {
                let k = kernels.ok_or(QueueError::NoKernels)?;
                // SAFETY: the caller's guarantee.
                unsafe { k.launch(stream, kernel, b, *src, *dst) }?;
                launches += 1;
            }
        }
    }
    Ok((copies, launches))
}

struct Meta {
    round: u32,
    /// A rank's copy within itself (these run before a round's receives).
    local: bool,
    from: Endpoint,
    to: Endpoint,
    block: Block,
}

enum Item {
    /// Copies and kernels on the device; `bytes` on the wire, `scratch`
    /// whether they pass through the run's scratch buffer.
    Device { ops: Vec<DeviceOp>, meta: usize, bytes: u64, scratch: bool },
    /// A piece converted on the host: pack, convert, unpack.
    Convert { step: Box<Step>, src: u64, dsts: Vec<u64>, meta: usize, why: Box<HostWhy> },
}

/// Why a piece is converted on the host, and whether that is a fallback
/// (`cuda::fallback`).
struct HostWhy {
    text: String,
    fallback: bool,
}

/// A plan prepared to run on one device: copies resolved to device
/// addresses, so runs (for timing) pay no planning. Borrows the memory it
/// names for as long as it lives.
pub struct DeviceRun<'m> {
    dev: &'m GpuDevice,
    items: Vec<Item>,
    meta: Vec<Meta>,
    staging: [PinnedStaging; 2],
    /// Packed pieces in their wire dtype, for steps converted twice.
    _scratch: Option<cudarc::driver::CudaSlice<u8>>,
    kernels: Option<&'m DeviceKernels>,
    staged_because: Option<String>,
    wire_bytes: u64,
    messages: u64,
    staged: u64,
    /// Destination ranks with block-scaled tensors (by index), quantized
    /// after the device work (`device::quantize_rank_on`).
    quantize: Vec<(usize, RankProgram)>,
    /// Every item's work captured once (`DeviceRunOptions::graph`), with
    /// the counts of copies and launches in it.
    graph: Option<(cudarc::driver::CudaGraph, u64, u64)>,
    memory: &'m mut [DeviceMemory],
}

impl std::fmt::Debug for DeviceRun<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRun").field("items", &self.items.len()).field("wire_bytes", &self.wire_bytes).finish()
    }
}

impl<'m> DeviceRun<'m> {
    /// Checks the programs against each other and against the memory
    /// (`memory[i]` belongs to `programs[i]`), and resolves every copy.
    pub fn prepare(dev: &'m GpuDevice, programs: &[RankProgram], memory: &'m mut [DeviceMemory]) -> Result<DeviceRun<'m>, DeviceExecError> {
        DeviceRun::prepare_with(dev, programs, memory, DeviceRunOptions::default())
    }

    /// [`prepare`](Self::prepare), issuing the work as `options` says.
    pub fn prepare_with(
        dev: &'m GpuDevice,
        programs: &[RankProgram],
        memory: &'m mut [DeviceMemory],
        options: DeviceRunOptions,
    ) -> Result<DeviceRun<'m>, DeviceExecError> {
        let schedule = same_device_schedule(programs)?;
        memory_fits(programs, memory)?;
        let addrs: Vec<Vec<u64>> = memory.iter().map(|m| m.device_addrs().to_vec()).collect();
        // Loaded once per device: dtype changes need them, and narrow rows
        // of plain copies use them where they load.
        let (kernels, kernels_missing) = match dev.kernels() {
            Ok(k) => (Some(k), None),
            Err(e) => (None, Some(e)),
        };
        let scratch_bytes = schedule
            .steps
            .iter()
            .filter(|s| s.to.iter().any(|t| needs_scratch(s.from.dtype, s.wire, t.dtype)))
            // (Each step was checked to fit its buffers: no overflow.)
            .map(|s| s.block.numel().saturating_mul(s.wire.size()))
            .max();
        let scratch = match scratch_bytes {
            Some(b) if kernels.is_some() => Some(dev.alloc(b as usize, "device scratch")?),
            _ => None,
        };
        let scratch_addr = scratch.as_ref().map(|b| dev.addr(b));
        let mut run = DeviceRun {
            dev,
            items: Vec::new(),
            meta: Vec::new(),
            staging: [PinnedStaging::new(dev), PinnedStaging::new(dev)],
            _scratch: scratch,
            kernels,
            staged_because: None,
            wire_bytes: schedule.wire_bytes,
            messages: schedule.messages,
            staged: 0,
            quantize: programs.iter().enumerate().filter(|(_, p)| !p.quantize.is_empty()).map(|(i, p)| (i, p.clone())).collect(),
            graph: None,
            memory,
        };
        for step in schedule.steps {
            run.add_step(step, programs, &addrs, (options, scratch_addr), kernels_missing.as_ref());
        }
        if options.graph {
            run.graph = run.capture(options.lanes);
        }
        Ok(run)
    }

    /// Resolves one step of the schedule to device addresses: device work
    /// where the kernels (or plain copies) take it, else a conversion on
    /// the host, and why (`kernels_missing`: why the kernels did not load).
    fn add_step(
        &mut self,
        step: Step,
        programs: &[RankProgram],
        addrs: &[Vec<u64>],
        (options, scratch_addr): (DeviceRunOptions, Option<u64>),
        kernels_missing: Option<&KernelError>,
    ) {
        let src = addrs[step.from.rank][step.from.span.buffer as usize];
        let dsts: Vec<u64> = step.to.iter().map(|t| addrs[t.rank][t.span.buffer as usize]).collect();
        let to_rank = step.to.first().map_or(step.from.rank, |t| t.rank);
        let meta = self.meta.len();
        self.meta.push(Meta {
            round: step.round,
            local: step.local,
            from: programs[step.from.rank].endpoint,
            to: programs[to_rank].endpoint,
            block: step.block,
        });
        let from = (src, step.from.span, step.from.dtype);
        let to: Vec<DevSide> = step.to.iter().zip(&dsts).map(|(t, &a)| (a, t.span, t.dtype)).collect();
        let on_device = if step.is_direct() || self.kernels.is_some() {
            let same =
                if self.kernels.is_some() && options.narrow_rows_by_kernel { SameType::NarrowRowsByKernel } else { SameType::Copies };
            piece_ops(step.block.extent(), from, step.wire, &to, self.dev.max_pitch(), scratch_addr, same)
        } else {
            None
        };
        match on_device {
            Some(ops) => {
                let scratch = step.to.iter().any(|t| needs_scratch(step.from.dtype, step.wire, t.dtype));
                let bytes = step.block.numel().saturating_mul(step.wire.size());
                self.items.push(Item::Device { ops, meta, bytes, scratch })
            }
            None => {
                self.staged += 1;
                let to_dtypes: Vec<DType> = to.iter().map(|t| t.2).collect();
                let why = match (kernels_missing, without_kernel(step.from.dtype, step.wire, &to_dtypes)) {
                    (Some(e), _) => HostWhy { text: format!("the cast kernels did not load: {e}"), fallback: true },
                    (None, Some(no_kernel)) => HostWhy { text: no_kernel, fallback: false },
                    (None, None) => HostWhy { text: "the copy kernels do not take this piece".into(), fallback: true },
                };
                if self.staged_because.is_none() {
                    self.staged_because = Some(why.text.clone());
                }
                self.items.push(Item::Convert { step: Box::new(step), src, dsts, meta, why: Box::new(why) });
            }
        }
    }

    /// Captures every item's device work as one CUDA graph, where every
    /// item is device work; `None` (the work is issued call by call) where
    /// one is not, or capture fails. Each group of items that may run
    /// together (one round's local copies, then its receives) forks onto
    /// `lanes` streams, balanced by bytes, and joins before the next.
    fn capture(&self, lanes: usize) -> Option<(cudarc::driver::CudaGraph, u64, u64)> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        if self.items.iter().any(|i| matches!(i, Item::Convert { .. })) {
            return None;
        }
        let main = self.dev.stream();
        // Made before capture begins (creating a stream is not captured).
        let side: Vec<_> = (1..lanes.max(1)).map(|_| main.context().new_stream()).collect::<Result<_, _>>().ok()?;
        main.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).ok()?;
        let queued = self.queue_groups(main, &side);
        // Capture always ends, whatever was queued.
        let ended = main.end_capture(CUgraphInstantiate_flags(0)).map_err(QueueError::Driver);
        let (calls, launches, graph) = match (queued, ended) {
            (Ok((c, k)), Ok(graph)) => (c, k, graph?),
            (Err(e), _) | (_, Err(e)) => {
                tracing::debug!(error = %e, "capturing a device run failed; it is issued call by call");
                return None;
            }
        };
        graph.upload().ok()?;
        Some((graph, calls, launches))
    }

    /// Queues every item's device work on `main` and the `side` streams
    /// (see [`capture`](Self::capture)); every side stream that forked is
    /// joined back into `main` before this returns, error or not.
    fn queue_groups(
        &self,
        main: &std::sync::Arc<cudarc::driver::CudaStream>,
        side: &[std::sync::Arc<cudarc::driver::CudaStream>],
    ) -> Result<(u64, u64), QueueError> {
        let (mut calls, mut launches) = (0u64, 0u64);
        let key = |item: &Item| match item {
            Item::Device { meta, .. } | Item::Convert { meta, .. } => (self.meta[*meta].round, self.meta[*meta].local),
        };
        let mut rest = &self.items[..];
        while let Some(first) = rest.first() {
            let n = rest.iter().take_while(|i| key(i) == key(first)).count();
            let (group, next) = rest.split_at(n);
            rest = next;
            let forked = !side.is_empty() && group.len() > 1;
            if forked {
                let fork = main.record_event(None).map_err(QueueError::Driver)?;
                for s in side {
                    s.wait(&fork).map_err(QueueError::Driver)?;
                }
            }
            let mut load = vec![0u64; side.len() + 1];
            let mut queued = Ok(());
            for item in group {
                let Item::Device { ops, bytes, scratch, .. } = item else { continue };
                // Pieces through the scratch stay on `main`, in order.
                let lane = if !forked || *scratch { 0 } else { (0..load.len()).min_by_key(|&l| load[l]).unwrap_or(0) };
                load[lane] = load[lane].saturating_add(*bytes);
                let stream = if lane == 0 { main } else { &side[lane - 1] };
                // SAFETY: as in `execute`: addresses of live allocations
                // borrowed for 'm (and the run's scratch); capturing only
                // records the work, which each replay runs while the run
                // (and so every borrow) is alive. Pieces on different
                // lanes write disjoint bytes and read none another writes
                // in the same group (the schedule's rounds).
                match unsafe { queue_ops_on(stream, self.kernels, ops) } {
                    Ok((c, k)) => {
                        calls += c;
                        launches += k;
                    }
                    Err(e) => {
                        queued = Err(e);
                        break;
                    }
                }
            }
            if forked {
                for s in side {
                    main.join(s).map_err(QueueError::Driver)?;
                }
            }
            queued?;
        }
        Ok((calls, launches))
    }

    /// Quantizes the block-scaled tensors of the ranks that do so first
    /// (sources, `first`) or last (destinations), on the device where it
    /// can; counts the ranks done on the device and on the host.
    fn quantize_ranks(&mut self, first: bool, (on_device, on_host): (&mut u64, &mut u64)) -> Result<(), DeviceExecError> {
        for (i, program) in self.quantize.iter().filter(|(_, p)| p.quantizes_first() == first) {
            let quantized = crate::cuda::device::quantize_rank_on(self.dev, &mut self.memory[*i], program)?;
            match quantized {
                crate::cuda::device::Quantized::OnDevice => *on_device += 1,
                crate::cuda::device::Quantized::OnHost(why) => {
                    crate::cuda::fallback::note(program.endpoint, "quantized its block-scaled tensors", &why, true);
                    *on_host += 1
                }
                crate::cuda::device::Quantized::Nothing => {}
            }
        }
        Ok(())
    }

    /// Runs every copy once, in order, and waits for the device.
    pub fn execute(&mut self) -> Result<DeviceReport, DeviceExecError> {
        let dev = self.dev;
        dev.bind()?;
        let start = dev.mark()?;
        let (mut calls, mut launches) = (0u64, 0u64);
        // Block-scaled FP8 tensors sent as codes: quantized by their
        // source ranks before anything moves; those received unquantized
        // by their destination ranks after.
        let (mut on_device, mut on_host) = (0, 0);
        self.quantize_ranks(true, (&mut on_device, &mut on_host))?;
        let graph = self.graph.as_ref();
        if let Some((g, c, k)) = graph {
            g.launch().map_err(|source| GpuError::Driver { what: "launching the run's graph".into(), source })?;
            calls = *c;
            launches = *k;
        }
        for item in self.items.iter().filter(|_| graph.is_none()) {
            match item {
                Item::Device { ops, meta, .. } => {
                    // SAFETY: addresses come from live allocations borrowed
                    // for 'm (and the scratch, held by the run); the
                    // schedule bounds-checked every span; the scratch holds
                    // the largest packed piece.
                    let (c, k) = unsafe { queue_ops(dev, self.kernels, ops) }.map_err(|e| self.copy_error(*meta, e))?;
                    calls += c;
                    launches += k;
                }
                Item::Convert { step, src, dsts, meta, why } => {
                    crate::cuda::fallback::note(self.meta[*meta].from, "converted a piece", &why.text, why.fallback);
                    calls += convert_on_host(dev, &mut self.staging, step, *src, dsts).map_err(|e| self.copy_error(*meta, e))?;
                }
            }
        }
        self.quantize_ranks(false, (&mut on_device, &mut on_host))?;
        let end = dev.mark()?;
        dev.synchronize()?;
        let elapsed = dev.elapsed(&start, &end)?;
        Ok(DeviceReport {
            elapsed,
            wire_bytes: self.wire_bytes,
            messages: self.messages,
            copy_calls: calls,
            kernel_launches: launches,
            staged_pieces: self.staged,
            staged_because: self.staged_because.clone(),
            quantized_on_host: on_host,
            quantized_on_device: on_device,
            graph: self.graph.is_some(),
        })
    }

    fn copy_error(&self, meta: usize, error: QueueError) -> DeviceExecError {
        let m = &self.meta[meta];
        DeviceExecError::Copy { from: m.from, to: m.to, round: m.round, block: Box::new(m.block), error }
    }
}

/// Checks that `memory[i]` holds the buffers of `programs[i]`, for every
/// program.
fn memory_fits(programs: &[RankProgram], memory: &[DeviceMemory]) -> Result<(), DeviceExecError> {
    if memory.len() != programs.len() {
        let me = programs.get(memory.len()).or(programs.last()).map_or(Endpoint::src(0), |p| p.endpoint);
        return Err(DeviceExecError::MemoryMismatch {
            me,
            got: memory.len(),
            got_bytes: Vec::new(),
            want: programs.len(),
            want_bytes: Vec::new(),
        });
    }
    for (p, m) in programs.iter().zip(memory.iter()) {
        // (Saturating: a size past `u64` matches no memory's.)
        let want: Vec<usize> = p.buffers.iter().map(|b| b.elems.saturating_mul(b.dtype.size()) as usize).collect();
        if m.buffer_lens() != want.as_slice() {
            return Err(DeviceExecError::MemoryMismatch {
                me: p.endpoint,
                got: m.buffer_lens().len(),
                got_bytes: m.buffer_lens().to_vec(),
                want: want.len(),
                want_bytes: want,
            });
        }
    }
    Ok(())
}

/// Converts one step's piece through pinned host staging; returns the
/// number of copy calls. Waits for the device twice.
pub(crate) fn convert_on_host(
    dev: &GpuDevice,
    staging: &mut [PinnedStaging; 2],
    step: &Step,
    src: u64,
    dsts: &[u64],
) -> Result<u64, QueueError> {
    let counts = step.block.extent();
    let n = step.block.numel();
    let packed = Side { base: 0, strides: packed_strides(counts) };
    let from = Side { base: step.from.span.base, strides: step.from.span.strides };
    let stream = dev.stream().cu_stream();
    let [a, b] = staging;
    let from_bytes = (n * step.from.dtype.size()) as usize;
    let pa = a.ensure(from_bytes)?;
    let mut calls = 0;
    for op in plan_copies(counts, &from, &packed, step.from.dtype.size(), dev.max_pitch()) {
        // SAFETY: device side in bounds (schedule), host side is the
        // packed piece inside the staging; we wait below.
        unsafe { issue(&op, Loc::Device(src), Loc::Host(pa), stream) }.map_err(QueueError::Driver)?;
        calls += 1;
    }
    dev.synchronize()?;
    // Host conversion: from → wire → destination dtype, as sender and
    // receiver would.
    let to_dtype = step.to.first().map_or(step.wire, |t| t.dtype);
    let mut wire = vec![0u8; (n * step.wire.size()) as usize];
    let to_bytes = (n * to_dtype.size()) as usize;
    let pb = b.ensure(to_bytes)?;
    let strides = packed_strides(counts);
    // SAFETY (of each view made here): the regions are `pa`/`pb` (pinned
    // staging of `from_bytes`/`to_bytes`, held by `b` for this call) and
    // `wire` (owned here), all alive while the views are used below.
    let r = |ptr: *const u8, len: usize, dtype: DType| unsafe { StridedRef::new(ptr, len, 0, strides, dtype) };
    // SAFETY: each region holds n packed elements of its dtype; nothing
    // else touches the staging now (the stream is idle).
    unsafe {
        copy_strided(counts, &r(pa, from_bytes, step.from.dtype), &r(wire.as_mut_ptr(), wire.len(), step.wire));
        copy_strided(counts, &r(wire.as_ptr(), wire.len(), step.wire), &r(pb, to_bytes, to_dtype));
    }
    for (t, &dst) in step.to.iter().zip(dsts) {
        let to = Side { base: t.span.base, strides: t.span.strides };
        for op in plan_copies(counts, &packed, &to, to_dtype.size(), dev.max_pitch()) {
            // SAFETY: as above, host → device.
            unsafe { issue(&op, Loc::Host(pb), Loc::Device(dst), stream) }.map_err(QueueError::Driver)?;
            calls += 1;
        }
    }
    dev.synchronize()?;
    Ok(calls)
}

/// Device time of one plain device-to-device copy of `bytes` bytes
/// (`cuMemcpyDtoDAsync`, best of `reps` after a warm-up): the yardstick for
/// reshard throughput on the same device.
pub fn time_plain_copy(dev: &GpuDevice, bytes: usize, reps: u32) -> Result<Duration, GpuError> {
    dev.bind()?;
    let a = dev.alloc(bytes, "plain copy source")?;
    let b = dev.alloc(bytes, "plain copy destination")?;
    let (pa, pb) = (dev.addr(&a), dev.addr(&b));
    let op = CopyOp {
        src: 0,
        dst: 0,
        width: bytes as u64,
        height: 1,
        depth: 1,
        src_pitch: bytes as u64,
        src_height: 1,
        dst_pitch: bytes as u64,
        dst_height: 1,
    };
    let mut best = Duration::MAX;
    for i in 0..=reps.max(1) {
        let start = dev.mark()?;
        // SAFETY: both allocations hold `bytes` bytes and live until the end.
        unsafe { issue(&op, Loc::Device(pa), Loc::Device(pb), dev.stream().cu_stream()) }
            .map_err(|source| GpuError::Driver { what: "plain copy".into(), source })?;
        let end = dev.mark()?;
        let t = dev.elapsed(&start, &end)?;
        if i > 0 {
            best = best.min(t);
        }
    }
    dev.synchronize()?;
    drop((a, b));
    Ok(best)
}
