//! Delta messages: a message's bytes sent as what changed since the same
//! message of an earlier refit, which sender and receiver both kept.
//!
//! Sans-I/O: [`encode`] compares a message's packed bytes with the base
//! (the bytes of the same message in the base refit) in units of `unit`
//! bytes (the smallest element size among its pieces, so a unit never
//! straddles two elements) and writes the shortest of three forms; [`decode`]
//! rebuilds the whole message from the base and the encoding, so the
//! receiver unpacks a dense message as always and every destination element
//! is written, changed or not. Both ends check what they hold: the encoding
//! names the base by its CRC-32C and the result by its own, so a receiver
//! holding another base, or a corrupted encoding, is an error, never wrong
//! weights.
//!
//! Encoding: a 26-byte header — `form` (u8: 0 dense, 1 bitmap, 2 indices,
//! 3 gaps), `unit` (u8), `units` (u64: message length / unit), base CRC
//! (u32), result CRC (u32), payload length (u64) — then
//! - dense: the message's bytes;
//! - bitmap: one bit per unit (LSB first), then the changed units' bytes in
//!   order;
//! - indices: the changed units' indices (u32 LE, ascending), then their
//!   bytes in order;
//! - gaps: the starting Rice parameter `k` (u8), the number of changed units (u64),
//!   the length of the gap stream (u64), the gap stream (`rice.rs`: before
//!   each changed unit, how many unchanged units precede it since the last
//!   changed one), then the changed units' bytes in order.
//!
//! The encoder writes whichever is shortest. For positions spread like
//! independent draws, the gaps cost within a few percent of the entropy of
//! the positions: a message in which a fraction `p` of its `n` units
//! changed takes about `n·H(p)` bits of positions plus the changed values,
//! where a bitmap takes `n` bits and an index list 32 bits per change.
//!
//! All integers little-endian.
//!
//! A delta run keeps each message it moved with its CRC-32C
//! ([`KeptMessage`]) and codes the next refit's on it ([`encode_kept`],
//! [`decode_kept`]), so neither end reads a base again to name it. The
//! encoder finds the changed units 64 at a time (vector compares into
//! masks, a block of masks at a time, the message's CRC taken block by
//! block as they are compared) and codes them in the same pass.

mod rice;

/// Bytes of the header.
pub const HEADER: usize = 26;

/// What one rank sent and received in a refit, message by message (the
/// packed bytes, keyed by round and peer): the base of the next delta
/// refit of the same plan. Costs as much memory as the rank sends plus
/// what it receives in a refit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeltaMemo {
    pub(crate) sent: std::collections::HashMap<(u32, reshard::Endpoint), KeptMessage>,
    pub(crate) received: std::collections::HashMap<(u32, reshard::Endpoint), KeptMessage>,
}

impl DeltaMemo {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.sent.values().chain(self.received.values()).map(|k| k.bytes.len() as u64).sum()
    }
}

/// A message's packed bytes as a refit moved them, with their CRC-32C
/// (computed by the encoder or checked by the decoder as they were made,
/// so the next delta refit does not read them again to name its base).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeptMessage {
    /// The bytes.
    pub(crate) bytes: Vec<u8>,
    /// Their CRC-32C.
    pub(crate) crc: u32,
}

impl KeptMessage {
    /// `bytes` kept, their CRC-32C computed.
    pub fn new(bytes: Vec<u8>) -> KeptMessage {
        KeptMessage { crc: crc32c::crc32c(&bytes), bytes }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// A delta refit on one rank ([`crate::delta`]): every message goes as
/// what changed since the same message of the base refit (`base`, this
/// rank's memo of it; `None`: dense this time), and the run leaves its own
/// memo for the next one. Every destination element is still written.
pub struct DeltaRun {
    /// The memo of the base refit, if this rank has it (used up as the
    /// run goes: each message's base is patched into this run's memo).
    pub base: Option<DeltaMemo>,
    /// This run's memo (filled as messages go and come).
    pub next: DeltaMemo,
    /// Bytes this rank put on the wire (encodings, headers included).
    pub wire_bytes: u64,
}

impl DeltaRun {
    /// A delta run on `base`.
    pub fn new(base: Option<DeltaMemo>) -> DeltaRun {
        DeltaRun { base, next: DeltaMemo::default(), wire_bytes: 0 }
    }
}

/// The unit a delta message of pieces of these wire types is encoded in:
/// the smallest element size among them, so a unit never straddles two
/// elements.
pub(crate) fn unit_of(wires: impl Iterator<Item = reshard::DType>) -> usize {
    wires.map(|w| w.size() as usize).min().unwrap_or(1)
}

const DENSE: u8 = 0;
const BITMAP: u8 = 1;
const INDICES: u8 = 2;
const GAPS: u8 = 3;
/// Bytes of the gaps form's own header: `k`, the changed units, the gap
/// stream's length.
const GAPS_HEADER: usize = 1 + 8 + 8;

/// Why an encoding could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeltaError {
    /// The bytes are not an encoding this module writes.
    #[error("malformed delta message: {0}")]
    Malformed(String),
    /// The receiver's base is not the one the sender encoded against.
    #[error("delta message against another base (its CRC {want:08x}, this rank's {have:08x})")]
    OtherBase {
        /// The sender's base CRC.
        want: u32,
        /// The receiver's.
        have: u32,
    },
    /// The rebuilt message is not the one the sender had.
    #[error("delta message rebuilt wrong (CRC {got:08x}, sender's {want:08x})")]
    Corrupt {
        /// Sender's CRC of the message.
        want: u32,
        /// CRC of what was rebuilt.
        got: u32,
    },
}

fn header(form: u8, unit: usize, units: u64, base_crc: u32, crc: u32, payload: u64) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0] = form;
    h[1] = unit as u8;
    h[2..10].copy_from_slice(&units.to_le_bytes());
    h[10..14].copy_from_slice(&base_crc.to_le_bytes());
    h[14..18].copy_from_slice(&crc.to_le_bytes());
    h[18..26].copy_from_slice(&payload.to_le_bytes());
    h
}

