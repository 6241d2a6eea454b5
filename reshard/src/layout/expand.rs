//! Placements expanded into blocks: the distinct blocks of every tensor
//! and the places that hold them ([`Layout::holdings`], one rank's
//! [`Layout::rank_holdings`]), and the buffers they fill.

use super::{BufferKey, BufferSpec, Holding, Layout, Loc, MeshDim, MeshPlacement, Placement, Rank, Region, ShardSpec, Storage};
use crate::block::{flat_blocks, Block, MAX_DIMS};
use std::collections::HashMap;
use std::sync::OnceLock;

/// What a [`Layout`] derives from its parts on first use and keeps: its
/// fingerprint, and per rank the tensors it holds a part of, by tensor,
/// with its first position in the rank list of each mesh-placed one (so
/// one rank's holdings and buffers cost a walk of its own tensors, not of
/// every tensor nor of a mesh's ranks: every rank's buffers over thousands
/// of ranks and tensors stay cheap). Two memos always compare equal (they
/// follow from the parts); a clone keeps the fingerprint and rebuilds the
/// rest on first use.
#[derive(Default)]
pub(super) struct Memo {
    pub(super) fingerprint: OnceLock<u64>,
    rank_tensors: OnceLock<Vec<Vec<(u32, u32)>>>,
    /// Per tensor, the id of the named buffer its mesh placement stores
    /// it in (looked up once, not by name for every rank).
    mesh_named: OnceLock<Vec<u32>>,
    /// Every mesh-placed tensor's shape and mesh, packed together (see
    /// [`MeshGeometry`]): a rank's blocks are computed from a few
    /// contiguous megabytes, not from three small allocations per tensor
    /// scattered among the meshes' rank lists.
    geometry: OnceLock<MeshGeometry>,
}

/// The shapes and meshes of a layout's mesh-placed tensors, packed: for
/// tensor `t`, `words[start[t]..]` holds `n` (its dims), `k` (its mesh's
/// dims), its `n` extents, then per mesh dim its size and the tensor dim
/// it shards ([`REPLICATED`] if none).
#[derive(Default)]
struct MeshGeometry {
    start: Vec<usize>,
    words: Vec<u64>,
}

/// A mesh dim that replicates, in [`MeshGeometry`].
const REPLICATED: u64 = u64::MAX;

impl MeshGeometry {
    fn of(tensors: &[super::TensorLayout]) -> MeshGeometry {
        let mut g = MeshGeometry::default();
        for t in tensors {
            g.start.push(g.words.len());
            let Placement::Mesh(m) = &t.placement else { continue };
            g.words.extend([t.shape.len() as u64, m.shape.len() as u64]);
            g.words.extend(&t.shape);
            for (size, dim) in m.shape.iter().zip(&m.dims) {
                let dim = match dim {
                    MeshDim::Shard(d) => *d as u64,
                    MeshDim::Replicate => REPLICATED,
                };
                g.words.extend([*size as u64, dim]);
            }
        }
        g
    }

    /// The block of mesh-placed tensor `t` held at position `pos` of its
    /// mesh's rank list: `torch.chunk` along each sharded dim, lower mesh
    /// dims first, then each piece by the next.
    fn block(&self, t: u32, pos: usize) -> Block {
        let w = &self.words[self.start[t as usize]..];
        let (n, k) = (w[0] as usize, w[1] as usize);
        let (shape, mesh) = w[2..].split_at(n);
        let mut off = [0u64; MAX_DIMS];
        let mut ext = [0u64; MAX_DIMS];
        for (d, e) in ext.iter_mut().enumerate() {
            *e = shape.get(d).copied().unwrap_or(0);
        }
        // `pos` in row-major order over the mesh: the coordinate on dim `i`
        // is `pos / stride % size`, the stride the product of later sizes.
        let mut stride: usize = (0..k).map(|i| mesh[2 * i] as usize).product();
        for i in 0..k {
            let (size, dim) = (mesh[2 * i] as usize, mesh[2 * i + 1]);
            stride /= size.max(1);
            if dim == REPLICATED {
                continue;
            }
            let d = dim as usize;
            let coord = (pos / stride.max(1)) % size.max(1);
            let (lo, hi) = chunk_range(ext[d], size as u64, coord as u64);
            off[d] += lo;
            ext[d] = hi - lo;
        }
        Block::new(&off[..n], &ext[..n])
    }
}

