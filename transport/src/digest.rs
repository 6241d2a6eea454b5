//! Digests of what a refit moved, read back from a rank's memory after its
//! run, so the orchestrator can check, before anything commits, that every
//! piece a rank holds is what its sender sent ([`RankDigest`]).
//!
//! # What is hashed
//!
//! Every piece of every message, on both ends, as the values of its
//! *wire type* (the narrower of the two buffer types,
//! [`reshard::wire_dtype`]) in the piece's row-major order: CRC-32C of
//! those bytes. A sender reads its buffer and narrows where the wire is
//! narrower (the same kernel, [`reshard::convert_slice`], as its sends,
//! so the same bits). A receiver reads back what it holds: where its
//! buffer's type is the wire's, the bytes as they are; where it widened on
//! receipt, each element narrowed back, and checked to be the widening of
//! that narrowed value (bit for bit: a widening is exact, so only a value
//! that came from the wire passes; a NaN, which narrowing makes the quiet
//! NaN, is taken back to the wire NaN bf16 to f32 keeps whole; the other
//! widenings keep no NaN payload, so a piece holding such a NaN cannot be
//! compared and its sender is listed as unread). So equal hashes mean the receiver holds, bit for
//! bit, the values it was sent, in its own type.
//!
//! Each piece's CRC is keyed by what both ends know of it without talking
//! — sender, receiver, round, its index in the message, its element count
//! and wire type — and mixed through a bijection of 64 bits, so a piece
//! landing in another's place, or a changed CRC, changes its term. Terms
//! are summed (wrapping) per peer: sender and receiver need not agree on
//! an order, and relays need no special case (a relay's sends are read
//! back from what it received, and checked against its own upstream).
//!
//! A rank whose piece went to several places (a rank holding an element
//! twice) checks its copies agree; a rank's local copies (the baseline's
//! slices out of a broadcast) are checked against their source in the same
//! memory. Pieces received into scratch the executor bypassed (the
//! baseline's: copied out on receipt, never stored) cannot be read back:
//! their senders are listed as unread.
//!
//! Not covered: device memory (the communicator fabrics); what a
//! destination computes itself from verified bytes (block-scaled FP8
//! codes and scales quantized at the destination); bytes carried from the
//! served version (a subset refit's other tensors).

use crate::bypass::Bypass;
use crate::copy::{for_each_run, StridedRef};
use crate::memory::MemView;
use reshard::{convert_slice, wire_dtype, Block, DType, Endpoint, Group, RankProgram, Span, MAX_DIMS};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// What one rank's run moved, as hashes its peers' can be checked against
/// (see the module's documentation).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankDigest {
    /// The rank of the program that ran (a replica plan's, for a member
    /// standing in for one).
    pub rank: Endpoint,
    /// Per receiver: the sum of the terms of every piece this rank sent it,
    /// by receiver.
    pub sent: Vec<(Endpoint, u64)>,
    /// Per sender: the sum of the terms of every piece this rank received
    /// from it, as it holds it now, by sender (none for the senders in
    /// `unread`).
    pub held: Vec<(Endpoint, u64)>,
    /// Senders some of whose pieces this rank cannot read back (they went
    /// through bypassed scratch, or hold a NaN whose payload the
    /// widening on receipt did not keep).
    pub unread: Vec<Endpoint>,
    /// Bytes read to make the digest.
    pub bytes: u64,
}

/// Why a rank gave no digest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum DigestError {
    /// Its memory cannot be read back here (device memory, say): its
    /// pieces are not verified.
    #[error("not read back: {0}")]
    Unread(String),
    /// Its memory disagrees with itself: a piece's copies differ, a local
    /// copy differs from its source, an element is not the widening of a
    /// wire value, or a piece lies outside its buffer.
    #[error("{0}")]
    Inconsistent(String),
}

/// Elements converted at a time while hashing a run.
const CHUNK: usize = 1 << 14;

