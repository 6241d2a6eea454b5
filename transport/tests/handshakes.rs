//! Incoming data-plane handshakes at scale: hundreds of connections arrive
//! at a rank at once, among them hundreds of silent strangers, and every
//! handshake is checked without a thread of its own (the rank's accepting
//! thread reads them all as their bytes arrive). A test binary of its own,
//! so that the threads of this process are this test's alone.

use reshard::{Endpoint, Group};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};
use transport::HelloKey;
use transport::{TcpConfig, TcpTransport};

/// The handshake of `who` to `to` as a holder of `key` sends it: the fixed
/// part (magic, endpoint, version 4, flags: proof) and the proof.
fn hello(who: Endpoint, to: Endpoint, key: &HelloKey) -> Vec<u8> {
    use hmac::Mac;
    let wire = |e: Endpoint| {
        let mut b = vec![match e.group {
            Group::Src => 0,
            Group::Dst => 1,
        }];
        b.extend_from_slice(&e.rank.to_le_bytes());
        b
    };
    let mut h = 0x5449_4652u32.to_le_bytes().to_vec();
    h.extend_from_slice(&wire(who));
    h.extend_from_slice(&[5, 4]);
    let mut mac = <hmac::Hmac<sha2::Sha256> as hmac::digest::KeyInit>::new_from_slice(&key.0).unwrap();
    mac.update(b"refit-data-hello/v4/");
    mac.update(&h);
    mac.update(&wire(to));
    h.extend_from_slice(&mac.finalize().into_bytes());
    h
}

/// This process's threads, from `/proc`.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
}

/// Raises this process's soft limit on descriptors towards `want` (as far
/// as the hard limit allows); returns the limit now in force.
fn raise_descriptor_limit(want: u64) -> u64 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `lim` is a live rlimit structure `getrlimit` fills.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 1024;
    }
    if lim.rlim_cur < want {
        let raised = libc::rlimit { rlim_cur: want.min(lim.rlim_max), rlim_max: lim.rlim_max };
        // SAFETY: `raised` is a live, initialised rlimit structure `setrlimit` reads.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return raised.rlim_cur;
        }
    }
    lim.rlim_cur
}

/// A rank expecting hundreds of peers: silent strangers connect first,
/// then every peer connects and sends the first part of its handshake,
/// then more silent strangers (more strangers in all than the rank holds
/// unfinished handshakes beyond its peers). While all of those
/// handshakes are under way the process has only a few threads more than
/// before (a thread per handshake would mean hundreds); then every peer
/// finishes its handshake and each one is accepted, the silent ones
/// having held up none of them, and every stranger still connected is
/// closed once the rank has all its peers.
#[test]
fn hundreds_of_handshakes_are_checked_without_a_thread_each_and_silent_ones_block_none() {
    // Descriptors, both ends of each connection in this process: the
    // rank's own connections out, the peers' in, the strangers.
    let limit = raise_descriptor_limit(8192);
    let peers = (300u64).min(limit.saturating_sub(128) / 8) as u32;
    assert!(peers >= 100, "only {limit} descriptors: too few for this test");
    let strangers = peers as usize / 2 + 100;
    let key = HelloKey([7; 32]);
    let me = Endpoint::dst(0);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let my_addr = listener.local_addr().unwrap();
    // Every peer's own port is one listener here: it takes the rank's
    // connection to each peer in turn (the rank dials them one by one) and
    // accepts its handshake.
    let ports = TcpListener::bind("127.0.0.1:0").unwrap();
    let ports_addr = ports.local_addr().unwrap();
    let before = threads();
    let answering = std::thread::spawn(move || {
        let mut kept = Vec::new();
        for _ in 0..peers {
            let (mut s, _) = ports.accept().unwrap();
            let mut h = [0u8; 11 + 32];
            s.read_exact(&mut h).unwrap();
            s.write_all(&[0]).unwrap();
            kept.push(s);
        }
        kept
    });
    let table: Vec<(Endpoint, SocketAddr)> =
        std::iter::once((me, my_addr)).chain((0..peers).map(|r| (Endpoint::src(r), ports_addr))).collect();
    let config = TcpConfig { hello_key: Some(key.clone()), connect_timeout: Duration::from_secs(120), ..TcpConfig::default() };
    let mine = std::thread::spawn(move || TcpTransport::connect(me, listener, &table, &config));

    let silent = |n: usize| -> Vec<TcpStream> { (0..n).map(|_| TcpStream::connect(my_addr).unwrap()).collect() };
    let mut quiet = silent(strangers / 2);
    let hellos: Vec<Vec<u8>> = (0..peers).map(|r| hello(Endpoint::src(r), me, &key)).collect();
    let mut honest: Vec<TcpStream> = hellos
        .iter()
        .map(|h| {
            let mut s = TcpStream::connect(my_addr).unwrap();
            s.write_all(&h[..11]).unwrap();
            s
        })
        .collect();
    quiet.extend(silent(strangers - strangers / 2));

    // All of those handshakes are under way now (none can finish): the
    // threads of the process while the rank reads them.
    let mut most = threads();
    let watch = Instant::now();
    while watch.elapsed() < Duration::from_millis(500) {
        most = most.max(threads());
        std::thread::sleep(Duration::from_millis(5));
    }
    // The rank's connecting and accepting threads, and the peers' port.
    let extra = most.saturating_sub(before);
    assert!(extra <= 8, "{extra} threads more while {} handshakes were under way", peers as usize + strangers);

    for (s, h) in honest.iter_mut().zip(&hellos) {
        s.write_all(&h[11..]).unwrap();
    }
    let answers: Vec<u8> = honest
        .iter_mut()
        .map(|s| {
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let mut a = [0u8; 1];
            s.read_exact(&mut a).map(|_| a[0]).unwrap_or(u8::MAX)
        })
        .collect();
    assert!(answers.iter().all(|&a| a == 0), "answers (0: accepted): {answers:?}");
    let t = mine.join().unwrap().unwrap();
    assert_eq!(t.peers().len(), peers as usize);
    let _outgoing = answering.join().unwrap();
    // The strangers: closed, whether dropped to make room or at the end.
    for mut s in quiet {
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut b = [0u8; 1];
        // Closed (0 bytes), or reset: still in the backlog when the
        // listener went.
        let got = s.read(&mut b);
        let closed = matches!(&got, Ok(0)) || matches!(&got, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset);
        assert!(closed, "a silent stranger was not closed: {got:?}");
    }
    drop(honest);
}
