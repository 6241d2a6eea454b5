//! A member that holds the job's secret and lies on its shared-memory
//! link: the honest receiver must fail its refit naming the liar, never
//! take more memory than its program expects from it.

use super::shm_link::ShmSetup;
use super::{fabric, TcpConfig, TcpTransport};
use crate::frame::{header, shm_info, CHUNK, LENT, SHM_INFO};
use crate::shm::ShmConfig;
use crate::transport::{Transport, TransportError};
use reshard::Endpoint;
use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};

const LIAR: Endpoint = Endpoint::src(0);
const HONEST: Endpoint = Endpoint::dst(0);
/// What the honest rank's program expects from the liar at most.
const PLANNED: u64 = 4096;

/// The resident memory of this process, in bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib =
        status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
    kib.unwrap_or(0) * 1024
}

/// The liar and the honest rank, connected through shared memory: the
/// liar announced a lend area of `lend` bytes; the honest rank takes at
/// most [`PLANNED`] bytes in one message from it.
fn pair(lend: u64, session: &str) -> (TcpTransport, TcpTransport) {
    let config = TcpConfig { max_frame_bytes_from: HashMap::from([(LIAR, PLANNED), (HONEST, PLANNED)]), ..TcpConfig::default() };
    let shm = |_| {
        Some(ShmSetup {
            session: session.into(),
            same_node: [LIAR, HONEST].into_iter().collect(),
            config: ShmConfig { lend_bytes: lend, stream_bytes: 1 << 20, ..ShmConfig::default() },
        })
    };
    let mut both = fabric(&[LIAR, HONEST], &config, |_| None, shm, &|_, _| true).unwrap();
    let honest = both.pop().unwrap();
    (both.pop().unwrap(), honest)
}

/// Writes a shared-memory notice of `kind` with `info` on the liar's
/// stream to the honest rank, as no honest sender would.
fn lie(liar: &mut TcpTransport, kind: u8, info: [u8; SHM_INFO]) {
    let link = liar.links.get_mut(&HONEST).unwrap();
    link.w.write_all(&header(kind, 0, SHM_INFO as u64)).unwrap();
    link.w.write_all(&info).unwrap();
    link.w.flush().unwrap();
}

/// The honest rank's next receive: it must fail, naming the liar, why.
fn refused(honest: &mut TcpTransport) -> String {
    match honest.recv(0, Instant::now() + Duration::from_secs(10)) {
        Err(TransportError::Broken { peer, problem }) => {
            assert_eq!(peer, LIAR);
            problem
        }
        Err(e) => panic!("failed otherwise: {e}"),
        Ok((from, payload)) => panic!("took a message of {} bytes from {from}", crate::frame::payload_len(&payload)),
    }
}

/// A lent message far larger than planned, inside a huge lend area: the
/// honest rank refuses it before touching a byte of it.
#[test]
fn a_lent_message_longer_than_planned_is_refused() {
    let (mut liar, mut honest) = pair(256 << 20, &format!("hostile-lent-{}", std::process::id()));
    let before = rss();
    lie(&mut liar, LENT, shm_info(0, 4096, 200 << 20, 0));
    let why = refused(&mut honest);
    assert!(why.contains("exceeds the limit of 4096"), "{why}");
    assert!(rss() < before + (64 << 20), "RSS grew from {before} to {}", rss());
}

/// A streamed message announced far larger than planned: refused before
/// a buffer for it is taken.
#[test]
fn a_streamed_message_longer_than_planned_is_refused() {
    let (mut liar, mut honest) = pair(1 << 20, &format!("hostile-chunk-{}", std::process::id()));
    let before = rss();
    lie(&mut liar, CHUNK, shm_info(1 << 30, 4096 + (1 << 20), 4096, 0));
    let why = refused(&mut honest);
    assert!(why.contains("exceeds the limit of 4096"), "{why}");
    assert!(rss() < before + (64 << 20), "RSS grew from {before} to {}", rss());
}

/// A lent message at an offset outside the lend area, or out of sequence.
#[test]
fn a_lent_message_outside_its_area_or_order_is_refused() {
    let (mut liar, mut honest) = pair(1 << 20, &format!("hostile-where-{}", std::process::id()));
    lie(&mut liar, LENT, shm_info(0, (1 << 20) + 4096 - 100, 200, 0));
    assert!(refused(&mut honest).contains("outside the lend area"));
    let (mut liar, mut honest) = pair(1 << 20, &format!("hostile-seq-{}", std::process::id()));
    lie(&mut liar, LENT, shm_info(7, 4096, 100, 0));
    assert!(refused(&mut honest).contains("expected 0"));
}
