//! Property tests: random valid layout pairs, planned with both strategies,
//! executed on the in-process data plane and checked bit for bit against
//! brute-force references written here from the layout semantics (not from
//! the library's own expansion of placements).
//!
//! Generation draws from a flat vector of random numbers (`Draw`); every
//! decision maps 0 to its simplest option, so shrinking the vector towards
//! zeros shrinks the layouts too.

use proptest::prelude::*;
use reshard::{
    baseline_summary, layout_to_json, parse_layout, plan_baseline, plan_reshard, Block, BufferKey, DType, Layout, LinkModel, MeshDim,
    MeshPlacement, Placement, PlanOptions, QuantizeAt, RankProgram, Region, Route, ShardSpec, Storage, Strategy as Planner, TensorLayout,
};
use reshard::{convert_slice, wire_dtype};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::time::Duration;
use transport::{fill_sources, run_local, verify_destinations, ExecOptions, RankMemory};
use transport::{pattern_value, tensor_seed};

// ---------------------------------------------------------------------------
// Generation
// ---------------------------------------------------------------------------

/// Number of random draws available to one case (unused ones are ignored,
/// missing ones read as 0).
const DRAWS: usize = 768;

/// A stream of random decisions.
struct Draw<'a> {
    vals: &'a [u16],
    pos: usize,
}

impl<'a> Draw<'a> {
    fn new(vals: &'a [u16]) -> Self {
        Draw { vals, pos: 0 }
    }

    /// Uniform-ish in `0..n` (0 when `n <= 1`, without consuming a draw).
    fn below(&mut self, n: u64) -> u64 {
        if n <= 1 {
            return 0;
        }
        let v = self.vals.get(self.pos).copied().unwrap_or(0) as u64;
        self.pos += 1;
        v % n
    }

    /// True with probability `1/n`; shrinks to false.
    fn one_in(&mut self, n: u64) -> bool {
        n >= 2 && self.below(n) == n - 1
    }

    /// Picks an element of a non-empty slice.
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }

    /// A random permutation of `0..n`.
    fn permutation(&mut self, n: u32) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n).collect();
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
        v
    }
}

/// One generated planning problem.
#[derive(Clone)]
struct Case {
    src: Layout,
    dst: Layout,
    options: PlanOptions,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f)?;
        writeln!(f, "src = {}", layout_to_json(&self.src))?;
        writeln!(f, "dst = {}", layout_to_json(&self.dst))?;
        write!(f, "options = max_staging_bytes: {}, links: {:?}", self.options.max_staging_bytes, self.options.links)
    }
}

/// Which group a placement is generated for: the source must cover every
/// tensor fully, the destination may leave parts unneeded.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Src,
    Dst,
}

const FLOATS: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];
const DTYPES: [DType; 6] = [DType::F32, DType::BF16, DType::F16, DType::F64, DType::I32, DType::U8];

/// Next free element per (named buffer, rank) of one side.
type Alloc = HashMap<(String, u32), u64>;

/// Places a region of `len` elements in named buffer `name` of `rank`, after
/// everything already there (sometimes leaving a small gap).
fn named(d: &mut Draw, alloc: &mut Alloc, name: String, rank: u32, len: u64) -> Storage {
    let next = alloc.entry((name.clone(), rank)).or_insert(0);
    let gap = if d.one_in(4) { 1 + d.below(3) } else { 0 };
    let at = *next + gap;
    *next = at + len;
    Storage::InBuffer { buffer: name, at }
}

/// Boundaries `0 = c0 <= c1 <= ... = n` with up to `max_cuts` random inner
/// cuts; `distinct` drops repeated cuts (no empty intervals).
fn cut_points(d: &mut Draw, n: u64, max_cuts: u64, distinct: bool) -> Vec<u64> {
    if n == 0 {
        return vec![0, 0];
    }
    let mut c = vec![0, n];
    for _ in 0..d.below(max_cuts + 1) {
        c.push(if distinct { 1 + d.below(n.saturating_sub(1)) } else { d.below(n + 1) });
    }
    c.sort_unstable();
    if distinct {
        c.dedup();
    }
    c
}

/// All boxes of the grid given by per-dimension cut points.
fn grid_boxes(cuts: &[Vec<u64>]) -> Vec<(Vec<u64>, Vec<u64>)> {
    let mut out = vec![(Vec::new(), Vec::new())];
    for c in cuts {
        let mut next = Vec::new();
        for (off, ext) in &out {
            for w in c.windows(2) {
                let (mut o, mut e) = (off.clone(), ext.clone());
                o.push(w[0]);
                e.push(w[1] - w[0]);
                next.push((o, e));
            }
        }
        out = next;
    }
    out
}

/// A random box inside `shape` (at least one element per non-empty dim).
fn random_box(d: &mut Draw, shape: &[u64]) -> (Vec<u64>, Vec<u64>) {
    let mut off = Vec::new();
    let mut ext = Vec::new();
    for &n in shape {
        let lo = d.below(n);
        off.push(lo);
        ext.push(if n == 0 { 0 } else { 1 + d.below(n - lo) });
    }
    (off, ext)
}

