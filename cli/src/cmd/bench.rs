//! `refit bench`: reshard and the gather-broadcast baseline side by side on one data plane.

use super::report::{
    bytes_json, duration, human, invalid, load, pair_summary, preset, preset_label, rate, say, seconds, typed, Failure, Progress, Table,
    TempLayouts, BYTES_LEGEND,
};
use crate::BenchArgs;
use refit_cli::bench::{exec_bench, link_loads, node_link_bound, BenchTransport, ClusterBench, LinkBound, LinkLoads};
use refit_cli::cluster::Cluster;
use reshard::{plan_baseline, plan_reshard, Figures, Layout, LinkModel, Plan, PlanOptions};
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;

fn loads_json(l: &LinkLoads) -> serde_json::Value {
    json!({
        "inter_node_bytes": l.inter_node_bytes,
        "intra_node_bytes": l.intra_node_bytes,
        "max_nic_out_bytes": l.max_nic_out,
        "max_nic_in_bytes": l.max_nic_in,
        "max_intra_out_bytes": l.max_intra_out,
        "node_pairs": l.node_pairs.iter().map(|(a, z, b)| json!({"from": a, "to": z, "bytes": b})).collect::<Vec<_>>(),
        "nodes": l.nodes.iter().map(|n| json!({"name": n.name(), "ranks": n.ranks, "out_bytes": n.out_bytes, "in_bytes": n.in_bytes}))
            .collect::<Vec<_>>(),
    })
}

/// Per node of `l`, `f` of it, keyed by the node's name.
fn per_node(l: &LinkLoads, f: impl Fn(&refit_cli::bench::NodeLoad) -> serde_json::Value) -> serde_json::Value {
    serde_json::Value::Object(l.nodes.iter().map(|n| (n.name(), f(n))).collect())
}

/// One strategy's JSON: its bytes (`bytes` kept beside `bytes_moved`) and
/// median time, then `more`.
fn strategy_json(f: &Figures, median: Duration, more: serde_json::Value) -> serde_json::Value {
    let mut m = bytes_json(f);
    m.insert("bytes".into(), f.total_bytes.into());
    m.insert("median_s".into(), median.as_secs_f64().into());
    if let serde_json::Value::Object(more) = more {
        m.extend(more);
    }
    serde_json::Value::Object(m)
}

/// The timing table: a row per strategy (bytes moved and its split, median
/// time, rate), then `reference` (a label, its bytes and time) if any, then
/// the legend.
fn print_times(strategies: [(&str, &Figures, Duration); 2], reference: Option<(String, u64, Duration)>) {
    let mut table = Table::new(&["", "bytes moved", "from sources", "relayed", "median time", "rate"]);
    for (name, f, t) in strategies {
        table.row(name, [human(f.total_bytes), human(f.src_egress_bytes), human(f.relayed_bytes()), duration(t), rate(f.total_bytes, t)]);
    }
    if let Some((name, bytes, t)) = reference {
        table.row(&name, [human(bytes), "-".into(), "-".into(), duration(t), rate(bytes, t)]);
    }
    table.print();
    say!("{BYTES_LEGEND}");
}

/// The link table: bytes each strategy puts on the network and inside nodes.
fn print_loads(reshard: &LinkLoads, baseline: &LinkLoads) {
    let mut table = Table::new(&["links", "network", "busiest NIC out", "busiest NIC in", "intra-node", "busiest rank out (intra)"]);
    for (name, l) in [("reshard", reshard), ("baseline", baseline)] {
        table.row(name, [l.inter_node_bytes, l.max_nic_out, l.max_nic_in, l.intra_node_bytes, l.max_intra_out].map(human));
    }
    table.print();
}

