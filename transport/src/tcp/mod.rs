//! The TCP transport: one stream per ordered pair of ranks, length-prefixed
//! frames ([`crate::frame`]), payload bytes written straight from the
//! sender's buffers (each contiguous run of a piece goes to the socket as
//! it is; no serialisation of payloads). A reader thread per incoming
//! stream turns frames into messages for [`Transport::recv`], in reusable
//! frame buffers lent to the executor ([`Payload::Lent`]; see
//! [`TcpConfig::frame_pool_bytes`]). A pair of ranks on one node moves the
//! bytes through shared memory instead and uses its stream for
//! notifications only ([`crate::tcp::shm_link`]).
//!
//! Link emulation paces data frames through the rank's inter-node token
//! bucket (shared-memory links use the intra-node one) in pieces of
//! [`crate::link::PACE_CHUNK`]; a frame hook ([`TcpConfig::hook`], e.g.
//! fault injection for tests) is asked about every data frame, counted
//! over all of a rank's links.

use crate::frame::{header, HelloKey, ABORT, BYE, MAX_REASON};
use crate::link::{FrameAction, FrameHook, LinkEmulation, TokenBucket};
use crate::shm::ShmOut;
use crate::sockopt::tcp_state;
pub(crate) use crate::sockopt::Congestion;
use crate::transport::{Payload, RoundInbox, Transport, TransportError, WithAbort};
use reshard::human;
use reshard::Endpoint;
use shm_link::ShmMessage;
use std::collections::HashMap;
use std::io::{BufWriter, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod accept;
mod connect;
#[cfg(test)]
mod hostile;
mod pool;
mod reader;
pub(crate) mod shm_link;
mod watch;
mod writer;

#[cfg(any(test, feature = "testkit"))]
pub(crate) use connect::fabric;
#[cfg(any(test, feature = "testkit"))]
pub use connect::{tcp_fabric, tcp_fabric_for};
pub(crate) use pool::FramePool;
use reader::{Incoming, GONE};
pub(crate) use reader::{PeerStatus, Stop, ALIVE, BROKEN};
pub(crate) use shm_link::fell_back;
use writer::write_tcp;

/// TCP transport settings.
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Largest payload a reader accepts from a peer not in
    /// [`max_frame_bytes_from`](Self::max_frame_bytes_from) (a bigger
    /// length is a protocol error).
    pub max_frame_bytes: u64,
    /// Largest payload a reader accepts from each listed peer (default
    /// none): what the rank's program expects from that peer, so one peer
    /// cannot make the rank hold what another may send.
    pub max_frame_bytes_from: HashMap<Endpoint, u64>,
    /// Send buffer per stream.
    pub write_buffer_bytes: usize,
    /// Time to set up all streams.
    pub connect_timeout: Duration,
    /// Every peer's listener was open before this rank started to connect
    /// (an orchestrator opens all endpoints in one step, then connects
    /// them in the next), so a peer that refuses a connection has closed
    /// its listener: its process exited or its own connect ended. Either
    /// way a refused connection is tried again until `connect_timeout`
    /// (a peer is given up only then); this says which the error names
    /// (default off: peers may still be starting).
    pub peers_listening: bool,
    /// A CRC-32C of every data frame's payload travels with it and is
    /// checked before the bytes are handed on (default off). Both ends must
    /// agree: the handshake refuses a peer with the other setting.
    pub checksum: bool,
    /// Egress rate caps (default off). A plain TCP transport treats every
    /// peer as on another node; see `crate::node` for mixed fabrics.
    pub emulation: LinkEmulation,
    /// Asked about every data frame a rank sends and told when it aborts,
    /// for tests and tooling: e.g. [`Faults::hook`](crate::faults::Faults::hook) injects faults (default
    /// none, which costs nothing per frame).
    pub hook: Option<Arc<dyn FrameHook>>,
    /// Received frame buffers (of 64 KiB or more) a rank keeps for reuse
    /// once unpacked, in bytes (default 512 MiB; 0: none). Reused buffers
    /// are already mapped, so a fabric kept from one refit to the next
    /// receives without page faults.
    pub frame_pool_bytes: u64,
    /// The key every handshake proves knowledge of ([`HelloKey`]: derived
    /// from the job's secret for this session). With it, a connection
    /// without the proof is refused, logged and dropped while accepting
    /// goes on; without it (default), any connection that names an
    /// expected peer is taken for it.
    pub hello_key: Option<HelloKey>,
    /// The TCP congestion control of the streams this rank sends on
    /// (default [`Congestion::AvoidBbr`]: the system's, unless that is
    /// BBR, whose policer mode makes a refit's last stream crawl; the
    /// environment variable `REFIT_TCP_CONGESTION` changes the default).
    pub congestion: Congestion,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            max_frame_bytes: 1 << 34,
            max_frame_bytes_from: HashMap::new(),
            write_buffer_bytes: 4 << 20,
            connect_timeout: Duration::from_secs(30),
            peers_listening: false,
            checksum: false,
            emulation: LinkEmulation::default(),
            hook: None,
            frame_pool_bytes: 512 << 20,
            hello_key: None,
            congestion: Congestion::from_env(),
        }
    }
}

