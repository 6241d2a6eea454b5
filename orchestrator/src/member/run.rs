//! How one run of a member's program goes: its settings, the memory its
//! store lends it for the version (per role: a source's weights under its
//! fence, a destination's served version for a replica it seeds, a
//! destination's staging), the executor on the endpoint with what the
//! plan's last run left, the digest, and the watchdog past the deadline.

use crate::protocol::{DigestError, MemberReply, Refusal, RunDelta, RunStats};
use crate::store::{DstStore, RunHold, SrcStore};
use reshard::RankProgram;
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport::fabric::{KillSwitch, RankEnd, RankRunError, RunMemory, RunOptions, Scratch};
use transport::{DeltaMemo, DeltaRun};

/// A rank's run of its program, as [`Member::run`] hands it on.
pub(super) struct RankRun {
    pub(super) program: Arc<RankProgram>,
    pub(super) end: RankEnd,
    pub(super) how: RunSettings,
    pub(super) left: RunReuse,
    pub(super) version: u64,
    pub(super) kill: Option<KillSwitch>,
}

/// What a clean run of a plan leaves for the next run of it.
#[derive(Default)]
pub(super) struct RunReuse {
    /// Its scratch buffers.
    pub(super) scratch: Scratch,
    /// A delta run's memo, with the refit it comes from.
    pub(super) memo: Option<(u64, DeltaMemo)>,
}

/// How one run goes.
#[derive(Clone, Copy)]
pub(super) struct RunSettings {
    /// The refit.
    pub(super) refit: u64,
    /// Time the data movement may take.
    pub(super) deadline: Duration,
    /// Whether it is a delta run, and on the memo of which refit.
    pub(super) delta: RunDelta,
    /// Read back what the run moved: its digest.
    pub(super) verify: bool,
    /// Test machinery: a byte flipped after the run, before the digest.
    #[cfg(feature = "testkit")]
    pub(super) corrupt: Option<(u32, u64)>,
}

/// Runs `program` on `memory` over the endpoint, with what the plan's
/// last run left; hands back what this one leaves. With `how.verify`, a
/// run that succeeded reads back what it moved from the same memory
/// ([`transport::fabric::digest`]): on a communicator fabric (device
/// memory) it says so instead.
fn execute_on(
    program: &RankProgram,
    mut memory: RunMemory<'_>,
    end: &mut RankEnd,
    how: RunSettings,
    left: RunReuse,
) -> (Result<RunStats, Refusal>, RunReuse) {
    let RunReuse { mut scratch, memo } = left;
    let mut delta = delta_run(&how, memo);
    let on_host = end.on_host_transport();
    let r = end.run(program, memory.reborrow(), RunOptions { deadline: how.deadline, delta: delta.as_mut(), scratch: &mut scratch });
    let memo = kept_memo(&r, &how, delta);
    let r = r.map(|s| RunStats { sent_bytes: s.sent_bytes, recv_bytes: s.recv_bytes, messages: s.messages, ..RunStats::default() });
    let mut r = r.map_err(|e| match e {
        RankRunError::Fabric(why) => Refusal::Fabric(why.to_string()),
        RankRunError::ProgramMismatch(why) => Refusal::ProgramMismatch(why.to_string()),
        RankRunError::Exec { after_peer, .. } => Refusal::Exec { why: e.to_string(), after_peer },
    });
    #[cfg(feature = "testkit")]
    if let (Ok(_), Some((buffer, byte))) = (&r, how.corrupt) {
        if let Err(why) = transport::fabric::flip_byte(program, memory.reborrow(), &mut scratch, buffer, byte) {
            tracing::warn!(%why, "the armed corruption was not made");
        }
    }
    if let (Ok(stats), true) = (&mut r, how.verify) {
        let t = Instant::now();
        stats.digest = Some(if on_host {
            transport::fabric::digest(program, memory, &mut scratch)
        } else {
            Err(DigestError::Unread(format!("{}: the communicator fabrics move device memory, which is not read back", program.endpoint)))
        });
        stats.digest_time = t.elapsed();
    }
    (r, RunReuse { scratch, memo })
}

/// The delta run `how` asks for, on the memo a run left if it is the base
/// refit's (otherwise this rank's messages go dense, and a peer that sends
/// it a delta fails the refit: the orchestrator then starts over, dense).
fn delta_run(how: &RunSettings, memo: Option<(u64, DeltaMemo)>) -> Option<DeltaRun> {
    let base = match how.delta {
        RunDelta::Off => return None,
        RunDelta::First => None,
        RunDelta::Since { base } => Some(base),
    };
    Some(DeltaRun::new(memo.filter(|(r, _)| Some(*r) == base).map(|(_, m)| m)))
}

