//! The verification pattern: every source element gets a value derived from
//! a hash of (tensor name, global flat index), so swapped, shifted or
//! duplicated blocks of any size show up; destinations are checked against
//! the same values, converted to their dtype.

use crate::memory::RankMemory;
use reshard::convert_slice;
use reshard::fnv64;
use reshard::span_in;

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
pub(crate) fn tensor_seed_at(name: &str, version: u64) -> u64 {
    if version == 0 {
        tensor_seed(name)
    } else {
        tensor_seed(name) ^ splitmix(version)
    }
}

/// Calls `f(global_flat_index, element_offset_in_buffer, len)` for every
/// run of `len` consecutive elements of `piece` (its innermost dimension),
/// stored row-major as part of `stored` from element `at`: both the global
/// flat index and the buffer offset advance by one along a run.
fn for_each_run(shape: &[u64], stored: &Block, at: u64, piece: &Block, mut f: impl FnMut(u64, u64, u64)) {
    let span = span_in(0, stored, at, piece);
    let nd = piece.ndim();
    if piece.numel() == 0 {
        return;
    }
    if nd == 0 {
        f(0, span.base, 1);
        return;
    }
    let run = piece.extent()[nd - 1];
    let outer = nd - 1;
    let mut gstride = vec![1u64; nd];
    for d in (0..nd.saturating_sub(1)).rev() {
        gstride[d] = gstride[d + 1] * shape[d + 1];
    }
    let mut idx = vec![0u64; outer];
    let mut flat = piece.flat_start(shape);
    let mut local = span.base;
    for _ in 0..piece.numel() / run {
        f(flat, local, run);
        for d in (0..outer).rev() {
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

/// Writes the pattern of elements `flat..flat + n` into `out` (`n` elements of `dtype`).
fn pattern_run(seed: u64, flat: u64, dtype: DType, out: &mut [u8]) {
    let size = dtype.size() as usize;
    for (k, o) in out.chunks_exact_mut(size).enumerate() {
        pattern_value(seed, flat + k as u64, dtype, o);
    }
}

/// Position of each of `rank`'s buffers in its memory.
fn rank_buffer_index(layout: &Layout, rank: u32) -> HashMap<reshard::BufferKey, usize> {
    layout.rank_buffers(rank).iter().enumerate().map(|(i, b)| (b.key, i)).collect()
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
    let index = rank_buffer_index(src, rank);
    for (ti, t) in src.tensors().iter().enumerate() {
        let seed = tensor_seed_at(&t.name, version);
        let size = t.dtype.size() as usize;
        for (block, loc) in src.rank_holdings(ti as u32, rank) {
            let buf = &mut memory.buffers[index[&loc.buffer]];
            for_each_run(&t.shape, &block, loc.at, &block, |flat, off, n| {
                let o = off as usize * size;
                pattern_run(seed, flat, t.dtype, &mut buf[o..o + n as usize * size]);
            });
        }
    }
}

/// Checks every destination element against the pattern converted from the
/// source dtype. `memory[r]` is destination rank `r`'s memory. Returns the
/// number of elements checked.
pub fn verify_destinations(src: &Layout, dst: &Layout, memory: &[RankMemory]) -> Result<u64, Box<Mismatch>> {
    verify_ranks(&source_dtypes(src), dst, None, 0, &|r| memory.get(r as usize), &|_| true)
}

/// Checks the elements of destination rank `rank` only; `memory` is its.
pub fn verify_destination_rank(src: &Layout, dst: &Layout, rank: u32, memory: &RankMemory) -> Result<u64, Box<Mismatch>> {
    verify_ranks(&source_dtypes(src), dst, Some(rank), 0, &|r| (r == rank).then_some(memory), &|_| true)
}

/// Checks the elements of destination rank `rank` against the pattern of
/// weights version `version`.
#[cfg(test)]
fn verify_destination_rank_at(src: &Layout, dst: &Layout, rank: u32, version: u64, memory: &RankMemory) -> Result<u64, Box<Mismatch>> {
    verify_ranks(&source_dtypes(src), dst, Some(rank), version, &|r| (r == rank).then_some(memory), &|_| true)
}

/// Checks the elements of destination rank `rank` of the tensors
/// `tensor(index)` names against the pattern of weights version
/// `version`, knowing of the source layout only the dtype of each tensor
/// (`source_dtype(name)`; `None`: the destination's own): what a process
/// holding only its own group's layout can do.
pub fn verify_destination_rank_from(
    dst: &Layout,
    rank: u32,
    version: u64,
    source_dtype: &dyn Fn(&str) -> Option<DType>,
    tensor: &dyn Fn(u32) -> bool,
    memory: &RankMemory,
) -> Result<u64, Box<Mismatch>> {
    verify_ranks(source_dtype, dst, Some(rank), version, &|r| (r == rank).then_some(memory), tensor)
}

/// The dtype `src` gives each tensor, by name (`None`: a tensor it does not
/// have): what [`verify_ranks`] converts the pattern from.
fn source_dtypes(src: &Layout) -> impl Fn(&str) -> Option<DType> + '_ {
    |name| src.tensor_index(name).map(|i| src.tensors()[i as usize].dtype)
}

fn verify_ranks<'m>(
    source_dtype: &dyn Fn(&str) -> Option<DType>,
    dst: &Layout,
    only: Option<u32>,
    version: u64,
    memory: &dyn Fn(u32) -> Option<&'m RankMemory>,
    tensor: &dyn Fn(u32) -> bool,
) -> Result<u64, Box<Mismatch>> {
    let ranks: Vec<u32> = match only {
        Some(r) => vec![r],
        None => (0..dst.ranks()).collect(),
    };
    let mut checked = 0u64;
    for rank in ranks {
        let Some(mem) = memory(rank) else { continue };
        let index = rank_buffer_index(dst, rank);
        for (ti, t) in dst.tensors().iter().enumerate().filter(|&(ti, _)| tensor(ti as u32)) {
            let seed = tensor_seed_at(&t.name, version);
            let from = source_dtype(&t.name).unwrap_or(t.dtype);
            let (fs, ts) = (from.size() as usize, t.dtype.size() as usize);
            let (mut raw, mut want) = (Vec::new(), Vec::new());
            let quantized = QuantizedPattern::of(dst, ti as u32, version, source_dtype);
            for (block, loc) in dst.rank_holdings(ti as u32, rank) {
                let buf = &mem.buffers[index[&loc.buffer]];
                if let Some(q) = &quantized {
                    checked += block.numel();
                    let want = q.expected(&block);
                    let o = loc.at as usize * ts;
                    let got = buf.get(o..o + want.len()).unwrap_or(&[]);
                    if got == want.as_slice() {
                        continue;
                    }
                    let elems = |b: &[u8]| b.chunks_exact(ts).map(<[u8]>::to_vec).collect::<Vec<_>>();
                    let (g, w) = (elems(got), elems(&want));
                    let bad: Vec<usize> = (0..w.len()).filter(|&k| g.get(k) != Some(&w[k])).collect();
                    let k = bad[0];
                    return Err(Box::new(Mismatch {
                        tensor: t.name.clone(),
                        rank: loc.rank,
                        buffer: dst.buffer_name(loc.buffer),
                        index: index_in(&block, k as u64),
                        got: g.get(k).cloned().unwrap_or_default(),
                        expected: w[k].clone(),
                        mismatches: bad.len() as u64,
                    }));
                }
                let mut first: Option<(u64, Vec<u8>, Vec<u8>)> = None;
                let mut bad = 0u64;
                for_each_run(&t.shape, &block, loc.at, &block, |flat, off, n| {
                    let n = n as usize;
                    raw.resize(n * fs, 0);
                    want.resize(n * ts, 0);
                    pattern_run(seed, flat, from, &mut raw);
                    convert_slice(from, &raw, t.dtype, &mut want);
                    let o = off as usize * ts;
                    let got = &buf[o..o + n * ts];
                    if got == want.as_slice() {
                        return;
                    }
                    for (k, (g, w)) in got.chunks_exact(ts).zip(want.chunks_exact(ts)).enumerate() {
                        if g != w {
                            bad += 1;
                            if first.is_none() {
                                first = Some((flat + k as u64, g.to_vec(), w.to_vec()));
                            }
                        }
                    }
                });
                checked += block.numel();
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

/// Global index of element `k` (row-major) of `block`.
fn index_in(block: &Block, k: u64) -> Vec<u64> {
    let mut index = vec![0u64; block.ndim()];
    let mut rem = k;
    for d in (0..block.ndim()).rev() {
        index[d] = block.offset()[d] + rem % block.extent()[d];
        rem /= block.extent()[d];
    }
    index
}

/// What a block-scaled tensor or its scale tensor holds after a refit of
/// the pattern: the source pattern quantized as [`reshard::quantize`] says,
/// each block's scale computed from the pattern of the whole block.
struct QuantizedPattern {
    /// The block-scaled tensor's seed, source dtype, shape and block.
    seed: u64,
    from: DType,
    shape: Vec<u64>,
    block: Vec<u64>,
    /// Checking the scale tensor (block-grid coordinates) rather than the
    /// tensor.
    scales: bool,
}

impl QuantizedPattern {
    /// For tensor `t` of `dst` at `version`, if it is block-scaled or a
    /// scale tensor.
    fn of(dst: &Layout, t: u32, version: u64, source_dtype: &dyn Fn(&str) -> Option<DType>) -> Option<QuantizedPattern> {
        let (w, scales) = match (dst.scale_of(t), dst.scale_for(t)) {
            (Some(_), _) => (t, false),
            (None, Some(w)) => (w, true),
            (None, None) => return None,
        };
        let (_, block) = dst.scale_of(w)?;
        let wt = &dst.tensors()[w as usize];
        Some(QuantizedPattern {
            seed: tensor_seed_at(&wt.name, version),
            from: source_dtype(&wt.name).unwrap_or(DType::F32),
            shape: wt.shape.clone(),
            block: block.to_vec(),
            scales,
        })
    }

    /// The pattern of block `g` (block-grid index) as f32 values, row-major.
    fn values(&self, g: &[u64]) -> (Block, Vec<f32>) {
        let elems = reshard::elements_of(&Block::new(g, &vec![1; g.len()]), &self.block, &self.shape);
        let size = self.from.size() as usize;
        let mut raw = vec![0u8; size];
        let mut out = Vec::with_capacity(elems.numel() as usize);
        reshard::for_each_row(&elems, |idx, run| {
            let flat = Block::new(idx, &vec![1; idx.len()]).flat_start(&self.shape);
            for k in 0..run {
                pattern_value(self.seed, flat + k, self.from, &mut raw);
                out.push(reshard::read_f32(self.from, &raw, 0));
            }
        });
        (elems, out)
    }

    /// Expected bytes of `held` (a box of the tensor, or of its scale
    /// tensor), row-major.
    fn expected(&self, held: &Block) -> Vec<u8> {
        let grid = if self.scales { *held } else { reshard::grid_of(held, &self.block) };
        let mut out = vec![0u8; held.numel() as usize * if self.scales { 4 } else { 1 }];
        reshard::for_each_cell(&grid, |g| {
            let (elems, values) = self.values(g);
            let s = reshard::block_scale(values.iter().fold(0f32, |m, v| m.max(v.abs())));
            if self.scales {
                let pos = reshard::offset_in(held, 0, g) as usize * 4;
                out[pos..pos + 4].copy_from_slice(&s.to_le_bytes());
                return;
            }
            let Some(part) = elems.intersect(held) else { return };
            reshard::for_each_row(&part, |idx, run| {
                let (from, to) = (reshard::offset_in(&elems, 0, idx) as usize, reshard::offset_in(held, 0, idx) as usize);
                for k in 0..run as usize {
                    out[to + k] = reshard::quantize_value(values[from + k], s);
                }
            });
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard::parse_layout;

    /// A 6x5 tensor split by rows over 2 ranks (uneven runs of 5 elements),
    /// f32 at the source and bf16 at the destination.
    fn layouts() -> (Layout, Layout) {
        let l = |dtype: &str| {
            parse_layout(&format!(
                r#"{{"ranks": 2, "tensors": [{{"name": "w", "dtype": "{dtype}", "shape": [6, 5],
                    "mesh": {{"shape": [2]}}, "placements": ["shard(0)"]}}]}}"#
            ))
            .unwrap()
        };
        (l("f32"), l("bf16"))
    }

    /// What a correct refit leaves on a destination rank: the source
    /// pattern, converted element by element.
    fn refitted(src: &Layout, dst: &Layout, rank: u32, version: u64) -> RankMemory {
        let mut from = RankMemory::for_buffers(&src.rank_buffers(rank));
        fill_source_rank_at(src, rank, version, &mut from);
        let mut to = RankMemory::for_buffers(&dst.rank_buffers(rank));
        convert_slice(DType::F32, &from.buffers[0], DType::BF16, &mut to.buffers[0]);
        to
    }

    #[test]
    fn a_correct_rank_passes_and_every_element_counts() {
        let (src, dst) = layouts();
        for rank in 0..2 {
            let m = refitted(&src, &dst, rank, 3);
            assert_eq!(verify_destination_rank_at(&src, &dst, rank, 3, &m).unwrap(), 15);
        }
    }

    #[test]
    fn a_wrong_element_or_version_is_found_and_located() {
        let (src, dst) = layouts();
        let mut m = refitted(&src, &dst, 1, 3);
        // Element (4, 2) of the tensor is row 1, column 2 of rank 1's block.
        m.buffers[0][(5 + 2) * 2] ^= 0x40;
        let e = verify_destination_rank_at(&src, &dst, 1, 3, &m).unwrap_err();
        assert_eq!((e.rank, e.index.clone(), e.mismatches), (1, vec![4, 2], 1), "{e}");
        // Another version's pattern differs almost everywhere.
        let m = refitted(&src, &dst, 0, 2);
        let e = verify_destination_rank_at(&src, &dst, 0, 3, &m).unwrap_err();
        assert_eq!(e.index, vec![0, 0]);
        assert!(e.mismatches > 10, "{e}");
    }
}