/// The digest of `program`'s last run on `mem` (after it succeeded).
///
/// # Safety
///
/// `mem` views the rank's buffers (as the run had them, scratch
/// included), each valid for reads of its length for the whole call and
/// written by nothing meanwhile.
pub(crate) unsafe fn rank_digest(program: &RankProgram, bypass: &Bypass, mem: &MemView) -> Result<RankDigest, DigestError> {
    let mut d = Digester {
        program,
        bypass,
        mem,
        reader: Reader::default(),
        sent: BTreeMap::new(),
        held: BTreeMap::new(),
        unread: Vec::new(),
        read: HashMap::new(),
    };
    for (r, round) in program.rounds.iter().enumerate() {
        let r = r as u32;
        // SAFETY: the caller's contract, passed on.
        unsafe {
            d.sends(r, round)?;
            d.recvs(r, round)?;
            d.locals(r, round)?;
        }
    }
    Ok(d.finish())
}

/// A rank's digest in the making ([`rank_digest`]), a round at a time.
struct Digester<'a> {
    program: &'a RankProgram,
    bypass: &'a Bypass,
    mem: &'a MemView,
    reader: Reader,
    /// Sum of the terms of what was sent to each peer.
    sent: BTreeMap<Endpoint, u64>,
    /// Sum of the terms of what is held from each peer.
    held: BTreeMap<Endpoint, u64>,
    /// Peers some of whose pieces are not read back.
    unread: Vec<Endpoint>,
    /// A piece sent to several peers (one leader per node that needs it)
    /// is read once.
    read: HashMap<(Span, [u64; MAX_DIMS], DType), u32>,
}

