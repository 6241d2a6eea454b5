//! Delta messages: a message's bytes sent as what changed since the same
//! message of an earlier refit, which sender and receiver both kept.
//!
//! Sans-I/O: [`encode`] compares a message's packed bytes with the base
//! (the bytes of the same message in the base refit) in units of `unit`
//! bytes (the smallest element size among its pieces, so a unit never
//! straddles two elements) and writes the shorter of two forms; [`decode`]
//! rebuilds the whole message from the base and the encoding, so the
//! receiver unpacks a dense message as always and every destination element
//! is written, changed or not.
//!
//! Encoding: a 26-byte header — `form` (u8: 0 dense, 4 blocks), `unit`
//! (u8), `units` (u64: message length / unit), the base's name (u32), the
//! result's name (u32), payload length (u64) — then
//! - dense: the message's bytes;
//! - blocks (`blocks.rs`): per block of 4096 units, the positions of its
//!   changed units as a bitmap or as Rice-coded gaps, whichever suits its
//!   density, then the changed units' bytes in order.
//!
//! For positions spread like independent draws, a message in which a
//! fraction `p` of its `n` units changed takes about `n·H(p)` bits of
//! positions plus the changed values where changes are sparse (gaps), and
//! `n` bits plus the values where they are dense (a bitmap, at most
//! 125% of the block's information: coded at memory speed).
//! The encoder never writes more than the dense form.
//!
//! **Names.** A message's *name* identifies its bytes to both ends: a
//! dense message's is its CRC-32C; a delta's is the CRC-32C of its
//! payload appended to its base's name (a chain rooted in a dense
//! message's CRC). The header carries the base's name and the result's:
//! a receiver holding another base is refused (`OtherBase`), and an
//! encoding damaged on the way is refused before it is applied (its
//! payload does not give the result's name: `Corrupt`) — never wrong
//! weights. Naming a delta by its payload, not by the whole message's
//! CRC, spares both ends a pass over every byte: the encoder reads the
//! message once (the compare), the decoder patches the changed units
//! only.
//!
//! All integers little-endian.
//!
//! A delta run keeps each message it moved with its name
//! ([`KeptMessage`]) and codes the next refit's on it ([`encode_kept`],
//! [`decode_kept`]). The encoder finds the changed units 64 at a time
//! (vector compares into masks, a block of masks at a time:
//! `compare.rs`) and codes each block as it is compared; the values of
//! 2-byte units move eight at a time through byte shuffles (`pack.rs`).

mod blocks;
mod compare;
mod pack;
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

/// A message's packed bytes as a refit moved them, with their name (see
/// the module doc: their CRC-32C where they came dense, chained from
/// their base's where they came as a delta), which the next delta refit
/// names its base by.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeptMessage {
    /// The bytes.
    pub(crate) bytes: Vec<u8>,
    /// Their name.
    pub(crate) crc: u32,
}

