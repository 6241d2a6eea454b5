//! [`RemoteError`]: what can go wrong talking to other nodes.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use thiserror::Error;

use crate::error::CallError;

/// Errors of [`Node`](super::Node), [`RemotePeer`](super::RemotePeer) and
/// the registry. Every variant about a connection names the peer's address.
#[derive(Debug, Error)]
pub enum RemoteError {
    /// The listening socket could not be bound.
    #[error("cannot bind {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The TCP connection could not be established.
    #[error("cannot connect to {peer}: {source}")]
    Connect {
        /// The peer's address.
        peer: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Mutual authentication failed: the two sides do not share the secret.
    #[error("authentication with {peer} failed: {why}")]
    AuthFailed {
        /// The peer's address.
        peer: String,
        /// What did not verify.
        why: String,
    },
    /// The handshake broke down (closed, malformed, wrong version, ...).
    #[error("handshake with {peer} failed: {problem}")]
    Handshake {
        /// The peer's address.
        peer: String,
        /// What went wrong.
        problem: String,
    },
    /// The connection broke during the handshake (closed, reset, a write
    /// failed): the server dropped it (a node drops connections still
    /// authenticating when too many arrive at once) or went away. Worth
    /// retrying ([`RemoteError::is_transient`]).
    #[error("handshake with {peer} cut off: {problem}")]
    HandshakeCut {
        /// The peer's address.
        peer: String,
        /// What happened.
        problem: String,
    },
    /// Something did not complete in time.
    #[error("{what} with {peer} timed out after {after:?}")]
    Timeout {
        /// The peer's address.
        peer: String,
        /// What timed out, e.g. `handshake`.
        what: &'static str,
        /// The timeout.
        after: Duration,
    },
    /// The connection is (or went) down.
    #[error("connection to {peer} lost: {problem}")]
    ConnectionLost {
        /// The peer's address.
        peer: String,
        /// What went wrong.
        problem: String,
    },
    /// The peer serves no actor under this name.
    #[error("{peer} serves no actor named {name:?}")]
    UnknownActor {
        /// The peer's address.
        peer: String,
        /// The name looked up.
        name: String,
    },
    /// A message could not be encoded for the wire.
    #[error("cannot encode a message for {peer}: {problem}")]
    Encode {
        /// The peer's address.
        peer: String,
        /// What went wrong.
        problem: String,
    },
    /// This node already serves an actor under this name.
    #[error("an actor named {name:?} is already served")]
    NameTaken {
        /// The name.
        name: String,
    },
    /// The registry refused a name another live node still serves.
    #[error("registry {registry}: '{name}' is already served by the live node at {holder}: use another name, or stop that one first")]
    NameHeld {
        /// The registry's address.
        registry: String,
        /// The name.
        name: String,
        /// The node that serves it.
        holder: SocketAddr,
    },
    /// The name is empty or longer than [`MAX_NAME_LEN`](super::MAX_NAME_LEN) bytes.
    #[error("invalid actor name {name:?}: must be 1 to {max} bytes")]
    InvalidName {
        /// The name.
        name: String,
        /// The maximum length.
        max: usize,
    },
    /// The registry has no entry for this name.
    #[error("registry at {registry} has no entry for {name:?}")]
    NotRegistered {
        /// The registry's address.
        registry: String,
        /// The name.
        name: String,
    },
    /// A call to the registry actor failed.
    #[error("registry at {registry}: {source}")]
    Registry {
        /// The registry's address.
        registry: String,
        /// The call's error.
        source: Box<CallError>,
    },
    /// The [`NodeConfig`](super::NodeConfig) is unusable.
    #[error("invalid node configuration: {problem}")]
    InvalidConfig {
        /// What is wrong.
        problem: String,
    },
    /// The node was shut down.
    #[error("the node is shut down")]
    NodeShutDown,
    /// Every attempt of a retried operation failed
    /// ([`Retry`](super::Retry)): the last error, after how many attempts
    /// and how long.
    #[error("gave up on {peer} after {attempts} attempts in {elapsed:.1?}: {last}")]
    GaveUp {
        /// The peer's address.
        peer: String,
        /// Attempts made.
        attempts: u32,
        /// Time spent in all.
        elapsed: Duration,
        /// The last attempt's error.
        last: Box<RemoteError>,
    },
}

impl RemoteError {
    pub(crate) fn handshake(peer: &str, problem: impl fmt::Display) -> Self {
        Self::Handshake { peer: peer.to_owned(), problem: problem.to_string() }
    }

    pub(crate) fn handshake_cut(peer: &str, problem: impl fmt::Display) -> Self {
        Self::HandshakeCut { peer: peer.to_owned(), problem: problem.to_string() }
    }

    /// `true` for failures another attempt may not meet: the handshake cut
    /// off ([`RemoteError::HandshakeCut`], e.g. a crowded node dropped the
    /// connection before it authenticated), a timeout, a lost connection,
    /// or a connection reset, aborted or timed out while connecting. Not
    /// for a refused connection (nothing listens there), a failed
    /// authentication (the secrets differ) or a protocol mismatch.
    pub fn is_transient(&self) -> bool {
        use std::io::ErrorKind;
        match self {
            Self::HandshakeCut { .. } | Self::Timeout { .. } | Self::ConnectionLost { .. } => true,
            Self::Connect { source, .. } => matches!(
                source.kind(),
                ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::TimedOut | ErrorKind::Interrupted
            ),
            _ => false,
        }
    }

    /// The peer's address, for errors about one peer.
    pub fn peer(&self) -> Option<&str> {
        match self {
            Self::Connect { peer, .. }
            | Self::AuthFailed { peer, .. }
            | Self::Handshake { peer, .. }
            | Self::HandshakeCut { peer, .. }
            | Self::GaveUp { peer, .. }
            | Self::Timeout { peer, .. }
            | Self::ConnectionLost { peer, .. }
            | Self::UnknownActor { peer, .. }
            | Self::Encode { peer, .. } => Some(peer),
            Self::NotRegistered { registry, .. } | Self::Registry { registry, .. } | Self::NameHeld { registry, .. } => Some(registry),
            Self::Bind { .. } | Self::NameTaken { .. } | Self::InvalidName { .. } | Self::InvalidConfig { .. } | Self::NodeShutDown => None,
        }
    }

    /// `true` for [`RemoteError::AuthFailed`].
    pub fn is_auth_failure(&self) -> bool {
        matches!(self, Self::AuthFailed { .. })
    }
}
