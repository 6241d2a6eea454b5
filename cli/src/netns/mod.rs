//! Emulated hosts: every node of both groups of a multi-process refit in a
//! network namespace of its own, so that the kernel — not our sender —
//! shapes each node's network link, in both directions, as a cluster's
//! NICs would (`refit launch|bench|chaos --netns`).
//!
//! For a launcher with process id `P` and a free private prefix `10.N`:
//!
//! - a bridge `rfPbr` in the root namespace with address `10.N.0.1/16`:
//!   the launcher's rendezvous listens there ([`Hosts::gateway`]);
//! - per node (source node `k`: `s<k>`, destination node `k`: `d<k>`) a
//!   namespace `refit-P-s<k>`, a veth pair whose root-side end `rfPs<k>`
//!   is a port of the bridge and whose other end is `eth0` inside, with
//!   address `10.N.1.<k+1>/16` (sources) or `10.N.128.<k+1>/16`
//!   (destinations); workers joining from there find their data address by
//!   themselves (the interface that reaches the rendezvous);
//! - with a rate, a `tbf` qdisc at the node's rate (its ranks × the
//!   per-rank rate) on the egress of **both** ends of its veth: inside, the
//!   node's egress; root side, the node's ingress (what the bridge forwards
//!   to it). With a loss rate, a classic-BPF filter on the node's egress
//!   (`clsact`) that matches that fraction of its IP packets at random
//!   (`ld rand`) and redirects them to an `ifb` device left down, which
//!   drops them. With a delay, a second filter there redirects the node's
//!   IP packets into a tap device whose frames a thread of the launcher
//!   holds for the delay before they go on through the `tbf` (`netns/delay.rs`;
//!   one-way: a message between two nodes is delayed once). The kernels
//!   this project runs on have no `netem` but have `cls_bpf`,
//!   `act_mirred`, `ifb` and `tun`, and the same mechanisms serve every
//!   kernel;
//!
//! Everything of launcher `P` is found by name and removed
//! ([`remove_owned_by`]) when the [`Hosts`] is dropped (normal exit, error,
//! panic), from a signal-watching thread on SIGINT, SIGTERM and SIGHUP
//! (then the process exits with 128 + the signal), and, for a launcher
//! killed outright (SIGKILL), by its watchdog, a process that notices the
//! launcher's death (the launcher's end of a pipe closes). What even the
//! watchdog could not remove (it was killed too) is stale by the launcher's
//! ownership record (pid and start time, so a reused pid is not taken for
//! the launcher): the next [`Hosts::create`] and `refit netns --clean`
//! ([`clean`]) remove it. Processes still inside a namespace being removed
//! are killed first.

mod cleanup;
mod delay;
mod owner;

pub use cleanup::remove_owned_by;
pub use owner::watch;

use cleanup::remove_stale;
use delay::DelayLine;
use reshard::{Group, Layout};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// The lock file under which launchers pick their prefix and build.
const LOCK_FILE: &str = "/run/refit-netns.lock";
/// How long a packet may wait in a shaping queue (tbf `latency`).
const QUEUE_LATENCY_MS: u64 = 100;

/// How to build the hosts.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NetnsConfig {
    /// Per-rank network rate in bytes/s: each node's link is shaped at its
    /// ranks × this, in each direction. `None`: links are not shaped.
    pub rank_bytes_per_s: Option<u64>,
    /// Delay and loss on each node's egress.
    pub netem: Netem,
    /// The `refit` program, run as the hosts' watchdog (`refit netns
    /// --watch`): it removes them if this process is killed outright.
    /// `None`: no watchdog (the next launcher or `refit netns --clean`
    /// removes what a killed one left).
    pub watchdog: Option<PathBuf>,
}

/// Delay (a delay line, `netns/delay.rs`) and loss (a random BPF filter) on a node's
/// egress (nothing by default).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Netem {
    /// One-way delay.
    pub delay: Option<Duration>,
    /// Percentage of packets dropped.
    pub loss_pct: Option<f64>,
}

impl Netem {
    /// The delay, when one is asked for.
    fn delay(&self) -> Option<Duration> {
        self.delay.filter(|d| !d.is_zero())
    }