/// Whether `unit` is a size units may have (1, 2, 4 or 8 bytes).
fn valid_unit(unit: usize) -> bool {
    matches!(unit, 1 | 2 | 4 | 8)
}

/// The encoding of `new` against `base` (`None`: no base; the form is then
/// dense). `unit` is 1, 2, 4 or 8 and divides `new.len()`; a base of
/// another length than `new` is ignored (dense).
///
/// Memory: one output buffer of [`HEADER`] plus `new.len()` bytes (its
/// pages zeroed by the system as first written: a short encoding touches
/// few), nothing else. One pass writes the gaps form, its stream from the
/// front and the values behind it, and counts the changed units; where
/// another form is shorter (or the changes overflow the gaps form's
/// areas, counted then), that form is written into the same buffer.
pub fn encode(base: Option<&[u8]>, new: &[u8], unit: usize) -> Vec<u8> {
    encode_on(base.map(|b| (b, crc32c::crc32c(b))), new, unit).0
}

/// [`encode`] on a base kept with its CRC-32C, as a delta run keeps it
/// (what a run pays: the base is not read again to name it): the
/// encoding and the CRC of `new`, to keep it with.
pub fn encode_kept(base: Option<&KeptMessage>, new: &[u8], unit: usize) -> (Vec<u8>, u32) {
    encode_on(base.map(|k| (&k.bytes[..], k.crc)), new, unit)
}

/// [`encode`] on `(base, its CRC-32C)`: the encoding and the CRC of `new`.
fn encode_on(base: Option<(&[u8], u32)>, new: &[u8], unit: usize) -> (Vec<u8>, u32) {
    let unit = unit_for(new.len() as u64, unit);
    let units = (new.len() / unit) as u64;
    let mut out = vec![0u8; HEADER + new.len()];
    let Some((base, base_crc)) = base.filter(|(b, _)| b.len() == new.len()) else {
        let crc = crc32c::crc32c(new);
        let payload = write_dense(new, &mut out[HEADER..]);
        return (finish(out, (DENSE, unit, units), (0, crc), payload), crc);
    };
    let changes = Changes { base, new, unit };
    let (gaps, crc) = match unit {
        1 => write_gaps::<1>(&changes, &mut out[HEADER..]),
        2 => write_gaps::<2>(&changes, &mut out[HEADER..]),
        4 => write_gaps::<4>(&changes, &mut out[HEADER..]),
        _ => write_gaps::<8>(&changes, &mut out[HEADER..]),
    };
    // The gaps form read every byte of `new` unless it stopped early.
    let crc = crc.unwrap_or_else(|| crc32c::crc32c(new));
    let crcs = (base_crc, crc);
    // More changed units than this and no form beats dense.
    let most = (new.len() - (units as usize).div_ceil(8).min(new.len())) / unit;
    let changed = match gaps {
        Some((changed, _)) => Some(changed).filter(|&c| c <= most),
        None => changes.count_up_to(most),
    };
    let Some(changed) = changed else {
        let payload = write_dense(new, &mut out[HEADER..]);
        return (finish(out, (DENSE, unit, units), crcs, payload), crc);
    };
    let values = changed * unit;
    let bitmap_len = (units as usize).div_ceil(8) + values;
    let indices_len = if units <= u32::MAX as u64 { changed * 4 + values } else { usize::MAX };
    let listed = bitmap_len.min(indices_len);
    let encoded = match gaps {
        Some((_, payload)) if payload <= listed && payload < new.len() => finish(out, (GAPS, unit, units), crcs, payload),
        _ if new.len() <= listed => {
            let payload = write_dense(new, &mut out[HEADER..]);
            finish(out, (DENSE, unit, units), crcs, payload)
        }
        _ => {
            let form = if indices_len < bitmap_len { INDICES } else { BITMAP };
            let payload = write_listed(&changes, form, changed, &mut out[HEADER..]);
            finish(out, (form, unit, units), crcs, payload)
        }
    };
    (encoded, crc)
}

/// `out` with its header written and cut to the header and `payload`.
fn finish(mut out: Vec<u8>, (form, unit, units): (u8, usize, u64), (base_crc, crc): (u32, u32), payload: usize) -> Vec<u8> {
    out[..HEADER].copy_from_slice(&header(form, unit, units, base_crc, crc, payload as u64));
    out.truncate(HEADER + payload);
    out
}

/// Writes the dense form's payload (the message) into `out`: its length.
fn write_dense(new: &[u8], out: &mut [u8]) -> usize {
    out[..new.len()].copy_from_slice(new);
    new.len()
}

