//! The fast path of [`parse_layout`](super::parse_layout): serde visitors
//! over `serde_json::Deserializer::from_str` that build the IR's tensors
//! straight from the text, with no `serde_json::Value` tree in between.
//!
//! This path only decides *whether* a file is acceptable; it does not phrase
//! errors. It accepts exactly what the reference walker
//! (`file::walk`) accepts and builds the same tensors: the same
//! fields, the same duplicate-key, null and number rules, the same implied
//! mesh positions and budget. On any error the caller re-runs the walker on
//! the text, which names the field at fault; `file::cross_check` compares
//! the two paths in the tests.

use super::{parse_mesh_dim, MAX_IMPLIED_POSITIONS};
use crate::dtype::DType;
use crate::layout::{BlockScale, MeshDim, MeshPlacement, Placement, Rank, Region, ShardSpec, Storage, TensorLayout, MAX_RANKS};
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// A layout file's contents before [`Layout::new`](crate::Layout::new)
/// validates them.
#[derive(Debug)]
pub(super) struct Parsed {
    /// The `ranks` field.
    pub(super) ranks: u32,
    /// The `ranks_per_node` field (`None` when absent or `null`).
    pub(super) ranks_per_node: Option<u32>,
    /// The tensors, in file order.
    pub(super) tensors: Vec<TensorLayout>,
}

/// Parses a layout file's text, or fails with an error whose text is never
/// shown (the caller falls back to the walker for the message).
pub(super) fn parse(text: &str) -> Result<Parsed, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = Top.deserialize(&mut de)?;
    de.end()?;
    Ok(parsed)
}

/// What the tensors of one file share while they are parsed: the layout's
/// rank count (once seen), the implied-position budget, and scratch lists
/// that are copied out at their exact length.
struct State {
    /// `ranks`, when it came before the tensors.
    ranks: Option<u32>,
    /// Mesh positions that meshes without `mesh.ranks` may still imply.
    budget: u64,
    /// The largest mesh without `mesh.ranks` so far (checked against
    /// `ranks` at the end, for files that give `ranks` after `tensors`).
    max_implied: u64,
    /// Scratch for integer lists.
    u64s: Vec<u64>,
    /// Scratch for rank lists and mesh shapes.
    u32s: Vec<u32>,
    /// Scratch for placements.
    dims: Vec<MeshDim>,
    /// Scratch for a tensor's shards.
    shards: Vec<ShardSpec>,
}

/// Fails the fast path; the message is never shown.
fn reject<E: serde::de::Error>(why: &str) -> E {
    E::custom(why)
}

/// Reads an object's fields: each key turned into its index by `key` (an
/// unknown key fails), each value read by `field(map, index)`; a key given
/// twice is a duplicate.
fn each_field<'de, A: MapAccess<'de>>(
    map: &mut A,
    key: fn(&str) -> Option<usize>,
    mut field: impl FnMut(&mut A, usize) -> Result<(), A::Error>,
) -> Result<(), A::Error> {
    let mut seen = 0u16;
    while let Some(k) = map.next_key_seed(StrWith(key))? {
        let bit = 1u16 << k;
        if seen & bit != 0 {
            return Err(reject("duplicate key"));
        }
        seen |= bit;
        field(map, k)?;
    }
    Ok(())
}

/// Index of a top-level field.
fn top_key(k: &str) -> Option<usize> {
    Some(match k {
        "ranks" => 0,
        "ranks_per_node" => 1,
        "tensors" => 2,
        _ => return None,
    })
}

/// Index of a tensor field.
fn tensor_key(k: &str) -> Option<usize> {
    Some(match k {
        "name" => 0,
        "dtype" => 1,
        "shape" => 2,
        "mesh" => 3,
        "placements" => 4,
        "shards" => 5,
        "buffer" => 6,
        "at" => 7,
        "scale" => 8,
        _ => return None,
    })
}

/// A tensor's `scale` object, as the file has it.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ScaleField {
    tensor: String,
    block: Vec<u64>,
}

/// Index of a `mesh` field.
fn mesh_key(k: &str) -> Option<usize> {
    Some(match k {
        "shape" => 0,
        "ranks" => 1,
        _ => return None,
    })
}

/// Index of a shard field.
fn shard_key(k: &str) -> Option<usize> {
    Some(match k {
        "rank" => 0,
        "offset" => 1,
        "extent" => 2,
        "flat" => 3,
        "buffer" => 4,
        "at" => 5,
        _ => return None,
    })
}

/// A string turned into a value by a function that may refuse it, without
/// allocating (an object key, `dtype`, a placement).
struct StrWith<F>(F);

impl<'de, T, F: FnOnce(&str) -> Option<T>> DeserializeSeed<'de> for StrWith<F> {
    type Value = T;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        d.deserialize_str(self)
    }
}

impl<T, F: FnOnce(&str) -> Option<T>> Visitor<'_> for StrWith<F> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<T, E> {
        (self.0)(v).ok_or_else(|| reject("bad string"))
    }
}

