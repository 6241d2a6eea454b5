//! A one-way delay on an emulated host's egress, without the kernel's
//! `netem` (which the kernels this project runs on lack): a tap device
//! inside the host's namespace and a thread of the launcher that holds
//! every frame for the delay before letting it go on.
//!
//! The wiring, inside the node's namespace (`eth0` keeps its rate shaping):
//!
//! ```text
//!  node's stack ─► eth0 egress hook (clsact) ─ IP, not yet delayed ─► tap `rfdelay` ─► thread
//!                      │ delayed (TOS bit set)                                          │ holds each frame
//!                      ▼                                                                │ `delay`, sets the
//!                  eth0 qdiscs (tbf) ─► veth ─► bridge        rfdelay ingress ◄─────────┘ TOS bit
//!                      ▲                                         │ (clsact)
//!                      └──────────── redirected to eth0 egress ──┘
//! ```
//!
//! A delayed frame is told apart by [`DELAYED_TOS`], a bit of its IPv4
//! header's type-of-service byte the thread sets (fixing the header
//! checksum; TCP's checksum does not cover it), so it passes the egress
//! hook the second time. refit's sockets leave that byte at 0.
//!
//! The tap goes away when its file descriptor is closed: when the
//! [`DelayLine`] is dropped, when the launcher exits however it exits, or
//! with the namespace.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The tap's name inside a node's namespace.
pub(super) const TAP: &str = "rfdelay";
/// The type-of-service bit that marks a frame already delayed (DSCP CS1's
/// low bit; refit never sets it).
pub(super) const DELAYED_TOS: u8 = 0x20;
/// Most bytes a line holds at once; frames beyond are dropped, as a full
/// queue drops them (TCP's window keeps far fewer in flight).
const MAX_HELD_BYTES: usize = 64 << 20;
/// How often the thread looks at its stop flag while idle.
const IDLE_POLL: Duration = Duration::from_millis(20);

/// `TUNSETIFF`: `_IOW('T', 202, int)`.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;

/// `struct ifreq` as `TUNSETIFF` reads it: the name, the flags, then the
/// rest of the union.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _rest: [u8; 22],
}

/// The classic-BPF program (in `tc`'s `bytecode` form) of the filter on a
/// node's egress that sends IP packets into the line: `A = byte 15 (the
/// IPv4 TOS, after a 14-byte Ethernet header); if A & DELAYED_TOS: no
/// match (already delayed, goes on) else match (redirected to the tap)`.
pub(super) fn redirect_bytecode() -> String {
    format!("4,48 0 0 15,69 1 0 {DELAYED_TOS},6 0 0 {},6 0 0 0", u32::MAX)
}

/// A running delay line: the tap and the thread holding its frames.
pub(super) struct DelayLine {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for DelayLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DelayLine").finish_non_exhaustive()
    }
}

impl DelayLine {
    /// Creates the tap [`TAP`] inside namespace `netns` (its name under
    /// `/run/netns`) and starts holding every frame it receives for
    /// `delay`. The caller wires it up with `tc` (see the module doc).
    pub(super) fn start(netns: &str, delay: Duration) -> Result<DelayLine, String> {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let (ns, flag) = (netns.to_string(), stop.clone());
        let thread = std::thread::Builder::new()
            .name(format!("refit-delay-{netns}"))
            .spawn(move || match open_tap_in(&ns) {
                Ok(tap) => {
                    let _ = tx.send(Ok(()));
                    hold(&tap, delay, &flag);
                }
                Err(e) => drop(tx.send(Err(e))),
            })
            .map_err(|e| format!("cannot start a delay thread for {netns}: {e}"))?;
        match rx.recv() {
            Ok(Ok(())) => Ok(DelayLine { stop, thread: Some(thread) }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(format!("the delay thread for {netns} ended before it opened its tap"))
            }
        }
    }
}