/// (a) A mesh on a random sub-mesh of the group (a pipeline stage, or any
/// subset in any order), mixing replicate and shard, the same tensor dim
/// possibly sharded by several mesh dims; sometimes fused into a named
/// buffer at one offset free on every rank of the mesh.
fn gen_mesh(d: &mut Draw, alloc: &mut Alloc, shape: &[u64], dtype: DType, ranks: u32) -> Placement {
    let mnd = 1 + d.below(3) as usize;
    let mut mshape: Vec<u32> = (0..mnd).map(|_| 1 + d.below(3) as u32).collect();
    while mshape.iter().product::<u32>() > ranks {
        let i = (0..mnd).max_by_key(|&i| (mshape[i], i)).unwrap_or(0);
        mshape[i] -= 1;
    }
    let size: u32 = mshape.iter().product();
    let mranks: Vec<u32> = match d.below(3) {
        0 => (0..size).collect(),
        1 => {
            let first = d.below((ranks - size + 1) as u64) as u32;
            (first..first + size).collect()
        }
        _ => d.permutation(ranks).into_iter().take(size as usize).collect(),
    };
    let mut last: Option<usize> = None;
    let dims = (0..mnd)
        .map(|_| {
            if shape.is_empty() {
                return MeshDim::Replicate;
            }
            let t = match d.below(4) {
                0 => return MeshDim::Replicate,
                1 => last.unwrap_or(0),
                _ => d.below(shape.len() as u64) as usize,
            };
            last = Some(t);
            MeshDim::Shard(t)
        })
        .collect();
    let mut m = MeshPlacement { shape: mshape, ranks: mranks, dims, storage: Storage::Own };
    if d.one_in(2) {
        let name = if d.one_in(3) { format!("flat.{dtype}") } else { format!("qkv.{dtype}") };
        let gap = if d.one_in(4) { 1 + d.below(3) } else { 0 };
        let at = m.ranks.iter().map(|&r| alloc.get(&(name.clone(), r)).copied().unwrap_or(0)).max().unwrap_or(0) + gap;
        for (pos, &r) in m.ranks.iter().enumerate() {
            let (_, ext) = mesh_box(shape, &m, pos);
            alloc.insert((name.clone(), r), at + ext.iter().product::<u64>());
        }
        m.storage = Storage::InBuffer { buffer: name, at };
    }
    Placement::Mesh(m)
}

/// Storage of a box- or flat-shaped shard: own buffer, or a named buffer
/// shared with other shards (`qkv.<dtype>` fuses tensors of one dtype).
fn storage(d: &mut Draw, alloc: &mut Alloc, mode: u64, dtype: DType, rank: u32, len: u64) -> Storage {
    match mode {
        0 => Storage::Own,
        1 => named(d, alloc, format!("qkv.{dtype}"), rank, len),
        _ => {
            if d.below(3) == 0 {
                Storage::Own
            } else {
                named(d, alloc, format!("flat.{dtype}"), rank, len)
            }
        }
    }
}

/// One tensor's placement on one side.
fn gen_placement(d: &mut Draw, alloc: &mut Alloc, side: Side, shape: &[u64], dtype: DType, ranks: u32) -> Placement {
    let numel: u64 = shape.iter().product();
    let drop = |d: &mut Draw| side == Side::Dst && d.one_in(4);
    match d.below(4) {
        0 => gen_mesh(d, alloc, shape, dtype, ranks),
        1 => {
            // (b) explicit block shards: a grid partition with uneven cuts,
            // each block on one or two ranks (maybe the same rank twice);
            // sometimes fused into a named buffer (d).
            let mode = if d.one_in(3) { 1 } else { 0 };
            let cuts: Vec<Vec<u64>> = shape.iter().map(|&n| cut_points(d, n, 2, true)).collect();
            let mut shards = Vec::new();
            for (offset, extent) in grid_boxes(&cuts) {
                if drop(d) {
                    continue;
                }
                let copies = if d.one_in(3) { 2 } else { 1 };
                for _ in 0..copies {
                    let rank = d.below(ranks as u64) as u32;
                    let len = extent.iter().product();
                    let storage = storage(d, alloc, mode, dtype, rank, len);
                    shards.push(ShardSpec { rank, region: Region::Block { offset: offset.clone(), extent: extent.clone() }, storage });
                }
            }
            Placement::Shards(shards)
        }
        2 => {
            // (c) flat FSDP shards (empty ranges included), some in a named
            // flat buffer per rank, some in their own buffers.
            let cuts = cut_points(d, numel, 4, false);
            let mut shards = Vec::new();
            for w in cuts.windows(2) {
                if drop(d) {
                    continue;
                }
                let copies = if d.one_in(5) { 2 } else { 1 };
                for _ in 0..copies {
                    let rank = d.below(ranks as u64) as u32;
                    let storage = storage(d, alloc, 2, dtype, rank, w[1] - w[0]);
                    shards.push(ShardSpec { rank, region: Region::Flat { start: w[0], len: w[1] - w[0] }, storage });
                }
            }
            Placement::Shards(shards)
        }
        _ => {
            // (e) arbitrary, possibly overlapping boxes; on the source on top
            // of a grid partition so that the whole tensor stays covered.
            let mode = if d.one_in(2) { 1 } else { 0 };
            let mut boxes = Vec::new();
            if side == Side::Src {
                let cuts: Vec<Vec<u64>> = shape.iter().map(|&n| cut_points(d, n, 1, true)).collect();
                boxes = grid_boxes(&cuts);
            }
            for _ in 0..1 + d.below(3) {
                boxes.push(random_box(d, shape));
            }
            let mut shards = Vec::new();
            for (offset, extent) in boxes {
                let rank = d.below(ranks as u64) as u32;
                let storage = storage(d, alloc, mode, dtype, rank, extent.iter().product());
                shards.push(ShardSpec { rank, region: Region::Block { offset, extent }, storage });
            }
            Placement::Shards(shards)
        }
    }
}

