//! The TCP data plane: every rank a thread, talking over loopback streams;
//! results bit-exact, and bad frames an error rather than a panic.

use reshard::{parse_layout, plan_baseline, plan_reshard, Endpoint, Group, PlanOptions};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};
use transport::{fill_sources, run_tcp, verify_destinations, ExecOptions, HelloKey, Payload, RankMemory, Transport, TransportError};
use transport::{tcp_fabric_for, TcpConfig, TcpTransport};

const SRC: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [37, 11], "mesh": {"shape": [2, 2]}, "placements": ["shard(0)", "shard(1)"]},
  {"name": "q", "dtype": "bf16", "shape": [8, 4], "shards": [
     {"rank": 0, "offset": [0, 0], "extent": [4, 4], "buffer": "qkv", "at": 0},
     {"rank": 3, "flat": [16, 16]}]}]}"#;
const DST: &str = r#"{"ranks": 3, "ranks_per_node": 1, "tensors": [
  {"name": "w", "dtype": "bf16", "shape": [37, 11], "mesh": {"shape": [3]}, "placements": ["shard(1)"]},
  {"name": "q", "dtype": "f32", "shape": [8, 4], "mesh": {"shape": [3]}, "placements": ["replicate"]}]}"#;

fn check(max_staging_bytes: u64) {
    check_pair(SRC, DST, max_staging_bytes);
}

fn check_pair(src: &str, dst: &str, max_staging_bytes: u64) {
    let (src, dst) = (parse_layout(src).unwrap(), parse_layout(dst).unwrap());
    let n_src = src.ranks() as usize;
    let opts = PlanOptions { max_staging_bytes, ..PlanOptions::default() };
    for plan in [plan_reshard(&src, &dst, &opts).unwrap(), plan_baseline(&src, &dst, &opts).unwrap()] {
        let programs = plan.programs(&src, &dst).unwrap();
        let mut memory = RankMemory::for_programs(&programs);
        fill_sources(&src, &mut memory[..n_src]);
        let report = run_tcp(&programs, &mut memory, &ExecOptions { deadline: Duration::from_secs(20) }, &TcpConfig::default()).unwrap();
        assert_eq!(report.bytes, plan.figures().total_bytes);
        let checked = verify_destinations(&src, &dst, &memory[n_src..]).unwrap();
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

/// `tcp_fabric_for` connects a rank only to the ranks its program
/// exchanges messages with: source rank i and destination rank i hold the
/// same shard, so each talks to its counterpart alone (all to all would
/// open 3 streams per rank), and the refit over those streams is bit-exact.
#[test]
fn a_fabric_for_programs_connects_only_the_pairs_that_talk() {
    let layout = |ranks: u32| {
        format!(
            r#"{{"ranks": {ranks}, "tensors": [{{"name": "w", "dtype": "f32", "shape": [8, 4],
                "mesh": {{"shape": [{ranks}]}}, "placements": ["shard(0)"]}}]}}"#
        )
    };
    let (src, dst) = (parse_layout(&layout(2)).unwrap(), parse_layout(&layout(2)).unwrap());
    let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
    let programs = plan.programs(&src, &dst).unwrap();
    let transports = tcp_fabric_for(&programs, &TcpConfig::default()).unwrap();
    let peers: Vec<Vec<Endpoint>> = transports.iter().map(TcpTransport::peers).collect();
    assert_eq!(peers, [vec![Endpoint::dst(0)], vec![Endpoint::dst(1)], vec![Endpoint::src(0)], vec![Endpoint::src(1)]]);
    let mut memory = RankMemory::for_programs(&programs);
    fill_sources(&src, &mut memory[..2]);
    let report = transport::run_threads(&programs, &mut memory, &ExecOptions { deadline: Duration::from_secs(20) }, transports).unwrap();
    assert_eq!(report.bytes, plan.figures().total_bytes);
    assert!(verify_destinations(&src, &dst, &memory[2..]).unwrap() > 0);
}

