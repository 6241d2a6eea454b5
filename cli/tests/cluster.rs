//! The multi-process path end to end: `refit launch` starts real worker
//! processes (per rank or per node), runs several refits of changing
//! weights versions, and every destination rank checks every element before
//! each commit; `refit bench --transport process` runs reshard and baseline
//! side by side in the same workers.

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_refit");

fn refit(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("spawn refit")
}

fn example(name: &str) -> (String, String) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples").join(name);
    let p = |f: &str| dir.join(f).to_str().expect("utf-8 path").to_string();
    (p("src.json"), p("dst.json"))
}

/// Runs `refit launch` and checks it verified every refit and the
/// committed weights of the last version.
fn check_launch(name: &str, extra: &[&str]) {
    let (src, dst) = example(name);
    let mut args = vec!["launch", "--verify", "--refits", "2", "--deadline-s", "60", "--src", &src, "--dst", &dst];
    args.extend_from_slice(extra);
    let out = refit(&args);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "refit {}\n{stdout}\n{stderr}", args.join(" "));
    assert!(stdout.contains("2 refit(s)") && stdout.contains("committed weights of version 2 match"), "{name} {extra:?}: {stdout}");
}

/// Every example pair (fused buffers, pipeline stages, experts, FSDP flat
/// shards, dtype conversion, relays) is bit-exact over the multi-process
/// data plane with both strategies, with a process per node (ranks of a
/// node share memory) and with a process per rank.
#[test]
fn slow_every_example_is_bit_exact_across_processes() {
    for name in ["tp-to-tp", "pp-to-tp", "ep-moe", "fsdp-to-tp", "fused-qkv", "mixed-2d", "fp8-block-scaled", "fp8-source-quantized"] {
        check_launch(name, &["--per-process", "node"]);
        check_launch(name, &["--per-process", "node", "--baseline"]);
    }
    for name in ["fused-qkv", "mixed-2d"] {
        check_launch(name, &["--per-process", "rank"]);
        check_launch(name, &["--per-process", "rank", "--baseline"]);
    }
}

/// `refit bench --transport process --json` reports both strategies, the
/// bytes per link and writes both traffic heat maps.
#[test]
fn process_bench_reports_both_strategies_and_links() {
    let (src, dst) = example("mixed-2d");
    let svg = std::env::temp_dir().join(format!("refit-cluster-bench-{}.svg", std::process::id()));
    let svg_s = svg.to_str().expect("utf-8 path");
    let out = refit(&["bench", "--transport", "process", "--reps", "1", "--json", "--svg", svg_s, "--src", &src, "--dst", &dst]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    for k in ["reshard", "baseline"] {
        assert!(v[k]["median_s"].as_f64().is_some_and(|t| t > 0.0), "{v}");
        assert!(v[k]["bytes"].as_u64().is_some_and(|b| b > 0), "{v}");
        assert!(v["links"][k]["inter_node_bytes"].as_u64().is_some(), "{v}");
    }
    assert!(v["baseline_over_reshard"].as_f64().is_some_and(|r| r > 0.0), "{v}");
    for who in ["launcher", "worker_max"] {
        assert!(v["peak_rss_bytes"][who].as_u64().is_some_and(|b| b > 1 << 20), "{who}: {v}");
    }
    for p in [svg.clone(), svg.with_extension("baseline.svg")] {
        let text = std::fs::read_to_string(&p).expect("svg written");
        assert!(text.starts_with("<svg") && text.contains("<rect"), "{}", p.display());
        let _ = std::fs::remove_file(&p);
    }
}

/// Process ids of `parent`'s children.
fn children_of(parent: u32) -> Vec<u32> {
    let out = Command::new("pgrep").args(["-P", &parent.to_string()]).output().expect("pgrep runs");
    String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.trim().parse().ok()).collect()
}

