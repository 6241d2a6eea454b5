//! Scratch buffers that need not exist.
//!
//! The gather-and-broadcast baseline sends a whole tensor to every rank that
//! holds any of it; each rank receives it into a scratch buffer and, in a
//! later round, copies its own slices out. On a rank that never sends from
//! that scratch buffer, the buffer only carries bytes from a receive to
//! local copies, so the copies can be made straight from the received data
//! and the buffer never allocated: a rank then holds its shards, not a
//! whole copy of the model. [`Bypass::of`] finds such buffers in a program;
//! the executor makes their copies on receipt and skips them in their own
//! round. The shards end up holding exactly what they would have.
//!
//! A scratch buffer is bypassed when all of these hold:
//! - no send reads it and no local copy writes it;
//! - every receive into it has one destination (in it);
//! - no two receives into it overlap;
//! - every local copy that reads it reads what receives of earlier rounds
//!   wrote (each part from the receive that wrote it), through the same
//!   strides, and keeps the buffer's type if the receive converted (so
//!   converting straight from the wire gives the same values).

use reshard::{Block, BufferKey, Endpoint, LocalCopy, LocalCopyView, Pieces, RankProgram, Span};
use std::collections::HashMap;

/// The local copies a received piece feeds, and which buffers are bypassed.
#[derive(Debug, Default)]
pub(crate) struct Bypass {
    /// Per buffer of the program: bypassed (never read or written).
    skipped: Vec<bool>,
    /// Per (round, sender): the copies made straight from that message's
    /// pieces, by piece (the piece of each, and the copies, packed).
    routes: HashMap<(u32, Endpoint), (Vec<u32>, Pieces<LocalCopy>)>,
    /// Per round: which of its local copies were made on receipt instead.
    early: HashMap<u32, Vec<bool>>,
}

/// A receive into a scratch buffer.
struct Write {
    buffer: u32,
    round: u32,
    peer: Endpoint,
    piece: u32,
    block: Block,
    span: Span,
    /// Whether the piece's type on the wire differs from the buffer's.
    converted: bool,
}

/// Most receives into one scratch buffer checked for overlaps (pairwise);
/// a buffer with more is kept.
const MAX_WRITES: usize = 64;

impl Bypass {
    /// The scratch buffers of `program` that need not exist, and what to do
    /// instead.
    pub(crate) fn of(program: &RankProgram) -> Bypass {
        let n = program.buffers.len();
        let scratch: Vec<bool> = program.buffers.iter().map(|b| matches!(b.key, BufferKey::Scratch { .. })).collect();
        if !scratch.contains(&true) {
            return Bypass { skipped: vec![false; n], ..Bypass::default() };
        }
        let mut ok = scratch.clone();
        let writes = ScratchWrites::of(program, &scratch, &mut ok);
        for (b, keep) in ok.iter_mut().enumerate() {
            let w = writes.of_buffer(b);
            if *keep
                && (w.len() > MAX_WRITES
                    || w.iter().enumerate().any(|(i, a)| w[i + 1..].iter().any(|c| a.block.intersect(&c.block).is_some())))
            {
                *keep = false;
            }
        }
        let mut feeds = feeds(program, &scratch, &mut ok, &writes);
        let mut bypass = Bypass { skipped: ok, ..Bypass::default() };
        // By message, then piece (stable: in program order within one).
        feeds.retain(|(_, _, w, _)| bypass.skipped[w.buffer as usize]);
        feeds.sort_by_key(|(_, _, w, _)| (w.round, w.peer, w.piece));
        for (round, local, w, copy) in feeds {
            let (pieces, copies) = bypass.routes.entry((w.round, w.peer)).or_default();
            pieces.push(w.piece);
            copies.push(&copy);
            let locals = program.rounds[round as usize].locals.len();
            bypass.early.entry(round).or_insert_with(|| vec![false; locals])[local as usize] = true;
        }
        for (pieces, copies) in bypass.routes.values_mut() {
            pieces.shrink_to_fit();
            copies.shrink_to_fit();
        }
        bypass
    }

    /// Whether buffer `b` is bypassed: it is never read or written, so it
    /// needs no memory.
    pub(crate) fn skips(&self, b: usize) -> bool {
        self.skipped.get(b).copied().unwrap_or(false)
    }

