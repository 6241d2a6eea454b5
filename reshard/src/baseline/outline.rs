//! The baseline before its transfers are made ([`Outline`]): per
//! destination tensor a [`Recipe`], shared by tensors placed alike.

use super::chain::{Chain, Interned, Pairs};
use super::chunk_bytes;
use super::schedule::Ends;
use crate::block::Block;
use crate::cost::{LinkModel, PipelinedBroadcast};
use crate::dtype::{wire_dtype, DType};
use crate::layout::{Holding, Layout, Placement, Rank, TensorLayout};
use crate::overlap::{atomize, SourceIndex};
use crate::plan::{Budget, Endpoint, PlanError, PlanOptions, MAX_PIECES};
use crate::planner::{
    add_node_needs, expand_work, hash_scale, match_tensors, placed_alike, placement_key, receivers_of, scaled_alike, wire_pairs, Matched,
};
use crate::route::{self, QuantizeAt, Route};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// The baseline before its transfers are made: per destination tensor, a
/// recipe (shared by tensors placed alike), checked in tensor order for
/// the errors [`plan_baseline`](super::plan_baseline) reports.
pub(super) struct Outline {
    /// Per destination tensor the destination holds any of, in order:
    /// (source tensor, destination tensor, recipe).
    pub(super) tensors: Vec<(u32, u32, u32)>,
    /// `None`: the destination holds none of the tensor.
    pub(super) recipes: Vec<Option<Recipe>>,
    pub(super) chains: Vec<Chain>,
    /// Every distinct (sender, receiver) pair of the recipes and chains.
    pub(super) pairs: Vec<(Endpoint, Endpoint)>,
    /// Per destination tensor: source and destination dtypes.
    pub(super) wire: Vec<(DType, DType)>,
    /// Per destination tensor, how its values travel.
    pub(super) routes: Vec<Route>,
    /// Per destination node, bytes of the union of its ranks' needs.
    pub(super) needs: Vec<u64>,
    pub(super) unique_bytes: u64,
    /// Pieces and transfers of the plan.
    pub(super) pieces: u64,
    pub(super) transfers: u64,
    /// Bytes of a chunk.
    pub(super) chunk: u64,
}

/// What the baseline does with one tensor.
pub(super) struct Recipe {
    /// The whole needed extent: the bounding box of every destination
    /// block (the whole tensor, whenever the destination holds all of it).
    pub(super) full: Block,
    /// The source rank that gathers it.
    pub(super) root: Rank,
    /// Bytes per element into a source rank, and on the wire to a
    /// destination rank.
    pub(super) src_size: u64,
    pub(super) wire_size: u64,
    /// The chunks of `full`, in order (none unless the gather was made).
    pub(super) chunks: Vec<Block>,
    /// Gather pieces (sender, block, pair to the root), chunk after chunk,
    /// with the end of each chunk's, or the region of `full` no source
    /// holds; `None` when the pieces were not made because the tensor alone
    /// would pass [`MAX_PIECES`].
    pub(super) gather: Option<Gather>,
    /// Per ring of its chain, the pair from the root to the ring's first
    /// receiver.
    pub(super) first_pairs: Vec<u32>,
    pub(super) chain: u32,
    /// The slices the ranks keep, chunk by chunk: (chunk, part of a
    /// destination block inside it, that block's index in `holders`).
    pub(super) finals: Vec<Final>,
    /// Per destination block, the ranks that keep it, as indices into the
    /// chain's receivers.
    pub(super) holders: Vec<Vec<u32>>,
    unique_bytes: u64,
    needs: Vec<(u32, u64)>,
}

/// A slice ranks keep: (chunk, part of a destination block inside it, that
/// block's index in [`Recipe::holders`]).
pub(super) type Final = (u32, Block, u32);

/// Gather pieces (sender, block, pair) and the end of each chunk's, or the
/// region no source holds.
pub(super) type Gather = Result<(Vec<(Rank, Block, u32)>, Vec<u32>), Box<Block>>;