impl Digester<'_> {
    /// Buffer `b` as an error names it.
    fn name(&self, b: u32) -> String {
        self.program.buffers.get(b as usize).map_or_else(|| format!("#{b}"), |s| format!("'{}'", s.name))
    }

    /// The view of `span`, or an error naming the piece (`block`) that
    /// does not fit its buffer.
    fn strided(&self, span: &Span, dtype: DType, extent: &[u64], block: &dyn Fn() -> Block) -> Result<StridedRef, DigestError> {
        self.mem.strided(span, dtype, extent).ok_or_else(|| {
            DigestError::Inconsistent(format!(
                "{}: piece {} does not fit buffer {}",
                self.program.endpoint,
                block(),
                self.name(span.buffer)
            ))
        })
    }

    /// Adds round `r`'s sends to what each peer was sent.
    ///
    /// # Safety
    /// As for [`rank_digest`].
    unsafe fn sends(&mut self, r: u32, round: &reshard::Round) -> Result<(), DigestError> {
        let me = self.program.endpoint;
        for m in &round.sends {
            for (i, p) in m.pieces.views().enumerate() {
                let extent = p.extent();
                let mut dims = [0u64; MAX_DIMS];
                dims[..extent.len().min(MAX_DIMS)].copy_from_slice(&extent[..extent.len().min(MAX_DIMS)]);
                let crc = match self.read.get(&(p.span(), dims, p.wire())) {
                    Some(&crc) => crc,
                    None => {
                        let view = self.strided(&p.span(), p.dtype(), extent, &|| p.block())?;
                        self.reader.bytes += numel(extent) * p.dtype().size();
                        // SAFETY: in bounds (checked); valid and unwritten
                        // (the caller's contract).
                        let crc = unsafe { self.reader.crc(extent, &view, p.wire(), false) }.unwrap_or_default();
                        self.read.insert((p.span(), dims, p.wire()), crc);
                        crc
                    }
                };
                let sum = self.sent.entry(m.peer).or_insert(0);
                *sum = sum.wrapping_add(term(me, m.peer, r, i, numel(extent), p.wire(), crc));
            }
        }
        Ok(())
    }

    /// Adds round `r`'s receives to what is held from each peer (a peer
    /// with a piece not read back, to the unread).
    ///
    /// # Safety
    /// As for [`rank_digest`].
    unsafe fn recvs(&mut self, r: u32, round: &reshard::Round) -> Result<(), DigestError> {
        let me = self.program.endpoint;
        for m in &round.recvs {
            let mut sum = 0u64;
            let mut skipped = false;
            for (i, p) in m.pieces.views().enumerate() {
                // SAFETY: the caller's contract, passed on.
                match unsafe { self.received(m.peer, &p) }? {
                    Received::Skipped => skipped = true,
                    Received::Crc(Some(crc)) => sum = sum.wrapping_add(term(m.peer, me, r, i, numel(p.extent()), p.wire(), crc)),
                    Received::Crc(None) => {}
                }
            }
            if skipped {
                self.unread.push(m.peer);
            } else {
                let s = self.held.entry(m.peer).or_insert(0);
                *s = s.wrapping_add(sum);
            }
        }
        Ok(())
    }

    /// The CRC of a piece received from `peer`, read from every place it
    /// was unpacked to (they must agree), or that one of them is skipped
    /// (bypassed scratch, or NaN).
    ///
    /// # Safety
    /// As for [`rank_digest`].
    unsafe fn received(&mut self, peer: Endpoint, p: &reshard::RecvPieceView<'_>) -> Result<Received, DigestError> {
        let me = self.program.endpoint;
        let extent = p.extent();
        let mut first: Option<(u32, u32)> = None;
        let mut skipped = false;
        for span in p.spans() {
            if self.bypass.skips(span.buffer as usize) {
                skipped = true;
                continue;
            }
            let view = self.strided(&span, p.dtype(), extent, &|| p.block())?;
            // SAFETY: in bounds (checked); valid and unwritten (the
            // caller's contract).
            let crc = match unsafe { self.reader.crc(extent, &view, p.wire(), true) } {
                Ok(crc) => crc,
                Err(NotWire::Nan) => {
                    skipped = true;
                    continue;
                }
                Err(NotWire::Inexact(e)) => {
                    return Err(DigestError::Inconsistent(format!(
                        "{me}: buffer {}, piece {} from {peer}: element {e} of the piece is not a {} value widened to {}",
                        self.name(span.buffer),
                        p.block(),
                        p.wire(),
                        p.dtype()
                    )))
                }
            };
            self.reader.bytes += numel(extent) * p.dtype().size();
            match first {
                None => first = Some((span.buffer, crc)),
                Some((b, c)) if c != crc => {
                    return Err(DigestError::Inconsistent(format!(
                        "{me}: the copies of piece {} from {peer} in buffers {} and {} differ",
                        p.block(),
                        self.name(b),
                        self.name(span.buffer)
                    )))
                }
                Some(_) => {}
            }
        }
        Ok(if skipped { Received::Skipped } else { Received::Crc(first.map(|(_, crc)| crc)) })
    }

    /// Checks that round `r`'s local copies match their sources.
    ///
    /// # Safety
    /// As for [`rank_digest`].
    unsafe fn locals(&mut self, r: u32, round: &reshard::Round) -> Result<(), DigestError> {
        let me = self.program.endpoint;
        let early = self.bypass.done_early(r);
        for (i, l) in round.locals.views().enumerate() {
            if early.get(i).copied().unwrap_or(false) || self.bypass.skips(l.from().buffer as usize) {
                // Made on receipt from bypassed scratch: its sender is unread.
                continue;
            }
            let extent = l.extent();
            let wire = wire_dtype(l.from_dtype(), l.to_dtype());
            let from = self.strided(&l.from(), l.from_dtype(), extent, &|| l.block())?;
            // SAFETY: in bounds (checked); valid and unwritten (the
            // caller's contract).
            let want = unsafe { self.reader.crc(extent, &from, wire, false) }.unwrap_or_default();
            for to in l.to() {
                let view = self.strided(&to, l.to_dtype(), extent, &|| l.block())?;
                // SAFETY: as above.
                let got = unsafe { self.reader.crc(extent, &view, wire, true) };
                if got != Ok(want) {
                    return Err(DigestError::Inconsistent(format!(
                        "{me}: piece {} copied from buffer {} to buffer {} differs from its source",
                        l.block(),
                        self.name(l.from().buffer),
                        self.name(to.buffer)
                    )));
                }
            }
        }
        Ok(())
    }

    /// The digest: a peer some of whose pieces are unread has no
    /// comparable sum.
    fn finish(self) -> RankDigest {
        let Digester { program, reader, sent, mut held, mut unread, .. } = self;
        unread.sort_unstable();
        unread.dedup();
        held.retain(|peer, _| unread.binary_search(peer).is_err());
        RankDigest {
            rank: program.endpoint,
            sent: sent.into_iter().collect(),
            held: held.into_iter().collect(),
            unread,
            bytes: reader.bytes,
        }
    }
}

/// A received piece as read back.
enum Received {
    /// One of its places is not read back (bypassed scratch, or NaN).
    Skipped,
    /// Its CRC (`None`: it has no places).
    Crc(Option<u32>),
}

