//! Shared reporting and loading helpers of the `refit` commands: the `say!`
//! macro, failures, layout loading, figures printing, temporary layout files.

use crate::{ClusterArgs, Pair};
use refit_cli::cluster::{ClusterConfig, ControlSecret, SECRET_ENV};
use refit_cli::netns::{Netem, NetnsConfig};
use refit_cli::presets::{layouts_with, Model, PresetError, PresetOptions, Setup};
pub(crate) use refit_cli::units::{duration, human, plural, rate, seconds};
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
    let max_work = work_limit(pair.max_plan_work, Some((&pair.src, &pair.dst)))?;
    Ok(PlanOptions { max_staging_bytes: bytes, max_work, ..PlanOptions::default() })
}

/// Units of planning work allowed per byte of the layout files planned:
/// the presets' files take about one (docs/benchmarks.md, "Planner work
/// limit").
const WORK_PER_FILE_BYTE: u64 = 16;

/// The least work limit of a pair of layout files, however small: about a
/// second of planning and 100 MB.
const MIN_FILE_WORK: u64 = 1 << 20;

/// The planner's work limit ([`PlanOptions::max_work`]): `--max-plan-work`
/// if given; else this machine's ([`orchestrator::machine::plan_work_limit`]),
/// and for layout files (`files`) no more than [`WORK_PER_FILE_BYTE`] per
/// byte of them (at least [`MIN_FILE_WORK`]), so a small file describing a
/// huge expansion (a mesh of a million ranks, a tensor cut into a million
/// pieces each side) is refused at once instead of planned for minutes.
pub(crate) fn work_limit(flag: Option<u64>, files: Option<(&Path, &Path)>) -> Result<u64, Failure> {
    match flag {
        Some(0) => return Err(invalid("--max-plan-work takes at least 1".into())),
        Some(n) => return Ok(n),
        None => {}
    }
    let machine = orchestrator::machine::plan_work_limit();
    let Some((src, dst)) = files else { return Ok(machine) };
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).map_err(|e| invalid(format!("{}: cannot read: {e}", p.display())));
    let bytes = size(src)?.saturating_add(size(dst)?);
    Ok(machine.min(bytes.saturating_mul(WORK_PER_FILE_BYTE).max(MIN_FILE_WORK)))
}

/// A preset's layouts at `scale`, with inference expert parallelism `ep`
/// if given (`--ep`; an EP the preset does not model is an error).
pub(crate) fn preset(model: Model, scale: u64, ep: Option<u32>) -> Result<(Layout, Layout), Failure> {
    preset_with(model, scale, PresetOptions { ep, setup: None })
}

/// A preset's layouts at `scale` with `options` (`--ep`, `--setup`); an
/// option the preset does not model is an error naming the flag.
pub(crate) fn preset_with(model: Model, scale: u64, options: PresetOptions) -> Result<(Layout, Layout), Failure> {
    layouts_with(model, scale, options).map_err(|e| match (e, options) {
        (e @ (PresetError::EpUnsupported { .. } | PresetError::EpDegree { .. }), PresetOptions { ep: Some(ep), .. }) => {
            invalid(format!("--ep {ep}: {e}"))
        }
        (e @ (PresetError::SetupUnsupported { .. } | PresetError::SetupWithEp { .. }), PresetOptions { setup: Some(s), .. }) => {
            invalid(format!("--setup {s}: {e}"))
        }
        (e, _) => invalid(format!("preset {model} at scale {scale}: {e}")),
    })
}

/// The setup `--setup NAME` names, for `model`: an unknown name is an
/// error naming the setups of `model` (or of every preset without one).
pub(crate) fn parse_setup(model: Option<Model>, name: &str) -> Result<Setup, Failure> {
    Setup::from_name(name).ok_or_else(|| {
        let valid = match model {
            Some(m) => format!("the {m} preset's setups: {}", m.setup_names()),
            None => {
                let all: Vec<String> = <Model as clap::ValueEnum>::value_variants()
                    .iter()
                    .filter(|m| !m.setups().is_empty())
                    .map(|m| format!("{m}: {}", m.setup_names()))
                    .collect();
                format!("the setups: {}", all.join("; "))
            }
        };
        invalid(format!("--setup {name}: no such setup ({valid})"))
    })
}