    /// The copies to make from the message from `peer` in `round`, as
    /// (piece, copy), by piece.
    pub(crate) fn routes(&self, round: u32, peer: Endpoint) -> impl Iterator<Item = (u32, LocalCopyView<'_>)> + '_ {
        self.routes.get(&(round, peer)).into_iter().flat_map(|(pieces, copies)| pieces.iter().copied().zip(copies.views()))
    }

    /// Per local copy of `round`, whether it was made on receipt (empty:
    /// none was).
    pub(crate) fn done_early(&self, round: u32) -> &[bool] {
        self.early.get(&round).map_or(&[], Vec::as_slice)
    }
}

/// The receives into scratch buffers that may be bypassed, by buffer.
struct ScratchWrites {
    /// Sorted by buffer (in program order within one).
    writes: Vec<Write>,
    /// Buffer `b`'s writes are `writes[first[b]..first[b + 1]]`.
    first: Vec<u32>,
}

impl ScratchWrites {
    /// Collects the receives into the scratch buffers of `program`
    /// (`scratch[b]`), clearing `ok[b]` for a buffer that a send reads, a
    /// local copy writes or a receive with several destinations fills.
    fn of(program: &RankProgram, scratch: &[bool], ok: &mut [bool]) -> ScratchWrites {
        let is_scratch = |b: u32| scratch.get(b as usize).copied().unwrap_or(false);
        let mut writes: Vec<Write> = Vec::new();
        for (r, round) in program.rounds.iter().enumerate() {
            for m in &round.sends {
                for p in m.pieces.views() {
                    let b = p.span().buffer;
                    if is_scratch(b) {
                        ok[b as usize] = false;
                    }
                }
            }
            for l in round.locals.views() {
                for to in l.to() {
                    if is_scratch(to.buffer) {
                        ok[to.buffer as usize] = false;
                    }
                }
            }
            for m in &round.recvs {
                for (i, p) in m.pieces.views().enumerate() {
                    let spans = p.spans().len();
                    for s in p.spans().filter(|s| is_scratch(s.buffer)) {
                        if spans != 1 {
                            ok[s.buffer as usize] = false;
                        } else if ok[s.buffer as usize] {
                            writes.push(Write {
                                buffer: s.buffer,
                                round: r as u32,
                                peer: m.peer,
                                piece: i as u32,
                                block: p.block(),
                                span: s,
                                converted: p.wire() != p.dtype(),
                            });
                        }
                    }
                }
            }
        }
        // By buffer (stable: in program order within one).
        writes.sort_by_key(|w| w.buffer);
        let n = scratch.len();
        let mut first = vec![0u32; n + 1];
        for w in &writes {
            first[w.buffer as usize + 1] += 1;
        }
        for b in 0..n {
            first[b + 1] += first[b];
        }
        ScratchWrites { writes, first }
    }

    /// The receives into buffer `b`.
    fn of_buffer(&self, b: usize) -> &[Write] {
        &self.writes[self.first[b] as usize..self.first[b + 1] as usize]
    }
}

/// The copies out of bypassable scratch buffers split by the receives
/// they read, as (round, local copy, receive, part of the copy). The
/// receives must cover each copy exactly (they do not overlap, so their
/// numbers of elements inside it add up to its own), each feeding its
/// part; a buffer with a copy that is not so covered is kept (`ok[b]`
/// cleared).
fn feeds<'w>(program: &RankProgram, scratch: &[bool], ok: &mut [bool], writes: &'w ScratchWrites) -> Vec<(u32, u32, &'w Write, LocalCopy)> {
    let is_scratch = |b: u32| scratch.get(b as usize).copied().unwrap_or(false);
    let mut feeds: Vec<(u32, u32, &Write, LocalCopy)> = Vec::new();
    for (r, round) in program.rounds.iter().enumerate() {
        for (li, l) in round.locals.views().enumerate() {
            let b = l.from().buffer as usize;
            if !is_scratch(b as u32) || !ok[b] {
                continue;
            }
            let l = l.get();
            let mut covered = 0u64;
            let before = feeds.len();
            for w in writes.of_buffer(b) {
                let Some(part) = w.block.intersect(&l.block) else { continue };
                // A piece converted on receipt feeds only copies that
                // keep the buffer's type: converting straight from the
                // wire then gives the same values.
                if w.round >= r as u32 || !same_place(w, &l.block, &l.from) || (w.converted && l.to_dtype != l.from_dtype) {
                    covered = u64::MAX;
                    break;
                }
                covered += part.numel();
                let part = LocalCopy {
                    block: part,
                    from: shifted(&l.from, &l.block, &part),
                    from_dtype: l.from_dtype,
                    to: l.to.iter().map(|t| shifted(t, &l.block, &part)).collect(),
                    to_dtype: l.to_dtype,
                };
                feeds.push((r as u32, li as u32, w, part));
            }
            if covered != l.block.numel() {
                feeds.truncate(before);
                ok[b] = false;
            }
        }
    }
    feeds
}