    /// The loss filter's classic-BPF program, in `tc`'s `bytecode` form,
    /// when a loss rate is asked for: `A = byte 15 (the IPv4 TOS); if A &
    /// DELAYED_TOS: no match (a packet coming back from the delay line was
    /// drawn for already); A = random u32; if A >= T: no match (the packet
    /// passes) else match (dropped)`, `T` = the rate's share of 2^32.
    fn loss_bytecode(&self) -> Option<String> {
        let p = self.loss_pct.filter(|p| *p > 0.0)?;
        let t = ((p.min(100.0) / 100.0) * 4_294_967_296.0).round().min(u32::MAX as f64) as u32;
        // `ld rand` is a load from SKF_AD_OFF (-0x1000) + SKF_AD_RANDOM (56).
        let rand = (-0x1000i32 + 56) as u32;
        Some(format!("6,48 0 0 15,69 2 0 {},32 0 0 {rand},53 0 1 {t},6 0 0 0,6 0 0 {}", delay::DELAYED_TOS, u32::MAX))
    }
}

/// One node to emulate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeSpec {
    /// Its group.
    pub group: Group,
    /// Its index within the group.
    pub node: u32,
    /// The ranks it hosts (the last node of a group may host fewer than
    /// `ranks_per_node`).
    pub ranks: u32,
}

impl NodeSpec {
    /// Every node of a layout pair, sources first.
    pub fn of(src: &Layout, dst: &Layout) -> Vec<NodeSpec> {
        let mut out = Vec::new();
        for (group, l) in [(Group::Src, src), (Group::Dst, dst)] {
            let rpn = l.ranks_per_node().max(1);
            for node in 0..l.nodes() {
                let ranks = l.ranks().saturating_sub(node * rpn).min(rpn);
                out.push(NodeSpec { group, node, ranks });
            }
        }
        out
    }

    /// `s<k>` or `d<k>`: the node's part of every name.
    fn tag(&self) -> String {
        format!("{}{}", if self.group == Group::Src { "s" } else { "d" }, self.node)
    }
}

/// One emulated host.
#[derive(Clone, Debug)]
pub struct Host {
    /// The node.
    pub spec: NodeSpec,
    /// Its network namespace (`refit-P-s0`).
    pub netns: String,
    /// The root-side end of its veth (a bridge port; `rfPs0`).
    pub veth: String,
    /// Its address.
    pub ip: Ipv4Addr,
    /// Its link's rate in bytes/s, each direction (`None`: unshaped).
    pub rate: Option<u64>,
}

