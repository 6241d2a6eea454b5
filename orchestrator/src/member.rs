//! The refit member actor: one per rank of each group, owning that rank's
//! part of the refit protocol. It shares its rank's store with the user's
//! training or rollout actor and talks to the orchestrator only by message.

use crate::store::{SinkStore, SourceStore};
use actors::{async_trait, Actor, ActorError, Context};
use reshard::{layout_to_json, Fingerprint, Layout, RankProgram};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use transport::{run_rank, ExecOptions, LocalTransport, RankMemory, RankStats};

/// Which side of the refit a member is on.
#[derive(Debug, Clone)]
pub enum Role {
    /// A training rank: its weights are read.
    Source(Arc<SourceStore>),
    /// An inference rank: its weights are written, then committed.
    Sink(Arc<SinkStore>),
}

/// What a member says about itself when asked ([`MemberMsg::Describe`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutInfo {
    /// The member's rank in its group.
    pub rank: u32,
    /// The whole group's layout, in the layout file format.
    pub layout_json: String,
}

/// Messages a member handles.
#[derive(Debug)]
pub enum MemberMsg {
    /// Report the group layout this member holds weights for.
    Describe,
    /// Report only a fingerprint of that layout (cheap; asked every refit).
    LayoutFingerprint,
    /// Keep this program for the plan with this fingerprint.
    Install {
        /// This rank's program.
        program: Arc<RankProgram>,
        /// The plan's fingerprint.
        fingerprint: Fingerprint,
    },
    /// Run the installed program for `version` over `transport`.
    Run {
        /// The weight version being moved.
        version: u64,
        /// The plan the orchestrator believes is installed.
        fingerprint: Fingerprint,
        /// This rank's end of the data plane for this refit.
        transport: LocalTransport,
        /// Time the data movement may take.
        deadline: Duration,
    },
    /// Make staged `version` visible (sinks).
    Commit {
        /// The version.
        version: u64,
    },
    /// Drop whatever was staged (sinks); a failed refit.
    Discard,
    /// Report the version this member serves (sinks) or holds (sources).
    Version,
}

/// Why a member refused a request (a normal reply, not a failure of the actor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The fingerprint does not match the installed program's.
    FingerprintMismatch {
        /// What the member has installed (if anything).
        installed: Option<Fingerprint>,
        /// What it was asked to run.
        asked: Fingerprint,
    },
    /// The program's buffers do not match this rank's weights.
    ProgramMismatch(String),
    /// The source holds another version than the one asked for.
    VersionMismatch {
        /// Held.
        held: u64,
        /// Asked.
        asked: u64,
    },
    /// The data plane failed.
    Exec(String),
    /// Commit without the whole version staged.
    NotStaged {
        /// What is staged completely, if anything.
        staged: Option<u64>,
    },
}

/// Replies of a member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberReply {
    /// Answer to `Describe`.
    Layout(LayoutInfo),
    /// Answer to `LayoutFingerprint`.
    LayoutFingerprint(u64),
    /// The request was done.
    Done,
    /// Answer to `Run`.
    Ran(RankStats),
    /// Answer to `Version`.
    Version(u64),
    /// The request was refused.
    Refused(Refusal),
}

/// The refit member of one rank.
pub struct Member {
    rank: u32,
    layout_json: String,
    role: Role,
    installed: Option<(Arc<RankProgram>, Fingerprint)>,
}

impl Member {
    /// A member for rank `rank` of a group laid out as `layout`.
    pub fn new(layout: &Layout, rank: u32, role: Role) -> Member {
        Member { rank, layout_json: layout_to_json(layout).to_string(), role, installed: None }
    }
}

/// Appends scratch buffers a program needs beyond the rank's weights.
fn with_scratch(memory: &mut RankMemory, program: &RankProgram) -> Result<usize, String> {
    let base = memory.buffers.len();
    if program.buffers.len() < base {
        return Err(format!("program has {} buffers, the rank holds {base}", program.buffers.len()));
    }
    for (i, spec) in program.buffers.iter().enumerate() {
        let bytes = (spec.elems * spec.dtype.size()) as usize;
        if i < base {
            if memory.buffers[i].len() != bytes || memory.dtypes[i] != spec.dtype {
                return Err(format!(
                    "buffer '{}' is {} bytes of {} here, the program expects {bytes} bytes of {}",
                    spec.name,
                    memory.buffers[i].len(),
                    memory.dtypes[i],
                    spec.dtype
                ));
            }
        } else {
            memory.buffers.push(vec![0; bytes]);
            memory.dtypes.push(spec.dtype);
        }
    }
    Ok(base)
}