impl Drop for DelayLine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Moves the calling thread into namespace `netns` (for good: the thread
/// is the line's own) and opens the tap there, non-blocking.
fn open_tap_in(netns: &str) -> Result<OwnedFd, String> {
    let path = format!("/run/netns/{netns}");
    let ns = std::fs::File::open(&path).map_err(|e| format!("{path}: cannot open: {e}"))?;
    // SAFETY: plain system call on a descriptor we own; it changes only
    // this thread's network namespace.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!("cannot enter network namespace {netns}: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: open(2) of a constant NUL-terminated path.
    let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(format!("/dev/net/tun: cannot open (a delay needs the kernel's tun/tap driver): {}", std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh descriptor from open(2), owned by this value only.
    let tap = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = IfReq { name: [0; libc::IFNAMSIZ], flags: (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short, _rest: [0; 22] };
    req.name[..TAP.len()].copy_from_slice(TAP.as_bytes());
    // SAFETY: TUNSETIFF reads (and may write back) one `struct ifreq`,
    // which `req` is, laid out as the kernel's.
    if unsafe { libc::ioctl(tap.as_raw_fd(), TUNSETIFF, &mut req as *mut IfReq) } != 0 {
        return Err(format!("cannot create tap {TAP} in {netns}: {}", std::io::Error::last_os_error()));
    }
    Ok(tap)
}

/// Sets [`DELAYED_TOS`] in the IPv4 header of an Ethernet frame and
/// recomputes the header's checksum. False (the frame untouched) when it is
/// not an IPv4 frame with a whole header.
pub(super) fn mark_delayed(frame: &mut [u8]) -> bool {
    const ETH: usize = 14;
    if frame.len() < ETH + 20 || frame[12..14] != [0x08, 0x00] || frame[ETH] >> 4 != 4 {
        return false;
    }
    let ihl = usize::from(frame[ETH] & 0x0f) * 4;
    if ihl < 20 || frame.len() < ETH + ihl {
        return false;
    }
    let header = &mut frame[ETH..ETH + ihl];
    header[1] |= DELAYED_TOS;
    header[10..12].copy_from_slice(&[0, 0]);
    let mut sum: u32 = header.chunks_exact(2).map(|w| u32::from(u16::from_be_bytes([w[0], w[1]]))).sum();
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    header[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    true
}

/// Reads frames off `tap` and writes each back `delay` after it came, in
/// order, until `stop` is set.
fn hold(tap: &OwnedFd, delay: Duration, stop: &AtomicBool) {
    let mut held: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    let mut held_bytes = 0usize;
    let mut buf = vec![0u8; 65_536];
    while !stop.load(Ordering::Relaxed) {
        let wait = held.front().map_or(IDLE_POLL, |(due, _)| due.saturating_duration_since(Instant::now()).min(IDLE_POLL));
        let mut pfd = libc::pollfd { fd: tap.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // Rounded up, so a frame is never let go early.
        let ms = wait.as_micros().div_ceil(1000) as libc::c_int;
        // SAFETY: one valid pollfd, for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, ms) };
        loop {
            // SAFETY: reads at most `buf.len()` bytes into `buf`.
            let n = unsafe { libc::read(tap.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                break;
            }
            let mut frame = buf[..n as usize].to_vec();
            if held_bytes + frame.len() > MAX_HELD_BYTES || !mark_delayed(&mut frame) {
                continue;
            }
            held_bytes += frame.len();
            held.push_back((Instant::now() + delay, frame));
        }
        let now = Instant::now();
        while held.front().is_some_and(|(due, _)| *due <= now) {
            let Some((_, frame)) = held.pop_front() else { break };
            held_bytes -= frame.len();
            // A frame the tap refuses is lost, as on a full link.
            // SAFETY: writes `frame.len()` bytes from `frame`.
            unsafe { libc::write(tap.as_raw_fd(), frame.as_ptr().cast(), frame.len()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An Ethernet frame with a 20-byte IPv4 header (checksum valid) and
    /// a few bytes of payload.
    fn frame() -> Vec<u8> {
        let mut f = vec![0u8; 14];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        // Version 4, IHL 5, TOS 0, length 24, id, flags, TTL 64, TCP,
        // checksum, 10.0.0.1 -> 10.0.0.2.
        f.extend_from_slice(&[0x45, 0, 0, 24, 0x12, 0x34, 0x40, 0, 64, 6, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2]);
        f.extend_from_slice(&[1, 2, 3, 4]);
        f
    }

    fn header_sums_to_zero(f: &[u8]) -> bool {
        let mut sum: u32 = f[14..34].chunks_exact(2).map(|w| u32::from(u16::from_be_bytes([w[0], w[1]]))).sum();
        while sum >> 16 != 0 {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        sum == 0xffff
    }

    #[test]
    fn marking_sets_the_bit_and_keeps_the_checksum_valid() {
        let mut f = frame();
        assert!(mark_delayed(&mut f));
        assert_eq!(f[15], DELAYED_TOS);
        assert!(header_sums_to_zero(&f));
        // Marked again: the same frame.
        let once = f.clone();
        assert!(mark_delayed(&mut f));
        assert_eq!(f, once);
        // Payload and addresses untouched.
        assert_eq!(&f[26..], &frame()[26..]);
    }

    #[test]
    fn only_whole_ipv4_headers_are_marked() {
        let mut arp = frame();
        arp[12..14].copy_from_slice(&[0x08, 0x06]);
        let before = arp.clone();
        assert!(!mark_delayed(&mut arp));
        assert_eq!(arp, before);
        let mut short = frame()[..30].to_vec();
        assert!(!mark_delayed(&mut short));
        let mut v6 = frame();
        v6[14] = 0x65;
        assert!(!mark_delayed(&mut v6));
        let mut options = frame();
        options[14] = 0x4f; // IHL 15: 60 bytes, more than the frame has
        assert!(!mark_delayed(&mut options));
    }

    #[test]
    fn the_redirect_filter_skips_delayed_packets() {
        // ldb [15]; jset DELAYED_TOS -> ret 0 (pass); else ret -1 (match).
        assert_eq!(redirect_bytecode(), "4,48 0 0 15,69 1 0 32,6 0 0 4294967295,6 0 0 0");
    }
}
