//! Where a rank's weights live: a [`SrcStore`] on a source (training) rank,
//! a [`DstStore`] on a destination (inference) rank, each holding the
//! rank's [`Buffers`], read and written tensor by tensor through
//! [`TensorView`]s.
//!
//! The source store is the version fence: the optimizer writes it under a
//! write lock ([`SrcStore::update`]) and a refit reads it under the same
//! lock, so a refit never sees half an optimizer step, and a step that
//! fails after writing leaves the store *torn* (refused by refits) rather
//! than passing off changed weights as the old version. The destination
//! store is the atomic commit: a refit writes a staging copy, and
//! [`DstStore::commit`] swaps it in whole; readers take an [`Arc`] snapshot
//! ([`DstStore::snapshot`]) and keep using it however many commits happen
//! meanwhile.

use crate::protocol::Weights;
use reshard::{Block, BufferSpec, DType, Layout, Rank};
use std::sync::{Arc, Mutex, RwLock};
use thiserror::Error;
use transport::RankMemory;

/// Why a buffer or a tensor of a rank cannot be read or written as asked.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BufferError {
    /// No buffer of that name on this rank.
    #[error("rank {rank}: no buffer '{name}' (this rank's buffers: {known})")]
    NoBuffer {
        /// The rank.
        rank: Rank,
        /// The name asked for.
        name: String,
        /// Some of the rank's buffer names.
        known: String,
    },
    /// The layout has no tensor of that name.
    #[error("rank {rank}: the layout has no tensor '{name}'{hint}")]
    NoTensor {
        /// The rank.
        rank: Rank,
        /// The name asked for.
        name: String,
        /// A suggestion, if one is close.
        hint: String,
    },
    /// The tensor exists but this rank holds no part of it (another
    /// pipeline stage or expert group holds it).
    #[error("rank {rank} holds no part of tensor '{name}'")]
    NotHeld {
        /// The rank.
        rank: Rank,
        /// The tensor.
        name: String,
    },
    /// The rank holds the tensor in several blocks (a flat shard that
    /// spans rows, or several explicit shards); address them one by one.
    #[error("rank {rank} holds tensor '{name}' in {blocks} blocks: use tensor_blocks / tensor_block_mut")]
    SeveralBlocks {
        /// The rank.
        rank: Rank,
        /// The tensor.
        name: String,
        /// How many blocks.
        blocks: usize,
    },
    /// A block index past the rank's blocks of the tensor.
    #[error("rank {rank} holds {blocks} blocks of tensor '{name}', not block {index}")]
    NoBlock {
        /// The rank.
        rank: Rank,
        /// The tensor.
        name: String,
        /// The index asked for.
        index: usize,
        /// How many blocks it holds.
        blocks: usize,
    },
    /// A buffer holds fewer bytes than the layout places in it (memory
    /// replaced through [`Buffers::memory_mut`]).
    #[error("rank {rank}: buffer '{buffer}' holds {bytes} bytes, the layout places data up to byte {needed}")]
    Truncated {
        /// The rank.
        rank: Rank,
        /// The buffer.
        buffer: String,
        /// Bytes it holds.
        bytes: usize,
        /// Bytes the layout needs.
        needed: usize,
    },
    /// The element type does not allow the access.
    #[error("{what}: holds {dtype}, which cannot be {access}")]
    DType {
        /// The tensor or buffer.
        what: String,
        /// Its element type.
        dtype: DType,
        /// The access asked for.
        access: &'static str,
    },
    /// The rank's weights are registered memory (device buffers, say):
    /// the store does not hold their bytes.
    #[error("rank {rank}: the weights are registered {residence} memory, not bytes of the store (write them in place inside `update`)")]
    Registered {
        /// The rank.
        rank: Rank,
        /// Where they are.
        residence: Residence,
    },
    /// Registered memory does not match the rank's buffer list.
    #[error("rank {rank}: {problem}")]
    BadRegistration {
        /// The rank.
        rank: Rank,
        /// What does not match.
        problem: String,
    },
    /// A write of the wrong number of elements.
    #[error("{what}: {given} values given for {expected} elements")]
    Length {
        /// The tensor or buffer.
        what: String,
        /// Elements it holds.
        expected: u64,
        /// Values given.
        given: u64,
    },
}

/// Where one block of a tensor lives in a rank's memory.
struct Located {
    /// The tensor's index in the layout.
    tensor: u32,
    /// The block of the global tensor.
    block: Block,
    /// The buffer's index.
    buffer: usize,
    /// The bytes of the buffer it occupies (within the buffer).
    bytes: std::ops::Range<usize>,
}

/// Where registered weights live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residence {
    /// Device memory of CUDA device `ordinal`: the NCCL and IPC fabrics
    /// read it in place (`CommPlane::Cuda`).
    Device {
        /// The CUDA device.
        ordinal: usize,
    },
    /// Host memory, standing in for device memory on the simulated planes
    /// (`CommPlane::Simulated`).
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

/// A rank's weights in memory the user owns, registered by address: one
/// region per buffer of the rank's buffer list, which a refit reads where
/// it is (no copy into the store). Made by the `unsafe`
/// [`Registered::new`], whose caller promises the regions stay valid.
#[derive(Clone)]
pub struct Registered {
    residence: Residence,
    /// (address, bytes) per buffer, in the rank's buffer order.
    regions: Vec<(u64, usize)>,
    /// Bytes each buffer needs, in the same order.
    needs: Vec<usize>,
    /// What re-derives the regions from their owner before each use.
    check: Option<Arc<dyn RegionCheck>>,
    /// The buffers' names, for errors.
    names: Arc<Vec<String>>,
}

impl std::fmt::Debug for Registered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered")
            .field("residence", &self.residence)
            .field("regions", &self.regions)
            .field("checked", &self.check.is_some())
            .finish()
    }
}

impl PartialEq for Registered {
    fn eq(&self, other: &Self) -> bool {
        let same_check = match (&self.check, &other.check) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        self.residence == other.residence && self.regions == other.regions && same_check
    }
}

impl Eq for Registered {}

