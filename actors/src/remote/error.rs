//! [`RemoteError`]: what can go wrong talking to other nodes.

use std::fmt;
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
}

impl RemoteError {
    pub(crate) fn handshake(peer: &str, problem: impl fmt::Display) -> Self {
        Self::Handshake { peer: peer.to_owned(), problem: problem.to_string() }
    }

    /// The peer's address, for errors about one peer.
    pub fn peer(&self) -> Option<&str> {
        match self {
            Self::Connect { peer, .. }
            | Self::AuthFailed { peer, .. }
            | Self::Handshake { peer, .. }
            | Self::Timeout { peer, .. }
            | Self::ConnectionLost { peer, .. }
            | Self::UnknownActor { peer, .. }
            | Self::Encode { peer, .. } => Some(peer),
            Self::NotRegistered { registry, .. } | Self::Registry { registry, .. } => Some(registry),
            Self::Bind { .. } | Self::NameTaken { .. } | Self::InvalidName { .. } | Self::InvalidConfig { .. } | Self::NodeShutDown => None,
        }
    }

    /// `true` for [`RemoteError::AuthFailed`].
    pub fn is_auth_failure(&self) -> bool {
        matches!(self, Self::AuthFailed { .. })
    }
}
