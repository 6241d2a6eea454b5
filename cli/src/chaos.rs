//! The chaos suite: real worker processes, real faults. Each case breaks
//! one refit on purpose (killing a worker by its pid at a given phase, or
//! injecting a fault into one worker's data plane) and then checks the
//! promise: the refit fails within its deadline (no hang), every live
//! destination rank holds exactly one committed weights version (no torn
//! version), and the next refit, after automatic recovery, succeeds.
//! Every case starts from a clean state (see [`run_chaos`]), so the cases
//! keep the promise in any order (`--shuffle`).

use crate::cluster::{kill_pid, Cluster, ClusterConfig, ClusterError, Disrupt, Disruption, FaultSpec, ReplicaConfig};
use crate::netns::Netem;
use orchestrator::{RefitReport, RefitStep};
use reshard::{Endpoint, Group, Layout, PlanOptions};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// One chaos case and what it showed.
#[derive(Clone, Debug)]
pub struct ChaosRow {
    /// What was done.
    pub case: String,
    /// The broken refit failed (`Some(true)`), or succeeded anyway
    /// (`Some(false)`: the fault came too late to matter); `None` when the
    /// case breaks nothing but the idle cluster.
    pub refit_failed: Option<bool>,
    /// How long the broken refit took to return: the orchestrator's answer
    /// (or, for the idle case, the time to notice the death).
    pub elapsed: Duration,
    /// The broken refit returned within its bound (deadline + abort grace +
    /// control timeout), i.e. it did not hang.
    pub within_deadline: bool,
    /// Some live destination rank held bytes matching no committed version.
    pub torn: bool,
    /// Committed versions seen on destination ranks after the case (`None`:
    /// a dead one).
    pub versions: Vec<Option<u64>>,
    /// The next refit (after recovery) succeeded and verified.
    pub recovered: bool,
    /// Workers the recovery replaced (dead or not answering).
    pub replaced: usize,
    /// How long the orchestrator took to answer the recovery's refit.
    pub recovery_refit: Option<Duration>,
    /// The error the broken refit reported (or the recovery's).
    pub detail: String,
    /// Why the case did not run (this kernel cannot do it), if it did not.
    pub skipped: Option<String>,
}

impl ChaosRow {
    /// The case kept the promise: no hang, no torn version, recovered (or
    /// it could not run here).
    pub fn kept_promise(&self) -> bool {
        self.skipped.is_some() || (self.within_deadline && !self.torn && self.recovered)
    }
}

/// Settings of a chaos run.
#[derive(Clone, Debug)]
pub struct ChaosConfig {
    /// The cluster (spawned workers, link emulation slow enough that a
    /// refit lasts long enough to be killed in the middle).
    pub cluster: ClusterConfig,
    /// Delay after the start of a refit before a "mid-transfer" kill.
    pub mid_transfer: Duration,
    /// Layout files a worker wrongly restarts with (different layouts).
    pub wrong_layouts: (PathBuf, PathBuf),
    /// Run only the cases whose name contains one of these (all: none).
    pub only: Vec<String>,
    /// Run the cases in an order shuffled by this seed (`None`: the
    /// suite's order).
    pub shuffle: Option<u64>,
    /// Run every chosen case this many times (at least once).
    pub repeat: usize,
}

/// The cases, in the order they run.
pub const CASES: [&str; 15] = [
    "kill idle destination (detection time)",
    "kill source during attach",
    "kill destination during attach",
    "kill source mid-transfer",
    "kill destination mid-transfer",
    "kill source during commit",
    "kill destination during commit",
    "stalled peer (stops sending)",
    "abort that hangs",
    "cut connection",
    "corrupt frame (checksums on)",
    "member restarts with a different layout",
    "kill replicated source at 10% of the transfer",
    "kill replicated source at 50% of the transfer",
    "kill replicated source at 90% of the transfer",
];

/// The fraction of the transfer at which a `kill replicated source` case
/// kills its worker.
fn replicated_kill_point(case: &str) -> Option<f64> {
    let pct: f64 = case.strip_prefix("kill replicated source at ")?.split('%').next()?.parse().ok()?;
    Some(pct / 100.0)
}

