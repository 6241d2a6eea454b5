//! Remote actors over real loopback TCP: location transparency, lost
//! connections (including a killed child process), heartbeats, hostile
//! peers, the registry and secrets.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use actors::codec;
use actors::remote::{FrameKind, Node, NodeConfig, RawPeer, RegistryClient, RemotePeer, SecretError};
use actors::{
    async_trait, spawn, Actor, ActorError, ActorRef, CallError, Context, RemoteError, Secret, SpawnConfig, StopReason, Supervisor,
    SupervisorEvents, Terminated,
};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Generous upper bound for "promptly" on a noisy machine.
const PROMPTLY: Duration = Duration::from_secs(3);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Msg {
    Echo(u64),
    Add(u64),
    Total,
    Fail(String),
    Fatal(String),
    SleepMs(u64),
    Blob(Vec<u8>),
}

#[derive(Debug, Default)]
struct Calc {
    total: u64,
}

#[async_trait]
impl Actor for Calc {
    type Msg = Msg;
    type Reply = u64;

    async fn handle(&mut self, msg: Msg, _ctx: &mut Context<Self>) -> Result<u64, ActorError> {
        match msg {
            Msg::Echo(x) => Ok(x),
            Msg::Add(x) => {
                self.total += x;
                Ok(self.total)
            }
            Msg::Total => Ok(self.total),
            Msg::Fail(why) => Err(ActorError::failed(why)),
            Msg::Fatal(why) => Err(ActorError::fatal(why)),
            Msg::SleepMs(ms) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(ms)
            }
            Msg::Blob(bytes) => Ok(bytes.len() as u64),
        }
    }
}

fn secret() -> Secret {
    Secret::from_bytes(b"refit-remote-test-secret-0123456789".to_vec()).unwrap()
}

fn config() -> NodeConfig {
    NodeConfig {
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_secs(1),
        handshake_timeout: Duration::from_millis(500),
        ..NodeConfig::default()
    }
}

/// A node serving a fresh `Calc` as `calc`.
async fn calc_server() -> (Node, ActorRef<Calc>) {
    let node = Node::bind(secret(), config()).await.unwrap();
    let calc = spawn(Calc::default(), SpawnConfig::default().name("calc"));
    node.serve("calc", &calc).unwrap();
    (node, calc)
}

async fn client_of(server: &Node) -> (Node, RemotePeer) {
    let node = Node::bind(secret(), config()).await.unwrap();
    let peer = node.connect(server.local_addr()).await.unwrap();
    (node, peer)
}

/// The same code, for a local and a remote handle.
async fn exercise(calc: &ActorRef<Calc>) {
    assert!(calc.is_alive());
    assert_eq!(calc.call(Msg::Echo(7)).await.unwrap(), 7);
    calc.tell(Msg::Add(5)).await.unwrap();
    calc.try_tell(Msg::Add(1)).unwrap();
    assert_eq!(calc.call(Msg::Total).await.unwrap(), 6);

    let err = calc.call(Msg::Fail("not today".into())).await.unwrap_err();
    assert_eq!(err.handler_error(), Some(&ActorError::Failed("not today".into())), "{err:?}");
    assert_eq!(err.actor(), calc.info());
    assert!(calc.is_alive(), "a recoverable error keeps the actor running");

    let err = calc.call_timeout(Msg::SleepMs(500), Duration::from_millis(100)).await.unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    assert_eq!(calc.call(Msg::Echo(8)).await.unwrap(), 8);
}

#[tokio::test]
async fn a_remote_ref_behaves_like_a_local_ref() {
    let local = spawn(Calc::default(), SpawnConfig::default().name("local-calc"));
    exercise(&local).await;

    let (server, served) = calc_server().await;
    let (_client, peer) = client_of(&server).await;
    let remote = peer.lookup::<Calc>("calc").await.unwrap();
    assert_eq!(remote.info(), served.info(), "the handle carries the remote actor's identity");
    exercise(&remote).await;
}

#[tokio::test]
async fn many_concurrent_calls() {
    let (server, _served) = calc_server().await;
    let (_client, peer) = client_of(&server).await;
    let remote = peer.lookup::<Calc>("calc").await.unwrap();
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..500u64 {
        let remote = remote.clone();
        calls.spawn(async move { (i, remote.call(Msg::Echo(i)).await) });
    }
    let mut seen = 0;
    while let Some(joined) = calls.join_next().await {
        let (i, reply) = joined.unwrap();
        assert_eq!(reply.unwrap(), i);
        seen += 1;
    }
    assert_eq!(seen, 500);
}

