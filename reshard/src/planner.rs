//! The reshard planner: intersect both layouts, send each destination node
//! exactly the union of what its ranks need, choose senders and relays with
//! the link model, fan out inside nodes.

use crate::block::Block;
use crate::cost::LinkModel;
use crate::dtype::{can_convert, wire_dtype, DType};
use crate::fingerprint::Fnv64;
use crate::layout::{Holding, Layout, Placement, Rank, TensorLayout};
use crate::overlap::{atomize, with_range, SourceIndex};
use crate::plan::{Budget, Endpoint, Group, Piece, Plan, PlanError, PlanOptions, PlanParts, SenderLists, Strategy, MAX_PIECES};
use crate::quant;
use crate::rebalance::rebalance;
use crate::route::{self, scale_block, QuantizeAt, Route};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{Hash, Hasher};

/// Matches destination tensors to source tensors and checks shapes and
/// dtypes; returns, per destination tensor, the source index and the
/// dtypes values leave and arrive in, and its [`Route`]. A block-scaled
/// tensor is quantized where `at` says if its source allows
/// ([`route::source_quantizable`]): at the source, codes travel (e4m3 to
/// e4m3) and its scale tensor is matched to the same source tensor (f32 to
/// f32); at the destination, its unquantized blocks arrive in
/// [`quant::staged_dtype`] and its scale tensor gets `None`: it is written
/// by the destination's quantization, never moved.
#[allow(clippy::type_complexity)]
pub(crate) fn match_tensors(
    src: &Layout,
    dst: &Layout,
    at: QuantizeAt,
) -> Result<(Vec<Option<(u32, DType, DType)>>, Vec<Route>), PlanError> {
    let mut routes = vec![Route::Plain; dst.tensors().len()];
    let mut matched = dst
        .tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if dst.scale_for(i as u32).is_some() {
                return Ok(None);
            }
            // Names are unique: layouts listing tensors in the same order
            // need no lookup.
            let si = match src.tensors().get(i) {
                Some(s) if s.name == t.name => i as u32,
                _ => src.tensor_index(&t.name).ok_or_else(|| PlanError::MissingTensor { tensor: t.name.clone() })?,
            };
            let s = &src.tensors()[si as usize];
            if s.shape != t.shape {
                return Err(PlanError::ShapeMismatch { tensor: t.name.clone(), src: s.shape.clone(), dst: t.shape.clone() });
            }
            if s.scale.is_some() {
                return Err(PlanError::ScaledSource { tensor: t.name.clone() });
            }
            if let Some((_, block)) = dst.scale_of(i as u32) {
                let staged = quant::staged_dtype(s.dtype).ok_or(PlanError::Quantize { tensor: t.name.clone(), from: s.dtype })?;
                if at == QuantizeAt::Source && route::source_quantizable(src, si, block) {
                    routes[i] = Route::QuantizedAtSource;
                    return Ok(Some((si, DType::F8E4M3, DType::F8E4M3)));
                }
                routes[i] = Route::QuantizedAtDestination;
                return Ok(Some((si, s.dtype, staged)));
            }
            if !can_convert(s.dtype, t.dtype) {
                return Err(PlanError::Conversion { tensor: t.name.clone(), from: s.dtype, to: t.dtype });
            }
            Ok(Some((si, s.dtype, t.dtype)))
        })
        .collect::<Result<Vec<_>, PlanError>>()?;
    // The scales of tensors quantized at the source travel from there too.
    for t in 0..matched.len() as u32 {
        if let (Route::QuantizedAtSource, Some((s, _))) = (routes[t as usize], dst.scale_of(t)) {
            let si = matched[t as usize].map(|m| m.0);
            matched[s as usize] = si.map(|si| (si, DType::F32, DType::F32));
            routes[s as usize] = Route::ScalesFromSource;
        }
    }
    Ok((matched, routes))
}

/// The dtypes per destination tensor of [`match_tensors`]'s result, as
/// [`Plan`] keeps them (a scale tensor, never moved, as its own f32).
pub(crate) fn wire_pairs(matched: &[Option<(u32, DType, DType)>]) -> Vec<(DType, DType)> {
    matched.iter().map(|m| m.map_or((DType::F32, DType::F32), |(_, s, d)| (s, d))).collect()
}

/// Sorted, deduplicated ranks holding any of `holdings[idx]`.
/// A hash over what makes a (source, destination) tensor pair placed alike
/// with another: the destination shape and both placements' geometry
/// (storage aside: own or fused buffers and offsets play no part in
/// which ranks exchange which blocks). Callers add what else they need to
/// agree (the dtypes) and compare with [`placed_alike`].
pub(crate) fn placement_key(st: &TensorLayout, dt: &TensorLayout) -> Fnv64 {
    let mut h = Fnv64::default();
    dt.shape.hash(&mut h);
    st.placement.hash_geometry(&mut h);
    dt.placement.hash_geometry(&mut h);
    h
}

/// Whether the pair (`rs`, `rd`) is placed like (`st`, `dt`) (see
/// [`placement_key`]).
pub(crate) fn placed_alike(st: &TensorLayout, dt: &TensorLayout, rs: &TensorLayout, rd: &TensorLayout) -> bool {
    rd.shape == dt.shape && rs.placement.same_geometry(&st.placement) && rd.placement.same_geometry(&dt.placement)
}

/// Whether destination tensors `a` and `b` are block-scaled alike: both
/// unscaled, or in blocks of one shape with their scales placed alike
/// (what, beside [`placed_alike`], decides where a plan delivers them).
pub(crate) fn scaled_alike(dst: &Layout, a: u32, b: u32) -> bool {
    match (dst.scale_of(a), dst.scale_of(b)) {
        (None, None) => true,
        (Some((sa, ba)), Some((sb, bb))) => {
            ba == bb && dst.tensors()[sa as usize].placement.same_geometry(&dst.tensors()[sb as usize].placement)
        }
        _ => false,
    }
}

