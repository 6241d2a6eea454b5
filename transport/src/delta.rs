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
//! Encoding: a 26-byte header — `form` (u8: 0 dense, 1 bitmap, 2 indices),
//! `unit` (u8), `units` (u64: message length / unit), base CRC (u32), result
//! CRC (u32), payload length (u64) — then
//! - dense: the message's bytes;
//! - bitmap: one bit per unit (LSB first), then the changed units' bytes in
//!   order;
//! - indices: the changed units' indices (u32 LE, ascending), then their
//!   bytes in order.
//!
//! All integers little-endian.

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

const DENSE: u8 = 0;
const BITMAP: u8 = 1;
const INDICES: u8 = 2;

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

fn header(form: u8, unit: usize, units: u64, base_crc: u32, crc: u32, payload: u64) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER);
    h.push(form);
    h.push(unit as u8);
    h.extend_from_slice(&units.to_le_bytes());
    h.extend_from_slice(&base_crc.to_le_bytes());
    h.extend_from_slice(&crc.to_le_bytes());
    h.extend_from_slice(&payload.to_le_bytes());
    h
}

/// Whether `unit` is a size units may have (1, 2, 4 or 8 bytes).
fn valid_unit(unit: usize) -> bool {
    matches!(unit, 1 | 2 | 4 | 8)
}

/// The encoding of `new` against `base` (`None`: no base; the form is then
/// dense). `unit` is 1, 2, 4 or 8 and divides `new.len()`; a base of
/// another length than `new` is ignored (dense).
pub fn encode(base: Option<&[u8]>, new: &[u8], unit: usize) -> Vec<u8> {
    let unit = if valid_unit(unit) && new.len().is_multiple_of(unit) { unit } else { 1 };
    let units = (new.len() / unit) as u64;
    let crc = crc32c::crc32c(new);
    let dense = |base_crc: u32| {
        let mut out = header(DENSE, unit, units, base_crc, crc, new.len() as u64);
        out.extend_from_slice(new);
        out
    };
    let Some(base) = base.filter(|b| b.len() == new.len()) else { return dense(0) };
    let base_crc = crc32c::crc32c(base);
    // More changed units than this and no form beats dense.
    let most = (new.len() - (units as usize).div_ceil(8).min(new.len())) / unit;
    let Some(changed) = changed_units(base, new, unit, most) else { return dense(base_crc) };
    let values = changed.len() * unit;
    let bitmap_len = (units as usize).div_ceil(8) + values;
    let indices_len = if units <= u32::MAX as u64 { changed.len() * 4 + values } else { usize::MAX };
    if new.len() <= bitmap_len.min(indices_len) {
        return dense(base_crc);
    }
    let mut out;
    if indices_len < bitmap_len {
        out = header(INDICES, unit, units, base_crc, crc, indices_len as u64);
        out.reserve(indices_len);
        for &i in &changed {
            out.extend_from_slice(&(i as u32).to_le_bytes());
        }
    } else {
        out = header(BITMAP, unit, units, base_crc, crc, bitmap_len as u64);
        out.reserve(bitmap_len);
        let mut bits = vec![0u8; (units as usize).div_ceil(8)];
        for &i in &changed {
            bits[(i / 8) as usize] |= 1 << (i % 8);
        }
        out.extend_from_slice(&bits);
    }
    for &i in &changed {
        let at = i as usize * unit;
        out.extend_from_slice(&new[at..at + unit]);
    }
    out
}

/// Indices of the `unit`-byte units where `new` differs from `base` (same
/// lengths, a multiple of `unit`), compared 8 bytes at a time; `None` if
/// more than `most` differ (found by a first pass that only counts, so a
/// message that changed all over costs no list).
fn changed_units(base: &[u8], new: &[u8], unit: usize, most: usize) -> Option<Vec<u64>> {
    let per_word = 8 / unit;
    let words = new.len() / 8;
    let tail = (words * 8 / unit)..(new.len() / unit);
    let unit_differs = |i: usize| new[i * unit..(i + 1) * unit] != base[i * unit..(i + 1) * unit];
    // Units of word `w` that differ (its 8 bytes differ).
    let in_word = |w: usize| (0..per_word).map(move |k| w * per_word + k).filter(move |&i| unit_differs(i));
    let differing_words = || new.chunks_exact(8).zip(base.chunks_exact(8)).enumerate().filter(|(_, (n, b))| n != b).map(|(w, _)| w);
    let mut count = 0usize;
    for w in differing_words() {
        count += in_word(w).count();
        if count > most {
            return None;
        }
    }
    count += tail.clone().filter(|&i| unit_differs(i)).count();
    if count > most {
        return None;
    }
    let mut changed = Vec::with_capacity(count);
    for w in differing_words() {
        changed.extend(in_word(w).map(|i| i as u64));
    }
    changed.extend(tail.filter(|&i| unit_differs(i)).map(|i| i as u64));
    Some(changed)
}

/// The form of an encoding, as a word (for reports): "dense", "bitmap",
/// "indices".
pub fn form(encoded: &[u8]) -> &'static str {
    match encoded.first() {
        Some(&DENSE) => "dense",
        Some(&BITMAP) => "bitmap",
        Some(&INDICES) => "indices",
        _ => "unknown",
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or([0; 4]))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]))
}

