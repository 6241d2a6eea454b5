//! Proxies: local mailboxes standing in for remote actors, so that a remote
//! actor is used through an ordinary [`ActorRef`].

use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use super::conn::{Complete, Conn, Outcome};
use super::node::Link;
use super::wire::{Failure, Message};
use crate::actor::{Actor, ActorInfo};
use crate::actor_ref::ActorRef;
use crate::codec;
use crate::error::{ActorError, CallError};
use crate::runtime::{Envelope, Mailbox, ReplyTx, Shared, SpawnConfig};
use crate::supervision::StopReason;

/// Spawns the proxy task for the remote actor `info` served as `name` on the
/// link's peer and returns the handle to it.
pub(crate) fn spawn_proxy<A>(link: Arc<Link>, name: String, info: ActorInfo, config: &SpawnConfig) -> ActorRef<A>
where
    A: Actor,
    A::Msg: Serialize,
    A::Reply: DeserializeOwned,
{
    let shared = Arc::new(Shared::new(info, config.supervisors().to_vec()));
    let (tx, rx) = mpsc::channel(config.capacity().max(1));
    let actor_ref = ActorRef::new(tx, Arc::clone(&shared), config.default_call_timeout());
    let mailbox = Mailbox::new(rx, shared);
    tokio::spawn(run::<A>(link, name, mailbox));
    actor_ref
}

async fn run<A>(link: Arc<Link>, name: String, mut mailbox: Mailbox<A>)
where
    A: Actor,
    A::Msg: Serialize,
    A::Reply: DeserializeOwned,
{
    let conn = link.conn();
    let shared = Arc::clone(&mailbox.shared);
    let (reason, proxy) = match conn.register_proxy(shared.info.id) {
        Err(reason) => (reason, None),
        Ok((proxy, mut remote_stop)) => {
            let reason = forward(conn, &name, proxy, &mut mailbox, &mut remote_stop).await;
            (reason, Some(proxy))
        }
    };
    tracing::debug!(actor = %shared.info, peer = %conn.peer(), %reason, "remote actor proxy stopped");
    mailbox.stop_accepting(&reason);
    if let Some(proxy) = proxy {
        conn.unregister_proxy(proxy, &reason);
    }
    mailbox.finish(&reason);
    drop(link);
}

/// Forwards envelopes until a reason to stop.
async fn forward<A>(
    conn: &Arc<Conn>,
    name: &str,
    proxy: u64,
    mailbox: &mut Mailbox<A>,
    remote_stop: &mut oneshot::Receiver<StopReason>,
) -> StopReason
where
    A: Actor,
    A::Msg: Serialize,
    A::Reply: DeserializeOwned,
{
    let shared = Arc::clone(&mailbox.shared);
    let max = conn.node().max_message_bytes();
    loop {
        if shared.is_stop_requested() {
            return StopReason::Requested;
        }
        let envelope = tokio::select! {
            biased;
            reason = &mut *remote_stop => return reason.unwrap_or(StopReason::Aborted),
            () = shared.stop_requested_notified() => return StopReason::Requested,
            envelope = mailbox.rx.recv() => match envelope {
                Some(envelope) => envelope,
                None => return StopReason::Normal,
            },
        };
        let Envelope { msg, reply } = envelope;
        let info = &shared.info;
        // Encoding may be heavy (a large message): keep it off the threads
        // that carry every connection's heartbeats.
        let msg = match super::conn::off_the_reactor(super::conn::LARGE, || codec::encode_with_max(&msg, max)) {
            Ok(msg) => msg,
            Err(err) => {
                let error = ActorError::failed(format!("cannot send the message to {} on {}: {err}", info, conn.peer()));
                match reply {
                    Some(reply) => {
                        let _ = reply.send(Err(CallError::Handler { actor: info.clone(), error }));
                    }
                    None => tracing::warn!(actor = %info, %error, "told message dropped"),
                }
                continue;
            }
        };
        let req = match reply {
            None => None,
            Some(reply) => match conn.register_call(proxy, completion::<A>(reply, info.clone(), max)) {
                Some(req) => Some(req),
                // Closed: the call was failed already; the stop arrives next.
                None => continue,
            },
        };
        // Fails only when the connection is closed, which also stops this proxy.
        let _ = conn.send(Message::Request { req, name: name.to_owned(), actor: info.id, msg }).await;
    }
}

/// Turns the outcome of a remote call into what the local caller expects.
fn completion<A>(reply: ReplyTx<A>, actor: ActorInfo, max: usize) -> Complete
where
    A: Actor,
    A::Reply: DeserializeOwned,
{
    Box::new(move |outcome| {
        let result = match outcome {
            Outcome::Reply(Ok(bytes)) => codec::decode_with_max::<A::Reply>(&bytes, max)
                .map_err(|err| CallError::Handler { actor: actor.clone(), error: ActorError::failed(format!("undecodable reply: {err}")) }),
            Outcome::Reply(Err(failure)) => Err(call_error(failure, actor)),
            Outcome::Lost(reason) => Err(CallError::Stopped { actor, reason }),
        };
        // The caller may have timed out already.
        let _ = reply.send(result);
    })
}

fn call_error(failure: Failure, actor: ActorInfo) -> CallError {
    match failure {
        Failure::Handler(error) => CallError::Handler { actor, error },
        Failure::Stopped(reason) => CallError::Stopped { actor, reason },
        Failure::Timeout(after) => CallError::Timeout { actor, after },
        other @ (Failure::UnknownActor(_) | Failure::BadMessage(_) | Failure::BadReply(_)) => {
            CallError::Handler { actor, error: ActorError::failed(format!("remote: {other}")) }
        }
    }
}
