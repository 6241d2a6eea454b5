//! Block-scaled FP8 destinations ([`reshard::quantize`]): bf16/f32/f64 sources
//! refit into `f8e4m3` tensors with their scale tensors, bit-exact against
//! a reference written here from the semantics alone (global tensor, block
//! by block), over in-process channels and TCP, with uneven dimensions and
//! shard boundaries on both sides cutting through blocks; NaN or infinity
//! in a source block fails the refit and names the tensor.

use reshard::e4m3_from_f32;
use reshard::{parse_layout, plan_baseline, plan_reshard, DType, Layout, Plan, PlanOptions, QuantizeAt, RankProgram, Route};
use std::time::Duration;
use transport::{
    fill_sources, pattern_value, run_local, run_tcp, tensor_seed, verify_destinations, ExecError, ExecOptions, RankMemory, TcpConfig,
};

/// The reference: tensor `name` of `shape` (source dtype `from`, the
/// pattern's values) quantized in blocks of `block`: every element's code
/// and every block's scale, both row-major over the whole tensor.
fn reference(name: &str, from: DType, shape: &[u64], block: &[u64]) -> (Vec<u8>, Vec<f32>) {
    let n: u64 = shape.iter().product();
    let mut raw = vec![0u8; from.size() as usize];
    let values: Vec<f32> = (0..n)
        .map(|i| {
            pattern_value(tensor_seed(name), i, from, &mut raw);
            match from {
                DType::BF16 => f32::from_bits((u16::from_le_bytes([raw[0], raw[1]]) as u32) << 16),
                DType::F32 => f32::from_le_bytes(raw[..4].try_into().unwrap()),
                DType::F64 => f64::from_le_bytes(raw[..8].try_into().unwrap()) as f32,
                _ => unreachable!("test sources are bf16, f32 or f64"),
            }
        })
        .collect();
    let grid: Vec<u64> = shape.iter().zip(block).map(|(&s, &b)| s.div_ceil(b)).collect();
    // Block (grid index, row-major) of each element.
    let block_of = |mut i: u64| -> u64 {
        let mut idx = vec![0u64; shape.len()];
        for d in (0..shape.len()).rev() {
            idx[d] = i % shape[d];
            i /= shape[d];
        }
        (0..shape.len()).fold(0, |acc, d| acc * grid[d] + idx[d] / block[d])
    };
    let blocks: u64 = grid.iter().product();
    let mut amax = vec![0f32; blocks as usize];
    for (i, v) in values.iter().enumerate() {
        let b = block_of(i as u64) as usize;
        amax[b] = amax[b].max(v.abs());
    }
    let scales: Vec<f32> = amax.iter().map(|&a| if a == 0.0 { 1.0 } else { a / 448.0 }).collect();
    let codes = values.iter().enumerate().map(|(i, &v)| e4m3_from_f32(v / scales[block_of(i as u64) as usize])).collect();
    (codes, scales)
}

/// Row-major flat index of element `k` of a box in a tensor of `shape`.
fn flat_of(offset: &[u64], extent: &[u64], shape: &[u64], mut k: u64) -> u64 {
    let mut idx = vec![0u64; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = offset[d] + k % extent[d];
        k /= extent[d];
    }
    (0..shape.len()).fold(0, |acc, d| acc * shape[d] + idx[d])
}

