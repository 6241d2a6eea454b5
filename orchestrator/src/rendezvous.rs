//! Groups whose members live in other processes or on other hosts.
//!
//! The orchestrator's process opens a [`Rendezvous`]: an authenticated
//! control node ([`actors::remote`]) hosting a name registry. Every member
//! process [`join`]s it with the same shared secret, spawns the
//! [`Member`] of each rank it holds weights for next to its own actors
//! ([`Joined::serve_member`]), and serves them under well-known names
//! ([`member_name`]). The rendezvous then hands the orchestrator ordinary
//! [`ActorGroup`]s of those members ([`Rendezvous::members`]); the user's
//! own actors (trainers, rollout engines) are looked up the same way
//! ([`Rendezvous::lookup`]).
//!
//! A member process keeps serving until the rendezvous goes away
//! ([`Joined::closed`]); a process that dies is seen by the orchestrator as
//! a member that died ([`crate::OrchestratorError::MemberDied`]), and its
//! replacement joins under the same name; [`Rendezvous::recover`] puts it
//! in the dead one's place. A control connection that breaks while both
//! processes live is made again by both sides (the `rejoin` module): the
//! member process joins again with its registrations, and
//! [`Rendezvous::reattach`] puts the same member back before a refit.

mod rejoin;

use crate::member::{Member, MemberConfig, Role};
use crate::{DstStore, OrchestratorHandle};
use actors::remote::{Node, NodeConfig, Registration, Registry, RegistryMsg, RegistryReply, RemotePeer, Retry, Secret, REGISTRY_NAME};
use actors::{spawn, Actor, ActorGroup, ActorRef, SpawnConfig};
use reshard::{Endpoint, Group, Layout};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;

/// Environment variable with the rendezvous address (`host:port`).
pub const RENDEZVOUS_ENV: &str = "REFIT_RENDEZVOUS";
/// Environment variable with the shared secret (16 bytes or more).
pub const SECRET_ENV: &str = "REFIT_SECRET";

/// Largest control-plane frame: programs of big models travel in one.
const MAX_FRAME_BYTES: usize = 256 << 20;

/// The name a group's rank's member is served under.
pub fn member_name(group: Group, rank: u32) -> String {
    match group {
        Group::Src => format!("refit.member.src.{rank}"),
        Group::Dst => format!("refit.member.dst.{rank}"),
    }
}

/// The registry name of rank `rank` of a replica named `replica` that
/// joins a destination group of replicas
/// ([`OrchestratorMsg::AddReplica`](crate::OrchestratorMsg::AddReplica)):
/// `refit.member.replica.<replica>.<rank>`.
pub fn replica_member_name(replica: &str, rank: u32) -> String {
    format!("refit.member.replica.{replica}.{rank}")
}

/// Why joining failed.
#[derive(Debug, Error)]
pub enum JoinError {
    /// A setting is missing or malformed.
    #[error("{0}")]
    Config(String),
    /// The control plane failed.
    #[error("{what}: {error}")]
    Remote {
        /// What was being done.
        what: String,
        /// The control plane's error.
        error: actors::RemoteError,
    },
    /// A name did not appear in the registry in time.
    #[error("'{name}' did not join within {within:?}")]
    Missing {
        /// The name.
        name: String,
        /// The time waited.
        within: Duration,
    },
    /// The registry could not be reached.
    #[error("registry: {0}")]
    Registry(String),
    /// Another live process serves the name (a replica or rank of that
    /// name is already serving): the join is refused.
    #[error("'{name}' is already served by the live process at {holder}: use another name (another replica name), or stop that one first")]
    NameHeld {
        /// The name.
        name: String,
        /// That process's control address.
        holder: SocketAddr,
    },
    /// The orchestrator did not take a replacement member.
    #[error("the orchestrator did not take the member that rejoined as {endpoint}: {why}")]
    Replace {
        /// The rank replaced.
        endpoint: Endpoint,
        /// The orchestrator's error.
        why: String,
    },
}

fn remote(what: impl Into<String>) -> impl FnOnce(actors::RemoteError) -> JoinError {
    let what = what.into();
    move |error| JoinError::Remote { what, error }
}

/// Control-plane settings both sides share.
#[derive(Debug, Clone)]
pub struct ControlConfig {
    /// A control connection silent this long, counted in the time this
    /// process was running, is dead (pings every 250 ms; default 10 s). A
    /// killed process is seen at once anyway (its sockets close): this
    /// bounds how long a hung but connected peer goes unnoticed (a refit's
    /// deadline bounds it too).
    pub heartbeat_timeout: Duration,
    /// A member process whose connection to the rendezvous broke (the
    /// rendezvous did not say goodbye) connects again, with backoff, for
    /// up to this long before it takes the rendezvous for gone (default
    /// 60 s).
    pub rejoin_timeout: Duration,
}