/// Adds to `h` what [`scaled_alike`] compares.
pub(crate) fn hash_scale(dst: &Layout, t: u32, h: &mut Fnv64) {
    match dst.scale_of(t) {
        None => 0u8.hash(h),
        Some((s, block)) => {
            1u8.hash(h);
            block.hash(h);
            dst.tensors()[s as usize].placement.hash_geometry(h);
        }
    }
}

pub(crate) fn receivers_of(hd: &[Holding], idx: &[u32]) -> Vec<Rank> {
    let mut r: Vec<Rank> = idx.iter().flat_map(|&h| hd[h as usize].holders.iter().map(|l| l.rank)).collect();
    r.sort_unstable();
    r.dedup();
    r
}

/// Adds the bytes of `block` to every destination node among `ranks`.
pub(crate) fn add_node_needs(needs: &mut [u64], ranks: &[Rank], rpn: u32, bytes: u64) {
    let mut last = u32::MAX;
    for &r in ranks {
        let n = r / rpn;
        if n != last {
            needs[n as usize] += bytes;
            last = n;
        }
    }
}

/// The overlap of one tensor's placements: pieces (already split to fit the
/// staging cap) with ranges of receivers and candidate senders in the pool.
struct Template {
    src_tensor: u32,
    dst_tensor: u32,
    wire: DType,
    route: Route,
    pieces: Vec<TemplatePiece>,
    /// Deliveries of its pieces: each piece times its receivers.
    transfers: u64,
    unique_bytes: u64,
    needs: Vec<(u32, u64)>,
}

/// Computes the overlap of tensor `ts` of `src` with tensor `td` of `dst`.
fn overlap_template(
    src: &Layout,
    dst: &Layout,
    (ts, td): (u32, u32),
    (wire, route): (DType, Route),
    options: &PlanOptions,
    pool: &mut Vec<Rank>,
    budget: &mut Budget,
) -> Result<Template, PlanError> {
    // Expanding both placements costs a holding per rank of each.
    let places = |t: &TensorLayout| match &t.placement {
        Placement::Mesh(m) => m.ranks.len() as u64,
        Placement::Shards(s) => s.len() as u64,
    };
    let expand = places(&src.tensors()[ts as usize]).saturating_add(places(&dst.tensors()[td as usize]));
    budget.take(expand, || format!("tensor '{}': placed on {expand} ranks in all", dst.tensors()[td as usize].name))?;
    let mut hs = route::offered_holdings(src, ts, route, scale_block(dst, td));
    if !options.lost_sources.is_empty() {
        // What only lost sources hold is not covered (an error below).
        for h in &mut hs {
            h.holders.retain(|l| options.lost_sources.binary_search(&l.rank).is_err());
        }
        hs.retain(|h| !h.holders.is_empty());
    }
    let hd = route::delivered_holdings(dst, td, route);
    let index = SourceIndex::new(&hs);
    let max_elems = (options.max_staging_bytes / wire.size()).max(1);
    // Cells of an atom that holdings cut differently are sent by different
    // ranks only where each is at least the least part of a split.
    let min_cell = options.min_split_bytes.div_ceil(wire.size());
    let mut t =
        Template { src_tensor: ts, dst_tensor: td, wire, route, pieces: Vec::new(), transfers: 0, unique_bytes: 0, needs: Vec::new() };
    let name = || &dst.tensors()[td as usize].name;
    let mut needs = vec![0u64; dst.nodes() as usize];
    for atom in atomize(&hd) {
        let receivers = receivers_of(&hd, &atom.holdings);
        // Covering scans the source holdings in the atom's window, then
        // compares each cover with each holding overlapping the atom.
        let window = index.window(&atom.block) as u64;
        budget.take(window.saturating_add(receivers.len() as u64), || {
            format!("tensor '{}': a part held by {} ranks, among {window} source blocks", name(), receivers.len())
        })?;
        let over = index.overlapping(&atom.block);
        let n = over.len() as u64;
        budget.take(n.saturating_mul(n), || format!("tensor '{}': a part overlapping {n} source blocks", name()))?;
        let covers = index.cover_split_among(&atom.block, &over, min_cell).map_err(|region| PlanError::NotCovered {
            tensor: dst.tensors()[td as usize].name.clone(),
            rank: receivers[0],
            region,
        })?;
        let bytes = atom.block.numel() * wire.size();
        t.unique_bytes += bytes;
        add_node_needs(&mut needs, &receivers, dst.ranks_per_node(), bytes);
        let r = (pool.len() as u32, receivers.len() as u32);
        pool.extend_from_slice(&receivers);
        for c in covers {
            let chunks = (c.block.numel() * wire.size()).div_ceil(options.max_staging_bytes.max(1));
            if chunks > MAX_PIECES {
                return Err(PlanError::TooManyPieces { tensor: name().clone(), limit: MAX_PIECES });
            }
            budget.take(chunks, || format!("tensor '{}': {} pieces and more", name(), t.pieces.len() as u64 + chunks))?;
            t.transfers = t.transfers.saturating_add(chunks.saturating_mul(receivers.len() as u64));
            let cand = (pool.len() as u32, c.candidates.len() as u32);
            pool.extend_from_slice(&c.candidates);
            if c.block.numel() > max_elems {
                t.pieces.extend(c.block.split_to_fit(max_elems).into_iter().map(|b| (b, r, cand)));
            } else {
                t.pieces.push((c.block, r, cand));
            }
        }
    }
    t.needs = needs.into_iter().enumerate().filter(|&(_, b)| b > 0).map(|(n, b)| (n as u32, b)).collect();
    Ok(t)
}

/// A piece of a template: its block, and its receivers and candidate
/// senders as (start, len) ranges of the rank pool.
type TemplatePiece = (Block, (u32, u32), (u32, u32));

/// How many recently used templates a tensor is compared with before its
/// placements are hashed.
const RECENT_TEMPLATES: usize = 8;

