//! The serving side: actors a node exposes, behind a type-erased interface
//! that decodes requests and encodes replies.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::oneshot;

use super::wire::Failure;
use crate::actor::{Actor, ActorInfo};
use crate::actor_ref::ActorRef;
use crate::codec;
use crate::error::CallError;
use crate::runtime::{Envelope, Shared};

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What became of a delivered request.
pub(crate) enum Delivery {
    /// A told message was queued.
    Told,
    /// Not delivered.
    Failed(Failure),
    /// A call was queued; its encoded reply comes from this future.
    Pending(BoxFuture<'static, Result<Vec<u8>, Failure>>),
}

/// An actor served by a node, whatever its type.
pub(crate) trait Served: Send + Sync {
    fn info(&self) -> &ActorInfo;
    fn shared(&self) -> Arc<Shared>;
    /// Decodes `msg` and queues it (in arrival order, waiting for mailbox space).
    fn deliver(&self, msg: Vec<u8>, want_reply: bool, max: usize) -> BoxFuture<'_, Delivery>;
}

impl<A> Served for ActorRef<A>
where
    A: Actor,
    A::Msg: DeserializeOwned,
    A::Reply: Serialize,
{
    fn info(&self) -> &ActorInfo {
        ActorRef::info(self)
    }

    fn shared(&self) -> Arc<Shared> {
        Arc::clone(ActorRef::shared(self))
    }

    fn deliver(&self, msg: Vec<u8>, want_reply: bool, max: usize) -> BoxFuture<'_, Delivery> {
        Box::pin(async move {
            let msg: A::Msg = match super::conn::off_the_reactor(msg.len(), || codec::decode_with_max(&msg, max)) {
                Ok(msg) => msg,
                Err(err) => return Delivery::Failed(Failure::BadMessage(err.to_string())),
            };
            if !want_reply {
                return match self.send_envelope(Envelope { msg, reply: None }).await {
                    Ok(()) => Delivery::Told,
                    Err(reason) => Delivery::Failed(Failure::Stopped(reason)),
                };
            }
            let (reply_tx, reply_rx) = oneshot::channel();
            if let Err(reason) = self.send_envelope(Envelope { msg, reply: Some(reply_tx) }).await {
                return Delivery::Failed(Failure::Stopped(reason));
            }
            let after = self.default_call_timeout();
            let shared = Arc::clone(ActorRef::shared(self));
            Delivery::Pending(Box::pin(async move {
                let result = match tokio::time::timeout(after, reply_rx).await {
                    Err(_elapsed) => return Err(Failure::Timeout(after)),
                    // Dropped unanswered: the actor is going away.
                    Ok(Err(_)) => return Err(Failure::Stopped(shared.wait_stopping().await)),
                    Ok(Ok(result)) => result,
                };
                match result {
                    Ok(reply) => codec::encode_with_max(&reply, max).map_err(|err| Failure::BadReply(err.to_string())),
                    Err(CallError::Handler { error, .. }) => Err(Failure::Handler(error)),
                    Err(CallError::Stopped { reason, .. }) => Err(Failure::Stopped(reason)),
                    Err(CallError::Timeout { after, .. }) => Err(Failure::Timeout(after)),
                }
            }))
        })
    }
}
