//! The blocks form: a message's changed units, block by block (4096 units
//! each, the last shorter), positions in a bit stream, values after it.
//!
//! Payload: the stream's length (u64), the changed units (u64), the
//! stream, then the changed units' bytes in order. The stream, per block:
//! its count of changed units (13 bits); if any, a kind bit, then
//! - 1, a bitmap: zero bits to a whole byte, then one bit per unit of the
//!   block (least significant first);
//! - 0, gaps: the Rice parameter `k` (4 bits), then before each changed
//!   unit the units unchanged since the last (or since the block's start),
//!   Rice-coded (`rice.rs`);
//!
//! then zero bits to a whole byte. Nothing changed at all: an empty
//! stream. The encoder writes a block as a bitmap where that costs at most
//! [`SLACK_PERCENT`] percent of the information in it (its values and the
//! entropy of their positions) — a bitmap and its values are coded and
//! decoded at memory speed, the gaps at some nanoseconds per change — and
//! as gaps elsewhere (within a few percent of that information; gaps of
//! clustered changes less, and never more than a bit per unit of the
//! block: with `k` 0 a gap of `g` takes `g + 1` bits, and the gaps of a
//! block sum to less than its units; a larger `k` is chosen only for
//! sparser blocks, whose gaps take fewer bits still).

use super::compare::{Changes, BLOCK};
use super::pack;
use super::rice::{self, BitReader, BitWriter};
use super::DeltaError;

/// Units of a block.
const BLOCK_UNITS: usize = 64 * BLOCK;
/// Bits of a block's count (0 to [`BLOCK_UNITS`]).
const COUNT_BITS: u32 = 13;
/// Bits of a gaps block's Rice parameter.
const K_BITS: u32 = 4;
/// Bytes of the payload before the stream: its length, the changed units.
const HEAD: usize = 16;
/// A block is a bitmap where that costs at most this percent of the
/// information in it (its changed values and the entropy of their
/// positions).
pub(super) const SLACK_PERCENT: u64 = 125;

/// Writes the blocks form's payload into `out` (the dense form's size):
/// its length, or `None` where it does not fit (a message that changed
/// nearly all over: the dense form then).
pub(super) fn write<const U: usize>(changes: &Changes<'_>, out: &mut [u8]) -> Option<usize> {
    let units = changes.new.len() / U;
    let blocks = units.div_ceil(BLOCK_UNITS);
    let (head, rest) = out.split_at_mut_checked(HEAD)?;
    // Room for every unit's bit and the blocks' fields: a gaps block
    // takes less than its bitmap (see the choice below).
    let stream_most = (units.div_ceil(8) + blocks * 4 + 8).min(rest.len());
    let (stream_area, values) = rest.split_at_mut(stream_most);
    let mut w = BitWriter::new(stream_area);
    let (mut at, mut changed, mut masks) = (0usize, 0u64, [0u64; BLOCK]);
    let mut positions = [0u16; BLOCK_UNITS + 8];
    for b in 0..blocks {
        let filled = changes.compare_block(b * BLOCK, &mut masks);
        let masks = &masks[..filled];
        let block_units = (units - b * BLOCK_UNITS).min(BLOCK_UNITS);
        let count: u32 = masks.iter().map(|m| m.count_ones()).sum();
        w.put(u64::from(count), COUNT_BITS);
        if count == 0 {
            continue;
        }
        if at + count as usize * U > values.len() || w.overflowed() {
            return None;
        }
        changed += u64::from(count);
        let lo = b * BLOCK_UNITS * U;
        let block = &changes.new[lo..(lo + BLOCK_UNITS * U).min(changes.new.len())];
        let value_bits = u64::from(count) * 8 * U as u64;
        if (block_units as u64 + 8 + value_bits) * 100 <= (information(count, block_units) + value_bits) * SLACK_PERCENT {
            write_bitmap(&mut w, masks, block_units);
            for (g, &mask) in masks.iter().enumerate() {
                at = pack::gather::<U>(mask, &block[g * 64 * U..((g + 1) * 64 * U).min(block.len())], values, at);
            }
            continue;
        }
        // Sparse: the positions listed first (a loop whose length rarely
        // varies), then coded and their values copied (loops of `count`).
        let listed = list_positions(masks, &mut positions);
        debug_assert_eq!(listed, count as usize);
        let k = rice::k_for(count, block_units as u32);
        w.put(0, 1);
        w.put(u64::from(k), K_BITS);
        let mut next = 0usize;
        for &i in &positions[..listed] {
            let i = usize::from(i);
            w.gap((i - next) as u64, k);
            next = i + 1;
        }
        for (&i, to) in positions[..listed].iter().zip(values[at..at + listed * U].chunks_exact_mut(U)) {
            let i = usize::from(i);
            to.copy_from_slice(&block[i * U..i * U + U]);
        }
        at += listed * U;
    }
    let stream = w.finish()?;
    if changed == 0 {
        // Nothing changed: an empty stream says so.
        head.fill(0);
        return Some(HEAD);
    }
    head[..8].copy_from_slice(&(stream as u64).to_le_bytes());
    head[8..].copy_from_slice(&changed.to_le_bytes());
    rest.copy_within(stream_most..stream_most + at, stream);
    Some(HEAD + stream + at)
}

/// The entropy of `count` positions among `units` (bits, rounded up), as
/// independent draws: what the gaps come within a few percent of.
fn information(count: u32, units: usize) -> u64 {
    let p = f64::from(count) / units as f64;
    let h = if p <= 0.0 || p >= 1.0 { 0.0 } else { -(p * p.log2() + (1.0 - p) * (1.0 - p).log2()) };
    (h * units as f64).ceil() as u64
}

