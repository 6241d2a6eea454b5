//! The accepting side of the handshake: one thread per rank polls its
//! listener and the connections whose handshake is under way, checks each
//! handshake as its bytes arrive, and takes, refuses or drops it.

use crate::frame::encode_region_ref;
use crate::frame::{
    decode_hello, hello_problem, proof_holds, HelloKey, ShmAnnounce, FLAG_CHECKSUM, FLAG_PROOF, FLAG_SHM, HELLO, HELLO_CHECKSUM,
    HELLO_DUPLICATE, HELLO_OK, HELLO_PEER, HELLO_PROOF, HELLO_REGION, HELLO_SHM, HELLO_VERSION, PROOF, SHM_ANNOUNCE, VERSION,
};
use crate::tcp::shm_link::{self, ShmReceiver, ShmSetup};
use reshard::Endpoint;
use std::collections::HashSet;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Incoming connections whose handshake is under way, beyond the peers a
/// rank expects, that it holds at once: a newer one drops one of them (a
/// silent one first, the oldest first). Holding one costs a descriptor and
/// a few bytes, no thread.
const MAX_GREETINGS: usize = 64;

/// The longest a rank waits in one `poll` for connections and handshake
/// bytes before it looks at its deadline again.
const POLL_SLICE: Duration = Duration::from_millis(200);

/// What is checked of every incoming handshake.
pub(super) struct Expect<'a> {
    pub(super) me: Endpoint,
    pub(super) deadline: Instant,
    pub(super) expected: &'a HashSet<Endpoint>,
    pub(super) checksum: bool,
    pub(super) shm: Option<&'a ShmSetup>,
    pub(super) key: Option<&'a HelloKey>,
}

/// Why an incoming connection was not taken: `fatal` when it proved
/// knowledge of the job's secret yet disagrees with this rank (another
/// configuration or plan: the connect fails), else it is only dropped.
/// `answer` is the refusal code the connection is told, if any.
struct Refused {
    why: String,
    fatal: bool,
    answer: Option<u8>,
}

impl Refused {
    fn dropped(why: String) -> Refused {
        Refused { why, fatal: false, answer: None }
    }
}

/// An incoming connection whose handshake is being read, without blocking
/// and without a thread of its own: the accepting thread reads whatever
/// has arrived whenever `poll` says there is more.
struct Greeting {
    stream: TcpStream,
    from: SocketAddr,
    /// The handshake's bytes so far (never more than the handshake: frames
    /// follow only once it is answered).
    got: Vec<u8>,
}

impl Greeting {
    /// How long the handshake is in all, as far as its bytes so far tell:
    /// the fixed part, then the shared-memory sizes and the proof its flags
    /// announce (a handshake of another version ends with its fixed part:
    /// it is refused as such).
    fn needs(&self) -> Result<usize, Refused> {
        let Some(fixed) = self.got.first_chunk::<HELLO>() else { return Ok(HELLO) };
        let (_, version, flags) = decode_hello(fixed).map_err(|e| Refused::dropped(format!("not a refit handshake: {e}")))?;
        if version != VERSION {
            return Ok(HELLO);
        }
        let shm = if flags & FLAG_SHM != 0 { SHM_ANNOUNCE } else { 0 };
        let proof = if flags & FLAG_PROOF != 0 { PROOF } else { 0 };
        Ok(HELLO + shm + proof)
    }

    /// Reads what has arrived of the handshake: whether all of it is in.
    fn read(&mut self) -> Result<bool, Refused> {
        let mut buf = [0u8; HELLO + SHM_ANNOUNCE + PROOF];
        loop {
            let needs = self.needs()?;
            let want = needs - self.got.len();
            if want == 0 {
                return Ok(true);
            }
            match (&self.stream).read(&mut buf[..want]) {
                Ok(0) => {
                    return Err(Refused::dropped(format!("closed after {} of the handshake's {needs} bytes", self.got.len())));
                }
                Ok(n) => self.got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Refused::dropped(format!("no handshake: {e}"))),
            }
        }
    }
}

