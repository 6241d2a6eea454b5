//! What the kernel knows of a data-plane TCP stream (`TCP_INFO`), and the
//! choice of its congestion control (`TCP_CONGESTION`): the data plane's
//! streams run a loss-based one by default ([`Congestion`]).

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::Duration;

/// Which TCP congestion control the streams a rank sends on run
/// ([`crate::tcp::TcpConfig::congestion`]).
///
/// The default avoids BBR (Linux's `bbr`, version 1). A refit is a
/// many-to-one transfer: every source starts a fresh stream to each
/// receiving node at once, and where a link's queue is short the BBR
/// streams, each probing at almost three times a rate it measured through
/// the link's burst allowance, lose a fifth or more of what they send. BBR
/// takes such steady loss for a token-bucket policer and then paces the
/// stream at the rate it measured while it shared the link, for 48 round
/// trips, even once the streams it shared with are done: the last stream
/// of a round crawls on an idle link. On emulated hosts (`--netns`, a 4
/// MB/s link, 8 streams into it) 22 of 210 refits on fresh streams took 3
/// to 5 s instead of 2.2 s or missed their 5 s deadline, the last stream
/// paced at 0.3 MB/s; with cubic or reno, none of 50 each did. The price:
/// under heavy random loss a loss-based sender is slower than BBR.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Congestion {
    /// The system's default, unless that is BBR: then `cubic`, or `reno`
    /// where this process may not choose `cubic` (an unprivileged process
    /// may choose only what `net.ipv4.tcp_allowed_congestion_control`
    /// lists; `reno` always). Any other default (`cubic`, `dctcp`, ...)
    /// is kept.
    #[default]
    AvoidBbr,
    /// The system's default, whatever it is.
    System,
    /// This one (a name `net.ipv4.tcp_available_congestion_control`
    /// lists); a stream that cannot take it keeps the default (logged).
    Named(String),
}

/// The environment variable that picks [`Congestion`] for
/// [`crate::tcp::TcpConfig::default`]: `avoid-bbr` (the default), `system`,
/// or the name of an algorithm (`cubic`, `bbr`, ...).
pub(crate) const CONGESTION_ENV: &str = "REFIT_TCP_CONGESTION";

impl Congestion {
    /// What `text` says (`CONGESTION_ENV`'s values; empty: the default).
    pub fn parse(text: &str) -> Congestion {
        match text.trim() {
            "" | "avoid-bbr" => Congestion::AvoidBbr,
            "system" => Congestion::System,
            name => Congestion::Named(name.to_string()),
        }
    }

    /// What `CONGESTION_ENV` says, or the default.
    pub fn from_env() -> Congestion {
        std::env::var(CONGESTION_ENV).map(|v| Congestion::parse(&v)).unwrap_or_default()
    }
}

