//! Hostile control frames: a table of bad frames (built here, byte by byte)
//! decoded as the control messages `refit launch` exchanges, each of which
//! must fail with a clear `CodecError` and never panic; then byte soup
//! (arbitrary bytes, arbitrary payloads behind a valid header, mutations of
//! valid frames) into the frame reader and the decoders.
//!
//! The message types mirror `ToLauncher` and `Peers` of `src/launch.rs`
//! (private there); `Terminated` and `CallError` are the runtime's own.

use actors::codec::{decode, decode_frame, encode, encode_frame, read_frame, CodecError, DEFAULT_MAX_SIZE};
use actors::{CallError, Terminated};
use proptest::prelude::*;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::fmt::Debug;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// Mirrors `ToLauncher` in `src/launch.rs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum ToLauncher {
    Hello { group: u8, rank: u32, data_addr: String, fingerprint: u64 },
    Done { group: u8, rank: u32, sent_bytes: u64, recv_bytes: u64, elapsed_ns: u64, verified: Option<u64>, error: Option<String> },
}

/// Mirrors `Peers` in `src/launch.rs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Peers {
    table: Vec<(u8, u32, String)>,
}

fn hello() -> ToLauncher {
    ToLauncher::Hello { group: 1, rank: 3, data_addr: "127.0.0.1:4000".into(), fingerprint: 0xfeed_beef }
}

fn done() -> ToLauncher {
    ToLauncher::Done { group: 0, rank: 1, sent_bytes: 10, recv_bytes: 20, elapsed_ns: 30, verified: Some(40), error: None }
}

fn peers() -> Peers {
    Peers { table: vec![(0, 0, "127.0.0.1:4000".into()), (1, 0, "127.0.0.1:4001".into())] }
}

/// `payload` behind a length prefix of its own size.
fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(payload);
    out
}

