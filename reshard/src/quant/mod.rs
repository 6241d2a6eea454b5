//! Block-scaled FP8 destinations: a destination tensor of dtype `f8e4m3`
//! with a scale tensor ([`BlockScale`](crate::layout::BlockScale)) is quantized per block from the
//! source's values, the way DeepSeek-V3 and Kimi-K2 checkpoints are stored
//! (`weight` + `weight_scale_inv`, 128 x 128 blocks).
//!
//! # Semantics
//! Blocks of `block[d]` elements per dimension tile the **global** tensor
//! from index 0 (the last block of a dimension may be partial). For block
//! `b`, `amax_b` is the largest `|x|` of its source values converted to
//! f32; `s_b = amax_b / 448` in f32, or `1.0` if `amax_b == 0`; every
//! element is `q = e4m3(x / s_b)` (the division in f32), rounded to nearest
//! even, saturating to ±448, the sign bit always kept (`-0.0` and negative
//! values that round to zero are `0x80`). A zero element is the signed
//! zero whatever `s_b` is (it differs from `e4m3(x / s_b)` only when `s_b`
//! underflows to zero, for f32/f64 blocks whose `amax` is below 2^-140,
//! where `0 / 0` would be NaN). The scale tensor holds `s_b`: `x ≈ q * s_b`.
//! A NaN or infinity among a block's values (after conversion to f32) is an
//! error naming the tensor and the block.
//!
//! # How a plan moves them
//! Where every block lies whole on the source ranks that hold it, the
//! sending source rank quantizes it and the plan moves codes and scales
//! ([`crate::route`]). Otherwise: a block's scale depends on all of its
//! elements, which may lie on several source ranks, and its elements may
//! go to several destination ranks. The plan then delivers **whole blocks** of unquantized
//! values (the source dtype; f32 for an f64 source) to every destination
//! rank that holds any element of the block or its scale, into a buffer of
//! the plan's ([`BufferKey::Unquantized`]): [`staged_holdings`]. After its
//! last receive, each such rank quantizes ([`Quantize`], [`quantize`]):
//! every block is quantized where it is needed, by the same function of the
//! same values, so replicas agree bit for bit. On the wire this costs the
//! source dtype's bytes (bf16: 2 per element, twice the FP8 payload) plus
//! the parts of blocks a rank needs beyond its own elements, where
//! destination shards cut through blocks.

use crate::block::Block;
use crate::dtype::{f16_bits_to_f64, DType};
use crate::layout::{BufferKey, BufferSpec, Holding, Layout, Loc, Rank};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use thiserror::Error;

/// The largest finite e4m3 value.
pub(crate) const E4M3_MAX: f32 = 448.0;

/// The e4m3 code of `x`, rounded to nearest even, saturating to ±448 (so
/// NaN never comes out of a finite input), the sign bit kept. e4m3 here is
/// `torch.float8_e4m3fn`: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa
/// bits, no infinities, `0x7f`/`0xff` NaN. A NaN input gives `0x7f` with
/// its sign (callers reject NaN first).
#[inline]
pub fn e4m3_from_f32(x: f32) -> u8 {
    // Branch-free (both roundings computed, one selected), so that a row
    // of elements compiles to vector code.
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7fff_ffff;
    // At or above 2^-6, the smallest normal e4m3: keep the exponent and 3
    // mantissa bits, rounding the 20 bits dropped half to even; a carry
    // out of the mantissa moves into the exponent, as it should. The
    // exponent is rebiased from 127 to 7 (120 << 3 in code units).
    let normal = ((abs + 0x7_ffff + ((abs >> 20) & 1)) >> 20).wrapping_sub(120 << 3);
    // Below it, codes count steps of 2^-9: scaling by 2^9 is exact, and
    // adding 2^23 rounds a value below 2^22 to an integer, half to even
    // (IEEE arithmetic, which Rust never reorders), left in the low
    // mantissa bits of the sum (2^23 is 0x4b00_0000).
    let sub = (f32::from_bits(abs) * 512.0 + 8_388_608.0).to_bits().wrapping_sub(0x4b00_0000);
    let code = if abs < 0x3c80_0000 { sub } else { normal.min(0x7e) };
    let code = if abs > 0x7f80_0000 { 0x7f } else { code };
    (sign | code) as u8
}