/// The cases of a destination group made of replicas (the suite's
/// destination layout as one replica, two of them), run on a cluster of
/// their own after the others: replicas join and leave while refits go
/// on, and a replica that loses a worker mid-refit leaves the group while
/// the other commits.
pub const REPLICA_CASES: [&str; 3] = [
    "replicas: one joins (seeded from a serving one), one leaves",
    "replicas: one joins while a refit is in flight",
    "replicas: kill a replica's worker mid-transfer",
];

/// The replicas the replica cases' group has between cases.
const REPLICAS: u32 = 2;

/// The network cases, run after [`CASES`] when the workers are on emulated
/// hosts (`--netns`): the kernel breaks the network, not our sender.
pub const NETWORK_CASES: [&str; 5] = [
    "net: link cut mid-transfer, then restored",
    "net: node partitioned from the launcher, not from its peers",
    "net: peer stops reading (SIGSTOP)",
    "net: 5% packet loss",
    "net: 100 ms delay",
];

/// Runs every case on one cluster (so recovery is exercised case after
/// case), each from a clean state: workers that died or stopped answering
/// replaced, no fault armed on any rank, and a verified refit on a fresh
/// data plane first; `progress` is told of each row as it is done.
pub fn run_chaos(
    config: ChaosConfig,
    src: Layout,
    dst: Layout,
    mut progress: impl FnMut(&ChaosRow),
) -> Result<Vec<ChaosRow>, ClusterError> {
    let chosen = |list: &[&'static str]| -> Vec<&'static str> {
        let mut cases: Vec<&str> = list
            .iter()
            .copied()
            .filter(|c| config.only.is_empty() || config.only.iter().any(|o| c.contains(o.as_str())))
            .flat_map(|c| std::iter::repeat_n(c, config.repeat.max(1)))
            .collect();
        if let Some(seed) = config.shuffle {
            shuffle(&mut cases, seed);
        }
        cases
    };
    let network = if config.cluster.netns.is_some() { &NETWORK_CASES[..] } else { &[] };
    let cases = chosen(&[&CASES[..], network].concat());
    let replica_cases = chosen(&REPLICA_CASES);
    let mut rows = Rows { done: Vec::new(), progress: &mut progress };
    if !cases.is_empty() {
        run_cases(&config, cases, src.clone(), dst.clone(), &mut rows)?;
    }
    if !replica_cases.is_empty() {
        run_replica_cases(&config, replica_cases, src, dst, &mut rows)?;
    }
    Ok(rows.done)
}

/// A broken refit returns by the data plane's deadline, plus the control
/// step that waits for a member whose abort hangs.
fn bound(config: &ChaosConfig) -> Duration {
    config.cluster.refit_deadline + config.cluster.setup_timeout + Duration::from_secs(2)
}

/// The rows of a run so far, each told to `progress` as it is added.
struct Rows<'p> {
    done: Vec<ChaosRow>,
    progress: &'p mut dyn FnMut(&ChaosRow),
}

impl Rows<'_> {
    /// Adds `row` and tells `progress` of it.
    fn add(&mut self, row: ChaosRow) {
        (self.progress)(&row);
        self.done.push(row);
    }

    /// Adds the row of a case that did not run because the cluster could
    /// not be brought to a clean state before it (`e`).
    fn add_not_clean(&mut self, case: &str, e: ClusterError) {
        self.add(not_run(case, format!("not run: the cluster could not be brought to a clean state first: {e}"), None));
    }
}

/// A row for a case that did not run: skipped (`skipped`), or not brought
/// to a clean state first.
fn not_run(case: &str, detail: String, skipped: Option<String>) -> ChaosRow {
    ChaosRow {
        case: case.to_string(),
        refit_failed: None,
        elapsed: Duration::ZERO,
        within_deadline: true,
        torn: false,
        versions: Vec::new(),
        recovered: false,
        replaced: 0,
        recovery_refit: None,
        detail,
        skipped,
    }
}

/// What a case did, and the promise checked after it.
struct Broken {
    /// The broken refit failed (see [`ChaosRow::refit_failed`]).
    failed: Option<bool>,
    /// What happened.
    detail: String,
    /// How long the broken refit took.
    elapsed: Duration,
}

