//! Block-scaled FP8 quantization on the device: a destination program's
//! [`Quantize`] steps as launches of the `refit_fp8_*` kernels of
//! `kernels.cu`, so a GPU plane quantizes where the values landed instead
//! of copying the rank's buffers to the host and back.
//!
//! Per step, per staged box (whole blocks of unquantized values):
//! 1. [`ScalesLaunch`]: every block's scale, into a scratch array of f32
//!    (one thread block per FP8 block: the largest magnitude as bits, then
//!    `block_scale`); a block holding NaN or infinity raises an error flag;
//! 2. [`CodesLaunch`]: for each of the rank's weight boxes, its part inside
//!    the staged box: every element's code with its block's scale;
//! 3. [`ScaleOutLaunch`]: for each of the rank's scale boxes, its part
//!    inside the staged box's grid: the scales copied out of the scratch
//!    (the plain 4-byte strided copy kernel).
//!
//! The arithmetic is [`reshard::quantize`]'s, bit for bit (`kernels.cu`
//! compiles the same functions as C on the host, where the tests compare
//! them with it); [`QuantPlan::replay`] runs the launches on host memory as
//! the kernels run them, which the tests compare with the host quantizer.
//! Every launch is checked against the rank's buffer sizes when the plan is
//! made, like [`reshard::quantize`] checks a program from the wire.
//! Tensors of more than three dimensions are left to the host.

use crate::cuda::kernels::CastBox;
use reshard::{block_scale, elements_of, grid_of, quantize_value, QuantError, Quantize, Stored};
use reshard::{Block, BufferSpec, DType, RankProgram};

/// A staged box's scales: one FP8 block per thread block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScalesLaunch {
    /// The staged buffer (index into the program's buffers).
    pub staged: u32,
    /// Its dtype, as the kernels name it (0 f32, 1 bf16, 2 f16).
    pub dt: u64,
    /// Blocks of the box per dimension, innermost first.
    pub grid: [u64; 3],
    /// The box's first block (block-grid index), innermost first.
    pub grid_off: [u64; 3],
    /// Block extent, innermost first.
    pub block: [u64; 3],
    /// The tensor's shape, innermost first.
    pub shape: [u64; 3],
    /// The box's first element (global index), innermost first.
    pub first: [u64; 3],
    /// Element offset of that element in the staged buffer.
    pub at: u64,
    /// The box's row-major element strides, innermost first.
    pub strides: [u64; 3],
    /// Where the box's scales start in the scratch array.
    pub base: u64,
}

/// The codes of a box of a rank's weights inside one staged box.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodesLaunch {
    /// The staged buffer.
    pub staged: u32,
    /// Its dtype code.
    pub dt: u64,
    /// The weight buffer (f8e4m3).
    pub weights: u32,
    /// Elements per dimension, innermost first.
    pub counts: [u64; 3],
    /// Staged element offset of the box's first element, and strides.
    pub src_base: u64,
    /// Staged element strides, innermost first.
    pub src_strides: [u64; 3],
    /// Weight element offset of the box's first element.
    pub dst_base: u64,
    /// Weight element strides, innermost first.
    pub dst_strides: [u64; 3],
    /// The box's first element (global index), innermost first.
    pub first: [u64; 3],
    /// Block extent, innermost first.
    pub block: [u64; 3],
    /// The staged box's first block, innermost first.
    pub grid_off: [u64; 3],
    /// Scratch strides of the staged box's grid, innermost first (the
    /// first is 1).
    pub grid_strides: [u64; 3],
    /// Where the staged box's scales start in the scratch array.
    pub base: u64,
}

/// Scales copied out of the scratch array into a rank's scale buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaleOutLaunch {
    /// The scale buffer (f32).
    pub scales: u32,
    /// The copy: source offsets in the scratch array, destination offsets
    /// in the scale buffer (f32 elements).
    pub copy: CastBox,
}