/// Lists the units `masks` mark (positions in their block, ascending)
/// into `positions`: how many. Eight at a time whatever the mask holds
/// (the extra entries are written over), so the loop runs once for a
/// group of up to eight changes.
fn list_positions(masks: &[u64], positions: &mut [u16; BLOCK_UNITS + 8]) -> usize {
    let mut n = 0usize;
    for (g, &mask) in masks.iter().enumerate() {
        let (mut m, base) = (mask, (g * 64) as u16);
        let count = m.count_ones() as usize;
        let mut j = n;
        while m != 0 {
            for _ in 0..8 {
                // A zero mask gives 64: overwritten, or past `count`.
                positions[j] = base.wrapping_add(m.trailing_zeros() as u16);
                m &= m.wrapping_sub(1);
                j += 1;
            }
        }
        n += count;
    }
    n
}

/// A bitmap block: its kind bit, zeros to a whole byte, its masks' bytes.
fn write_bitmap(w: &mut BitWriter<'_>, masks: &[u64], block_units: usize) {
    w.put(1, 1);
    w.align();
    let mut left = block_units.div_ceil(8);
    for &mask in masks {
        let n = left.min(8);
        w.bytes(&mask.to_le_bytes()[..n]);
        left -= n;
    }
}

/// Patches `out` (the base, units of `U` bytes) with the blocks form's
/// `body`: its claims (changed units, stream length, each block's count)
/// checked against the bytes received before any is used, every position
/// inside its block.
pub(super) fn patch<const U: usize>(out: &mut [u8], body: &[u8]) -> Result<(), DeltaError> {
    let bad = |why: &str| DeltaError::Malformed(format!("blocks: {why}"));
    let (head, rest) = body.split_at_checked(HEAD).ok_or_else(|| bad("cut short"))?;
    let (stream, changed) = (super::u64_at(head, 0), super::u64_at(head, 8));
    let value_bytes = changed.checked_mul(U as u64).ok_or_else(|| bad("more changed units than bytes"))?;
    if stream.checked_add(value_bytes) != Some(rest.len() as u64) {
        return Err(bad("the stream and the values do not add up to the bytes sent"));
    }
    let (stream, values) = rest.split_at(stream as usize);
    if changed == 0 {
        return if stream.is_empty() { Ok(()) } else { Err(bad("a stream for no changed unit")) };
    }
    let units = out.len() / U;
    let mut r = BitReader::new(stream);
    let cut = || bad("the stream ends early");
    let mut at = 0usize;
    for b in 0..units.div_ceil(BLOCK_UNITS) {
        let block_units = (units - b * BLOCK_UNITS).min(BLOCK_UNITS);
        let count = r.get(COUNT_BITS).ok_or_else(cut)? as usize;
        if count > block_units {
            return Err(bad(&format!("block {b}: {count} changed units of {block_units}")));
        }
        if count == 0 {
            continue;
        }
        if at + count * U > values.len() {
            return Err(bad("more changed units than values sent"));
        }
        let block =
            Landing { block: &mut out[b * BLOCK_UNITS * U..(b * BLOCK_UNITS + block_units) * U], units: block_units, count, values, at };
        let landed = if r.get(1).ok_or_else(cut)? == 1 { block.bitmap::<U>(&mut r) } else { block.gaps::<U>(&mut r) };
        at = landed.map_err(|why| bad(&format!("block {b}: {why}")))?;
    }
    if r.align().is_none() || !r.at_end() {
        return Err(bad("bits left in the stream"));
    }
    if at != values.len() {
        return Err(bad("values left over"));
    }
    Ok(())
}

/// Where one block's changed units land: the block of the base, its
/// units, its count of changed units, and the values from `at` (at least
/// `count` of them: checked by the caller).
struct Landing<'a> {
    block: &'a mut [u8],
    units: usize,
    count: usize,
    values: &'a [u8],
    at: usize,
}

impl Landing<'_> {
    /// A bitmap block's values into the block: the new `at`.
    fn bitmap<const U: usize>(self, r: &mut BitReader<'_>) -> Result<usize, &'static str> {
        let Landing { block, units, count, values, mut at } = self;
        r.align().ok_or("a bitmap's padding is not zeros")?;
        let bits = r.bytes(units.div_ceil(8)).ok_or("the stream ends early")?;
        if bits.iter().map(|b| b.count_ones() as usize).sum::<usize>() != count {
            return Err("a bitmap marks another count of units");
        }
        if !units.is_multiple_of(8) && bits.last().is_some_and(|&b| b >> (units % 8) != 0) {
            return Err("a bitmap marks units past the block");
        }
        for (g, chunk) in bits.chunks(8).enumerate() {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            let group = &mut block[g * 64 * U..((g + 1) * 64 * U).min(units * U)];
            at = pack::scatter::<U>(u64::from_le_bytes(word), values, at, group);
        }
        Ok(at)
    }

    /// A gaps block's values into the block: the new `at`.
    fn gaps<const U: usize>(self, r: &mut BitReader<'_>) -> Result<usize, &'static str> {
        let Landing { block, units, count, values, mut at } = self;
        let k = r.get(K_BITS).ok_or("the stream ends early")? as u32;
        if k > rice::MAX_K {
            return Err("a Rice parameter above 12");
        }
        let mut next = 0usize;
        for _ in 0..count {
            let most = units.checked_sub(next + 1).ok_or("a position past the block")?;
            let gap = r.gap(k, most as u64).ok_or("the stream ends early or points past the block")?;
            // `next + gap` < units.
            let i = next + gap as usize;
            block[i * U..i * U + U].copy_from_slice(&values[at..at + U]);
            at += U;
            next = i + 1;
        }
        Ok(at)
    }
}