/// The owner of registered memory (an embedding's objects: a Python
/// tensor, say), asked for each region right before a refit touches it, so
/// memory the owner moved or freed since it was registered is never read
/// or written.
///
/// [`Registered::visit`] calls [`RegionCheck::visit`] before a source's
/// refit reads its regions and around a destination's commit (and the
/// staging's first sync), which do their copies inside it.
pub trait RegionCheck: Send + Sync {
    /// Re-derives region `index` of every buffer from its owner, in buffer
    /// order, and calls `f(index, (address, bytes))` on each right after
    /// its check — with nothing able to move or free it in between (for
    /// Python objects: the GIL held from the look-up through `f`). An
    /// error names the buffer and what changed; nothing after it is
    /// visited.
    fn visit(&self, f: &mut dyn FnMut(usize, (u64, usize)) -> Result<(), String>) -> Result<(), String>;
}

impl Registered {
    /// Registers `regions` (address and bytes, one per buffer of rank
    /// `rank` of `layout`, in [`Layout::rank_buffers`] order) as the rank's
    /// weights; each must hold at least its buffer's bytes.
    ///
    /// # Safety
    /// Every region must be memory of `residence` valid for reads and
    /// writes of its bytes for as long as any store or refit holds this
    /// value, and never freed or moved meanwhile (reallocating a parameter
    /// means registering again). For a [`SrcStore`] it is written only
    /// inside the store's `update` (or `restore`); for a [`DstStore`] only
    /// its commits write it, and the user touches it only inside
    /// [`DstStore::serve`].
    pub unsafe fn new(layout: &Layout, rank: Rank, residence: Residence, regions: Vec<(u64, usize)>) -> Result<Registered, BufferError> {
        let bad = |problem: String| BufferError::BadRegistration { rank, problem };
        if rank >= layout.ranks() {
            return Err(bad(format!("the layout has {} ranks", layout.ranks())));
        }
        let specs = layout.rank_buffers(rank);
        if regions.len() != specs.len() {
            return Err(bad(format!(
                "{} regions registered for {} buffers ({})",
                regions.len(),
                specs.len(),
                some_names(specs.iter().map(|s| s.name.as_str()))
            )));
        }
        let mut needs = Vec::with_capacity(specs.len());
        for (spec, &(addr, len)) in specs.iter().zip(&regions) {
            let need = spec.elems.checked_mul(spec.dtype.size()).and_then(|n| usize::try_from(n).ok());
            let need = need.ok_or_else(|| bad(format!("buffer '{}' is larger than this machine can address", spec.name)))?;
            if addr == 0 || len < need {
                return Err(bad(format!("buffer '{}' needs {need} bytes, {len} registered at {addr:#x}", spec.name)));
            }
            needs.push(need);
        }
        let names = specs.iter().map(|s| s.name.clone()).collect();
        Ok(Registered { residence, regions, needs, check: None, names: Arc::new(names) })
    }

    /// The same registration, its regions re-derived by `check` before
    /// every use ([`Registered::visit`]).
    ///
    /// # Safety
    /// As [`Registered::new`] for every region `check` yields: memory of
    /// this residence, valid for its bytes while `check`'s visit runs the
    /// caller's closure on it (for a source's refit, until the refit's run
    /// ends).
    pub unsafe fn with_check(mut self, check: Arc<dyn RegionCheck>) -> Registered {
        self.check = Some(check);
        self
    }

    /// Calls `f(index, (address, bytes))` on every region, in buffer
    /// order: the registered ones, or, with a [`RegionCheck`], each as its
    /// owner holds it now, checked to hold its buffer's bytes. An error
    /// (the owner's, or a region too small) names the buffer.
    pub fn visit(&self, f: &mut dyn FnMut(usize, (u64, usize)) -> Result<(), String>) -> Result<(), String> {
        let mut checked = |i: usize, (addr, len): (u64, usize)| {
            let need = *self.needs.get(i).ok_or_else(|| format!("region {i}: the rank has {} buffers", self.needs.len()))?;
            if addr == 0 || len < need {
                return Err(format!("buffer '{}' needs {need} bytes, {len} found at {addr:#x}", self.names[i]));
            }
            f(i, (addr, len))
        };
        match &self.check {
            Some(check) => {
                let mut seen = 0;
                check.visit(&mut |i, r| {
                    if i != seen {
                        return Err(format!("region {i} visited out of order (expected {seen})"));
                    }
                    seen += 1;
                    checked(i, r)
                })?;
                if seen != self.needs.len() {
                    return Err(format!("{seen} of {} regions visited", self.needs.len()));
                }
                Ok(())
            }
            None => self.regions.iter().enumerate().try_for_each(|(i, &r)| checked(i, r)),
        }
    }

    /// This registration with its regions as their owner holds them now
    /// ([`Registered::visit`]), for a use that cannot run inside the visit
    /// (a source's refit, a device copy).
    pub fn current(&self) -> Result<Registered, String> {
        if self.check.is_none() {
            return Ok(self.clone());
        }
        let mut regions = Vec::with_capacity(self.needs.len());
        self.visit(&mut |_, r| {
            regions.push(r);
            Ok(())
        })?;
        Ok(Registered { regions, ..self.clone() })
    }

    /// Where the regions are.
    pub fn residence(&self) -> Residence {
        self.residence
    }

    /// (address, bytes) per buffer.
    pub fn regions(&self) -> &[(u64, usize)] {
        &self.regions
    }
}

/// A rank's buffers: the memory the data plane reads and writes, and the
/// layout that says which block of which tensor lives where in it.
#[derive(Clone)]
pub struct Buffers {
    layout: Arc<Layout>,
    rank: Rank,
    specs: Vec<BufferSpec>,
    memory: RankMemory,
    /// The user's own memory in place of `memory` (which is then empty).
    registered: Option<Registered>,
    /// Set by every mutable access: whether the weights may have changed
    /// since the flag was last cleared (a step's start).
    written: bool,
}

impl std::fmt::Debug for Buffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.specs.iter().map(|s| s.name.as_str()).collect();
        f.debug_struct("Buffers").field("rank", &self.rank).field("buffers", &names).finish_non_exhaustive()
    }
}

/// Up to five names and how many more, for error messages.
fn some_names<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let all: Vec<&str> = names.collect();
    let mut text = all.iter().take(5).map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ");
    if all.len() > 5 {
        text.push_str(&format!(" and {} more", all.len() - 5));
    }
    if all.is_empty() {
        text.push_str("none");
    }
    text
}

impl Buffers {
    /// Zeroed buffers for rank `rank` of `layout` (none for a rank past
    /// the layout's). Pages are untouched, so they cost no memory until
    /// written.
    pub fn new(layout: &Arc<Layout>, rank: Rank) -> Buffers {
        let specs = if rank < layout.ranks() { layout.rank_buffers(rank) } else { Vec::new() };
        let memory = RankMemory::for_buffers(&specs);
        Buffers { layout: layout.clone(), rank, specs, memory, registered: None, written: false }
    }