/// Builds a valid layout pair and options from a stream of draws.
fn build_case(vals: &[u16]) -> Case {
    let mut d = Draw::new(vals);
    let src_ranks = 1 + d.below(6) as u32;
    let dst_ranks = 1 + d.below(6) as u32;
    // One rank per node often, so that pieces fan out over many nodes (and
    // the reshard planner considers relaying them node to node).
    let src_rpn = if d.one_in(3) { 1 } else { 1 + d.below(src_ranks as u64) as u32 };
    let dst_rpn = if d.one_in(3) { 1 } else { 1 + d.below(dst_ranks as u64) as u32 };
    let n = 1 + d.below(4) as usize;
    // Often one dtype for all tensors, so that they can share fused buffers.
    let common = if d.one_in(2) { None } else { Some(d.pick(&DTYPES)) };
    let mut specs: Vec<(String, Vec<u64>, DType, DType)> = Vec::new();
    for i in 0..n {
        let ndim = d.pick(&[1usize, 2, 2, 3, 0, 1, 2, 3]);
        // Sizes 1..=9, rarely an empty dim.
        let shape: Vec<u64> = (0..ndim).map(|_| if d.one_in(16) { 0 } else { 1 + d.below(9) }).collect();
        let sd = common.unwrap_or_else(|| d.pick(&DTYPES));
        let dd = if sd.is_convertible_float() && d.one_in(2) { d.pick(&FLOATS) } else { sd };
        specs.push((format!("layers.{i}.w"), shape, sd, dd));
    }
    let mut alloc = Alloc::new();
    let src_tensors: Vec<TensorLayout> = specs
        .iter()
        .map(|(name, shape, sd, _)| TensorLayout {
            name: name.clone(),
            dtype: *sd,
            shape: shape.clone(),
            placement: gen_placement(&mut d, &mut alloc, Side::Src, shape, *sd, src_ranks),
            scale: None,
        })
        .collect();
    // The destination may skip a tensor and list tensors in another order.
    let mut order: Vec<usize> = (0..n).collect();
    if n > 1 && d.one_in(4) {
        order.remove(d.below(n as u64) as usize);
    }
    if d.one_in(3) {
        let k = d.below(order.len() as u64) as usize;
        order.rotate_left(k);
    }
    let mut alloc = Alloc::new();
    let dst_tensors: Vec<TensorLayout> = order
        .iter()
        .map(|&i| {
            let (name, shape, _, dd) = &specs[i];
            TensorLayout {
                name: name.clone(),
                dtype: *dd,
                shape: shape.clone(),
                placement: gen_placement(&mut d, &mut alloc, Side::Dst, shape, *dd, dst_ranks),
                scale: None,
            }
        })
        .collect();
    let max_staging_bytes = match d.below(4) {
        0 => PlanOptions::default().max_staging_bytes,
        1 => 64 + d.below(4033),
        2 => 1 + d.below(32),
        _ => 256 + d.below(256),
    };
    let links = if d.one_in(3) {
        LinkModel {
            net_bytes_per_s: 1e9 * (1 + d.below(100)) as f64,
            intra_bytes_per_s: 1e9 * (1 + d.below(1000)) as f64,
            message_latency_s: 1e-6 * d.below(50) as f64,
        }
    } else {
        LinkModel::default()
    };
    // Often tiny, so that the reshard splits pieces among the ranks holding
    // them (the cases are a few bytes large).
    let min_split_bytes = match d.below(3) {
        0 => PlanOptions::default().min_split_bytes,
        _ => 1 + d.below(16),
    };
    let src = Layout::new(src_ranks, Some(src_rpn), src_tensors).expect("generated source layout is valid");
    let dst = Layout::new(dst_ranks, Some(dst_rpn), dst_tensors).expect("generated destination layout is valid");
    Case { src, dst, options: PlanOptions { max_staging_bytes, links, min_split_bytes, ..PlanOptions::default() } }
}

fn cases() -> impl Strategy<Value = Case> {
    prop::collection::vec(any::<u16>(), DRAWS).prop_map(|v| build_case(&v))
}

// ---------------------------------------------------------------------------
// Brute-force reference, straight from the layout semantics
// ---------------------------------------------------------------------------

/// Which buffer of its rank a stored region lives in.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Buf {
    Own(u32),
    Named(String),
}

/// A region of a tensor on one rank: `flats[k]` (global row-major index) is
/// stored at element `at + k` of buffer `buf`.
struct Stored {
    rank: u32,
    buf: Buf,
    at: u64,
    flats: Vec<u64>,
}

