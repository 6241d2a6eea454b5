//! `refit plan`: validate both layouts, plan reshard and baseline, print the figures.

use super::report::{
    figures_json, invalid, load, pair_summary, preset, preset_label, print_figures, say, seconds, write_layouts, Failure, Progress,
};
use refit::presets::Model;
use reshard::{baseline_summary, plan_baseline, plan_reshard, LinkModel, PlanOptions};
use serde_json::json;
use std::path::{Path, PathBuf};

/// Arguments of `refit plan`.
pub(crate) struct PlanArgs<'a> {
    pub(crate) src: &'a Option<PathBuf>,
    pub(crate) dst: &'a Option<PathBuf>,
    pub(crate) model: Option<Model>,
    pub(crate) scale: u64,
    /// Inference expert parallelism of the preset (`--ep`).
    pub(crate) ep: Option<u32>,
    pub(crate) max_staging_mib: u64,
    pub(crate) topology: &'a str,
    pub(crate) estimate: bool,
    pub(crate) svg: &'a Option<PathBuf>,
    pub(crate) json: bool,
    pub(crate) emit_layouts: &'a Option<PathBuf>,
    /// Block-scale the destination to FP8 in blocks of this size first.
    pub(crate) fp8_dst: Option<u64>,
    /// Where the reshard quantizes FP8 destinations.
    pub(crate) quantize_at: reshard::QuantizeAt,
}