impl Outline {
    pub(super) fn new(src: &Layout, dst: &Layout, options: &PlanOptions) -> Result<Outline, PlanError> {
        let (matched, routes) = match_tensors(src, dst, QuantizeAt::Destination)?;
        let only = options.only.as_ref().map(|s| s.mask(dst)).transpose()?;
        let included = |td: usize| only.as_ref().is_none_or(|m| m[td]);
        let planned = |(td, m): (usize, &Matched)| m.filter(|_| included(td)).map(|m| (td, m));
        let total = matched
            .iter()
            .enumerate()
            .filter_map(planned)
            .map(|(td, (_, s, d))| dst.tensors()[td].shape.iter().product::<u64>().saturating_mul(wire_dtype(s, d).size()))
            .fold(0u64, u64::saturating_add);
        let mut o = Outline {
            tensors: Vec::new(),
            recipes: Vec::new(),
            chains: Vec::new(),
            pairs: Vec::new(),
            wire: wire_pairs(&matched),
            routes,
            needs: vec![0; dst.nodes() as usize],
            unique_bytes: 0,
            pieces: 0,
            transfers: 0,
            chunk: chunk_bytes(total, options.max_staging_bytes),
        };
        let mut interned = Interned::default();
        let mut budget = Budget::new(options.max_work);
        let mut by_key: HashMap<u64, Vec<u32>> = HashMap::new();
        // Per recipe, the (source, destination) tensors it was made from.
        let mut made_from: Vec<(u32, u32)> = Vec::new();
        for (td, (ts, sd, dd)) in matched.iter().enumerate().filter_map(planned) {
            let (st, dt) = (&src.tensors()[ts as usize], &dst.tensors()[td]);
            // Tensors placed alike (storage aside) with the same dtypes
            // share a recipe.
            let key = {
                let mut h = placement_key(st, dt);
                sd.hash(&mut h);
                dd.hash(&mut h);
                hash_scale(dst, td as u32, &mut h);
                h.finish()
            };
            let same = |r: &(u32, u32)| {
                let (rs, rd) = (&src.tensors()[r.0 as usize], &dst.tensors()[r.1 as usize]);
                let dtypes = matched[r.1 as usize].map(|(_, s, d)| (s, d));
                rs.dtype == sd && dtypes == Some((sd, dd)) && placed_alike(st, dt, rs, rd) && scaled_alike(dst, td as u32, r.1)
            };
            let found = by_key.get(&key).and_then(|list| list.iter().copied().find(|&i| same(&made_from[i as usize])));
            let id = match found {
                Some(i) => i,
                None => {
                    let rec = Recipe::new(src, dst, (ts, td as u32), (sd, dd), o.chunk, (&mut interned, &mut budget))?;
                    o.recipes.push(rec);
                    made_from.push((ts, td as u32));
                    let id = o.recipes.len() as u32 - 1;
                    by_key.entry(key).or_default().push(id);
                    id
                }
            };
            o.add_tensor((src, dst), (ts, td as u32, id), (sd, dd), (&interned.chains, &mut budget))?;
        }
        o.chains = interned.chains;
        o.pairs = interned.pairs.list;
        Ok(o)
    }