/// The value of an e4m3 code (NaN for `0x7f`/`0xff`).
#[cfg(test)]
pub(crate) fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, mant) = (((code >> 3) & 0xf) as i32, (code & 7) as f32);
    if exp == 15 && code & 7 == 7 {
        return f32::NAN.copysign(sign);
    }
    if exp == 0 {
        return sign * mant * 2f32.powi(-9);
    }
    sign * (1.0 + mant / 8.0) * 2f32.powi(exp - 7)
}

/// A block's scale from its largest magnitude: `amax / 448` in f32, `1.0`
/// for an all-zero block.
pub fn block_scale(amax: f32) -> f32 {
    if amax == 0.0 {
        1.0
    } else {
        amax / E4M3_MAX
    }
}

/// One element quantized with its block's scale: `e4m3(x / s)`, a zero
/// staying the signed zero.
#[inline]
pub fn quantize_value(x: f32, s: f32) -> u8 {
    if x == 0.0 {
        ((x.to_bits() >> 24) & 0x80) as u8
    } else {
        e4m3_from_f32(x / s)
    }
}

/// Element `i` of `bytes` (type `dtype`, a float the semantics accept;
/// NaN for any other) as f32, as the semantics convert it.
pub fn read_f32(dtype: DType, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]),
        DType::BF16 => f32::from_bits((u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]) as u32) << 16),
        DType::F16 => f16_bits_to_f64(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])) as f32,
        DType::F64 => {
            let b = &bytes[8 * i..8 * i + 8];
            f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32
        }
        _ => f32::NAN,
    }
}

/// Appends `bytes` (elements of `dtype`, a float the semantics accept) to
/// `out` as f32.
fn extend_f32(dtype: DType, bytes: &[u8], out: &mut Vec<f32>) {
    match dtype {
        DType::BF16 => out.extend(bytes.chunks_exact(2).map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))),
        DType::F32 => out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        _ => {
            let size = dtype.size() as usize;
            out.extend((0..bytes.len() / size).map(|i| read_f32(dtype, bytes, i)));
        }
    }
}

/// The dtype a plan delivers a block-scaled tensor in, from a source of
/// `src`: the source's own (f32 for f64, which the semantics convert to
/// f32 first anyway); `None` where the source is not a float the
/// semantics accept.
pub(crate) fn staged_dtype(src: DType) -> Option<DType> {
    match src {
        DType::F64 => Some(DType::F32),
        DType::F32 | DType::BF16 | DType::F16 => Some(src),
        _ => None,
    }
}

/// The block-grid box of the blocks that element box `b` touches.
pub fn grid_of(b: &Block, block: &[u64]) -> Block {
    let nd = b.ndim();
    let off: Vec<u64> = (0..nd).map(|d| b.offset()[d] / block[d]).collect();
    let ext: Vec<u64> = (0..nd).map(|d| b.end(d).div_ceil(block[d]) - off[d]).collect();
    Block::new(&off, &ext)
}

/// The element box of block-grid box `g` in a tensor of `shape`
/// (saturating: a grid box of a step from the wire may reach past `u64`
/// elements; its element box then ends at the tensor's end, and one past
/// that end is empty).
pub fn elements_of(g: &Block, block: &[u64], shape: &[u64]) -> Block {
    let nd = g.ndim();
    let off: Vec<u64> = (0..nd).map(|d| g.offset()[d].saturating_mul(block[d])).collect();
    let ext: Vec<u64> = (0..nd).map(|d| g.end(d).saturating_mul(block[d]).min(shape[d]).saturating_sub(off[d])).collect();
    Block::new(&off, &ext)
}

/// Block-grid boxes, made disjoint (each box keeps what no earlier box
/// covers), in order.
fn disjoint(boxes: Vec<Block>) -> Vec<Block> {
    let mut out: Vec<Block> = Vec::new();
    for b in boxes {
        let mut rest = vec![b];
        for o in &out {
            rest = rest.into_iter().flat_map(|r| r.subtract(o)).collect();
        }
        out.extend(rest.into_iter().filter(|r| !r.is_empty()));
    }
    out
}

/// Per rank, the disjoint block-grid boxes it needs of block-scaled tensor
/// `t`: the blocks touching its elements of `t`, and those of its scale
/// elements. Ranks in order.
fn grid_needs(layout: &Layout, t: u32) -> Vec<(Rank, Vec<Block>)> {
    let Some((s, block)) = layout.scale_of(t) else { return Vec::new() };
    let mut by_rank: HashMap<Rank, Vec<Block>> = HashMap::new();
    for h in layout.holdings(t) {
        let g = grid_of(&h.block, block);
        for l in &h.holders {
            by_rank.entry(l.rank).or_default().push(g);
        }
    }
    for h in layout.holdings(s) {
        for l in &h.holders {
            by_rank.entry(l.rank).or_default().push(h.block);
        }
    }
    let mut out: Vec<(Rank, Vec<Block>)> = by_rank.into_iter().map(|(r, boxes)| (r, disjoint(boxes))).collect();
    out.sort_unstable_by_key(|(r, _)| *r);
    out
}

