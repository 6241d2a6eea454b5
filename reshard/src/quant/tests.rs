//! Tests of block-scaled FP8 quantization.

use super::*;

/// Every code that is a number decodes and encodes back to itself.
#[test]
fn every_code_round_trips() {
    for code in 0..=255u8 {
        let v = e4m3_to_f32(code);
        if v.is_nan() {
            continue;
        }
        assert_eq!(e4m3_from_f32(v), code, "code {code:#04x} = {v}");
    }
}

/// Midpoints between neighbouring codes round to the even code;
/// anything just off a midpoint rounds to the nearer code.
#[test]
fn midpoints_round_to_even() {
    for code in 0..0x7eu8 {
        let (lo, hi) = (e4m3_to_f32(code) as f64, e4m3_to_f32(code + 1) as f64);
        let mid = ((lo + hi) / 2.0) as f32;
        assert_eq!(mid as f64, (lo + hi) / 2.0, "midpoint exact in f32");
        let even = if code % 2 == 0 { code } else { code + 1 };
        assert_eq!(e4m3_from_f32(mid), even, "midpoint of {code:#04x}");
        assert_eq!(e4m3_from_f32(-mid), even | 0x80);
        assert_eq!(e4m3_from_f32(f32::from_bits(mid.to_bits() - 1)), code);
        assert_eq!(e4m3_from_f32(f32::from_bits(mid.to_bits() + 1)), code + 1);
    }
}

/// A 3 x 5 f32 tensor in blocks of 2 x 2, staged as two boxes of whole
/// blocks; the rank holds a 2 x 3 window across both and all scales.
fn op() -> (Quantize, Vec<u8>) {
    let values: Vec<f32> = (0..15).map(|i| (i as f32 - 6.0) * 0.75).collect();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    // Rows 0..2 (10 values), then row 2 (5 values), back to back.
    let staged = vec![
        Stored { block: Block::new(&[0, 0], &[2, 5]), buffer: 0, at: 0 },
        Stored { block: Block::new(&[2, 0], &[1, 5]), buffer: 0, at: 10 },
    ];
    let op = Quantize {
        tensor: "w".into(),
        shape: vec![3, 5],
        block: vec![2, 2],
        staged_dtype: DType::F32,
        staged,
        weights: vec![Stored { block: Block::new(&[1, 1], &[2, 3]), buffer: 1, at: 0 }],
        scales: vec![Stored { block: Block::new(&[0, 0], &[2, 3]), buffer: 2, at: 0 }],
    };
    (op, bytes)
}

#[test]
fn quantizes_a_window_from_whole_blocks() {
    let (op, bytes) = op();
    let (mut w, mut s) = (vec![0u8; 6], vec![0u8; 24]);
    quantize(&op, &|b| (b == 0).then_some(bytes.as_slice()), &mut [&mut w[..]], &mut [&mut s[..]]).unwrap();
    let x = |r: usize, c: usize| (r as f32 * 5.0 + c as f32 - 6.0) * 0.75;
    let scale = |br: usize, bc: usize| {
        let mut m = 0f32;
        for r in 2 * br..(2 * br + 2).min(3) {
            for c in 2 * bc..(2 * bc + 2).min(5) {
                m = m.max(x(r, c).abs());
            }
        }
        m / 448.0
    };
    for (k, &q) in w.iter().enumerate() {
        let (r, c) = (1 + k / 3, 1 + k % 3);
        assert_eq!(q, e4m3_from_f32(x(r, c) / scale(r / 2, c / 2)), "({r}, {c})");
    }
    for (k, got) in s.chunks_exact(4).enumerate() {
        assert_eq!(f32::from_le_bytes(got.try_into().unwrap()), scale(k / 3, k % 3), "scale {k}");
    }
}

