//! Behaviour of the actor runtime: calls, timeouts, backpressure, groups,
//! supervision and shutdown.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use actors::{
    async_trait, spawn, spawn_group, Actor, ActorError, ActorGroup, ActorRef, CallError, Context, GroupError, SpawnConfig, StopReason,
    Supervisor, TellError,
};
use tokio::sync::Notify;
use tokio::time::Instant;

/// A two-sided gate: the handler signals `entered`, then waits for `release`.
#[derive(Debug, Clone, Default)]
struct Gate {
    entered: Arc<Notify>,
    release: Arc<Notify>,
}

impl Gate {
    async fn wait_entered(&self) {
        self.entered.notified().await;
    }

    fn open(&self) {
        self.release.notify_one();
    }
}

#[derive(Debug, Clone)]
enum Msg {
    Echo(u64),
    Add(u64),
    Sleep(Duration),
    SleepThenRank(Duration),
    Rank,
    Record(u64),
    Fail(String),
    Fatal(String),
    Panic(String),
    Block(Gate),
    TellSelf(u64),
    StopSelf,
}

type Log = Arc<Mutex<Vec<String>>>;

fn log_entries(log: &Log) -> Vec<String> {
    log.lock().unwrap().clone()
}

struct Worker {
    total: u64,
    log: Log,
}

impl Worker {
    fn new(log: &Log) -> Self {
        Self { total: 0, log: Arc::clone(log) }
    }

    fn record(&self, entry: String) {
        self.log.lock().unwrap().push(entry);
    }
}

#[async_trait]
impl Actor for Worker {
    type Msg = Msg;
    type Reply = u64;

    async fn handle(&mut self, msg: Msg, ctx: &mut Context<Self>) -> Result<u64, ActorError> {
        let rank = ctx.rank().map_or(u64::MAX, |r| r as u64);
        match msg {
            Msg::Echo(x) => Ok(x),
            Msg::Add(x) => {
                self.total += x;
                Ok(self.total)
            }
            Msg::Sleep(d) => {
                tokio::time::sleep(d).await;
                Ok(0)
            }
            Msg::SleepThenRank(d) => {
                tokio::time::sleep(d).await;
                self.record(format!("done:{rank}"));
                Ok(rank)
            }
            Msg::Rank => Ok(rank),
            Msg::Record(x) => {
                self.record(format!("record:{x}"));
                Ok(x)
            }
            Msg::Fail(why) => Err(ActorError::failed(why)),
            Msg::Fatal(why) => Err(ActorError::fatal(why)),
            Msg::Panic(why) => panic!("{why}"),
            Msg::Block(gate) => {
                gate.entered.notify_one();
                gate.release.notified().await;
                Ok(0)
            }
            Msg::TellSelf(x) => {
                let me = ctx.myself().upgrade().ok_or_else(|| ActorError::failed("no strong ref"))?;
                me.try_tell(Msg::Record(x)).map_err(|e| ActorError::failed(e.to_string()))?;
                Ok(x)
            }
            Msg::StopSelf => {
                ctx.stop();
                Ok(0)
            }
        }
    }

    async fn stopped(&mut self, reason: &StopReason) {
        self.record(format!("stopped:{reason:?}"));
    }
}

fn new_log() -> Log {
    Arc::new(Mutex::new(Vec::new()))
}

fn worker(log: &Log, config: SpawnConfig) -> ActorRef<Worker> {
    spawn(Worker::new(log), config)
}

fn workers(n: usize, log: &Log, config: SpawnConfig) -> ActorGroup<Worker> {
    spawn_group(n, config.name("worker"), |_| Worker::new(log))
}

#[tokio::test]
async fn call_returns_reply_and_keeps_state() {
    let log = new_log();
    let actor = worker(&log, SpawnConfig::default().name("trainer[3]"));
    assert_eq!(actor.name(), "trainer[3]");
    assert_eq!(actor.rank(), None);
    assert_eq!(actor.call(Msg::Add(2)).await.unwrap(), 2);
    assert_eq!(actor.call(Msg::Add(3)).await.unwrap(), 5);
    assert_eq!(actor.call(Msg::Echo(7)).await.unwrap(), 7);
    assert!(actor.is_alive());
    assert_eq!(actor.stop_reason(), None);
}

