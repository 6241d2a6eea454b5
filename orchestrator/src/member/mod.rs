//! The refit member actor: one per rank of each group, owning that rank's
//! part of the refit protocol ([`crate::protocol`]). It shares its rank's
//! store with the user's training or inference actor and talks to the
//! orchestrator only by message, so it may live in any process.

use crate::protocol::{
    Fabric, HeldVersion, LayoutInfo, MemberMsg, MemberReply, PeerAddr, ProgramRole, Refusal, RunRequest, INSTALLED_PLANS,
};
use crate::store::{CommitFence, DstStore, RegisteredStagingHold, SrcStore};
use actors::{async_trait, Actor, ActorError, Context};
use reshard::{BufferSpec, Endpoint, Fingerprint, Group, Layout, Rank, RankProgram};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport::fabric::{Connecting, NodeFaults, RankEnd, RegisteredStaging, Residence, Site};
mod run;

use run::{finish, refuse_run, run_dst, run_held, run_seed, run_src, Ran, RankRun, RunReuse, RunSettings};

/// Which side of the refit a member is on, with its rank's store.
#[derive(Debug, Clone)]
pub enum Role {
    /// A source (training) rank: its weights are read.
    Src(Arc<SrcStore>),
    /// A destination (inference) rank: its weights are written, then
    /// committed.
    Dst(Arc<DstStore>),
}

impl Role {
    /// The group of this side.
    pub fn group(&self) -> Group {
        match self {
            Role::Src(_) => Group::Src,
            Role::Dst(_) => Group::Dst,
        }
    }

    /// The weights held (a source) or served (a destination).
    fn weights(&self) -> HeldVersion {
        match self {
            Role::Src(store) => store.weights(),
            Role::Dst(store) => store.weights(),
        }
    }
}

/// Adjusts a member's node-fabric settings for one refit (its sequence
/// number) just before the endpoint connects: for tools that emulate
/// links per member or inject faults in tests. Production members have
/// none.
pub type FaultHook = Arc<dyn Fn(u64, &mut NodeFaults) + Send + Sync>;

/// Where a member's data plane listens, and how it may be adjusted.
#[derive(Clone)]
pub struct MemberConfig {
    /// The address peers reach this member's node-fabric endpoint at
    /// (default loopback; [`crate::join`] uses the interface that reaches
    /// the rendezvous).
    pub data_ip: IpAddr,
    /// See [`FaultHook`].
    pub tweak: Option<FaultHook>,
    /// The job's secret: every node-fabric handshake proves knowledge of
    /// a key derived from it for the session (`None`: a random secret of
    /// this process, which every member of this process shares; members in
    /// other processes need the job's, as [`crate::Joined::member_config`]
    /// gives them).
    pub secret: Option<actors::Secret>,
    /// The CUDA device this member's rank uses on the NCCL and IPC fabrics
    /// ([`CommPlane::Cuda`](crate::CommPlane::Cuda)); `None`: the member
    /// refuses them.
    pub gpu: Option<usize>,
    /// A destination serving registered memory
    /// ([`DstStore::registered`]): how long past a run's deadline it holds
    /// its readers off while it waits for the commit (or a discard) of the
    /// version it staged, so a vanished orchestrator never locks readers
    /// out for good. Default 30 s.
    pub commit_hold: Duration,
    /// Test machinery: a byte to flip after a run, before its digest.
    #[cfg(feature = "testkit")]
    pub corrupt: Option<Arc<crate::testkit::Corrupt>>,
}

impl Default for MemberConfig {
    fn default() -> Self {
        MemberConfig {
            data_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            tweak: None,
            secret: None,
            gpu: None,
            commit_hold: COMMIT_HOLD,
            #[cfg(feature = "testkit")]
            corrupt: None,
        }
    }
}

/// Why a member has no data-plane key: this process's own secret could
/// not be made (kept for every later ask).
#[derive(Clone, Debug, thiserror::Error)]
#[error(transparent)]
struct NoDataKey(Arc<actors::remote::SecretError>);