/// Writes the gaps form's payload into `out` (the dense form's size) in
/// one pass: the gap stream from the front (at most a quarter of `out`)
/// and the values behind it, moved down behind the stream at the end.
/// The changed units and the payload's length (`None` if they overflowed
/// either area: a denser message than the form suits), and the CRC-32C of
/// the message if every byte was read (the comparison computes it as it
/// goes).
fn write_gaps<const U: usize>(changes: &Changes<'_>, out: &mut [u8]) -> (Option<(usize, usize)>, Option<u32>) {
    let Some(stream_most) = out.len().checked_sub(GAPS_HEADER).map(|l| l / 4) else { return (None, None) };
    let (head, rest) = out.split_at_mut(GAPS_HEADER);
    let (stream_area, values) = rest.split_at_mut(stream_most);
    let mut gaps = rice::GapWriter::new(stream_area, rice::START_K);
    let (mut next, mut at) = (0usize, 0usize);
    // A block of masks at a time, walked here (the hot loop, inline).
    let (mut masks, mut crc, mut first) = ([0u64; BLOCK], 0u32, 0usize);
    let groups = changes.groups();
    while first < groups {
        let filled = changes.compare_block(first, &mut masks, Some(&mut crc));
        for (g, &mask) in masks[..filled].iter().enumerate() {
            let (mut differ, group) = (mask, (first + g) * 64);
            while differ != 0 {
                let i = group + differ.trailing_zeros() as usize;
                differ &= differ - 1;
                if at + U > values.len() || gaps.overflowed() {
                    return (None, None);
                }
                gaps.gap((i - next) as u64);
                values[at..at + U].copy_from_slice(&changes.new[i * U..i * U + U]);
                next = i + 1;
                at += U;
            }
        }
        first += filled;
    }
    let crc = Some(crc);
    let Some(stream) = gaps.finish() else { return (None, crc) };
    let changed = at / U;
    head[0] = rice::START_K as u8;
    head[1..9].copy_from_slice(&(changed as u64).to_le_bytes());
    head[9..GAPS_HEADER].copy_from_slice(&(stream as u64).to_le_bytes());
    rest.copy_within(stream_most..stream_most + at, stream);
    (Some((changed, GAPS_HEADER + stream + at)), crc)
}

/// Writes the bitmap or indices form's payload for `changed` changed units
/// into `out`: its length.
fn write_listed(changes: &Changes<'_>, form: u8, changed: usize, out: &mut [u8]) -> usize {
    let unit = changes.unit;
    let lead = if form == INDICES { changed * 4 } else { (changes.new.len() / unit).div_ceil(8) };
    let (lead_area, vals) = out.split_at_mut(lead);
    // (A gaps form written before left its bytes here.)
    lead_area.fill(0);
    let mut k = 0usize;
    for i in changes.positions() {
        if form == INDICES {
            lead_area[k * 4..k * 4 + 4].copy_from_slice(&(i as u32).to_le_bytes());
        } else {
            lead_area[i / 8] |= 1 << (i % 8);
        }
        copy_unit(vals, k * unit, &changes.new[i * unit..], unit);
        k += 1;
    }
    debug_assert_eq!(k, changed);
    lead + changed * unit
}

/// The `unit`-byte units where `new` differs from `base` (same lengths, a
/// multiple of `unit`), walked without being listed.
#[derive(Clone, Copy)]
struct Changes<'a> {
    base: &'a [u8],
    new: &'a [u8],
    unit: usize,
}

impl<'a> Changes<'a> {
    /// The index of every changed unit, ascending.
    fn positions(&self) -> Positions<'a> {
        Positions { changes: *self, groups: self.groups(), first: 0, filled: 0, g: 0, current: 0, masks: [0; BLOCK], crc: None }
    }

    /// Groups of 64 units in the message (the last may be short).
    fn groups(&self) -> usize {
        (self.new.len() / self.unit).div_ceil(64)
    }

    /// Compares the block of (up to) [`BLOCK`] groups from group `first`
    /// into `masks` ([`differing`]) and appends its bytes of `new` to
    /// `crc`, if asked (while they are in the cache): the groups compared.
    fn compare_block(&self, first: usize, masks: &mut [u64; BLOCK], crc: Option<&mut u32>) -> usize {
        let end = (first + BLOCK).min(self.groups());
        let (lo, hi) = (first * 64 * self.unit, (end * 64 * self.unit).min(self.new.len()));
        let (new, base, masks) = (&self.new[lo..hi], &self.base[lo..hi], &mut masks[..end - first]);
        if let Some(crc) = crc {
            *crc = crc32c::crc32c_append(*crc, new);
        }
        match self.unit {
            1 => differing::<1>(new, base, masks),
            2 => differing::<2>(new, base, masks),
            4 => differing::<4>(new, base, masks),
            _ => differing::<8>(new, base, masks),
        }
        end - first
    }

    /// How many units changed; `None` as soon as more than `most` did (a
    /// message that changed all over is not walked to its end).
    fn count_up_to(&self, most: usize) -> Option<usize> {
        let mut count = 0usize;
        for _ in self.positions() {
            count += 1;
            if count > most {
                return None;
            }
        }
        Some(count)
    }
}

/// Groups of 64 units compared at a time into a block of masks.
const BLOCK: usize = 64;