/// Checks a whole handshake (`got`, as [`Greeting::read`] collected it).
/// Returns the peer and the receiving end of the peer's region (for
/// shared-memory peers); a refusal says what to answer. `no_shm` holds the
/// peers whose region this rank could not map: they connect again
/// without one, and talk TCP.
fn check_hello(got: &[u8], x: &Expect<'_>, no_shm: &mut HashSet<Endpoint>) -> Result<(Endpoint, Option<ShmReceiver>), Refused> {
    let fixed = got.first_chunk::<HELLO>().ok_or_else(|| Refused::dropped("short handshake".into()))?;
    let (peer, version, flags) = decode_hello(fixed).map_err(|e| Refused::dropped(format!("not a refit handshake: {e}")))?;
    let refuse = |code: u8, authentic: bool| Refused {
        why: format!("claimed to be {peer}; {}", hello_problem(code)),
        fatal: authentic,
        answer: Some(code),
    };
    if version != VERSION {
        return Err(refuse(HELLO_VERSION, false));
    }
    let truncated = || Refused::dropped(format!("claimed to be {peer}; truncated handshake"));
    let shm_len = if flags & FLAG_SHM != 0 { SHM_ANNOUNCE } else { 0 };
    let proof_len = if flags & FLAG_PROOF != 0 { PROOF } else { 0 };
    if got.len() != HELLO + shm_len + proof_len {
        return Err(truncated());
    }
    // What the proof covers: the fixed part and the sizes.
    let (sent, proof) = got.split_at(HELLO + shm_len);
    let proof = (proof_len > 0).then_some(proof);
    let sizes: [u8; SHM_ANNOUNCE] = match sent[HELLO..].try_into() {
        Ok(sizes) => sizes,
        Err(_) if shm_len == 0 => [0; SHM_ANNOUNCE],
        Err(_) => return Err(truncated()),
    };
    // With a key, only a valid proof makes a peer; without one, nothing
    // does, and a problem drops the connection rather than failing.
    let authentic = match (x.key, proof) {
        (Some(key), Some(proof)) if proof_holds(key, sent, x.me, proof) => true,
        (Some(_), _) | (None, Some(_)) => return Err(refuse(HELLO_PROOF, false)),
        (None, None) => false,
    };
    if !x.expected.contains(&peer) {
        return Err(refuse(HELLO_PEER, authentic));
    }
    if (flags & FLAG_CHECKSUM != 0) != x.checksum {
        return Err(refuse(HELLO_CHECKSUM, authentic));
    }
    let shared = x.shm.filter(|s| s.shares(peer) && !no_shm.contains(&peer));
    if (flags & FLAG_SHM != 0) != shared.is_some() {
        return Err(refuse(HELLO_SHM, authentic));
    }
    let inbound = match shared {
        None => None,
        Some(s) => match s.open(x.me, peer, ShmAnnounce::decode(&sizes)) {
            Ok(receiver) => Some(receiver),
            Err(e) => {
                // Not a failure (the proof, if the fabric has a key, held):
                // the peer connects again without shared memory.
                shm_link::fell_back(x.me, peer, &format!("cannot map its region: {e}"));
                no_shm.insert(peer);
                return Err(Refused { why: format!("shared memory from {peer}: {e}"), fatal: false, answer: Some(HELLO_REGION) });
            }
        },
    };
    Ok((peer, inbound))
}

