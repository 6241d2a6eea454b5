//! The GPU check: `scripts/gpu-check.sh` builds it (`--build`, with the
//! `cuda` feature) and runs it on a machine with one NVIDIA GPU and no Rust
//! toolchain. The runner starts every check as a process of its own
//! (`gpu_check --only NAME --root DIR`) with its own timeout, so a fault or
//! a hang in one cannot void the rest, NCCL last; it prints one line per
//! check (`--json`: one JSON object), writes them all to
//! `OUT/gpu-check.json` after each check (`--out OUT`), and stops starting
//! checks when `--budget S` seconds are spent. A check that converted a
//! piece or quantized a tensor on the host instead of the device fails.
//! Exit code 0 if every check passed, 1 if one failed, 2 if CUDA is
//! unavailable. `--list`: each check's name, timeout and expected seconds.
//! `--root` is the folder holding `examples/` (paths are given at run time,
//! never compiled in).
//!
//! - `environment`: driver, NCCL and NVRTC versions, the device and its
//!   UUID; passes when the cast kernels are the shipped PTX (NVRTC's build
//!   for the device is tried and reported);
//! - `kernels`: the cast kernels on the device against the host
//!   conversion, over every 16-bit value and a million f32 values;
//! - `layouts`: every example layout pair (`examples/*/`), reshard and
//!   baseline, run on the device (ranks as separate buckets of the one GPU;
//!   dtype changes by the cast kernels) and byte-compared with the host
//!   executor's result;
//! - `ipc`: a colocated refit between two processes on one GPU: a child
//!   process holds the source ranks and exports each rank's bucket as one
//!   CUDA IPC handle; this process maps them, runs the refit into its own
//!   buckets, verifies every destination element, and lets the child go;
//! - `throughput`: a device refit of `llama3-8b --scale 2` (verified)
//!   against a `cuMemcpyDtoD` of the same bytes in the same run; passes at
//!   a ratio of at least 0.7;
//! - `orchestrator-ipc`: a colocated refit through the orchestrator on the
//!   CUDA IPC fabric: a child process serves two source members (f32, row
//!   shards) on GPU 0 through a rendezvous, this process two destination
//!   members (bf16, column shards) on the same GPU; every destination
//!   element checked;
//! - `orchestrator-ipc-in-place`: the same with each destination serving
//!   its weights in device buffers of this process registered in place
//!   (`DstStore::registered`): the refit stages on the GPU and its commit
//!   copies into them; checked by reading them back inside `serve`;
//! - `ipc-abort-in-flight`: an IPC rank gives up while its 8 GiB copy
//!   from another process's bucket runs; the context still copies and
//!   casts afterwards (the peer's mapping was kept, not closed under it);
//! - `registered-lies`: registered device regions past their allocation,
//!   or in host memory, refused by the driver's checks; honest ones taken;
//! - `nccl-same-device`: four members on one GPU through the orchestrator
//!   on the NCCL fabric: refused before any communicator, within seconds;
//! - `nccl-missing-peer`: a communicator of two with one rank and a 3 s
//!   creation timeout: answered within the creation and abort timeouts
//!   (aborted, or its thread counted as abandoned);
//! - `nccl`: a one-rank NCCL communicator created (non-blocking, polled),
//!   an empty group, a 64 MiB send/receive to itself (verified), an abort
//!   that returns within its deadline, then the same with a new id;
//! - `orchestrator` (2 GPUs or more; skipped on one, where NCCL cannot
//!   put two ranks of a communicator): refits through the orchestrator
//!   on the NCCL fabric, one source rank (f32) and a destination rank
//!   (bf16, row shards) per further GPU, three versions on one
//!   communicator, every destination element checked.

#[cfg(feature = "cuda")]
fn main() -> std::process::ExitCode {
    check::main()
}

#[cfg(not(feature = "cuda"))]
fn main() -> std::process::ExitCode {
    eprintln!("CUDA transport unavailable: built without the cuda feature (cargo run --example gpu_check --features cuda)");
    std::process::ExitCode::from(2)
}

#[cfg(feature = "cuda")]
mod check {
    use refit::presets::{layouts, Model};
    use reshard::dtype::convert_slice;
    use reshard::{parse_layout, plan_baseline, plan_reshard, BufferKey, BufferSpec, DType, Endpoint, Layout, Plan, PlanOptions};
    use serde_json::{json, Value};
    use std::io::{BufRead, Write};
    use std::path::{Path, PathBuf};
    use std::process::{Command, ExitCode, Stdio};
    use std::time::{Duration, Instant};
    use transport::cuda::comm::{AbortOutcome, CommConfig, P2p};
    use transport::cuda::device::{DeviceMemory, GpuDevice};
    use transport::cuda::exec::{time_plain_copy, DeviceRun};
    use transport::cuda::id::CommId;
    use transport::cuda::ipc::IpcHandle;
    use transport::cuda::nccl::create_comms;
    use transport::{fill_sources, run_local, verify_destinations, ExecOptions, RankMemory};

    const TARGET_RATIO: f64 = 0.7;

    fn e2s(e: impl std::fmt::Display) -> String {
        e.to_string()
    }

    fn gbps(bytes: u64, t: Duration) -> f64 {
        bytes as f64 / t.as_secs_f64().max(1e-12) / 1e9
    }

    fn spec(dtype: DType, elems: u64) -> BufferSpec {
        BufferSpec { key: BufferKey::Named(0), name: "v".into(), dtype, elems }
    }

    /// Host bytes through a device cast kernel and back.
    fn device_cast(dev: &GpuDevice, from: DType, bytes: &[u8], to: DType) -> Result<Vec<u8>, String> {
        let n = bytes.len() as u64 / from.size();
        let me = Endpoint::src(0);
        let mut a = DeviceMemory::for_buffers(dev, me, &[spec(from, n)]).map_err(e2s)?;
        let mut b = DeviceMemory::for_buffers(dev, me, &[spec(to, n)]).map_err(e2s)?;
        a.upload(dev, &RankMemory { buffers: vec![bytes.to_vec()], dtypes: vec![from] }).map_err(e2s)?;
        a.cast_into(dev, 0, &mut b, 0).map_err(e2s)?;
        Ok(b.download(dev).map_err(e2s)?.buffers.remove(0))
    }

