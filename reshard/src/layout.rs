//! The layout IR: which blocks of each tensor every rank holds, and where in
//! that rank's memory each block lives.
//!
//! A [`Layout`] is always valid: [`Layout::new`] checks every rule and is the
//! only way to make one. Mesh placements stay in their compact form; the
//! planner expands them per tensor with [`Layout::holdings`].

use crate::block::{flat_blocks, Block, MAX_DIMS};
use crate::dtype::DType;
use crate::file::escape;
pub use crate::quant::BlockScale;
use std::collections::HashMap;
use thiserror::Error;

/// Index of a rank within its group.
pub type Rank = u32;

/// Most ranks one group may have.
pub const MAX_RANKS: u32 = 1 << 20;

/// How a mesh dimension places a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum MeshDim {
    /// Every coordinate along this mesh dim holds the same data.
    Replicate,
    /// Tensor dim `d` is split along this mesh dim (`torch.chunk` semantics).
    Shard(usize),
}

/// A tensor placed on a (sub-)mesh of ranks, DTensor style.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct MeshPlacement {
    /// Size of each mesh dimension.
    pub shape: Vec<u32>,
    /// Ranks in row-major order of mesh coordinates (`len == product(shape)`).
    pub ranks: Vec<Rank>,
    /// One placement per mesh dimension.
    pub dims: Vec<MeshDim>,
    /// Where every rank stores its local block: a buffer of its own, or
    /// row-major from element `at` of the rank's named buffer (the same name
    /// and offset on every rank of the mesh; local blocks may differ in size).
    pub storage: Storage,
}

/// Which part of a tensor a shard holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Region {
    /// A box: offset and extent per dimension.
    Block {
        /// Start index per dimension.
        offset: Vec<u64>,
        /// Length per dimension.
        extent: Vec<u64>,
    },
    /// A range `[start, start + len)` of the row-major flattened tensor.
    Flat {
        /// First flat index.
        start: u64,
        /// Number of elements.
        len: u64,
    },
}

/// Where a shard is stored in its rank's memory.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Storage {
    /// A buffer of its own, holding exactly this shard.
    Own,
    /// Row-major from element `at` of the rank's buffer named `buffer`
    /// (shared with other shards: fused QKV, gate_up, flat FSDP buffers).
    InBuffer {
        /// Buffer name, unique per rank.
        buffer: String,
        /// Element offset within the buffer.
        at: u64,
    },
}

/// One shard of an explicitly placed tensor.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ShardSpec {
    /// Holding rank.
    pub rank: Rank,
    /// Part of the tensor held.
    pub region: Region,
    /// Where it lives.
    pub storage: Storage,
}

/// How a tensor is spread over ranks.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Placement {
    /// Mesh plus one placement per mesh dim; each rank's block in its own
    /// buffer or at one offset of a named buffer.
    Mesh(MeshPlacement),
    /// An explicit list of shards.
    Shards(Vec<ShardSpec>),
}

impl Placement {
    /// Hashes where the blocks are (mesh, ranks and placements, or the
    /// shards' ranks and regions), not where they are stored.
    pub(crate) fn hash_geometry<H: std::hash::Hasher>(&self, h: &mut H) {
        use std::hash::Hash;
        match self {
            Placement::Mesh(m) => {
                0u8.hash(h);
                m.shape.hash(h);
                m.ranks.hash(h);
                m.dims.hash(h);
            }
            Placement::Shards(shards) => {
                1u8.hash(h);
                shards.len().hash(h);
                for s in shards {
                    s.rank.hash(h);
                    s.region.hash(h);
                }
            }
        }
    }

    /// Whether both place the same blocks on the same ranks, wherever each
    /// stores them.
    pub(crate) fn same_geometry(&self, other: &Placement) -> bool {
        match (self, other) {
            (Placement::Mesh(a), Placement::Mesh(b)) => a.shape == b.shape && a.ranks == b.ranks && a.dims == b.dims,
            (Placement::Shards(a), Placement::Shards(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.rank == y.rank && x.region == y.region)
            }
            _ => false,
        }
    }
}

/// One logical tensor of a layout.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct TensorLayout {
    /// Unique name (e.g. `layers.0.attn.q_proj.weight`).
    pub name: String,
    /// Element type on this side.
    pub dtype: DType,
    /// Global shape; empty for a scalar.
    pub shape: Vec<u64>,
    /// Where the pieces are.
    pub placement: Placement,
    /// For an `f8e4m3` destination tensor: its block scale (the scale
    /// tensor and the block shape); see [`crate::quant`].
    pub scale: Option<BlockScale>,
}