/// One message mixing what a receiver reads straight into place (long
/// rows), what it stages with its neighbours (short rows; converted pieces
/// of 2- and 4-byte elements back to back, so staged pieces need
/// re-aligning) and a converted piece larger than its stage (512 KiB on
/// the wire), every element checked.
#[test]
fn staged_and_direct_pieces_share_a_message_over_tcp() {
    let src = r#"{"ranks": 1, "ranks_per_node": 1, "tensors": [
      {"name": "a", "dtype": "bf16", "shape": [3], "mesh": {"shape": [1]}, "placements": ["replicate"]},
      {"name": "b", "dtype": "f32", "shape": [5], "mesh": {"shape": [1]}, "placements": ["replicate"]},
      {"name": "c", "dtype": "bf16", "shape": [7, 3], "mesh": {"shape": [1]}, "placements": ["replicate"]},
      {"name": "d", "dtype": "bf16", "shape": [64, 300], "mesh": {"shape": [1]}, "placements": ["replicate"]},
      {"name": "e", "dtype": "bf16", "shape": [512, 512], "mesh": {"shape": [1]}, "placements": ["replicate"]},
      {"name": "f", "dtype": "bf16", "shape": [9], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}"#;
    let dst = r#"{"ranks": 1, "ranks_per_node": 1, "tensors": [
      {"name": "a", "dtype": "f32", "shape": [3], "mesh": {"shape": [1]}, "placements": ["replicate"]},
      {"name": "b", "dtype": "f32", "shape": [5], "mesh": {"shape": [1]}, "placements": ["replicate"]},
      {"name": "c", "dtype": "bf16", "shape": [7, 3], "mesh": {"shape": [1]}, "placements": ["replicate"]},
      {"name": "d", "dtype": "bf16", "shape": [64, 300], "mesh": {"shape": [1]}, "placements": ["replicate"]},
      {"name": "e", "dtype": "f32", "shape": [512, 512], "mesh": {"shape": [1]}, "placements": ["replicate"]},
      {"name": "f", "dtype": "f32", "shape": [9], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}"#;
    check_pair(src, dst, 256 << 20);
}

/// A listener on a free loopback port, and its address.
fn listen() -> (TcpListener, std::net::SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    (l, addr)
}

