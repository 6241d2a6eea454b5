//! The caller's end of a communicator thread ([`CommHandle`]): starting
//! it ([`PendingComm`]), running groups, checking and
//! aborting, none of it waiting past its deadline.

use super::abort::{AbortOutcome, DoneOnDrop, Mark, ThreadWatch};
use super::backend::{CommBackend, Fence, P2p};
use super::error::{BackendError, CommError};
use super::thread::{comm_thread, Command, InitFail, Report};
use super::CommConfig;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    Ready,
    Failed(String),
    Closed,
}

/// The caller's end of a communicator thread. Never blocks past a
/// deadline; dropping it asks the thread to abort without waiting.
pub struct CommHandle {
    config: CommConfig,
    tag: String,
    commands: Sender<Command>,
    reports: Receiver<Report>,
    stop: Arc<AtomicBool>,
    mark: Arc<Mark>,
    thread: Option<JoinHandle<()>>,
    state: State,
}

impl std::fmt::Debug for CommHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommHandle").field("rank", &self.config.rank).field("comm", &self.tag).field("state", &self.state).finish()
    }
}

/// Slack on top of a deadline for the thread's own answer to arrive.
fn grace(config: &CommConfig) -> Duration {
    config.poll_interval * 4 + Duration::from_millis(50)
}

/// A communicator whose creation is under way on its thread
/// ([`CommHandle::start`]); [`PendingComm::wait`] turns it into a
/// [`CommHandle`]. Start every communicator a process hosts before waiting
/// for any (as `create_comms` does): NCCL completes a creation only once every rank
/// of the communicator has joined, so creating one after another waits out
/// the first one's timeout.
pub struct PendingComm {
    handle: CommHandle,
    start: Instant,
    init_deadline: Instant,
}

impl std::fmt::Debug for PendingComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingComm").field("rank", &self.handle.config.rank).field("comm", &self.handle.tag).finish()
    }
}

impl PendingComm {
    /// Waits until the communicator is ready, or fails within
    /// `init_timeout + abort_timeout` (plus slack) of its start.
    pub fn wait(self) -> Result<CommHandle, CommError> {
        let PendingComm { mut handle, start, init_deadline } = self;
        let config = handle.config;
        let (rank, nranks, comm) = (config.rank, config.nranks, handle.tag.clone());
        let wait = (init_deadline + grace(&config)).saturating_duration_since(Instant::now());
        let fail = match handle.reports.recv_timeout(wait) {
            Ok(Report::Init(Ok(()))) => return Ok(handle),
            Ok(Report::Init(Err(InitFail::Timeout))) | Err(RecvTimeoutError::Timeout) => None,
            Ok(Report::Init(Err(InitFail::Failed(reason)))) => Some(reason),
            Ok(Report::Aborted(_)) | Err(RecvTimeoutError::Disconnected) => Some(BackendError::ThreadEnded),
        };
        // Creation failed: the thread aborts what it created; wait for that
        // at most the abort timeout.
        handle.stop.store(true, Ordering::SeqCst);
        let abandoned = handle.finish_abort().needs_restart();
        handle.state = State::Closed;
        Err(match fail {
            None => CommError::InitTimeout { rank, nranks, comm, waited: start.elapsed(), abandoned },
            Some(reason) => CommError::InitFailed { rank, nranks, comm, reason: Box::new(reason), abandoned },
        })
    }
}

/// Waits for every started communicator (each against its own deadline,
/// so all of them together take at most the longest init timeout), in
/// order.
#[cfg(test)]
pub(super) fn wait_all(pending: Vec<PendingComm>) -> Vec<Result<CommHandle, CommError>> {
    pending.into_iter().map(PendingComm::wait).collect()
}

