//! The thread drivers: every rank of a plan run as a thread of this
//! process over one fabric (in-process, loopback TCP, or any transport
//! given), ordinary or delta runs, with the first root cause reported.

use super::{run_rank_inner, DeltaRun, ExecError, ExecOptions, ExecReport, RankStats};
use crate::bypass::Bypass;
use crate::delta::DeltaMemo;
use crate::local::local_fabric;
use crate::memory::{MemView, RankMemory};
use crate::tcp::{tcp_fabric_for, TcpConfig};
use crate::transport::{Transport, TransportError, WithAbort};
use crate::StagingPool;
use reshard::{Endpoint, RankProgram};
use std::time::Instant;

/// Runs all programs, one thread per rank with work, over the in-process
/// transport. `memory[i]` belongs to `programs[i]`. Returns the first root
/// cause if any rank fails (other ranks then stop on the abort).
pub fn run_local(programs: &[RankProgram], memory: &mut [RankMemory], options: &ExecOptions) -> Result<ExecReport, ExecError> {
    let endpoints: Vec<Endpoint> = programs.iter().map(|p| p.endpoint).collect();
    run_threads(programs, memory, options, local_fabric(&endpoints))
}

/// Runs all programs as threads of this process over loopback TCP streams
/// (one per ordered pair of ranks): the TCP data plane end to end, without
/// separate processes.
pub fn run_tcp(
    programs: &[RankProgram],
    memory: &mut [RankMemory],
    options: &ExecOptions,
    config: &TcpConfig,
) -> Result<ExecReport, ExecError> {
    let transports = tcp_fabric_for(programs, config).map_err(|e| ExecError::Setup(e.to_string()))?;
    run_threads(programs, memory, options, transports)
}

/// Runs `programs[i]` on `memory[i]` over `transports[i]`, a thread per rank
/// with work; returns the first root cause if any rank fails.
pub fn run_threads<T: Transport + WithAbort>(
    programs: &[RankProgram],
    memory: &mut [RankMemory],
    options: &ExecOptions,
    transports: Vec<T>,
) -> Result<ExecReport, ExecError> {
    run_threads_inner(programs, memory, options, transports, None).map(|(report, _)| report)
}

/// [`run_threads`] as a delta refit: `bases[i]` is
/// rank `i`'s memo of the base refit (`None`: dense). Returns the report
/// (`bytes`: what went on the wire) and every rank's memo of this run.
pub fn run_threads_delta<T: Transport + WithAbort>(
    programs: &[RankProgram],
    memory: &mut [RankMemory],
    options: &ExecOptions,
    transports: Vec<T>,
    bases: Vec<Option<DeltaMemo>>,
) -> Result<(ExecReport, Vec<DeltaMemo>), ExecError> {
    if bases.len() != programs.len() {
        return Err(ExecError::Setup(format!("{} delta bases for {} programs", bases.len(), programs.len())));
    }
    run_threads_inner(programs, memory, options, transports, Some(bases))
}

/// [`run_threads_delta`] over the in-process transport.
pub fn run_local_delta(
    programs: &[RankProgram],
    memory: &mut [RankMemory],
    options: &ExecOptions,
    bases: Vec<Option<DeltaMemo>>,
) -> Result<(ExecReport, Vec<DeltaMemo>), ExecError> {
    let endpoints: Vec<Endpoint> = programs.iter().map(|p| p.endpoint).collect();
    run_threads_delta(programs, memory, options, local_fabric(&endpoints), bases)
}

/// One thread per rank with work, ordinary or (with `bases`) delta runs.
fn run_threads_inner<T: Transport + WithAbort>(
    programs: &[RankProgram],
    memory: &mut [RankMemory],
    options: &ExecOptions,
    transports: Vec<T>,
    bases: Option<Vec<Option<DeltaMemo>>>,
) -> Result<(ExecReport, Vec<DeltaMemo>), ExecError> {
    let views: Vec<MemView> = memory.iter_mut().map(|m| m.view()).collect();
    let delta = bases.is_some();
    let mut bases: Vec<Option<Option<DeltaMemo>>> = match bases {
        Some(b) => b.into_iter().map(Some).collect(),
        None => vec![None; programs.len()],
    };
    let start = Instant::now();
    let deadline = start + options.deadline;
    // One thread per rank with work. (Running send-only ranks on this
    // thread instead would deadlock: a sender waits in `flush` for a
    // receiver that waits for a sender not yet started.)
    type Ran = (Result<RankStats, ExecError>, DeltaMemo);
    let mut results: Vec<Option<Ran>> = (0..programs.len()).map(|_| None).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = programs
            .iter()
            .zip(transports)
            .zip(&views)
            .zip(bases.iter_mut().map(Option::take))
            .enumerate()
            .filter(|(_, (((p, _), _), _))| p.rounds.iter().any(|r| !(r.sends.is_empty() && r.recvs.is_empty() && r.locals.is_empty())))
            .map(|(i, (((p, mut t), v), base))| {
                let abort = t.abort_all();
                let spawned = std::thread::Builder::new().spawn_scoped(scope, move || {
                    let mut run = base.map(DeltaRun::new);
                    let r = run_rank_inner(p, &Bypass::of(p), v, &mut t, deadline, run.as_mut(), &StagingPool::default());
                    match run {
                        Some(d) => (r.map(|s| RankStats { sent_bytes: d.wire_bytes, ..s }), d.next),
                        None => (r, DeltaMemo::default()),
                    }
                });
                if let Err(e) = &spawned {
                    abort(&format!("could not start a thread: {e}"));
                }
                (i, p.endpoint, spawned)
            })
            .collect();
        for (i, me, h) in handles {
            results[i] = Some(match h {
                Ok(h) => h.join().unwrap_or((Err(ExecError::Panicked { me }), DeltaMemo::default())),
                Err(e) => (Err(ExecError::Spawn { me, error: e.to_string() }), DeltaMemo::default()),
            });
        }
    });
    let elapsed = start.elapsed();
    let mut first_err = None;
    let mut report = ExecReport { elapsed, ..ExecReport::default() };
    let mut memos = Vec::with_capacity(if delta { programs.len() } else { 0 });
    for (r, memo) in results.into_iter().map(|r| r.unwrap_or((Ok(RankStats::default()), DeltaMemo::default()))) {
        match r {
            Ok(s) => {
                report.bytes += s.sent_bytes;
                report.messages += s.messages;
            }
            Err(e) => {
                // A peer that aborted, or whose end is gone, is the
                // consequence of another rank's failure: that one is the
                // root cause.
                let secondary = |e: &ExecError| {
                    matches!(e, ExecError::Transport(TransportError::PeerAborted { .. } | TransportError::Disconnected { .. }))
                };
                match &first_err {
                    None => first_err = Some(e),
                    Some(f) if secondary(f) && !secondary(&e) => first_err = Some(e),
                    _ => {}
                }
            }
        }
        if delta {
            memos.push(memo);
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok((report, memos)),
    }
}
