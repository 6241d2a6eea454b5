//! Validation of a layout: the rules [`Layout::new`] checks (names,
//! meshes, shards, block scales, named buffers that neither mix dtypes nor
//! overlap), and the messages that name what breaks them.

use super::expand::mesh_holdings;
use super::{
    field, tensor_err, BufferKey, Layout, LayoutError, MeshDim, MeshPlacement, Placement, Rank, Region, ShardSpec, Storage, TensorLayout,
    MAX_RANKS,
};
use crate::block::MAX_DIMS;
use crate::dtype::DType;
use std::collections::HashMap;

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
        let layout = Layout {
            ranks,
            ranks_per_node,
            tensors,
            buffer_names,
            buffer_ids,
            named_dtypes,
            by_name,
            scale_ids,
            scale_for,
            memo: Default::default(),
        };
        layout.check_named_buffers(&stored_ids, shortcut)?;
        Ok(layout)
    }
    /// Checks the named-buffer rules: one dtype per buffer name, and no two
    /// stored regions overlapping in one buffer of one rank. Mesh-form
    /// tensors are expanded per rank one buffer name at a time, so that the
    /// check needs memory for the largest buffer only. `ids` holds the
    /// buffer id of every stored region, in tensor and shard order;
    /// `shortcut` skips the sweep of buffers filled front to back.
    fn check_named_buffers(&self, ids: &[u32], shortcut: bool) -> Result<(), LayoutError> {
        let mut members = self.buffer_members(ids)?;
        // Per buffer, a sweep in order of `at` (the same on every rank of a
        // mesh): on each rank, a region overlaps an earlier one exactly when
        // it starts before the furthest end so far. Per rank: (buffer id + 1
        // when last written, start, end, tensor) of the furthest-reaching region.
        let mut state: Vec<(u32, u64, u64, u32)> = vec![(0, 0, 0, 0); self.ranks as usize];
        for (id, list) in members.iter_mut().enumerate() {
            // The entries are distinct, so an unstable sort keeps the order
            // (at, tensor, shard) deterministic.
            list.sort_unstable();
            if shortcut && in_order_without_overlap(&self.tensors, list) {
                // The common case (fused buffers filled front to back): no
                // rank can see an overlap, so skip the per-rank sweep.
                continue;
            }
            self.sweep_buffer(&mut state, id, list)?;
        }
        Ok(())
    }

    /// Per buffer id, the regions stored in it: (at, tensor, shard index,
    /// or `u32::MAX` for a tensor's mesh placement), in tensor and shard
    /// order (`ids`: see [`check_named_buffers`](Self::check_named_buffers));
    /// an error where a buffer would hold two dtypes.
    fn buffer_members(&self, ids: &[u32]) -> Result<Vec<Vec<Member>>, LayoutError> {
        /// A tensor's mesh placement (rather than one of its shards).
        const MESH: u32 = u32::MAX;
        // Per buffer id: (at, tensor, shard index or MESH) stored in it.
        let mut members: Vec<Vec<Member>> = vec![Vec::new(); self.buffer_names.len()];
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
        Ok(members)
    }

    /// Sweeps the regions `list` (sorted) of buffer `id` on every rank that
    /// holds them, `state` per rank (see
    /// [`check_named_buffers`](Self::check_named_buffers)); an error naming
    /// the first two regions that overlap.
    fn sweep_buffer(&self, state: &mut [(u32, u64, u64, u32)], id: usize, list: &[Member]) -> Result<(), LayoutError> {
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
        {
            let gen = id as u32 + 1;
            // Adds one region to the sweep of every rank in `ranks` (all the
            // ranks of a mesh in the common case: the hot loop).
            let mut visit = |ranks: &[Rank], region: (u64, u64, u32)| -> Result<(), LayoutError> {
                match sweep(state, ranks, gen, region) {
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

/// A region stored in a named buffer: (at, tensor, shard index, or
/// `u32::MAX` for a tensor's mesh placement).
type Member = (u64, u32, u32);

/// Whether the regions stored in one buffer (`list`: (at, tensor, shard or
/// mesh), sorted) follow one another: each non-empty region starts at or
/// after the furthest end of all before it, on any rank. Then the per-rank
/// sweep of `check_named_buffers` finds nothing. `false` also when a check
/// needs the sweep (an uneven mesh, an end past `u64::MAX`).
fn in_order_without_overlap(tensors: &[TensorLayout], list: &[Member]) -> bool {
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

/// `s` with control characters escaped, so messages stay on one line.
pub(crate) fn escape(s: &str) -> String {
    s.chars().flat_map(|c| if c.is_control() { c.escape_default().collect::<Vec<_>>() } else { vec![c] }).collect()
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
        Placement::Mesh(m) => validate_mesh(t, m, ranks, (stamp, seen)),
        Placement::Shards(shards) => validate_shards(t, shards, ranks, numel),
    }
}

/// Checks a mesh placement `m` of tensor `t` (the mesh, its ranks among
/// `ranks`, its placements, its buffer); `seen` marks the ranks met, with
/// `stamp`, where the ranks need checking one by one.
fn validate_mesh(t: &TensorLayout, m: &MeshPlacement, ranks: u32, (stamp, seen): (u32, &mut Vec<u32>)) -> Result<(), LayoutError> {
    let name = t.name.as_str();
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
    Ok(())
}

/// Checks explicit shards of tensor `t` (`numel` elements): ranks among
/// `ranks`, regions inside the tensor, buffers.
fn validate_shards(t: &TensorLayout, shards: &[ShardSpec], ranks: u32, numel: u64) -> Result<(), LayoutError> {
    let name = t.name.as_str();
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