/// The iterator of [`Changes::positions`]: compares a block of
/// [`BLOCK`] groups of 64 units at a time into masks of the units that
/// differ ([`differing`]), then walks their set bits.
struct Positions<'a> {
    changes: Changes<'a>,
    /// Groups of 64 units in the message (the last may be short).
    groups: usize,
    /// The group `masks[0]` is of.
    first: usize,
    /// Masks of the block (`masks[..filled]`).
    filled: usize,
    /// The mask being walked (`masks[g]`, its bits left in `current`).
    g: usize,
    current: u64,
    masks: [u64; BLOCK],
    /// CRC-32C of the blocks of `new` compared so far, if asked for (the
    /// walks that find the positions again after the gaps form do not).
    crc: Option<u32>,
}

impl Iterator for Positions<'_> {
    type Item = usize;

    #[inline]
    fn next(&mut self) -> Option<usize> {
        while self.current == 0 {
            self.g += 1;
            if self.g >= self.filled {
                let first = self.first + self.filled;
                if first >= self.groups {
                    return None;
                }
                (self.first, self.filled, self.g) = (first, self.changes.compare_block(first, &mut self.masks, self.crc.as_mut()), 0);
            }
            self.current = self.masks[self.g];
        }
        let i = (self.first + self.g) * 64 + self.current.trailing_zeros() as usize;
        self.current &= self.current - 1;
        Some(i)
    }
}

impl Positions<'_> {
    /// The CRC-32C of `new`, once its last block was compared.
    #[cfg(test)]
    fn crc(&self) -> Option<u32> {
        self.crc.filter(|_| self.first + self.filled >= self.groups)
    }
}

/// Into `masks[g]`, bit `i` set where unit `i` of group `g` (64 units of
/// `U` bytes; the last group may be short) of `new` and `base` differ: as
/// vector compares on x86-64 (SSE2, [`sse2`]), one unit at a time
/// elsewhere and for a short group.
fn differing<const U: usize>(new: &[u8], base: &[u8], masks: &mut [u64]) {
    let (new_groups, new_tail) = new.as_chunks::<U>().0.as_chunks::<64>();
    let (base_groups, base_tail) = base.as_chunks::<U>().0.as_chunks::<64>();
    let whole = new_groups.len();
    #[cfg(target_arch = "x86_64")]
    if U <= 4 {
        // SAFETY: `sse2::differing` is compiled for SSE2, which every
        // x86-64 processor has (the target's baseline); it assumes
        // nothing else.
        unsafe { sse2::differing(new_groups, base_groups, &mut masks[..whole]) };
    } else {
        scalar_differing(new_groups, base_groups, &mut masks[..whole]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    scalar_differing(new_groups, base_groups, &mut masks[..whole]);
    if let Some(last) = masks.get_mut(whole) {
        *last = new_tail.iter().zip(base_tail).enumerate().fold(0, |m, (i, (n, b))| m | u64::from(n != b) << i);
    }
}

/// [`differing`] one unit at a time.
fn scalar_differing<const U: usize>(new: &[[[u8; U]; 64]], base: &[[[u8; U]; 64]], masks: &mut [u64]) {
    for ((n, b), mask) in new.iter().zip(base).zip(masks.iter_mut()) {
        *mask = (0..64).fold(0u64, |m, i| m | u64::from(n[i] != b[i]) << i);
    }
}

#[cfg(target_arch = "x86_64")]
mod sse2 {
    use core::arch::x86_64::{
        __m128i, _mm_cmpeq_epi16, _mm_cmpeq_epi32, _mm_cmpeq_epi8, _mm_movemask_epi8, _mm_packs_epi16, _mm_packs_epi32, _mm_set_epi64x,
    };

    /// [`super::differing`] for units of `U` = 1, 2 or 4 bytes.
    #[target_feature(enable = "sse2")]
    pub(super) fn differing<const U: usize>(new: &[[[u8; U]; 64]], base: &[[[u8; U]; 64]], masks: &mut [u64]) {
        for ((n, b), mask) in new.iter().zip(base).zip(masks.iter_mut()) {
            let (n, b) = (n.as_flattened(), b.as_flattened());
            let step = 16 * U;
            *mask = (0..4).fold(0u64, |m, j| {
                let at = j * step..(j + 1) * step;
                m | u64::from(differing16::<U>(&n[at.clone()], &b[at])) << (16 * j)
            });
        }
    }

    /// Sixteen bytes as a vector (two word loads the compiler merges).
    #[target_feature(enable = "sse2")]
    #[inline]
    fn load(b: &[u8]) -> __m128i {
        let word = |at: usize| i64::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3], b[at + 4], b[at + 5], b[at + 6], b[at + 7]]);
        _mm_set_epi64x(word(8), word(0))
    }

    /// Bit `i` set where unit `i` (of `U` = 1, 2 or 4 bytes) of the
    /// sixteen units in `new` and `base` (`16 * U` bytes each) differs.
    #[target_feature(enable = "sse2")]
    #[inline]
    fn differing16<const U: usize>(new: &[u8], base: &[u8]) -> u16 {
        let eq = |v: usize| {
            let (n, b) = (load(&new[16 * v..16 * v + 16]), load(&base[16 * v..16 * v + 16]));
            match U {
                1 => _mm_cmpeq_epi8(n, b),
                2 => _mm_cmpeq_epi16(n, b),
                _ => _mm_cmpeq_epi32(n, b),
            }
        };
        // Each unit's lanes all ones where equal, packed (signed
        // saturation keeps -1 and 0) down to one byte per unit.
        let bytes = match U {
            1 => eq(0),
            2 => _mm_packs_epi16(eq(0), eq(1)),
            _ => _mm_packs_epi16(_mm_packs_epi32(eq(0), eq(1)), _mm_packs_epi32(eq(2), eq(3))),
        };
        !(_mm_movemask_epi8(bytes) as u16)
    }
}

