//! Checks of the device executor: every example layout pair run on the
//! device and compared with the host executor (`layouts`), and a large
//! refit against one `cuMemcpyDtoD` of its bytes (`throughput`).

use super::{e2s, gbps, load, Ctx};
use refit_cli::presets::{layouts, Model};
use reshard::{plan_baseline, plan_reshard, BufferKey, Layout, Plan, PlanOptions};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;
use transport::{
    cuda::{time_plain_copy, DeviceMemory, DeviceRun, GpuDevice},
    fill_sources, run_local, verify_destinations, ExecOptions, RankMemory,
};

const TARGET_RATIO: f64 = 0.7;

/// Runs `plan` on the device (`reps` timed runs after one) and returns
/// the destinations' memory, the best device time and the report.
fn device_refit(
    dev: &GpuDevice,
    src: &Layout,
    dst: &Layout,
    plan: &Plan,
    reps: u32,
) -> Result<(Vec<RankMemory>, Duration, transport::cuda::DeviceReport), String> {
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

pub(super) fn layout_pairs(ctx: &Ctx) -> Result<(String, Value), String> {
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
                let differs =
                    a.buffers.iter().zip(&b.buffers).zip(specs).find(|((x, y), s)| x != y && !matches!(s.key, BufferKey::Scratch { .. }));
                if let Some((_, s)) = differs {
                    failures.push(format!("{name} {strategy}: destination rank {r} buffer '{}' differs from the host executor's", s.name));
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

/// A device refit of `llama3-8b --scale 2` against one `cuMemcpyDtoD`
/// of the same bytes, issued several ways side by side (one CUDA graph
/// or call by call; lanes; narrow rows by the copy kernel or by copy
/// calls), best of three runs each
/// after one; the default way must reach the target. The first two ways
/// are verified on destinations they alone wrote.
pub(super) fn throughput(ctx: &Ctx) -> Result<(String, Value), String> {
    use transport::cuda::DeviceRunOptions;
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
    let copies = DeviceRunOptions { narrow_rows_by_kernel: false, ..d };
    // (name, options, verified): the default first.
    let ways = [
        ("one graph, 8 lanes, narrow rows by kernel (the default)", d, true),
        ("one graph, 8 lanes, copy calls only", copies, true),
        ("one graph, 16 lanes, narrow rows by kernel", DeviceRunOptions { lanes: 16, ..d }, false),
        ("one graph, one lane, narrow rows by kernel", DeviceRunOptions { lanes: 1, ..d }, false),
        ("one graph, one lane, copy calls only", DeviceRunOptions { lanes: 1, ..copies }, false),
        ("call by call, copy calls only", DeviceRunOptions { graph: false, ..copies }, false),
    ];
    let mut timed = Vec::new();
    let mut checked = 0;
    for (name, options, verified) in ways {
        if verified {
            for m in &mut memory[n_src..] {
                m.zero(dev).map_err(e2s)?;
            }
        }
        let mut run = DeviceRun::prepare_with(dev, &programs, &mut memory, options).map_err(e2s)?;
        let first = run.execute().map_err(e2s)?;
        let mut best = first.elapsed;
        for _ in 0..3 {
            best = best.min(run.execute().map_err(e2s)?.elapsed);
        }
        drop(run);
        timed.push((name, best, first));
        if verified {
            // Verified on destinations this way alone wrote (zeroed
            // above); the others are timed only.
            let back = memory[n_src..].iter().map(|m| m.download(dev)).collect::<Result<Vec<_>, _>>().map_err(e2s)?;
            let n = verify_destinations(&src, &dst, &back).map_err(|e| format!("MISMATCH ({name}): {e}"))?;
            checked = checked.max(n);
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
