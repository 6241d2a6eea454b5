//! `refit bench`: reshard and the gather-broadcast baseline side by side on one data plane.

use super::report::{human, invalid, load, preset, preset_label, say, Failure, TempLayouts};
use crate::BenchArgs;
use refit::bench::{exec_bench, link_loads, BenchTransport, LinkLoads};
use refit::cluster::Cluster;
use reshard::{plan_baseline, plan_reshard, LinkModel, PlanOptions};
use serde_json::json;
use std::time::Duration;

fn loads_json(l: &LinkLoads) -> serde_json::Value {
    json!({
        "inter_node_bytes": l.inter_node_bytes,
        "intra_node_bytes": l.intra_node_bytes,
        "max_nic_out_bytes": l.max_nic_out,
        "max_nic_in_bytes": l.max_nic_in,
        "max_intra_out_bytes": l.max_intra_out,
        "node_pairs": l.node_pairs.iter().map(|(a, z, b)| json!({"from": a, "to": z, "bytes": b})).collect::<Vec<_>>(),
    })
}

fn say_loads(name: &str, l: &LinkLoads) {
    say!(
        "  links {name:<9} network {:>10} (busiest NIC out {}, in {}); intra-node {:>10} (busiest rank out {})",
        human(l.inter_node_bytes),
        human(l.max_nic_out),
        human(l.max_nic_in),
        human(l.intra_node_bytes),
        human(l.max_intra_out)
    );
}

fn say_time(name: &str, bytes: u64, t: Duration) {
    let gib = bytes as f64 / t.as_secs_f64().max(1e-12) / (1u64 << 30) as f64;
    say!("  {name:<9} {:>10}  {:>9.3} ms  {gib:>7.2} GiB/s", human(bytes), t.as_secs_f64() * 1e3);
}