impl Host {
    /// Shapes the node's egress (inside its namespace): a `tbf` at the
    /// link's rate, the loss filter (if a loss rate is asked for) and the
    /// delay line (if a delay is; returned: it runs while it lives).
    fn shape_egress(&self, netem: &Netem) -> Result<Option<DelayLine>, String> {
        let ns = self.netns.as_str();
        if let Some(rate) = self.rate {
            tc(&words(&["-n", ns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:"], tbf(rate)))?;
        }
        let loss = netem.loss_bytecode();
        if loss.is_some() || netem.delay().is_some() {
            tc(&["-n", ns, "qdisc", "add", "dev", "eth0", "clsact"])
                .map_err(|e| format!("{e} (delay and loss need the kernel's clsact)"))?;
        }
        if let Some(program) = loss {
            add_loss_filter(ns, "eth0", &program)?;
        }
        netem.delay().map(|d| add_delay_line(ns, "eth0", d)).transpose()
    }

    /// Takes the node's link down (`up` false: as if its cable were
    /// pulled: the root-side end of its veth goes down) or back up. Back up,
    /// the neighbour entries the outage left failed, on both sides, are
    /// flushed: a failed entry answers a new connection with "no route to
    /// host" until it is probed again, seconds later.
    pub fn set_link(&self, up: bool) -> Result<(), String> {
        ip(&["link", "set", &self.veth, if up { "up" } else { "down" }])?;
        if up {
            ip(&["-n", &self.netns, "neigh", "flush", "dev", "eth0"])?;
            ip(&["neigh", "flush", "to", &self.ip.to_string()])?;
        }
        Ok(())
    }

    /// Cuts the node off from `launcher` (the bridge's address) in both
    /// directions while it still reaches every other node (`cut` false:
    /// heals it): blackhole policy-routing rules inside its namespace.
    pub fn partition_from(&self, launcher: Ipv4Addr, cut: bool) -> Result<(), String> {
        let (gw, verb) = (launcher.to_string(), if cut { "add" } else { "del" });
        ip(&["-n", &self.netns, "rule", verb, "prio", "100", "to", &gw, "blackhole"])?;
        ip(&["-n", &self.netns, "rule", verb, "prio", "101", "from", &gw, "blackhole"])
    }
}

/// A set of emulated hosts, removed when dropped.
pub struct Hosts {
    owner: u32,
    gateway: Ipv4Addr,
    bridge: String,
    hosts: Vec<Host>,
    /// The delay lines running now (one per host while a delay is set).
    delays: Mutex<Vec<DelayLine>>,
    /// Removes the hosts if this process dies without doing so.
    watchdog: Option<owner::Watchdog>,
}

/// Whether this process has a set of hosts (one at a time; also the lock
/// that orders building, dropping and the signal teardown).
static LIVE: Mutex<bool> = Mutex::new(false);

impl Hosts {
    /// Builds one host per node of `nodes` (removing first what launchers
    /// that are gone left behind). Needs root, `ip` and `tc`.
    pub fn create(config: &NetnsConfig, nodes: &[NodeSpec]) -> Result<Hosts, String> {
        check(config)?;
        if nodes.len() > 32_000 {
            return Err(format!("{} nodes: emulated hosts support at most 32000", nodes.len()));
        }
        install_signal_teardown()?;
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        if *live {
            return Err("this process already runs a set of emulated hosts (one at a time)".into());
        }
        // Across launchers: one at a time picks its prefix and builds.
        let _lock = LockFile::take(Path::new(LOCK_FILE))?;
        remove_stale(false);
        let owner = std::process::id();
        let start = owner::start_time(owner).ok_or("cannot read this process's start time from /proc")?;
        let octet = free_octet()?;
        // From here everything named after `owner` is ours: recorded before
        // anything is built, watched in case this process dies.
        owner::write_record(owner, start)?;
        let watchdog = match config.watchdog.as_deref().map(|p| owner::Watchdog::start(p, owner, start)).transpose() {
            Ok(w) => w,
            Err(e) => {
                owner::remove_record(owner);
                return Err(e);
            }
        };
        let net = |third: u32, fourth: u32| Ipv4Addr::new(10, octet, 0, 0).to_bits() | ((third << 8) + fourth);
        let hosts = nodes
            .iter()
            .map(|&spec| {
                let base = if spec.group == Group::Src { net(1, 0) } else { net(128, 0) };
                Host {
                    spec,
                    netns: format!("refit-{owner}-{}", spec.tag()),
                    veth: format!("rf{owner}{}", spec.tag()),
                    ip: Ipv4Addr::from_bits(base + spec.node + 1),
                    rate: config.rank_bytes_per_s.map(|r| r.saturating_mul(u64::from(spec.ranks.max(1)))),
                }
            })
            .collect();
        let hosts = Hosts {
            owner,
            gateway: Ipv4Addr::from_bits(net(0, 1)),
            bridge: format!("rf{owner}br"),
            hosts,
            delays: Mutex::new(Vec::new()),
            watchdog,
        };
        // From here a signal's teardown removes whatever exists.
        *live = true;
        if let Err(e) = hosts.build(config) {
            hosts.lines().clear();
            remove_owned_by(owner);
            *live = false;
            // `hosts` is dropped below with `live` false: nothing twice
            // (its watchdog is let go).
            return Err(e);
        }
        Ok(hosts)
    }

    fn build(&self, config: &NetnsConfig) -> Result<(), String> {
        let br = self.bridge.as_str();
        ip(&["link", "add", br, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{}/16", self.gateway), "dev", br])?;
        ip(&["link", "set", br, "up"])?;
        for h in &self.hosts {
            let ns = h.netns.as_str();
            ip(&["netns", "add", ns])?;
            ip(&["link", "add", &h.veth, "type", "veth", "peer", "name", "eth0", "netns", ns])?;
            ip(&["link", "set", &h.veth, "master", br, "up"])?;
            ip(&["-n", ns, "addr", "add", &format!("{}/16", h.ip), "dev", "eth0"])?;
            ip(&["-n", ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            let line = h.shape_egress(&config.netem)?;
            self.lines().extend(line);
            // The node's ingress: what the bridge forwards to it.
            if let Some(rate) = h.rate {
                tc(&words(&["qdisc", "add", "dev", &h.veth, "root", "handle", "1:"], tbf(rate)))?;
            }
        }
        Ok(())
    }

    /// Puts `netem`'s delay and loss on every node's egress from now on
    /// (`Netem::default()`: none), keeping each link's rate.
    pub fn set_netem(&self, netem: &Netem) -> Result<(), String> {
        let mut lines = self.lines();
        for h in &self.hosts {
            // The shaping and the filters are rebuilt from the top (a
            // missing one is fine).
            let _ = tc(&["-n", &h.netns, "qdisc", "del", "dev", "eth0", "root"]);
            let _ = tc(&["-n", &h.netns, "qdisc", "del", "dev", "eth0", "clsact"]);
        }
        // Nothing redirects into the old lines any more: their taps go.
        lines.clear();
        for h in &self.hosts {
            lines.extend(h.shape_egress(netem)?);
        }
        Ok(())
    }

    fn lines(&self) -> std::sync::MutexGuard<'_, Vec<DelayLine>> {
        self.delays.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The bridge's address: where the launcher's rendezvous listens.
    pub fn gateway(&self) -> Ipv4Addr {
        self.gateway
    }

    /// Every host, sources first.
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// The host of node `node` of `group`.
    pub fn host(&self, group: Group, node: u32) -> Option<&Host> {
        self.hosts.iter().find(|h| h.spec.group == group && h.spec.node == node)
    }

    /// The launcher's process id (every name carries it).
    pub fn owner(&self) -> u32 {
        self.owner
    }

    /// The process id of the hosts' watchdog, if they have one.
    pub fn watchdog_pid(&self) -> Option<u32> {
        self.watchdog.as_ref().map(owner::Watchdog::pid)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        self.lines().clear();
        if *live {
            remove_owned_by(self.owner);
            *live = false;
        }
        // The record is gone: the watchdog leaves without a thing to do.
        if let Some(w) = self.watchdog.take() {
            w.dismiss();
        }
    }
}

/// The `tbf` arguments for `rate` bytes/s: a bucket of 10 ms of traffic
/// (at least 64 KiB, so that segmentation offload's large packets pass).
fn tbf(rate: u64) -> Vec<String> {
    let burst = (rate / 100).max(64 << 10);
    let rate = format!("{}bit", rate.saturating_mul(8));
    ["tbf", "rate", &rate, "burst", &burst.to_string(), "latency", &format!("{QUEUE_LATENCY_MS}ms")].map(String::from).to_vec()
}

/// The device of a namespace that lost packets are redirected to (an `ifb`
/// left down, so the redirect drops them).
const DROP_DEV: &str = "rfdrop";

/// Drops a random share of the IP packets leaving `dev` in namespace `ns`:
/// the classic-BPF `program` ([`Netem::loss_bytecode`]) on its egress hook
/// (`clsact`, already there), matched packets redirected to [`DROP_DEV`].
fn add_loss_filter(ns: &str, dev: &str, program: &str) -> Result<(), String> {
    let needs = |e: String| format!("{e} (a loss rate needs the kernel's ifb, clsact, cls_bpf and act_mirred)");
    if ip(&["-n", ns, "link", "show", DROP_DEV]).is_err() {
        ip(&["-n", ns, "link", "add", DROP_DEV, "type", "ifb"]).map_err(needs)?;
    }
    redirect_filter(Filter { ns, dev, hook: "egress", protocol: "ip", prio: "1", program }, DROP_DEV).map_err(needs)
}

/// Where a classic-BPF filter sits and what it matches.
struct Filter<'a> {
    ns: &'a str,
    dev: &'a str,
    /// `ingress` or `egress` (the device's `clsact` hooks).
    hook: &'a str,
    /// `ip` or `all`.
    protocol: &'a str,
    prio: &'a str,
    /// The program, in `tc`'s `bytecode` form.
    program: &'a str,
}

/// Adds filter `f`, its matches redirected to the egress of device `to`
/// (loss, the delay line's way in and its way out).
fn redirect_filter(f: Filter<'_>, to: &str) -> Result<(), String> {
    let Filter { ns, dev, hook, protocol, prio, program } = f;
    tc(&[
        "-n", ns, "filter", "add", "dev", dev, hook, "protocol", protocol, "prio", prio, "bpf", "bytecode", program, "action", "mirred",
        "egress", "redirect", "dev", to,
    ])
}

/// Delays the IP packets leaving `dev` in namespace `ns` by `delay`: a
/// [`DelayLine`] and the filters that take packets into it and back out
/// (the wiring of `netns/delay.rs`; `dev`'s `clsact` already there).
fn add_delay_line(ns: &str, dev: &str, delay: Duration) -> Result<DelayLine, String> {
    let needs = |e: String| format!("{e} (a delay needs the kernel's tun, clsact, cls_bpf and act_mirred)");
    let line = DelayLine::start(ns, delay)?;
    // Room for a window of frames between two reads of the thread (a tap
    // queues 500 by default, and drops the rest of a burst).
    ip(&["-n", ns, "link", "set", delay::TAP, "txqueuelen", "100000", "up"]).map_err(needs)?;
    tc(&["-n", ns, "qdisc", "add", "dev", delay::TAP, "clsact"]).map_err(needs)?;
    let all = format!("1,6 0 0 {}", u32::MAX);
    redirect_filter(Filter { ns, dev: delay::TAP, hook: "ingress", protocol: "all", prio: "1", program: &all }, dev).map_err(needs)?;
    let into = delay::redirect_bytecode();
    redirect_filter(Filter { ns, dev, hook: "egress", protocol: "ip", prio: "2", program: &into }, delay::TAP).map_err(needs)?;
    Ok(line)
}

/// `head` then `tail`, as one argument list.
fn words(head: &[&str], tail: Vec<String>) -> Vec<String> {
    head.iter().map(|w| w.to_string()).chain(tail).collect()
}

/// Whether emulated hosts can be built here: root, `ip` and `tc` (and the
/// delay line's parts when a delay is asked for, the loss filter's when a
/// loss rate is). The error says what is missing.
pub fn check(config: &NetnsConfig) -> Result<(), String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err("--netns needs root (network namespaces, veth pairs, a bridge and tc qdiscs)".into());
    }
    let missing: Vec<&str> = ["ip", "tc"].into_iter().filter(|p| !on_path(p)).collect();
    if !missing.is_empty() {
        return Err(format!("--netns needs {} on PATH (iproute2)", missing.join(" and ")));
    }
    if config.netem.delay().is_some() {
        delay_available()?;
    }
    if config.netem.loss_bytecode().is_some() {
        loss_available()?;
    }
    Ok(())
}

/// Whether the loss filter can be built: tried on the loopback of a
/// throwaway namespace; the error says what is missing.
pub fn loss_available() -> Result<(), String> {
    let ns = probe_netns();
    ip(&["netns", "add", &ns])?;
    let program = Netem { loss_pct: Some(1.0), ..Netem::default() }.loss_bytecode().unwrap_or_default();
    let r = tc(&["-n", &ns, "qdisc", "add", "dev", "lo", "clsact"]).and_then(|()| add_loss_filter(&ns, "lo", &program));
    let _ = ip(&["netns", "del", &ns]);
    r.map_err(|e| format!("--netem-loss-pct: {e}"))
}

/// Whether a delay line can be built: tried on the loopback of a
/// throwaway namespace; the error says what is missing.
pub fn delay_available() -> Result<(), String> {
    let ns = probe_netns();
    ip(&["netns", "add", &ns])?;
    let r = tc(&["-n", &ns, "qdisc", "add", "dev", "lo", "clsact"]).and_then(|()| add_delay_line(&ns, "lo", Duration::from_millis(1)));
    // The line stops (its tap goes) before its namespace does.
    let r = r.map(drop);
    let _ = ip(&["netns", "del", &ns]);
    r.map_err(|e| format!("--netem-delay-ms: {e}"))
}

/// The name of this process's throwaway namespace, cleared of one a dead
/// process with this pid may have left.
fn probe_netns() -> String {
    let ns = format!("refit-{}-probe", std::process::id());
    let _ = ip(&["netns", "del", &ns]);
    ns
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|paths| std::env::split_paths(&paths).any(|d| d.join(program).is_file()))
}

/// Runs `program args`; its stdout, or an error naming the command and
/// quoting the first line it printed on stderr.
fn run<S: AsRef<str>>(program: &str, args: &[S]) -> Result<String, String> {
    let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
    let what = || format!("`{program} {}`", args.join(" "));
    let out = Command::new(program).args(&args).stdin(Stdio::null()).output().map_err(|e| format!("{}: cannot run: {e}", what()))?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let why = stderr.lines().find(|l| !l.trim().is_empty()).unwrap_or("no message").trim().to_string();
    Err(format!("{} failed: {why}", what()))
}

fn ip<S: AsRef<str>>(args: &[S]) -> Result<(), String> {
    run("ip", args).map(drop)
}

fn tc<S: AsRef<str>>(args: &[S]) -> Result<(), String> {
    run("tc", args).map(drop)
}

/// Removes what launchers that are gone left behind (`refit netns
/// --clean`): every namespace and link named
/// after a launcher whose process is not running (or whose pid another
/// process holds now, by its ownership record). One line per launcher:
/// what was removed, or kept and why.
pub fn clean() -> Result<Vec<String>, String> {
    check(&NetnsConfig::default())?;
    let _lock = LockFile::take(Path::new(LOCK_FILE))?;
    let live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    Ok(remove_stale(*live))
}

/// The second octet of a `10.N.0.0/16` no interface or route here uses,
/// 213 to 254 first.
fn free_octet() -> Result<u8, String> {
    let mut used = Vec::new();
    for args in [&["-o", "-4", "addr", "show"][..], &["-4", "route", "show", "table", "all"]] {
        let text = run("ip", args)?;
        for word in text.split_whitespace() {
            let mut parts = word.split(['.', '/']);
            if parts.next() == Some("10") {
                used.extend(parts.next().and_then(|o| o.parse::<u8>().ok()));
            }
        }
    }
    (213..=254)
        .chain(200..213)
        .find(|o| !used.contains(o))
        .ok_or_else(|| "no free 10.N.0.0/16 prefix (200 to 254) for the emulated hosts".into())
}

/// An exclusive `flock` on a file, released when dropped (or when the
/// process dies).
struct LockFile(std::fs::File);

impl LockFile {
    fn take(path: &Path) -> Result<LockFile, String> {
        use std::os::fd::AsRawFd;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| format!("{}: cannot open: {e}", path.display()))?;
        loop {
            // SAFETY: plain system call on a file descriptor we own.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(LockFile(file));
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(format!("{}: cannot lock: {e}", path.display()));
            }
        }
    }
}

impl Drop for LockFile {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: plain system call on a file descriptor we own.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// The write end of the pipe the signal handler writes the signal's
/// number into (-1: not installed).
static SIGNAL_PIPE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(signal: libc::c_int) {
    let fd = SIGNAL_PIPE.load(Ordering::Relaxed);
    let byte = signal as u8;
    // SAFETY: write(2) is async-signal-safe; `fd` is the pipe's write end,
    // open for the life of the process; one byte from a local.
    unsafe { libc::write(fd, (&byte as *const u8).cast(), 1) };
}

/// On SIGINT, SIGTERM or SIGHUP: remove this process's hosts and exit with
/// 128 + the signal. The handler only writes to a pipe; a thread does the
/// rest (under [`LIVE`], so never halfway through building or dropping).
fn install_signal_teardown() -> Result<(), String> {
    static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            use std::io::Read;
            use std::os::fd::FromRawFd;
            let mut fds = [0 as libc::c_int; 2];
            // SAFETY: `fds` has room for the two descriptors pipe2 writes.
            if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
                return Err(format!("cannot make a pipe for the signal handler: {}", std::io::Error::last_os_error()));
            }
            // SAFETY: a fresh descriptor from pipe2, owned by this File only.
            let mut reader = unsafe { std::fs::File::from_raw_fd(fds[0]) };
            SIGNAL_PIPE.store(fds[1], Ordering::Relaxed);
            std::thread::Builder::new()
                .name("refit-netns-signals".into())
                .spawn(move || {
                    let mut byte = [0u8; 1];
                    // Only an error of the pipe itself ends this thread
                    // (read_exact retries interrupted reads).
                    if reader.read_exact(&mut byte).is_err() {
                        return;
                    }
                    let _live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
                    remove_owned_by(std::process::id());
                    eprintln!("refit: signal {}: emulated hosts removed", byte[0]);
                    std::process::exit(128 + i32::from(byte[0]));
                })
                .map_err(|e| format!("cannot start the signal-watching thread: {e}"))?;
            for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
                // SAFETY: a zeroed sigaction is a valid "no flags, empty
                // mask" value; the handler only does async-signal-safe work
                // (one write to a pipe).
                let r = unsafe {
                    let mut action: libc::sigaction = std::mem::zeroed();
                    action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
                    action.sa_flags = libc::SA_RESTART;
                    libc::sigemptyset(&mut action.sa_mask);
                    libc::sigaction(signal, &action, std::ptr::null_mut())
                };
                if r != 0 {
                    return Err(format!("cannot install a handler for signal {signal}: {}", std::io::Error::last_os_error()));
                }
            }
            Ok(())
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_of_a_pair() {
        let layout = |ranks: u32, rpn: u32| {
            let text = format!(
                r#"{{"ranks": {ranks}, "ranks_per_node": {rpn}, "tensors": [{{"name": "w", "dtype": "f32", "shape": [{ranks}],
                    "mesh": {{"shape": [{ranks}]}}, "placements": ["shard(0)"]}}]}}"#
            );
            reshard::parse_layout(&text).map_err(|e| e.to_string())
        };
        let (src, dst) = (layout(8, 4).unwrap(), layout(6, 4).unwrap());
        let nodes = NodeSpec::of(&src, &dst);
        let got: Vec<(String, u32)> = nodes.iter().map(|n| (n.tag(), n.ranks)).collect();
        assert_eq!(got, [("s0".into(), 4), ("s1".into(), 4), ("d0".into(), 4), ("d1".into(), 2)]);
    }

    #[test]
    fn netem_arguments() {
        assert_eq!(Netem::default().delay(), None);
        assert_eq!(Netem::default().loss_bytecode(), None);
        let c = Netem { delay: Some(Duration::from_millis(100)), loss_pct: Some(5.0) };
        assert_eq!(c.delay(), Some(Duration::from_millis(100)));
        assert_eq!(Netem { delay: Some(Duration::ZERO), ..c }.delay(), None);
        // Delayed packets (TOS bit 32) pass; 5% of 2^32 is 214748364.8;
        // `ld rand` loads from -4040.
        assert_eq!(c.loss_bytecode().as_deref(), Some("6,48 0 0 15,69 2 0 32,32 0 0 4294963256,53 0 1 214748365,6 0 0 0,6 0 0 4294967295"));
        let all = Netem { loss_pct: Some(100.0), ..Netem::default() };
        assert!(all.loss_bytecode().is_some_and(|b| b.contains("53 0 1 4294967295,")));
        assert_eq!(Netem { loss_pct: Some(0.0), ..Netem::default() }.loss_bytecode(), None);
    }

    #[test]
    fn tbf_bucket_holds_large_packets() {
        assert_eq!(tbf(1_000_000)[4], (64 << 10).to_string());
        assert_eq!(words(&["qdisc", "add"], tbf(1_000_000))[2], "tbf");
        assert_eq!(tbf(400_000_000)[2], "3200000000bit");
    }
}