/// Identifies one buffer of a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum BufferKey {
    /// The own buffer of shard `shard` of tensor `tensor` (indices into the layout).
    Own {
        /// Tensor index.
        tensor: u32,
        /// Shard index within the tensor's shard list (0 for mesh placements).
        shard: u32,
    },
    /// A named buffer (index into [`Layout::buffer_names`]).
    Named(u32),
    /// A planner-owned scratch buffer holding the whole of tensor `tensor`
    /// (used by the gather-broadcast baseline).
    Scratch {
        /// Tensor index.
        tensor: u32,
    },
    /// A planner-owned buffer on a destination rank holding the whole
    /// blocks of block-scaled tensor `tensor` it needs, unquantized
    /// ([`crate::quant`]).
    Unquantized {
        /// Tensor index.
        tensor: u32,
    },
}

/// A place where a block is stored: rank, buffer and element offset of the
/// block's first element (the block is stored row-major from there).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Loc {
    /// Holding rank.
    pub rank: Rank,
    /// Buffer on that rank.
    pub buffer: BufferKey,
    /// Element offset in the buffer.
    pub at: u64,
}

/// A distinct block of a tensor and every place that holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    /// The block.
    pub block: Block,
    /// All holders, in rank order (a rank may appear more than once).
    pub holders: Vec<Loc>,
}

/// One buffer a rank must allocate.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BufferSpec {
    /// Which buffer.
    pub key: BufferKey,
    /// Human name (`qkv`, `w#0`, ...).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Size in elements.
    pub elems: u64,
}

/// Why a layout was rejected. Messages name the tensor, rank or field.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum LayoutError {
    /// A field has a bad value.
    #[error("{field}: {problem}")]
    Field {
        /// Path of the field (e.g. `tensors[2].mesh.ranks`).
        field: String,
        /// What is wrong.
        problem: String,
    },
    /// A tensor-level rule is broken.
    #[error("tensor '{tensor}': {problem}")]
    Tensor {
        /// Tensor name.
        tensor: String,
        /// What is wrong.
        problem: String,
    },
    /// Two shards overlap in one buffer.
    #[error(
        "rank {rank}: buffer '{buffer}': elements {a_start}..{a_end} of tensor '{a}' overlap elements {b_start}..{b_end} of tensor '{b}'"
    )]
    BufferOverlap {
        /// Rank.
        rank: Rank,
        /// Buffer name.
        buffer: String,
        /// First tensor.
        a: String,
        /// Its buffer range start.
        a_start: u64,
        /// Its buffer range end.
        a_end: u64,
        /// Second tensor.
        b: String,
        /// Its buffer range start.
        b_start: u64,
        /// Its buffer range end.
        b_end: u64,
    },
}

fn field(field: impl Into<String>, problem: impl Into<String>) -> LayoutError {
    LayoutError::Field { field: field.into(), problem: problem.into() }
}

fn tensor_err(t: &str, problem: impl Into<String>) -> LayoutError {
    LayoutError::Tensor { tensor: t.to_string(), problem: problem.into() }
}

/// A validated layout of one group of ranks.
///
/// It serializes as its parts (ranks, ranks per node, tensors) and
/// deserializes through [`Layout::new`], so a layout that arrives in a
/// message is checked like one read from a file.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "LayoutParts")]
pub struct Layout {
    ranks: u32,
    ranks_per_node: u32,
    tensors: Vec<TensorLayout>,
    buffer_names: Vec<String>,
    buffer_ids: HashMap<String, u32>,
    named_dtypes: Vec<DType>,
    by_name: HashMap<String, u32>,
    /// Per tensor: the index of its scale tensor, if block-scaled.
    scale_ids: Vec<Option<u32>>,
    /// Per tensor: the tensor it is the scale of, if any.
    scale_for: Vec<Option<u32>>,
}

/// What a [`Layout`] is made of, as it travels.
#[derive(serde::Deserialize)]
struct LayoutParts {
    ranks: u32,
    ranks_per_node: u32,
    tensors: Vec<TensorLayout>,
}

impl TryFrom<LayoutParts> for Layout {
    type Error = LayoutError;

    fn try_from(p: LayoutParts) -> Result<Layout, LayoutError> {
        Layout::new(p.ranks, Some(p.ranks_per_node), p.tensors)
    }
}

impl serde::Serialize for Layout {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("LayoutParts", 3)?;
        st.serialize_field("ranks", &self.ranks)?;
        st.serialize_field("ranks_per_node", &self.ranks_per_node)?;
        st.serialize_field("tensors", &self.tensors)?;
        st.end()
    }
}

impl Layout {
    /// Validates and builds a layout. `ranks_per_node: None` puts all ranks
    /// on one node.
    pub fn new(ranks: u32, ranks_per_node: Option<u32>, tensors: Vec<TensorLayout>) -> Result<Layout, LayoutError> {
        Self::build(ranks, ranks_per_node, tensors, true)
    }