    /// Records that destination tensor `td` (from source tensor `ts`, in
    /// dtypes `sd` and `dd`) uses recipe `id`: checks it against the piece
    /// limit and that the sources cover it, adds its needs, pieces and
    /// transfers, and takes their work from `budget`.
    fn add_tensor(
        &mut self,
        (src, dst): (&Layout, &Layout),
        (ts, td, id): (u32, u32, u32),
        (sd, dd): (DType, DType),
        (chains, budget): (&[Chain], &mut Budget),
    ) -> Result<(), PlanError> {
        let (st, dt) = (&src.tensors()[ts as usize], &dst.tensors()[td as usize]);
        let Some(rec) = &self.recipes[id as usize] else { return Ok(()) };
        let fail_pieces = || PlanError::TooManyPieces { tensor: st.name.clone(), limit: MAX_PIECES };
        let bound = rec.full.numel().div_ceil(chunk_elems(self.chunk, sd, dd)).saturating_mul(2);
        if self.pieces.saturating_add(bound) > MAX_PIECES {
            return Err(fail_pieces());
        }
        let gather = match &rec.gather {
            Some(Ok((g, _))) => g,
            Some(Err(region)) => {
                return Err(PlanError::BaselineNotCovered { tensor: st.name.clone(), extent: Box::new(rec.full), region: region.clone() })
            }
            None => return Err(fail_pieces()),
        };
        let receivers = chains[rec.chain as usize].receivers.len() as u64;
        self.unique_bytes += rec.unique_bytes;
        for &(node, bytes) in &rec.needs {
            self.needs[node as usize] += bytes;
        }
        let finals: u64 = rec.finals.iter().map(|&(_, _, h)| rec.holders[h as usize].len() as u64).sum();
        let pieces = (gather.len() + rec.chunks.len() + rec.finals.len()) as u64;
        let transfers = (gather.len() as u64).saturating_add((rec.chunks.len() as u64).saturating_mul(receivers)).saturating_add(finals);
        // Every tensor's transfers are made and packed, whether or not
        // it shares its recipe.
        budget.take(pieces.saturating_add(transfers), || {
            format!("the baseline, tensor '{}': {pieces} pieces, {transfers} transfers", dt.name)
        })?;
        self.pieces += pieces;
        self.transfers += transfers;
        self.tensors.push((ts, td, id));
        Ok(())
    }

    /// The baseline's time as NCCL runs it ([`PipelinedBroadcast`]): each
    /// recipe once, weighted by the tensors that use it.
    pub(super) fn pipelined_seconds(&self, src: &Layout, dst: &Layout, ends: &Ends, links: &LinkModel) -> f64 {
        let mut uses = vec![0u64; self.recipes.len()];
        for &(_, _, recipe) in &self.tensors {
            uses[recipe as usize] += 1;
        }
        let mut model = PipelinedBroadcast::new(src.ranks(), dst.ranks(), links);
        for (rec, &count) in self.recipes.iter().zip(&uses) {
            let Some(rec) = rec.as_ref().filter(|_| count > 0) else { continue };
            let root = Endpoint::src(rec.root);
            if let Some(Ok((gather, _))) = &rec.gather {
                // One gather message per sender and tensor, whatever the
                // plan's chunks.
                let mut senders: Vec<(Rank, u64)> = Vec::new();
                for &(sender, block, _) in gather.iter().filter(|g| g.0 != rec.root) {
                    let bytes = block.numel().saturating_mul(rec.src_size);
                    match senders.iter_mut().find(|s| s.0 == sender) {
                        Some(s) => s.1 = s.1.saturating_add(bytes),
                        None => senders.push((sender, bytes)),
                    }
                }
                for (sender, bytes) in senders {
                    model.gather(sender, rec.root, ends.cross(Endpoint::src(sender), root), bytes, count);
                }
            }
            let chain = &self.chains[rec.chain as usize];
            let mut nodes: Vec<&[Rank]> = Vec::new();
            let mut start = 0;
            let rpn = dst.ranks_per_node().max(1);
            for i in 1..=chain.receivers.len() {
                if i == chain.receivers.len() || chain.receivers[i] / rpn != chain.receivers[start] / rpn {
                    nodes.push(&chain.receivers[start..i]);
                    start = i;
                }
            }
            model.broadcast(rec.root, rec.full.numel().saturating_mul(rec.wire_size), &nodes, count);
        }
        model.seconds()
    }
}

/// Elements of one chunk of a tensor: its bytes in the wider of the two
/// dtypes (gathers travel in the source dtype, the broadcast in the wire
/// dtype), at least one.
pub(super) fn chunk_elems(chunk: u64, src: DType, dst: DType) -> u64 {
    (chunk / src.size().max(wire_dtype(src, dst).size())).max(1)
}

