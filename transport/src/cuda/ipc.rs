//! CUDA IPC between processes of one node: a rank's buffers live in one
//! device allocation (its **bucket**), exported once per refit epoch as one
//! 64-byte handle (`cuIpcGetMemHandle`), not one handle per tensor; another
//! process on the node maps the bucket (`cuIpcOpenMemHandle`) and reaches
//! every buffer of the rank at the same offsets, which both sides derive
//! from the rank's buffer list ([`BucketLayout`]). A bucket that is
//! reallocated (its buffers moved) gets a new handle; a mapping is closed
//! when dropped.
//!
//! This module is the part that needs no GPU: the handle as bytes for
//! messages and the bucket's layout. Exporting and mapping are
//! `DeviceMemory::export_ipc` / `DeviceMemory::import_ipc` (`cuda` feature).

use crate::cuda::copyplan::packed_offsets;
use reshard::BufferSpec;
use std::fmt;
use thiserror::Error;

/// Bytes in a CUDA IPC memory handle (`CU_IPC_HANDLE_SIZE`).
pub const IPC_HANDLE_BYTES: usize = 64;

/// Where each buffer of a bucket starts: buffers are placed back to back in
/// the rank's buffer order, each at a 256-byte boundary (CUDA's allocation
/// alignment, so every dtype's elements stay aligned).
pub const BUCKET_ALIGN: u64 = 256;

/// A CUDA IPC memory handle: opaque bytes made by the exporting process.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcHandle([u8; IPC_HANDLE_BYTES]);

/// Why bytes do not decode to an [`IpcHandle`].
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum IpcHandleError {
    /// Not exactly [`IPC_HANDLE_BYTES`] bytes.
    #[error("CUDA IPC handle must be {IPC_HANDLE_BYTES} bytes, got {got}")]
    Length {
        /// Bytes given.
        got: usize,
    },
    /// Every byte is zero: a handle that was never filled in.
    #[error("CUDA IPC handle is all zeros (never exported)")]
    Zero,
    /// The hex text has a character that is not a hex digit.
    #[error("CUDA IPC handle hex has a non-hex character at {at}")]
    Hex {
        /// Character position.
        at: usize,
    },
}

impl IpcHandle {
    /// The handle from its bytes; rejects a wrong length and all zeros.
    pub fn from_bytes(bytes: &[u8]) -> Result<IpcHandle, IpcHandleError> {
        let raw: [u8; IPC_HANDLE_BYTES] = bytes.try_into().map_err(|_| IpcHandleError::Length { got: bytes.len() })?;
        if raw.iter().all(|&b| b == 0) {
            return Err(IpcHandleError::Zero);
        }
        Ok(IpcHandle(raw))
    }

    /// The handle's bytes, as CUDA made them.
    pub fn as_bytes(&self) -> &[u8; IPC_HANDLE_BYTES] {
        &self.0
    }

    /// The bytes to put in a message.
    pub fn to_vec(&self) -> Vec<u8> {
        self.0.to_vec()
    }

    /// Lower-case hex (128 characters), for text addresses.
    pub fn to_hex(&self) -> String {
        crate::cuda::id::hex(&self.0)
    }

    /// Decodes [`IpcHandle::to_hex`] output.
    pub fn from_hex(text: &str) -> Result<IpcHandle, IpcHandleError> {
        use crate::cuda::id::{unhex, Unhex};
        match unhex(text, IPC_HANDLE_BYTES) {
            Ok(raw) => IpcHandle::from_bytes(&raw),
            Err(Unhex::Length { got }) => Err(IpcHandleError::Length { got }),
            Err(Unhex::Digit { at }) => Err(IpcHandleError::Hex { at }),
        }
    }
}

impl fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The first bytes tell handles apart in logs; the rest is noise.
        let head: String = self.0[..8].iter().map(|b| format!("{b:02x}")).collect();
        write!(f, "IpcHandle({head}…)")
    }
}

/// Byte offsets of a rank's buffers in its bucket and the bucket's length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketLayout {
    /// Byte offset of each buffer, in the rank's buffer order.
    pub offsets: Vec<u64>,
    /// Byte length of each buffer.
    pub lens: Vec<u64>,
    /// Bytes of the whole bucket (at least 1).
    pub bytes: u64,
}

impl BucketLayout {
    /// The layout of a rank's buffers (`RankProgram::buffers`); an error
    /// naming the buffer where their sizes pass `u64` bytes (a program from
    /// the wire may claim any), so no buffer lies outside the bucket.
    pub fn of(specs: &[BufferSpec]) -> Result<BucketLayout, String> {
        let lens = specs
            .iter()
            .enumerate()
            .map(|(i, b)| {
                b.elems
                    .checked_mul(b.dtype.size())
                    .ok_or_else(|| format!("buffer {i} '{}': {} elements of {} pass u64 bytes", b.name, b.elems, b.dtype))
            })
            .collect::<Result<Vec<u64>, String>>()?;
        let (offsets, bytes) = packed_offsets(&lens, BUCKET_ALIGN).ok_or("the buffers together pass u64 bytes")?;
        Ok(BucketLayout { offsets, lens, bytes: bytes.max(1) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard::{BufferKey, DType};

    #[test]
    fn handles_round_trip_and_bad_bytes_are_rejected() {
        let mut raw = [0u8; IPC_HANDLE_BYTES];
        raw[3] = 9;
        let h = IpcHandle::from_bytes(&raw).unwrap();
        assert_eq!(IpcHandle::from_bytes(&h.to_vec()).unwrap(), h);
        assert_eq!(IpcHandle::from_bytes(&raw[..10]), Err(IpcHandleError::Length { got: 10 }));
        assert_eq!(IpcHandle::from_bytes(&[0u8; IPC_HANDLE_BYTES]), Err(IpcHandleError::Zero));
        assert!(format!("{h:?}").starts_with("IpcHandle(00000009"));
    }

    #[test]
    fn buckets_align_every_buffer() {
        let spec = |elems, dtype| BufferSpec { name: "b".into(), key: BufferKey::Named(0), dtype, elems };
        let l = BucketLayout::of(&[spec(3, DType::BF16), spec(10, DType::F32), spec(0, DType::F64), spec(1, DType::U8)]).unwrap();
        assert_eq!(l.offsets, vec![0, 256, 512, 512]);
        assert_eq!(l.lens, vec![6, 40, 0, 1]);
        assert_eq!(l.bytes, 513);
        assert!(l.offsets.iter().all(|o| o % BUCKET_ALIGN == 0));
        assert_eq!(BucketLayout::of(&[]).unwrap().bytes, 1);
        // Sizes past u64, alone or together, are refused.
        let e = BucketLayout::of(&[spec(1, DType::F32), spec(u64::MAX / 2, DType::F32)]).unwrap_err();
        assert!(e.contains("buffer 1 'b'"), "{e}");
        assert!(BucketLayout::of(&[spec(u64::MAX - 8, DType::U8), spec(u64::MAX - 8, DType::U8)]).is_err());
    }
}