/// Default [`ControlConfig::heartbeat_timeout`].
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for ControlConfig {
    fn default() -> Self {
        ControlConfig { heartbeat_timeout: HEARTBEAT_TIMEOUT, rejoin_timeout: actors::remote::DEFAULT_RETRY_TIMEOUT }
    }
}

/// How the orchestrator's handles to members and other remote actors are
/// spawned: the orchestrator bounds every call itself.
fn member_spawn_config(name: &str) -> SpawnConfig {
    SpawnConfig::default().name(name).call_timeout(Duration::from_secs(7 * 24 * 3600))
}

fn node_config(bind: SocketAddr, control: &ControlConfig) -> NodeConfig {
    NodeConfig { bind, max_frame_bytes: MAX_FRAME_BYTES, heartbeat_timeout: control.heartbeat_timeout, ..NodeConfig::default() }
}

/// The orchestrator's side: where member processes meet.
pub struct Rendezvous {
    node: Node,
    registry: ActorRef<Registry>,
    peers: tokio::sync::Mutex<HashMap<SocketAddr, RemotePeer>>,
    /// Where each name was registered when it was last looked up: a
    /// rejoin forgets that registration, never a replacement's that came
    /// since.
    looked_up: std::sync::Mutex<HashMap<String, SocketAddr>>,
}

impl Rendezvous {
    /// Listens at `bind` (use port 0 for any) and hosts the registry.
    pub async fn bind(secret: Secret, bind: SocketAddr, control: &ControlConfig) -> Result<Rendezvous, JoinError> {
        let node = Node::bind(secret, node_config(bind, control)).await.map_err(remote(format!("listen on {bind}")))?;
        let registry = node.host_registry().map_err(remote("host the registry"))?;
        Ok(Rendezvous { node, registry, peers: Default::default(), looked_up: Default::default() })
    }

    /// The address member processes join (`REFIT_RENDEZVOUS`).
    pub fn addr(&self) -> SocketAddr {
        self.node.advertised_addr()
    }

    /// The control node (to serve actors of the orchestrator's own).
    pub fn node(&self) -> &Node {
        &self.node
    }

    async fn resolve(&self, name: &str) -> Result<Option<Registration>, JoinError> {
        match self.registry.call(RegistryMsg::Resolve(name.to_string())).await {
            Ok(RegistryReply::Resolved(r)) => Ok(r),
            Ok(other) => Err(JoinError::Registry(format!("answered {other:?} to Resolve"))),
            Err(e) => Err(JoinError::Registry(e.to_string())),
        }
    }