/// An array of integers of type `T`: `u64` (its own rules: JSON integers
/// only, as `Value::as_u64` has them) or `u32` (mesh shapes, rank lists),
/// copied out at its exact length.
struct Ints<'a, T>(&'a mut Vec<T>);

impl<'de, T: serde::Deserialize<'de>> DeserializeSeed<'de> for Ints<'_, T> {
    type Value = Vec<T>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<T>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, T: serde::Deserialize<'de>> Visitor<'de> for Ints<'_, T> {
    type Value = Vec<T>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of integers")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        fill_exact(self.0, || seq.next_element())
    }
}

/// Fills the scratch list `scratch` from `next` until it yields `None`,
/// then moves the items out at their exact length (the scratch keeps its
/// capacity for the next list).
fn fill_exact<T, E>(scratch: &mut Vec<T>, mut next: impl FnMut() -> Result<Option<T>, E>) -> Result<Vec<T>, E> {
    scratch.clear();
    while let Some(x) = next()? {
        scratch.push(x);
    }
    let mut out = Vec::with_capacity(scratch.len());
    out.append(scratch);
    Ok(out)
}

/// `null` (absent) or an array of `u32` (`mesh.ranks`).
struct OptU32s<'a>(&'a mut Vec<u32>);

visitor_seed!(OptU32s<'_> => Option<Vec<u32>>, deserialize_option, "null or an array of integers", {
    fn visit_none<E>(self) -> Result<Option<Vec<u32>>, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Option<Vec<u32>>, E> {
        Ok(None)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<Vec<u32>>, D::Error> {
        Ints(self.0).deserialize(d).map(Some)
    }
});

/// An array of placement strings.
struct Dims<'a>(&'a mut Vec<MeshDim>);

visitor_seed!(Dims<'_> => Vec<MeshDim>, deserialize_seq, "an array of placements", {
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<MeshDim>, A::Error> {
        fill_exact(self.0, || seq.next_element_seed(StrWith(parse_mesh_dim)))
    }
});

/// The top-level object.
struct Top;

visitor_seed!(Top => Parsed, deserialize_map, "a layout object", {
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Parsed, A::Error> {
        let mut st = State {
            ranks: None,
            budget: MAX_IMPLIED_POSITIONS,
            max_implied: 0,
            u64s: Vec::new(),
            u32s: Vec::new(),
            dims: Vec::new(),
            shards: Vec::new(),
        };
        let mut ranks_per_node = None;
        let mut tensors = None;
        each_field(&mut map, top_key, |map, k| {
            match k {
                0 => {
                    let r: u32 = map.next_value()?;
                    if r > MAX_RANKS {
                        return Err(reject("too many ranks"));
                    }
                    st.ranks = Some(r);
                }
                1 => ranks_per_node = map.next_value::<Option<u32>>()?,
                _ => tensors = Some(map.next_value_seed(Tensors(&mut st))?),
            }
            Ok(())
        })?;
        let (Some(ranks), Some(mut tensors)) = (st.ranks, tensors) else {
            return Err(reject("missing field"));
        };
        if st.max_implied > ranks as u64 {
            return Err(reject("implied mesh larger than the layout"));
        }
        tensors.shrink_to_fit();
        Ok(Parsed { ranks, ranks_per_node, tensors })
    }
});

/// The `tensors` array.
struct Tensors<'a>(&'a mut State);

visitor_seed!(Tensors<'_> => Vec<TensorLayout>, deserialize_seq, "an array of tensors", {
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<TensorLayout>, A::Error> {
        let mut out = Vec::new();
        while let Some(t) = seq.next_element_seed(Tensor(&mut *self.0))? {
            out.push(t);
        }
        Ok(out)
    }
});

/// One tensor object.
struct Tensor<'a>(&'a mut State);

