//! Deriving rank programs from a plan: [`Programs`] indexes a plan's
//! transfers by rank and builds any one rank's [`RankProgram`] from its
//! transfers and holdings; [`Plan::programs`] builds them all.

use super::pieces::Pack;
use super::{span_in, LocalCopy, Message, Pieces, RankProgram, RecvPiece, Round, SendPiece, Span};
use crate::block::Block;
use crate::dtype::DType;
use crate::fingerprint::FnvMap;
use crate::layout::{BufferKey, BufferSpec, Layout, Loc, Rank, RankHoldings};
use crate::plan::{expected_fingerprint, Endpoint, Group, Plan, PlanError, Transfer};
use crate::quant::{self, Quantize};
use crate::route::{self, scale_block, Route};
use std::collections::{BTreeMap, BTreeSet};

/// Derives rank programs from one plan, one rank at a time: built once
/// per plan (it checks the layouts are the plan's and indexes the transfers
/// by rank), it makes any rank's program from that rank's transfers and
/// holdings alone, so a coordinator can hand programs out one by one
/// without ever holding all of them.
pub struct Programs<'a> {
    plan: &'a Plan,
    src: &'a Layout,
    dst: &'a Layout,
    /// Per endpoint (sources, then destinations): the transfers it sends,
    /// receives or copies, each as (destination tensor, transfer index),
    /// ascending by index ([`program`](Self::program) walks them by
    /// tensor; the tensor beside the index spares a lookup in the plan per
    /// transfer).
    by_endpoint: Vec<Vec<(u32, u32)>>,
    /// Destination tensors the destination quantizes, ascending.
    quantized_at_destination: Vec<u32>,
}

