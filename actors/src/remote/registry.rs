//! A small name registry so nodes find each other: a [`Registry`] actor,
//! served by one node under [`REGISTRY_NAME`], maps actor names to the node
//! serving them; a [`RegistryClient`] announces names and resolves them.
//!
//! Entries are not tied to connections: a node that goes away leaves its
//! entries behind until they are withdrawn or replaced, and resolving such a
//! name then fails to connect. A name is replaced only by the node that
//! registered it, by the same actor from another node, or once its holder
//! is gone: before replacing another node's entry the registry asks that
//! node whether it still serves the same actor under the name
//! ([`Registry`]); if it does, the registration is refused
//! ([`RegistryReply::Taken`], [`RemoteError::NameHeld`]).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::error::RemoteError;
use super::node::{Node, RemotePeer};
use crate::actor::{Actor, ActorInfo, Context};
use crate::actor_ref::ActorRef;
use crate::error::ActorError;
use crate::runtime::{spawn, SpawnConfig};

/// The name the registry actor is served under.
pub const REGISTRY_NAME: &str = "refit.registry";

/// Where a named actor lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// The name it is served under.
    pub name: String,
    /// The serving node's address.
    pub addr: SocketAddr,
    /// The actor's identity.
    pub info: ActorInfo,
}

/// Messages of the [`Registry`] actor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegistryMsg {
    /// Adds the entry for `registration.name`, or replaces it where it
    /// is the same node's, the same actor's, or its holder is gone;
    /// [`RegistryReply::Taken`] where its holder still serves it.
    Register(Registration),
    /// Removes the entry for `name` if it points at `addr`.
    Unregister {
        /// The name.
        name: String,
        /// The node that registered it.
        addr: SocketAddr,
    },
    /// Looks a name up.
    Resolve(String),
    /// Lists every entry, sorted by name.
    List,
}

/// Replies of the [`Registry`] actor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegistryReply {
    /// `Register` / `Unregister` done; for `Unregister`, whether an entry was removed.
    Done(bool),
    /// The entry, if any.
    Resolved(Option<Registration>),
    /// All entries.
    Listed(Vec<Registration>),
    /// `Register` refused: the name's entry, whose node still serves it.
    Taken(Registration),
}

/// The longest a registration waits to learn whether a name's holder
/// still serves it (connect, handshake and look-up): a holder that does
/// not answer within it is taken for gone.
const HOLDER_PROBE: Duration = Duration::from_secs(2);

/// The registry actor: a map from names to [`Registration`]s, served by
/// `node`, which asks a name's holder whether it still serves it before
/// another node's registration replaces it.
#[derive(Debug)]
pub struct Registry {
    node: Node,
    entries: BTreeMap<String, Registration>,
}

impl Registry {
    /// Whether `new` may replace `held` (the entry for the same name): the
    /// same node or the same actor, or a holder that no longer serves the
    /// actor it registered (its node gone, unreachable within
    /// [`HOLDER_PROBE`], or serving something else under the name).
    async fn replaces(&self, held: &Registration, new: &Registration) -> bool {
        if held.addr == new.addr || held.info.id == new.info.id {
            return true;
        }
        let probe = async {
            let peer = self.node.connect(held.addr).await.ok()?;
            let info = peer.served_info(&held.name, HOLDER_PROBE).await.ok()?;
            peer.close();
            Some(info.id == held.info.id)
        };
        let serves = tokio::time::timeout(HOLDER_PROBE, probe).await.ok().flatten().unwrap_or(false);
        if !serves {
            tracing::info!(name = %held.name, holder = %held.addr, by = %new.addr, "registry: a gone holder's name taken over");
        }
        !serves
    }
}

#[async_trait::async_trait]
impl Actor for Registry {
    type Msg = RegistryMsg;
    type Reply = RegistryReply;

    async fn handle(&mut self, msg: RegistryMsg, _ctx: &mut Context<Self>) -> Result<RegistryReply, ActorError> {
        Ok(match msg {
            RegistryMsg::Register(registration) => {
                if let Some(held) = self.entries.get(&registration.name) {
                    if !self.replaces(held, &registration).await {
                        return Ok(RegistryReply::Taken(held.clone()));
                    }
                }
                self.entries.insert(registration.name.clone(), registration);
                RegistryReply::Done(true)
            }
            RegistryMsg::Unregister { name, addr } => {
                let matches = self.entries.get(&name).is_some_and(|entry| entry.addr == addr);
                if matches {
                    self.entries.remove(&name);
                }
                RegistryReply::Done(matches)
            }
            RegistryMsg::Resolve(name) => RegistryReply::Resolved(self.entries.get(&name).cloned()),
            RegistryMsg::List => RegistryReply::Listed(self.entries.values().cloned().collect()),
        })
    }
}

