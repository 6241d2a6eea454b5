//! Multi-process refits. A launcher ([`Cluster`], the orchestrator of this
//! path) opens an authenticated control node with a registry; worker
//! processes ([`run_worker`], `refit worker`) join it, each hosting one rank
//! or every rank of one node as a *member* actor. The launcher plans once,
//! ships each member its ranks' programs, then drives refits step by step
//! (prepare, connect, start, commit) through remote-actor calls, each refit
//! over a fresh data plane (shared memory within a node, TCP between nodes)
//! among exactly the ranks that exchange data. Heartbeats and connection
//! loss tell it of dead workers; a failing refit is aborted everywhere,
//! nothing is committed, and dead workers are respawned before the next.
//! On a cluster the user's launcher (srun, a Kubernetes job) starts
//! `refit worker` with the same rendezvous address; see
//! `docs/multiprocess.md` and `docs/reliability.md`.

mod launcher;
mod wire;
mod worker;

pub use launcher::{kill_pid, Cluster, ClusterConfig, ClusterError, PerProcess, Phase, RefitOutcome, RefitRequest, WorkerInfo, SECRET_ENV};
pub use wire::{DataPlane, FaultSpec};
pub use worker::{run_worker, Hosted, WorkerConfig};

use actors::remote::Secret;
use std::fmt;
use std::time::Duration;

/// Default heartbeat timeout of the control plane: a connection with no byte
/// from the peer for this long is dead (pings go every 250 ms). A killed
/// worker is noticed sooner anyway (its sockets close, its process exits).
/// Raise it (`--heartbeat-timeout-ms`) when dozens of processes share a few
/// cores, where a healthy peer may not be scheduled for seconds.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2);
use std::path::Path;

/// The control plane's shared secret as text, so that a launcher can hand
/// it to the workers it spawns through their environment. Never printed.
#[derive(Clone)]
pub struct ControlSecret(String);

impl ControlSecret {
    /// A fresh random secret (256 bits, hex), for a launcher that spawns its
    /// own workers.
    pub fn random() -> ControlSecret {
        let mut s = String::new();
        for _ in 0..2 {
            s.push_str(&random_hex128());
        }
        ControlSecret(s)
    }

    /// The secret in environment variable `var` (surrounding whitespace
    /// trimmed).
    pub fn from_env(var: &str) -> Result<ControlSecret, String> {
        match std::env::var(var) {
            Ok(v) => Ok(ControlSecret(v.trim().to_string())),
            Err(std::env::VarError::NotPresent) => Err(format!("environment variable {var} is not set")),
            Err(std::env::VarError::NotUnicode(_)) => Err(format!("environment variable {var} is not valid UTF-8")),
        }
    }

    /// The secret in the file at `path` (surrounding whitespace trimmed).
    pub fn from_file(path: &Path) -> Result<ControlSecret, String> {
        std::fs::read_to_string(path)
            .map(|t| ControlSecret(t.trim().to_string()))
            .map_err(|e| format!("{}: cannot read the secret: {e}", path.display()))
    }

    /// The secret for the control node (at least 16 bytes).
    pub fn secret(&self) -> Result<Secret, String> {
        Secret::from_bytes(self.0.as_bytes().to_vec()).map_err(|e| e.to_string())
    }

    /// The text, for a child's environment only.
    pub(crate) fn text(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ControlSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ControlSecret(<redacted>)")
    }
}

/// 128 random bits as hex, from the operating system's generator.
fn random_hex128() -> String {
    let mut bytes = [0u8; 16];
    let from_os = std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
    if from_os.is_err() {
        // No /dev/urandom: std's randomly keyed hasher is the fallback.
        use std::hash::{BuildHasher, Hasher};
        for chunk in bytes.chunks_mut(8) {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
            chunk.copy_from_slice(&h.finish().to_le_bytes()[..chunk.len()]);
        }
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