/// How the commands name a preset workload, the model as typed:
/// `deepseek-v3 scale 1`, with ` EP32` after the model when `ep` is given.
pub(crate) fn preset_label(model: Model, scale: u64, ep: Option<u32>) -> String {
    preset_label_with(model, scale, PresetOptions { ep, setup: None })
}

/// [`preset_label`] with a setup: `kimi-k2 vllm-rdt scale 1`.
pub(crate) fn preset_label_with(model: Model, scale: u64, options: PresetOptions) -> String {
    match options {
        PresetOptions { setup: Some(s), .. } => format!("{model} {s} scale {scale}"),
        PresetOptions { ep: Some(ep), .. } => format!("{model} EP{ep} scale {scale}"),
        PresetOptions { .. } => format!("{model} scale {scale}"),
    }
}

/// What a layout pair is, in one phrase: `8 src ranks (2 nodes) -> 4 dst
/// ranks (2 nodes), 2 tensors`.
pub(crate) fn pair_summary(src: &Layout, dst: &Layout) -> String {
    format!(
        "{} src ranks ({}) -> {} dst ranks ({}), {}",
        src.ranks(),
        plural(src.nodes(), "node"),
        dst.ranks(),
        plural(dst.nodes(), "node"),
        plural(dst.tensors().len() as u64, "tensor")
    )
}

/// A command-line choice as it is typed (`rank`, `tcp`), not its Rust name.
pub(crate) fn typed(choice: &impl clap::ValueEnum) -> String {
    choice.to_possible_value().map_or_else(String::new, |v| v.get_name().to_string())
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

/// The three byte figures every command reports under the same names:
/// `bytes_moved` (= `Figures::total_bytes`, also kept under that key where
/// it was) splits into `src_egress_bytes` and `relayed_bytes`.
pub(crate) fn bytes_json(f: &Figures) -> serde_json::Map<String, serde_json::Value> {
    let mut m = serde_json::Map::new();
    m.insert("bytes_moved".into(), f.total_bytes.into());
    m.insert("src_egress_bytes".into(), f.src_egress_bytes.into());
    m.insert("relayed_bytes".into(), f.relayed_bytes().into());
    m
}

pub(crate) fn figures_json(f: &Figures) -> serde_json::Value {
    let mut m = bytes_json(f);
    let rest = json!({
        "dst_node_ingress_bytes": f.dst_node_ingress_bytes,
        "cross_node_bytes": f.cross_node_bytes,
        "src_rank_egress_bytes": f.src_rank_egress_bytes,
        "max_src_rank_egress_bytes": f.max_src_rank_egress_bytes(),
        "max_rank_send_bytes": f.max_rank_send_bytes,
        "max_rank_recv_bytes": f.max_rank_recv_bytes,
        "messages": f.messages,
        "max_rank_send_messages": f.max_rank_send_messages,
        "max_rank_recv_messages": f.max_rank_recv_messages,
        "total_bytes": f.total_bytes,
        "rounds": f.rounds,
        "stages": f.stages,
        "pieces": f.pieces,
    });
    if let serde_json::Value::Object(rest) = rest {
        m.extend(rest);
    }
    serde_json::Value::Object(m)
}

/// What the byte figures mean, printed under every table that shows them.
pub(crate) const BYTES_LEGEND: &str = "bytes moved: every message between two ranks, in its wire dtype = from sources (sent by \
     training ranks) + relayed (forwarded by inference ranks to other inference ranks)";

/// A table for the terminal: a header row, then rows of a label (left
/// aligned) and figures (right aligned), columns sized to their widest cell.
pub(crate) struct Table(Vec<Vec<String>>);

impl Table {
    /// A table with these column names (the first heads the labels).
    pub(crate) fn new(header: &[&str]) -> Table {
        Table(vec![header.iter().map(|h| h.to_string()).collect()])
    }

    /// Adds a row: `label`, then one cell per further column.
    pub(crate) fn row(&mut self, label: &str, cells: impl IntoIterator<Item = String>) -> &mut Table {
        self.0.push(std::iter::once(label.to_string()).chain(cells).collect());
        self
    }

    /// Prints the table to stdout.
    pub(crate) fn print(&self) {
        let columns = self.0.iter().map(Vec::len).max().unwrap_or(0);
        let width: Vec<usize> =
            (0..columns).map(|c| self.0.iter().filter_map(|r| r.get(c)).map(|x| x.chars().count()).max().unwrap_or(0)).collect();
        for row in &self.0 {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                if c == 0 {
                    line.push_str(&format!("{cell:<w$}", w = width[0]));
                } else {
                    line.push_str(&format!("   {cell:>w$}", w = width[c]));
                }
            }
            say!("{}", line.trim_end());
        }
    }
}

