//! The node transport: shared memory between ranks of one node, TCP
//! between nodes; plans bit-exact with intra-node fan-out, checksums, link
//! emulation, and failures (dead peers, corrupt frames, stalls, cuts,
//! aborts) reported as errors before the deadline.

use reshard::{parse_layout, plan_baseline, plan_reshard, DType, Endpoint, Layout, Plan, PlanOptions};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};
use transport::{
    fill_sources, node_fabric, packed_strides, run_node, verify_destinations, ExecError, ExecOptions, Faults, LinkEmulation, NodeTransport,
    NodeTransportConfig, Payload, RankMemory, Release, Segment, ShmConfig, StridedRef, TcpConfig, TcpTransport, Transport, TransportError,
};

const SRC: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [37, 11], "mesh": {"shape": [2, 2]}, "placements": ["shard(0)", "shard(1)"]},
  {"name": "q", "dtype": "bf16", "shape": [8, 4], "shards": [
     {"rank": 0, "offset": [0, 0], "extent": [4, 4], "buffer": "qkv", "at": 0},
     {"rank": 3, "flat": [16, 16]}]},
  {"name": "e", "dtype": "f32", "shape": [1200, 64], "mesh": {"shape": [4]}, "placements": ["shard(0)"]}]}"#;
const DST: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "bf16", "shape": [37, 11], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(1)"]},
  {"name": "q", "dtype": "f32", "shape": [8, 4], "mesh": {"shape": [4]}, "placements": ["replicate"]},
  {"name": "e", "dtype": "f32", "shape": [1200, 64], "mesh": {"shape": [4]}, "placements": ["replicate"]}]}"#;

fn layouts() -> (Layout, Layout) {
    (parse_layout(SRC).unwrap(), parse_layout(DST).unwrap())
}

fn plans(max_staging_bytes: u64) -> Vec<Plan> {
    let (src, dst) = layouts();
    let opts = PlanOptions { max_staging_bytes, ..PlanOptions::default() };
    vec![plan_reshard(&src, &dst, &opts).unwrap(), plan_baseline(&src, &dst, &opts).unwrap()]
}

fn deadline(s: u64) -> ExecOptions {
    ExecOptions { deadline: Duration::from_secs(s) }
}

/// Runs both plans over a node fabric and checks every destination element.
fn check(max_staging_bytes: u64, config: &NodeTransportConfig) {
    let (src, dst) = layouts();
    for plan in plans(max_staging_bytes) {
        let programs = plan.programs(&src, &dst).unwrap();
        // The plan fans out inside destination nodes: intra-node messages exist.
        let intra = programs
            .iter()
            .flat_map(|p| p.rounds.iter().flat_map(move |r| r.sends.iter().map(move |m| (p.endpoint, m.peer))))
            .filter(|(a, b)| plan.node_of(*a) == plan.node_of(*b))
            .count();
        assert!(intra > 0, "{:?}: no intra-node message", plan.strategy());
        let mut memory = RankMemory::for_programs(&programs);
        fill_sources(&src, &mut memory[..4]);
        let report = run_node(&programs, &mut memory, &deadline(30), |e| plan.node_of(e), config).unwrap();
        assert_eq!(report.bytes, plan.figures().total_bytes);
        let checked = verify_destinations(&src, &dst, &memory[4..]).unwrap();
        assert!(checked > 0);
    }
}

fn with_checksum() -> NodeTransportConfig {
    NodeTransportConfig { tcp: TcpConfig { checksum: true, ..TcpConfig::default() }, ..NodeTransportConfig::default() }
}

#[test]
fn reshard_and_baseline_are_bit_exact_over_the_node_transport_with_checksums() {
    check(256 << 20, &with_checksum());
}

#[test]
fn without_checksums_and_in_many_small_rounds() {
    check(64, &NodeTransportConfig::default());
}

/// Regions far smaller than the messages: every intra-node message is
/// streamed in chunks that wrap around the stream area.
#[test]
fn tiny_regions_stream_in_chunks() {
    let mut config = with_checksum();
    config.shm = ShmConfig { lend_bytes: 256, stream_bytes: 100, ..ShmConfig::default() };
    check(256 << 20, &config);
}

