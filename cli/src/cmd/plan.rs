//! `refit plan`: validate both layouts, plan reshard and baseline, print the figures.

use super::report::{
    figures_json, invalid, load, pair_summary, parse_setup, preset_label_with, preset_with, print_figures, say, seconds, work_limit,
    write_layouts, Failure, Progress,
};
use refit_cli::presets::{Model, PresetOptions, Setup};
use reshard::{
    baseline_summary, plan_baseline, plan_reshard, BaselineSummary, Estimate, Figures, Fingerprint, Layout, LinkModel, PlanError,
    PlanOptions,
};
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
    /// An anchor's setup of the preset (`--setup`), as typed.
    pub(crate) setup: Option<&'a str>,
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
    /// `--max-plan-work`, if given.
    pub(crate) max_plan_work: Option<u64>,
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
    /// Measured refit time of their point-to-point (reshard) path, seconds
    /// (the low end where they published a range).
    reshard_s: f64,
    /// The high end of the range, where they published one.
    reshard_max_s: Option<f64>,
    /// Where it is published.
    source: &'static str,
    /// What the layouts assume where their setup is not published (a
    /// setup's reference only: the others are not on these layouts).
    assumed: Option<&'static str>,
}

impl Reference {
    fn ratio(&self) -> Option<f64> {
        self.baseline_s.map(|b| b / self.reshard_s)
    }

    /// Their refit time as published: `7.53 s` or `2.39-2.83 s`.
    fn reshard(&self) -> String {
        match self.reshard_max_s {
            Some(hi) => format!("{}-{hi} s", self.reshard_s),
            None => format!("{} s", self.reshard_s),
        }
    }
}

/// A published measurement and the plan it belongs beside: the model, the
/// setup (`None`: the preset's default layouts, which are not the layouts
/// measured) and the FP8 block size of the destination, if any.
struct Anchor {
    model: Model,
    setup: Option<Setup>,
    fp8: Option<u64>,
    reference: Reference,
}

const NVIDIA: &str = "NVIDIA, NeMo RL weight refit, measured end to end in their setup";
const VLLM_RDT: &str = "vLLM blog, \"Sharded Weight Transfer with Ray Direct Transport (RDT) in vLLM\" \
                        (vllm-project/vllm-project.github.io pull request 312)";

/// Every anchor: the refit times others measured, with what they measured
/// them on. `refit plan --estimate` quotes the one matching its model,
/// `--setup` and `--fp8-dst`.
const ANCHORS: &[Anchor] = &[
    Anchor {
        model: Model::DeepseekV3,
        setup: None,
        fp8: None,
        reference: Reference {
            by: "NVIDIA",
            workload: "DeepSeek-V3 671B at full size on DGX H100",
            baseline_s: Some(14.9),
            reshard_s: 2.6,
            reshard_max_s: None,
            source: NVIDIA,
            assumed: None,
        },
    },
    Anchor {
        model: Model::Qwen3_235b,
        setup: None,
        fp8: None,
        reference: Reference {
            by: "NVIDIA",
            workload: "Qwen3-235B-A22B at full size on DGX H100",
            baseline_s: Some(6.4),
            reshard_s: 1.9,
            reshard_max_s: None,
            source: NVIDIA,
            assumed: None,
        },
    },
    Anchor {
        model: Model::KimiK2,
        setup: None,
        fp8: Some(128),
        reference: Reference {
            by: "Perplexity",
            workload: "Kimi-K2 1T at full size, 256 training GPUs (BF16) to 128 inference GPUs (FP8), RDMA WRITE point to point",
            baseline_s: None,
            reshard_s: 1.3,
            reshard_max_s: None,
            source: "Perplexity, \"Weight Transfer for RL Post-Training in under 2 seconds\" (their engineering blog)",
            assumed: None,
        },
    },
    Anchor {
        model: Model::DeepseekV3,
        setup: Some(Setup::NemoRl),
        fp8: None,
        reference: Reference {
            by: "NVIDIA",
            workload: "DeepSeek-V3 BF16, Megatron PP16 x EP16 (256 H100) to vLLM TP32 x DP8 (256 H100), non-colocated, \
                       NeMo RL's nccl_reshard refit (FFN weights shard to shard, 97.6% of the bytes; the rest by packed broadcast)",
            baseline_s: None,
            reshard_s: 2.39,
            reshard_max_s: Some(2.83),
            source: "NeMo RL, docs/design-docs/nccl-reshard-refit.md, \"Expected Performance\" (github.com/NVIDIA-NeMo/RL); \
                     layouts from examples/configs/recipes/llm/performance/grpo-deepseek-v3-32n8g.yaml",
            assumed: Some(
                "TP1 and DP16 within a training stage (NeMo RL's defaults; the recipe sets PP16, EP16, 3 layers in the \
                           first stage and 2 in the last), Megatron's rank order (stage-major)",
            ),
        },
    },
    Anchor {
        model: Model::KimiK2,
        setup: Some(Setup::VllmRdt),
        fp8: None,
        reference: Reference {
            by: "vLLM",
            workload: "Kimi-K2 BF16, Megatron TP8 x PP8 x EP32 (32 x 8 H100) to vLLM TP32 x EP32 (16 x 8 H100: 4 instances), \
                       sharded weight transfer over Ray Direct Transport / NIXL, 7.9 TB moved per sync, pipeline stages sent \
                       one after another",
            baseline_s: None,
            reshard_s: 7.53,
            reshard_max_s: None,
            source: VLLM_RDT,
            assumed: Some(
                "the layer split over PP8 (miles' 7 stages of 8 layers, then 5) and Megatron's rank order (TP \
                           innermost, the 4 dense replicas next, stage-major)",
            ),
        },
    },
    Anchor {
        model: Model::Qwen3_235b,
        setup: Some(Setup::VllmRdt),
        fp8: None,
        reference: Reference {
            by: "vLLM",
            workload: "Qwen3-235B-A22B BF16 in SkyRL, Megatron TP4 x PP2 x EP8 (2 x 8 H100) to vLLM DP16 x EP16 (2 x 8 H100), \
                       gather-broadcast = SkyRL's NCCL broadcast, reshard = their pipelined sharded RDT transfer, both end \
                       to end including the trainer's gathers",
            baseline_s: Some(64.72),
            reshard_s: 3.49,
            reshard_max_s: None,
            source: VLLM_RDT,
            assumed: Some("47 layers a stage and Megatron's rank order (TP innermost, then DP, stage-major)"),
        },
    },
];