/// The data-plane handshake key of `session` under `secret` (or this
/// process's own random secret).
fn hello_key(secret: Option<&actors::Secret>, session: &str) -> Result<transport::HelloKey, NoDataKey> {
    static PROCESS: std::sync::OnceLock<Result<actors::Secret, NoDataKey>> = std::sync::OnceLock::new();
    let secret = match secret {
        Some(s) => s,
        None => PROCESS.get_or_init(|| actors::Secret::random().map_err(|e| NoDataKey(Arc::new(e)))).as_ref().map_err(Clone::clone)?,
    };
    Ok(transport::HelloKey(secret.derive(format!("data-hello/{session}").as_bytes())))
}

impl std::fmt::Debug for MemberConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemberConfig")
            .field("data_ip", &self.data_ip)
            .field("tweak", &self.tweak.is_some())
            .field("secret", &self.secret.is_some())
            .field("gpu", &self.gpu)
            .field("commit_hold", &self.commit_hold)
            .finish_non_exhaustive()
    }
}

/// Where a member stands in the refit in progress: one refit at a time,
/// each step taken only from the one before it (a step that comes out of
/// turn is refused and leaves the member idle).
enum RefitState {
    /// No refit in progress.
    Idle,
    /// Refit `refit`'s endpoint is open (`Prepare`), its peers not yet
    /// connected.
    Prepared(Pending),
    /// Connected to its peers (`Connect`), or a kept endpoint taken up
    /// again (`Resume`): ready to run.
    Connected(Pending),
    /// A registered destination's run staged a whole version: the commit
    /// copies it in (or, written in place, publishes it); a discard, the
    /// next refit or the hold's timer lets its readers back in.
    Staged(Staged),
}

impl RefitState {
    /// The endpoint of `refit`, for `Connect` (the member must be
    /// `Prepared` for it) or `Run` (`Connected`, or `Prepared` on a fabric
    /// with no connect step: the end says whether it is ready); idle
    /// afterwards either way.
    fn take(&mut self, refit: u64, step: Step) -> Result<Pending, Refusal> {
        match (std::mem::replace(self, RefitState::Idle), step) {
            (RefitState::Prepared(p), _) | (RefitState::Connected(p), Step::Run) if p.refit == refit => Ok(p),
            _ => Err(Refusal::NotPrepared { refit }),
        }
    }

    /// The staged version, if it is `version`; idle afterwards either way.
    fn take_staged(&mut self, version: u64) -> Result<Staged, Refusal> {
        match std::mem::replace(self, RefitState::Idle) {
            RefitState::Staged(s) if s.version == version => Ok(s),
            RefitState::Staged(s) => Err(Refusal::NotStaged { staged: Some(s.version) }),
            _ => Err(Refusal::NotStaged { staged: None }),
        }
    }
}

/// A step that takes up the refit in progress.
#[derive(Clone, Copy)]
enum Step {
    Connect,
    Run,
}

/// The data-plane endpoint of the refit in progress.
struct Pending {
    refit: u64,
    program: Arc<RankProgram>,
    end: RankEnd,
    /// The session the endpoint belongs to.
    session: String,
    /// Keep the endpoint connected after a run that succeeds.
    keep: bool,
}

/// A node-fabric endpoint left connected and clean by a run that succeeded,
/// for the next refit of the same plan (`MemberMsg::Resume`).
struct KeptEndpoint {
    fingerprint: Fingerprint,
    session: String,
    end: RankEnd,
}

/// The refit member of one rank.
pub struct Member {
    endpoint: Endpoint,
    node: u32,
    /// The group's layout, shared by the members of one process.
    layout: Arc<Layout>,
    layout_fingerprint: u64,
    /// This rank's buffers in `layout` (every installed program's first
    /// buffers must be these), listed once: a plan's install at thousands
    /// of members then compares, not walks the layout again.
    own_buffers: Vec<BufferSpec>,
    role: Role,
    config: MemberConfig,
    /// The latest installed programs, newest last.
    installed: Vec<(Arc<RankProgram>, Fingerprint)>,
    /// The refit in progress.
    state: RefitState,
    /// At most one kept endpoint per installed plan.
    kept: Vec<KeptEndpoint>,
    /// What a plan's last clean run left for the next, by plan.
    leftovers: Vec<(Fingerprint, RunReuse)>,
    /// A registered destination's staging, kept between refits.
    registered_staging: Option<RegisteredStaging>,
}

