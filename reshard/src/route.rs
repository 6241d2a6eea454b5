//! Where a block-scaled FP8 destination tensor is quantized, and so which
//! values a plan moves for it: a [`Route`] per destination tensor.
//!
//! A block's scale depends on all of its elements ([`crate::quantize`]).
//! Where every block of a tensor lies whole inside one holding of its
//! source tensor (the common case: Megatron and FSDP-by-row shards cut at
//! multiples of 128 rows, experts held whole), the source rank that sends a
//! block can quantize it itself and send one byte per element plus the
//! block's f32 scale: [`Route::QuantizedAtSource`] for the tensor and
//! [`Route::ScalesFromSource`] for its scale tensor. A sending source rank
//! quantizes each of its boxes of the tensor that it sends any piece of
//! (whole blocks; a replica quantizes only what it sends), before its
//! first send, into two buffers of the plan's ([`BufferKey::Quantized`] for the codes,
//! stored like its holdings, back to back; [`BufferKey::Scales`] for the
//! scales of those blocks, in block-grid coordinates), and sends from
//! there; destinations receive codes and scales into the tensors' own
//! buffers and quantize nothing. The values are those of the semantics bit
//! for bit: every block is quantized by the same function of the same
//! source values wherever it is quantized.
//!
//! Otherwise (a block cut over source ranks, e.g. flat FSDP shards; the
//! gather-broadcast baseline; or [`QuantizeAt::Destination`]) the plan
//! delivers whole blocks of unquantized values and each destination rank
//! quantizes ([`Route::QuantizedAtDestination`], the module doc of
//! [`crate::quantize`]).

use crate::block::Block;
use crate::dtype::DType;
use crate::layout::{BufferKey, BufferSpec, Holding, Layout, Loc, Rank};
use crate::quant::{self, grid_of, Quantize, Stored};
use std::collections::{BTreeSet, HashMap};

/// Where block-scaled FP8 destination tensors are quantized
/// ([`PlanOptions::quantize_at`](crate::PlanOptions::quantize_at)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum QuantizeAt {
    /// By the source rank that sends a block, for every tensor whose
    /// blocks each lie whole in one holding of the source tensor; the
    /// others at the destination. Half the bytes on the wire from a bf16
    /// source.
    #[default]
    Source,
    /// Always by the destination ranks, from whole blocks of unquantized
    /// values (the source dtype's bytes on the wire).
    Destination,
}

/// How a destination tensor's values travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Route {
    /// As they are, converted to the destination dtype on the way.
    Plain,
    /// A block-scaled tensor: whole blocks of unquantized values, each
    /// destination rank quantizing the blocks it needs.
    QuantizedAtDestination,
    /// A block-scaled tensor: e4m3 codes quantized by the sending source
    /// rank, from its [`BufferKey::Quantized`] buffer.
    QuantizedAtSource,
    /// The scale tensor of a [`Route::QuantizedAtSource`] tensor: the f32
    /// scales computed with its codes, from [`BufferKey::Scales`].
    ScalesFromSource,
}

/// The block shape of destination tensor `td` if it is block-scaled or the
/// scale of one.
pub(crate) fn scale_block(dst: &Layout, td: u32) -> Option<&[u64]> {
    match dst.scale_of(td) {
        Some((_, block)) => Some(block),
        None => dst.scale_for(td).and_then(|w| dst.scale_of(w)).map(|(_, block)| block),
    }
}

/// Whether every block (of extent `block`, tiling the tensor from index 0)
/// of source tensor `ts` lies whole inside each holding that touches it,
/// and no rank holds two overlapping boxes of it: then any rank holding an
/// element holds its whole block, and can quantize it.
pub(crate) fn source_quantizable(src: &Layout, ts: u32, block: &[u64]) -> bool {
    let shape = &src.tensors()[ts as usize].shape;
    if block.len() != shape.len() || block.contains(&0) {
        return false;
    }
    let aligned = |b: &Block| {
        (0..b.ndim()).all(|d| b.offset()[d].is_multiple_of(block[d]) && (b.end(d).is_multiple_of(block[d]) || b.end(d) == shape[d]))
    };
    let mut by_rank: HashMap<Rank, Vec<Block>> = HashMap::new();
    for h in src.holdings(ts) {
        if !aligned(&h.block) {
            return false;
        }
        for l in &h.holders {
            let boxes = by_rank.entry(l.rank).or_default();
            if !boxes.contains(&h.block) {
                boxes.push(h.block);
            }
        }
    }
    by_rank.values().all(|boxes| boxes.iter().enumerate().all(|(i, a)| boxes[i + 1..].iter().all(|b| a.intersect(b).is_none())))
}

/// Rank `rank`'s distinct boxes of source tensor `ts`, in holding order,
/// and where each is stored.
fn distinct(src: &Layout, ts: u32, rank: Rank) -> Vec<(Block, Loc)> {
    let mut out: Vec<(Block, Loc)> = Vec::new();
    for (b, l) in src.rank_holdings(ts, rank) {
        if !out.iter().any(|(o, _)| *o == b) {
            out.push((b, l));
        }
    }
    out
}