/// A destination program's quantize steps as device launches.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QuantPlan {
    /// f32 scales the scratch array holds (every staged box's blocks).
    pub scratch: u64,
    /// Step 1 launches, in order.
    pub scales: Vec<ScalesLaunch>,
    /// Step 2 launches.
    pub codes: Vec<CodesLaunch>,
    /// Step 3 launches.
    pub outs: Vec<ScaleOutLaunch>,
}

/// Why a program's quantize steps stay on the host.
/// Why a [`QuantPlan`]'s launches do not fit the buffers they name
/// ([`QuantPlan::fits`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FitError {
    /// A buffer a launch names is missing or of another dtype.
    #[error("{what} buffer {buffer} is not {dtype} here")]
    Buffer {
        /// The buffer's role (staged, weight, scale).
        what: &'static str,
        /// Its index.
        buffer: u32,
        /// The dtype the launch takes.
        dtype: DType,
    },
    /// A staged dtype code no kernel takes.
    #[error("bad staged dtype")]
    StagedDtype(u64),
    /// A launch reaches past its buffer.
    #[error("a {what} launch reaches past its buffer")]
    Past {
        /// The launch (scales, codes, scale).
        what: &'static str,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostOnly {
    /// A tensor of more than three dimensions.
    Dimensions {
        /// The tensor.
        tensor: String,
        /// Its dimensions.
        ndim: usize,
    },
    /// Blocks whose two innermost dimensions hold 2^32 elements or more
    /// (the scale kernel indexes them in 32 bits).
    Block {
        /// The tensor.
        tensor: String,
    },
    /// Values of a type the kernels do not read (f64: a source that
    /// quantizes reads its own dtype).
    Dtype {
        /// The tensor.
        tensor: String,
        /// The values' type.
        dtype: DType,
    },
}

impl std::fmt::Display for HostOnly {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostOnly::Dimensions { tensor, ndim } => {
                write!(f, "tensor '{tensor}' has {ndim} dimensions; the device quantizes up to 3")
            }
            HostOnly::Block { tensor } => write!(f, "tensor '{tensor}': blocks too large for the device quantizer"),
            HostOnly::Dtype { tensor, dtype } => write!(f, "tensor '{tensor}': the device quantizer does not read {dtype}"),
        }
    }
}

/// `v` (outermost first, at most 3 long) innermost first, padded with `pad`.
fn inner3(v: &[u64], pad: u64) -> [u64; 3] {
    let mut out = [pad; 3];
    for (o, &x) in out.iter_mut().zip(v.iter().rev()) {
        *o = x;
    }
    out
}

/// Row-major strides of a box of `extent` (outermost first), innermost
/// first; `None` where they pass `u64`.
fn row_major(extent: &[u64]) -> Option<[u64; 3]> {
    let e = inner3(extent, 1);
    Some([1, e[0], e[0].checked_mul(e[1])?])
}

/// Element offset of global index `idx` in box `b` stored row-major from
/// `at`.
fn offset_of(b: &Block, at: u64, idx: &[u64]) -> u64 {
    reshard::offset_in(b, at, idx)
}

fn dt_code(dtype: DType) -> Option<u64> {
    match dtype {
        DType::F32 => Some(0),
        DType::BF16 => Some(1),
        DType::F16 => Some(2),
        _ => None,
    }
}

impl QuantPlan {
    /// The launches of `program`'s quantize steps, every region checked
    /// against the program's buffers (`Err`: a step that does not fit them,
    /// as the host quantizer would refuse it); `Ok(Err)` where a step must
    /// stay on the host. An empty plan for a program with none.
    pub fn new(program: &RankProgram) -> Result<Result<QuantPlan, HostOnly>, QuantError> {
        let mut plan = QuantPlan::default();
        for op in &program.quantize {
            if op.shape.len() > 3 {
                return Ok(Err(HostOnly::Dimensions { tensor: op.tensor.clone(), ndim: op.shape.len() }));
            }
            let b = inner3(&op.block, 1);
            if b[0].checked_mul(b[1]).is_none_or(|rows| rows >> 32 != 0) {
                return Ok(Err(HostOnly::Block { tensor: op.tensor.clone() }));
            }
            if op.staged_dtype == DType::F64 {
                return Ok(Err(HostOnly::Dtype { tensor: op.tensor.clone(), dtype: op.staged_dtype }));
            }
            plan.add(op, &program.buffers)?;
        }
        Ok(Ok(plan))
    }