/// The position recorded in [`Memo`]'s per-rank lists for a tensor placed
/// by shards (no mesh).
const NO_MESH: u32 = u32::MAX;

impl Clone for Memo {
    fn clone(&self) -> Memo {
        let fingerprint = OnceLock::new();
        if let Some(&f) = self.fingerprint.get() {
            let _ = fingerprint.set(f);
        }
        Memo { fingerprint, ..Memo::default() }
    }
}

impl PartialEq for Memo {
    fn eq(&self, _: &Memo) -> bool {
        true
    }
}

impl Eq for Memo {}

impl std::fmt::Debug for Memo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Memo")
    }
}

/// Every tensor's [`Layout::rank_holdings`] on one rank, by tensor, each
/// with the index of its buffer in [`Layout::rank_buffers`].
#[derive(Default)]
pub(crate) struct RankHoldings {
    /// The tensor of each holding, ascending.
    tensors: Vec<u32>,
    held: Vec<(Block, Loc, u32)>,
    /// Where the last answer ended: tensors asked in ascending order (a
    /// destination's, as programs walk them) are found by a short step
    /// forward instead of a search.
    after: std::cell::Cell<usize>,
}

impl RankHoldings {
    /// `Layout::rank_holdings(t, rank)` of the rank these are of.
    pub(crate) fn of(&self, t: u32) -> &[(Block, Loc, u32)] {
        let tensors = &self.tensors;
        let after = self.after.get().min(tensors.len());
        let ahead = after == 0 || tensors[after - 1] < t;
        let from = match tensors[after..].iter().take(8).position(|&x| x >= t) {
            Some(i) if ahead => after + i,
            _ => tensors.partition_point(|&x| x < t),
        };
        let to = from + tensors[from..].iter().take_while(|&&x| x == t).count();
        self.after.set(to);
        &self.held[from..to]
    }
}

impl Layout {
    /// `rank`'s first position in the rank list of tensor `t`'s mesh, if
    /// it is in it.
    fn mesh_position(&self, t: u32, rank: Rank) -> Option<usize> {
        let list = self.rank_tensors(rank);
        let i = list.binary_search_by_key(&t, |&(ti, _)| ti).ok()?;
        let pos = list[i].1;
        (pos != NO_MESH).then_some(pos as usize)
    }

    /// The id of the named buffer mesh-placed tensor `t` is stored in (0
    /// if it has none: then it is never asked).
    fn mesh_named(&self, t: u32) -> u32 {
        let ids = self.memo.mesh_named.get_or_init(|| {
            let id = |t: &super::TensorLayout| match &t.placement {
                Placement::Mesh(MeshPlacement { storage: Storage::InBuffer { buffer, .. }, .. }) => {
                    self.buffer_ids.get(buffer).copied().unwrap_or(0)
                }
                _ => 0,
            };
            self.tensors.iter().map(id).collect()
        });
        ids.get(t as usize).copied().unwrap_or(0)
    }

    /// The tensors `rank` holds a part of (it is in the mesh's rank list
    /// or names a shard), by tensor, with its first position in the mesh's
    /// rank list ([`NO_MESH`] for tensors placed by shards).
    fn rank_tensors(&self, rank: Rank) -> &[(u32, u32)] {
        let index = self.memo.rank_tensors.get_or_init(|| {
            let mut index: Vec<Vec<(u32, u32)>> = vec![Vec::new(); self.ranks as usize];
            let mut note = |r: Rank, ti: usize, pos: u32| {
                // Tensors in order, positions ascending: the first
                // position of a rank listed twice is kept.
                let Some(list) = index.get_mut(r as usize) else { return };
                if list.last().is_none_or(|&(last, _)| last != ti as u32) {
                    list.push((ti as u32, pos));
                }
            };
            for (ti, tensor) in self.tensors.iter().enumerate() {
                match &tensor.placement {
                    Placement::Mesh(m) => m.ranks.iter().enumerate().for_each(|(pos, &r)| note(r, ti, pos as u32)),
                    Placement::Shards(shards) => shards.iter().for_each(|s| note(s.rank, ti, NO_MESH)),
                }
            }
            index
        });
        index.get(rank as usize).map_or(&[], |l| l.as_slice())
    }