/// The outgoing side of one peer.
struct Link {
    w: BufWriter<TcpStream>,
    shm: Option<ShmOut>,
    status: Arc<PeerStatus>,
}

/// The incoming side of one peer, as far as errors describe it.
struct Inbound {
    /// A handle on the peer's stream (its reader thread owns another).
    stream: Arc<TcpStream>,
    status: Arc<PeerStatus>,
    /// Messages come through shared memory, the stream carries notices.
    shm: bool,
}

/// One rank's end of a TCP fabric (and, built through
/// [`crate::node::NodeTransport`], of shared-memory links to same-node peers).
pub struct TcpTransport {
    me: Endpoint,
    links: HashMap<Endpoint, Link>,
    /// The incoming side of each peer (for [`Transport::link_from`]).
    inbound: HashMap<Endpoint, Inbound>,
    /// Every stream of this rank (both directions), for [`WithAbort`](crate::WithAbort).
    streams: Arc<Mutex<Vec<Arc<TcpStream>>>>,
    inbox: RoundInbox<Incoming>,
    checksum: bool,
    hook: Option<Arc<dyn FrameHook>>,
    /// Data frames sent so far (counted only with a hook).
    frames: u64,
    inter: Option<TokenBucket>,
    intra: Option<TokenBucket>,
    wait_timeout: Duration,
    /// Where short runs of outgoing frames are gathered (see `Gather` in [`writer`]).
    stage: Vec<u8>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shm = self.links.values().filter(|l| l.shm.is_some()).count();
        f.debug_struct("TcpTransport").field("me", &self.me).field("peers", &self.links.len()).field("shm_peers", &shm).finish()
    }
}

impl TcpTransport {
    /// A switch that tears this rank's data plane down from any thread:
    /// every stream (both directions) is shut down, so a send or receive
    /// blocked on it fails at once and the peers see the links break.
    pub fn kill_switch(&self) -> impl Fn() + Send + Sync + 'static {
        let streams = Arc::clone(&self.streams);
        move || {
            for s in streams.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    /// The peers this rank has streams to, in order.
    pub fn peers(&self) -> Vec<Endpoint> {
        let mut v: Vec<Endpoint> = self.links.keys().copied().collect();
        v.sort();
        v
    }

    /// The peers reached through shared memory.
    pub fn shm_peers(&self) -> Vec<Endpoint> {
        let mut v: Vec<Endpoint> = self.links.iter().filter(|(_, l)| l.shm.is_some()).map(|(e, _)| *e).collect();
        v.sort();
        v
    }
}

impl TcpTransport {
    /// The incoming side of `peer` in words: what its reader last saw,
    /// the messages taken from it, and the kernel's count of the bytes in
    /// and of the time since the last.
    fn describe_inbound(&self, peer: Endpoint) -> Option<String> {
        let i = self.inbound.get(&peer)?;
        let mut words = vec![match i.status.get() {
            ALIVE => "stream up".to_string(),
            GONE => "it said goodbye".to_string(),
            BROKEN => "its stream broke".to_string(),
            _ => "it aborted".to_string(),
        }];
        let n = i.status.messages();
        words.push(format!("{n} message{} taken from it on this data plane", if n == 1 { "" } else { "s" }));
        if let Some(k) = tcp_state(&i.stream) {
            let via = if i.shm { " (notices; messages in shared memory)" } else { "" };
            words.push(format!(
                "{} received on the stream{via}, the last {:.2} s ago",
                human(k.bytes_received),
                k.last_data_recv.as_secs_f64()
            ));
            if k.state != 1 {
                words.push(format!("TCP state {}", k.state));
            }
        }
        Some(words.join(", "))
    }