impl<'a> Programs<'a> {
    /// Prepares to derive `plan`'s programs. Fails if the layouts are not
    /// the plan's.
    pub fn new(plan: &'a Plan, src: &'a Layout, dst: &'a Layout) -> Result<Programs<'a>, PlanError> {
        let fp = expected_fingerprint(plan, src, dst);
        if fp != plan.fingerprint {
            return Err(PlanError::FingerprintMismatch { plan: plan.fingerprint, layouts: fp });
        }
        let n_src = src.ranks() as usize;
        let mut by_endpoint: Vec<Vec<(u32, u32)>> = vec![Vec::new(); n_src + dst.ranks() as usize];
        let idx = |e: Endpoint| match e.group {
            Group::Src => e.rank as usize,
            Group::Dst => n_src + e.rank as usize,
        };
        // Each list sized once, then filled in plan order (each program
        // sorts its own list by tensor: in parallel, where programs are).
        let mut lengths = vec![0usize; by_endpoint.len()];
        for t in &plan.transfers {
            lengths[idx(t.from)] += 1;
            if t.to != t.from {
                lengths[idx(t.to)] += 1;
            }
        }
        for (list, n) in by_endpoint.iter_mut().zip(lengths) {
            list.reserve_exact(n);
        }
        for (i, t) in plan.transfers.iter().enumerate() {
            let d = plan.pieces.get(t.piece as usize).map_or(0, |p| p.dst_tensor);
            by_endpoint[idx(t.from)].push((d, i as u32));
            if t.to != t.from {
                by_endpoint[idx(t.to)].push((d, i as u32));
            }
        }
        let quantized_at_destination =
            (0..plan.routes.len() as u32).filter(|&t| plan.routes[t as usize] == Route::QuantizedAtDestination).collect();
        Ok(Programs { plan, src, dst, by_endpoint, quantized_at_destination })
    }

    /// Every endpoint of the plan: source ranks by rank, then destination ranks.
    pub fn endpoints(&self) -> impl Iterator<Item = Endpoint> {
        (0..self.src.ranks()).map(Endpoint::src).chain((0..self.dst.ranks()).map(Endpoint::dst))
    }

    /// The program of one rank. Sender and receiver of every message list
    /// its pieces in the same order (destination tensor, then transfer), so
    /// they agree without exchanging it.
    ///
    /// # Panics
    /// If `e` is not a rank of the plan's layouts.
    pub fn program(&self, e: Endpoint) -> RankProgram {
        let plan = self.plan;
        let (layout, slot) = match e.group {
            Group::Src => (self.src, e.rank as usize),
            Group::Dst => (self.dst, self.src.ranks() as usize + e.rank as usize),
        };
        // By destination tensor; transfers of one tensor in plan order.
        let mut mine = self.by_endpoint[slot].clone();
        mine.sort_unstable();
        // The rank's buffers and, from the same walk, its holdings.
        let (buffers, holdings) = layout.rank_buffers_and_holdings(e.rank, true);
        let mut d = Derivation {
            e,
            layout,
            side: Side::new(layout, e.rank, buffers),
            sends: Builder::new(),
            recvs: Builder::new(),
            locals: BTreeMap::new(),
            quantized_here: BTreeMap::new(),
            spans: Vec::new(),
        };
        let mut k = 0;
        while k < mine.len() {
            let td = mine[k].0;
            let end = k + mine[k..].iter().take_while(|&&(d, _)| d == td).count();
            self.tensor_pieces(&mut d, &holdings, td, &mine[k..end]);
            k = end;
        }
        let Derivation { mut side, sends, recvs, locals, quantized_here, .. } = d;
        let rounds = rounds_of(plan.figures.rounds, e.rank, (sends, recvs, locals));
        let carried = carried(plan, layout, e, &side);
        let quantize = self.quantize_steps(layout, e, &quantized_here, &mut side);
        RankProgram { endpoint: e, fingerprint: plan.fingerprint, buffers: side.buffers, rounds, carried, quantize }
    }

    /// Adds to `d` the pieces of destination tensor `td` the rank sends,
    /// receives or copies: `transfers`, its transfers of that tensor, in
    /// plan order.
    fn tensor_pieces(&self, d: &mut Derivation<'a>, holdings: &RankHoldings, td: u32, transfers: &[(u32, u32)]) {
        let (plan, e, layout) = (self.plan, d.e, d.layout);
        let ts = plan.pieces[plan.transfers[transfers[0].1 as usize].piece as usize].src_tensor;
        // This rank's tensor, and its holdings of it.
        let tensor = if e.group == Group::Src { ts } else { td };
        // Values leave in the source's dtype and arrive in the one the
        // plan delivers (a block-scaled tensor's, unquantized).
        let (src_dtype, dst_dtype) = plan.wire[td as usize];
        let dtype_of = |g: Group| if g == Group::Src { src_dtype } else { dst_dtype };
        let my_dtype = dtype_of(e.group);
        let route = plan.routes[td as usize];
        let mut quantizing = None;
        // Its holdings as the route sends or delivers them: the
        // layout's own (`rank_offered`'s and `rank_delivered`'s on
        // other routes), or those the route makes.
        let routed: Vec<(Block, Loc, u32)>;
        let held: &[(Block, Loc, u32)] = match e.group {
            Group::Src => {
                let block = scale_block(self.dst, td);
                if let (Route::QuantizedAtSource | Route::ScalesFromSource, Some(b)) = (route, block) {
                    d.side.source_quantized(tensor, b);
                    quantizing = Some(&mut d.quantized_here.entry(tensor).or_insert_with(|| (b.to_vec(), BTreeSet::new())).1);
                    routed = d.side.indexed(route::rank_offered(layout, tensor, e.rank, route, block));
                    &routed
                } else {
                    holdings.of(tensor)
                }
            }
            Group::Dst => {
                if route == Route::QuantizedAtDestination {
                    d.side.staged(tensor, my_dtype);
                    routed = d.side.indexed(route::rank_delivered(layout, tensor, e.rank, route));
                    &routed
                } else {
                    holdings.of(tensor)
                }
            }
        };
        let (side, spans) = (&mut d.side, &mut d.spans);
        for &(_, ti) in transfers {
            let t: &Transfer = &plan.transfers[ti as usize];
            let piece = &plan.pieces[t.piece as usize].block;
            let scratch = plan.scratch_blocks.get(td as usize).unwrap_or(piece);
            // The places on this rank that hold the piece, into `spans`
            // (reused: no allocation per piece).
            let span_here = |side: &mut Side<'_>, from_scratch: bool, spans: &mut Vec<Span>| {
                spans.clear();
                if from_scratch {
                    let b = side.scratch(tensor, scratch, my_dtype);
                    spans.push(span_in(b, scratch, 0, piece));
                } else {
                    spans.extend(Side::spans(held, piece));
                }
            };
            if t.from == e {
                // (The boxes offered for codes and for scales are the
                // rank's distinct boxes in one order.)
                if let Some(sent) = quantizing.as_mut() {
                    sent.extend(held.iter().position(|(b, ..)| b.contains(piece)).map(|i| i as u32));
                }
                span_here(side, t.from_scratch, spans);
                let from = match spans.first() {
                    Some(s) => *s,
                    None => unreachable!("planner chose {} which does not hold {piece}", t.from),
                };
                if t.to == e {
                    span_here(side, t.to_scratch, spans);
                    let copy = LocalCopy { block: *piece, from, from_dtype: my_dtype, to: std::mem::take(spans), to_dtype: my_dtype };
                    d.locals.entry(t.round).or_default().push(&copy);
                    *spans = copy.to;
                    continue;
                }
                let wire = plan.transfer_wire_dtype(t);
                d.sends.push((t.round, t.to), &SendPiece { block: *piece, span: from, dtype: my_dtype, wire });
            } else {
                span_here(side, t.to_scratch, spans);
                let wire = plan.transfer_wire_dtype(t);
                let recv = RecvPiece { block: *piece, spans: std::mem::take(spans), wire, dtype: dtype_of(t.to.group) };
                d.recvs.push((t.round, t.from), &recv);
                *spans = recv.spans;
            }
        }
    }