/// Checks the promise after a case: no live destination on a torn
/// version, and recovery (dead workers replaced, then a verified refit of
/// `version`) succeeds; `between` runs after the check, before recovery.
fn conclude(
    cluster: &mut Cluster,
    case: &str,
    broken: Broken,
    bound: Duration,
    version: u64,
    between: impl FnOnce(&mut Cluster) -> Result<(), ClusterError>,
) -> Result<ChaosRow, ClusterError> {
    // Torn? Every live destination's committed bytes must be exactly
    // one version (the check verifies every element).
    let checked = cluster.check();
    let torn = checked.iter().any(|c| c.torn.is_some());
    let versions = checked.iter().map(|c| c.version).collect();
    between(cluster)?;
    // Recovery: dead or stuck workers are replaced, and the next refit
    // must succeed and verify.
    let mut replaced = 0;
    let recovery = cluster.recover().and_then(|n| {
        replaced = n;
        cluster.refit(version, true)
    });
    let recovery_refit = cluster.last_refit_call();
    let recovered = matches!(&recovery, Ok(o) if o.verified.is_some());
    let detail = match recovery {
        Ok(_) => broken.detail,
        Err(e) => format!("{}; recovery failed: {e}", broken.detail),
    };
    Ok(ChaosRow {
        case: case.to_string(),
        refit_failed: broken.failed,
        within_deadline: broken.elapsed <= bound,
        elapsed: broken.elapsed,
        torn,
        versions,
        recovered,
        replaced,
        recovery_refit,
        detail,
        skipped: None,
    })
}

/// The cases of [`CASES`] and [`NETWORK_CASES`] in `cases`, on one cluster;
/// their rows go to `rows`.
fn run_cases(config: &ChaosConfig, cases: Vec<&str>, src: Layout, dst: Layout, rows: &mut Rows<'_>) -> Result<(), ClusterError> {
    let bound = bound(config);
    let mid = config.mid_transfer;
    let wrong = config.wrong_layouts.clone();
    let options = config.cluster.options.clone();
    let layouts = (src.clone(), dst.clone());
    let mut cluster = Cluster::start(config.cluster.clone(), src, dst, |_| {})?;
    // A source worker whose every part other sources hold too (and that
    // sends something): the refit can go on without it.
    let replicated = replicated_source_worker(&cluster, &options, &layouts.0, &layouts.1);
    let mut version = 1;
    // The last clean refit's transfer: what a kill point is a fraction of.
    let mut transfer = cluster.refit(version, true)?.report.transfer_time;
    let workers = cluster.workers();
    let first = |g: Group| workers.iter().position(|w| w.ranks.iter().any(|e| e.group == g)).unwrap_or(0);
    let (a_src, a_dst) = (first(Group::Src), first(Group::Dst));
    let all_ranks: Vec<Endpoint> = workers.iter().flat_map(|w| w.ranks.iter().copied()).collect();
    let targets = Targets {
        a_src,
        a_dst,
        src_rank: workers[a_src].ranks.first().copied().unwrap_or(Endpoint::src(0)),
        dst_ranks: all_ranks.iter().copied().filter(|e| e.group == Group::Dst).collect(),
    };
    for (i, case) in cases.into_iter().enumerate() {
        // Every case starts from a clean state, whatever ran before it:
        // workers that died or stopped answering replaced, no fault left
        // armed on any rank, and a verified refit on a fresh data plane.
        if i > 0 {
            version += 1;
            let cleaned = clean_slate(&mut cluster, version, &all_ranks);
            if let Ok(t) = &cleaned {
                transfer = *t;
            }
            if let Err(e) = cleaned {
                rows.add_not_clean(case, e);
                continue;
            }
        }
        version += 1;
        let t = Instant::now();
        let why_not = match (replicated_kill_point(case), replicated) {
            (Some(_), None) => Some("no source worker holds only what other sources hold too".to_string()),
            _ => cannot_run(&cluster, case),
        };
        if let Some(why) = why_not {
            version -= 1;
            rows.add(not_run(case, format!("skipped: {why}"), Some(why)));
            continue;
        }
        let (failed, detail) = match case {
            "kill idle destination (detection time)" => {
                let pid = cluster.workers()[a_dst].pid;
                kill_pid(pid);
                let seen = cluster.wait_for_death(Duration::from_secs(10));
                version -= 1;
                (None, seen.map_or("not noticed within 10 s".into(), |d| format!("noticed dead after {} ms", d.as_millis())))
            }
            net if net.starts_with("net: ") => network_case(&mut cluster, net, version, mid, a_dst)?,
            replicated_case if replicated_kill_point(replicated_case).is_some() => {
                let (worker, point) = (replicated.unwrap_or(a_src), replicated_kill_point(replicated_case).unwrap_or(0.5));
                let lost = |r: &RefitReport| (!r.lost_sources.is_empty()).then(|| format!("source ranks {:?}", r.lost_sources));
                kill_mid_refit(&mut cluster, version, worker, transfer.mul_f64(point), lost)
            }
            _ => injected_case(&mut cluster, case, version, &targets, (mid, bound), &wrong)?,
        };
        // The broken refit's own time: the orchestrator's answer, not the
        // launcher stepping the sources first (seconds under a sanitizer).
        let elapsed = match failed {
            None => t.elapsed(),
            Some(_) => cluster.last_refit_call().unwrap_or_else(|| t.elapsed()),
        };
        version += 1;
        let restarted = case == "member restarts with a different layout";
        let put_back = |c: &mut Cluster| if restarted { c.restart_worker(a_dst, None) } else { Ok(()) };
        rows.add(conclude(&mut cluster, case, Broken { failed, detail, elapsed }, bound, version, put_back)?);
    }
    cluster.shutdown();
    Ok(())
}