/// Global row-major indices of a box, in the box's row-major order.
fn box_flats(shape: &[u64], off: &[u64], ext: &[u64]) -> Vec<u64> {
    let nd = shape.len();
    if ext.contains(&0) {
        return Vec::new();
    }
    let mut stride = vec![1u64; nd];
    for k in (0..nd.saturating_sub(1)).rev() {
        stride[k] = stride[k + 1] * shape[k + 1];
    }
    let mut out = Vec::new();
    let mut idx = vec![0u64; nd];
    loop {
        out.push((0..nd).map(|k| (off[k] + idx[k]) * stride[k]).sum());
        let mut k = nd;
        loop {
            if k == 0 {
                return out;
            }
            k -= 1;
            idx[k] += 1;
            if idx[k] < ext[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}

/// The box of mesh position `pos` (row-major over `m.shape`): torch.chunk
/// per shard dim, lower mesh dims first.
fn mesh_box(shape: &[u64], m: &MeshPlacement, pos: usize) -> (Vec<u64>, Vec<u64>) {
    let mut coord = vec![0u64; m.shape.len()];
    let mut p = pos as u64;
    for i in (0..m.shape.len()).rev() {
        coord[i] = p % m.shape[i] as u64;
        p /= m.shape[i] as u64;
    }
    let mut off = vec![0u64; shape.len()];
    let mut ext = shape.to_vec();
    for (i, dim) in m.dims.iter().enumerate() {
        if let MeshDim::Shard(t) = *dim {
            let (n, k) = (ext[t], m.shape[i] as u64);
            let c = n.div_ceil(k);
            let lo = (coord[i] * c).min(n);
            let hi = ((coord[i] + 1) * c).min(n);
            off[t] += lo;
            ext[t] = hi - lo;
        }
    }
    (off, ext)
}

/// Every region of tensor `t`, with where it is stored.
fn stored(t: &TensorLayout) -> Vec<Stored> {
    match &t.placement {
        Placement::Mesh(m) => m
            .ranks
            .iter()
            .enumerate()
            .map(|(pos, &rank)| {
                let (off, ext) = mesh_box(&t.shape, m, pos);
                let (buf, at) = match &m.storage {
                    Storage::Own => (Buf::Own(0), 0),
                    Storage::InBuffer { buffer, at } => (Buf::Named(buffer.clone()), *at),
                };
                Stored { rank, buf, at, flats: box_flats(&t.shape, &off, &ext) }
            })
            .collect(),
        Placement::Shards(shards) => shards
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let flats = match &s.region {
                    Region::Block { offset, extent } => box_flats(&t.shape, offset, extent),
                    Region::Flat { start, len } => (*start..start + len).collect(),
                };
                let (buf, at) = match &s.storage {
                    Storage::Own => (Buf::Own(i as u32), 0),
                    Storage::InBuffer { buffer, at } => (Buf::Named(buffer.clone()), *at),
                };
                Stored { rank: s.rank, buf, at, flats }
            })
            .collect(),
    }
}

fn buffer_key(layout: &Layout, tensor: usize, buf: &Buf) -> BufferKey {
    match buf {
        Buf::Own(shard) => BufferKey::Own { tensor: tensor as u32, shard: *shard },
        Buf::Named(name) => {
            let i = layout.buffer_names().iter().position(|b| b == name).expect("named buffer is known to the layout");
            BufferKey::Named(i as u32)
        }
    }
}

/// Index of `key` in a rank program's buffer list.
fn buffer_index(program: &RankProgram, key: BufferKey) -> usize {
    program.buffers.iter().position(|b| b.key == key).unwrap_or_else(|| panic!("{:?}: no buffer {key:?}", program.endpoint))
}

/// Destination elements held, replicas and duplicate buffers counted.
fn dst_elements(dst: &Layout) -> u64 {
    dst.tensors().iter().flat_map(stored).map(|s| s.flats.len() as u64).sum()
}

/// Per destination node: bytes (in wire dtype) of the union of the elements
/// its ranks hold; and the bytes of the union over all nodes.
fn brute_force_needs(src: &Layout, dst: &Layout) -> (Vec<u64>, u64) {
    let rpn = dst.ranks_per_node();
    let mut per_node = vec![0u64; dst.ranks().div_ceil(rpn) as usize];
    let mut all = 0u64;
    for t in dst.tensors() {
        let sd = src.tensors()[src.tensor_index(&t.name).expect("tensor in source") as usize].dtype;
        let wire = wire_dtype(sd, t.dtype).size();
        let mut sets: HashMap<u32, HashSet<u64>> = HashMap::new();
        let mut union: HashSet<u64> = HashSet::new();
        for s in stored(t) {
            sets.entry(s.rank / rpn).or_default().extend(&s.flats);
            union.extend(&s.flats);
        }
        for (node, set) in sets {
            per_node[node as usize] += set.len() as u64 * wire;
        }
        all += union.len() as u64 * wire;
    }
    (per_node, all)
}

/// The library's expansion of a layout ([`Layout::holdings`]) must place
/// exactly the elements the reference places, at the same buffer positions.
fn check_holdings(layout: &Layout) -> Result<(), TestCaseError> {
    for (ti, t) in layout.tensors().iter().enumerate() {
        let mut want: Vec<(u32, BufferKey, u64, u64)> = Vec::new();
        for s in stored(t) {
            let key = buffer_key(layout, ti, &s.buf);
            want.extend(s.flats.iter().enumerate().map(|(k, &f)| (s.rank, key, s.at + k as u64, f)));
        }
        let mut got: Vec<(u32, BufferKey, u64, u64)> = Vec::new();
        for h in layout.holdings(ti as u32) {
            let flats = box_flats(&t.shape, h.block.offset(), h.block.extent());
            for loc in &h.holders {
                got.extend(flats.iter().enumerate().map(|(k, &f)| (loc.rank, loc.buffer, loc.at + k as u64, f)));
            }
        }
        want.sort_unstable();
        got.sort_unstable();
        prop_assert!(want == got, "tensor '{}': holdings differ from the reference expansion", t.name);
        // One rank's view is the whole expansion filtered to that rank, in
        // the same order.
        for rank in 0..layout.ranks() {
            let whole: Vec<_> = layout
                .holdings(ti as u32)
                .iter()
                .flat_map(|h| h.holders.iter().filter(|l| l.rank == rank).map(|l| (h.block, *l)).collect::<Vec<_>>())
                .collect();
            prop_assert!(layout.rank_holdings(ti as u32, rank) == whole, "tensor '{}': rank {rank}'s holdings differ", t.name);
        }
    }
    let all = layout.buffers();
    for rank in 0..layout.ranks() {
        prop_assert!(layout.rank_buffers(rank) == all[rank as usize], "rank {rank}: its buffers differ from the whole layout's");
    }
    Ok(())
}

/// Writes the pattern into every source region, at the reference positions.
fn ref_fill(src: &Layout, programs: &[RankProgram], memory: &mut [RankMemory]) {
    for (ti, t) in src.tensors().iter().enumerate() {
        let seed = tensor_seed(&t.name);
        let size = t.dtype.size() as usize;
        for s in stored(t) {
            if s.flats.is_empty() {
                continue;
            }
            let r = s.rank as usize;
            let b = buffer_index(&programs[r], buffer_key(src, ti, &s.buf));
            let buf = &mut memory[r].buffers[b];
            for (k, &flat) in s.flats.iter().enumerate() {
                let o = (s.at as usize + k) * size;
                pattern_value(seed, flat, t.dtype, &mut buf[o..o + size]);
            }
        }
    }
}

/// Checks every destination region, at the reference positions, against the
/// pattern converted from the source dtype.
fn ref_verify(src: &Layout, dst: &Layout, programs: &[RankProgram], memory: &[RankMemory]) -> Result<(), TestCaseError> {
    for (ti, t) in dst.tensors().iter().enumerate() {
        let seed = tensor_seed(&t.name);
        let sd = src.tensors()[src.tensor_index(&t.name).expect("tensor in source") as usize].dtype;
        let (ss, ds) = (sd.size() as usize, t.dtype.size() as usize);
        let (mut raw, mut want) = (vec![0u8; ss], vec![0u8; ds]);
        for s in stored(t) {
            if s.flats.is_empty() {
                continue;
            }
            let r = s.rank as usize;
            let b = buffer_index(&programs[r], buffer_key(dst, ti, &s.buf));
            let buf = &memory[r].buffers[b];
            for (k, &flat) in s.flats.iter().enumerate() {
                pattern_value(seed, flat, sd, &mut raw);
                convert_slice(sd, &raw, t.dtype, &mut want);
                let o = (s.at as usize + k) * ds;
                prop_assert!(
                    buf[o..o + ds] == want[..],
                    "tensor '{}' dst rank {r} {:?} element {} (flat {flat}): got {:02x?}, want {:02x?}",
                    t.name,
                    s.buf,
                    s.at as usize + k,
                    &buf[o..o + ds],
                    want
                );
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------

/// plan -> execute (the executor, every rank a thread) -> verify with both
/// strategies: bit-exact, and every destination element checked (by the
/// library and by the reference).
fn check_execution(c: &Case) -> Result<(), TestCaseError> {
    let expected = dst_elements(&c.dst);
    let n_src = c.src.ranks() as usize;
    for strategy in [Planner::Reshard, Planner::Baseline] {
        let planned = match strategy {
            Planner::Reshard => plan_reshard(&c.src, &c.dst, &c.options),
            Planner::Baseline => plan_baseline(&c.src, &c.dst, &c.options),
        };
        let plan = planned.map_err(|e| TestCaseError::fail(format!("{strategy}: plan: {e}")))?;
        let programs = plan.programs(&c.src, &c.dst).map_err(|e| TestCaseError::fail(format!("{strategy}: programs: {e}")))?;
        let mut memory = RankMemory::for_programs(&programs);
        fill_sources(&c.src, &mut memory[..n_src]);
        ref_fill(&c.src, &programs[..n_src], &mut memory[..n_src]);
        run_local(&programs, &mut memory, &ExecOptions { deadline: Duration::from_secs(60) })
            .map_err(|e| TestCaseError::fail(format!("{strategy}: execute: {e}")))?;
        let checked =
            verify_destinations(&c.src, &c.dst, &memory[n_src..]).map_err(|e| TestCaseError::fail(format!("{strategy}: verify: {e}")))?;
        prop_assert_eq!(checked, expected, "{}: verified element count", strategy);
        ref_verify(&c.src, &c.dst, &programs[n_src..], &memory[n_src..])
            .map_err(|e| TestCaseError::fail(format!("{strategy}: reference check: {e}")))?;
    }
    Ok(())
}

/// Reshard ingress per destination node is exactly the union of its ranks'
/// needs; sources send every needed element at least once; the baseline
/// never brings less into a node.
fn check_figures(c: &Case) -> Result<(), TestCaseError> {
    check_holdings(&c.src)?;
    check_holdings(&c.dst)?;
    let (per_node, unique) = brute_force_needs(&c.src, &c.dst);
    let reshard = plan_reshard(&c.src, &c.dst, &c.options).map_err(|e| TestCaseError::fail(format!("reshard: {e}")))?;
    let baseline = plan_baseline(&c.src, &c.dst, &c.options).map_err(|e| TestCaseError::fail(format!("baseline: {e}")))?;
    let rf = reshard.figures();
    prop_assert_eq!(&rf.dst_node_ingress_bytes, &per_node, "reshard ingress per node vs brute force");
    prop_assert_eq!(reshard.needed_node_bytes(), &per_node[..], "needed_node_bytes vs brute force");
    prop_assert!(rf.src_egress_bytes >= unique, "src egress {} < unique needed bytes {}", rf.src_egress_bytes, unique);
    let bf = baseline.figures();
    prop_assert_eq!(bf.dst_node_ingress_bytes.len(), per_node.len());
    for (n, (&b, &r)) in bf.dst_node_ingress_bytes.iter().zip(&rf.dst_node_ingress_bytes).enumerate() {
        prop_assert!(b >= r, "node {n}: baseline ingress {b} < reshard ingress {r}");
    }
    Ok(())
}

/// The baseline's summary (figures and estimate without the plan) is what
/// the plan gives: figures exactly, estimate within 1e-9 relative.
fn check_baseline_summary(c: &Case) -> Result<(), TestCaseError> {
    let plan = plan_baseline(&c.src, &c.dst, &c.options).map_err(|e| TestCaseError::fail(format!("baseline: {e}")))?;
    let links = c.options.links;
    let summary =
        baseline_summary(&c.src, &c.dst, &c.options, &links).map_err(|e| TestCaseError::fail(format!("baseline summary: {e}")))?;
    prop_assert_eq!(&summary.figures, plan.figures(), "summary figures");
    let (got, want) = (summary.estimate, plan.estimate(&links));
    for (g, w, what) in [(got.seconds, want.seconds, "estimate"), (got.lower_bound_seconds, want.lower_bound_seconds, "lower bound")] {
        prop_assert!((g - w).abs() <= 1e-9 * g.abs().max(w.abs()), "{}: summary {} vs plan {}", what, g, w);
    }
    Ok(())
}

/// The case's destination made block-scaled FP8 (every float tensor of 2
/// or more dimensions, in blocks of `block`, scales placed like it:
/// `refit_cli::bench::fp8_destination`), refit by the reshard quantizing at
/// the source where it can, by the reshard quantizing at the destination,
/// and by the baseline: every destination byte the same three times, and
/// every element as the semantics say (`verify_destinations` quantizes the
/// pattern itself). Blocks of one element make every source holding whole
/// blocks, so the source route is always taken there.
fn check_fp8_routes(c: &Case, block: u64) -> Result<(), TestCaseError> {
    // (The helper refuses a fused buffer whose tensors would get two
    // dtypes: such a case has no FP8 version to test.)
    let dst = refit_cli::bench::fp8_destination(&c.dst, block);
    prop_assume!(dst.is_ok(), "no FP8 version of this destination");
    let dst = dst.map_err(|e| TestCaseError::fail(e.to_string()))?;
    let n_src = c.src.ranks() as usize;
    let at = |quantize_at| PlanOptions { quantize_at, ..c.options.clone() };
    let runs = [
        ("reshard, at the source", plan_reshard(&c.src, &dst, &at(QuantizeAt::Source))),
        ("reshard, at the destination", plan_reshard(&c.src, &dst, &at(QuantizeAt::Destination))),
        ("baseline", plan_baseline(&c.src, &dst, &c.options)),
    ];
    let mut landed: Vec<Vec<Vec<u8>>> = Vec::new();
    let mut at_source = 0;
    for (what, planned) in runs {
        let plan = planned.map_err(|e| TestCaseError::fail(format!("{what}: plan: {e}")))?;
        at_source += (0..dst.tensors().len() as u32).filter(|&t| plan.route(t) == Route::QuantizedAtSource).count();
        let programs = plan.programs(&c.src, &dst).map_err(|e| TestCaseError::fail(format!("{what}: programs: {e}")))?;
        let mut memory = RankMemory::for_programs(&programs);
        fill_sources(&c.src, &mut memory[..n_src]);
        run_local(&programs, &mut memory, &ExecOptions { deadline: Duration::from_secs(60) })
            .map_err(|e| TestCaseError::fail(format!("{what}: execute: {e}")))?;
        verify_destinations(&c.src, &dst, &memory[n_src..]).map_err(|e| TestCaseError::fail(format!("{what}: verify: {e}")))?;
        // The destination layout's own buffers (not the plan's scratch).
        landed.push(memory[n_src..].iter().enumerate().flat_map(|(r, m)| m.buffers[..dst.rank_buffers(r as u32).len()].to_vec()).collect());
    }
    prop_assert!(landed[0] == landed[1] && landed[1] == landed[2], "the three refits landed different bytes");
    if block == 1 {
        // Blocks of one element: every block-scaled tensor whose source
        // ranks each hold disjoint boxes of it (a rank holding one region
        // twice, overlapping, keeps the destination route).
        let disjoint = |ts: u32| {
            (0..c.src.ranks()).all(|r| {
                let boxes: Vec<Block> = c.src.rank_holdings(ts, r).into_iter().map(|(b, _)| b).collect();
                boxes.iter().enumerate().all(|(i, a)| boxes[i + 1..].iter().all(|b| a == b || a.intersect(b).is_none()))
            })
        };
        let want = (0..dst.tensors().len() as u32)
            .filter(|&t| dst.scale_of(t).is_some() && disjoint(c.src.tensor_index(&dst.tensors()[t as usize].name).unwrap()))
            .count();
        // (Counted over the two reshard plans; the baseline never does.)
        prop_assert_eq!(at_source, want, "blocks of one element: quantized at the source");
    }
    Ok(())
}

/// Planning twice gives the same plan.
fn check_deterministic(c: &Case) -> Result<(), TestCaseError> {
    for strategy in [Planner::Reshard, Planner::Baseline] {
        let plan = || {
            match strategy {
                Planner::Reshard => plan_reshard(&c.src, &c.dst, &c.options),
                Planner::Baseline => plan_baseline(&c.src, &c.dst, &c.options),
            }
            .map_err(|e| TestCaseError::fail(format!("{strategy}: {e}")))
        };
        let (a, b) = (plan()?, plan()?);
        prop_assert_eq!(a.fingerprint(), b.fingerprint(), "{}: fingerprint", strategy);
        prop_assert_eq!(a.figures(), b.figures(), "{}: figures", strategy);
        prop_assert_eq!(a.pieces(), b.pieces(), "{}: pieces", strategy);
        prop_assert_eq!(a.transfers(), b.transfers(), "{}: transfers", strategy);
        // Where blocks are stored (own or named buffers, offsets) plays no
        // part in what moves where.
        let (src, dst) = (without_storage(&c.src), without_storage(&c.dst));
        let own = match strategy {
            Planner::Reshard => plan_reshard(&src, &dst, &c.options),
            Planner::Baseline => plan_baseline(&src, &dst, &c.options),
        }
        .map_err(|e| TestCaseError::fail(format!("{strategy} without named buffers: {e}")))?;
        prop_assert_eq!(a.figures(), own.figures(), "{}: figures without named buffers", strategy);
        prop_assert_eq!(a.pieces(), own.pieces(), "{}: pieces without named buffers", strategy);
        prop_assert_eq!(a.transfers(), own.transfers(), "{}: transfers without named buffers", strategy);
    }
    // The file format round-trips, named buffers of mesh-form tensors included.
    for (side, layout) in [("src", &c.src), ("dst", &c.dst)] {
        let back = parse_layout(&layout_to_json(layout).to_string()).map_err(|e| TestCaseError::fail(format!("{side}: {e}")))?;
        prop_assert!(&back == layout, "{}: layout_to_json does not round-trip", side);
    }
    Ok(())
}

/// The same layout with every block in a buffer of its own.
fn without_storage(layout: &Layout) -> Layout {
    let tensors = layout
        .tensors()
        .iter()
        .map(|t| {
            let mut t = t.clone();
            match &mut t.placement {
                Placement::Mesh(m) => m.storage = Storage::Own,
                Placement::Shards(shards) => shards.iter_mut().for_each(|s| s.storage = Storage::Own),
            }
            t
        })
        .collect();
    Layout::new(layout.ranks(), Some(layout.ranks_per_node()), tensors).expect("a layout without named buffers is valid")
}

/// `PROPTEST_CASES` overrides the number of cases (for longer soak runs).
fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(cases);
    ProptestConfig { cases, max_shrink_iters: 4096, failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config(256))]
    #[test]
    fn prop_execute_bit_exact(c in cases()) {
        check_execution(&c)?;
    }
}

proptest! {
    #![proptest_config(config(512))]
    #[test]
    fn prop_reshard_ingress_is_union_of_node_needs(c in cases()) {
        check_figures(&c)?;
    }
}

proptest! {
    #![proptest_config(config(256))]
    #[test]
    fn prop_baseline_summary_is_the_plans(c in cases()) {
        check_baseline_summary(&c)?;
    }
}

proptest! {
    #![proptest_config(config(128))]
    #[test]
    fn prop_fp8_routes_land_the_same_bytes(c in cases(), block in prop_oneof![Just(1u64), 2u64..5]) {
        check_fp8_routes(&c, block)?;
    }
}

proptest! {
    #![proptest_config(config(256))]
    #[test]
    fn prop_planning_is_deterministic(c in cases()) {
        check_deterministic(&c)?;
    }
}

// ---------------------------------------------------------------------------
// Hand-written regression cases
// ---------------------------------------------------------------------------

/// Runs every property on one layout pair, with default options, with
/// pieces split among their holders down to a byte or two, and with a tiny
/// staging budget (many rounds).
fn check(src_json: &str, dst_json: &str) {
    let src = parse_layout(src_json).expect("source layout parses");
    let dst = parse_layout(dst_json).expect("destination layout parses");
    let (staging, split) = (PlanOptions::default().max_staging_bytes, PlanOptions::default().min_split_bytes);
    for (max_staging_bytes, min_split_bytes) in [(staging, split), (staging, 1), (48, 2), (1, split)] {
        let options = PlanOptions { max_staging_bytes, min_split_bytes, ..PlanOptions::default() };
        let c = Case { src: src.clone(), dst: dst.clone(), options };
        let run = || -> Result<(), TestCaseError> {
            check_execution(&c)?;
            check_figures(&c)?;
            check_deterministic(&c)
        };
        if let Err(e) = run() {
            panic!("{e}\ncase: {c:?}");
        }
    }
}

#[test]
fn tp4_to_tp2_f32_to_bf16() {
    check(
        r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
            {"name": "w", "dtype": "f32", "shape": [10, 6], "mesh": {"shape": [4]}, "placements": ["shard(0)"]},
            {"name": "b", "dtype": "f32", "shape": [7], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]}]}"#,
        r#"{"ranks": 2, "ranks_per_node": 1, "tensors": [
            {"name": "w", "dtype": "bf16", "shape": [10, 6], "mesh": {"shape": [2]}, "placements": ["shard(1)"]},
            {"name": "b", "dtype": "bf16", "shape": [7], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#,
    );
}

#[test]
fn pp2_sub_meshes_to_tp() {
    // Two pipeline stages of two ranks each; the inference side is one TP group.
    check(
        r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
            {"name": "layers.0.w", "dtype": "bf16", "shape": [6, 5], "mesh": {"shape": [2], "ranks": [0, 1]}, "placements": ["shard(0)"]},
            {"name": "layers.1.w", "dtype": "bf16", "shape": [6, 5], "mesh": {"shape": [2], "ranks": [3, 2]}, "placements": ["shard(1)"]}]}"#,
        r#"{"ranks": 3, "ranks_per_node": 2, "tensors": [
            {"name": "layers.1.w", "dtype": "bf16", "shape": [6, 5], "mesh": {"shape": [3]}, "placements": ["shard(0)"]},
            {"name": "layers.0.w", "dtype": "f32", "shape": [6, 5], "mesh": {"shape": [3]}, "placements": ["shard(1)"]}]}"#,
    );
}