/// Messages from one sender are handled in the order it sent them, even
/// when several senders interleave and the mailbox is small.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_from_one_sender_keep_their_order() {
    let log = new_log();
    let actor = worker(&log, SpawnConfig::default().mailbox_capacity(2));
    let senders: Vec<_> = (0..3u64)
        .map(|s| {
            let actor = actor.clone();
            tokio::spawn(async move {
                for i in 0..50u64 {
                    actor.tell(Msg::Record(s * 1000 + i)).await.unwrap();
                }
            })
        })
        .collect();
    for s in senders {
        s.await.unwrap();
    }
    actor.call(Msg::Echo(0)).await.unwrap();
    let entries = log_entries(&log);
    for s in 0..3u64 {
        let mine: Vec<u64> = entries
            .iter()
            .filter_map(|e| e.strip_prefix("record:").and_then(|x| x.parse::<u64>().ok()))
            .filter(|x| x / 1000 == s)
            .collect();
        assert_eq!(mine, (0..50).map(|i| s * 1000 + i).collect::<Vec<_>>(), "sender {s}");
    }
}

#[tokio::test]
async fn default_name_is_the_type_name_and_ids_are_unique() {
    let log = new_log();
    let a = worker(&log, SpawnConfig::default());
    let b = worker(&log, SpawnConfig::default());
    assert_eq!(a.name(), "Worker");
    assert_ne!(a.id(), b.id());
    assert_eq!(a.clone(), a);
    assert_ne!(a, b);
}

#[tokio::test(start_paused = true)]
async fn call_timeout_on_slow_handler_returns_promptly() {
    let log = new_log();
    let actor = worker(&log, SpawnConfig::default().name("slow"));
    let start = Instant::now();
    let err = actor.call_timeout(Msg::Sleep(Duration::from_secs(3600)), Duration::from_millis(100)).await.unwrap_err();
    assert_eq!(start.elapsed(), Duration::from_millis(100));
    match &err {
        CallError::Timeout { actor: info, after } => {
            assert_eq!(info.name, "slow");
            assert_eq!(*after, Duration::from_millis(100));
        }
        other => panic!("expected timeout, got {other:?}"),
    }
    assert!(err.is_timeout());
    // A timeout does not stop the actor.
    assert!(actor.is_alive());
}

#[tokio::test(start_paused = true)]
async fn default_call_timeout_comes_from_the_config() {
    let log = new_log();
    let actor = worker(&log, SpawnConfig::default().call_timeout(Duration::from_millis(50)));
    assert_eq!(actor.default_call_timeout(), Duration::from_millis(50));
    let start = Instant::now();
    let err = actor.call(Msg::Sleep(Duration::from_secs(10))).await.unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    assert_eq!(start.elapsed(), Duration::from_millis(50));
}

#[tokio::test(start_paused = true)]
async fn bounded_mailbox_applies_backpressure() {
    let log = new_log();
    let actor = worker(&log, SpawnConfig::default().mailbox_capacity(2));
    let gate = Gate::default();
    actor.tell(Msg::Block(gate.clone())).await.unwrap();
    gate.wait_entered().await; // the mailbox is empty again, the handler is busy

    actor.try_tell(Msg::Record(1)).unwrap();
    actor.try_tell(Msg::Record(2)).unwrap();
    assert_eq!(actor.mailbox_free(), 0);
    let err = actor.try_tell(Msg::Record(3)).unwrap_err();
    assert!(err.is_full());
    assert_eq!(err.actor().id, actor.id());
    let msg = err.into_msg();
    assert!(matches!(msg, Msg::Record(3)), "message handed back: {msg:?}");

    // `tell` waits for space instead of failing.
    let waited = tokio::time::timeout(Duration::from_millis(50), actor.tell(msg.clone())).await;
    assert!(waited.is_err(), "tell must wait while the mailbox is full");

    gate.open();
    actor.tell(msg).await.unwrap();
    assert_eq!(actor.call(Msg::Echo(0)).await.unwrap(), 0);
    assert_eq!(log_entries(&log), ["record:1", "record:2", "record:3"]);
}