/// The workers and ranks the cases break: the first worker holding a
/// source rank and the first holding a destination rank.
struct Targets {
    a_src: usize,
    a_dst: usize,
    /// The source worker's first rank.
    src_rank: Endpoint,
    /// Every destination rank.
    dst_ranks: Vec<Endpoint>,
}

/// A case that kills a worker at a refit step, arms faults on ranks, or
/// restarts a member with `wrong` layouts, and runs the refit it breaks
/// (`mid`: how far into the transfer; `bound`: how long a refit may take);
/// whether that refit failed, and how.
fn injected_case(
    cluster: &mut Cluster,
    case: &str,
    version: u64,
    t: &Targets,
    (mid, bound): (Duration, Duration),
    wrong: &(PathBuf, PathBuf),
) -> Result<(Option<bool>, String), ClusterError> {
    let (a_src, a_dst) = (t.a_src, t.a_dst);
    let kill = |worker, step, after| Some(Disruption { step, after, action: Disrupt::Kill(worker) });
    let at = Duration::ZERO;
    let kill = match case {
        "kill source during attach" => kill(a_src, RefitStep::Preparing, at),
        "kill destination during attach" => kill(a_dst, RefitStep::Connecting, at),
        "kill source mid-transfer" => kill(a_src, RefitStep::Running, mid),
        "kill destination mid-transfer" => kill(a_dst, RefitStep::Running, mid),
        "kill source during commit" => kill(a_src, RefitStep::Committing, at),
        "kill destination during commit" => kill(a_dst, RefitStep::Committing, at),
        _ => None,
    };
    let stall = FaultSpec { stall_at_frame: Some(0), ..FaultSpec::default() };
    let faults = match case {
        "stalled peer (stops sending)" => vec![(t.src_rank, stall)],
        // A source stalls; the destinations waiting for it time out at
        // the deadline, and the abort of whichever times out
        // first hangs (as NCCL's has been seen to; every destination's
        // would): the refit still returns, and the stuck worker
        // is replaced.
        "abort that hangs" => {
            let hang = FaultSpec { abort_hang: Some(bound * 4), ..FaultSpec::default() };
            std::iter::once((t.src_rank, stall)).chain(t.dst_ranks.iter().map(|&e| (e, hang.clone()))).collect()
        }
        "cut connection" => vec![(t.src_rank, FaultSpec { cut_at_frame: Some(1), ..FaultSpec::default() })],
        "corrupt frame (checksums on)" => vec![(t.src_rank, FaultSpec { corrupt_frame: Some(0), ..FaultSpec::default() })],
        _ => Vec::new(),
    };
    if case == "member restarts with a different layout" {
        cluster.restart_worker(a_dst, Some(wrong.clone()))?;
    }
    Ok(match cluster.refit_with(version, true, &faults, kill) {
        Ok(_) => (Some(false), "the refit completed before the fault mattered".to_string()),
        Err(e) => (Some(true), e.to_string()),
    })
}