visitor_seed!(Tensor<'_> => TensorLayout, deserialize_map, "a tensor object", {
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TensorLayout, A::Error> {
        let st = self.0;
        let mut name: Option<String> = None;
        let mut dtype: Option<DType> = None;
        let mut shape: Option<Vec<u64>> = None;
        let mut mesh: Option<(Vec<u32>, Option<Vec<u32>>)> = None;
        let mut dims: Option<Vec<MeshDim>> = None;
        let mut shards: Option<Vec<ShardSpec>> = None;
        let mut buffer: Option<String> = None;
        let mut at: Option<u64> = None;
        let mut scale: Option<BlockScale> = None;
        each_field(&mut map, tensor_key, |map, k| {
            match k {
                0 => name = Some(map.next_value()?),
                1 => dtype = Some(map.next_value_seed(StrWith(DType::from_name))?),
                2 => shape = Some(map.next_value_seed(Ints(&mut st.u64s))?),
                3 => mesh = Some(map.next_value_seed(Mesh(&mut st.u32s))?),
                4 => dims = Some(map.next_value_seed(Dims(&mut st.dims))?),
                5 => shards = Some(map.next_value_seed(Shards(&mut *st))?),
                6 => buffer = Some(map.next_value()?),
                7 => at = Some(map.next_value()?),
                _ => {
                    let f: ScaleField = map.next_value()?;
                    scale = Some(BlockScale { tensor: f.tensor, block: f.block });
                }
            }
            Ok(())
        })?;
        let (Some(name), Some(dtype), Some(shape)) = (name, dtype, shape) else {
            return Err(reject("missing field"));
        };
        let placement = match (mesh, dims, shards) {
            (Some((mesh_shape, ranks)), Some(dims), None) => {
                let ranks = match ranks {
                    Some(r) => r,
                    None => implied_ranks(st, &mesh_shape)?,
                };
                let storage = match (buffer, at) {
                    (None, None) => Storage::Own,
                    (Some(buffer), at) => Storage::InBuffer { buffer, at: at.unwrap_or(0) },
                    (None, Some(_)) => return Err(reject("'at' without 'buffer'")),
                };
                Placement::Mesh(MeshPlacement { shape: mesh_shape, ranks, dims, storage })
            }
            (None, None, Some(shards)) if buffer.is_none() && at.is_none() => Placement::Shards(shards),
            _ => return Err(reject("not exactly one form")),
        };
        Ok(TensorLayout { name, dtype, shape, placement, scale })
    }
});

/// The ranks `0..size` of a mesh without `mesh.ranks`, within the layout's
/// ranks (or [`MAX_RANKS`] until `ranks` is seen) and the implied-position
/// budget.
fn implied_ranks<E: serde::de::Error>(st: &mut State, mesh_shape: &[u32]) -> Result<Vec<Rank>, E> {
    let size = mesh_shape.iter().try_fold(1u64, |a, &b| a.checked_mul(b as u64)).unwrap_or(u64::MAX);
    if size > st.ranks.unwrap_or(MAX_RANKS) as u64 {
        return Err(reject("implied mesh larger than the layout"));
    }
    st.budget = st.budget.checked_sub(size).ok_or_else(|| reject("implied positions over budget"))?;
    st.max_implied = st.max_implied.max(size);
    Ok((0..size as u32).collect())
}

/// A `mesh` object: its shape and, unless absent or `null`, its ranks.
struct Mesh<'a>(&'a mut Vec<u32>);

visitor_seed!(Mesh<'_> => (Vec<u32>, Option<Vec<u32>>), deserialize_map, "a mesh object", {
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut shape = None;
        let mut ranks = None;
        each_field(&mut map, mesh_key, |map, k| {
            match k {
                0 => shape = Some(map.next_value_seed(Ints(&mut *self.0))?),
                _ => ranks = map.next_value_seed(OptU32s(&mut *self.0))?,
            }
            Ok(())
        })?;
        let shape = shape.ok_or_else(|| reject("missing mesh.shape"))?;
        Ok((shape, ranks))
    }
});

/// A `shards` array, copied out at its exact length.
struct Shards<'a>(&'a mut State);

visitor_seed!(Shards<'_> => Vec<ShardSpec>, deserialize_seq, "an array of shards", {
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<ShardSpec>, A::Error> {
        let State { shards, u64s, .. } = self.0;
        fill_exact(shards, || seq.next_element_seed(Shard(&mut *u64s)))
    }
});

/// One shard object.
struct Shard<'a>(&'a mut Vec<u64>);

visitor_seed!(Shard<'_> => ShardSpec, deserialize_map, "a shard object", {
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ShardSpec, A::Error> {
        let mut rank: Option<u32> = None;
        let mut offset = None;
        let mut extent = None;
        let mut flat = None;
        let mut buffer: Option<String> = None;
        let mut at: Option<u64> = None;
        each_field(&mut map, shard_key, |map, k| {
            match k {
                0 => rank = Some(map.next_value()?),
                1 => offset = Some(map.next_value_seed(Ints(&mut *self.0))?),
                2 => extent = Some(map.next_value_seed(Ints(&mut *self.0))?),
                3 => flat = Some(map.next_value_seed(Ints(&mut *self.0))?),
                4 => buffer = Some(map.next_value()?),
                _ => at = Some(map.next_value()?),
            }
            Ok(())
        })?;
        let rank = rank.ok_or_else(|| reject("missing rank"))?;
        let region = match (offset, extent, flat) {
            (Some(offset), Some(extent), None) => Region::Block { offset, extent },
            (None, None, Some(f)) if f.len() == 2 => Region::Flat { start: f[0], len: f[1] },
            _ => return Err(reject("bad region")),
        };
        let storage = match (buffer, at) {
            (None, None) => Storage::Own,
            (Some(buffer), at) => Storage::InBuffer { buffer, at: at.unwrap_or(0) },
            (None, Some(_)) => return Err(reject("'at' without 'buffer'")),
        };
        Ok(ShardSpec { rank, region, storage })
    }
});