/// `refit bench --digest-cost`'s output.
fn print_digest_cost(b: &refit_cli::bench::DigestBench, what: &str, pair: &str, transport: String, json: bool) -> Result<(), Failure> {
    let secs = |v: &[Duration]| v.iter().map(|t| t.as_secs_f64()).collect::<Vec<_>>();
    let median = |v: &[Duration]| {
        let mut v = v.to_vec();
        v.sort();
        v[v.len() / 2]
    };
    let range = |v: &[Duration]| {
        let (lo, hi) = (v.iter().min().copied().unwrap_or_default(), v.iter().max().copied().unwrap_or_default());
        format!("{} - {} (median {})", duration(lo), duration(hi), duration(median(v)))
    };
    let ratio = median(&b.checked).as_secs_f64() / median(&b.unchecked).as_secs_f64().max(1e-9);
    if json {
        say!(
            "{}",
            json!({"workload": what, "transport": transport, "reps": b.checked.len(), "bytes": b.bytes,
                   "checked_s": secs(&b.checked), "unchecked_s": secs(&b.unchecked), "verify_s": secs(&b.verify),
                   "checked_over_unchecked": ratio, "verified_ranks": b.verified_ranks.0, "dst_ranks": b.verified_ranks.1})
        );
    } else {
        say!("workload: {what}; {pair}; transport {transport}; {} reps each, alternating", b.checked.len());
        say!("without the digest check   {}   {}", human(b.bytes), range(&b.unchecked));
        say!("with it                    {}   {}", human(b.bytes), range(&b.checked));
        say!("  of which the check       {}", range(&b.verify));
        say!(
            "median with / median without = {ratio:.2}; {} of {} destination ranks verified whole",
            b.verified_ranks.0,
            b.verified_ranks.1
        );
    }
    Ok(())
}

/// The two layouts a bench refits between, and how the output names them.
struct Workload {
    s: Layout,
    d: Layout,
    what: String,
}

/// Both strategies' plans reduced to what the comparison prints: their
/// figures, their link loads, and those loads as JSON.
struct Compared {
    rf: Figures,
    bf: Figures,
    rl: LinkLoads,
    bl: LinkLoads,
    links: serde_json::Value,
}

/// A failure of the bench itself (exit code 1).
fn fail(line: String) -> Failure {
    Failure { line, code: 1 }
}

pub(crate) fn run(a: &BenchArgs) -> Result<(), Failure> {
    if a.cluster.netns && a.transport != BenchTransport::Process {
        return Err(invalid("--netns runs worker processes on emulated hosts: it needs --transport process".into()));
    }
    let progress = Progress::spinner(a.json);
    let w = workload(a, &progress)?;
    let opts = PlanOptions { max_staging_bytes: a.max_staging_mib.max(1) << 20, ..PlanOptions::default() };
    if a.fp8_dst {
        return fp8_vs_dense(a, &w, &opts, progress);
    }
    if a.digest_cost {
        let b = refit_cli::bench::digest_bench(&w.s, &w.d, &opts, a.reps, a.transport, |p| progress.phase(p.to_string()))
            .map_err(|e| fail(e.to_string()))?;
        drop(progress);
        return print_digest_cost(&b, &w.what, &pair_summary(&w.s, &w.d), typed(&a.transport), a.json);
    }
    progress.phase("planning reshard");
    let rplan = plan_reshard(&w.s, &w.d, &opts).map_err(|e| fail(e.to_string()))?;
    if let Some(fraction) = a.delta_fraction {
        return delta_vs_dense(a, &w, &opts, fraction, progress);
    }
    progress.phase("planning baseline");
    let bplan = plan_baseline(&w.s, &w.d, &opts).map_err(|e| fail(e.to_string()))?;
    let (rl, bl) = (link_loads(&rplan), link_loads(&bplan));
    let links = json!({"reshard": loads_json(&rl), "baseline": loads_json(&bl)});
    let c = Compared { rf: rplan.figures().clone(), bf: bplan.figures().clone(), rl, bl, links };
    if let Some(path) = &a.svg {
        for (plan, p) in [(&rplan, path.clone()), (&bplan, path.with_extension("baseline.svg"))] {
            progress.phase(format!("drawing {}", p.display()));
            std::fs::write(&p, refit_cli::svg::traffic_svg(plan, &w.what))
                .map_err(|e| invalid(format!("{}: cannot write: {e}", p.display())))?;
        }
    }
    if a.transport == BenchTransport::Process {
        return cluster_compare(a, &w, opts, &rplan, &c, progress);
    }
    exec_compare(a, &w, &opts, &c, progress)
}

/// The layouts of `--src` and `--dst`, or of the `--model` preset.
fn workload(a: &BenchArgs, progress: &Progress) -> Result<Workload, Failure> {
    match (&a.layouts.src, &a.layouts.dst, a.layouts.model) {
        (Some(s), Some(d), _) => {
            progress.phase("reading layouts");
            Ok(Workload { s: load(s)?, d: load(d)?, what: format!("{} -> {}", s.display(), d.display()) })
        }
        (_, _, Some(m)) => {
            progress.phase(format!("building the {m} layouts"));
            let (s, d) = preset(m, a.scale, a.ep)?;
            Ok(Workload { s, d, what: preset_label(m, a.scale, a.ep) })
        }
        _ => Err(invalid("give --src and --dst, or --model".into())),
    }
}