/// Where source rank `rank` offers source tensor `ts` for a destination
/// tensor of route `route` (blocks of extent `block` for the two source
/// routes): its holdings; for [`Route::QuantizedAtSource`] its distinct
/// boxes in its [`BufferKey::Quantized`] buffer, back to back; for
/// [`Route::ScalesFromSource`] their block-grid boxes in its
/// [`BufferKey::Scales`] buffer, back to back (the same boxes in the same
/// order: entry `i` of both is the rank's distinct box `i`).
pub(crate) fn rank_offered(src: &Layout, ts: u32, rank: Rank, route: Route, block: Option<&[u64]>) -> Vec<(Block, Loc)> {
    let (buffer, scales, block) = match (route, block) {
        (Route::QuantizedAtSource, Some(b)) => (BufferKey::Quantized { tensor: ts }, false, b),
        (Route::ScalesFromSource, Some(b)) => (BufferKey::Scales { tensor: ts }, true, b),
        _ => return src.rank_holdings(ts, rank),
    };
    let mut at = 0u64;
    distinct(src, ts, rank)
        .into_iter()
        .map(|(b, _)| {
            let b = if scales { grid_of(&b, block) } else { b };
            let here = at;
            at += b.numel();
            (b, Loc { rank, buffer, at: here })
        })
        .collect()
}

/// The boxes of source tensor `ts` each source rank can send for a
/// destination tensor of route `route`, grouped by distinct box like
/// [`Layout::holdings`]: its holdings, or for [`Route::ScalesFromSource`]
/// their block-grid boxes (aligned holdings have distinct ones). The
/// planner looks only at boxes and ranks, so the holders keep the
/// source's own places; where a rank sends from is [`rank_offered`]'s.
pub(crate) fn offered_holdings(src: &Layout, ts: u32, route: Route, block: Option<&[u64]>) -> Vec<Holding> {
    let mut out = src.holdings(ts);
    if let (Route::ScalesFromSource, Some(b)) = (route, block) {
        for h in &mut out {
            h.block = grid_of(&h.block, b);
        }
    }
    out
}

/// The route of destination tensor `td` where nothing is quantized at the
/// source: block-scaled tensors at the destination, the rest plain (scale
/// tensors are then not moved at all).
pub(crate) fn at_destination(dst: &Layout, td: u32) -> Route {
    match dst.scale_of(td) {
        Some(_) => Route::QuantizedAtDestination,
        None => Route::Plain,
    }
}

/// Where a plan delivers destination tensor `td` of route `route`: its
/// holdings, or for a tensor quantized at the destination its staged
/// unquantized blocks ([`quant::staged_holdings`]).
pub(crate) fn delivered_holdings(dst: &Layout, td: u32, route: Route) -> Vec<Holding> {
    match route {
        Route::QuantizedAtDestination => quant::staged_holdings(dst, td),
        _ => dst.holdings(td),
    }
}

/// [`delivered_holdings`] of one rank.
pub(crate) fn rank_delivered(dst: &Layout, td: u32, rank: Rank, route: Route) -> Vec<(Block, Loc)> {
    match route {
        Route::QuantizedAtDestination => quant::rank_staged(dst, td, rank),
        _ => dst.rank_holdings(td, rank),
    }
}

/// The two buffers source rank `rank` quantizes tensor `ts` into (codes,
/// then scales); `None` where it holds none of it.
pub(crate) fn source_buffers(src: &Layout, ts: u32, rank: Rank, block: &[u64]) -> Option<[BufferSpec; 2]> {
    let boxes = distinct(src, ts, rank);
    if boxes.is_empty() {
        return None;
    }
    let codes: u64 = boxes.iter().map(|(b, _)| b.numel()).sum();
    let scales: u64 = boxes.iter().map(|(b, _)| grid_of(b, block).numel()).sum();
    let spec = |key, dtype, elems| BufferSpec { key, name: src.buffer_name(key), dtype, elems };
    Some([spec(BufferKey::Quantized { tensor: ts }, DType::F8E4M3, codes), spec(BufferKey::Scales { tensor: ts }, DType::F32, scales)])
}

/// Source rank `rank`'s [`Quantize`] op for source tensor `ts` (blocks of
/// extent `block`): those of its distinct boxes numbered in `sent` (the
/// ones it sends codes or scales from; see [`rank_offered`]), read where
/// the layout stores them, quantized into its [`BufferKey::Quantized`] and
/// [`BufferKey::Scales`] buffers; `buffer(key)` gives a buffer's index in
/// the rank's program. `None` where that is no box or a buffer is missing.
pub(crate) fn source_quantize_op(
    src: &Layout,
    ts: u32,
    rank: Rank,
    block: &[u64],
    sent: &BTreeSet<u32>,
    buffer: &dyn Fn(BufferKey) -> Option<u32>,
) -> Option<Quantize> {
    let tensor = &src.tensors()[ts as usize];
    let stored = |list: Vec<(Block, Loc)>| -> Option<Vec<Stored>> {
        let kept = list.into_iter().enumerate().filter(|(i, _)| sent.contains(&(*i as u32)));
        kept.map(|(_, (b, l))| Some(Stored { block: b, buffer: buffer(l.buffer)?, at: l.at })).collect()
    };
    let staged = stored(distinct(src, ts, rank))?;
    if staged.is_empty() {
        return None;
    }
    Some(Quantize {
        tensor: tensor.name.clone(),
        shape: tensor.shape.clone(),
        block: block.to_vec(),
        staged_dtype: tensor.dtype,
        staged,
        weights: stored(rank_offered(src, ts, rank, Route::QuantizedAtSource, Some(block)))?,
        scales: stored(rank_offered(src, ts, rank, Route::ScalesFromSource, Some(block)))?,
    })
}