#[test]
fn link_emulation_keeps_results_exact() {
    let mut config = with_checksum();
    // Slow enough to pace (many 4 KiB chunks), fast enough for a test.
    config.tcp.emulation =
        LinkEmulation { inter_node_bytes_per_s: Some(200 << 20), intra_node_bytes_per_s: Some(400 << 20), burst_bytes: 4096 };
    check(256 << 20, &config);
}

fn segments(buf: &[u8], rows: u64, cols: u64, stride: u64) -> Payload {
    // A `rows` x `cols` block of bytes with row stride `stride`.
    // SAFETY: the caller keeps `buf` alive and unwritten until the payload
    // is consumed.
    let view = unsafe { StridedRef::new(buf.as_ptr(), buf.len(), 0, [stride, 1, 0, 0, 0, 0, 0, 0], DType::U8) };
    Payload::Segments { segments: vec![Segment::new(view, &[rows, cols])], keep_alive: Vec::new(), release: Release::default() }
}

fn contiguous(buf: &[u8]) -> Payload {
    let n = buf.len() as u64;
    // SAFETY: as above.
    let view = unsafe { StridedRef::new(buf.as_ptr(), buf.len(), 0, packed_strides(&[n]), DType::U8) };
    Payload::Segments { segments: vec![Segment::new(view, &[n])], keep_alive: Vec::new(), release: Release::default() }
}

fn bytes_of(p: Payload) -> Vec<u8> {
    match p {
        Payload::Bytes(b) => b,
        Payload::Lent(l) => l.as_slice().to_vec(),
        Payload::Stream(mut frame) => {
            let mut b = vec![0u8; frame.len() as usize];
            frame.read_exact(&mut b).unwrap();
            b
        }
        Payload::Segments { .. } | Payload::Pieces(_) => panic!("segments from a process transport"),
    }
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8).collect()
}

/// Three ranks: src 0 alone, dst 0 and dst 1 on one node.
fn trio(config: &NodeTransportConfig) -> Vec<NodeTransport> {
    let eps = [Endpoint::src(0), Endpoint::dst(0), Endpoint::dst(1)];
    node_fabric(&eps, |e| e.group, config).unwrap()
}

#[test]
fn same_node_peers_use_shared_memory_and_others_tcp() {
    let t = trio(&NodeTransportConfig::default());
    assert!(t[0].shm_peers().is_empty());
    assert_eq!(t[1].shm_peers(), vec![Endpoint::dst(1)]);
    assert_eq!(t[2].shm_peers(), vec![Endpoint::dst(0)]);
}

/// Messages of every size through both areas, strided and contiguous,
/// including two ranks sending each other more than their regions hold
/// before either receives (the stream readers drain: no deadlock).
#[test]
fn messages_of_every_size_cross_shared_memory_exactly() {
    let mut config = with_checksum();
    config.shm = ShmConfig { lend_bytes: 64 << 10, stream_bytes: 16 << 10, ..ShmConfig::default() };
    let mut t = trio(&config);
    let (mut b, mut a) = (t.pop().unwrap(), t.pop().unwrap());
    let when = || Instant::now() + Duration::from_secs(20);
    let sizes = [0usize, 1, 63, 64, 4096, 40 << 10, 64 << 10, (64 << 10) + 1, 1 << 20, 3 << 20];
    let bufs: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| pattern(n, i as u8)).collect();
    std::thread::scope(|s| {
        let bufs = &bufs;
        let h = s.spawn(move || {
            for (r, buf) in bufs.iter().enumerate() {
                b.send(r as u32, Endpoint::dst(0), contiguous(buf)).unwrap();
            }
            for (r, buf) in bufs.iter().enumerate() {
                let (from, p) = b.recv(r as u32, when()).unwrap();
                assert_eq!(from, Endpoint::dst(0));
                assert!(bytes_of(p) == *buf, "round {r}");
            }
        });
        for (r, buf) in bufs.iter().enumerate() {
            a.send(r as u32, Endpoint::dst(1), contiguous(buf)).unwrap();
        }
        for (r, buf) in bufs.iter().enumerate() {
            let (from, p) = a.recv(r as u32, when()).unwrap();
            assert_eq!(from, Endpoint::dst(1));
            assert!(bytes_of(p) == *buf, "round {r}");
        }
        h.join().unwrap();
    });
    // A strided block: rows of 100 bytes out of rows of 256.
    let mut t = trio(&config);
    let buf = pattern(256 * 1000, 9);
    t[1].send(7, Endpoint::dst(1), segments(&buf, 1000, 100, 256)).unwrap();
    let (_, p) = t[2].recv(7, when()).unwrap();
    let want: Vec<u8> = buf.chunks(256).flat_map(|r| r[..100].to_vec()).collect();
    assert!(bytes_of(p) == want);
}