/// The anchor of a preset's model and setup, as planned (`fp8`: the block
/// size of FP8 destinations, if any).
fn anchor(model: Model, setup: Option<Setup>, fp8: Option<u64>) -> Option<&'static Anchor> {
    ANCHORS.iter().find(|a| a.model == model && a.setup == setup && a.fp8 == fp8)
}

/// What the two modelled times are, for the legend and `--json`.
const RESHARD_MODEL: &str = "per round the busiest link, summed over rounds";
const BASELINE_MODEL: &str = "pipelined chunked broadcast";

/// The layouts to plan, how the output names them, and the preset's model
/// and setup they came from (if any).
struct Workload {
    src: Layout,
    dst: Layout,
    what: String,
    preset: Option<(Model, Option<Setup>)>,
}

/// What the planning leaves for the output: the reshard plan's figures
/// (the plan itself is dropped before the baseline's turn), the baseline's
/// summary or why it is impossible.
struct Planned {
    figures: Figures,
    fingerprint: Fingerprint,
    /// The reshard's modelled time (`--estimate`).
    estimate: Option<Estimate>,
    /// Block-scaled tensors the reshard quantizes at the source, and at the destination.
    quantized: (usize, usize),
    baseline: Result<BaselineSummary, PlanError>,
}

pub(crate) fn run(args: &PlanArgs<'_>) -> Result<(), Failure> {
    let progress = Progress::spinner(args.json);
    let w = workload(args, &progress)?;
    let anchor = w.preset.and_then(|(m, setup)| anchor(m, setup, args.fp8_dst));
    if let Some(dir) = args.emit_layouts {
        progress.phase("writing layouts");
        write_layouts(&w.src, &w.dst, dir)?;
        if !args.json {
            progress.suspend(|| say!("wrote {}/src.json and dst.json", dir.display()));
        }
    }
    let links = topology(args.topology)?;
    let opts = plan_options(args, links)?;
    let planned = plan(args, &w, &opts, &links, &progress)?;
    drop(progress);
    if args.json {
        say!("{}", plan_json(args, &planned, anchor));
        return Ok(());
    }
    print_plan(args, &w, &planned, anchor);
    Ok(())
}