#[tokio::test(start_paused = true)]
async fn call_all_gathers_replies_in_rank_order() {
    let log = new_log();
    let n = 4;
    let group = workers(n, &log, SpawnConfig::default());
    let start = Instant::now();
    // Rank r sleeps (n - r) * 10ms: replies arrive in reverse rank order.
    let replies = group.call_all(|rank| Msg::SleepThenRank(Duration::from_millis(10 * (n - rank) as u64))).await.unwrap();
    assert_eq!(replies, [0, 1, 2, 3]);
    assert_eq!(log_entries(&log), ["done:3", "done:2", "done:1", "done:0"]);
    // Concurrent: the slowest call bounds the time, not the sum (100ms).
    assert_eq!(start.elapsed(), Duration::from_millis(40));
}

#[tokio::test]
async fn group_members_are_named_and_ranked() {
    let log = new_log();
    let group = workers(3, &log, SpawnConfig::default());
    assert_eq!(group.len(), 3);
    assert!(!group.is_empty());
    assert_eq!(group.ranks(), 0..3);
    for (rank, member) in group.iter() {
        assert_eq!(member.rank(), Some(rank));
        assert_eq!(member.name(), format!("worker[{rank}]"));
    }
    assert_eq!(group.call_rank(2, Msg::Rank).await.unwrap(), 2);
    assert_eq!(group.call_all(|_| Msg::Rank).await.unwrap(), [0, 1, 2]);
}

