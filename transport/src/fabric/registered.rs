//! Memory the user owns, registered by address: where it lives
//! ([`Residence`]), what the fabric asks of its owner
//! ([`RegisteredMemory`]), and a registered destination's staging
//! ([`RegisteredStaging`]).

use super::error::{ProgramMismatch, RegisteredError, RegisteredMemoryError};
use crate::RankMemory;
use reshard::RankProgram;

/// Where registered weights live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residence {
    /// Device memory of CUDA device `ordinal`: the NCCL and IPC fabrics
    /// read it in place ([`CommPlane::Cuda`](super::CommPlane::Cuda)).
    Device {
        /// The CUDA device.
        ordinal: usize,
    },
    /// Host memory, standing in for device memory on the simulated planes
    /// ([`CommPlane::Simulated`](super::CommPlane::Simulated)); the host
    /// fabrics read a source's in place.
    Host,
}

impl std::fmt::Display for Residence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Residence::Device { ordinal } => write!(f, "device (GPU {ordinal})"),
            Residence::Host => f.write_str("host"),
        }
    }
}

/// A rank's weights in memory its owner holds, one region (address,
/// bytes) per buffer of the rank, which a refit reads (a source) or whose
/// staging a commit copies in (a destination) where it is. The one
/// contract for registered memory: fixed addresses implement it, and so
/// does an embedding whose objects are looked up again before each use
/// (a Python tensor that may have moved).
///
/// # Safety
/// An implementation promises that every region it yields — to the
/// closure of [`RegisteredMemory::visit`], or from
/// [`RegisteredMemory::current_regions`] — is memory of
/// [`RegisteredMemory::residence`], at least as many bytes as it says,
/// valid for reads and writes until the run or copy that asked for it ends
/// (a region visited, at least until the closure returns); and that nothing
/// else writes it meanwhile (a source's owner writes it only outside
/// refits, a destination's only outside commits).
pub unsafe trait RegisteredMemory: Send + Sync {
    /// Where the regions are.
    fn residence(&self) -> Residence;

    /// How many buffers are registered (the rank's, in its program's
    /// buffer order).
    fn buffers(&self) -> usize;

    /// Calls `f(index, (address, bytes))` on every region in buffer order,
    /// each checked with its owner right before (nothing can move or free
    /// it until `f` returns). An error names the buffer.
    fn visit(&self, f: &mut dyn FnMut(usize, (u64, usize)) -> Result<(), RegisteredVisitError>) -> Result<(), RegisteredVisitError>;

    /// Every region as its owner holds it now, for a use that cannot run
    /// inside [`RegisteredMemory::visit`] (a source's run, a device copy).
    fn current_regions(&self) -> Result<Vec<(u64, usize)>, RegisteredMemoryError> {
        let mut regions = Vec::with_capacity(self.buffers());
        let visited = self.visit(&mut |_, r| {
            regions.push(r);
            Ok(())
        });
        match visited {
            Ok(()) => Ok(regions),
            Err(RegisteredVisitError::Owner(e)) => Err(e),
            // (The closure above fails on nothing: an owner's own words.)
            Err(RegisteredVisitError::Visitor(e)) => Err(RegisteredMemoryError::new(e.to_string())),
        }
    }
}

