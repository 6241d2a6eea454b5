//! `refit chaos`: kill workers and inject data-plane faults, check every refit keeps the promise.

use super::report::{duration, load, say, Failure, Progress, TempLayouts};
use crate::ClusterArgs;
use refit_cli::chaos::{ChaosConfig, ChaosRow};
use refit_cli::cluster::PerProcess;
use reshard::PlanOptions;
use serde_json::json;
use std::path::Path;
use std::time::Duration;

/// Arguments of `refit chaos`.
pub(crate) struct ChaosArgs {
    pub(crate) json: bool,
    pub(crate) nic_mbps: u64,
    pub(crate) deadline_s: u64,
    pub(crate) netns: bool,
    pub(crate) only: Vec<String>,
    pub(crate) shuffle: Option<u64>,
    pub(crate) repeat: usize,
}

pub(crate) fn run(a: &ChaosArgs) -> Result<(), Failure> {
    let as_json = a.json;
    // The suite's own layouts: TP2xDP... on 8 training ranks (2 nodes) to 4
    // inference ranks; the "different layout" is another pair.
    const SRC: &str = include_str!("../../../examples/tp-to-tp/src.json");
    const DST: &str = include_str!("../../../examples/tp-to-tp/dst.json");
    const WRONG: &str = include_str!("../../../examples/mixed-2d/dst.json");
    let fail = |e: String| Failure { line: e, code: 1 };
    let dir = std::env::temp_dir().join(format!("refit-chaos-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    let _temp = TempLayouts(dir.clone());
    for (name, text) in [("src.json", SRC), ("dst.json", DST), ("wrong.json", WRONG)] {
        std::fs::write(dir.join(name), text).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    }
    let (src, dst) = (load(&dir.join("src.json"))?, load(&dir.join("dst.json"))?);
    let config = suite_config(a, &dir)?;
    if !as_json {
        say!("{:<60} {:>7} {:>9} {:>6} {:>5} {:>9}  detail", "case", "failed", "elapsed", "hang", "torn", "recovered");
    }
    let progress = Progress::spinner(as_json);
    progress.phase("starting workers, then the first case");
    let mut done = 0;
    let rows = refit_cli::chaos::run_chaos(config, src, dst, |r| {
        done += 1;
        progress.phase(format!("{done} cases done"));
        if !as_json {
            progress.suspend(|| print_row(r));
        }
    })
    .map_err(|e| fail(e.to_string()))?;
    drop(progress);
    let skipped = rows.iter().filter(|r| r.skipped.is_some()).count();
    let ok = rows.iter().filter(|r| r.kept_promise()).count() - skipped;
    let ran = rows.len() - skipped;
    if as_json {
        let list: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                json!({
                    "case": r.case, "refit_failed": r.refit_failed, "elapsed_s": r.elapsed.as_secs_f64(),
                    "hang": !r.within_deadline, "torn": r.torn, "recovered": r.recovered,
                    "versions": r.versions, "detail": r.detail, "skipped": r.skipped,
                    "replaced": r.replaced, "recovery_refit_s": r.recovery_refit.map(|d| d.as_secs_f64()),
                })
            })
            .collect();
        say!("{}", json!({"cases": list, "passed": ok, "total": ran, "skipped": skipped}));
    } else {
        print_summary(&rows, (ok, ran, skipped));
    }
    if ok == ran {
        Ok(())
    } else {
        Err(Failure { line: format!("{} chaos case(s) broke the promise", ran - ok), code: 1 })
    }
}

/// The suite's cluster (a worker per rank, checksums on, emulated NICs,
/// short timeouts) over the layout files in `dir`.
fn suite_config(a: &ChaosArgs, dir: &Path) -> Result<ChaosConfig, Failure> {
    let args = ClusterArgs {
        per_process: PerProcess::Rank,
        deadline_s: a.deadline_s.max(1),
        checksum: true,
        fresh_data_plane: false,
        no_digest_check: false,
        tcp: false,
        emulate_nic_mbps: Some(a.nic_mbps.max(1)),
        netns: a.netns,
        netem_delay_ms: None,
        netem_loss_pct: None,
        secret_file: None,
        heartbeat_timeout_ms: 2000,
    };
    let mut cluster = args.config(&dir.join("src.json"), &dir.join("dst.json"), PlanOptions::default(), "127.0.0.1:0", true)?;
    cluster.setup_timeout = Duration::from_secs(10);
    // A peer killed before it connects fails the connect step after this.
    cluster.fabric.connect_timeout = Duration::from_secs(5);
    Ok(ChaosConfig {
        cluster,
        mid_transfer: Duration::from_millis(200),
        wrong_layouts: (dir.join("src.json"), dir.join("wrong.json")),
        only: a.only.clone(),
        shuffle: a.shuffle,
        repeat: a.repeat,
    })
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// One case's line of the table.
fn print_row(r: &ChaosRow) {
    match &r.skipped {
        Some(why) => say!("{:<60} {:>7} {:>9} {:>6} {:>5} {:>9}  skipped: {why}", r.case, "-", "-", "-", "-", "-"),
        None => say!(
            "{:<60} {:>7} {:>9} {:>6} {:>5} {:>9}  {}",
            r.case,
            r.refit_failed.map_or("-", yes),
            duration(r.elapsed),
            yes(!r.within_deadline),
            yes(r.torn),
            yes(r.recovered),
            r.detail
        ),
    }
}

/// The lines after the table: how often the cases that may commit despite
/// the fault did, then the verdict (`ok` of `ran` kept the promise).
fn print_summary(rows: &[ChaosRow], (ok, ran, skipped): (usize, usize, usize)) {
    let mut names: Vec<&str> = rows.iter().filter(|r| r.case.starts_with("kill replicated source")).map(|r| r.case.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    for name in names {
        let of: Vec<&ChaosRow> = rows.iter().filter(|r| r.case == name && r.skipped.is_none()).collect();
        let committed = of.iter().filter(|r| r.refit_failed == Some(false)).count();
        say!("{name}: the refit committed in {committed} of {} runs", of.len());
    }
    let skipped = if skipped > 0 { format!(" ({skipped} skipped: this machine cannot run them)") } else { String::new() };
    say!("{ok} of {ran} cases kept the promise (no hang, no torn version, recovered){skipped}");
}