fn numel(extent: &[u64]) -> u64 {
    extent.iter().product()
}

/// SplitMix64's finaliser: a bijection of 64 bits that mixes every input
/// bit into every output bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn endpoint_word(e: Endpoint) -> u64 {
    let group = match e.group {
        Group::Src => 1u64,
        Group::Dst => 2,
    };
    (group << 32) | e.rank as u64
}

/// A piece's term: its CRC keyed by what both ends know of it. For a
/// given key, distinct CRCs give distinct terms (`mix` is a bijection).
fn term(from: Endpoint, to: Endpoint, round: u32, index: usize, numel: u64, wire: DType, crc: u32) -> u64 {
    let mut key = 0x7265_6669_745f_6467; // "refit_dg"
    for word in [endpoint_word(from), endpoint_word(to), round as u64, index as u64, numel, wire.index() as u64] {
        key = mix(key ^ word);
    }
    mix(key ^ crc as u64)
}

/// Reads pieces as CRCs of their wire values, with its conversion buffers.
#[derive(Default)]
struct Reader {
    wire: Vec<u8>,
    back: Vec<u8>,
    bytes: u64,
}

impl Reader {
    /// CRC-32C of the `extent` elements at `view` as values of `wire`, in
    /// row-major order. With `widened` (a receiver whose buffer's type is
    /// wider than the wire's), every element must also be the widening of
    /// its wire value; else the index of the first that is not.
    ///
    /// # Safety
    /// `view` must be in bounds and its memory valid for reads and not
    /// written for the duration of the call.
    unsafe fn crc(&mut self, extent: &[u64], view: &StridedRef, wire: DType, widened: bool) -> Result<u32, NotWire> {
        let from = view.dtype;
        let mut crc = 0u32;
        if from == wire {
            // SAFETY: the caller's contract.
            unsafe { for_each_run(extent, view, |run| crc = crc32c::crc32c_append(crc, run)) };
            return Ok(crc);
        }
        let (fs, ws) = (from.size() as usize, wire.size() as usize);
        let (mut at, mut bad) = (0u64, None);
        let Reader { wire: narrowed, back, .. } = self;
        // SAFETY: the caller's contract.
        unsafe {
            for_each_run(extent, view, |run| {
                for part in run.chunks(CHUNK * fs) {
                    let n = part.len() / fs;
                    narrowed.resize(n * ws, 0);
                    convert_slice(from, part, wire, narrowed);
                    if widened
                        && bad.is_none()
                        && (from, wire) != (DType::F32, DType::BF16)
                        && part.chunks_exact(fs).any(|e| is_nan(from, e))
                    {
                        // This widening keeps no NaN payload.
                        bad = Some(NotWire::Nan);
                    }
                    if widened && bad.is_none() {
                        back.resize(part.len(), 0);
                        convert_slice(wire, narrowed, from, back);
                        if back[..] != *part {
                            bad = exact_or_first_inexact(from, part, back, wire, narrowed).map(|e| match e {
                                NotWire::Inexact(i) => NotWire::Inexact(at + i),
                                nan => nan,
                            });
                        }
                    }
                    crc = crc32c::crc32c_append(crc, narrowed);
                    at += n as u64;
                }
            })
        };
        bad.map_or(Ok(crc), Err)
    }
}

/// Why a widened element is not read back as a wire value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NotWire {
    /// Element `0` of the piece is no widened wire value.
    Inexact(u64),
    /// A NaN whose wire value its widening did not keep (every pair but
    /// bf16 to f32 makes the NaN quiet or canonical): the piece cannot be
    /// compared.
    Nan,
}

