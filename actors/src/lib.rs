//! A thin actor runtime on tokio.
//!
//! Refit moves weights from training actors to inference actors after every
//! optimizer step. This crate provides just enough actor machinery for that,
//! with no actor framework underneath:
//!
//! - [`Actor`]: a type that owns its state and handles one message type
//!   (usually an enum) producing one reply type. Each actor runs as its own
//!   tokio task behind a **bounded** mailbox.
//! - [`ActorRef`]: a cloneable handle. [`ActorRef::call`] is request/reply
//!   with a timeout and never hangs; [`ActorRef::tell`] is fire-and-forget
//!   (waits for mailbox space); [`ActorRef::try_tell`] fails when the mailbox
//!   is full and hands the message back.
//! - [`ActorGroup`]: N rank-indexed actors spawned together (a "mesh"),
//!   with concurrent [`ActorGroup::call_all`] gathering replies in rank order,
//!   broadcast, and slicing into sub-groups that keep their original ranks.
//! - Supervision: a panicking handler or an [`ActorError::Fatal`] stops the
//!   actor (never the process) with a [`StopReason`]; every [`Supervisor`] it
//!   is linked to receives a [`Terminated`] event. Dropping the last
//!   [`ActorRef`] stops an actor cleanly after it has drained its mailbox.
//! - [`codec`]: the one module in the project that calls bincode.
//! - [`remote`]: location-transparent remote actors over authenticated TCP
//!   connections with heartbeats: a remote actor is an ordinary [`ActorRef`].
//!
//! ```
//! use actors::{async_trait, spawn, Actor, ActorError, Context, SpawnConfig};
//!
//! struct Counter(u64);
//!
//! #[async_trait]
//! impl Actor for Counter {
//!     type Msg = u64;
//!     type Reply = u64;
//!
//!     async fn handle(&mut self, add: u64, _ctx: &mut Context<Self>) -> Result<u64, ActorError> {
//!         self.0 += add;
//!         Ok(self.0)
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let counter = spawn(Counter(0), SpawnConfig::default().name("counter"));
//! assert_eq!(counter.call(2).await.unwrap(), 2);
//! assert_eq!(counter.call(3).await.unwrap(), 5);
//! # }
//! ```

mod actor;
mod actor_ref;
pub mod codec;
mod error;
mod group;
mod join;
pub mod log;
pub use join::join_all;
mod panic;
pub mod remote;
mod runtime;
mod supervision;

pub use actor::{Actor, ActorInfo, Context};
pub use actor_ref::{ActorRef, WeakActorRef};
pub use error::{ActorError, BroadcastError, CallError, GroupError, TellError};
pub use group::{spawn_group, ActorGroup};
pub use remote::{RemoteError, Secret};
pub use runtime::{spawn, spawn_rank, SpawnConfig};
pub use supervision::{StopReason, Supervisor, SupervisorEvents, Terminated};

/// Re-export of [`macro@async_trait::async_trait`], so implementors of [`Actor`]
/// need no direct dependency on it.
pub use async_trait::async_trait;