impl Node {
    /// Spawns a [`Registry`] and serves it under [`REGISTRY_NAME`].
    ///
    /// # Panics
    ///
    /// Like [`tokio::spawn`], panics when called outside a tokio runtime.
    pub fn host_registry(&self) -> Result<ActorRef<Registry>, RemoteError> {
        let registry = spawn(Registry { node: self.clone(), entries: BTreeMap::new() }, SpawnConfig::default().name(REGISTRY_NAME));
        self.serve(REGISTRY_NAME, &registry)?;
        Ok(registry)
    }

    /// Connects to the registry served by the node at `addr`.
    pub async fn registry_client(&self, addr: SocketAddr) -> Result<RegistryClient, RemoteError> {
        let peer = self.connect(addr).await?;
        let registry = peer.lookup::<Registry>(REGISTRY_NAME).await?;
        let mut peers = HashMap::new();
        peers.insert(addr, peer);
        Ok(RegistryClient { node: self.clone(), addr, registry, peers: Mutex::new(peers) })
    }
}

/// A node's view of a registry: announce what it serves, find what others
/// serve. Connections to resolved nodes are cached and reused while alive.
#[derive(Debug)]
pub struct RegistryClient {
    node: Node,
    addr: SocketAddr,
    registry: ActorRef<Registry>,
    peers: Mutex<HashMap<SocketAddr, RemotePeer>>,
}

impl RegistryClient {
    /// The registry's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    async fn call(&self, msg: RegistryMsg) -> Result<RegistryReply, RemoteError> {
        self.registry.call(msg).await.map_err(|source| RemoteError::Registry { registry: self.addr.to_string(), source: Box::new(source) })
    }

    /// Announces that this node serves `name` (which it must already serve),
    /// at [`Node::advertised_addr`].
    pub async fn announce(&self, name: &str) -> Result<(), RemoteError> {
        let info = self
            .node
            .served_info(name)
            .ok_or_else(|| RemoteError::UnknownActor { peer: self.node.local_addr().to_string(), name: name.to_owned() })?;
        let registration = Registration { name: name.to_owned(), addr: self.node.advertised_addr(), info };
        match self.call(RegistryMsg::Register(registration)).await? {
            RegistryReply::Taken(held) => {
                Err(RemoteError::NameHeld { registry: self.addr.to_string(), name: held.name, holder: held.addr })
            }
            _ => Ok(()),
        }
    }

    /// Withdraws this node's entry for `name`; `true` if there was one.
    pub async fn withdraw(&self, name: &str) -> Result<bool, RemoteError> {
        match self.call(RegistryMsg::Unregister { name: name.to_owned(), addr: self.node.advertised_addr() }).await? {
            RegistryReply::Done(removed) => Ok(removed),
            _ => Ok(false),
        }
    }

    /// Where `name` is served, if registered.
    pub async fn resolve(&self, name: &str) -> Result<Option<Registration>, RemoteError> {
        match self.call(RegistryMsg::Resolve(name.to_owned())).await? {
            RegistryReply::Resolved(found) => Ok(found),
            _ => Ok(None),
        }
    }

    /// Every registration, sorted by name.
    pub async fn list(&self) -> Result<Vec<Registration>, RemoteError> {
        match self.call(RegistryMsg::List).await? {
            RegistryReply::Listed(all) => Ok(all),
            _ => Ok(Vec::new()),
        }
    }

    /// Resolves `name`, connects to its node (reusing a live connection)
    /// and returns a handle to the actor.
    pub async fn lookup<A>(&self, name: &str) -> Result<ActorRef<A>, RemoteError>
    where
        A: Actor,
        A::Msg: Serialize,
        A::Reply: DeserializeOwned,
    {
        let registration = self
            .resolve(name)
            .await?
            .ok_or_else(|| RemoteError::NotRegistered { registry: self.addr.to_string(), name: name.to_owned() })?;
        let cached = self.peers().get(&registration.addr).filter(|peer| peer.is_connected()).cloned();
        let peer = match cached {
            Some(peer) => peer,
            None => {
                let peer = self.node.connect(registration.addr).await?;
                self.peers().insert(registration.addr, peer.clone());
                peer
            }
        };
        peer.lookup::<A>(name).await
    }

    fn peers(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, RemotePeer>> {
        // Nothing panics while holding this lock; recover from poison anyway.
        self.peers.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