#[test]
fn flat_fsdp_to_row_tp() {
    // Two tensors in one flat buffer per rank, cut at arbitrary flat indices.
    check(
        r#"{"ranks": 3, "ranks_per_node": 3, "tensors": [
            {"name": "a", "dtype": "f32", "shape": [4, 3], "shards": [
                {"rank": 0, "flat": [0, 5], "buffer": "flat", "at": 0},
                {"rank": 1, "flat": [5, 5], "buffer": "flat", "at": 0},
                {"rank": 2, "flat": [10, 2], "buffer": "flat", "at": 0}]},
            {"name": "b", "dtype": "f32", "shape": [3, 3, 2], "shards": [
                {"rank": 0, "flat": [0, 1], "buffer": "flat", "at": 5},
                {"rank": 1, "flat": [1, 9], "buffer": "flat", "at": 5},
                {"rank": 2, "flat": [10, 8], "buffer": "flat", "at": 2}]}]}"#,
        r#"{"ranks": 2, "ranks_per_node": 1, "tensors": [
            {"name": "a", "dtype": "f16", "shape": [4, 3], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
            {"name": "b", "dtype": "f64", "shape": [3, 3, 2], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#,
    );
}

#[test]
fn fused_qkv_to_separate_shards() {
    // q, k, v row halves back to back in one "qkv" buffer per rank.
    check(
        r#"{"ranks": 2, "tensors": [
            {"name": "q", "dtype": "bf16", "shape": [4, 3], "shards": [
                {"rank": 0, "offset": [0, 0], "extent": [2, 3], "buffer": "qkv", "at": 0},
                {"rank": 1, "offset": [2, 0], "extent": [2, 3], "buffer": "qkv", "at": 0}]},
            {"name": "k", "dtype": "bf16", "shape": [2, 3], "shards": [
                {"rank": 0, "offset": [0, 0], "extent": [1, 3], "buffer": "qkv", "at": 6},
                {"rank": 1, "offset": [1, 0], "extent": [1, 3], "buffer": "qkv", "at": 6}]},
            {"name": "v", "dtype": "bf16", "shape": [2, 3], "shards": [
                {"rank": 0, "offset": [0, 0], "extent": [1, 3], "buffer": "qkv", "at": 9},
                {"rank": 1, "offset": [1, 0], "extent": [1, 3], "buffer": "qkv", "at": 9}]}]}"#,
        r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
            {"name": "q", "dtype": "bf16", "shape": [4, 3], "mesh": {"shape": [4]}, "placements": ["shard(1)"]},
            {"name": "k", "dtype": "bf16", "shape": [2, 3], "mesh": {"shape": [2, 2]}, "placements": ["shard(0)", "shard(0)"]},
            {"name": "v", "dtype": "bf16", "shape": [2, 3], "shards": [
                {"rank": 3, "offset": [0, 1], "extent": [2, 2]},
                {"rank": 0, "flat": [0, 4]}]}]}"#,
    );
}