impl Recipe {
    /// The recipe for source tensor `tensors.0` to destination tensor
    /// `tensors.1` with these dtypes, in chunks of `chunk` bytes; `None`
    /// when the destination holds none of it. Its chains and pairs go to
    /// `interned`; the work of making them is taken from `budget` first
    /// (the chain's hops, the chunks with the blocks kept of each).
    pub(super) fn new(
        src: &Layout,
        dst: &Layout,
        tensors: (u32, u32),
        dtypes: (DType, DType),
        chunk: u64,
        (interned, budget): (&mut Interned, &mut Budget),
    ) -> Result<Option<Recipe>, PlanError> {
        let ((ts, td), (sd, dd)) = (tensors, dtypes);
        let name = || format!("the baseline, tensor '{}'", dst.tensors()[td as usize].name);
        let expand = expand_work(&src.tensors()[ts as usize], &dst.tensors()[td as usize]);
        budget.take(expand, || format!("{}: placed on {expand} ranks in all", name()))?;
        let hd = route::delivered_holdings(dst, td, route::at_destination(dst, td));
        if hd.is_empty() {
            return Ok(None);
        }
        let wire = wire_dtype(sd, dd);
        let (unique_bytes, needs) = needs_of(dst, &hd, wire);
        let full = bounding_box(hd.iter().map(|h| h.block));
        let hs = src.holdings(ts);
        let root = root_of(&src.tensors()[ts as usize], &hs);
        let elems = chunk_elems(chunk, sd, dd);
        let chain = chain_of(&hd, full.numel().div_ceil(elems), dst.ranks_per_node().max(1), (interned, budget), &name)?;
        // A tensor that alone passes the piece limit fails wherever it
        // comes: its pieces are not made.
        let made = full.numel().div_ceil(elems).saturating_mul(2) <= MAX_PIECES;
        if made {
            // Each chunk is covered by the source holdings and met with
            // every destination block.
            let chunks = full.numel().div_ceil(elems);
            let work = chunks.saturating_mul(hd.len() as u64 + 1);
            budget.take(work, || format!("{}: {chunks} chunks, each met with {} destination blocks", name(), hd.len()))?;
        }
        let chunks = if made { full.split_to_fit(elems) } else { Vec::new() };
        let gather = made.then(|| gather_pieces(&hs, &chunks, root, elems, &mut interned.pairs));
        let (chunks, finals, holders, first_pairs) = match &gather {
            Some(Ok(_)) => {
                let (finals, holders) = kept(&hd, &chunks, &interned.chains[chain as usize]);
                let first_pairs = first_pairs(&interned.chains[chain as usize], root, &mut interned.pairs);
                (chunks, finals, holders, first_pairs)
            }
            _ => (Vec::new(), Vec::new(), Vec::new(), Vec::new()),
        };
        Ok(Some(Recipe {
            full,
            root,
            src_size: sd.size(),
            wire_size: wire.size(),
            chunks,
            gather,
            first_pairs,
            chain,
            finals,
            holders,
            unique_bytes,
            needs,
        }))
    }
}

/// The bytes of the union of the destination blocks `hd` (in `wire`), and
/// per destination node the bytes of its ranks' needs (nodes with some):
/// the lower bound's bookkeeping, identical to the reshard's.
fn needs_of(dst: &Layout, hd: &[Holding], wire: DType) -> (u64, Vec<(u32, u64)>) {
    let rpn = dst.ranks_per_node().max(1);
    let (mut unique_bytes, mut needs) = (0u64, vec![0u64; dst.nodes() as usize]);
    for atom in atomize(hd) {
        let bytes = atom.block.numel() * wire.size();
        unique_bytes += bytes;
        add_node_needs(&mut needs, &receivers_of(hd, &atom.holdings), rpn, bytes);
    }
    (unique_bytes, needs.into_iter().enumerate().filter(|&(_, b)| b > 0).map(|(n, b)| (n as u32, b)).collect())
}

/// The source rank that gathers tensor `st`: the first rank of its mesh,
/// or the lowest rank among its holdings `hs`.
fn root_of(st: &TensorLayout, hs: &[Holding]) -> Rank {
    match &st.placement {
        Placement::Mesh(m) => m.ranks.first().copied().unwrap_or(0),
        Placement::Shards(_) => hs.iter().flat_map(|h| h.holders.iter().map(|l| l.rank)).min().unwrap_or(0),
    }
}

