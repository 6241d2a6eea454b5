//! `refit launch` (worker processes running refits among them) and `refit worker` (one of them).

use super::report::{duration, human, invalid, load, options, rate, say, Failure, Progress};
use crate::{ClusterArgs, Pair, ReplicaArgs};
use refit_cli::cluster::{run_worker, Cluster, ControlSecret, Hosted, ReplicaConfig, WorkerConfig, WorkerLayouts, SECRET_ENV};
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
    pub(crate) replicas: &'a ReplicaArgs,
}

/// The replica settings asked for, checked.
fn replica_config(r: &ReplicaArgs, no_spawn: bool) -> Result<Option<ReplicaConfig>, Failure> {
    let Some(start) = r.replicas else { return Ok(None) };
    if no_spawn && !(r.add_replica_at.is_empty() && r.remove_replica_at.is_empty()) {
        return Err(invalid(
            "--add-replica-at/--remove-replica-at start and stop workers here: with --no-spawn, replicas join with `refit worker --replica NAME`".into(),
        ));
    }
    let adds = u32::try_from(r.add_replica_at.len()).unwrap_or(u32::MAX);
    let most = r.most_replicas.unwrap_or(start.saturating_add(adds));
    if start == 0 || most < start {
        return Err(invalid(format!("--replicas {start} --most-replicas {most}: need 1 <= replicas <= most")));
    }
    Ok(Some(ReplicaConfig { start, most }))
}

/// Adds and removes the replicas `r` asks for before refit `version`; what
/// happened, one line each, and whether all of it did.
fn change_replicas(cluster: &mut Cluster, r: &ReplicaArgs, version: u64) -> (Vec<serde_json::Value>, bool) {
    let mut events = Vec::new();
    let mut ok = true;
    for _ in r.add_replica_at.iter().filter(|&&v| v == version) {
        let t = Instant::now();
        let added = cluster.add_replica();
        ok &= added.is_ok();
        events.push(match added {
            Ok(report) => {
                let seeded = report.seeded.as_ref();
                json!({
                    "before_refit": version, "event": "add", "ok": true, "replicas": report.replicas,
                    "seeded_version": seeded.map(|s| s.version), "seeded_from": seeded.map(|s| s.from_replica),
                    "seed_bytes": seeded.map(|s| s.bytes), "seed_s": seeded.map(|s| s.wall.as_secs_f64()),
                    "s": t.elapsed().as_secs_f64(),
                })
            }
            Err(e) => json!({"before_refit": version, "event": "add", "ok": false, "error": e.to_string()}),
        });
    }
    for _ in r.remove_replica_at.iter().filter(|&&v| v == version) {
        let removed = cluster.remove_replica(0);
        ok &= removed.is_ok();
        events.push(match removed {
            Ok(report) => json!({"before_refit": version, "event": "remove", "ok": true, "replicas": report.replicas}),
            Err(e) => json!({"before_refit": version, "event": "remove", "ok": false, "error": e.to_string()}),
        });
    }
    (events, ok)
}

/// One replica event in words.
fn describe_event(e: &serde_json::Value) -> String {
    let what = if e["event"] == "add" { "a replica joined" } else { "replica 0 left" };
    if e["ok"] != true {
        return format!("{what}: FAILED: {}", e["error"].as_str().unwrap_or_default());
    }
    let seeded = match (e["seeded_version"].as_u64(), e["seed_bytes"].as_u64(), e["seed_s"].as_f64()) {
        (Some(v), Some(b), Some(s)) => format!(
            ", seeded with version {v} from replica {} ({} in {}; no training rank sent a byte)",
            e["seeded_from"],
            human(b),
            duration(Duration::from_secs_f64(s))
        ),
        _ if e["event"] == "add" => ", serving nothing until the next refit".to_string(),
        _ => String::new(),
    };
    format!("{what}: {} replicas{seeded}", e["replicas"])
}

/// What the refits of a launch came to: per refit its JSON line, the
/// wall times of those that succeeded, the bytes one moves, and the
/// replica events.
#[derive(Default)]
struct Tally {
    outcomes: Vec<serde_json::Value>,
    walls: Vec<Duration>,
    bytes: u64,
    events: Vec<serde_json::Value>,
    events_ok: bool,
}