/// `--fp8-dst`: a dense refit against one to block-scaled FP8 destinations, in process.
fn fp8_vs_dense(a: &BenchArgs, w: &Workload, opts: &PlanOptions, progress: Progress) -> Result<(), Failure> {
    if a.transport != BenchTransport::Local || a.delta_fraction.is_some() || a.fp8_block == 0 {
        return Err(invalid(
            "--fp8-dst runs in process (--transport local), without --delta-fraction, with --fp8-block of at least 1".into(),
        ));
    }
    let Workload { s, d, what } = w;
    let fp8 = refit_cli::bench::fp8_destination(d, a.fp8_block).map_err(|e| fail(format!("the FP8 destination layout: {e}")))?;
    let b = refit_cli::bench::fp8_bench(s, d, &fp8, opts, a.reps, |p| progress.phase(p.to_string())).map_err(|e| fail(e.to_string()))?;
    drop(progress);
    let share = b.fp8_bytes as f64 / b.dense_bytes.max(1) as f64;
    let scaled = fp8.tensors().iter().filter(|t| t.scale.is_some()).count();
    if a.json {
        say!(
            "{}",
            json!({"workload": what, "fp8_block": a.fp8_block, "fp8_tensors": scaled, "reps": b.reps, "dense_bytes": b.dense_bytes,
                   "fp8_bytes": b.fp8_bytes, "fp8_share": share, "fp8_held_bytes": b.fp8_held_bytes, "dense_s": b.dense.as_secs_f64(),
                   "fp8_s": b.fp8.as_secs_f64(), "verified_elements": b.verified})
        );
    } else {
        say!(
            "workload: {what}; {}; {scaled} tensors block-scaled FP8 in blocks of {}; medians of {} reps",
            pair_summary(s, d),
            a.fp8_block,
            b.reps
        );
        say!("as given     {:>12}   {}", human(b.dense_bytes), duration(b.dense));
        say!(
            "FP8          {:>12}   {}   ({:.1}% of the bytes as given: whole blocks, unquantized; quantized on the destination ranks)",
            human(b.fp8_bytes),
            duration(b.fp8),
            share * 100.0
        );
        say!("FP8 destinations hold {} (codes and scales); verify: all {} destination elements match", human(b.fp8_held_bytes), b.verified);
    }
    Ok(())
}

/// `--delta-fraction`: a dense refit against a delta refit of the changed elements, in process.
fn delta_vs_dense(a: &BenchArgs, w: &Workload, opts: &PlanOptions, fraction: f64, progress: Progress) -> Result<(), Failure> {
    if a.transport != BenchTransport::Local || !(0.0..=1.0).contains(&fraction) {
        return Err(invalid("--delta-fraction takes a fraction from 0 to 1 and runs in process (--transport local)".into()));
    }
    let Workload { s, d, what } = w;
    let b =
        refit_cli::bench::delta_bench(s, d, opts, fraction, a.reps, |p| progress.phase(p.to_string())).map_err(|e| fail(e.to_string()))?;
    drop(progress);
    let share = b.delta_bytes as f64 / b.dense_bytes.max(1) as f64;
    if a.json {
        say!(
            "{}",
            json!({"workload": what, "delta_fraction": b.fraction, "reps": b.reps, "dense_bytes": b.dense_bytes, "delta_bytes": b.delta_bytes,
                   "delta_share": share, "dense_s": b.dense.as_secs_f64(), "delta_s": b.delta.as_secs_f64()})
        );
    } else {
        say!(
            "workload: {what}; {}; {:.2}% of source elements changed before each refit; medians of {} reps",
            pair_summary(s, d),
            b.fraction * 100.0,
            b.reps
        );
        say!("dense refit   {:>12}   {}", human(b.dense_bytes), duration(b.dense));
        say!(
            "delta refit   {:>12}   {}   ({:.1}% of the dense bytes; bit-exact with the dense refit)",
            human(b.delta_bytes),
            duration(b.delta),
            share * 100.0
        );
    }
    Ok(())
}

/// The first line of a comparison's text output.
fn say_header(w: &Workload, transport: &str, reps: usize) {
    say!("workload: {}; {}; transport {transport}; medians of {reps} reps", w.what, pair_summary(&w.s, &w.d));
}

