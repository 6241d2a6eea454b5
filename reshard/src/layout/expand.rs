//! Placements expanded into blocks: the distinct blocks of every tensor
//! and the places that hold them ([`Layout::holdings`], one rank's
//! [`Layout::rank_holdings`]), and the buffers they fill.

use super::{BufferKey, BufferSpec, Holding, Layout, Loc, MeshDim, MeshPlacement, Placement, Rank, Region, ShardSpec, Storage};
use crate::block::{flat_blocks, Block};
use std::collections::HashMap;
use std::sync::OnceLock;

/// What a [`Layout`] derives from its parts on first use and keeps: its
/// fingerprint, and per rank the mesh-placed tensors it is in with its
/// first position in each mesh's rank list, by tensor (so one rank's
/// holdings cost a lookup per tensor, not a scan of the mesh's ranks:
/// a rank's buffers over thousands of ranks and tensors stay cheap).
/// Two memos always compare equal (they follow from the parts); a clone
/// starts empty.
#[derive(Default)]
pub(super) struct Memo {
    pub(super) fingerprint: OnceLock<u64>,
    mesh_positions: OnceLock<Vec<Vec<(u32, u32)>>>,
}

impl Clone for Memo {
    fn clone(&self) -> Memo {
        Memo::default()
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

impl Layout {
    /// `rank`'s first position in the rank list of tensor `t`'s mesh, if
    /// it is in it.
    fn mesh_position(&self, t: u32, rank: Rank) -> Option<usize> {
        let list = self.mesh_positions(rank);
        list.binary_search_by_key(&t, |&(ti, _)| ti).ok().map(|i| list[i].1 as usize)
    }

    /// The mesh-placed tensors `rank` is in, by tensor, with its first
    /// position in each mesh's rank list.
    fn mesh_positions(&self, rank: Rank) -> &[(u32, u32)] {
        let index = self.memo.mesh_positions.get_or_init(|| {
            let mut index: Vec<Vec<(u32, u32)>> = vec![Vec::new(); self.ranks as usize];
            for (ti, tensor) in self.tensors.iter().enumerate() {
                let Placement::Mesh(m) = &tensor.placement else { continue };
                for (pos, &r) in m.ranks.iter().enumerate() {
                    // Tensors in order, positions ascending: the first
                    // position of a rank listed twice is kept.
                    let Some(list) = index.get_mut(r as usize) else { continue };
                    if list.last().is_none_or(|&(last, _)| last != ti as u32) {
                        list.push((ti as u32, pos as u32));
                    }
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
            Storage::InBuffer { buffer, at } => (BufferKey::Named(self.buffer_ids.get(buffer).copied().unwrap_or(0)), *at),
        };
        let block = mesh_block(&self.tensors[t as usize].shape, m, pos);
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
        let mut out: Vec<BufferSpec> = Vec::new();
        let mut index: HashMap<BufferKey, usize> = HashMap::new();
        // The rank's meshes in tensor order, walked beside the tensors.
        let mut meshes = self.mesh_positions(rank).iter().peekable();
        for (ti, t) in self.tensors.iter().enumerate() {
            let held = match &t.placement {
                Placement::Mesh(m) => match meshes.next_if(|&&(mt, _)| mt == ti as u32) {
                    Some(&(_, pos)) => self.mesh_holding(ti as u32, m, pos as usize, rank).into_iter().collect(),
                    None => Vec::new(),
                },
                Placement::Shards(_) => self.rank_holdings(ti as u32, rank),
            };
            for (block, loc) in held {
                let end = loc.at + block.numel();
                match index.get(&loc.buffer) {
                    Some(&i) => out[i].elems = out[i].elems.max(end),
                    None => {
                        index.insert(loc.buffer, out.len());
                        out.push(BufferSpec { key: loc.buffer, name: self.buffer_name(loc.buffer), dtype: t.dtype, elems: end });
                    }
                }
            }
        }
        out
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

/// The block held by the rank at position `pos` of a mesh's rank list.
fn mesh_block(shape: &[u64], m: &MeshPlacement, pos: usize) -> Block {
    let mut coord = vec![0u32; m.shape.len()];
    let mut rest = pos;
    for i in (0..m.shape.len()).rev() {
        coord[i] = (rest % m.shape[i] as usize) as u32;
        rest /= m.shape[i] as usize;
    }
    let mut off = vec![0u64; shape.len()];
    let mut ext = shape.to_vec();
    // Lower mesh dims split first, then each piece by the next.
    for (i, p) in m.dims.iter().enumerate() {
        let MeshDim::Shard(d) = *p else { continue };
        let (lo, hi) = chunk_range(ext[d], m.shape[i] as u64, coord[i] as u64);
        off[d] += lo;
        ext[d] = hi - lo;
    }
    Block::new(&off, &ext)
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
        // torch.chunk(range(5), 4) -> sizes [2, 2, 1, 0]
        let sizes: Vec<u64> = (0..4)
            .map(|i| {
                let (a, b) = chunk_range(5, 4, i);
                b - a
            })
            .collect();
        assert_eq!(sizes, vec![2, 2, 1, 0]);
        // torch.chunk(range(6), 4) -> [2, 2, 2, 0]
        let sizes: Vec<u64> = (0..4)
            .map(|i| {
                let (a, b) = chunk_range(6, 4, i);
                b - a
            })
            .collect();
        assert_eq!(sizes, vec![2, 2, 2, 0]);
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
