//! Which host, as far as shared memory goes, a member runs on, and as whom:
//! two members with the same [`this_host`] can map each other's regions,
//! so their ranks may talk through shared memory whatever group and node
//! they belong to.

use serde::{Deserialize, Serialize};
use std::os::unix::fs::MetadataExt;
use std::sync::OnceLock;

/// Where a member runs, for the node fabric: the machine and the user.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Host {
    /// The machine as shared memory sees it: the boot's id, the process-id
    /// namespace (a region is found through `/proc/<pid>`) and the network
    /// namespace (an emulated host, a network namespace of its own,
    /// differs), hashed; `0` where any of them cannot be read: such a
    /// member shares memory only with ranks of its own node.
    pub machine: u64,
    /// The effective user: a region can be mapped only by its own user.
    pub user: u32,
}

impl Host {
    /// A member whose machine is not known.
    pub const UNKNOWN: Host = Host { machine: 0, user: 0 };

    /// Whether this member can map the regions of a member on `other`:
    /// a known machine, the same one, the same user.
    pub fn shares_memory_with(&self, other: &Host) -> bool {
        self.machine != 0 && self == other
    }
}

/// This process's [`Host`].
pub fn this_host() -> Host {
    static HOST: OnceLock<Host> = OnceLock::new();
    // SAFETY: geteuid has no preconditions and cannot fail.
    *HOST.get_or_init(|| Host { machine: machine().unwrap_or(0), user: unsafe { libc::geteuid() } })
}

fn machine() -> Option<u64> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let pid = std::fs::metadata("/proc/self/ns/pid").ok()?;
    let net = std::fs::metadata("/proc/self/ns/net").ok()?;
    // The planner's stable hash: members built apart agree on it.
    let id = (boot.trim(), pid.dev(), pid.ino(), net.dev(), net.ino());
    // Never 0, the unknown machine.
    Some(reshard::fnv64(&id) | 1)
}

#[cfg(test)]
mod tests {
    use super::{this_host, Host};

    #[test]
    fn this_host_is_known_here_and_stable() {
        let h = this_host();
        assert_ne!(h.machine, 0, "this machine has /proc");
        assert_eq!(this_host(), h);
        assert!(h.shares_memory_with(&h));
        assert!(!h.shares_memory_with(&Host { user: h.user + 1, ..h }));
        assert!(!Host::UNKNOWN.shares_memory_with(&Host::UNKNOWN));
    }
}
