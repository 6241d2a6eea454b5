//! The control messages between the launcher and its workers, and how they
//! travel: length-prefixed frames encoded by `actors::codec`, each read
//! under a size limit and a timeout.

use actors::codec;
use reshard::{Endpoint, RankProgram, Strategy};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Largest control frame accepted (a rank's program for a large model is a
/// few MiB).
pub(crate) const MAX_CONTROL: usize = 64 << 20;

/// A worker's messages to the launcher.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum ToLauncher {
    /// Joined: the ranks this worker hosts, its process id and the
    /// fingerprints of both plans for the layouts it loaded.
    Hello { ranks: Vec<Endpoint>, pid: u32, reshard: u64, baseline: u64 },
    /// A step of refit `seq` went well; `addrs` answers `Prepare`.
    Ready { seq: u64, addrs: Vec<(Endpoint, String)> },
    /// Refit `seq` finished (or failed) on this worker.
    Done(Box<WorkerReport>),
    /// Refit `seq` (or an install, `seq` 0) failed on this worker.
    Failed { seq: u64, error: String },
}

/// What one worker did in one refit.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct WorkerReport {
    /// The refit.
    pub(crate) seq: u64,
    /// Bytes its ranks sent to other ranks.
    pub(crate) sent_bytes: u64,
    /// Its data-plane time (all its ranks, from start to the last one done).
    pub(crate) elapsed_ns: u64,
    /// Destination elements checked, if asked.
    pub(crate) verified: Option<u64>,
}

/// The launcher's messages to a worker.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum ToWorker {
    /// The programs of this worker's ranks under `strategy`.
    Install { strategy: Strategy, programs: Vec<RankProgram> },
    /// Get ready for refit `seq`: weights version `version` in the sources,
    /// fresh data-plane listeners; answer `Ready` with their addresses.
    Prepare { seq: u64, strategy: Strategy, version: u64, verify: bool },
    /// Connect the data plane of refit `seq` to these peers; answer `Ready`.
    Connect { seq: u64, table: Vec<(Endpoint, String)> },
    /// Run refit `seq`; answer `Done` (or `Failed`).
    Start { seq: u64 },
    /// Make refit `seq`'s destination weights the committed ones; answer
    /// `Ready`.
    Commit { seq: u64 },
    /// Check the committed destination weights against weights version
    /// `version`; answer `Done` with the count (or `Failed`).
    Check { version: u64 },
    /// Exit.
    Shutdown,
}

/// Sends one control message.
pub(crate) fn send<T: Serialize>(stream: &mut TcpStream, value: &T) -> io::Result<()> {
    let mut out = Vec::new();
    codec::encode_frame(&mut out, value).map_err(io::Error::other)?;
    stream.write_all(&out)
}

/// Receives one control message, waiting at most `timeout`.
pub(crate) fn recv<T: DeserializeOwned>(stream: &mut TcpStream, timeout: Duration) -> io::Result<T> {
    stream.set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_CONTROL {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("control frame of {n} bytes exceeds {MAX_CONTROL}")));
    }
    let mut buf = vec![0u8; 4 + n];
    buf[..4].copy_from_slice(&len);
    stream.read_exact(&mut buf[4..])?;
    let bad = |e: codec::CodecError| io::Error::new(io::ErrorKind::InvalidData, e.to_string());
    let (payload, _) = codec::read_frame(&buf, MAX_CONTROL).map_err(bad)?;
    codec::decode_with_max(payload, MAX_CONTROL).map_err(bad)
}