    /// The buffers of a rank whose weights are `registered` memory.
    fn over(layout: &Arc<Layout>, rank: Rank, registered: Registered) -> Buffers {
        let specs = layout.rank_buffers(rank);
        Buffers { layout: layout.clone(), rank, specs, memory: RankMemory::default(), registered: Some(registered), written: false }
    }

    /// The registered memory holding this rank's weights, if any (the
    /// store then holds no bytes of them).
    pub fn registered(&self) -> Option<&Registered> {
        self.registered.as_ref()
    }

    fn held(&self) -> Result<(), BufferError> {
        match &self.registered {
            Some(r) => Err(BufferError::Registered { rank: self.rank, residence: r.residence }),
            None => Ok(()),
        }
    }

    /// The same buffers, zeroed.
    fn zeroed_like(&self) -> Buffers {
        Buffers { memory: RankMemory::for_buffers(&self.specs), ..self.emptied() }
    }

    /// The same buffer list with no memory (a placeholder while the memory
    /// is moved elsewhere).
    fn emptied(&self) -> Buffers {
        Buffers {
            layout: self.layout.clone(),
            rank: self.rank,
            specs: self.specs.clone(),
            memory: RankMemory::default(),
            registered: None,
            written: false,
        }
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The group's layout.
    pub fn layout(&self) -> &Arc<Layout> {
        &self.layout
    }

    /// The buffer list (order and sizes the data plane expects).
    pub fn specs(&self) -> &[BufferSpec] {
        &self.specs
    }

    /// Raw memory, in `specs` order.
    pub fn memory(&self) -> &RankMemory {
        &self.memory
    }

    /// Raw memory, mutable.
    pub fn memory_mut(&mut self) -> &mut RankMemory {
        self.written = true;
        &mut self.memory
    }

    /// The index of buffer `name`, which the memory holds (perhaps
    /// shorter than the layout says, if replaced through `memory_mut`).
    fn buffer_index(&self, name: &str) -> Result<usize, BufferError> {
        self.held()?;
        let i = self.specs.iter().position(|b| b.name == name).ok_or_else(|| BufferError::NoBuffer {
            rank: self.rank,
            name: name.to_string(),
            known: some_names(self.specs.iter().map(|s| s.name.as_str())),
        })?;
        if i >= self.memory.buffers.len() {
            let needed = (self.specs[i].elems * self.specs[i].dtype.size()) as usize;
            return Err(BufferError::Truncated { rank: self.rank, buffer: name.to_string(), bytes: 0, needed });
        }
        Ok(i)
    }

    /// The bytes of the buffer named `name` (a fused buffer's name, or
    /// `"{tensor}#{shard}"` for a block stored on its own).
    pub fn buffer(&self, name: &str) -> Result<&[u8], BufferError> {
        let i = self.buffer_index(name)?;
        Ok(&self.memory.buffers[i])
    }

    /// The bytes of the buffer named `name`, mutable.
    pub fn buffer_mut(&mut self, name: &str) -> Result<&mut [u8], BufferError> {
        let i = self.buffer_index(name)?;
        self.written = true;
        Ok(&mut self.memory.buffers[i])
    }

    /// The buffer named `name` as f32 values (converted from f64, bf16 or
    /// f16): a fused or flat parameter buffer whole, say.
    pub fn buffer_to_f32(&self, name: &str) -> Result<Vec<f32>, BufferError> {
        let i = self.buffer_index(name)?;
        decode_f32(&|| format!("rank {}: buffer '{name}'", self.rank), self.specs[i].dtype, &self.memory.buffers[i])
    }

    /// Overwrites the buffer named `name` with `values` (converted to its
    /// dtype); `values.len()` must be its length in elements.
    pub fn write_buffer_f32(&mut self, name: &str, values: &[f32]) -> Result<(), BufferError> {
        let i = self.buffer_index(name)?;
        self.written = true;
        let rank = self.rank;
        encode_f32(&|| format!("rank {rank}: buffer '{name}'"), self.specs[i].dtype, values, &mut self.memory.buffers[i])
    }

    /// Every block of tensor `name` this rank holds, with the bytes it
    /// occupies in this rank's memory (checked against the memory's size:
    /// a buffer replaced through `memory_mut` may be shorter).
    fn locate(&self, name: &str) -> Result<Vec<Located>, BufferError> {
        self.held()?;
        let Some(t) = self.layout.tensor_index(name) else {
            let hint = match name.split_once('#') {
                Some((tensor, _)) if self.layout.tensor_index(tensor).is_some() => {
                    format!(" (buffers of blocks stored alone are named '{{tensor}}#{{shard}}'; the tensor is '{tensor}')")
                }
                _ => String::new(),
            };
            return Err(BufferError::NoTensor { rank: self.rank, name: name.to_string(), hint });
        };
        let held = self.layout.rank_holdings(t, self.rank);
        if held.is_empty() {
            return Err(BufferError::NotHeld { rank: self.rank, name: name.to_string() });
        }
        let size = self.layout.tensors()[t as usize].dtype.size();
        held.into_iter()
            .map(|(block, loc)| {
                // `rank_buffers` lists every buffer `rank_holdings` names.
                let buffer_name = || self.layout.buffer_name(loc.buffer);
                let i = self.specs.iter().position(|s| s.key == loc.buffer).ok_or_else(|| BufferError::NoBuffer {
                    rank: self.rank,
                    name: buffer_name(),
                    known: some_names(self.specs.iter().map(|s| s.name.as_str())),
                })?;
                let (start, len) = ((loc.at * size) as usize, (block.numel() * size) as usize);
                let held = self.memory.buffers.get(i).map_or(0, Vec::len);
                if start + len > held {
                    return Err(BufferError::Truncated { rank: self.rank, buffer: buffer_name(), bytes: held, needed: start + len });
                }
                Ok(Located { tensor: t, block, buffer: i, bytes: start..start + len })
            })
            .collect()
    }

    /// The one block of tensor `name` this rank holds.
    fn locate_one(&self, name: &str) -> Result<Located, BufferError> {
        let mut blocks = self.locate(name)?;
        match blocks.len() {
            1 => Ok(blocks.remove(0)),
            n => Err(BufferError::SeveralBlocks { rank: self.rank, name: name.to_string(), blocks: n }),
        }
    }

    fn view(&self, found: Located) -> TensorView<'_> {
        let t = &self.layout.tensors()[found.tensor as usize];
        let bytes = &self.memory.buffers[found.buffer][found.bytes];
        TensorView { name: &t.name, shape: &t.shape, dtype: t.dtype, block: found.block, bytes }
    }

