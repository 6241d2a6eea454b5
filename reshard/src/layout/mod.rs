//! The layout IR: which blocks of each tensor every rank holds, and where in
//! that rank's memory each block lives.
//!
//! A [`Layout`] is always valid: [`Layout::new`] checks every rule and is the
//! only way to make one. Mesh placements stay in their compact form; the
//! planner expands them per tensor with [`Layout::holdings`].

mod expand;
mod replicas;
pub(crate) mod validate;

pub(crate) use expand::RankHoldings;

use crate::block::Block;
use crate::dtype::DType;
use std::collections::HashMap;
use thiserror::Error;

/// Index of a rank within its group.
pub type Rank = u32;

/// Most ranks one group may have.
pub(crate) const MAX_RANKS: u32 = 1 << 20;

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
    /// tensor and the block shape); see [`crate::quantize`].
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
    /// ([`crate::quantize`]).
    Unquantized {
        /// Tensor index.
        tensor: u32,
    },
    /// A planner-owned buffer on a source rank holding the e4m3 codes of
    /// its boxes of tensor `tensor`, which it quantizes before sending
    /// ([`Route::QuantizedAtSource`](crate::Route::QuantizedAtSource)).
    Quantized {
        /// Tensor index (of the source layout).
        tensor: u32,
    },
    /// A planner-owned buffer on a source rank holding the f32 block
    /// scales of its boxes of tensor `tensor`
    /// ([`Route::ScalesFromSource`](crate::Route::ScalesFromSource)).
    Scales {
        /// Tensor index (of the source layout).
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
    /// What is derived from the parts above on first use (the fingerprint,
    /// each rank's place in the meshes).
    memo: expand::Memo,
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
            BufferKey::Own { tensor, shard } => {
                // Built by hand: `format!` cost a tenth of deriving every
                // rank's program at 4,096 ranks (one name per buffer).
                let name = &self.tensors[tensor as usize].name;
                let mut digits = [0u8; 10];
                let mut n = shard;
                let mut i = digits.len();
                loop {
                    i -= 1;
                    digits[i] = b'0' + (n % 10) as u8;
                    n /= 10;
                    if n == 0 {
                        break;
                    }
                }
                let mut out = String::with_capacity(name.len() + 1 + digits.len() - i);
                out.push_str(name);
                out.push('#');
                digits[i..].iter().for_each(|&d| out.push(char::from(d)));
                out
            }
            BufferKey::Named(i) => self.buffer_names[i as usize].clone(),
            BufferKey::Scratch { tensor } => format!("scratch:{}", self.tensors[tensor as usize].name),
            BufferKey::Unquantized { tensor } => format!("unquantized:{}", self.tensors[tensor as usize].name),
            BufferKey::Quantized { tensor } => format!("quantized:{}", self.tensors[tensor as usize].name),
            BufferKey::Scales { tensor } => format!("scales:{}", self.tensors[tensor as usize].name),
        }
    }

    /// A stable 64-bit hash of the whole layout (ranks, nodes, every
    /// tensor's name, type, shape and placement): members of one group
    /// report it so that the layout itself travels once.
    pub fn fingerprint(&self) -> u64 {
        *self.memo.fingerprint.get_or_init(|| self.hash_parts())
    }

    fn hash_parts(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = crate::fingerprint::Fnv64::default();
        self.ranks.hash(&mut h);
        self.ranks_per_node.hash(&mut h);
        self.tensors.hash(&mut h);
        h.finish() ^ crate::fingerprint::fnv64("refit-layout-v1")
    }
}

/// How a tensor of a layout is block-scaled (the layout checked it).
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct BlockScale {
    /// Name of the scale tensor, in the same layout: f32, shape
    /// `ceil(shape[d] / block[d])`.
    pub tensor: String,
    /// Block extent per dimension (each at least 1).
    pub block: Vec<u64>,
}
