//! Emulated hosts (`--netns`): every node in a network namespace of its
//! own, its link shaped by the kernel in both directions. Refits verify on
//! them, `refit bench` bounds them by the busiest node link, and nothing of
//! ours is left afterwards — after a normal exit, after SIGTERM, and after
//! a launcher killed outright (its watchdog removes what it left; `refit
//! netns --clean`, what a launcher killed with its watchdog left).
//!
//! These need root, `ip` and `tc`; elsewhere each test says it was skipped
//! and why.

use serde_json::Value;
use std::collections::HashSet;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_refit");

fn example(name: &str) -> (String, String) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples").join(name);
    let p = |f: &str| dir.join(f).to_str().expect("utf-8 path").to_string();
    (p("src.json"), p("dst.json"))
}

/// Why emulated hosts cannot be built here, if they cannot.
fn unavailable() -> Option<String> {
    let uid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).and_then(|l| l.split_whitespace().nth(2).map(String::from)));
    if uid.as_deref() != Some("0") {
        return Some("not root".into());
    }
    for program in ["ip", "tc"] {
        if Command::new(program).arg("-V").output().is_err() {
            return Some(format!("no `{program}` on PATH"));
        }
    }
    None
}

macro_rules! needs_netns {
    () => {
        if let Some(why) = unavailable() {
            eprintln!("skipped: --netns needs root, ip and tc: {why}");
            return;
        }
    };
}

fn start(args: &[&str]) -> Child {
    Command::new(BIN).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn refit")
}

fn text(out: &Output) -> String {
    format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Namespaces and links named after launcher `pid`.
fn left_by(pid: u32) -> Vec<String> {
    let run = |args: &[&str]| String::from_utf8_lossy(&Command::new("ip").args(args).output().expect("ip").stdout).into_owned();
    let (ns, link) = (format!("refit-{pid}-"), format!("rf{pid}"));
    let mut left: Vec<String> = run(&["netns", "list"]).lines().filter(|l| l.starts_with(&ns)).map(String::from).collect();
    left.extend(
        run(&["-o", "link", "show"]).lines().filter_map(|l| l.split(": ").nth(1)).filter(|n| n.starts_with(&link)).map(String::from),
    );
    left
}

/// Waits until launcher `pid` has built its hosts.
fn wait_for_hosts(pid: u32) {
    let t = Instant::now();
    while left_by(pid).iter().filter(|n| n.starts_with("refit-")).count() < 2 {
        assert!(t.elapsed() < Duration::from_secs(30), "launcher {pid} built no emulated hosts within 30 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `refit launch --netns` with a process per rank (several processes in
/// one namespace, sharing its memory directory) and per node: every refit
/// verifies, and no namespace, veth, bridge or shared-memory directory of
/// the launcher is left.
#[test]
fn slow_netns_launch_verifies_and_leaves_nothing() {
    needs_netns!();
    let (src, dst) = example("tp-to-tp");
    for per in ["rank", "node"] {
        let args = [
            "launch",
            "--src",
            &src,
            "--dst",
            &dst,
            "--netns",
            "--emulate-nic-mbps",
            "50",
            "--verify",
            "--refits",
            "2",
            "--json",
            "--per-process",
            per,
        ];
        let child = start(&args);
        let pid = child.id();
        let out = child.wait_with_output().expect("wait");
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out)));
        assert_eq!(v["verified"], true, "{v}");
        let refits = v["refits"].as_array().expect("refits");
        assert_eq!(refits.len(), 2, "{v}");
        assert!(refits.iter().all(|r| r["ok"] == true), "{v}");
        assert_eq!(left_by(pid), Vec::<String>::new(), "--per-process {per}: left behind");
    }
}

/// `--netem-delay-ms` delays each node's packets for real (the kernels
/// here have no netem: a tap and a thread of the launcher hold them): the
/// same refits, side by side, without a delay and with 100 ms on every
/// node's egress. A refit is a chain of replies from the nodes to the
/// launcher (status, prepare, connect, run, commit), each crossing one
/// delayed egress, so it takes at least 0.4 s more; and every refit still
/// verifies.
#[test]
fn slow_netns_delay_delays_and_verifies() {
    needs_netns!();
    let (src, dst) = example("tp-to-tp");
    let refit_s = |delay: &str| -> Vec<f64> {
        let args = ["launch", "--src", &src, "--dst", &dst, "--netns", "--netem-delay-ms", delay, "--verify", "--refits", "2", "--json"];
        let child = start(&args);
        let pid = child.id();
        let out = child.wait_with_output().expect("wait");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
        assert_eq!(left_by(pid), Vec::<String>::new(), "--netem-delay-ms {delay}: left behind");
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
        assert_eq!(v["verified"], true, "{v}");
        v["refits"].as_array().expect("refits").iter().map(|r| r["refit_s"].as_f64().expect("refit_s")).collect()
    };
    let (plain, delayed) = (refit_s("0"), refit_s("100"));
    eprintln!("refit_s without a delay {plain:?}, with 100 ms {delayed:?}");
    for (p, d) in plain.iter().zip(&delayed) {
        assert!(d - p >= 0.4, "100 ms on every node's egress added only {:.3} s to a refit ({p:.3} s -> {d:.3} s)", d - p);
    }
}

/// The processes `pid` started (`/proc/<pid>/task/<pid>/children`) that
/// run in another network namespace than this one: its workers, on their
/// emulated hosts (not its watchdog, whose `/proc/<pid>/net/tcp` would be
/// this machine's own table).
fn children(pid: u32) -> Vec<u32> {
    let net = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/net")).ok();
    let ours = net("self");
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter(|p| net(p).is_some_and(|n| Some(n) != ours))
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// The TCP sockets listening in the network namespace of process `pid`
/// (inode and address, from its `/proc/<pid>/net/tcp`).
fn listeners_of(pid: u32) -> Vec<(u64, SocketAddr)> {
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (local, state, inode) = (f.get(1)?, f.get(3)?, f.get(9)?.parse::<u64>().ok()?);
            let (ip, port) = local.split_once(':')?;
            // The address is the kernel's u32 in hex, its bytes in memory order.
            let ip = Ipv4Addr::from(u32::from_str_radix(ip, 16).ok()?.to_le_bytes());
            (*state == "0A").then_some((inode, SocketAddr::from((ip, u16::from_str_radix(port, 16).ok()?))))
        })
        .collect()
}

