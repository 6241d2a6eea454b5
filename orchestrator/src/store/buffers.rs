//! A rank's buffers ([`Buffers`]): its memory and the layout that places
//! each tensor's blocks in it, read and written block by block through
//! [`TensorView`] and [`TensorViewMut`].

use super::error::some_names;
use super::{BufferError, Registered};
use reshard::{Block, BufferSpec, DType, Layout, Rank};
use std::sync::Arc;
use transport::fabric::RunMemory;
use transport::RankMemory;

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

/// A rank's buffers: the memory the data plane reads and writes, and the
/// layout that says which block of which tensor lives where in it.
#[derive(Clone)]
pub struct Buffers {
    layout: Arc<Layout>,
    rank: Rank,
    specs: Vec<BufferSpec>,
    memory: RankMemory,
    /// The user's own memory in place of `memory` (which is then empty).
    pub(super) registered: Option<Registered>,
    /// Set by every mutable access: whether the weights may have changed
    /// since the flag was last cleared (a step's start).
    pub(super) written: bool,
}

impl std::fmt::Debug for Buffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.specs.iter().map(|s| s.name.as_str()).collect();
        f.debug_struct("Buffers").field("rank", &self.rank).field("buffers", &names).finish_non_exhaustive()
    }
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
    pub(super) fn over(layout: &Arc<Layout>, rank: Rank, registered: Registered) -> Buffers {
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
            Some(r) => Err(BufferError::Registered { rank: self.rank, residence: r.residence() }),
            None => Ok(()),
        }
    }

    /// The same buffers, zeroed.
    pub(super) fn zeroed_like(&self) -> Buffers {
        Buffers { memory: RankMemory::for_buffers(&self.specs), ..self.emptied() }
    }

    /// The same buffer list with no memory (a placeholder while the memory
    /// is moved elsewhere).
    pub(super) fn emptied(&self) -> Buffers {
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

    /// The rank's memory for a run ([`super::RunHold`]): registered memory
    /// where its owner holds it, or these buffers (which the run may
    /// write).
    pub(super) fn run_memory(&mut self) -> RunMemory<'_> {
        match &self.registered {
            Some(registered) => RunMemory::Registered(registered),
            None => {
                self.written = true;
                RunMemory::Host(&mut self.memory)
            }
        }
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
    reshard::convert_slice(dtype, bytes, DType::F32, &mut raw);
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
    reshard::convert_slice(DType::F32, &raw, dtype, bytes);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fixtures::layout;

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
}
