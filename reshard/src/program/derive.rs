//! Deriving rank programs from a plan: [`Programs`] indexes a plan's
//! transfers by rank and builds any one rank's [`RankProgram`] from its
//! transfers and holdings; [`Plan::programs`] builds them all.

use super::{span_in, LocalCopy, Message, Pieces, RankProgram, RecvPiece, Round, SendPiece, Span};
use crate::block::Block;
use crate::dtype::DType;
use crate::layout::{BufferKey, BufferSpec, Layout, Loc, Rank};
use crate::plan::{fingerprint, Endpoint, Group, Plan, PlanError, Transfer};
use crate::quant;
use crate::route::{self, scale_block, Route};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Derives rank programs from one plan, one rank at a time: built once
/// per plan (it checks the layouts are the plan's and indexes the transfers
/// by rank), it makes any rank's program from that rank's transfers and
/// holdings alone, so a coordinator can hand programs out one by one
/// without ever holding all of them.
pub struct Programs<'a> {
    plan: &'a Plan,
    src: &'a Layout,
    dst: &'a Layout,
    /// Per endpoint (sources, then destinations): indices of the transfers
    /// it sends, receives or copies, ascending.
    by_endpoint: Vec<Vec<u32>>,
}

impl<'a> Programs<'a> {
    /// Prepares to derive `plan`'s programs. Fails if the layouts are not
    /// the plan's.
    pub fn new(plan: &'a Plan, src: &'a Layout, dst: &'a Layout) -> Result<Programs<'a>, PlanError> {
        let fp = fingerprint(src, dst, &plan.options, plan.strategy);
        if fp != plan.fingerprint {
            return Err(PlanError::FingerprintMismatch { plan: plan.fingerprint, layouts: fp });
        }
        let n_src = src.ranks() as usize;
        let mut by_endpoint: Vec<Vec<u32>> = vec![Vec::new(); n_src + dst.ranks() as usize];
        let idx = |e: Endpoint| match e.group {
            Group::Src => e.rank as usize,
            Group::Dst => n_src + e.rank as usize,
        };
        for (i, t) in plan.transfers.iter().enumerate() {
            by_endpoint[idx(t.from)].push(i as u32);
            if t.to != t.from {
                by_endpoint[idx(t.to)].push(i as u32);
            }
        }
        Ok(Programs { plan, src, dst, by_endpoint })
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
        let mut mine = self.by_endpoint[slot].clone();
        // Stable: transfers of one tensor stay in plan order.
        mine.sort_by_key(|&i| plan.pieces[plan.transfers[i as usize].piece as usize].dst_tensor);
        let mut side = Side::new(layout, e.rank);
        let mut sends: Builder<SendPiece> = BTreeMap::new();
        let mut recvs: Builder<RecvPiece> = BTreeMap::new();
        let mut locals: BTreeMap<u32, Pieces<LocalCopy>> = BTreeMap::new();
        // Source tensors this rank quantizes before sending: their
        // blocks' extent and which of its distinct boxes of them it sends
        // from (only those are quantized).
        let mut quantized_here: BTreeMap<u32, (Vec<u64>, BTreeSet<u32>)> = BTreeMap::new();
        let mut k = 0;
        while k < mine.len() {
            let td = plan.pieces[plan.transfers[mine[k] as usize].piece as usize].dst_tensor;
            let end =
                k + mine[k..].iter().take_while(|&&i| plan.pieces[plan.transfers[i as usize].piece as usize].dst_tensor == td).count();
            let ts = plan.pieces[plan.transfers[mine[k] as usize].piece as usize].src_tensor;
            // This rank's tensor, and its holdings of it.
            let tensor = if e.group == Group::Src { ts } else { td };
            // Values leave in the source's dtype and arrive in the one the
            // plan delivers (a block-scaled tensor's, unquantized).
            let (src_dtype, dst_dtype) = plan.wire[td as usize];
            let dtype_of = |g: Group| if g == Group::Src { src_dtype } else { dst_dtype };
            let my_dtype = dtype_of(e.group);
            let route = plan.routes[td as usize];
            let mut quantizing = None;
            let held = match e.group {
                Group::Src => {
                    let block = scale_block(self.dst, td);
                    if let (Route::QuantizedAtSource | Route::ScalesFromSource, Some(b)) = (route, block) {
                        side.source_quantized(tensor, b);
                        quantizing = Some(&mut quantized_here.entry(tensor).or_insert_with(|| (b.to_vec(), BTreeSet::new())).1);
                    }
                    route::rank_offered(layout, tensor, e.rank, route, block)
                }
                Group::Dst => {
                    if route == Route::QuantizedAtDestination {
                        side.staged(tensor, my_dtype);
                    }
                    route::rank_delivered(layout, tensor, e.rank, route)
                }
            };
            for &ti in &mine[k..end] {
                let t: &Transfer = &plan.transfers[ti as usize];
                let piece = plan.pieces[t.piece as usize].block;
                let scratch = plan.scratch_blocks.get(td as usize).copied().unwrap_or(piece);
                let span_here = |side: &mut Side<'_>, from_scratch: bool| -> Vec<Span> {
                    if from_scratch {
                        let b = side.scratch(tensor, &scratch, my_dtype);
                        vec![span_in(b, &scratch, 0, &piece)]
                    } else {
                        side.spans(&held, &piece)
                    }
                };
                if t.from == e {
                    // (The boxes offered for codes and for scales are the
                    // rank's distinct boxes in one order.)
                    if let Some(sent) = quantizing.as_mut() {
                        sent.extend(held.iter().position(|(b, _)| b.contains(&piece)).map(|i| i as u32));
                    }
                    let from = match span_here(&mut side, t.from_scratch).first() {
                        Some(s) => *s,
                        None => unreachable!("planner chose {} which does not hold {piece}", t.from),
                    };
                    if t.to == e {
                        let to = span_here(&mut side, t.to_scratch);
                        locals.entry(t.round).or_default().push(&LocalCopy {
                            block: piece,
                            from,
                            from_dtype: my_dtype,
                            to,
                            to_dtype: my_dtype,
                        });
                        continue;
                    }
                    let wire = plan.transfer_wire_dtype(t);
                    sends.entry((t.round, t.to)).or_default().push(&SendPiece { block: piece, span: from, dtype: my_dtype, wire });
                } else {
                    let spans = span_here(&mut side, t.to_scratch);
                    let wire = plan.transfer_wire_dtype(t);
                    recvs.entry((t.round, t.from)).or_default().push(&RecvPiece { block: piece, spans, wire, dtype: dtype_of(t.to.group) });
                }
            }
            k = end;
        }
        // Pieces were pushed one by one: keep only the words they take.
        let mut rounds: Vec<Round> = vec![Round::default(); plan.figures.rounds as usize];
        for ((r, peer), mut pieces) in sends {
            pieces.shrink_to_fit();
            rounds[r as usize].sends.push(Message { peer, pieces });
        }
        for ((r, peer), mut pieces) in recvs {
            pieces.shrink_to_fit();
            rounds[r as usize].recvs.push(Message { peer, pieces });
        }
        // A rank sends a round's messages one after another, in peer order;
        // if every rank began with the lowest peer, every sender would feed
        // the first destination node's links first and leave the others
        // idle. Each rank starts at another peer instead (its rank, modulo
        // its peers), so the senders of a round spread over the receivers.
        for round in &mut rounds {
            let n = round.sends.len();
            if n > 1 {
                round.sends.rotate_left(e.rank as usize % n);
            }
        }
        for (r, mut l) in locals {
            l.shrink_to_fit();
            rounds[r as usize].locals = l;
        }
        let carried = match (&plan.options().only, e.group) {
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
        };
        let mut quantize = Vec::new();
        for (ts, (block, sent)) in &quantized_here {
            quantize.extend(route::source_quantize_op(layout, *ts, e.rank, block, sent, &|key| side.index.get(&key).copied()));
        }
        if e.group == Group::Dst {
            let mask = plan.options().only.as_ref().and_then(|only| only.mask(layout).ok());
            for t in 0..layout.tensors().len() as u32 {
                if plan.routes[t as usize] != Route::QuantizedAtDestination || mask.as_ref().is_some_and(|m| !m[t as usize]) {
                    continue;
                }
                let dtype = plan.wire[t as usize].1;
                side.staged(t, dtype);
                quantize.extend(quant::quantize_op(layout, t, e.rank, dtype, &|key| side.index.get(&key).copied()));
            }
        }
        RankProgram { endpoint: e, fingerprint: plan.fingerprint, buffers: side.buffers, rounds, carried, quantize }
    }
}

/// One rank's buffers while its program is derived: the layout's, then
/// scratch buffers as the program needs them.
struct Side<'a> {
    layout: &'a Layout,
    rank: Rank,
    buffers: Vec<BufferSpec>,
    index: HashMap<BufferKey, u32>,
}

impl<'a> Side<'a> {
    fn new(layout: &'a Layout, rank: Rank) -> Side<'a> {
        let buffers = layout.rank_buffers(rank);
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
    fn spans(&self, held: &[(Block, Loc)], piece: &Block) -> Vec<Span> {
        held.iter().filter(|(b, _)| b.contains(piece)).map(|(b, l)| span_in(self.index[&l.buffer], b, l.at, piece)).collect()
    }
}

type Builder<P> = BTreeMap<(u32, Endpoint), Pieces<P>>;

impl Plan {
    /// Builds every rank's program: source ranks first (by rank), then
    /// destination ranks. Fails if the layouts are not the plan's. Holds
    /// them all at once; see [`Programs`] to derive them one by one.
    pub fn programs(&self, src: &Layout, dst: &Layout) -> Result<Vec<RankProgram>, PlanError> {
        let p = Programs::new(self, src, dst)?;
        Ok(p.endpoints().map(|e| p.program(e)).collect())
    }
}
