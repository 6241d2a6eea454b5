//! The communicator thread itself: it creates the communicator through
//! its backend, polls creation and every group until done or past their
//! deadline, serves the handle's commands, and aborts (polling a teardown
//! in progress to its end); a panic of the backend is an error.

use super::backend::{CommBackend, Fence, GroupError, P2p, Progress};
use super::error::BackendError;
use super::CommConfig;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) enum Command {
    Group { ops: Vec<P2p>, after: Option<Fence>, round: u32, deadline: Instant, reply: Sender<Result<(), Option<GroupError>>> },
    Check { reply: Sender<Result<(), BackendError>> },
    Abort,
}

/// What the thread reports, in order: creation, then (after a failed
/// creation or an abort command) the abort's result.
pub(super) enum Report {
    Init(Result<(), InitFail>),
    Aborted(Result<(), BackendError>),
}

pub(super) enum InitFail {
    Timeout,
    Failed(BackendError),
}

fn poll_until<E: From<BackendError>>(
    stop: &AtomicBool,
    deadline: Instant,
    max_sleep: Duration,
    mut poll: impl FnMut() -> Result<Progress, E>,
) -> Result<(), Option<E>> {
    let mut sleep = Duration::from_micros(20).min(max_sleep);
    loop {
        match poll() {
            Ok(Progress::Ready) => return Ok(()),
            Ok(Progress::Pending) => {}
            Err(e) => return Err(Some(e)),
        }
        if stop.load(Ordering::SeqCst) {
            return Err(Some(E::from(BackendError::Stopped)));
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(None);
        }
        std::thread::sleep(sleep.min(deadline - now));
        sleep = (sleep * 2).min(max_sleep);
    }
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_else(|| "panic".into())
}

/// Calls a backend method, turning a panic into an error.
fn guarded<T, E: From<BackendError>>(f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(E::from(BackendError::Panicked(panic_text(p)))))
}

pub(super) fn comm_thread<B: CommBackend>(
    make: impl FnOnce() -> Result<B, BackendError>,
    config: CommConfig,
    init_deadline: Instant,
    stop: Arc<AtomicBool>,
    commands: Receiver<Command>,
    reports: Sender<Report>,
) {
    let mut backend = match guarded(make) {
        Ok(b) => b,
        Err(e) => {
            let _ = reports.send(Report::Init(Err(InitFail::Failed(e))));
            // Nothing was created, so there is nothing to abort.
            let _ = reports.send(Report::Aborted(Ok(())));
            return;
        }
    };
    let init = poll_until(&stop, init_deadline, config.poll_interval, || guarded(|| backend.poll_init()));
    if let Err(e) = init {
        let _ = reports.send(Report::Init(Err(e.map_or(InitFail::Timeout, InitFail::Failed))));
        let r = abort_backend(&mut backend, &config);
        let _ = reports.send(Report::Aborted(r));
        return;
    }
    let _ = reports.send(Report::Init(Ok(())));
    // Serve commands until abort or until the handle is gone.
    while let Ok(cmd) = commands.recv() {
        match cmd {
            Command::Group { ops, after, round, deadline, reply } => {
                // Err(None): the deadline passed. `after` (the fence's
                // keeper) lives until the group is over, however long.
                let event = after.as_ref().map_or(0, |f| f.event.0);
                let r = guarded(|| backend.start_group(&ops, event, round))
                    .map_err(Some)
                    .and_then(|()| poll_until(&stop, deadline, config.poll_interval, || guarded(|| backend.poll_group())));
                let _ = reply.send(r);
            }
            Command::Check { reply } => {
                let _ = reply.send(guarded(|| backend.check()));
            }
            Command::Abort => break,
        }
    }
    let r = abort_backend(&mut backend, &config);
    let _ = reports.send(Report::Aborted(r));
}

/// Aborts and, where the teardown goes on in the background, polls it to
/// its end: an abort answered "in progress" is not done. No deadline here:
/// the caller stops waiting after its abort timeout and abandons the thread,
/// which keeps polling (slowly) and is counted until the teardown ends.
fn abort_backend<B: CommBackend>(backend: &mut B, config: &CommConfig) -> Result<(), BackendError> {
    if guarded(|| backend.abort())? == Progress::Ready {
        return Ok(());
    }
    let mut sleep = Duration::from_micros(20).min(config.poll_interval);
    loop {
        if guarded(|| backend.poll_abort())? == Progress::Ready {
            return Ok(());
        }
        std::thread::sleep(sleep);
        sleep = (sleep * 2).min(config.poll_interval.max(Duration::from_millis(10)));
    }
}
