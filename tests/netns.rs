//! Emulated hosts (`--netns`): every node in a network namespace of its
//! own, its link shaped by the kernel in both directions. Refits verify on
//! them, `refit bench` bounds them by the busiest node link, and nothing of
//! ours is left afterwards — after a normal exit, after SIGTERM, and after
//! a launcher killed outright (the next run removes what it left).
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
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples").join(name);
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

/// Namespaces, links and shared-memory directories named after launcher `pid`.
fn left_by(pid: u32) -> Vec<String> {
    let run = |args: &[&str]| String::from_utf8_lossy(&Command::new("ip").args(args).output().expect("ip").stdout).into_owned();
    let (ns, link) = (format!("refit-{pid}-"), format!("rf{pid}"));
    let mut left: Vec<String> = run(&["netns", "list"]).lines().filter(|l| l.starts_with(&ns)).map(String::from).collect();
    left.extend(
        run(&["-o", "link", "show"]).lines().filter_map(|l| l.split(": ").nth(1)).filter(|n| n.starts_with(&link)).map(String::from),
    );
    if let Ok(dir) = std::fs::read_dir("/dev/shm") {
        left.extend(dir.filter_map(Result::ok).map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with(&ns)));
    }
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

/// The processes `pid` started (`/proc/<pid>/task/<pid>/children`).
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
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
        h.extend_from_slice(&[0, 0, 0, 0, 0, 4, flags]);
        h
    };
    let forged = |mut h: Vec<u8>| {
        h.extend_from_slice(&[0x5a; 32]);
        h
    };
    let mut shm = hello(2 | 4);
    shm.extend_from_slice(&[0xff; 24]);
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
/// exits with 128 + 15. A launcher killed outright (SIGKILL) cannot; the
/// next launcher removes what it left.
#[test]
fn slow_netns_is_removed_after_sigterm_and_after_sigkill() {
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

    let mut killed = start(&args);
    let gone = killed.id();
    wait_for_hosts(gone);
    assert!(Command::new("kill").args(["-KILL", &gone.to_string()]).status().expect("kill").success());
    let _ = killed.wait();
    assert!(!left_by(gone).is_empty(), "a launcher killed with SIGKILL cannot clean up");
    let next = start(&["launch", "--src", &src, "--dst", &dst, "--netns", "--refits", "1", "--verify"]);
    let out = next.wait_with_output().expect("wait");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(left_by(gone), Vec::<String>::new(), "the next launcher should remove a dead launcher's hosts");
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