impl CommHandle {
    /// Starts a communicator thread and returns at once: `make` runs on it
    /// and creates the communicator without blocking (the backend is never
    /// moved between threads), then the thread polls creation until it
    /// completes or `config.init_timeout` passes. Fails here only if the
    /// thread cannot be started.
    pub fn start<B, F>(config: CommConfig, tag: &str, make: F) -> Result<PendingComm, CommError>
    where
        B: CommBackend,
        F: FnOnce() -> Result<B, BackendError> + Send + 'static,
    {
        let start = Instant::now();
        let init_deadline = start + config.init_timeout;
        let (commands, command_rx) = channel();
        let (report_tx, reports) = channel();
        let stop = Arc::new(AtomicBool::new(false));
        let mark = Arc::new(Mark::default());
        let (stop2, mark2) = (stop.clone(), mark.clone());
        let spawned = std::thread::Builder::new().name(format!("nccl-r{}-{}", config.rank, tag)).spawn(move || {
            let _done = DoneOnDrop(mark2);
            comm_thread(make, config, init_deadline, stop2, command_rx, report_tx);
        });
        let thread = spawned.map_err(|e| CommError::InitFailed {
            rank: config.rank,
            nranks: config.nranks,
            comm: tag.to_string(),
            reason: Box::new(BackendError::Spawn(e.to_string())),
            abandoned: false,
        })?;
        let handle = CommHandle { config, tag: tag.to_string(), commands, reports, stop, mark, thread: Some(thread), state: State::Ready };
        Ok(PendingComm { handle, start, init_deadline })
    }

    /// [`CommHandle::start`], then [`PendingComm::wait`]: for a process
    /// that hosts one rank of the communicator.
    pub fn spawn<B, F>(config: CommConfig, tag: &str, make: F) -> Result<CommHandle, CommError>
    where
        B: CommBackend,
        F: FnOnce() -> Result<B, BackendError> + Send + 'static,
    {
        CommHandle::start(config, tag, make)?.wait()
    }

    /// This member's rank.
    pub fn rank(&self) -> u32 {
        self.config.rank
    }

    /// Ranks in the communicator.
    pub fn nranks(&self) -> u32 {
        self.config.nranks
    }

    /// The communicator's tag (from its id).
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// Whether the communicator can run groups.
    pub fn is_ready(&self) -> bool {
        self.state == State::Ready
    }

    fn usable(&self) -> Result<(), CommError> {
        match &self.state {
            State::Ready => Ok(()),
            State::Failed(why) => {
                Err(CommError::Unusable { rank: self.config.rank, comm: self.tag.clone(), state: format!("failed: {why}") })
            }
            State::Closed => Err(CommError::Unusable { rank: self.config.rank, comm: self.tag.clone(), state: "aborted".into() }),
        }
    }