#[test]
fn corrupt_frames_are_caught_on_both_kinds_of_link() {
    let mut config = with_checksum();
    config.tcp.hook = Faults { corrupt_frame: Some(0), ..Faults::default() }.hook();
    for (big, tiny) in [(false, false), (true, false), (true, true)] {
        if tiny {
            config.shm = ShmConfig { lend_bytes: 4096, stream_bytes: 1024, ..ShmConfig::default() };
        }
        let mut t = trio(&config);
        let buf = pattern(if big { 100_000 } else { 1000 }, 3);
        // src 0 -> dst 0 over TCP, dst 1 -> dst 0 over shared memory: each
        // transport's first frame is the corrupt one.
        t[0].send(0, Endpoint::dst(0), contiguous(&buf)).unwrap();
        t[2].send(0, Endpoint::dst(0), contiguous(&buf)).unwrap();
        let when = Instant::now() + Duration::from_secs(10);
        let mut seen = Vec::new();
        for _ in 0..2 {
            match t[1].recv(0, when) {
                Err(TransportError::Corrupt { peer, round: 0 }) => seen.push(peer),
                other => panic!("{other:?}"),
            }
        }
        seen.sort();
        assert_eq!(seen, vec![Endpoint::src(0), Endpoint::dst(1)]);
    }
}