impl KeptMessage {
    /// `bytes` kept as a dense message would be: named by their CRC-32C.
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
/// (Forms 1 to 3, a bitmap, an index list and gaps over the whole
/// message, were this module's before the blocks form; no longer written
/// or read.)
const BLOCKS: u8 = 4;

/// Why an encoding could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeltaError {
    /// The bytes are not an encoding this module writes.
    #[error("malformed delta message: {0}")]
    Malformed(String),
    /// The receiver's base is not the one the sender encoded against.
    #[error("delta message against another base (its name {want:08x}, this rank's {have:08x})")]
    OtherBase {
        /// The sender's base CRC.
        want: u32,
        /// The receiver's.
        have: u32,
    },
    /// The encoding is not the one the sender wrote (damaged on the way).
    #[error("delta message damaged (it names its result {want:08x}, its bytes give {got:08x})")]
    Corrupt {
        /// The result's name in the header.
        want: u32,
        /// The name the bytes received give.
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
/// dense), a base named by its CRC-32C (as a dense message is). `unit` is
/// 1, 2, 4 or 8 and divides `new.len()`; a base of another length than
/// `new` is ignored (dense).
///
/// Memory: one output buffer of [`HEADER`] plus `new.len()` bytes (its
/// pages zeroed by the system as first written: a short encoding touches
/// few), nothing else. One pass compares and writes the blocks form, its
/// stream from the front and the values behind it; where it does not come
/// out shorter than the message, the dense form is written into the same
/// buffer.
pub fn encode(base: Option<&[u8]>, new: &[u8], unit: usize) -> Vec<u8> {
    encode_on(base.map(|b| (b, crc32c::crc32c(b))), new, unit).0
}

/// [`encode`] on a base kept with its name, as a delta run keeps it: the
/// encoding and the name of `new`, to keep it with.
pub fn encode_kept(base: Option<&KeptMessage>, new: &[u8], unit: usize) -> (Vec<u8>, u32) {
    encode_on(base.map(|k| (&k.bytes[..], k.crc)), new, unit)
}

/// [`encode`] on `(base, its name)`: the encoding and the name of `new`.
fn encode_on(base: Option<(&[u8], u32)>, new: &[u8], unit: usize) -> (Vec<u8>, u32) {
    let unit = unit_for(new.len() as u64, unit);
    let units = (new.len() / unit) as u64;
    let mut out = vec![0u8; HEADER + new.len()];
    huge_pages(&mut out);
    let base = base.filter(|(b, _)| b.len() == new.len());
    if let Some((base, base_name)) = base {
        let changes = compare::Changes { base, new, unit };
        let body = &mut out[HEADER..];
        let payload = match unit {
            1 => blocks::write::<1>(&changes, body),
            2 => blocks::write::<2>(&changes, body),
            4 => blocks::write::<4>(&changes, body),
            _ => blocks::write::<8>(&changes, body),
        };
        if let Some(payload) = payload.filter(|&p| p < new.len()) {
            let name = chain(base_name, &out[HEADER..HEADER + payload]);
            return (finish(out, (BLOCKS, unit, units), (base_name, name), payload), name);
        }
    }
    let name = crc32c::crc32c(new);
    out[HEADER..].copy_from_slice(new);
    let base_name = base.map_or(0, |(_, n)| n);
    (finish(out, (DENSE, unit, units), (base_name, name), new.len()), name)
}

/// Asks the system to back `buf`'s whole pages with huge pages where it
/// can (an output buffer the size of the message, of which an encoding
/// touches a part: fewer, larger page faults).
fn huge_pages(buf: &mut [u8]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        if buf.len() < 2 * HUGE {
            return;
        }
        let start = buf.as_mut_ptr() as usize;
        let first = start.next_multiple_of(4096);
        let len = (start + buf.len() - first) / 4096 * 4096;
        // SAFETY: advice over whole pages inside `buf` (its start rounded
        // up to a page, its end down; `buf` is at least 4 MiB, so the
        // range is inside it and not empty), which this function borrows
        // mutably: it changes no byte and no mapping, only how the system
        // backs the pages. On failure (an old kernel, no huge pages) it
        // changes nothing and the result is ignored.
        unsafe {
            libc::madvise(first as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
    }
}

/// The name of a delta's result: its payload's CRC-32C appended to its
/// base's name.
fn chain(base_name: u32, payload: &[u8]) -> u32 {
    crc32c::crc32c_append(base_name, payload)
}

/// `out` with its header written and cut to the header and `payload`.
fn finish(mut out: Vec<u8>, (form, unit, units): (u8, usize, u64), (base_name, name): (u32, u32), payload: usize) -> Vec<u8> {
    out[..HEADER].copy_from_slice(&header(form, unit, units, base_name, name, payload as u64));
    out.truncate(HEADER + payload);
    out
}

/// The form of an encoding, as a word (for reports): "dense", "blocks".
pub fn form(encoded: &[u8]) -> &'static str {
    match encoded.first() {
        Some(&DENSE) => "dense",
        Some(&BLOCKS) => "blocks",
        _ => "unknown",
    }
}

pub(super) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or([0; 4]))
}