/// The boxes of block-scaled tensor `t` that `rank` receives, each whole
/// blocks, stored back to back in its [`BufferKey::Unquantized`] buffer.
fn rank_staged_from(layout: &Layout, t: u32, grids: &[Block]) -> Vec<(Block, u64)> {
    let Some((_, block)) = layout.scale_of(t) else { return Vec::new() };
    let shape = &layout.tensors()[t as usize].shape;
    let mut at = 0u64;
    grids
        .iter()
        .map(|g| {
            let b = elements_of(g, block, shape);
            let here = at;
            at += b.numel();
            (b, here)
        })
        .collect()
}

/// Where a plan delivers block-scaled tensor `t` of a destination layout:
/// its distinct staged boxes and their holders (see the module doc), like
/// [`Layout::holdings`]. Empty for a tensor without a scale.
pub(crate) fn staged_holdings(layout: &Layout, t: u32) -> Vec<Holding> {
    let mut out: Vec<Holding> = Vec::new();
    let mut index: HashMap<Block, usize> = HashMap::new();
    for (rank, grids) in grid_needs(layout, t) {
        for (block, at) in rank_staged_from(layout, t, &grids) {
            let loc = Loc { rank, buffer: BufferKey::Unquantized { tensor: t }, at };
            match index.get(&block) {
                Some(&h) => out[h].holders.push(loc),
                None => {
                    index.insert(block, out.len());
                    out.push(Holding { block, holders: vec![loc] });
                }
            }
        }
    }
    out
}

/// Block-scaled tensor `t`'s staged boxes on `rank` (see
/// [`staged_holdings`]), like [`Layout::rank_holdings`].
pub(crate) fn rank_staged(layout: &Layout, t: u32, rank: Rank) -> Vec<(Block, Loc)> {
    let Some((s, block)) = layout.scale_of(t) else { return Vec::new() };
    let mut grids: Vec<Block> = layout.rank_holdings(t, rank).iter().map(|(b, _)| grid_of(b, block)).collect();
    grids.extend(layout.rank_holdings(s, rank).into_iter().map(|(b, _)| b));
    rank_staged_from(layout, t, &disjoint(grids))
        .into_iter()
        .map(|(b, at)| (b, Loc { rank, buffer: BufferKey::Unquantized { tensor: t }, at }))
        .collect()
}

/// The [`BufferKey::Unquantized`] buffer of block-scaled tensor `t` on
/// `rank`, in `dtype` (see [`staged_dtype`]); `None` where the rank needs
/// none of it.
pub(crate) fn staged_buffer(layout: &Layout, t: u32, rank: Rank, dtype: DType) -> Option<BufferSpec> {
    let elems: u64 = rank_staged(layout, t, rank).iter().map(|(b, _)| b.numel()).sum();
    (elems > 0).then(|| {
        let key = BufferKey::Unquantized { tensor: t };
        BufferSpec { key, name: layout.buffer_name(key), dtype, elems }
    })
}

/// A box of a tensor stored row-major from element `at` of buffer `buffer`
/// (an index into the rank program's buffers).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stored {
    /// The box.
    pub block: Block,
    /// Buffer index.
    pub buffer: u32,
    /// Element offset of its first element.
    pub at: u64,
}

/// What a destination rank does after its last receive for one
/// block-scaled tensor: quantize the whole blocks it received into its
/// elements of the tensor and of its scale tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quantize {
    /// The tensor (for errors).
    pub tensor: String,
    /// Its global shape.
    pub shape: Vec<u64>,
    /// Block extent per dimension.
    pub block: Vec<u64>,
    /// Type of the received values.
    pub staged_dtype: DType,
    /// The received boxes: disjoint, whole blocks each.
    pub staged: Vec<Stored>,
    /// The rank's boxes of the tensor (e4m3).
    pub weights: Vec<Stored>,
    /// The rank's boxes of the scale tensor (f32, block-grid coordinates).
    pub scales: Vec<Stored>,
}