    /// The block of mesh-placed tensor `t` at position `pos` of its mesh,
    /// held by `rank`, with where it is stored; `None` if it is empty.
    fn mesh_holding(&self, t: u32, m: &MeshPlacement, pos: usize, rank: Rank) -> Option<(Block, Loc)> {
        let (buffer, at) = match &m.storage {
            Storage::Own => (BufferKey::Own { tensor: t, shard: 0 }, 0),
            Storage::InBuffer { at, .. } => (BufferKey::Named(self.mesh_named(t)), *at),
        };
        let block = self.memo.geometry.get_or_init(|| MeshGeometry::of(&self.tensors)).block(t, pos);
        (!block.is_empty()).then_some((block, Loc { rank, buffer, at }))
    }
}

impl Layout {
    /// The distinct blocks of tensor `t` and their holders; empty shards are
    /// skipped. Deterministic; holders within a holding are in rank order.
    pub fn holdings(&self, t: u32) -> Vec<Holding> {
        let tensor = &self.tensors[t as usize];
        match &tensor.placement {
            Placement::Mesh(m) => {
                let (buffer, at) = match &m.storage {
                    Storage::Own => (BufferKey::Own { tensor: t, shard: 0 }, 0),
                    Storage::InBuffer { buffer, at } => (BufferKey::Named(self.buffer_ids.get(buffer).copied().unwrap_or(0)), *at),
                };
                mesh_holdings(&tensor.shape, m, buffer, at)
            }
            Placement::Shards(shards) => {
                let mut out: Vec<Holding> = Vec::new();
                let mut index: HashMap<Block, usize> = HashMap::new();
                for (i, s) in shards.iter().enumerate() {
                    for (block, at) in shard_blocks(&tensor.shape, s) {
                        if block.is_empty() {
                            continue;
                        }
                        let buffer = match &s.storage {
                            Storage::Own => BufferKey::Own { tensor: t, shard: i as u32 },
                            Storage::InBuffer { buffer, .. } => BufferKey::Named(self.buffer_ids.get(buffer).copied().unwrap_or(0)),
                        };
                        let loc = Loc { rank: s.rank, buffer, at };
                        match index.get(&block) {
                            Some(&h) => out[h].holders.push(loc),
                            None => {
                                index.insert(block, out.len());
                                out.push(Holding { block, holders: vec![loc] });
                            }
                        }
                    }
                }
                for h in &mut out {
                    h.holders.sort_by_key(|l| l.rank);
                }
                out
            }
        }
    }

    /// The blocks of tensor `t` that `rank` holds, each with where it is
    /// stored, in the order of [`holdings`](Self::holdings) (a rank may
    /// store one block more than once). For mesh placements this costs the
    /// rank's own block only, not the whole mesh.
    pub fn rank_holdings(&self, t: u32, rank: Rank) -> Vec<(Block, Loc)> {
        let tensor = &self.tensors[t as usize];
        match &tensor.placement {
            Placement::Mesh(m) => {
                let Some(pos) = self.mesh_position(t, rank) else { return Vec::new() };
                self.mesh_holding(t, m, pos, rank).into_iter().collect()
            }
            Placement::Shards(shards) => {
                if !shards.iter().any(|s| s.rank == rank) {
                    return Vec::new();
                }
                let mut out = Vec::new();
                for h in self.holdings(t) {
                    for l in h.holders.iter().filter(|l| l.rank == rank) {
                        out.push((h.block, *l));
                    }
                }
                out
            }
        }
    }

