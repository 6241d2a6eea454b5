//! Control connections that break while both processes live (a busy host
//! starving heartbeats, a connection reset) are made again, by both sides:
//!
//! - a member process whose connection to the rendezvous broke (not closed
//!   on purpose: the rendezvous did not say goodbye) connects again with
//!   backoff, for up to [`ControlConfig::rejoin_timeout`], and registers
//!   again every name it registered, as the same holder (its node's
//!   address, the same actors); only when that fails is the rendezvous gone
//!   ([`Joined::closed`](crate::Joined::closed) returns);
//! - the orchestrator's side finds a member whose connection broke again
//!   by its name ([`Rendezvous::find_again`](crate::Rendezvous::find_again)):
//!   registered by the same actor, served by the same node, which answers;
//!   before every refit ([`Rendezvous::reattach`](crate::Rendezvous::reattach))
//!   it puts every such member back in its place.
//!
//! A member's process that died is not found again (nothing answers at its
//! node's address): it is replaced by the process that joins under its name
//! ([`Rendezvous::recover`](crate::Rendezvous::recover)).

use crate::rendezvous::ControlConfig;
use actors::remote::{Node, Registration, Registry, RegistryMsg, RegistryReply, RemotePeer, Retry, REGISTRY_NAME};
use actors::{ActorRef, CallError, RemoteError};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use tokio::sync::watch;

/// A member process's connection to the rendezvous, made again while the
/// rendezvous lives, and what the process registered there.
pub(crate) struct Control {
    node: Node,
    rendezvous: SocketAddr,
    retry: Retry,
    state: Mutex<State>,
    /// Why the rendezvous is gone, once it is for good.
    gone: watch::Sender<Option<String>>,
}

struct State {
    peer: RemotePeer,
    registry: ActorRef<Registry>,
    /// Every registration made, in order, made again after a reconnect.
    registered: Vec<Registration>,
}

impl Control {
    /// Watches `peer` (to the registry at `rendezvous`) and makes it again
    /// when it breaks.
    pub(crate) fn start(
        node: Node,
        rendezvous: SocketAddr,
        peer: RemotePeer,
        registry: ActorRef<Registry>,
        control: &ControlConfig,
    ) -> Arc<Control> {
        let retry = Retry::default().within(control.rejoin_timeout);
        let (gone, _) = watch::channel(None);
        let state = Mutex::new(State { peer, registry, registered: Vec::new() });
        let control = Arc::new(Control { node, rendezvous, retry, state, gone });
        tokio::spawn(watch_connection(Arc::downgrade(&control)));
        control
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding this lock; recover from poison anyway.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn node(&self) -> &Node {
        &self.node
    }

    /// The registry as reached now.
    pub(crate) fn registry(&self) -> ActorRef<Registry> {
        self.state().registry.clone()
    }

    /// Registers `registration` and, unless another live holder has the
    /// name ([`RegistryReply::Taken`]), keeps it, to register it again
    /// after a reconnect.
    pub(crate) async fn register(&self, registration: Registration) -> Result<RegistryReply, CallError> {
        let reply = self.registry().call(RegistryMsg::Register(registration.clone())).await?;
        if !matches!(reply, RegistryReply::Taken(_)) {
            let mut state = self.state();
            state.registered.retain(|r| r.name != registration.name);
            state.registered.push(registration);
        }
        Ok(reply)
    }

    /// Waits until the rendezvous is gone for good; says why.
    pub(crate) async fn closed(&self) -> String {
        let mut rx = self.gone.subscribe();
        let why = match rx.wait_for(Option::is_some).await {
            Ok(why) => why.clone().unwrap_or_default(),
            // `self` holds the sender.
            Err(_) => "the rendezvous connection is gone".to_string(),
        };
        why
    }

    /// Connects to the rendezvous again and registers everything again.
    async fn reconnect(&self) -> Result<usize, RemoteError> {
        let registry_addr = self.rendezvous.to_string();
        let (peer, registry, again, taken) = self
            .retry
            .run(&registry_addr, || async {
                let peer = self.node.connect(self.rendezvous).await?;
                let registry = peer.lookup::<Registry>(REGISTRY_NAME).await?;
                // The same node and actors as before: the registry takes
                // them back as the same holder.
                let again = self.state().registered.clone();
                let mut taken = Vec::new();
                for registration in &again {
                    let reply = registry.call(RegistryMsg::Register(registration.clone())).await.map_err(|e| match e {
                        // Broken again: another attempt may succeed.
                        CallError::Stopped { reason, .. } => {
                            RemoteError::ConnectionLost { peer: registry_addr.clone(), problem: reason.to_string() }
                        }
                        other => RemoteError::Registry { registry: registry_addr.clone(), source: Box::new(other) },
                    })?;
                    if let RegistryReply::Taken(held) = reply {
                        taken.push(held);
                    }
                }
                Ok((peer, registry, again.len() - taken.len(), taken))
            })
            .await?;
        let mut state = self.state();
        state.peer = peer;
        state.registry = registry;
        for held in taken {
            // Another live process took the name meanwhile (a replacement
            // started for this one): it is no longer this process's.
            tracing::warn!(
                name = %held.name, holder = %held.addr,
                "a name this process registered is served by another live process now: not registered again"
            );
            state.registered.retain(|r| r.name != held.name);
        }
        Ok(again)
    }
}

/// Makes the connection to the rendezvous again each time it breaks while
/// the member process wants it; ends when the rendezvous is gone for good
/// or the [`Control`] is dropped.
async fn watch_connection(control: Weak<Control>) {
    loop {
        let Some(peer) = control.upgrade().map(|c| c.state().peer.clone()) else { return };
        let why = peer.closed().await;
        let Some(c) = control.upgrade() else { return };
        if peer.closed_on_purpose() || c.node.is_shut_down() {
            c.gone.send_replace(Some(why));
            return;
        }
        tracing::warn!(
            rendezvous = %c.rendezvous, problem = %why,
            "the control connection to the rendezvous broke without a goodbye: joining again, as this process, with its registrations"
        );
        match c.reconnect().await {
            Ok(names) => tracing::warn!(rendezvous = %c.rendezvous, names, "joined the rendezvous again; every name registered again"),
            Err(e) => {
                tracing::warn!(rendezvous = %c.rendezvous, error = %e, "could not join the rendezvous again: it is gone");
                c.gone.send_replace(Some(format!("{why}; joining again failed: {e}")));
                return;
            }
        }
    }
}

impl super::Rendezvous {
    /// The actor registered as `name` that a handle `gone` (stopped:
    /// its connection broke) stood for, found again as itself: the
    /// registration under `name` is still `gone`'s actor (not a
    /// replacement's), its node answers at the registered address
    /// (connecting again, with backoff, for up to `within`) and serves
    /// that same actor under `name`. `None` when it is not there: its
    /// process died (nothing answers), the name was withdrawn, or another
    /// actor holds it now (a replacement: see [`recover`](Self::recover)).
    pub async fn find_again<A>(
        &self,
        name: &str,
        gone: &ActorRef<A>,
        within: std::time::Duration,
    ) -> Result<Option<ActorRef<A>>, super::JoinError>
    where
        A: actors::Actor,
        A::Msg: serde::Serialize,
        A::Reply: serde::de::DeserializeOwned,
    {
        let Some(registration) = self.resolve(name).await? else { return Ok(None) };
        if registration.info.id != gone.id() {
            return Ok(None);
        }
        let found = match self.connected(registration.addr, within).await {
            Ok(peer) => peer.lookup_with::<A>(name, super::member_spawn_config(name)).await,
            Err(e) => Err(e),
        };
        match found {
            Ok(actor) if actor.id() == gone.id() => {
                self.looked_up.lock().unwrap_or_else(|e| e.into_inner()).insert(name.to_string(), registration.addr);
                Ok(Some(actor))
            }
            Ok(_) => Ok(None),
            Err(e) => {
                tracing::debug!(name, addr = %registration.addr, error = %e, "not found again where it was registered");
                Ok(None)
            }
        }
    }