/// The message `encoded` encodes, rebuilt on `base` (the receiver's copy
/// of the same message in the base refit, patched in place; `None` if it
/// has none).
pub fn decode(base: Option<Vec<u8>>, encoded: &[u8]) -> Result<Vec<u8>, DeltaError> {
    let bad = |why: &str| DeltaError::Malformed(why.to_string());
    if encoded.len() < HEADER {
        return Err(bad("shorter than its header"));
    }
    let (form, unit) = (encoded[0], encoded[1] as usize);
    let (units, base_crc, crc, payload) = (u64_at(encoded, 2), u32_at(encoded, 10), u32_at(encoded, 14), u64_at(encoded, 18));
    let body = &encoded[HEADER..];
    if !valid_unit(unit) {
        return Err(bad("unit not 1, 2, 4 or 8 bytes"));
    }
    if body.len() as u64 != payload {
        return Err(bad("payload length does not match its header"));
    }
    let len = units.checked_mul(unit as u64).and_then(|l| usize::try_from(l).ok()).ok_or_else(|| bad("length overflows"))?;
    let out = match form {
        DENSE => {
            if body.len() != len {
                return Err(bad("dense payload of the wrong length"));
            }
            body.to_vec()
        }
        BITMAP | INDICES => {
            let base = base.ok_or(DeltaError::OtherBase { want: base_crc, have: 0 })?;
            let have = crc32c::crc32c(&base);
            if base.len() != len || have != base_crc {
                return Err(DeltaError::OtherBase { want: base_crc, have });
            }
            let mut out = base;
            let changed: Vec<u64> = if form == BITMAP {
                let bits = units.div_ceil(8) as usize;
                if body.len() < bits {
                    return Err(bad("bitmap cut short"));
                }
                (0..units).filter(|&i| body[(i / 8) as usize] & (1 << (i % 8)) != 0).collect()
            } else {
                // Values follow the indices: indices * (4 + unit) == body.
                if !body.len().is_multiple_of(4 + unit) {
                    return Err(bad("index list and values do not add up"));
                }
                let n = body.len() / (4 + unit);
                let idx: Vec<u64> = (0..n).map(|k| u32_at(body, k * 4) as u64).collect();
                if idx.windows(2).any(|w| w[0] >= w[1]) || idx.last().is_some_and(|&i| i >= units) {
                    return Err(bad("indices not ascending within the message"));
                }
                idx
            };
            let values_at = if form == BITMAP { units.div_ceil(8) as usize } else { changed.len() * 4 };
            if body.len() - values_at != changed.len() * unit {
                return Err(bad("values do not match the changed units"));
            }
            for (k, &i) in changed.iter().enumerate() {
                let (from, to) = (values_at + k * unit, i as usize * unit);
                out[to..to + unit].copy_from_slice(&body[from..from + unit]);
            }
            out
        }
        _ => return Err(bad("unknown form")),
    };
    let got = crc32c::crc32c(&out);
    if got != crc {
        return Err(DeltaError::Corrupt { want: crc, got });
    }
    Ok(out)
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
            (10_000, 50, "indices", 0.07), // 2%: 4-byte index + 2-byte value per change
            (10_000, 8, "bitmap", 0.20),   // 12.5%: a bit per unit beats indices
            (10_000, 1, "dense", 1.0 + 30.0 / 20_000.0),
        ];
        for (n, every, want, share) in cases {
            let (base, new) = pair(n, every);
            let e = encode(Some(&base), &new, 2);
            assert_eq!(form(&e), want, "every {every}");
            assert!((e.len() as f64) <= share * new.len() as f64, "every {every}: {} of {}", e.len(), new.len());
            assert_eq!(decode(Some(base.to_vec()), &e).unwrap(), new);
        }
        // Unchanged: nothing but the header and an empty list.
        let (base, _) = pair(1000, 1);
        let e = encode(Some(&base), &base, 2);
        assert_eq!((form(&e), e.len()), ("indices", HEADER));
        assert_eq!(decode(Some(base.to_vec()), &e).unwrap(), base);
        // No base: dense, decodable without one.
        let e = encode(None, &base, 2);
        assert_eq!(form(&e), "dense");
        assert_eq!(decode(None, &e).unwrap(), base);
    }

    #[test]
    fn another_base_or_damage_is_an_error() {
        let (base, new) = pair(1000, 10);
        let e = encode(Some(&base), &new, 2);
        let mut other = base.clone();
        other[3] ^= 1;
        assert!(matches!(decode(Some(other.to_vec()), &e), Err(DeltaError::OtherBase { .. })));
        assert!(matches!(decode(None, &e), Err(DeltaError::OtherBase { .. })));
        assert!(matches!(decode(Some(base[..10].to_vec()), &e), Err(DeltaError::OtherBase { .. })));
        for i in [0, 1, 5, 20, HEADER, HEADER + 3, e.len() - 1] {
            let mut bad = e.clone();
            bad[i] ^= 0x10;
            assert!(decode(Some(base.to_vec()), &bad).is_err(), "byte {i} flipped");
        }
        assert!(decode(Some(base.to_vec()), &e[..e.len() - 1]).is_err());
        assert!(decode(Some(base.to_vec()), &e[..5]).is_err());
    }

    proptest! {
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
            prop_assert_eq!(decode(Some(base.to_vec()), &e).unwrap(), new);
        }
    }
}