    /// [`Layout::new`]; `shortcut: false` runs the per-rank overlap sweep
    /// on every buffer (the tests compare both).
    fn build(ranks: u32, ranks_per_node: Option<u32>, tensors: Vec<TensorLayout>, shortcut: bool) -> Result<Layout, LayoutError> {
        if ranks == 0 {
            return Err(field("ranks", "must be at least 1"));
        }
        if ranks > MAX_RANKS {
            return Err(field("ranks", format!("{ranks} ranks; at most {MAX_RANKS} are supported")));
        }
        let ranks_per_node = match ranks_per_node {
            Some(0) => return Err(field("ranks_per_node", "must be at least 1")),
            Some(n) => n,
            None => ranks,
        };
        let mut by_name = HashMap::with_capacity(tensors.len());
        let mut buffer_names: Vec<String> = Vec::new();
        let mut buffer_ids: HashMap<String, u32> = HashMap::new();
        let mut named_dtypes: Vec<DType> = Vec::new();
        // Per rank: the index + 1 of the last mesh tensor that listed it.
        let mut seen: Vec<u32> = Vec::new();
        // The buffer id of every stored region, in the order in which
        // `check_named_buffers` meets them; the last name looked up (runs of
        // tensors share a fused buffer).
        let mut stored_ids: Vec<u32> = Vec::new();
        let mut last: Option<(&str, u32)> = None;
        for (i, t) in tensors.iter().enumerate() {
            if t.name.is_empty() {
                return Err(field(format!("tensors[{i}].name"), "must not be empty"));
            }
            if has_control(&t.name) {
                return Err(field(format!("tensors[{i}].name"), format!("'{}' contains control characters", escape(&t.name))));
            }
            if by_name.insert(t.name.clone(), i as u32).is_some() {
                return Err(field(format!("tensors[{i}].name"), format!("duplicate tensor name '{}'", t.name)));
            }
            validate_tensor(t, ranks, i as u32 + 1, &mut seen)?;
            let (mesh_storage, shards): (Option<&Storage>, &[ShardSpec]) = match &t.placement {
                Placement::Mesh(m) => (Some(&m.storage), &[]),
                Placement::Shards(shards) => (None, shards),
            };
            for storage in mesh_storage.into_iter().chain(shards.iter().map(|s| &s.storage)) {
                if let Storage::InBuffer { buffer, .. } = storage {
                    let id = match last {
                        Some((name, id)) if name == buffer => id,
                        _ => match buffer_ids.get(buffer) {
                            Some(&id) => id,
                            None => {
                                let id = buffer_names.len() as u32;
                                buffer_ids.insert(buffer.clone(), id);
                                buffer_names.push(buffer.clone());
                                named_dtypes.push(t.dtype);
                                id
                            }
                        },
                    };
                    last = Some((buffer.as_str(), id));
                    stored_ids.push(id);
                }
            }
        }
        let (scale_ids, scale_for) = check_scales(&tensors, &by_name)?;
        let layout = Layout { ranks, ranks_per_node, tensors, buffer_names, buffer_ids, named_dtypes, by_name, scale_ids, scale_for };
        layout.check_named_buffers(&stored_ids, shortcut)?;
        Ok(layout)
    }

    /// Number of ranks in the group.
    pub fn ranks(&self) -> u32 {
        self.ranks
    }

    /// Ranks per node (the last node may be partly filled).
    pub fn ranks_per_node(&self) -> u32 {
        self.ranks_per_node
    }

    /// Node of a rank.
    pub fn node_of(&self, rank: Rank) -> u32 {
        rank / self.ranks_per_node
    }

    /// Number of nodes.
    pub fn nodes(&self) -> u32 {
        self.ranks.div_ceil(self.ranks_per_node)
    }

    /// All tensors, in file order.
    pub fn tensors(&self) -> &[TensorLayout] {
        &self.tensors
    }

    /// Index of the tensor named `name`.
    pub fn tensor_index(&self, name: &str) -> Option<u32> {
        self.by_name.get(name).copied()
    }

    /// The scale tensor and block shape of block-scaled tensor `t`.
    pub fn scale_of(&self, t: u32) -> Option<(u32, &[u64])> {
        let s = self.scale_ids.get(t as usize).copied().flatten()?;
        let block = self.tensors[t as usize].scale.as_ref().map(|b| b.block.as_slice())?;
        Some((s, block))
    }

    /// The block-scaled tensor that tensor `s` is the scale of.
    pub fn scale_for(&self, s: u32) -> Option<u32> {
        self.scale_for.get(s as usize).copied().flatten()
    }

    /// Names of the named buffers ([`BufferKey::Named`] indexes this).
    pub fn buffer_names(&self) -> &[String] {
        &self.buffer_names
    }