/// Accepts until every expected peer is connected (or `deadline`). One
/// thread checks every incoming handshake: the listener and the
/// connections whose handshake is under way are polled together, and each
/// handshake is read as its bytes arrive, so thousands of connections at
/// once cost descriptors, not threads, and a silent or slow one holds up
/// nothing. A bad or duplicate one is refused, logged and dropped, and
/// accepting goes on; past [`MAX_GREETINGS`] unfinished handshakes beyond
/// the expected peers, a newer connection drops a silent one (a peer
/// speaks as soon as it connects, and retries if dropped before its
/// answer). `accepted` gets each peer's stream, blocking again.
pub(super) fn accept_all(
    listener: &TcpListener,
    x: &Expect<'_>,
    mut accepted: impl FnMut(Endpoint, TcpStream, Option<ShmReceiver>) -> io::Result<()>,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let me = x.me;
    let mut waiting: HashSet<Endpoint> = x.expected.clone();
    let most = x.expected.len() + MAX_GREETINGS;
    let mut greeting: std::collections::VecDeque<Greeting> = Default::default();
    // The last error `accept` gave that accepting survives (out of
    // descriptors, say): named if the deadline passes.
    let mut trouble: Option<io::Error> = None;
    listener.set_nonblocking(true)?;
    let mut no_shm = HashSet::new();
    // A whole handshake: taken, refused (told so), or the connect fails.
    let mut settle = |g: Greeting, waiting: &mut HashSet<Endpoint>| -> io::Result<()> {
        let Greeting { mut stream, from, got } = g;
        match check_hello(&got, x, &mut no_shm) {
            Ok((peer, inbound)) if waiting.contains(&peer) => {
                // Accepted; a shared-memory pair's answer says where this
                // side's acknowledgement page is.
                let mut answer = vec![HELLO_OK];
                if let Some(r) = &inbound {
                    answer.extend_from_slice(&encode_region_ref(r.acks()?));
                }
                let answered =
                    stream.set_nonblocking(false).and_then(|()| stream.set_nodelay(true)).and_then(|()| stream.write_all(&answer));
                if let Err(e) = answered {
                    // Gone before its answer: the peer connects again.
                    tracing::warn!(%me, %peer, %from, error = %e, "a data-plane connection closed before its handshake was answered");
                    return Ok(());
                }
                waiting.remove(&peer);
                accepted(peer, stream, inbound)
            }
            Ok((peer, _)) => {
                let _ = stream.write_all(&[HELLO_DUPLICATE]);
                tracing::warn!(%me, %peer, %from, "refused a data-plane connection: that endpoint is connected already");
                Ok(())
            }
            Err(Refused { why, fatal, answer }) => {
                if let Some(code) = answer {
                    let _ = stream.write_all(&[code]);
                }
                if fatal {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{me}: {from}: {why}")));
                }
                tracing::warn!(%me, %from, reason = %why, "refused a data-plane connection");
                Ok(())
            }
        }
    };
    let dropped = |from: SocketAddr, why: &str| tracing::warn!(%me, %from, reason = %why, "refused a data-plane connection");
    let mut fds: Vec<libc::pollfd> = Vec::new();
    while !waiting.is_empty() {
        let now = Instant::now();
        if now >= x.deadline {
            let mut missing: Vec<String> = waiting.iter().map(|e| e.to_string()).collect();
            missing.sort();
            let also = trouble.as_ref().map(|e| format!(" (accepting failed meanwhile: {e})")).unwrap_or_default();
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{me}: peers did not connect in time: {}{also}", missing.join(", ")),
            ));
        }
        fds.clear();
        let pollfd = |fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        fds.push(pollfd(listener.as_raw_fd()));
        fds.extend(greeting.iter().map(|g| pollfd(g.stream.as_raw_fd())));
        let wait = x.deadline.saturating_duration_since(now).min(POLL_SLICE).as_millis().max(1) as libc::c_int;
        // SAFETY: `fds` is a live, initialised array of `fds.len()` pollfd
        // structures, which `poll` writes the `revents` of and nothing else.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait) };
        if ready < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(io::Error::new(e.kind(), format!("{me}: waiting for data-plane connections: {e}")));
        }
        // Handshakes with news, back to front (removing one leaves the
        // places of those before it).
        for i in (0..greeting.len()).rev() {
            if fds[i + 1].revents == 0 {
                continue;
            }
            match greeting[i].read() {
                Ok(false) => {}
                Ok(true) => {
                    if let Some(g) = greeting.remove(i) {
                        settle(g, &mut waiting)?;
                    }
                }
                Err(r) => {
                    if let Some(g) = greeting.remove(i) {
                        dropped(g.from, &r.why);
                    }
                }
            }
        }
        if fds[0].revents == 0 {
            continue;
        }
        // New connections: each handshake is read at once as far as it has
        // come (a peer writes it right after connecting).
        loop {
            let (stream, from) = match listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted) => continue,
                Err(e) => {
                    // Out of descriptors or memory, say: the connection
                    // waits in the backlog; try again shortly.
                    tracing::warn!(%me, error = %e, "accepting a data-plane connection failed; retrying");
                    trouble = Some(e);
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            };
            if let Err(e) = stream.set_nonblocking(true) {
                dropped(from, &format!("socket setup: {e}"));
                continue;
            }
            let mut g = Greeting { stream, from, got: Vec::new() };
            match g.read() {
                Ok(true) => settle(g, &mut waiting)?,
                Ok(false) => greeting.push_back(g),
                Err(r) => dropped(from, &r.why),
            }
            // Too many unfinished: drop the oldest of those from which
            // nothing has come even now (else the oldest).
            while greeting.len() > most && !waiting.is_empty() {
                let mut silent = None;
                let mut i = 0;
                while i < greeting.len() {
                    if greeting[i].got.is_empty() {
                        match greeting[i].read() {
                            Ok(false) if greeting[i].got.is_empty() => {
                                silent = Some(i);
                                break;
                            }
                            Ok(false) => {}
                            Ok(true) => {
                                if let Some(g) = greeting.remove(i) {
                                    settle(g, &mut waiting)?;
                                }
                                continue;
                            }
                            Err(r) => {
                                if let Some(g) = greeting.remove(i) {
                                    dropped(g.from, &r.why);
                                }
                                continue;
                            }
                        }
                    }
                    i += 1;
                }
                if greeting.len() > most {
                    if let Some(g) = greeting.remove(silent.unwrap_or(0)) {
                        tracing::debug!(%me, from = %g.from, "dropped an unfinished data-plane handshake to make room");
                    }
                }
            }
            if waiting.is_empty() {
                break;
            }
        }
    }
    // Handshakes still under way are strangers' (or duplicates'): dropping
    // them closes them.
    Ok(())
}