/// One piece still to be assigned senders.
#[derive(Clone, Copy)]
struct Work {
    piece: u32,
    bytes: u64,
    receivers: (u32, u32),
    candidates: (u32, u32),
    /// Destination nodes among the receivers.
    nodes: u32,
}

/// Plans a reshard from `src` to `dst`.
pub fn plan_reshard(src: &Layout, dst: &Layout, options: &PlanOptions) -> Result<Plan, PlanError> {
    let (matched, routes) = match_tensors(src, dst, options.quantize_at)?;
    let only = options.only.as_ref().map(|s| s.mask(dst)).transpose()?;
    let included = |td: usize| only.as_ref().is_none_or(|m| m[td]);
    let mut pool: Vec<Rank> = Vec::new();
    let mut needs = vec![0u64; dst.nodes() as usize];
    let mut unique_bytes = 0u64;
    // Tensors placed alike on both sides (same shape, placements and wire
    // dtype: e.g. every expert of one EP rank) share one overlap
    // computation, a template of pieces with receiver and candidate ranges.
    let mut templates: Vec<Template> = Vec::new();
    let mut by_key: HashMap<u64, Vec<u32>> = HashMap::new();
    // The templates used last, most recent first: neighbouring tensors are
    // often placed alike (an expert's weights, layer after layer), and
    // checking a few is cheaper than hashing both placements.
    let mut recent: Vec<u32> = Vec::with_capacity(RECENT_TEMPLATES);
    // Each destination tensor's template, and how many pieces in all.
    let mut template_of: Vec<u32> = Vec::with_capacity(matched.len());
    let mut total_pieces = 0u64;
    let mut budget = Budget::new(options.max_work);
    for (td, m) in matched.iter().enumerate() {
        let Some(&(ts, sd, dd)) = m.as_ref().filter(|_| included(td)) else {
            template_of.push(NOT_PLANNED);
            continue;
        };
        let wire = wire_dtype(sd, dd);
        let route = routes[td];
        let (st, dt) = (&src.tensors()[ts as usize], &dst.tensors()[td]);
        let same = |t: &Template| {
            let (rs, rd) = (&src.tensors()[t.src_tensor as usize], &dst.tensors()[t.dst_tensor as usize]);
            t.wire == wire
                && t.route == route
                && placed_alike(st, dt, rs, rd)
                && scaled_alike(dst, td as u32, t.dst_tensor)
                && scale_block(dst, td as u32) == scale_block(dst, t.dst_tensor)
        };
        let template = match recent.iter().position(|&i| same(&templates[i as usize])) {
            Some(at) => {
                let i = recent.remove(at);
                i as usize
            }
            None => {
                // Storage (own or named buffers, offsets) plays no part in
                // the overlap: fused tensors placed alike share a template too.
                let key = {
                    let mut h = placement_key(st, dt);
                    wire.hash(&mut h);
                    route.hash(&mut h);
                    hash_scale(dst, td as u32, &mut h);
                    scale_block(dst, td as u32).hash(&mut h);
                    h.finish()
                };
                let found = by_key.get(&key).and_then(|list| list.iter().copied().find(|&i| same(&templates[i as usize])));
                match found {
                    Some(i) => i as usize,
                    None => {
                        let t = overlap_template(src, dst, (ts, td as u32), (wire, route), options, &mut pool, &mut budget)?;
                        by_key.entry(key).or_default().push(templates.len() as u32);
                        templates.push(t);
                        templates.len() - 1
                    }
                }
            }
        };
        if recent.len() == RECENT_TEMPLATES {
            recent.pop();
        }
        recent.insert(0, template as u32);
        template_of.push(template as u32);
        let t = &templates[template];
        total_pieces += t.pieces.len() as u64;
        if total_pieces > MAX_PIECES {
            return Err(PlanError::TooManyPieces { tensor: dt.name.clone(), limit: MAX_PIECES });
        }
        // Every tensor's pieces are made and assigned, one transfer per
        // receiver, whether or not it shares its template.
        budget.take((t.pieces.len() as u64).saturating_add(t.transfers), || {
            format!("tensor '{}': {} pieces delivered {} times", dt.name, t.pieces.len(), t.transfers)
        })?;
        unique_bytes += t.unique_bytes;
        for &(node, bytes) in &t.needs {
            needs[node as usize] += bytes;
        }
    }
    // Pieces in tensor order, and the work on them largest first, ties by
    // piece order (deterministic): a counting sort over the few distinct
    // piece sizes, which the templates know.
    let mut sizes: Vec<u64> = templates.iter().flat_map(|t| t.pieces.iter().map(|p| p.0.numel() * t.wire.size())).collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.dedup();
    let size_of = |t: &Template| -> Vec<u32> {
        t.pieces.iter().map(|p| sizes.partition_point(|&s| s > p.0.numel() * t.wire.size()) as u32).collect()
    };
    let slots: Vec<Vec<u32>> = templates.iter().map(size_of).collect();
    let mut starts = vec![0usize; sizes.len() + 1];
    for &t in template_of.iter().filter(|&&t| t != NOT_PLANNED) {
        for &slot in &slots[t as usize] {
            starts[slot as usize + 1] += 1;
        }
    }
    for i in 1..starts.len() {
        starts[i] += starts[i - 1];
    }
    let mut pieces: Vec<Piece> = Vec::with_capacity(total_pieces as usize);
    // The ranks holding each piece (a range of the pool), for the last step.
    let mut holders: Vec<(u32, u32)> = Vec::with_capacity(total_pieces as usize);
    let mut work: Vec<Work> = vec![Work { piece: 0, bytes: 0, receivers: (0, 0), candidates: (0, 0), nodes: 0 }; total_pieces as usize];
    for (td, (m, &t)) in matched.iter().zip(&template_of).enumerate() {
        let Some(&(ts, _, _)) = m.as_ref().filter(|_| t != NOT_PLANNED) else {
            continue;
        };
        let t = t as usize;
        for (&(block, receivers, candidates), &slot) in templates[t].pieces.iter().zip(&slots[t]) {
            let at = &mut starts[slot as usize];
            work[*at] = Work { piece: pieces.len() as u32, bytes: sizes[slot as usize], receivers, candidates, nodes: 0 };
            *at += 1;
            pieces.push(Piece { src_tensor: ts, dst_tensor: td as u32, block });
            holders.push(candidates);
        }
    }
    drop(slots);
    let mut assigner = Assigner::new(src, dst, options.links, options.min_split_bytes);
    // Every receiver of a piece gets one transfer of it, almost all from a
    // source in stage 0.
    let expected = work.iter().map(|w| w.receivers.1 as usize).sum();
    let mut lists = SenderLists::new(src.ranks(), dst.ranks(), expected);
    // What every piece is expected to add to the egress of the source
    // ranks holding it (see `Assigner::expect`).
    for w in work.iter_mut() {
        let receivers = &pool[w.receivers.0 as usize..(w.receivers.0 + w.receivers.1) as usize];
        let candidates = &pool[w.candidates.0 as usize..(w.candidates.0 + w.candidates.1) as usize];
        w.nodes = assigner.nodes(receivers) as u32;
        assigner.expect(candidates, w.bytes, w.nodes as u64, true);
    }
    let mut parts: Vec<(Block, u64, Option<Rank>)> = Vec::new();
    for w in &work {
        let receivers = &pool[w.receivers.0 as usize..(w.receivers.0 + w.receivers.1) as usize];
        let candidates = &pool[w.candidates.0 as usize..(w.candidates.0 + w.candidates.1) as usize];
        let k = w.nodes as u64;
        assigner.expect(candidates, w.bytes, k, false);
        // A piece that several ranks hold may be split among them (parts
        // of whole rows), where that lowers the busiest source link; the
        // first part keeps the piece's index, the others are new pieces.
        let room = MAX_PIECES.saturating_sub(pieces.len() as u64).min(budget.left() / (1 + receivers.len() as u64));
        let piece = pieces[w.piece as usize];
        if assigner.split(&piece.block, w.bytes, k, candidates, room, &mut parts) {
            // Each part past the first is a piece more, delivered to every
            // receiver (within `room`, so within the budget).
            let more = (parts.len() as u64).saturating_sub(1).saturating_mul(1 + receivers.len() as u64);
            budget.take(more, || format!("splitting a piece of tensor '{}'", dst.tensors()[piece.dst_tensor as usize].name))?;
            for (i, &(block, bytes, sender)) in parts.iter().enumerate() {
                let index = if i == 0 {
                    pieces[w.piece as usize].block = block;
                    w.piece
                } else {
                    pieces.push(Piece { block, ..piece });
                    holders.push(w.candidates);
                    pieces.len() as u32 - 1
                };
                match sender {
                    Some(s) => assigner.assign(index, bytes, receivers, &[s], &mut lists),
                    None => assigner.assign(index, bytes, receivers, candidates, &mut lists),
                }
            }
        } else {
            assigner.assign(w.piece, w.bytes, receivers, candidates, &mut lists);
        }
    }
    drop(work);
    // Source sends move among their pieces' holders where that lowers the
    // busiest source rank.
    let load = (0..src.ranks()).map(|r| assigner.load(0, SRC_OUT, r)).collect();
    rebalance(&mut lists, load, &holders, &pool);
    budget.take(lists.packing_work(), || "packing the transfers into rounds (ranks with many peers each)".into())?;
    let parts =
        PlanParts { pieces, wire: wire_pairs(&matched), routes, needed_node_bytes: needs, unique_bytes, scratch_blocks: Vec::new() };
    Ok(Plan::assemble_by_sender(Strategy::Reshard, src, dst, options, parts, lists))
}

