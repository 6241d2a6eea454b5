//! Which host, as far as shared memory goes, a member runs on: two members
//! with the same [`this_host`] see the same `/dev/shm` and the same network,
//! so their ranks may talk through shared memory whatever group and node
//! they belong to.

use std::os::unix::fs::MetadataExt;
use std::sync::OnceLock;

/// An identity of this process's host for the node fabric: the boot's id,
/// the `/dev/shm` mount (device and inode: a container with a private
/// one differs) and the network namespace (an emulated host, a network
/// namespace of its own, differs). `0` where any of them cannot be read:
/// such a member shares memory only with ranks of its own node.
pub fn this_host() -> u64 {
    static HOST: OnceLock<u64> = OnceLock::new();
    *HOST.get_or_init(|| identity().unwrap_or(0))
}

fn identity() -> Option<u64> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let shm = std::fs::metadata("/dev/shm").ok()?;
    let net = std::fs::metadata("/proc/self/ns/net").ok()?;
    // The planner's stable hash: members built apart agree on it.
    let id = (boot.trim(), shm.dev(), shm.ino(), net.dev(), net.ino());
    // Never 0, the unknown host.
    Some(reshard::fnv64(&id) | 1)
}

#[cfg(test)]
mod tests {
    use super::this_host;

    #[test]
    fn this_host_is_known_here_and_stable() {
        let h = this_host();
        assert_ne!(h, 0, "this machine has /proc and /dev/shm");
        assert_eq!(this_host(), h);
    }
}
