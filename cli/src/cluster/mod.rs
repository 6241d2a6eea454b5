//! Multi-process refits of the verification pattern: the tooling behind
//! `refit launch`, `refit worker`, `refit chaos`, `refit soak` and
//! `refit bench --transport process`.
//!
//! A [`Cluster`] opens a rendezvous, starts worker processes (or waits for
//! ones a cluster launcher started), and drives refits through the one
//! orchestrator ([`orchestrator::Orchestrator`]) over the node fabric.
//! Each worker ([`run_worker`]) hosts one rank or every rank of a node:
//! per rank a store, the orchestrator's member, and a pattern actor that
//! steps the sources to a weights version and checks what the destinations serve.
//! Dead workers are replaced ([`Cluster::recover`]) and the job goes on.
//! See `docs/multiprocess.md` and `docs/reliability.md`.

mod launcher;
mod worker;

pub use launcher::{
    kill_pid, Cluster, ClusterConfig, ClusterError, Committed, Disrupt, Disruption, RefitAndReplica, RefitOutcome, ReplicaConfig,
    WorkerInfo,
};
pub use orchestrator::rendezvous::SECRET_ENV;
pub use worker::{run_worker, FaultSpec, Hosted, WorkerConfig, WorkerLayouts};

/// How long an idle blocking thread of a launcher's or worker's runtime
/// lives (tokio's default is 10 s): the data plane of each refit runs on
/// one, and between refits they should not pile up.
pub const IDLE_THREAD: std::time::Duration = std::time::Duration::from_secs(1);

/// How ranks map onto worker processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PerProcess {
    /// One process per rank; ranks of a node share memory across processes.
    Rank,
    /// One process per node, its ranks side by side.
    Node,
}

use actors::remote::Secret;
use std::fmt;
use std::time::Duration;

/// Default heartbeat timeout of the control plane: a connection with no byte
/// from the peer for this long is dead (pings go every 250 ms). A killed
/// worker is noticed sooner anyway (its sockets close, its process exits),
/// so this bounds only how long a hung but connected peer goes unnoticed
/// (a refit's deadline bounds it too). 10 s: with dozens of worker
/// processes on a few cores (DeepSeek-V3's 48 on this project's 2-core
/// machines) a healthy peer may not be scheduled for seconds; tests that
/// want hung peers found fast lower it (`--heartbeat-timeout-ms`).
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);
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
            Ok(v) => {
                let secret = ControlSecret(v.trim().to_string());
                // Wipes the untrimmed copy.
                drop(ControlSecret(v));
                Ok(secret)
            }
            Err(std::env::VarError::NotPresent) => Err(format!("environment variable {var} is not set")),
            Err(std::env::VarError::NotUnicode(_)) => Err(format!("environment variable {var} is not valid UTF-8")),
        }
    }

    /// [`from_env`](Self::from_env), then removes the variable from this
    /// process's environment, so that no child it starts inherits it (the
    /// process's initial environment block, readable by its owner in
    /// `/proc/<pid>/environ`, is not rewritten). Call it before any other
    /// thread runs (a worker does, first thing).
    pub fn take_from_env(var: &str) -> Result<ControlSecret, String> {
        let secret = ControlSecret::from_env(var)?;
        std::env::remove_var(var);
        Ok(secret)
    }

    /// The secret in the file at `path` (surrounding whitespace trimmed);
    /// a file other users may read or write is refused
    /// ([`actors::remote::read_secret_file`]).
    pub fn from_file(path: &Path) -> Result<ControlSecret, String> {
        let mut bytes = actors::remote::read_secret_file(path).map_err(|e| e.to_string())?;
        let text = std::str::from_utf8(&bytes).map(|t| ControlSecret(t.trim().to_string()));
        actors::remote::wipe(&mut bytes);
        text.map_err(|_| format!("secret file {}: not UTF-8 text", path.display()))
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

impl Drop for ControlSecret {
    fn drop(&mut self) {
        let mut bytes = std::mem::take(&mut self.0).into_bytes();
        actors::remote::wipe(&mut bytes);
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