    /// Whether there is nothing to quantize.
    pub fn is_empty(&self) -> bool {
        self.scales.is_empty()
    }

    fn add(&mut self, op: &Quantize, buffers: &[BufferSpec]) -> Result<(), QuantError> {
        let dt = check_op(op, buffers)?;
        for st in op.staged.iter().filter(|st| !st.block.is_empty()) {
            // (An empty box holds no block: no launch, as the host
            // quantizer skips it.)
            self.add_box(op, st, dt)?;
        }
        Ok(())
    }

    /// The launches of staged box `st` of `op` (checked by [`check_op`]),
    /// whose staged dtype has code `dt`: its scales into the scratch,
    /// the codes of every weight box it meets, the scales copied out.
    fn add_box(&mut self, op: &Quantize, st: &Stored, dt: u64) -> Result<(), QuantError> {
        let oob = |what| QuantError::OutOfBounds { tensor: op.tensor.clone(), what };
        let block = inner3(&op.block, 1);
        // Strides of a box checked to fit its buffer (so they fit `u64`).
        let strides = |b: &Block, what| row_major(b.extent()).ok_or_else(|| oob(what));
        let g = grid_of(&st.block, &op.block);
        let base = self.scratch;
        let grid = inner3(g.extent(), 1);
        // The grid has no more cells than the box has elements.
        let grid_strides = row_major(g.extent()).ok_or_else(|| oob("staged"))?;
        self.scratch = g.checked_numel().and_then(|n| n.checked_add(base)).ok_or_else(|| oob("staged"))?;
        self.scales.push(ScalesLaunch {
            staged: st.buffer,
            dt,
            grid,
            grid_off: inner3(g.offset(), 0),
            block,
            shape: inner3(&op.shape, 1),
            first: inner3(st.block.offset(), 0),
            at: st.at,
            strides: strides(&st.block, "staged")?,
            base,
        });
        for w in &op.weights {
            let Some(part) = w.block.intersect(&st.block) else { continue };
            self.codes.push(CodesLaunch {
                staged: st.buffer,
                dt,
                weights: w.buffer,
                counts: inner3(part.extent(), 1),
                src_base: offset_of(&st.block, st.at, part.offset()),
                src_strides: strides(&st.block, "staged")?,
                dst_base: offset_of(&w.block, w.at, part.offset()),
                dst_strides: strides(&w.block, "weight")?,
                first: inner3(part.offset(), 0),
                block,
                grid_off: inner3(g.offset(), 0),
                grid_strides,
                base,
            });
        }
        for sc in &op.scales {
            let Some(part) = sc.block.intersect(&g) else { continue };
            self.outs.push(ScaleOutLaunch {
                scales: sc.buffer,
                copy: CastBox {
                    counts: inner3(part.extent(), 1),
                    src_base: offset_of(&g, base, part.offset()),
                    src_strides: grid_strides,
                    dst_base: offset_of(&sc.block, sc.at, part.offset()),
                    dst_strides: strides(&sc.block, "scale")?,
                },
            });
        }
        Ok(())
    }