    fn kernels(ctx: &Ctx) -> Result<(String, Value), String> {
        let dev = &ctx.dev;
        let origin = dev.kernels()?.origin().to_string();
        let all16: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let f32s: Vec<u8> = (0..1_000_000)
            .flat_map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x as u32).to_le_bytes()
            })
            .collect();
        let mut checked = 0u64;
        for (from, to, input) in [
            (DType::BF16, DType::F32, &all16),
            (DType::F16, DType::F32, &all16),
            (DType::F32, DType::BF16, &f32s),
            (DType::F32, DType::F16, &f32s),
            (DType::BF16, DType::F16, &all16),
            (DType::F16, DType::BF16, &all16),
        ] {
            let got = device_cast(dev, from, input, to)?;
            let mut want = vec![0u8; got.len()];
            convert_slice(from, input, to, &mut want);
            // NaN payloads: both sides keep NaN with its sign; compare bits.
            if let Some(i) =
                (0..got.len()).step_by(to.size() as usize).find(|&i| got[i..i + to.size() as usize] != want[i..i + to.size() as usize])
            {
                return Err(format!("{from} -> {to}: element {} differs from the host conversion", i as u64 / to.size()));
            }
            checked += input.len() as u64 / from.size();
        }
        Ok((format!("{checked} values bit-exact against the host conversion ({origin})"), json!({ "values": checked, "origin": origin })))
    }

    /// Runs `plan` on the device (`reps` timed runs after one) and returns
    /// the destinations' memory, the best device time and the report.
    fn device_refit(
        dev: &GpuDevice,
        src: &Layout,
        dst: &Layout,
        plan: &Plan,
        reps: u32,
    ) -> Result<(Vec<RankMemory>, Duration, transport::cuda::exec::DeviceReport), String> {
        let programs = plan.programs(src, dst).map_err(e2s)?;
        let n_src = src.ranks() as usize;
        let mut host = RankMemory::for_programs(&programs);
        fill_sources(src, &mut host[..n_src]);
        let mut memory = DeviceMemory::for_programs(dev, &programs).map_err(e2s)?;
        for (m, h) in memory.iter_mut().zip(&host) {
            m.zero(dev).map_err(e2s)?;
            m.upload(dev, h).map_err(e2s)?;
        }
        let mut run = DeviceRun::prepare(dev, &programs, &mut memory).map_err(e2s)?;
        let first = run.execute().map_err(e2s)?;
        let mut best = first.elapsed;
        for _ in 0..reps {
            best = best.min(run.execute().map_err(e2s)?.elapsed);
        }
        drop(run);
        let back = memory[n_src..].iter().map(|m| m.download(dev)).collect::<Result<Vec<_>, _>>().map_err(e2s)?;
        Ok((back, best, first))
    }

    fn example_pairs(root: &Path) -> Vec<(String, PathBuf, PathBuf)> {
        let root = root.join("examples");
        let mut out = Vec::new();
        if let Ok(dirs) = std::fs::read_dir(&root) {
            for d in dirs.flatten() {
                let (s, t) = (d.path().join("src.json"), d.path().join("dst.json"));
                if s.exists() && t.exists() {
                    out.push((d.file_name().to_string_lossy().into_owned(), s, t));
                }
            }
        }
        out.sort();
        out
    }

    fn load(path: &Path) -> Result<Layout, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        parse_layout(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    fn layout_pairs(ctx: &Ctx) -> Result<(String, Value), String> {
        let dev = &ctx.dev;
        let pairs = example_pairs(&ctx.root);
        if pairs.is_empty() {
            return Err(format!("no example layouts under {}/examples/", ctx.root.display()));
        }
        let (mut runs, mut launches, mut staged, mut elements) = (0u64, 0u64, 0u64, 0u64);
        // Every pair runs, whatever an earlier one showed.
        let mut failures = Vec::new();
        let (mut fp8_device, mut fp8_host) = (0u64, 0u64);
        let mut names = Vec::new();
        for (name, s, d) in &pairs {
            let (src, dst) = (load(s)?, load(d)?);
            let opts = PlanOptions::default();
            for (strategy, plan) in [("reshard", plan_reshard(&src, &dst, &opts)), ("baseline", plan_baseline(&src, &dst, &opts))] {
                let plan = plan.map_err(|e| format!("{name} {strategy}: {e}"))?;
                let (device, _, report) = match device_refit(dev, &src, &dst, &plan, 0) {
                    Ok(r) => r,
                    Err(e) => {
                        failures.push(format!("{name} {strategy}: {e}"));
                        continue;
                    }
                };
                // The host executor's result, byte for byte.
                let programs = plan.programs(&src, &dst).map_err(e2s)?;
                let mut host = RankMemory::for_programs(&programs);
                fill_sources(&src, &mut host[..src.ranks() as usize]);
                run_local(&programs, &mut host, &ExecOptions::default()).map_err(|e| format!("{name} {strategy} on the host: {e}"))?;
                // The layout's buffers, not scratch (which the host
                // executor may bypass; it holds no weight).
                let n_src = src.ranks() as usize;
                for (r, (a, b)) in device.iter().zip(&host[n_src..]).enumerate() {
                    let specs = &programs[n_src + r].buffers;
                    let differs = a
                        .buffers
                        .iter()
                        .zip(&b.buffers)
                        .zip(specs)
                        .find(|((x, y), s)| x != y && !matches!(s.key, BufferKey::Scratch { .. }));
                    if let Some((_, s)) = differs {
                        failures
                            .push(format!("{name} {strategy}: destination rank {r} buffer '{}' differs from the host executor's", s.name));
                    }
                }
                match verify_destinations(&src, &dst, &device) {
                    Ok(n) => elements += n,
                    Err(e) => failures.push(format!("{name} {strategy}: {e}")),
                }
                runs += 1;
                launches += report.kernel_launches;
                staged += report.staged_pieces;
                fp8_device += report.quantized_on_device;
                fp8_host += report.quantized_on_host;
            }
            names.push(name.clone());
        }
        if !failures.is_empty() {
            return Err(format!("{} of {runs} runs differ: {}", failures.len(), failures.join("; ")));
        }
        Ok((
            format!(
                "{} layout pairs x reshard/baseline: every byte of the destinations' layout buffers equals the host executor's, {elements} elements verified; \
                 {launches} cast kernel launches, {staged} pieces converted on the host; FP8 ranks quantized on the device {fp8_device}, \
                 on the host {fp8_host}",
                pairs.len()
            ),
            json!({ "pairs": names, "runs": runs, "elements": elements, "kernel_launches": launches, "staged_pieces": staged,
                    "fp8_ranks_on_device": fp8_device, "fp8_ranks_on_host": fp8_host }),
        ))
    }

    /// The IPC pair: the child's side. Prints one handle (hex) per source
    /// rank, then waits for a line on stdin before freeing its buckets.
    fn ipc_exporter(dir: &Path) -> Result<(), String> {
        let (src, dst) = (load(&dir.join("src.json"))?, load(&dir.join("dst.json"))?);
        let plan = plan_reshard(&src, &dst, &PlanOptions::default()).map_err(e2s)?;
        let programs = plan.programs(&src, &dst).map_err(e2s)?;
        let dev = GpuDevice::open(0).map_err(e2s)?;
        let n_src = src.ranks() as usize;
        let mut host = RankMemory::for_programs(&programs[..n_src]);
        fill_sources(&src, &mut host);
        let mut buckets = Vec::new();
        for (p, h) in programs[..n_src].iter().zip(&host) {
            let mut m = DeviceMemory::for_buffers(&dev, p.endpoint, &p.buffers).map_err(e2s)?;
            m.upload(&dev, h).map_err(e2s)?;
            buckets.push(m);
        }
        publish(&dev, &buckets)
    }

    /// An exporting child's part: prints each bucket's IPC handle (hex, a
    /// line each) and keeps the buckets until a line arrives on stdin.
    fn publish(dev: &GpuDevice, buckets: &[DeviceMemory]) -> Result<(), String> {
        let mut out = std::io::stdout().lock();
        for m in buckets {
            writeln!(out, "{}", m.export_ipc(dev).map_err(e2s)?.to_hex()).map_err(e2s)?;
        }
        out.flush().map_err(e2s)?;
        drop(out);
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map_err(e2s)?;
        Ok(())
    }

    /// A child process of this program that exports IPC handles
    /// ([`publish`]) and keeps their memory until [`Exporter::finish`].
    struct Exporter {
        child: std::process::Child,
        lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
    }

    impl Exporter {
        fn start(args: &[&std::ffi::OsStr]) -> Result<Exporter, String> {
            let exe = std::env::current_exe().map_err(e2s)?;
            let mut child = Command::new(exe)
                .args(args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| format!("starting the exporting process: {e}"))?;
            let out = child.stdout.take().ok_or("no child stdout")?;
            Ok(Exporter { child, lines: std::io::BufReader::new(out).lines() })
        }

        /// The next handle the child exported.
        fn handle(&mut self) -> Result<IpcHandle, String> {
            let hex = self.lines.next().ok_or("the exporting process ended before sending its handles")?.map_err(e2s)?;
            IpcHandle::from_hex(&hex).map_err(|e| format!("the exporting process's handle: {e}"))
        }

        /// Lets the child free its memory and end; whether it ended well.
        fn finish(mut self) -> Result<(), String> {
            if let Some(mut stdin) = self.child.stdin.take() {
                let _ = writeln!(stdin, "done");
            }
            let status = self.child.wait().map_err(e2s)?;
            if status.success() {
                Ok(())
            } else {
                Err(format!("the exporting process failed: {status}"))
            }
        }
    }

    fn ipc(ctx: &Ctx) -> Result<(String, Value), String> {
        let dev = &ctx.dev;
        let dir = ctx.root.join("examples/mixed-2d");
        let (src, dst) = (load(&dir.join("src.json"))?, load(&dir.join("dst.json"))?);
        let plan = plan_reshard(&src, &dst, &PlanOptions::default()).map_err(e2s)?;
        let programs = plan.programs(&src, &dst).map_err(e2s)?;
        let n_src = src.ranks() as usize;
        let mut exporter = Exporter::start(&["--ipc-exporter".as_ref(), dir.as_os_str()])?;
        let result = (|| -> Result<(String, Value), String> {
            let mut memory = Vec::new();
            for p in &programs[..n_src] {
                let handle = exporter.handle()?;
                // SAFETY: the child keeps its buckets until we write to its
                // stdin (after the refit and the mappings are dropped), and
                // does not touch them meanwhile.
                memory.push(unsafe { DeviceMemory::import_ipc(dev, p.endpoint, &p.buffers, &handle) }.map_err(e2s)?);
            }
            for p in &programs[n_src..] {
                let mut m = DeviceMemory::for_buffers(dev, p.endpoint, &p.buffers).map_err(e2s)?;
                m.zero(dev).map_err(e2s)?;
                memory.push(m);
            }
            let report = DeviceRun::prepare(dev, &programs, &mut memory).map_err(e2s)?.execute().map_err(e2s)?;
            let back = memory[n_src..].iter().map(|m| m.download(dev)).collect::<Result<Vec<_>, _>>().map_err(e2s)?;
            drop(memory);
            let checked = verify_destinations(&src, &dst, &back).map_err(|e| format!("MISMATCH: {e}"))?;
            Ok((
                format!(
                    "{} source ranks in another process, one IPC handle each; {checked} destination elements verified, {} bytes in {:?}",
                    n_src, report.wire_bytes, report.elapsed
                ),
                json!({ "handles": n_src, "elements": checked, "bytes": report.wire_bytes, "seconds": report.elapsed.as_secs_f64() }),
            ))
        })();
        let finished = exporter.finish();
        let r = result?;
        finished?;
        Ok(r)
    }

    fn nccl(ctx: &Ctx) -> Result<(String, Value), String> {
        let dev = &ctx.dev;
        let abort_timeout = Duration::from_secs(10);
        let config = CommConfig { init_timeout: Duration::from_secs(60), abort_timeout, ..CommConfig::new(0, 1) };
        let bytes = 64usize << 20;
        let mut lines = Vec::new();
        let mut fields = Vec::new();
        for attempt in ["first", "new id"] {
            let id = CommId::generate()?;
            let t = Instant::now();
            let mut comm = create_comms(&[(dev.ordinal(), 0)], id, config).remove(0).map_err(|e| format!("{attempt}: {e}"))?;
            let init = t.elapsed();
            let t = Instant::now();
            // SAFETY: an empty group names no memory.
            unsafe { comm.group(0, Vec::new(), None, Instant::now() + Duration::from_secs(30)) }
                .map_err(|e| format!("{attempt}: empty group: {e}"))?;
            let empty = t.elapsed();
            let me = Endpoint::src(0);
            let data: Vec<u8> = (0..bytes).map(|i| (i * 31 + 7) as u8).collect();
            let mut a = DeviceMemory::for_buffers(dev, me, &[spec(DType::U8, bytes as u64)]).map_err(e2s)?;
            let mut b = DeviceMemory::for_buffers(dev, me, &[spec(DType::U8, bytes as u64)]).map_err(e2s)?;
            a.upload(dev, &RankMemory { buffers: vec![data.clone()], dtypes: vec![DType::U8] }).map_err(e2s)?;
            b.zero(dev).map_err(e2s)?;
            let (pa, pb) = (a.device_addrs()[0], b.device_addrs()[0]);
            let ops = vec![P2p::Send { peer: 0, addr: pa, bytes: bytes as u64 }, P2p::Recv { peer: 0, addr: pb, bytes: bytes as u64 }];
            let t = Instant::now();
            // SAFETY: both buffers hold `bytes` bytes on this device and
            // live until after the group; if it fails they are never freed.
            if let Err(e) = unsafe { comm.group(1, ops, None, Instant::now() + Duration::from_secs(30)) } {
                std::mem::forget((a, b));
                return Err(format!("{attempt}: self send/recv: {e}"));
            }
            let sendrecv = t.elapsed();
            if b.download(dev).map_err(e2s)?.buffers[0] != data {
                return Err(format!("{attempt}: MISMATCH: received bytes differ from the sent ones"));
            }
            let t = Instant::now();
            let outcome = comm.abort();
            let aborted = t.elapsed();
            if !matches!(outcome, AbortOutcome::Aborted { .. }) || aborted > abort_timeout {
                return Err(format!("{attempt}: abort: {outcome:?} after {aborted:?} (deadline {abort_timeout:?})"));
            }
            lines.push(format!(
                "{attempt}: init {init:?}, empty group {empty:?}, 64 MiB to itself {sendrecv:?} ({:.1} GB/s) verified, abort {aborted:?}",
                gbps(bytes as u64, sendrecv)
            ));
            fields.push(json!({ "init_s": init.as_secs_f64(), "sendrecv_s": sendrecv.as_secs_f64(), "abort_s": aborted.as_secs_f64() }));
        }
        Ok((lines.join("; "), json!({ "attempts": fields })))
    }

    /// A device refit of `llama3-8b --scale 2` against one `cuMemcpyDtoD`
    /// of the same bytes, issued four ways (one CUDA graph or call by
    /// call; narrow rows by the copy kernels or by copy calls), best of
    /// three runs each after one; the default way must reach the target.
    fn throughput(ctx: &Ctx) -> Result<(String, Value), String> {
        use transport::cuda::exec::DeviceRunOptions;
        let dev = &ctx.dev;
        let (src, dst) = layouts(Model::Llama3_8b, 2).map_err(e2s)?;
        let plan = plan_reshard(&src, &dst, &PlanOptions::default()).map_err(e2s)?;
        let programs = plan.programs(&src, &dst).map_err(e2s)?;
        let n_src = src.ranks() as usize;
        let mut host = RankMemory::for_programs(&programs);
        fill_sources(&src, &mut host[..n_src]);
        let mut memory = DeviceMemory::for_programs(dev, &programs).map_err(e2s)?;
        for (m, h) in memory.iter_mut().zip(&host) {
            m.zero(dev).map_err(e2s)?;
            m.upload(dev, h).map_err(e2s)?;
        }
        drop(host);
        let d = DeviceRunOptions::default();
        let ways = [
            ("one graph, 8 lanes, copy calls only", d),
            ("one graph, 16 lanes, copy calls only", DeviceRunOptions { lanes: 16, ..d }),
            ("one graph, one lane, copy calls only", DeviceRunOptions { lanes: 1, ..d }),
            ("one graph, 8 lanes, narrow rows by kernel", DeviceRunOptions { narrow_rows_by_kernel: true, ..d }),
            ("call by call, copy calls only", DeviceRunOptions { graph: false, ..d }),
        ];
        let mut timed = Vec::new();
        let mut checked = 0;
        for (i, (name, options)) in ways.into_iter().enumerate() {
            let mut run = DeviceRun::prepare_with(dev, &programs, &mut memory, options).map_err(e2s)?;
            let first = run.execute().map_err(e2s)?;
            let mut best = first.elapsed;
            for _ in 0..3 {
                best = best.min(run.execute().map_err(e2s)?.elapsed);
            }
            drop(run);
            timed.push((name, best, first));
            if i == 0 {
                // The default way, verified on destinations it alone wrote
                // (zeroed above); the others are timed only.
                let back = memory[n_src..].iter().map(|m| m.download(dev)).collect::<Result<Vec<_>, _>>().map_err(e2s)?;
                checked = verify_destinations(&src, &dst, &back).map_err(|e| format!("MISMATCH ({name}): {e}"))?;
            }
        }
        drop(memory);
        let (_, best, report) = &timed[0];
        let plain = time_plain_copy(dev, report.wire_bytes as usize, 3).map_err(e2s)?;
        let ratio = plain.as_secs_f64() / best.as_secs_f64().max(1e-12);
        let ways_text: Vec<String> = timed
            .iter()
            .map(|(name, t, r)| {
                format!("{name}: {t:?} ({} copies, {} kernels{})", r.copy_calls, r.kernel_launches, if r.graph { ", graph" } else { "" })
            })
            .collect();
        let line = format!(
            "llama3-8b --scale 2: {} bytes in {best:?} ({:.0} GB/s, {checked} elements verified); cuMemcpyDtoD of the same bytes \
             {plain:?} ({:.0} GB/s); ratio {ratio:.2} (target >= {TARGET_RATIO}); {}",
            report.wire_bytes,
            gbps(report.wire_bytes, *best),
            gbps(report.wire_bytes, plain),
            ways_text.join("; ")
        );
        let ways_json: Vec<Value> = timed
            .iter()
            .map(|(name, t, r)| json!({ "way": name, "refit_s": t.as_secs_f64(), "copies": r.copy_calls, "kernels": r.kernel_launches, "graph": r.graph }))
            .collect();
        let fields = json!({
            "bytes": report.wire_bytes, "refit_s": best.as_secs_f64(), "memcpy_s": plain.as_secs_f64(),
            "ratio": ratio, "target": TARGET_RATIO, "elements": checked, "ways": ways_json,
        });
        if ratio >= TARGET_RATIO {
            Ok((line, fields))
        } else {
            Err(line)
        }
    }

    /// Refits through the orchestrator on the NCCL fabric over `gpus` GPUs.
    fn orchestrated(gpus: usize) -> Result<(String, Value), String> {
        use orchestrator::{spawn_refit, CommPlane, Fabric, NcclFabric, OrchestratorConfig};
        let dst_ranks = (gpus - 1).min(7);
        let (rows, cols) = (4096u64, 4096u64);
        let src = format!(
            r#"{{"ranks": 1, "tensors": [{{"name": "w", "dtype": "f32", "shape": [{rows}, {cols}], "shards": [
                {{"rank": 0, "offset": [0, 0], "extent": [{rows}, {cols}], "buffer": "params", "at": 0}}]}}]}}"#
        );
        let dst = format!(
            r#"{{"ranks": {dst_ranks}, "tensors": [{{"name": "w", "dtype": "bf16", "shape": [{rows}, {cols}],
                "mesh": {{"shape": [{dst_ranks}]}}, "placements": ["shard(0)"]}}]}}"#
        );
        let (src, dst) = (parse_layout(&src).map_err(e2s)?, parse_layout(&dst).map_err(e2s)?);
        // Integers below 256: exact in bf16.
        let value = |i: u64, k: u64| ((i % 100) + k) as f32;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().map_err(e2s)?;
        rt.block_on(async {
            let config = OrchestratorConfig {
                fabric: Fabric::Nccl(NcclFabric::new(CommPlane::Cuda)),
                deadline: Duration::from_secs(60),
                ..OrchestratorConfig::default()
            };
            let sys = spawn_refit(&src, &dst, config).await.map_err(e2s)?;
            let mut lines = Vec::new();
            let mut checked = 0u64;
            for k in 1..=3u64 {
                let (v, _) = sys.src_stores[0]
                    .try_update(|b| b.tensor_mut("w")?.map_f32(|at, _| value(at[0] * cols + at[1], k)))
                    .await
                    .map_err(e2s)?;
                let report = sys.orchestrator.refit(v).await.map_err(|e| format!("refit {k}: {e}"))?;
                for (r, store) in sys.dst_stores.iter().enumerate() {
                    let snap = store.snapshot().ok_or(format!("refit {k}: dst[{r}] serves nothing"))?;
                    let view = snap.buffers.tensor("w").map_err(e2s)?;
                    let got = view.to_f32().map_err(e2s)?;
                    let mut bad = None;
                    view.for_each_index(|i, at| {
                        if bad.is_none() && got[i] != value(at[0] * cols + at[1], k) {
                            bad = Some(at.to_vec());
                        }
                    });
                    if let Some(at) = bad {
                        return Err(format!("refit {k}: MISMATCH: dst[{r}] element {at:?}"));
                    }
                    checked += got.len() as u64;
                }
                lines.push(format!("v{v}: {:.1} ms{}", report.wall.as_secs_f64() * 1e3, if report.resumed { " (kept)" } else { "" }));
            }
            Ok((
                format!("1 source + {dst_ranks} destinations on {} GPUs, {checked} elements checked; {}", dst_ranks + 1, lines.join(", ")),
                json!({ "gpus": dst_ranks + 1, "elements": checked, "refits": lines }),
            ))
        })
    }

    /// The layouts of the `orchestrator-ipc` check and its values.
    const IPC_SRC: &str = r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [2048, 1024], "shards": [
        {"rank": 0, "offset": [0, 0], "extent": [1024, 1024], "buffer": "params", "at": 0},
        {"rank": 1, "offset": [1024, 0], "extent": [1024, 1024], "buffer": "params", "at": 0}]}]}"#;
    const IPC_DST: &str = r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "bf16", "shape": [2048, 1024],
        "mesh": {"shape": [2]}, "placements": ["shard(1)"]}]}"#;

    /// Integers below 256: exact in bf16.
    fn ipc_value(at: &[u64]) -> f32 {
        ((at[0] * 1024 + at[1]) % 251) as f32
    }

    /// The `orchestrator-ipc` check's child: serves both source members on
    /// GPU 0 with version 1 written, until the rendezvous closes.
    fn ipc_members() -> Result<(), String> {
        use orchestrator::{join, JoinConfig, MemberConfig, Role, SrcStore};
        use std::sync::Arc;
        let src = Arc::new(parse_layout(IPC_SRC).map_err(e2s)?);
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(e2s)?;
        rt.block_on(async {
            let joined = join(&JoinConfig::from_env().map_err(e2s)?).await.map_err(e2s)?;
            for rank in 0..src.ranks() {
                let store = Arc::new(SrcStore::new(&src, rank));
                store.try_update(|b| b.tensor_mut("w")?.map_f32(|at, _| ipc_value(at))).await.map_err(e2s)?;
                let config = MemberConfig { gpu: Some(0), ..joined.member_config() };
                joined.serve_member_with(src.clone(), rank, Role::Src(store), config).await.map_err(e2s)?;
            }
            joined.closed().await;
            joined.shutdown();
            Ok(())
        })
    }

    /// Where the `orchestrator-ipc` checks' destinations serve their
    /// weights.
    #[derive(Clone, Copy, PartialEq)]
    enum Served {
        /// In their stores (host memory).
        Stores,
        /// In device buffers of this process registered in place
        /// (`DstStore::registered`): the refit's commit copies into them.
        InPlace,
    }

    fn orchestrated_ipc(ctx: &Ctx) -> Result<(String, Value), String> {
        orchestrated_ipc_into(&ctx.dev, Served::Stores)
    }

    fn orchestrated_ipc_in_place(ctx: &Ctx) -> Result<(String, Value), String> {
        orchestrated_ipc_into(&ctx.dev, Served::InPlace)
    }

    /// A colocated refit through the orchestrator on the CUDA IPC fabric,
    /// between a child process (sources) and this one (destinations), on
    /// one GPU.
    fn orchestrated_ipc_into(dev: &GpuDevice, served: Served) -> Result<(String, Value), String> {
        use actors::{spawn, ActorGroup, Secret, SpawnConfig};
        use orchestrator::rendezvous::{ControlConfig, RENDEZVOUS_ENV, SECRET_ENV};
        use orchestrator::{
            spawn_orchestrator, CommPlane, DstStore, Fabric, IpcFabric, Member, MemberConfig, OrchestratorConfig, Rendezvous, Role,
        };
        use orchestrator::{Buffers, Registered, Residence};
        use reshard::Group;
        use std::sync::Arc;
        let (src, dst) = (parse_layout(IPC_SRC).map_err(e2s)?, Arc::new(parse_layout(IPC_DST).map_err(e2s)?));
        let wait = Duration::from_secs(60);
        // The destinations' own device buffers (in place): declared before
        // the runtime, so they outlive every store and member that names
        // them.
        let mut device = Vec::new();
        if served == Served::InPlace {
            for r in 0..dst.ranks() {
                let mem = DeviceMemory::for_buffers(dev, Endpoint::dst(r), &dst.rank_buffers(r)).map_err(e2s)?;
                device.push(mem);
            }
        }
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().map_err(e2s)?;
        rt.block_on(async {
            let secret_text = format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
            let secret = Secret::from_bytes(secret_text.as_bytes().to_vec()).map_err(e2s)?;
            // Destination members here prove the job's secret too.
            let member_config = MemberConfig { gpu: Some(0), secret: Some(secret.clone()), ..MemberConfig::default() };
            let rendezvous = Rendezvous::bind(secret, "127.0.0.1:0".parse().map_err(e2s)?, &ControlConfig::default()).await.map_err(e2s)?;
            let exe = std::env::current_exe().map_err(e2s)?;
            let mut child = Command::new(exe)
                .arg("--ipc-members")
                .env(RENDEZVOUS_ENV, rendezvous.addr().to_string())
                .env(SECRET_ENV, &secret_text)
                .spawn()
                .map_err(|e| format!("starting the source process: {e}"))?;
            let result = async {
                let src_members = rendezvous.members(Group::Src, src.ranks(), wait).await.map_err(e2s)?;
                let mut stores: Vec<Arc<DstStore>> = Vec::new();
                for r in 0..dst.ranks() {
                    stores.push(Arc::new(match device.get(r as usize) {
                        None => DstStore::new(&dst, r),
                        Some(mem) => {
                            let regions = mem.device_addrs().iter().copied().zip(mem.buffer_lens().iter().copied()).collect();
                            // SAFETY: `device` is this process's allocation on
                            // GPU 0, alive until after the runtime (and so
                            // every store) is gone; read below only inside
                            // `serve`.
                            let reg = unsafe { Registered::new(&dst, r, Residence::Device { ordinal: 0 }, regions) }.map_err(e2s)?;
                            DstStore::registered(&dst, r, reg)
                        }
                    }));
                }
                let config = OrchestratorConfig { fabric: Fabric::Ipc(IpcFabric::new(CommPlane::Cuda)), ..OrchestratorConfig::default() };
                let members = stores
                    .iter()
                    .enumerate()
                    .map(|(r, s)| {
                        let member = Member::with_config(dst.clone(), r as u32, Role::Dst(s.clone()), member_config.clone());
                        spawn(member, SpawnConfig::default().call_timeout(config.deadline + config.control_timeout))
                    })
                    .collect();
                let orchestrator = spawn_orchestrator(src_members, ActorGroup::from_refs(members), config);
                let report = orchestrator.refit(1).await.map_err(|e| format!("refit: {e}"))?;
                let mut checked = 0u64;
                for (r, store) in stores.iter().enumerate() {
                    let serving = store.serve().await;
                    if serving.version() != Some(1) {
                        return Err(format!("dst[{r}] serves {:?}, not version 1", serving.version()));
                    }
                    let snap = store.snapshot().ok_or(format!("dst[{r}] serves nothing"))?;
                    let mut copied = Buffers::new(&dst, r as u32);
                    let buffers = match device.get(r) {
                        None => &snap.buffers,
                        Some(mem) => {
                            *copied.memory_mut() = mem.download(dev).map_err(e2s)?;
                            &copied
                        }
                    };
                    drop(serving);
                    let view = buffers.tensor("w").map_err(e2s)?;
                    let got = view.to_f32().map_err(e2s)?;
                    let mut bad = None;
                    view.for_each_index(|i, at| {
                        if bad.is_none() && got[i] != ipc_value(at) {
                            bad = Some(at.to_vec());
                        }
                    });
                    if let Some(at) = bad {
                        return Err(format!("MISMATCH: dst[{r}] element {at:?}"));
                    }
                    checked += got.len() as u64;
                }
                Ok((
                    format!(
                        "2 sources in process {} → 2 destinations here{}, one GPU: {checked} elements checked, {:.1} ms (commit {:.1} ms)",
                        child.id(),
                        if served == Served::InPlace { " (registered device buffers)" } else { "" },
                        report.wall.as_secs_f64() * 1e3,
                        report.commit_time.as_secs_f64() * 1e3
                    ),
                    json!({ "elements": checked, "wall_ms": report.wall.as_secs_f64() * 1e3, "commit_ms": report.commit_time.as_secs_f64() * 1e3, "bytes": report.bytes }),
                ))
            }
            .await;
            drop(rendezvous);
            let _ = child.kill();
            let _ = child.wait();
            result
        })
    }

    /// The driver, NCCL and NVRTC versions, the device, and where the
    /// cast kernels came from: passes when they are the shipped code (a
    /// device on which only NVRTC's load would run slower paths silently
    /// elsewhere). NVRTC is reported, not required.
    fn environment(ctx: &Ctx) -> Result<(String, Value), String> {
        use transport::cuda::device::{device_uuid, driver_version, nccl_version_text, probe_nccl};
        let dev = &ctx.dev;
        let driver = driver_version()?;
        let nccl = probe_nccl().map(nccl_version_text);
        let uuid = device_uuid(dev.ordinal())?;
        let (major, minor) = dev.context().compute_capability().map_err(e2s)?;
        let nvrtc = transport::cuda::kernels::nvrtc_version();
        // NVRTC's own build of the kernels, for this device, loads too.
        let nvrtc_kernels = dev.check_nvrtc_kernels();
        let kernels = dev.kernels()?;
        let fields = json!({
            "device": dev.name(), "uuid": uuid, "compute_capability": format!("{major}.{minor}"), "driver_cuda": driver,
            "nccl": nccl.clone().unwrap_or_else(|e| format!("unavailable: {e}")),
            "nvrtc": nvrtc.clone().unwrap_or_else(|e| format!("unavailable: {e}")),
            "nvrtc_kernels_load": nvrtc_kernels.clone().map(|o| format!("yes: {o}")).unwrap_or_else(|e| e),
            "kernels": kernels.origin(), "ptx_isa": transport::cuda::kernels::shipped_ptx_isa(),
        });
        let line = format!(
            "{} (sm_{major}{minor}, {uuid}), driver CUDA {driver}, NCCL {}, NVRTC {}; kernels: {}; NVRTC's build loads: {}",
            dev.name(),
            fields["nccl"].as_str().unwrap_or_default(),
            fields["nvrtc"].as_str().unwrap_or_default(),
            kernels.origin(),
            fields["nvrtc_kernels_load"].as_str().unwrap_or_default()
        );
        if !kernels.shipped() {
            return Err(format!("{line} — the shipped PTX did not load"));
        }
        nccl.map_err(|e| format!("{line} — NCCL: {e}"))?;
        Ok((line, fields))
    }

    /// The `ipc-abort-in-flight` check's child: exports one bucket of
    /// `bytes` on GPU 0, prints its handle, and keeps it until a line
    /// arrives on stdin.
    fn ipc_bucket(bytes: &str) -> Result<(), String> {
        let bytes: u64 = bytes.parse().map_err(|e| format!("bucket size {bytes}: {e}"))?;
        let dev = GpuDevice::open(0).map_err(e2s)?;
        let mut m = DeviceMemory::for_buffers(&dev, Endpoint::src(0), &[spec(DType::U8, bytes)]).map_err(e2s)?;
        m.zero(&dev).map_err(e2s)?;
        publish(&dev, &[m])
    }

    /// An IPC rank that gives up while its copy from a peer's bucket (in
    /// another process) is still running: the peer's mapping must stay
    /// (closing it under the copy faults the context that the framework's
    /// own work shares). Afterwards this process's context still copies,
    /// casts and allocates.
    fn ipc_abort_in_flight(ctx: &Ctx) -> Result<(String, Value), String> {
        use transport::cuda::comm::Progress;
        use transport::cuda::ipc_comm::{gpu::GpuIpc, IpcMemory};
        let dev = &ctx.dev;
        let bytes: u64 = 8 << 30;
        let size = bytes.to_string();
        let mut exporter = Exporter::start(&["--ipc-bucket".as_ref(), size.as_ref()])?;
        let result = (|| -> Result<(String, Value), String> {
            let handle = exporter.handle()?;
            let me = Endpoint::dst(0);
            let (mut rank, _) = GpuIpc::export(0, me, 1 << 20)?;
            rank.map_peer(0, Endpoint::src(0), &handle, bytes)?;
            // Never freed: the copy into it may outlive any early return
            // below (this process ends soon after the check).
            let target = std::mem::ManuallyDrop::new(DeviceMemory::for_buffers(dev, me, &[spec(DType::U8, bytes)]).map_err(e2s)?);
            let t = Instant::now();
            // SAFETY: `target` holds `bytes` bytes of this process and is
            // never freed (ManuallyDrop above), on every path out of here.
            unsafe { rank.pull(0, 0, target.device_addrs()[0], bytes) }?;
            let in_flight = rank.pulled()? == Progress::Pending;
            rank.abandon();
            drop(rank);
            // The copy ends on its own; the context must still be usable.
            dev.context().synchronize().map_err(|e| format!("the context after the abort: {e}"))?;
            let copied = t.elapsed();
            let sample: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
            let mut m = DeviceMemory::for_buffers(dev, me, &[spec(DType::U8, sample.len() as u64)]).map_err(e2s)?;
            m.upload(dev, &RankMemory { buffers: vec![sample.clone()], dtypes: vec![DType::U8] }).map_err(e2s)?;
            if m.download(dev).map_err(e2s)?.buffers[0] != sample {
                return Err("after the abort, bytes uploaded to the device came back different".into());
            }
            let f = [1.5f32, -2.25, 3.0e-3].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
            let mut want = vec![0u8; 6];
            convert_slice(DType::F32, &f, DType::BF16, &mut want);
            if device_cast(dev, DType::F32, &f, DType::BF16)? != want {
                return Err("after the abort, the cast kernel returned other bytes".into());
            }
            if !in_flight {
                return Err(format!("the {bytes}-byte copy was done before the abort ({copied:?}): nothing was tested"));
            }
            Ok((
                format!("aborted with an {} GiB copy from another process's bucket in flight; it finished in {copied:?}, the context then copied and cast correctly", bytes >> 30),
                json!({ "bytes": bytes, "in_flight_at_abort": in_flight, "copy_s": copied.as_secs_f64() }),
            ))
        })();
        let finished = exporter.finish();
        let r = result?;
        finished?;
        Ok(r)
    }

    /// Registered device memory that lies: a region past the end of its
    /// allocation, one in host memory, and one offset into the middle of
    /// an allocation running past its end are refused by the driver's
    /// checks (`DeviceMemory::register`), naming what is wrong; an honest
    /// region inside the allocation is taken.
    fn registered_lies(ctx: &Ctx) -> Result<(String, Value), String> {
        let dev = &ctx.dev;
        let me = Endpoint::dst(0);
        let n: u64 = 1 << 20;
        let mem = DeviceMemory::for_buffers(dev, me, &[spec(DType::U8, n)]).map_err(e2s)?;
        let base = mem.device_addrs()[0];
        let host = vec![0u8; n as usize];
        let try_region = |addr: u64, len: u64| {
            // SAFETY: `register` only reads the addresses' attributes from
            // the driver and records them; the result is dropped here
            // unused, so no byte at them is read or written whatever the
            // check decides.
            unsafe { DeviceMemory::register(dev, me, &[spec(DType::U8, len)], &[(addr, len as usize)]) }.map(drop).map_err(e2s)
        };
        try_region(base, n).map_err(|e| format!("an honest region was refused: {e}"))?;
        try_region(base + 4096, n - 4096).map_err(|e| format!("an honest region was refused: {e}"))?;
        let mut refusals = Vec::new();
        for (what, addr, len) in [
            ("one byte past the allocation", base, n + 1),
            ("from the middle past the end", base + n / 2, n),
            ("host memory", host.as_ptr() as u64, n),
        ] {
            match try_region(addr, len) {
                Ok(()) => return Err(format!("a region {what} was taken")),
                Err(e) => refusals.push(format!("{what}: {e}")),
            }
        }
        drop(host);
        Ok((format!("an honest region taken; refused: {}", refusals.join("; ")), json!({ "refusals": refusals })))
    }

    /// Two ranks of one communicator on this one GPU (a trainer and an
    /// engine colocated) through the orchestrator: refused before any
    /// communicator is made, within seconds.
    fn nccl_same_device(_ctx: &Ctx) -> Result<(String, Value), String> {
        use actors::{spawn, ActorGroup, SpawnConfig};
        use orchestrator::{
            spawn_orchestrator, CommPlane, DstStore, Fabric, Member, MemberConfig, NcclFabric, OrchestratorConfig, Role, SrcStore,
        };
        use std::sync::Arc;
        let (src, dst) = (Arc::new(parse_layout(IPC_SRC).map_err(e2s)?), Arc::new(parse_layout(IPC_DST).map_err(e2s)?));
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(e2s)?;
        rt.block_on(async {
            let config = OrchestratorConfig { fabric: Fabric::Nccl(NcclFabric::new(CommPlane::Cuda)), ..OrchestratorConfig::default() };
            let on_gpu0 = MemberConfig { gpu: Some(0), ..MemberConfig::default() };
            let spawn_config = SpawnConfig::default().call_timeout(config.deadline + config.control_timeout);
            let src_stores: Vec<_> = (0..src.ranks()).map(|r| Arc::new(SrcStore::new(&src, r))).collect();
            let srcs = (0..src.ranks())
                .map(|r| {
                    spawn(
                        Member::with_config(src.clone(), r, Role::Src(src_stores[r as usize].clone()), on_gpu0.clone()),
                        spawn_config.clone(),
                    )
                })
                .collect();
            let dsts = (0..dst.ranks())
                .map(|r| {
                    spawn(
                        Member::with_config(dst.clone(), r, Role::Dst(Arc::new(DstStore::new(&dst, r))), on_gpu0.clone()),
                        spawn_config.clone(),
                    )
                })
                .collect();
            let orchestrator = spawn_orchestrator(ActorGroup::from_refs(srcs), ActorGroup::from_refs(dsts), config);
            let mut version = 0;
            for s in &src_stores {
                version = s.try_update(|b| b.tensor_mut("w")?.map_f32(|at, _| ipc_value(at))).await.map_err(e2s)?.0;
            }
            let t = Instant::now();
            let r = orchestrator.refit(version).await;
            let took = t.elapsed();
            match r {
                Ok(_) => Err("4 ranks on one GPU: the refit ran (NCCL should never have been asked)".into()),
                Err(e) if e.to_string().contains("on one GPU") && took < Duration::from_secs(10) => Ok((
                    format!("refused in {took:?}: {e}"),
                    json!({ "refused_s": took.as_secs_f64(), "abandoned_threads": transport::cuda::comm::abandoned_comm_threads() }),
                )),
                Err(e) => Err(format!("after {took:?}, not the same-device refusal: {e}")),
            }
        })
    }

    /// A communicator of two ranks of which one never comes, with a 3 s
    /// creation timeout: creation fails by then, its cleanup abort either
    /// finishes or its thread is counted as abandoned, and the caller is
    /// answered within the timeouts.
    fn nccl_missing_peer(ctx: &Ctx) -> Result<(String, Value), String> {
        use transport::cuda::comm::{abandoned_comm_threads, CommError};
        let (init_timeout, abort_timeout) = (Duration::from_secs(3), Duration::from_secs(5));
        let config = CommConfig { init_timeout, abort_timeout, ..CommConfig::new(0, 2) };
        let id = CommId::generate()?;
        let t = Instant::now();
        let r = create_comms(&[(ctx.dev.ordinal(), 0)], id, config).remove(0);
        let took = t.elapsed();
        let bound = init_timeout + abort_timeout + Duration::from_secs(2);
        match r {
            Ok(_) => Err("a communicator of 2 was made with only 1 rank".into()),
            Err(e @ CommError::InitTimeout { abandoned, .. }) if took <= bound => Ok((
                format!("{e} — answered in {took:?} (bound {bound:?})"),
                json!({ "answered_s": took.as_secs_f64(), "abandoned": abandoned, "abandoned_threads": abandoned_comm_threads() }),
            )),
            Err(e) => Err(format!("after {took:?} (bound {bound:?}): {e}")),
        }
    }

    /// The NCCL orchestrator check where there are GPUs for it.
    fn orchestrated_on_gpus(_ctx: &Ctx) -> Result<(String, Value), String> {
        match transport::cuda::device::device_count() {
            Ok(gpus) if gpus >= 2 => orchestrated(gpus),
            Ok(gpus) => Err(format!("SKIP: needs 2 GPUs (one NCCL rank per GPU), found {gpus}")),
            Err(e) => Err(format!("counting GPUs: {e}")),
        }
    }

    /// What a check runs on: device 0 and the folder that holds
    /// `examples/` (given at run time: `--root`, default the current one).
    struct Ctx {
        dev: GpuDevice,
        root: PathBuf,
    }

    type Check = fn(&Ctx) -> Result<(String, Value), String>;

    /// One check: its own child process, killed past `timeout_s`;
    /// `expected_s` is what it takes on one H200 (the dry run adds them up).
    struct Spec {
        name: &'static str,
        timeout_s: u64,
        expected_s: u64,
        run: Check,
    }

    /// In the order they run: NCCL last (a hang there cannot hold the
    /// rest). Expected times as measured on an H200 (2026-12-04; the
    /// throughput check fills and verifies 4 GB on the host).
    const CHECKS: &[Spec] = &[
        Spec { name: "environment", timeout_s: 60, expected_s: 2, run: environment },
        Spec { name: "kernels", timeout_s: 60, expected_s: 1, run: kernels },
        Spec { name: "layouts", timeout_s: 120, expected_s: 2, run: layout_pairs },
        Spec { name: "ipc", timeout_s: 60, expected_s: 1, run: ipc },
        Spec { name: "throughput", timeout_s: 150, expected_s: 65, run: throughput },
        Spec { name: "orchestrator-ipc", timeout_s: 60, expected_s: 1, run: orchestrated_ipc },
        Spec { name: "orchestrator-ipc-in-place", timeout_s: 60, expected_s: 1, run: orchestrated_ipc_in_place },
        Spec { name: "ipc-abort-in-flight", timeout_s: 60, expected_s: 1, run: ipc_abort_in_flight },
        Spec { name: "registered-lies", timeout_s: 30, expected_s: 1, run: registered_lies },
        Spec { name: "nccl-same-device", timeout_s: 30, expected_s: 1, run: nccl_same_device },
        Spec { name: "nccl-missing-peer", timeout_s: 40, expected_s: 4, run: nccl_missing_peer },
        Spec { name: "nccl", timeout_s: 90, expected_s: 3, run: nccl },
        Spec { name: "orchestrator", timeout_s: 90, expected_s: 1, run: orchestrated_on_gpus },
    ];

    /// A check's result as the runner records it (skipped: `ok` absent).
    fn result_json(check: &str, result: Result<(String, Value), String>, seconds: f64) -> Value {
        let fallbacks = transport::cuda::nccl::host_fallbacks();
        let mut v = match result {
            Ok((line, fields)) => {
                let mut v = json!({ "check": check, "ok": true, "line": line });
                if let (Value::Object(m), Value::Object(f)) = (&mut v, fields) {
                    m.extend(f);
                }
                v
            }
            Err(e) if e.starts_with("SKIP: ") => json!({ "check": check, "skipped": e["SKIP: ".len()..] }),
            Err(e) => json!({ "check": check, "ok": false, "line": e }),
        };
        v["seconds"] = json!(seconds);
        // Correct but slow is a failure here: every piece converted and
        // every tensor quantized on the device.
        v["host_fallbacks"] = json!(fallbacks);
        if fallbacks > 0 && v["ok"] == json!(true) {
            v["ok"] = json!(false);
            v["line"] = json!(format!(
                "{} — but {fallbacks} piece(s) or quantization(s) ran on the host instead of the GPU (the log's first warning says why)",
                v["line"].as_str().unwrap_or_default()
            ));
        }
        v
    }

    /// `--only NAME`: runs one check in this process, prints its JSON.
    fn run_one(name: &str, root: PathBuf) -> ExitCode {
        let Some(spec) = CHECKS.iter().find(|c| c.name == name) else {
            eprintln!("no check {name}");
            return ExitCode::from(2);
        };
        let t = Instant::now();
        let result = GpuDevice::open(0).map_err(e2s).and_then(|dev| (spec.run)(&Ctx { dev, root }));
        let v = result_json(name, result, t.elapsed().as_secs_f64());
        println!("{v}");
        let _ = std::io::stdout().flush();
        if v["ok"] == json!(false) {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        }
    }

    /// Runs `exe --only NAME` with its timeout; its JSON line, or a failure
    /// that says how the child ended.
    fn run_child(exe: &Path, spec: &Spec, root: &Path, limit: Duration) -> Value {
        let t = Instant::now();
        let failed = |why: String| json!({ "check": spec.name, "ok": false, "line": why, "seconds": t.elapsed().as_secs_f64() });
        let child =
            Command::new(exe).arg("--only").arg(spec.name).arg("--root").arg(root).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) => return failed(format!("cannot start the check's process: {e}")),
        };
        // The child's output is one line: read it on a thread so that a
        // child that fills the pipe cannot block the wait below.
        let mut out = child.stdout.take();
        let reader = std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(o) = out.as_mut() {
                let _ = std::io::Read::read_to_string(o, &mut text);
            }
            text
        });
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if t.elapsed() < limit => std::thread::sleep(Duration::from_millis(50)),
                Ok(None) | Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
            }
        };
        let text = reader.join().unwrap_or_default();
        let Some(status) = status else {
            return failed(format!("no answer within {:.0} s: the check's process was killed", limit.as_secs_f64()));
        };
        match text.lines().rev().find_map(|l| serde_json::from_str::<Value>(l).ok()) {
            Some(v) => v,
            None => {
                use std::os::unix::process::ExitStatusExt;
                let how = match (status.code(), status.signal()) {
                    (_, Some(sig)) => format!("killed by signal {sig}"),
                    (Some(code), _) => format!("exited with status {code}"),
                    _ => "ended".to_string(),
                };
                failed(format!("the check's process {how} without a result"))
            }
        }
    }

    /// Writes the results so far to `DIR/gpu-check.json` (after every
    /// check: a run cut short still leaves what it found).
    fn write_results(dir: &Path, results: &[Value], totals: &Value) -> Result<(), String> {
        let path = dir.join("gpu-check.json");
        let text = serde_json::to_string_pretty(&json!({ "checks": results, "totals": totals })).map_err(e2s)?;
        std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&path, text)).map_err(|e| format!("cannot write {}: {e}", path.display()))
    }

    /// The runner: every check in its own process (each within its timeout
    /// and what is left of `budget`), one line (or JSON object) each, the
    /// results in `OUT/gpu-check.json` with `--out`.
    fn run_all(root: &Path, out: Option<&Path>, json_lines: bool, budget: Duration) -> ExitCode {
        let exe = match std::env::current_exe() {
            Ok(e) => e,
            Err(e) => {
                eprintln!("cannot find this program: {e}");
                return ExitCode::from(2);
            }
        };
        let start = Instant::now();
        let mut results = Vec::new();
        let (mut passed, mut failed, mut skipped) = (0u32, 0u32, 0u32);
        let totals = |p: u32, f: u32, s: u32| json!({ "passed": p, "failed": f, "skipped": s, "seconds": start.elapsed().as_secs_f64() });
        for spec in CHECKS {
            let left = budget.saturating_sub(start.elapsed());
            let v = if left < Duration::from_secs(1) {
                json!({ "check": spec.name, "ok": false, "line": format!("not run: the run's budget of {budget:?} is spent"), "seconds": 0.0 })
            } else {
                run_child(&exe, spec, root, Duration::from_secs(spec.timeout_s).min(left))
            };
            match v["ok"].as_bool() {
                Some(true) => passed += 1,
                Some(false) => failed += 1,
                None => skipped += 1,
            }
            if json_lines {
                println!("{v}");
            } else {
                let word = match v["ok"].as_bool() {
                    Some(true) => "PASS",
                    Some(false) => "FAIL",
                    None => "SKIP",
                };
                let line = v["line"].as_str().or(v["skipped"].as_str()).unwrap_or_default();
                println!("{word} {} ({:.1} s): {line}", spec.name, v["seconds"].as_f64().unwrap_or_default());
            }
            let _ = std::io::stdout().flush();
            results.push(v);
            if let Some(dir) = out {
                if let Err(e) = write_results(dir, &results, &totals(passed, failed, skipped)) {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
            }
        }
        let total = totals(passed, failed, skipped);
        if json_lines {
            println!("{total}");
        } else {
            println!("{passed} passed, {failed} failed, {skipped} skipped ({:.1} s)", start.elapsed().as_secs_f64());
        }
        if failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }

    pub(crate) fn main() -> ExitCode {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
        let root = value("--root").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
        if args.iter().any(|a| a == "--ipc-members") {
            return match ipc_members() {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("ipc members: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        if let Some(dir) = value("--ipc-exporter") {
            return match ipc_exporter(Path::new(&dir)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("ipc exporter: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        if let Some(bytes) = value("--ipc-bucket") {
            return match ipc_bucket(&bytes) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("ipc bucket: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        if args.iter().any(|a| a == "--list") {
            // The dry run's table: name, timeout and expected seconds.
            for c in CHECKS {
                println!("{}\t{}\t{}", c.name, c.timeout_s, c.expected_s);
            }
            return ExitCode::SUCCESS;
        }
        if let Err(e) = transport::cuda_available() {
            eprintln!("CUDA transport unavailable: {e}");
            return ExitCode::from(2);
        }
        if let Some(name) = value("--only") {
            return run_one(&name, root);
        }
        let budget = match value("--budget").map(|b| b.parse::<u64>()) {
            None => Duration::from_secs(CHECKS.iter().map(|c| c.timeout_s).sum()),
            Some(Ok(s)) => Duration::from_secs(s),
            Some(Err(e)) => {
                eprintln!("--budget: {e}");
                return ExitCode::from(2);
            }
        };
        run_all(&root, value("--out").as_deref().map(Path::new), args.iter().any(|a| a == "--json"), budget)
    }
}