/// The template of a tensor a subset refit leaves out.
const NOT_PLANNED: u32 = u32::MAX;

/// Most stages a reshard can use: one source send, doubling relays across
/// up to 2^30 nodes, one intra-node fan-out.
const MAX_STAGES: usize = 33;

/// Greedy sender/relay choice against per-stage link loads.
///
/// The cost of a plan is modelled as the sum over stages of the busiest
/// link's time in that stage. Each piece (largest first) takes whichever of
/// two shapes adds less to that cost: direct (a source sends to one leader
/// rank in every destination node that needs it) or relay (a source sends to
/// one node; nodes that have it forward to others, doubling each stage).
/// Either way the leader then fans out to the other ranks of its node.
struct Assigner {
    n_src: usize,
    n_dst: usize,
    n_links: usize,
    net_bw: f64,
    /// Seconds per byte: network, then intra-node.
    inv_bw: [f64; 2],
    /// Node of each destination rank.
    dst_node: Vec<u32>,
    /// Node of each source rank, and bytes each source node sends.
    src_node: Vec<u32>,
    src_node_load: Vec<u64>,
    /// Bytes per (stage, link), stage-major; grown a stage at a time.
    loads: Vec<u64>,
    /// Per stage: the most bytes on any link timed at network bandwidth
    /// and on any timed at intra-node bandwidth (see [`Assigner::add`]).
    max_bytes: [[u64; 2]; MAX_STAGES],
    /// The same including the option being evaluated (equal to
    /// `max_bytes` outside an evaluation), up to stage `top`.
    pending: [[u64; 2]; MAX_STAGES],
    top: usize,
    /// Total ingress per destination rank (leader choice).
    dst_in_total: Vec<u64>,
    /// Transfers of the relay option while it is evaluated (taken off the
    /// links one by one on rollback). The direct option is known from
    /// `groups`, `leaders` and `picks` alone.
    emitted: Vec<(Endpoint, Endpoint, u16)>,
    /// The piece's receivers by node (ranges of its receivers), each
    /// node's leader, and whether any node has more than one receiver.
    groups: Vec<(u32, u32)>,
    leaders: Vec<Rank>,
    fans: bool,
    /// Scratch: candidates' (egress << 64 | node egress, rank), and the
    /// senders picked.
    cand: Vec<(u128, Rank)>,
    picks: Vec<Rank>,
    arrival: Vec<u16>,
    /// Least bytes of a part when a piece is split among its candidates
    /// ([`PlanOptions::min_split_bytes`]).
    min_split: u64,
    /// Per source rank, the bytes that pieces only it holds will still add
    /// to its egress (once per receiving node); with its stage-0 egress
    /// so far, its *outlook*, by which senders are chosen among several
    /// candidates: a piece others hold too goes elsewhere than to the rank
    /// that alone must send much later.
    forced: Vec<u64>,
    /// Per source rank, its even share of what the pieces it holds (with
    /// others or alone) not assigned yet will add to the source ranks'
    /// egress: its stage-0 egress plus this is about where the ranks it
    /// shares pieces with end up anyway.
    shares: Vec<u64>,
    /// The most any source rank's outlook has been.
    src_max: u64,
    /// Scratch for [`split`](Self::split): candidates' (stage-0 egress,
    /// rank), and rows per part.
    by_load: Vec<(u64, Rank)>,
    rows: Vec<u64>,
}