/// The memo a successful delta run leaves for the next, with its refit.
fn kept_memo<T, E>(r: &Result<T, E>, how: &RunSettings, delta: Option<DeltaRun>) -> Option<(u64, DeltaMemo)> {
    delta.filter(|_| r.is_ok()).map(|d| (how.refit, d.next))
}

/// How long past its deadline a rank's data plane may stay blocked — in a
/// send to a peer that stopped reading, behind a link that went down —
/// before its connections are torn down (the executor's own deadline
/// catches only receives).
const BLOCKED_GRACE: Duration = Duration::from_secs(1);

/// Awaits a rank's data plane; if it runs `BLOCKED_GRACE` past `deadline`,
/// pulls `kill` (its sends and receives then fail at once, and its peers
/// see the links break) and awaits the failure.
async fn watched<T>(
    mut run: tokio::task::JoinHandle<T>,
    deadline: Duration,
    kill: Option<KillSwitch>,
) -> Result<T, tokio::task::JoinError> {
    // No watchdog without a switch, or for deadlines beyond a timer's reach.
    let (Some(kill), true) = (kill, deadline < Duration::from_secs(365 * 24 * 3600)) else {
        return run.await;
    };
    match tokio::time::timeout(deadline + BLOCKED_GRACE, &mut run).await {
        Ok(r) => r,
        Err(_) => {
            kill("the data plane's deadline passed");
            run.await
        }
    }
}

/// A data-plane task's result and, unless the task failed, its endpoint.
fn split<T>(joined: Result<(Result<RunStats, Refusal>, T), tokio::task::JoinError>) -> (Result<RunStats, Refusal>, Option<T>) {
    match joined {
        Ok((r, end)) => (r, Some(end)),
        Err(e) => (Err(Refusal::Exec { why: format!("data plane task failed: {e}"), after_peer: false }), None),
    }
}

pub(super) fn finish(result: Result<RunStats, Refusal>) -> MemberReply {
    match result {
        Ok(stats) => MemberReply::Ran(stats),
        Err(refusal) => MemberReply::Refused(refusal),
    }
}

/// What a run ends with: its outcome and, unless its task failed, the
/// endpoint and what it leaves for the plan's next run.
pub(super) type Ran = (Result<RunStats, Refusal>, Option<(RankEnd, RunReuse)>);

/// A run refused before it started: its peers are told (the end aborts).
pub(super) fn refuse_run(mut end: RankEnd, refusal: Refusal) -> Ran {
    end.abort(&refusal.to_string());
    (Err(refusal), None)
}

/// Runs the rank's program on memory its store lends for the run
/// ([`RunHold`]), watched past the deadline; hands the hold back with the
/// endpoint (its staging, say) unless the run's task failed.
pub(super) async fn run_held<H: RunHold>(mut hold: H, run: RankRun) -> (Result<RunStats, Refusal>, Option<(RankEnd, RunReuse, H)>) {
    let RankRun { program, mut end, how, left, kill, .. } = run;
    let task = tokio::task::spawn_blocking(move || {
        hold.prepare();
        let (r, left) = execute_on(&program, hold.memory(), &mut end, how, left);
        hold.ran(r.is_ok());
        (r, (end, left, hold))
    });
    split(watched(task, how.deadline, kill).await)
}

/// [`run_held`] on the hold `lent` (or refused, its peers told), let go
/// after the run.
async fn run_lent<H: RunHold>(lent: Result<H, Refusal>, run: RankRun) -> Ran {
    match lent {
        Ok(hold) => {
            let (r, kept) = run_held(hold, run).await;
            (r, kept.map(|(end, left, _)| (end, left)))
        }
        Err(refusal) => refuse_run(run.end, refusal),
    }
}

/// Runs a source rank on the version its store holds, under the store's
/// write fence while peers read its weights.
pub(super) async fn run_src(store: &Arc<SrcStore>, run: RankRun) -> Ran {
    let lent = store.hold_for_run(run.version).await;
    run_lent(lent, run).await
}

/// Runs a destination rank that seeds a replica: it sends the version it
/// serves.
pub(super) async fn run_seed(store: &Arc<DstStore>, run: RankRun) -> Ran {
    let lent = store.hold_served(run.version);
    run_lent(lent, run).await
}

/// Runs a destination rank whose store holds its weights: into the
/// store's staging, complete once the run succeeds.
pub(super) async fn run_dst(store: &Arc<DstStore>, run: RankRun) -> Ran {
    let lent = store.hold_staging(run.version, &run.program.carried).await;
    run_lent(lent, run).await
}
