//! Templates: the overlap of one (source, destination) tensor pair's
//! placements (pieces with their receivers and candidate senders),
//! computed once and shared by every tensor pair placed alike; and
//! [`Overlaps`], every planned tensor's template.

use super::matching::{hash_scale, placed_alike, placement_key, scaled_alike, Matched};
use crate::block::Block;
use crate::dtype::{wire_dtype, DType};
use crate::layout::{Holding, Layout, Placement, Rank, TensorLayout};
use crate::overlap::{atomize, SourceIndex};
use crate::plan::{Budget, PlanError, PlanOptions, MAX_PIECES};
use crate::route::{self, scale_block, Route};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// Sorted, deduplicated ranks holding any of `hd[idx]`.
pub(crate) fn receivers_of(hd: &[Holding], idx: &[u32]) -> Vec<Rank> {
    let mut r: Vec<Rank> = idx.iter().flat_map(|&h| hd[h as usize].holders.iter().map(|l| l.rank)).collect();
    r.sort_unstable();
    r.dedup();
    r
}

/// The work of expanding the placements of source tensor `st` and
/// destination tensor `dt`: a holding per rank of each.
pub(crate) fn expand_work(st: &TensorLayout, dt: &TensorLayout) -> u64 {
    let places = |t: &TensorLayout| match &t.placement {
        Placement::Mesh(m) => m.ranks.len() as u64,
        Placement::Shards(s) => s.len() as u64,
    };
    places(st).saturating_add(places(dt))
}

/// Adds `bytes` to every destination node among `ranks`.
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
pub(super) struct Template {
    src_tensor: u32,
    dst_tensor: u32,
    pub(super) wire: DType,
    route: Route,
    pub(super) pieces: Vec<TemplatePiece>,
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
    let expand = expand_work(&src.tensors()[ts as usize], &dst.tensors()[td as usize]);
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
pub(super) type TemplatePiece = (Block, (u32, u32), (u32, u32));

/// How many recently used templates a tensor is compared with before its
/// placements are hashed.
const RECENT_TEMPLATES: usize = 8;

/// The template of a tensor a subset refit leaves out.
pub(super) const NOT_PLANNED: u32 = u32::MAX;

/// The overlap of every planned tensor: the templates, each destination
/// tensor's, and what they add up to.
///
/// Tensors placed alike on both sides (same shape, placements and wire
/// dtype: e.g. every expert of one EP rank) share one overlap computation,
/// a template of pieces with receiver and candidate ranges.
pub(super) struct Overlaps {
    pub(super) templates: Vec<Template>,
    /// Each destination tensor's template ([`NOT_PLANNED`] for one a
    /// subset refit leaves out, or one never moved).
    pub(super) template_of: Vec<u32>,
    /// The ranks the templates' receiver and candidate ranges point into.
    pub(super) pool: Vec<Rank>,
    /// Per destination node, bytes of the union of its ranks' needs.
    pub(super) needs: Vec<u64>,
    pub(super) unique_bytes: u64,
    /// Pieces of all planned tensors together.
    pub(super) total_pieces: u64,
}

/// Where [`Overlaps::new`] looks for a template a tensor can share.
struct Lookup {
    by_key: HashMap<u64, Vec<u32>>,
    /// The templates used last, most recent first: neighbouring tensors are
    /// often placed alike (an expert's weights, layer after layer), and
    /// checking a few is cheaper than hashing both placements.
    recent: Vec<u32>,
}

/// A destination tensor to plan: its source tensor, the dtype on the wire
/// and its route.
#[derive(Clone, Copy)]
struct Pairing {
    ts: u32,
    td: u32,
    wire: DType,
    route: Route,
}

impl Overlaps {
    /// The templates of every destination tensor `matched` (from
    /// `match_tensors`, with `routes`) pairs with a source tensor and
    /// `only` includes (all where `None`), in tensor order, each checked
    /// against the piece limit and its work taken from `budget`.
    pub(super) fn new(
        src: &Layout,
        dst: &Layout,
        (matched, routes): (&[Matched], &[Route]),
        only: Option<&[bool]>,
        options: &PlanOptions,
        budget: &mut Budget,
    ) -> Result<Overlaps, PlanError> {
        let mut o = Overlaps {
            templates: Vec::new(),
            template_of: Vec::with_capacity(matched.len()),
            pool: Vec::new(),
            needs: vec![0u64; dst.nodes() as usize],
            unique_bytes: 0,
            total_pieces: 0,
        };
        let mut lookup = Lookup { by_key: HashMap::new(), recent: Vec::with_capacity(RECENT_TEMPLATES) };
        for (td, m) in matched.iter().enumerate() {
            let Some(&(ts, sd, dd)) = m.as_ref().filter(|_| only.is_none_or(|m| m[td])) else {
                o.template_of.push(NOT_PLANNED);
                continue;
            };
            let pairing = Pairing { ts, td: td as u32, wire: wire_dtype(sd, dd), route: routes[td] };
            let template = o.template_for(src, dst, pairing, &mut lookup, options, budget)?;
            o.add_tensor(&dst.tensors()[td], template, budget)?;
        }
        Ok(o)
    }