const SRC_OUT: usize = 0;
const DST_IN_NET: usize = 1;
const DST_OUT_NET: usize = 2;
const DST_IN_NV: usize = 3;
const DST_OUT_NV: usize = 4;

impl Assigner {
    fn new(src: &Layout, dst: &Layout, links: LinkModel, min_split: u64) -> Assigner {
        let (n_src, n_dst) = (src.ranks() as usize, dst.ranks() as usize);
        Assigner {
            n_src,
            n_dst,
            n_links: n_src + 4 * n_dst,
            net_bw: links.net_bytes_per_s,
            inv_bw: [1.0 / links.net_bytes_per_s, 1.0 / links.intra_bytes_per_s],
            dst_node: (0..dst.ranks()).map(|r| dst.node_of(r)).collect(),
            src_node: (0..src.ranks()).map(|r| src.node_of(r)).collect(),
            src_node_load: vec![0; src.nodes() as usize],
            loads: Vec::new(),
            max_bytes: [[0; 2]; MAX_STAGES],
            pending: [[0; 2]; MAX_STAGES],
            top: 0,
            dst_in_total: vec![0; n_dst],
            emitted: Vec::new(),
            groups: Vec::new(),
            leaders: Vec::new(),
            fans: false,
            cand: Vec::new(),
            picks: Vec::new(),
            arrival: Vec::new(),
            min_split: min_split.max(1),
            forced: vec![0; n_src],
            shares: vec![0; n_src],
            src_max: 0,
            by_load: Vec::new(),
            rows: Vec::new(),
        }
    }

    #[inline]
    fn link(&self, kind: usize, rank: Rank) -> usize {
        match kind {
            SRC_OUT => rank as usize,
            k => self.n_src + (k - 1) * self.n_dst + rank as usize,
        }
    }

    /// Time of a stage's busiest links (bytes per bandwidth class).
    #[inline]
    fn time(&self, bytes: [u64; 2]) -> f64 {
        (bytes[0] as f64 * self.inv_bw[0]).max(bytes[1] as f64 * self.inv_bw[1])
    }

    /// Adds `bytes` to a link in `stage`. Destination egress inside the
    /// node is timed at the intra-node bandwidth, every other link (the
    /// ingress side of a transfer inside the node included) at the
    /// network's, so the busiest time of a stage is the larger of the two
    /// classes' busiest links.
    #[inline]
    fn add(&mut self, stage: u16, kind: usize, rank: Rank, bytes: u64) {
        let s = stage as usize;
        let need = (s + 1) * self.n_links;
        if self.loads.len() < need {
            self.loads.resize(need, 0);
        }
        let i = s * self.n_links + self.link(kind, rank);
        let load = self.loads[i] + bytes;
        self.loads[i] = load;
        let class = &mut self.pending[s][(kind == DST_OUT_NV) as usize];
        if load > *class {
            *class = load;
        }
        self.top = self.top.max(s + 1);
    }

    /// Takes back what [`add`](Self::add) added.
    #[inline]
    fn sub(&mut self, stage: u16, kind: usize, rank: Rank, bytes: u64) {
        let i = stage as usize * self.n_links + self.link(kind, rank);
        self.loads[i] -= bytes;
    }

    /// Source rank `r`'s stage-0 egress so far plus what pieces only it
    /// holds will still add.
    #[inline]
    fn outlook(&self, r: Rank) -> u64 {
        self.load(0, SRC_OUT, r).saturating_add(self.forced[r as usize])
    }

    /// Counts (`on`) or takes back what a piece of `bytes` held by
    /// `candidates` is expected to add to their egress: once per receiving
    /// node, shared evenly among them (`shares`), and all of it to the
    /// one candidate of a piece only one rank holds (`forced`); `k` is
    /// the number of receiving nodes.
    fn expect(&mut self, candidates: &[Rank], bytes: u64, k: u64, on: bool) {
        let total = k.saturating_mul(bytes);
        let share = total / candidates.len().max(1) as u64;
        let change = |x: &mut u64, by: u64| *x = if on { x.saturating_add(by) } else { x.saturating_sub(by) };
        if let [only] = candidates {
            change(&mut self.forced[*only as usize], total);
            if on {
                self.src_max = self.src_max.max(self.forced[*only as usize]);
            }
        }
        for &c in candidates {
            change(&mut self.shares[c as usize], share);
        }
    }

    /// The number of destination nodes among `receivers` (at least 1).
    fn nodes(&self, receivers: &[Rank]) -> u64 {
        // The receivers are sorted, so a node's are a run.
        let mut k = 0u64;
        let mut last = u32::MAX;
        for &r in receivers {
            let n = self.dst_node[r as usize];
            if n != last {
                (k, last) = (k + 1, n);
            }
        }
        k.max(1)
    }