/// A registered destination's run that staged a whole version: what its
/// commit copies in, and the fence that keeps readers off the registered
/// memory until the commit or a discard.
struct Staged {
    version: u64,
    program: Arc<RankProgram>,
    /// Taken by the commit; dropped with this value (a discard, a new
    /// run) or by a timer once [`MemberConfig::commit_hold`] past the run's
    /// deadline, so readers are not held off for good if the orchestrator
    /// went away.
    fence: Arc<std::sync::Mutex<Option<CommitFence>>>,
    /// The run wrote the registered memory in place: the commit copies
    /// nothing.
    in_place: bool,
}

/// The default [`MemberConfig::commit_hold`].
const COMMIT_HOLD: Duration = Duration::from_secs(30);

impl Member {
    /// A member for rank `rank` of a group laid out as `layout`, with the
    /// default [`MemberConfig`]. Members of one process share the layout.
    pub fn new(layout: Arc<Layout>, rank: Rank, role: Role) -> Member {
        Member::with_config(layout, rank, role, MemberConfig::default())
    }

    /// A member with explicit settings.
    pub fn with_config(layout: Arc<Layout>, rank: Rank, role: Role, config: MemberConfig) -> Member {
        Member {
            endpoint: Endpoint { group: role.group(), rank },
            node: layout.node_of(rank),
            layout_fingerprint: layout.fingerprint(),
            own_buffers: layout.rank_buffers(rank),
            layout,
            role,
            config,
            installed: Vec::new(),
            state: RefitState::Idle,
            kept: Vec::new(),
            leftovers: Vec::new(),
            registered_staging: None,
        }
    }
}

impl Member {
    fn program(&self, fingerprint: Fingerprint) -> Result<Arc<RankProgram>, Refusal> {
        match self.installed.iter().find(|(_, f)| *f == fingerprint) {
            Some((p, _)) => Ok(p.clone()),
            None => Err(Refusal::FingerprintMismatch { installed: self.installed.last().map(|(_, f)| *f), asked: fingerprint }),
        }
    }

    fn prepare(&mut self, refit: u64, fingerprint: Fingerprint, session: String, fabric: Fabric, keep: bool) -> MemberReply {
        // A new refit: whatever the last left (a version staged whose
        // commit never came) is dropped, its readers let back in.
        self.state = RefitState::Idle;
        // A fresh data plane for this plan replaces the kept one.
        self.kept.retain(|k| k.fingerprint != fingerprint);
        let program = match self.program(fingerprint) {
            Ok(p) => p,
            Err(r) => return MemberReply::Refused(r),
        };
        // Registered weights the fabric cannot reach are refused now (a
        // rank standing in for a replica's runs from what it serves).
        let registered = match &self.role {
            _ if program.endpoint != self.endpoint => None,
            Role::Src(store) => store.registered_residence(),
            Role::Dst(store) => store.registered_memory().map(|r| r.residence()),
        };
        let site = Site { data_ip: self.config.data_ip, gpu: self.config.gpu, registered };
        // The program's endpoint: the member's own, or that of a rank of a
        // replica plan it stands in for.
        let endpoint = program.endpoint;
        match RankEnd::open(fabric, &program, site, &session) {
            Ok((end, addr)) => {
                self.state = RefitState::Prepared(Pending { refit, program, end, session, keep });
                MemberReply::Prepared { endpoint, node: self.node, addr, host: transport::fabric::this_host() }
            }
            Err(e) => MemberReply::Refused(Refusal::Fabric(e.to_string())),
        }
    }

    fn resume(&mut self, refit: u64, fingerprint: Fingerprint, session: String) -> MemberReply {
        self.state = RefitState::Idle;
        let program = match self.program(fingerprint) {
            Ok(p) => p,
            Err(r) => return MemberReply::Refused(r),
        };
        match self.kept.iter().position(|k| k.fingerprint == fingerprint && k.session == session) {
            Some(i) => {
                let KeptEndpoint { end, session, .. } = self.kept.swap_remove(i);
                self.state = RefitState::Connected(Pending { refit, program, end, session, keep: true });
                MemberReply::Done
            }
            None => MemberReply::Refused(Refusal::NotKept { session }),
        }
    }