    /// The block of tensor `name` this rank holds, with where it sits in
    /// the global tensor. Fails if the rank holds none of it, or several
    /// blocks ([`tensor_blocks`](Self::tensor_blocks)).
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, BufferError> {
        let found = self.locate_one(name)?;
        Ok(self.view(found))
    }

    /// Every block of tensor `name` this rank holds (one for a mesh
    /// placement; a flat shard spanning rows is several).
    pub fn tensor_blocks(&self, name: &str) -> Result<Vec<TensorView<'_>>, BufferError> {
        Ok(self.locate(name)?.into_iter().map(|found| self.view(found)).collect())
    }

    /// The block of tensor `name` this rank holds, writable.
    pub fn tensor_mut(&mut self, name: &str) -> Result<TensorViewMut<'_>, BufferError> {
        let found = self.locate_one(name)?;
        Ok(self.view_mut(found))
    }

    /// Block `index` of [`tensor_blocks`](Self::tensor_blocks), writable.
    pub fn tensor_block_mut(&mut self, name: &str, index: usize) -> Result<TensorViewMut<'_>, BufferError> {
        let mut blocks = self.locate(name)?;
        if index >= blocks.len() {
            return Err(BufferError::NoBlock { rank: self.rank, name: name.to_string(), index, blocks: blocks.len() });
        }
        let found = blocks.swap_remove(index);
        Ok(self.view_mut(found))
    }

    fn view_mut(&mut self, found: Located) -> TensorViewMut<'_> {
        self.written = true;
        let t = &self.layout.tensors()[found.tensor as usize];
        let bytes = &mut self.memory.buffers[found.buffer][found.bytes];
        TensorViewMut { name: &t.name, shape: &t.shape, dtype: t.dtype, block: found.block, bytes }
    }

    /// Names of the tensors this rank holds some part of, in layout order.
    pub fn held_tensors(&self) -> impl Iterator<Item = &str> + '_ {
        let layout = &self.layout;
        (0..layout.tensors().len() as u32)
            .filter(move |&t| !layout.rank_holdings(t, self.rank).is_empty())
            .map(move |t| layout.tensors()[t as usize].name.as_str())
    }
}

/// `bytes` (elements of `dtype`) as f32 values; `what` names them in errors.
fn decode_f32(what: &dyn Fn() -> String, dtype: DType, bytes: &[u8]) -> Result<Vec<f32>, BufferError> {
    if !dtype.is_convertible_float() {
        return Err(BufferError::DType { what: what(), dtype, access: "read as f32" });
    }
    let mut raw = vec![0u8; bytes.len() / dtype.size() as usize * 4];
    reshard::dtype::convert_slice(dtype, bytes, DType::F32, &mut raw);
    Ok(raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// Overwrites `bytes` (elements of `dtype`) with `values`, converted
/// (round-to-nearest-even); `what` names them in errors.
fn encode_f32(what: &dyn Fn() -> String, dtype: DType, values: &[f32], bytes: &mut [u8]) -> Result<(), BufferError> {
    if !dtype.is_convertible_float() {
        return Err(BufferError::DType { what: what(), dtype, access: "written from f32" });
    }
    let expected = bytes.len() as u64 / dtype.size();
    if values.len() as u64 != expected {
        return Err(BufferError::Length { what: what(), expected, given: values.len() as u64 });
    }
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    reshard::dtype::convert_slice(DType::F32, &raw, dtype, bytes);
    Ok(())
}

/// Calls `f(i, coords)` for every element of `block` in row-major order,
/// with its global coordinates.
fn for_each_coord(block: &Block, mut f: impl FnMut(usize, &[u64])) {
    let n = block.numel();
    if n == 0 {
        return;
    }
    let (offset, extent) = (block.offset(), block.extent());
    let mut at: Vec<u64> = offset.to_vec();
    for i in 0..n as usize {
        f(i, &at);
        for d in (0..at.len()).rev() {
            at[d] += 1;
            if at[d] < offset[d] + extent[d] {
                break;
            }
            at[d] = offset[d];
        }
    }
}

/// One block of a tensor in a rank's memory: its global position and its
/// bytes, read in place.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    name: &'a str,
    shape: &'a [u64],
    dtype: DType,
    block: Block,
    bytes: &'a [u8],
}

/// Accessors shared by [`TensorView`] and [`TensorViewMut`].
macro_rules! view_accessors {
    () => {
        /// The tensor's name.
        pub fn name(&self) -> &str {
            self.name
        }

        /// The tensor's global shape.
        pub fn shape(&self) -> &[u64] {
            self.shape
        }

        /// The element type on this side.
        pub fn dtype(&self) -> DType {
            self.dtype
        }

        /// Which part of the global tensor this block is.
        pub fn block(&self) -> &Block {
            &self.block
        }

        /// The block's first global index per dimension.
        pub fn offset(&self) -> &[u64] {
            self.block.offset()
        }

        /// The block's length per dimension.
        pub fn extent(&self) -> &[u64] {
            self.block.extent()
        }

        /// Number of elements in the block.
        pub fn len(&self) -> u64 {
            self.block.numel()
        }

        /// Whether the block has no elements.
        pub fn is_empty(&self) -> bool {
            self.block.numel() == 0
        }

        /// The block's bytes, row-major, little-endian.
        pub fn bytes(&self) -> &[u8] {
            &*self.bytes
        }

        /// The block's values as `f32` (converted from f64, bf16 or f16;
        /// copies this block only).
        pub fn to_f32(&self) -> Result<Vec<f32>, BufferError> {
            decode_f32(&|| format!("tensor '{}'", self.name), self.dtype, &self.bytes)
        }

        /// The block's raw 16-bit patterns (bf16 or f16 only).
        pub fn to_bits16(&self) -> Result<Vec<u16>, BufferError> {
            self.bits16("read as 16-bit patterns")?;
            Ok(self.bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
        }

        fn bits16(&self, access: &'static str) -> Result<(), BufferError> {
            if matches!(self.dtype, DType::BF16 | DType::F16) {
                Ok(())
            } else {
                Err(BufferError::DType { what: format!("tensor '{}'", self.name), dtype: self.dtype, access })
            }
        }

        /// Calls `f(i, coords)` for every element of the block, in
        /// row-major order: its index in the block and its global
        /// coordinates.
        pub fn for_each_index(&self, f: impl FnMut(usize, &[u64])) {
            for_each_coord(&self.block, f)
        }
    };
}

impl<'a> TensorView<'a> {
    view_accessors!();

    /// The block's bytes, for as long as the view's borrow.
    pub fn into_bytes(self) -> &'a [u8] {
        self.bytes
    }
}

/// One block of a tensor in a rank's memory, writable in place.
#[derive(Debug)]
pub struct TensorViewMut<'a> {
    name: &'a str,
    shape: &'a [u64],
    dtype: DType,
    block: Block,
    bytes: &'a mut [u8],
}