pub(crate) fn run(a: &BenchArgs) -> Result<(), Failure> {
    let (s, d, what) = match (&a.src, &a.dst, a.model) {
        (Some(s), Some(d), _) => (load(s)?, load(d)?, format!("{} -> {}", s.display(), d.display())),
        (_, _, Some(m)) => {
            let (s, d) = preset(m, a.scale, a.ep)?;
            (s, d, preset_label(m, a.scale, a.ep))
        }
        _ => return Err(invalid("give --src and --dst, or --model".into())),
    };
    let opts = PlanOptions { max_staging_bytes: a.max_staging_mib.max(1) << 20, ..PlanOptions::default() };
    let fail = |e: String| Failure { line: e, code: 1 };
    let rplan = plan_reshard(&s, &d, &opts).map_err(|e| fail(e.to_string()))?;
    let bplan = plan_baseline(&s, &d, &opts).map_err(|e| fail(e.to_string()))?;
    let (rl, bl) = (link_loads(&rplan), link_loads(&bplan));
    if let Some(path) = &a.svg {
        for (plan, p) in [(&rplan, path.clone()), (&bplan, path.with_extension("baseline.svg"))] {
            std::fs::write(&p, refit::svg::traffic_svg(plan, &what)).map_err(|e| invalid(format!("{}: cannot write: {e}", p.display())))?;
        }
    }
    let links = json!({"reshard": loads_json(&rl), "baseline": loads_json(&bl)});
    let gib = |bytes: u64, t: Duration| bytes as f64 / t.as_secs_f64().max(1e-12) / (1u64 << 30) as f64;
    let header = |reps: usize| {
        say!("workload: {what}; {} src ranks -> {} dst ranks, {} tensors; medians of {reps} reps", s.ranks(), d.ranks(), d.tensors().len())
    };
    if a.transport == BenchTransport::Process {
        // Workers read layout files: write the preset's, if that is what we have.
        let (paths, _temp) = match (&a.src, &a.dst) {
            (Some(sp), Some(dp)) => ((sp.clone(), dp.clone()), None),
            _ => {
                let dir = std::env::temp_dir().join(format!("refit-bench-{}", std::process::id()));
                std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
                let temp = TempLayouts(dir.clone());
                for (name, l) in [("src.json", &s), ("dst.json", &d)] {
                    std::fs::write(dir.join(name), reshard::layout_to_json(l).to_string())
                        .map_err(|e| fail(format!("{}: {e}", dir.display())))?;
                }
                ((dir.join("src.json"), dir.join("dst.json")), Some(temp))
            }
        };
        let config = a.cluster.config(&paths.0, &paths.1, opts, "127.0.0.1:0", true)?;
        let mut cluster = Cluster::start(config, s.clone(), d.clone(), |_| {}).map_err(|e| fail(e.to_string()))?;
        let b = refit::bench::cluster_bench(&mut cluster, a.reps);
        // The lower bound under the emulated links (no bound without them:
        // loopback and a shared CPU have no link model). The emulation caps
        // each rank's egress only, so the bound is the source group's
        // egress term (`Plan::egress_lower_bound`).
        let bound = a.cluster.emulation().map(|(net, intra)| {
            let links = LinkModel { net_bytes_per_s: net as f64, intra_bytes_per_s: intra as f64, message_latency_s: 0.0 };
            rplan.egress_lower_bound(&links)
        });
        let peak = json!({"launcher": refit::bench::peak_rss_bytes(), "worker_max": cluster.worker_peak_rss()});
        cluster.shutdown();
        let b = b.map_err(|e| fail(e.to_string()))?;
        let ratio = b.baseline.as_secs_f64() / b.reshard.as_secs_f64();
        let efficiency = bound.map(|lb| lb / b.reshard.as_secs_f64());
        if a.json {
            say!(
                "{}",
                json!({
                    "workload": what, "reps": b.reps, "transport": "process", "workers": b.workers, "peak_rss_bytes": peak,
                    "per_process": format!("{:?}", a.cluster.per_process).to_lowercase(),
                    "emulated_nic_bytes_per_s": a.cluster.emulation().map(|e| e.0),
                    "reshard": {"bytes": b.reshard_bytes, "median_s": b.reshard.as_secs_f64(),
                                "times_s": b.reshard_times.iter().map(|t| t.as_secs_f64()).collect::<Vec<_>>()},
                    "baseline": {"bytes": b.baseline_bytes, "median_s": b.baseline.as_secs_f64(),
                                 "times_s": b.baseline_times.iter().map(|t| t.as_secs_f64()).collect::<Vec<_>>()},
                    "baseline_over_reshard": ratio,
                    "lower_bound_s": bound,
                    "efficiency": efficiency,
                    "links": links,
                })
            );
        } else {
            header(b.reps);
            say!("  {} worker processes ({:?} per process), bit-exact warm-up of each", b.workers, a.cluster.per_process);
            say_time("reshard", b.reshard_bytes, b.reshard);
            say_time("baseline", b.baseline_bytes, b.baseline);
            say_loads("reshard", &rl);
            say_loads("baseline", &bl);
            say!("  baseline time / reshard time = {ratio:.2}");
            match (bound, efficiency) {
                (Some(lb), Some(e)) => {
                    say!(
                        "  lower bound on the emulated (egress-capped) links {:.3} ms; efficiency (lower bound / reshard time) = {e:.2}",
                        lb * 1e3
                    )
                }
                _ => say!("  efficiency: needs --emulate-nic-mbps (a link model to bound against)"),
            }
        }
        return Ok(());
    }
    let b = exec_bench(&s, &d, (rplan, bplan), a.reps, a.transport).map_err(|e| fail(e.to_string()))?;
    let reference = match a.transport {
        BenchTransport::Local => "memcpy",
        _ => "socket copy",
    };
    let transport = format!("{:?}", a.transport).to_lowercase();
    if a.json {
        say!(
            "{}",
            json!({
                "workload": what, "reps": b.reps,
                "reshard": {"bytes": b.reshard_bytes, "median_s": b.reshard.as_secs_f64()},
                "baseline": {"bytes": b.baseline_bytes, "median_s": b.baseline.as_secs_f64()},
                "transport": transport,
                "reference": {"kind": reference, "bytes": b.reshard_bytes, "threads": b.memcpy_threads, "median_s": b.memcpy.as_secs_f64()},
                "reshard_vs_reference": b.memcpy.as_secs_f64() / b.reshard.as_secs_f64(),
                "baseline_over_reshard": b.baseline.as_secs_f64() / b.reshard.as_secs_f64(),
                "links": links,
            })
        );
    } else {
        header(b.reps);
        say_time("reshard", b.reshard_bytes, b.reshard);
        say_time("baseline", b.baseline_bytes, b.baseline);
        say!(
            "  {reference:<11} {:>8}  {:>9.3} ms  {:>7.2} GiB/s  ({} {})",
            human(b.reshard_bytes),
            b.memcpy.as_secs_f64() * 1e3,
            gib(b.reshard_bytes, b.memcpy),
            b.memcpy_threads,
            if a.transport == BenchTransport::Local { "threads" } else { "streams" }
        );
        say_loads("reshard", &rl);
        say_loads("baseline", &bl);
        say!(
            "  transport {transport}: reshard throughput / {reference} throughput = {:.2}; baseline time / reshard time = {:.2}",
            b.memcpy.as_secs_f64() / b.reshard.as_secs_f64(),
            b.baseline.as_secs_f64() / b.reshard.as_secs_f64()
        );
    }
    Ok(())
}