    async fn connect(&mut self, refit: u64, peers: Vec<PeerAddr>) -> MemberReply {
        let Pending { program, end, session, keep, .. } = match self.state.take(refit, Step::Connect) {
            Ok(p) => p,
            Err(r) => return MemberReply::Refused(r),
        };
        let p = program.clone();
        let key = match hello_key(self.config.secret.as_ref(), &session) {
            Ok(k) => k,
            Err(e) => return MemberReply::Refused(Refusal::Fabric(format!("no data-plane key: {e}"))),
        };
        let tweak = self.config.tweak.clone();
        let tweak = move |tweaks: &mut NodeFaults| {
            if let Some(t) = &tweak {
                t(refit, tweaks);
            }
        };
        match tokio::task::spawn_blocking(move || end.connect(&p, &peers, Connecting { key, tweak: &tweak })).await {
            Ok(Ok(end)) => {
                self.state = RefitState::Connected(Pending { refit, program, end, session, keep });
                MemberReply::Done
            }
            Ok(Err(e)) => MemberReply::Refused(Refusal::Fabric(e.to_string())),
            Err(e) => MemberReply::Refused(Refusal::Fabric(format!("connect task failed: {e}"))),
        }
    }

    /// Runs the connected endpoint's program for `req`: the run for the
    /// member's role and memory, then what a clean run leaves kept.
    async fn run(&mut self, req: RunRequest) -> MemberReply {
        let (run, session, keep) = match self.start_run(&req) {
            Ok(started) => started,
            Err(r) => return MemberReply::Refused(r),
        };
        let role = self.role.clone();
        let (result, kept) = match &role {
            Role::Src(store) => run_src(store, run).await,
            // Seeding a replica: this rank sends the version it serves.
            Role::Dst(store) if run.program.endpoint.group == Group::Src => run_seed(store, run).await,
            Role::Dst(store) if store.registered_memory().is_some() => self.run_registered_dst(store, run).await,
            Role::Dst(store) => run_dst(store, run).await,
        };
        if result.is_ok() {
            if let Some((end, left)) = kept {
                self.keep_after_run(req.fingerprint, session, end, left, keep);
            }
        }
        finish(result)
    }

    /// Takes the connected endpoint of refit `req.refit` and checks it can
    /// run `req`'s plan: the run, with this plan's scratch from its last
    /// clean run (taken, so a run that fails leaves none behind), and the
    /// endpoint's session and whether to keep it.
    fn start_run(&mut self, req: &RunRequest) -> Result<(RankRun, String, bool), Refusal> {
        let Pending { program, mut end, session, keep, .. } = self.state.take(req.refit, Step::Run)?;
        if program.fingerprint != req.fingerprint {
            // Peers must not wait for this rank.
            end.abort("fingerprint mismatch");
            return Err(Refusal::FingerprintMismatch { installed: Some(program.fingerprint), asked: req.fingerprint });
        }
        end.ready().map_err(|e| Refusal::Fabric(e.to_string()))?;
        let kill = end.kill_switch();
        let left = match self.leftovers.iter().position(|(f, _)| *f == req.fingerprint) {
            Some(i) => self.leftovers.swap_remove(i).1,
            None => RunReuse::default(),
        };
        let how = RunSettings {
            refit: req.refit,
            deadline: req.deadline,
            delta: req.delta,
            verify: req.verify,
            #[cfg(feature = "testkit")]
            corrupt: self.config.corrupt.as_ref().and_then(|c| c.take()),
        };
        Ok((RankRun { program, end, how, left, version: req.version, kill }, session, keep))
    }

    /// After a clean run: what it leaves for the plan's next run, and its
    /// endpoint, kept (`keep`) while connected — every message of the
    /// program was sent and received, and what it lent released, so the
    /// connections carry nothing of this refit.
    fn keep_after_run(&mut self, fingerprint: Fingerprint, session: String, end: RankEnd, left: RunReuse, keep: bool) {
        self.leftovers.push((fingerprint, left));
        if keep && end.is_connected() {
            self.kept.retain(|k| k.fingerprint != fingerprint);
            self.kept.push(KeptEndpoint { fingerprint, session, end });
        }
    }

