//! Incoming streams that have carried nothing yet: one thread per rank
//! watches them all and gives a stream its own reader thread
//! ([`read_loop`]) only when a frame other than a goodbye arrives on it.
//!
//! A rank's fabric holds a stream from every peer it talks to in either
//! direction, but its program receives on only some of them (a training
//! rank receives nothing: the streams its receivers opened carry a goodbye
//! at the end, or an abort). With a reader thread per incoming stream,
//! DeepSeek-V3 /128 placed with each expert's copies on four nodes needed
//! about 32,000 threads on one host, over the kernel's 32,768 processes
//! (`kernel.pid_max`): a rank's acceptor could not start a reader, its
//! connect failed and closed its listener, and its peers were refused.

use super::reader::{finish, read_loop, Reader, Stop};
use crate::frame::{decode_header, BYE, HEADER};
use reshard::Endpoint;
use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// How often the watcher tries again to start the reader thread of a
/// stream whose thread could not be started.
const SPAWN_RETRY: Duration = Duration::from_millis(50);

/// How long the watcher keeps trying to start a stream's reader thread
/// (the host out of threads) before it reports the stream broken.
const SPAWN_PATIENCE: Duration = Duration::from_secs(10);

/// An incoming stream no thread reads yet.
struct Parked {
    stream: TcpStream,
    reader: Reader,
    /// Since when starting its reader thread has failed, if it has.
    spawn_failing: Option<Instant>,
}

/// What the first bytes waiting on a parked stream say.
enum Waiting {
    /// Nothing yet.
    Nothing,
    /// The peer said goodbye (and nothing else).
    Bye,
    /// The stream ended or failed.
    Ended(String),
    /// A frame for a reader thread.
    Frame,
}

/// Looks at what has arrived on `stream` without taking it (a goodbye is
/// taken).
fn waiting(stream: &TcpStream) -> Waiting {
    let mut h = [0u8; HEADER];
    // SAFETY: `h` is a live, writable buffer of `HEADER` bytes, and the
    // descriptor is `stream`'s, open for the whole call; `recv` writes at
    // most `h.len()` bytes into it.
    let n = unsafe { libc::recv(stream.as_raw_fd(), h.as_mut_ptr().cast(), h.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Waiting::Nothing,
            _ => Waiting::Ended(e.to_string()),
        };
    }
    if n == 0 {
        return Waiting::Ended("connection closed".into());
    }
    if n as usize == HEADER && decode_header(&h).is_some_and(|f| f.kind == BYE) {
        // Taken off the stream: a peek showed it whole.
        let _ = (&*stream).read_exact(&mut h);
        return Waiting::Bye;
    }
    Waiting::Frame
}

/// Starts the thread that watches `parked` (each an incoming stream and
/// how to read it) for `me`, until each has a reader thread of its own,
/// said goodbye or ended. Nothing to watch starts nothing.
pub(super) fn watch(me: Endpoint, parked: Vec<(TcpStream, Reader)>) -> io::Result<()> {
    if parked.is_empty() {
        return Ok(());
    }
    let parked = parked.into_iter().map(|(stream, reader)| Parked { stream, reader, spawn_failing: None }).collect();
    std::thread::Builder::new().name(format!("refit-watch-{me}")).spawn(move || watch_loop(me, parked))?;
    Ok(())
}

fn watch_loop(me: Endpoint, mut parked: Vec<Parked>) {
    let mut fds: Vec<libc::pollfd> = Vec::new();
    while !parked.is_empty() {
        fds.clear();
        fds.extend(parked.iter().map(|p| libc::pollfd { fd: p.stream.as_raw_fd(), events: libc::POLLIN, revents: 0 }));
        // Only a stream's news wakes the watcher, unless a reader thread is
        // still to be started.
        let retrying = parked.iter().any(|p| p.spawn_failing.is_some());
        let wait = if retrying { SPAWN_RETRY.as_millis() as libc::c_int } else { -1 };
        // SAFETY: `fds` is a live, initialised array of `fds.len()` pollfd
        // structures, which `poll` writes the `revents` of and nothing else.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait) };
        if ready < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // Out of memory, say: look again shortly.
            tracing::warn!(%me, error = %e, "watching idle data-plane streams failed; trying again");
            std::thread::sleep(SPAWN_RETRY);
            continue;
        }
        // Back to front: removing one leaves the places of those before it.
        for i in (0..parked.len()).rev() {
            let retry = parked[i].spawn_failing.is_some();
            if fds[i].revents == 0 && !retry {
                continue;
            }
            match waiting(&parked[i].stream) {
                Waiting::Nothing => {}
                // As a reader thread would have ended on them.
                Waiting::Bye => finish(&parked.swap_remove(i).reader, Stop::Quiet),
                Waiting::Ended(problem) => finish(&parked.swap_remove(i).reader, Stop::Broken(problem)),
                Waiting::Frame => {
                    let p = parked.swap_remove(i);
                    if let Some(p) = start_reader(me, p) {
                        parked.push(p);
                    }
                }
            }
        }
        // A stream still waiting for its thread stays ready to read: pace
        // the tries.
        if parked.iter().any(|p| p.spawn_failing.is_some()) {
            std::thread::sleep(SPAWN_RETRY);
        }
    }
}

/// Gives `p` a reader thread of its own. Where the host has no thread to
/// give, `p` comes back to be tried again, until [`SPAWN_PATIENCE`]
/// passes: then its peer's stream is reported broken, saying why.
fn start_reader(me: Endpoint, mut p: Parked) -> Option<Parked> {
    let peer = p.reader.peer;
    // The stream and its reader go to the thread once it runs, so a
    // thread that cannot be started leaves them here.
    let (hand, take) = std::sync::mpsc::sync_channel::<(TcpStream, Reader)>(1);
    let spawned = std::thread::Builder::new().name(format!("refit-read-{peer}")).spawn(move || {
        if let Ok((stream, reader)) = take.recv() {
            read_loop(stream, reader);
        }
    });
    let e = match spawned {
        Ok(_) => {
            // The thread waits for exactly this one hand-over.
            let _ = hand.send((p.stream, p.reader));
            return None;
        }
        Err(e) => e,
    };
    let since = *p.spawn_failing.get_or_insert_with(|| {
        tracing::warn!(%me, %peer, error = %e, "no thread to read a data-plane stream yet; trying again");
        Instant::now()
    });
    if since.elapsed() < SPAWN_PATIENCE {
        return Some(p);
    }
    let problem = format!("{me} could not start a thread to read its stream for {} s: {e}", SPAWN_PATIENCE.as_secs());
    finish(&p.reader, Stop::Broken(problem));
    None
}
