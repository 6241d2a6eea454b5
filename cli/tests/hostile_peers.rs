//! Strangers on the network against a running job (loopback only), and
//! set-ups a careless user makes: each runs beside a real `refit launch
//! --no-spawn` whose workers this test starts, as a cluster launcher
//! would; the refits must still commit and verify, and the launcher and
//! workers must log what they refused or fell back from, with the reason.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_refit");
const SECRET: &str = "a job secret the strangers do not hold";

fn example(name: &str) -> (String, String) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples").join(name);
    let p = |f: &str| dir.join(f).to_str().expect("utf-8 path").to_string();
    (p("src.json"), p("dst.json"))
}

fn ranks(path: &str) -> u64 {
    let text = std::fs::read_to_string(path).expect("layout file");
    serde_json::from_str::<serde_json::Value>(&text).expect("layout json")["ranks"].as_u64().expect("ranks")
}

/// A launcher waiting for workers, and the rendezvous address it printed.
struct Launch {
    launcher: Child,
    addr: String,
    stdout: BufReader<std::process::ChildStdout>,
    src: String,
    dst: String,
}

impl Launch {
    fn start(pair: &str, refits: u32) -> Launch {
        let (src, dst) = example(pair);
        let mut launcher = Command::new(BIN)
            .args(["launch", "--no-spawn", "--verify", "--deadline-s", "30", "--refits", &refits.to_string(), "--src", &src, "--dst", &dst])
            .env("REFIT_SECRET", SECRET)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start launcher");
        let mut stdout = BufReader::new(launcher.stdout.take().expect("piped stdout"));
        let mut first = String::new();
        stdout.read_line(&mut first).expect("rendezvous line");
        let addr = first.split_whitespace().nth(3).expect("address in the first line").trim_end_matches(':').to_string();
        Launch { launcher, addr, stdout, src, dst }
    }

    /// Starts one worker per rank of both groups.
    fn workers(&self) -> Vec<Child> {
        self.workers_as(|_| None)
    }

    /// As [`Launch::workers`], the workers of group `g` as user and group
    /// `uid_of(g)` where given (root only), their warnings on a pipe.
    fn workers_as(&self, uid_of: impl Fn(&str) -> Option<u32>) -> Vec<Child> {
        use std::os::unix::process::CommandExt;
        let groups = [("src", ranks(&self.src)), ("dst", ranks(&self.dst))];
        groups
            .iter()
            .flat_map(|&(g, n)| (0..n).map(move |r| (g, r)))
            .map(|(g, r)| {
                let mut worker = Command::new(BIN);
                worker
                    .args(["worker", "--src", &self.src, "--dst", &self.dst, "--group", g, "--rank", &r.to_string()])
                    .args(["--rendezvous", &self.addr])
                    .env("REFIT_SECRET", SECRET)
                    .env("RUST_LOG", "warn")
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped());
                if let Some(uid) = uid_of(g) {
                    worker.uid(uid).gid(uid);
                }
                worker.spawn().expect("start worker")
            })
            .collect()
    }

    /// Waits for the launcher; its stdout and stderr. It must have
    /// succeeded, every refit verified.
    fn finish(self, workers: Vec<Child>) -> (String, String) {
        let (out, err, _) = self.finish_logged(workers);
        (out, err)
    }

    /// As [`Launch::finish`], with what the workers wrote on stderr.
    fn finish_logged(mut self, workers: Vec<Child>) -> (String, String, String) {
        // Both pipes drained at once: a launcher that fills one while the
        // other is read to its end would wait for us forever.
        let stderr = self.launcher.stderr.take().map(|mut e| {
            std::thread::spawn(move || {
                let mut err = String::new();
                e.read_to_string(&mut err).expect("launcher stderr");
                err
            })
        });
        let mut out = String::new();
        self.stdout.read_to_string(&mut out).expect("launcher stdout");
        let err = stderr.map(|t| t.join().expect("stderr reader")).unwrap_or_default();
        let status = self.launcher.wait().expect("launcher");
        let mut logged = String::new();
        for w in workers {
            if let Ok(done) = w.wait_with_output() {
                logged.push_str(&String::from_utf8_lossy(&done.stderr));
            }
        }
        assert!(status.success(), "launcher failed\n{out}\n{err}\n{logged}");
        assert!(out.contains("committed weights of version"), "{out}");
        (out, err, logged)
    }
}

/// 300 connections that never say a word, opened at the rendezvous just
/// before the workers join: they do not keep the workers out (silent
/// sockets have a budget of their own: a newcomer pushes one out, and they
/// leave after the `Hello` deadline), and the launcher logs every one it
/// dropped with the reason.
#[test]
fn silent_control_connections_do_not_keep_workers_out() {
    let launch = Launch::start("tp-to-tp", 2);
    let silent: Vec<TcpStream> = (0..300).map(|_| TcpStream::connect(&launch.addr).expect("silent connection")).collect();
    let workers = launch.workers();
    let (_, err) = launch.finish(workers);
    drop(silent);
    // Pushed out by newcomers, or silent past the `Hello` deadline (on a
    // loaded machine the launcher may accept them slower than that). The
    // last ones, at most the unauthenticated budget, may still be inside
    // their `Hello` deadline when a quick launch ends: those close with the
    // launcher, unlogged. Every other one was dropped and logged.
    let reasons = ["rejected connection: not authenticated before newer connections", "rejected connection: no handshake in time"];
    let dropped = err.lines().filter(|l| reasons.iter().any(|r| l.contains(r))).count();
    let budget = actors::remote::NodeConfig::default().max_unauthenticated;
    assert!(dropped >= 300 - budget, "expected every silent connection dropped and logged but the last {budget}:\n{err}");
    assert!(err.lines().all(|l| !l.contains("rejected connection") || l.starts_with("WARN ")), "{err}");
}

/// A trainer and an engine run by two users on one host (service accounts
/// of their own): neither can map the other's shared memory, so every pair
/// across the two talks TCP (pairs of one user still share memory), each
/// refit commits and verifies, and both ends of such a pair say why, once.
/// Needs root (to start workers as another user).
#[test]
fn two_users_on_one_host_refit_over_tcp_and_say_why() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: starting workers as another user needs root");
        return;
    }
    let launch = Launch::start("tp-to-tp", 3);
    let workers = launch.workers_as(|g| (g == "dst").then_some(54_321));
    let (out, _, logged) = launch.finish_logged(workers);
    assert!(out.contains("3 refit(s), 0 failed") && out.contains("version 3 match on every destination rank"), "{out}");
    let fell_back: Vec<&str> = logged.lines().filter(|l| l.contains("no shared memory with this peer: the pair talks TCP")).collect();
    let says = |side: &str| fell_back.iter().any(|l| l.contains(&format!("me={side}")) && l.contains("runs as user"));
    assert!(says("src rank 0") && says("dst rank 0"), "both ends say why they talk TCP:\n{logged}");
    // Once per pair and process, not once per refit.
    let mut pairs: Vec<&str> = fell_back.iter().map(|l| l.split(" reason=").next().unwrap_or(l)).collect();
    let all = pairs.len();
    pairs.sort_unstable();
    pairs.dedup();
    assert_eq!(pairs.len(), all, "a pair said it more than once:\n{logged}");
}