    /// Puts back in its place every member of `src` and `dst` whose
    /// control connection broke while it lives ([`find_again`](Self::find_again),
    /// waiting up to `within` in all), in both groups and in `orchestrator`
    /// (whose next refit opens a fresh data plane, as after any
    /// replacement). Returns the ranks put back; a member that cannot be
    /// put back (the registry or the orchestrator failed) is logged and
    /// left as it is. Members whose process died stay as they are: the
    /// next refit fails for them, until [`recover`](Self::recover) puts a
    /// replacement in. The Python `Orchestrator` calls this before every
    /// refit.
    pub async fn reattach(
        &self,
        orchestrator: &crate::OrchestratorHandle,
        src: &mut actors::ActorGroup<crate::Member>,
        dst: &mut actors::ActorGroup<crate::Member>,
        within: std::time::Duration,
    ) -> Vec<reshard::Endpoint> {
        let until = std::time::Instant::now() + within;
        let mut back = Vec::new();
        for (group, members) in [(reshard::Group::Src, src), (reshard::Group::Dst, dst)] {
            let gone: Vec<(usize, ActorRef<crate::Member>)> =
                members.iter().filter(|(_, m)| !m.is_alive()).map(|(r, m)| (r, m.clone())).collect();
            for (rank, old) in gone {
                let endpoint = reshard::Endpoint { group, rank: rank as u32 };
                let left = until.saturating_duration_since(std::time::Instant::now());
                let put_back = async {
                    let Some(member) = self.find_again(old.name(), &old, left).await? else { return Ok(false) };
                    self.put_back(orchestrator, members, endpoint, member).await.map(|()| true)
                };
                match put_back.await {
                    Ok(true) => {
                        tracing::warn!(member = %old.name(), "a member whose control connection broke lives: found again as itself and put back");
                        back.push(endpoint);
                    }
                    Ok(false) => tracing::debug!(member = %old.name(), "a member whose control connection broke was not found again"),
                    Err(e) => {
                        tracing::warn!(member = %old.name(), error = %e, "could not put back a member whose control connection broke")
                    }
                }
            }
        }
        back
    }

    /// Puts `member` in rank `endpoint`'s place in `members` and in `orchestrator`.
    pub(super) async fn put_back(
        &self,
        orchestrator: &crate::OrchestratorHandle,
        members: &mut actors::ActorGroup<crate::Member>,
        endpoint: reshard::Endpoint,
        member: ActorRef<crate::Member>,
    ) -> Result<(), super::JoinError> {
        let replace = |e: String| super::JoinError::Replace { endpoint, why: e };
        orchestrator.replace(endpoint, member.clone()).await.map_err(|e| replace(e.to_string()))?;
        *members = members.with_member(endpoint.rank as usize, member).map_err(|e| replace(e.to_string()))?;
        Ok(())
    }

    /// A live connection to the node at `addr` (the one kept, or a new one
    /// made within `within`).
    pub(super) async fn connected(&self, addr: SocketAddr, within: std::time::Duration) -> Result<RemotePeer, RemoteError> {
        let mut peers = self.peers.lock().await;
        if let Some(p) = peers.get(&addr).filter(|p| p.is_connected()) {
            return Ok(p.clone());
        }
        let p = self.node.connect_retrying(addr, &Retry::default().within(within)).await?;
        peers.insert(addr, p.clone());
        Ok(p)
    }
}
