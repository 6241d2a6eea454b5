//! The project's one serialization module: every bincode call lives here.
//!
//! Messages that may cross process boundaries derive `serde`'s `Serialize`
//! and `Deserialize` and are turned into bytes only through this module.
//! bincode is pinned at `=2.0.1` (its serde API, `standard()` config: varint
//! integers, little endian): bincode 3.0 is an empty release and the crate is
//! unmaintained, so a switch to another format is expected at some point.
//! Keeping every call here makes that a one-file change; no bincode type
//! appears in this module's API.
//!
//! Untrusted input is handled defensively:
//! - [`decode`] rejects trailing bytes and input larger than the maximum, and
//!   decodes under bincode's byte limit, so a forged length inside the
//!   payload cannot make it allocate much more than the input could
//!   legitimately describe (see [`decode_with_max`]).
//! - [`read_frame`] checks a frame's length prefix against a maximum before
//!   touching the payload and never allocates (it borrows from the buffer).
//! - Nothing here panics on malformed input; every failure is a
//!   [`CodecError`].
//!
//! Frame format: a `u32` little-endian payload length, then the payload.

use bincode::enc::write::Writer;
use bincode::error::{DecodeError, EncodeError};
use serde::de::DeserializeOwned;
use serde::Serialize;
use thiserror::Error;

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

/// Default maximum size of an encoded message or frame payload (64 MiB).
pub const DEFAULT_MAX_SIZE: usize = 64 * MIB;

/// Hard ceiling on the size of an encoded message (128 MiB), whatever
/// maximum is asked for. Bulk tensor data does not belong in messages.
pub const MAX_SIZE_CEILING: usize = 128 * MIB;

/// Size of a frame's length prefix.
pub const FRAME_HEADER_LEN: usize = 4;

/// Errors of encoding, decoding and framing.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CodecError {
    /// The value could not be serialized.
    #[error("encoding failed: {0}")]
    Encode(String),
    /// The bytes are not a valid encoding of the requested type.
    #[error("decoding failed: {0}")]
    Decode(String),
    /// A value was decoded but bytes were left over.
    #[error("{trailing} trailing byte(s) after the decoded value")]
    TrailingBytes {
        /// How many bytes were left over.
        trailing: usize,
    },
    /// A message or frame is larger than allowed. When encoding, `len` is
    /// the size at which encoding was abandoned (a lower bound).
    #[error("{len} bytes exceed the size limit of {max} bytes")]
    TooLarge {
        /// The (claimed, or at least reached) size.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Lengths inside the payload claim more memory than its size allows
    /// (a forged or corrupted length).
    #[error("decoding would allocate more than {limit} bytes")]
    LimitExceeded {
        /// The allocation budget for this input.
        limit: usize,
    },
    /// The buffer ends before the frame does. When reading a stream, this
    /// means "read more bytes and retry".
    #[error("truncated frame: need {needed} bytes, have {available}")]
    Truncated {
        /// Bytes needed for the complete frame (header included), as far as
        /// known.
        needed: usize,
        /// Bytes available.
        available: usize,
    },
}

/// Encodes `value`, failing if the result would exceed [`DEFAULT_MAX_SIZE`].
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, CodecError> {
    encode_with_max(value, DEFAULT_MAX_SIZE)
}

/// Encodes `value`, failing (without building the whole encoding) if the
/// result would exceed `max_len` bytes (or [`MAX_SIZE_CEILING`]).
pub fn encode_with_max<T: Serialize + ?Sized>(value: &T, max_len: usize) -> Result<Vec<u8>, CodecError> {
    let mut out = Vec::new();
    encode_append(&mut out, value, max_len)?;
    Ok(out)
}

/// Decodes a `T` that must occupy all of `bytes`, which may be at most
/// [`DEFAULT_MAX_SIZE`] long.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    decode_with_max(bytes, DEFAULT_MAX_SIZE)
}

