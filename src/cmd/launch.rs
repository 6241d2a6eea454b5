//! `refit launch` (worker processes running refits among them) and `refit worker` (one of them).

use super::report::{duration, human, invalid, load, options, rate, say, Failure, Progress};
use crate::{ClusterArgs, Pair};
use refit::cluster::{run_worker, Cluster, ControlSecret, Hosted, WorkerConfig, WorkerLayouts, SECRET_ENV};
use reshard::Strategy;
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub(crate) struct LaunchArgs<'a> {
    pub(crate) pair: &'a Pair,
    pub(crate) strategy: Strategy,
    pub(crate) verify: bool,
    pub(crate) refits: u64,
    pub(crate) fail_fast: bool,
    pub(crate) json: bool,
    pub(crate) cluster: &'a ClusterArgs,
    pub(crate) bind: &'a str,
    pub(crate) no_spawn: bool,
}

pub(crate) fn run(a: &LaunchArgs<'_>) -> Result<(), Failure> {
    let (src, dst) = (load(&a.pair.src)?, load(&a.pair.dst)?);
    let mut config = a.cluster.config(&a.pair.src, &a.pair.dst, options(a.pair)?, a.bind, !a.no_spawn)?;
    config.strategy = a.strategy;
    let t = Instant::now();
    let ranks = src.ranks() + dst.ranks();
    let refits = a.refits.max(1);
    let (quiet, no_spawn) = (a.json, a.no_spawn);
    let bar = Progress::bar(refits, quiet);
    bar.phase(if no_spawn { "waiting for workers" } else { "starting workers" });
    let mut cluster = Cluster::start(config, src, dst, |addr| {
        if no_spawn && !quiet {
            bar.suspend(|| {
                say!("rendezvous listening on {addr}: start workers covering all {ranks} ranks with `refit worker --rendezvous {addr} ...`")
            });
        }
    })
    .map_err(|e| Failure { line: e.to_string(), code: 1 })?;
    let workers = cluster.workers().len();
    let mut outcomes = Vec::new();
    let mut walls = Vec::new();
    let mut bytes = 0;
    for version in 1..=refits {
        bar.phase(format!("refit {version}"));
        let t = Instant::now();
        // Replace workers that died since the last refit (a failure here is
        // this refit's failure) — unless the first failure ends the launch.
        let r =
            if a.fail_fast { cluster.refit(version, a.verify) } else { cluster.recover().and_then(|_| cluster.refit(version, a.verify)) };
        let took = t.elapsed();
        let error = r.as_ref().err().map(|e| e.to_string());
        if let Ok(o) = &r {
            walls.push(o.report.wall);
            bytes = o.report.bytes;
        }
        bar.set_position(version);
        if !a.json {
            bar.suspend(|| match &r {
                Ok(o) => say!(
                    "refit {version}: ok in {} ({} with filling the sources{}){}",
                    duration(o.report.wall),
                    duration(took),
                    if a.verify { " and verifying" } else { "" },
                    o.verified.map_or(String::new(), |n| format!(", {n} destination elements verified"))
                ),
                Err(e) => say!("refit {version}: FAILED in {}: {e}", duration(took)),
            });
        }
        // `ms` counts stepping the sources and checking too; `refit_s` is
        // the orchestrator's refit alone, `transfer_s` its data movement.
        let secs = |f: fn(&orchestrator::RefitReport) -> Duration| r.as_ref().ok().map(|o| f(&o.report).as_secs_f64());
        outcomes.push(json!({
            "version": version, "ok": r.is_ok(), "error": error, "ms": took.as_secs_f64() * 1e3,
            "refit_s": secs(|r| r.wall), "plan_s": secs(|r| r.plan_time), "connect_s": secs(|r| r.connect_time),
            "transfer_s": secs(|r| r.transfer_time), "commit_s": secs(|r| r.commit_time),
            "resumed": r.as_ref().ok().map(|o| o.report.resumed),
        }));
        if r.is_err() && a.fail_fast {
            break;
        }
    }
    bar.phase("stopping workers");
    let peak = json!({"launcher": refit::bench::peak_rss_bytes(), "worker_max": cluster.worker_peak_rss()});
    cluster.shutdown();
    drop(bar);
    let last_ok = outcomes.last().is_some_and(|o| o["ok"] == true) && outcomes.len() as u64 == refits;
    let verified = a.verify && last_ok;
    let failed = outcomes.iter().filter(|o| o["ok"] == false).count();
    if a.json {
        say!(
            "{}",
            json!({"refits": outcomes, "verified": verified, "bytes_moved": (!walls.is_empty()).then_some(bytes), "peak_rss_bytes": peak})
        );
    } else {
        say!("{}: {workers} worker processes ({ranks} ranks); bytes moved {} per refit", a.strategy, human(bytes));
        if !walls.is_empty() {
            walls.sort();
            let median = walls[walls.len() / 2];
            say!(
                "{} refit(s), {failed} failed: median {} ({}), slowest {}; whole launch {}",
                outcomes.len(),
                duration(median),
                rate(bytes, median),
                duration(walls[walls.len() - 1]),
                duration(t.elapsed())
            );
        }
        if verified {
            say!("verify: the committed weights of version {refits} match on every destination rank");
        }
    }
    if last_ok {
        Ok(())
    } else {
        Err(Failure { line: format!("{failed} of {} refit(s) failed, the last one among them", outcomes.len()), code: 1 })
    }
}

