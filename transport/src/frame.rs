//! The wire format of the TCP and shared-memory links ([`crate::tcp`],
//! [`crate::tcp::shm_link`]): frames, the handshake, and the order of a
//! payload's bytes on the wire.
//!
//! Frame: magic `RFIT` (u32 LE), kind (u8: 0 data, 1 abort, 2 bye: the
//! sender is done and closes cleanly, 3 lent and 4 chunk: a message in
//! shared memory, see [`crate::shm`]), round (u32 LE), payload length
//! (u64 LE), payload; with checksums on, a data frame ends with the
//! CRC-32C of its payload (u32 LE). The payload of a data frame is the
//! message's pieces back to back in wire order; that of an abort frame
//! the reason (UTF-8, at most 64 KiB); that of a lent or chunk frame four
//! u64 (LE): for lent the sequence number, region offset, length and
//! checksum of a message lent in place; for chunk the message's total
//! length, the chunk's region offset and length, and (on the last chunk)
//! the message's checksum.
//!
//! A stream starts with a handshake: magic, the sender's group (u8) and
//! rank (u32 LE), protocol version (u8, 5), flags (u8: 1 checksums, 2
//! shared memory, 4 proof; then, with shared memory, the region's lend and
//! stream sizes, u64 LE each, and where to find it: the sender's process
//! id and descriptor, u32 LE each, and the region's token, u64 LE; then
//! the proof: HMAC-SHA256 under the fabric's [`HelloKey`] of everything
//! before it and the receiver's endpoint); the receiver answers one byte,
//! 0 for accepted or the reason it refuses (other version, other checksum
//! setting, disagreement on sharing a node, region not mappable,
//! unexpected peer, missing or wrong proof, endpoint already connected),
//! and an accepted shared-memory pair's answer goes on with where its
//! acknowledgement page is (process id, descriptor, token). A region not
//! mappable is no failure: the sender connects again without shared
//! memory, and the pair talks TCP. An authenticated peer with another
//! configuration fails at connect time on both ends; anything else is
//! dropped and the receiver goes on accepting.

use crate::copy::{for_each_run, in_bounds, run_bytes, StridedRef};
use crate::shm::RegionRef;
use crate::transport::Payload;
use reshard::{Endpoint, Group};
use std::io;

/// Frame magic: "RFIT" little-endian.
pub(crate) const MAGIC: u32 = 0x5449_4652;
/// Frame kind: a message's bytes.
pub(crate) const DATA: u8 = 0;
/// Frame kind: the sender gave up (payload: the reason).
pub(crate) const ABORT: u8 = 1;
/// Frame kind: the sender is done and closes cleanly.
pub(crate) const BYE: u8 = 2;
/// Frame kind: a message lent in place in the shared-memory lend area.
pub(crate) const LENT: u8 = 3;
/// Frame kind: a chunk of a message in the shared-memory stream area.
pub(crate) const CHUNK: u8 = 4;
/// Frame header: magic, kind, round, payload length.
pub(crate) const HEADER: usize = 4 + 1 + 4 + 8;
/// Handshake version: 2 added the flags byte, checksums and shared memory;
/// 3 the proof; 5 sealed regions found through `/proc` and the
/// receiver's acknowledgement page.
pub(crate) const VERSION: u8 = 5;
/// Handshake flag: data frames carry a CRC-32C.
pub(crate) const FLAG_CHECKSUM: u8 = 1;
/// Handshake flag: the pair talks through shared memory (a
/// [`ShmAnnounce`] follows).
pub(crate) const FLAG_SHM: u8 = 2;
/// What a handshake with [`FLAG_SHM`] announces of the region the sender
/// made for the pair: its areas' sizes and where to find it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ShmAnnounce {
    /// Lend area, in bytes.
    pub lend: u64,
    /// Stream area, in bytes.
    pub stream: u64,
    /// The region.
    pub region: RegionRef,
}

/// Bytes of a [`ShmAnnounce`] on the wire (the sizes, u64 LE each, and a
/// [`RegionRef`]).
pub(crate) const SHM_ANNOUNCE: usize = 16 + REGION_REF;

/// Bytes of a [`RegionRef`] on the wire: process id and descriptor (u32
/// LE each), token (u64 LE).
pub(crate) const REGION_REF: usize = 16;