#[tokio::test]
async fn fatal_remote_error_stops_the_handle_with_the_same_reason() {
    let (server, served) = calc_server().await;
    let (_client, peer) = client_of(&server).await;
    let remote = peer.lookup::<Calc>("calc").await.unwrap();
    let (supervisor, mut events) = Supervisor::channel();
    remote.link(&supervisor);

    let err = remote.call(Msg::Fatal("boom".into())).await.unwrap_err();
    assert_eq!(err.handler_error(), Some(&ActorError::Fatal("boom".into())));
    let reason = tokio::time::timeout(PROMPTLY, remote.terminated()).await.unwrap();
    assert_eq!(reason, StopReason::Fatal("boom".into()));
    assert_eq!(served.terminated().await, StopReason::Fatal("boom".into()));
    let event = next_event(&mut events).await;
    assert_eq!(event.id, served.id());
    assert_eq!(event.reason, StopReason::Fatal("boom".into()));
    assert!(!remote.is_alive());
    let err = remote.call(Msg::Echo(1)).await.unwrap_err();
    assert_eq!(err.stop_reason(), Some(&StopReason::Fatal("boom".into())));
}

#[tokio::test]
async fn a_handle_to_an_already_stopped_actor_is_stopped_with_its_reason() {
    let (server, served) = calc_server().await;
    let (_client, peer) = client_of(&server).await;
    served.stop();
    assert_eq!(served.terminated().await, StopReason::Requested);
    for _ in 0..2 {
        let remote = peer.lookup::<Calc>("calc").await.unwrap();
        let reason = tokio::time::timeout(PROMPTLY, remote.terminated()).await.unwrap();
        assert_eq!(reason, StopReason::Requested);
    }
}

#[tokio::test]
async fn stopping_a_remote_handle_stops_only_the_handle() {
    let (server, served) = calc_server().await;
    let (_client, peer) = client_of(&server).await;
    let remote = peer.lookup::<Calc>("calc").await.unwrap();
    remote.stop();
    assert_eq!(tokio::time::timeout(PROMPTLY, remote.terminated()).await.unwrap(), StopReason::Requested);
    assert!(served.is_alive());
    let again = peer.lookup::<Calc>("calc").await.unwrap();
    assert_eq!(again.call(Msg::Echo(4)).await.unwrap(), 4);
}

#[tokio::test]
async fn looking_up_an_unknown_name_is_a_clean_error() {
    let (server, _served) = calc_server().await;
    let (_client, peer) = client_of(&server).await;
    let err = peer.lookup::<Calc>("nobody").await.unwrap_err();
    assert!(matches!(&err, RemoteError::UnknownActor { name, .. } if name == "nobody"), "{err:?}");
    assert_eq!(err.peer(), Some(server.local_addr().to_string().as_str()));
    // The connection is still good.
    let remote = peer.lookup::<Calc>("calc").await.unwrap();
    assert_eq!(remote.call(Msg::Echo(3)).await.unwrap(), 3);
}

#[tokio::test]
async fn a_client_with_the_wrong_secret_gets_auth_failed() {
    let (server, _served) = calc_server().await;
    let other = Node::bind(Secret::from_bytes(b"a-completely-different-secret".to_vec()).unwrap(), config()).await.unwrap();
    let err = other.connect(server.local_addr()).await.unwrap_err();
    assert!(err.is_auth_failure(), "{err:?}");
    assert!(err.to_string().contains(&server.local_addr().to_string()), "{err}");
    assert_serving(&server).await;
}

#[tokio::test]
async fn messages_larger_than_a_frame_are_refused_without_breaking_the_connection() {
    let (server, _served) = calc_server().await;
    let client = Node::bind(secret(), NodeConfig { max_frame_bytes: 64 * 1024, ..config() }).await.unwrap();
    let peer = client.connect(server.local_addr()).await.unwrap();
    let remote = peer.lookup::<Calc>("calc").await.unwrap();
    let err = remote.call(Msg::Blob(vec![7; 100 * 1024])).await.unwrap_err();
    assert!(err.handler_error().is_some(), "{err:?}");
    assert_eq!(remote.call(Msg::Blob(vec![7; 1000])).await.unwrap(), 1000);
}

async fn next_event(events: &mut SupervisorEvents) -> Terminated {
    tokio::time::timeout(PROMPTLY, events.recv()).await.expect("no Terminated event in time").expect("supervision channel closed")
}

fn assert_connection_lost(reason: &StopReason) {
    assert!(reason.is_connection_lost(), "expected ConnectionLost, got {reason:?}");
}