    /// Runs one round's group of operations and waits, until `deadline`,
    /// for its work to finish on the device. On any error the communicator
    /// becomes unusable: abort it and create a new one with a new id.
    ///
    /// `after` is a device event the group's stream waits for before its
    /// operations start (the event that follows packing the round's sends
    /// on another stream): the device orders the two, not the host.
    ///
    /// # Safety
    /// Every operation's address must name `bytes` bytes of memory the
    /// communicator can reach (device memory for NCCL, host memory for the
    /// simulated communicator), untouched by other work, until this
    /// returns `Ok` — and, if it returns an error, for as long as the
    /// communicator may still run (never reuse or free it: the aborted
    /// communicator may still write it, or never stop).
    pub unsafe fn group(&mut self, round: u32, ops: Vec<P2p>, after: Option<Fence>, deadline: Instant) -> Result<(), CommError> {
        self.usable()?;
        let (rank, comm) = (self.config.rank, self.tag.clone());
        if let Some(op) = ops.iter().find(|op| op.peer() >= self.config.nranks) {
            return Err(CommError::BadPeer { rank, comm, peer: op.peer(), nranks: self.config.nranks });
        }
        let mut peers: Vec<u32> = ops.iter().map(P2p::peer).collect();
        peers.sort_unstable();
        peers.dedup();
        let start = Instant::now();
        let (reply, answer) = channel();
        if self.commands.send(Command::Group { ops, after, round, deadline, reply }).is_err() {
            self.state = State::Failed("thread gone".into());
            return Err(CommError::ThreadGone { rank, comm });
        }
        let wait = (deadline + grace(&self.config)).saturating_duration_since(Instant::now());
        let result = match answer.recv_timeout(wait) {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(None)) => CommError::GroupTimeout { rank, comm, round, peers, waited: start.elapsed() },
            Ok(Err(Some(e))) => CommError::GroupFailed { rank, comm, round, peers, reason: Box::new(e.reason), peer_first: e.peer_first },
            Err(RecvTimeoutError::Timeout) => {
                // The thread is stuck inside a call: stop its polling.
                self.stop.store(true, Ordering::SeqCst);
                CommError::GroupTimeout { rank, comm, round, peers, waited: start.elapsed() }
            }
            Err(RecvTimeoutError::Disconnected) => CommError::ThreadGone { rank, comm },
        };
        self.state = State::Failed(result.to_string());
        Err(result)
    }

    /// Asks the communicator for an asynchronous error (a peer that died,
    /// a network failure) while no group runs; waits at most `timeout`.
    pub fn check(&mut self, timeout: Duration) -> Result<(), CommError> {
        self.usable()?;
        let (rank, comm) = (self.config.rank, self.tag.clone());
        let (reply, answer) = channel();
        if self.commands.send(Command::Check { reply }).is_err() {
            self.state = State::Failed("thread gone".into());
            return Err(CommError::ThreadGone { rank, comm });
        }
        let err = match answer.recv_timeout(timeout) {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(reason)) => CommError::Async { rank, comm, reason: Box::new(reason) },
            Err(RecvTimeoutError::Timeout) => CommError::Async { rank, comm, reason: Box::new(BackendError::NoAnswer(timeout)) },
            Err(RecvTimeoutError::Disconnected) => CommError::ThreadGone { rank, comm },
        };
        self.state = State::Failed(err.to_string());
        Err(err)
    }

    /// Tears the communicator down, waiting at most the abort timeout. If
    /// the thread does not answer in time it is abandoned (left running and
    /// counted by [`abandoned_comm_threads`](super::abandoned_comm_threads)) and the outcome says so: the
    /// caller is never blocked by a hung abort.
    pub fn abort(&mut self) -> AbortOutcome {
        if self.state == State::Closed {
            return AbortOutcome::AlreadyClosed;
        }
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.commands.send(Command::Abort);
        self.state = State::Closed;
        self.finish_abort()
    }

    /// Waits for the thread's abort report, then joins it or abandons it.
    fn finish_abort(&mut self) -> AbortOutcome {
        let start = Instant::now();
        let deadline = start + self.config.abort_timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.reports.recv_timeout(left) {
                Ok(Report::Init(_)) => continue,
                Ok(Report::Aborted(r)) => {
                    // The thread returns right after this report.
                    if let Some(t) = self.thread.take() {
                        let _ = t.join();
                    }
                    return match r {
                        Ok(()) => AbortOutcome::Aborted { elapsed: start.elapsed() },
                        Err(reason) => AbortOutcome::Failed { elapsed: start.elapsed(), reason },
                    };
                }
                Err(RecvTimeoutError::Disconnected) => {
                    if let Some(t) = self.thread.take() {
                        let _ = t.join();
                    }
                    return AbortOutcome::Failed { elapsed: start.elapsed(), reason: BackendError::ThreadEnded };
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.mark.abandon();
                    self.thread.take(); // detach
                    return AbortOutcome::Abandoned { waited: start.elapsed(), watch: ThreadWatch(self.mark.clone()) };
                }
            }
        }
    }
}