impl ShmAnnounce {
    /// Reads one off the wire.
    pub(crate) fn decode(b: &[u8; SHM_ANNOUNCE]) -> ShmAnnounce {
        let mut r = [0u8; REGION_REF];
        r.copy_from_slice(&b[16..]);
        ShmAnnounce { lend: u64_at(b, 0), stream: u64_at(b, 8), region: decode_region_ref(&r) }
    }

    fn encode(&self, into: &mut Vec<u8>) {
        into.extend_from_slice(&self.lend.to_le_bytes());
        into.extend_from_slice(&self.stream.to_le_bytes());
        into.extend_from_slice(&encode_region_ref(self.region));
    }
}

/// A [`RegionRef`] on the wire.
pub(crate) fn encode_region_ref(r: RegionRef) -> [u8; REGION_REF] {
    let mut b = [0u8; REGION_REF];
    b[..4].copy_from_slice(&r.pid.to_le_bytes());
    b[4..8].copy_from_slice(&r.fd.to_le_bytes());
    b[8..].copy_from_slice(&r.token.to_le_bytes());
    b
}

/// A [`RegionRef`] as read.
pub(crate) fn decode_region_ref(b: &[u8; REGION_REF]) -> RegionRef {
    RegionRef { pid: u32::from_le_bytes([b[0], b[1], b[2], b[3]]), fd: u32::from_le_bytes([b[4], b[5], b[6], b[7]]), token: u64_at(b, 8) }
}

/// Handshake flag: a proof follows (after the region sizes).
pub(crate) const FLAG_PROOF: u8 = 4;
/// Length of a handshake's proof.
pub(crate) const PROOF: usize = 32;
/// Payload of a `lent` or `chunk` frame: four u64 (LE).
pub(crate) const SHM_INFO: usize = 32;
/// Longest abort reason read.
pub(crate) const MAX_REASON: u64 = 1 << 16;
/// Handshake before the region sizes: magic, endpoint, version, flags.
pub(crate) const HELLO: usize = 4 + 5 + 1 + 1;

/// Handshake answer: accepted.
pub(crate) const HELLO_OK: u8 = 0;
/// Handshake answer: other protocol version.
pub(crate) const HELLO_VERSION: u8 = 1;
/// Handshake answer: other checksum setting.
pub(crate) const HELLO_CHECKSUM: u8 = 2;
/// Handshake answer: shared memory on one side only.
pub(crate) const HELLO_SHM: u8 = 3;
/// Handshake answer: the region could not be mapped.
pub(crate) const HELLO_REGION: u8 = 4;
/// Handshake answer: the peer is not expected.
pub(crate) const HELLO_PEER: u8 = 5;
/// Handshake answer: the proof is missing or wrong.
pub(crate) const HELLO_PROOF: u8 = 6;
/// Handshake answer: this endpoint is connected already.
pub(crate) const HELLO_DUPLICATE: u8 = 7;

/// The key a fabric's handshakes prove knowledge of: derived from the
/// job's secret for one data-plane session (so a proof from one session
/// is worthless in another). Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct HelloKey(pub [u8; 32]);

impl std::fmt::Debug for HelloKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HelloKey(<redacted>)")
    }
}

impl Drop for HelloKey {
    fn drop(&mut self) {
        self.0.fill(0);
        std::hint::black_box(&self.0);
    }
}

type Hmac = hmac::Hmac<sha2::Sha256>;

fn hello_mac(key: &HelloKey, sent: &[u8], to: Endpoint) -> Hmac {
    use hmac::Mac;
    // HMAC takes keys of any length: this cannot fail.
    let mut mac = <Hmac as hmac::digest::KeyInit>::new_from_slice(&key.0).unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
    mac.update(b"refit-data-hello/v4/");
    mac.update(sent);
    mac.update(&encode_endpoint(to));
    mac
}

/// Whether `proof` is the proof of `sent` (the handshake before it) to
/// `to` under `key` (compared in constant time).
pub(crate) fn proof_holds(key: &HelloKey, sent: &[u8], to: Endpoint, proof: &[u8]) -> bool {
    use hmac::Mac;
    hello_mac(key, sent, to).verify_slice(proof).is_ok()
}