/// `refit launch --refits N --verify --json` keeps the job alive while
/// workers are killed with SIGKILL: it reports each refit, replaces the
/// dead workers, and ends with a committed, verified refit (exit 0).
#[test]
fn slow_launch_survives_killed_workers() {
    let (src, dst) = example("tp-to-tp");
    // Emulated links slow each refit to most of a second, so the kills land
    // while refits run.
    let args = ["launch", "--verify", "--json", "--refits", "12", "--emulate-nic-mbps", "2", "--src", &src, "--dst", &dst];
    let launcher = Command::new(BIN).args(args).stdout(std::process::Stdio::piped()).spawn().expect("start launcher");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut workers = Vec::new();
    while workers.len() < 12 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        workers = children_of(launcher.id());
    }
    assert_eq!(workers.len(), 12, "{workers:?}");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let killed = [workers[2], workers[9]];
    for pid in killed {
        Command::new("kill").args(["-9", &pid.to_string()]).status().expect("kill runs");
        std::thread::sleep(std::time::Duration::from_millis(900));
    }
    // The launcher replaces them (and reaps the dead) as it notices them:
    // look until it has, or until it ends (a loaded machine takes longer).
    let replaced = |now: &[u32]| now.len() == 12 && killed.iter().all(|k| !now.contains(k));
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut now = children_of(launcher.id());
    while !replaced(&now) && !now.is_empty() && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(100));
        now = children_of(launcher.id());
    }
    let out = launcher.wait_with_output().expect("launcher ends");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    // The killed workers were replaced while the job went on.
    assert_eq!(now.len(), 12, "{now:?}");
    assert!(killed.iter().all(|k| !now.contains(k)), "killed {killed:?}, running {now:?}");
    let v: Value = serde_json::from_str(&stdout).expect("one JSON object");
    let refits = v["refits"].as_array().expect("refits");
    assert_eq!(refits.len(), 12, "{v}");
    for (i, r) in refits.iter().enumerate() {
        assert_eq!(r["version"].as_u64(), Some(i as u64 + 1), "{v}");
        assert!(r["ms"].as_f64().is_some_and(|ms| ms > 0.0), "{v}");
        assert_eq!(r["ok"].as_bool(), Some(r["error"].is_null()), "{v}");
    }
    assert_eq!(refits[11]["ok"], true, "{v}");
    assert_eq!(v["verified"], true, "{v}");
    // Both ends report their peak memory.
    for who in ["launcher", "worker_max"] {
        assert!(v["peak_rss_bytes"][who].as_u64().is_some_and(|b| b > 1 << 20), "{who}: {v}");
    }
}

/// With `--fail-fast` the first failed refit ends the launch (exit 1).
#[test]
fn launch_fail_fast_stops_at_the_first_failure() {
    let (src, dst) = example("tp-to-tp");
    let args = ["launch", "--verify", "--json", "--fail-fast", "--refits", "50", "--emulate-nic-mbps", "2", "--src", &src, "--dst", &dst];
    let launcher = Command::new(BIN).args(args).stdout(std::process::Stdio::piped()).spawn().expect("start launcher");
    let mut workers = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while workers.len() < 12 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        workers = children_of(launcher.id());
    }
    std::thread::sleep(std::time::Duration::from_millis(1200));
    Command::new("kill").args(["-9", &workers[0].to_string()]).status().expect("kill runs");
    let out = launcher.wait_with_output().expect("launcher ends");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let v: Value = serde_json::from_str(&stdout).expect("one JSON object");
    let refits = v["refits"].as_array().expect("refits");
    assert!(refits.len() < 50, "{v}");
    assert_eq!(refits.last().expect("a refit")["ok"], false, "{v}");
    assert_eq!(v["verified"], false, "{v}");
}