#[test]
fn a_malformed_step_is_an_error_not_a_panic() {
    let (good, bytes) = op();
    let staged = |b: u32| (b == 0).then_some(bytes.as_slice());
    type Change = Box<dyn Fn(&mut Quantize)>;
    let bad: Vec<(&str, Change)> = vec![
        ("zero block", Box::new(|o| o.block[1] = 0)),
        ("block of another rank", Box::new(|o| o.block = vec![2])),
        ("staged not whole blocks", Box::new(|o| o.staged[0].block = Block::new(&[0, 0], &[2, 3]))),
        ("staged past its buffer", Box::new(|o| o.staged[1].at = u64::MAX - 2)),
        ("weight outside the tensor", Box::new(|o| o.weights[0].block = Block::new(&[2, 3], &[2, 3]))),
        ("scale outside the grid", Box::new(|o| o.scales[0].block = Block::new(&[1, 1], &[2, 3]))),
        ("unknown staged buffer", Box::new(|o| o.staged[0].buffer = 9)),
    ];
    for (what, change) in bad {
        let mut o = good.clone();
        change(&mut o);
        let (mut w, mut s) = (vec![0u8; o.weights[0].block.numel() as usize], vec![0u8; o.scales[0].block.numel() as usize * 4]);
        let e = quantize(&o, &staged, &mut [&mut w[..]], &mut [&mut s[..]]).unwrap_err();
        assert!(matches!(e, QuantError::OutOfBounds { .. }), "{what}: {e}");
    }
}

/// Extents whose product wraps (3 * 0xAAAA_AAAA_AAAA_AAAB is 2^65 + 1,
/// 1 if it wrapped) are refused, never taken for a 1-element box.
#[test]
fn extents_that_multiply_past_u64_are_refused() {
    let huge = Block::new(&[0, 0], &[3, 0xAAAA_AAAA_AAAA_AAAB]);
    let bytes = vec![0u8; 64];
    let staged = |b: u32| (b == 0).then_some(bytes.as_slice());
    let op = |staged: Block, weight: Block, scale: Block| Quantize {
        tensor: "w".into(),
        shape: vec![3, 0xAAAA_AAAA_AAAA_AAAB],
        block: vec![1, 1],
        staged_dtype: DType::F32,
        staged: vec![Stored { block: staged, buffer: 0, at: 0 }],
        weights: vec![Stored { block: weight, buffer: 1, at: 0 }],
        scales: vec![Stored { block: scale, buffer: 2, at: 0 }],
    };
    let small = Block::new(&[0, 0], &[1, 1]);
    for (what, o) in [("staged", op(huge, small, small)), ("weight", op(small, huge, small)), ("scale", op(small, small, huge))] {
        // Outputs sized as a wrapped count would size them.
        let (mut w, mut s) = (vec![0u8; 1], vec![0u8; 4]);
        let e = quantize(&o, &staged, &mut [&mut w[..]], &mut [&mut s[..]]).unwrap_err();
        assert_eq!(e, QuantError::OutOfBounds { tensor: "w".into(), what }, "{what}");
    }
}

/// A staged box holding no element quantizes nothing (no panic), and
/// the rest of the step is quantized as without it.
#[test]
fn an_empty_staged_box_quantizes_nothing() {
    let (good, bytes) = op();
    let staged = |b: u32| (b == 0).then_some(bytes.as_slice());
    let (mut w0, mut s0) = (vec![0u8; 6], vec![0u8; 24]);
    quantize(&good, &staged, &mut [&mut w0[..]], &mut [&mut s0[..]]).unwrap();
    for empty in [Block::new(&[2, 0], &[1, 0]), Block::new(&[2, 4], &[0, 1]), Block::new(&[0, 0], &[0, 0])] {
        let mut o = good.clone();
        o.staged.push(Stored { block: empty, buffer: 0, at: 15 });
        let (mut w, mut s) = (vec![0u8; 6], vec![0u8; 24]);
        quantize(&o, &staged, &mut [&mut w[..]], &mut [&mut s[..]]).unwrap();
        assert_eq!((w, s), (w0.clone(), s0.clone()), "{empty}");
    }
    // Still checked against its buffer.
    let mut o = good.clone();
    o.staged.push(Stored { block: Block::new(&[2, 0], &[1, 0]), buffer: 0, at: 16 });
    let (mut w, mut s) = (vec![0u8; 6], vec![0u8; 24]);
    assert!(quantize(&o, &staged, &mut [&mut w[..]], &mut [&mut s[..]]).is_err());
}

