//! Location-transparent remote actors over TCP.
//!
//! A [`Node`] listens on TCP (loopback by default), serves named actors
//! ([`Node::serve`]) and connects to other nodes ([`Node::connect`] →
//! [`RemotePeer`]). [`RemotePeer::lookup`] returns an ordinary
//! [`ActorRef<A>`](crate::ActorRef) whose mailbox is drained by a local proxy
//! task that forwards each message over the connection: `call`,
//! `call_timeout`, `tell`, `try_tell`, `link`, `terminated` and `is_alive`
//! behave as for a local actor. A handler's [`ActorError`](crate::ActorError)
//! comes back as the same [`CallError::Handler`](crate::CallError::Handler);
//! when the remote actor stops, the handle stops with the same
//! [`StopReason`](crate::StopReason). A [`Registry`] lets nodes find each
//! other by actor name.
//!
//! ```
//! use actors::remote::{Node, NodeConfig};
//! use actors::{async_trait, spawn, Actor, ActorError, Context, Secret, SpawnConfig};
//!
//! struct Doubler;
//!
//! #[async_trait]
//! impl Actor for Doubler {
//!     type Msg = u64;
//!     type Reply = u64;
//!
//!     async fn handle(&mut self, x: u64, _ctx: &mut Context<Self>) -> Result<u64, ActorError> {
//!         Ok(2 * x)
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let secret = Secret::from_bytes(*b"a shared secret of 16+ bytes")?;
//! // Process A serves an actor...
//! let server = Node::bind(secret.clone(), NodeConfig::default()).await?;
//! server.serve("doubler", &spawn(Doubler, SpawnConfig::default()))?;
//! // ...process B uses it through an ordinary `ActorRef<Doubler>`.
//! let client = Node::bind(secret, NodeConfig::default()).await?;
//! let peer = client.connect(server.local_addr()).await?;
//! let doubler = peer.lookup::<Doubler>("doubler").await?;
//! assert_eq!(doubler.call(21).await?, 42);
//! # Ok(())
//! # }
//! ```
//!
//! A connection lives while its [`RemotePeer`] or a handle obtained through
//! it exists, and while both [`Node`]s are up.
//!
//! # Protocol
//!
//! **Frames.** Every frame is a `u32` little-endian payload length followed
//! by the payload ([`crate::codec`] framing; everything is encoded by
//! [`crate::codec`]). The length is checked before anything is allocated:
//! at most 256 bytes before authentication, [`NodeConfig::max_frame_bytes`]
//! after.
//!
//! **Handshake** (client → server unless noted), each step one frame, all
//! within [`NodeConfig::handshake_timeout`] (the `Hello` within
//! [`NodeConfig::hello_timeout`] of the server accepting):
//! 1. `Hello { magic, version, client_nonce }`
//! 2. server → `Challenge { version, server_nonce }`
//! 3. `Proof { HMAC(secret, "proof/client" ‖ client_nonce ‖ server_nonce) }`
//! 4. server → `Accepted { HMAC(secret, "proof/server" ‖ client_nonce ‖ server_nonce) }`,
//!    or `Rejected` (and close) if the client's proof does not verify.
//!
//! HMAC is HMAC-SHA256 over the shared [`Secret`] (with a
//! `refit-remote/v1/` domain prefix); nonces are 32 fresh random bytes
//! (two v4 UUIDs) per side; tags are compared in constant time. Each side
//! proves knowledge of the secret over both nonces and its role, so neither
//! a proof nor a recorded session can be replayed. Both sides then derive
//! one frame key per direction: `HMAC(secret, "frame-key/<sender role>" ‖
//! client_nonce ‖ server_nonce)`.
//!
//! **Authenticated frames.** The payload is `(seq: u64, kind: u8, body,
//! tag)`, where `tag = HMAC(frame key, seq ‖ kind ‖ body)` and `seq` counts
//! the sender's frames from 0. The receiver checks the tag, then that `seq`
//! is exactly the next one (a replayed or reordered frame is a protocol
//! error), then the [`FrameKind`], then decodes the body. Kinds: `Ping`,
//! `Lookup`/`Found` (name → [`ActorInfo`](crate::ActorInfo)), `Request`
//! (call or tell, by name and actor id) / `Reply` (encoded reply or
//! failure), `Stopped` (a looked-up served actor stopped, with its reason)
//! and `Close` (goodbye, with why). Frames are authenticated, not encrypted:
//! keep the control plane on a trusted network.
//!
//! **Crowding.** Incoming connections still authenticating have a budget
//! of their own ([`NodeConfig::max_unauthenticated`], 64): when it is full,
//! a newcomer is let in and one of the waiting ones is dropped, at random
//! among those that have not sent their `Hello` (all of them if every one
//! has), so silent sockets cannot push out a client whose `Hello` was read
//! and push out one still in flight only by chance. Such a client sees its
//! handshake cut off ([`RemoteError::HandshakeCut`], transient:
//! [`RemoteError::is_transient`]) and, through
//! [`Node::connect_retrying`] and a [`Retry`], tries again with backoff.
//!
//! **Heartbeats.** Each side sends a `Ping` every
//! [`NodeConfig::heartbeat_interval`] (250 ms) and considers the peer dead
//! after [`NodeConfig::heartbeat_timeout`] (1 s) without any byte, counted
//! in the time this process was running: every node has a clock that ticks
//! each heartbeat interval, and what its ticks come late by (the process
//! was not scheduled, was stopped, or its runtime was held up) is not held
//! against a peer silent meanwhile. On a busy host the peer's pings are
//! late for the same reason; a peer silent while this process runs on time
//! is dead after the timeout as before.
//!
//! **Failures.** Any unauthenticated, oversized, truncated, undecodable,
//! mistagged, unknown-kind or out-of-sequence frame, an I/O error, a stalled
//! write ([`NodeConfig::write_timeout`]), end of stream or a heartbeat
//! timeout closes that connection only (logged with `tracing::warn!`; the
//! secret is never logged); the node keeps serving the others. A request
//! for a name the node does not serve is answered with an error, not
//! dropped. When a connection closes, every handle obtained through it
//! stops with [`StopReason::ConnectionLost`](crate::StopReason::ConnectionLost),
//! its pending calls fail at once with
//! [`CallError::Stopped`](crate::CallError::Stopped), and linked
//! supervisors get a [`Terminated`](crate::Terminated) event.
//!
//! Requests from one connection are queued to served actors in arrival
//! order, waiting for mailbox space: a full mailbox holds up the other
//! requests of that connection (heartbeats keep flowing).

mod auth;
mod clock;
mod conn;
mod error;
mod node;
mod proxy;
mod raw;
mod registry;
mod retry;
mod secret;
mod served;
mod wire;

pub use auth::PROTOCOL_VERSION;
pub use error::RemoteError;
pub use node::{
    Node, NodeConfig, RemotePeer, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_HELLO_TIMEOUT,
    DEFAULT_MAX_FRAME_BYTES,
};
pub use raw::RawPeer;
pub use registry::{Registration, Registry, RegistryClient, RegistryMsg, RegistryReply, REGISTRY_NAME};
pub use retry::{Retry, DEFAULT_RETRY_TIMEOUT};
pub use secret::{read_secret_file, wipe, Secret, SecretError, MIN_SECRET_LEN};
pub use wire::{FrameKind, MAX_NAME_LEN};
