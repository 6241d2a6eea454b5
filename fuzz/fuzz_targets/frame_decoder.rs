//! Arbitrary bytes into the codec's frame reader and decoders, as a peer on
//! the control socket could send them. The message types mirror the control
//! messages of `src/launch.rs` and the runtime's own serializable types.
//!
//! Oracle: no panic; whatever decodes re-encodes, and that decodes to the
//! same value (bincode accepts non-canonical varints, so the bytes may differ).
#![no_main]

use actors::codec::{decode, decode_frame, encode, read_frame, DEFAULT_MAX_SIZE};
use actors::{CallError, Terminated};
use libfuzzer_sys::fuzz_target;
use serde::{Deserialize, Serialize};

/// Mirrors `ToLauncher` in `src/launch.rs`.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum ToLauncher {
    Hello { group: u8, rank: u32, data_addr: String, fingerprint: u64 },
    Done { group: u8, rank: u32, sent_bytes: u64, recv_bytes: u64, elapsed_ns: u64, verified: Option<u64>, error: Option<String> },
}

/// Mirrors `Peers` in `src/launch.rs`.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Peers {
    table: Vec<(u8, u32, String)>,
}

fn round_trips<T: Serialize + for<'de> Deserialize<'de> + PartialEq + std::fmt::Debug>(payload: &[u8]) {
    if let Ok(value) = decode::<T>(payload) {
        let bytes = encode(&value).expect("a decoded value encodes");
        let again = decode::<T>(&bytes).expect("a re-encoded value decodes");
        assert_eq!(again, value);
    }
}

fuzz_target!(|data: &[u8]| {
    // A stream of frames, each decoded as every message type.
    let mut rest = data;
    while let Ok((payload, next)) = read_frame(rest, DEFAULT_MAX_SIZE) {
        round_trips::<ToLauncher>(payload);
        round_trips::<Peers>(payload);
        let _ = decode::<Terminated>(payload);
        let _ = decode::<CallError>(payload);
        if next.len() == rest.len() {
            break;
        }
        rest = next;
    }
    let _ = decode_frame::<ToLauncher>(data);
    let _ = decode_frame::<Peers>(data);
    round_trips::<ToLauncher>(data);
});
