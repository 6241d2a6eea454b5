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
//! The arithmetic is [`reshard::quant`]'s, bit for bit (`kernels.cu`
//! compiles the same functions as C on the host, where the tests compare
//! them with it); [`QuantPlan::replay`] runs the launches on host memory as
//! the kernels run them, which the tests compare with the host quantizer.
//! Every launch is checked against the rank's buffer sizes when the plan is
//! made, like [`reshard::quant::quantize`] checks a program from the wire.
//! Tensors of more than three dimensions are left to the host.

use crate::cuda::kernels::CastBox;
use reshard::quant::{block_scale, elements_of, grid_of, quantize_value, QuantError, Quantize, Stored};
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
}

impl std::fmt::Display for HostOnly {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostOnly::Dimensions { tensor, ndim } => {
                write!(f, "tensor '{tensor}' has {ndim} dimensions; the device quantizes up to 3")
            }
            HostOnly::Block { tensor } => write!(f, "tensor '{tensor}': blocks too large for the device quantizer"),
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
/// first.
fn row_major(extent: &[u64]) -> [u64; 3] {
    let e = inner3(extent, 1);
    [1, e[0], e[0] * e[1]]
}

/// Element offset of global index `idx` in box `b` stored row-major from
/// `at`.
fn offset_of(b: &Block, at: u64, idx: &[u64]) -> u64 {
    reshard::quant::offset_in(b, at, idx)
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
            plan.add(op, &program.buffers)?;
        }
        Ok(Ok(plan))
    }

    /// Whether there is nothing to quantize.
    pub fn is_empty(&self) -> bool {
        self.scales.is_empty()
    }

    fn add(&mut self, op: &Quantize, buffers: &[BufferSpec]) -> Result<(), QuantError> {
        let oob = |what| QuantError::OutOfBounds { tensor: op.tensor.clone(), what };
        let nd = op.shape.len();
        if op.block.len() != nd || op.block.contains(&0) {
            return Err(oob("block"));
        }
        let grid_shape: Vec<u64> = op.shape.iter().zip(&op.block).map(|(&n, &b)| n.div_ceil(b)).collect();
        let inside = |b: &Block, shape: &[u64]| b.ndim() == nd && (0..nd).all(|d| b.end(d) <= shape[d]);
        // A region of `numel` elements of `dtype` from element `at` of
        // buffer `buffer`, inside it.
        let fits = |st: &Stored, dtype: DType, what| -> Result<(), QuantError> {
            let spec = buffers.get(st.buffer as usize).ok_or_else(|| oob(what))?;
            let end = st.at.checked_add(st.block.numel()).ok_or_else(|| oob(what))?;
            if spec.dtype != dtype || end > spec.elems {
                return Err(oob(what));
            }
            Ok(())
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
        for (list, dtype, shape, what) in
            [(&op.weights, DType::F8E4M3, &op.shape, "weight"), (&op.scales, DType::F32, &grid_shape, "scale")]
        {
            for st in list.iter() {
                fits(st, dtype, what)?;
                if !inside(&st.block, shape) || op.staged.iter().any(|s| s.buffer == st.buffer) {
                    return Err(oob(what));
                }
                regions.push((st.buffer, st.at, st.at + st.block.numel()));
            }
        }
        regions.sort_unstable();
        if regions.windows(2).any(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2) {
            return Err(oob("overlapping"));
        }
        let block = inner3(&op.block, 1);
        for st in &op.staged {
            let g = grid_of(&st.block, &op.block);
            let base = self.scratch;
            let grid = inner3(g.extent(), 1);
            let grid_strides = [1, grid[0], grid[0] * grid[1]];
            self.scratch += g.numel();
            self.scales.push(ScalesLaunch {
                staged: st.buffer,
                dt,
                grid,
                grid_off: inner3(g.offset(), 0),
                block,
                shape: inner3(&op.shape, 1),
                first: inner3(st.block.offset(), 0),
                at: st.at,
                strides: row_major(st.block.extent()),
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
                    src_strides: row_major(st.block.extent()),
                    dst_base: offset_of(&w.block, w.at, part.offset()),
                    dst_strides: row_major(w.block.extent()),
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
                        dst_strides: row_major(sc.block.extent()),
                    },
                });
            }
        }
        Ok(())
    }

    /// Checks that every launch stays inside buffers of `lens` bytes and
    /// `dtypes` (the rank's device buffers, in program order) and inside
    /// the scratch array: the gate before any kernel runs.
    pub fn fits(&self, lens: &[usize], dtypes: &[DType]) -> Result<(), String> {
        let elems = |b: u32, dtype: DType, what: &str| -> Result<u64, String> {
            match (lens.get(b as usize), dtypes.get(b as usize)) {
                (Some(&len), Some(&d)) if d == dtype => Ok(len as u64 / dtype.size()),
                _ => Err(format!("{what} buffer {b} is not {dtype} here")),
            }
        };
        // One past the last element of a box of `counts` at `base`.
        let end = |counts: [u64; 3], base: u64, strides: [u64; 3]| -> u64 {
            if counts.contains(&0) {
                return base;
            }
            base + (0..3).map(|d| (counts[d] - 1) * strides[d]).sum::<u64>() + 1
        };
        let out = |what: &str| Err(format!("a {what} launch reaches past its buffer"));
        for l in &self.scales {
            let dtype = [DType::F32, DType::BF16, DType::F16].get(l.dt as usize).copied().ok_or("bad staged dtype")?;
            let n = elems(l.staged, dtype, "staged")?;
            if l.block[0].checked_mul(l.block[1]).is_none_or(|rows| rows >> 32 != 0) {
                return out("scales");
            }
            let mut ext = [0u64; 3];
            for (d, e) in ext.iter_mut().enumerate() {
                let start = l.grid_off[d] * l.block[d];
                let stop = ((l.grid_off[d] + l.grid[d]) * l.block[d]).min(l.shape[d]);
                if start < l.first[d] || stop < start || l.block[d] == 0 {
                    return out("scales");
                }
                *e = stop - l.first[d];
            }
            if end(ext, l.at, l.strides) > n || l.base + l.grid.iter().product::<u64>() > self.scratch {
                return out("scales");
            }
        }
        for l in &self.codes {
            let dtype = [DType::F32, DType::BF16, DType::F16].get(l.dt as usize).copied().ok_or("bad staged dtype")?;
            let (n, w) = (elems(l.staged, dtype, "staged")?, elems(l.weights, DType::F8E4M3, "weight")?);
            if l.counts.contains(&0) {
                continue;
            }
            let mut cell = l.base;
            for d in 0..3 {
                let b = l.block[d];
                if b == 0 {
                    return out("codes");
                }
                let (lo, hi) = (l.first[d] / b, (l.first[d] + l.counts[d] - 1) / b);
                if lo < l.grid_off[d] {
                    return out("codes");
                }
                cell += (hi - l.grid_off[d]) * l.grid_strides[d];
            }
            if end(l.counts, l.src_base, l.src_strides) > n || end(l.counts, l.dst_base, l.dst_strides) > w || cell >= self.scratch {
                return out("codes");
            }
        }
        for o in &self.outs {
            let n = elems(o.scales, DType::F32, "scale")?;
            let (src, dst) = o.copy.ends();
            if src > self.scratch || dst > n {
                return out("scale");
            }
        }
        Ok(())
    }

    /// Runs the launches on host buffers (the program's, in order) as the
    /// kernels run them. Returns the scratch index of the first block
    /// holding NaN or infinity, if any (its codes are then unspecified, as
    /// on the device).
    pub fn replay(&self, buffers: &mut [Vec<u8>]) -> Result<(), u64> {
        let mut scratch = vec![0f32; self.scratch as usize];
        let mut bad: Option<u64> = None;
        let load = |buf: &[u8], dt: u64, i: u64| -> f32 {
            let dtype = [DType::F32, DType::BF16, DType::F16][dt as usize];
            reshard::quant::read_f32(dtype, buf, i as usize)
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