    /// Checks that every launch stays inside buffers of `lens` bytes and
    /// `dtypes` (the rank's device buffers, in program order) and inside
    /// the scratch array: the gate before any kernel runs.
    pub fn fits(&self, lens: &[usize], dtypes: &[DType]) -> Result<(), FitError> {
        let elems = |buffer: u32, dtype: DType, what: &'static str| -> Result<u64, FitError> {
            match (lens.get(buffer as usize), dtypes.get(buffer as usize)) {
                (Some(&len), Some(&d)) if d == dtype => Ok(len as u64 / dtype.size()),
                _ => Err(FitError::Buffer { what, buffer, dtype }),
            }
        };
        // One past the last element of a box of `counts` at `base` (`None`
        // past `u64`: every launch's numbers are checked here, whoever
        // made them).
        let end = |counts: [u64; 3], base: u64, strides: [u64; 3]| -> Option<u64> {
            if counts.contains(&0) {
                return Some(base);
            }
            let mut last = base;
            for (c, s) in counts.into_iter().zip(strides) {
                last = last.checked_add((c - 1).checked_mul(s)?)?;
            }
            last.checked_add(1)
        };
        let out = |what: &'static str| Err(FitError::Past { what });
        for l in &self.scales {
            let dtype = [DType::F32, DType::BF16, DType::F16].get(l.dt as usize).copied().ok_or(FitError::StagedDtype(l.dt))?;
            let n = elems(l.staged, dtype, "staged")?;
            if l.block[0].checked_mul(l.block[1]).is_none_or(|rows| rows >> 32 != 0) {
                return out("scales");
            }
            let mut ext = [0u64; 3];
            for (d, e) in ext.iter_mut().enumerate() {
                // The kernel reads a cell's elements from its first up to
                // the tensor's end (a whole block past it if the cell
                // started there): no cell may start past the end.
                let start = l.grid_off[d].checked_mul(l.block[d]);
                let end = l.grid_off[d].checked_add(l.grid[d]).and_then(|g| g.checked_mul(l.block[d]));
                let last_cell = end.and_then(|e| e.checked_sub(l.block[d]));
                match (start, end, last_cell) {
                    (Some(start), Some(end), Some(last)) if start >= l.first[d] && l.block[d] != 0 && last <= l.shape[d] => {
                        *e = end.min(l.shape[d]) - l.first[d]
                    }
                    _ if l.grid[d] == 0 && l.block[d] != 0 => *e = 0,
                    _ => return out("scales"),
                }
            }
            let cells = l.grid.iter().try_fold(1u64, |n, &g| n.checked_mul(g)).and_then(|c| c.checked_add(l.base));
            if end(ext, l.at, l.strides).is_none_or(|e| e > n) || cells.is_none_or(|c| c > self.scratch) {
                return out("scales");
            }
        }
        for l in &self.codes {
            let dtype = [DType::F32, DType::BF16, DType::F16].get(l.dt as usize).copied().ok_or(FitError::StagedDtype(l.dt))?;
            let (n, w) = (elems(l.staged, dtype, "staged")?, elems(l.weights, DType::F8E4M3, "weight")?);
            if l.counts.contains(&0) {
                continue;
            }
            // The kernel steps through the grid's first dimension by 1.
            if l.grid_strides[0] != 1 {
                return out("codes");
            }
            let mut cell = Some(l.base);
            for d in 0..3 {
                let b = l.block[d];
                let last = l.first[d].checked_add(l.counts[d] - 1);
                let (lo, hi) = match last {
                    Some(last) if b != 0 => (l.first[d] / b, last / b),
                    _ => return out("codes"),
                };
                if lo < l.grid_off[d] {
                    return out("codes");
                }
                cell = cell.and_then(|c| c.checked_add((hi - l.grid_off[d]).checked_mul(l.grid_strides[d])?));
            }
            if end(l.counts, l.src_base, l.src_strides).is_none_or(|e| e > n)
                || end(l.counts, l.dst_base, l.dst_strides).is_none_or(|e| e > w)
                || cell.is_none_or(|c| c >= self.scratch)
            {
                return out("codes");
            }
        }
        for o in &self.outs {
            let n = elems(o.scales, DType::F32, "scale")?;
            match o.copy.ends() {
                Some((src, dst)) if src <= self.scratch && dst <= n => {}
                _ => return out("scale"),
            }
        }
        Ok(())
    }

    /// Runs the launches on host buffers (the program's, in order) as the
    /// kernels run them, once [`QuantPlan::fits`] accepted these buffers.
    /// Returns the scratch index of the first block holding NaN or
    /// infinity, if any (its codes are then unspecified, as on the
    /// device).
    pub fn replay(&self, buffers: &mut [Vec<u8>]) -> Result<(), u64> {
        let mut scratch = vec![0f32; self.scratch as usize];
        let mut bad: Option<u64> = None;
        let load = |buf: &[u8], dt: u64, i: u64| -> f32 {
            let dtype = [DType::F32, DType::BF16, DType::F16][dt as usize];
            reshard::read_f32(dtype, buf, i as usize)
        };
        for l in &self.scales {
            let buf = &buffers[l.staged as usize];
            for z in 0..l.grid[2] {
                for y in 0..l.grid[1] {
                    for x in 0..l.grid[0] {
                        let cell = [x, y, z];
                        let e: [u64; 3] = std::array::from_fn(|d| (l.grid_off[d] + cell[d]) * l.block[d]);
                        let c: [u64; 3] = std::array::from_fn(|d| (l.shape[d] - e[d]).min(l.block[d]));
                        let at = l.at + (0..3).map(|d| (e[d] - l.first[d]) * l.strides[d]).sum::<u64>();
                        let mut top = 0u32;
                        for k in 0..c[2] {
                            for j in 0..c[1] {
                                for i in 0..c[0] {
                                    let v = load(buf, l.dt, at + i * l.strides[0] + j * l.strides[1] + k * l.strides[2]);
                                    top = top.max(v.to_bits() & 0x7fff_ffff);
                                }
                            }
                        }
                        let index = l.base + x + l.grid[0] * (y + l.grid[1] * z);
                        scratch[index as usize] = if top >= 0x7f80_0000 {
                            bad = Some(bad.map_or(index, |b| b.min(index)));
                            f32::NAN
                        } else {
                            block_scale(f32::from_bits(top))
                        };
                    }
                }
            }
        }
        for l in &self.codes {
            let (lo, hi) = (l.staged.min(l.weights) as usize, l.staged.max(l.weights) as usize);
            let (a, b) = buffers.split_at_mut(hi);
            let (staged, weights) = if (l.staged as usize) < hi { (&a[lo], &mut b[0]) } else { (&b[0], &mut a[lo]) };
            for k in 0..l.counts[2] {
                for j in 0..l.counts[1] {
                    for i in 0..l.counts[0] {
                        let idx = [i, j, k];
                        let cell =
                            l.base + (0..3).map(|d| ((l.first[d] + idx[d]) / l.block[d] - l.grid_off[d]) * l.grid_strides[d]).sum::<u64>();
                        let x = load(staged, l.dt, l.src_base + (0..3).map(|d| idx[d] * l.src_strides[d]).sum::<u64>());
                        let to = l.dst_base + (0..3).map(|d| idx[d] * l.dst_strides[d]).sum::<u64>();
                        weights[to as usize] = quantize_value(x, scratch[cell as usize]);
                    }
                }
            }
        }
        let bytes: Vec<u8> = scratch.iter().flat_map(|s| s.to_le_bytes()).collect();
        for o in &self.outs {
            if !o.copy.apply(DType::F32, &bytes, DType::F32, &mut buffers[o.scales as usize]) {
                return Err(u64::MAX);
            }
        }
        bad.map_or(Ok(()), Err)
    }
}