/// Why a peer refused a handshake, from its answer.
pub(crate) fn hello_problem(code: u8) -> &'static str {
    match code {
        HELLO_VERSION => "speaks another protocol version",
        HELLO_CHECKSUM => "has the other checksum setting (TcpConfig::checksum must match on all ranks)",
        HELLO_SHM => "disagrees on whether we share a node (shared memory on one side only)",
        HELLO_REGION => "could not map our shared-memory region (the pair talks TCP)",
        HELLO_PEER => "is not (or no longer) expected",
        HELLO_PROOF => "refused the handshake: its proof of the job's secret is missing or wrong",
        HELLO_DUPLICATE => "refused the handshake: that endpoint is connected already",
        _ => "refused the handshake",
    }
}

/// An endpoint on the wire: group (u8), rank (u32 LE).
pub(crate) fn encode_endpoint(e: Endpoint) -> [u8; 5] {
    let mut b = [0u8; 5];
    b[0] = match e.group {
        Group::Src => 0,
        Group::Dst => 1,
    };
    b[1..].copy_from_slice(&e.rank.to_le_bytes());
    b
}

/// The endpoint [`encode_endpoint`] wrote.
pub(crate) fn decode_endpoint(b: &[u8; 5]) -> io::Result<Endpoint> {
    let rank = u32::from_le_bytes([b[1], b[2], b[3], b[4]]);
    match b[0] {
        0 => Ok(Endpoint::src(rank)),
        1 => Ok(Endpoint::dst(rank)),
        g => Err(io::Error::new(io::ErrorKind::InvalidData, format!("unknown group {g} in handshake"))),
    }
}

/// The handshake rank `me` sends to `to`: the fixed part, the region sizes
/// `(lend, stream)` when it talks to the peer through shared memory, and
/// the proof when the fabric has a key.
pub(crate) fn hello(me: Endpoint, to: Endpoint, checksum: bool, shm: Option<ShmAnnounce>, key: Option<&HelloKey>) -> Vec<u8> {
    use hmac::Mac;
    let mut hello = Vec::with_capacity(HELLO + SHM_ANNOUNCE + PROOF);
    hello.extend_from_slice(&MAGIC.to_le_bytes());
    hello.extend_from_slice(&encode_endpoint(me));
    hello.push(VERSION);
    let flags =
        if checksum { FLAG_CHECKSUM } else { 0 } | if shm.is_some() { FLAG_SHM } else { 0 } | if key.is_some() { FLAG_PROOF } else { 0 };
    hello.push(flags);
    if let Some(a) = shm {
        a.encode(&mut hello);
    }
    if let Some(key) = key {
        let proof = hello_mac(key, &hello, to).finalize().into_bytes();
        hello.extend_from_slice(&proof);
    }
    hello
}

/// The fixed part of a handshake: the peer, its version and flags.
pub(crate) fn decode_hello(hello: &[u8; HELLO]) -> io::Result<(Endpoint, u8, u8)> {
    if u32::from_le_bytes([hello[0], hello[1], hello[2], hello[3]]) != MAGIC {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "bad handshake"));
    }
    let peer = decode_endpoint(&[hello[4], hello[5], hello[6], hello[7], hello[8]])?;
    Ok((peer, hello[9], hello[10]))
}

/// A frame header.
pub(crate) fn header(kind: u8, round: u32, len: u64) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4] = kind;
    h[5..9].copy_from_slice(&round.to_le_bytes());
    h[9..].copy_from_slice(&len.to_le_bytes());
    h
}

/// A frame header as read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    /// [`DATA`], [`ABORT`], [`BYE`], [`LENT`] or [`CHUNK`].
    pub(crate) kind: u8,
    pub(crate) round: u32,
    /// Payload length.
    pub(crate) len: u64,
}

/// The header [`header`] wrote, or `None` for a bad magic or an unknown
/// kind.
pub(crate) fn decode_header(h: &[u8; HEADER]) -> Option<Header> {
    let magic = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    let kind = h[4];
    let round = u32::from_le_bytes([h[5], h[6], h[7], h[8]]);
    let len = u64::from_le_bytes([h[9], h[10], h[11], h[12], h[13], h[14], h[15], h[16]]);
    if magic != MAGIC || kind > CHUNK {
        return None;
    }
    Some(Header { kind, round, len })
}