/// What a stranger without the secret sends to a data port: junk, a
/// handshake claiming an expected endpoint (source rank 0) with no proof, one
/// with a forged proof, one claiming shared memory with absurd region sizes
/// and a forged proof; and nothing at all (a silent socket).
fn stranger_hellos() -> Vec<Vec<u8>> {
    let hello = |flags: u8| {
        let mut h = 0x5449_4652u32.to_le_bytes().to_vec();
        h.extend_from_slice(&[0, 0, 0, 0, 0, 5, flags]);
        h
    };
    let forged = |mut h: Vec<u8>| {
        h.extend_from_slice(&[0x5a; 32]);
        h
    };
    let mut shm = hello(2 | 4);
    shm.extend_from_slice(&[0xff; 32]);
    vec![vec![0xab; 64], hello(0), forged(hello(4)), forged(shm), Vec::new()]
}

/// Strangers at the workers' data ports during every refit, across
/// emulated hosts: each refit opens fresh data-plane endpoints
/// (`--fresh-data-plane`), and as soon as one listens a stranger in the
/// root namespace sends it junk, handshakes claiming an expected endpoint
/// without the secret's proof or with a forged one (one with absurd
/// shared-memory sizes), and a silent socket. 50 ms on every node's egress
/// makes the order certain: a node's data port is open for at least one
/// round trip to the launcher and one between nodes before its real peers
/// arrive, while the strangers, next to the bridge, arrive after one. Every
/// refit still commits and verifies, and the workers log each refusal with
/// its reason.
#[test]
fn slow_netns_strangers_at_the_data_ports_do_not_stop_refits() {
    needs_netns!();
    let (src, dst) = example("tp-to-tp");
    let args = [
        "launch",
        "--src",
        &src,
        "--dst",
        &dst,
        "--netns",
        "--netem-delay-ms",
        "50",
        "--fresh-data-plane",
        "--verify",
        "--refits",
        "3",
        "--json",
    ];
    let child = Command::new(BIN).args(args).env("RUST_LOG", "warn").stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
    let pid = child.id();
    let stop = Arc::new(AtomicBool::new(false));
    let attacker = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut seen: HashSet<(u32, u64)> = HashSet::new();
            let mut strangers = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                for w in children(pid) {
                    for (inode, addr) in listeners_of(w) {
                        if addr.ip().is_loopback() || !seen.insert((w, inode)) {
                            continue;
                        }
                        for bytes in stranger_hellos() {
                            strangers.push(std::thread::spawn(move || {
                                let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else { return };
                                let _ = s.write_all(&bytes);
                                // Silent from here on, until the port closes.
                                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                                let _ = std::io::Read::read(&mut s, &mut [0u8; 16]);
                            }));
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            let n = strangers.len();
            for s in strangers {
                let _ = s.join();
            }
            n
        })
    };
    let out = child.wait_with_output().expect("wait");
    stop.store(true, Ordering::Relaxed);
    let strangers = attacker.join().expect("attacker");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out)));
    assert_eq!(v["verified"], true, "{v}");
    let refits = v["refits"].as_array().expect("refits");
    assert!(refits.len() == 3 && refits.iter().all(|r| r["ok"] == true), "{v}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let refused: Vec<&str> = stderr.lines().filter(|l| l.contains("refused a data-plane connection")).collect();
    eprintln!("{strangers} strangers; {} data-plane refusals logged", refused.len());
    assert!(refused.iter().all(|l| l.starts_with("WARN ")), "{stderr}");
    assert!(refused.iter().any(|l| l.contains("not a refit handshake")), "junk was not refused and logged:\n{stderr}");
    assert!(
        refused.iter().any(|l| l.contains("claimed to be src rank 0") && l.contains("proof of the job's secret is missing or wrong")),
        "a stranger's handshake was not refused and logged:\n{stderr}"
    );
    assert_eq!(left_by(pid), Vec::<String>::new());
}