/// Why quantizing failed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum QuantError {
    /// A block's source values hold NaN or infinity.
    #[error("tensor '{tensor}': block {block:?} (elements from {first:?}) holds NaN or infinity; block-scaled FP8 needs finite values")]
    NonFinite {
        /// The tensor.
        tensor: String,
        /// Block-grid index.
        block: Vec<u64>,
        /// Global index of the block's first element.
        first: Vec<u64>,
    },
    /// A region does not fit its buffer (a program that does not match its
    /// memory).
    #[error("tensor '{tensor}': a {what} region does not fit its buffer")]
    OutOfBounds {
        /// The tensor.
        tensor: String,
        /// Which region.
        what: &'static str,
    },
}

/// Row-major element offset of global index `idx` inside `stored` (which
/// contains it), stored from element `at`.
pub fn offset_in(stored: &Block, at: u64, idx: &[u64]) -> u64 {
    at + (0..stored.ndim()).fold(0u64, |acc, d| acc * stored.extent()[d] + (idx[d] - stored.offset()[d]))
}

/// Calls `f(global index of the run's first element, run length)` for every
/// innermost-dimension run of `b`, in row-major order.
pub fn for_each_row(b: &Block, mut f: impl FnMut(&[u64], u64)) {
    let nd = b.ndim();
    if b.is_empty() {
        return;
    }
    if nd == 0 {
        f(&[], 1);
        return;
    }
    let run = b.extent()[nd - 1];
    let mut idx: Vec<u64> = b.offset().to_vec();
    loop {
        f(&idx, run);
        let mut d = nd - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < b.end(d) {
                break;
            }
            idx[d] = b.offset()[d];
        }
    }
}

/// Runs `op`: `buffers[i]` is program buffer `i` for every staged buffer,
/// `weights[k]` and `scales[k]` the bytes of `op.weights[k]` and
/// `op.scales[k]` (exactly their elements, e4m3 and f32). Every element of
/// those regions is written, each block's scale computed once here.
pub fn quantize<'a>(
    op: &Quantize,
    staged: &dyn Fn(u32) -> Option<&'a [u8]>,
    weights: &mut [&mut [u8]],
    scales: &mut [&mut [u8]],
) -> Result<(), QuantError> {
    check_quantize(op, weights, scales)?;
    let size = op.staged_dtype.size() as usize;
    let oob = |what| QuantError::OutOfBounds { tensor: op.tensor.clone(), what };
    // A band: the whole blocks of a staged box that share their block
    // index in every dimension but the last, read in one sequential pass
    // (rows of the box), then quantized from there.
    let mut scratch = BandScratch::default();
    for st in &op.staged {
        let bytes = staged(st.buffer).ok_or_else(|| oob("staged"))?;
        let end = st
            .block
            .checked_numel()
            .and_then(|n| n.checked_add(st.at))
            .and_then(|n| n.checked_mul(size as u64))
            .ok_or_else(|| oob("staged"))?;
        if (bytes.len() as u64) < end {
            return Err(oob("staged"));
        }
        // An empty box holds no block: nothing to quantize from it.
        if st.block.is_empty() {
            continue;
        }
        let bands = Bands::new(op, st, bytes);
        let outer = Block::new(&bands.grid.offset()[..bands.last], &bands.grid.extent()[..bands.last]);
        let mut result = Ok(());
        for_each_cell(&outer, |o| {
            if result.is_ok() {
                result = bands.quantize(o, &mut scratch, weights, scales);
            }
        });
        result?;
    }
    Ok(())
}

/// Checks `op` as any input (a program that came over the wire): the
/// outputs match its regions, the geometry is the tensor's, every staged
/// box is whole blocks.
fn check_quantize(op: &Quantize, weights: &[&mut [u8]], scales: &[&mut [u8]]) -> Result<(), QuantError> {
    let oob = |what| QuantError::OutOfBounds { tensor: op.tensor.clone(), what };
    if weights.len() != op.weights.len() || scales.len() != op.scales.len() {
        return Err(oob("output"));
    }
    // Element counts checked: extents from the wire may multiply past
    // `u64`, which must not pass for a small box.
    for (w, r) in op.weights.iter().zip(weights.iter()) {
        if w.block.checked_numel() != Some(r.len() as u64) {
            return Err(oob("weight"));
        }
    }
    for (s, r) in op.scales.iter().zip(scales.iter()) {
        if s.block.checked_numel().and_then(|n| n.checked_mul(4)) != Some(r.len() as u64) {
            return Err(oob("scale"));
        }
    }
    let nd = op.shape.len();
    let grid_shape: Vec<u64> = match op.block.iter().all(|&b| b > 0) && op.block.len() == nd {
        true => op.shape.iter().zip(&op.block).map(|(&n, &b)| n.div_ceil(b)).collect(),
        false => return Err(oob("block")),
    };
    let inside = |b: &Block, shape: &[u64]| b.ndim() == nd && (0..nd).all(|d| b.end(d) <= shape[d]);
    if !op
        .staged
        .iter()
        .all(|st| inside(&st.block, &op.shape) && elements_of(&grid_of(&st.block, &op.block), &op.block, &op.shape) == st.block)
    {
        return Err(oob("staged"));
    }
    if !op.weights.iter().all(|w| inside(&w.block, &op.shape)) {
        return Err(oob("weight"));
    }
    if !op.scales.iter().all(|sc| inside(&sc.block, &grid_shape)) {
        return Err(oob("scale"));
    }
    Ok(())
}

