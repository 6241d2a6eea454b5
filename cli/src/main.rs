//! The `refit` command line.

mod cmd;

use clap::{Parser, Subcommand};
use refit_cli::bench::BenchTransport;
use refit_cli::cluster::PerProcess;
use refit_cli::demo::{DemoConfig, DemoMode};
use refit_cli::presets::Model;
use reshard::Strategy;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

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
    /// Most units of planning work (pieces, transfers, overlaps, pairs of
    /// ranks to schedule) before a pair is refused instead of planned.
    /// Default: for layout files, 16 units per byte of them (at least
    /// 2^20: a pair of small files plans in about a second), and never
    /// more than half this machine's available memory holds.
    #[arg(long, value_name = "N")]
    max_plan_work: Option<u64>,
}

/// The layout pair a refit moves between and its strategy (`refit run`,
/// `refit launch`).
#[derive(clap::Args)]
struct PairStrategy {
    #[command(flatten)]
    pair: Pair,
    /// Run the gather-broadcast baseline instead of the reshard.
    #[arg(long)]
    baseline: bool,
}

/// The layout pair a command works on: two files, or a model preset.
#[derive(clap::Args)]
struct LayoutChoice {
    /// Source (training) layout file (or use --model).
    #[arg(long, requires = "dst", conflicts_with = "model")]
    src: Option<PathBuf>,
    /// Destination (inference) layout file.
    #[arg(long, requires = "src")]
    dst: Option<PathBuf>,
    /// A model preset instead of files.
    #[arg(long, value_enum)]
    model: Option<Model>,
}