    /// The buffers `rank` must allocate: [`buffers`](Self::buffers)`()[rank]`,
    /// computed from that rank's holdings only.
    pub fn rank_buffers(&self, rank: Rank) -> Vec<BufferSpec> {
        self.rank_buffers_and_holdings(rank, false).0
    }

    /// [`rank_buffers`](Self::rank_buffers), and where `keep` is set every
    /// tensor's [`rank_holdings`](Self::rank_holdings) found on the way (one
    /// walk of the rank's tensors serves both when a program is derived).
    pub(crate) fn rank_buffers_and_holdings(&self, rank: Rank, keep: bool) -> (Vec<BufferSpec>, RankHoldings) {
        let mut out: Vec<BufferSpec> = Vec::new();
        let mut holdings = RankHoldings::default();
        // Where each named buffer is in `out` (by id); a tensor's own
        // buffers are found among those its own holdings added.
        let mut named: Vec<usize> = Vec::new();
        // Adds a holding's buffer (or grows it); its index.
        let mut add = |out: &mut Vec<BufferSpec>, first: usize, block: &Block, loc: &Loc, dtype| -> usize {
            let end = loc.at + block.numel();
            let found = match loc.buffer {
                BufferKey::Named(id) => named.get(id as usize).copied().filter(|&i| i != usize::MAX),
                key => out[first..].iter().position(|b| b.key == key).map(|i| first + i),
            };
            match found {
                Some(i) => {
                    out[i].elems = out[i].elems.max(end);
                    i
                }
                None => {
                    if let BufferKey::Named(id) = loc.buffer {
                        let id = id as usize;
                        if named.len() <= id {
                            named.resize(id + 1, usize::MAX);
                        }
                        named[id] = out.len();
                    }
                    out.push(BufferSpec { key: loc.buffer, name: self.buffer_name(loc.buffer), dtype, elems: end });
                    out.len() - 1
                }
            }
        };
        for &(ti, pos) in self.rank_tensors(rank) {
            let t = &self.tensors[ti as usize];
            let first = out.len();
            let mut keep_one = |block: Block, loc: Loc, buffer: usize| {
                if keep {
                    holdings.tensors.push(ti);
                    holdings.held.push((block, loc, buffer as u32));
                }
            };
            match &t.placement {
                Placement::Mesh(m) => {
                    if let Some((block, loc)) = self.mesh_holding(ti, m, pos as usize, rank) {
                        let i = add(&mut out, first, &block, &loc, t.dtype);
                        keep_one(block, loc, i);
                    }
                }
                Placement::Shards(_) => {
                    for (block, loc) in self.rank_holdings(ti, rank) {
                        let i = add(&mut out, first, &block, &loc, t.dtype);
                        keep_one(block, loc, i);
                    }
                }
            }
        }
        (out, holdings)
    }

    /// The buffers every rank must allocate, indexed by rank. Buffer order
    /// is deterministic (tensor order, then first appearance).
    pub fn buffers(&self) -> Vec<Vec<BufferSpec>> {
        let mut out: Vec<Vec<BufferSpec>> = vec![Vec::new(); self.ranks as usize];
        let mut index: HashMap<(Rank, BufferKey), usize> = HashMap::new();
        for (ti, t) in self.tensors.iter().enumerate() {
            for h in self.holdings(ti as u32) {
                for loc in &h.holders {
                    let end = loc.at + h.block.numel();
                    let list = &mut out[loc.rank as usize];
                    match index.get(&(loc.rank, loc.buffer)) {
                        Some(&i) => list[i].elems = list[i].elems.max(end),
                        None => {
                            index.insert((loc.rank, loc.buffer), list.len());
                            list.push(BufferSpec { key: loc.buffer, name: self.buffer_name(loc.buffer), dtype: t.dtype, elems: end });
                        }
                    }
                }
            }
        }
        out
    }
}