/// SIGTERM in the middle of a launch: the launcher removes its hosts and
/// exits with 128 + 15.
#[test]
fn slow_netns_is_removed_after_sigterm() {
    needs_netns!();
    let (src, dst) = example("tp-to-tp");
    let args = ["launch", "--src", &src, "--dst", &dst, "--netns", "--emulate-nic-mbps", "20", "--refits", "1000", "--json"];
    let term = start(&args);
    let pid = term.id();
    wait_for_hosts(pid);
    std::thread::sleep(Duration::from_millis(300));
    assert!(Command::new("kill").args(["-TERM", &pid.to_string()]).status().expect("kill").success());
    let out = term.wait_with_output().expect("wait");
    assert_eq!(out.status.code(), Some(143), "{}", text(&out));
    assert_eq!(left_by(pid), Vec::<String>::new(), "left behind after SIGTERM");
    assert_eq!(watchdogs_of(pid), Vec::<u32>::new(), "the watchdog outlived a launcher that cleaned up");
}

/// Everything of launcher `pid` the kernel and the file system still hold:
/// [`left_by`] (namespaces, links, shared-memory directories), qdiscs on
/// its links, namespace mount points, its ownership record and processes
/// in its namespaces.
fn all_left_by(pid: u32) -> Vec<String> {
    let mut left = left_by(pid);
    let qdiscs = Command::new("tc").args(["qdisc", "show"]).output().expect("tc");
    let dev = format!("dev rf{pid}");
    left.extend(String::from_utf8_lossy(&qdiscs.stdout).lines().filter(|l| l.contains(&dev)).map(|l| format!("qdisc: {l}")));
    let ns = format!("refit-{pid}-");
    if let Ok(dir) = std::fs::read_dir("/run/netns") {
        left.extend(
            dir.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&ns))
                .map(|n| format!("/run/netns/{n}")),
        );
    }
    let record = PathBuf::from(format!("/run/refit-netns/{pid}"));
    if record.exists() {
        left.push(record.display().to_string());
    }
    left
}