pub(crate) fn run(a: &LaunchArgs<'_>) -> Result<(), Failure> {
    let (src, dst) = (load(&a.pair.src)?, load(&a.pair.dst)?);
    let mut config = a.cluster.config(&a.pair.src, &a.pair.dst, options(a.pair)?, a.bind, !a.no_spawn)?;
    config.strategy = a.strategy;
    config.replicas = replica_config(a.replicas, a.no_spawn)?;
    let t = Instant::now();
    let (ranks, dst_ranks, replicas) = (src.ranks() + dst.ranks(), dst.ranks(), config.replicas.is_some());
    let refits = a.refits.max(1);
    let (quiet, no_spawn) = (a.json, a.no_spawn);
    let bar = Progress::bar(refits, quiet);
    bar.phase(if no_spawn { "waiting for workers" } else { "starting workers" });
    let mut cluster = Cluster::start(config, src, dst, |addr| {
        if no_spawn && quiet {
            // Standard output holds the one JSON object: the address goes
            // to standard error.
            eprintln!("rendezvous listening on {addr}");
        }
        if no_spawn && !quiet {
            bar.suspend(|| {
                if replicas {
                    say!("rendezvous listening on {addr}: start workers covering the {} training ranks with `refit worker --rendezvous {addr} ...`, and each replica's with `refit worker --rendezvous {addr} --group dst --replica NAME ...`", ranks - dst_ranks)
                } else {
                    say!("rendezvous listening on {addr}: start workers covering all {ranks} ranks with `refit worker --rendezvous {addr} ...`")
                }
            });
        }
    })
    .map_err(|e| Failure { line: e.to_string(), code: 1 })?;
    let workers = cluster.workers().len();
    let mut tally = Tally { events_ok: true, ..Tally::default() };
    for version in 1..=refits {
        if !refit_version(a, &mut cluster, version, &bar, &mut tally) {
            break;
        }
    }
    bar.phase("stopping workers");
    let peak = json!({"launcher": refit_cli::bench::peak_rss_bytes(), "worker_max": cluster.worker_peak_rss()});
    cluster.shutdown();
    drop(bar);
    let Tally { outcomes, mut walls, bytes, events, events_ok } = tally;
    let last_ok = outcomes.last().is_some_and(|o| o["ok"] == true) && outcomes.len() as u64 == refits;
    let verified = a.verify && last_ok;
    let failed = outcomes.iter().filter(|o| o["ok"] == false).count();
    if a.json {
        say!(
            "{}",
            json!({
                "refits": outcomes, "verified": verified, "bytes_moved": (!walls.is_empty()).then_some(bytes),
                "peak_rss_bytes": peak, "replica_events": events,
            })
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
    if last_ok && events_ok {
        Ok(())
    } else if last_ok {
        Err(Failure { line: "a replica could not be added or removed (see above)".into(), code: 1 })
    } else {
        Err(Failure { line: format!("{failed} of {} refit(s) failed, the last one among them", outcomes.len()), code: 1 })
    }
}

/// Refit `version` (replicas added and removed first, as asked), said on
/// the bar's line and tallied; whether the launch goes on.
fn refit_version(a: &LaunchArgs<'_>, cluster: &mut Cluster, version: u64, bar: &Progress, tally: &mut Tally) -> bool {
    if config_has_replicas(cluster) {
        bar.phase(format!("replicas before refit {version}"));
        let (happened, ok) = change_replicas(cluster, a.replicas, version);
        tally.events_ok &= ok;
        if !a.json {
            bar.suspend(|| happened.iter().for_each(|e| say!("before refit {version}: {}", describe_event(e))));
        }
        tally.events.extend(happened);
    }
    bar.phase(format!("refit {version}"));
    let t = Instant::now();
    // Replace workers that died since the last refit (a failure here is
    // this refit's failure) — unless the first failure ends the launch.
    let r = if a.fail_fast { cluster.refit(version, a.verify) } else { cluster.recover().and_then(|_| cluster.refit(version, a.verify)) };
    let took = t.elapsed();
    let error = r.as_ref().err().map(|e| e.to_string());
    let dropped = r.as_ref().map(|o| o.report.dropped_replicas.clone()).unwrap_or_default();
    let replicas = cluster.replica_names().map(|n| n.len());
    if let Ok(o) = &r {
        tally.walls.push(o.report.wall);
        tally.bytes = o.report.bytes;
    }
    bar.set_position(version);
    if !a.json {
        bar.suspend(|| match &r {
            Ok(o) => say!(
                "refit {version}: ok in {} ({} with filling the sources{}){}{}",
                duration(o.report.wall),
                duration(took),
                if a.verify { " and verifying" } else { "" },
                o.verified.map_or(String::new(), |n| format!(", {n} destination elements verified")),
                if dropped.is_empty() { String::new() } else { format!("; replicas {dropped:?} left the group during it") }
            ),
            Err(e) => say!("refit {version}: FAILED in {}: {e}", duration(took)),
        });
    }
    // `ms` counts stepping the sources and checking too; `refit_s` is
    // the orchestrator's refit alone, `transfer_s` its data movement.
    let secs = |f: fn(&orchestrator::RefitReport) -> Duration| r.as_ref().ok().map(|o| f(&o.report).as_secs_f64());
    tally.outcomes.push(json!({
        "version": version, "ok": r.is_ok(), "error": error, "ms": took.as_secs_f64() * 1e3,
        "refit_s": secs(|r| r.wall), "plan_s": secs(|r| r.plan_time), "connect_s": secs(|r| r.connect_time),
        "transfer_s": secs(|r| r.transfer_time), "commit_s": secs(|r| r.commit_time),
        "resumed": r.as_ref().ok().map(|o| o.report.resumed),
        "replicas": replicas, "dropped_replicas": dropped,
    }));
    !(r.is_err() && a.fail_fast)
}

/// Whether the cluster's destination group is made of replicas.
fn config_has_replicas(cluster: &Cluster) -> bool {
    cluster.replica_names().is_some()
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
    pub(crate) replica: &'a Option<String>,
}

pub(crate) fn worker(a: &WorkerArgs<'_>) -> Result<(), Failure> {
    let WorkerArgs { pair, group, rank, node, rendezvous, heartbeat_timeout, secret_file, replica } = *a;
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
    let control = orchestrator::rendezvous::ControlConfig {
        heartbeat_timeout: heartbeat_timeout.max(Duration::from_millis(500)),
        ..orchestrator::rendezvous::ControlConfig::default()
    };
    if replica.is_some() && group != reshard::Group::Dst {
        return Err(invalid("--replica: only destination ranks (--group dst) join as a replica".into()));
    }
    let join = orchestrator::JoinConfig { rendezvous, secret, control };
    let config = WorkerConfig { hosted, join, replica: replica.clone() };
    run_worker(config, layouts).map_err(|e| Failure { line: e, code: 1 })
}