/// Reshard and baseline in this process (`--transport local` or `node`),
/// beside a plain copy of the same bytes.
fn exec_compare(a: &BenchArgs, w: &Workload, opts: &PlanOptions, c: &Compared, progress: Progress) -> Result<(), Failure> {
    let b = exec_bench(&w.s, &w.d, opts, a.reps, a.transport, !a.cluster.no_digest_check, |p| progress.phase(p.to_string()))
        .map_err(|e| fail(e.to_string()))?;
    drop(progress);
    let (reference, copies) = match a.transport {
        BenchTransport::Local => ("memcpy", "threads"),
        _ => ("socket copy", "streams"),
    };
    let vs_reference = b.memcpy.as_secs_f64() / b.reshard.as_secs_f64();
    let ratio = b.baseline.as_secs_f64() / b.reshard.as_secs_f64();
    let transport = typed(&a.transport);
    if a.json {
        say!(
            "{}",
            json!({
                "workload": w.what, "reps": b.reps,
                "reshard": strategy_json(&c.rf, b.reshard, json!({})),
                "baseline": strategy_json(&c.bf, b.baseline, json!({})),
                "transport": transport,
                "reference": {"kind": reference, "bytes": b.reshard_bytes, "threads": b.memcpy_threads, "median_s": b.memcpy.as_secs_f64()},
                "reshard_vs_reference": vs_reference,
                "baseline_over_reshard": ratio,
                "links": c.links,
            })
        );
    } else {
        say_header(w, &transport, b.reps);
        say!("");
        let reference_row = (format!("{reference} ({} {copies})", b.memcpy_threads), b.reshard_bytes, b.memcpy);
        print_times([("reshard", &c.rf, b.reshard), ("baseline", &c.bf, b.baseline)], Some(reference_row));
        say!("");
        print_loads(&c.rl, &c.bl);
        say!("");
        say!("reshard throughput / {reference} throughput = {vs_reference:.2}; baseline time / reshard time = {ratio:.2}");
    }
    Ok(())
}

/// What a worker-process comparison is measured against: the lower bound on
/// the emulated links (none without them: loopback and a shared CPU have no
/// link model).
struct Bounds {
    /// Every node's link, in either direction, at its ranks x the per-rank
    /// rate, and each rank's shared-memory egress at its cap.
    node_links: Option<LinkBound>,
    /// Without --netns our senders cap each rank's egress only (ingress is
    /// free): the node-link bound is then what a real cluster's links would
    /// impose, and this egress-only bound (`Plan::egress_lower_bound`) is
    /// the emulation's own. With --netns the kernel shapes both directions
    /// of every node's link, so the bound is that model's and this is none.
    egress: Option<f64>,
    /// How the links are emulated, in words.
    link_model: Option<&'static str>,
}

fn bounds(a: &BenchArgs, rplan: &Plan, rl: &LinkLoads) -> Bounds {
    let caps = a.cluster.emulation();
    let node_links = a.cluster.rank_rate().map(|r| node_link_bound(rl, r, caps.intra_node_bytes_per_s));
    let egress = a.cluster.rank_rate().filter(|_| !a.cluster.netns).map(|r| {
        let links = LinkModel { net_bytes_per_s: r as f64, intra_bytes_per_s: (r * 9) as f64, message_latency_s: 0.0 };
        rplan.egress_lower_bound(&links)
    });
    let link_model = match (a.cluster.rank_rate(), a.cluster.netns) {
        (None, _) => None,
        (Some(_), true) => Some("netns: every node's link shaped by the kernel in both directions (tc on both ends of its veth)"),
        (Some(_), false) => Some("egress: a token bucket on each rank's egress (ingress free)"),
    };
    Bounds { node_links, egress, link_model }
}