    /// Runs a registered destination's program into its staging (with
    /// what the plan's last run left, on a host fabric); once the whole
    /// version is staged, takes the store's commit fence (waiting for
    /// readers, within the deadline) and keeps both for the commit. The
    /// registered memory is not written.
    /// A store written in place ([`DstStore::registered_direct`]) is run
    /// by [`run_in_place_dst`](Self::run_in_place_dst) instead, on a
    /// communicator fabric or over host memory.
    async fn run_registered_dst(&mut self, store: &Arc<DstStore>, mut run: RankRun) -> Ran {
        let started = Instant::now();
        let Some(registered) = store.registered_memory().cloned() else {
            return refuse_run(run.end, Refusal::ProgramMismatch("the store is not registered".into()));
        };
        // (A host transport reaches host memory only; a communicator end
        // reaches its plane's memory and refuses the rest, naming it.)
        if store.writes_in_place() && (registered.residence() == Residence::Host || !run.end.on_host_transport()) {
            return self.run_in_place_dst(store, registered, run, started).await;
        }
        if !run.program.carried.is_empty() && store.version().is_none() {
            return refuse_run(run.end, Refusal::NoBaseVersion);
        }
        let (program, how, version) = (run.program.clone(), run.how, run.version);
        let hold = RegisteredStagingHold { registered, staging: self.registered_staging.take() };
        let (result, kept) = run_held(hold, run).await;
        let end = kept.map(|(end, left, hold)| {
            self.registered_staging = hold.staging;
            (end, left)
        });
        if result.is_err() {
            return (result, end);
        }
        // The registered memory is still what was registered (looked up
        // again now, before any destination commits, so memory its owner
        // moved fails the refit here rather than one rank's commit).
        let registered = store.registered_memory().cloned();
        let checked = tokio::task::spawn_blocking(move || registered.map_or(Ok(()), |r| r.check())).await;
        if let Err(why) = checked.map_err(|e| e.to_string()).and_then(|r| r.map_err(|e| e.to_string())) {
            let why = format!("{}: registered weights: {why}", program.endpoint);
            return (Err(Refusal::Exec { why, after_peer: false }), end);
        }
        // Readers let go of the served weights within the deadline, or the
        // refit fails here, before anything was written.
        let within = how.deadline.saturating_sub(started.elapsed()).max(Duration::from_millis(100));
        let Some(fence) = store.fence_for_commit(within).await else {
            let why = format!("{}: readers held its registered weights (DstStore::serve) past the refit's deadline", program.endpoint);
            return (Err(Refusal::Exec { why, after_peer: false }), end);
        };
        self.hold_for_commit(version, program, fence, false, how.deadline);
        (result, end)
    }

    /// Keeps a staged version's hold on the store's readers for its
    /// commit, at most [`MemberConfig::commit_hold`] past the run's
    /// deadline.
    fn hold_for_commit(&mut self, version: u64, program: Arc<RankProgram>, fence: CommitFence, in_place: bool, deadline: Duration) {
        let fence = Arc::new(std::sync::Mutex::new(Some(fence)));
        let hold = deadline.saturating_add(self.config.commit_hold);
        if hold < Duration::from_secs(365 * 24 * 3600) {
            let expiring = Arc::downgrade(&fence);
            tokio::spawn(async move {
                tokio::time::sleep(hold).await;
                if let Some(fence) = expiring.upgrade() {
                    if fence.lock().unwrap_or_else(|e| e.into_inner()).take().is_some() {
                        tracing::warn!("a staged version's commit never came: readers are let back in, and it will not be committed");
                    }
                }
            });
        }
        self.state = RefitState::Staged(Staged { version, program, fence, in_place });
    }

