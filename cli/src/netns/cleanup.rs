//! Our namespaces and links, found by the launcher pid in their names,
//! and their removal: one launcher's on exit, or those of launchers that
//! are gone (by their ownership records, `owner.rs`).

use super::{ip, owner, run};

/// The launcher pid in one of our names: `refit-P-…` (namespaces, shared
/// memory directories) or `rfP…` (links), with the rest a node tag (`s0`,
/// `d12`), `br` or `probe`.
pub(super) fn owner_of(name: &str) -> Option<u32> {
    let (digits, rest) = if let Some(r) = name.strip_prefix("refit-") {
        let (d, rest) = r.split_once('-')?;
        (d, rest)
    } else {
        let r = name.strip_prefix("rf")?;
        let end = r.find(|c: char| !c.is_ascii_digit())?;
        r.split_at(end)
    };
    let tag_ok = rest == "br"
        || rest == "probe"
        || (rest.len() > 1 && (rest.starts_with('s') || rest.starts_with('d')) && rest[1..].bytes().all(|b| b.is_ascii_digit()));
    if digits.is_empty() || digits.len() > 10 || !digits.bytes().all(|b| b.is_ascii_digit()) || !tag_ok {
        return None;
    }
    digits.parse().ok()
}

/// Our namespaces and links that exist now.
#[derive(Debug, Default)]
struct Found {
    netns: Vec<String>,
    links: Vec<String>,
}

fn found() -> Found {
    let netns = run("ip", &["netns", "list"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| owner_of(n).is_some())
        .map(String::from)
        .collect();
    // `5: rf123s0@if2: <BROADCAST,...`
    let links = run("ip", &["-o", "link", "show"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n))
        .filter(|n| owner_of(n).is_some())
        .map(String::from)
        .collect();
    Found { netns, links }
}

impl Found {
    /// `2 namespaces (refit-1-s0, refit-1-d0), 3 links (…)`.
    fn describe(&self) -> String {
        let part = |what: (&str, &str), names: Vec<String>| match names.len() {
            0 => None,
            1 => Some(format!("1 {} ({})", what.0, names.join(", "))),
            n => Some(format!("{n} {} ({})", what.1, names.join(", "))),
        };
        [part(("namespace", "namespaces"), self.netns.clone()), part(("link", "links"), self.links.clone())]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn owned(found: &Found, owner: u32) -> Found {
    let mine = |n: &str| owner_of(n) == Some(owner);
    Found {
        netns: found.netns.iter().filter(|n| mine(n)).cloned().collect(),
        links: found.links.iter().filter(|n| mine(n)).cloned().collect(),
    }
}

/// Removes every namespace and link of launcher
/// `owner`, killing the processes still inside those namespaces first, and
/// then its ownership record. Never fails: what cannot be removed is left
/// (and reported on stderr).
pub fn remove_owned_by(owner: u32) {
    remove(&owned(&found(), owner));
    owner::remove_record(owner);
}

fn remove(f: &Found) {
    for ns in &f.netns {
        for pid in run("ip", &["netns", "pids", ns]).unwrap_or_default().split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
            // SAFETY: plain system call; the pid is a process inside our
            // namespace (a worker of ours), never 0 or negative.
            if pid > 0 {
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
    // Root-side veth ends first (each takes its peer along), the bridge last.
    let (bridges, veths): (Vec<&String>, Vec<&String>) = f.links.iter().partition(|l| l.ends_with("br"));
    let mut left = Vec::new();
    for l in veths.into_iter().chain(bridges) {
        left.extend(ip(&["link", "del", l]).err());
    }
    for ns in &f.netns {
        left.extend(ip(&["netns", "del", ns]).err());
    }
    for l in left {
        // A link deleted with its peer is gone already: not worth a word.
        if !l.contains("Cannot find device") {
            eprintln!("refit: emulated hosts: {l}");
        }
    }
}

/// Removes what launchers that are gone left behind (under the build
/// lock; `me_has_hosts`: whether this process holds a set now). One line
/// per launcher whose things were removed, or kept, and why.
pub(super) fn remove_stale(me_has_hosts: bool) -> Vec<String> {
    let mut all = found();
    let me = std::process::id();
    // This process's own throwaway namespace may be in use (a probe on
    // another thread); a dead process's of our pid goes before a probe.
    all.netns.retain(|n| !(n.ends_with("-probe") && owner_of(n) == Some(me)));
    let mut owners: Vec<u32> = all.netns.iter().chain(&all.links).filter_map(|n| owner_of(n)).collect::<Vec<_>>();
    owners.extend(owner::recorded());
    owners.sort_unstable();
    owners.dedup();
    let mut said = Vec::new();
    for owner in owners {
        let mine = owned(&all, owner);
        let what = mine.netns.len() + mine.links.len();
        match owner::gone(owner, me, me_has_hosts, owner::read_record(owner), owner::start_time(owner)) {
            Some(why) => {
                remove(&mine);
                owner::remove_record(owner);
                if what > 0 {
                    said.push(format!("launcher {owner}: removed {} ({why})", mine.describe()));
                }
            }
            None if what > 0 => said.push(format!("launcher {owner}: kept {} (it is running)", mine.describe())),
            None => {}
        }
    }
    said
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_their_owner() {
        assert_eq!(owner_of("refit-1234-s0"), Some(1234));
        assert_eq!(owner_of("refit-1234-d17"), Some(1234));
        assert_eq!(owner_of("refit-1234-probe"), Some(1234));
        assert_eq!(owner_of("rf1234br"), Some(1234));
        assert_eq!(owner_of("rf1234s3"), Some(1234));
        assert_eq!(owner_of("rf1234d12"), Some(1234));
        // Shared-memory regions (a session id, then ranks), other links.
        assert_eq!(owner_of("refit-0f3a9c-s0-d1"), None);
        assert_eq!(owner_of("refit-12345678901234567890123456789012-s0-d1"), None);
        assert_eq!(owner_of("rf1234"), None);
        assert_eq!(owner_of("rf1234x0"), None);
        assert_eq!(owner_of("eth0"), None);
        assert_eq!(owner_of("refit-abc-s0"), None);
        assert_eq!(owner_of("refit-12-s"), None);
    }
}