impl<'a> TensorViewMut<'a> {
    view_accessors!();

    /// The block's bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.bytes
    }

    /// The block's bytes, writable, for as long as the view's borrow.
    pub fn into_bytes_mut(self) -> &'a mut [u8] {
        self.bytes
    }

    /// Overwrites the block with `values` (converted to its dtype,
    /// round-to-nearest-even); `values.len()` must be the block's length.
    pub fn write_f32(&mut self, values: &[f32]) -> Result<(), BufferError> {
        let name = self.name;
        encode_f32(&|| format!("tensor '{name}'"), self.dtype, values, self.bytes)
    }

    /// Overwrites the block with raw 16-bit patterns (bf16 or f16 only).
    pub fn write_bits16(&mut self, values: &[u16]) -> Result<(), BufferError> {
        self.bits16("written from 16-bit patterns")?;
        if values.len() as u64 != self.len() {
            let what = format!("tensor '{}'", self.name);
            return Err(BufferError::Length { what, expected: self.len(), given: values.len() as u64 });
        }
        for (c, v) in self.bytes.chunks_exact_mut(2).zip(values) {
            c.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    }

    /// Sets every element to `f(coords, old)`: its global coordinates and
    /// its value now, as f32 (an optimizer step, or a fill that ignores
    /// `old`).
    pub fn map_f32(&mut self, mut f: impl FnMut(&[u64], f32) -> f32) -> Result<(), BufferError> {
        let mut values = self.to_f32()?;
        for_each_coord(&self.block, |i, at| values[i] = f(at, values[i]));
        self.write_f32(&values)
    }
}

/// The version state of a source store.
#[derive(Debug, Clone, Copy, Default)]
struct SrcState {
    /// The last version written whole (None: nothing written yet).
    version: Option<u64>,
    /// A step failed (or panicked) after writing: the weights are neither
    /// `version` nor a new one.
    torn: bool,
}

/// Marks a store torn if the step it guards unwinds.
struct TornOnUnwind<'a>(&'a Mutex<SrcState>);

impl Drop for TornOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).torn = true;
        }
    }
}

/// The weights of one source (training) rank, with a version fence.
///
/// A step that can fail: [`try_update`](Self::try_update) keeps the version
/// when it fails, and refits refuse weights a failed step changed.
#[derive(Debug)]
pub struct SrcStore {
    rank: Rank,
    buffers: Arc<tokio::sync::RwLock<Buffers>>,
    state: Mutex<SrcState>,
}

impl SrcStore {
    /// Zeroed weights for rank `rank` of `layout`, with no version: a refit
    /// refuses the store until [`update`](Self::update) or
    /// [`restore`](Self::restore) writes it.
    pub fn new(layout: &Arc<Layout>, rank: Rank) -> SrcStore {
        SrcStore { rank, buffers: Arc::new(tokio::sync::RwLock::new(Buffers::new(layout, rank))), state: Mutex::default() }
    }

    /// A store over weights the user holds in `registered` memory (device
    /// buffers a framework's optimizer writes in place): a refit on the
    /// NCCL or IPC fabric reads them where they are, with no copy; the
    /// store keeps the version and the fence. Steps write the memory with
    /// the user's own code inside [`update`](Self::update) (the buffers
    /// passed to it hold no bytes); a step that fails leaves the store torn,
    /// since the store cannot tell whether it wrote. No version until the
    /// first `update` or `restore`.
    pub fn registered(layout: &Arc<Layout>, rank: Rank, registered: Registered) -> SrcStore {
        SrcStore { rank, buffers: Arc::new(tokio::sync::RwLock::new(Buffers::over(layout, rank, registered))), state: Mutex::default() }
    }

    /// This store's rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    fn state(&self) -> std::sync::MutexGuard<'_, SrcState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The version of the weights: the last successful
    /// [`update`](Self::update) or [`restore`](Self::restore); `None`
    /// before the first.
    pub fn version(&self) -> Option<u64> {
        self.state().version
    }

    /// The weights as a refit finds them: unwritten, a version, or torn by
    /// a failed step (refits refuse this rank until the next successful
    /// `update` or `restore`).
    pub fn weights(&self) -> Weights {
        match *self.state() {
            SrcState { torn: true, version } => Weights::Torn { after: version },
            SrcState { version: Some(v), .. } => Weights::Version(v),
            SrcState { version: None, .. } => Weights::Unwritten,
        }
    }

    /// Runs one optimizer step: `step` changes the weights under the write
    /// lock (waiting for any refit reading them), then the version goes up
    /// by one (to 1 for the first step). Returns the new version and the
    /// step's value. A step that can fail: [`try_update`](Self::try_update).
    pub async fn update<R>(&self, step: impl FnOnce(&mut Buffers) -> R) -> (u64, R) {
        let done = self.write(|v| v.map_or(1, |v| v + 1), |b| Ok::<R, std::convert::Infallible>(step(b))).await;
        done.unwrap_or_else(|never| match never {})
    }

    /// [`update`](Self::update) for a step that can fail. On `Ok` the
    /// version goes up by one; on `Err` it stays, and if the step had
    /// already written (any mutable access to the buffers) the store
    /// becomes torn: refits refuse it until a later step or a restore
    /// succeeds, so no refit passes changed weights off as the old version.
    pub async fn try_update<T, E>(&self, step: impl FnOnce(&mut Buffers) -> Result<T, E>) -> Result<(u64, T), E> {
        self.write(|v| v.map_or(1, |v| v + 1), step).await
    }