/// Copies unit `i` of `from` (units of `unit` bytes) to `to[at..]`, its
/// length a constant for each unit size (no call for a 2-byte copy).
#[inline(always)]
fn copy_unit(to: &mut [u8], at: usize, from: &[u8], unit: usize) {
    match unit {
        1 => to[at] = from[0],
        2 => to[at..at + 2].copy_from_slice(&from[..2]),
        4 => to[at..at + 4].copy_from_slice(&from[..4]),
        8 => to[at..at + 8].copy_from_slice(&from[..8]),
        _ => to[at..at + unit].copy_from_slice(&from[..unit]),
    }
}

/// The form of an encoding, as a word (for reports): "dense", "bitmap",
/// "indices", "gaps".
pub fn form(encoded: &[u8]) -> &'static str {
    match encoded.first() {
        Some(&DENSE) => "dense",
        Some(&BITMAP) => "bitmap",
        Some(&INDICES) => "indices",
        Some(&GAPS) => "gaps",
        _ => "unknown",
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or([0; 4]))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]))
}

/// The unit [`encode`] uses for a message of `len` bytes asked to use
/// `unit`: `unit` if it is 1, 2, 4 or 8 and divides `len`, else 1.
pub fn unit_for(len: u64, unit: usize) -> usize {
    if valid_unit(unit) && len.is_multiple_of(unit as u64) {
        unit
    } else {
        1
    }
}

/// The most bytes an encoding of a message of `len` bytes takes: its dense
/// form, [`HEADER`] plus the message ([`encode`] never writes more).
pub fn most_encoded(len: u64) -> u64 {
    len.saturating_add(HEADER as u64)
}

/// Refuses an encoding of `encoded` bytes for a message the receiver
/// expects to be `len` bytes long, if it is longer than any encoding of
/// such a message ([`most_encoded`]): checked on the length alone, before
/// the encoding is copied or read.
pub fn check_encoded_len(encoded: u64, len: u64) -> Result<(), DeltaError> {
    let most = most_encoded(len);
    if encoded > most {
        return Err(DeltaError::Malformed(format!("an encoding of {encoded} bytes for a message of {len}: at most {most} expected")));
    }
    Ok(())
}

/// The message `encoded` encodes, rebuilt on `base` (the receiver's copy
/// of the same message in the base refit, patched in place; `None` if it
/// has none). The receiver knows the message: `len` bytes, whose sender
/// encoded it in units of `unit` bytes as asked of [`encode`] (the smallest
/// element size among its pieces); a header that says otherwise is
/// refused, and so is an encoding longer than the message's densest form
/// ([`check_encoded_len`]). Nothing is allocated but the dense form's copy of its bytes:
/// the claims of the encoding are checked against the bytes received
/// before any is used, so a peer claiming more changed units than it sent
/// costs no memory.
pub fn decode(base: Option<Vec<u8>>, encoded: &[u8], unit: usize, len: u64) -> Result<Vec<u8>, DeltaError> {
    let base = base.map(|bytes| KeptMessage { crc: crc32c::crc32c(&bytes), bytes });
    decode_kept(base, encoded, unit, len).map(|kept| kept.bytes)
}