/// `--replicas`: the inference group is replicas of the `--dst` layout; one
/// joins before refit 2 (seeded from a serving one, with the version it
/// serves), the first leaves before refit 3, and every refit verifies
/// every destination of the replicas then in the group.
#[test]
fn launch_with_replicas_joining_and_leaving_verifies_every_refit() {
    let (src, dst) = example("tp-to-tp");
    let args = [
        "launch",
        "--verify",
        "--json",
        "--refits",
        "4",
        "--per-process",
        "node",
        "--replicas",
        "2",
        "--add-replica-at",
        "2",
        "--remove-replica-at",
        "3",
        "--src",
        &src,
        "--dst",
        &dst,
    ];
    let out = refit(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(&stdout).expect("one JSON object");
    let refits = v["refits"].as_array().expect("refits");
    let replicas: Vec<u64> = refits.iter().map(|r| r["replicas"].as_u64().unwrap_or(0)).collect();
    assert_eq!(replicas, [2, 3, 2, 2], "{v}");
    assert!(refits.iter().all(|r| r["ok"] == true), "{v}");
    assert_eq!(v["verified"], true, "{v}");
    let events = v["replica_events"].as_array().expect("replica events");
    assert_eq!(events.len(), 2, "{v}");
    let (add, remove) = (&events[0], &events[1]);
    assert_eq!((add["event"].as_str(), add["ok"].as_bool(), add["before_refit"].as_u64()), (Some("add"), Some(true), Some(2)), "{v}");
    // Seeded with what the group served: version 1.
    assert_eq!(add["seeded_version"].as_u64(), Some(1), "{v}");
    assert!(add["seed_bytes"].as_u64().is_some_and(|b| b > 0), "{v}");
    assert_eq!(
        (remove["event"].as_str(), remove["ok"].as_bool(), remove["replicas"].as_u64()),
        (Some("remove"), Some(true), Some(2)),
        "{v}"
    );
}

/// A `refit launch --no-spawn --json` of the tp-to-tp example, started and
/// listening, and a way to start its workers.
struct NoSpawnLaunch {
    launcher: std::process::Child,
    addr: String,
    src: String,
    dst: String,
}

const SECRET: &str = "shared by the launcher and its workers";

impl NoSpawnLaunch {
    /// Starts the launcher with `extra` arguments and waits until its
    /// rendezvous listens (the line it writes to standard error then: a
    /// worker refused at once gives up); its standard error is drained on
    /// a thread from then on.
    fn start(extra: &[&str]) -> NoSpawnLaunch {
        use std::io::BufRead;
        let (src, dst) = example("tp-to-tp");
        let addr = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").to_string();
        let mut args =
            vec!["launch", "--no-spawn", "--verify", "--json", "--deadline-s", "60", "--bind", &addr, "--src", &src, "--dst", &dst];
        args.extend_from_slice(extra);
        let mut launcher = Command::new(BIN)
            .args(args)
            .env("REFIT_SECRET", SECRET)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start launcher");
        let mut err = std::io::BufReader::new(launcher.stderr.take().expect("piped stderr"));
        let mut line = String::new();
        while !line.starts_with("rendezvous listening on ") {
            line.clear();
            assert!(err.read_line(&mut line).expect("launcher's stderr") > 0, "the launcher ended before listening");
        }
        std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
        NoSpawnLaunch { launcher, addr, src, dst }
    }

    /// Starts a worker with `extra` arguments.
    fn worker(&self, extra: &[&str]) -> std::process::Child {
        let mut a = vec!["worker", "--src", self.src.as_str(), "--dst", self.dst.as_str(), "--rendezvous", self.addr.as_str()];
        a.extend_from_slice(extra);
        Command::new(BIN).args(a).env("REFIT_SECRET", SECRET).spawn().expect("start worker")
    }

    /// Waits for the launcher: its exit code and its JSON object.
    fn finish(self) -> (Option<i32>, Value, String) {
        let out = self.launcher.wait_with_output().expect("launcher ends");
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let v = serde_json::from_str(&stdout).unwrap_or(Value::Null);
        (out.status.code(), v, stdout)
    }
}

/// With `--no-spawn`, replicas are whatever joins as `refit worker
/// --replica NAME`: the launcher starts with the first to join whole and
/// adds one that joins later before a refit.
#[test]
fn launch_without_spawning_adopts_replicas_that_join() {
    // Emulated links keep each refit long enough (about half a second)
    // that the second replica joins while refits remain.
    let launch = NoSpawnLaunch::start(&["--refits", "6", "--replicas", "1", "--emulate-nic-mbps", "8"]);
    let mut workers: Vec<_> = (0..2).map(|n| launch.worker(&["--group", "src", "--node", &n.to_string()])).collect();
    workers.extend((0..2).map(|n| launch.worker(&["--group", "dst", "--node", &n.to_string(), "--replica", "a"])));
    // A second replica a little later.
    std::thread::sleep(std::time::Duration::from_millis(300));
    workers.extend((0..2).map(|n| launch.worker(&["--group", "dst", "--node", &n.to_string(), "--replica", "b"])));
    let (code, v, stdout) = launch.finish();
    assert_eq!(code, Some(0), "{stdout}");
    let refits = v["refits"].as_array().expect("refits");
    assert!(refits.iter().all(|r| r["ok"] == true), "{v}");
    assert_eq!(refits.last().and_then(|r| r["replicas"].as_u64()), Some(2), "{v}");
    assert_eq!(v["verified"], true, "{v}");
    for mut w in workers {
        assert!(w.wait().unwrap().success());
    }
}

/// A replica's tasks die and a cluster launcher starts them again under
/// the same name (`--no-spawn`): the replica leaves the group while the
/// other serves on, and the one started again is taken in as new, seeded,
/// before a later refit.
#[test]
fn slow_a_replica_started_again_under_its_name_rejoins() {
    // Emulated links slow each refit to about half a second.
    let launch = NoSpawnLaunch::start(&["--refits", "30", "--replicas", "2", "--emulate-nic-mbps", "8"]);
    let replica = |name: &str| -> Vec<_> {
        (0..2).map(|n| launch.worker(&["--group", "dst", "--node", &n.to_string(), "--replica", name])).collect()
    };
    let mut workers: Vec<_> = (0..2).map(|n| launch.worker(&["--group", "src", "--node", &n.to_string()])).collect();
    workers.extend(replica("a"));
    let b = replica("b");
    std::thread::sleep(std::time::Duration::from_secs(4));
    for mut w in b {
        w.kill().expect("kill a worker of replica b");
        w.wait().expect("reap it");
    }
    std::thread::sleep(std::time::Duration::from_secs(1));
    workers.extend(replica("b"));
    let (code, v, stdout) = launch.finish();
    assert_eq!(code, Some(0), "{stdout}");
    let refits = v["refits"].as_array().expect("refits");
    let replicas: Vec<u64> = refits.iter().map(|r| r["replicas"].as_u64().unwrap_or(0)).collect();
    // Two, then one while b was gone, then two again.
    let gone = replicas.iter().position(|&n| n == 1).unwrap_or_else(|| panic!("b never left: {replicas:?}"));
    assert!(replicas[..gone].iter().all(|&n| n == 2) && replicas.last() == Some(&2), "{replicas:?}");
    assert_eq!(refits.last().map(|r| &r["ok"]), Some(&Value::Bool(true)), "{v}");
    assert_eq!(v["verified"], true, "{v}");
    for mut w in workers {
        assert!(w.wait().unwrap().success());
    }
}