    /// Replaces the weights with a known `version` (initial weights, or a
    /// trainer restarted from a checkpoint of that step): `write` fills
    /// them under the write lock, then the store holds `version`.
    pub async fn restore<R>(&self, version: u64, write: impl FnOnce(&mut Buffers) -> R) -> R {
        let done = self.write(|_| version, |b| Ok::<R, std::convert::Infallible>(write(b))).await;
        done.map(|(_, r)| r).unwrap_or_else(|never| match never {})
    }

    /// [`restore`](Self::restore) for a `write` that can fail; on `Err` as
    /// for [`try_update`](Self::try_update).
    pub async fn try_restore<T, E>(&self, version: u64, write: impl FnOnce(&mut Buffers) -> Result<T, E>) -> Result<T, E> {
        self.write(|_| version, write).await.map(|(_, r)| r)
    }

    /// Runs `f` under the write lock; on `Ok` the store holds version
    /// `next(current)`, whole; on `Err` (or a panic) it keeps its version
    /// and is torn if `f` had written.
    async fn write<T, E>(
        &self,
        next: impl FnOnce(Option<u64>) -> u64,
        f: impl FnOnce(&mut Buffers) -> Result<T, E>,
    ) -> Result<(u64, T), E> {
        let mut guard = self.buffers.write().await;
        guard.written = false;
        let unwinding = TornOnUnwind(&self.state);
        let result = f(&mut guard);
        drop(unwinding);
        let mut state = self.state();
        match result {
            Ok(value) => {
                let v = next(state.version);
                *state = SrcState { version: Some(v), torn: false };
                Ok((v, value))
            }
            Err(e) => {
                // Registered memory may have been written without a trace.
                state.torn |= guard.written || guard.registered.is_some();
                Err(e)
            }
        }
    }

    /// Starts a step that runs outside a closure (a Python optimizer step
    /// between two calls, say): waits for the write lock and holds it until
    /// the guard is [finished](UpdateGuard::finish) (the version goes up by
    /// one) or dropped (the step failed: the version stays, and the store
    /// is torn if the step wrote — always, for registered memory).
    pub async fn begin_update(self: &Arc<Self>) -> UpdateGuard {
        let mut guard = self.buffers.clone().write_owned().await;
        guard.written = false;
        UpdateGuard { store: self.clone(), guard: Some(guard) }
    }

    /// Reads the weights (shared with other readers, excluded from updates).
    pub async fn read<R>(&self, f: impl FnOnce(&Buffers) -> R) -> R {
        f(&*self.buffers.read().await)
    }

    /// The lock a refit holds while it reads this rank's weights.
    pub(crate) fn lock(&self) -> Arc<tokio::sync::RwLock<Buffers>> {
        self.buffers.clone()
    }
}

/// A step in progress on a [`SrcStore`], holding its write lock
/// ([`SrcStore::begin_update`]).
pub struct UpdateGuard {
    store: Arc<SrcStore>,
    /// `None` once finished.
    guard: Option<tokio::sync::OwnedRwLockWriteGuard<Buffers>>,
}

impl std::fmt::Debug for UpdateGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpdateGuard").field("rank", &self.store.rank).finish_non_exhaustive()
    }
}

impl UpdateGuard {
    /// The buffers the step writes (no bytes for registered memory, which
    /// the step writes in place).
    pub fn buffers(&mut self) -> Option<&mut Buffers> {
        self.guard.as_deref_mut()
    }

    /// The step succeeded: the store holds the next version, whole.
    /// Returns it.
    pub fn finish(mut self) -> u64 {
        let mut state = self.store.state();
        let v = state.version.map_or(1, |v| v + 1);
        *state = SrcState { version: Some(v), torn: false };
        drop(state);
        self.guard = None;
        v
    }
}

impl Drop for UpdateGuard {
    fn drop(&mut self) {
        if let Some(guard) = self.guard.take() {
            // Not finished: the step failed.
            self.store.state().torn |= guard.written || guard.registered.is_some();
        }
    }
}

/// One committed version of a destination rank's weights.
#[derive(Debug)]
pub struct Snapshot {
    /// The version.
    pub version: u64,
    /// The weights.
    pub buffers: Buffers,
}

/// The weights of one destination (inference) rank: the committed version
/// readers use, the one before it (so a tensor-parallel group can agree on
/// a version while a commit sweeps over its ranks), and a staging copy that
/// refits write.
///
/// A store over **registered** memory ([`DstStore::registered`]: the
/// inference engine's own device buffers) serves one version, in that
/// memory: a refit writes the member's staging (device memory of the
/// fabric's), and the commit copies it in while no reader holds the
/// store ([`DstStore::serve`]).
#[derive(Debug)]
pub struct DstStore {
    rank: Rank,
    layout: Arc<Layout>,
    live: RwLock<Live>,
    staging: Arc<tokio::sync::Mutex<Staging>>,
    /// The user's memory the weights are served in, if registered.
    registered: Option<Registered>,
    /// Readers of registered memory hold it shared ([`Serving`]); a
    /// commit into that memory holds it exclusively.
    fence: Arc<tokio::sync::RwLock<()>>,
}

/// The current and the previous committed version (none before the first
/// commit).
#[derive(Debug, Default)]
struct Live {
    current: Option<Arc<Snapshot>>,
    previous: Option<Arc<Snapshot>>,
    /// Registered memory a commit failed to copy into whole: it holds
    /// neither the last committed version nor the new one.
    torn: bool,
    /// The last version committed whole.
    last: Option<u64>,
}

/// A reader's hold on a destination's served weights
/// ([`DstStore::serve`]): while it lives, no commit changes them. Readers
/// of registered memory (an inference engine's device buffers) keep it for
/// as long as their work reads the weights — until that work has finished
/// on the device, not just been queued.
#[derive(Debug)]
pub struct Serving {
    version: Option<u64>,
    _fence: tokio::sync::OwnedRwLockReadGuard<()>,
}

impl Serving {
    /// The version the weights hold while this hold lasts (`None`:
    /// nothing committed yet, or registered memory torn by a failed
    /// commit: not to be used).
    pub fn version(&self) -> Option<u64> {
        self.version
    }
}

/// A commit's exclusive hold on a destination's served weights: taken by
/// the member once its run staged the whole version
/// ([`DstStore::fence_for_commit`]), released by the commit or a discard.
pub(crate) type CommitFence = tokio::sync::OwnedRwLockWriteGuard<()>;