#[test]
fn fused_mesh_qkv_tp2_to_tp4_with_whole_kv_heads() {
    // Megatron-style training TP2 x DP2: q, k, v of each rank back to back in
    // its buffer "linear_qkv" (q's local block 4x3 at 0, k's 1x3 at 12, v's
    // at 15), gate and up in "linear_fc1". vLLM-style inference TP4: q split
    // 4 ways, the 2 KV heads (1 row each) each whole on 2 ranks (mesh [2, 2],
    // shard(0) then replicate), all in "qkv_proj"; gate/up in "gate_up_proj"
    // with uneven chunks (5 rows over 4 ranks: 2, 2, 1, 0) at a gap.
    check(
        r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
            {"name": "q", "dtype": "bf16", "shape": [8, 3], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"],
             "buffer": "linear_qkv", "at": 0},
            {"name": "k", "dtype": "bf16", "shape": [2, 3], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"],
             "buffer": "linear_qkv", "at": 12},
            {"name": "v", "dtype": "bf16", "shape": [2, 3], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"],
             "buffer": "linear_qkv", "at": 15},
            {"name": "gate", "dtype": "f32", "shape": [5, 2], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"],
             "buffer": "linear_fc1"},
            {"name": "up", "dtype": "f32", "shape": [5, 2], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"],
             "buffer": "linear_fc1", "at": 6}]}"#,
        r#"{"ranks": 4, "ranks_per_node": 4, "tensors": [
            {"name": "q", "dtype": "bf16", "shape": [8, 3], "mesh": {"shape": [4]}, "placements": ["shard(0)"],
             "buffer": "qkv_proj", "at": 0},
            {"name": "k", "dtype": "bf16", "shape": [2, 3], "mesh": {"shape": [2, 2]}, "placements": ["shard(0)", "replicate"],
             "buffer": "qkv_proj", "at": 6},
            {"name": "v", "dtype": "bf16", "shape": [2, 3], "mesh": {"shape": [2, 2], "ranks": [0, 1, 2, 3]},
             "placements": ["shard(0)", "replicate"], "buffer": "qkv_proj", "at": 9},
            {"name": "gate", "dtype": "f32", "shape": [5, 2], "mesh": {"shape": [4]}, "placements": ["shard(0)"], "buffer": "gate_up_proj", "at": 1},
            {"name": "up", "dtype": "f16", "shape": [5, 2], "mesh": {"shape": [4]}, "placements": ["shard(0)"], "buffer": "up_alone", "at": 3}]}"#,
    );
}