/// A named link model, or one read from a JSON file.
fn topology(name: &str) -> Result<LinkModel, Failure> {
    match name {
        "dgx-h100" => return Ok(LinkModel::DGX_H100),
        "gb200" => return Ok(LinkModel::GB200),
        _ => {}
    }
    let text = std::fs::read_to_string(name)
        .map_err(|e| invalid(format!("--topology {name}: not dgx-h100 or gb200, and cannot read it as a file: {e}")))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| invalid(format!("{name}: invalid JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| invalid(format!("{name}: expected an object")))?;
    let mut links = LinkModel::DGX_H100;
    for (k, val) in obj {
        let x = val
            .as_f64()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .ok_or_else(|| invalid(format!("{name}: {k}: expected a non-negative number")))?;
        match k.as_str() {
            "net_bytes_per_s" if x > 0.0 => links.net_bytes_per_s = x,
            "intra_bytes_per_s" if x > 0.0 => links.intra_bytes_per_s = x,
            "message_latency_s" => links.message_latency_s = x,
            "net_bytes_per_s" | "intra_bytes_per_s" => return Err(invalid(format!("{name}: {k}: must be positive"))),
            other => {
                return Err(invalid(format!(
                    "{name}: unknown field '{other}' (expected net_bytes_per_s, intra_bytes_per_s, message_latency_s)"
                )))
            }
        }
    }
    Ok(links)
}

/// A refit measured by someone else on a preset's model: quoted next to
/// our modelled times as a reference, never as our measurement.
struct Reference {
    /// Who measured it.
    by: &'static str,
    /// The model and setup measured.
    workload: &'static str,
    /// Measured gather-broadcast refit time, seconds, where published.
    baseline_s: Option<f64>,
    /// Measured refit time of their point-to-point (reshard) path, seconds.
    reshard_s: f64,
    /// Where it is published.
    source: &'static str,
}

impl Reference {
    fn ratio(&self) -> Option<f64> {
        self.baseline_s.map(|b| b / self.reshard_s)
    }
}

/// The measured refit times published for a preset's model, as planned
/// (`fp8`: the block size of FP8 destinations, if any).
fn reference(model: Model, fp8: Option<u64>) -> Option<Reference> {
    const NVIDIA: &str = "NVIDIA, NeMo RL weight refit, measured end to end in their setup";
    let nvidia =
        |workload, baseline_s, reshard_s| Reference { by: "NVIDIA", workload, baseline_s: Some(baseline_s), reshard_s, source: NVIDIA };
    match (model, fp8) {
        (Model::DeepseekV3, None) => Some(nvidia("DeepSeek-V3 671B at full size on DGX H100", 14.9, 2.6)),
        (Model::Qwen3_235b, None) => Some(nvidia("Qwen3-235B-A22B at full size on DGX H100", 6.4, 1.9)),
        (Model::KimiK2, Some(128)) => Some(Reference {
            by: "Perplexity",
            workload: "Kimi-K2 1T at full size, 256 training GPUs (BF16) to 128 inference GPUs (FP8), RDMA WRITE point to point",
            baseline_s: None,
            reshard_s: 1.3,
            source: "Perplexity, \"Weight Transfer for RL Post-Training in under 2 seconds\" (their engineering blog)",
        }),
        _ => None,
    }
}

/// What the two modelled times are, for the legend and `--json`.
const RESHARD_MODEL: &str = "per round the busiest link, summed over rounds";
const BASELINE_MODEL: &str = "pipelined chunked broadcast";

pub(crate) fn run(args: &PlanArgs<'_>) -> Result<(), Failure> {
    let progress = Progress::spinner(args.json);
    let (src, dst, what, model) = match (args.src, args.dst, args.model) {
        (Some(s), Some(d), _) => {
            progress.phase("reading layouts");
            (load(s)?, load(d)?, format!("{} -> {}", s.display(), d.display()), None)
        }
        (_, _, Some(m)) => {
            progress.phase(format!("building the {m} layouts"));
            let (s, d) = preset(m, args.scale, args.ep)?;
            (s, d, preset_label(m, args.scale, args.ep), Some(m))
        }
        _ => return Err(invalid("give --src and --dst, or --model".into())),
    };
    let dst = match args.fp8_dst {
        None => dst,
        Some(0) => return Err(invalid("--fp8-dst takes a block size of at least 1".into())),
        Some(block) => refit::bench::fp8_destination(&dst, block).map_err(|e| invalid(format!("the FP8 destination layout: {e}")))?,
    };
    let what = match args.fp8_dst {
        None => what,
        Some(block) => format!("{what}, FP8 in blocks of {block}"),
    };
    let reference = model.and_then(|m| reference(m, args.fp8_dst));
    if let Some(dir) = args.emit_layouts {
        progress.phase("writing layouts");
        write_layouts(&src, &dst, dir)?;
        if !args.json {
            progress.suspend(|| say!("wrote {}/src.json and dst.json", dir.display()));
        }
    }
    let links = topology(args.topology)?;
    let bytes = args
        .max_staging_mib
        .checked_mul(1 << 20)
        .filter(|&b| b > 0)
        .ok_or_else(|| invalid("--max-staging-mib must be between 1 and 2^44".into()))?;
    let opts = PlanOptions { max_staging_bytes: bytes, links, quantize_at: args.quantize_at, ..PlanOptions::default() };
    let ctx = |e: reshard::PlanError| invalid(format!("{what}: {e}"));
    let write_svg = |p: &Path, plan: &reshard::Plan| {
        progress.phase(format!("drawing {}", p.display()));
        std::fs::write(p, refit::svg::traffic_svg(plan, &what)).map_err(|e| invalid(format!("{}: cannot write: {e}", p.display())))
    };
    progress.phase("planning reshard");
    let reshard = plan_reshard(&src, &dst, &opts).map_err(ctx)?;
    let r_est = args.estimate.then(|| {
        progress.phase("estimating the reshard's time");
        reshard.estimate(&links)
    });
    if let Some(path) = args.svg {
        write_svg(path, &reshard)?;
    }
    // Block-scaled tensors by where the reshard quantizes them.
    let count = |route| (0..dst.tensors().len() as u32).filter(|&t| reshard.route(t) == route).count();
    let quantized = (count(reshard::Route::QuantizedAtSource), count(reshard::Route::QuantizedAtDestination));
    // Only the figures stay: the plan is dropped before the baseline's turn.
    let (r_figures, fingerprint) = (reshard.figures().clone(), reshard.fingerprint());
    drop(reshard);
    // The baseline may be impossible where the reshard is not (it gathers
    // whole tensors); that is reported, not fatal. Its figures and estimate
    // come without building its plan (millions of transfers on a large
    // model); the plan is built only to draw it.
    progress.phase("planning baseline (figures only)");
    let baseline = baseline_summary(&src, &dst, &opts, &links);
    if let (Some(path), Ok(_)) = (args.svg, &baseline) {
        progress.phase("planning baseline (to draw it)");
        write_svg(&path.with_extension("baseline.svg"), &plan_baseline(&src, &dst, &opts).map_err(ctx)?)?;
    }
    drop(progress);
    // The baseline priced as NCCL runs it; its store-and-forward price (the
    // plan as written, round by round) stays in the JSON for comparison.
    let b_est = baseline.as_ref().ok().map(|b| b.pipelined);
    let b_store = baseline.as_ref().ok().map(|b| b.estimate);
    let ratio = |r: &reshard::Estimate| b_est.filter(|_| r.seconds > 0.0).map(|b| b.seconds / r.seconds);
    if args.json {
        let (b, err) = match &baseline {
            Ok(b) => (figures_json(&b.figures), serde_json::Value::Null),
            Err(e) => (serde_json::Value::Null, json!(e.to_string())),
        };
        let mut out = json!({"reshard": figures_json(&r_figures), "baseline": b, "baseline_error": err});
        if quantized != (0, 0) {
            out["reshard"]["quantized_at_source"] = json!(quantized.0);
            out["reshard"]["quantized_at_destination"] = json!(quantized.1);
        }
        if let Some(r_est) = r_est {
            let mut estimate = json!({
                "topology": args.topology,
                "modelled": true,
                "reshard_s": r_est.seconds,
                "reshard_model": RESHARD_MODEL,
                "baseline_s": b_est.map(|e| e.seconds),
                "baseline_model": BASELINE_MODEL,
                "baseline_store_and_forward_s": b_store.map(|e| e.seconds),
                "lower_bound_s": r_est.lower_bound_seconds,
                "ratio": ratio(&r_est),
            });
            if let Some(r) = &reference {
                estimate["reference_ratio"] = json!({
                    "ratio": r.ratio(),
                    "baseline_s": r.baseline_s,
                    "reshard_s": r.reshard_s,
                    "measured": true,
                    "by": r.by,
                    "workload": r.workload,
                    "source": r.source,
                });
            }
            out["estimate"] = estimate;
        }
        say!("{out}");
        return Ok(());
    }
    say!("{what}: {}, fingerprint {fingerprint}", pair_summary(&src, &dst));
    if quantized != (0, 0) {
        say!(
            "FP8: the reshard quantizes {} tensors at the source (codes and scales on the wire), {} at the destination \
             (whole blocks of source values on the wire); the baseline all at the destination",
            quantized.0,
            quantized.1
        );
    }
    say!("");
    let estimate_row = r_est.map(|r| {
        let baseline = b_est.map_or_else(|| "-".into(), |b| seconds(b.seconds));
        (format!("estimate (modelled, {})", args.topology), [seconds(r.seconds), baseline])
    });
    print_figures(&r_figures, baseline.as_ref().map(|b| &b.figures).map_err(|e| e.to_string()), estimate_row.into_iter().collect());
    if let Some(r_est) = r_est {
        say!(
            "estimate: modelled on the {} link model, not measured. reshard: {RESHARD_MODEL}; baseline: gathers, then per \
             tensor a {BASELINE_MODEL} (an NCCL ring from its root; roots overlap); both at line rate with perfect overlap \
             (docs/benchmarks.md, \"What the estimate models\")",
            args.topology
        );
        let vs_baseline = ratio(&r_est).map_or_else(String::new, |x| format!("; modelled baseline / reshard: {x:.2}x"));
        say!(
            "lower bound for any plan {} (reshard efficiency {:.2}){vs_baseline}",
            seconds(r_est.lower_bound_seconds),
            r_est.lower_bound_seconds / r_est.seconds.max(1e-12)
        );
        if let Some(r) = &reference {
            let times = match (r.baseline_s, r.ratio()) {
                (Some(b), Some(x)) => format!("gather-broadcast {b} s, reshard {} s, {x:.1}x", r.reshard_s),
                _ => format!("refit {} s", r.reshard_s),
            };
            say!("reference, measured by {}, not by refit nor on these layouts: {}: {times} (source: {})", r.by, r.workload, r.source);
        }
    }
    Ok(())
}