    /// The rank's quantize steps: a source's for the tensors it quantizes
    /// before sending (`quantized_here`: their blocks' extent and the boxes
    /// it sends from), a destination's for the tensors it quantizes after
    /// receiving (those its subset refit includes).
    fn quantize_steps(
        &self,
        layout: &Layout,
        e: Endpoint,
        quantized_here: &BTreeMap<u32, (Vec<u64>, BTreeSet<u32>)>,
        side: &mut Side<'_>,
    ) -> Vec<Quantize> {
        let mut quantize = Vec::new();
        for (ts, (block, sent)) in quantized_here {
            quantize.extend(route::source_quantize_op(layout, *ts, e.rank, block, sent, &|key| side.index.get(&key).copied()));
        }
        if e.group == Group::Dst {
            let mask = self.plan.options().only.as_ref().and_then(|only| only.mask(layout).ok());
            for &t in &self.quantized_at_destination {
                if mask.as_ref().is_some_and(|m| !m[t as usize]) {
                    continue;
                }
                let dtype = self.plan.wire[t as usize].1;
                side.staged(t, dtype);
                quantize.extend(quant::quantize_op(layout, t, e.rank, dtype, &|key| side.index.get(&key).copied()));
            }
        }
        quantize
    }
}

/// One rank's program while it is derived: its buffers, its messages and
/// local copies so far, and what it quantizes before sending.
struct Derivation<'a> {
    e: Endpoint,
    layout: &'a Layout,
    side: Side<'a>,
    sends: Builder<SendPiece>,
    recvs: Builder<RecvPiece>,
    locals: BTreeMap<u32, Pieces<LocalCopy>>,
    /// Source tensors this rank quantizes before sending: their
    /// blocks' extent and which of its distinct boxes of them it sends
    /// from (only those are quantized).
    quantized_here: BTreeMap<u32, (Vec<u64>, BTreeSet<u32>)>,
    /// Scratch: the spans of the piece at hand.
    spans: Vec<Span>,
}

/// The `rounds` rounds of rank `rank`'s program from its messages and local
/// copies.
fn rounds_of(
    rounds: u32,
    rank: Rank,
    (sends, recvs, locals): (Builder<SendPiece>, Builder<RecvPiece>, BTreeMap<u32, Pieces<LocalCopy>>),
) -> Vec<Round> {
    // Pieces were pushed one by one: keep only the words they take.
    let mut out: Vec<Round> = vec![Round::default(); rounds as usize];
    for ((r, peer), mut pieces) in sends.into_sorted() {
        pieces.shrink_to_fit();
        out[r as usize].sends.push(Message { peer, pieces });
    }
    for ((r, peer), mut pieces) in recvs.into_sorted() {
        pieces.shrink_to_fit();
        out[r as usize].recvs.push(Message { peer, pieces });
    }
    // A rank sends a round's messages one after another, in peer order;
    // if every rank began with the lowest peer, every sender would feed
    // the first destination node's links first and leave the others
    // idle. Each rank starts at another peer instead (its rank, modulo
    // its peers), so the senders of a round spread over the receivers.
    for round in &mut out {
        let n = round.sends.len();
        if n > 1 {
            round.sends.rotate_left(rank as usize % n);
        }
    }
    for (r, mut l) in locals {
        l.shrink_to_fit();
        out[r as usize].locals = l;
    }
    out
}

/// The buffers (indices into `side`'s) a destination rank `e` of a subset
/// refit carries over: those of the tensors the subset leaves out.
fn carried(plan: &Plan, layout: &Layout, e: Endpoint, side: &Side<'_>) -> Vec<u32> {
    match (&plan.options().only, e.group) {
        (Some(only), Group::Dst) => {
            // The plan was made with this subset, so it names only
            // tensors the layout has.
            let mask = only.mask(layout).unwrap_or_default();
            let mut carried: Vec<u32> = (0..layout.tensors().len() as u32)
                .filter(|&t| !mask.get(t as usize).copied().unwrap_or(false))
                .flat_map(|t| layout.rank_holdings(t, e.rank))
                .filter_map(|(_, loc)| side.index.get(&loc.buffer).copied())
                .collect();
            carried.sort_unstable();
            carried.dedup();
            carried
        }
        _ => Vec::new(),
    }
}