/// A peer posing as source rank 0 without a key, on a thread: accepts the
/// real transport's stream on `listener` and answers its handshake, opens
/// its own to `to` with a plain handshake (magic, endpoint, version,
/// flags) and, once accepted, hands that stream to `then`.
fn fake_source(
    listener: TcpListener,
    to: std::net::SocketAddr,
    then: impl FnOnce(&mut TcpStream) + Send + 'static,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let (mut incoming, _) = listener.accept().unwrap();
        let mut hello = [0u8; 11];
        incoming.read_exact(&mut hello).unwrap();
        incoming.write_all(&[0]).unwrap();
        let mut s = TcpStream::connect(to).unwrap();
        s.write_all(&0x5449_4652u32.to_le_bytes()).unwrap();
        s.write_all(&[0, 0, 0, 0, 0, 5, 0]).unwrap();
        let mut answer = [0u8; 1];
        s.read_exact(&mut answer).unwrap();
        assert_eq!(answer, [0]);
        then(&mut s);
    })
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
        let ((listener, my_addr), (fake_listener, fake_addr)) = (listen(), listen());
        let garbage = garbage.to_vec();
        let peer = fake_source(fake_listener, my_addr, move |s| {
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

/// Frame limits are per peer: a frame of 4 KiB from a peer whose limit is
/// 1 KiB is refused on its length (the stream reported broken before a
/// byte of the payload is read), though the rank's default limit (1 MiB,
/// for peers it has no limit for) would have taken it.
#[test]
fn a_peer_is_held_to_its_own_frame_limit() {
    let me = Endpoint::dst(0);
    let fake = Endpoint::src(0);
    let ((listener, my_addr), (fake_listener, fake_addr)) = (listen(), listen());
    let peer = fake_source(fake_listener, my_addr, |s| {
        // A data frame header (magic, kind 0, round 0, length 4096); no payload.
        let mut header = vec![0x52, 0x46, 0x49, 0x54, 0, 0, 0, 0, 0];
        header.extend_from_slice(&4096u64.to_le_bytes());
        s.write_all(&header).unwrap();
        std::thread::sleep(Duration::from_millis(300));
    });
    let config =
        TcpConfig { max_frame_bytes: 1 << 20, max_frame_bytes_from: [(fake, 1 << 10)].into_iter().collect(), ..TcpConfig::default() };
    let mut t = TcpTransport::connect(me, listener, &[(me, my_addr), (fake, fake_addr)], &config).unwrap();
    let got = t.recv(0, Instant::now() + Duration::from_secs(5));
    match got {
        Err(TransportError::Broken { peer, problem }) => {
            assert_eq!(peer, fake);
            assert!(problem.contains("4096") && problem.contains("1024"), "{problem}");
        }
        other => panic!("expected the stream reported broken, got {other:?}"),
    }
    peer.join().unwrap();
}

/// A peer that refuses connections (nothing listening at its address yet,
/// or any more) is tried again, with backoff, until the connect deadline,
/// also where every peer is known to have opened its listener
/// (`peers_listening`): a refusal is no proof that the peer is gone. One
/// that never listens fails the connect at the deadline, with an error
/// naming the peer, its address and what was tried.
///
/// The refusing address is a socket bound on loopback and never listening:
/// it refuses every connection and, held for the whole test, keeps its port
/// from being handed to a listener of a test running alongside (a port
/// freed by dropping a listener could be, and a stranger answering there
/// ended the retrying early).
#[test]
fn a_refused_peer_is_tried_again_until_the_deadline() {
    let (_held, gone) = bound_not_listening();
    for peers_listening in [true, false] {
        let me = TcpListener::bind("127.0.0.1:0").unwrap();
        let config = TcpConfig { connect_timeout: Duration::from_secs(2), peers_listening, ..TcpConfig::default() };
        let t = Instant::now();
        let err = TcpTransport::connect(Endpoint::src(0), me, &[(Endpoint::dst(0), gone)], &config).err().map(|e| e.to_string());
        let took = t.elapsed();
        assert!(took >= Duration::from_secs(2), "gave up after {took:?}: {err:?}");
        let err = err.expect("a peer that never listens fails the connect");
        for want in ["src rank 0", "dst rank 0", &gone.to_string(), "refused the connection", "tries in"] {
            assert!(err.contains(want), "{want:?} not in {err:?}");
        }
    }
}

/// A peer whose listener opens only after this rank first dialed it (its
/// connections refused meanwhile) is connected once it listens: the same
/// socket that refused starts listening,
/// takes the stream, answers its handshake and opens its own.
#[test]
fn a_peer_that_starts_listening_late_is_connected() {
    use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
    let me = Endpoint::dst(0);
    let fake = Endpoint::src(0);
    let (listener, my_addr) = listen();
    let (held, fake_addr) = bound_not_listening();
    let peer = std::thread::spawn(move || {
        // Refused for a while first.
        std::thread::sleep(Duration::from_millis(400));
        // SAFETY: `listen` takes no pointers; `held` is a bound, open socket.
        assert_eq!(unsafe { libc::listen(held.as_raw_fd(), 16) }, 0, "listen: {}", std::io::Error::last_os_error());
        // SAFETY: `held` owned the descriptor; `into_raw_fd` gives that
        // ownership up to the listener, which closes it once.
        let fake_listener = unsafe { TcpListener::from_raw_fd(held.into_raw_fd()) };
        let (mut s, _) = fake_listener.accept().unwrap();
        let mut hello = [0u8; 11];
        s.read_exact(&mut hello).unwrap();
        s.write_all(&[0]).unwrap();
        let mut out = TcpStream::connect(my_addr).unwrap();
        out.write_all(&0x5449_4652u32.to_le_bytes()).unwrap();
        out.write_all(&[0, 0, 0, 0, 0, 5, 0]).unwrap();
        let mut answer = [0u8; 1];
        out.read_exact(&mut answer).unwrap();
        assert_eq!(answer, [0]);
        (s, out)
    });
    let config = TcpConfig { peers_listening: true, connect_timeout: Duration::from_secs(20), ..TcpConfig::default() };
    let t = TcpTransport::connect(me, listener, &[(me, my_addr), (fake, fake_addr)], &config).unwrap();
    assert_eq!(t.peers(), [fake]);
    let _streams = peer.join().unwrap();
}

/// A connection a peer closes before answering its handshake (its
/// acceptor dropped it to make room, or had no room yet) is made again
/// within the connect deadline, even where every peer is known to listen:
/// the third one is accepted.
#[test]
fn a_connection_closed_before_its_answer_is_made_again() {
    let me = Endpoint::dst(0);
    let fake = Endpoint::src(0);
    let ((listener, my_addr), (fake_listener, fake_addr)) = (listen(), listen());
    let peer = std::thread::spawn(move || {
        let handshake = |answer: bool| {
            let (mut s, _) = fake_listener.accept().unwrap();
            let mut hello = [0u8; 11];
            s.read_exact(&mut hello).unwrap();
            if answer {
                s.write_all(&[0]).unwrap();
            }
            s
        };
        drop(handshake(false));
        drop(handshake(false));
        let kept = handshake(true);
        let mut out = TcpStream::connect(my_addr).unwrap();
        out.write_all(&0x5449_4652u32.to_le_bytes()).unwrap();
        out.write_all(&[0, 0, 0, 0, 0, 5, 0]).unwrap();
        let mut answer = [0u8; 1];
        out.read_exact(&mut answer).unwrap();
        assert_eq!(answer, [0]);
        (kept, out)
    });
    let config = TcpConfig { peers_listening: true, connect_timeout: Duration::from_secs(20), ..TcpConfig::default() };
    let t = TcpTransport::connect(me, listener, &[(me, my_addr), (fake, fake_addr)], &config).unwrap();
    assert_eq!(t.peers(), [fake]);
    let _streams = peer.join().unwrap();
}

/// A TCP socket bound to a free loopback port without `listen`: connections
/// to it are refused for as long as the returned descriptor lives, and no
/// other socket can bind the port meanwhile.
fn bound_not_listening() -> (std::os::fd::OwnedFd, std::net::SocketAddr) {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: `socket` takes no pointers.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: a non-negative result of `socket` is a fresh descriptor nothing
    // else owns, so `OwnedFd` closes it exactly once, on every path out of
    // this function too (a failed assert below included).
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let mut addr = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be() },
        sin_zero: [0; 8],
    };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: `addr` is a live, initialised `sockaddr_in` and `len` its size;
    // `bind` reads and `getsockname` writes at most `len` bytes of it.
    let bound = unsafe { libc::bind(fd.as_raw_fd(), (&raw const addr).cast(), len) };
    assert_eq!(bound, 0, "bind: {}", std::io::Error::last_os_error());
    // SAFETY: as for `bind`.
    let named = unsafe { libc::getsockname(fd.as_raw_fd(), (&raw mut addr).cast(), &mut len) };
    assert_eq!(named, 0, "getsockname: {}", std::io::Error::last_os_error());
    (fd, std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, u16::from_be(addr.sin_port))))
}

