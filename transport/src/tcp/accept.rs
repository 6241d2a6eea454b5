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
use std::collections::{HashSet, VecDeque};
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
    accepted: impl FnMut(Endpoint, TcpStream, Option<ShmReceiver>) -> io::Result<()>,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    listener.set_nonblocking(true)?;
    let mut acceptor =
        Acceptor { x, waiting: x.expected.clone(), greeting: Default::default(), trouble: None, no_shm: HashSet::new(), accepted };
    let mut fds: Vec<libc::pollfd> = Vec::new();
    while !acceptor.waiting.is_empty() {
        let now = Instant::now();
        if now >= x.deadline {
            return Err(acceptor.timed_out());
        }
        fds.clear();
        let pollfd = |fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        fds.push(pollfd(listener.as_raw_fd()));
        fds.extend(acceptor.greeting.iter().map(|g| pollfd(g.stream.as_raw_fd())));
        let wait = x.deadline.saturating_duration_since(now).min(POLL_SLICE).as_millis().max(1) as libc::c_int;
        // SAFETY: `fds` is a live, initialised array of `fds.len()` pollfd
        // structures, which `poll` writes the `revents` of and nothing else.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait) };
        if ready < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(io::Error::new(e.kind(), format!("{}: waiting for data-plane connections: {e}", x.me)));
        }
        let news: Vec<bool> = fds[1..].iter().map(|f| f.revents != 0).collect();
        acceptor.read_greetings(&news)?;
        if fds[0].revents != 0 {
            acceptor.accept_new(listener)?;
        }
    }
    // Handshakes still under way are strangers' (or duplicates'): dropping
    // them closes them.
    Ok(())
}

/// [`accept_all`]'s state: the peers still awaited, the handshakes under
/// way, and what it hands each accepted peer to.
struct Acceptor<'x, 'a, F> {
    x: &'x Expect<'a>,
    waiting: HashSet<Endpoint>,
    greeting: VecDeque<Greeting>,
    /// The last error `accept` gave that accepting survives (out of
    /// descriptors, say): named if the deadline passes.
    trouble: Option<io::Error>,
    /// Peers whose region this rank could not map (see [`check_hello`]).
    no_shm: HashSet<Endpoint>,
    accepted: F,
}

impl<F> Acceptor<'_, '_, F>
where
    F: FnMut(Endpoint, TcpStream, Option<ShmReceiver>) -> io::Result<()>,
{
    /// The error when the deadline passed: the peers that did not connect.
    fn timed_out(&self) -> io::Error {
        let mut missing: Vec<String> = self.waiting.iter().map(|e| e.to_string()).collect();
        missing.sort();
        let also = self.trouble.as_ref().map(|e| format!(" (accepting failed meanwhile: {e})")).unwrap_or_default();
        io::Error::new(io::ErrorKind::TimedOut, format!("{}: peers did not connect in time: {}{also}", self.x.me, missing.join(", ")))
    }

    /// A connection dropped before (or instead of) its handshake's check.
    fn dropped(&self, from: SocketAddr, why: &str) {
        tracing::warn!(me = %self.x.me, %from, reason = %why, "refused a data-plane connection");
    }

    /// A whole handshake: taken, refused (told so), or the connect fails.
    fn settle(&mut self, g: Greeting) -> io::Result<()> {
        let me = self.x.me;
        let Greeting { mut stream, from, got } = g;
        match check_hello(&got, self.x, &mut self.no_shm) {
            Ok((peer, inbound)) if self.waiting.contains(&peer) => {
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
                self.waiting.remove(&peer);
                (self.accepted)(peer, stream, inbound)
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
                self.dropped(from, &why);
                Ok(())
            }
        }
    }

    /// Reads the handshakes `poll` has news of (`news[i]` for the `i`th
    /// under way), back to front: removing one leaves the places of those
    /// before it.
    fn read_greetings(&mut self, news: &[bool]) -> io::Result<()> {
        for i in (0..self.greeting.len().min(news.len())).rev() {
            if news[i] {
                self.read_one(i)?;
            }
        }
        Ok(())
    }

    /// Reads the `i`th handshake under way: settled if whole, dropped if
    /// bad; whether it is gone from the queue.
    fn read_one(&mut self, i: usize) -> io::Result<bool> {
        match self.greeting[i].read() {
            Ok(false) => Ok(false),
            Ok(true) => {
                if let Some(g) = self.greeting.remove(i) {
                    self.settle(g)?;
                }
                Ok(true)
            }
            Err(r) => {
                if let Some(g) = self.greeting.remove(i) {
                    self.dropped(g.from, &r.why);
                }
                Ok(true)
            }
        }
    }

    /// New connections: each handshake is read at once as far as it has
    /// come (a peer writes it right after connecting).
    fn accept_new(&mut self, listener: &TcpListener) -> io::Result<()> {
        let me = self.x.me;
        loop {
            let (stream, from) = match listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted) => continue,
                Err(e) => {
                    // Out of descriptors or memory, say: the connection
                    // waits in the backlog; try again shortly.
                    tracing::warn!(%me, error = %e, "accepting a data-plane connection failed; retrying");
                    self.trouble = Some(e);
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            };
            if let Err(e) = stream.set_nonblocking(true) {
                self.dropped(from, &format!("socket setup: {e}"));
                continue;
            }
            let mut g = Greeting { stream, from, got: Vec::new() };
            match g.read() {
                Ok(true) => self.settle(g)?,
                Ok(false) => self.greeting.push_back(g),
                Err(r) => self.dropped(from, &r.why),
            }
            self.make_room()?;
            if self.waiting.is_empty() {
                break;
            }
        }
        Ok(())
    }

    /// Too many unfinished handshakes: drops the oldest of those from
    /// which nothing has come even now (else the oldest).
    fn make_room(&mut self) -> io::Result<()> {
        let most = self.x.expected.len() + MAX_GREETINGS;
        while self.greeting.len() > most && !self.waiting.is_empty() {
            let mut silent = None;
            let mut i = 0;
            while i < self.greeting.len() {
                if self.greeting[i].got.is_empty() {
                    if self.read_one(i)? {
                        continue;
                    }
                    if self.greeting[i].got.is_empty() {
                        silent = Some(i);
                        break;
                    }
                }
                i += 1;
            }
            if self.greeting.len() > most {
                if let Some(g) = self.greeting.remove(silent.unwrap_or(0)) {
                    tracing::debug!(me = %self.x.me, from = %g.from, "dropped an unfinished data-plane handshake to make room");
                }
            }
        }
        Ok(())
    }
}