    #[inline]
    fn load(&self, stage: u16, kind: usize, rank: Rank) -> u64 {
        self.loads.get(stage as usize * self.n_links + self.link(kind, rank)).copied().unwrap_or(0)
    }

    /// Cost increase of the option being evaluated.
    fn delta(&self) -> f64 {
        (0..self.top).map(|s| self.time(self.pending[s]) - self.time(self.max_bytes[s])).sum()
    }

    /// Forgets the evaluated option's maxima.
    fn forget(&mut self) {
        self.pending[..self.top].copy_from_slice(&self.max_bytes[..self.top]);
        self.top = 0;
    }

    /// Takes the relay option off the links and forgets it.
    fn rollback(&mut self, bytes: u64) {
        for i in 0..self.emitted.len() {
            let (from, to, stage) = self.emitted[i];
            let (out, inn) = self.link_kinds(from, to);
            self.sub(stage, out, from.rank, bytes);
            self.sub(stage, inn, to.rank, bytes);
        }
        self.emitted.clear();
        self.forget();
    }

    /// Puts the direct option on the links (`on`) or takes it off: each
    /// chosen source sends to its node's leader in stage 0, which fans out
    /// inside its node in stage 1.
    fn direct_links(&mut self, receivers: &[Rank], bytes: u64, on: bool) {
        // Stage 0 (source egress and leader ingress, both network links)
        // in one sweep over that stage's loads.
        let need = 2 * self.n_links;
        if self.loads.len() < need {
            self.loads.resize(need, 0);
        }
        let (n_src, loads) = (self.n_src, &mut self.loads[..self.n_links]);
        let (sources, leaders) = (&self.picks, &self.leaders);
        if on {
            let mut most = self.pending[0][0];
            for (&s, &l) in sources.iter().zip(leaders) {
                loads[s as usize] += bytes;
                loads[n_src + l as usize] += bytes;
                most = most.max(loads[s as usize]).max(loads[n_src + l as usize]);
            }
            self.pending[0][0] = most;
            self.top = self.top.max(1);
        } else {
            for (&s, &l) in sources.iter().zip(leaders) {
                loads[s as usize] -= bytes;
                loads[n_src + l as usize] -= bytes;
            }
        }
        if !self.fans {
            return;
        }
        // Stage 1: fan-out inside nodes.
        for j in 0..self.groups.len() {
            let (g, l) = (self.groups[j], self.leaders[j]);
            if g.1 - g.0 > 1 {
                for &r in &receivers[g.0 as usize..g.1 as usize] {
                    if r == l {
                        continue;
                    }
                    if on {
                        self.add(1, DST_OUT_NV, l, bytes);
                        self.add(1, DST_IN_NV, r, bytes);
                    } else {
                        self.sub(1, DST_OUT_NV, l, bytes);
                        self.sub(1, DST_IN_NV, r, bytes);
                    }
                }
            }
        }
    }

    /// Keeps the direct option: its maxima, and its transfers in `out`:
    /// the sources' sends to the leaders, then the leaders' fan-outs.
    fn commit_direct(&mut self, piece: u32, bytes: u64, receivers: &[Rank], out: &mut SenderLists) {
        self.max_bytes[..self.top].copy_from_slice(&self.pending[..self.top]);
        self.top = 0;
        for (&s, &l) in self.picks.iter().zip(&self.leaders) {
            self.src_node_load[self.src_node[s as usize] as usize] += bytes;
            self.src_max = self.src_max.max(self.outlook(s));
            out.push(0, Endpoint::src(s), Endpoint::dst(l), piece, bytes);
        }
        if !self.fans {
            return;
        }
        for (&g, &l) in self.groups.iter().zip(&self.leaders) {
            if g.1 - g.0 > 1 {
                for &r in &receivers[g.0 as usize..g.1 as usize] {
                    if r != l {
                        out.push(1, Endpoint::dst(l), Endpoint::dst(r), piece, bytes);
                    }
                }
            }
        }
    }

    /// Keeps the relay option: its maxima, and its transfers in `out`.
    fn commit(&mut self, piece: u32, bytes: u64, out: &mut SenderLists) {
        self.max_bytes[..self.top].copy_from_slice(&self.pending[..self.top]);
        self.top = 0;
        let mut emitted = std::mem::take(&mut self.emitted);
        for (from, to, stage) in emitted.drain(..) {
            if from.group == Group::Src {
                self.src_node_load[self.src_node[from.rank as usize] as usize] += bytes;
                self.src_max = self.src_max.max(self.outlook(from.rank));
            }
            out.push(stage, from, to, piece, bytes);
        }
        self.emitted = emitted;
    }

    /// A lower bound on the relay option's cost, computed while the direct
    /// option's additions are still applied: the growth of the stage-0
    /// maximum from the relay's one source send (the source's load before
    /// the direct option was at least its load now minus `k` sends) and its
    /// first leader's ingress (direct added exactly this piece to it).
    fn relay_first_hop_cost(&self, candidates: &[Rank], bytes: u64) -> f64 {
        let k = self.leaders.len() as u64;
        let least = candidates.iter().map(|&c| self.load(0, SRC_OUT, c)).min().unwrap_or(0);
        let src = (least.saturating_sub(k * bytes) + bytes) as f64 / self.net_bw;
        let dst = self.load(0, DST_IN_NET, self.leaders[0]) as f64 / self.net_bw;
        (src.max(dst) - self.time(self.max_bytes[0])).max(0.0)
    }