/// Arguments of `refit bench`.
#[derive(clap::Args)]
struct BenchArgs {
    #[command(flatten)]
    layouts: LayoutChoice,
    /// Divide hidden sizes by this (presets only).
    #[arg(long, default_value_t = 8)]
    scale: u64,
    /// deepseek-v3 and kimi-k2: inference with expert parallelism over EP groups
    /// of N ranks (8, 16, 32, 64 or 128), as vLLM's TP8 x DP N/8
    /// `--enable-expert-parallel`: the routed experts (256 or 384) whole,
    /// spread over each group, the other weights TP8 within each node.
    /// Default: deepseek-v3 TP8 x DP16, experts TP-sharded too; kimi-k2
    /// EP16.
    #[arg(long, value_name = "N", requires = "model", conflicts_with = "src")]
    ep: Option<u32>,
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
    /// Instead: a delta refit against a dense one (reshard, in process),
    /// with this fraction of source elements (0 to 1) changed before each
    /// pair of refits; reports both bytes and times (`--json`:
    /// `delta_bytes`, `dense_bytes`, `delta_s`, `dense_s`).
    #[arg(long, value_name = "F")]
    delta_fraction: Option<f64>,
    /// Instead: refits with the orchestrator's digest check before the
    /// commit against the same without it (reshard, `--transport local`
    /// or `tcp`), two systems side by side, alternating, `--reps` times
    /// after a verified warm-up; reports every time, their ranges and
    /// medians (`--json`: `checked_s`, `unchecked_s`, `verify_s`, lists of
    /// seconds).
    #[arg(long, conflicts_with_all = ["delta_fraction", "fp8_dst"])]
    digest_cost: bool,
    /// Instead: the refit into the destination as given against the same
    /// into its block-scaled FP8 version (every float tensor of 2 or more
    /// dimensions `f8e4m3` in blocks of `--fp8-block`, with an f32 scale
    /// tensor placed like it), reshard in process; reports both bytes and
    /// times (`--json`: `fp8_bytes`, `dense_bytes`, `fp8_s`, `dense_s`).
    #[arg(long)]
    fp8_dst: bool,
    /// With `--fp8-dst`: the block size per dimension.
    #[arg(long, default_value_t = 128, value_name = "N")]
    fp8_block: u64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Arguments of `refit plan`.
#[derive(clap::Args)]
struct PlanCli {
    #[command(flatten)]
    layouts: LayoutChoice,
    /// Divide hidden sizes by this (presets only; 1 = full size).
    #[arg(long, default_value_t = 1)]
    scale: u64,
    /// deepseek-v3 and kimi-k2: inference with expert parallelism over EP groups
    /// of N ranks (8, 16, 32, 64 or 128), as vLLM's TP8 x DP N/8
    /// `--enable-expert-parallel`: the routed experts (256 or 384) whole,
    /// spread over each group, the other weights TP8 within each node.
    /// Default: deepseek-v3 TP8 x DP16, experts TP-sharded too; kimi-k2
    /// EP16.
    #[arg(long, value_name = "N", requires = "model", conflicts_with = "src")]
    ep: Option<u32>,
    /// An anchor's published training -> inference setup instead of the
    /// preset's default layouts, the one they measured a refit on:
    /// deepseek-v3 nemo-rl (NeMo RL: Megatron PP16 x EP16 -> vLLM TP32 x
    /// DP8, 256 -> 256 ranks); kimi-k2 vllm-rdt (vLLM's RDT transfer:
    /// TP8 x PP8 x EP32 -> TP32 x EP32, 256 -> 128 ranks); qwen3-235b
    /// vllm-rdt (TP4 x PP2 x EP8 -> DP16 x EP16, 16 -> 16 ranks).
    /// `--estimate` then quotes their measurement beside the model.
    #[arg(long, value_name = "NAME", requires = "model")]
    setup: Option<String>,
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
    /// Plan into the destination's block-scaled FP8 version instead:
    /// every float tensor of 2 or more dimensions `f8e4m3` in blocks of
    /// N per dimension, with an f32 scale tensor placed like it (as
    /// `refit bench --fp8-dst` does).
    #[arg(long, value_name = "N")]
    fp8_dst: Option<u64>,
    /// Where the reshard quantizes block-scaled FP8 destinations:
    /// `source` (by the source rank that sends a block, for tensors
    /// whose source shards hold whole blocks; codes and scales on the
    /// wire) or `destination` (whole blocks of source values on the
    /// wire). The baseline always quantizes at the destination.
    #[arg(long, value_enum, default_value = "source")]
    quantize_at: QuantizeAtArg,
    /// Most units of planning work (pieces, transfers, overlaps, pairs of
    /// ranks to schedule) before a pair is refused instead of planned.
    /// Default: for layout files, 16 units per byte of them (at least
    /// 2^20: a pair of small files plans in about a second), and never
    /// more than half this machine's available memory holds.
    #[arg(long, value_name = "N")]
    max_plan_work: Option<u64>,
}

/// How `refit launch` and `refit bench --transport process` run workers.
#[derive(clap::Args, Clone)]
struct ClusterArgs {
    /// One worker process per rank or per node.
    #[arg(long, value_enum, default_value = "rank")]
    per_process: PerProcess,
    /// Fail a refit whose data plane takes longer than this, in seconds
    /// (the rendezvous and each control step get the same).
    #[arg(long, default_value_t = orchestrator::DEFAULT_DEADLINE.as_secs())]
    deadline_s: u64,
    /// A CRC-32C on every data frame, checked before the bytes land.
    #[arg(long)]
    checksum: bool,
    /// Open a fresh data plane (listen, connect, shared memory) for every
    /// refit, instead of keeping the connections of a refit that committed
    /// for the next refit of the same plan.
    #[arg(long)]
    fresh_data_plane: bool,
    /// Commit without the orchestrator's digest check (every member reads
    /// back what its run moved; the orchestrator compares them before any
    /// destination commits).
    #[arg(long)]
    no_digest_check: bool,
    /// Every pair of ranks talks TCP, no shared memory (for comparison).
    /// By default ranks of one node share memory, and so do all ranks of a
    /// host of at most 16 of them, whatever their group (both groups on
    /// one machine), unless --emulate-nic-mbps without --netns makes the
    /// nodes stand for different hosts.
    #[arg(long)]
    tcp: bool,
    /// Emulate DGX H100 links at this per-rank network rate, in MB/s:
    /// each rank's egress to other nodes is capped at it, and to ranks of
    /// its own node at 9 times it (per direction: NVLink 4's 450 GB/s vs a
    /// 400 Gb/s = 50 GB/s NIC per GPU). With --netns, each node's link is
    /// shaped instead, at its ranks times this, in both directions.
    #[arg(long)]
    emulate_nic_mbps: Option<u64>,
    /// Run every node on an emulated host: a network namespace of its own,
    /// a veth pair to a bridge, its link shaped by the kernel (tc) in both
    /// directions at its ranks x --emulate-nic-mbps. Needs root, ip and tc.
    #[arg(long)]
    netns: bool,
    /// With --netns: delay added to each node's outgoing packets, in
    /// milliseconds (a tap device per node whose frames the launcher holds;
    /// the kernel needs tun, clsact, cls_bpf and act_mirred).
    #[arg(long, value_name = "MS", requires = "netns")]
    netem_delay_ms: Option<u64>,
    /// With --netns: percentage of each node's outgoing IP packets dropped,
    /// at random (a classic-BPF filter; the kernel needs ifb, clsact,
    /// cls_bpf and act_mirred).
    #[arg(long, value_name = "P", requires = "netns")]
    netem_loss_pct: Option<f64>,
    /// File holding the control-plane secret (default: REFIT_SECRET, or a
    /// fresh random one for workers this launcher starts).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// A control connection with no byte for this long is dead, in
    /// milliseconds (raise it when dozens of processes share few cores).
    #[arg(long, default_value_t = 10000)]
    heartbeat_timeout_ms: u64,
}

/// The inference group as replicas that join and leave (`refit launch`).
#[derive(clap::Args, Clone)]
struct ReplicaArgs {
    /// The inference group is N replicas of the --dst layout (one
    /// replica's ranks, whole nodes): a replica joining is seeded from a
    /// serving one (no training rank sends it anything), a replica whose
    /// worker dies during a refit leaves the group while the others commit,
    /// and is replaced by a fresh one before the next refit. Without
    /// workers started here (--no-spawn), replicas join with `refit worker
    /// --replica NAME` (every rank of it), the first N before the first
    /// refit and any later one before the next refit.
    #[arg(long, value_name = "N")]
    replicas: Option<u32>,
    /// Before refit V, a new replica starts and joins the group. Repeatable.
    #[arg(long, value_name = "V", requires = "replicas")]
    add_replica_at: Vec<u64>,
    /// Before refit V, the group's first replica leaves (its workers stop).
    /// Repeatable.
    #[arg(long, value_name = "V", requires = "replicas")]
    remove_replica_at: Vec<u64>,
    /// The most replicas at once (emulated hosts are made for this many;
    /// default: N plus the number of --add-replica-at).
    #[arg(long, value_name = "M", requires = "replicas")]
    most_replicas: Option<u32>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate both layouts, plan reshard and baseline, print the figures.
    Plan(PlanCli),
    /// Fill sources with a pattern, run one refit, optionally verify.
    Run {
        #[command(flatten)]
        refit: PairStrategy,
        /// Check every destination element.
        #[arg(long)]
        verify: bool,
        /// Commit without the orchestrator's digest check (every member
        /// reads back what its run moved; the orchestrator compares them
        /// before any destination commits).
        #[arg(long)]
        no_digest_check: bool,
        /// Data plane the members open (every rank's member and store in
        /// this process, the orchestrator over them): `local` (in-process
        /// channels), `tcp` (the node fabric over loopback TCP, no shared
        /// memory) or `nccl` (one NCCL communicator, every rank on its own
        /// GPU; a build with `--features cuda`). `ipc` (CUDA IPC joins
        /// processes) and `cuda` (every rank on one GPU: the GPU checks'
        /// executor) are refused here. Where one cannot run, the command
        /// exits 2 with `<NAME> transport unavailable: <reason>`.
        #[arg(long, default_value = "local")]
        transport: String,
        /// Fail if the refit takes longer than this many seconds.
        #[arg(long, default_value_t = orchestrator::DEFAULT_DEADLINE.as_secs())]
        deadline_s: u64,
        /// Print one JSON object: strategy, ranks, bytes moved (from
        /// sources, relayed), messages, rounds, times, verified elements.
        #[arg(long)]
        json: bool,
        /// After the refit, write every destination rank's buffers to DIR:
        /// `DIR/rank<r>/<buffer>.bin` (raw little-endian bytes in the
        /// buffer's dtype) and `DIR/rank<r>/index.json` (each buffer's name,
        /// file, dtype and byte length), to check the result with any tool.
        #[arg(long, value_name = "DIR")]
        dump_dst: Option<std::path::PathBuf>,
        /// A subset refit: after a full refit of the version before (what
        /// a subset refit builds on; not timed), plan and move only these
        /// destination tensors (comma-separated names); `--verify` checks
        /// them (and that the others kept the version before), `--json`'s
        /// `bytes_moved` is theirs alone.
        #[arg(long, value_delimiter = ',', value_name = "NAMES")]
        only: Vec<String>,
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
        /// deepseek-v3 and kimi-k2: inference with expert parallelism over EP groups
        /// of N ranks (8, 16, 32, 64 or 128), as vLLM's TP8 x DP N/8
        /// `--enable-expert-parallel`: the routed experts (256 or 384) whole,
        /// spread over each group, the other weights TP8 within each node.
        /// Default: deepseek-v3 TP8 x DP16, experts TP-sharded too; kimi-k2
        /// EP16.
        #[arg(long, value_name = "N")]
        ep: Option<u32>,
        /// Repetitions (the median is reported).
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Skip planning the baseline.
        #[arg(long)]
        no_baseline: bool,
        /// The inference layout is one replica of a group of N: compare
        /// planning the whole group with deriving its plan from the one
        /// replica's (what an orchestrator does when replicas join or
        /// leave).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        replicas: Option<u32>,
    },
    /// One orchestrator over thousands of members in this process (the
    /// in-process fabric, tiny weights, the model's tensors): planning,
    /// deriving and installing every member's program, each refit's
    /// status, prepare, run and commit, control messages and memory, at
    /// each size; every refit verified on every destination.
    ControllerBench {
        /// The model whose structure the layouts take: deepseek-v3 or kimi-k2.
        #[arg(long, value_enum, default_value = "deepseek-v3")]
        model: Model,
        /// Divide hidden sizes by this (the tensors stay as many).
        #[arg(long, default_value_t = 1024)]
        scale: u64,
        /// The model's first this many layers (training PP16, or fewer
        /// stages with fewer layers).
        #[arg(long, default_value_t = 16)]
        layers: u32,
        /// Ranks on each side, one measurement per value: training PP x
        /// EP16 x DP, inference EP16 instances (TP8 within a node).
        #[arg(long, value_delimiter = ',', default_value = "256,512,1024,2048")]
        ranks: Vec<u32>,
        /// Refits at each size, each verified.
        #[arg(long, default_value_t = 3)]
        refits: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
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
        refit: PairStrategy,
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
        #[command(flatten)]
        replicas: ReplicaArgs,
    },
    /// One rank of `refit demo --processes` (started by it; joins the
    /// rendezvous in REFIT_RENDEZVOUS with the secret in REFIT_SECRET).
    #[command(hide = true)]
    DemoMember {
        /// Trainer or rollout.
        #[arg(long, value_enum)]
        role: refit_cli::demo::DemoRole,
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
        #[arg(long, default_value_t = 10000)]
        heartbeat_timeout_ms: u64,
        /// Join as ranks of the replica named NAME (`--dst` is one
        /// replica's layout) of a launcher run with --replicas.
        #[arg(long, value_name = "NAME")]
        replica: Option<String>,
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
        /// Run the workers on emulated hosts (see `refit launch --netns`;
        /// root, ip and tc) and add the network cases: a link cut and
        /// restored, a node partitioned from the launcher, a peer that
        /// stops reading, packet loss and delay (these two need the
        /// kernel's ifb or tun, clsact, cls_bpf and act_mirred).
        #[arg(long)]
        netns: bool,
        /// Run only the cases whose name contains this (`net:` for the
        /// network cases); repeat for several (they run in the suite's
        /// order).
        #[arg(long, value_name = "TEXT")]
        only: Vec<String>,
        /// Run the cases in an order shuffled by this seed (each case
        /// must keep the promise whatever ran before it).
        #[arg(long, value_name = "SEED")]
        shuffle: Option<u64>,
        /// Run every chosen case this many times (each from a clean
        /// state); prints how often the refits that may survive their
        /// fault (a killed replicated source) committed.
        #[arg(long, default_value_t = 1)]
        repeat: usize,
    },
    /// Emulated hosts (`--netns`): `--clean` removes the namespaces, links
    /// and shared-memory directories of launchers that are gone (killed
    /// outright, their watchdog too), and says what it removed and what it
    /// kept. Needs root, ip and tc.
    Netns {
        /// Remove what launchers that are gone left behind.
        #[arg(long, required_unless_present = "watch")]
        clean: bool,
        /// Internal: the watchdog of launcher PID (its end of the pipe on
        /// standard input).
        #[arg(long, hide = true, value_name = "PID", requires = "token", conflicts_with = "clean")]
        watch: Option<u32>,
        /// Internal: the watched launcher's start time.
        #[arg(long, hide = true, requires = "watch")]
        token: Option<u64>,
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
        /// deepseek-v3 and kimi-k2: inference with expert parallelism over EP groups
        /// of N ranks (8, 16, 32, 64 or 128), as vLLM's TP8 x DP N/8
        /// `--enable-expert-parallel`: the routed experts (256 or 384) whole,
        /// spread over each group, the other weights TP8 within each node.
        /// Default: deepseek-v3 TP8 x DP16, experts TP-sharded too; kimi-k2
        /// EP16.
        #[arg(long, value_name = "N")]
        ep: Option<u32>,
        /// An anchor's published training -> inference setup instead of the
        /// preset's default layouts, the one they measured a refit on:
        /// deepseek-v3 nemo-rl (NeMo RL: Megatron PP16 x EP16 -> vLLM TP32 x
        /// DP8, 256 -> 256 ranks); kimi-k2 vllm-rdt (vLLM's RDT transfer:
        /// TP8 x PP8 x EP32 -> TP32 x EP32, 256 -> 128 ranks); qwen3-235b
        /// vllm-rdt (TP4 x PP2 x EP8 -> DP16 x EP16, 16 -> 16 ranks).
        /// `--estimate` then quotes their measurement beside the model.
        #[arg(long, value_name = "NAME", requires = "model")]
        setup: Option<String>,
        /// Directory to write src.json and dst.json into.
        #[arg(long)]
        out: PathBuf,
    },
}

/// `--quantize-at`: [`reshard::QuantizeAt`] on the command line.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum QuantizeAtArg {
    /// By the source ranks that send a block, where they hold whole blocks.
    Source,
    /// By the destination ranks, from whole blocks of source values.
    Destination,
}

