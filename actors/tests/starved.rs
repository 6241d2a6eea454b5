//! Heartbeats on a starved host: a peer's silence counts only while this
//! process runs. A process frozen whole (every task of its runtime held up
//! past the heartbeat timeout, as a busy host or a stopped process holds
//! it up) loses no connection; a peer frozen while this process runs on
//! time is declared dead within the timeout, as before.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use actors::remote::{Node, NodeConfig};
use actors::{async_trait, spawn, Actor, ActorError, CallError, Context, Secret, SpawnConfig, StopReason};

const INTERVAL: Duration = Duration::from_millis(100);
const TIMEOUT: Duration = Duration::from_millis(600);

struct Echo;

#[async_trait]
impl Actor for Echo {
    type Msg = u64;
    type Reply = u64;

    async fn handle(&mut self, x: u64, _ctx: &mut Context<Self>) -> Result<u64, ActorError> {
        Ok(x)
    }
}

fn secret() -> Secret {
    Secret::from_bytes(*b"starved-host-test-secret-32bytes").unwrap()
}

fn config() -> NodeConfig {
    NodeConfig { heartbeat_interval: INTERVAL, heartbeat_timeout: TIMEOUT, ..NodeConfig::default() }
}

async fn serving_node() -> Node {
    let node = Node::bind(secret(), config()).await.unwrap();
    node.serve("echo", &spawn(Echo, SpawnConfig::default())).unwrap();
    node
}

#[tokio::test(flavor = "current_thread")]
async fn a_process_frozen_whole_past_the_heartbeat_timeout_loses_no_connection() {
    // Both nodes on this one thread: freezing it freezes both ends, as a
    // starved host holds up every process on it.
    let server = serving_node().await;
    let client = Node::bind(secret(), config()).await.unwrap();
    let peer = client.connect(server.local_addr()).await.unwrap();
    let echo = peer.lookup::<Echo>("echo").await.unwrap();
    assert_eq!(echo.call(1).await.unwrap(), 1);
    for _ in 0..3 {
        // Five heartbeat timeouts without running a task.
        std::thread::sleep(TIMEOUT * 5);
        tokio::time::sleep(INTERVAL * 3).await;
        assert!(peer.is_connected(), "the connection was dropped: {}", peer.closed().await);
        assert_eq!(echo.call(2).await.unwrap(), 2);
    }
    assert!(echo.is_alive());
}

/// A node serving `echo` on a thread of its own, whose runtime the test
/// freezes (`std::thread::sleep` on it) while this one runs on time.
fn frozen_peer(freeze: Duration) -> (SocketAddr, std::thread::JoinHandle<()>, tokio::sync::oneshot::Sender<()>) {
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (go, go_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let node = serving_node().await;
            addr_tx.send(node.local_addr()).unwrap();
            let _ = go_rx.await;
            std::thread::sleep(freeze);
            // Running again: the peer gave this one up meanwhile.
            tokio::time::sleep(INTERVAL * 3).await;
            drop(node);
        });
    });
    (addr_rx.recv().unwrap(), thread, go)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_frozen_while_this_process_runs_is_declared_dead_within_the_timeout() {
    let freeze = TIMEOUT * 10;
    let (addr, thread, go) = frozen_peer(freeze);
    let client = Node::bind(secret(), config()).await.unwrap();
    let peer = client.connect(addr).await.unwrap();
    let echo = peer.lookup::<Echo>("echo").await.unwrap();
    assert_eq!(echo.call(7).await.unwrap(), 7);
    let frozen = Instant::now();
    go.send(()).unwrap();
    let reason = echo.terminated().await;
    let after = frozen.elapsed();
    assert!(after < freeze, "declared dead only after {after:?}, when the peer ran again");
    match &reason {
        StopReason::ConnectionLost { problem, .. } => assert!(problem.contains("heartbeat timeout"), "{reason}"),
        other => panic!("expected a lost connection, got {other}"),
    }
    assert!(matches!(echo.call(8).await, Err(CallError::Stopped { .. })));
    tokio::task::spawn_blocking(move || thread.join().unwrap()).await.unwrap();
}