    /// What the kernel still holds of the messages sent to each peer (for
    /// a log line when the data plane goes away with bytes undelivered).
    fn undelivered(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (peer, l) in &self.links {
            let Some(k) = tcp_state(l.w.get_ref()) else { continue };
            let unacked = k.bytes_sent.saturating_sub(k.bytes_retrans).saturating_sub(k.bytes_acked.saturating_sub(1));
            let left = unacked + k.notsent + l.w.buffer().len() as u64;
            if left == 0 || k.bytes_sent == 0 {
                continue;
            }
            let cc = crate::sockopt::congestion(l.w.get_ref()).unwrap_or_default();
            out.push(format!(
                "to {peer}: {} not yet delivered, {} retransmitted, {} retransmission timeouts, {cc} pacing at {}/s",
                human(left),
                human(k.bytes_retrans),
                k.rtos,
                human(k.pacing_rate)
            ));
        }
        out.sort();
        out
    }
}

impl Drop for TcpTransport {
    /// Says goodbye on every stream, so peers can tell a finished rank from
    /// a crashed one (whose streams just end).
    fn drop(&mut self) {
        if tracing::enabled!(tracing::Level::DEBUG) {
            let left = self.undelivered();
            if !left.is_empty() {
                tracing::debug!(me = %self.me, streams = %left.join("; "), "data plane closed while the kernel still held bytes of it to deliver");
            }
        }
        for l in self.links.values_mut() {
            let _ = l.w.write_all(&header(BYE, 0, 0)).and_then(|_| l.w.flush());
        }
    }
}

impl WithAbort for TcpTransport {
    fn abort_all(&self) -> Box<dyn Fn(&str) + Send> {
        // Shutting every stream down fails whatever this rank is blocked
        // on, and its peers see the links break (no goodbye).
        let kill = self.kill_switch();
        Box::new(move |_| kill())
    }
}

impl Transport for TcpTransport {
    fn me(&self) -> Endpoint {
        self.me
    }

    fn send(&mut self, round: u32, to: Endpoint, payload: Payload) -> Result<(), TransportError> {
        let action = match &self.hook {
            None => FrameAction::Pass,
            Some(hook) => {
                let index = self.frames;
                self.frames += 1;
                hook.data_frame(index)
            }
        };
        let Some(link) = self.links.get_mut(&to) else { return Err(TransportError::Disconnected { peer: to }) };
        match action {
            FrameAction::Stall => return Ok(()),
            FrameAction::Cut => {
                let _ = link.w.get_ref().shutdown(Shutdown::Both);
                return Err(TransportError::Disconnected { peer: to });
            }
            FrameAction::Pass | FrameAction::Corrupt => {}
        }
        let corrupt = action == FrameAction::Corrupt;
        // Once written (to the socket or the region), the bytes are out of
        // the sender's memory: the payload (and its release token) can go.
        match &mut link.shm {
            Some(out) => {
                let m = ShmMessage { me: self.me, to, round, payload: &payload, checksum: self.checksum, corrupt, wait: self.wait_timeout };
                shm_link::send(out, &mut link.w, &link.status, self.intra.as_mut(), m)
            }
            None => write_tcp(&mut link.w, &mut self.stage, round, &payload, self.checksum, corrupt, self.inter.as_mut())
                .map_err(|_| TransportError::Disconnected { peer: to }),
        }
    }

    fn recv(&mut self, round: u32, deadline: Instant) -> Result<(Endpoint, Payload), TransportError> {
        self.inbox.recv(self.me, round, deadline, |e| match e {
            Incoming::Data { round, from, payload } => Ok((round, from, payload)),
            Incoming::Abort { from, reason } => Err(TransportError::PeerAborted { peer: from, reason }),
            Incoming::Broken { from, problem } => Err(TransportError::Broken { peer: from, problem }),
            Incoming::Corrupt { from, round } => Err(TransportError::Corrupt { peer: from, round }),
        })
    }

    fn flush(&mut self, _round: u32, _deadline: Instant) -> Result<(), TransportError> {
        // `send` returns only after the bytes left the sender's memory.
        Ok(())
    }

    fn link_from(&self, peer: Endpoint) -> Option<String> {
        self.describe_inbound(peer)
    }

    fn converts_on_send(&self, to: Endpoint) -> bool {
        // A shared-memory link converts as it copies, lent (into the lend
        // area) or streamed (through a bounce buffer in cache).
        self.links.get(&to).is_some_and(|l| l.shm.is_some())
    }

    fn abort(&mut self, reason: &str) {
        if let Some(hook) = &self.hook {
            hook.before_abort();
        }
        let reason = &reason.as_bytes()[..reason.len().min(MAX_REASON as usize)];
        for l in self.links.values_mut() {
            let _ = l.w.write_all(&header(ABORT, 0, reason.len() as u64)).and_then(|_| l.w.write_all(reason)).and_then(|_| l.w.flush());
        }
    }
}