impl From<&QuantizeAtArg> for reshard::QuantizeAt {
    fn from(a: &QuantizeAtArg) -> reshard::QuantizeAt {
        match a {
            QuantizeAtArg::Source => reshard::QuantizeAt::Source,
            QuantizeAtArg::Destination => reshard::QuantizeAt::Destination,
        }
    }
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
    // Warnings (refused connections, failed refits) on standard error;
    // RUST_LOG adjusts. Workers inherit the variable.
    match actors::log::Logger::from_env() {
        Ok(logger) => {
            logger.install();
        }
        Err(e) => {
            eprintln!("refit: {e}");
            return ExitCode::from(2);
        }
    }
    match dispatch(&cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            let line: String =
                f.line.chars().flat_map(|c| if c.is_control() { c.escape_default().collect::<Vec<_>>() } else { vec![c] }).collect();
            eprintln!("error: {line}");
            ExitCode::from(f.code)
        }
    }
}

/// Runs the command given.
fn dispatch(command: &Command) -> Result<(), cmd::report::Failure> {
    match command {
        Command::Plan(a) => cmd::plan::run(&cmd::plan::PlanArgs {
            src: &a.layouts.src,
            dst: &a.layouts.dst,
            model: a.layouts.model,
            scale: a.scale,
            ep: a.ep,
            setup: a.setup.as_deref(),
            max_staging_mib: a.max_staging_mib,
            topology: &a.topology,
            estimate: a.estimate,
            svg: &a.svg,
            json: a.json,
            emit_layouts: &a.emit_layouts,
            fp8_dst: a.fp8_dst,
            quantize_at: (&a.quantize_at).into(),
            max_plan_work: a.max_plan_work,
        }),
        Command::Run { refit: PairStrategy { pair, baseline }, verify, no_digest_check, transport, deadline_s, json, dump_dst, only } => {
            cmd::run::run(&cmd::run::RunArgs {
                pair,
                baseline: *baseline,
                verify: *verify,
                digest_check: !no_digest_check,
                transport,
                deadline_s: *deadline_s,
                json: *json,
                dump_dst: dump_dst.as_deref(),
                only,
            })
        }
        Command::Bench(args) => cmd::bench::run(args),
        Command::Chaos { json, emulate_nic_mbps, deadline_s, netns, only, shuffle, repeat } => cmd::chaos::run(&cmd::chaos::ChaosArgs {
            json: *json,
            nic_mbps: *emulate_nic_mbps,
            deadline_s: *deadline_s,
            netns: *netns,
            only: only.clone(),
            shuffle: *shuffle,
            repeat: *repeat,
        }),
        Command::Netns { clean: _, watch, token } => cmd::netns::run(watch.zip(*token)),
        Command::Soak { src, dst, refits, cluster, json } => cmd::soak::run(src, dst, *refits, cluster, *json),
        Command::PlanBench { model, scale, ep, reps, no_baseline, replicas } => match replicas {
            Some(n) => cmd::plan_bench::replicas(*model, *scale, *ep, *reps, *n),
            None => cmd::plan_bench::run(*model, *scale, *ep, *reps, *no_baseline),
        },
        Command::ControllerBench { model, scale, layers, ranks, refits, json } => {
            cmd::controller_bench::run(&cmd::controller_bench::ControllerArgs {
                model: *model,
                scale: *scale,
                layers: *layers,
                ranks,
                refits: *refits,
                json: *json,
            })
        }
        Command::Emit { model, scale, ep, setup, out } => cmd::emit::run(*model, *scale, *ep, setup.as_deref(), out),
        Command::Launch { refit: PairStrategy { pair, baseline }, verify, refits, fail_fast, json, cluster, bind, no_spawn, replicas } => {
            cmd::launch::run(&cmd::launch::LaunchArgs {
                pair,
                strategy: if *baseline { Strategy::Baseline } else { Strategy::Reshard },
                verify: *verify,
                refits: *refits,
                fail_fast: *fail_fast,
                json: *json,
                cluster,
                bind,
                no_spawn: *no_spawn,
                replicas,
            })
        }
        Command::Worker { pair, group, rank, node, rendezvous, secret_file, heartbeat_timeout_ms, replica } => {
            cmd::launch::worker(&cmd::launch::WorkerArgs {
                pair,
                group,
                rank: *rank,
                node: *node,
                rendezvous: rendezvous.as_deref(),
                heartbeat_timeout: Duration::from_millis(*heartbeat_timeout_ms),
                secret_file,
                replica,
            })
        }
        Command::Demo { steps, batch, lr, seed, mode, no_refit, json, processes } => cmd::demo::run(
            DemoConfig { steps: *steps, batch: *batch, lr: *lr, seed: *seed, mode: *mode, refit: !no_refit, processes: *processes },
            *json,
        ),
        Command::DemoMember { role, rank } => cmd::demo::member(*role, *rank),
    }
}
