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
//! - gaps: the Rice parameter `k` (u8), the number of changed units (u64),
//!   the length of the gap stream (u64), the gap stream ([`rice`]: before
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

mod rice;

/// Bytes of the header.
pub const HEADER: usize = 26;

/// What one rank sent and received in a refit, message by message (the
/// packed bytes, keyed by round and peer): the base of the next delta
/// refit of the same plan. Costs as much memory as the rank sends plus
/// what it receives in a refit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeltaMemo {
    pub(crate) sent: std::collections::HashMap<(u32, reshard::Endpoint), Vec<u8>>,
    pub(crate) received: std::collections::HashMap<(u32, reshard::Endpoint), Vec<u8>>,
}

impl DeltaMemo {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.sent.values().chain(self.received.values()).map(|v| v.len() as u64).sum()
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
/// Memory: one output buffer of at most [`HEADER`] plus `new.len()` bytes,
/// nothing else. The changed units are counted first (a pass that only
/// compares), the form chosen from the count, then the output sized
/// exactly and written in a second pass: no list of changed units, no
/// candidate encoding other than the one sent.
pub fn encode(base: Option<&[u8]>, new: &[u8], unit: usize) -> Vec<u8> {
    let unit = unit_for(new.len() as u64, unit);
    let units = (new.len() / unit) as u64;
    let crc = crc32c::crc32c(new);
    let dense = |base_crc: u32| {
        let mut out = Vec::with_capacity(HEADER + new.len());
        out.extend_from_slice(&header(DENSE, unit, units, base_crc, crc, new.len() as u64));
        out.extend_from_slice(new);
        out
    };
    let Some(base) = base.filter(|b| b.len() == new.len()) else { return dense(0) };
    let base_crc = crc32c::crc32c(base);
    let changes = Changes { base, new, unit };
    // More changed units than this and no form beats dense.
    let most = (new.len() - (units as usize).div_ceil(8).min(new.len())) / unit;
    let Some((changed, last)) = changes.count_up_to(most) else { return dense(base_crc) };
    let values = changed * unit;
    let bitmap_len = (units as usize).div_ceil(8) + values;
    let indices_len = if units <= u32::MAX as u64 { changed * 4 + values } else { usize::MAX };
    // The gaps sum to the last changed unit's index less the changed units
    // before it.
    let gap_sum = (last + 1 - changed.min(last + 1)) as u64;
    let k = rice::parameter(changed as u64, gap_sum);
    let gaps_most = usize::try_from(rice::most_bits(changed as u64, gap_sum, k).div_ceil(8))
        .map_or(usize::MAX, |stream| stream.saturating_add(GAPS_HEADER + values));
    if new.len() <= bitmap_len.min(indices_len).min(gaps_most) {
        return dense(base_crc);
    }
    if gaps_most < bitmap_len.min(indices_len) {
        return encode_gaps(&changes, (units, changed, k), (base_crc, crc), gaps_most);
    }
    let (form, payload, lead) =
        if indices_len < bitmap_len { (INDICES, indices_len, changed * 4) } else { (BITMAP, bitmap_len, bitmap_len - values) };
    // Sized exactly (less than `new.len()`, checked above): the index
    // list or bitmap (zeroed), then the values, each written in place.
    let mut out = vec![0u8; HEADER + payload];
    out[..HEADER].copy_from_slice(&header(form, unit, units, base_crc, crc, payload as u64));
    let (lead, vals) = out[HEADER..].split_at_mut(lead);
    let mut k = 0usize;
    changes.for_each(|i| {
        if form == INDICES {
            lead[k * 4..k * 4 + 4].copy_from_slice(&(i as u32).to_le_bytes());
        } else {
            lead[i / 8] |= 1 << (i % 8);
        }
        vals[k * unit..(k + 1) * unit].copy_from_slice(&new[i * unit..(i + 1) * unit]);
        k += 1;
    });
    debug_assert_eq!(k, changed);
    out
}

/// The gaps form of `changes` (`changed` of `units` changed, Rice parameter
/// `k`) in one buffer of at most `most` payload bytes, the header's CRCs
/// `crcs` (base, result).
fn encode_gaps(changes: &Changes<'_>, (units, changed, k): (u64, usize, u32), (base_crc, crc): (u32, u32), most: usize) -> Vec<u8> {
    let unit = changes.unit;
    let mut out = Vec::with_capacity(HEADER + most);
    out.extend_from_slice(&[0u8; HEADER + GAPS_HEADER]);
    let mut gaps = rice::GapWriter::new(&mut out, k);
    let mut next = 0usize;
    changes.for_each(|i| {
        gaps.gap((i - next) as u64);
        next = i + 1;
    });
    gaps.finish();
    let stream = out.len() - HEADER - GAPS_HEADER;
    changes.for_each(|i| out.extend_from_slice(&changes.new[i * unit..(i + 1) * unit]));
    let payload = (out.len() - HEADER) as u64;
    out[..HEADER].copy_from_slice(&header(GAPS, unit, units, base_crc, crc, payload));
    out[HEADER] = k as u8;
    out[HEADER + 1..HEADER + 9].copy_from_slice(&(changed as u64).to_le_bytes());
    out[HEADER + 9..HEADER + GAPS_HEADER].copy_from_slice(&(stream as u64).to_le_bytes());
    debug_assert!(out.len() <= HEADER + most, "the gaps form outgrew its bound");
    out
}

/// The `unit`-byte units where `new` differs from `base` (same lengths, a
/// multiple of `unit`), compared 8 bytes at a time, walked without being
/// listed.
struct Changes<'a> {
    base: &'a [u8],
    new: &'a [u8],
    unit: usize,
}