/// One rank's buffers while its program is derived: the layout's, then
/// scratch buffers as the program needs them.
struct Side<'a> {
    layout: &'a Layout,
    rank: Rank,
    buffers: Vec<BufferSpec>,
    index: FnvMap<BufferKey, u32>,
}

impl<'a> Side<'a> {
    fn new(layout: &'a Layout, rank: Rank, buffers: Vec<BufferSpec>) -> Side<'a> {
        let index = buffers.iter().enumerate().map(|(i, b)| (b.key, i as u32)).collect();
        Side { layout, rank, buffers, index }
    }

    fn scratch(&mut self, tensor: u32, block: &Block, dtype: DType) -> u32 {
        let key = BufferKey::Scratch { tensor };
        if let Some(&i) = self.index.get(&key) {
            return i;
        }
        let i = self.buffers.len() as u32;
        self.buffers.push(BufferSpec { key, name: self.layout.buffer_name(key), dtype, elems: block.numel() });
        self.index.insert(key, i);
        i
    }

    /// Adds, once, the buffer of block-scaled tensor `tensor`'s
    /// unquantized blocks on this rank (nothing for other tensors).
    fn staged(&mut self, tensor: u32, dtype: DType) {
        let key = BufferKey::Unquantized { tensor };
        if self.index.contains_key(&key) {
            return;
        }
        if let Some(spec) = quant::staged_buffer(self.layout, tensor, self.rank, dtype) {
            self.index.insert(key, self.buffers.len() as u32);
            self.buffers.push(spec);
        }
    }

    /// Adds, once, the buffers source tensor `tensor`'s codes and scales
    /// are quantized into on this rank (blocks of extent `block`).
    fn source_quantized(&mut self, tensor: u32, block: &[u64]) {
        let key = BufferKey::Quantized { tensor };
        if self.index.contains_key(&key) {
            return;
        }
        for spec in route::source_buffers(self.layout, tensor, self.rank, block).into_iter().flatten() {
            self.index.insert(spec.key, self.buffers.len() as u32);
            self.buffers.push(spec);
        }
    }

    /// Spans on this rank holding all of `piece`.
    fn spans<'h>(held: &'h [(Block, Loc, u32)], piece: &'h Block) -> impl Iterator<Item = Span> + 'h {
        held.iter().filter(|(b, ..)| b.contains(piece)).map(|&(ref b, l, i)| span_in(i, b, l.at, piece))
    }

    /// Holdings with the index of their buffers on this rank (which must
    /// be here).
    fn indexed(&self, held: Vec<(Block, Loc)>) -> Vec<(Block, Loc, u32)> {
        held.into_iter().map(|(b, l)| (b, l, self.index[&l.buffer])).collect()
    }
}

/// One rank's messages while its program is derived, by (round, peer):
/// the pieces of one message mostly come one after another, so the last
/// one used is at hand before any lookup.
struct Builder<P> {
    index: FnvMap<(u32, Endpoint), usize>,
    list: Vec<((u32, Endpoint), Pieces<P>)>,
    last: Option<((u32, Endpoint), usize)>,
}

impl<P: Pack> Builder<P> {
    fn new() -> Builder<P> {
        Builder { index: FnvMap::default(), list: Vec::new(), last: None }
    }

    /// Appends `piece` to the message of `key`.
    fn push(&mut self, key: (u32, Endpoint), piece: &P) {
        let i = match self.last {
            Some((k, i)) if k == key => i,
            _ => {
                let next = self.list.len();
                let i = *self.index.entry(key).or_insert(next);
                if i == next {
                    self.list.push((key, Pieces::new()));
                }
                self.last = Some((key, i));
                i
            }
        };
        self.list[i].1.push(piece);
    }

    /// The messages by round, then peer.
    fn into_sorted(self) -> Vec<((u32, Endpoint), Pieces<P>)> {
        let mut list = self.list;
        list.sort_unstable_by_key(|(k, _)| *k);
        list
    }
}

impl Plan {
    /// Builds every rank's program: source ranks first (by rank), then
    /// destination ranks. Fails if the layouts are not the plan's. Holds
    /// them all at once; see [`Programs`] to derive them one by one.
    pub fn programs(&self, src: &Layout, dst: &Layout) -> Result<Vec<RankProgram>, PlanError> {
        let p = Programs::new(self, src, dst)?;
        Ok(p.endpoints().map(|e| p.program(e)).collect())
    }
}