#[tokio::test]
async fn slices_keep_original_rank_numbers() {
    let log = new_log();
    let group = workers(8, &log, SpawnConfig::default());
    let mid = group.slice(2..6).unwrap();
    assert_eq!(mid.len(), 4);
    assert_eq!(mid.ranks(), 2..6);
    assert_eq!(mid.refs()[0].name(), "worker[2]");
    assert_eq!(mid.get(2).and_then(ActorRef::rank), Some(2));
    assert!(mid.get(1).is_none());
    assert!(mid.get(6).is_none());
    assert_eq!(mid.call_all(|_| Msg::Rank).await.unwrap(), [2, 3, 4, 5]);
    assert_eq!(mid.call_all(|rank| Msg::Echo(rank as u64)).await.unwrap(), [2, 3, 4, 5]);
    assert_eq!(mid.call_rank(5, Msg::Rank).await.unwrap(), 5);
    assert_eq!(mid.call_rank(1, Msg::Rank).await.unwrap_err(), GroupError::NoSuchRank { rank: 1, ranks: 2..6 });

    let inner = mid.slice(3..5).unwrap();
    assert_eq!(inner.call_all(|_| Msg::Rank).await.unwrap(), [3, 4]);
    assert_eq!(inner.iter().map(|(rank, _)| rank).collect::<Vec<_>>(), [3, 4]);
    assert!(matches!(
        mid.slice(1..3),
        Err(GroupError::InvalidRange { ranks, .. }) if ranks == (2..6)
    ));
    let (start, end) = (5, 3);
    assert!(mid.slice(start..end).is_err());
    assert!(inner.slice(2..5).is_err(), "a slice cannot widen its parent");

    let empty = mid.slice(4..4).unwrap();
    assert!(empty.is_empty());
    assert!(empty.call_all(|_| Msg::Rank).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_handler_stops_only_that_actor() {
    let log = new_log();
    let (supervisor, mut events) = Supervisor::channel();
    let group = workers(3, &log, SpawnConfig::default().supervisor(&supervisor));

    let err = group.call_rank(1, Msg::Panic("boom at step 7".into())).await.unwrap_err();
    match &err {
        GroupError::Rank { rank: 1, error: CallError::Stopped { actor, reason } } => {
            assert_eq!(actor.name, "worker[1]");
            assert_eq!(*reason, StopReason::Panicked("boom at step 7".into()));
        }
        other => panic!("unexpected error {other:?}"),
    }

    let event = events.recv().await.unwrap();
    assert_eq!(event.id, group.get(1).unwrap().id());
    assert_eq!(event.name, "worker[1]");
    assert_eq!(event.rank, Some(1));
    assert_eq!(event.reason, StopReason::Panicked("boom at step 7".into()));
    assert!(event.reason.is_failure());
    // The `stopped` hook still ran.
    assert!(log_entries(&log).contains(&"stopped:Panicked(\"boom at step 7\")".to_owned()));

    // The others keep working.
    assert_eq!(group.call_rank(0, Msg::Echo(10)).await.unwrap(), 10);
    assert_eq!(group.call_rank(2, Msg::Echo(12)).await.unwrap(), 12);
    // The dead one fails fast with the reason.
    let again = group.call_rank(1, Msg::Echo(1)).await.unwrap_err();
    assert!(matches!(again, GroupError::Rank { rank: 1, error: CallError::Stopped { reason: StopReason::Panicked(_), .. } }));
    assert!(events.try_recv().is_none(), "exactly one event");
}

#[tokio::test(start_paused = true)]
async fn calls_to_a_stopped_actor_fail_fast() {
    let log = new_log();
    let actor = worker(&log, SpawnConfig::default());
    actor.call(Msg::Panic("gone".into())).await.unwrap_err();
    assert_eq!(actor.terminated().await, StopReason::Panicked("gone".into()));
    assert!(!actor.is_alive());

    let start = Instant::now();
    let err = actor.call(Msg::Echo(1)).await.unwrap_err();
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(err.stop_reason(), Some(&StopReason::Panicked("gone".into())));

    let err = actor.tell(Msg::Record(4)).await.unwrap_err();
    assert!(matches!(err, TellError::Stopped { reason: StopReason::Panicked(_), msg: Msg::Record(4), .. }));
    let err = actor.try_tell(Msg::Record(5)).unwrap_err();
    assert!(!err.is_full());
    assert!(matches!(err.into_msg(), Msg::Record(5)));
}

#[tokio::test]
async fn fatal_error_stops_the_actor_with_that_reason() {
    let log = new_log();
    let (supervisor, mut events) = Supervisor::channel();
    let actor = worker(&log, SpawnConfig::default().name("inference[0]").supervisor(&supervisor));
    let err = actor.call(Msg::Fatal("weights corrupted".into())).await.unwrap_err();
    assert_eq!(err.handler_error(), Some(&ActorError::Fatal("weights corrupted".into())));
    let reason = StopReason::Fatal("weights corrupted".into());
    assert_eq!(actor.terminated().await, reason);
    let event = events.recv().await.unwrap();
    assert_eq!((event.name.as_str(), &event.reason), ("inference[0]", &reason));
    assert_eq!(actor.call(Msg::Echo(1)).await.unwrap_err().stop_reason(), Some(&reason));
    assert_eq!(log_entries(&log), [format!("stopped:{reason:?}")]);
}

#[tokio::test]
async fn fatal_error_from_a_told_message_stops_the_actor() {
    let log = new_log();
    let actor = worker(&log, SpawnConfig::default());
    actor.tell(Msg::Fatal("bad".into())).await.unwrap();
    assert_eq!(actor.terminated().await, StopReason::Fatal("bad".into()));
}

#[tokio::test]
async fn recoverable_error_is_returned_and_the_actor_continues() {
    let log = new_log();
    let actor = worker(&log, SpawnConfig::default());
    assert_eq!(actor.call(Msg::Add(5)).await.unwrap(), 5);
    let err = actor.call(Msg::Fail("shape mismatch".into())).await.unwrap_err();
    assert!(matches!(
        &err,
        CallError::Handler { error: ActorError::Failed(why), .. } if why == "shape mismatch"
    ));
    // A failed told message is only logged.
    actor.tell(Msg::Fail("ignored".into())).await.unwrap();
    assert_eq!(actor.call(Msg::Add(1)).await.unwrap(), 6);
    assert!(actor.is_alive());
}

#[tokio::test]
async fn dropping_the_last_ref_stops_normally_after_draining() {
    let log = new_log();
    let (supervisor, mut events) = Supervisor::channel();
    let actor = worker(&log, SpawnConfig::default().supervisor(&supervisor));
    let gate = Gate::default();
    actor.tell(Msg::Block(gate.clone())).await.unwrap();
    gate.wait_entered().await;
    for i in 1..=5 {
        actor.tell(Msg::Record(i)).await.unwrap();
    }
    let weak = actor.downgrade();
    let other = actor.clone();
    drop(actor);
    assert!(weak.upgrade().is_some(), "a clone is still alive");
    drop(other);
    assert!(weak.upgrade().is_none());

    gate.open();
    assert_eq!(weak.terminated().await, StopReason::Normal);
    assert_eq!(log_entries(&log), ["record:1", "record:2", "record:3", "record:4", "record:5", "stopped:Normal"]);
    let event = events.recv().await.unwrap();
    assert_eq!(event.reason, StopReason::Normal);
    assert_eq!(weak.stop_reason(), Some(StopReason::Normal));
}

#[tokio::test]
async fn dropping_a_group_stops_its_members_normally() {
    let log = new_log();
    let (supervisor, mut events) = Supervisor::channel();
    let group = workers(3, &log, SpawnConfig::default().supervisor(&supervisor));
    let slice = group.slice(1..2).unwrap();
    drop(group);
    assert_eq!(slice.call_rank(1, Msg::Echo(3)).await.unwrap(), 3);
    drop(slice);
    drop(supervisor);
    let mut ranks = Vec::new();
    while let Some(event) = events.recv().await {
        assert_eq!(event.reason, StopReason::Normal);
        ranks.push(event.rank.unwrap());
    }
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1, 2]);
}

