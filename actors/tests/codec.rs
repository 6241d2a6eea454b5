//! The codec: round trips, strictness, framing and hostile input.

use std::collections::BTreeMap;

use actors::codec::{
    decode, decode_frame, decode_with_max, encode, encode_frame, encode_with_max, read_frame, write_frame, CodecError, DEFAULT_MAX_SIZE,
    FRAME_HEADER_LEN, MAX_SIZE_CEILING,
};
use actors::{ActorError, ActorInfo, CallError, StopReason, Terminated};
use proptest::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Dtype {
    Bf16,
    F32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct TensorMeta {
    name: String,
    shape: Vec<u64>,
    dtype: Dtype,
    shard: Option<(u32, u32)>,
    scale: f32,
    attrs: BTreeMap<String, i64>,
}

fn meta() -> TensorMeta {
    TensorMeta {
        name: "model.layers.0.self_attn.q_proj.weight".into(),
        shape: vec![4096, 4096],
        dtype: Dtype::Bf16,
        shard: Some((1, 8)),
        scale: 0.5,
        attrs: BTreeMap::from([("step".into(), 42), ("version".into(), -1)]),
    }
}

#[test]
fn round_trips_a_struct() {
    let value = meta();
    let bytes = encode(&value).unwrap();
    assert_eq!(decode::<TensorMeta>(&bytes).unwrap(), value);
}

#[test]
fn runtime_types_round_trip() {
    let info = ActorInfo { id: uuid::Uuid::nil(), name: "trainer[3]".into(), rank: Some(3) };
    let event = Terminated { id: info.id, name: info.name.clone(), rank: info.rank, reason: StopReason::Panicked("boom".into()) };
    assert_eq!(decode::<Terminated>(&encode(&event).unwrap()).unwrap(), event);
    let err = CallError::Handler { actor: info, error: ActorError::Fatal("bad".into()) };
    assert_eq!(decode::<CallError>(&encode(&err).unwrap()).unwrap(), err);
}

#[test]
fn trailing_bytes_are_rejected() {
    let mut bytes = encode(&meta()).unwrap();
    bytes.extend_from_slice(&[0, 1]);
    assert_eq!(decode::<TensorMeta>(&bytes).unwrap_err(), CodecError::TrailingBytes { trailing: 2 });
}

#[test]
fn short_or_invalid_input_is_an_error() {
    let bytes = encode(&meta()).unwrap();
    assert!(matches!(decode::<TensorMeta>(&bytes[..bytes.len() - 1]), Err(CodecError::Decode(_))));
    assert!(matches!(decode::<u32>(&[]), Err(CodecError::Decode(_))));
    // 2 is not a valid variant index of `Dtype`.
    assert!(matches!(decode::<Dtype>(&[2]), Err(CodecError::Decode(_))));
    // Invalid UTF-8 in a string.
    assert!(matches!(decode::<String>(&[1, 0xff]), Err(CodecError::Decode(_))));
}

/// A varint-encoded length as bincode writes it: marker 0xFD, then a u64.
fn forged_len(len: u64) -> Vec<u8> {
    let mut bytes = vec![0xFD];
    bytes.extend_from_slice(&len.to_le_bytes());
    bytes
}

#[test]
fn forged_length_inside_payload_hits_the_limit_instead_of_allocating() {
    // A string claiming u64::MAX bytes, and one claiming 1 GiB: the 9-byte
    // input allows a budget of 1 MiB, so neither is allocated.
    assert_eq!(decode::<String>(&forged_len(u64::MAX)).unwrap_err(), CodecError::LimitExceeded { limit: 1024 * 1024 });
    assert_eq!(decode::<String>(&forged_len(1 << 30)).unwrap_err(), CodecError::LimitExceeded { limit: 1024 * 1024 });
    // Within budget the claim is rejected for lack of input.
    assert!(matches!(decode::<String>(&forged_len(1000)), Err(CodecError::Decode(_))));
    // Sequences are read element by element; a forged count just runs out of input.
    assert!(matches!(decode::<Vec<u64>>(&forged_len(1 << 40)), Err(CodecError::Decode(_))));
}

#[test]
fn dense_values_within_the_size_limit_decode() {
    // u128s and u64s take 1 encoded byte each but 16/8 bytes in memory,
    // which bincode's limit counts: still within budget.
    let dense = (vec![1u128; 5000], vec![7u64; 5000], vec![Some(()); 100]);
    let bytes = encode_with_max(&dense, 16 * 1024).unwrap();
    assert!(bytes.len() < 16 * 1024);
    assert_eq!(decode_with_max::<(Vec<u128>, Vec<u64>, Vec<Option<()>>)>(&bytes, 16 * 1024).unwrap(), dense);
}

#[test]
fn size_limits_apply_to_both_directions() {
    assert_eq!(decode_with_max::<Vec<u8>>(&[0; 9], 8).unwrap_err(), CodecError::TooLarge { len: 9, max: 8 });
    let err = encode_with_max(&vec![7u8; 100], 16).unwrap_err();
    assert!(matches!(err, CodecError::TooLarge { len, max: 16 } if len > 16), "{err:?}");
    let ok = encode_with_max(&vec![7u8; 10], 16).unwrap();
    assert_eq!(decode_with_max::<Vec<u8>>(&ok, 16).unwrap(), vec![7u8; 10]);
    // No maximum lifts the ceiling.
    let err = decode_with_max::<u8>(&vec![0; MAX_SIZE_CEILING + 1], usize::MAX).unwrap_err();
    assert_eq!(err, CodecError::TooLarge { len: MAX_SIZE_CEILING + 1, max: MAX_SIZE_CEILING });
}

#[test]
fn frames_are_read_back_in_sequence() {
    let mut buf = Vec::new();
    write_frame(&mut buf, b"first", 64).unwrap();
    write_frame(&mut buf, b"", 64).unwrap();
    encode_frame(&mut buf, &meta()).unwrap();

    let (first, rest) = read_frame(&buf, 64).unwrap();
    assert_eq!(first, b"first");
    let (empty, rest) = read_frame(rest, 64).unwrap();
    assert!(empty.is_empty());
    let (value, rest) = decode_frame::<TensorMeta>(rest).unwrap();
    assert_eq!(value, meta());
    assert!(rest.is_empty());
}

#[test]
fn truncated_frames_are_reported() {
    let mut buf = Vec::new();
    write_frame(&mut buf, b"payload", 64).unwrap();
    assert_eq!(
        read_frame(&buf[..buf.len() - 1], 64).unwrap_err(),
        CodecError::Truncated { needed: FRAME_HEADER_LEN + 7, available: FRAME_HEADER_LEN + 6 }
    );
    assert_eq!(read_frame(&buf[..2], 64).unwrap_err(), CodecError::Truncated { needed: FRAME_HEADER_LEN, available: 2 });
    assert!(matches!(decode_frame::<TensorMeta>(&[]), Err(CodecError::Truncated { .. })));
}

#[test]
fn oversized_length_prefix_is_rejected_before_reading_the_payload() {
    // Claims 4 GiB - 1, carries 3 bytes.
    let buf = [0xff, 0xff, 0xff, 0xff, 1, 2, 3];
    assert_eq!(read_frame(&buf, 1024).unwrap_err(), CodecError::TooLarge { len: u32::MAX as usize, max: 1024 });
    assert!(matches!(decode_frame::<TensorMeta>(&buf), Err(CodecError::TooLarge { max: DEFAULT_MAX_SIZE, .. })));
}

#[test]
fn oversized_frames_are_not_written() {
    let mut buf = vec![9];
    assert_eq!(write_frame(&mut buf, &[0; 10], 4).unwrap_err(), CodecError::TooLarge { len: 10, max: 4 });
    assert_eq!(buf, [9], "output untouched on error");
}

proptest! {
    #[test]
    fn prop_round_trip(
        step in any::<u64>(),
        name in ".{0,40}",
        data in proptest::collection::vec(any::<u8>(), 0..256),
        shard in any::<Option<(u32, u32)>>(),
        pairs in proptest::collection::vec((any::<u16>(), any::<bool>()), 0..16),
    ) {
        let value = (step, name, data, shard, pairs);
        let bytes = encode(&value).unwrap();
        prop_assert_eq!(decode::<(u64, String, Vec<u8>, Option<(u32, u32)>, Vec<(u16, bool)>)>(&bytes).unwrap(), value.clone());

        let mut framed = Vec::new();
        encode_frame(&mut framed, &value).unwrap();
        encode_frame(&mut framed, &step).unwrap();
        let (back, rest) = decode_frame::<(u64, String, Vec<u8>, Option<(u32, u32)>, Vec<(u16, bool)>)>(&framed).unwrap();
        prop_assert_eq!(back, value);
        let (back_step, rest) = decode_frame::<u64>(rest).unwrap();
        prop_assert_eq!(back_step, step);
        prop_assert!(rest.is_empty());
    }

    #[test]
    fn prop_hostile_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = decode::<TensorMeta>(&bytes);
        let _ = decode::<(String, Vec<u64>)>(&bytes);
        let _ = decode_with_max::<Vec<String>>(&bytes, 32);
        let _ = read_frame(&bytes, 16);
        let _ = decode_frame::<Vec<u8>>(&bytes);
    }

    #[test]
    fn prop_every_strict_prefix_of_a_frame_is_truncated(payload in proptest::collection::vec(any::<u8>(), 0..64)) {
        let mut buf = Vec::new();
        write_frame(&mut buf, &payload, 64).unwrap();
        for cut in 0..buf.len() {
            let is_truncated = matches!(read_frame(&buf[..cut], 64), Err(CodecError::Truncated { .. }));
            prop_assert!(is_truncated, "cut at {}", cut);
        }
        prop_assert_eq!(read_frame(&buf, 64).unwrap(), (&payload[..], &[][..]));
    }
}