/// Every destination element of every block-scaled tensor and scale
/// tensor equals the reference; returns how many were compared.
fn compare_with_reference(src: &Layout, dst: &Layout, memory: &[RankMemory]) -> u64 {
    let mut compared = 0;
    for (t, tensor) in dst.tensors().iter().enumerate() {
        let Some((s, block)) = dst.scale_of(t as u32) else { continue };
        let from = src.tensors()[src.tensor_index(&tensor.name).unwrap() as usize].dtype;
        let (codes, scales) = reference(&tensor.name, from, &tensor.shape, block);
        let scale_shape = &dst.tensors()[s as usize].shape;
        for rank in 0..dst.ranks() {
            let buffers = dst.rank_buffers(rank);
            let buf = |key| &memory[rank as usize].buffers[buffers.iter().position(|b| b.key == key).unwrap()];
            for (b, loc) in dst.rank_holdings(t as u32, rank) {
                for k in 0..b.numel() {
                    let want = codes[flat_of(b.offset(), b.extent(), &tensor.shape, k) as usize];
                    let got = buf(loc.buffer)[(loc.at + k) as usize];
                    assert_eq!(got, want, "'{}' rank {rank} element {k} of {b}", tensor.name);
                    compared += 1;
                }
            }
            for (b, loc) in dst.rank_holdings(s, rank) {
                for k in 0..b.numel() {
                    let want = scales[flat_of(b.offset(), b.extent(), scale_shape, k) as usize];
                    let at = ((loc.at + k) * 4) as usize;
                    let got = f32::from_le_bytes(buf(loc.buffer)[at..at + 4].try_into().unwrap());
                    assert_eq!(got.to_bits(), want.to_bits(), "scale of '{}' rank {rank} element {k} of {b}", tensor.name);
                    compared += 1;
                }
            }
        }
    }
    compared
}

/// How a case runs.
#[derive(Clone, Copy, Debug)]
enum Run {
    Reshard,
    Baseline,
    ReshardTcp,
}

/// Refits `src` into `dst` as `run` says, with destinations starting from
/// garbage; checks every destination element against the reference and
/// the verification pattern. Returns the plan.
fn check(src: &str, dst: &str, run: Run, options: &PlanOptions) -> Plan {
    let (src, dst) = (parse_layout(src).unwrap(), parse_layout(dst).unwrap());
    let plan = match run {
        Run::Baseline => plan_baseline(&src, &dst, options),
        _ => plan_reshard(&src, &dst, options),
    }
    .unwrap();
    let programs = plan.programs(&src, &dst).unwrap();
    let mut memory = RankMemory::for_programs(&programs);
    let n_src = src.ranks() as usize;
    fill_sources(&src, &mut memory[..n_src]);
    for m in &mut memory[n_src..] {
        for b in &mut m.buffers {
            b.fill(0xee);
        }
    }
    let exec = ExecOptions { deadline: Duration::from_secs(30) };
    let report = match run {
        Run::ReshardTcp => run_tcp(&programs, &mut memory, &exec, &TcpConfig::default()),
        _ => run_local(&programs, &mut memory, &exec),
    }
    .unwrap();
    assert_eq!(report.bytes, plan.figures().total_bytes, "{run:?}: bytes moved as planned");
    let compared = compare_with_reference(&src, &dst, &memory[n_src..]);
    assert!(compared > 0);
    let checked = verify_destinations(&src, &dst, &memory[n_src..]).unwrap();
    assert!(checked >= compared, "{run:?}: the pattern checks every element ({checked} < {compared})");
    plan
}

/// The layouts, their reshard plan and its programs.
fn planned(src: &str, dst: &str, options: &PlanOptions) -> (Layout, Layout, Plan, Vec<RankProgram>) {
    let (src, dst) = (parse_layout(src).unwrap(), parse_layout(dst).unwrap());
    let plan = plan_reshard(&src, &dst, options).unwrap();
    let programs = plan.programs(&src, &dst).unwrap();
    (src, dst, plan, programs)
}

/// bf16 TP4 by rows: row shards of 75 cut the 128-row blocks.
const SRC: &str = r#"{"ranks": 4, "tensors": [
  {"name": "w", "dtype": "bf16", "shape": [300, 200], "mesh": {"shape": [4]}, "placements": ["shard(0)"]},
  {"name": "v", "dtype": "f32", "shape": [130], "mesh": {"shape": [4]}, "placements": ["replicate"]},
  {"name": "q", "dtype": "f64", "shape": [5, 33, 40], "mesh": {"shape": [4]}, "placements": ["shard(1)"]},
  {"name": "k", "dtype": "bf16", "shape": [20, 40], "mesh": {"shape": [4]}, "placements": ["shard(0)"]},
  {"name": "b", "dtype": "bf16", "shape": [200], "mesh": {"shape": [4]}, "placements": ["shard(0)"]}]}"#;