/// Where an element of `got` (of type `dtype`, narrowed to `wire` in
/// `narrowed`) differs from the widening of its narrowing (`back`): a NaN
/// widened from bf16 to f32 is given the wire value it widens from
/// (narrowing gives the quiet NaN, whatever the payload; that widening
/// keeps it: sign, exponent, the top mantissa bits); a NaN of another pair
/// cannot be; any other element is inexact, the first one's index
/// returned.
fn exact_or_first_inexact(dtype: DType, got: &[u8], back: &[u8], wire: DType, narrowed: &mut [u8]) -> Option<NotWire> {
    let (size, ws) = (dtype.size() as usize, wire.size() as usize);
    for (i, (g, b)) in got.chunks_exact(size).zip(back.chunks_exact(size)).enumerate() {
        if g == b {
            continue;
        }
        if !is_nan(dtype, g) {
            return Some(NotWire::Inexact(i as u64));
        }
        if (dtype, wire) != (DType::F32, DType::BF16) {
            return Some(NotWire::Nan);
        }
        let bits = nan_narrowed(dtype, le_bits(g), wire).to_le_bytes();
        narrowed[i * ws..(i + 1) * ws].copy_from_slice(&bits[..ws]);
    }
    None
}

/// (exponent bits, mantissa bits) of a float type.
fn float_bits(dtype: DType) -> (u32, u32) {
    match dtype {
        DType::F64 => (11, 52),
        DType::F32 => (8, 23),
        DType::BF16 => (8, 7),
        DType::F16 => (5, 10),
        _ => (0, 0),
    }
}

/// The `narrow` NaN a widening to `wide` keeps as `bits`: its sign, an
/// exponent of all ones, the top mantissa bits.
fn nan_narrowed(wide: DType, bits: u64, narrow: DType) -> u64 {
    let ((_, mw), (en, mn)) = (float_bits(wide), float_bits(narrow));
    let sign = bits >> (wide.size() * 8 - 1) & 1;
    let mantissa = (bits & ((1u64 << mw) - 1)) >> (mw - mn);
    sign << (narrow.size() * 8 - 1) | ((1u64 << en) - 1) << mn | mantissa
}

fn le_bits(e: &[u8]) -> u64 {
    e.iter().rev().fold(0u64, |acc, &b| (acc << 8) | b as u64)
}