/// Why [`RegisteredMemory::visit`] stopped: the owner refused a region, or
/// the visitor failed on one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegisteredVisitError {
    /// The owner refused a region.
    #[error(transparent)]
    Owner(#[from] RegisteredMemoryError),
    /// The visitor failed.
    #[error(transparent)]
    Visitor(#[from] RegisteredError),
}

impl RegisteredVisitError {
    /// This error for rank `me`: an owner's refusal named as the rank's
    /// registered weights, the visitor's as it is.
    fn of(self, me: reshard::Endpoint) -> RegisteredError {
        match self {
            RegisteredVisitError::Owner(source) => RegisteredError::Owner { me, source },
            RegisteredVisitError::Visitor(e) => e,
        }
    }
}

/// The rank's buffers' regions of `registered` memory as their owner holds
/// them now, each cut to its buffer's bytes (the program's first buffers
/// are the rank's): memory the owner moved or freed since is never
/// named. An owner's refusal fails the run; regions that do not fit the
/// program are a mismatch.
pub(super) fn current_regions(program: &RankProgram, registered: &dyn RegisteredMemory) -> Result<Vec<(u64, usize)>, RegisteredError> {
    let me = program.endpoint;
    let current = registered.current_regions().map_err(|source| RegisteredError::Owner { me, source })?;
    Ok(cut_to_buffers(program, &current)?)
}

/// `registered` regions, each cut to its buffer's bytes.
fn cut_to_buffers(program: &RankProgram, registered: &[(u64, usize)]) -> Result<Vec<(u64, usize)>, ProgramMismatch> {
    let me = program.endpoint;
    let base = registered.len();
    if program.buffers.len() < base {
        return Err(ProgramMismatch::Registered { me, program: program.buffers.len(), registered: base });
    }
    let mut regions = Vec::with_capacity(program.buffers.len());
    for (spec, &(addr, len)) in program.buffers.iter().zip(registered) {
        let bytes = (spec.elems * spec.dtype.size()) as usize;
        if len < bytes {
            return Err(ProgramMismatch::RegisteredTooSmall { me, name: spec.name.clone(), bytes, len });
        }
        regions.push((addr, bytes));
    }
    Ok(regions)
}

/// A registered destination's staging: the memory its refits write (every
/// buffer of its program, scratch too), on the plane's side (host memory
/// for the simulated plane, a device bucket on the member's GPU for
/// CUDA); the commit copies the rank's buffers into the registered memory.
/// The member keeps it between refits.
pub struct RegisteredStaging {
    pub(super) memory: StagingMemory,
    /// The rank's buffers hold what the registered memory holds (after a
    /// commit); a run clears it, and a run that finds it clear first copies
    /// the registered memory in, so bytes no refit writes (gaps in a fused
    /// buffer, the buffers a subset refit carries) are what is served.
    pub(super) synced: bool,
}

/// Where a [`RegisteredStaging`] is.
pub(super) enum StagingMemory {
    /// Host memory (the simulated plane).
    Host(RankMemory),
    /// A bucket on the member's GPU.
    #[cfg(feature = "cuda")]
    Device(crate::cuda::GpuDevice, crate::cuda::DeviceMemory),
}

impl StagingMemory {
    fn host(&mut self) -> Option<&mut RankMemory> {
        match self {
            StagingMemory::Host(m) => Some(m),
            #[cfg(feature = "cuda")]
            StagingMemory::Device(..) => None,
        }
    }
}

impl RegisteredStaging {
    /// Host staging for `program` over host `registered` memory, holding the
    /// program's first `buffers` buffers (all of them for a communicator's
    /// run; the rank's own for a host fabric's, whose executor adds the
    /// scratch): made, or remade for another plan; when not synced, first
    /// filled from the registered memory. The caller's run writes it, so
    /// it is no longer synced.
    pub(super) fn host<'a>(
        staging: &'a mut Option<RegisteredStaging>,
        program: &RankProgram,
        registered: &dyn RegisteredMemory,
        buffers: usize,
    ) -> Result<&'a mut RankMemory, RegisteredError> {
        let me = program.endpoint;
        if registered.residence() != Residence::Host {
            return Err(RegisteredError::OffHost { me, residence: registered.residence() });
        }
        let specs = program.buffers.get(..buffers).ok_or(RegisteredError::NoBuffers { me, buffers })?;
        let lens = specs.iter().map(|b| (b.elems * b.dtype.size()) as usize);
        let fits =
            matches!(staging, Some(RegisteredStaging { memory: StagingMemory::Host(m), .. }) if m.buffers.iter().map(Vec::len).eq(lens));
        if !fits {
            *staging = Some(RegisteredStaging { memory: StagingMemory::Host(RankMemory::for_buffers(specs)), synced: false });
        }
        let st = staging.as_mut().ok_or(RegisteredError::NoStaging)?;
        let memory = st.memory.host().ok_or(RegisteredError::NoStaging)?;
        if !st.synced {
            registered
                .visit(&mut |i, (addr, _)| {
                    let to = memory.buffers.get_mut(i).ok_or(RegisteredError::NoStagingFor(i))?;
                    let len = to.len();
                    // SAFETY: the owner re-derived this region just now and
                    // `visit` checked it holds the buffer's bytes (at least
                    // `len`, the staging being made for the same buffers) of
                    // host memory (the residence checked above); nothing can
                    // move or free it until this closure returns
                    // (`RegisteredMemory`'s contract).
                    // `to` is our own buffer of `len` bytes.
                    to.copy_from_slice(unsafe { std::slice::from_raw_parts(addr as *const u8, len) });
                    Ok(())
                })
                .map_err(|e| e.of(me))?;
        }
        st.synced = false;
        Ok(memory)
    }

    /// The host staging a run just wrote, as it left it (not synced from
    /// the registered memory again); `None` for none, or staging on a
    /// device.
    pub(super) fn written(staging: &mut Option<RegisteredStaging>) -> Option<&mut RankMemory> {
        staging.as_mut().and_then(|s| s.memory.host())
    }

    /// Copies the rank's buffers into `registered` memory (the commit,
    /// under the store's commit fence: no reader holds it) and waits.
    pub fn commit(&mut self, program: &RankProgram, registered: &dyn RegisteredMemory) -> Result<(), RegisteredError> {
        let me = program.endpoint;
        match &mut self.memory {
            StagingMemory::Host(memory) => {
                if registered.residence() != Residence::Host {
                    return Err(RegisteredError::HostStaging { me, residence: registered.residence() });
                }
                registered
                    .visit(&mut |i, (addr, _)| {
                        let from = memory.buffers.get(i).ok_or(RegisteredError::NoStagingFor(i))?;
                        let len = from.len();
                        if program.buffers.get(i).map(|b| (b.elems * b.dtype.size()) as usize) != Some(len) {
                            return Err(RegisteredError::StagingSize { len, buffer: i }.into());
                        }
                        // SAFETY: the owner re-derived this region just now
                        // and `visit` checked it holds the buffer's bytes
                        // (`len`, checked above) of host memory (the
                        // residence checked above); nothing can move or
                        // free it until this closure returns, and nothing
                        // else writes it during a commit
                        // (`RegisteredMemory`'s contract). `from` is our
                        // own buffer, not inside it.
                        unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), addr as *mut u8, len) };
                        Ok(())
                    })
                    .map_err(|e| e.of(me))?;
            }
            #[cfg(feature = "cuda")]
            StagingMemory::Device(dev, mem) => {
                let regions = current_regions(program, registered)?;
                if registered.residence() != (Residence::Device { ordinal: dev.ordinal() }) {
                    return Err(RegisteredError::DeviceStaging { me, ordinal: dev.ordinal(), residence: registered.residence() });
                }
                // SAFETY: the regions are device memory of this GPU
                // (checked above; `RegisteredMemory`'s contract), written
                // by nothing else during a commit; the staging is our own
                // bucket.
                unsafe { mem.copy_to_regions(dev, &regions) }?;
            }
        }
        self.synced = true;
        Ok(())
    }
}