impl Drop for CommHandle {
    fn drop(&mut self) {
        if self.state != State::Closed {
            // Ask for an abort but never wait for it here.
            self.stop.store(true, Ordering::SeqCst);
            let _ = self.commands.send(Command::Abort);
            self.mark.abandon();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::comm::{abandoned_comm_threads, BackendError, GroupError, Progress, RawEvent};
    use std::sync::atomic::AtomicUsize;
    use std::sync::mpsc::SyncSender;
    use std::sync::Mutex;

    /// A fake communicator: counts polls, logs calls, and can be told to
    /// never finish creation or groups, to fail, or to hang in abort.
    #[derive(Default)]
    struct Fake {
        /// Polls until creation completes (None: never).
        init_after: Option<u32>,
        init_polls: u32,
        /// Polls until a group completes (None: never).
        group_after: Option<u32>,
        group_polls: u32,
        /// Error reported by group polls and checks from this poll on.
        async_error_at: Option<(u32, String)>,
        /// Abort blocks on this until the test lets it go.
        abort_hang: Option<Receiver<()>>,
        /// Starting a group blocks on this until the test lets it go.
        group_hang: Option<Receiver<()>>,
        /// Abort answers "in progress"; polls until the teardown is done
        /// (None: never).
        abort_pending: Option<Option<u32>>,
        abort_polls: u32,
        /// Creation completes only once this many fakes sharing the counter
        /// have been created (NCCL's: every rank must join).
        joined: Option<(Arc<AtomicUsize>, usize)>,
        log: Arc<Mutex<Vec<String>>>,
    }

    impl CommBackend for Fake {
        fn poll_init(&mut self) -> Result<Progress, BackendError> {
            self.init_polls += 1;
            if let Some((joined, all)) = &self.joined {
                if joined.load(Ordering::SeqCst) < *all {
                    return Ok(Progress::Pending);
                }
            }
            match self.init_after {
                Some(n) if self.init_polls >= n => Ok(Progress::Ready),
                _ => Ok(Progress::Pending),
            }
        }
        fn start_group(&mut self, ops: &[P2p], after: u64, _round: u32) -> Result<(), GroupError> {
            if let Some(rx) = &self.group_hang {
                let _ = rx.recv();
            }
            self.group_polls = 0;
            let after = if after == 0 { String::new() } else { format!(" after {after:#x}") };
            self.log.lock().unwrap().push(format!("group {ops:?}{after}"));
            Ok(())
        }
        fn poll_group(&mut self) -> Result<Progress, GroupError> {
            self.group_polls += 1;
            if let Some((at, e)) = &self.async_error_at {
                if self.group_polls >= *at {
                    return Err(BackendError::Fake(e.clone()).into());
                }
            }
            match self.group_after {
                Some(n) if self.group_polls >= n => Ok(Progress::Ready),
                _ => Ok(Progress::Pending),
            }
        }
        fn check(&mut self) -> Result<(), BackendError> {
            self.log.lock().unwrap().push("check".into());
            match &self.async_error_at {
                Some((_, e)) => Err(BackendError::Fake(e.clone())),
                None => Ok(()),
            }
        }
        fn abort(&mut self) -> Result<Progress, BackendError> {
            self.log.lock().unwrap().push("abort".into());
            if let Some(rx) = &self.abort_hang {
                let _ = rx.recv();
            }
            Ok(if self.abort_pending.is_some() { Progress::Pending } else { Progress::Ready })
        }
        fn poll_abort(&mut self) -> Result<Progress, BackendError> {
            self.abort_polls += 1;
            match self.abort_pending {
                Some(Some(n)) if self.abort_polls >= n => {
                    self.log.lock().unwrap().push(format!("aborted after {} polls", self.abort_polls));
                    Ok(Progress::Ready)
                }
                _ => Ok(Progress::Pending),
            }
        }
    }

    fn joining_fake(
        log: &Arc<Mutex<Vec<String>>>,
        joined: &Arc<AtomicUsize>,
        all: usize,
    ) -> impl FnOnce() -> Result<Fake, BackendError> + Send + 'static {
        let fake = Fake { joined: Some((joined.clone(), all)), ..ready_fake(log) };
        let joined = joined.clone();
        move || {
            joined.fetch_add(1, Ordering::SeqCst);
            Ok(fake)
        }
    }

    #[test]
    fn communicators_of_one_process_are_created_together() {
        // Three ranks of one communicator in this process: creation
        // completes only once all three joined. Started together, all are
        // ready; the first created alone times out (NCCL would too).
        let log = Arc::new(Mutex::new(Vec::new()));
        let joined = Arc::new(AtomicUsize::new(0));
        let pending: Vec<PendingComm> = (0..3)
            .map(|r| CommHandle::start(CommConfig { rank: r, nranks: 3, ..config() }, "all", joining_fake(&log, &joined, 3)).unwrap())
            .collect();
        let handles = wait_all(pending);
        assert_eq!(handles.len(), 3);
        for (r, h) in handles.into_iter().enumerate() {
            let mut h = h.unwrap();
            assert_eq!(h.rank(), r as u32);
            assert!(matches!(h.abort(), AbortOutcome::Aborted { .. }));
        }
        let joined = Arc::new(AtomicUsize::new(0));
        let err = CommHandle::spawn(CommConfig { rank: 0, nranks: 3, ..config() }, "one", joining_fake(&log, &joined, 3)).unwrap_err();
        assert!(matches!(&err, CommError::InitTimeout { rank: 0, nranks: 3, .. }), "{err}");
    }

    #[test]
    fn an_abort_in_progress_is_polled_to_its_end() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let fake = Fake { abort_pending: Some(Some(5)), ..ready_fake(&log) };
        let mut h = CommHandle::spawn(config(), "t10", move || Ok(fake)).unwrap();
        assert!(matches!(h.abort(), AbortOutcome::Aborted { .. }));
        assert_eq!(log.lock().unwrap().last().map(String::as_str), Some("aborted after 5 polls"));

        // A teardown that never ends is not taken as done: the caller gets
        // its answer within the abort timeout, the thread is abandoned.
        let log = Arc::new(Mutex::new(Vec::new()));
        let fake = Fake { abort_pending: Some(None), ..ready_fake(&log) };
        let mut h = CommHandle::spawn(config(), "t11", move || Ok(fake)).unwrap();
        let start = Instant::now();
        let outcome = h.abort();
        assert!(start.elapsed() < Duration::from_millis(1500));
        assert!(matches!(outcome, AbortOutcome::Abandoned { .. }) && outcome.needs_restart(), "{outcome:?}");
    }

