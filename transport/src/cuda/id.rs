//! The NCCL unique id as plain bytes, so it can travel in actor messages.
//!
//! One member creates the id (`ncclGetUniqueId`: `CommId::generate` with
//! the `cuda` feature), the orchestrator hands it to every member, and each member creates its
//! communicator from it. A replaced communicator always gets a new id: an id
//! is never reused after its communicator failed or was aborted.

use std::fmt;

/// Bytes in an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub(crate) const COMM_ID_BYTES: usize = 128;

/// An NCCL unique id: opaque bytes made by one rank and shared with all.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CommId([u8; COMM_ID_BYTES]);

/// Why hex text does not decode to `n` bytes.
pub(crate) enum Unhex {
    /// Not `2 n` characters: about `got` bytes.
    Length { got: usize },
    /// Not a hex digit at this character.
    Digit { at: usize },
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Exactly `n` bytes from hex text (surrounding space ignored).
pub(crate) fn unhex(text: &str, n: usize) -> Result<Vec<u8>, Unhex> {
    let text = text.trim();
    if text.len() != 2 * n {
        return Err(Unhex::Length { got: text.len() / 2 });
    }
    let digit = |i: usize| (text.as_bytes()[i] as char).to_digit(16).map(|d| d as u8).ok_or(Unhex::Digit { at: i });
    (0..n).map(|i| Ok((digit(2 * i)? << 4) | digit(2 * i + 1)?)).collect()
}

/// The face of an opaque id of `$n` bytes made by a library (`$ty`, a
/// newtype over `[u8; $n]`): from and to bytes (an all-zero id, one never
/// filled in, refused), lower-case hex for text, and serde as that hex,
/// checked as it is read; and the error enum `$err` of what does not
/// decode, whose messages call the id `$what` and say what an all-zero
/// one was never (`$never`: "generated", "exported").
macro_rules! opaque_id {
    ($ty:ident, $err:ident, $n:expr, $what:literal, never $never:literal) => {
        #[doc = concat!("Why bytes do not decode to a [`", stringify!($ty), "`].")]
        #[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
        pub enum $err {
            /// The encoding is not exactly the id's length.
            #[error("{what} must be {n} bytes, got {got}", what = $what, n = $n)]
            Length {
                /// Bytes given.
                got: usize,
            },
            /// Every byte is zero: an id that was never filled in.
            #[error("{what} is all zeros (never {never})", what = $what, never = $never)]
            Zero,
            /// The hex text has a character that is not a hex digit.
            #[error("{what} hex has a non-hex character at {at}", what = $what)]
            Hex {
                /// Character position.
                at: usize,
            },
        }

        impl $ty {
            /// From its bytes; rejects a wrong length and all zeros.
            pub fn from_bytes(bytes: &[u8]) -> Result<$ty, $err> {
                let raw: [u8; $n] = bytes.try_into().map_err(|_| $err::Length { got: bytes.len() })?;
                if raw.iter().all(|&b| b == 0) {
                    return Err($err::Zero);
                }
                Ok($ty(raw))
            }

            /// Its bytes, exactly as the library made them.
            pub fn as_bytes(&self) -> &[u8; $n] {
                &self.0
            }

            /// The bytes to put in a message (decoded by `from_bytes`).
            pub fn to_vec(&self) -> Vec<u8> {
                self.0.to_vec()
            }

            /// Lower-case hex, for text messages, addresses and logs.
            pub fn to_hex(&self) -> String {
                $crate::cuda::id::hex(&self.0)
            }

            /// Decodes `to_hex` output (surrounding space ignored).
            pub fn from_hex(text: &str) -> Result<$ty, $err> {
                use $crate::cuda::id::{unhex, Unhex};
                match unhex(text, $n) {
                    Ok(raw) => $ty::from_bytes(&raw),
                    Err(Unhex::Length { got }) => Err($err::Length { got }),
                    Err(Unhex::Digit { at }) => Err($err::Hex { at }),
                }
            }
        }

        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.to_hex())
            }
        }

        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<$ty, D::Error> {
                let text = <String as serde::Deserialize>::deserialize(d)?;
                $ty::from_hex(&text).map_err(serde::de::Error::custom)
            }
        }
    };
}
pub(crate) use opaque_id;

impl CommId {
    /// A short tag for logs and errors (first 8 bytes, hex).
    pub fn tag(&self) -> String {
        self.0[..8].iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for CommId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CommId({}…)", self.tag())
    }
}

impl fmt::Display for CommId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.tag())
    }
}

opaque_id!(CommId, CommIdError, COMM_ID_BYTES, "NCCL unique id", never "generated");

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CommId {
        let raw: Vec<u8> = (0..COMM_ID_BYTES).map(|i| (i * 37 + 1) as u8).collect();
        CommId::from_bytes(&raw).unwrap()
    }

    #[test]
    fn bytes_round_trip() {
        let id = sample();
        let wire = id.to_vec();
        assert_eq!(wire.len(), COMM_ID_BYTES);
        assert_eq!(CommId::from_bytes(&wire).unwrap(), id);
        assert_eq!(CommId::from_hex(&id.to_hex()).unwrap(), id);
        assert_eq!(id.to_hex().len(), 256);
        assert!(format!("{id:?}").starts_with("CommId("));
    }

    #[test]
    fn wrong_length_rejected() {
        let wire = sample().to_vec();
        assert_eq!(CommId::from_bytes(&wire[..127]), Err(CommIdError::Length { got: 127 }));
        let mut long = wire.clone();
        long.push(0);
        assert_eq!(CommId::from_bytes(&long), Err(CommIdError::Length { got: 129 }));
        assert_eq!(CommId::from_bytes(&[]), Err(CommIdError::Length { got: 0 }));
        assert!(CommId::from_hex("abcd").is_err());
    }

    #[test]
    fn zero_and_bad_hex_rejected() {
        assert_eq!(CommId::from_bytes(&[0u8; COMM_ID_BYTES]), Err(CommIdError::Zero));
        let mut hex = sample().to_hex();
        hex.replace_range(10..11, "g");
        assert_eq!(CommId::from_hex(&hex), Err(CommIdError::Hex { at: 10 }));
        let e = CommId::from_bytes(&[1u8; 3]).unwrap_err().to_string();
        assert!(e.contains("128 bytes, got 3"), "{e}");
    }

    #[test]
    fn messages_name_the_id() {
        use crate::cuda::ipc::IpcHandleError;
        let said = |e: &dyn std::error::Error| e.to_string();
        assert_eq!(said(&CommIdError::Length { got: 3 }), "NCCL unique id must be 128 bytes, got 3");
        assert_eq!(said(&CommIdError::Zero), "NCCL unique id is all zeros (never generated)");
        assert_eq!(said(&CommIdError::Hex { at: 5 }), "NCCL unique id hex has a non-hex character at 5");
        assert_eq!(said(&IpcHandleError::Length { got: 3 }), "CUDA IPC handle must be 64 bytes, got 3");
        assert_eq!(said(&IpcHandleError::Zero), "CUDA IPC handle is all zeros (never exported)");
        assert_eq!(said(&IpcHandleError::Hex { at: 5 }), "CUDA IPC handle hex has a non-hex character at 5");
    }
}