/// TP2 by columns (100 each: the first block of columns is cut), scales
/// sharded with their weights; `v` split 65/65 with its scale (2 blocks of
/// 128 and 2) split too; `q` and `k` fused in one FP8 buffer; `b` plain.
const DST_TP: &str = r#"{"ranks": 2, "tensors": [
  {"name": "w", "dtype": "f8e4m3", "shape": [300, 200], "mesh": {"shape": [2]}, "placements": ["shard(1)"],
   "scale": {"tensor": "w_scale_inv", "block": [128, 128]}},
  {"name": "w_scale_inv", "dtype": "f32", "shape": [3, 2], "mesh": {"shape": [2]}, "placements": ["shard(1)"]},
  {"name": "v", "dtype": "f8e4m3", "shape": [130], "mesh": {"shape": [2]}, "placements": ["shard(0)"],
   "scale": {"tensor": "v_scale", "block": [128]}},
  {"name": "v_scale", "dtype": "f32", "shape": [2], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
  {"name": "q", "dtype": "f8e4m3", "shape": [5, 33, 40], "mesh": {"shape": [2]}, "placements": ["shard(2)"],
   "buffer": "qk", "at": 0, "scale": {"tensor": "q_scale", "block": [2, 16, 32]}},
  {"name": "k", "dtype": "f8e4m3", "shape": [20, 40], "mesh": {"shape": [2]}, "placements": ["shard(1)"],
   "buffer": "qk", "at": 3300, "scale": {"tensor": "k_scale", "block": [7, 7]}},
  {"name": "q_scale", "dtype": "f32", "shape": [3, 3, 2], "mesh": {"shape": [2]}, "placements": ["replicate"]},
  {"name": "k_scale", "dtype": "f32", "shape": [3, 6], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
  {"name": "b", "dtype": "bf16", "shape": [200], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"#;

/// DP2 x TP2 on two nodes: rows 150 each (blocks of rows cut at 128),
/// the scale replicated on every rank (so every rank needs every block).
const DST_DP: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "f8e4m3", "shape": [300, 200], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"],
   "scale": {"tensor": "w_scale_inv", "block": [128, 128]}},
  {"name": "w_scale_inv", "dtype": "f32", "shape": [3, 2], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "replicate"]},
  {"name": "v", "dtype": "f8e4m3", "shape": [130], "mesh": {"shape": [2, 2]}, "placements": ["shard(0)", "replicate"],
   "scale": {"tensor": "v_scale", "block": [64]}},
  {"name": "v_scale", "dtype": "f32", "shape": [3], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]}]}"#;

#[test]
fn block_scaled_destinations_match_the_reference_in_every_case() {
    for (dst, run) in [
        (DST_TP, Run::Reshard),
        (DST_TP, Run::Baseline),
        (DST_TP, Run::ReshardTcp),
        (DST_DP, Run::Reshard),
        (DST_DP, Run::Baseline),
        (DST_DP, Run::ReshardTcp),
    ] {
        check(SRC, dst, run, &PlanOptions::default());
    }
}