/// The rows of `refit plan`'s table: a label and how to show it.
type FigureRow = (&'static str, fn(&Figures) -> String);

const FIGURE_ROWS: [FigureRow; 11] = [
    ("bytes moved", |f| human(f.total_bytes)),
    ("  from sources", |f| human(f.src_egress_bytes)),
    ("  relayed", |f| human(f.relayed_bytes())),
    ("cross-node", |f| human(f.cross_node_bytes)),
    ("into each dst node", node_ingress),
    ("most sent off-node by a src rank", |f| human(f.max_src_rank_egress_bytes())),
    ("most sent by a rank", |f| human(f.max_rank_send_bytes)),
    ("most received by a rank", |f| human(f.max_rank_recv_bytes)),
    ("messages", |f| f.messages.to_string()),
    ("most messages per rank", |f| format!("{} out, {} in", f.max_rank_send_messages, f.max_rank_recv_messages)),
    ("rounds (stages)", |f| format!("{} ({})", f.rounds, f.stages)),
];

/// What each destination node takes in from outside it: one figure when
/// every node takes the same, else the least and the most.
fn node_ingress(f: &Figures) -> String {
    let (lo, hi) = (f.dst_node_ingress_bytes.iter().min(), f.dst_node_ingress_bytes.iter().max());
    match (lo, hi) {
        (Some(lo), Some(hi)) if lo != hi => format!("{} to {}", human(*lo), human(*hi)),
        (_, Some(hi)) => human(*hi),
        _ => "-".into(),
    }
}

/// Prints both plans' figures as one table (a column per strategy; a
/// baseline that cannot be planned shows `-` and why under the table),
/// then `extra` rows (a label, the reshard's cell, the baseline's), then
/// the legend.
pub(crate) fn print_figures(reshard: &Figures, baseline: Result<&Figures, String>, extra: Vec<(String, [String; 2])>) {
    let mut table = Table::new(&["", "reshard", "baseline"]);
    for (label, show) in FIGURE_ROWS {
        table.row(label, [show(reshard), baseline.as_ref().map_or_else(|_| "-".into(), |b| show(b))]);
    }
    for (label, cells) in extra {
        table.row(&label, cells);
    }
    table.print();
    say!("{BYTES_LEGEND}");
    if let Err(e) = baseline {
        say!("baseline unavailable: {e}");
    }
}

/// What a command is doing, on stderr while it works: a spinner (or a bar
/// of refits) with the current phase. Hidden when JSON is asked for or
/// stderr is not a terminal, so it never mixes with the output; cleared
/// when dropped.
pub(crate) struct Progress(indicatif::ProgressBar);

impl Progress {
    /// A spinner with the phase after it.
    pub(crate) fn spinner(quiet: bool) -> Progress {
        Progress::new(None, quiet)
    }

    /// A bar of `len` refits with the phase after it.
    pub(crate) fn bar(len: u64, quiet: bool) -> Progress {
        Progress::new(Some(len), quiet)
    }

    fn new(len: Option<u64>, quiet: bool) -> Progress {
        if quiet || !std::io::stderr().is_terminal() {
            return Progress(indicatif::ProgressBar::hidden());
        }
        let (bar, template) = match len {
            Some(len) => (indicatif::ProgressBar::new(len), "[{bar:32.cyan/blue}] {pos}/{len} refits  {msg} {elapsed}"),
            None => (indicatif::ProgressBar::new_spinner(), "{spinner} {msg} {elapsed}"),
        };
        if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
            bar.set_style(style);
        }
        bar.enable_steady_tick(Duration::from_millis(100));
        Progress(bar)
    }

    /// Names what the command does now ("planning reshard", "rep 3/9 reshard").
    pub(crate) fn phase(&self, what: impl Into<std::borrow::Cow<'static, str>>) {
        self.0.set_message(what);
    }

    /// Refits done, on a bar.
    pub(crate) fn set_position(&self, done: u64) {
        self.0.set_position(done);
    }

    /// Runs `f` (which prints to stdout) with the progress line out of the way.
    pub(crate) fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.0.suspend(f)
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

/// Temporary layout files for worker processes, removed when dropped.
pub(crate) struct TempLayouts(pub(crate) PathBuf);

impl Drop for TempLayouts {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl ClusterArgs {
    /// The per-rank network rate of the emulated links, bytes/s.
    pub(crate) fn rank_rate(&self) -> Option<u64> {
        self.emulate_nic_mbps.map(|m| m.saturating_mul(1_000_000))
    }

    /// The per-rank egress caps of our senders: to other nodes at the rank
    /// rate — unless the kernel shapes the network (`--netns`) — and to
    /// ranks of the node at 9 times it.
    pub(crate) fn emulation(&self) -> orchestrator::EgressCaps {
        orchestrator::EgressCaps {
            inter_node_bytes_per_s: self.rank_rate().filter(|_| !self.netns),
            intra_node_bytes_per_s: self.rank_rate().map(|r| r.saturating_mul(9)),
        }
    }

    /// The emulated hosts asked for (`--netns`), checked to be possible
    /// here.
    fn netns(&self) -> Result<Option<NetnsConfig>, Failure> {
        if !self.netns {
            return Ok(None);
        }
        if let Some(p) = self.netem_loss_pct.filter(|p| !(0.0..=100.0).contains(p)) {
            return Err(invalid(format!("--netem-loss-pct {p}: expected a percentage from 0 to 100")));
        }
        let config = NetnsConfig {
            rank_bytes_per_s: self.rank_rate(),
            netem: Netem { delay: self.netem_delay_ms.map(Duration::from_millis), loss_pct: self.netem_loss_pct },
            // This program is `refit`: it watches the hosts in case the
            // launcher is killed outright.
            watchdog: std::env::current_exe().ok(),
        };
        refit_cli::netns::check(&config).map_err(invalid)?;
        Ok(Some(config))
    }

    pub(crate) fn config(&self, src: &Path, dst: &Path, options: PlanOptions, bind: &str, spawn: bool) -> Result<ClusterConfig, Failure> {
        let bind = bind.parse().map_err(|e| invalid(format!("--bind {bind}: {e}")))?;
        if self.netns && !spawn {
            return Err(invalid(
                "--netns starts its workers on emulated hosts: it cannot wait for workers started elsewhere (--no-spawn)".into(),
            ));
        }
        let netns = self.netns()?;
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
                shared_memory: !self.tcp,
                // Links emulated in the senders make the nodes of this
                // machine stand for hosts: only ranks of a node share
                // memory (emulated hosts, namespaces of their own, are
                // told apart anyway).
                same_host: self.emulation().inter_node_bytes_per_s.is_none(),
            },
            strategy: Strategy::Reshard,
            keep_data_plane: !self.fresh_data_plane,
            digest_check: !self.no_digest_check,
            netns,
            replicas: None,
        })
    }
}
