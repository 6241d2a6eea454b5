//! The `refit` command line.

use clap::{Parser, Subcommand};
use refit::bench::{exec_bench, link_loads, peak_rss_bytes, BenchTransport, LinkLoads};
use refit::cluster::{run_worker, Cluster, ClusterConfig, ControlSecret, Hosted, PerProcess, WorkerConfig, SECRET_ENV};
use refit::demo::{run_demo, DemoConfig, DemoError, DemoMode, DemoReport};
use refit::presets::{layouts, Model};
use refit::runner::prepare;
use reshard::{parse_layout, plan_baseline, plan_reshard, Figures, Layout, LinkModel, PlanOptions, Strategy};
use serde_json::json;
use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};
use transport::ExecOptions;

#[derive(Parser)]
#[command(name = "refit", version, about = "Reshard training weights into inference layouts")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct Pair {
    /// Source (training) layout file.
    #[arg(long)]
    src: PathBuf,
    /// Destination (inference) layout file.
    #[arg(long)]
    dst: PathBuf,
    /// Most bytes one rank stages per round, in MiB.
    #[arg(long, default_value_t = 256)]
    max_staging_mib: u64,
}

/// Arguments of `refit bench`.
#[derive(clap::Args)]
struct BenchArgs {
    /// Source layout file (or use --model).
    #[arg(long, requires = "dst", conflicts_with = "model")]
    src: Option<PathBuf>,
    /// Destination layout file.
    #[arg(long, requires = "src")]
    dst: Option<PathBuf>,
    /// A model preset instead of files.
    #[arg(long, value_enum)]
    model: Option<Model>,
    /// Divide hidden sizes by this (presets only).
    #[arg(long, default_value_t = 8)]
    scale: u64,
    /// Repetitions after one warm-up.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Most bytes one rank stages per round, in MiB.
    #[arg(long, default_value_t = 256)]
    max_staging_mib: u64,
    /// Data plane: local (in-process, vs a plain memcpy), tcp (every rank a
    /// thread over loopback TCP, vs a raw socket copy) or process (worker
    /// processes, as `refit launch` starts them).
    #[arg(long, value_enum, default_value = "local")]
    transport: BenchTransport,
    /// With `--transport process`: how workers run.
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Draw both plans' traffic matrices (rank and node level) as SVG heat
    /// maps: FILE (reshard) and FILE with `.baseline.svg` (baseline).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// How `refit launch` and `refit bench --transport process` run workers.
#[derive(clap::Args, Clone)]
struct ClusterArgs {
    /// One worker process per rank or per node.
    #[arg(long, value_enum, default_value = "rank")]
    per_process: PerProcess,
    /// Fail a refit whose data plane takes longer than this, in seconds
    /// (the rendezvous and each control step get the same).
    #[arg(long, default_value_t = 120)]
    deadline_s: u64,
    /// A CRC-32C on every data frame, checked before the bytes land.
    #[arg(long)]
    checksum: bool,
    /// Emulate DGX H100 links at this per-rank network rate, in MB/s:
    /// each rank's egress to other nodes is capped at it, and to ranks of
    /// its own node at 9 times it (per direction: NVLink 4's 450 GB/s vs a
    /// 400 Gb/s = 50 GB/s NIC per GPU).
    #[arg(long)]
    emulate_nic_mbps: Option<u64>,
    /// File holding the control-plane secret (default: REFIT_SECRET, or a
    /// fresh random one for workers this launcher starts).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// A control connection with no byte for this long is dead, in
    /// milliseconds (raise it when dozens of processes share few cores).
    #[arg(long, default_value_t = 2000)]
    heartbeat_timeout_ms: u64,
}

impl ClusterArgs {
    /// The per-rank (inter-node, intra-node) egress caps, bytes/s.
    fn emulation(&self) -> Option<(u64, u64)> {
        self.emulate_nic_mbps.map(|m| (m * 1_000_000, m * 9_000_000))
    }