pub(super) fn u64_at(b: &[u8], at: usize) -> u64 {
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
    let base = base.map(KeptMessage::new);
    decode_kept(base, encoded, unit, len).map(|kept| kept.bytes)
}

/// [`decode`] on a base kept with its name, as a delta run keeps it: the
/// rebuilt message, kept with its name.
pub fn decode_kept(base: Option<KeptMessage>, encoded: &[u8], unit: usize, len: u64) -> Result<KeptMessage, DeltaError> {
    let bad = |why: String| DeltaError::Malformed(why);
    check_encoded_len(encoded.len() as u64, len)?;
    if encoded.len() < HEADER {
        return Err(bad("shorter than its header".into()));
    }
    let (form, unit_got) = (encoded[0], encoded[1] as usize);
    let (units, base_name, name, payload) = (u64_at(encoded, 2), u32_at(encoded, 10), u32_at(encoded, 14), u64_at(encoded, 18));
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
    match form {
        DENSE => {
            if body.len() != len {
                return Err(bad(format!("dense payload of {} bytes for a message of {len}", body.len())));
            }
            let got = crc32c::crc32c(body);
            if got != name {
                return Err(DeltaError::Corrupt { want: name, got });
            }
            Ok(KeptMessage { bytes: body.to_vec(), crc: name })
        }
        BLOCKS => {
            let base = base.ok_or(DeltaError::OtherBase { want: base_name, have: 0 })?;
            if base.bytes.len() != len || base.crc != base_name {
                return Err(DeltaError::OtherBase { want: base_name, have: base.crc });
            }
            let got = chain(base.crc, body);
            if got != name {
                return Err(DeltaError::Corrupt { want: name, got });
            }
            let mut out = base.bytes;
            match unit {
                1 => blocks::patch::<1>(&mut out, body)?,
                2 => blocks::patch::<2>(&mut out, body)?,
                4 => blocks::patch::<4>(&mut out, body)?,
                _ => blocks::patch::<8>(&mut out, body)?,
            }
            Ok(KeptMessage { bytes: out, crc: name })
        }
        _ => Err(bad(format!("unknown form {form}"))),
    }
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
    fn the_shorter_form_is_chosen_and_round_trips() {
        // (units, every k-th changed, form, most bytes as a share of dense)
        let cases = [
            (10_000, 50, "blocks", 0.04), // 2%: ~7 bits of gap + a 2-byte value per change
            (10_000, 8, "blocks", 0.20),  // 12.5%: a bit per unit (a bitmap) + the values
            (10_000, 3, "blocks", 0.40),  // 33%: a bit per unit + the values
            (10_000, 1, "dense", 1.0 + 30.0 / 20_000.0),
        ];
        for (n, every, want, share) in cases {
            let (base, new) = pair(n, every);
            let e = encode(Some(&base), &new, 2);
            assert_eq!(form(&e), want, "every {every}");
            assert!((e.len() as f64) <= share * new.len() as f64, "every {every}: {} of {}", e.len(), new.len());
            assert_eq!(decode(Some(base.to_vec()), &e, 2, new.len() as u64).unwrap(), new);
        }
        // Unchanged: the header, the payload's two counts, an empty stream.
        let (base, _) = pair(1000, 1);
        let e = encode(Some(&base), &base, 2);
        assert_eq!((form(&e), e.len()), ("blocks", HEADER + 16));
        assert_eq!(decode(Some(base.to_vec()), &e, 2, base.len() as u64).unwrap(), base);
        // No base: dense, decodable without one.
        let e = encode(None, &base, 2);
        assert_eq!(form(&e), "dense");
        assert_eq!(decode(None, &e, 2, base.len() as u64).unwrap(), base);
    }

    /// Spread changes cost near their information (positions' entropy
    /// plus values) where they are sparse, a bit per unit plus values where
    /// they are dense; a message with both codes each part as it suits.
    #[test]
    fn bytes_follow_the_information_in_the_change() {
        let n = 1 << 20;
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut draw = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let base: Vec<u8> = (0..2 * n).map(|i| (i * 31 % 253) as u8).collect();
        let h = |p: f64| -(p * p.log2() + (1.0 - p) * (1.0 - p).log2());
        for (p, most) in [(0.001f64, 1.2), (0.01, 1.06), (0.034, 1.05), (0.1, 1.2), (0.16, 1.15), (0.5, 1.05)] {
            let mut new = base.clone();
            let mut changed = 0usize;
            for u in 0..n {
                if draw() < p {
                    new[2 * u] ^= 0x81;
                    changed += 1;
                }
            }
            let e = encode(Some(&base), &new, 2);
            let bound = n as f64 * h(changed as f64 / n as f64) / 8.0 + 2.0 * changed as f64;
            let ratio = e.len() as f64 / bound;
            assert!(ratio <= most, "p {p}: {} bytes, {ratio:.3} of the bound", e.len());
            assert_eq!(decode(Some(base.clone()), &e, 2, 2 * n as u64).unwrap(), new, "p {p}");
        }
        // Half the message changed densely, half sparsely.
        let mut new = base.clone();
        for u in 0..n {
            if draw() < if u < n / 2 { 0.4 } else { 0.002 } {
                new[2 * u + 1] ^= 0x10;
            }
        }
        let e = encode(Some(&base), &new, 2);
        assert_eq!(decode(Some(base.clone()), &e, 2, 2 * n as u64).unwrap(), new);
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
        for i in 0..e.len() {
            let mut bad = e.clone();
            bad[i] ^= 0x10;
            assert!(decode(Some(base.to_vec()), &bad, 2, n).is_err(), "byte {i} flipped");
        }
        assert!(decode(Some(base.to_vec()), &e[..e.len() - 1], 2, n).is_err());
        assert!(decode(Some(base.to_vec()), &e[..5], 2, n).is_err());
        // A dense message damaged: its CRC says so.
        let mut d = encode(None, &new, 2);
        d[HEADER + 7] ^= 1;
        assert!(matches!(decode(None, &d, 2, n), Err(DeltaError::Corrupt { .. })));
    }

    /// A delta's name chains from its base's: the next delta on the
    /// result names it so, on both ends.
    #[test]
    fn kept_names_chain_from_refit_to_refit() {
        let (b0, b1) = pair(5000, 40);
        let mut b2 = b1.clone();
        b2[77] ^= 3;
        let kept0 = KeptMessage::new(b0.clone());
        let (e1, name1) = encode_kept(Some(&kept0), &b1, 2);
        let got1 = decode_kept(Some(kept0.clone()), &e1, 2, b1.len() as u64).unwrap();
        assert_eq!((&got1.bytes, got1.crc), (&b1, name1));
        let sent1 = KeptMessage { bytes: b1.clone(), crc: name1 };
        let (e2, name2) = encode_kept(Some(&sent1), &b2, 2);
        let got2 = decode_kept(Some(got1), &e2, 2, b2.len() as u64).unwrap();
        assert_eq!((&got2.bytes, got2.crc), (&b2, name2));
        // The same bytes under another name (kept from another chain): refused.
        assert!(matches!(decode_kept(Some(KeptMessage::new(b1.clone())), &e2, 2, b2.len() as u64), Err(DeltaError::OtherBase { .. })));
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
        // A form this module no longer writes.
        let mut old = e.clone();
        old[0] = 3;
        malformed(decode(Some(base[..1999].to_vec()), &old, 2, 1999), "unknown form 3");
    }

    /// A blocks encoding of `body` for a message of `units` bytes on
    /// `base`, correctly named (so that its claims are what is checked).
    fn blocks_of(base: &[u8], body: &[u8]) -> Vec<u8> {
        let name = chain(crc32c::crc32c(base), body);
        let mut e = header(BLOCKS, 1, base.len() as u64, crc32c::crc32c(base), name, body.len() as u64).to_vec();
        e.extend_from_slice(body);
        e
    }

    /// A payload: the stream's length, the changed units, the stream's
    /// bytes and the values.
    fn body(stream: u64, changed: u64, rest: &[u8]) -> Vec<u8> {
        let mut b = stream.to_le_bytes().to_vec();
        b.extend_from_slice(&changed.to_le_bytes());
        b.extend_from_slice(rest);
        b
    }

    /// A stream of `(value, bits)` fields, least significant bit first.
    fn stream(fields: &[(u64, u32)]) -> Vec<u8> {
        let (mut out, mut acc, mut bits) = (Vec::new(), 0u128, 0u32);
        for &(v, n) in fields {
            acc |= u128::from(v) << bits;
            bits += n;
            while bits >= 8 {
                out.push(acc as u8);
                acc >>= 8;
                bits -= 8;
            }
        }
        if bits > 0 {
            out.push(acc as u8);
        }
        out
    }

    #[test]
    fn claims_past_the_bytes_sent_are_refused() {
        let malformed = |r: Result<Vec<u8>, DeltaError>, what: &str| match r {
            Err(DeltaError::Malformed(m)) => assert!(m.contains(what), "{m}"),
            other => panic!("{what}: {other:?}"),
        };
        let base = vec![0u8; 64];
        let dec = |rest: &[u8], stream_len: u64, changed: u64| {
            decode(Some(base.clone()), &blocks_of(&base, &body(stream_len, changed, rest)), 1, 64)
        };
        // A billion changed units, one byte of values.
        malformed(dec(&[0, 7], 1, 1 << 30), "do not add up");
        // A stream longer than the bytes sent.
        malformed(dec(&[0, 7], 1 << 40, 1), "do not add up");
        malformed(dec(&[], 0, u64::MAX), "do not add up");
        // One changed unit: count 1, gaps with k 0, gap 3 (111 0).
        let one = stream(&[(1, 13), (0, 1), (0, 4), (0b0111, 4)]);
        let mut ok = one.clone();
        ok.push(9);
        let mut want = base.clone();
        want[3] = 9;
        assert_eq!(dec(&ok, one.len() as u64, 1).unwrap(), want);
        // A count above the block's units.
        let s = stream(&[(65, 13)]);
        malformed(dec(&[s.as_slice(), &[9]].concat(), s.len() as u64, 1), "block 0: 65 changed units of 64");
        // More changed units in a block than values sent.
        let s = stream(&[(2, 13), (0, 1), (0, 4), (0, 1), (0, 1)]);
        malformed(dec(&[s.as_slice(), &[9]].concat(), s.len() as u64, 1), "more changed units than values");
        // A Rice parameter above 12.
        let s = stream(&[(1, 13), (0, 1), (13, 4), (0, 1)]);
        malformed(dec(&[s.as_slice(), &[9]].concat(), s.len() as u64, 1), "a Rice parameter above 12");
        // A gap past the block (64 units: gap 64 with k 6 is 0 then 000000... = 1 0 + 64? use k 6: q 1).
        let s = stream(&[(1, 13), (0, 1), (6, 4), (0b01, 2), (0, 6)]);
        malformed(dec(&[s.as_slice(), &[9]].concat(), s.len() as u64, 1), "points past the block");
        // A bitmap marking two units for a count of one; one past the end.
        let s = stream(&[(1, 13), (1, 1), (0, 2), (0b11, 64)]);
        malformed(dec(&[s.as_slice(), &[9]].concat(), s.len() as u64, 1), "another count of units");
        // Bits left after the last block.
        let s = [one.as_slice(), &[0xff]].concat();
        malformed(dec(&[s.as_slice(), &[9]].concat(), s.len() as u64, 1), "bits left in the stream");
        // Nothing changed, yet a stream.
        malformed(dec(&[0], 1, 0), "a stream for no changed unit");
        // Cut before its two counts.
        let e = blocks_of(&base, &[0; 5]);
        malformed(decode(Some(base.clone()), &e, 1, 64), "cut short");
    }

    #[test]
    fn a_bitmap_past_a_short_block_is_refused() {
        // 60 units: a bitmap of 8 bytes whose bit 62 is set.
        let base = vec![0u8; 60];
        let s = stream(&[(1, 13), (1, 1), (0, 2), (1 << 62, 64)]);
        let e = blocks_of(&base, &body(s.len() as u64, 1, &[s.as_slice(), &[9]].concat()));
        match decode(Some(base.clone()), &e, 1, 60) {
            Err(DeltaError::Malformed(m)) => assert!(m.contains("past the block"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    /// A peer's blocks body on bf16 units, where the decoder spreads
    /// values eight at a time (byte shuffles): a bitmap block whose
    /// values are one short, whose bitmap marks more than its count, or
    /// that claims more values than were sent, is refused before a value
    /// is spread; an honest one is applied exactly.
    #[test]
    fn lying_bitmap_blocks_on_the_vector_path_are_refused() {
        let units = 4096usize;
        let base: Vec<u8> = (0..2 * units).map(|i| (i * 13 % 251) as u8).collect();
        let dec = |count: u64, bits: &[u8], values: &[u8], changed: u64| {
            let mut fields = vec![(count, 13u32), (1, 1), (0, 2)];
            fields.extend(bits.iter().map(|&b| (u64::from(b), 8)));
            let s = stream(&fields);
            let body = body(s.len() as u64, changed, &[s.as_slice(), values].concat());
            let name = chain(crc32c::crc32c(&base), &body);
            let mut e = header(BLOCKS, 2, units as u64, crc32c::crc32c(&base), name, body.len() as u64).to_vec();
            e.extend_from_slice(&body);
            decode(Some(base.clone()), &e, 2, 2 * units as u64)
        };
        let malformed = |r: Result<Vec<u8>, DeltaError>, what: &str| match r {
            Err(DeltaError::Malformed(m)) => assert!(m.contains(what), "{m}"),
            other => panic!("{what}: {:?}", other.map(|v| v.len())),
        };
        // Every other unit marked (the shuffles' mixed case).
        let half = vec![0x55u8; units / 8];
        let n = units / 2;
        let values: Vec<u8> = (0..2 * n).map(|i| (i * 7 % 253) as u8).collect();
        // One value short (the header says so too): the sums disagree.
        malformed(dec(n as u64, &half, &values[..2 * n - 2], n as u64 - 1), "more changed units than values");
        // The bitmap marks 2048 units, its count says 2047.
        malformed(dec(n as u64 - 1, &half, &values[..2 * n - 2], n as u64 - 1), "another count of units");
        // The header claims more values than follow.
        malformed(dec(n as u64, &half, &values[..2 * n - 2], n as u64), "do not add up");
        // Honest: every marked unit takes its value, the others keep the base's.
        let mut want = base.clone();
        for (k, v) in values.chunks(2).enumerate() {
            want[4 * k..4 * k + 2].copy_from_slice(v);
        }
        assert_eq!(dec(n as u64, &half, &values, n as u64).unwrap(), want);
    }

    proptest! {
        /// Whatever a peer sends as a blocks body (named right): an error
        /// or a message, never a panic or an allocation past the message.
        #[test]
        fn any_blocks_body_is_decoded_or_refused(stream_len in 0u64..40, changed in 0u64..80, rest in proptest::collection::vec(any::<u8>(), 0..96)) {
            let base = vec![3u8; 64];
            let e = blocks_of(&base, &body(stream_len, changed, &rest));
            if let Ok(out) = decode(Some(base.clone()), &e, 1, 64) {
                prop_assert_eq!(out.len(), 64);
            }
        }

        #[test]
        fn any_change_round_trips(
            base in proptest::collection::vec(any::<u8>(), 0..9000),
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..300),
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