/// Processes running `refit netns --watch <pid>`: launcher `pid`'s watchdog.
fn watchdogs_of(pid: u32) -> Vec<u32> {
    let want = format!("netns\0--watch\0{pid}\0");
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .filter(|p| std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| String::from_utf8_lossy(&c).contains(&want)))
        .collect()
}

/// Pids of the processes inside launcher `pid`'s namespaces (its workers).
fn workers_of(pid: u32) -> Vec<u32> {
    let list = Command::new("ip").args(["netns", "list"]).output().expect("ip");
    let ns = format!("refit-{pid}-");
    let names: Vec<String> = String::from_utf8_lossy(&list.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&ns))
        .map(String::from)
        .collect();
    names
        .iter()
        .flat_map(|n| {
            let out = Command::new("ip").args(["netns", "pids", n]).output().expect("ip");
            String::from_utf8_lossy(&out.stdout).split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<u32>>()
        })
        .collect()
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
}

/// Waits up to `within` until `done` holds; whether it did.
fn eventually(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < within {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    done()
}

/// Starts `args` with 1% loss and a 1 ms delay where the kernel has their
/// parts (a launch asking for a missing one is refused: then with less);
/// returns once its hosts are built, with the arguments it took.
fn start_with_netem(args: &[&str]) -> (Child, Vec<String>) {
    let loss = ["--netem-loss-pct", "1"];
    let delay = ["--netem-delay-ms", "1"];
    for extra in [&[loss, delay][..], &[loss], &[delay], &[]] {
        let full: Vec<String> = args.iter().copied().chain(extra.iter().flatten().copied()).map(String::from).collect();
        let mut child = Command::new(BIN).args(&full).stdout(Stdio::null()).stderr(Stdio::inherit()).spawn().expect("spawn refit");
        let pid = child.id();
        let t = Instant::now();
        loop {
            if left_by(pid).iter().filter(|n| n.starts_with("refit-")).count() >= 2 {
                return (child, full);
            }
            if let Ok(Some(status)) = child.try_wait() {
                // (Why, on stderr.)
                eprintln!("{full:?}: {status}");
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "launcher {pid} built no emulated hosts within 30 s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    panic!("no launch with --netns started");
}

/// A launcher killed with SIGKILL mid-run (workers in every namespace, a
/// shaped link per node in both directions, and, where the kernel has
/// them, the loss filter's `ifb` and BPF filters and the delay line's
/// taps): its watchdog notices the death and removes every namespace,
/// link, qdisc, shared-memory directory and process of that run, and the
/// ownership record, with no other launcher started. Then a launcher and
/// its watchdog both killed: `refit netns --clean` removes what they left.
#[test]
fn slow_netns_sigkill_leaves_nothing() {
    needs_netns!();
    let (src, dst) = example("tp-to-tp");
    let base = ["launch", "--src", &src, "--dst", &dst, "--netns", "--emulate-nic-mbps", "20", "--refits", "1000", "--json"];
    let (mut killed, args) = start_with_netem(&base);
    let gone = killed.id();
    assert!(
        eventually(Duration::from_secs(60), || workers_of(gone).len() >= 12),
        "launcher {gone} started no workers: {:?}",
        left_by(gone)
    );
    let workers = workers_of(gone);
    let watchdogs = watchdogs_of(gone);
    assert_eq!(watchdogs.len(), 1, "launcher {gone} has no watchdog");
    let before = all_left_by(gone);
    assert!(before.iter().any(|l| l.starts_with("qdisc: ")), "no shaped link to check: {before:?}");
    assert!(Command::new("kill").args(["-KILL", &gone.to_string()]).status().expect("kill").success());
    let _ = killed.wait();
    let t = Instant::now();
    let clean = eventually(Duration::from_secs(30), || all_left_by(gone).is_empty() && !alive(watchdogs[0]));
    assert!(clean, "after SIGKILL, left behind: {:?} (watchdog alive: {})", all_left_by(gone), alive(watchdogs[0]));
    eprintln!("launcher {gone} killed: everything removed by its watchdog within {:?}", t.elapsed());
    let survivors: Vec<u32> = workers.iter().copied().filter(|&w| alive(w)).collect();
    assert!(survivors.is_empty(), "workers of the killed launcher still running: {survivors:?}");

    // The launcher and its watchdog killed at once: everything stays,
    // stale by the ownership record, until `refit netns --clean`.
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut both = start(&args);
    let pid = both.id();
    wait_for_hosts(pid);
    let dog = watchdogs_of(pid);
    assert_eq!(dog.len(), 1, "launcher {pid} has no watchdog");
    assert!(!all_left_by(pid).is_empty(), "launcher {pid} built nothing?");
    assert!(Command::new("kill").args(["-KILL", &dog[0].to_string(), &pid.to_string()]).status().expect("kill").success());
    let _ = both.wait();
    let out = Command::new(BIN).args(["netns", "--clean"]).output().expect("refit netns --clean");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(all_left_by(pid).is_empty(), "after `refit netns --clean`: {:?}\n{said}", all_left_by(pid));
    // (A launcher of a test running alongside may have removed them first,
    // as it starts.)
    if let Some(line) = said.lines().find(|l| l.starts_with(&format!("launcher {pid}:"))) {
        assert!(line.contains(": removed") && line.contains("its launcher is not running"), "{said}");
    }
}

/// What is named after a pid whose process is not the launcher that
/// recorded it (the pid reused since: recorded start time differs) is
/// stale: `refit netns --clean` removes it, while a running launcher's
/// (the right start time) and names without a record are kept.
#[test]
fn netns_clean_sees_through_a_reused_pid() {
    needs_netns!();
    // A live process standing in for the one that reused the dead
    // launcher's pid.
    let mut stand_in = Command::new("sleep").arg("60").spawn().expect("sleep");
    let pid = stand_in.id();
    let ns = format!("refit-{pid}-s0");
    let record = PathBuf::from(format!("/run/refit-netns/{pid}"));
    let cleanup = |ns: &str| {
        let _ = Command::new("ip").args(["netns", "del", ns]).output();
        let _ = std::fs::remove_file(&record);
    };
    let made = Command::new("ip").args(["netns", "add", &ns]).status().expect("ip");
    assert!(made.success(), "ip netns add {ns}");
    let clean = || Command::new(BIN).args(["netns", "--clean"]).output().expect("refit netns --clean");

    // No record: a launcher of an older build, perhaps; kept while it runs.
    let out = clean();
    let kept = left_by(pid);
    if kept.len() != 1 {
        cleanup(&ns);
    }
    assert_eq!(kept.len(), 1, "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("launcher {pid}: kept")), "{}", text(&out));

    // Recorded with another start time: the recorder is gone.
    std::fs::create_dir_all("/run/refit-netns").expect("record dir");
    std::fs::write(&record, "1\n").expect("record");
    let out = clean();
    let (left, record_left) = (left_by(pid), record.exists());
    cleanup(&ns);
    let _ = stand_in.kill();
    let _ = stand_in.wait();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(left, Vec::<String>::new(), "{}", text(&out));
    assert!(!record_left, "the stale record stays: {}", text(&out));
    // (A launcher of a test running alongside may have removed them first,
    // for the same reason, as it starts.)
    let said = String::from_utf8_lossy(&out.stdout);
    if let Some(line) = said.lines().find(|l| l.starts_with(&format!("launcher {pid}:"))) {
        assert!(line.contains(": removed") && line.contains("belongs to another process"), "{said}");
    }
}

/// `refit bench --transport process --netns` bounds the reshard by the
/// busiest node link in either direction and reports every node's bytes.
#[test]
fn slow_netns_bench_bounds_by_the_busiest_node_link() {
    needs_netns!();
    let (src, dst) = example("tp-to-tp");
    let args =
        ["bench", "--src", &src, "--dst", &dst, "--transport", "process", "--netns", "--emulate-nic-mbps", "20", "--reps", "1", "--json"];
    let child = start(&args);
    let pid = child.id();
    let out = child.wait_with_output().expect("wait");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out)));
    assert!(v["link_model"].as_str().is_some_and(|m| m.starts_with("netns")), "{v}");
    // Every node of both groups, each cross-node byte out of one and into
    // another; tp-to-tp's destination nodes (2 ranks, 40 MB/s) each take
    // in about 8 MiB, the most any link carries.
    let sum = |key: &str| v[key].as_object().expect(key).values().map(|b| b.as_u64().expect("bytes")).sum::<u64>();
    let names: Vec<&String> = v["node_in_bytes"].as_object().expect("node_in_bytes").keys().collect();
    assert_eq!(names, ["dst node 0", "dst node 1", "src node 0", "src node 1"], "{v}");
    assert_eq!(sum("node_out_bytes"), v["links"]["reshard"]["inter_node_bytes"].as_u64().expect("inter-node bytes"), "{v}");
    assert_eq!(sum("node_in_bytes"), sum("node_out_bytes"), "{v}");
    assert_eq!(v["node_rate_bytes_per_s"]["src node 0"], 80_000_000, "{v}");
    assert_eq!(v["node_rate_bytes_per_s"]["dst node 1"], 40_000_000, "{v}");
    let into_dst0 = v["node_in_bytes"]["dst node 0"].as_f64().expect("bytes");
    assert!(into_dst0 >= (8 << 20) as f64, "{v}");
    assert_eq!(v["lower_bound_s"].as_f64(), Some(into_dst0 / 40e6), "{v}");
    assert_eq!(v["bound_link"], "dst node 0 in", "{v}");
    // The kernel shapes the links: the reshard cannot beat the bound
    // (a little slack for the bucket's burst).
    let efficiency = v["efficiency"].as_f64().expect("efficiency");
    assert!(efficiency > 0.0 && efficiency < 1.05, "{v}");
    assert!(v["baseline_over_reshard"].as_f64().is_some(), "{v}");
    assert!(v["egress_lower_bound_s"].is_null(), "{v}");
    assert_eq!(left_by(pid), Vec::<String>::new());
}

/// Misuse is refused with one line and exit code 2, before anything is built.
#[test]
fn netns_misuse_is_refused() {
    needs_netns!();
    let (src, dst) = example("tp-to-tp");
    let cases: [(&[&str], &str); 3] = [
        (&["launch", "--src", &src, "--dst", &dst, "--netns", "--no-spawn", "--secret-file", "/dev/null"], "--no-spawn"),
        (&["bench", "--src", &src, "--dst", &dst, "--netns"], "--transport process"),
        (&["launch", "--src", &src, "--dst", &dst, "--netem-delay-ms", "5"], "--netns"),
    ];
    for (args, says) in cases {
        let out = Command::new(BIN).args(args).output().expect("spawn refit");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}

/// `refit chaos --netns`: the network cases (a link cut mid-transfer and
/// restored, a node partitioned from the launcher but not from its peers,
/// a peer that stops reading, packet loss, 100 ms delay; the last two
/// where the kernel has their parts: ifb, clsact, cls_bpf, act_mirred, tun)
/// each fail the refit within its bound, leave no torn version, and the
/// next refit after healing commits.
#[test]
fn slow_netns_network_chaos_keeps_the_promise() {
    needs_netns!();
    let args = ["chaos", "--netns", "--only", "net:", "--emulate-nic-mbps", "4", "--deadline-s", "3", "--json"];
    let child = start(&args);
    let pid = child.id();
    let out = child.wait_with_output().expect("wait");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out)));
    let cases = v["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 5, "{v}");
    for c in cases {
        if let Some(why) = c["skipped"].as_str() {
            // Only delay (netem) and loss (its filter's kernel parts) may
            // be skipped, with the reason.
            assert!(why.contains("netem"), "{c}");
            eprintln!("{}: skipped: {why}", c["case"]);
            continue;
        }
        assert_eq!(c["hang"], false, "{c}");
        assert_eq!(c["torn"], false, "{c}");
        assert_eq!(c["recovered"], true, "{c}");
    }
    for c in &cases[..3] {
        assert_eq!(c["refit_failed"], true, "a link cut, a partition or a stopped peer mid-transfer must fail the refit: {c}");
    }
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(left_by(pid), Vec::<String>::new());
}