/// The cases of [`REPLICA_CASES`] in `cases`, on a cluster of their own
/// whose destination group is [`REPLICAS`] replicas of `dst` (room for
/// one more); their rows go to `rows`.
fn run_replica_cases(config: &ChaosConfig, cases: Vec<&str>, src: Layout, dst: Layout, rows: &mut Rows<'_>) -> Result<(), ClusterError> {
    let bound = bound(config);
    let k = dst.ranks();
    let mut cluster_config = config.cluster.clone();
    cluster_config.replicas = Some(ReplicaConfig { start: REPLICAS, most: REPLICAS + 1 });
    let mut cluster = Cluster::start(cluster_config, src, dst, |_| {})?;
    let mut version = 1;
    let mut transfer = cluster.refit(version, true)?.report.transfer_time;
    for (i, case) in cases.into_iter().enumerate() {
        if i > 0 {
            // Replicas dropped or dead were replaced by recovery, those a
            // case added and left in leave; this refit runs on a fresh
            // data plane.
            version += 1;
            let cleaned = (|| {
                while let Some(n) = cluster.replica_names().map(|n| n.len()).filter(|&n| n > REPLICAS as usize) {
                    cluster.remove_replica(n as u32 - 1)?;
                }
                clean_slate(&mut cluster, version, &[])
            })();
            match cleaned {
                Ok(t) => transfer = t,
                Err(e) => {
                    rows.add_not_clean(case, e);
                    continue;
                }
            }
        }
        version += 1;
        let t = Instant::now();
        let (failed, detail) = match case {
            "replicas: one joins (seeded from a serving one), one leaves" => {
                match join_and_leave(&mut cluster, k, &mut version) {
                    Ok(detail) => (Some(false), detail),
                    Err(e) => (Some(true), e.to_string()),
                }
            }
            "replicas: one joins while a refit is in flight" => match cluster.refit_adding_replica(version, true, RefitStep::Running) {
                Err(e) => (Some(true), format!("the replica's workers did not start: {e}")),
                Ok((Ok(o), Ok(added))) => match added.seeded {
                    Some(s) if s.version == version => (
                        Some(false),
                        format!(
                            "refit {version} committed in {} ms; the replica asked to join during it joined after, seeded with version {version} from replica {} in {} ms; {} replicas verified",
                            o.report.wall.as_millis(),
                            s.from_replica,
                            s.wall.as_millis(),
                            added.replicas
                        ),
                    ),
                    other => (Some(true), format!("the replica joined seeded with {:?}, not version {version}", other.map(|s| s.version))),
                },
                Ok((Err(e), _)) => (Some(true), format!("the refit failed: {e}")),
                Ok((_, Err(e))) => (Some(true), format!("the replica did not join: {e}")),
            },
            "replicas: kill a replica's worker mid-transfer" => {
                let worker = cluster.replica_workers(1).first().copied();
                let worker = worker.ok_or_else(|| ClusterError::Setup(format!("{case}: the group has no replica 1")))?;
                let left = |r: &RefitReport| {
                    (!r.dropped_replicas.is_empty()).then(|| format!("replicas {:?}, which left the group", r.dropped_replicas))
                };
                kill_mid_refit(&mut cluster, version, worker, transfer.mul_f64(0.5), left)
            }
            other => return Err(ClusterError::Setup(format!("unknown chaos case '{other}'"))),
        };
        let elapsed = cluster.last_refit_call().unwrap_or_else(|| t.elapsed());
        version += 1;
        rows.add(conclude(&mut cluster, case, Broken { failed, detail, elapsed }, bound, version, |_| Ok(()))?);
    }
    cluster.shutdown();
    Ok(())
}