    /// Runs a destination written in place
    /// ([`DstStore::registered_direct`]): waits for its readers to let go
    /// (within the deadline, before anything is written), marks it torn,
    /// runs the program straight into the registered memory, and keeps
    /// the readers off until the commit (which copies nothing) or a
    /// discard (after which it stays torn).
    async fn run_in_place_dst(&mut self, store: &Arc<DstStore>, registered: crate::Registered, run: RankRun, started: Instant) -> Ran {
        let (program, version) = (run.program.clone(), run.version);
        let Some(fence) = store.fence_for_commit(run.how.deadline).await else {
            let why = format!("{}: readers held its registered weights (DstStore::serve) past the refit's deadline", program.endpoint);
            return refuse_run(run.end, Refusal::Exec { why, after_peer: false });
        };
        // From the first byte written the memory holds no whole version.
        store.tear(&fence);
        let how = RunSettings { deadline: run.how.deadline.saturating_sub(started.elapsed()), ..run.how };
        let (result, kept) = run_held(registered, RankRun { how, ..run }).await;
        let end = kept.map(|(end, left, _)| (end, left));
        if result.is_ok() {
            self.hold_for_commit(version, program, fence, true, how.deadline);
        }
        (result, end)
    }

    /// Commits a registered destination's staged `version`: copies the
    /// staging into the registered memory under the commit fence, then
    /// serves it. A copy that fails leaves the memory torn (served again
    /// after the next refit commits).
    async fn commit_registered(&mut self, store: Arc<DstStore>, version: u64) -> MemberReply {
        let me = self.endpoint;
        let staged = match self.state.take_staged(version) {
            Ok(s) => s,
            Err(refusal) => return MemberReply::Refused(refusal),
        };
        let Some(fence) = staged.fence.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            let why = format!("{me}: version {version} was staged, but its commit came after the hold on its readers expired");
            return MemberReply::Refused(Refusal::Exec { why, after_peer: false });
        };
        if staged.in_place {
            // The run wrote the version where it is served.
            store.publish(version, &fence);
            return MemberReply::Done;
        }
        let Some(registered) = store.registered_memory().cloned() else {
            return MemberReply::Refused(Refusal::NotStaged { staged: None });
        };
        let mut staging = self.registered_staging.take();
        let program = staged.program.clone();
        let copied = tokio::task::spawn_blocking(move || {
            let r = staging.as_mut().map(|s| s.commit(&program, &registered));
            (r, staging)
        })
        .await;
        let failed = match copied {
            Ok((Some(Ok(())), staging)) => {
                self.registered_staging = staging;
                store.publish(version, &fence);
                return MemberReply::Done;
            }
            Ok((r, staging)) => {
                self.registered_staging = staging;
                match r {
                    Some(Err(e)) => e.to_string(),
                    _ => format!("{me}: no staging to commit"),
                }
            }
            Err(e) => format!("{me}: the commit's copy failed: {e}"),
        };
        store.tear(&fence);
        let why = format!("{failed}; the registered weights are torn until the next refit commits");
        MemberReply::Refused(Refusal::Exec { why, after_peer: false })
    }

    /// Why `program`'s buffers are not this rank's (its first buffers must
    /// be the rank's own, as its layout says: a program cannot make a
    /// member size or address its weights otherwise), if they are not. A
    /// program for a rank of a replica (`ProgramRole::Replica`) names its
    /// buffers as that replica's layout does: their types and sizes must
    /// be this rank's.
    fn foreign_buffers(&self, program: &RankProgram, seat: ProgramRole) -> Option<String> {
        let own = &self.own_buffers;
        let given = program.buffers.get(..own.len());
        let fits = match (seat, given) {
            (_, None) => false,
            (ProgramRole::Own, Some(given)) => given == own.as_slice(),
            (ProgramRole::Replica, Some(given)) => same_shapes(given, own),
        };
        (!fits).then(|| format!("its first buffers are not the {} buffers {} holds in its layout", own.len(), self.endpoint))
    }

    fn install(&mut self, program: Box<RankProgram>, fingerprint: Fingerprint, seat: ProgramRole) -> MemberReply {
        let seated = match seat {
            ProgramRole::Own => program.endpoint == self.endpoint,
            // A destination serves its replica's version, or joins one.
            ProgramRole::Replica => self.endpoint.group == Group::Dst,
        };
        if program.fingerprint != fingerprint {
            MemberReply::Refused(Refusal::FingerprintMismatch { installed: Some(program.fingerprint), asked: fingerprint })
        } else if !seated {
            MemberReply::Refused(Refusal::ProgramMismatch(format!("program for {} ({seat:?}) sent to {}", program.endpoint, self.endpoint)))
        } else if let Some(why) = self.foreign_buffers(&program, seat) {
            MemberReply::Refused(Refusal::ProgramMismatch(why))
        } else {
            self.installed.retain(|(_, f)| *f != fingerprint);
            if self.installed.len() == INSTALLED_PLANS {
                let (_, evicted) = self.installed.remove(0);
                self.kept.retain(|k| k.fingerprint != evicted);
                self.leftovers.retain(|(f, _)| *f != evicted);
            }
            self.installed.push((Arc::from(program), fingerprint));
            MemberReply::Done
        }
    }

    /// Takes rank `rank` of `layout` as this member's (see
    /// [`MemberMsg::Relayout`]).
    fn relayout(&mut self, layout: Arc<Layout>, rank: Rank) -> MemberReply {
        if rank >= layout.ranks() {
            return MemberReply::Refused(Refusal::ProgramMismatch(format!(
                "relayout to rank {rank} of a layout of {} ranks",
                layout.ranks()
            )));
        }
        let buffers = layout.rank_buffers(rank);
        if !same_shapes(&buffers, &self.own_buffers) {
            return MemberReply::Refused(Refusal::ProgramMismatch(format!(
                "rank {rank} of the new layout holds other buffers than {} ({} buffers, {} here)",
                self.endpoint,
                buffers.len(),
                self.own_buffers.len()
            )));
        }
        self.endpoint.rank = rank;
        self.node = layout.node_of(rank);
        self.layout_fingerprint = layout.fingerprint();
        self.layout = layout;
        self.own_buffers = buffers;
        self.installed.clear();
        self.state = RefitState::Idle;
        self.kept.clear();
        self.leftovers.clear();
        MemberReply::Done
    }
}