/// Whether the little-endian element `e` of `dtype` is a NaN.
fn is_nan(dtype: DType, e: &[u8]) -> bool {
    let bits = le_bits(e);
    match dtype {
        DType::F64 => f64::from_bits(bits).is_nan(),
        DType::F32 => f32::from_bits(bits as u32).is_nan(),
        DType::BF16 => (bits & 0x7fff) > 0x7f80,
        DType::F16 => (bits & 0x7fff) > 0x7c00,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RankMemory;
    use reshard::{parse_layout, plan_reshard, PlanOptions};

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn crc_of(bytes: &[u8], dtype: DType, wire: DType, widened: bool) -> Result<u32, NotWire> {
        let n = bytes.len() as u64 / dtype.size();
        // SAFETY: the view covers exactly `bytes`, alive and unwritten
        // for the call.
        let view = unsafe { StridedRef::new(bytes.as_ptr(), bytes.len(), 0, crate::packed_strides(&[n]), dtype) };
        unsafe { Reader::default().crc(&[n], &view, wire, widened) }
    }

    #[test]
    fn a_widened_value_reads_back_as_its_wire_value_and_anything_else_is_caught() {
        let values = [1.5f32, -0.0, 3.0e-3, 65504.0, f32::INFINITY];
        let mut wire = vec![0u8; values.len() * 2];
        convert_slice(DType::F32, &f32s(&values), DType::BF16, &mut wire);
        let mut widened = vec![0u8; values.len() * 4];
        convert_slice(DType::BF16, &wire, DType::F32, &mut widened);
        let sender = crc_of(&wire, DType::BF16, DType::BF16, false).unwrap();
        assert_eq!(crc_of(&widened, DType::F32, DType::BF16, true), Ok(sender));
        // A flipped low mantissa bit narrows back to the same bf16: the
        // exactness check names the element.
        let mut flipped = widened.clone();
        flipped[4 * 2] ^= 1;
        assert_eq!(crc_of(&flipped, DType::F32, DType::BF16, true), Err(NotWire::Inexact(2)));
        // A NaN narrows to the quiet NaN, whatever its payload: read back
        // as the wire value it widened from.
        for wire_nan in [0x7f81u16, 0xffc3, 0x7fc0] {
            let sent = crc_of(&wire_nan.to_le_bytes(), DType::BF16, DType::BF16, false).unwrap();
            let held = f32s(&[f32::from_bits((wire_nan as u32) << 16)]);
            assert_eq!(crc_of(&held, DType::F32, DType::BF16, true), Ok(sent), "{wire_nan:#x}");
        }
        let f16_nan = 0x7e01u16;
        let mut held = vec![0u8; 4];
        convert_slice(DType::F16, &f16_nan.to_le_bytes(), DType::F32, &mut held);
        // f16 to f32 keeps no payload: such a piece cannot be compared.
        assert_eq!(crc_of(&held, DType::F32, DType::F16, true), Err(NotWire::Nan));
        // A sender narrows without any such check.
        assert!(crc_of(&f32s(&values), DType::F32, DType::BF16, false).is_ok());
    }

    #[test]
    fn terms_depend_on_every_key_field_and_the_crc() {
        let (s, d) = (Endpoint { group: Group::Src, rank: 0 }, Endpoint { group: Group::Dst, rank: 1 });
        let base = term(s, d, 2, 3, 10, DType::BF16, 77);
        let others = [
            term(d, s, 2, 3, 10, DType::BF16, 77),
            term(s, Endpoint { group: Group::Dst, rank: 2 }, 2, 3, 10, DType::BF16, 77),
            term(s, d, 1, 3, 10, DType::BF16, 77),
            term(s, d, 2, 4, 10, DType::BF16, 77),
            term(s, d, 2, 3, 11, DType::BF16, 77),
            term(s, d, 2, 3, 10, DType::F32, 77),
            term(s, d, 2, 3, 10, DType::BF16, 78),
        ];
        assert!(others.iter().all(|&t| t != base));
    }

    /// Runs every rank of a plan in this process, then checks that each
    /// receiver's held sums equal its senders' sent sums, and that a byte
    /// flipped in one destination changes exactly that destination's sum
    /// from that sender.
    #[test]
    fn senders_and_receivers_agree_and_a_flipped_byte_shows() {
        let src = parse_layout(
            r#"{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [8, 6], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#,
        )
        .unwrap();
        let dst = parse_layout(
            r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [{"name": "w", "dtype": "bf16", "shape": [8, 6], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(1)"]}]}"#,
        )
        .unwrap();
        let plan = plan_reshard(&src, &dst, &PlanOptions::default()).unwrap();
        let programs = plan.programs(&src, &dst).unwrap();
        let mut memory = RankMemory::for_programs(&programs);
        for (p, m) in programs.iter().zip(memory.iter_mut()) {
            if p.endpoint.group == Group::Src {
                for b in m.buffers.iter_mut() {
                    let vals: Vec<f32> = (0..b.len() / 4).map(|i| i as f32 * 0.37 + p.endpoint.rank as f32).collect();
                    b.copy_from_slice(&f32s(&vals));
                }
            }
        }
        crate::run_local(&programs, &mut memory, &crate::ExecOptions::default()).unwrap();
        let digests = |memory: &mut Vec<RankMemory>| -> Vec<RankDigest> {
            programs
                .iter()
                .zip(memory.iter_mut())
                // SAFETY: our own buffers, alive and unwritten for the call.
                .map(|(p, m)| unsafe { rank_digest(p, &Bypass::of(p), &m.view()) }.unwrap())
                .collect()
        };
        let expected = |all: &[RankDigest], to: Endpoint| -> Vec<(Endpoint, u64)> {
            let mut v: Vec<(Endpoint, u64)> =
                all.iter().flat_map(|d| d.sent.iter().filter(|(r, _)| *r == to).map(move |(_, h)| (d.rank, *h))).collect();
            v.sort();
            v
        };
        let good = digests(&mut memory);
        for d in good.iter().filter(|d| d.rank.group == Group::Dst) {
            assert!(!d.held.is_empty() && d.unread.is_empty());
            assert_eq!(d.held, expected(&good, d.rank), "{}", d.rank);
        }
        // One byte of destination rank 3 flipped.
        let i = programs.iter().position(|p| p.endpoint == Endpoint { group: Group::Dst, rank: 3 }).unwrap();
        memory[i].buffers[0][5] ^= 0x10;
        let bad = digests(&mut memory);
        for d in bad.iter().filter(|d| d.rank.group == Group::Dst) {
            let matches = d.held == expected(&bad, d.rank);
            assert_eq!(matches, d.rank.rank != 3, "{}", d.rank);
        }
    }
}