#[test]
fn replicated_scalar() {
    check(
        r#"{"ranks": 2, "tensors": [
            {"name": "scale", "dtype": "f32", "shape": [], "mesh": {"shape": [2]}, "placements": ["replicate"]},
            {"name": "step", "dtype": "i32", "shape": [], "shards": [{"rank": 1, "offset": [], "extent": []}]}]}"#,
        r#"{"ranks": 3, "ranks_per_node": 1, "tensors": [
            {"name": "scale", "dtype": "f16", "shape": [], "mesh": {"shape": [3]}, "placements": ["replicate"]},
            {"name": "step", "dtype": "i32", "shape": [], "mesh": {"shape": [1, 3]}, "placements": ["replicate", "replicate"]}]}"#,
    );
}

#[test]
fn uneven_chunks_and_same_dim_sharded_twice() {
    // torch.chunk(5, 4) = [2, 2, 1, 0]; [2, 2] mesh sharding dim 0 twice.
    check(
        r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
            {"name": "w", "dtype": "u8", "shape": [5, 3], "mesh": {"shape": [4]}, "placements": ["shard(0)"]},
            {"name": "x", "dtype": "f64", "shape": [7, 2], "mesh": {"shape": [2, 2], "ranks": [3, 1, 2, 0]}, "placements": ["shard(0)", "shard(0)"]}]}"#,
        r#"{"ranks": 5, "ranks_per_node": 2, "tensors": [
            {"name": "w", "dtype": "u8", "shape": [5, 3], "mesh": {"shape": [3]}, "placements": ["shard(0)"]},
            {"name": "x", "dtype": "bf16", "shape": [7, 2], "mesh": {"shape": [5]}, "placements": ["shard(0)"]}]}"#,
    );
}