/// Whether two lists of buffers have the same types and sizes, in order.
fn same_shapes(a: &[BufferSpec], b: &[BufferSpec]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.dtype == y.dtype && x.elems == y.elems)
}

#[async_trait]
impl Actor for Member {
    type Msg = MemberMsg;
    type Reply = MemberReply;

    async fn handle(&mut self, msg: MemberMsg, _ctx: &mut Context<Self>) -> Result<MemberReply, ActorError> {
        Ok(match msg {
            MemberMsg::Describe => {
                MemberReply::Layout(LayoutInfo { rank: self.endpoint.rank, layout: self.layout.clone(), pid: std::process::id() })
            }
            MemberMsg::Status => MemberReply::Status {
                layout: self.layout_fingerprint,
                installed: self.installed.iter().map(|(_, f)| *f).collect(),
                weights: self.role.weights(),
            },
            MemberMsg::Install { program, fingerprint, seat } => self.install(program, fingerprint, seat),
            MemberMsg::Relayout { layout, rank } => self.relayout(layout, rank),
            MemberMsg::Prepare { refit, fingerprint, session, fabric, keep } => self.prepare(refit, fingerprint, session, fabric, keep),
            MemberMsg::Resume { refit, fingerprint, session } => self.resume(refit, fingerprint, session),
            MemberMsg::Connect { refit, peers } => self.connect(refit, peers).await,
            MemberMsg::Run(req) => self.run(req).await,
            MemberMsg::Commit { version } => match &self.role {
                Role::Dst(store) if store.registered_memory().is_some() => self.commit_registered(store.clone(), version).await,
                Role::Dst(store) => match store.commit(version).await {
                    Ok(()) => MemberReply::Done,
                    Err(staged) => MemberReply::Refused(Refusal::NotStaged { staged }),
                },
                Role::Src(_) => MemberReply::Done,
            },
            MemberMsg::Discard => {
                // Lets the readers of registered weights back in.
                self.state = RefitState::Idle;
                self.kept.clear();
                if let Role::Dst(store) = &self.role {
                    store.discard().await;
                }
                MemberReply::Done
            }
            MemberMsg::Version => MemberReply::Version(self.role.weights()),
        })
    }
}