    fn config(&self, src: &Path, dst: &Path, options: PlanOptions, bind: &str, spawn: bool) -> Result<ClusterConfig, Failure> {
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

#[derive(Subcommand)]
enum Command {
    /// Validate both layouts, plan reshard and baseline, print the figures.
    Plan {
        /// Source (training) layout file (or use --model).
        #[arg(long, requires = "dst", conflicts_with = "model")]
        src: Option<PathBuf>,
        /// Destination (inference) layout file.
        #[arg(long, requires = "src")]
        dst: Option<PathBuf>,
        /// A model preset instead of files.
        #[arg(long, value_enum)]
        model: Option<Model>,
        /// Divide hidden sizes by this (presets only; 1 = full size).
        #[arg(long, default_value_t = 1)]
        scale: u64,
        /// Most bytes one rank stages per round, in MiB.
        #[arg(long, default_value_t = 256)]
        max_staging_mib: u64,
        /// Link model: dgx-h100, gb200, or a JSON file
        /// {"net_bytes_per_s": .., "intra_bytes_per_s": .., "message_latency_s": ..}.
        #[arg(long, default_value = "dgx-h100")]
        topology: String,
        /// Also print the estimated refit time of both plans and the lower bound.
        #[arg(long)]
        estimate: bool,
        /// Draw the reshard's traffic matrix (ranks and nodes) as an SVG
        /// heat map into this file (and the baseline's next to it, `.baseline.svg`).
        #[arg(long)]
        svg: Option<PathBuf>,
        /// Print one JSON object {"reshard": {...}, "baseline": {...}}.
        #[arg(long)]
        json: bool,
        /// Also write both layouts (e.g. a preset's) as layout files
        /// DIR/src.json and DIR/dst.json.
        #[arg(long, value_name = "DIR")]
        emit_layouts: Option<PathBuf>,
    },
    /// Fill sources with a pattern, run one refit, optionally verify.
    Run {
        #[command(flatten)]
        pair: Pair,
        /// Run the gather-broadcast baseline instead of the reshard.
        #[arg(long)]
        baseline: bool,
        /// Check every destination element.
        #[arg(long)]
        verify: bool,
        /// Data plane: `local` (in-process, host memory), `tcp` (every rank
        /// a thread, talking over loopback TCP streams) or `cuda` (GPU 0;
        /// needs a build with `--features cuda`).
        #[arg(long, default_value = "local")]
        transport: String,
        /// Fail if the refit takes longer than this many seconds.
        #[arg(long, default_value_t = 600)]
        deadline_s: u64,
    },
    /// Measure reshard and the gather-broadcast baseline side by side
    /// (alternating, medians over repetitions) on one data plane, with a
    /// reference copy of the same bytes (local, tcp) or the link lower bound
    /// (process with --emulate-nic-mbps).
    Bench(BenchArgs),
    /// Time planning (reshard and baseline) on a model preset and report
    /// peak memory.
    PlanBench {
        /// The model preset.
        #[arg(long, value_enum, default_value = "deepseek-v3")]
        model: Model,
        /// Divide hidden sizes by this (1 = full size).
        #[arg(long, default_value_t = 1)]
        scale: u64,
        /// Repetitions (the median is reported).
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Skip planning the baseline.
        #[arg(long)]
        no_baseline: bool,
    },
    /// A small RL loop (contextual bandit, policy MLP) whose rollout ranks
    /// learn only because refit delivers fresh weights after every step:
    /// training TP4 f32 (fused buffer) -> rollout TP2 x DP2 bf16.
    Demo {
        /// Optimizer steps.
        #[arg(long, default_value_t = DemoConfig::default().steps)]
        steps: usize,
        /// Samples per step (a multiple of 2: each rollout replica does half).
        #[arg(long, default_value_t = DemoConfig::default().batch)]
        batch: usize,
        /// SGD learning rate.
        #[arg(long, default_value_t = DemoConfig::default().lr)]
        lr: f32,
        /// Seed of the task, the initial weights and the sampling.
        #[arg(long, default_value_t = DemoConfig::default().seed)]
        seed: u64,
        /// Refit strategy; `both` runs the loop twice from the same seed.
        #[arg(long, value_enum, default_value = "both")]
        mode: DemoMode,
        /// Refit only once, before step 0: rollouts keep the initial policy
        /// (the control: the reward stays flat).
        #[arg(long)]
        no_refit: bool,
        /// Print one JSON object (no progress bar).
        #[arg(long)]
        json: bool,
        /// Every training and rollout rank in an OS process of its own
        /// (actors over the authenticated control plane, weights over
        /// shared memory and TCP).
        #[arg(long)]
        processes: bool,
    },
    /// Start worker processes on this machine (one per rank, or one per
    /// node), meeting at an authenticated control node, moving bytes over
    /// shared memory inside a node and TCP between nodes, and run refits
    /// among them.
    Launch {
        #[command(flatten)]
        pair: Pair,
        /// Run the gather-broadcast baseline instead of the reshard.
        #[arg(long)]
        baseline: bool,
        /// After each refit, every destination rank checks every element it
        /// serves against the version just committed.
        #[arg(long)]
        verify: bool,
        /// Consecutive refits (weights version 1, 2, ...). A failed refit
        /// is reported, dead workers are replaced, and the next one runs.
        #[arg(long, default_value_t = 1)]
        refits: u64,
        /// Stop at the first failed refit (exit code 1).
        #[arg(long)]
        fail_fast: bool,
        /// Print one JSON object: every refit's outcome.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        cluster: ClusterArgs,
        /// Address the control node (rendezvous) listens on.
        #[arg(long, default_value = "127.0.0.1:0")]
        bind: String,
        /// Start no workers: wait for `refit worker --rendezvous ADDR`
        /// processes started elsewhere (e.g. by srun). The secret must then
        /// come from --secret-file or REFIT_SECRET, on both sides.
        #[arg(long)]
        no_spawn: bool,
    },
    /// One rank of `refit demo --processes` (started by it; joins the
    /// rendezvous in REFIT_RENDEZVOUS with the secret in REFIT_SECRET).
    #[command(hide = true)]
    DemoMember {
        /// Trainer or rollout.
        #[arg(long, value_enum)]
        role: refit::demo::DemoRole,
        /// The rank.
        #[arg(long)]
        rank: u32,
    },
    /// One worker of a multi-process refit (started by `refit launch`, or by
    /// a cluster launcher such as srun with the same rendezvous address):
    /// hosts one rank (`--rank`) or every rank of one node (`--node`). The
    /// control-plane secret comes from --secret-file or REFIT_SECRET.
    Worker {
        #[command(flatten)]
        pair: Pair,
        /// `src` or `dst`.
        #[arg(long)]
        group: String,
        /// Rank within the group.
        #[arg(long, required_unless_present = "node", conflicts_with = "node")]
        rank: Option<u32>,
        /// Node within the group (its `ranks_per_node` ranks).
        #[arg(long)]
        node: Option<u32>,
        /// The launcher's rendezvous address (host:port; default:
        /// REFIT_RENDEZVOUS).
        #[arg(long)]
        rendezvous: Option<String>,
        /// File holding the control-plane secret (default: REFIT_SECRET).
        #[arg(long)]
        secret_file: Option<PathBuf>,
        /// A control connection with no byte for this long is dead, in
        /// milliseconds.
        #[arg(long, default_value_t = 2000)]
        heartbeat_timeout_ms: u64,
    },
    /// The chaos suite: kill worker processes at each phase of a refit and
    /// inject data-plane faults (stall, hanging abort, cut, corrupt frame,
    /// a member back with another layout); check every refit fails within
    /// its deadline, no destination holds a torn version, and the next
    /// refit recovers. Exit code 1 if any case breaks the promise.
    Chaos {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Per-rank network rate of the emulated links, MB/s (slow enough
        /// that a refit can be killed in the middle).
        #[arg(long, default_value_t = 2)]
        emulate_nic_mbps: u64,
        /// Data-plane deadline of each refit, in seconds.
        #[arg(long, default_value_t = 5)]
        deadline_s: u64,
    },
    /// Many consecutive refits on the multi-process path, each verified
    /// before it commits; reports resident memory, file descriptors and
    /// threads of the launcher and its workers after the first refit and
    /// after the last.
    Soak {
        /// Layout files (default: the chaos suite's small pair).
        #[arg(long, requires = "dst")]
        src: Option<PathBuf>,
        /// Destination layout file.
        #[arg(long, requires = "src")]
        dst: Option<PathBuf>,
        /// Number of refits.
        #[arg(long, default_value_t = 1000)]
        refits: u64,
        #[command(flatten)]
        cluster: ClusterArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write a model preset's layouts as layout files.
    Emit {
        /// The model preset.
        #[arg(long, value_enum)]
        model: Model,
        /// Divide hidden sizes by this.
        #[arg(long, default_value_t = 1)]
        scale: u64,
        /// Directory to write src.json and dst.json into.
        #[arg(long)]
        out: PathBuf,
    },
}

/// A failure to report: one line, and the exit code.
struct Failure {
    line: String,
    code: u8,
}

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

fn invalid(line: String) -> Failure {
    Failure { line, code: 2 }
}

fn load(path: &Path) -> Result<Layout, Failure> {
    let text = std::fs::read_to_string(path).map_err(|e| invalid(format!("{}: cannot read: {e}", path.display())))?;
    parse_layout(&text).map_err(|e| invalid(format!("{}: {e}", path.display())))
}

fn options(pair: &Pair) -> Result<PlanOptions, Failure> {
    let bytes = pair
        .max_staging_mib
        .checked_mul(1 << 20)
        .filter(|&b| b > 0)
        .ok_or_else(|| invalid("--max-staging-mib must be between 1 and 2^44".into()))?;
    Ok(PlanOptions { max_staging_bytes: bytes, ..PlanOptions::default() })
}

fn figures_json(f: &Figures) -> serde_json::Value {
    json!({
        "src_egress_bytes": f.src_egress_bytes,
        "dst_node_ingress_bytes": f.dst_node_ingress_bytes,
        "cross_node_bytes": f.cross_node_bytes,
        "max_rank_send_bytes": f.max_rank_send_bytes,
        "max_rank_recv_bytes": f.max_rank_recv_bytes,
        "messages": f.messages,
        "total_bytes": f.total_bytes,
        "rounds": f.rounds,
        "stages": f.stages,
        "pieces": f.pieces,
    })
}

fn human(bytes: u64) -> String {
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

fn print_figures(name: &str, f: &Figures) {
    let ingress: Vec<String> = f.dst_node_ingress_bytes.iter().map(|&b| human(b)).collect();
    say!("{name}:");
    say!("  src egress          {}", human(f.src_egress_bytes));
    say!("  dst node ingress    [{}]", ingress.join(", "));
    say!("  cross-node          {}", human(f.cross_node_bytes));
    say!("  max rank send/recv  {} / {}", human(f.max_rank_send_bytes), human(f.max_rank_recv_bytes));
    say!("  messages            {} in {} rounds ({} stages)", f.messages, f.rounds, f.stages);
}

#[cfg(feature = "cuda")]
fn execute_cuda(prepared: &mut refit::runner::Prepared) -> Result<transport::ExecReport, refit::runner::RunError> {
    prepared.execute_cuda()
}

#[cfg(not(feature = "cuda"))]
fn execute_cuda(_: &mut refit::runner::Prepared) -> Result<transport::ExecReport, refit::runner::RunError> {
    // cuda_available() already refused: this build has no GPU data plane.
    Err(refit::runner::RunError::Gpu("built without the cuda feature".into()))
}

/// Arguments of `refit plan`.
struct PlanArgs<'a> {
    src: &'a Option<PathBuf>,
    dst: &'a Option<PathBuf>,
    model: Option<Model>,
    scale: u64,
    max_staging_mib: u64,
    topology: &'a str,
    estimate: bool,
    svg: &'a Option<PathBuf>,
    json: bool,
    emit_layouts: &'a Option<PathBuf>,
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

fn cmd_plan(args: &PlanArgs<'_>) -> Result<(), Failure> {
    let (src, dst, what) = match (args.src, args.dst, args.model) {
        (Some(s), Some(d), _) => (load(s)?, load(d)?, format!("{} -> {}", s.display(), d.display())),
        (_, _, Some(m)) => {
            let (s, d) = preset(m, args.scale)?;
            (s, d, format!("{m:?} scale {}", args.scale))
        }
        _ => return Err(invalid("give --src and --dst, or --model".into())),
    };
    if let Some(dir) = args.emit_layouts {
        write_layouts(&src, &dst, dir)?;
        if !args.json {
            say!("wrote {}/src.json and dst.json", dir.display());
        }
    }
    let links = topology(args.topology)?;
    let bytes = args
        .max_staging_mib
        .checked_mul(1 << 20)
        .filter(|&b| b > 0)
        .ok_or_else(|| invalid("--max-staging-mib must be between 1 and 2^44".into()))?;
    let opts = PlanOptions { max_staging_bytes: bytes, links };
    let ctx = |e: reshard::PlanError| invalid(format!("{what}: {e}"));
    let reshard = plan_reshard(&src, &dst, &opts).map_err(ctx)?;
    // The baseline may be impossible where the reshard is not (it gathers
    // whole tensors); that is reported, not fatal.
    let baseline = plan_baseline(&src, &dst, &opts);
    if let Some(path) = args.svg {
        let write = |p: &Path, plan: &reshard::Plan| {
            std::fs::write(p, refit::svg::traffic_svg(plan, &what)).map_err(|e| invalid(format!("{}: cannot write: {e}", p.display())))
        };
        write(path, &reshard)?;
        if let Ok(b) = &baseline {
            write(&path.with_extension("baseline.svg"), b)?;
        }
    }
    let r_est = reshard.estimate(&links);
    let b_est = baseline.as_ref().ok().map(|b| b.estimate(&links));
    if args.json {
        let (b, err) = match &baseline {
            Ok(b) => (figures_json(b.figures()), serde_json::Value::Null),
            Err(e) => (serde_json::Value::Null, json!(e.to_string())),
        };
        let mut out = json!({"reshard": figures_json(reshard.figures()), "baseline": b, "baseline_error": err});
        if args.estimate {
            out["estimate"] = json!({
                "topology": args.topology,
                "reshard_s": r_est.seconds,
                "baseline_s": b_est.map(|e| e.seconds),
                "lower_bound_s": r_est.lower_bound_seconds,
            });
        }
        say!("{out}");
        return Ok(());
    }
    say!(
        "{} src ranks ({} nodes) -> {} dst ranks ({} nodes), {} tensors, fingerprint {}",
        src.ranks(),
        src.nodes(),
        dst.ranks(),
        dst.nodes(),
        dst.tensors().len(),
        reshard.fingerprint()
    );
    print_figures("reshard", reshard.figures());
    match &baseline {
        Ok(b) => print_figures("baseline", b.figures()),
        Err(e) => say!("baseline: unavailable: {e}"),
    }
    if args.estimate {
        say!("estimate ({} links, model):", args.topology);
        say!("  reshard      {:>10.3} ms", r_est.seconds * 1e3);
        if let Some(b) = b_est {
            say!("  baseline     {:>10.3} ms  ({:.2}x the reshard)", b.seconds * 1e3, b.seconds / r_est.seconds.max(1e-12));
        }
        say!(
            "  lower bound  {:>10.3} ms  (reshard efficiency {:.2})",
            r_est.lower_bound_seconds * 1e3,
            r_est.lower_bound_seconds / r_est.seconds.max(1e-12)
        );
    }
    Ok(())
}

fn cmd_run(pair: &Pair, baseline: bool, verify: bool, transport: &str, deadline_s: u64) -> Result<(), Failure> {
    match transport {
        "local" | "tcp" => {}
        "cuda" => transport::cuda_available().map_err(|e| invalid(format!("CUDA transport unavailable: {e}")))?,
        other => return Err(invalid(format!("--transport {other}: unknown transport (available: local, tcp, cuda)"))),
    }
    let (src, dst) = (load(&pair.src)?, load(&pair.dst)?);
    let opts = options(pair)?;
    let strategy = if baseline { Strategy::Baseline } else { Strategy::Reshard };
    let mut prepared =
        prepare(&src, &dst, strategy, &opts).map_err(|e| invalid(format!("{} -> {}: {e}", pair.src.display(), pair.dst.display())))?;
    let exec = ExecOptions { deadline: Duration::from_secs(deadline_s) };
    let report = match transport {
        "cuda" => execute_cuda(&mut prepared),
        "tcp" => prepared.execute_tcp(&exec),
        _ => prepared.execute(&exec),
    }
    .map_err(|e| Failure { line: e.to_string(), code: 1 })?;
    let secs = report.elapsed.as_secs_f64();
    let f = prepared.plan.figures();
    say!(
        "{strategy}: {} src ranks -> {} dst ranks, {} tensors, {} moved in {} messages, {} rounds",
        src.ranks(),
        dst.ranks(),
        dst.tensors().len(),
        human(report.bytes),
        report.messages,
        f.rounds
    );
    say!(
        "time {:.3} ms, {:.2} GiB/s (plan {:.3} ms)",
        secs * 1e3,
        report.bytes as f64 / secs.max(1e-12) / (1u64 << 30) as f64,
        prepared.plan_time.as_secs_f64() * 1e3
    );
    if verify {
        let n = prepared.verify(&src, &dst).map_err(|e| Failure { line: e.to_string(), code: 1 })?;
        say!("verify: all {n} destination elements match");
    }
    Ok(())
}

fn preset(model: Model, scale: u64) -> Result<(Layout, Layout), Failure> {
    layouts(model, scale).map_err(|e| invalid(format!("preset {model:?} at scale {scale}: {e}")))
}

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

/// Temporary layout files for worker processes, removed when dropped.
struct TempLayouts(PathBuf);

impl Drop for TempLayouts {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn cmd_bench(a: &BenchArgs) -> Result<(), Failure> {
    let (s, d, what) = match (&a.src, &a.dst, a.model) {
        (Some(s), Some(d), _) => (load(s)?, load(d)?, format!("{} -> {}", s.display(), d.display())),
        (_, _, Some(m)) => {
            let (s, d) = preset(m, a.scale)?;
            (s, d, format!("{m:?} scale {}", a.scale))
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
        cluster.shutdown();
        let b = b.map_err(|e| fail(e.to_string()))?;
        let ratio = b.baseline.as_secs_f64() / b.reshard.as_secs_f64();
        let efficiency = bound.map(|lb| lb / b.reshard.as_secs_f64());
        if a.json {
            say!(
                "{}",
                json!({
                    "workload": what, "reps": b.reps, "transport": "process", "workers": b.workers,
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

fn cmd_plan_bench(model: Model, scale: u64, reps: usize, no_baseline: bool) -> Result<(), Failure> {
    let t = Instant::now();
    let (src, dst) = preset(model, scale)?;
    let build = t.elapsed();
    let opts = PlanOptions::default();
    let mut times = Vec::new();
    let mut figures = None;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let plan = plan_reshard(&src, &dst, &opts).map_err(|e| invalid(e.to_string()))?;
        times.push(t.elapsed());
        figures = Some(plan.figures().clone());
        drop(plan);
    }
    times.sort();
    let f = figures.unwrap_or_default();
    say!(
        "{model:?} scale {scale}: {} tensors, {} src ranks -> {} dst ranks (layouts built in {:.3} s)",
        dst.tensors().len(),
        src.ranks(),
        dst.ranks(),
        build.as_secs_f64()
    );
    say!(
        "  reshard plan: median {:.3} s over {} reps; {} pieces, {} transfers, {} messages, {} rounds",
        times[times.len() / 2].as_secs_f64(),
        times.len(),
        f.pieces,
        f.transfers,
        f.messages,
        f.rounds
    );
    say!(
        "  reshard moves {} ({} into the busiest dst node)",
        human(f.total_bytes),
        human(f.dst_node_ingress_bytes.iter().copied().max().unwrap_or(0))
    );
    if let Some(peak) = peak_rss_bytes() {
        say!("  peak resident memory after reshard planning: {}", human(peak));
    }
    if !no_baseline {
        let t = Instant::now();
        let base = plan_baseline(&src, &dst, &opts).map_err(|e| invalid(e.to_string()))?;
        say!(
            "  baseline plan: {:.3} s; {} transfers, moves {}",
            t.elapsed().as_secs_f64(),
            base.figures().transfers,
            human(base.figures().total_bytes)
        );
    }
    Ok(())
}

struct LaunchArgs<'a> {
    pair: &'a Pair,
    strategy: Strategy,
    verify: bool,
    refits: u64,
    fail_fast: bool,
    json: bool,
    cluster: &'a ClusterArgs,
    bind: &'a str,
    no_spawn: bool,
}

fn cmd_launch(a: &LaunchArgs<'_>) -> Result<(), Failure> {
    let (src, dst) = (load(&a.pair.src)?, load(&a.pair.dst)?);
    let mut config = a.cluster.config(&a.pair.src, &a.pair.dst, options(a.pair)?, a.bind, !a.no_spawn)?;
    config.strategy = a.strategy;
    let t = Instant::now();
    let ranks = src.ranks() + dst.ranks();
    let (quiet, no_spawn) = (a.json, a.no_spawn);
    let mut cluster = Cluster::start(config, src, dst, |addr| {
        if no_spawn && !quiet {
            say!("rendezvous listening on {addr}: start workers covering all {ranks} ranks with `refit worker --rendezvous {addr} ...`");
        }
    })
    .map_err(|e| Failure { line: e.to_string(), code: 1 })?;
    let workers = cluster.workers().len();
    let mut outcomes = Vec::new();
    let mut walls = Vec::new();
    let mut bytes = 0;
    for version in 1..=a.refits.max(1) {
        let t = Instant::now();
        // Replace workers that died since the last refit (a failure here is
        // this refit's failure) — unless the first failure ends the launch.
        let r =
            if a.fail_fast { cluster.refit(version, a.verify) } else { cluster.recover().and_then(|_| cluster.refit(version, a.verify)) };
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let error = r.as_ref().err().map(|e| e.to_string());
        if let Ok(o) = &r {
            walls.push(o.report.wall);
            bytes = o.report.bytes;
        }
        if !a.json {
            match &r {
                Ok(o) => say!(
                    "refit {version}: ok in {ms:.1} ms{}",
                    o.verified.map_or(String::new(), |n| format!(", {n} destination elements verified"))
                ),
                Err(e) => say!("refit {version}: FAILED in {ms:.1} ms: {e}"),
            }
        }
        outcomes.push(json!({"version": version, "ok": r.is_ok(), "error": error, "ms": ms}));
        if r.is_err() && a.fail_fast {
            break;
        }
    }
    cluster.shutdown();
    let last_ok = outcomes.last().is_some_and(|o| o["ok"] == true) && outcomes.len() as u64 == a.refits.max(1);
    let verified = a.verify && last_ok;
    let failed = outcomes.iter().filter(|o| o["ok"] == false).count();
    if a.json {
        say!("{}", json!({"refits": outcomes, "verified": verified}));
    } else {
        say!("{}: {workers} worker processes ({ranks} ranks), {} moved per refit", a.strategy, human(bytes));
        if !walls.is_empty() {
            walls.sort();
            let median = walls[walls.len() / 2];
            say!(
                "{} refit(s), {failed} failed: median {:.3} ms ({:.2} GiB/s), slowest {:.3} ms; whole launch {:.3} s",
                outcomes.len(),
                median.as_secs_f64() * 1e3,
                bytes as f64 / median.as_secs_f64().max(1e-12) / (1u64 << 30) as f64,
                walls[walls.len() - 1].as_secs_f64() * 1e3,
                t.elapsed().as_secs_f64()
            );
        }
        if verified {
            say!("verify: the committed weights of version {} match on every destination rank", a.refits.max(1));
        }
    }
    if last_ok {
        Ok(())
    } else {
        Err(Failure { line: format!("{failed} of {} refit(s) failed, the last one among them", outcomes.len()), code: 1 })
    }
}

fn cmd_worker(
    pair: &Pair,
    group: &str,
    rank: Option<u32>,
    node: Option<u32>,
    rendezvous: Option<&str>,
    heartbeat_timeout: Duration,
    secret_file: &Option<PathBuf>,
) -> Result<(), Failure> {
    let (src, dst) = (load(&pair.src)?, load(&pair.dst)?);
    let group = match group {
        "src" => reshard::Group::Src,
        "dst" => reshard::Group::Dst,
        other => return Err(invalid(format!("--group {other}: expected src or dst"))),
    };
    let hosted = match (rank, node) {
        (Some(r), _) => Hosted::Rank(reshard::Endpoint { group, rank: r }),
        (None, Some(n)) => Hosted::Node(group, n),
        (None, None) => return Err(invalid("give --rank or --node".into())),
    };
    hosted.endpoints(&src, &dst).map_err(invalid)?;
    let rendezvous = match rendezvous {
        Some(r) => r.to_string(),
        None => std::env::var(orchestrator::rendezvous::RENDEZVOUS_ENV)
            .map_err(|_| invalid(format!("give --rendezvous or set {}", orchestrator::rendezvous::RENDEZVOUS_ENV)))?,
    };
    let rendezvous = rendezvous.parse().map_err(|e| invalid(format!("--rendezvous {rendezvous}: {e}")))?;
    let secret = match secret_file {
        Some(f) => ControlSecret::from_file(f),
        None => ControlSecret::from_env(SECRET_ENV),
    }
    .and_then(|s| s.secret())
    .map_err(|e| invalid(format!("control-plane secret: {e}")))?;
    let control = orchestrator::rendezvous::ControlConfig { heartbeat_timeout: heartbeat_timeout.max(Duration::from_millis(500)) };
    let config = WorkerConfig { hosted, join: orchestrator::JoinConfig { rendezvous, secret, control } };
    run_worker(config, src, dst).map_err(|e| Failure { line: e, code: 1 })
}

fn cmd_chaos(as_json: bool, nic_mbps: u64, deadline_s: u64) -> Result<(), Failure> {
    // The suite's own layouts: TP2xDP... on 8 training ranks (2 nodes) to 4
    // inference ranks; the "different layout" is another pair.
    const SRC: &str = include_str!("../examples/tp-to-tp/src.json");
    const DST: &str = include_str!("../examples/tp-to-tp/dst.json");
    const WRONG: &str = include_str!("../examples/mixed-2d/dst.json");
    let fail = |e: String| Failure { line: e, code: 1 };
    let dir = std::env::temp_dir().join(format!("refit-chaos-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    let _temp = TempLayouts(dir.clone());
    for (name, text) in [("src.json", SRC), ("dst.json", DST), ("wrong.json", WRONG)] {
        std::fs::write(dir.join(name), text).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    }
    let (src, dst) = (load(&dir.join("src.json"))?, load(&dir.join("dst.json"))?);
    let args = ClusterArgs {
        per_process: PerProcess::Rank,
        deadline_s: deadline_s.max(1),
        checksum: true,
        emulate_nic_mbps: Some(nic_mbps.max(1)),
        secret_file: None,
        heartbeat_timeout_ms: 2000,
    };
    let mut cluster = args.config(&dir.join("src.json"), &dir.join("dst.json"), PlanOptions::default(), "127.0.0.1:0", true)?;
    cluster.setup_timeout = Duration::from_secs(10);
    // A peer killed before it connects fails the connect step after this.
    cluster.fabric.connect_timeout = Duration::from_secs(5);
    let config = refit::chaos::ChaosConfig {
        cluster,
        mid_transfer: Duration::from_millis(200),
        wrong_layouts: (dir.join("src.json"), dir.join("wrong.json")),
    };
    if !as_json {
        say!("{:<40} {:>7} {:>9} {:>6} {:>5} {:>9}  detail", "case", "failed", "elapsed", "hang", "torn", "recovered");
    }
    let yes = |b: bool| if b { "yes" } else { "no" };
    let rows = refit::chaos::run_chaos(config, src, dst, |r| {
        if !as_json {
            say!(
                "{:<40} {:>7} {:>7.0}ms {:>6} {:>5} {:>9}  {}",
                r.case,
                r.refit_failed.map_or("-", yes),
                r.elapsed.as_secs_f64() * 1e3,
                yes(!r.within_deadline),
                yes(r.torn),
                yes(r.recovered),
                r.detail
            );
        }
    })
    .map_err(|e| fail(e.to_string()))?;
    let good = |r: &refit::chaos::ChaosRow| r.within_deadline && !r.torn && r.recovered;
    let ok = rows.iter().filter(|r| good(r)).count();
    if as_json {
        let list: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                json!({
                    "case": r.case, "refit_failed": r.refit_failed, "elapsed_s": r.elapsed.as_secs_f64(),
                    "hang": !r.within_deadline, "torn": r.torn, "recovered": r.recovered,
                    "versions": r.versions, "detail": r.detail,
                })
            })
            .collect();
        say!("{}", json!({"cases": list, "passed": ok, "total": rows.len()}));
    } else {
        say!("{ok} of {} cases kept the promise (no hang, no torn version, recovered)", rows.len());
    }
    if ok == rows.len() {
        Ok(())
    } else {
        Err(Failure { line: format!("{} chaos case(s) broke the promise", rows.len() - ok), code: 1 })
    }
}

/// A progress bar on stderr when it is a terminal and no JSON is asked for.
fn progress_bar(len: u64, quiet: bool) -> indicatif::ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template("[{bar:32.cyan/blue}] {pos}/{len} refits {elapsed}") {
        bar.set_style(style);
    }
    bar
}

fn cmd_soak(src: &Option<PathBuf>, dst: &Option<PathBuf>, refits: u64, args: &ClusterArgs, as_json: bool) -> Result<(), Failure> {
    let fail = |e: String| Failure { line: e, code: 1 };
    let dir = std::env::temp_dir().join(format!("refit-soak-{}", std::process::id()));
    let _temp = TempLayouts(dir.clone());
    let (sp, dp) = match (src, dst) {
        (Some(s), Some(d)) => (s.clone(), d.clone()),
        _ => {
            std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
            std::fs::write(dir.join("src.json"), include_str!("../examples/tp-to-tp/src.json")).map_err(|e| fail(e.to_string()))?;
            std::fs::write(dir.join("dst.json"), include_str!("../examples/tp-to-tp/dst.json")).map_err(|e| fail(e.to_string()))?;
            (dir.join("src.json"), dir.join("dst.json"))
        }
    };
    let (s, d) = (load(&sp)?, load(&dp)?);
    let config = args.config(&sp, &dp, PlanOptions::default(), "127.0.0.1:0", true)?;
    let bar = progress_bar(refits, as_json);
    let r = refit::soak::run_soak(config, s, d, refits, |n| bar.set_position(n)).map_err(|e| fail(e.to_string()));
    bar.finish_and_clear();
    let r = r?;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    if as_json {
        let res = |x: &refit::soak::Resources| json!({"rss_bytes": x.rss_bytes, "fds": x.fds, "threads": x.threads});
        say!(
            "{}",
            json!({
                "refits": r.refits, "workers": r.workers, "verified_elements": r.verified,
                "first": res(&r.first), "last": res(&r.last),
                "median_s": r.median.as_secs_f64(), "slowest_s": r.slowest.as_secs_f64(), "elapsed_s": r.elapsed.as_secs_f64(),
            })
        );
    } else {
        say!(
            "soak: {} refits on {} worker processes, every one verified before commit ({} elements in all)",
            r.refits,
            r.workers,
            r.verified
        );
        say!(
            "  refit time: median {:.1} ms, slowest {:.1} ms; whole soak {:.1} s",
            r.median.as_secs_f64() * 1e3,
            r.slowest.as_secs_f64() * 1e3,
            r.elapsed.as_secs_f64()
        );
        say!(
            "  after refit 1:    RSS {:>8.1} MiB  fds {:>5}  threads {:>5}  (launcher + workers)",
            mib(r.first.rss_bytes),
            r.first.fds,
            r.first.threads
        );
        say!("  after refit {:<5} RSS {:>8.1} MiB  fds {:>5}  threads {:>5}", r.refits, mib(r.last.rss_bytes), r.last.fds, r.last.threads);
    }
    Ok(())
}

/// Writes `out/src.json` and `out/dst.json`.
fn write_layouts(src: &Layout, dst: &Layout, out: &Path) -> Result<(), Failure> {
    std::fs::create_dir_all(out).map_err(|e| invalid(format!("{}: cannot create: {e}", out.display())))?;
    for (name, l) in [("src.json", src), ("dst.json", dst)] {
        let path = out.join(name);
        std::fs::write(&path, reshard::layout_to_json(l).to_string())
            .map_err(|e| invalid(format!("{}: cannot write: {e}", path.display())))?;
    }
    Ok(())
}

fn cmd_emit(model: Model, scale: u64, out: &Path) -> Result<(), Failure> {
    let (src, dst) = preset(model, scale)?;
    write_layouts(&src, &dst, out)?;
    say!("wrote {}/src.json and dst.json ({} tensors)", out.display(), dst.tensors().len());
    Ok(())
}

fn print_demo(report: &DemoReport) {
    let c = &report.config;
    say!(
        "refit demo: contextual bandit ({} contexts, {} actions), policy MLP {}-{}-{}",
        refit::demo::CONTEXTS,
        refit::demo::ACTIONS,
        refit::demo::DIM,
        refit::demo::HIDDEN,
        refit::demo::ACTIONS
    );
    say!("  training: TP4 f32 on 4 ranks (2 nodes), fused buffer 'params' -> rollout: TP2 x DP2 bf16 on 4 ranks (2 nodes)");
    say!(
        "  {} steps, batch {}, lr {}, seed {}, {}",
        c.steps,
        c.batch,
        c.lr,
        c.seed,
        if c.refit { "refit after every step" } else { "NO refit after the initial one (control)" }
    );
    say!("");
    say!(
        "  {:<9} {:>12} {:>11} {:>14} {:>13} {:>14}",
        "mode",
        "reward start",
        "reward end",
        "refit median",
        "bytes/refit",
        "served at end"
    );
    for run in &report.runs {
        let s = &run.summary;
        let served = run.steps.last().map_or(0, |r| r.version_served);
        let (ms, bytes) = if c.refit {
            (format!("{:.3} ms", s.median_refit_ms), human(s.median_refit_bytes))
        } else {
            ("-".to_string(), "-".to_string())
        };
        say!(
            "  {:<9} {:>12.3} {:>11.3} {:>14} {:>13} {:>14}",
            run.mode.to_string(),
            s.reward_start,
            s.reward_end,
            ms,
            bytes,
            format!("v{served}")
        );
    }
    say!("");
    say!(
        "  reward start/end: mean of the first/last {} steps; chance is {:.3}",
        refit::demo::SUMMARY_WINDOW,
        1.0 / refit::demo::ACTIONS as f64
    );
    if let (true, Some(r), Some(b)) = (c.refit, report.run(Strategy::Reshard), report.run(Strategy::Baseline)) {
        let same = if report.identical_rewards() { "identical" } else { "DIFFERENT" };
        say!("  rewards step by step, reshard vs baseline: {same} (the same weights are delivered)");
        if r.summary.median_refit_bytes > 0 && r.summary.median_refit_ms > 0.0 {
            say!(
                "  baseline / reshard: {:.2}x the bytes, {:.2}x the time per refit",
                b.summary.median_refit_bytes as f64 / r.summary.median_refit_bytes as f64,
                b.summary.median_refit_ms / r.summary.median_refit_ms
            );
        }
    }
    if !c.refit {
        say!("  without refit the rollout ranks keep serving version 1: the policy they sample from never changes");
    }
}

#[allow(clippy::too_many_arguments)]
fn cmd_demo(config: DemoConfig, as_json: bool) -> Result<(), Failure> {
    let progress = !as_json && std::io::stdout().is_terminal();
    let report = run_demo(config, progress).map_err(|e| match e {
        DemoError::Config(_) => invalid(e.to_string()),
        other => Failure { line: other.to_string(), code: 1 },
    })?;
    if as_json {
        say!("{}", report.to_json());
    } else {
        print_demo(&report);
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let result = match &cli.command {
        Command::Plan { src, dst, model, scale, max_staging_mib, topology, estimate, svg, json, emit_layouts } => cmd_plan(&PlanArgs {
            src,
            dst,
            model: *model,
            scale: *scale,
            max_staging_mib: *max_staging_mib,
            topology,
            estimate: *estimate,
            svg,
            json: *json,
            emit_layouts,
        }),
        Command::Run { pair, baseline, verify, transport, deadline_s } => cmd_run(pair, *baseline, *verify, transport, *deadline_s),
        Command::Bench(args) => cmd_bench(args),
        Command::Chaos { json, emulate_nic_mbps, deadline_s } => cmd_chaos(*json, *emulate_nic_mbps, *deadline_s),
        Command::Soak { src, dst, refits, cluster, json } => cmd_soak(src, dst, *refits, cluster, *json),
        Command::PlanBench { model, scale, reps, no_baseline } => cmd_plan_bench(*model, *scale, *reps, *no_baseline),
        Command::Emit { model, scale, out } => cmd_emit(*model, *scale, out),
        Command::Launch { pair, baseline, verify, refits, fail_fast, json, cluster, bind, no_spawn } => cmd_launch(&LaunchArgs {
            pair,
            strategy: if *baseline { Strategy::Baseline } else { Strategy::Reshard },
            verify: *verify,
            refits: *refits,
            fail_fast: *fail_fast,
            json: *json,
            cluster,
            bind,
            no_spawn: *no_spawn,
        }),
        Command::Worker { pair, group, rank, node, rendezvous, secret_file, heartbeat_timeout_ms } => {
            cmd_worker(pair, group, *rank, *node, rendezvous.as_deref(), Duration::from_millis(*heartbeat_timeout_ms), secret_file)
        }
        Command::Demo { steps, batch, lr, seed, mode, no_refit, json, processes } => cmd_demo(
            DemoConfig { steps: *steps, batch: *batch, lr: *lr, seed: *seed, mode: *mode, refit: !no_refit, processes: *processes },
            *json,
        ),
        Command::DemoMember { role, rank } => {
            refit::demo::run_demo_member(*role, *rank).map_err(|e| Failure { line: e.to_string(), code: 1 })
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            let line: String =
                f.line.chars().flat_map(|c| if c.is_control() { c.escape_default().collect::<Vec<_>>() } else { vec![c] }).collect();
            eprintln!("error: {line}");
            ExitCode::from(f.code)
        }
    }
}