#[test]
fn a_scalar_is_one_block() {
    let bytes = (-3.0f32).to_le_bytes();
    let at = |_| Stored { block: Block::new(&[], &[]), buffer: 0, at: 0 };
    let op = Quantize {
        tensor: "s".into(),
        shape: vec![],
        block: vec![],
        staged_dtype: DType::F32,
        staged: vec![at(0)],
        weights: vec![Stored { buffer: 1, ..at(1) }],
        scales: vec![Stored { buffer: 2, ..at(2) }],
    };
    let (mut w, mut s) = (vec![0u8; 1], vec![0u8; 4]);
    quantize(&op, &|b| (b == 0).then_some(&bytes[..]), &mut [&mut w[..]], &mut [&mut s[..]]).unwrap();
    assert_eq!((w[0], f32::from_le_bytes(s[..].try_into().unwrap())), (0xfe, 3.0 / 448.0));
}

#[test]
fn saturates_and_keeps_signs() {
    assert_eq!(e4m3_from_f32(448.0), 0x7e);
    assert_eq!(e4m3_from_f32(464.0), 0x7e, "the midpoint to 480 saturates");
    assert_eq!(e4m3_from_f32(1e30), 0x7e);
    assert_eq!(e4m3_from_f32(f32::INFINITY), 0x7e);
    assert_eq!(e4m3_from_f32(-1e30), 0xfe);
    assert_eq!(e4m3_from_f32(0.0), 0x00);
    assert_eq!(e4m3_from_f32(-0.0), 0x80);
    assert_eq!(e4m3_from_f32(-1e-30), 0x80, "a negative value rounding to zero keeps its sign");
    assert_eq!(e4m3_from_f32(2f32.powi(-10)), 0x00, "half the smallest subnormal ties to even zero");
    assert_eq!(e4m3_from_f32(2f32.powi(-10) * 1.0001), 0x01);
    assert_eq!(e4m3_from_f32(f32::NAN), 0x7f);
    assert_eq!(quantize_value(-0.0, 0.0), 0x80);
    assert_eq!(quantize_value(3.0, 0.0), 0x7e, "x / 0 is infinite and saturates");
    assert_eq!(block_scale(0.0), 1.0);
    assert_eq!(block_scale(448.0), 1.0);
}

/// Against an f64 reference over many values: the nearest code, ties
/// to even.
#[test]
fn matches_a_nearest_value_reference() {
    let codes: Vec<(f64, u8)> = (0..0x7fu8).map(|c| (e4m3_to_f32(c) as f64, c)).collect();
    let mut x = 0x1234_5678_9abc_def0u64;
    for _ in 0..200_000 {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let r = x.wrapping_mul(0x2545_f491_4f6c_dd1d);
        // Magnitudes from 2^-14 to 2^10, random mantissa.
        let v = f32::from_bits(((r as u32) & 0x807f_ffff) | ((((r >> 40) % 25) as u32 + 113) << 23));
        let a = (v as f64).abs().min(448.0);
        let mut best = (f64::INFINITY, 0u8);
        for &(val, c) in &codes {
            let d = (val - a).abs();
            if d < best.0 || (d == best.0 && c % 2 == 0) {
                best = (d, c);
            }
        }
        let want = best.1 | if v.is_sign_negative() { 0x80 } else { 0 };
        assert_eq!(e4m3_from_f32(v), want, "{v:e}");
    }
}
