//! Who owns a set of emulated hosts, and who removes them once that
//! launcher is gone — however it went.
//!
//! - **A record** `/run/refit-netns/<pid>` per launcher that builds hosts,
//!   written (under the build lock) before anything is built and removed
//!   with the hosts: the launcher's start time (`/proc/<pid>/stat`, clock
//!   ticks since boot). Everything named after pid `P` belongs to the
//!   process with that pid *and that start time*; once no such process
//!   runs, it is stale — also when the pid was reused by another process
//!   since, which a check of `/proc/<pid>` alone would take for the
//!   launcher. The next launcher with `--netns` and `refit netns --clean`
//!   remove what is stale ([`gone`]).
//! - **A watchdog** per launcher, `refit netns --watch <pid> --token
//!   <start time>`, started with the read end of a pipe as its standard
//!   input; the write end is the launcher's alone (close-on-exec: no
//!   worker or other child holds it). When the launcher exits in any way,
//!   SIGKILL included, the kernel closes its end, the watchdog reads the
//!   end of the file and, if the launcher's record is still there (it did
//!   not tear its hosts down itself), removes its hosts and the record. The
//!   watchdog runs in a process group of its own, so a Ctrl-C at the
//!   terminal (which the launcher handles) does not take it along.

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the ownership records are.
pub(super) const RECORD_DIR: &str = "/run/refit-netns";

/// When process `pid` started, in clock ticks since boot (field 22 of
/// `/proc/<pid>/stat`); `None` when no such process runs.
pub(super) fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ...`: comm may hold spaces and parentheses; the
    // fields after its last `)` start with the state (field 3).
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

fn record_path(owner: u32) -> PathBuf {
    Path::new(RECORD_DIR).join(owner.to_string())
}

/// Records that this process (`owner`, started at `start`) owns what is
/// named after its pid from now on.
pub(super) fn write_record(owner: u32, start: u64) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = Path::new(RECORD_DIR);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("{}: cannot create the directory of ownership records: {e}", dir.display()))?;
    let path = record_path(owner);
    std::fs::write(&path, format!("{start}\n")).map_err(|e| format!("{}: cannot write the ownership record: {e}", path.display()))
}

/// The start time recorded for launcher `owner`, if it has a record.
pub(super) fn read_record(owner: u32) -> Option<u64> {
    std::fs::read_to_string(record_path(owner)).ok()?.trim().parse().ok()
}

/// Removes launcher `owner`'s record (none: nothing to do).
pub(super) fn remove_record(owner: u32) {
    let _ = std::fs::remove_file(record_path(owner));
}

/// The pids that have a record.
pub(super) fn recorded() -> Vec<u32> {
    std::fs::read_dir(RECORD_DIR)
        .map(|d| d.filter_map(Result::ok).filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok())).collect())
        .unwrap_or_default()
}

/// Why what is named after pid `owner` is stale, if it is: `me` is this
/// process (`me_has_hosts`: whether it holds a set now), `recorded` the
/// start time on `owner`'s record, `running` the start time of the
/// process with pid `owner` now (`None`: none runs).
pub(super) fn gone(owner: u32, me: u32, me_has_hosts: bool, recorded: Option<u64>, running: Option<u64>) -> Option<&'static str> {
    match (running, recorded) {
        (None, _) => Some("its launcher is not running"),
        _ if owner == me && !me_has_hosts => Some("left by an earlier launcher that had this process id"),
        (Some(now), Some(then)) if now != then => Some("its launcher is gone (its process id belongs to another process now)"),
        // A live launcher's (or one that has no record: kept, we cannot
        // tell).
        _ => None,
    }
}

/// A launcher's watchdog: holds the write end of its pipe.
pub(super) struct Watchdog {
    child: Child,
    write: Option<OwnedFd>,
}

impl Watchdog {
    /// Starts `program netns --watch <owner> --token <start>`.
    pub(super) fn start(program: &Path, owner: u32, start: u64) -> Result<Watchdog, String> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(format!("cannot make the watchdog's pipe: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: fresh descriptors from pipe2, each owned by one OwnedFd.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        use std::os::unix::process::CommandExt;
        let child = Command::new(program)
            .args(["netns", "--watch", &owner.to_string(), "--token", &start.to_string()])
            .stdin(Stdio::from(read))
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start the emulated hosts' watchdog `{} netns --watch`: {e}", program.display()))?;
        Ok(Watchdog { child, write: Some(write) })
    }

    /// The watchdog's process id.
    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Lets the watchdog go (its launcher removed the hosts itself, and
    /// their record): closes the pipe and reaps it if it exits soon.
    pub(super) fn dismiss(mut self) {
        drop(self.write.take());
        let until = Instant::now() + Duration::from_secs(1);
        while Instant::now() < until {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The watchdog's body (`refit netns --watch <owner> --token <start>`):
/// waits until standard input ends (launcher `owner` exited: its end of
/// the pipe closed), then removes `owner`'s hosts if its record (start
/// time `start`) is still there. What it removed, on stderr.
pub fn watch(owner: u32, start: u64) -> Result<(), String> {
    let mut stdin = std::io::stdin().lock();
    let mut buf = [0u8; 64];
    loop {
        match stdin.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // A broken pipe reads as the end, too.
            Err(_) => break,
        }
    }
    if read_record(owner) != Some(start) {
        // The launcher removed its hosts itself (or a new launcher with
        // its pid owns the names now).
        return Ok(());
    }
    let _lock = super::LockFile::take(Path::new(super::LOCK_FILE))?;
    if read_record(owner) != Some(start) {
        return Ok(());
    }
    super::remove_owned_by(owner);
    eprintln!("refit: launcher {owner} is gone: its emulated hosts were removed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_stale() {
        let me = 100;
        // Not running: stale, record or none.
        assert!(gone(7, me, false, Some(5), None).is_some());
        assert!(gone(7, me, false, None, None).is_some());
        // Running with the recorded start time: its launcher's.
        assert_eq!(gone(7, me, false, Some(5), Some(5)), None);
        // Its pid reused by another process since.
        assert!(gone(7, me, false, Some(5), Some(9)).is_some_and(|w| w.contains("another process")));
        // No record (a launcher of an older build): kept while it runs.
        assert_eq!(gone(7, me, false, None, Some(9)), None);
        // Named after this process, which holds no hosts: a dead
        // launcher's that had our pid.
        assert!(gone(me, me, false, None, Some(1)).is_some());
        assert!(gone(me, me, false, Some(1), Some(1)).is_some());
        assert_eq!(gone(me, me, true, Some(1), Some(1)), None);
    }

    #[test]
    fn start_times_are_read() {
        let me = std::process::id();
        let t = start_time(me).expect("this process's start time");
        assert_eq!(start_time(me), Some(t));
        // pid 0 has no /proc entry.
        assert_eq!(start_time(0), None);
    }
}