/// The source of [`SRC`]'s tensors cut at block boundaries (each tensor's
/// blocks are those of both destinations), with replicas and two boxes of
/// one tensor on one rank in one buffer: every block-scaled tensor is
/// quantized by the source ranks that send it.
const SRC_ALIGNED: &str = r#"{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "bf16", "shape": [300, 200], "shards": [
    {"rank": 0, "offset": [0, 0], "extent": [128, 200]},
    {"rank": 1, "offset": [128, 0], "extent": [128, 200]},
    {"rank": 2, "offset": [256, 0], "extent": [44, 200]},
    {"rank": 3, "offset": [0, 0], "extent": [128, 200], "buffer": "w3", "at": 0},
    {"rank": 3, "offset": [256, 0], "extent": [44, 200], "buffer": "w3", "at": 25600}]},
  {"name": "v", "dtype": "f32", "shape": [130], "mesh": {"shape": [4]}, "placements": ["replicate"]},
  {"name": "q", "dtype": "f64", "shape": [5, 33, 40], "shards": [
    {"rank": 0, "offset": [0, 0, 0], "extent": [2, 33, 40]},
    {"rank": 1, "offset": [2, 0, 0], "extent": [2, 33, 40]},
    {"rank": 2, "offset": [4, 0, 0], "extent": [1, 33, 40]},
    {"rank": 3, "offset": [0, 0, 0], "extent": [5, 33, 40]}]},
  {"name": "k", "dtype": "bf16", "shape": [20, 40], "shards": [
    {"rank": 0, "offset": [0, 0], "extent": [14, 40]},
    {"rank": 1, "offset": [14, 0], "extent": [6, 40]},
    {"rank": 2, "offset": [0, 0], "extent": [7, 40]},
    {"rank": 3, "offset": [7, 0], "extent": [13, 40]}]},
  {"name": "b", "dtype": "bf16", "shape": [200], "mesh": {"shape": [4]}, "placements": ["shard(0)"]}]}"#;

/// Where every source holds whole blocks, the reshard quantizes at the
/// source: destinations get the reference's codes and scales bit for bit
/// on every transport, as when quantizing at the destination (asked for,
/// and what the baseline always does).
#[test]
fn sources_holding_whole_blocks_quantize_and_match_the_reference() {
    let at_destination = PlanOptions { quantize_at: QuantizeAt::Destination, ..PlanOptions::default() };
    for dst in [DST_TP, DST_DP] {
        for run in [Run::Reshard, Run::ReshardTcp] {
            let plan = check(SRC_ALIGNED, dst, run, &PlanOptions::default());
            let again = check(SRC_ALIGNED, dst, run, &at_destination);
            let dst = parse_layout(dst).unwrap();
            for (t, tensor) in dst.tensors().iter().enumerate() {
                let want = match (dst.scale_of(t as u32), dst.scale_for(t as u32)) {
                    (Some(_), _) => Route::QuantizedAtSource,
                    (_, Some(_)) => Route::ScalesFromSource,
                    _ => Route::Plain,
                };
                assert_eq!(plan.route(t as u32), want, "{}", tensor.name);
            }
            assert!((0..dst.tensors().len() as u32).all(|t| again.route(t) != Route::QuantizedAtSource));
        }
        let plan = check(SRC_ALIGNED, dst, Run::Baseline, &PlanOptions::default());
        let dst = parse_layout(dst).unwrap();
        assert!((0..dst.tensors().len() as u32).all(|t| plan.route(t) != Route::QuantizedAtSource));
    }
    // The unaligned source of the other cases keeps `w`, `q` and `k` at
    // the destination; `v` (replicated whole) goes as codes.
    let plan = check(SRC, DST_TP, Run::Reshard, &PlanOptions::default());
    let dst = parse_layout(DST_TP).unwrap();
    let route = |name: &str| plan.route(dst.tensor_index(name).unwrap());
    assert_eq!(
        [route("w"), route("q"), route("k"), route("v"), route("v_scale")],
        [
            Route::QuantizedAtDestination,
            Route::QuantizedAtDestination,
            Route::QuantizedAtDestination,
            Route::QuantizedAtSource,
            Route::ScalesFromSource
        ]
    );
}