/// Decodes a `T` that must occupy all of `bytes`, which may be at most
/// `max_len` (and [`MAX_SIZE_CEILING`]) long.
///
/// Whatever [`encode_with_max`] produced under the same `max_len` decodes.
/// Allocation is bounded by bincode's byte limit, chosen from the input size:
/// bincode counts the in-memory size of what it decodes (at most 16 bytes per
/// encoded byte, for a `u128`), so the limit is 16 times the input size,
/// rounded up to a tier of 1 MiB, 16 MiB, 256 MiB or 2 GiB.
pub fn decode_with_max<T: DeserializeOwned>(bytes: &[u8], max_len: usize) -> Result<T, CodecError> {
    let max = max_len.min(MAX_SIZE_CEILING);
    if bytes.len() > max {
        return Err(CodecError::TooLarge { len: bytes.len(), max });
    }
    let (value, read) = decode_limited::<T>(bytes)?;
    match bytes.len().checked_sub(read) {
        Some(0) => Ok(value),
        Some(trailing) => Err(CodecError::TrailingBytes { trailing }),
        // bincode never reports reading more than it was given.
        None => Err(CodecError::Decode(format!("decoder reported reading {read} of {} bytes", bytes.len()))),
    }
}

/// Decodes under a byte limit of at least 16 × `bytes.len()` (see
/// [`decode_with_max`]); `bytes.len()` is at most [`MAX_SIZE_CEILING`].
fn decode_limited<T: DeserializeOwned>(bytes: &[u8]) -> Result<(T, usize), CodecError> {
    // bincode's limit is a const generic, hence one instantiation per tier.
    macro_rules! decode_under {
        ($limit:expr) => {{
            const LIMIT: usize = $limit;
            let config = bincode::config::standard().with_limit::<LIMIT>();
            bincode::serde::decode_from_slice::<T, _>(bytes, config).map_err(|err| decode_error(err, LIMIT))
        }};
    }
    match bytes.len() {
        len if len <= 64 * KIB => decode_under!(16 * 64 * KIB),
        len if len <= MIB => decode_under!(16 * MIB),
        len if len <= 16 * MIB => decode_under!(16 * 16 * MIB),
        // `MAX_SIZE_CEILING` bounds the input; 2 GiB still fits a 32-bit usize.
        _ => decode_under!(16 * MAX_SIZE_CEILING),
    }
}

/// bincode's own `Display` is its `Debug` output; the common malformed-input
/// cases get a plain sentence instead.
fn decode_error(err: DecodeError, limit: usize) -> CodecError {
    let text = match err {
        DecodeError::LimitExceeded => return CodecError::LimitExceeded { limit },
        DecodeError::UnexpectedEnd { .. } => "unexpected end of input".to_owned(),
        DecodeError::OtherString(text) => text,
        DecodeError::Other(text) => text.to_owned(),
        DecodeError::Utf8 { inner } => format!("invalid UTF-8 in a string: {inner}"),
        DecodeError::UnexpectedVariant { type_name, found, .. } => format!("invalid variant index {found} for {type_name}"),
        DecodeError::InvalidIntegerType { expected, found } => {
            format!("integer encoded as {found:?} where {expected:?} was expected (out of range or invalid varint marker)")
        }
        DecodeError::InvalidBooleanValue(v) => format!("invalid boolean value {v} (expected 0 or 1)"),
        DecodeError::InvalidCharEncoding(bytes) => format!("invalid char encoding {bytes:?}"),
        DecodeError::OutsideUsizeRange(n) => format!("length {n} does not fit in usize"),
        other => other.to_string(),
    };
    CodecError::Decode(text)
}