/// The payload of a `lent` or `chunk` frame.
pub(crate) fn shm_info(a: u64, b: u64, c: u64, d: u64) -> [u8; SHM_INFO] {
    let mut i = [0u8; SHM_INFO];
    for (k, v) in [a, b, c, d].into_iter().enumerate() {
        i[k * 8..k * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    i
}

/// The four values [`shm_info`] wrote.
pub(crate) fn decode_shm_info(info: &[u8; SHM_INFO]) -> [u64; 4] {
    [u64_at(info, 0), u64_at(info, 8), u64_at(info, 16), u64_at(info, 24)]
}

/// The u64 (LE) at `at` in `b`.
pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Calls `f` with every contiguous byte run of a payload, in wire order.
///
/// # Safety
/// The memory the payload's segments point into must stay valid and
/// unwritten while the payload lives (the executor's contract).
pub(crate) unsafe fn for_payload_runs<'a>(payload: &'a Payload, mut f: impl FnMut(&'a [u8])) -> io::Result<()> {
    if let Payload::Pieces(sent) = payload {
        if sent.leaves_conversion() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "pieces left to convert cannot go out as bytes"));
        }
    }
    // SAFETY: the caller's contract. No run is shorter than 0 bytes, so
    // every piece comes run by run; a short piece would be walked here
    // the same way (in bounds, checked by `for_payload_items`); no piece
    // is left to convert (checked above).
    unsafe {
        for_payload_items(payload, 0, |item| match item {
            Item::Run(run) => f(run),
            Item::Short { counts, view } => for_each_run(counts, &view, |run| f(std::slice::from_raw_parts(run.as_ptr(), run.len()))),
            Item::Convert { .. } => {}
        })
    }
}

/// A piece whose contiguous runs are shorter than this goes to the wire
/// packed by one strided copy rather than run by run (below the copy
/// kernel's streaming threshold, so what it packs stays in cache for
/// whoever reads it next).
pub(crate) const SHORT_RUN: u64 = 256;

/// A stretch of a payload's bytes in wire order, as
/// [`for_payload_items`] hands them out.
pub(crate) enum Item<'a> {
    /// Contiguous bytes.
    Run(&'a [u8]),
    /// A whole piece whose contiguous runs are short (rows a few elements
    /// wide): its element counts and its view, checked to be in bounds.
    Short { counts: &'a [u64], view: StridedRef },
    /// A whole piece left unconverted ([`SentPieces::leaves_conversion`](crate::SentPieces::leaves_conversion)):
    /// its element counts, its view (in its buffer's type, checked to be
    /// in bounds) and the type it goes out in, packed.
    Convert { counts: &'a [u64], view: StridedRef, wire: reshard::DType },
}

/// Calls `f` with a payload's bytes in wire order: pieces whose runs are
/// shorter than `short` bytes whole, as [`Item::Short`] (for one strided
/// copy), everything else run by run.
///
/// # Safety
/// The memory the payload's segments point into must stay valid and
/// unwritten while the payload lives (the executor's contract).
pub(crate) unsafe fn for_payload_items<'a>(payload: &'a Payload, short: u64, mut f: impl FnMut(Item<'a>)) -> io::Result<()> {
    let mut one = |counts: &'a [u64], view: StridedRef, wire: reshard::DType| {
        if view.dtype != wire {
            f(Item::Convert { counts, view, wire });
        } else if run_bytes(counts, &view) < short {
            f(Item::Short { counts, view });
        } else {
            // SAFETY: in bounds (checked by the caller); valid while the
            // payload lives (the caller's contract), so the runs may
            // borrow it.
            unsafe { for_each_run(counts, &view, |run| f(Item::Run(std::slice::from_raw_parts(run.as_ptr(), run.len())))) };
        }
    };
    match payload {
        Payload::Pieces(sent) => {
            // Every piece checked before any run is handed out.
            if let Some(Err(b)) = sent.pieces().find(Result::is_err) {
                return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("piece {} does not fit the sender's memory", b.block())));
            }
            for p in sent.pieces().flatten() {
                one(p.extent, p.view, p.wire);
            }
        }
        Payload::Segments { segments, .. } => {
            if segments.iter().any(|s| !in_bounds(s.extent(), s.view())) {
                return Err(io::Error::new(io::ErrorKind::InvalidInput, "segment out of bounds"));
            }
            for s in segments {
                one(s.extent(), *s.view(), s.view().dtype);
            }
        }
        Payload::Bytes(b) => f(Item::Run(b)),
        Payload::Lent(l) => f(Item::Run(l.as_slice())),
        Payload::Stream(_) => return Err(io::Error::new(io::ErrorKind::InvalidInput, "a received frame cannot be sent on")),
    }
    Ok(())
}