/// Quantized at the source, `w` costs a byte per element it delivers plus
/// its scales: no whole blocks, no source dtype.
#[test]
fn codes_and_scales_are_all_the_wire_carries_from_sources_that_quantize() {
    let one = |dst: &str, quantize_at| {
        let only = reshard::TensorSubset::new(["w"]);
        let (_, _, plan, _) = planned(SRC_ALIGNED, dst, &PlanOptions { only: Some(only), quantize_at, ..PlanOptions::default() });
        plan.figures().total_bytes
    };
    // TP2 by columns: each rank its 100 columns and its column of scales.
    assert_eq!(one(DST_TP, QuantizeAt::Source), 300 * 200 + 6 * 4);
    assert_eq!(one(DST_TP, QuantizeAt::Destination), 300 * (128 + 200) * 2);
    // DP2 x TP2 on two nodes: each node's rows 0..150 and 150..300 once
    // from the sources, then to its other rank; every rank all 6 scales,
    // once per node and then inside it.
    assert_eq!(one(DST_DP, QuantizeAt::Source), 2 * 300 * 200 + 4 * 6 * 4);
}

/// What the plan moves for `w`: whole blocks of bf16, so at least the
/// tensor's bf16 bytes, and more where destination shards cut blocks.
#[test]
fn the_wire_carries_unquantized_whole_blocks() {
    let one = |dst: &str| {
        let only = reshard::TensorSubset::new(["w"]);
        let (_, _, plan, _) = planned(SRC, dst, &PlanOptions { only: Some(only), ..PlanOptions::default() });
        plan.figures().total_bytes
    };
    // TP2 by columns: rank 0 needs columns 0..128, rank 1 all 200.
    assert_eq!(one(DST_TP), 300 * (128 + 200) * 2);
    // Two replicas of rows 0..256 and 128..300 (the scale, replicated,
    // asks every rank for all of it): each of 4 ranks receives the whole
    // tensor, once per node from the sources, then inside the node.
    let plain = 300 * 200 * 2;
    assert_eq!(one(DST_DP), 4 * plain);
}

