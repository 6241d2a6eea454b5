//! The verification pattern: every source element gets a value derived from
//! a hash of (tensor name, global flat index), so swapped, shifted or
//! duplicated blocks of any size show up; destinations are checked against
//! the same values, converted to their dtype.

use crate::memory::RankMemory;
use reshard::dtype::convert_slice;
use reshard::fingerprint::fnv64;
use reshard::program::span_in;
use reshard::{Block, DType, Layout};
use std::collections::HashMap;
use thiserror::Error;

/// A destination element that does not hold the expected value.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("tensor '{tensor}' on dst rank {rank}, buffer '{buffer}': element {index:?} is {got:02x?}, expected {expected:02x?} ({mismatches} mismatched elements in all)")]
pub struct Mismatch {
    /// Tensor name.
    pub tensor: String,
    /// Destination rank.
    pub rank: u32,
    /// Buffer name.
    pub buffer: String,
    /// Global index of the first bad element.
    pub index: Vec<u64>,
    /// Bytes found.
    pub got: Vec<u8>,
    /// Bytes expected.
    pub expected: Vec<u8>,
    /// Number of bad elements.
    pub mismatches: u64,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The pattern value of element `index` of a tensor with seed `seed`, as
/// little-endian bytes of `dtype` (written into `out`). Floats are finite,
/// normal, within ±2^±10, so every float conversion is defined.
pub fn pattern_value(seed: u64, index: u64, dtype: DType, out: &mut [u8]) {
    let h = splitmix(seed ^ index.wrapping_mul(0x2545_f491_4f6c_dd1d));
    let sign = h >> 63;
    let e = ((h >> 40) % 21) as i64 - 10;
    let bits: u64 = match dtype {
        DType::F64 => (sign << 63) | (((e + 1023) as u64) << 52) | (h & ((1 << 52) - 1)),
        DType::F32 => (sign << 31) | (((e + 127) as u64) << 23) | (h & ((1 << 23) - 1)),
        DType::BF16 => (sign << 15) | (((e + 127) as u64) << 7) | (h & ((1 << 7) - 1)),
        DType::F16 => (sign << 15) | (((e + 15) as u64) << 10) | (h & ((1 << 10) - 1)),
        _ => h,
    };
    out.copy_from_slice(&bits.to_le_bytes()[..dtype.size() as usize]);
}

/// Seed of a tensor's pattern.
pub fn tensor_seed(name: &str) -> u64 {
    fnv64(name)
}

/// Seed of a tensor's pattern at weights version `version` (version 0 is
/// [`tensor_seed`]), so that every version has different values and a
/// destination left on an older version shows up as a mismatch.
pub fn tensor_seed_at(name: &str, version: u64) -> u64 {
    if version == 0 {
        tensor_seed(name)
    } else {
        tensor_seed(name) ^ splitmix(version)
    }
}

/// Calls `f(global_flat_index, element_offset_in_buffer)` for every element
/// of `piece`, stored as part of `stored` from element `at`.
fn for_each_element(shape: &[u64], stored: &Block, at: u64, piece: &Block, mut f: impl FnMut(u64, u64)) {
    let span = span_in(0, stored, at, piece);
    let nd = piece.ndim();
    let numel = piece.numel();
    if numel == 0 {
        return;
    }
    let mut gstride = vec![1u64; nd];
    for d in (0..nd.saturating_sub(1)).rev() {
        gstride[d] = gstride[d + 1] * shape[d + 1];
    }
    let mut idx = vec![0u64; nd];
    let mut flat = piece.flat_start(shape);
    let mut local = span.base;
    for _ in 0..numel {
        f(flat, local);
        for d in (0..nd).rev() {
            idx[d] += 1;
            flat += gstride[d];
            local += span.strides[d];
            if idx[d] < piece.extent()[d] {
                break;
            }
            flat -= gstride[d] * piece.extent()[d];
            local -= span.strides[d] * piece.extent()[d];
            idx[d] = 0;
        }
    }
}

fn buffer_index(layout: &Layout) -> Vec<HashMap<reshard::BufferKey, usize>> {
    layout.buffers().iter().map(|l| l.iter().enumerate().map(|(i, b)| (b.key, i)).collect()).collect()
}

/// Fills every source shard with the pattern. `memory[r]` is source rank
/// `r`'s memory, laid out as its program's buffers (layout buffers first).
pub fn fill_sources(src: &Layout, memory: &mut [RankMemory]) {
    for (r, m) in memory.iter_mut().enumerate() {
        fill_source_rank(src, r as u32, m);
    }
}

/// Fills the shards of source rank `rank` with the pattern.
pub fn fill_source_rank(src: &Layout, rank: u32, memory: &mut RankMemory) {
    fill_source_rank_at(src, rank, 0, memory)
}

/// Fills the shards of source rank `rank` with the pattern of weights
/// version `version`.
pub fn fill_source_rank_at(src: &Layout, rank: u32, version: u64, memory: &mut RankMemory) {
    let index = buffer_index(src);
    for (ti, t) in src.tensors().iter().enumerate() {
        let seed = tensor_seed_at(&t.name, version);
        let size = t.dtype.size() as usize;
        for h in src.holdings(ti as u32) {
            for loc in h.holders.iter().filter(|l| l.rank == rank) {
                let b = index[loc.rank as usize][&loc.buffer];
                let buf = &mut memory.buffers[b];
                for_each_element(&t.shape, &h.block, loc.at, &h.block, |flat, off| {
                    let o = off as usize * size;
                    pattern_value(seed, flat, t.dtype, &mut buf[o..o + size]);
                });
            }
        }
    }
}

/// Checks every destination element against the pattern converted from the
/// source dtype. `memory[r]` is destination rank `r`'s memory. Returns the
/// number of elements checked.
pub fn verify_destinations(src: &Layout, dst: &Layout, memory: &[RankMemory]) -> Result<u64, Box<Mismatch>> {
    verify_impl(src, dst, None, 0, &|r| memory.get(r as usize))
}

/// Checks the elements of destination rank `rank` only; `memory` is its.
pub fn verify_destination_rank(src: &Layout, dst: &Layout, rank: u32, memory: &RankMemory) -> Result<u64, Box<Mismatch>> {
    verify_impl(src, dst, Some(rank), 0, &|r| (r == rank).then_some(memory))
}

/// Checks the elements of destination rank `rank` against the pattern of
/// weights version `version`.
pub fn verify_destination_rank_at(src: &Layout, dst: &Layout, rank: u32, version: u64, memory: &RankMemory) -> Result<u64, Box<Mismatch>> {
    verify_impl(src, dst, Some(rank), version, &|r| (r == rank).then_some(memory))
}

fn verify_impl<'m>(
    src: &Layout,
    dst: &Layout,
    only: Option<u32>,
    version: u64,
    memory: &dyn Fn(u32) -> Option<&'m RankMemory>,
) -> Result<u64, Box<Mismatch>> {
    let index = buffer_index(dst);
    let mut checked = 0u64;
    for (ti, t) in dst.tensors().iter().enumerate() {
        let seed = tensor_seed_at(&t.name, version);
        let from = src.tensor_index(&t.name).map_or(t.dtype, |i| src.tensors()[i as usize].dtype);
        let (fs, ts) = (from.size() as usize, t.dtype.size() as usize);
        let mut raw = vec![0u8; fs];
        let mut want = vec![0u8; ts];
        for h in dst.holdings(ti as u32) {
            for loc in h.holders.iter().filter(|l| only.is_none_or(|r| l.rank == r)) {
                let b = index[loc.rank as usize][&loc.buffer];
                let Some(mem) = memory(loc.rank) else { continue };
                let buf = &mem.buffers[b];
                let mut first: Option<(u64, Vec<u8>, Vec<u8>)> = None;
                let mut bad = 0u64;
                for_each_element(&t.shape, &h.block, loc.at, &h.block, |flat, off| {
                    pattern_value(seed, flat, from, &mut raw);
                    convert_slice(from, &raw, t.dtype, &mut want);
                    let o = off as usize * ts;
                    let got = &buf[o..o + ts];
                    if got != want.as_slice() {
                        bad += 1;
                        if first.is_none() {
                            first = Some((flat, got.to_vec(), want.clone()));
                        }
                    }
                });
                checked += h.block.numel();
                if let Some((flat, got, expected)) = first {
                    let mut index = vec![0u64; t.shape.len()];
                    let mut rem = flat;
                    for d in (0..t.shape.len()).rev() {
                        index[d] = rem % t.shape[d];
                        rem /= t.shape[d];
                    }
                    return Err(Box::new(Mismatch {
                        tensor: t.name.clone(),
                        rank: loc.rank,
                        buffer: dst.buffer_name(loc.buffer),
                        index,
                        got,
                        expected,
                        mismatches: bad,
                    }));
                }
            }
        }
    }
    Ok(checked)
}