    /// Human name of a buffer.
    pub fn buffer_name(&self, key: BufferKey) -> String {
        match key {
            BufferKey::Own { tensor, shard } => format!("{}#{shard}", self.tensors[tensor as usize].name),
            BufferKey::Named(i) => self.buffer_names[i as usize].clone(),
            BufferKey::Scratch { tensor } => format!("scratch:{}", self.tensors[tensor as usize].name),
            BufferKey::Unquantized { tensor } => format!("unquantized:{}", self.tensors[tensor as usize].name),
        }
    }

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
                let Some(pos) = m.ranks.iter().position(|&r| r == rank) else { return Vec::new() };
                let (buffer, at) = match &m.storage {
                    Storage::Own => (BufferKey::Own { tensor: t, shard: 0 }, 0),
                    Storage::InBuffer { buffer, at } => (BufferKey::Named(self.buffer_ids.get(buffer).copied().unwrap_or(0)), *at),
                };
                let block = mesh_block(&tensor.shape, m, pos);
                if block.is_empty() {
                    return Vec::new();
                }
                vec![(block, Loc { rank, buffer, at })]
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
        for (ti, t) in self.tensors.iter().enumerate() {
            for (block, loc) in self.rank_holdings(ti as u32, rank) {
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

    /// A stable 64-bit hash of the whole layout (ranks, nodes, every
    /// tensor's name, type, shape and placement): members of one group
    /// report it so that the layout itself travels once.
    pub fn fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = crate::fingerprint::Fnv64::default();
        self.ranks.hash(&mut h);
        self.ranks_per_node.hash(&mut h);
        self.tensors.hash(&mut h);
        h.finish() ^ crate::fingerprint::fnv64("refit-layout-v1")
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

    /// Checks the named-buffer rules: one dtype per buffer name, and no two
    /// stored regions overlapping in one buffer of one rank. Mesh-form
    /// tensors are expanded per rank one buffer name at a time, so that the
    /// check needs memory for the largest buffer only. `ids` holds the
    /// buffer id of every stored region, in tensor and shard order;
    /// `shortcut` skips the sweep of buffers filled front to back.
    fn check_named_buffers(&self, ids: &[u32], shortcut: bool) -> Result<(), LayoutError> {
        /// A tensor's mesh placement (rather than one of its shards).
        const MESH: u32 = u32::MAX;
        // Per buffer id: (at, tensor, shard index or MESH) stored in it.
        let mut members: Vec<Vec<(u64, u32, u32)>> = vec![Vec::new(); self.buffer_names.len()];
        let mut first: Vec<u32> = vec![u32::MAX; self.buffer_names.len()];
        let mut ids = ids.iter();
        for (ti, t) in self.tensors.iter().enumerate() {
            let mut add = |which: u32, rank: Rank, buffer: &str, at: u64| -> Result<(), LayoutError> {
                let id = ids.next().map_or_else(|| self.buffer_ids[buffer], |&id| id) as usize;
                debug_assert_eq!(id, self.buffer_ids[buffer] as usize);
                if first[id] == u32::MAX {
                    first[id] = ti as u32;
                }
                let other = &self.tensors[first[id] as usize];
                if other.dtype != t.dtype {
                    return Err(tensor_err(
                        &t.name,
                        format!(
                            "rank {rank}: buffer '{buffer}' already holds {} elements of tensor '{}', so it cannot take {} elements; one buffer has one dtype",
                            other.dtype, other.name, t.dtype
                        ),
                    ));
                }
                members[id].push((at, ti as u32, which));
                Ok(())
            };
            match &t.placement {
                Placement::Mesh(m) => {
                    if let Storage::InBuffer { buffer, at } = &m.storage {
                        add(MESH, m.ranks[0], buffer, *at)?;
                    }
                }
                Placement::Shards(shards) => {
                    for (i, s) in shards.iter().enumerate() {
                        if let Storage::InBuffer { buffer, at } = &s.storage {
                            add(i as u32, s.rank, buffer, *at)?;
                        }
                    }
                }
            }
        }
        // Per buffer, a sweep in order of `at` (the same on every rank of a
        // mesh): on each rank, a region overlaps an earlier one exactly when
        // it starts before the furthest end so far. Per rank: (buffer id + 1
        // when last written, start, end, tensor) of the furthest-reaching region.
        let mut state: Vec<(u32, u64, u64, u32)> = vec![(0, 0, 0, 0); self.ranks as usize];
        let overlap = |rank: Rank, id: usize, a: (u64, u64, u32), b: (u64, u64, u32)| LayoutError::BufferOverlap {
            rank,
            buffer: self.buffer_names[id].clone(),
            a: self.tensors[a.2 as usize].name.clone(),
            a_start: a.0,
            a_end: a.1,
            b: self.tensors[b.2 as usize].name.clone(),
            b_start: b.0,
            b_end: b.1,
        };
        for (id, list) in members.iter_mut().enumerate() {
            let gen = id as u32 + 1;
            // The entries are distinct, so an unstable sort keeps the order
            // (at, tensor, shard) deterministic.
            list.sort_unstable();
            if shortcut && in_order_without_overlap(&self.tensors, list) {
                // The common case (fused buffers filled front to back): no
                // rank can see an overlap, so skip the per-rank sweep.
                continue;
            }
            // Adds one region to the sweep of every rank in `ranks` (all the
            // ranks of a mesh in the common case: the hot loop).
            let mut visit = |ranks: &[Rank], region: (u64, u64, u32)| -> Result<(), LayoutError> {
                match sweep(&mut state, ranks, gen, region) {
                    Some((rank, earlier)) => Err(overlap(rank, id, earlier, region)),
                    None => Ok(()),
                }
            };
            for &(at, ti, which) in list.iter() {
                let t = &self.tensors[ti as usize];
                match &t.placement {
                    Placement::Mesh(mesh) => {
                        if let Some(len) = uniform_local_elems(&t.shape, mesh) {
                            // Every rank holds a block of `len` elements (the common case, no expansion).
                            if len > 0 {
                                visit(&mesh.ranks, (at, at.saturating_add(len), ti))?;
                            }
                            continue;
                        }
                        for h in mesh_holdings(&t.shape, mesh, BufferKey::Named(id as u32), at) {
                            // `at` + the largest local block was checked to fit.
                            let end = at.saturating_add(h.block.numel());
                            for l in &h.holders {
                                visit(std::slice::from_ref(&l.rank), (at, end, ti))?;
                            }
                        }
                    }
                    Placement::Shards(shards) => {
                        let s = &shards[which as usize];
                        let len = region_len(&s.region);
                        if len == 0 {
                            continue;
                        }
                        let end = at.checked_add(len).ok_or_else(|| {
                            tensor_err(&t.name, format!("rank {}: buffer '{}': at + size overflows", s.rank, self.buffer_names[id]))
                        })?;
                        visit(std::slice::from_ref(&s.rank), (at, end, ti))?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Whether the regions stored in one buffer (`list`: (at, tensor, shard or
/// mesh), sorted) follow one another: each non-empty region starts at or
/// after the furthest end of all before it, on any rank. Then the per-rank
/// sweep of `check_named_buffers` finds nothing. `false` also when a check
/// needs the sweep (an uneven mesh, an end past `u64::MAX`).
fn in_order_without_overlap(tensors: &[TensorLayout], list: &[(u64, u32, u32)]) -> bool {
    let mut furthest = 0u64;
    for &(at, ti, which) in list {
        let t = &tensors[ti as usize];
        let len = match &t.placement {
            Placement::Mesh(mesh) => match uniform_local_elems(&t.shape, mesh) {
                Some(len) => len,
                None => return false,
            },
            Placement::Shards(shards) => region_len(&shards[which as usize].region),
        };
        if len == 0 {
            continue;
        }
        match at.checked_add(len) {
            Some(end) if at >= furthest => furthest = end,
            _ => return false,
        }
    }
    true
}

/// One step of the per-rank overlap sweep of `check_named_buffers`: adds
/// `region` (start, end, tensor) of buffer generation `gen` to the state of
/// every rank in `ranks`, or returns the first rank where it overlaps an
/// earlier region, and that region.
fn sweep(state: &mut [(u32, u64, u64, u32)], ranks: &[Rank], gen: u32, region: (u64, u64, u32)) -> Option<(Rank, (u64, u64, u32))> {
    for &rank in ranks {
        let st = &mut state[rank as usize];
        if st.0 == gen && region.0 < st.2 {
            return Some((rank, (st.1, st.2, st.3)));
        }
        if st.0 != gen || region.1 > st.2 {
            *st = (gen, region.0, region.1, region.2);
        }
    }
    None
}

/// The element count of every rank's local block of a mesh placement, when
/// every split is exact (all local blocks equally large).
fn uniform_local_elems(shape: &[u64], m: &MeshPlacement) -> Option<u64> {
    let mut ext = [0u64; MAX_DIMS];
    let ext = &mut ext[..shape.len()];
    ext.copy_from_slice(shape);
    for (i, p) in m.dims.iter().enumerate() {
        if let MeshDim::Shard(d) = p {
            let k = m.shape[i] as u64;
            if !ext[*d].is_multiple_of(k) {
                return None;
            }
            ext[*d] /= k;
        }
    }
    Some(ext.iter().product())
}

fn region_len(r: &Region) -> u64 {
    match r {
        Region::Block { extent, .. } => extent.iter().product(),
        Region::Flat { len, .. } => *len,
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

/// Checks every tensor's block scale (see [`crate::quant`]): an `f8e4m3`
/// tensor, a scale tensor of the same layout that is f32, of shape
/// `ceil(shape / block)`, itself unscaled and the scale of no other tensor.
/// Returns per tensor its scale's index, and the tensor each scale serves.
#[allow(clippy::type_complexity)]
fn check_scales(tensors: &[TensorLayout], by_name: &HashMap<String, u32>) -> Result<(Vec<Option<u32>>, Vec<Option<u32>>), LayoutError> {
    let mut ids = vec![None; tensors.len()];
    let mut serves: Vec<Option<u32>> = vec![None; tensors.len()];
    for (i, t) in tensors.iter().enumerate() {
        let Some(scale) = &t.scale else { continue };
        let at = |f: &str| format!("tensors[{i}].scale{f}");
        if t.dtype != DType::F8E4M3 {
            return Err(field(at(""), format!("only f8e4m3 tensors are block-scaled; '{}' is {}", escape(&t.name), t.dtype)));
        }
        if scale.block.len() != t.shape.len() {
            return Err(field(at(".block"), format!("{} dimensions for a tensor of {} ({:?})", scale.block.len(), t.shape.len(), t.shape)));
        }
        if let Some(d) = scale.block.iter().position(|&b| b == 0) {
            return Err(field(format!("{}[{d}]", at(".block")), "must be at least 1"));
        }
        let Some(&s) = by_name.get(&scale.tensor) else {
            return Err(field(at(".tensor"), format!("no tensor named '{}' in this layout", escape(&scale.tensor))));
        };
        let st = &tensors[s as usize];
        if s as usize == i {
            return Err(field(at(".tensor"), "a tensor cannot be its own scale"));
        }
        if st.dtype != DType::F32 {
            return Err(field(at(".tensor"), format!("scale tensor '{}' is {}; scales are f32", escape(&st.name), st.dtype)));
        }
        let want: Vec<u64> = t.shape.iter().zip(&scale.block).map(|(&n, &b)| n.div_ceil(b)).collect();
        if st.shape != want {
            return Err(field(
                at(".tensor"),
                format!(
                    "scale tensor '{}' has shape {:?}; blocks of {:?} over {:?} need {want:?}",
                    escape(&st.name),
                    st.shape,
                    scale.block,
                    t.shape
                ),
            ));
        }
        if st.scale.is_some() {
            return Err(field(at(".tensor"), format!("scale tensor '{}' is block-scaled itself", escape(&st.name))));
        }
        if let Some(other) = serves[s as usize] {
            return Err(field(
                at(".tensor"),
                format!("'{}' is already the scale of '{}'", escape(&st.name), escape(&tensors[other as usize].name)),
            ));
        }
        ids[i] = Some(s);
        serves[s as usize] = Some(i as u32);
    }
    Ok((ids, serves))
}

/// `torch.chunk` split of `n` into `k` parts: part `i` is
/// `[min(i*c, n), min((i+1)*c, n))` with `c = ceil(n / k)`.
pub fn chunk_range(n: u64, k: u64, i: u64) -> (u64, u64) {
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
fn mesh_holdings(shape: &[u64], m: &MeshPlacement, buffer: BufferKey, at: u64) -> Vec<Holding> {
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

/// Whether `s` has a control character (`char::is_control`); printable
/// ASCII (the common case) is checked a byte at a time.
fn has_control(s: &str) -> bool {
    !s.bytes().all(|b| (0x20..0x7f).contains(&b)) && s.chars().any(char::is_control)
}

/// A buffer name must be non-empty and free of control characters;
/// `prefix` locates it in the tensor (`shards[2]: `, or nothing for a mesh).
fn check_buffer_name(tensor: &str, prefix: &str, buffer: &str) -> Result<(), LayoutError> {
    if buffer.is_empty() {
        return Err(tensor_err(tensor, format!("{prefix}buffer name must not be empty")));
    }
    if has_control(buffer) {
        return Err(tensor_err(tensor, format!("{prefix}buffer name '{}' contains control characters", escape(buffer))));
    }
    Ok(())
}

/// `shards[i]`, written only when a message needs it.
struct ShardAt(usize);

impl std::fmt::Display for ShardAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "shards[{}]", self.0)
    }
}

/// Checks one tensor against the layout's `ranks`. `seen` is scratch shared
/// by all tensors: per rank, the `stamp` (distinct per tensor, never 0) of
/// the last mesh that listed the rank, so that no tensor pays for a
/// `ranks`-long list of its own.
fn validate_tensor(t: &TensorLayout, ranks: u32, stamp: u32, seen: &mut Vec<u32>) -> Result<(), LayoutError> {
    let name = t.name.as_str();
    if t.shape.len() > MAX_DIMS {
        return Err(tensor_err(name, format!("{} dims; at most {MAX_DIMS} are supported", t.shape.len())));
    }
    let numel = t.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
    match numel.and_then(|n| n.checked_mul(t.dtype.size())) {
        Some(_) => {}
        None => return Err(tensor_err(name, format!("shape {:?}: element count overflows 64 bits", t.shape))),
    }
    let numel = numel.unwrap_or(0);
    match &t.placement {
        Placement::Mesh(m) => {
            if m.shape.is_empty() {
                return Err(tensor_err(name, "mesh.shape must have at least one dimension"));
            }
            if let Some(i) = m.shape.iter().position(|&s| s == 0) {
                return Err(tensor_err(name, format!("mesh.shape[{i}] is 0")));
            }
            let size = m.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
            if size != Some(m.ranks.len() as u64) {
                let size = size.map_or_else(|| format!("more than {}", u64::MAX), |s| s.to_string());
                return Err(tensor_err(
                    name,
                    format!("mesh.ranks has {} entries but mesh.shape {:?} has {size} positions", m.ranks.len(), m.shape),
                ));
            }
            if m.dims.len() != m.shape.len() {
                return Err(tensor_err(name, format!("{} placements for a {}-d mesh; need one per mesh dim", m.dims.len(), m.shape.len())));
            }
            // Strictly increasing ranks (`0..n` when implied, and most
            // explicit lists) are distinct, the last the largest: only
            // other lists need the per-rank check that names the culprit.
            let falls = m.ranks.iter().zip(m.ranks.iter().skip(1)).filter(|(a, b)| a >= b).count();
            if falls > 0 || m.ranks.last().is_some_and(|&r| r >= ranks) {
                if seen.len() < ranks as usize {
                    seen.resize(ranks as usize, 0);
                }
                for &r in &m.ranks {
                    if r >= ranks {
                        return Err(tensor_err(name, format!("mesh.ranks: rank {r} >= ranks ({ranks})")));
                    }
                    if std::mem::replace(&mut seen[r as usize], stamp) == stamp {
                        return Err(tensor_err(name, format!("mesh.ranks: rank {r} appears twice")));
                    }
                }
            }
            for (i, p) in m.dims.iter().enumerate() {
                if let MeshDim::Shard(d) = p {
                    if *d >= t.shape.len() {
                        return Err(tensor_err(name, format!("placements[{i}]: shard({d}) but the tensor has {} dims", t.shape.len())));
                    }
                }
            }
            if let Storage::InBuffer { buffer, at } = &m.storage {
                check_buffer_name(name, "", buffer)?;
                // The largest local block is the first chunk of every split.
                let mut ext = [0u64; MAX_DIMS];
                let ext = &mut ext[..t.shape.len()];
                ext.copy_from_slice(&t.shape);
                for (i, p) in m.dims.iter().enumerate() {
                    if let MeshDim::Shard(d) = p {
                        ext[*d] = ext[*d].div_ceil(m.shape[i] as u64);
                    }
                }
                let len: u64 = ext.iter().product();
                if at.checked_add(len).and_then(|e| e.checked_mul(t.dtype.size())).is_none() {
                    return Err(tensor_err(name, format!("at {at} + local block size overflows")));
                }
            }
        }
        Placement::Shards(shards) => {
            for (i, s) in shards.iter().enumerate() {
                let at = ShardAt(i);
                if s.rank >= ranks {
                    return Err(tensor_err(name, format!("{at}: rank {} >= ranks ({ranks})", s.rank)));
                }
                match &s.region {
                    Region::Block { offset, extent } => {
                        if offset.len() != t.shape.len() || extent.len() != t.shape.len() {
                            return Err(tensor_err(
                                name,
                                format!(
                                    "{at} (rank {}): offset has {} and extent {} dims, tensor has {}",
                                    s.rank,
                                    offset.len(),
                                    extent.len(),
                                    t.shape.len()
                                ),
                            ));
                        }
                        for d in 0..t.shape.len() {
                            let end = offset[d].checked_add(extent[d]);
                            if end.is_none_or(|e| e > t.shape[d]) {
                                return Err(tensor_err(
                                    name,
                                    format!(
                                        "{at} (rank {}): dim {d}: {}..{} is outside 0..{}",
                                        s.rank,
                                        offset[d],
                                        offset[d].saturating_add(extent[d]),
                                        t.shape[d]
                                    ),
                                ));
                            }
                        }
                    }
                    Region::Flat { start, len } => {
                        if start.checked_add(*len).is_none_or(|e| e > numel) {
                            return Err(tensor_err(
                                name,
                                format!("{at} (rank {}): flat {start}..{} is outside 0..{numel}", s.rank, start.saturating_add(*len)),
                            ));
                        }
                    }
                }
                if let Storage::InBuffer { buffer, at: off } = &s.storage {
                    if buffer.is_empty() || has_control(buffer) {
                        check_buffer_name(name, &format!("{at}: "), buffer)?;
                    }
                    if off.checked_add(region_len(&s.region)).and_then(|e| e.checked_mul(t.dtype.size())).is_none() {
                        return Err(tensor_err(name, format!("{at}: at {off} + size overflows")));
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// A mesh tensor `name` of 8 u8 elements sharded over `ranks`, stored
    /// at `at` of buffer `b` when `at` is given.
    fn on_ranks(name: &str, ranks: Vec<u32>, at: Option<u64>) -> TensorLayout {
        let storage = at.map_or(Storage::Own, |at| Storage::InBuffer { buffer: "b".into(), at });
        TensorLayout {
            name: name.into(),
            dtype: DType::U8,
            shape: vec![8],
            placement: Placement::Mesh(MeshPlacement { shape: vec![ranks.len() as u32], ranks, dims: vec![MeshDim::Shard(0)], storage }),
            scale: None,
        }
    }

    #[test]
    fn mesh_rank_lists_in_any_order() {
        // Unsorted lists share the per-rank scratch: no tensor sees another's ranks.
        let ok = vec![on_ranks("a", vec![3, 1, 2, 0], None), on_ranks("b", vec![1, 0, 3, 2], None), on_ranks("c", vec![0, 1, 2, 3], None)];
        Layout::new(4, None, ok).unwrap();
        let err = |ranks: Vec<u32>| {
            let ts = vec![on_ranks("a", vec![3, 1, 2, 0], None), on_ranks("w", ranks, None)];
            Layout::new(4, None, ts).unwrap_err().to_string()
        };
        assert_eq!(err(vec![1, 0, 1, 2]), "tensor 'w': mesh.ranks: rank 1 appears twice");
        assert_eq!(err(vec![0, 1, 1, 2]), "tensor 'w': mesh.ranks: rank 1 appears twice");
        assert_eq!(err(vec![0, 1, 2, 4]), "tensor 'w': mesh.ranks: rank 4 >= ranks (4)");
        assert_eq!(err(vec![5, 1, 1, 2]), "tensor 'w': mesh.ranks: rank 5 >= ranks (4)");
        assert_eq!(err(vec![2, 2, 1, 7]), "tensor 'w': mesh.ranks: rank 2 appears twice");
    }

    #[test]
    fn shared_buffer_overlaps_name_both_tensors() {
        // 2 elements per rank; "c" starts inside "a" on every rank, first found on rank 0.
        let ts = vec![on_ranks("a", vec![0, 1, 2, 3], Some(0)), on_ranks("c", vec![0, 1, 2, 3], Some(1))];
        assert_eq!(
            Layout::new(4, None, ts).unwrap_err().to_string(),
            "rank 0: buffer 'b': elements 0..2 of tensor 'a' overlap elements 1..3 of tensor 'c'"
        );
        // Back to back, in any file order, with another buffer in between.
        let mut other = on_ranks("x", vec![3, 2, 1, 0], Some(0));
        if let Placement::Mesh(m) = &mut other.placement {
            m.storage = Storage::InBuffer { buffer: "o".into(), at: 0 };
        }
        let ts = vec![on_ranks("c", vec![0, 1, 2, 3], Some(2)), other, on_ranks("a", vec![0, 1, 2, 3], Some(0))];
        let l = Layout::new(4, None, ts).unwrap();
        assert_eq!(l.buffer_names(), ["b".to_string(), "o".to_string()]);
        // The same offset on disjoint ranks (expert groups): no overlap, but
        // only the per-rank sweep can tell.
        let ts = vec![on_ranks("e0", vec![0, 1], Some(0)), on_ranks("e1", vec![2, 3], Some(0)), on_ranks("e2", vec![1, 2], Some(4))];
        Layout::new(4, None, ts).unwrap();
        let ts = vec![on_ranks("e0", vec![0, 1], Some(0)), on_ranks("e1", vec![2, 3], Some(0)), on_ranks("e2", vec![1, 2], Some(3))];
        assert_eq!(
            Layout::new(4, None, ts).unwrap_err().to_string(),
            "rank 1: buffer 'b': elements 0..4 of tensor 'e0' overlap elements 3..7 of tensor 'e2'"
        );
    }

    use proptest::prelude::*;

    /// A random tensor on 4 ranks in buffer "a" or "b": a mesh over some
    /// ranks (even or uneven split) or two flat shards.
    fn stored_tensor(i: usize) -> impl Strategy<Value = TensorLayout> {
        let mesh = (proptest::sample::subsequence(vec![0u32, 1, 2, 3], 1..=4), any::<bool>(), 0u64..12, 5u64..9, any::<bool>()).prop_map(
            move |(ranks, even, at, n, in_a)| {
                let shape = vec![if even { 8 } else { n }];
                let storage = Storage::InBuffer { buffer: if in_a { "a" } else { "b" }.into(), at };
                let mesh = MeshPlacement { shape: vec![ranks.len() as u32], ranks, dims: vec![MeshDim::Shard(0)], storage };
                TensorLayout { name: format!("t{i}"), dtype: DType::U8, shape, placement: Placement::Mesh(mesh), scale: None }
            },
        );
        let shards = (0u32..4, 0u32..4, 0u64..5, 0u64..12, 0u64..12).prop_map(move |(r0, r1, cut, at0, at1)| {
            let shard = |rank, start, len, at| ShardSpec {
                rank,
                region: Region::Flat { start, len },
                storage: Storage::InBuffer { buffer: "a".into(), at },
            };
            let shards = vec![shard(r0, 0, cut, at0), shard(r1, cut, 4 - cut, at1)];
            TensorLayout { name: format!("t{i}"), dtype: DType::U8, shape: vec![4], placement: Placement::Shards(shards), scale: None }
        });
        prop_oneof![mesh, shards]
    }

    proptest! {
        /// Skipping the sweep of buffers filled front to back changes no
        /// answer.
        #[test]
        fn prop_overlap_shortcut_agrees_with_the_sweep(
            tensors in (1usize..6).prop_flat_map(|n| (0..n).map(stored_tensor).collect::<Vec<_>>())
        ) {
            let fast = Layout::build(4, None, tensors.clone(), true);
            let sweep = Layout::build(4, None, tensors, false);
            prop_assert_eq!(fast, sweep);
        }
    }
}