    /// Waits up to `within` for `name` to join, then looks it up.
    pub async fn lookup<A>(&self, name: &str, within: Duration) -> Result<ActorRef<A>, JoinError>
    where
        A: Actor,
        A::Msg: Serialize,
        A::Reply: DeserializeOwned,
    {
        let until = Instant::now() + within;
        let registration = loop {
            if let Some(r) = self.resolve(name).await? {
                break r;
            }
            if Instant::now() >= until {
                return Err(JoinError::Missing { name: name.to_string(), within });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        // A member's control node may be crowded by strangers too.
        let left = until.saturating_duration_since(Instant::now());
        let peer = self.connected(registration.addr, left).await.map_err(remote(format!("connect to '{name}'")))?;
        let found = peer.lookup_with::<A>(name, member_spawn_config(name)).await.map_err(remote(format!("look up '{name}'")))?;
        self.looked_up.lock().unwrap_or_else(|e| e.into_inner()).insert(name.to_string(), registration.addr);
        Ok(found)
    }

    /// Looks `name` up again once what was looked up under it is gone:
    /// forgets that registration (a replacement that registered since
    /// stays) and waits up to `within` for one to join under the name.
    pub async fn rejoin<A>(&self, name: &str, within: Duration) -> Result<ActorRef<A>, JoinError>
    where
        A: Actor,
        A::Msg: Serialize,
        A::Reply: DeserializeOwned,
    {
        let gone = self.looked_up.lock().unwrap_or_else(|e| e.into_inner()).get(name).copied();
        if let Some(addr) = gone {
            // Removes the entry only while it is still the dead one's.
            self.registry
                .call(RegistryMsg::Unregister { name: name.to_string(), addr })
                .await
                .map_err(|e| JoinError::Registry(e.to_string()))?;
        }
        self.lookup(name, within).await
    }

    /// Forgets what was looked up under `name` (its registration, while
    /// it is still the one looked up): one that joins under the name later
    /// is new (a replica that left the group and is started again).
    pub async fn forget(&self, name: &str) -> Result<(), JoinError> {
        let gone = self.looked_up.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
        if let Some(addr) = gone {
            self.registry
                .call(RegistryMsg::Unregister { name: name.to_string(), addr })
                .await
                .map_err(|e| JoinError::Registry(e.to_string()))?;
        }
        Ok(())
    }

    /// Puts a member that rejoined in the place of every member of `src`
    /// and `dst` that is gone (its process died, or its connection broke
    /// or went silent past the heartbeat timeout), in both groups and in
    /// `orchestrator`, waiting up to `within` in all: the same member
    /// found again where its process still lives ([`find_again`](Self::find_again)),
    /// else a replacement that joins under the dead one's name
    /// ([`member_name`]). Returns the ranks replaced (none: every member
    /// is alive). A rank whose replacement
    /// does not join in time fails the call with [`JoinError::Missing`];
    /// ranks replaced before it stay replaced, and calling again picks up
    /// where it stopped. The next refit installs the plan on the new
    /// members and reconnects the data plane; a new destination serves no
    /// version until that refit commits (a subset refit is refused until
    /// then), a new source holds none until its process steps.
    pub async fn recover(
        &self,
        orchestrator: &OrchestratorHandle,
        src: &mut ActorGroup<Member>,
        dst: &mut ActorGroup<Member>,
        within: Duration,
    ) -> Result<Vec<Endpoint>, JoinError> {
        let until = Instant::now() + within;
        let mut replaced = Vec::new();
        for (group, members) in [(Group::Src, src), (Group::Dst, dst)] {
            let gone: Vec<usize> = members.iter().filter(|(_, m)| !m.is_alive()).map(|(r, _)| r).collect();
            for rank in gone {
                let endpoint = Endpoint { group, rank: rank as u32 };
                let left = until.saturating_duration_since(Instant::now());
                let name = member_name(group, endpoint.rank);
                let old = members.get(rank).cloned();
                let again = match &old {
                    Some(old) => self.find_again(&name, old, left).await?,
                    None => None,
                };
                let member = match again {
                    Some(member) => member,
                    None => self.rejoin::<Member>(&name, until.saturating_duration_since(Instant::now())).await?,
                };
                self.put_back(orchestrator, members, endpoint, member).await?;
                replaced.push(endpoint);
            }
        }
        Ok(replaced)
    }

    /// The members of ranks `0..ranks` of `group`, once all have joined
    /// (waiting up to `within` in all).
    pub async fn members(&self, group: Group, ranks: u32, within: Duration) -> Result<ActorGroup<Member>, JoinError> {
        self.named_members(ranks, within, |r| member_name(group, r)).await
    }

    /// The members of ranks `0..ranks` of the replica named `replica`
    /// ([`Joined::serve_replica_member`]), waiting up to `within` for all.
    pub async fn replica_members(&self, replica: &str, ranks: u32, within: Duration) -> Result<ActorGroup<Member>, JoinError> {
        self.named_members(ranks, within, |r| replica_member_name(replica, r)).await
    }

    /// The names of the replicas every one of whose `ranks` ranks has
    /// joined ([`Joined::serve_replica_member`]), sorted: a launcher
    /// that lets replicas join at any time asks before each refit.
    pub async fn joined_replicas(&self, ranks: u32) -> Result<Vec<String>, JoinError> {
        let listed = match self.registry.call(RegistryMsg::List).await {
            Ok(RegistryReply::Listed(entries)) => entries,
            Ok(other) => return Err(JoinError::Registry(format!("answered {other:?} to List"))),
            Err(e) => return Err(JoinError::Registry(e.to_string())),
        };
        // `refit.member.replica.` (the name of an empty replica's rank 0,
        // less `.0`), then `<replica>.<rank>`; a replica's name may hold
        // dots.
        let name = replica_member_name("", 0);
        let prefix = name.strip_suffix('0').unwrap_or(&name).trim_end_matches('.');
        let mut joined: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
        for entry in &listed {
            let Some((replica, rank)) = entry.name.strip_prefix(prefix).and_then(|rest| rest.strip_prefix('.')?.rsplit_once('.')) else {
                continue;
            };
            if let Ok(rank) = rank.parse::<u32>() {
                joined.entry(replica).or_default().push(rank);
            }
        }
        Ok(joined.into_iter().filter(|(_, held)| (0..ranks).all(|r| held.contains(&r))).map(|(replica, _)| replica.to_string()).collect())
    }

    /// The members named `name(r)` for ranks `0..ranks`, waiting up to
    /// `within` for all.
    async fn named_members(&self, ranks: u32, within: Duration, name: impl Fn(u32) -> String) -> Result<ActorGroup<Member>, JoinError> {
        let until = Instant::now() + within;
        let mut refs = Vec::with_capacity(ranks as usize);
        for r in 0..ranks {
            let left = until.saturating_duration_since(Instant::now());
            refs.push(self.lookup::<Member>(&name(r), left).await?);
        }
        Ok(ActorGroup::from_refs(refs))
    }
}

/// How a member process finds the rendezvous.
#[derive(Debug, Clone)]
pub struct JoinConfig {
    /// The rendezvous address.
    pub rendezvous: SocketAddr,
    /// The shared secret.
    pub secret: Secret,
    /// Control-plane settings.
    pub control: ControlConfig,
}

impl JoinConfig {
    /// From the environment: `REFIT_RENDEZVOUS` (`host:port`; else
    /// torchrun's `MASTER_ADDR` with `REFIT_PORT`) and `REFIT_SECRET`.
    pub fn from_env() -> Result<JoinConfig, JoinError> {
        let var = |k: &str| std::env::var(k).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let text = match (var(RENDEZVOUS_ENV), var("MASTER_ADDR"), var("REFIT_PORT")) {
            (Some(a), _, _) => a,
            (None, Some(host), Some(port)) => format!("{host}:{port}"),
            _ => return Err(JoinError::Config(format!("set {RENDEZVOUS_ENV}=host:port (or MASTER_ADDR and REFIT_PORT)"))),
        };
        let rendezvous = resolve_addr(&text).map_err(|e| JoinError::Config(format!("{RENDEZVOUS_ENV}={text}: {e}")))?;
        let secret = Secret::from_env(SECRET_ENV).map_err(|e| JoinError::Config(format!("{SECRET_ENV}: {e}")))?;
        Ok(JoinConfig { rendezvous, secret, control: ControlConfig::default() })
    }
}

/// Why a rendezvous address does not resolve.
#[derive(Debug, thiserror::Error)]
enum AddrError {
    /// The lookup failed.
    #[error(transparent)]
    Lookup(#[from] std::io::Error),
    /// The lookup found no address.
    #[error("no address")]
    NoAddress,
}

fn resolve_addr(text: &str) -> Result<SocketAddr, AddrError> {
    use std::net::ToSocketAddrs;
    text.to_socket_addrs()?.next().ok_or(AddrError::NoAddress)
}

/// A member process's membership: its control node, connected to the
/// rendezvous (connected again, with its registrations, when the
/// connection breaks while the rendezvous lives: [`ControlConfig::rejoin_timeout`]).
pub struct Joined {
    control: Arc<rejoin::Control>,
    ip: IpAddr,
    secret: Secret,
}

/// Joins the rendezvous: binds a control node on the interface that
/// reaches it and connects, retrying with backoff for up to a minute
/// ([`Retry::default`]; see [`join_with`]).
pub async fn join(config: &JoinConfig) -> Result<Joined, JoinError> {
    join_with(config, &Retry::default()).await
}

/// [`join`], retrying as `retry` says. Connecting and looking up the
/// registry are attempted again after failures another attempt may not
/// meet ([`actors::RemoteError::is_transient`]): above all the rendezvous
/// dropping the connection before it authenticated, when others that do
/// not authenticate crowd its control port. A refused connection (nothing
/// listens there) or a failed authentication (the secrets differ) fails
/// at once.
pub async fn join_with(config: &JoinConfig, retry: &Retry) -> Result<Joined, JoinError> {
    let to = config.rendezvous;
    let ip = local_ip_towards(to).map_err(|e| JoinError::Config(format!("no route to the rendezvous {to}: {e}")))?;
    let node = Node::bind(config.secret.clone(), node_config(SocketAddr::new(ip, 0), &config.control))
        .await
        .map_err(remote(format!("listen on {ip}")))?;
    let (peer, registry) = retry
        .run(&to.to_string(), || async {
            let peer = node.connect(to).await?;
            let registry = peer.lookup::<Registry>(REGISTRY_NAME).await?;
            Ok((peer, registry))
        })
        .await
        .map_err(remote(format!("join the rendezvous {to}")))?;
    let control = rejoin::Control::start(node, to, peer, registry, &config.control);
    Ok(Joined { control, ip, secret: config.secret.clone() })
}

impl Joined {
    /// This process's control node.
    pub fn node(&self) -> &Node {
        self.control.node()
    }

    /// Serves `actor` under `name` and registers it with the rendezvous
    /// (again, as the same holder, whenever this process joins the
    /// rendezvous again after its connection broke).
    pub async fn serve<A>(&self, name: &str, actor: &ActorRef<A>) -> Result<(), JoinError>
    where
        A: Actor,
        A::Msg: DeserializeOwned,
        A::Reply: Serialize,
    {
        let node = self.node();
        node.serve(name, actor).map_err(remote(format!("serve '{name}'")))?;
        let registration = Registration { name: name.to_string(), addr: node.advertised_addr(), info: actor.info().clone() };
        match self.control.register(registration).await {
            Ok(RegistryReply::Taken(held)) => {
                node.unserve(name);
                Err(JoinError::NameHeld { name: held.name, holder: held.addr })
            }
            Ok(_) => Ok(()),
            Err(e) => {
                node.unserve(name);
                Err(JoinError::Registry(e.to_string()))
            }
        }
    }

    /// Spawns the member of rank `rank` of the group laid out as `layout`
    /// on this process's store, serves it and registers it; its data plane
    /// listens on the interface that reaches the rendezvous.
    pub async fn serve_member(&self, layout: Arc<Layout>, rank: u32, role: Role) -> Result<ActorRef<Member>, JoinError> {
        self.serve_member_with(layout, rank, role, self.member_config()).await
    }

    /// The member settings [`serve_member`](Self::serve_member) uses: the
    /// data plane on the interface that reaches the rendezvous, its
    /// handshakes proving the job's secret.
    pub fn member_config(&self) -> MemberConfig {
        MemberConfig { data_ip: self.ip, secret: Some(self.secret.clone()), ..MemberConfig::default() }
    }

    /// [`serve_member`](Self::serve_member) with explicit settings.
    pub async fn serve_member_with(
        &self,
        layout: Arc<Layout>,
        rank: u32,
        role: Role,
        config: MemberConfig,
    ) -> Result<ActorRef<Member>, JoinError> {
        if rank >= layout.ranks() {
            return Err(JoinError::Config(format!("rank {rank}: the layout has {} ranks", layout.ranks())));
        }
        self.serve_member_named(member_name(role.group(), rank), layout, rank, role, config).await
    }

    /// [`serve_member_with`](Self::serve_member_with) of rank `rank` of a
    /// replica named `replica` (laid out as `layout`, one replica's
    /// layout) that the orchestrator is to add to its destination group:
    /// served as [`replica_member_name`].
    pub async fn serve_replica_member(
        &self,
        replica: &str,
        layout: Arc<Layout>,
        rank: u32,
        store: Arc<DstStore>,
        config: MemberConfig,
    ) -> Result<ActorRef<Member>, JoinError> {
        if rank >= layout.ranks() {
            return Err(JoinError::Config(format!("rank {rank}: the replica's layout has {} ranks", layout.ranks())));
        }
        if replica.is_empty() || replica.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err(JoinError::Config(format!("replica name {replica:?}: must be non-empty, without spaces or control characters")));
        }
        self.serve_member_named(replica_member_name(replica, rank), layout, rank, Role::Dst(store), config).await
    }

    async fn serve_member_named(
        &self,
        name: String,
        layout: Arc<Layout>,
        rank: u32,
        role: Role,
        config: MemberConfig,
    ) -> Result<ActorRef<Member>, JoinError> {
        let member = Member::with_config(layout, rank, role, config);
        // Calls are bounded by the orchestrator (a refit may take minutes).
        let member = spawn(member, SpawnConfig::default().name(name.clone()).call_timeout(Duration::from_secs(7 * 24 * 3600)));
        self.serve(&name, &member).await?;
        Ok(member)
    }

    /// Waits until the rendezvous goes away for good (it said goodbye,
    /// or joining it again after the connection broke failed within
    /// [`ControlConfig::rejoin_timeout`]); says why.
    pub async fn closed(&self) -> String {
        self.control.closed().await
    }

    /// Closes this process's control node.
    pub fn shutdown(&self) {
        self.node().shutdown();
    }
}

/// The address of this machine's interface that reaches `to` (no packet is
/// sent).
fn local_ip_towards(to: SocketAddr) -> std::io::Result<IpAddr> {
    let any = if to.is_ipv4() { IpAddr::from([0u8; 4]) } else { IpAddr::from([0u16; 8]) };
    let probe = std::net::UdpSocket::bind(SocketAddr::new(any, 0))?;
    probe.connect(to)?;
    Ok(probe.local_addr()?.ip())
}