/// The congestion control `stream` runs.
pub(crate) fn congestion(stream: &TcpStream) -> io::Result<String> {
    let mut name = [0u8; 32];
    let mut len = name.len() as libc::socklen_t;
    // SAFETY: `name` is valid for writes of `len` bytes, and `len` is a
    // live `socklen_t` the kernel updates.
    let r = unsafe { libc::getsockopt(stream.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_CONGESTION, name.as_mut_ptr().cast(), &mut len) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    let name = &name[..(len as usize).min(name.len())];
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Ok(String::from_utf8_lossy(&name[..end]).into_owned())
}

/// Makes `stream` run congestion control `name`.
pub(crate) fn set_congestion(stream: &TcpStream, name: &str) -> io::Result<()> {
    // SAFETY: `name` is valid for reads of its length, which is passed.
    let r = unsafe {
        libc::setsockopt(stream.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_CONGESTION, name.as_ptr().cast(), name.len() as libc::socklen_t)
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Applies `want` to `stream` (a stream this rank sends on, before it
/// sends): the congestion control it runs then. Never fails the stream:
/// what cannot be chosen is logged and the default kept.
pub(crate) fn choose_congestion(stream: &TcpStream, want: &Congestion) -> String {
    let current = congestion(stream).unwrap_or_default();
    let candidates: Vec<&str> = match want {
        Congestion::System => Vec::new(),
        Congestion::AvoidBbr if current.starts_with("bbr") => vec!["cubic", "reno"],
        Congestion::AvoidBbr => Vec::new(),
        Congestion::Named(n) if *n == current => Vec::new(),
        Congestion::Named(n) => vec![n.as_str()],
    };
    let mut refused = Vec::new();
    for c in candidates {
        match set_congestion(stream, c) {
            Ok(()) => return c.to_string(),
            Err(e) => refused.push(format!("{c}: {e}")),
        }
    }
    if !refused.is_empty() {
        tracing::debug!(kept = %current, refused = %refused.join("; "), "a data-plane stream keeps the system's congestion control");
    }
    current
}

/// What the kernel says of a TCP stream: the fields the data plane reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TcpState {
    /// The connection's state (`TCP_ESTABLISHED` = 1, ...).
    pub(crate) state: u8,
    /// Bytes received on it so far.
    pub(crate) bytes_received: u64,
    /// Since the last data came in.
    pub(crate) last_data_recv: Duration,
    /// Bytes sent, retransmissions included.
    pub(crate) bytes_sent: u64,
    /// Bytes the peer acknowledged.
    pub(crate) bytes_acked: u64,
    /// Bytes retransmitted.
    pub(crate) bytes_retrans: u64,
    /// Bytes written but not yet sent.
    pub(crate) notsent: u64,
    /// Retransmission timeouts so far.
    pub(crate) rtos: u16,
    /// The rate the kernel paces the stream at, bytes/s.
    pub(crate) pacing_rate: u64,
}

/// `TCP_INFO` of `stream`, as far as this kernel reports it (`None` if it
/// does not).
pub(crate) fn tcp_state(stream: &TcpStream) -> Option<TcpState> {
    // SAFETY: `tcp_info` is plain data, valid when zeroed.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is valid for writes of `len` bytes; the kernel writes
    // at most that and says how much in `len`.
    let r = unsafe {
        libc::getsockopt(stream.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_INFO, (&mut info as *mut libc::tcp_info).cast(), &mut len)
    };
    if r != 0 {
        return None;
    }
    // Fields past what this kernel filled stay zero.
    let has = |end: usize| len as usize >= end;
    use std::mem::{offset_of, size_of};
    let mut s =
        TcpState { state: info.tcpi_state, last_data_recv: Duration::from_millis(info.tcpi_last_data_recv.into()), ..TcpState::default() };
    if has(offset_of!(libc::tcp_info, tcpi_bytes_received) + size_of::<u64>()) {
        s.bytes_received = info.tcpi_bytes_received;
        s.bytes_acked = info.tcpi_bytes_acked;
        s.pacing_rate = info.tcpi_pacing_rate;
    }
    if has(offset_of!(libc::tcp_info, tcpi_notsent_bytes) + size_of::<u32>()) {
        s.notsent = info.tcpi_notsent_bytes.into();
    }
    if has(offset_of!(libc::tcp_info, tcpi_bytes_retrans) + size_of::<u64>()) {
        s.bytes_sent = info.tcpi_bytes_sent;
        s.bytes_retrans = info.tcpi_bytes_retrans;
    }
    if has(offset_of!(libc::tcp_info, tcpi_total_rto) + size_of::<u16>()) {
        s.rtos = info.tcpi_total_rto;
    }
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    #[test]
    fn kernel_counts_a_streams_bytes() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut out = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut inc, _) = listener.accept().unwrap();
        out.write_all(&[7u8; 5000]).unwrap();
        let mut got = vec![0u8; 5000];
        inc.read_exact(&mut got).unwrap();
        let s = tcp_state(&inc).expect("TCP_INFO");
        assert_eq!(s.state, 1, "established");
        assert_eq!(s.bytes_received, 5000);
        assert!(s.last_data_recv < Duration::from_secs(5));
        // (The acknowledgement may be delayed: the SYN counts one.)
        let t = std::time::Instant::now();
        let mut o = tcp_state(&out).expect("TCP_INFO");
        while o.bytes_acked < 5001 && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
            o = tcp_state(&out).expect("TCP_INFO");
        }
        assert_eq!((o.bytes_acked, o.bytes_sent, o.notsent), (5001, 5000, 0), "{o:?}");
        assert_eq!(reshard::human(5000), "4.88 KiB");
        assert_eq!(reshard::human(3 << 20), "3.00 MiB");
    }

    /// `reno` is always there and any process may choose it; `System`
    /// changes nothing; a name the kernel does not know keeps the default.
    #[test]
    fn congestion_is_chosen_per_stream() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let out = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let default = congestion(&out).unwrap();
        assert!(!default.is_empty());
        assert_eq!(choose_congestion(&out, &Congestion::System), default);
        assert_eq!(choose_congestion(&out, &Congestion::Named("no-such-algorithm".into())), default);
        assert_eq!(choose_congestion(&out, &Congestion::Named("reno".into())), "reno");
        assert_eq!(congestion(&out).unwrap(), "reno");
        // Not BBR now: kept.
        assert_eq!(choose_congestion(&out, &Congestion::AvoidBbr), "reno");
        // BBR (where this kernel has it and lets this process pick it) is
        // replaced by a loss-based one.
        if set_congestion(&out, "bbr").is_ok() {
            let chosen = choose_congestion(&out, &Congestion::AvoidBbr);
            assert!(chosen == "cubic" || chosen == "reno", "{chosen}");
            assert_eq!(congestion(&out).unwrap(), chosen);
        }
    }

    #[test]
    fn congestion_is_named_in_words() {
        assert_eq!(Congestion::parse(""), Congestion::AvoidBbr);
        assert_eq!(Congestion::parse("avoid-bbr"), Congestion::AvoidBbr);
        assert_eq!(Congestion::parse(" system "), Congestion::System);
        assert_eq!(Congestion::parse("cubic"), Congestion::Named("cubic".into()));
    }
}