    /// The template `pairing` shares with an earlier tensor placed alike,
    /// or a new one.
    fn template_for(
        &mut self,
        src: &Layout,
        dst: &Layout,
        pairing: Pairing,
        lookup: &mut Lookup,
        options: &PlanOptions,
        budget: &mut Budget,
    ) -> Result<usize, PlanError> {
        let Pairing { ts, td, wire, route } = pairing;
        let (st, dt) = (&src.tensors()[ts as usize], &dst.tensors()[td as usize]);
        let same = |t: &Template| {
            let (rs, rd) = (&src.tensors()[t.src_tensor as usize], &dst.tensors()[t.dst_tensor as usize]);
            t.wire == wire
                && t.route == route
                && placed_alike(st, dt, rs, rd)
                && scaled_alike(dst, td, t.dst_tensor)
                && scale_block(dst, td) == scale_block(dst, t.dst_tensor)
        };
        let template = match lookup.recent.iter().position(|&i| same(&self.templates[i as usize])) {
            Some(at) => {
                let i = lookup.recent.remove(at);
                i as usize
            }
            None => {
                // Storage (own or named buffers, offsets) plays no part in
                // the overlap: fused tensors placed alike share a template too.
                let key = {
                    let mut h = placement_key(st, dt);
                    wire.hash(&mut h);
                    route.hash(&mut h);
                    hash_scale(dst, td, &mut h);
                    scale_block(dst, td).hash(&mut h);
                    h.finish()
                };
                let found = lookup.by_key.get(&key).and_then(|list| list.iter().copied().find(|&i| same(&self.templates[i as usize])));
                match found {
                    Some(i) => i as usize,
                    None => {
                        let t = overlap_template(src, dst, (ts, td), (wire, route), options, &mut self.pool, budget)?;
                        lookup.by_key.entry(key).or_default().push(self.templates.len() as u32);
                        self.templates.push(t);
                        self.templates.len() - 1
                    }
                }
            }
        };
        if lookup.recent.len() == RECENT_TEMPLATES {
            lookup.recent.pop();
        }
        lookup.recent.insert(0, template as u32);
        Ok(template)
    }

    /// Records that destination tensor `dt` (the next in order) uses
    /// `template`: its pieces, work and needs.
    fn add_tensor(&mut self, dt: &TensorLayout, template: usize, budget: &mut Budget) -> Result<(), PlanError> {
        self.template_of.push(template as u32);
        let t = &self.templates[template];
        self.total_pieces += t.pieces.len() as u64;
        if self.total_pieces > MAX_PIECES {
            return Err(PlanError::TooManyPieces { tensor: dt.name.clone(), limit: MAX_PIECES });
        }
        // Every tensor's pieces are made and assigned, one transfer per
        // receiver, whether or not it shares its template.
        budget.take((t.pieces.len() as u64).saturating_add(t.transfers), || {
            format!("tensor '{}': {} pieces delivered {} times", dt.name, t.pieces.len(), t.transfers)
        })?;
        self.unique_bytes += t.unique_bytes;
        for &(node, bytes) in &t.needs {
            self.needs[node as usize] += bytes;
        }
        Ok(())
    }
}