/// The chain among every rank holding any of `hd` (`rpn` ranks to a
/// node), interned; the work of its hops (for a chain not interned yet)
/// and of `chunks` chunks' rounds is taken from `budget` first, in the
/// words of `name`.
fn chain_of(
    hd: &[Holding],
    chunks: u64,
    rpn: u32,
    (interned, budget): (&mut Interned, &mut Budget),
    name: &impl Fn() -> String,
) -> Result<u32, PlanError> {
    let all: Vec<u32> = (0..hd.len() as u32).collect();
    let receivers = receivers_of(hd, &all);
    let (hops, nodes) = Chain::hops(&receivers, rpn);
    if !interned.by_receivers.contains_key(&receivers) {
        budget.take(hops, || format!("{}: a broadcast of {hops} hops among {} ranks", name(), receivers.len()))?;
    }
    // Each receiver keeps per-round loads up to the round its last
    // chunk reaches it: past the chain's nodes, one after another, and
    // the chunks.
    let rounds = nodes.saturating_add(chunks).saturating_mul(receivers.len() as u64);
    budget.take(rounds, || format!("{}: {chunks} chunks through a chain of {nodes} nodes", name()))?;
    Ok(interned.chain(receivers, rpn))
}

/// The gather pieces of `chunks` onto `root` ([`Recipe::gather`]): each
/// chunk covered by the source holdings `hs`, a cover sent by the root
/// where it holds it (else its first holder), in pieces of at most `elems`
/// elements; or the region no source holds.
fn gather_pieces(hs: &[Holding], chunks: &[Block], root: Rank, elems: u64, pairs: &mut Pairs) -> Gather {
    let index = SourceIndex::new(hs);
    let (mut g, mut ends) = (Vec::new(), Vec::with_capacity(chunks.len()));
    for c in chunks {
        for cover in index.cover(c)? {
            let sender = if cover.candidates.contains(&root) { root } else { cover.candidates.first().copied().unwrap_or(root) };
            let pair = pairs.id(Endpoint::src(sender), Endpoint::src(root));
            g.extend(cover.block.split_to_fit(elems).into_iter().map(|b| (sender, b, pair)));
        }
        ends.push(g.len() as u32);
    }
    Ok((g, ends))
}

/// What the ranks of `chain` keep of `chunks` ([`Recipe::finals`]), and who
/// keeps each destination block of `hd` ([`Recipe::holders`]).
fn kept(hd: &[Holding], chunks: &[Block], chain: &Chain) -> (Vec<Final>, Vec<Vec<u32>>) {
    let holders: Vec<Vec<u32>> = hd
        .iter()
        .map(|h| {
            let mut ranks: Vec<Rank> = h.holders.iter().map(|l| l.rank).collect();
            ranks.dedup();
            ranks.iter().filter_map(|r| chain.receivers.binary_search(r).ok().map(|i| i as u32)).collect()
        })
        .collect();
    let mut finals = Vec::new();
    for (k, chunk) in chunks.iter().enumerate() {
        for (i, h) in hd.iter().enumerate() {
            if let Some(part) = h.block.intersect(chunk) {
                finals.push((k as u32, part, i as u32));
            }
        }
    }
    (finals, holders)
}

/// Per ring of `chain`, the pair from `root` to the ring's first receiver.
fn first_pairs(chain: &Chain, root: Rank, pairs: &mut Pairs) -> Vec<u32> {
    let entries: Vec<Rank> = chain.channels.iter().map(|ring| chain.receivers[ring.entry as usize]).collect();
    entries.into_iter().map(|entry| pairs.id(Endpoint::src(root), Endpoint::dst(entry))).collect()
}

/// The smallest block containing all `blocks` (at least one).
pub(super) fn bounding_box(mut blocks: impl Iterator<Item = Block>) -> Block {
    let first = blocks.next().unwrap_or_else(|| Block::new(&[], &[]));
    let nd = first.ndim();
    let mut lo: Vec<u64> = first.offset().to_vec();
    let mut hi: Vec<u64> = (0..nd).map(|d| first.end(d)).collect();
    for b in blocks {
        for d in 0..nd {
            lo[d] = lo[d].min(b.offset()[d]);
            hi[d] = hi[d].max(b.end(d));
        }
    }
    let ext: Vec<u64> = (0..nd).map(|d| hi[d] - lo[d]).collect();
    Block::new(&lo, &ext)
}
