//! A rank's digest after its run ([`digest`]): the run's memory read
//! back, scratch included, where the run had it (see `crate::digest`);
//! and, for tests, a byte flipped in it first (`flip_byte`).

use super::{current_regions, drop_scratch, scratch_for, with_scratch, RegisteredStaging, Residence, RunMemory, Scratch};
use crate::digest::rank_digest;
pub use crate::digest::{DigestError, RankDigest};
use crate::memory::{MemView, RawBuf};
use crate::Bypass;
use reshard::RankProgram;

/// The digest of what `program`'s run just moved, read back from the same
/// `memory`, with the scratch the run left in `scratch` (call it right
/// after a run that succeeded, on the memory it ran on, before anything
/// else writes it). Host memory only: registered device memory, or
/// staging on a device, is [`DigestError::Unread`].
pub fn digest(program: &RankProgram, memory: RunMemory<'_>, scratch: &mut Scratch) -> Result<RankDigest, DigestError> {
    let bypass = Bypass::of(program);
    // SAFETY: `with_view`'s views are the rank's memory, valid for the
    // call and written by nothing meanwhile (its contract).
    with_view(program, &bypass, memory, scratch, |mem| unsafe { rank_digest(program, &bypass, mem) })?
}

/// Flips every bit of byte `byte` of buffer `buffer` (scratch included)
/// of the memory a run of `program` just wrote: test machinery, for
/// checks that a digest catches what changed after a transfer.
#[cfg(feature = "testkit")]
pub fn flip_byte(program: &RankProgram, memory: RunMemory<'_>, scratch: &mut Scratch, buffer: u32, byte: u64) -> Result<(), FlipError> {
    let bypass = Bypass::of(program);
    let flipped = with_view(program, &bypass, memory, scratch, |mem| {
        let buf = mem.bufs.get(buffer as usize).filter(|b| byte < b.len as u64).ok_or(FlipError::NoByte { buffer, byte })?;
        // SAFETY: in bounds of one of the rank's buffers, valid for
        // writes and used by nothing else during the call (`with_view`'s
        // contract).
        unsafe { *buf.ptr.add(byte as usize) ^= 0xff };
        Ok(())
    });
    flipped?
}

/// Why [`flip_byte`] flipped nothing.
#[cfg(feature = "testkit")]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FlipError {
    /// The memory could not be read back.
    #[error(transparent)]
    Unread(#[from] DigestError),
    /// No such byte.
    #[error("no byte {byte} in buffer {buffer}")]
    NoByte {
        /// The buffer.
        buffer: u32,
        /// The byte.
        byte: u64,
    },
}

/// Calls `f` with a view of every buffer of `program` on `memory`: the
/// rank's own, then the scratch `scratch` holds (put back after). The
/// view's memory is valid for reads and writes for the call, and nothing
/// else uses it meanwhile (the caller holds the memory's owner as a run
/// does).
fn with_view<R>(
    program: &RankProgram,
    bypass: &Bypass,
    memory: RunMemory<'_>,
    scratch: &mut Scratch,
    f: impl FnOnce(&MemView) -> R,
) -> Result<R, DigestError> {
    let me = program.endpoint;
    let reuse = std::mem::take(&mut scratch.buffers);
    let host = match memory {
        RunMemory::Host(m) => m,
        RunMemory::Staged { staging, .. } => match RegisteredStaging::written(staging) {
            Some(m) => m,
            None => return Err(DigestError::Unread(format!("{me}: its staging is device memory"))),
        },
        RunMemory::Registered(registered) => {
            if registered.residence() != Residence::Host {
                return Err(DigestError::Unread(format!("{me}: its weights are registered {} memory", registered.residence())));
            }
            let regions = current_regions(program, registered).map_err(|e| DigestError::Unread(e.to_string()))?;
            let mut beside = scratch_for(program, bypass, regions.len(), reuse);
            let mut bufs: Vec<RawBuf> = regions.iter().map(|&(addr, len)| RawBuf { ptr: addr as *mut u8, len }).collect();
            bufs.extend(beside.iter_mut().map(|b| RawBuf { ptr: b.as_mut_ptr(), len: b.len() }));
            // The registered regions were re-derived from their owner just
            // now, host memory, each cut to its buffer's bytes; the owner
            // keeps them (a source's store lock, a destination's commit
            // fence) while its member runs this, as during the run.
            let r = f(&MemView { bufs });
            scratch.buffers = beside;
            return Ok(r);
        }
    };
    let base = with_scratch(host, program, bypass, reuse).map_err(|e| DigestError::Unread(format!("{me}: {e}")))?;
    let r = f(&host.view());
    scratch.buffers = drop_scratch(host, base);
    Ok(r)
}