#[tokio::test]
async fn explicit_stop_rejects_queued_messages() {
    let log = new_log();
    let actor = worker(&log, SpawnConfig::default().mailbox_capacity(8));
    let gate = Gate::default();
    actor.tell(Msg::Block(gate.clone())).await.unwrap();
    gate.wait_entered().await;

    let queued_call = tokio::spawn({
        let actor = actor.clone();
        async move { actor.call(Msg::Record(1)).await }
    });
    while actor.mailbox_free() != 7 {
        tokio::task::yield_now().await;
    }
    actor.try_tell(Msg::Record(2)).unwrap();
    actor.stop();
    gate.open();

    let err = queued_call.await.unwrap().unwrap_err();
    assert_eq!(err.stop_reason(), Some(&StopReason::Requested));
    assert_eq!(actor.terminated().await, StopReason::Requested);
    assert_eq!(log_entries(&log), ["stopped:Requested"]);
    actor.stop(); // idempotent
}

#[tokio::test]
async fn context_can_stop_and_message_its_own_actor() {
    let log = new_log();
    let actor = worker(&log, SpawnConfig::default());
    assert_eq!(actor.call(Msg::TellSelf(9)).await.unwrap(), 9);
    assert_eq!(actor.call(Msg::Echo(0)).await.unwrap(), 0);
    assert_eq!(log_entries(&log), ["record:9"]);
    actor.call(Msg::StopSelf).await.unwrap();
    assert_eq!(actor.terminated().await, StopReason::Requested);
}

/// An actor whose `started` hook fails or panics.
struct BadStart {
    panic: bool,
}

#[async_trait]
impl Actor for BadStart {
    type Msg = ();
    type Reply = ();

    async fn started(&mut self, _ctx: &mut Context<Self>) -> Result<(), ActorError> {
        if self.panic {
            panic!("no GPU");
        }
        Err(ActorError::failed("cannot connect"))
    }

    async fn handle(&mut self, _msg: (), _ctx: &mut Context<Self>) -> Result<(), ActorError> {
        Ok(())
    }
}

#[tokio::test]
async fn failing_start_stops_the_actor() {
    let (supervisor, mut events) = Supervisor::channel();
    let config = SpawnConfig::default().supervisor(&supervisor);
    let failed = spawn(BadStart { panic: false }, config.clone());
    let panicked = spawn(BadStart { panic: true }, config);
    assert_eq!(failed.terminated().await, StopReason::Fatal("cannot connect".into()));
    assert_eq!(panicked.terminated().await, StopReason::Panicked("no GPU".into()));
    assert!(failed.call(()).await.unwrap_err().stop_reason().is_some());
    let mut reasons = vec![events.recv().await.unwrap().reason, events.recv().await.unwrap().reason];
    reasons.sort_by_key(|r| r.to_string());
    assert_eq!(reasons, [StopReason::Fatal("cannot connect".into()), StopReason::Panicked("no GPU".into())]);
}