/// The layouts of `--src` and `--dst` or of the preset, their destination
/// made FP8 with `--fp8-dst`.
fn workload(args: &PlanArgs<'_>, progress: &Progress) -> Result<Workload, Failure> {
    let (src, dst, what, preset) = match (args.src, args.dst, args.model) {
        (Some(s), Some(d), _) => {
            progress.phase("reading layouts");
            (load(s)?, load(d)?, format!("{} -> {}", s.display(), d.display()), None)
        }
        (_, _, Some(m)) => {
            let options = PresetOptions { ep: args.ep, setup: args.setup.map(|name| parse_setup(Some(m), name)).transpose()? };
            progress.phase(format!("building the {m} layouts"));
            let (s, d) = preset_with(m, args.scale, options)?;
            (s, d, preset_label_with(m, args.scale, options), Some((m, options.setup)))
        }
        _ => return Err(invalid("give --src and --dst, or --model".into())),
    };
    let dst = match args.fp8_dst {
        None => dst,
        Some(0) => return Err(invalid("--fp8-dst takes a block size of at least 1".into())),
        Some(block) => refit_cli::bench::fp8_destination(&dst, block).map_err(|e| invalid(format!("the FP8 destination layout: {e}")))?,
    };
    let what = match args.fp8_dst {
        None => what,
        Some(block) => format!("{what}, FP8 in blocks of {block}"),
    };
    Ok(Workload { src, dst, what, preset })
}

/// The planner's options: `--max-staging-mib`, the link model,
/// `--quantize-at` and the work limit.
fn plan_options(args: &PlanArgs<'_>, links: LinkModel) -> Result<PlanOptions, Failure> {
    let bytes = args
        .max_staging_mib
        .checked_mul(1 << 20)
        .filter(|&b| b > 0)
        .ok_or_else(|| invalid("--max-staging-mib must be between 1 and 2^44".into()))?;
    let files = args.src.as_deref().zip(args.dst.as_deref());
    let max_work = work_limit(args.max_plan_work, files)?;
    Ok(PlanOptions { max_staging_bytes: bytes, links, quantize_at: args.quantize_at, max_work, ..PlanOptions::default() })
}

/// Plans the reshard, then the baseline (figures only), drawing each with `--svg`.
fn plan(args: &PlanArgs<'_>, w: &Workload, opts: &PlanOptions, links: &LinkModel, progress: &Progress) -> Result<Planned, Failure> {
    let Workload { src, dst, what, .. } = w;
    let ctx = |e: PlanError| invalid(format!("{what}: {e}"));
    let write_svg = |p: &Path, plan: &reshard::Plan| {
        progress.phase(format!("drawing {}", p.display()));
        std::fs::write(p, refit_cli::svg::traffic_svg(plan, what)).map_err(|e| invalid(format!("{}: cannot write: {e}", p.display())))
    };
    progress.phase("planning reshard");
    let reshard = plan_reshard(src, dst, opts).map_err(ctx)?;
    let estimate = args.estimate.then(|| {
        progress.phase("estimating the reshard's time");
        reshard.estimate(links)
    });
    if let Some(path) = args.svg {
        write_svg(path, &reshard)?;
    }
    // Block-scaled tensors by where the reshard quantizes them.
    let count = |route| (0..dst.tensors().len() as u32).filter(|&t| reshard.route(t) == route).count();
    let quantized = (count(reshard::Route::QuantizedAtSource), count(reshard::Route::QuantizedAtDestination));
    // Only the figures stay: the plan is dropped before the baseline's turn.
    let (figures, fingerprint) = (reshard.figures().clone(), reshard.fingerprint());
    drop(reshard);
    // The baseline may be impossible where the reshard is not (it gathers
    // whole tensors); that is reported, not fatal. Its figures and estimate
    // come without building its plan (millions of transfers on a large
    // model); the plan is built only to draw it.
    progress.phase("planning baseline (figures only)");
    let baseline = baseline_summary(src, dst, opts, links);
    if let (Some(path), Ok(_)) = (args.svg, &baseline) {
        progress.phase("planning baseline (to draw it)");
        write_svg(&path.with_extension("baseline.svg"), &plan_baseline(src, dst, opts).map_err(ctx)?)?;
    }
    Ok(Planned { figures, fingerprint, estimate, quantized, baseline })
}

/// The baseline priced as NCCL runs it; its store-and-forward price (the
/// plan as written, round by round) stays in the JSON for comparison.
fn baseline_estimate(p: &Planned) -> Option<Estimate> {
    p.baseline.as_ref().ok().map(|b| b.pipelined)
}

/// Modelled baseline time over the reshard's, if both are known.
fn modelled_ratio(p: &Planned, r: &Estimate) -> Option<f64> {
    baseline_estimate(p).filter(|_| r.seconds > 0.0).map(|b| b.seconds / r.seconds)
}