/// What [`quantize`] reuses from band to band: the band's values, each
/// block's largest magnitude (as bits) and each block's scale.
#[derive(Default)]
struct BandScratch {
    values: Vec<f32>,
    tops: Vec<u32>,
    block_scales: Vec<f32>,
}

/// One staged box of a [`Quantize`] step, quantized band by band.
struct Bands<'a> {
    op: &'a Quantize,
    st: &'a Stored,
    /// The staged buffer's bytes.
    bytes: &'a [u8],
    /// The box's blocks, its number of dimensions and its last one.
    grid: Block,
    nd: usize,
    last: usize,
    /// The first block and the blocks of a band along the last dimension,
    /// and a block's width there.
    g0: u64,
    gn: u64,
    width: usize,
}

impl<'a> Bands<'a> {
    fn new(op: &'a Quantize, st: &'a Stored, bytes: &'a [u8]) -> Bands<'a> {
        let grid = grid_of(&st.block, &op.block);
        let nd = grid.ndim();
        // A scalar is one block of one element: its last dimension is a
        // dimension of extent 1.
        let last = nd.saturating_sub(1);
        let (g0, gn) = if nd == 0 { (0, 1) } else { (grid.offset()[last], grid.extent()[last]) };
        let width = if nd == 0 { 1 } else { op.block[last] as usize };
        Bands { op, st, bytes, grid, nd, last, g0, gn, width }
    }

    /// Quantizes the band of blocks at `o` in every dimension but the last
    /// into the parts of `weights` and `scales` it covers.
    fn quantize(
        &self,
        o: &[u64],
        scratch: &mut BandScratch,
        weights: &mut [&mut [u8]],
        scales: &mut [&mut [u8]],
    ) -> Result<(), QuantError> {
        let (op, nd, last) = (self.op, self.nd, self.last);
        let band_grid = if nd == 0 {
            self.grid
        } else {
            let (mut first, mut ext) = (o.to_vec(), vec![1; last]);
            first.push(self.g0);
            ext.push(self.gn);
            Block::new(&first, &ext)
        };
        let band = elements_of(&band_grid, &op.block, &op.shape);
        self.read(&band, &mut scratch.values);
        self.block_scales(o, &band, scratch)?;
        for (w, out) in op.weights.iter().zip(weights.iter_mut()) {
            let Some(part) = w.block.intersect(&band) else { continue };
            self.write_codes(&band, w, &part, scratch, out);
        }
        for (sc, out) in op.scales.iter().zip(scales.iter_mut()) {
            let Some(part) = sc.block.intersect(&band_grid) else { continue };
            for_each_cell(&part, |cell| {
                let j = if nd == 0 { 0 } else { (cell[last] - self.g0) as usize };
                let i = offset_in(&sc.block, 0, cell) as usize * 4;
                out[i..i + 4].copy_from_slice(&scratch.block_scales[j].to_le_bytes());
            });
        }
        Ok(())
    }

    /// The values of `band` (rows of the staged box, in one pass), as f32.
    fn read(&self, band: &Block, values: &mut Vec<f32>) {
        let size = self.op.staged_dtype.size() as usize;
        values.clear();
        for_each_row(band, |idx, run| {
            let first = offset_in(&self.st.block, self.st.at, idx) as usize * size;
            extend_f32(self.op.staged_dtype, &self.bytes[first..first + run as usize * size], values);
        });
    }

    /// Each block's scale of the band at `o` (`band`, its values read),
    /// into `scratch.block_scales`; an error naming the first block with a
    /// value that is not finite.
    fn block_scales(&self, o: &[u64], band: &Block, scratch: &mut BandScratch) -> Result<(), QuantError> {
        let (op, nd) = (self.op, self.nd);
        let row = if nd == 0 { 1 } else { band.extent()[self.last] as usize };
        // Each block's largest magnitude, as bits: a positive float's
        // bits order like its value, and NaN and infinity lie above
        // every finite one.
        let (tops, values) = (&mut scratch.tops, &scratch.values);
        tops.clear();
        tops.resize(self.gn as usize, 0);
        for r in values.chunks_exact(row) {
            for (top, chunk) in tops.iter_mut().zip(r.chunks(self.width)) {
                *top = chunk.iter().fold(*top, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
            }
        }
        scratch.block_scales.clear();
        for (j, &top) in tops.iter().enumerate() {
            if top >= 0x7f80_0000 {
                let mut cell = o.to_vec();
                cell.extend((nd > 0).then_some(self.g0 + j as u64));
                let first = elements_of(&Block::new(&cell, &vec![1; cell.len()]), &op.block, &op.shape).offset().to_vec();
                return Err(QuantError::NonFinite { tensor: op.tensor.clone(), block: cell, first });
            }
            scratch.block_scales.push(block_scale(f32::from_bits(top)));
        }
        Ok(())
    }

    /// Writes the codes of `part`, the part of weight region `w` in `band`,
    /// into `out` (the region's bytes).
    fn write_codes(&self, band: &Block, w: &Stored, part: &Block, scratch: &BandScratch, out: &mut [u8]) {
        let (nd, last, width) = (self.nd, self.last, self.width);
        let (values, block_scales) = (&scratch.values, &scratch.block_scales);
        for_each_row(part, |idx, run| {
            // Where the run starts in the band's values, in the
            // output, and in the band's last dimension.
            let (from, to) = (offset_in(band, 0, idx) as usize, offset_in(&w.block, 0, idx) as usize);
            let col = if nd == 0 { 0 } else { (idx[last] - band.offset()[last]) as usize };
            let mut k = 0usize;
            while k < run as usize {
                // Up to the end of this element's block.
                let j = (col + k) / width;
                let stop = (run as usize).min((j + 1) * width - col);
                let s = block_scales[j];
                let (q, x) = (&mut out[to + k..to + stop], &values[from + k..from + stop]);
                if s > 0.0 {
                    // `x / s` of a zero is the signed zero already.
                    for (q, &x) in q.iter_mut().zip(x) {
                        *q = e4m3_from_f32(x / s);
                    }
                } else {
                    for (q, &x) in q.iter_mut().zip(x) {
                        *q = quantize_value(x, s);
                    }
                }
                k = stop;
            }
        });
    }
}

/// Calls `f(index)` for every index of box `b`, row-major.
pub fn for_each_cell(b: &Block, mut f: impl FnMut(&[u64])) {
    for_each_row(b, |idx, run| {
        let mut i = idx.to_vec();
        let last = i.len().saturating_sub(1);
        for k in 0..run {
            if let Some(x) = i.get_mut(last) {
                *x = idx[last] + k;
            }
            f(&i);
        }
    });
}

/// The [`Quantize`] op of destination rank `rank` for block-scaled tensor
/// `t`: `buffer(key)` gives the index of a buffer in the rank's program.
/// `None` where the rank holds nothing of `t` or its scale.
pub(crate) fn quantize_op(
    layout: &Layout,
    t: u32,
    rank: Rank,
    staged_dtype: DType,
    buffer: &dyn Fn(BufferKey) -> Option<u32>,
) -> Option<Quantize> {
    let (s, block) = layout.scale_of(t)?;
    let stored = |list: Vec<(Block, Loc)>| -> Option<Vec<Stored>> {
        list.into_iter().map(|(b, l)| Some(Stored { block: b, buffer: buffer(l.buffer)?, at: l.at })).collect()
    };
    let staged = stored(rank_staged(layout, t, rank))?;
    if staged.is_empty() {
        return None;
    }
    let tensor = &layout.tensors()[t as usize];
    Some(Quantize {
        tensor: tensor.name.clone(),
        shape: tensor.shape.clone(),
        block: block.to_vec(),
        staged_dtype,
        staged,
        weights: stored(layout.rank_holdings(t, rank))?,
        scales: stored(layout.rank_holdings(s, rank))?,
    })
}

#[cfg(test)]
mod tests;