fn drop_scratch(memory: &mut RankMemory, base: usize) {
    memory.buffers.truncate(base);
    memory.dtypes.truncate(base);
}

impl Member {
    async fn run(&mut self, version: u64, fingerprint: Fingerprint, mut transport: LocalTransport, deadline: Duration) -> MemberReply {
        use transport::Transport as _;
        let program = match &self.installed {
            Some((p, f)) if *f == fingerprint => p.clone(),
            other => {
                // Peers must not wait for this rank.
                transport.abort("fingerprint mismatch");
                return MemberReply::Refused(Refusal::FingerprintMismatch {
                    installed: other.as_ref().map(|(_, f)| *f),
                    asked: fingerprint,
                });
            }
        };
        let options = ExecOptions { deadline };
        match &self.role {
            Role::Source(store) => {
                // The fence: hold the write lock while peers read our weights.
                let mut guard = store.lock().write_owned().await;
                let held = store.version();
                if held != version {
                    transport.abort("version mismatch");
                    return MemberReply::Refused(Refusal::VersionMismatch { held, asked: version });
                }
                let result = tokio::task::spawn_blocking(move || execute(&program, guard.memory_mut(), &mut transport, &options)).await;
                finish(result)
            }
            Role::Sink(store) => {
                let staging = store.staging();
                let mut guard = staging.lock_owned().await;
                guard.complete = None;
                let result = tokio::task::spawn_blocking(move || {
                    let r = execute(&program, guard.buffers.memory_mut(), &mut transport, &options);
                    if r.is_ok() {
                        guard.complete = Some(version);
                    }
                    r
                })
                .await;
                finish(result)
            }
        }
    }
}

/// Runs `program` on `memory` (plus any scratch it needs) over `transport`.
fn execute(
    program: &RankProgram,
    memory: &mut RankMemory,
    transport: &mut LocalTransport,
    options: &ExecOptions,
) -> Result<RankStats, Refusal> {
    use transport::Transport as _;
    let base = with_scratch(memory, program).map_err(|e| {
        transport.abort(&e);
        Refusal::ProgramMismatch(e)
    })?;
    let r = run_rank(program, memory, transport, options).map_err(|e| Refusal::Exec(e.to_string()));
    drop_scratch(memory, base);
    r
}

fn finish(result: Result<Result<RankStats, Refusal>, tokio::task::JoinError>) -> MemberReply {
    match result {
        Ok(Ok(stats)) => MemberReply::Ran(stats),
        Ok(Err(refusal)) => MemberReply::Refused(refusal),
        Err(e) => MemberReply::Refused(Refusal::Exec(format!("data plane task failed: {e}"))),
    }
}

#[async_trait]
impl Actor for Member {
    type Msg = MemberMsg;
    type Reply = MemberReply;

    async fn handle(&mut self, msg: MemberMsg, _ctx: &mut Context<Self>) -> Result<MemberReply, ActorError> {
        Ok(match msg {
            MemberMsg::Describe => MemberReply::Layout(LayoutInfo { rank: self.rank, layout_json: self.layout_json.clone() }),
            MemberMsg::LayoutFingerprint => MemberReply::LayoutFingerprint(reshard::fingerprint::fnv64(&self.layout_json)),
            MemberMsg::Install { program, fingerprint } => {
                if program.fingerprint != fingerprint {
                    MemberReply::Refused(Refusal::FingerprintMismatch { installed: Some(program.fingerprint), asked: fingerprint })
                } else if program.endpoint.rank != self.rank {
                    MemberReply::Refused(Refusal::ProgramMismatch(format!("program for {} sent to rank {}", program.endpoint, self.rank)))
                } else {
                    self.installed = Some((program, fingerprint));
                    MemberReply::Done
                }
            }
            MemberMsg::Run { version, fingerprint, transport, deadline } => self.run(version, fingerprint, transport, deadline).await,
            MemberMsg::Commit { version } => match &self.role {
                Role::Sink(store) => match store.commit(version).await {
                    Ok(()) => MemberReply::Done,
                    Err(staged) => MemberReply::Refused(Refusal::NotStaged { staged }),
                },
                Role::Source(_) => MemberReply::Done,
            },
            MemberMsg::Discard => {
                if let Role::Sink(store) = &self.role {
                    store.discard().await;
                }
                MemberReply::Done
            }
            MemberMsg::Version => MemberReply::Version(match &self.role {
                Role::Source(s) => s.version(),
                Role::Sink(s) => s.version(),
            }),
        })
    }
}