/// Whether `from` (a view of `block`) and what `w` wrote place the
/// tensor's elements alike in the buffer: same strides, same origin.
fn same_place(w: &Write, block: &Block, from: &Span) -> bool {
    let origin = |span: &Span, b: &Block| {
        let mut o = span.base as i128;
        for d in 0..b.ndim() {
            o -= b.offset()[d] as i128 * span.strides[d] as i128;
        }
        o
    };
    w.span.buffer == from.buffer && w.span.strides == from.strides && origin(&w.span, &w.block) == origin(from, block)
}

/// `span` (a view of `outer`) narrowed to `inner`, a block inside `outer`.
fn shifted(span: &Span, outer: &Block, inner: &Block) -> Span {
    let mut base = span.base;
    for d in 0..inner.ndim() {
        base += (inner.offset()[d] - outer.offset()[d]) * span.strides[d];
    }
    Span { base, ..*span }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{fill_sources, run_local, verify_destinations, ExecOptions, RankMemory};
    use reshard::{parse_layout, plan_baseline, plan_reshard, Group, Plan, PlanOptions};

    /// Runs `plan` with every bypassed buffer given no memory at all (any
    /// access would fail its bounds check), checks every destination
    /// element, and returns how many buffers were bypassed.
    fn run_bypassed(src: &reshard::Layout, dst: &reshard::Layout, plan: &Plan) -> usize {
        let programs = plan.programs(src, dst).unwrap();
        let mut memory = RankMemory::for_programs(&programs);
        let n_src = programs.iter().filter(|p| p.endpoint.group == Group::Src).count();
        fill_sources(src, &mut memory[..n_src]);
        let mut bypassed = 0;
        for (p, m) in programs.iter().zip(memory.iter_mut()) {
            let b = Bypass::of(p);
            for i in (0..p.buffers.len()).filter(|&i| b.skips(i)) {
                assert!(matches!(p.buffers[i].key, BufferKey::Scratch { .. }), "{}: buffer {i} is not scratch", p.endpoint);
                m.buffers[i] = Vec::new();
                bypassed += 1;
            }
        }
        run_local(&programs, &mut memory, &ExecOptions::default()).unwrap();
        verify_destinations(src, dst, &memory[n_src..]).unwrap();
        bypassed
    }

    /// Layout pairs of `examples/`, with a few staging caps: the baseline
    /// bypasses the scratch of ranks that only keep slices (and still
    /// delivers every element); the reshard has no scratch.
    #[test]
    fn slow_bypassed_scratch_is_never_touched() {
        let check = |name: &str, src: &str, dst: &str, want_some: bool| {
            let (src, dst) = (parse_layout(src).unwrap(), parse_layout(dst).unwrap());
            for cap in [1 << 20, 4096, 256] {
                let options = PlanOptions { max_staging_bytes: cap, ..PlanOptions::default() };
                let baseline = run_bypassed(&src, &dst, &plan_baseline(&src, &dst, &options).unwrap());
                assert_eq!(baseline > 0, want_some, "{name}, cap {cap}: {baseline} bypassed");
                assert_eq!(run_bypassed(&src, &dst, &plan_reshard(&src, &dst, &options).unwrap()), 0, "{name}, cap {cap}: reshard");
            }
        };
        check("mixed-2d", include_str!("../../examples/mixed-2d/src.json"), include_str!("../../examples/mixed-2d/dst.json"), true);
        check("tp-to-tp", include_str!("../../examples/tp-to-tp/src.json"), include_str!("../../examples/tp-to-tp/dst.json"), true);
        check("fused-qkv", include_str!("../../examples/fused-qkv/src.json"), include_str!("../../examples/fused-qkv/dst.json"), true);
        check("pp-to-tp", include_str!("../../examples/pp-to-tp/src.json"), include_str!("../../examples/pp-to-tp/dst.json"), true);
        check("fsdp-to-tp", include_str!("../../examples/fsdp-to-tp/src.json"), include_str!("../../examples/fsdp-to-tp/dst.json"), true);
        check("ep-moe", include_str!("../../examples/ep-moe/src.json"), include_str!("../../examples/ep-moe/dst.json"), true);
    }
}