/// The layout files worker processes read: `--src` and `--dst`, or the
/// preset's written to a temporary folder (removed when the guard drops).
fn layout_files(a: &BenchArgs, w: &Workload, progress: &Progress) -> Result<((PathBuf, PathBuf), Option<TempLayouts>), Failure> {
    if let (Some(sp), Some(dp)) = (&a.layouts.src, &a.layouts.dst) {
        return Ok(((sp.clone(), dp.clone()), None));
    }
    progress.phase("writing layouts for the workers");
    let dir = std::env::temp_dir().join(format!("refit-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    let temp = TempLayouts(dir.clone());
    for (name, l) in [("src.json", &w.s), ("dst.json", &w.d)] {
        std::fs::write(dir.join(name), reshard::layout_to_json(l).to_string()).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    }
    Ok(((dir.join("src.json"), dir.join("dst.json")), Some(temp)))
}

/// `--transport process`: reshard and baseline through worker processes.
fn cluster_compare(a: &BenchArgs, w: &Workload, opts: PlanOptions, rplan: &Plan, c: &Compared, progress: Progress) -> Result<(), Failure> {
    let (paths, _temp) = layout_files(a, w, &progress)?;
    let config = a.cluster.config(&paths.0, &paths.1, opts, "127.0.0.1:0", true)?;
    progress.phase("starting workers");
    let mut cluster = Cluster::start(config, w.s.clone(), w.d.clone(), |_| {}).map_err(|e| fail(e.to_string()))?;
    let b = refit_cli::bench::cluster_bench(&mut cluster, a.reps, |p| progress.phase(p.to_string()));
    let bounds = bounds(a, rplan, &c.rl);
    let peak = json!({"launcher": refit_cli::bench::peak_rss_bytes(), "worker_max": cluster.worker_peak_rss()});
    progress.phase("stopping workers");
    cluster.shutdown();
    drop(progress);
    let b = b.map_err(|e| fail(e.to_string()))?;
    if (b.reshard_bytes, b.baseline_bytes) != (c.rf.total_bytes, c.bf.total_bytes) {
        return Err(fail(format!(
            "bug: the workers report {} and {} bytes moved (reshard, baseline), the plans {} and {}",
            b.reshard_bytes, b.baseline_bytes, c.rf.total_bytes, c.bf.total_bytes
        )));
    }
    if a.json {
        say!("{}", cluster_json(a, w, c, &b, &bounds, peak));
    } else {
        print_cluster(a, w, c, &b, &bounds);
    }
    Ok(())
}

/// `refit bench --transport process --json`'s output.
fn cluster_json(
    a: &BenchArgs,
    w: &Workload,
    c: &Compared,
    b: &ClusterBench,
    bounds: &Bounds,
    peak: serde_json::Value,
) -> serde_json::Value {
    let times = |v: &[Duration]| json!({"times_s": v.iter().map(|t| t.as_secs_f64()).collect::<Vec<_>>()});
    let bound = bounds.node_links.as_ref();
    json!({
        "workload": w.what, "reps": b.reps, "transport": typed(&a.transport), "workers": b.workers, "peak_rss_bytes": peak,
        "per_process": typed(&a.cluster.per_process),
        "netns": a.cluster.netns,
        "link_model": bounds.link_model,
        "emulated_nic_bytes_per_s": a.cluster.rank_rate(),
        "reshard": strategy_json(&c.rf, b.reshard, times(&b.reshard_times)),
        "baseline": strategy_json(&c.bf, b.baseline, times(&b.baseline_times)),
        "baseline_over_reshard": b.baseline.as_secs_f64() / b.reshard.as_secs_f64(),
        "lower_bound_s": bound.map(|lb| lb.seconds),
        "bound_link": bound.map(|lb| lb.busiest.clone()),
        "efficiency": bound.map(|lb| lb.seconds / b.reshard.as_secs_f64()),
        "egress_lower_bound_s": bounds.egress,
        "node_rate_bytes_per_s": a.cluster.rank_rate().map(|r| per_node(&c.rl, |n| (r * u64::from(n.ranks)).into())),
        "node_out_bytes": per_node(&c.rl, |n| n.out_bytes.into()),
        "node_in_bytes": per_node(&c.rl, |n| n.in_bytes.into()),
        "links": c.links,
    })
}

/// `refit bench --transport process`'s text output.
fn print_cluster(a: &BenchArgs, w: &Workload, c: &Compared, b: &ClusterBench, bounds: &Bounds) {
    let ratio = b.baseline.as_secs_f64() / b.reshard.as_secs_f64();
    let efficiency = bounds.node_links.as_ref().map(|lb| lb.seconds / b.reshard.as_secs_f64());
    say_header(w, &typed(&a.transport), b.reps);
    say!("{} worker processes (one per {}), a verified warm-up of each strategy", b.workers, typed(&a.cluster.per_process));
    say!("");
    print_times([("reshard", &c.rf, b.reshard), ("baseline", &c.bf, b.baseline)], None);
    say!("");
    print_loads(&c.rl, &c.bl);
    say!("");
    say!("baseline time / reshard time = {ratio:.2}");
    match (&bounds.node_links, efficiency, bounds.link_model) {
        (Some(lb), Some(e), Some(model)) => {
            say!("link model: {model}");
            say!(
                "lower bound on the node links, both directions: {} (busiest: {}); efficiency (lower bound / reshard time) = {e:.2}",
                seconds(lb.seconds),
                lb.busiest
            );
            if let Some(eb) = bounds.egress {
                say!(
                    "  (this emulation leaves ingress free, so the in-terms do not bind here; its own egress-only bound is {})",
                    seconds(eb)
                );
            }
        }
        _ => say!("efficiency: needs --emulate-nic-mbps (a link model to bound against)"),
    }
}