    /// A group on a fake communicator, which never touches memory.
    fn fake_group(h: &mut CommHandle, round: u32, ops: Vec<P2p>, after: Option<Fence>, deadline: Instant) -> Result<(), CommError> {
        // SAFETY: the fake backend never reads or writes the addresses.
        unsafe { h.group(round, ops, after, deadline) }
    }

    fn config() -> CommConfig {
        CommConfig {
            rank: 1,
            nranks: 4,
            init_timeout: Duration::from_millis(300),
            abort_timeout: Duration::from_millis(300),
            poll_interval: Duration::from_millis(1),
        }
    }

    fn ready_fake(log: &Arc<Mutex<Vec<String>>>) -> Fake {
        Fake { init_after: Some(3), group_after: Some(2), log: log.clone(), ..Fake::default() }
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[test]
    fn handle_can_move_between_threads() {
        fn send<T: Send>() {}
        send::<CommHandle>();
        send::<CommError>();
        send::<AbortOutcome>();
    }

    #[test]
    fn commands_round_trip() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let fake = ready_fake(&log);
        let mut h = CommHandle::spawn(config(), "t0", move || Ok(fake)).unwrap();
        assert!(h.is_ready() && h.rank() == 1 && h.nranks() == 4 && h.tag() == "t0");
        let ops = vec![P2p::Send { peer: 0, addr: 0x1000, bytes: 64 }, P2p::Recv { peer: 2, addr: 0x2000, bytes: 32 }];
        fake_group(&mut h, 0, ops.clone(), None, soon()).unwrap();
        fake_group(&mut h, 1, Vec::new(), Some(Fence::new(RawEvent(0xe7), Arc::new(()))), soon()).unwrap();
        h.check(Duration::from_secs(5)).unwrap();
        assert!(matches!(h.abort(), AbortOutcome::Aborted { .. }));
        assert!(matches!(h.abort(), AbortOutcome::AlreadyClosed));
        let log = log.lock().unwrap().clone();
        assert_eq!(log, vec![format!("group {ops:?}"), "group [] after 0xe7".into(), "check".into(), "abort".into()]);
        assert!(matches!(fake_group(&mut h, 2, Vec::new(), None, soon()), Err(CommError::Unusable { rank: 1, .. })));
    }