    /// The candidate with the least stage-0 egress; ties go to the one on
    /// the least loaded source node, then to the lowest rank.
    /// Chooses `k` senders in turn, each the least loaded (as
    /// [`best_source`](Self::best_source)) after the earlier choices' bytes.
    fn pick_sources(&mut self, candidates: &[Rank], k: usize, bytes: u64) {
        self.picks.clear();
        if let [only] = candidates {
            self.picks.resize(k, *only);
            return;
        }
        // (egress, node egress) as one number, compared at once.
        let mut cand = std::mem::take(&mut self.cand);
        cand.clear();
        cand.extend(candidates.iter().map(|&c| {
            let node = self.src_node_load[self.src_node[c as usize] as usize];
            ((self.outlook(c) as u128) << 64 | node as u128, c)
        }));
        for _ in 0..k {
            let (mut best, mut least) = (0, cand[0].0);
            for (i, &(key, _)) in cand.iter().enumerate().skip(1) {
                if key < least {
                    (best, least) = (i, key);
                }
            }
            cand[best].0 += (bytes as u128) << 64;
            self.picks.push(cand[best].1);
        }
        self.cand = cand;
    }

    fn best_source(&self, candidates: &[Rank]) -> Rank {
        let mut best = candidates[0];
        let mut best_load = (u64::MAX, u64::MAX);
        for &c in candidates {
            let l = (self.outlook(c), self.src_node_load[self.src_node[c as usize] as usize]);
            if l < best_load {
                best = c;
                best_load = l;
            }
        }
        best
    }

    /// The links a transfer loads: the sender's and the receiver's.
    #[inline]
    fn link_kinds(&self, from: Endpoint, to: Endpoint) -> (usize, usize) {
        match (from.group, from.group == Group::Dst && self.dst_node[from.rank as usize] == self.dst_node[to.rank as usize]) {
            (Group::Src, _) => (SRC_OUT, DST_IN_NET),
            (Group::Dst, false) => (DST_OUT_NET, DST_IN_NET),
            (Group::Dst, true) => (DST_OUT_NV, DST_IN_NV),
        }
    }

    fn send(&mut self, from: Endpoint, to: Endpoint, stage: u16, bytes: u64) {
        let (out, inn) = self.link_kinds(from, to);
        self.add(stage, out, from.rank, bytes);
        self.add(stage, inn, to.rank, bytes);
        self.emitted.push((from, to, stage));
    }

    /// Sends from the node leader to the other receivers of its node.
    fn fan_out(&mut self, leader: Rank, group: &[Rank], stage: u16, bytes: u64) {
        for &r in group {
            if r != leader {
                self.send(Endpoint::dst(leader), Endpoint::dst(r), stage, bytes);
            }
        }
    }

    /// Whether to split a piece (`block`, `bytes` on the wire, needed by
    /// `k` destination nodes) among its `candidates`, and if so its parts
    /// in `parts`: (block, bytes, the one candidate to send it, or `None`:
    /// any of them), at most `room` parts.
    ///
    /// The piece is cut along its first dimension of more than one index
    /// into ranges of whole rows, so every part stays one strided span of
    /// its holders' buffers, each part at least `min_split` bytes. Sent
    /// whole, the direct option sends it `k` times, from the least loaded
    /// candidates in turn (by outlook). It is split only when that would
    /// raise both the busiest source rank's outlook and the level its
    /// candidates are expected to reach anyway (outlook plus their share
    /// of pieces still to come, which later pieces even out), and the split
    /// ends lower:
    /// - `k = 1`: the copy is levelled (water-filled) over the least loaded
    ///   candidates, as many as the rows and `min_split` allow, each part
    ///   sent by one;
    /// - `k > 1` with more candidates than `k`: into equal parts, about one
    ///   per `k` candidates, each part then chosen for like any piece (its
    ///   `k` copies from different candidates, or relayed), so the copies
    ///   spread over all candidates instead of `k` of them. (With no more
    ///   candidates than copies, the direct option already uses them all.)
    fn split(
        &mut self,
        block: &Block,
        bytes: u64,
        k: u64,
        candidates: &[Rank],
        room: u64,
        parts: &mut Vec<(Block, u64, Option<Rank>)>,
    ) -> bool {
        parts.clear();
        let n = candidates.len() as u64;
        if n < 2 || bytes / 2 < self.min_split || room < 2 || (k > 1 && n <= k) {
            return false;
        }
        let Some(d) = (0..block.ndim()).find(|&d| block.extent()[d] > 1) else { return false };
        let rows = block.extent()[d];
        let row_bytes = bytes / rows;
        let min_rows = self.min_split.div_ceil(row_bytes.max(1)).max(1);
        if row_bytes == 0 || rows / 2 < min_rows {
            return false;
        }
        let mut by_load = std::mem::take(&mut self.by_load);
        by_load.clear();
        let mut bar = self.src_max;
        for &c in candidates {
            by_load.push((self.outlook(c), c));
            bar = bar.max(self.load(0, SRC_OUT, c).saturating_add(self.shares[c as usize]));
        }
        by_load.sort_unstable();
        let split = self.whole_raises(&by_load, k, bytes, bar).is_some_and(|whole| {
            if k == 1 {
                self.level(&by_load, bytes, rows, row_bytes, min_rows, room, whole)
            } else {
                let p = (n / k).min(rows / min_rows).min(room);
                self.rows.clear();
                self.rows.extend((0..p).map(|i| rows / p + u64::from(i < rows % p)));
                p >= 2
            }
        });
        if split {
            let mut at = block.offset()[d];
            for (i, &r) in self.rows.iter().enumerate() {
                let sender = (k == 1).then(|| by_load[i].1);
                parts.push((with_range(block, d, at, r), r * row_bytes, sender));
                at += r;
            }
        }
        self.by_load = by_load;
        split
    }