/// Checks `op` against `buffers`: its block shape, every staged box inside
/// the tensor and on block boundaries, every output inside its buffer,
/// outside every staged buffer and disjoint from the others. Returns the
/// staged dtype's code.
fn check_op(op: &Quantize, buffers: &[BufferSpec]) -> Result<u64, QuantError> {
    let oob = |what| QuantError::OutOfBounds { tensor: op.tensor.clone(), what };
    let nd = op.shape.len();
    if op.block.len() != nd || op.block.contains(&0) {
        return Err(oob("block"));
    }
    let grid_shape: Vec<u64> = op.shape.iter().zip(&op.block).map(|(&n, &b)| n.div_ceil(b)).collect();
    let inside = |b: &Block, shape: &[u64]| b.ndim() == nd && (0..nd).all(|d| b.end(d) <= shape[d]);
    // A region of `numel` elements of `dtype` from element `at` of
    // buffer `buffer`, inside it: its end. Counts are checked (extents
    // from the wire may multiply past `u64`), so every offset inside a
    // box below is less than its end.
    let fits = |st: &Stored, dtype: DType, what| -> Result<u64, QuantError> {
        let spec = buffers.get(st.buffer as usize).ok_or_else(|| oob(what))?;
        let end = st.block.checked_numel().and_then(|n| n.checked_add(st.at)).ok_or_else(|| oob(what))?;
        if spec.dtype != dtype || end > spec.elems {
            return Err(oob(what));
        }
        Ok(end)
    };
    let dt = dt_code(op.staged_dtype).ok_or_else(|| oob("staged"))?;
    for st in &op.staged {
        fits(st, op.staged_dtype, "staged")?;
        if !inside(&st.block, &op.shape) || elements_of(&grid_of(&st.block, &op.block), &op.block, &op.shape) != st.block {
            return Err(oob("staged"));
        }
    }
    // Outputs: in bounds, outside every staged buffer, pairwise disjoint.
    let mut regions: Vec<(u32, u64, u64)> = Vec::new();
    for (list, dtype, shape, what) in [(&op.weights, DType::F8E4M3, &op.shape, "weight"), (&op.scales, DType::F32, &grid_shape, "scale")] {
        for st in list.iter() {
            let end = fits(st, dtype, what)?;
            if !inside(&st.block, shape) || op.staged.iter().any(|s| s.buffer == st.buffer) {
                return Err(oob(what));
            }
            regions.push((st.buffer, st.at, end));
        }
    }
    regions.sort_unstable();
    if regions.windows(2).any(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2) {
        return Err(oob("overlapping"));
    }
    Ok(dt)
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard::{BufferKey, Endpoint, Fingerprint, Group, RankProgram};

    /// 3 x 0xAAAA_AAAA_AAAA_AAAB elements: 2^65 + 1, so 1 if the product
    /// wrapped.
    const WRAPS: [u64; 2] = [3, 0xAAAA_AAAA_AAAA_AAAB];

    fn spec(i: u32, dtype: DType, elems: u64) -> BufferSpec {
        BufferSpec { key: BufferKey::Named(i), name: format!("b{i}"), dtype, elems }
    }

    /// A destination program with one step: a 3 x 5 f32 tensor in 2 x 2
    /// blocks, staged as two boxes in buffer 0; the rank holds a 2 x 3
    /// window (buffer 1) and every scale (buffer 2).
    fn program() -> RankProgram {
        let op = Quantize {
            tensor: "w".into(),
            shape: vec![3, 5],
            block: vec![2, 2],
            staged_dtype: DType::F32,
            staged: vec![
                Stored { block: Block::new(&[0, 0], &[2, 5]), buffer: 0, at: 0 },
                Stored { block: Block::new(&[2, 0], &[1, 5]), buffer: 0, at: 10 },
            ],
            weights: vec![Stored { block: Block::new(&[1, 1], &[2, 3]), buffer: 1, at: 0 }],
            scales: vec![Stored { block: Block::new(&[0, 0], &[2, 3]), buffer: 2, at: 0 }],
        };
        RankProgram {
            endpoint: Endpoint { group: Group::Dst, rank: 0 },
            fingerprint: Fingerprint(0),
            buffers: vec![spec(0, DType::F32, 16), spec(1, DType::F8E4M3, 6), spec(2, DType::F32, 6)],
            rounds: Vec::new(),
            carried: Vec::new(),
            quantize: vec![op],
        }
    }

    fn lens_and_dtypes(p: &RankProgram) -> (Vec<usize>, Vec<DType>) {
        p.buffers.iter().map(|b| ((b.elems * b.dtype.size()) as usize, b.dtype)).unzip()
    }

    #[test]
    fn a_step_of_wrapping_extents_does_not_fit() {
        let huge = Block::new(&[0, 0], &WRAPS);
        let small = Block::new(&[0, 0], &[1, 1]);
        for (what, st, w, sc) in [("staged", huge, small, small), ("weight", small, huge, small), ("scale", small, small, huge)] {
            let mut p = program();
            let op = &mut p.quantize[0];
            (op.shape, op.block) = (WRAPS.to_vec(), vec![1, 1]);
            op.staged.truncate(1);
            (op.staged[0].block, op.weights[0].block, op.scales[0].block) = (st, w, sc);
            // Every buffer has room for the 1 element a wrapped count
            // claims; the staged one for 16.
            assert_eq!(QuantPlan::new(&p), Err(QuantError::OutOfBounds { tensor: "w".into(), what }), "{what}");
        }
    }

    #[test]
    fn launches_whose_numbers_pass_u64_do_not_fit() {
        let p = program();
        let good = QuantPlan::new(&p).unwrap().unwrap();
        let (lens, dtypes) = lens_and_dtypes(&p);
        good.fits(&lens, &dtypes).unwrap();
        type Change = Box<dyn Fn(&mut QuantPlan)>;
        let bad: Vec<(&str, Change)> = vec![
            ("scales: a grid of wrapping cells", Box::new(|q| q.scales[0].grid = [WRAPS[1], WRAPS[0], 1])),
            ("scales: a grid offset past u64", Box::new(|q| q.scales[0].grid_off[0] = u64::MAX / 2)),
            ("scales: a stride past u64", Box::new(|q| q.scales[0].strides[1] = u64::MAX)),
            ("scales: the scratch base past u64", Box::new(|q| q.scales[0].base = u64::MAX)),
            (
                "scales: cells past the tensor's end",
                Box::new(|q| {
                    q.scales[0].grid[0] += 2;
                    q.scratch += 100;
                }),
            ),
            ("codes: wrapping counts", Box::new(|q| q.codes[0].counts = [WRAPS[1], WRAPS[0], 1])),
            ("codes: the first element past u64", Box::new(|q| q.codes[0].first[0] = u64::MAX)),
            ("codes: a stride past u64", Box::new(|q| q.codes[0].dst_strides[0] = u64::MAX / 2 + 1)),
            ("codes: the scratch base past u64", Box::new(|q| q.codes[0].base = u64::MAX)),
            ("codes: a grid stride the kernel does not use", Box::new(|q| q.codes[0].grid_strides[0] = 0)),
            ("outs: counts past u64", Box::new(|q| q.outs[0].copy.counts = [2, u64::MAX, 1])),
            ("outs: a base past u64", Box::new(|q| q.outs[0].copy.dst_base = u64::MAX)),
        ];
        for (what, change) in bad {
            let mut q = good.clone();
            change(&mut q);
            assert!(q.fits(&lens, &dtypes).is_err(), "{what}");
        }
    }

    #[test]
    fn an_empty_staged_box_has_no_launch() {
        let p = program();
        let good = QuantPlan::new(&p).unwrap().unwrap();
        for empty in [Block::new(&[2, 0], &[1, 0]), Block::new(&[0, 0], &[0, 0])] {
            let mut q = p.clone();
            q.quantize[0].staged.push(Stored { block: empty, buffer: 0, at: 15 });
            assert_eq!(QuantPlan::new(&q).unwrap().unwrap(), good, "{empty}");
            // Still checked against its buffer.
            q.quantize[0].staged.last_mut().unwrap().at = 17;
            assert!(QuantPlan::new(&q).is_err(), "{empty} past the buffer");
        }
    }
}