impl Changes<'_> {
    /// Calls `f` with the index of every changed unit, ascending.
    fn for_each(&self, mut f: impl FnMut(usize)) {
        let _ = self.try_for_each(|i| {
            f(i);
            true
        });
    }

    /// How many units changed, and the last that did (0 if none); `None`
    /// as soon as more than `most` did (a message that changed all over is
    /// not walked to its end).
    fn count_up_to(&self, most: usize) -> Option<(usize, usize)> {
        let (mut count, mut last) = (0usize, 0usize);
        self.try_for_each(|i| {
            count += 1;
            last = i;
            count <= most
        })
        .then_some((count, last))
    }

    /// Calls `f` with the index of every changed unit, ascending, while it
    /// returns true; whether it always did.
    fn try_for_each(&self, mut f: impl FnMut(usize) -> bool) -> bool {
        let (base, new, unit) = (self.base, self.new, self.unit);
        let per_word = 8 / unit;
        let words = new.len() / 8;
        let unit_differs = |i: usize| new[i * unit..(i + 1) * unit] != base[i * unit..(i + 1) * unit];
        for (w, (n, b)) in new.chunks_exact(8).zip(base.chunks_exact(8)).enumerate() {
            if n == b {
                continue;
            }
            for i in (w * per_word..(w + 1) * per_word).filter(|&i| unit_differs(i)) {
                if !f(i) {
                    return false;
                }
            }
        }
        for i in ((words * 8 / unit)..(new.len() / unit)).filter(|&i| unit_differs(i)) {
            if !f(i) {
                return false;
            }
        }
        true
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
            let have = crc32c::crc32c(&base);
            if base.len() != len || have != base_crc {
                return Err(DeltaError::OtherBase { want: base_crc, have });
            }
            // `units` = len / unit, at most the base's length.
            let units = len / unit;
            let mut out = base;
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
                        out[i * unit..(i + 1) * unit].copy_from_slice(v);
                    }
                }
            } else if form == GAPS {
                patch_gaps(&mut out, body, unit)?;
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
                    out[i * unit..(i + 1) * unit].copy_from_slice(v);
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
    Ok(out)
}

/// Patches `out` (the base, `unit`-byte units) with the gaps form's
/// `body`: its claims (changed units, stream length) checked against the
/// bytes received before any is used, every position inside the message.
fn patch_gaps(out: &mut [u8], body: &[u8], unit: usize) -> Result<(), DeltaError> {
    let bad = |why: &str| DeltaError::Malformed(format!("gaps: {why}"));
    let (head, rest) = body.split_at_checked(GAPS_HEADER).ok_or_else(|| bad("cut short"))?;
    let (k, changed, stream) = (u32::from(head[0]), u64_at(head, 1), u64_at(head, 9));
    if k >= 64 {
        return Err(bad("a Rice parameter of 64 or more"));
    }
    let values = changed.checked_mul(unit as u64).ok_or_else(|| bad("more changed units than bytes"))?;
    if stream.checked_add(values) != Some(rest.len() as u64) {
        return Err(bad("the gap stream and the values do not add up to the bytes sent"));
    }
    let (stream, values) = rest.split_at(stream as usize);
    let units = out.len() / unit;
    let mut gaps = rice::GapReader::new(stream, k, units as u64);
    let mut next = 0usize;
    for v in values.chunks_exact(unit) {
        let gap = gaps.gap().ok_or_else(|| bad("the gap stream ends early or points past the message"))?;
        // `gap` <= units, and `next` <= units: no overflow.
        let i = next + gap as usize;
        if i >= units {
            return Err(bad("a position past the message's end"));
        }
        out[i * unit..(i + 1) * unit].copy_from_slice(v);
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
        // One gap of 70 (k = 6: one 1 then 0, then 6 low bits) in a message of 64.
        malformed(decode(Some(base.clone()), &gaps(6, 1, 1, &[0b0001_1001, 7]), 1, 64), "past the message");
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