/// `refit plan --json`'s output.
fn plan_json(args: &PlanArgs<'_>, p: &Planned, anchor: Option<&Anchor>) -> serde_json::Value {
    let (b, err) = match &p.baseline {
        Ok(b) => (figures_json(&b.figures), serde_json::Value::Null),
        Err(e) => (serde_json::Value::Null, json!(e.to_string())),
    };
    let mut out = json!({"reshard": figures_json(&p.figures), "baseline": b, "baseline_error": err});
    if p.quantized != (0, 0) {
        out["reshard"]["quantized_at_source"] = json!(p.quantized.0);
        out["reshard"]["quantized_at_destination"] = json!(p.quantized.1);
    }
    if let Some(r_est) = p.estimate {
        let mut estimate = json!({
            "topology": args.topology,
            "modelled": true,
            "reshard_s": r_est.seconds,
            "reshard_model": RESHARD_MODEL,
            "baseline_s": baseline_estimate(p).map(|e| e.seconds),
            "baseline_model": BASELINE_MODEL,
            "baseline_store_and_forward_s": p.baseline.as_ref().ok().map(|b| b.estimate.seconds),
            "lower_bound_s": r_est.lower_bound_seconds,
            "ratio": modelled_ratio(p, &r_est),
        });
        if let Some(Anchor { reference: r, setup, .. }) = anchor {
            estimate["reference_ratio"] = json!({
                "ratio": r.ratio(),
                "baseline_s": r.baseline_s,
                "reshard_s": r.reshard_s,
                "reshard_max_s": r.reshard_max_s,
                "measured": true,
                "by": r.by,
                "workload": r.workload,
                "source": r.source,
                "setup": setup.map(Setup::name),
                "on_these_layouts": setup.is_some(),
                "assumed": r.assumed,
            });
        }
        out["estimate"] = estimate;
    }
    out
}

/// `refit plan`'s text output: the pair, the figures table, then the estimate.
fn print_plan(args: &PlanArgs<'_>, w: &Workload, p: &Planned, anchor: Option<&Anchor>) {
    say!("{}: {}, fingerprint {}", w.what, pair_summary(&w.src, &w.dst), p.fingerprint);
    if p.quantized != (0, 0) {
        say!(
            "FP8: the reshard quantizes {} tensors at the source (codes and scales on the wire), {} at the destination \
             (whole blocks of source values on the wire); the baseline all at the destination",
            p.quantized.0,
            p.quantized.1
        );
    }
    say!("");
    let b_est = baseline_estimate(p);
    let estimate_row = p.estimate.map(|r| {
        let baseline = b_est.map_or_else(|| "-".into(), |b| seconds(b.seconds));
        (format!("estimate (modelled, {})", args.topology), [seconds(r.seconds), baseline])
    });
    print_figures(&p.figures, p.baseline.as_ref().map(|b| &b.figures).map_err(|e| e.to_string()), estimate_row.into_iter().collect());
    if let Some(r_est) = p.estimate {
        print_estimate(args, p, &r_est, anchor);
    }
}

/// The estimate's lines of `refit plan --estimate`: what is modelled, the
/// lower bound, and the anchor's measurement beside the model.
fn print_estimate(args: &PlanArgs<'_>, p: &Planned, r_est: &Estimate, anchor: Option<&Anchor>) {
    say!(
        "estimate: modelled on the {} link model, not measured. reshard: {RESHARD_MODEL}; baseline: gathers, then per \
         tensor a {BASELINE_MODEL} (an NCCL ring from its root; roots overlap); both at line rate with perfect overlap \
         (docs/benchmarks.md, \"What the estimate models\")",
        args.topology
    );
    let vs_baseline = modelled_ratio(p, r_est).map_or_else(String::new, |x| format!("; modelled baseline / reshard: {x:.2}x"));
    say!(
        "lower bound for any plan {} (reshard efficiency {:.2}){vs_baseline}",
        seconds(r_est.lower_bound_seconds),
        r_est.lower_bound_seconds / r_est.seconds.max(1e-12)
    );
    let Some(Anchor { reference: r, setup, .. }) = anchor else { return };
    let times = match (r.baseline_s, r.ratio()) {
        (Some(b), Some(x)) => format!("gather-broadcast {b} s, reshard {}, {x:.1}x", r.reshard()),
        _ => format!("refit {}", r.reshard()),
    };
    let on = match setup {
        None => "not by refit nor on these layouts".to_string(),
        Some(s) => format!("on the {s} setup these layouts model, not by refit"),
    };
    say!("reference, measured by {}, {on}: {}: {times} (source: {})", r.by, r.workload, r.source);
    if let Some(assumed) = r.assumed {
        say!("  not published by them, assumed in these layouts: {assumed}");
    }
    let baseline = baseline_estimate(p).map_or_else(|| "-".into(), |b| seconds(b.seconds));
    say!(
        "side by side: measured by {} {} | modelled by refit ({}): reshard {}, baseline {baseline}, lower bound {}",
        r.by,
        r.reshard(),
        args.topology,
        seconds(r_est.seconds),
        seconds(r_est.lower_bound_seconds)
    );
}