/// Refits `version` with worker `worker` killed `after` into `Running`,
/// for a case whose refit may go on without it: one that commits is not
/// failed, and `without` says what it went without (`None`: nothing, the
/// kill came after the transfer).
fn kill_mid_refit(
    cluster: &mut Cluster,
    version: u64,
    worker: usize,
    after: Duration,
    without: impl Fn(&RefitReport) -> Option<String>,
) -> (Option<bool>, String) {
    let kill = Some(Disruption { step: RefitStep::Running, after, action: Disrupt::Kill(worker) });
    match cluster.refit_with(version, true, &[], kill) {
        Ok(o) => match without(&o.report) {
            None => (Some(false), format!("committed and verified; the kill at {} ms came after the transfer", after.as_millis())),
            Some(what) => (
                Some(false),
                format!("committed and verified without {what} (killed at {} ms), in {} ms", after.as_millis(), o.report.wall.as_millis()),
            ),
        },
        Err(e) => (Some(true), e.to_string()),
    }
}

/// A replica joins (seeded from a serving one: the seed plan's sources
/// must be the `k` ranks of that replica, no training rank), refit
/// `version` reaches every replica, the first replica leaves, and refit
/// `version + 1` reaches the others; every refit verified.
fn join_and_leave(cluster: &mut Cluster, k: u32, version: &mut u64) -> Result<String, ClusterError> {
    let wrong = |problem: String| ClusterError::Setup(problem);
    let serving = *version - 1;
    let added = cluster.add_replica()?;
    let seed = added.seeded.ok_or_else(|| wrong(format!("the replica joined unseeded; the others serve version {serving}")))?;
    if seed.version != serving {
        return Err(wrong(format!("the replica was seeded with version {}, the others serve {serving}", seed.version)));
    }
    let senders = seed.figures.src_rank_egress_bytes.len();
    if senders != k as usize {
        return Err(wrong(format!("the seed plan has {senders} sending ranks; a replica has {k}")));
    }
    let seeded = cluster.verify(serving)?;
    let all = cluster.refit(*version, true)?.verified.unwrap_or(0);
    cluster.remove_replica(0)?;
    *version += 1;
    let fewer = cluster.refit(*version, true)?.verified.unwrap_or(0);
    let left = cluster.replica_names().map_or(0, |n| n.len());
    Ok(format!(
        "seeded with version {serving} from replica {} ({} bytes planned from its {k} ranks, none from a training rank; {seeded} elements verified); \
         refit {} verified on {} replicas ({all} elements); replica 0 left; refit {} verified on {left} ({fewer} elements)",
        seed.from_replica,
        seed.figures.src_egress_bytes,
        *version - 1,
        added.replicas,
        *version,
    ))
}

/// Brings `cluster` to a clean state for the next case: every worker that
/// died or stopped answering replaced, every rank's armed faults replaced by
/// none (a rank takes what is armed when it next connects, so a fault armed
/// for a refit that failed before reaching it would otherwise fire in a
/// later case), and a verified refit of `version` on a fresh data plane (no
/// connection of an earlier case is used again). Tried twice.
/// Returns that refit's transfer time.
fn clean_slate(cluster: &mut Cluster, version: u64, ranks: &[Endpoint]) -> Result<Duration, ClusterError> {
    let none: Vec<(Endpoint, FaultSpec)> = ranks.iter().map(|&e| (e, FaultSpec::default())).collect();
    let mut tries = 0;
    loop {
        tries += 1;
        let r = cluster.recover().and_then(|_| cluster.refit_with(version, true, &none, None));
        match r {
            Ok(o) => return Ok(o.report.transfer_time),
            Err(e) if tries >= 2 => return Err(e),
            Err(_) => {}
        }
    }
}