/// The staging copy and which version it holds completely, if any.
#[derive(Debug)]
pub(crate) struct Staging {
    pub(crate) buffers: Buffers,
    pub(crate) complete: Option<u64>,
}

impl DstStore {
    /// A store for rank `rank` of `layout` that serves nothing until the
    /// first refit commits.
    pub fn new(layout: &Arc<Layout>, rank: Rank) -> DstStore {
        let buffers = Buffers::new(layout, rank);
        DstStore::with(layout, rank, buffers, None)
    }

    /// A store that serves its weights in `registered` memory (the
    /// inference engine's own buffers, one region per buffer of the rank):
    /// a refit on the NCCL or IPC fabric writes the member's staging and
    /// the commit copies it into the memory, once every member of both
    /// groups succeeded and no reader [serves](Self::serve) it; a failed
    /// refit never touches it. The store holds none of the bytes (its
    /// snapshots' [`Buffers`] answer [`BufferError::Registered`]); readers
    /// use the memory itself, inside [`serve`](Self::serve). Serves nothing
    /// until the first refit commits.
    pub fn registered(layout: &Arc<Layout>, rank: Rank, registered: Registered) -> DstStore {
        let buffers = Buffers::over(layout, rank, registered.clone());
        DstStore::with(layout, rank, buffers, Some(registered))
    }

    fn with(layout: &Arc<Layout>, rank: Rank, buffers: Buffers, registered: Option<Registered>) -> DstStore {
        DstStore {
            rank,
            layout: layout.clone(),
            live: RwLock::default(),
            staging: Arc::new(tokio::sync::Mutex::new(Staging { buffers, complete: None })),
            registered,
            fence: Arc::default(),
        }
    }

    /// The registered memory the weights are served in, if any.
    pub fn registered_memory(&self) -> Option<&Registered> {
        self.registered.as_ref()
    }

    /// Holds the served weights for a reader: waits while a commit copies
    /// into registered memory, then no commit changes them until the hold
    /// is dropped (a refit that staged its version meanwhile waits for it,
    /// within its deadline). On a store of host memory, snapshots never
    /// change anyway; the hold only names the version.
    pub async fn serve(&self) -> Serving {
        let fence = self.fence.clone().read_owned().await;
        Serving { version: self.version(), _fence: fence }
    }

    /// The weights as a refit finds them: nothing committed, a version, or
    /// registered memory torn by a commit that failed midway (served again
    /// after the next refit commits).
    pub fn weights(&self) -> Weights {
        let live = self.live();
        match (&live.current, live.torn) {
            (_, true) => Weights::Torn { after: live.last },
            (Some(s), false) => Weights::Version(s.version),
            (None, false) => Weights::Unwritten,
        }
    }

    /// This store's rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    fn live(&self) -> std::sync::RwLockReadGuard<'_, Live> {
        self.live.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The committed weights, `None` before the first refit. Keep the `Arc`
    /// for as long as one rollout needs consistent weights; later commits
    /// do not change it.
    pub fn snapshot(&self) -> Option<Arc<Snapshot>> {
        self.live().current.clone()
    }

    /// The committed weights of `version`, if it is the current or the
    /// previous committed version. The ranks of a tensor-parallel group
    /// agree on a version (the orchestrator's last committed one, say) and
    /// each reads it here: a commit in progress across the group, which
    /// flips ranks one after another, cannot make them read different
    /// versions.
    pub fn snapshot_at(&self, version: u64) -> Option<Arc<Snapshot>> {
        let live = self.live();
        if let Some(current) = live.current.as_ref().filter(|s| s.version == version) {
            return Some(current.clone());
        }
        live.previous.as_ref().filter(|s| s.version == version).cloned()
    }

    /// The version readers currently get; `None` before the first refit.
    pub fn version(&self) -> Option<u64> {
        self.live().current.as_ref().map(|s| s.version)
    }

    pub(crate) fn staging(&self) -> Arc<tokio::sync::Mutex<Staging>> {
        self.staging.clone()
    }

    /// Makes the staged version `version` the committed one, atomically,
    /// by moving the staging buffers in (no copy). The version before the
    /// previous one becomes the next staging copy if no reader holds it any
    /// more (a refit rewrites every element), else staging is allocated
    /// afresh. Fails (changing nothing) unless staging holds all of
    /// `version`.
    pub(crate) async fn commit(&self, version: u64) -> Result<(), Option<u64>> {
        debug_assert!(self.registered.is_none(), "registered stores commit through `publish`");
        let mut staging = self.staging.lock().await;
        if staging.complete != Some(version) {
            return Err(staging.complete);
        }
        let blank = staging.buffers.emptied();
        let buffers = std::mem::replace(&mut staging.buffers, blank);
        let next = Arc::new(Snapshot { version, buffers });
        let retired = {
            let mut live = self.live.write().unwrap_or_else(|e| e.into_inner());
            live.last = Some(version);
            let current = live.current.replace(next);
            std::mem::replace(&mut live.previous, current)
        };
        staging.buffers = match retired.map(Arc::try_unwrap) {
            Some(Ok(old)) => old.buffers,
            _ => staging.buffers.zeroed_like(),
        };
        staging.complete = None;
        Ok(())
    }

    /// Forgets a partly or wholly staged version.
    pub(crate) async fn discard(&self) {
        self.staging.lock().await.complete = None;
    }

    /// The exclusive hold a commit into registered memory needs: waits for
    /// the readers [serving](Self::serve) the weights to let go, at most
    /// `within`; `None` if they did not.
    pub(crate) async fn fence_for_commit(&self, within: std::time::Duration) -> Option<CommitFence> {
        tokio::time::timeout(within, self.fence.clone().write_owned()).await.ok()
    }

    /// Registered memory now holds `version` whole (the commit copied it
    /// in under `_fence`): readers get it from here on.
    pub(crate) fn publish(&self, version: u64, _fence: &CommitFence) {
        if let Some(registered) = &self.registered {
            let buffers = Buffers::over(&self.layout, self.rank, registered.clone());
            let mut live = self.live.write().unwrap_or_else(|e| e.into_inner());
            // Registered memory holds one version: the one before is gone.
            *live = Live { current: Some(Arc::new(Snapshot { version, buffers })), previous: None, torn: false, last: Some(version) };
        }
    }

