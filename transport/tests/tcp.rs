//! The TCP data plane: every rank a thread, talking over loopback streams;
//! results bit-exact, and bad frames an error rather than a panic.

use reshard::{parse_layout, plan_baseline, plan_reshard, Endpoint, PlanOptions};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};
use transport::tcp::{TcpConfig, TcpTransport};
use transport::{fill_sources, run_tcp, verify_destinations, ExecOptions, RankMemory, Transport, TransportError};

const SRC: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [37, 11], "mesh": {"shape": [2, 2]}, "placements": ["shard(0)", "shard(1)"]},
  {"name": "q", "dtype": "bf16", "shape": [8, 4], "shards": [
     {"rank": 0, "offset": [0, 0], "extent": [4, 4], "buffer": "qkv", "at": 0},
     {"rank": 3, "flat": [16, 16]}]}]}"#;
const DST: &str = r#"{"ranks": 3, "ranks_per_node": 1, "tensors": [
  {"name": "w", "dtype": "bf16", "shape": [37, 11], "mesh": {"shape": [3]}, "placements": ["shard(1)"]},
  {"name": "q", "dtype": "f32", "shape": [8, 4], "mesh": {"shape": [3]}, "placements": ["replicate"]}]}"#;

fn check(max_staging_bytes: u64) {
    let (src, dst) = (parse_layout(SRC).unwrap(), parse_layout(DST).unwrap());
    let opts = PlanOptions { max_staging_bytes, ..PlanOptions::default() };
    for plan in [plan_reshard(&src, &dst, &opts).unwrap(), plan_baseline(&src, &dst, &opts).unwrap()] {
        let programs = plan.programs(&src, &dst).unwrap();
        let mut memory = RankMemory::for_programs(&programs);
        fill_sources(&src, &mut memory[..4]);
        let report = run_tcp(&programs, &mut memory, &ExecOptions { deadline: Duration::from_secs(20) }, &TcpConfig::default()).unwrap();
        assert_eq!(report.bytes, plan.figures().total_bytes);
        let checked = verify_destinations(&src, &dst, &memory[4..]).unwrap();
        assert!(checked > 0);
    }
}

#[test]
fn reshard_and_baseline_are_bit_exact_over_tcp() {
    check(256 << 20);
}

#[test]
fn many_small_rounds_are_bit_exact_over_tcp() {
    check(64);
}

/// A peer that sends garbage after a valid handshake gets the stream
/// reported as broken, never a panic or a huge allocation.
#[test]
fn garbage_frames_are_reported_not_trusted() {
    for garbage in
        [&b"XXXXXXXXXXXXXXXXXXXXXXXXX"[..], &[0x52, 0x46, 0x49, 0x54, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f][..]]
    {
        let me = Endpoint::dst(0);
        let fake = Endpoint::src(0);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let my_addr = listener.local_addr().unwrap();
        let fake_listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let fake_addr = fake_listener.local_addr().unwrap();
        let garbage = garbage.to_vec();
        let peer = std::thread::spawn(move || {
            // Accept the real transport's stream and answer its handshake
            // (magic, endpoint, version, flags), then send ours.
            let (mut incoming, _) = fake_listener.accept().unwrap();
            let mut hello = [0u8; 11];
            incoming.read_exact(&mut hello).unwrap();
            incoming.write_all(&[0]).unwrap();
            let mut s = TcpStream::connect(my_addr).unwrap();
            s.write_all(&0x5449_4652u32.to_le_bytes()).unwrap();
            s.write_all(&[0, 0, 0, 0, 0, 2, 0]).unwrap();
            let mut answer = [0u8; 1];
            s.read_exact(&mut answer).unwrap();
            assert_eq!(answer, [0]);
            s.write_all(&garbage).unwrap();
            std::thread::sleep(Duration::from_millis(200));
        });
        let config = TcpConfig { max_frame_bytes: 1 << 20, ..TcpConfig::default() };
        let mut t = TcpTransport::connect(me, listener, &[(me, my_addr), (fake, fake_addr)], &config).unwrap();
        let got = t.recv(0, Instant::now() + Duration::from_secs(5));
        assert!(matches!(got, Err(TransportError::Broken { peer, .. }) if peer == fake), "{got:?}");
        peer.join().unwrap();
    }
}

/// A peer whose listener is gone refuses the connection. Where every peer
/// is known to be listening already (`peers_listening`), that fails the
/// connect at once; otherwise the rank keeps retrying (the peer may still
/// be starting) until the connect timeout.
#[test]
fn a_refused_peer_fails_the_connect_at_once_when_peers_are_known_to_listen() {
    let gone = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let try_connect = |peers_listening: bool| {
        let me = TcpListener::bind("127.0.0.1:0").unwrap();
        let config = TcpConfig { connect_timeout: Duration::from_secs(2), peers_listening, ..TcpConfig::default() };
        let t = Instant::now();
        let r = TcpTransport::connect(Endpoint::src(0), me, &[(Endpoint::dst(0), gone)], &config);
        (r.err().map(|e| e.to_string()), t.elapsed())
    };
    let (err, took) = try_connect(true);
    assert!(err.as_deref().is_some_and(|e| e.contains("refused")), "{err:?}");
    assert!(took < Duration::from_secs(1), "{took:?}");
    let (err, took) = try_connect(false);
    assert!(err.is_some());
    assert!(took >= Duration::from_secs(2), "retried only {took:?}");
}