/// Bytes a payload puts on the wire.
pub(crate) fn payload_len(payload: &Payload) -> u64 {
    match payload {
        Payload::Bytes(b) => b.len() as u64,
        Payload::Lent(l) => l.as_slice().len() as u64,
        Payload::Segments { segments, .. } => segments.iter().map(|s| s.numel() * s.view().dtype.size()).sum(),
        Payload::Pieces(sent) => sent.wire_bytes(),
        Payload::Stream(frame) => frame.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = header(CHUNK, 7, 1 << 40);
        assert_eq!(&h[..4], b"RFIT");
        assert_eq!(decode_header(&h), Some(Header { kind: CHUNK, round: 7, len: 1 << 40 }));
        let mut bad = h;
        bad[4] = CHUNK + 1;
        assert_eq!(decode_header(&bad), None);
        bad = h;
        bad[0] ^= 1;
        assert_eq!(decode_header(&bad), None);
    }

    #[test]
    fn hello_round_trips() {
        let plain = hello(Endpoint::dst(3), Endpoint::src(0), true, None, None);
        assert_eq!(plain.len(), HELLO);
        let fixed: [u8; HELLO] = plain[..].try_into().unwrap();
        assert_eq!(decode_hello(&fixed).unwrap(), (Endpoint::dst(3), VERSION, FLAG_CHECKSUM));
        let a = ShmAnnounce { lend: 5, stream: 6, region: RegionRef { pid: 77, fd: 9, token: 0xfeed_beef } };
        let shared = hello(Endpoint::src(9), Endpoint::src(1), false, Some(a), None);
        assert_eq!(shared.len(), HELLO + SHM_ANNOUNCE);
        let fixed: [u8; HELLO] = shared[..HELLO].try_into().unwrap();
        assert_eq!(decode_hello(&fixed).unwrap(), (Endpoint::src(9), VERSION, FLAG_SHM));
        let announced: [u8; SHM_ANNOUNCE] = shared[HELLO..].try_into().unwrap();
        assert_eq!(ShmAnnounce::decode(&announced), a);
        let mut bad = fixed;
        bad[4] = 2;
        assert!(decode_hello(&bad).unwrap_err().to_string().contains("unknown group 2"));
        bad = fixed;
        bad[1] = 0;
        assert_eq!(decode_hello(&bad).unwrap_err().to_string(), "bad handshake");
    }

    #[test]
    fn proofs_bind_key_sender_receiver_and_settings() {
        let key = HelloKey([7; 32]);
        let (me, to) = (Endpoint::src(2), Endpoint::dst(5));
        let h = hello(
            me,
            to,
            true,
            Some(ShmAnnounce { lend: 1 << 20, stream: 1 << 16, region: RegionRef { pid: 1, fd: 2, token: 7 } }),
            Some(&key),
        );
        assert_eq!(h.len(), HELLO + SHM_ANNOUNCE + PROOF);
        let fixed: [u8; HELLO] = h[..HELLO].try_into().unwrap();
        assert_eq!(decode_hello(&fixed).unwrap(), (me, VERSION, FLAG_CHECKSUM | FLAG_SHM | FLAG_PROOF));
        let (sent, proof) = h.split_at(HELLO + SHM_ANNOUNCE);
        assert!(proof_holds(&key, sent, to, proof));
        // Another receiver, another key, any changed byte: no.
        assert!(!proof_holds(&key, sent, Endpoint::dst(6), proof));
        assert!(!proof_holds(&HelloKey([8; 32]), sent, to, proof));
        for i in 0..sent.len() {
            let mut changed = sent.to_vec();
            changed[i] ^= 1;
            assert!(!proof_holds(&key, &changed, to, proof), "byte {i}");
        }
        assert!(!proof_holds(&key, sent, to, &proof[..31]));
        assert_eq!(format!("{key:?}"), "HelloKey(<redacted>)");
    }

    #[test]
    fn shm_info_round_trips() {
        assert_eq!(decode_shm_info(&shm_info(1, 2, u64::MAX, 4)), [1, 2, u64::MAX, 4]);
    }
}