/// The index of the first source worker whose ranks send something in
/// the plan of `src` to `dst` and whose every part other sources hold too
/// (a plan without them exists), if any.
fn replicated_source_worker(cluster: &Cluster, options: &PlanOptions, src: &Layout, dst: &Layout) -> Option<usize> {
    let plan = reshard::plan_reshard(src, dst, options).ok()?;
    cluster.workers().iter().position(|w| {
        let lost: Vec<u32> = w.ranks.iter().filter(|e| e.group == Group::Src).map(|e| e.rank).collect();
        let sends = plan.transfers().iter().any(|t| t.from.group == Group::Src && lost.contains(&t.from.rank));
        let without = PlanOptions { lost_sources: lost.clone(), ..options.clone() };
        !lost.is_empty() && sends && reshard::plan_reshard(src, dst, &without).is_ok()
    })
}

/// Shuffles `items` by `seed` (Fisher–Yates on a splitmix64 stream: the
/// same seed, the same order).
fn shuffle<T>(items: &mut [T], seed: u64) {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for i in (1..items.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        items.swap(i, j);
    }
}

/// Why `case` cannot run on this cluster, if it cannot.
fn cannot_run(cluster: &Cluster, case: &str) -> Option<String> {
    cluster.emulated_hosts()?;
    if case.contains("delay") {
        return crate::netns::delay_available().err();
    }
    if case.contains("loss") {
        return crate::netns::loss_available().err();
    }
    None
}

/// Breaks the network of the emulated hosts as `case` says during the
/// refit of `version`, heals it once the refit returned, and says whether
/// the refit failed and how.
fn network_case(
    cluster: &mut Cluster,
    case: &str,
    version: u64,
    mid: Duration,
    a_dst: usize,
) -> Result<(Option<bool>, String), ClusterError> {
    let setup = |e: String| ClusterError::Setup(e);
    let hosts = cluster.emulated_hosts().ok_or_else(|| setup(format!("{case}: needs emulated hosts (--netns)")))?;
    let (group, node) = cluster.workers().get(a_dst).map(|w| w.node).ok_or_else(|| setup(format!("{case}: no worker {a_dst}")))?;
    let host = hosts.host(group, node).cloned().ok_or_else(|| setup(format!("{case}: no emulated host for the destination")))?;
    let launcher = hosts.gateway();
    let at = |action| Some(Disruption { step: RefitStep::Running, after: mid, action });
    let mut netem = None;
    let disruption = match case {
        "net: link cut mid-transfer, then restored" => {
            let h = host.clone();
            at(Disrupt::Run(Box::new(move || drop(h.set_link(false)))))
        }
        "net: node partitioned from the launcher, not from its peers" => {
            let h = host.clone();
            at(Disrupt::Run(Box::new(move || drop(h.partition_from(launcher, true)))))
        }
        "net: peer stops reading (SIGSTOP)" => at(Disrupt::Stop(a_dst)),
        "net: 5% packet loss" => {
            netem = Some(Netem { loss_pct: Some(5.0), ..Netem::default() });
            None
        }
        "net: 100 ms delay" => {
            netem = Some(Netem { delay: Some(Duration::from_millis(100)), ..Netem::default() });
            None
        }
        other => return Err(setup(format!("unknown chaos case '{other}'"))),
    };
    if let Some(n) = &netem {
        hosts.set_netem(n).map_err(setup)?;
    }
    let r = cluster.refit_with(version, true, &[], disruption);
    // Heal whatever was broken (each is a no-op, or a harmless error, when
    // it was not).
    let healed = match case {
        "net: link cut mid-transfer, then restored" => host.set_link(true),
        "net: node partitioned from the launcher, not from its peers" => host.partition_from(launcher, false).or_else(|e| {
            // The refit may have ended before the partition came.
            if e.contains("No such file") {
                Ok(())
            } else {
                Err(e)
            }
        }),
        _ => match (&netem, cluster.emulated_hosts()) {
            (Some(_), Some(h)) => h.set_netem(&Netem::default()),
            _ => Ok(()),
        },
    };
    healed.map_err(|e| setup(format!("{case}: cannot heal: {e}")))?;
    Ok(match r {
        Ok(_) => (Some(false), "the refit completed (verified) despite the fault".to_string()),
        Err(e) => (Some(true), e.to_string()),
    })
}