/// The blocks of one explicit shard with the element offset each is stored at.
fn shard_blocks(shape: &[u64], s: &ShardSpec) -> Vec<(Block, u64)> {
    let at = match &s.storage {
        Storage::Own => 0,
        Storage::InBuffer { at, .. } => *at,
    };
    match &s.region {
        Region::Block { offset, extent } => vec![(Block::new(offset, extent), at)],
        Region::Flat { start, len } => {
            let mut pos = at;
            flat_blocks(shape, *start, *len)
                .into_iter()
                .map(|b| {
                    let here = pos;
                    pos += b.numel();
                    (b, here)
                })
                .collect()
        }
    }
}

/// `torch.chunk` split of `n` into `k` parts: part `i` is
/// `[min(i*c, n), min((i+1)*c, n))` with `c = ceil(n / k)`.
pub(crate) fn chunk_range(n: u64, k: u64, i: u64) -> (u64, u64) {
    // In u128: (i + 1) * c may exceed u64 for extents near 2^64.
    let c = n.div_ceil(k) as u128;
    let at = |j: u64| (j as u128 * c).min(n as u128) as u64;
    (at(i), at(i + 1))
}

/// Expands a mesh placement: one holding per combination of coordinates on
/// the sharding mesh dims; ranks differing only on replicate dims share it.
/// Every holder stores its block at element `at` of `buffer`.
pub(super) fn mesh_holdings(shape: &[u64], m: &MeshPlacement, buffer: BufferKey, at: u64) -> Vec<Holding> {
    let nd = m.shape.len();
    let sharded: Vec<usize> = (0..nd).filter(|&i| matches!(m.dims[i], MeshDim::Shard(_))).collect();
    // Holding slot per combination of sharded coordinates (mixed radix).
    let slots: usize = sharded.iter().map(|&i| m.shape[i] as usize).product();
    let mut slot_of: Vec<u32> = vec![u32::MAX; slots];
    let mut out: Vec<Holding> = Vec::new();
    let mut coord = vec![0u32; nd];
    for &rank in &m.ranks {
        let key = sharded.iter().fold(0usize, |k, &i| k * m.shape[i] as usize + coord[i] as usize);
        if slot_of[key] == u32::MAX {
            let mut off = vec![0u64; shape.len()];
            let mut ext = shape.to_vec();
            // Lower mesh dims split first, then each piece by the next.
            for &i in &sharded {
                let MeshDim::Shard(d) = m.dims[i] else { continue };
                let (lo, hi) = chunk_range(ext[d], m.shape[i] as u64, coord[i] as u64);
                off[d] += lo;
                ext[d] = hi - lo;
            }
            slot_of[key] = out.len() as u32;
            out.push(Holding { block: Block::new(&off, &ext), holders: Vec::new() });
        }
        out[slot_of[key] as usize].holders.push(Loc { rank, buffer, at });
        // advance row-major coordinate
        for i in (0..nd).rev() {
            coord[i] += 1;
            if coord[i] < m.shape[i] {
                break;
            }
            coord[i] = 0;
        }
    }
    out.retain(|h| !h.block.is_empty());
    for h in &mut out {
        h.holders.sort_by_key(|l| l.rank);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::layout::TensorLayout;

    fn mesh_tensor(shape: Vec<u64>, mesh: Vec<u32>, dims: Vec<MeshDim>) -> TensorLayout {
        let n: u32 = mesh.iter().product();
        TensorLayout {
            name: "w".into(),
            dtype: DType::F32,
            shape,
            placement: Placement::Mesh(MeshPlacement { shape: mesh, ranks: (0..n).collect(), dims, storage: Storage::Own }),
            scale: None,
        }
    }

    #[test]
    fn chunk_is_torch_chunk() {
        let sizes = |n: u64| -> Vec<u64> {
            (0..4)
                .map(|i| {
                    let (a, b) = chunk_range(n, 4, i);
                    b - a
                })
                .collect()
        };
        // torch.chunk(range(5), 4) -> sizes [2, 2, 1, 0]
        assert_eq!(sizes(5), vec![2, 2, 1, 0]);
        // torch.chunk(range(6), 4) -> [2, 2, 2, 0]
        assert_eq!(sizes(6), vec![2, 2, 2, 0]);
    }

    #[test]
    fn mesh_same_dim_twice_splits_lower_first() {
        // shape [8], mesh [2, 2], both shard(0): rank (i, j) holds chunk j of chunk i.
        let t = mesh_tensor(vec![8], vec![2, 2], vec![MeshDim::Shard(0), MeshDim::Shard(0)]);
        let l = Layout::new(4, None, vec![t]).unwrap();
        let hs = l.holdings(0);
        let got: Vec<(u32, u64, u64)> = hs.iter().map(|h| (h.holders[0].rank, h.block.offset()[0], h.block.extent()[0])).collect();
        assert_eq!(got, vec![(0, 0, 2), (1, 2, 2), (2, 4, 2), (3, 6, 2)]);
    }

    #[test]
    fn replicas_share_a_holding() {
        let t = mesh_tensor(vec![6, 4], vec![2, 3], vec![MeshDim::Replicate, MeshDim::Shard(0)]);
        let l = Layout::new(6, Some(3), vec![t]).unwrap();
        let hs = l.holdings(0);
        assert_eq!(hs.len(), 3);
        assert_eq!(hs[0].holders.iter().map(|h| h.rank).collect::<Vec<_>>(), vec![0, 3]);
        assert_eq!(l.nodes(), 2);
    }
}

#[cfg(test)]
mod rank_holdings_tests {
    use crate::builder::TensorBuilder;
    use crate::dtype::DType;
    use crate::layout::{
        Layout,
        MeshDim::{Replicate, Shard},
        Region, Storage,
    };

    /// Meshes (own and fused buffers, on ranks of their own), flat shards (a
    /// rank holding two), tensors a rank holds none of: the holdings one walk of a
    /// rank's tensors keeps are [`Layout::rank_holdings`], whatever order
    /// they are asked in, each with its buffer's index in `rank_buffers`.
    #[test]
    fn one_walk_keeps_every_tensors_holdings_and_buffer() {
        let flat = |start, len| Region::Flat { start, len };
        let layout = Layout::builder(4)
            .tensor(TensorBuilder::new("a", DType::F32, [8, 6]).mesh([2, 2], [Shard(0), Shard(1)]))
            .tensor(TensorBuilder::new("b", DType::F32, [6]).mesh([4], [Replicate]).buffer("fused", 0))
            .tensor(TensorBuilder::new("c", DType::F32, [5, 4]).mesh([2], [Shard(1)]).on_ranks([3, 1]).buffer("fused", 6))
            .tensor(
                TensorBuilder::new("d", DType::BF16, [3, 5]).shard(0, flat(0, 7), Storage::Own).shard(2, flat(7, 8), Storage::Own).shard(
                    0,
                    flat(7, 8),
                    Storage::Own,
                ),
            )
            .tensor(TensorBuilder::new("e", DType::F32, [4]).mesh([2], [Shard(0)]).on_ranks([2, 0]))
            .build()
            .expect("a valid layout");
        let tensors = layout.tensors().len() as u32;
        for rank in 0..layout.ranks() {
            let (buffers, held) = layout.rank_buffers_and_holdings(rank, true);
            assert_eq!(buffers, layout.rank_buffers(rank));
            let orders: [Vec<u32>; 3] = [(0..tensors).collect(), (0..tensors).rev().collect(), vec![3, 3, 0, 4, 1, 1, 2]];
            for order in orders {
                for t in order {
                    let got = held.of(t);
                    let want = layout.rank_holdings(t, rank);
                    assert_eq!(got.iter().map(|&(b, l, _)| (b, l)).collect::<Vec<_>>(), want, "rank {rank}, tensor {t}");
                    for &(_, loc, i) in got {
                        assert_eq!(buffers[i as usize].key, loc.buffer, "rank {rank}, tensor {t}");
                    }
                }
            }
        }
    }
}