/// NaN or infinity anywhere in a block fails the refit with an error that
/// names the tensor and the block; so does a value beyond f32's range in
/// an f64 source.
#[test]
fn non_finite_source_values_fail_the_refit_and_name_the_tensor() {
    let (src, _, _, programs) = planned(SRC, DST_TP, &PlanOptions::default());
    let n_src = src.ranks() as usize;
    // Writes `value` over element `at_elem` of `tensor` on source ranks `ranks`.
    let bad = |tensor: &str, value: &[u8], at_elem: usize, ranks: &[u32]| {
        let mut memory = RankMemory::for_programs(&programs);
        fill_sources(&src, &mut memory[..n_src]);
        let t = src.tensor_index(tensor).unwrap();
        for &r in ranks {
            let buffers = src.rank_buffers(r);
            let (_, loc) = src.rank_holdings(t, r)[0];
            let i = buffers.iter().position(|b| b.key == loc.buffer).unwrap();
            let size = value.len();
            memory[r as usize].buffers[i][at_elem * size..(at_elem + 1) * size].copy_from_slice(value);
        }
        let err = run_local(&programs, &mut memory, &ExecOptions { deadline: Duration::from_secs(30) }).unwrap_err();
        assert!(matches!(err, ExecError::Quantize { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains(&format!("tensor '{tensor}'")) && text.contains("NaN or infinity"), "{text}");
        text
    };
    // Row 75 + 0 (source rank 1's first row) is in block row 0.
    // Source rank 1 holds rows 75..150: (75, 3) is in block [0, 0].
    let text = bad("w", &0x7fc0u16.to_le_bytes(), 3, &[1]);
    assert!(text.contains("block [0, 0]"), "{text}");
    // -inf at (135, 150): block [1, 1].
    let text = bad("w", &0xff80u16.to_le_bytes(), 200 * 60 + 150, &[1]);
    assert!(text.contains("block [1, 1]"), "{text}");
    bad("q", &1e300f64.to_le_bytes(), 0, &[1]);
    // Replicated: whichever source sends it.
    bad("v", &f32::INFINITY.to_le_bytes(), 129, &[0, 1, 2, 3]);
}

/// A delta refit into block-scaled destinations quantizes what it rebuilt:
/// after the sources change, the destinations equal a dense refit's.
#[test]
fn a_delta_refit_into_fp8_matches_a_dense_one() {
    let (src, dst, plan, programs) = planned(SRC, DST_DP, &PlanOptions::default());
    let n_src = src.ranks() as usize;
    let exec = ExecOptions { deadline: Duration::from_secs(30) };
    let mut memory = RankMemory::for_programs(&programs);
    fill_sources(&src, &mut memory[..n_src]);
    let (_, memos) = transport::run_local_delta(&programs, &mut memory, &exec, vec![None; programs.len()]).unwrap();
    verify_destinations(&src, &dst, &memory[n_src..]).unwrap();
    // Change one source element in forty (a bf16/f32 mantissa bit), in the
    // layout's buffers (not those the plan quantizes into).
    for (r, m) in memory[..n_src].iter_mut().enumerate() {
        let held = src.rank_buffers(r as u32).len();
        for (b, dtype) in m.buffers.iter_mut().zip(&m.dtypes).take(held) {
            let size = dtype.size() as usize;
            for e in b.chunks_exact_mut(size).step_by(40) {
                e[size - 2] ^= 0x10;
            }
        }
    }
    let bases = memos.into_iter().map(Some).collect();
    let (report, _) = transport::run_local_delta(&programs, &mut memory, &exec, bases).unwrap();
    assert!(report.bytes < plan.figures().total_bytes / 2, "{} of {}", report.bytes, plan.figures().total_bytes);
    let after_delta: Vec<Vec<Vec<u8>>> = memory[n_src..].iter().map(|m| m.buffers.clone()).collect();
    run_local(&programs, &mut memory, &exec).unwrap();
    let dense: Vec<Vec<Vec<u8>>> = memory[n_src..].iter().map(|m| m.buffers.clone()).collect();
    assert_eq!(after_delta, dense);
}

/// The device quantizer's launches (`transport::cuda::quantplan`, replayed
/// on the host as the kernels run them) give every destination byte the
/// host quantizer gives, in every layout above (1-D, 2-D and 3-D tensors,
/// blocks cut by shards on both sides, fused FP8 buffers, bf16, f32 and
/// f64 sources, reshard and baseline); a NaN is found in the same block.
#[test]
fn the_device_quantizer_plan_matches_the_host_quantizer() {
    use transport::cuda::QuantPlan;
    let (mut launches, mut on_sources, mut host_only) = (0, 0, 0);
    for (src, dst) in [(SRC, DST_TP), (SRC, DST_DP), (SRC_ALIGNED, DST_TP), (SRC_ALIGNED, DST_DP)] {
        for strategy in [plan_reshard, plan_baseline] {
            let (src, dst) = (parse_layout(src).unwrap(), parse_layout(dst).unwrap());
            let plan = strategy(&src, &dst, &PlanOptions::default()).unwrap();
            let programs = plan.programs(&src, &dst).unwrap();
            // The values as they land: every program run without its
            // quantize steps.
            let bare: Vec<RankProgram> = programs
                .iter()
                .cloned()
                .map(|mut p| {
                    p.quantize.clear();
                    p
                })
                .collect();
            let mut memory = RankMemory::for_programs(&bare);
            let n_src = src.ranks() as usize;
            fill_sources(&src, &mut memory[..n_src]);
            for m in &mut memory[n_src..] {
                for b in &mut m.buffers {
                    b.fill(0xee);
                }
            }
            run_local(&bare, &mut memory, &ExecOptions { deadline: Duration::from_secs(30) }).unwrap();
            // Sources quantize before sending (what they hold is there
            // from the start), destinations after receiving.
            for (program, landed) in programs.iter().zip(&memory).filter(|(p, _)| !p.quantize.is_empty()) {
                if program.quantizes_first() {
                    on_sources += 1;
                }
                let qp = match QuantPlan::new(program).unwrap() {
                    Ok(qp) => qp,
                    Err(why) => {
                        // f64 values quantized where they are: the host's.
                        assert!(why.to_string().contains("does not read f64"), "{why}");
                        host_only += 1;
                        continue;
                    }
                };
                assert_eq!(qp.is_empty(), program.quantize.is_empty());
                // Every launch fits the rank's buffers, and not one byte
                // less where a step's region reaches a buffer's end (a
                // source quantizes only the boxes it sends from, which
                // may end before its buffer does).
                let lens: Vec<usize> = landed.buffers.iter().map(Vec::len).collect();
                qp.fits(&lens, &landed.dtypes).unwrap();
                let reach = |b: usize| {
                    let ends = |list: &[reshard::Stored], size: u64| {
                        list.iter().filter(|s| s.buffer as usize == b).map(|s| (s.at + s.block.numel()) * size).max().unwrap_or(0)
                    };
                    let size = landed.dtypes[b].size();
                    program.quantize.iter().map(|op| ends(&op.weights, size).max(ends(&op.scales, size)).max(ends(&op.staged, size))).max()
                };
                for b in 0..lens.len() {
                    if lens[b] > 0 && reach(b) == Some(lens[b] as u64) {
                        let mut short = lens.clone();
                        short[b] -= 1;
                        assert!(qp.fits(&short, &landed.dtypes).is_err(), "{}: buffer {b} one byte short", program.endpoint);
                    }
                }
                launches += qp.scales.len() + qp.codes.len() + qp.outs.len();
                let mut host = landed.clone();
                transport::quantize_rank(program, &mut host).unwrap();
                let mut device = landed.clone();
                qp.replay(&mut device.buffers).unwrap();
                assert!(host.buffers == device.buffers, "{}: the device plan's bytes differ from the host quantizer's", program.endpoint);
                // A NaN in the first staged box's first element: both find it.
                if let Some(op) = program.quantize.first() {
                    let st = &op.staged[0];
                    let size = op.staged_dtype.size() as usize;
                    let mut bad = landed.clone();
                    let nan: Vec<u8> = match size {
                        2 => 0x7fc0u16.to_le_bytes().to_vec(),
                        _ => f32::NAN.to_le_bytes().to_vec(),
                    };
                    bad.buffers[st.buffer as usize][st.at as usize * size..][..size].copy_from_slice(&nan);
                    let mut host = bad.clone();
                    assert!(transport::quantize_rank(program, &mut host).is_err());
                    assert!(qp.replay(&mut bad.buffers).is_err());
                }
            }
        }
    }
    assert!(launches > 40, "{launches} launches");
    assert!(on_sources > 0 && host_only > 0, "{on_sources} source ranks quantized, {host_only} on the host only");
}

/// A source rank quantizes only the boxes it sends codes or scales from:
/// each of its quantize steps' boxes feeds one of its sends, and with
/// replicas (`w` and `q` held twice) the sources quantize fewer elements
/// than they hold.
#[test]
fn sources_quantize_only_the_boxes_they_send_from() {
    for dst in [DST_TP, DST_DP] {
        let (src, _, _, programs) = planned(SRC_ALIGNED, dst, &PlanOptions::default());
        let (mut quantized, mut held) = (0u64, 0u64);
        for p in programs.iter().filter(|p| p.quantizes_first()) {
            let sent: Vec<(reshard::Block, u32)> =
                p.rounds.iter().flat_map(|r| &r.sends).flat_map(|m| m.pieces.views().map(|v| (v.block(), v.span().buffer))).collect();
            for op in &p.quantize {
                let t = src.tensor_index(&op.tensor).unwrap();
                held += src.rank_holdings(t, p.endpoint.rank).iter().map(|(b, _)| b.numel()).sum::<u64>();
                for (w, s) in op.weights.iter().zip(&op.scales) {
                    quantized += w.block.numel();
                    let feeds =
                        sent.iter().any(|(b, buf)| (*buf == w.buffer && w.block.contains(b)) || (*buf == s.buffer && s.block.contains(b)));
                    assert!(feeds, "{}: quantizes {} of '{}' and sends none of it", p.endpoint, w.block, op.tensor);
                }
            }
        }
        assert!(quantized > 0 && quantized < held, "quantized {quantized} of {held} held elements");
    }
}