/// [`decode`] on a base kept with its CRC-32C, as a delta run keeps it
/// (what a run pays): the rebuilt message, kept with its CRC.
pub fn decode_kept(base: Option<KeptMessage>, encoded: &[u8], unit: usize, len: u64) -> Result<KeptMessage, DeltaError> {
    let bad = |why: String| DeltaError::Malformed(why);
    check_encoded_len(encoded.len() as u64, len)?;
    if encoded.len() < HEADER {
        return Err(bad("shorter than its header".into()));
    }
    let (form, unit_got) = (encoded[0], encoded[1] as usize);
    let (units, base_crc, crc, payload) = (u64_at(encoded, 2), u32_at(encoded, 10), u32_at(encoded, 14), u64_at(encoded, 18));
    let body = &encoded[HEADER..];
    let want_unit = unit_for(len, unit);
    if unit_got != want_unit {
        return Err(bad(format!("unit of {unit_got} bytes, the message's elements need {want_unit}")));
    }
    let unit = want_unit;
    if units.checked_mul(unit as u64) != Some(len) {
        return Err(bad(format!("{units} units of {unit} bytes, the message has {len} bytes")));
    }
    if body.len() as u64 != payload {
        return Err(bad(format!("payload length {payload} in the header, {} bytes follow it", body.len())));
    }
    let len = usize::try_from(len).map_err(|_| bad(format!("{len} bytes do not fit this machine")))?;
    let out = match form {
        DENSE => {
            if body.len() != len {
                return Err(bad(format!("dense payload of {} bytes for a message of {len}", body.len())));
            }
            body.to_vec()
        }
        BITMAP | INDICES | GAPS => {
            let base = base.ok_or(DeltaError::OtherBase { want: base_crc, have: 0 })?;
            if base.bytes.len() != len || base.crc != base_crc {
                return Err(DeltaError::OtherBase { want: base_crc, have: base.crc });
            }
            // `units` = len / unit, at most the base's length.
            let units = len / unit;
            let mut out = base.bytes;
            if form == BITMAP {
                let (bits, values) = body.split_at_checked(units.div_ceil(8)).ok_or_else(|| bad("bitmap cut short".into()))?;
                // Bits past the last unit are never set.
                if !units.is_multiple_of(8) && bits.last().is_some_and(|&b| b >> (units % 8) != 0) {
                    return Err(bad("bitmap marks units past the message's end".into()));
                }
                let changed: usize = bits.iter().map(|b| b.count_ones() as usize).sum();
                if changed.checked_mul(unit) != Some(values.len()) {
                    return Err(bad(format!("{changed} changed units, {} bytes of values", values.len())));
                }
                let mut from = values.chunks_exact(unit);
                for (byte, &b) in bits.iter().enumerate() {
                    let mut b = b;
                    while b != 0 {
                        let i = byte * 8 + b.trailing_zeros() as usize;
                        b &= b - 1;
                        // As many values as set bits: checked above.
                        let Some(v) = from.next() else { return Err(bad("values cut short".into())) };
                        copy_unit(&mut out, i * unit, v, unit);
                    }
                }
            } else if form == GAPS {
                match unit {
                    1 => patch_gaps::<1>(&mut out, body)?,
                    2 => patch_gaps::<2>(&mut out, body)?,
                    4 => patch_gaps::<4>(&mut out, body)?,
                    _ => patch_gaps::<8>(&mut out, body)?,
                }
            } else {
                // Values follow the indices: indices * (4 + unit) == body.
                if !body.len().is_multiple_of(4 + unit) {
                    return Err(bad("index list and values do not add up".into()));
                }
                let (idx, values) = body.split_at(body.len() / (4 + unit) * 4);
                let mut prev: Option<u32> = None;
                for i in idx.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])) {
                    if prev.is_some_and(|p| p >= i) || i as usize >= units {
                        return Err(bad("indices not ascending within the message".into()));
                    }
                    prev = Some(i);
                }
                for (c, v) in idx.chunks_exact(4).zip(values.chunks_exact(unit)) {
                    let i = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize;
                    copy_unit(&mut out, i * unit, v, unit);
                }
            }
            out
        }
        _ => return Err(bad(format!("unknown form {form}"))),
    };
    let got = crc32c::crc32c(&out);
    if got != crc {
        return Err(DeltaError::Corrupt { want: crc, got });
    }
    Ok(KeptMessage { bytes: out, crc })
}

