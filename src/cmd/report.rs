//! Shared reporting and loading helpers of the `refit` commands: the `say!`
//! macro, failures, layout loading, figures printing, temporary layout files.

use crate::{ClusterArgs, Pair};
use refit::cluster::{ClusterConfig, ControlSecret, SECRET_ENV};
use refit::presets::{layouts_with, Model, PresetError, PresetOptions};
use reshard::{parse_layout, Figures, Layout, PlanOptions, Strategy};
use serde_json::json;
use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Prints a line to stdout; a closed pipe (`refit plan | head -1`) ends the
/// program quietly instead of panicking.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout().lock(), $($arg)*).is_err() {
            std::process::exit(0);
        }
    }};
}
pub(crate) use say;

/// A failure to report: one line, and the exit code.
pub(crate) struct Failure {
    pub(crate) line: String,
    pub(crate) code: u8,
}

pub(crate) fn invalid(line: String) -> Failure {
    Failure { line, code: 2 }
}

pub(crate) fn load(path: &Path) -> Result<Layout, Failure> {
    let text = std::fs::read_to_string(path).map_err(|e| invalid(format!("{}: cannot read: {e}", path.display())))?;
    parse_layout(&text).map_err(|e| invalid(format!("{}: {e}", path.display())))
}

pub(crate) fn options(pair: &Pair) -> Result<PlanOptions, Failure> {
    let bytes = pair
        .max_staging_mib
        .checked_mul(1 << 20)
        .filter(|&b| b > 0)
        .ok_or_else(|| invalid("--max-staging-mib must be between 1 and 2^44".into()))?;
    Ok(PlanOptions { max_staging_bytes: bytes, ..PlanOptions::default() })
}

/// A preset's layouts at `scale`, with inference expert parallelism `ep`
/// if given (`--ep`; an EP the preset does not model is an error).
pub(crate) fn preset(model: Model, scale: u64, ep: Option<u32>) -> Result<(Layout, Layout), Failure> {
    layouts_with(model, scale, PresetOptions { ep }).map_err(|e| match (e, ep) {
        (e @ (PresetError::EpUnsupported { .. } | PresetError::EpDegree { .. }), Some(ep)) => invalid(format!("--ep {ep}: {e}")),
        (e, _) => invalid(format!("preset {model:?} at scale {scale}: {e}")),
    })
}

/// How the commands name a preset workload: `DeepseekV3 scale 1`, with
/// ` EP32` after the model when `ep` is given.
pub(crate) fn preset_label(model: Model, scale: u64, ep: Option<u32>) -> String {
    match ep {
        Some(ep) => format!("{model:?} EP{ep} scale {scale}"),
        None => format!("{model:?} scale {scale}"),
    }
}

/// Writes `out/src.json` and `out/dst.json`.
pub(crate) fn write_layouts(src: &Layout, dst: &Layout, out: &Path) -> Result<(), Failure> {
    std::fs::create_dir_all(out).map_err(|e| invalid(format!("{}: cannot create: {e}", out.display())))?;
    for (name, l) in [("src.json", src), ("dst.json", dst)] {
        let path = out.join(name);
        std::fs::write(&path, reshard::layout_to_json(l).to_string())
            .map_err(|e| invalid(format!("{}: cannot write: {e}", path.display())))?;
    }
    Ok(())
}

pub(crate) fn figures_json(f: &Figures) -> serde_json::Value {
    json!({
        "src_egress_bytes": f.src_egress_bytes,
        "dst_node_ingress_bytes": f.dst_node_ingress_bytes,
        "cross_node_bytes": f.cross_node_bytes,
        "max_rank_send_bytes": f.max_rank_send_bytes,
        "max_rank_recv_bytes": f.max_rank_recv_bytes,
        "messages": f.messages,
        "max_rank_send_messages": f.max_rank_send_messages,
        "max_rank_recv_messages": f.max_rank_recv_messages,
        "total_bytes": f.total_bytes,
        "rounds": f.rounds,
        "stages": f.stages,
        "pieces": f.pieces,
    })
}

pub(crate) fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

pub(crate) fn print_figures(name: &str, f: &Figures) {
    let ingress: Vec<String> = f.dst_node_ingress_bytes.iter().map(|&b| human(b)).collect();
    say!("{name}:");
    say!("  src egress          {}", human(f.src_egress_bytes));
    say!("  dst node ingress    [{}]", ingress.join(", "));
    say!("  cross-node          {}", human(f.cross_node_bytes));
    say!("  max rank send/recv  {} / {}", human(f.max_rank_send_bytes), human(f.max_rank_recv_bytes));
    say!(
        "  messages            {} in {} rounds ({} stages); most per rank: {} sent, {} received",
        f.messages,
        f.rounds,
        f.stages,
        f.max_rank_send_messages,
        f.max_rank_recv_messages
    );
}

/// A progress bar on stderr when it is a terminal and no JSON is asked for.
pub(crate) fn progress_bar(len: u64, quiet: bool) -> indicatif::ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template("[{bar:32.cyan/blue}] {pos}/{len} refits {elapsed}") {
        bar.set_style(style);
    }
    bar
}

/// Temporary layout files for worker processes, removed when dropped.
pub(crate) struct TempLayouts(pub(crate) PathBuf);

impl Drop for TempLayouts {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl ClusterArgs {
    /// The per-rank (inter-node, intra-node) egress caps, bytes/s.
    pub(crate) fn emulation(&self) -> Option<(u64, u64)> {
        self.emulate_nic_mbps.map(|m| (m * 1_000_000, m * 9_000_000))
    }

    pub(crate) fn config(&self, src: &Path, dst: &Path, options: PlanOptions, bind: &str, spawn: bool) -> Result<ClusterConfig, Failure> {
        let bind = bind.parse().map_err(|e| invalid(format!("--bind {bind}: {e}")))?;
        let spawn = if spawn {
            Some(std::env::current_exe().map_err(|e| Failure { line: format!("cannot find this program: {e}"), code: 1 })?)
        } else {
            None
        };
        let secret = match (&self.secret_file, std::env::var_os(SECRET_ENV)) {
            (Some(f), _) => ControlSecret::from_file(f).map_err(invalid)?,
            (None, Some(_)) => ControlSecret::from_env(SECRET_ENV).map_err(invalid)?,
            (None, None) if spawn.is_some() => ControlSecret::random(),
            (None, None) => {
                return Err(invalid(format!("--no-spawn needs the control-plane secret: give --secret-file or set {SECRET_ENV}")))
            }
        };
        secret.secret().map_err(|e| invalid(format!("control-plane secret: {e}")))?;
        let deadline = Duration::from_secs(self.deadline_s.max(1));
        Ok(ClusterConfig {
            src_path: src.to_path_buf(),
            dst_path: dst.to_path_buf(),
            options,
            bind,
            spawn,
            per_process: self.per_process,
            secret,
            setup_timeout: deadline,
            refit_deadline: deadline,
            heartbeat_timeout: Duration::from_millis(self.heartbeat_timeout_ms.max(500)),
            fabric: orchestrator::NodeFabric {
                checksum: self.checksum,
                emulation: self.emulation(),
                connect_timeout: deadline.min(Duration::from_secs(60)),
            },
            strategy: Strategy::Reshard,
        })
    }
}