/// Appends one frame (length prefix + `payload`) to `out`. Fails if the
/// payload is longer than `max_len` (or `u32::MAX`); `out` is then unchanged.
pub fn write_frame(out: &mut Vec<u8>, payload: &[u8], max_len: usize) -> Result<(), CodecError> {
    let max = max_len.min(u32_max());
    let len = match u32::try_from(payload.len()) {
        Ok(len) if payload.len() <= max => len,
        _ => return Err(CodecError::TooLarge { len: payload.len(), max }),
    };
    out.reserve(FRAME_HEADER_LEN + payload.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(payload);
    Ok(())
}

/// Reads one frame from the start of `buf`, returning `(payload, rest)`.
///
/// Fails with [`CodecError::TooLarge`] if the length prefix exceeds `max_len`
/// (checked first, nothing is allocated), and with [`CodecError::Truncated`]
/// if `buf` ends before the frame does.
pub fn read_frame(buf: &[u8], max_len: usize) -> Result<(&[u8], &[u8]), CodecError> {
    let Some((header, rest)) = buf.split_first_chunk::<FRAME_HEADER_LEN>() else {
        return Err(CodecError::Truncated { needed: FRAME_HEADER_LEN, available: buf.len() });
    };
    let claimed = u32::from_le_bytes(*header);
    // On 16-bit targets a length that does not fit `usize` is too large anyway.
    let len = usize::try_from(claimed).unwrap_or(usize::MAX);
    if len > max_len {
        return Err(CodecError::TooLarge { len, max: max_len });
    }
    if rest.len() < len {
        return Err(CodecError::Truncated { needed: FRAME_HEADER_LEN.saturating_add(len), available: buf.len() });
    }
    Ok(rest.split_at(len))
}

/// Encodes `value` as one frame appended to `out` (payload at most
/// [`DEFAULT_MAX_SIZE`]); `out` is unchanged on error.
pub fn encode_frame<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) -> Result<(), CodecError> {
    let start = out.len();
    out.extend_from_slice(&[0; FRAME_HEADER_LEN]);
    let header_end = out.len();
    let payload_len = match encode_append(out, value, DEFAULT_MAX_SIZE) {
        Ok(()) => out.len() - header_end,
        Err(err) => {
            out.truncate(start);
            return Err(err);
        }
    };
    // `DEFAULT_MAX_SIZE` fits in a `u32`, so this conversion cannot fail; stay total anyway.
    let Ok(len) = u32::try_from(payload_len) else {
        out.truncate(start);
        return Err(CodecError::TooLarge { len: payload_len, max: DEFAULT_MAX_SIZE.min(u32_max()) });
    };
    out[start..header_end].copy_from_slice(&len.to_le_bytes());
    Ok(())
}

/// Decodes one frame holding a `T` from the start of `buf` (payload at most
/// [`DEFAULT_MAX_SIZE`]), returning the value and the rest of the buffer.
pub fn decode_frame<T: DeserializeOwned>(buf: &[u8]) -> Result<(T, &[u8]), CodecError> {
    let (payload, rest) = read_frame(buf, DEFAULT_MAX_SIZE)?;
    Ok((decode(payload)?, rest))
}

fn u32_max() -> usize {
    usize::try_from(u32::MAX).unwrap_or(usize::MAX)
}

/// Encodes `value` onto the end of `out`, stopping as soon as the encoding
/// exceeds `max_len` (or [`MAX_SIZE_CEILING`]) bytes; `out` is restored on
/// error.
fn encode_append<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T, max_len: usize) -> Result<(), CodecError> {
    let max = max_len.min(MAX_SIZE_CEILING);
    let start = out.len();
    let mut writer = LimitedWriter { out, start, max, reached: None };
    match bincode::serde::encode_into_writer(value, &mut writer, bincode::config::standard()) {
        Ok(()) => Ok(()),
        Err(err) => {
            let reached = writer.reached;
            out.truncate(start);
            Err(match reached {
                Some(len) => CodecError::TooLarge { len, max },
                None => encode_error(err),
            })
        }
    }
}

fn encode_error(err: EncodeError) -> CodecError {
    CodecError::Encode(err.to_string())
}

/// A bincode writer appending to a `Vec`, refusing to grow past `max` bytes
/// (counted from `start`).
struct LimitedWriter<'a> {
    out: &'a mut Vec<u8>,
    start: usize,
    max: usize,
    /// Set to the size that would have been reached when the limit is hit.
    reached: Option<usize>,
}

impl Writer for LimitedWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> Result<(), EncodeError> {
        let len = self.out.len().saturating_sub(self.start).saturating_add(bytes.len());
        if len > self.max {
            self.reached = Some(len);
            return Err(EncodeError::Other("size limit exceeded"));
        }
        self.out.extend_from_slice(bytes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_header_is_u32_le() {
        let mut out = Vec::new();
        write_frame(&mut out, b"abc", 16).unwrap();
        assert_eq!(out, [3, 0, 0, 0, b'a', b'b', b'c']);
    }

    #[test]
    fn encode_frame_matches_write_frame_of_encode() {
        let value = ("refit".to_owned(), vec![1u32, 2, 3]);
        let mut framed = Vec::new();
        encode_frame(&mut framed, &value).unwrap();
        let mut expected = Vec::new();
        write_frame(&mut expected, &encode(&value).unwrap(), DEFAULT_MAX_SIZE).unwrap();
        assert_eq!(framed, expected);
    }
}
