//! Member processes this process started: started with the rendezvous
//! address and secret in their environment (never on the command line),
//! replaced when they die, and killed whenever their owner ends, on every
//! exit path.

use orchestrator::rendezvous::{RENDEZVOUS_ENV, SECRET_ENV};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// glibc's environment tunables: the number of malloc arenas, and the size
/// from which an allocation is mapped on its own.
const MALLOC_ARENA_MAX: &str = "MALLOC_ARENA_MAX";
const MALLOC_MMAP_THRESHOLD: &str = "MALLOC_MMAP_THRESHOLD_";

/// The number after `field` (e.g. `VmHWM:`) in Linux's `/proc/PID/status`
/// of process `pid` (a number, or `self`); `None` where `/proc` does not
/// tell.
pub fn status_number(pid: &str, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Peak resident memory (Linux `VmHWM`) of process `pid` (a number, or
/// `self`), in bytes.
pub fn peak_rss_of(pid: &str) -> Option<u64> {
    status_number(pid, "VmHWM:").map(|kib| kib * 1024)
}

/// One started process and how to start it again.
struct Slot {
    args: Vec<String>,
    /// The network namespace it runs in (`None`: this process's).
    netns: Option<String>,
    child: Option<Child>,
}

/// Processes running `exe`, each joining the rendezvous at `rendezvous`.
pub struct Children {
    exe: PathBuf,
    rendezvous: SocketAddr,
    secret: String,
    slots: Vec<Slot>,
    quiet: bool,
}

impl Children {
    /// No process yet. With `quiet`, their stderr is discarded.
    pub fn new(exe: &Path, rendezvous: SocketAddr, secret: &str, quiet: bool) -> Children {
        Children { exe: exe.to_path_buf(), rendezvous, secret: secret.to_string(), slots: Vec::new(), quiet }
    }

    fn start(&self, args: &[String], netns: Option<&str>) -> Result<Child, String> {
        // In a namespace: `ip netns exec` enters it and execs the program in
        // place, so the child's pid is the program's.
        let mut command = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&self.exe);
                c
            }
            None => Command::new(&self.exe),
        };
        // glibc's allocator, tuned for a worker (a value the user set
        // wins): it runs hundreds of short-lived data-plane threads, and
        // with the default of up to 8 malloc arenas per core each keeps its
        // own free memory; and it holds thousands of weight buffers and
        // frames of 64 KiB and more, which, mapped on their own, stay
        // untouched until written (a destination's version 0 costs nothing) and go
        // back to the system when freed. Together: DeepSeek-V3 at 1/128, a
        // destination worker's peak over 2 refits 414-422 -> ~335 MiB.
        for (name, value) in [(MALLOC_ARENA_MAX, "2"), (MALLOC_MMAP_THRESHOLD, "65536")] {
            if std::env::var_os(name).is_none() {
                command.env(name, value);
            }
        }
        command
            .args(args)
            .env(RENDEZVOUS_ENV, self.rendezvous.to_string())
            .env(SECRET_ENV, &self.secret)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(if self.quiet { Stdio::null() } else { Stdio::inherit() })
            .spawn()
            .map_err(|e| {
                let place = netns.map_or(String::new(), |ns| format!(" in network namespace {ns}"));
                format!("cannot start {} {}{place}: {e}", self.exe.display(), args.join(" "))
            })
    }

    /// Starts a process with `args`; returns its index.
    pub fn spawn(&mut self, args: Vec<String>) -> Result<usize, String> {
        self.spawn_in(args, None)
    }

    /// Starts a process with `args` in network namespace `netns` (`None`:
    /// this process's), where its restarts run too; returns its index.
    pub fn spawn_in(&mut self, args: Vec<String>, netns: Option<String>) -> Result<usize, String> {
        let child = self.start(&args, netns.as_deref())?;
        self.slots.push(Slot { args, netns, child: Some(child) });
        Ok(self.slots.len() - 1)
    }

    /// Process ids, by index (0 for one that is not running).
    pub fn pids(&self) -> Vec<u32> {
        self.slots.iter().map(|s| s.child.as_ref().map_or(0, Child::id)).collect()
    }

    /// The arguments of process `index`.
    pub fn args(&self, index: usize) -> &[String] {
        self.slots.get(index).map_or(&[], |s| &s.args)
    }

    /// Indices of processes that have exited (reaped here).
    pub fn exited(&mut self) -> Vec<usize> {
        let mut out = Vec::new();
        for (i, s) in self.slots.iter_mut().enumerate() {
            let gone = match &mut s.child {
                Some(c) => !matches!(c.try_wait(), Ok(None)),
                None => true,
            };
            if gone {
                s.child = None;
                out.push(i);
            }
        }
        out
    }

    /// Kills process `index` (if running) for good: it is not started
    /// again, and counts as exited.
    pub fn stop(&mut self, index: usize) {
        if let Some(mut c) = self.slots.get_mut(index).and_then(|s| s.child.take()) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills process `index` (if running) and starts it again.
    pub fn restart(&mut self, index: usize) -> Result<u32, String> {
        let args = self.slots.get(index).map(|s| s.args.clone()).ok_or_else(|| format!("no process {index}"))?;
        self.restart_with(index, args)
    }

    /// Kills process `index` (if running) and starts it with `args` from now on.
    pub fn restart_with(&mut self, index: usize, args: Vec<String>) -> Result<u32, String> {
        if index >= self.slots.len() {
            return Err(format!("no process {index}"));
        }
        self.slots[index].args = args.clone();
        if let Some(mut c) = self.slots[index].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let child = self.start(&args, self.slots[index].netns.as_deref())?;
        let pid = child.id();
        self.slots[index].child = Some(child);
        Ok(pid)
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for s in &mut self.slots {
            if let Some(c) = &mut s.child {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}