#[test]
fn replicated_over_six_nodes() {
    // One destination rank per node, all needing the whole tensor: the
    // reshard planner relays pieces node to node (stages beyond the first
    // fan-out) instead of sending each from the sources six times.
    check(
        r#"{"ranks": 2, "ranks_per_node": 1, "tensors": [
            {"name": "w", "dtype": "f32", "shape": [8, 8], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#,
        r#"{"ranks": 6, "ranks_per_node": 1, "tensors": [
            {"name": "w", "dtype": "bf16", "shape": [8, 8], "mesh": {"shape": [6]}, "placements": ["replicate"]}]}"#,
    );
}

#[test]
fn mixed_wire_dtypes_in_one_message() {
    // Regression for a transport bug (transport/src/exec/mod.rs, run_rounds,
    // sender staging): pieces converted on the sender are packed into one
    // staging area at byte offset `pos`, and the segment's element offset is
    // `pos / wire_size`. When a message carries a narrower converted piece
    // (f16 -> bf16, 2 bytes) before a wider one (f64 -> f32, 4 bytes), the
    // second one starts at byte 2, is truncated to element 0 (byte 0) and
    // overwrites the first: dst 'a' receives two bytes of 'b'. Both planners
    // put both pieces in one src 0 -> dst 0 message.
    check(
        r#"{"ranks": 1, "tensors": [
            {"name": "a", "dtype": "f16", "shape": [1], "mesh": {"shape": [1]}, "placements": ["replicate"]},
            {"name": "b", "dtype": "f64", "shape": [1], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}"#,
        r#"{"ranks": 1, "tensors": [
            {"name": "a", "dtype": "bf16", "shape": [1], "mesh": {"shape": [1]}, "placements": ["replicate"]},
            {"name": "b", "dtype": "f32", "shape": [1], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}"#,
    );
}

#[test]
fn pieces_split_among_replicas_and_halves() {
    // Rank 0 holds `w` whole, ranks 1 and 2 its halves (an atom cut into
    // cells along the halves), and `r` is replicated on all four ranks;
    // with parts of a byte or two the reshard splits both among their
    // holders, and every part must still land where it belongs: the node's
    // first rank fans the parts of `w` out to the second.
    check(
        r#"{"ranks": 4, "ranks_per_node": 1, "tensors": [
            {"name": "w", "dtype": "f32", "shape": [6, 5], "shards": [
                {"rank": 0, "offset": [0, 0], "extent": [6, 5]},
                {"rank": 1, "offset": [0, 0], "extent": [3, 5]},
                {"rank": 2, "offset": [3, 0], "extent": [3, 5]}]},
            {"name": "r", "dtype": "bf16", "shape": [1, 9, 4], "mesh": {"shape": [4]}, "placements": ["replicate"]}]}"#,
        r#"{"ranks": 2, "ranks_per_node": 2, "tensors": [
            {"name": "w", "dtype": "bf16", "shape": [6, 5], "mesh": {"shape": [2]}, "placements": ["replicate"]},
            {"name": "r", "dtype": "bf16", "shape": [1, 9, 4], "mesh": {"shape": [2]}, "placements": ["shard(2)"]}]}"#,
    );
}