/// A length prefix claiming `len` bytes, followed by `body`.
fn claim(len: u32, body: &[u8]) -> Vec<u8> {
    let mut out = len.to_le_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

/// bincode's varint for a u64 written with the 8-byte marker.
fn varint_u64(n: u64) -> Vec<u8> {
    let mut out = vec![0xfd];
    out.extend_from_slice(&n.to_le_bytes());
    out
}

/// Which message a frame is decoded as.
#[derive(Debug, Clone, Copy)]
enum As {
    ToLauncher,
    Peers,
}

fn decode_as(kind: As, buf: &[u8]) -> Result<String, CodecError> {
    match kind {
        As::ToLauncher => decode_frame::<ToLauncher>(buf).map(|(v, rest)| format!("{v:?} + {} bytes", rest.len())),
        As::Peers => decode_frame::<Peers>(buf).map(|(v, rest)| format!("{v:?} + {} bytes", rest.len())),
    }
}

/// Decodes one bad frame under `catch_unwind` and a time limit; the error's
/// message must contain `expect`. Returns what went wrong, if anything.
fn check(name: &str, kind: As, buf: &[u8], expect: &str) -> Option<String> {
    let start = Instant::now();
    let outcome = catch_unwind(AssertUnwindSafe(|| decode_as(kind, buf)));
    let took = start.elapsed();
    let msg = match outcome {
        Err(_) => return Some(format!("{name}: panicked")),
        Ok(Ok(v)) => return Some(format!("{name}: accepted as {v}")),
        Ok(Err(e)) => e.to_string(),
    };
    if took > Duration::from_secs(2) {
        return Some(format!("{name}: took {took:?}"));
    }
    if !msg.contains(expect) || msg.contains('\n') {
        return Some(format!("{name}: message {msg:?} lacks {expect:?} (or spans lines)"));
    }
    None
}

#[test]
fn hostile_frames_are_rejected_clearly() {
    let hello_bytes = encode(&hello()).unwrap();
    let peers_bytes = encode(&peers()).unwrap();
    let mut trailing = hello_bytes.clone();
    trailing.extend_from_slice(&[0, 0]);
    // Hello: variant 0, group 1, rank 3, then the address string.
    let mut bad_utf8 = vec![0, 1, 3, 3, 0xff, 0xfe, b'x'];
    bad_utf8.extend_from_slice(&varint_u64(1));
    let mut forged_string = vec![0, 1, 3];
    forged_string.extend_from_slice(&varint_u64(1 << 60));
    let mut forged_vec = varint_u64(1 << 60);
    forged_vec.extend_from_slice(&[0, 0, 1, b'a']);
    // Done: variant 1, group, rank, three u64, then Option tag 2.
    let bad_option = vec![1, 0, 1, 10, 20, 30, 2, 40, 0];
    // Hello with a rank that needs 8 bytes: does not fit a u32.
    let mut rank_too_wide = vec![0, 1];
    rank_too_wide.extend_from_slice(&varint_u64(1 << 40));
    rank_too_wide.extend_from_slice(&[0, 0]);
    // Hello with a u32 rank behind the u128 marker (0xfe).
    let rank_u128_marker = [&[0u8, 1, 0xfe][..], &[0; 16], &[0, 0]].concat();

    let cases: Vec<(&str, As, Vec<u8>, String)> = vec![
        ("empty", As::Peers, vec![], "truncated frame: need 4 bytes, have 0".into()),
        ("truncated header", As::ToLauncher, vec![7, 0], "truncated frame: need 4 bytes, have 2".into()),
        ("truncated body", As::ToLauncher, claim(10, &[0, 1, 2]), "truncated frame: need 14 bytes, have 7".into()),
        (
            "length prefix 0xFFFFFFFF",
            As::Peers,
            claim(u32::MAX, &[1, 2, 3]),
            format!("4294967295 bytes exceed the size limit of {DEFAULT_MAX_SIZE} bytes"),
        ),
        (
            "length prefix one over the maximum",
            As::Peers,
            claim(DEFAULT_MAX_SIZE as u32 + 1, &[]),
            format!("{} bytes exceed the size limit of {DEFAULT_MAX_SIZE} bytes", DEFAULT_MAX_SIZE + 1),
        ),
        ("empty payload", As::ToLauncher, frame(&[]), "decoding failed: unexpected end of input".into()),
        ("wrong type: Peers read as ToLauncher", As::ToLauncher, frame(&peers_bytes), "expected variant index 0 <= i < 2".into()),
        ("wrong type: Hello read as Peers", As::Peers, frame(&hello_bytes), "trailing byte(s) after the decoded value".into()),
        ("trailing bytes", As::ToLauncher, frame(&trailing), "2 trailing byte(s) after the decoded value".into()),
        ("truncated payload", As::ToLauncher, frame(&hello_bytes[..hello_bytes.len() - 1]), "unexpected end of input".into()),
        ("forged string length 2^60", As::ToLauncher, frame(&forged_string), "decoding would allocate more than 1048576 bytes".into()),
        ("forged Vec length 2^60", As::Peers, frame(&forged_vec), "unexpected end of input".into()),
        (
            "invalid enum tag",
            As::ToLauncher,
            frame(&[7, 0, 0]),
            "decoding failed: invalid value: integer `7`, expected variant index".into(),
        ),
        ("invalid UTF-8 string", As::ToLauncher, frame(&bad_utf8), "decoding failed: invalid UTF-8 in a string".into()),
        ("invalid Option tag", As::ToLauncher, frame(&bad_option), "decoding failed: invalid variant index 2 for Option<T>".into()),
        (
            "rank does not fit u32",
            As::ToLauncher,
            frame(&rank_too_wide),
            "decoding failed: integer encoded as U64 where U32 was expected".into(),
        ),
        ("u128 varint marker for a u32", As::ToLauncher, frame(&rank_u128_marker), "integer encoded as U128 where U32 was expected".into()),
    ];
    assert!(cases.len() >= 10);
    let failures: Vec<String> = cases.iter().filter_map(|(name, kind, buf, expect)| check(name, *kind, buf, expect)).collect();
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

/// Decodes `bytes` as `T` under `catch_unwind`; anything decoded must
/// re-encode and decode back to itself.
fn decode_never_panics<T: Serialize + DeserializeOwned + PartialEq + Debug>(bytes: &[u8]) -> Result<(), TestCaseError> {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        if let Ok(value) = decode::<T>(bytes) {
            let again = decode::<T>(&encode(&value).expect("a decoded value encodes")).expect("a re-encoded value decodes");
            assert_eq!(again, value);
        }
        if let Ok((value, _rest)) = decode_frame::<T>(bytes) {
            let mut out = Vec::new();
            encode_frame(&mut out, &value).expect("a decoded value frames");
        }
    }));
    prop_assert!(outcome.is_ok(), "panicked on {:?}", bytes);
    Ok(())
}

/// Every message type the control plane decodes.
fn all_types(bytes: &[u8]) -> Result<(), TestCaseError> {
    decode_never_panics::<ToLauncher>(bytes)?;
    decode_never_panics::<Peers>(bytes)?;
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let _ = decode::<Terminated>(bytes);
        let _ = decode::<CallError>(bytes);
        let mut rest = bytes;
        while let Ok((payload, next)) = read_frame(rest, 1 << 16) {
            let _ = decode::<ToLauncher>(payload);
            if next.len() == rest.len() {
                break;
            }
            rest = next;
        }
    }));
    prop_assert!(outcome.is_ok(), "panicked on {:?}", bytes);
    Ok(())
}

fn valid_frame() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![Just(hello()), Just(done())]
        .prop_map(|m| encode(&m).unwrap())
        .boxed()
        .prop_union(Just(encode(&peers()).unwrap()).boxed())
        .prop_map(|payload| frame(&payload))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn prop_arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        all_types(&bytes)?;
    }

    #[test]
    fn prop_arbitrary_payload_behind_a_valid_header(payload in proptest::collection::vec(any::<u8>(), 0..256)) {
        all_types(&frame(&payload))?;
    }

    #[test]
    fn prop_mutated_frames_never_panic(
        base in valid_frame(),
        edits in proptest::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 1..6),
    ) {
        let mut bytes = base;
        for (pos, byte, op) in edits {
            let len = bytes.len();
            match op {
                0 if len > 0 => bytes[pos % len] = byte,
                1 => bytes.insert(pos % (len + 1), byte),
                _ if len > 0 => {
                    bytes.remove(pos % len);
                }
                _ => {}
            }
        }
        all_types(&bytes)?;
    }
}