/// Patches `out` (the base, `unit`-byte units) with the gaps form's
/// `body`: its claims (changed units, stream length) checked against the
/// bytes received before any is used, every position inside the message.
fn patch_gaps<const U: usize>(out: &mut [u8], body: &[u8]) -> Result<(), DeltaError> {
    let bad = |why: &str| DeltaError::Malformed(format!("gaps: {why}"));
    let (head, rest) = body.split_at_checked(GAPS_HEADER).ok_or_else(|| bad("cut short"))?;
    let (k, changed, stream) = (u32::from(head[0]), u64_at(head, 1), u64_at(head, 9));
    if k >= 64 {
        return Err(bad("a starting Rice parameter of 64 or more"));
    }
    let values = changed.checked_mul(U as u64).ok_or_else(|| bad("more changed units than bytes"))?;
    if stream.checked_add(values) != Some(rest.len() as u64) {
        return Err(bad("the gap stream and the values do not add up to the bytes sent"));
    }
    let (stream, values) = rest.split_at(stream as usize);
    let units = out.len() / U;
    let mut gaps = rice::GapReader::new(stream, k, units as u64);
    let mut next = 0usize;
    for v in values.as_chunks::<U>().0 {
        let gap = gaps.gap().ok_or_else(|| bad("the gap stream ends early or points past the message"))?;
        // `gap` <= units, and `next` <= units: no overflow.
        let i = next + gap as usize;
        if i >= units {
            return Err(bad("a position past the message's end"));
        }
        out[i * U..i * U + U].copy_from_slice(v);
        next = i + 1;
    }
    if !gaps.at_end() {
        return Err(bad("bytes left in the gap stream"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `n` bf16-like units of which every `every`-th changed.
    fn pair(n: usize, every: usize) -> (Vec<u8>, Vec<u8>) {
        let base: Vec<u8> = (0..n * 2).map(|i| (i * 7 % 251) as u8).collect();
        let mut new = base.clone();
        for u in (0..n).step_by(every.max(1)) {
            new[u * 2] ^= 0x5a;
        }
        (base, new)
    }

    /// The positions the block-wise vector compares find are exactly the
    /// units that differ, for every unit size, across short last groups
    /// and block boundaries.
    #[test]
    fn positions_are_every_unit_that_differs() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            seed >> 33
        };
        for unit in [1usize, 2, 4, 8] {
            for units in [0usize, 1, 63, 64, 65, 4095, 4096, 4097, 64 * BLOCK * 2 + 17] {
                let base: Vec<u8> = (0..units * unit).map(|_| next() as u8).collect();
                let mut new = base.clone();
                for b in new.iter_mut() {
                    // About one byte in twelve changes (each of a unit's bytes alone).
                    if next() % 12 == 0 {
                        *b ^= 1 << (next() % 8);
                    }
                }
                let want: Vec<usize> = (0..units).filter(|&i| new[i * unit..(i + 1) * unit] != base[i * unit..(i + 1) * unit]).collect();
                let mut positions = Positions { crc: Some(0), ..Changes { base: &base, new: &new, unit }.positions() };
                let got: Vec<usize> = positions.by_ref().collect();
                assert_eq!(got, want, "unit {unit}, {units} units");
                assert_eq!(positions.crc(), Some(crc32c::crc32c(&new)), "unit {unit}, {units} units");
            }
        }
    }

    #[test]
    fn the_shortest_form_is_chosen_and_round_trips() {
        // (units, every k-th changed, form, most bytes as a share of dense)
        let cases = [
            (10_000, 50, "gaps", 0.04), // 2%: ~7 bits of gap + a 2-byte value per change
            (10_000, 8, "gaps", 0.17),  // 12.5%: ~4 bits of gap + the value
            (10_000, 1, "dense", 1.0 + 30.0 / 20_000.0),
        ];
        for (n, every, want, share) in cases {
            let (base, new) = pair(n, every);
            let e = encode(Some(&base), &new, 2);
            assert_eq!(form(&e), want, "every {every}");
            assert!((e.len() as f64) <= share * new.len() as f64, "every {every}: {} of {}", e.len(), new.len());
            assert_eq!(decode(Some(base.to_vec()), &e, 2, new.len() as u64).unwrap(), new);
        }
        // Unchanged: nothing but the header and an empty list.
        let (base, _) = pair(1000, 1);
        let e = encode(Some(&base), &base, 2);
        assert_eq!((form(&e), e.len()), ("indices", HEADER));
        assert_eq!(decode(Some(base.to_vec()), &e, 2, base.len() as u64).unwrap(), base);
        // No base: dense, decodable without one.
        let e = encode(None, &base, 2);
        assert_eq!(form(&e), "dense");
        assert_eq!(decode(None, &e, 2, base.len() as u64).unwrap(), base);
    }

    #[test]
    fn another_base_or_damage_is_an_error() {
        let (base, new) = pair(1000, 10);
        let n = new.len() as u64;
        let e = encode(Some(&base), &new, 2);
        let mut other = base.clone();
        other[3] ^= 1;
        assert!(matches!(decode(Some(other.to_vec()), &e, 2, n), Err(DeltaError::OtherBase { .. })));
        assert!(matches!(decode(None, &e, 2, n), Err(DeltaError::OtherBase { .. })));
        assert!(matches!(decode(Some(base[..10].to_vec()), &e, 2, n), Err(DeltaError::OtherBase { .. })));
        for i in [0, 1, 5, 20, HEADER, HEADER + 3, e.len() - 1] {
            let mut bad = e.clone();
            bad[i] ^= 0x10;
            assert!(decode(Some(base.to_vec()), &bad, 2, n).is_err(), "byte {i} flipped");
        }
        assert!(decode(Some(base.to_vec()), &e[..e.len() - 1], 2, n).is_err());
        assert!(decode(Some(base.to_vec()), &e[..5], 2, n).is_err());
    }

    #[test]
    fn a_header_that_is_not_the_expected_message_is_refused() {
        let (base, new) = pair(1000, 10);
        let n = new.len() as u64;
        let e = encode(Some(&base), &new, 2);
        let malformed = |r: Result<Vec<u8>, DeltaError>, what: &str| match r {
            Err(DeltaError::Malformed(m)) => assert!(m.contains(what), "{m}"),
            other => panic!("{what}: {other:?}"),
        };
        // Elements of 4 bytes: units of 2 are not theirs.
        malformed(decode(Some(base.clone()), &e, 4, n), "unit of 2 bytes, the message's elements need 4");
        // Another length than the message's.
        malformed(decode(Some(base.clone()), &e, 2, n - 2), "1000 units of 2 bytes, the message has 1998 bytes");
        malformed(decode(Some(base.clone()), &e, 2, n + 2), "the message has 2002 bytes");
        // A unit that does not divide the length falls back to bytes, on
        // both ends.
        assert_eq!((unit_for(6, 4), unit_for(8, 4), unit_for(8, 3), unit_for(0, 8)), (1, 4, 1, 8));
        let odd = &new[..1999];
        let e = encode(Some(&base[..1999]), odd, 2);
        assert_eq!(decode(Some(base[..1999].to_vec()), &e, 2, 1999).unwrap(), odd);
    }

    #[test]
    fn claims_past_the_bytes_sent_are_refused() {
        let malformed = |r: Result<Vec<u8>, DeltaError>, what: &str| match r {
            Err(DeltaError::Malformed(m)) => assert!(m.contains(what), "{m}"),
            other => panic!("{what}: {other:?}"),
        };
        // A 64 KiB message in bytes: every unit marked changed, no value.
        let base = vec![7u8; 1 << 16];
        let crc = crc32c::crc32c(&base);
        let bits = vec![0xffu8; (1 << 16) / 8];
        let mut e = header(BITMAP, 1, 1 << 16, crc, crc, bits.len() as u64).to_vec();
        e.extend_from_slice(&bits);
        malformed(decode(Some(base.clone()), &e, 1, 1 << 16), "65536 changed units, 0 bytes of values");
        // 12 units of a byte: one value short of the bits set.
        let base = vec![0u8; 12];
        let crc = crc32c::crc32c(&base);
        let mut e = header(BITMAP, 1, 12, crc, crc, 2 + 2).to_vec();
        e.extend_from_slice(&[0b101, 0b0000_1000, 1, 2]);
        malformed(decode(Some(base.clone()), &e, 1, 12), "3 changed units, 2 bytes of values");
        // A bit past the last unit.
        let mut e = header(BITMAP, 1, 12, crc, crc, 2 + 1).to_vec();
        e.extend_from_slice(&[0, 0b0001_0000, 9]);
        malformed(decode(Some(base.clone()), &e, 1, 12), "past the message's end");
        // A bitmap shorter than its units.
        let mut e = header(BITMAP, 1, 12, crc, crc, 1).to_vec();
        e.push(0);
        malformed(decode(Some(base.clone()), &e, 1, 12), "bitmap cut short");
        // Indices past the message, or not ascending.
        for idx in [[3u32, 12], [5, 5], [6, 2]] {
            let mut e = header(INDICES, 1, 12, crc, crc, 10).to_vec();
            idx.iter().for_each(|i| e.extend_from_slice(&i.to_le_bytes()));
            e.extend_from_slice(&[1, 2]);
            malformed(decode(Some(base.clone()), &e, 1, 12), "indices not ascending");
        }
    }

    #[test]
    fn gap_claims_past_the_bytes_sent_are_refused() {
        let malformed = |r: Result<Vec<u8>, DeltaError>, what: &str| match r {
            Err(DeltaError::Malformed(m)) => assert!(m.contains(what), "{m}"),
            other => panic!("{what}: {other:?}"),
        };
        let base = vec![0u8; 64];
        let crc = crc32c::crc32c(&base);
        let gaps = |k: u8, changed: u64, stream: u64, rest: &[u8]| {
            let mut body = vec![k];
            body.extend_from_slice(&changed.to_le_bytes());
            body.extend_from_slice(&stream.to_le_bytes());
            body.extend_from_slice(rest);
            let mut e = header(GAPS, 1, 64, crc, crc, body.len() as u64).to_vec();
            e.extend_from_slice(&body);
            e
        };
        // A billion changed units, one byte of values.
        malformed(decode(Some(base.clone()), &gaps(0, 1 << 30, 1, &[0, 7]), 1, 64), "do not add up");
        // A stream longer than the bytes sent.
        malformed(decode(Some(base.clone()), &gaps(0, 1, 1 << 40, &[0, 7]), 1, 64), "do not add up");
        malformed(decode(Some(base.clone()), &gaps(64, 1, 1, &[0, 7]), 1, 64), "Rice parameter");
        // One gap of 70 (from k0 = 6 the first k is 5: two ones, a zero,
        // then the 5 low bits, 6) in a message of 64.
        malformed(decode(Some(base.clone()), &gaps(6, 1, 1, &[0b0011_0011, 7]), 1, 64), "past the message");
        // All ones: no end to the quotient within the stream.
        malformed(decode(Some(base.clone()), &gaps(0, 1, 2, &[0xff, 0xff, 7]), 1, 64), "ends early");
        // A byte of stream left over after the one gap.
        malformed(decode(Some(base.clone()), &gaps(0, 1, 2, &[0, 0xff, 7]), 1, 64), "left in the gap stream");
        // Cut short before its own header.
        let mut e = header(GAPS, 1, 64, crc, crc, 3).to_vec();
        e.extend_from_slice(&[0, 0, 0]);
        malformed(decode(Some(base.clone()), &e, 1, 64), "cut short");
    }

    proptest! {
        /// Whatever a peer sends as a gaps body: an error or a message,
        /// never a panic or an allocation past the message.
        #[test]
        fn any_gaps_body_is_decoded_or_refused(k in 0u8..70, changed in 0u64..80, stream in 0u64..80, rest in proptest::collection::vec(any::<u8>(), 0..96)) {
            let base = vec![3u8; 64];
            let crc = crc32c::crc32c(&base);
            let mut body = vec![k];
            body.extend_from_slice(&changed.to_le_bytes());
            body.extend_from_slice(&stream.to_le_bytes());
            body.extend_from_slice(&rest);
            let mut e = header(GAPS, 1, 64, crc, crc, body.len() as u64).to_vec();
            e.extend_from_slice(&body);
            if let Ok(out) = decode(Some(base.clone()), &e, 1, 64) {
                prop_assert_eq!(out.len(), 64);
            }
        }

        #[test]
        fn any_change_round_trips(
            base in proptest::collection::vec(any::<u8>(), 0..512),
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..64),
            unit in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
        ) {
            let len = base.len() / unit * unit;
            let base = &base[..len];
            let mut new = base.to_vec();
            for (at, x) in flips {
                if len > 0 {
                    new[at % len] ^= x;
                }
            }
            let e = encode(Some(base), &new, unit);
            prop_assert!(e.len() <= HEADER + new.len());
            prop_assert_eq!(decode(Some(base.to_vec()), &e, unit, len as u64).unwrap(), new);
        }
    }
}