#[tokio::test]
async fn linking_after_termination_reports_immediately() {
    let log = new_log();
    let actor = worker(&log, SpawnConfig::default());
    actor.stop();
    assert_eq!(actor.terminated().await, StopReason::Requested);
    let (supervisor, mut events) = Supervisor::channel();
    actor.link(&supervisor);
    let event = events.try_recv().expect("event for an already stopped actor");
    assert_eq!((event.id, event.reason), (actor.id(), StopReason::Requested));
}

#[tokio::test(start_paused = true)]
async fn call_all_fails_fast_naming_the_rank() {
    let log = new_log();
    let group = workers(3, &log, SpawnConfig::default());
    let start = Instant::now();
    let err = group
        .call_all(|rank| if rank == 2 { Msg::Fail("rank 2 broke".into()) } else { Msg::Sleep(Duration::from_secs(3600)) })
        .await
        .unwrap_err();
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(err.rank(), Some(2));
    assert!(err.to_string().starts_with("rank 2: "), "{err}");
}

#[tokio::test(start_paused = true)]
async fn call_all_results_reports_every_rank() {
    let log = new_log();
    let group = workers(3, &log, SpawnConfig::default());
    let results = group.call_all_results(|rank| if rank == 1 { Msg::Fail("nope".into()) } else { Msg::Rank }).await;
    assert_eq!(results.len(), 3);
    assert_eq!(results[0], Ok(0));
    assert_eq!(results[1].as_ref().unwrap_err().handler_error(), Some(&ActorError::Failed("nope".into())));
    assert_eq!(results[2], Ok(2));

    let timed_out = group.call_all_timeout(|_| Msg::Sleep(Duration::from_secs(5)), Duration::from_secs(1)).await.unwrap_err();
    assert!(matches!(timed_out, GroupError::Rank { error: CallError::Timeout { .. }, .. }));
}

#[tokio::test]
async fn broadcast_reaches_every_live_rank_and_hands_back_the_rest() {
    let log = new_log();
    let group = workers(3, &log, SpawnConfig::default());
    group.broadcast(Msg::Record(7)).await.unwrap();
    group.call_all(|_| Msg::Echo(0)).await.unwrap();
    assert_eq!(log_entries(&log), ["record:7"; 3]);

    let rank1 = group.get(1).unwrap();
    rank1.stop();
    rank1.terminated().await;
    let err = group.tell_all(|rank| Msg::Record(rank as u64)).await.unwrap_err();
    assert_eq!(err.failures.len(), 1);
    let (rank, tell_err) = err.failures.into_iter().next().unwrap();
    assert_eq!(rank, 1);
    assert!(matches!(tell_err.into_msg(), Msg::Record(1)));
}

#[tokio::test]
async fn group_stop_and_terminated() {
    let log = new_log();
    let group = workers(4, &log, SpawnConfig::default());
    let (supervisor, mut events) = Supervisor::channel();
    let upper = group.slice(2..4).unwrap();
    upper.link(&supervisor);
    upper.stop();
    assert_eq!(upper.terminated().await, [StopReason::Requested, StopReason::Requested]);
    assert_eq!(events.recv().await.unwrap().reason, StopReason::Requested);
    assert_eq!(events.recv().await.unwrap().reason, StopReason::Requested);
    assert_eq!(group.call_all(|_| Msg::Rank).await.unwrap_err().rank(), Some(2));
    assert_eq!(group.slice(0..2).unwrap().call_all(|_| Msg::Rank).await.unwrap(), [0, 1]);
}

#[test]
fn runtime_shutdown_aborts_actors_without_hanging_callers() {
    let (supervisor, mut events) = Supervisor::channel();
    let log = new_log();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let actor = runtime.block_on(async { worker(&log, SpawnConfig::default().supervisor(&supervisor)) });
    drop(runtime);
    assert_eq!(actor.stop_reason(), Some(StopReason::Aborted));
    assert_eq!(events.try_recv().unwrap().reason, StopReason::Aborted);

    let other = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let err = other.block_on(actor.call(Msg::Echo(1))).unwrap_err();
    assert_eq!(err.stop_reason(), Some(&StopReason::Aborted));
}