    /// The most outlook among the candidates (`by_load`, least first)
    /// after `k` copies of `bytes` from the least loaded in turn, if that
    /// is above `bar`.
    fn whole_raises(&self, by_load: &[(u64, Rank)], k: u64, bytes: u64, bar: u64) -> Option<u64> {
        // If the k least loaded each take a copy without passing the bar,
        // so does the choice in turn (while fewer than k are chosen, one
        // of the k least loaded is not, so each copy goes to a candidate at
        // most as loaded as the k-th least).
        if k as usize <= by_load.len() && by_load[k as usize - 1].0.saturating_add(bytes) <= bar {
            return None;
        }
        let mut loads: BinaryHeap<Reverse<u64>> = by_load.iter().map(|&(l, _)| Reverse(l)).collect();
        let mut whole = 0;
        for _ in 0..k {
            let Some(Reverse(least)) = loads.pop() else { break };
            let l = least.saturating_add(bytes);
            loads.push(Reverse(l));
            whole = whole.max(l);
        }
        (whole > bar).then_some(whole)
    }

    /// Rows per part (in `self.rows`, for the first candidates of
    /// `by_load`, least loaded first) that level one copy of a piece of
    /// `rows` rows over the least loaded candidates, if that ends below
    /// `whole`, the most after sending it whole.
    #[allow(clippy::too_many_arguments)]
    fn level(&mut self, by_load: &[(u64, Rank)], bytes: u64, rows: u64, row_bytes: u64, min_rows: u64, room: u64, whole: u64) -> bool {
        let (total, unit) = (bytes as u128, row_bytes as u128);
        // The candidates below the level of all of them (water-filling:
        // the least loaded p whose level is above the p-th load).
        let mut below = 0;
        let mut sum = total;
        for (i, &(l, _)) in by_load.iter().enumerate() {
            if (l as u128) * (i as u128) >= sum {
                break;
            }
            sum += l as u128;
            below = i + 1;
        }
        let most_parts = (rows / min_rows).min(below as u64).min(room) as usize;
        for p in (2..=most_parts).rev() {
            // Level L over the p least loaded: p·L = bytes + their loads;
            // candidate i takes (L - load_i) / row_bytes rows.
            let sum: u128 = by_load[..p].iter().map(|&(l, _)| l as u128).sum::<u128>() + total;
            let denom = p as u128 * unit;
            self.rows.clear();
            let mut fracs: Vec<(u128, usize)> = Vec::with_capacity(p);
            let mut given = 0u64;
            let mut fits = true;
            for (i, &(l, _)) in by_load[..p].iter().enumerate() {
                let Some(num) = sum.checked_sub(p as u128 * l as u128) else {
                    fits = false;
                    break;
                };
                let n = (num / denom) as u64;
                self.rows.push(n);
                fracs.push((num % denom, i));
                given += n;
            }
            if !fits {
                continue;
            }
            // The rows left by rounding down, to the largest remainders.
            fracs.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            for &(_, i) in fracs.iter().take(rows.saturating_sub(given) as usize) {
                self.rows[i] += 1;
            }
            if self.rows.iter().sum::<u64>() != rows || self.rows.iter().any(|&n| n < min_rows) {
                continue;
            }
            let most = by_load[..p].iter().zip(&self.rows).map(|(&(l, _), &n)| l.saturating_add(n * row_bytes)).max().unwrap_or(u64::MAX);
            return most < whole;
        }
        false
    }

    fn assign(&mut self, piece: u32, bytes: u64, receivers: &[Rank], candidates: &[Rank], out: &mut SenderLists) {
        // Receivers grouped by node (they are sorted, so groups are runs).
        self.groups.clear();
        self.leaders.clear();
        self.fans = false;
        let mut start = 0;
        let mut node = receivers.first().map_or(0, |&r| self.dst_node[r as usize]);
        for i in 1..=receivers.len() {
            let next = receivers.get(i).map_or(u32::MAX, |&r| self.dst_node[r as usize]);
            if next != node {
                let leader = match &receivers[start..i] {
                    &[only] => only,
                    g => {
                        self.fans = true;
                        g.iter().copied().min_by_key(|&r| (self.dst_in_total[r as usize], r)).unwrap_or(g[0])
                    }
                };
                self.groups.push((start as u32, i as u32));
                self.leaders.push(leader);
                (start, node) = (i, next);
            }
        }
        let k = self.groups.len();
        let group = |g: (u32, u32)| &receivers[g.0 as usize..g.1 as usize];

        // Option A: direct from sources to every node; senders chosen as
        // `best_source` would, one after another, on a local copy of the
        // candidates' loads.
        self.pick_sources(candidates, k, bytes);
        self.direct_links(receivers, bytes, true);
        let direct_cost = if k >= 2 { self.delta() } else { 0.0 };
        let mut direct = true;
        // The relay costs at least its first hop's growth of the stage-0
        // maximum; skip evaluating it when that alone is no better.
        if k >= 2 && self.relay_first_hop_cost(candidates, bytes) < direct_cost {
            self.direct_links(receivers, bytes, false);
            self.forget();

            // Option B: one source send, then node-to-node doubling.
            let s = self.best_source(candidates);
            let l0 = self.leaders[0];
            self.send(Endpoint::src(s), Endpoint::dst(l0), 0, bytes);
            self.arrival.clear();
            self.arrival.resize(k, 0);
            let (mut have, mut stage) = (1usize, 1u16);
            while have < k {
                let senders = have;
                for i in 0..senders {
                    if have >= k {
                        break;
                    }
                    let (from, to) = (self.leaders[i], self.leaders[have]);
                    self.send(Endpoint::dst(from), Endpoint::dst(to), stage, bytes);
                    self.arrival[have] = stage;
                    have += 1;
                }
                stage += 1;
            }
            for j in 0..k {
                let (g, l, a) = (self.groups[j], self.leaders[j], self.arrival[j]);
                self.fan_out(l, group(g), a + 1, bytes);
            }
            if self.delta() + 1e-15 >= direct_cost {
                self.rollback(bytes);
                self.direct_links(receivers, bytes, true);
            } else {
                direct = false;
            }
        }
        for j in 0..k {
            self.dst_in_total[self.leaders[j] as usize] += bytes;
        }
        if direct {
            self.commit_direct(piece, bytes, receivers, out);
        } else {
            self.commit(piece, bytes, out);
        }
    }
}