    /// A commit into registered memory failed midway (under `_fence`): the
    /// memory holds no whole version; nothing is served until the next
    /// refit commits.
    pub(crate) fn tear(&self, _fence: &CommitFence) {
        let mut live = self.live.write().unwrap_or_else(|e| e.into_inner());
        live.current = None;
        live.previous = None;
        live.torn = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard::{MeshDim::Shard, Region, Storage, TensorBuilder};

    fn layout() -> Arc<Layout> {
        Arc::new(
            Layout::builder(2)
                .tensor(TensorBuilder::new("w", DType::F32, [4, 3]).mesh([2], [Shard(0)]).buffer("params", 0))
                .tensor(TensorBuilder::new("e", DType::BF16, [2, 2]).mesh([2], [Shard(0)]))
                .tensor(TensorBuilder::new("b", DType::F32, [3]).mesh([2], [Shard(0)]).buffer("params", 6))
                .tensor(TensorBuilder::new("flat", DType::F32, [3, 4]).shard(1, Region::Flat { start: 2, len: 7 }, Storage::Own).shard(
                    0,
                    Region::Flat { start: 0, len: 2 },
                    Storage::Own,
                ))
                .build()
                .unwrap(),
        )
    }

    #[test]
    fn views_know_their_global_block() {
        let mut b = Buffers::new(&layout(), 1);
        let mut w = b.tensor_mut("w").unwrap();
        assert_eq!((w.offset(), w.extent(), w.shape()), (&[2, 0][..], &[2, 3][..], &[4, 3][..]));
        w.map_f32(|at, _| (at[0] * 3 + at[1]) as f32).unwrap();
        assert_eq!(b.tensor("w").unwrap().to_f32().unwrap(), vec![6.0, 7.0, 8.0, 9.0, 10.0, 11.0]);
        b.tensor_mut("e").unwrap().write_f32(&[6.0, 1.0 / 3.0]).unwrap();
        // bf16 bits of 6.0 and of 1/3 rounded to nearest even.
        assert_eq!(b.tensor("e").unwrap().to_bits16().unwrap(), vec![0x40c0, 0x3eab]);
        // `b` on rank 1 is element 1..3 of a [3] tensor split in chunks of 2.
        let mut bias = b.tensor_mut("b").unwrap();
        assert_eq!((bias.offset(), bias.extent()), (&[2][..], &[1][..]));
        bias.write_f32(&[5.0]).unwrap();
        // It lives after w's block in the fused buffer: bytes 24..28.
        assert_eq!(&b.buffer("params").unwrap()[24..28], &5.0f32.to_le_bytes());
    }

    #[test]
    fn mistakes_say_why() {
        let mut b = Buffers::new(&layout(), 1);
        let e = |r: Result<(), BufferError>| r.unwrap_err().to_string();
        assert_eq!(e(b.tensor("v").map(drop)), "rank 1: the layout has no tensor 'v'");
        assert_eq!(
            e(b.tensor("w#0").map(drop)),
            "rank 1: the layout has no tensor 'w#0' (buffers of blocks stored alone are named '{tensor}#{shard}'; the tensor is 'w')"
        );
        assert_eq!(e(b.buffer("w#0").map(drop)), "rank 1: no buffer 'w#0' (this rank's buffers: 'params', 'e#0', 'flat#0')");
        assert_eq!(e(b.tensor("flat").map(drop)), "rank 1 holds tensor 'flat' in 3 blocks: use tensor_blocks / tensor_block_mut");
        assert_eq!(e(b.tensor_block_mut("flat", 3).map(drop)), "rank 1 holds 3 blocks of tensor 'flat', not block 3");
        assert_eq!(e(b.tensor_mut("w").unwrap().write_f32(&[1.0])), "tensor 'w': 1 values given for 6 elements");
        let blocks = b.tensor_blocks("flat").unwrap();
        // Memory replaced by hand with less than the layout places in it.
        let mut cut = Buffers::new(&layout(), 1);
        cut.memory_mut().buffers[0].truncate(10);
        assert_eq!(e(cut.tensor("w").map(drop)), "rank 1: buffer 'params' holds 10 bytes, the layout places data up to byte 24");
        cut.memory_mut().buffers.clear();
        assert_eq!(e(cut.buffer("params").map(drop)), "rank 1: buffer 'params' holds 0 bytes, the layout places data up to byte 28");
        assert_eq!(blocks.iter().map(|v| v.len()).sum::<u64>(), 7);
        assert_eq!(e(blocks[0].to_bits16().map(drop)), "tensor 'flat': holds f32, which cannot be read as 16-bit patterns");
    }

    #[tokio::test]
    async fn failed_steps_keep_the_version() {
        let store = SrcStore::new(&layout(), 0);
        assert_eq!((store.version(), store.weights()), (None, Weights::Unwritten));
        let (v, ()) = store.try_update(|b| b.tensor_mut("b")?.write_f32(&[1.0, 2.0])).await.unwrap();
        assert_eq!((v, store.weights()), (1, Weights::Version(1)));
        // Fails before writing: nothing changed, the store stays clean.
        assert!(store.try_update(|b| b.tensor_mut("nope").map(drop)).await.is_err());
        assert_eq!(store.weights(), Weights::Version(1));
        // Fails after writing: torn until the next good step.
        let failed: Result<_, BufferError> = store
            .try_update(|b| {
                b.tensor_mut("b")?.write_f32(&[3.0, 4.0])?;
                b.tensor_mut("w")?.write_f32(&[0.0])
            })
            .await;
        assert!(failed.is_err());
        assert_eq!((store.version(), store.weights()), (Some(1), Weights::Torn { after: Some(1) }));
        store.try_restore(7, |b| b.tensor_mut("b")?.write_f32(&[1.0, 2.0])).await.unwrap();
        assert_eq!(store.weights(), Weights::Version(7));
        let (v, ()) = store.update(|_| ()).await;
        assert_eq!(v, 8);
        store.restore(3, |_| ()).await;
        assert_eq!(store.weights(), Weights::Version(3));
        // A panicking step tears the store too.
        let store = Arc::new(store);
        let s = store.clone();
        let panicked = tokio::spawn(async move { s.update(|b| b.tensor_mut("b").map(|_| panic!("step failed"))).await }).await;
        assert!(panicked.is_err());
        assert_eq!(store.weights(), Weights::Torn { after: Some(3) });
        store.restore(7, |_| ()).await;
        assert_eq!(store.weights(), Weights::Version(7));
    }
}