/// A corrupt message fails the receiving rank's program, and none of its
/// bytes reach the destination buffers.
#[test]
fn a_corrupt_message_never_reaches_destination_memory() {
    let src = parse_layout(r#"{"ranks": 1, "tensors": [{"name": "w", "dtype": "f32", "shape": [64, 32], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}"#).unwrap();
    let dst = parse_layout(r#"{"ranks": 1, "tensors": [{"name": "w", "dtype": "f32", "shape": [64, 32], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}"#).unwrap();
    let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
    let programs = plan.programs(&src, &dst).unwrap();
    let mut config = with_checksum();
    config.tcp.hook = Faults { corrupt_frame: Some(0), ..Faults::default() }.hook();
    // Over TCP (different nodes), then over shared memory (one node).
    for one_node in [false, true] {
        let mut memory = RankMemory::for_programs(&programs);
        fill_sources(&src, &mut memory[..1]);
        let got = run_node(
            &programs,
            &mut memory,
            &deadline(10),
            |e| if one_node { 0 } else { e.rank + 10 * (e.group == reshard::Group::Dst) as u32 },
            &config,
        );
        assert!(
            matches!(got, Err(ExecError::Transport(TransportError::Corrupt { peer, round: 0 })) if peer == Endpoint::src(0)),
            "{got:?}"
        );
        assert!(memory[1].buffers.iter().all(|b| b.iter().all(|&x| x == 0)), "destination written");
    }
}

#[test]
fn a_stalled_sender_makes_its_receiver_time_out_at_the_deadline() {
    let mut config = NodeTransportConfig::default();
    config.tcp.hook = Faults { stall_at_frame: Some(1), ..Faults::default() }.hook();
    let mut t = trio(&config);
    let buf = pattern(5000, 1);
    // dst 0 -> dst 1 over shared memory, src 0 -> dst 1 over TCP.
    t[1].send(0, Endpoint::dst(1), contiguous(&buf)).unwrap();
    t[1].send(1, Endpoint::dst(1), contiguous(&buf)).unwrap(); // dropped
    t[0].send(0, Endpoint::dst(1), contiguous(&buf)).unwrap();
    t[0].send(1, Endpoint::dst(1), contiguous(&buf)).unwrap(); // dropped
    let long = Instant::now() + Duration::from_secs(10);
    for _ in 0..2 {
        assert!(bytes_of(t[2].recv(0, long).unwrap().1) == buf);
    }
    let start = Instant::now();
    let wait = Duration::from_millis(300);
    let got = t[2].recv(1, start + wait);
    assert_eq!(got.err(), Some(TransportError::timeout(Endpoint::dst(1), 1)));
    assert!(start.elapsed() >= wait);
}

/// A destination that gives up names the peer whose message it still
/// waited for, and what it knew of that peer's stream (up, nothing taken
/// from it); not the source whose message came.
#[test]
fn a_timeout_names_the_peers_still_awaited_and_their_streams() {
    let one = |ranks: u32, placement: &str| {
        parse_layout(&format!(
            r#"{{"ranks": {ranks}, "tensors": [{{"name": "w", "dtype": "f32", "shape": [64, 32], "mesh": {{"shape": [{ranks}]}}, "placements": ["{placement}"]}}]}}"#
        ))
        .unwrap()
    };
    let (src, dst) = (one(2, "shard(0)"), one(1, "replicate"));
    let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
    let programs = plan.programs(&src, &dst).unwrap();
    let endpoints: Vec<Endpoint> = programs.iter().map(|p| p.endpoint).collect();
    let stalled = Endpoint::src(0);
    let faults = move |e| if e == stalled { Faults { stall_at_frame: Some(0), ..Faults::default() } } else { Faults::default() };
    // Every rank its own node: TCP everywhere.
    let node_of = |e: Endpoint| e.rank + 10 * (e.group == reshard::Group::Dst) as u32;
    let mut fabric = transport::node_fabric_with_faults(&endpoints, node_of, &NodeTransportConfig::default(), faults).unwrap();
    let mut memory = RankMemory::for_programs(&programs);
    fill_sources(&src, &mut memory[..2]);
    let options = ExecOptions { deadline: Duration::from_millis(500) };
    // Every rank's end stays open until all are done (as a member keeps
    // its own between refits): a source that finished says no goodbye.
    let results: Vec<_> = std::thread::scope(|s| {
        let runs: Vec<_> = programs
            .iter()
            .zip(fabric.iter_mut())
            .zip(memory.iter_mut())
            .map(|((p, t), m)| s.spawn(move || transport::run_rank(p, m, t, &options)))
            .collect();
        runs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(results[..2].iter().all(|r| r.is_ok()), "{results:?}");
    let got = &results[2];
    let Err(ExecError::Transport(e @ TransportError::Timeout { me, round: 0, waiting, closed: false })) = got else {
        panic!("{got:?}");
    };
    assert_eq!(*me, Endpoint::dst(0));
    assert_eq!(waiting.iter().map(|w| w.peer).collect::<Vec<_>>(), vec![stalled], "{e}");
    let link = waiting[0].link.as_deref().unwrap_or_default();
    assert!(link.starts_with("stream up, 0 messages taken from it") && link.contains("received on the stream"), "{e}");
    assert!(e.to_string().starts_with("dst rank 0: timed out waiting for round 0 messages from src rank 0 (stream up"), "{e}");
}

/// A rank every peer of which has said goodbye stops waiting at once, and
/// says why, rather than that its deadline passed.
#[test]
fn a_rank_whose_peers_all_left_does_not_wait_for_its_deadline() {
    let mut t = trio(&NodeTransportConfig::default());
    let last = t.pop().unwrap();
    drop(t);
    let mut last = last;
    let start = Instant::now();
    let got = last.recv(0, start + Duration::from_secs(30));
    assert!(start.elapsed() < Duration::from_secs(10), "{:?}", start.elapsed());
    let Err(e @ TransportError::Timeout { closed: true, .. }) = &got else { panic!("{got:?}") };
    assert_eq!(e.to_string(), "dst rank 1: no more round 0 messages can arrive: every stream to this rank ended");
}

#[test]
fn a_cut_connection_is_reported_broken() {
    let mut config = NodeTransportConfig::default();
    config.tcp.hook = Faults { cut_at_frame: Some(0), ..Faults::default() }.hook();
    let buf = pattern(5000, 1);
    // Over TCP and over shared memory.
    for (from, i) in [(Endpoint::src(0), 0), (Endpoint::dst(1), 2)] {
        let mut t = trio(&config);
        assert_eq!(t[i].send(0, Endpoint::dst(0), contiguous(&buf)).err(), Some(TransportError::Disconnected { peer: Endpoint::dst(0) }));
        let got = t[1].recv(0, Instant::now() + Duration::from_secs(10));
        assert!(matches!(&got, Err(TransportError::Broken { peer, .. }) if *peer == from), "{got:?}");
    }
}

#[test]
fn aborts_reach_every_peer_even_after_a_hang() {
    let mut config = NodeTransportConfig::default();
    config.tcp.hook = Faults { abort_hang: Some(Duration::from_millis(100)), ..Faults::default() }.hook();
    let mut t = trio(&config);
    let start = Instant::now();
    t[1].abort("giving up");
    assert!(start.elapsed() >= Duration::from_millis(100));
    for i in [0, 2] {
        let got = t[i].recv(0, Instant::now() + Duration::from_secs(10));
        assert_eq!(got.err(), Some(TransportError::PeerAborted { peer: Endpoint::dst(0), reason: "giving up".into() }));
    }
}

#[test]
fn mismatched_checksum_settings_fail_the_handshake_clearly() {
    let (a, b) = (Endpoint::src(0), Endpoint::dst(0));
    let (la, lb) = (TcpListener::bind("127.0.0.1:0").unwrap(), TcpListener::bind("127.0.0.1:0").unwrap());
    let peers = [(a, la.local_addr().unwrap()), (b, lb.local_addr().unwrap())];
    let on = TcpConfig { checksum: true, connect_timeout: Duration::from_secs(5), ..TcpConfig::default() };
    let off = TcpConfig { checksum: false, ..on.clone() };
    let h = std::thread::spawn(move || TcpTransport::connect(a, la, &peers, &on).map(|_| ()));
    let got = TcpTransport::connect(b, lb, &peers, &off).map(|_| ());
    let other = h.join().unwrap();
    let msg = format!("{:?} {:?}", got.err(), other.err());
    assert!(msg.contains("checksum"), "{msg}");
}

#[test]
fn a_bad_session_id_is_refused() {
    let config = NodeTransportConfig { session: "../etc".into(), ..NodeTransportConfig::default() };
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let me = Endpoint::dst(0);
    let peers = [(me, l.local_addr().unwrap())];
    assert!(NodeTransport::connect(me, l, &peers, |_| 0, &config).is_err());
}

// ---- separate processes ----------------------------------------------

const CHILD: &str = "REFIT_NODE_CHILD";
const SESSION: &str = "REFIT_NODE_SESSION";

fn endpoint_arg(s: &str) -> Endpoint {
    let (g, r) = s.split_once(':').unwrap();
    let r: u32 = r.parse().unwrap();
    if g == "src" {
        Endpoint::src(r)
    } else {
        Endpoint::dst(r)
    }
}

fn endpoint_name(e: Endpoint) -> String {
    format!("{}:{}", if e.group == reshard::Group::Src { "src" } else { "dst" }, e.rank)
}

/// Child side: listen, print the address, read the peer table from stdin,
/// then do what the role says.
fn child_connect(me: Endpoint, config: &NodeTransportConfig, node_of: impl Fn(Endpoint) -> u32) -> NodeTransport {
    use std::io::BufRead;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("\nREFIT@addr {}", l.local_addr().unwrap());
    let mut table = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        if line == "end" {
            break;
        }
        let (e, a) = line.split_once(' ').unwrap();
        table.push((endpoint_arg(e), a.parse::<SocketAddr>().unwrap()));
    }
    NodeTransport::connect(me, l, &table, node_of, config).unwrap()
}

fn process_config() -> NodeTransportConfig {
    let mut c = with_checksum();
    c.session = std::env::var(SESSION).unwrap_or_else(|_| "x".into());
    // Small areas, so both the lend and the stream paths are taken.
    c.shm = ShmConfig { lend_bytes: 32 << 10, stream_bytes: 8 << 10, ..ShmConfig::default() };
    c
}

/// Runs as a child process (only when `REFIT_NODE_CHILD` is set): one rank
/// of the plan, then verification of its own destination buffers.
#[test]
fn child_process_entry() {
    let Ok(role) = std::env::var(CHILD) else { return };
    let (kind, who) = role.split_once('/').unwrap();
    let me = endpoint_arg(who);
    let (src, dst) = layouts();
    match kind {
        "plan" => {
            let plan = plans(256 << 20).remove(0);
            let programs = plan.programs(&src, &dst).unwrap();
            let program = programs.iter().find(|p| p.endpoint == me).unwrap();
            let mut memory = RankMemory::for_buffers(&program.buffers);
            if me.group == reshard::Group::Src {
                transport::fill_source_rank(&src, me.rank, &mut memory);
            }
            let mut t = child_connect(me, &process_config(), |e| plan.node_of(e).1 + 100 * (e.group == reshard::Group::Dst) as u32);
            let shm: Vec<String> = t.shm_peers().into_iter().map(endpoint_name).collect();
            println!("\nREFIT@shm {}", shm.join(","));
            transport::run_rank(program, &mut memory, &mut t, &deadline(30)).unwrap();
            drop(t);
            if me.group == reshard::Group::Dst {
                let n = transport::verify_destination_rank(&src, &dst, me.rank, &memory).unwrap();
                println!("\nREFIT@verified {n}");
            } else {
                println!("\nREFIT@sent");
            }
        }
        "idle" | "idle-tcp" => {
            // Connect (on the parent's node, or on another one), say so,
            // then wait to be killed.
            let one_node = kind == "idle";
            let _t = child_connect(me, &process_config(), move |e| if one_node { 0 } else { e.rank });
            println!("\nREFIT@ready");
            std::thread::sleep(Duration::from_secs(60));
        }
        _ => panic!("unknown role {role}"),
    }
}

struct Child {
    child: std::process::Child,
    out: std::io::BufReader<std::process::ChildStdout>,
}

impl Child {
    fn spawn(role: &str, session: &str) -> Child {
        Child::spawn_as(role, session, None)
    }

    /// As [`Child::spawn`], as user and group `uid` if given (root only).
    fn spawn_as(role: &str, session: &str, uid: Option<u32>) -> Child {
        use std::os::unix::process::CommandExt;
        let mut command = std::process::Command::new(std::env::current_exe().unwrap());
        command
            .args(["child_process_entry", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, role)
            .env(SESSION, session)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        if let Some(uid) = uid {
            command.uid(uid).gid(uid);
        }
        let mut child = command.spawn().unwrap();
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        Child { child, out }
    }

    /// The next line starting with `prefix` (the test harness prints others).
    fn line(&mut self, prefix: &str) -> String {
        use std::io::BufRead;
        loop {
            let mut l = String::new();
            assert!(self.out.read_line(&mut l).unwrap() > 0, "child ended before printing {prefix:?}");
            if let Some(i) = l.find(&format!("REFIT@{prefix}")) {
                return l[i + 6 + prefix.len()..].trim().to_string();
            }
        }
    }

    fn send_table(&mut self, table: &[(Endpoint, String)]) {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().unwrap();
        for (e, a) in table {
            writeln!(stdin, "{} {a}", endpoint_name(*e)).unwrap();
        }
        writeln!(stdin, "end").unwrap();
        stdin.flush().unwrap();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every rank of a plan is its own process: sources on two nodes,
/// destinations on two nodes whose leaders fan out to their neighbours
/// through shared memory; each destination process checks its buffers.
#[test]
fn one_process_per_rank_is_bit_exact() {
    let (src, dst) = layouts();
    let session = format!("proc-{}", std::process::id());
    let ranks: Vec<Endpoint> = (0..src.ranks()).map(Endpoint::src).chain((0..dst.ranks()).map(Endpoint::dst)).collect();
    let shm = run_processes(&ranks, &session, |_| None);
    // Ranks of one node talk through shared memory, and leave no file
    // behind.
    assert_eq!(shm[&Endpoint::dst(0)], "dst:1");
    assert_eq!(shm[&Endpoint::dst(3)], "dst:2");
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(&session))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// Runs every rank of the plan as a process of its own (as user `uid_of`
/// the rank, if given), each destination checking its buffers; returns
/// the peers each rank talks to through shared memory.
fn run_processes(ranks: &[Endpoint], session: &str, uid_of: impl Fn(Endpoint) -> Option<u32>) -> HashMap<Endpoint, String> {
    let mut children: Vec<Child> =
        ranks.iter().map(|e| Child::spawn_as(&format!("plan/{}", endpoint_name(*e)), session, uid_of(*e))).collect();
    let table: Vec<(Endpoint, String)> = ranks.iter().zip(&mut children).map(|(e, c)| (*e, c.line("addr"))).collect();
    for c in &mut children {
        c.send_table(&table);
    }
    let mut shm = HashMap::new();
    for (e, c) in ranks.iter().zip(&mut children) {
        shm.insert(*e, c.line("shm"));
        if e.group == reshard::Group::Dst {
            let n: u64 = c.line("verified").parse().unwrap();
            assert!(n > 0);
        } else {
            c.line("sent");
        }
        assert!(c.child.wait().unwrap().success(), "{e} failed");
    }
    shm
}

/// Ranks of one node run by two users (a trainer and an engine under
/// different service accounts): neither can map the other's regions
/// (both ends check the region's owner), so each such pair talks TCP,
/// and the refit is bit-exact; pairs of one user still share memory.
/// Needs root (to start processes as another user).
#[test]
fn ranks_of_two_users_on_one_node_talk_tcp() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: starting processes as another user needs root");
        return;
    }
    let (src, dst) = layouts();
    let session = format!("users-{}", std::process::id());
    let ranks: Vec<Endpoint> = (0..src.ranks()).map(Endpoint::src).chain((0..dst.ranks()).map(Endpoint::dst)).collect();
    // Destination nodes {0, 1} and {2, 3}: ranks 1 and 2 run as another
    // user, so each node holds one rank of each user; so do the sources'.
    let other = |e: Endpoint| (e.rank == 1 || e.rank == 2).then_some(54_321);
    let shm = run_processes(&ranks, &session, other);
    for (e, peers) in &shm {
        assert_eq!(peers, "", "{e} shares memory with {peers} across users");
    }
}

/// A peer process is killed (on this node, then on another): a sender
/// waiting for its stream space or writing to its socket, and a receiver
/// waiting for its message, all fail fast.
#[test]
fn a_killed_peer_process_is_an_error_not_a_hang() {
    for one_node in [true, false] {
        let session = format!("kill-{}-{one_node}", std::process::id());
        let (me, peer) = (Endpoint::dst(0), Endpoint::dst(1));
        let kind = if one_node { "idle" } else { "idle-tcp" };
        let mut child = Child::spawn(&format!("{kind}/{}", endpoint_name(peer)), &session);
        let peer_addr = child.line("addr");
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let table = vec![(me, l.local_addr().unwrap().to_string()), (peer, peer_addr)];
        child.send_table(&table);
        let peers: Vec<(Endpoint, SocketAddr)> = table.iter().map(|(e, a)| (*e, a.parse().unwrap())).collect();
        let config = NodeTransportConfig { session, ..process_config() };
        let mut t = NodeTransport::connect(me, l, &peers, move |e| if one_node { 0 } else { e.rank }, &config).unwrap();
        assert_eq!(t.shm_peers(), if one_node { vec![peer] } else { vec![] });
        child.line("ready");
        child.child.kill().unwrap();
        let _ = child.child.wait();
        let start = Instant::now();
        // 4 MiB: through an 8 KiB stream area nobody drains any more, or
        // into a socket whose other end is gone.
        let buf = pattern(4 << 20, 5);
        let sent = t.send(0, peer, contiguous(&buf));
        assert!(matches!(sent, Err(TransportError::Broken { .. } | TransportError::Disconnected { .. })), "{sent:?}");
        let got = t.recv(0, start + Duration::from_secs(20));
        assert!(matches!(&got, Err(TransportError::Broken { peer: p, .. }) if *p == peer), "{got:?}");
        assert!(start.elapsed() < Duration::from_secs(10));
    }
}

/// One fabric kept for several refits (frame buffers and shared-memory
/// space reused), over the node transport and plain TCP: every refit
/// bit-exact.
#[test]
fn a_fabric_serves_many_refits() {
    let (src, dst) = layouts();
    let plan = plans(256 << 20).remove(0);
    let programs = plan.programs(&src, &dst).unwrap();
    let endpoints: Vec<Endpoint> = programs.iter().map(|p| p.endpoint).collect();
    let mut config = with_checksum();
    // Frames of 64 KiB and more come from the pool (the "e" pieces).
    config.tcp.frame_pool_bytes = 1 << 20;
    config.shm = ShmConfig { lend_bytes: 48 << 10, stream_bytes: 8 << 10, ..ShmConfig::default() };
    let mut fabric = node_fabric(&endpoints, |e| plan.node_of(e), &config).unwrap();
    for _ in 0..3 {
        let mut memory = RankMemory::for_programs(&programs);
        fill_sources(&src, &mut memory[..4]);
        transport::run_threads(&programs, &mut memory, &deadline(30), fabric.iter_mut().collect()).unwrap();
        verify_destinations(&src, &dst, &memory[4..]).unwrap();
    }
    let mut fabric = transport::tcp_fabric(&endpoints, &config.tcp).unwrap();
    for _ in 0..3 {
        let mut memory = RankMemory::for_programs(&programs);
        fill_sources(&src, &mut memory[..4]);
        transport::run_threads(&programs, &mut memory, &deadline(30), fabric.iter_mut().collect()).unwrap();
        verify_destinations(&src, &dst, &memory[4..]).unwrap();
    }
}

/// One source rank sends a corrupt frame in the middle of a plan: the
/// refit fails with that root cause (the others stop on the abort).
#[test]
fn one_corrupting_rank_fails_the_refit_with_its_name() {
    let (src, dst) = layouts();
    for plan in plans(256 << 20) {
        let programs = plan.programs(&src, &dst).unwrap();
        let endpoints: Vec<Endpoint> = programs.iter().map(|p| p.endpoint).collect();
        // A source that sends, and a destination leader that forwards (its
        // first frame goes over shared memory or TCP).
        for bad in [Endpoint::src(1), Endpoint::dst(0)] {
            let faults = move |e| if e == bad { Faults { corrupt_frame: Some(0), ..Faults::default() } } else { Faults::default() };
            let fabric = transport::node_fabric_with_faults(&endpoints, |e| plan.node_of(e), &with_checksum(), faults).unwrap();
            let mut memory = RankMemory::for_programs(&programs);
            fill_sources(&src, &mut memory[..4]);
            let got = transport::run_threads(&programs, &mut memory, &deadline(20), fabric);
            let sends = programs.iter().find(|p| p.endpoint == bad).unwrap().rounds.iter().any(|r| !r.sends.is_empty());
            if sends {
                assert!(matches!(&got, Err(ExecError::Transport(TransportError::Corrupt { peer, .. })) if *peer == bad), "{got:?}");
            } else {
                got.unwrap();
            }
        }
    }
}