    #[test]
    fn init_polled_to_completion() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let fake = Fake { init_after: Some(20), ..ready_fake(&log) };
        let mut h = CommHandle::spawn(config(), "t1", move || Ok(fake)).unwrap();
        assert!(h.is_ready());
        assert!(matches!(h.abort(), AbortOutcome::Aborted { .. }));
    }

    #[test]
    fn init_that_never_completes_times_out_within_deadline() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let fake = Fake { init_after: None, ..ready_fake(&log) };
        let start = Instant::now();
        let err = CommHandle::spawn(config(), "t2", move || Ok(fake)).unwrap_err();
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(300) && took < Duration::from_millis(1500), "{took:?}");
        match &err {
            CommError::InitTimeout { rank: 1, nranks: 4, comm, abandoned: false, .. } => assert_eq!(comm, "t2"),
            e => panic!("unexpected {e}"),
        }
        assert!(err.to_string().contains("rank 1/4 comm t2: creation did not complete"), "{err}");
        // The half-created communicator was aborted.
        assert_eq!(log.lock().unwrap().last().map(String::as_str), Some("abort"));
    }

    #[test]
    fn init_failure_and_panic_are_errors() {
        // Generous: a panic may print a symbolized backtrace (RUST_BACKTRACE)
        // on a loaded machine before the thread ends.
        let config = || CommConfig { init_timeout: Duration::from_secs(20), ..config() };
        let err = CommHandle::spawn(config(), "t3", || Err::<Fake, _>(BackendError::Fake("libnccl.so not found".to_string()))).unwrap_err();
        assert!(matches!(&err, CommError::InitFailed { reason, .. } if reason.to_string().contains("libnccl")), "{err}");
        let err = CommHandle::spawn(config(), "t4", || -> Result<Fake, BackendError> { panic!("symbol missing") }).unwrap_err();
        assert!(matches!(&err, CommError::InitFailed { reason, .. } if reason.to_string().contains("symbol missing")), "{err}");
    }

    #[test]
    fn hanging_abort_returns_within_deadline_and_is_reported_abandoned() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let (release, hang): (SyncSender<()>, Receiver<()>) = std::sync::mpsc::sync_channel(1);
        let fake = Fake { abort_hang: Some(hang), ..ready_fake(&log) };
        let mut h = CommHandle::spawn(config(), "t5", move || Ok(fake)).unwrap();
        fake_group(&mut h, 0, vec![P2p::Send { peer: 3, addr: 8, bytes: 8 }], None, soon()).unwrap();
        let start = Instant::now();
        let outcome = h.abort();
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(300) && took < Duration::from_millis(1500), "{took:?}");
        let AbortOutcome::Abandoned { watch, .. } = &outcome else { panic!("expected abandoned, got {outcome:?}") };
        assert!(outcome.needs_restart());
        assert!(!watch.is_finished());
        assert!(abandoned_comm_threads() >= 1);
        // A new communicator with a new id replaces it meanwhile.
        let log2 = Arc::new(Mutex::new(Vec::new()));
        let fake2 = ready_fake(&log2);
        let mut h2 = CommHandle::spawn(config(), "t5b", move || Ok(fake2)).unwrap();
        fake_group(&mut h2, 0, Vec::new(), None, soon()).unwrap();
        assert!(matches!(h2.abort(), AbortOutcome::Aborted { .. }));
        // Once the stuck call returns, the thread ends and is no longer counted.
        release.send(()).unwrap();
        let until = Instant::now() + Duration::from_secs(5);
        while !watch.is_finished() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(watch.is_finished());
    }

    #[test]
    fn async_error_is_surfaced() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let fake = Fake { group_after: None, async_error_at: Some((3, "remote process exited".into())), ..ready_fake(&log) };
        let mut h = CommHandle::spawn(config(), "t6", move || Ok(fake)).unwrap();
        let ops = vec![P2p::Recv { peer: 0, addr: 16, bytes: 16 }, P2p::Send { peer: 2, addr: 32, bytes: 16 }];
        let err = fake_group(&mut h, 7, ops, None, soon()).unwrap_err();
        match &err {
            CommError::GroupFailed { rank: 1, round: 7, peers, reason, .. } => {
                assert_eq!(peers, &vec![0, 2]);
                assert!(reason.to_string().contains("remote process exited"));
            }
            e => panic!("unexpected {e}"),
        }
        assert!(!h.is_ready());
        assert!(matches!(fake_group(&mut h, 8, Vec::new(), None, soon()), Err(CommError::Unusable { .. })));
        assert!(matches!(h.abort(), AbortOutcome::Aborted { .. }));

        // The same error while idle, through check().
        let log = Arc::new(Mutex::new(Vec::new()));
        let fake = Fake { async_error_at: Some((1, "peer 3 unreachable".into())), ..ready_fake(&log) };
        let mut h = CommHandle::spawn(config(), "t7", move || Ok(fake)).unwrap();
        let err = h.check(Duration::from_secs(5)).unwrap_err();
        assert!(matches!(&err, CommError::Async { rank: 1, reason, .. } if reason.to_string().contains("peer 3")), "{err}");
    }

    #[test]
    fn group_that_never_completes_times_out() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let fake = Fake { group_after: None, ..ready_fake(&log) };
        let mut h = CommHandle::spawn(config(), "t8", move || Ok(fake)).unwrap();
        let start = Instant::now();
        let err = fake_group(&mut h, 2, vec![P2p::Send { peer: 0, addr: 1, bytes: 1 }], None, Instant::now() + Duration::from_millis(100))
            .unwrap_err();
        assert!(start.elapsed() < Duration::from_millis(1000));
        assert!(matches!(&err, CommError::GroupTimeout { rank: 1, round: 2, .. }), "{err}");
        assert!(matches!(h.abort(), AbortOutcome::Aborted { .. }));
    }

    #[test]
    fn bad_peer_rejected_before_sending() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let fake = ready_fake(&log);
        let mut h = CommHandle::spawn(config(), "t9", move || Ok(fake)).unwrap();
        let err = fake_group(&mut h, 0, vec![P2p::Recv { peer: 4, addr: 0, bytes: 4 }], None, soon()).unwrap_err();
        assert_eq!(err, CommError::BadPeer { rank: 1, comm: "t9".into(), peer: 4, nranks: 4 });
        assert!(h.is_ready());
        drop(h); // asks for an abort without waiting
    }

    #[test]
    fn a_thread_stuck_in_a_group_call_keeps_its_fence_alive() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let (release, hang) = std::sync::mpsc::channel();
        let fake = Fake { group_hang: Some(hang), ..ready_fake(&log) };
        let mut h = CommHandle::spawn(config(), "t10", move || Ok(fake)).unwrap();
        let event: Arc<dyn std::any::Any + Send + Sync> = Arc::new(());
        let err =
            fake_group(&mut h, 3, Vec::new(), Some(Fence::new(RawEvent(0xe8), event.clone())), Instant::now() + Duration::from_millis(50))
                .unwrap_err();
        assert!(matches!(&err, CommError::GroupTimeout { round: 3, .. }), "{err}");
        // The caller gave up; the thread is still inside the call, and still
        // holds the event's owner, whatever the caller drops.
        assert_eq!(Arc::strong_count(&event), 2);
        release.send(()).unwrap();
        let start = Instant::now();
        while Arc::strong_count(&event) > 1 {
            assert!(start.elapsed() < Duration::from_secs(5), "the thread never let the fence go");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(log.lock().unwrap().iter().any(|l| l.contains("after 0xe8")));
        drop(h);
    }
}