#[tokio::test]
async fn server_shutdown_stops_handles_and_fails_pending_calls_promptly() {
    let (server, _served) = calc_server().await;
    let (_client, peer) = client_of(&server).await;
    let remote = peer.lookup::<Calc>("calc").await.unwrap();
    let (supervisor, mut events) = Supervisor::channel();
    remote.link(&supervisor);

    let pending = {
        let remote = remote.clone();
        tokio::spawn(async move { remote.call_timeout(Msg::SleepMs(60_000), Duration::from_secs(60)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let start = Instant::now();
    server.shutdown();

    let err = tokio::time::timeout(PROMPTLY, pending).await.expect("pending call did not fail in time").unwrap().unwrap_err();
    assert!(matches!(&err, CallError::Stopped { reason, .. } if reason.is_connection_lost()), "{err:?}");
    let reason = tokio::time::timeout(PROMPTLY, remote.terminated()).await.unwrap();
    assert_connection_lost(&reason);
    let event = next_event(&mut events).await;
    assert_eq!(event.id, remote.id());
    assert_connection_lost(&event.reason);
    assert!(start.elapsed() < PROMPTLY, "took {:?}", start.elapsed());
    assert!(!remote.is_alive());
    let err = remote.call(Msg::Echo(1)).await.unwrap_err();
    assert!(err.stop_reason().is_some_and(StopReason::is_connection_lost), "{err:?}");
    assert!(!peer.is_connected());
}

#[tokio::test]
async fn closing_the_peer_stops_its_handles() {
    let (server, _served) = calc_server().await;
    let (_client, peer) = client_of(&server).await;
    let remote = peer.lookup::<Calc>("calc").await.unwrap();
    peer.close();
    let reason = tokio::time::timeout(PROMPTLY, remote.terminated()).await.unwrap();
    assert_connection_lost(&reason);
    // The server is unaffected.
    assert_serving(&server).await;
}

/// A TCP relay between a client and a server that can freeze (stop
/// forwarding, keep the sockets open: a partition) or cut (close) the
/// connection.
struct Relay {
    addr: SocketAddr,
    frozen: Arc<AtomicBool>,
    cut: Arc<tokio::sync::Notify>,
}

impl Relay {
    async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let frozen = Arc::new(AtomicBool::new(false));
        let cut = Arc::new(tokio::sync::Notify::new());
        let (f, c) = (Arc::clone(&frozen), Arc::clone(&cut));
        tokio::spawn(async move {
            let (client, _) = listener.accept().await.unwrap();
            let server = TcpStream::connect(target).await.unwrap();
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::select! {
                () = pump(cr, sw, Arc::clone(&f)) => {}
                () = pump(sr, cw, f) => {}
                () = c.notified() => {}
            }
        });
        Relay { addr, frozen, cut }
    }
}

async fn pump(mut from: tokio::net::tcp::OwnedReadHalf, mut to: tokio::net::tcp::OwnedWriteHalf, frozen: Arc<AtomicBool>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[tokio::test]
async fn a_silent_peer_is_declared_dead_after_the_heartbeat_timeout() {
    let (server, _served) = calc_server().await;
    let relay = Relay::start(server.local_addr()).await;
    let client = Node::bind(secret(), config()).await.unwrap();
    let peer = client.connect(relay.addr).await.unwrap();
    let remote = peer.lookup::<Calc>("calc").await.unwrap();
    let (supervisor, mut events) = Supervisor::channel();
    remote.link(&supervisor);
    assert_eq!(remote.call(Msg::Echo(1)).await.unwrap(), 1);
    // Heartbeats keep an idle connection alive well past the timeout.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(remote.is_alive());

    let start = Instant::now();
    relay.frozen.store(true, Ordering::SeqCst);
    let reason = tokio::time::timeout(config().heartbeat_timeout + PROMPTLY, remote.terminated()).await.unwrap();
    assert!(matches!(&reason, StopReason::ConnectionLost { problem, .. } if problem.contains("heartbeat")), "{reason:?}");
    assert_connection_lost(&next_event(&mut events).await.reason);
    let elapsed = start.elapsed();
    assert!(elapsed >= Duration::from_millis(500), "declared dead too early: {elapsed:?}");
    assert!(elapsed < config().heartbeat_timeout + PROMPTLY, "took {elapsed:?}");
}

#[tokio::test]
async fn a_cut_connection_stops_handles_promptly() {
    let (server, _served) = calc_server().await;
    let relay = Relay::start(server.local_addr()).await;
    let (client, _) = client_of(&server).await;
    let peer = client.connect(relay.addr).await.unwrap();
    let remote = peer.lookup::<Calc>("calc").await.unwrap();
    let start = Instant::now();
    relay.cut.notify_one();
    let reason = tokio::time::timeout(PROMPTLY, remote.terminated()).await.unwrap();
    assert_connection_lost(&reason);
    assert!(start.elapsed() < PROMPTLY);
}

#[tokio::test]
async fn an_authenticated_raw_peer_that_goes_silent_is_dropped_by_the_server() {
    let (server, _served) = calc_server().await;
    let mut raw = RawPeer::connect(server.local_addr()).await.unwrap();
    raw.handshake(&secret()).await.unwrap();
    let start = Instant::now();
    assert!(raw.closed_within(config().heartbeat_timeout + PROMPTLY).await, "server kept a silent peer");
    assert!(start.elapsed() >= Duration::from_millis(500), "dropped too early: {:?}", start.elapsed());
    assert_serving(&server).await;
}

// ---------------------------------------------------------------------------
// A real second process.

const CHILD_ENV: &str = "REFIT_REMOTE_CHILD";
const CHILD_SECRET_ENV: &str = "REFIT_REMOTE_TEST_SECRET";
const ADDR_LINE: &str = "REFIT_REMOTE_ADDR=";

/// Runs as a server node only when started by
/// `a_killed_child_process_is_reported_dead` (with `REFIT_REMOTE_CHILD=1`);
/// otherwise passes at once.
#[test]
fn remote_child_server() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let secret = Secret::from_env(CHILD_SECRET_ENV).unwrap();
        let node = Node::bind(secret, config()).await.unwrap();
        let calc = spawn(Calc::default(), SpawnConfig::default().name("child-calc"));
        node.serve("calc", &calc).unwrap();
        {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            writeln!(out, "{ADDR_LINE}{}", node.local_addr()).unwrap();
            out.flush().unwrap();
        }
        // Serve until killed; never outlive a lost parent by much.
        tokio::time::sleep(Duration::from_secs(60)).await;
    });
}

/// Kills the child on drop, so a failing test leaves no process behind.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn a_killed_child_process_is_reported_dead() {
    let secret_text = "child-process-secret-0123456789";
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "remote_child_server", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .env(CHILD_SECRET_ENV, secret_text)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut child = ChildGuard(child);
    let stdout = child.0.stdout.take().unwrap();
    let addr = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::task::spawn_blocking(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let line = line.ok()?;
                // libtest may print "test remote_child_server ... " first.
                if let Some((_, addr)) = line.split_once(ADDR_LINE) {
                    return addr.trim().parse::<SocketAddr>().ok();
                }
            }
            None
        }),
    )
    .await
    .expect("child did not print its address in time")
    .unwrap()
    .expect("child exited without printing its address");

    let client = Node::bind(Secret::from_bytes(secret_text.as_bytes().to_vec()).unwrap(), config()).await.unwrap();
    let peer = client.connect(addr).await.unwrap();
    let remote = peer.lookup::<Calc>("calc").await.unwrap();
    assert_eq!(remote.name(), "child-calc");
    assert_eq!(remote.call(Msg::Add(40)).await.unwrap(), 40);
    assert_eq!(remote.call(Msg::Add(2)).await.unwrap(), 42);
    let (supervisor, mut events) = Supervisor::channel();
    remote.link(&supervisor);

    let start = Instant::now();
    child.0.kill().unwrap();
    let event = next_event(&mut events).await;
    assert_eq!(event.id, remote.id());
    assert_connection_lost(&event.reason);
    assert!(start.elapsed() <= PROMPTLY, "took {:?}", start.elapsed());
    assert_connection_lost(&remote.terminated().await);
    let err = remote.call(Msg::Echo(1)).await.unwrap_err();
    assert!(err.stop_reason().is_some_and(StopReason::is_connection_lost), "{err:?}");
}