/// Strangers at a rank's data port while its fabric connects, with the
/// job's key configured: junk bytes, a silent socket, a handshake claiming
/// an expected peer without a proof, with a wrong key's proof, with a
/// forged proof, and a second valid claim of an endpoint already
/// connected. Each is refused and dropped while accepting goes on; the
/// real peers (played here by hand) connect, and a message gets through
/// bit for bit.
#[test]
fn strangers_at_the_data_port_do_not_stop_the_connect() {
    let key = HelloKey([42; 32]);
    let me = Endpoint::dst(0);
    let peers = [Endpoint::src(0), Endpoint::src(1)];
    let (listener, my_addr) = listen();
    // The peers' own ports: each accepts this rank's stream and its
    // handshake (fixed part and proof), and accepts it.
    let mut table = vec![(me, my_addr)];
    let mut outgoing = Vec::new();
    for &p in &peers {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        table.push((p, l.local_addr().unwrap()));
        outgoing.push(std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut h = [0u8; 11 + 32];
            s.read_exact(&mut h).unwrap();
            s.write_all(&[0]).unwrap();
            s
        }));
    }
    // A handshake of `who` to `me`, as a holder of `key` (if any) sends it.
    let hello = |who: Endpoint, key: Option<&HelloKey>| -> Vec<u8> {
        let mut h = 0x5449_4652u32.to_le_bytes().to_vec();
        h.push(match who.group {
            Group::Src => 0,
            Group::Dst => 1,
        });
        h.extend_from_slice(&who.rank.to_le_bytes());
        h.extend_from_slice(&[5, if key.is_some() { 4 } else { 0 }]);
        if let Some(k) = key {
            use hmac::Mac;
            let mut mac = <hmac::Hmac<sha2::Sha256> as hmac::digest::KeyInit>::new_from_slice(&k.0).unwrap();
            mac.update(b"refit-data-hello/v4/");
            mac.update(&h);
            mac.update(&[1, 0, 0, 0, 0]);
            h.extend_from_slice(&mac.finalize().into_bytes());
        }
        h
    };
    let claim = |bytes: &[u8]| -> (TcpStream, u8) {
        let mut s = TcpStream::connect(my_addr).unwrap();
        s.write_all(bytes).unwrap();
        let mut a = [0u8; 1];
        let code = s.read_exact(&mut a).map(|_| a[0]).unwrap_or(u8::MAX);
        (s, code)
    };
    let config = TcpConfig { hello_key: Some(key.clone()), connect_timeout: Duration::from_secs(20), ..TcpConfig::default() };
    let mine = {
        let table = table.clone();
        std::thread::spawn(move || TcpTransport::connect(me, listener, &table, &config))
    };
    let mut junk = TcpStream::connect(my_addr).unwrap();
    junk.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let silent = TcpStream::connect(my_addr).unwrap();
    let mut forged = hello(peers[0], Some(&key));
    let last = forged.len() - 1;
    forged[last] ^= 1;
    let mut codes = Vec::new();
    let mut kept = Vec::new();
    for bytes in [hello(peers[0], None), hello(peers[0], Some(&HelloKey([1; 32]))), forged] {
        let (s, code) = claim(&bytes);
        codes.push(code);
        kept.push(s);
    }
    // "Missing or wrong proof" (6) for all three.
    assert_eq!(codes, [6, 6, 6]);
    let (mut from_0, code) = claim(&hello(peers[0], Some(&key)));
    assert_eq!(code, 0, "the real peer is accepted");
    let (_dup, code) = claim(&hello(peers[0], Some(&key)));
    assert_eq!(code, 7, "a second claim of a connected endpoint is refused");
    let (_from_1, code) = claim(&hello(peers[1], Some(&key)));
    assert_eq!(code, 0);
    let mut t = mine.join().unwrap().unwrap();
    let _outgoing: Vec<TcpStream> = outgoing.into_iter().map(|h| h.join().unwrap()).collect();
    // A data frame from the real peer: magic, kind 0, round 0, length.
    let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    let mut frame = 0x5449_4652u32.to_le_bytes().to_vec();
    frame.push(0);
    frame.extend_from_slice(&0u32.to_le_bytes());
    frame.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    frame.extend_from_slice(&bytes);
    from_0.write_all(&frame).unwrap();
    let (from, got) = t.recv(0, Instant::now() + Duration::from_secs(10)).unwrap();
    assert_eq!(from, peers[0]);
    let got = match got {
        Payload::Bytes(b) => b,
        Payload::Lent(l) => l.as_slice().to_vec(),
        Payload::Stream(mut f) => {
            let mut b = vec![0u8; f.len() as usize];
            f.read_exact(&mut b).unwrap();
            b
        }
        other => panic!("{other:?}"),
    };
    assert_eq!(got, bytes);
    drop((junk, silent, kept));
}