/// Arguments of `refit worker`.
pub(crate) struct WorkerArgs<'a> {
    pub(crate) pair: &'a Pair,
    pub(crate) group: &'a str,
    pub(crate) rank: Option<u32>,
    pub(crate) node: Option<u32>,
    pub(crate) rendezvous: Option<&'a str>,
    pub(crate) heartbeat_timeout: Duration,
    pub(crate) secret_file: &'a Option<PathBuf>,
    pub(crate) shm_dir: &'a Option<PathBuf>,
}

pub(crate) fn worker(a: &WorkerArgs<'_>) -> Result<(), Failure> {
    let WorkerArgs { pair, group, rank, node, rendezvous, heartbeat_timeout, secret_file, shm_dir } = *a;
    let group = match group {
        "src" => reshard::Group::Src,
        "dst" => reshard::Group::Dst,
        other => return Err(invalid(format!("--group {other}: expected src or dst"))),
    };
    // Only the hosted group's layout stays; a destination keeps the source's
    // dtypes for its check (the source layout is dropped before the
    // destination's is read, so both never live at once).
    let layouts = match group {
        reshard::Group::Src => WorkerLayouts { layout: load(&pair.src)?, source_dtypes: Default::default() },
        reshard::Group::Dst => {
            let source_dtypes = load(&pair.src)?.tensors().iter().map(|t| (t.name.clone(), t.dtype)).collect();
            WorkerLayouts { layout: load(&pair.dst)?, source_dtypes }
        }
    };
    let hosted = match (rank, node) {
        (Some(r), _) => Hosted::Rank(reshard::Endpoint { group, rank: r }),
        (None, Some(n)) => Hosted::Node(group, n),
        (None, None) => return Err(invalid("give --rank or --node".into())),
    };
    hosted.endpoints(&layouts.layout).map_err(invalid)?;
    let rendezvous = match rendezvous {
        Some(r) => r.to_string(),
        None => std::env::var(orchestrator::rendezvous::RENDEZVOUS_ENV)
            .map_err(|_| invalid(format!("give --rendezvous or set {}", orchestrator::rendezvous::RENDEZVOUS_ENV)))?,
    };
    let rendezvous = rendezvous.parse().map_err(|e| invalid(format!("--rendezvous {rendezvous}: {e}")))?;
    let secret = match secret_file {
        Some(f) => ControlSecret::from_file(f),
        // Read once, then gone from this process's environment (no thread
        // runs yet).
        None => ControlSecret::take_from_env(SECRET_ENV),
    }
    .and_then(|s| s.secret())
    .map_err(|e| invalid(format!("control-plane secret: {e}")))?;
    let control = orchestrator::rendezvous::ControlConfig { heartbeat_timeout: heartbeat_timeout.max(Duration::from_millis(500)) };
    let config = WorkerConfig { hosted, join: orchestrator::JoinConfig { rendezvous, secret, control }, shm_dir: shm_dir.clone() };
    run_worker(config, layouts).map_err(|e| Failure { line: e, code: 1 })
}