// ---------------------------------------------------------------------------
// Hostile peers.

/// Collects the warnings and errors of every test in this binary (a
/// global subscriber: per-thread ones can miss events when other threads
/// hit the same call sites first).
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<String>>>);

impl Logs {
    fn global() -> &'static Logs {
        static LOGS: OnceLock<Logs> = OnceLock::new();
        LOGS.get_or_init(|| {
            let logs = Logs::default();
            tracing::subscriber::set_global_default(logs.clone()).expect("another global subscriber");
            logs
        })
    }

    /// The lines mentioning `needle`.
    fn lines_with(&self, needle: &str) -> Vec<String> {
        self.0.lock().unwrap().iter().filter(|line| line.contains(needle)).cloned().collect()
    }
}

struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write;
        let _ = write!(self.0, "{}={:?} ", field.name(), value);
    }
}

impl tracing::Subscriber for Logs {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::WARN
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = Fields(format!("{} ", event.metadata().level()));
        event.record(&mut fields);
        self.0.lock().unwrap().push(fields.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// One step of a hostile script.
enum Step {
    /// Raw bytes.
    Bytes(Vec<u8>),
    /// Close our sending direction.
    Finish,
    /// A correctly sealed frame with the next sequence number.
    Ping,
    /// A correctly sealed frame with this sequence number (`None`: the next one), kind and body.
    Sealed(Option<u64>, u8, Vec<u8>),
    /// A correctly sealed call to the actor served under this name.
    Call(&'static str),
}

/// How the attack starts.
enum Start {
    /// Authenticate properly first.
    Authenticated,
    /// Send the steps without a handshake.
    Unauthenticated,
    /// Try to authenticate with another secret.
    WrongSecret,
}

/// What the server must do.
enum Expect {
    /// Drop the connection, logging a warning containing this text.
    Dropped(&'static str),
    /// Answer with an error reply containing this text and keep the connection.
    ErrorReply(&'static str),
}

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    codec::write_frame(&mut out, payload, usize::MAX).unwrap();
    out
}

fn cases() -> Vec<(&'static str, Start, Vec<Step>, Expect)> {
    use Expect::*;
    use Start::*;
    use Step::*;
    let lookup = FrameKind::Lookup as u8;
    let ping = FrameKind::Ping as u8;
    let forged = codec::encode(&(0u64, ping, RawPeer::ping_body(), [0u8; 32])).unwrap();
    vec![
        ("wrong secret", WrongSecret, vec![], Dropped("wrong secret")),
        ("no handshake (silence)", Unauthenticated, vec![], Dropped("no handshake in time")),
        ("oversized length prefix before auth", Unauthenticated, vec![Bytes(vec![0xFF; 4])], Dropped("exceeds the limit of 256 bytes")),
        (
            "truncated frame before auth",
            Unauthenticated,
            vec![Bytes(vec![100, 0, 0, 0, 1, 2, 3]), Finish],
            Dropped("in the middle of a frame"),
        ),
        (
            "garbage before auth",
            Unauthenticated,
            vec![Bytes(b"GET / HTTP/1.1\r\n\r\n".to_vec())],
            Dropped("exceeds the limit of 256 bytes"),
        ),
        (
            "undecodable handshake frame",
            Unauthenticated,
            vec![Bytes(frame(&[0xde, 0xad, 0xbe, 0xef]))],
            Dropped("undecodable handshake frame"),
        ),
        ("data frame without handshake", Unauthenticated, vec![Bytes(frame(&forged))], Dropped("undecodable handshake frame")),
        ("oversized length prefix", Authenticated, vec![Bytes(vec![0xFF; 4])], Dropped("exceeds the limit of 16777216 bytes")),
        ("truncated frame", Authenticated, vec![Bytes(vec![100, 0, 0, 0, 1, 2, 3]), Finish], Dropped("in the middle of a frame")),
        (
            "garbage bytes",
            Authenticated,
            vec![Bytes(vec![8, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef, 0xde, 0xad, 0xbe, 0xef])],
            Dropped("malformed frame"),
        ),
        (
            "valid-length frame of the wrong type",
            Authenticated,
            vec![Bytes(frame(&codec::encode("not a frame").unwrap()))],
            Dropped("malformed frame"),
        ),
        ("forged tag", Authenticated, vec![Bytes(frame(&forged))], Dropped("authentication tag does not verify")),
        ("unknown frame kind", Authenticated, vec![Sealed(None, 0xEE, vec![])], Dropped("unknown frame kind 238")),
        (
            "known kind, undecodable body",
            Authenticated,
            vec![Sealed(None, lookup, vec![0xFF; 3])],
            Dropped("undecodable Lookup frame body"),
        ),
        (
            "replayed frame (same seq twice)",
            Authenticated,
            vec![Ping, Sealed(Some(0), ping, RawPeer::ping_body())],
            Dropped("expected #1, got #0"),
        ),
        ("reordered frame (seq skipped)", Authenticated, vec![Sealed(Some(5), ping, RawPeer::ping_body())], Dropped("expected #0, got #5")),
        ("request for an unknown actor", Authenticated, vec![Ping, Call("nobody")], ErrorReply("nobody")),
    ]
}

async fn check(server: &Node, logs: &Logs, name: &str, start: Start, steps: Vec<Step>, expect: Expect) {
    let mut raw = RawPeer::connect(server.local_addr()).await.unwrap();
    let me = raw.local_addr().unwrap();
    match start {
        Start::Authenticated => raw.handshake(&secret()).await.unwrap(),
        Start::Unauthenticated => {}
        Start::WrongSecret => {
            let wrong = Secret::from_bytes(b"not-the-right-secret-at-all".to_vec()).unwrap();
            let err = raw.handshake(&wrong).await.unwrap_err();
            assert!(err.is_auth_failure(), "{name}: {err:?}");
        }
    }
    for step in steps {
        let sent = match step {
            Step::Bytes(bytes) => raw.send_bytes(&bytes).await,
            Step::Finish => raw.finish_sending().await,
            Step::Ping => raw.send_ping().await,
            Step::Sealed(seq, kind, body) => {
                let seq = seq.unwrap_or_else(|| raw.next_seq());
                raw.send_sealed(seq, kind, &body).await
            }
            Step::Call(actor) => raw.send_call(99, actor, &codec::encode(&Msg::Echo(1)).unwrap()).await,
        };
        // A write may fail once the server has dropped us; that is fine.
        if sent.is_err() {
            break;
        }
    }
    match expect {
        Expect::Dropped(why) => {
            assert!(raw.closed_within(PROMPTLY).await, "{name}: the server did not drop the connection");
            // The warning is logged before the socket closes, but give the
            // server task a moment to be scheduled.
            let mut logged = Vec::new();
            for _ in 0..100 {
                logged = logs.lines_with(&format!("peer={me} "));
                if logged.iter().any(|line| line.contains(why)) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(logged.iter().any(|line| line.contains(why)), "{name}: no warning containing {why:?} in {logged:#?}");
        }
        Expect::ErrorReply(text) => {
            let (req, reply) = raw.recv_reply(PROMPTLY).await.unwrap_or_else(|err| panic!("{name}: no reply: {err}"));
            assert_eq!(req, 99, "{name}");
            let err = reply.expect_err(name);
            assert!(err.contains(text), "{name}: {err}");
            // Still connected: a correctly sealed ping goes through and the
            // server keeps pinging us.
            raw.send_ping().await.unwrap();
        }
    }
    assert_serving(server).await;
}

/// A good client can still connect, look up and call.
async fn assert_serving(server: &Node) {
    let client = Node::bind(secret(), config()).await.unwrap();
    let peer = client.connect(server.local_addr()).await.unwrap();
    let calc = peer.lookup::<Calc>("calc").await.unwrap();
    assert_eq!(calc.call(Msg::Echo(11)).await.unwrap(), 11);
}

#[tokio::test]
async fn hostile_frames_drop_only_that_connection() {
    // No line anywhere shows the secret.
    let secret_text = "refit-remote-test-secret";
    let logs = Logs::global();
    let (server, _served) = calc_server().await;
    for (name, start, steps, expect) in cases() {
        check(&server, logs, name, start, steps, expect).await;
    }
    assert!(!server.is_shut_down());
    assert_eq!(logs.lines_with(secret_text), Vec::<String>::new());
}

// ---------------------------------------------------------------------------
// Registry.

#[tokio::test]
async fn nodes_find_each_other_through_the_registry() {
    let registry_node = Node::bind(secret(), config()).await.unwrap();
    registry_node.host_registry().unwrap();

    let (server, served) = calc_server().await;
    let announcer: RegistryClient = server.registry_client(registry_node.local_addr()).await.unwrap();
    announcer.announce("calc").await.unwrap();
    let err = announcer.announce("not-served").await.unwrap_err();
    assert!(matches!(err, RemoteError::UnknownActor { .. }), "{err:?}");

    let client = Node::bind(secret(), config()).await.unwrap();
    let finder = client.registry_client(registry_node.local_addr()).await.unwrap();
    let registration = finder.resolve("calc").await.unwrap().unwrap();
    assert_eq!(registration.addr, server.local_addr());
    assert_eq!(&registration.info, served.info());
    assert_eq!(finder.list().await.unwrap(), vec![registration]);

    let calc = finder.lookup::<Calc>("calc").await.unwrap();
    assert_eq!(calc.call(Msg::Echo(5)).await.unwrap(), 5);
    assert_eq!(finder.resolve("nobody").await.unwrap(), None);
    let err = finder.lookup::<Calc>("nobody").await.unwrap_err();
    assert!(matches!(err, RemoteError::NotRegistered { .. }), "{err:?}");

    assert!(announcer.withdraw("calc").await.unwrap());
    assert_eq!(finder.resolve("calc").await.unwrap(), None);
}

#[tokio::test]
async fn a_name_a_live_node_serves_is_refused_and_a_gone_holders_is_taken_over() {
    let registry_node = Node::bind(secret(), config()).await.unwrap();
    registry_node.host_registry().unwrap();
    let client = Node::bind(secret(), config()).await.unwrap();
    let finder = client.registry_client(registry_node.local_addr()).await.unwrap();
    let holder = |addr: SocketAddr| {
        let finder = &finder;
        async move { assert_eq!(finder.resolve("calc").await.unwrap().unwrap().addr, addr) }
    };

    let (first, first_calc) = calc_server().await;
    let first_registry = first.registry_client(registry_node.local_addr()).await.unwrap();
    first_registry.announce("calc").await.unwrap();
    // The same node registers again (a member re-announcing itself).
    first_registry.announce("calc").await.unwrap();

    // Another node, while the first serves the name: refused by name.
    let (second, _second_calc) = calc_server().await;
    let second_registry = second.registry_client(registry_node.local_addr()).await.unwrap();
    let err = second_registry.announce("calc").await.unwrap_err();
    assert!(matches!(&err, RemoteError::NameHeld { name, holder, .. } if name == "calc" && *holder == first.local_addr()), "{err:?}");
    assert!(err.to_string().contains("'calc' is already served by the live node at"), "{err}");
    holder(first.local_addr()).await;

    // The same actor served from another node (a member that reconnected
    // through a new node) takes its own name.
    let (moved, _) = client_of(&registry_node).await;
    moved.serve("calc", &first_calc).unwrap();
    let moved_registry = moved.registry_client(registry_node.local_addr()).await.unwrap();
    moved_registry.announce("calc").await.unwrap();
    holder(moved.local_addr()).await;
    moved_registry.announce("calc").await.unwrap();

    // The holder's node still up, no longer serving the name: taken over.
    moved.unserve("calc");
    second_registry.announce("calc").await.unwrap();
    holder(second.local_addr()).await;

    // The holder's node gone (a worker that died and is replaced).
    let (third, _third_calc) = calc_server().await;
    let third_registry = third.registry_client(registry_node.local_addr()).await.unwrap();
    assert!(matches!(third_registry.announce("calc").await, Err(RemoteError::NameHeld { .. })));
    second.shutdown();
    drop(second_registry);
    third_registry.announce("calc").await.unwrap();
    holder(third.local_addr()).await;
}

// ---------------------------------------------------------------------------
// Configuration and secrets.

#[test]
fn default_config_is_loopback_with_bounded_heartbeats_and_frames() {
    let config = NodeConfig::default();
    assert!(config.bind.ip().is_loopback());
    assert_eq!(config.bind.port(), 0);
    assert_eq!(config.heartbeat_interval, Duration::from_millis(250));
    assert_eq!(config.heartbeat_timeout, Duration::from_secs(1));
    assert!(config.heartbeat_timeout <= Duration::from_secs(2));
    assert!(config.heartbeat_interval * 2 < config.heartbeat_timeout);
    assert_eq!(config.max_frame_bytes, 16 * 1024 * 1024);
}

#[tokio::test]
async fn unusable_configs_are_refused() {
    for (what, config) in [
        ("interval >= timeout", NodeConfig { heartbeat_interval: Duration::from_secs(2), ..NodeConfig::default() }),
        ("zero interval", NodeConfig { heartbeat_interval: Duration::ZERO, ..NodeConfig::default() }),
        ("tiny frames", NodeConfig { max_frame_bytes: 100, ..NodeConfig::default() }),
    ] {
        let err = Node::bind(secret(), config).await.unwrap_err();
        assert!(matches!(err, RemoteError::InvalidConfig { .. }), "{what}: {err:?}");
    }
}

#[test]
fn secrets_never_show_their_content() {
    let text = "super-secret-value-do-not-print";
    let secret = Secret::from_bytes(text.as_bytes().to_vec()).unwrap();
    assert!(!format!("{secret:?}").contains(text));
    assert!(!format!("{secret}").contains(text));
    assert!(!format!("{secret:#?}").contains("super"));

    let err = Secret::from_bytes(b"short".to_vec()).unwrap_err();
    assert!(matches!(err, SecretError::TooShort { len: 5, .. }), "{err:?}");
}

#[test]
fn secret_from_env_names_the_missing_variable() {
    let var = "REFIT_REMOTE_TEST_DEFINITELY_UNSET_VAR";
    let err = Secret::from_env(var).unwrap_err();
    assert!(matches!(&err, SecretError::EnvMissing { var: v } if v == var), "{err:?}");
    assert!(err.to_string().contains(var), "{err}");
}

#[test]
fn secret_from_env_reads_and_trims_the_variable() {
    let var = "REFIT_REMOTE_TEST_SECRET_FROM_ENV";
    std::env::set_var(var, "  env-secret-0123456789abcdef\n");
    let secret = Secret::from_env(var).unwrap();
    std::env::remove_var(var);
    assert!(!format!("{secret:?}").contains("env-secret"));
    std::env::set_var("REFIT_REMOTE_TEST_SHORT_SECRET", "tiny");
    let err = Secret::from_env("REFIT_REMOTE_TEST_SHORT_SECRET").unwrap_err();
    assert!(err.to_string().contains("REFIT_REMOTE_TEST_SHORT_SECRET"), "{err}");
    assert!(!err.to_string().contains("tiny"), "{err}");
}

#[test]
fn secret_from_file_names_the_file_but_not_the_content() {
    let dir = std::env::temp_dir().join(format!("refit-remote-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("no-such-secret");
    let err = Secret::from_file(&missing).unwrap_err();
    assert!(matches!(&err, SecretError::File { path, .. } if *path == missing), "{err:?}");
    assert!(err.to_string().contains("no-such-secret"), "{err}");

    let short = dir.join("short-secret");
    write_private(&short, "hunter2\n");
    let err = Secret::from_file(&short).unwrap_err();
    assert!(err.to_string().contains("short-secret") && !err.to_string().contains("hunter2"), "{err}");

    let good = dir.join("good-secret");
    write_private(&good, "file-secret-0123456789abcdef\n");
    let from_file = Secret::from_file(&good).unwrap();
    assert!(!format!("{from_file:?}").contains("file-secret"));

    // A file others may read (or write) is refused, naming file and mode;
    // so is something that is not a file.
    for mode in [0o644, 0o604, 0o620] {
        std::fs::set_permissions(&good, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
        let err = Secret::from_file(&good).unwrap_err();
        assert!(matches!(&err, SecretError::Exposed { mode: m, .. } if *m == mode), "{err:?}");
        let text = err.to_string();
        assert!(text.contains("good-secret") && text.contains(&format!("{mode:03o}")) && !text.contains("file-secret"), "{text}");
    }
    assert!(matches!(Secret::from_file(&dir), Err(SecretError::NotAFile { .. })));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Writes a file only its owner may read.
fn write_private(path: &std::path::Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
}

#[tokio::test]
async fn secrets_from_a_file_and_from_bytes_agree() {
    let dir = std::env::temp_dir().join(format!("refit-remote-agree-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("secret");
    write_private(&path, "refit-remote-test-secret-0123456789\n");
    let node = Node::bind(Secret::from_file(&path).unwrap(), config()).await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let (server, _served) = calc_server().await;
    let peer = node.connect(server.local_addr()).await.unwrap();
    assert_eq!(peer.lookup::<Calc>("calc").await.unwrap().call(Msg::Echo(2)).await.unwrap(), 2);
}

/// Connections that never authenticate have a budget of their own: with it
/// full of silent sockets (and more waiting), a client with the secret
/// still gets in at once (the oldest silent one makes way), and the
/// authenticated connections stay bounded on their own.
#[tokio::test]
async fn silent_sockets_cannot_keep_a_client_with_the_secret_out() {
    let server = Node::bind(secret(), NodeConfig { max_unauthenticated: 4, max_connections: 1, ..config() }).await.unwrap();
    let calc = spawn(Calc::default(), SpawnConfig::default().name("calc"));
    server.serve("calc", &calc).unwrap();
    let mut silent = Vec::new();
    for _ in 0..10 {
        silent.push(tokio::net::TcpStream::connect(server.local_addr()).await.unwrap());
    }
    let client = Node::bind(secret(), config()).await.unwrap();
    let peer = client.connect(server.local_addr()).await.unwrap();
    assert_eq!(peer.lookup::<Calc>("calc").await.unwrap().call(Msg::Echo(7)).await.unwrap(), 7);
    // A second authenticated connection is over `max_connections`.
    let other = Node::bind(secret(), config()).await.unwrap();
    let refused = match other.connect(server.local_addr()).await {
        Ok(p) => p.lookup::<Calc>("calc").await.is_err(),
        Err(_) => true,
    };
    assert!(refused, "a connection beyond max_connections was served");
    drop(silent);
}
