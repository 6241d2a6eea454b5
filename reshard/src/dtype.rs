//! Element types and the conversions allowed between them.
//!
//! Floating-point types `f64`, `f32`, `bf16` and `f16` convert among
//! themselves with round-to-nearest-even; every other pair must match
//! exactly. Values travel in the narrower of the two types ([`wire_dtype`]).

use std::fmt;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum DType {
    /// IEEE 754 binary64.
    F64,
    /// IEEE 754 binary32.
    F32,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    BF16,
    /// IEEE 754 binary16.
    F16,
    /// 8-bit float, 4-bit exponent, 3-bit mantissa (copied bit for bit).
    F8E4M3,
    /// 8-bit float, 5-bit exponent, 2-bit mantissa (copied bit for bit).
    F8E5M2,
    /// 64-bit signed integer.
    I64,
    /// 32-bit signed integer.
    I32,
    /// 8-bit signed integer.
    I8,
    /// 8-bit unsigned integer.
    U8,
}

/// All element types, in the order the file format lists them.
pub const ALL_DTYPES: [DType; 10] =
    [DType::F64, DType::F32, DType::BF16, DType::F16, DType::F8E4M3, DType::F8E5M2, DType::I64, DType::I32, DType::I8, DType::U8];

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> u64 {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3 | DType::F8E5M2 | DType::I8 | DType::U8 => 1,
        }
    }

    /// Position in [`ALL_DTYPES`] (0 to 9): a small code for packed
    /// encodings (`ALL_DTYPES[d.index() as usize] == d`).
    pub const fn index(self) -> u8 {
        match self {
            DType::F64 => 0,
            DType::F32 => 1,
            DType::BF16 => 2,
            DType::F16 => 3,
            DType::F8E4M3 => 4,
            DType::F8E5M2 => 5,
            DType::I64 => 6,
            DType::I32 => 7,
            DType::I8 => 8,
            DType::U8 => 9,
        }
    }

    /// The name used in layout files (`"bf16"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::I8 => "i8",
            DType::U8 => "u8",
        }
    }

    /// Parses a layout-file name; `None` if unknown.
    pub fn from_name(name: &str) -> Option<DType> {
        ALL_DTYPES.into_iter().find(|d| d.name() == name)
    }

    /// Whether this is one of the convertible floating-point types.
    pub const fn is_convertible_float(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::BF16 | DType::F16)
    }

    /// Rank by precision among convertible floats (wider is larger).
    const fn width_rank(self) -> u8 {
        match self {
            DType::F64 => 3,
            DType::F32 => 2,
            // bf16 and f16 both have 16 bits; neither holds the other, so a
            // bf16 <-> f16 pair converts on the sender to the destination type.
            DType::BF16 | DType::F16 => 1,
            _ => 0,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether elements of `from` may be converted to `to`.
pub(crate) fn can_convert(from: DType, to: DType) -> bool {
    from == to || (from.is_convertible_float() && to.is_convertible_float())
}

/// The type values travel in between `src` and `dst`: the narrower one, or
/// `dst` when neither is narrower (so conversion happens on the sender).
/// Both must be the same type, or both floating-point types that convert
/// (layouts are checked for this when a plan is made).
pub fn wire_dtype(src: DType, dst: DType) -> DType {
    if src.width_rank() < dst.width_rank() {
        src
    } else {
        dst
    }
}

/// Converts `n` elements from `src` (type `from`, little-endian bytes) into
/// `dst` (type `to`). Both slices must hold exactly `n` elements and the
/// types must be equal or both floating-point types that convert.
///
/// Every pair runs a loop over fixed-size elements with a branch-free
/// element function, which the compiler vectorises, built for the widest
/// vectors the CPU has: the same results as rounding the exact value once
/// (f64 to bf16 and f16 rounds from the f64's bits: through f32 it would
/// round twice).
pub fn convert_slice(from: DType, src: &[u8], to: DType, dst: &mut [u8]) {
    debug_assert_eq!(src.len() as u64 / from.size(), dst.len() as u64 / to.size());
    use DType::{BF16, F16, F32, F64};
    match (from, to) {
        _ if from == to => dst.copy_from_slice(src),
        (F32, BF16) => widest(Vectors::Narrowing, src, dst, f32_to_bf16),
        (BF16, F32) => widest(Vectors::Widening, src, dst, bf16_to_f32),
        (F32, F16) => widest(Vectors::Narrowing, src, dst, f32_to_f16),
        (F16, F32) => widest(Vectors::Widening, src, dst, f16_to_f32),
        (BF16, F16) => widest(Vectors::Narrowing, src, dst, bf16_to_f16),
        (F16, BF16) => widest(Vectors::Narrowing, src, dst, f16_to_bf16),
        (F64, F32) => widest(Vectors::Narrowing, src, dst, f64_to_f32),
        (F32, F64) => widest(Vectors::Widening, src, dst, f32_to_f64),
        (BF16, F64) => widest(Vectors::Widening, src, dst, bf16_to_f64),
        (F16, F64) => widest(Vectors::Widening, src, dst, f16_to_f64),
        (F64, BF16) => widest(Vectors::Narrowing, src, dst, f64_to_bf16),
        (F64, F16) => widest(Vectors::Narrowing, src, dst, f64_to_f16),
        // No other pair converts (`can_convert`); element by element
        // through f64, as a last resort.
        _ => {
            let (fs, ts) = (from.size() as usize, to.size() as usize);
            for (s, d) in src.chunks_exact(fs).zip(dst.chunks_exact_mut(ts)) {
                let v = read_as_f64(from, s);
                write_from_f64(to, v, d);
            }
        }
    }
}

/// Which vector builds a conversion loop runs in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Vectors {
    /// AVX-512 where the CPU has it, else AVX2 (narrowing f32 to bf16:
    /// about 1.2x AVX2's speed here).
    Narrowing,
    /// AVX2 at most (widening loops are bound by their stores, and were
    /// no faster built for AVX-512 here).
    Widening,
}

/// Runs the conversion loop `f` built for the widest vectors `vectors`
/// allows on this CPU (the x86-64 baseline's SSE2 elsewhere).
#[inline(always)]
fn widest(vectors: Vectors, src: &[u8], dst: &mut [u8], f: impl Fn(&[u8], &mut [u8])) {
    #[cfg(target_arch = "x86_64")]
    {
        if vectors == Vectors::Narrowing && std::arch::is_x86_feature_detected!("avx512bw") {
            // SAFETY: this CPU has AVX-512 F and BW (asked just above: BW
            // implies F), all the function requires.
            return unsafe { wide::avx512(src, dst, f) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: this CPU has AVX2 (asked just above), all the
            // function requires.
            return unsafe { wide::avx2(src, dst, f) };
        }
    }
    let _ = vectors;
    f(src, dst)
}

#[inline(always)]
fn f32_to_bf16(src: &[u8], dst: &mut [u8]) {
    convert_elems::<4, 2>(src, dst, |s| f32_bits_to_bf16(u32::from_le_bytes(s)).to_le_bytes())
}

#[inline(always)]
fn bf16_to_f32(src: &[u8], dst: &mut [u8]) {
    convert_elems::<2, 4>(src, dst, |s| ((u16::from_le_bytes(s) as u32) << 16).to_le_bytes())
}

#[inline(always)]
fn f32_to_f16(src: &[u8], dst: &mut [u8]) {
    convert_elems::<4, 2>(src, dst, |s| f32_bits_to_f16(u32::from_le_bytes(s)).to_le_bytes())
}

#[inline(always)]
fn f16_to_f32(src: &[u8], dst: &mut [u8]) {
    convert_elems::<2, 4>(src, dst, |s| f16_bits_to_f32(u16::from_le_bytes(s)).to_le_bytes())
}

/// bf16 widens to f32 exactly, so this rounds once, as from the value.
#[inline(always)]
fn bf16_to_f16(src: &[u8], dst: &mut [u8]) {
    convert_elems::<2, 2>(src, dst, |s| f32_bits_to_f16((u16::from_le_bytes(s) as u32) << 16).to_le_bytes())
}

/// f16 widens to f32 exactly, so this rounds once, as from the value.
#[inline(always)]
fn f16_to_bf16(src: &[u8], dst: &mut [u8]) {
    convert_elems::<2, 2>(src, dst, |s| f32_bits_to_bf16(f16_bits_to_f32(u16::from_le_bytes(s))).to_le_bytes())
}

#[inline(always)]
fn f64_to_f32(src: &[u8], dst: &mut [u8]) {
    convert_elems::<8, 4>(src, dst, |s| (f64::from_le_bytes(s) as f32).to_le_bytes())
}

#[inline(always)]
fn f32_to_f64(src: &[u8], dst: &mut [u8]) {
    convert_elems::<4, 8>(src, dst, |s| (f32::from_le_bytes(s) as f64).to_le_bytes())
}

#[inline(always)]
fn bf16_to_f64(src: &[u8], dst: &mut [u8]) {
    convert_elems::<2, 8>(src, dst, |s| (f32::from_bits((u16::from_le_bytes(s) as u32) << 16) as f64).to_le_bytes())
}

#[inline(always)]
fn f16_to_f64(src: &[u8], dst: &mut [u8]) {
    convert_elems::<2, 8>(src, dst, |s| (f32::from_bits(f16_bits_to_f32(u16::from_le_bytes(s))) as f64).to_le_bytes())
}

#[inline(always)]
fn f64_to_bf16(src: &[u8], dst: &mut [u8]) {
    convert_elems::<8, 2>(src, dst, |s| (f64_bits_to_narrow::<8, 7>(u64::from_le_bytes(s)) as u16).to_le_bytes())
}

#[inline(always)]
fn f64_to_f16(src: &[u8], dst: &mut [u8]) {
    convert_elems::<8, 2>(src, dst, |s| (f64_bits_to_narrow::<5, 10>(u64::from_le_bytes(s)) as u16).to_le_bytes())
}

/// f64 bits to the bits of a binary format of `EB` exponent and `MB`
/// mantissa bits (bf16: 8, 7; f16: 5, 10), as [`round_f64`] rounds them
/// (to nearest even, subnormal results included, too large to infinity,
/// NaN to the quiet NaN with the sign kept), by integer operations and
/// selects only: loops over it vectorise.
#[inline(always)]
fn f64_bits_to_narrow<const EB: u32, const MB: u32>(x: u64) -> u64 {
    let bias = (1u64 << (EB - 1)) - 1;
    let max_exp = (1u64 << EB) - 1;
    let infinity = max_exp << MB;
    let sign = (x >> 63) << (EB + MB);
    let a = x & 0x7fff_ffff_ffff_ffff;
    // A normal result: the exponent rebiased (1023 -> bias), the dropped
    // bits rounded to nearest even (a carry runs on into the exponent, up
    // to infinity's code, past which everything is infinity).
    let drop = 52 - MB;
    let rebias = (1023 - bias) << 52;
    let normal = (a.wrapping_sub(rebias).wrapping_add((1u64 << (drop - 1)) - 1 + ((a >> drop) & 1)) >> drop).min(infinity);
    // A subnormal result (or zero): the significand with its implicit bit
    // shifted right by `drop` plus how far the exponent is below the
    // smallest normal, rounded the same way (from 54 on: zero).
    let shift = (1076 - MB as u64 - bias).saturating_sub(a >> 52).min(63);
    let m = (a & 0x000f_ffff_ffff_ffff) | (1u64 << 52);
    let half = (1u64 << shift) >> 1;
    let sub = m.wrapping_add(half.wrapping_sub(1)).wrapping_add((m >> shift) & 1) >> shift;
    let h = if a > 0x7ff0_0000_0000_0000 {
        infinity | (1u64 << (MB - 1))
    } else if a >= (1023 - bias + 1) << 52 {
        normal
    } else {
        sub
    };
    sign | h
}

/// Conversion loops built for wider vectors than the x86-64 baseline's
/// (the loop, `#[inline(always)]`, is inlined into each build).
#[cfg(target_arch = "x86_64")]
mod wide {
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) fn avx512(src: &[u8], dst: &mut [u8], f: impl Fn(&[u8], &mut [u8])) {
        f(src, dst)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn avx2(src: &[u8], dst: &mut [u8], f: impl Fn(&[u8], &mut [u8])) {
        f(src, dst)
    }
}

/// Converts elements of `F` bytes in `src` to elements of `T` bytes in
/// `dst` with `one`. Over arrays of fixed size, with `one` free of
/// branches, the compiler turns the loop into vector instructions (over
/// byte slices, element by element, it did not: 5-6x slower).
#[inline(always)]
fn convert_elems<const F: usize, const T: usize>(src: &[u8], dst: &mut [u8], one: impl Fn([u8; F]) -> [u8; T]) {
    let (s, _) = src.as_chunks::<F>();
    let (d, _) = dst.as_chunks_mut::<T>();
    for (s, d) in s.iter().zip(d) {
        *d = one(*s);
    }
}

/// Reads one float element as `f64` (exact for all convertible types).
fn read_as_f64(t: DType, b: &[u8]) -> f64 {
    match t {
        DType::F64 => f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
        DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::BF16 => f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16) as f64,
        DType::F16 => f16_bits_to_f64(u16::from_le_bytes([b[0], b[1]])),
        _ => unreachable!("read_as_f64 called on non-float {t}"),
    }
}

/// Writes one `f64` as type `t`, rounding to nearest even.
fn write_from_f64(t: DType, v: f64, out: &mut [u8]) {
    match t {
        DType::F64 => out.copy_from_slice(&v.to_le_bytes()),
        // `as f32` rounds to nearest, ties to even.
        DType::F32 => out.copy_from_slice(&(v as f32).to_le_bytes()),
        DType::BF16 => out.copy_from_slice(&(round_f64(v.to_bits(), 8, 7) as u16).to_le_bytes()),
        DType::F16 => out.copy_from_slice(&(round_f64(v.to_bits(), 5, 10) as u16).to_le_bytes()),
        _ => unreachable!("write_from_f64 called on non-float {t}"),
    }
}

/// f32 bits to bf16 bits, round to nearest even, NaN stays NaN.
#[inline(always)]
pub fn f32_bits_to_bf16(v: u32) -> u16 {
    // Both results, then a select: no branch, so loops over it vectorise.
    let quiet_nan = (v >> 16) | 0x0040; // sign kept
    let rounded = v.wrapping_add(0x7fff + ((v >> 16) & 1)) >> 16;
    (if (v & 0x7fff_ffff) > 0x7f80_0000 { quiet_nan } else { rounded }) as u16
}

/// f32 bits to f16 bits, round to nearest even (subnormal results
/// included), too large to infinity, NaN to the quiet NaN with the sign
/// kept: what rounding the value as an f64 gives ([`round_f64`]). Integer
/// operations and selects only (no branch, and no floating point, so no
/// dependence on a thread's denormal flags): loops over it vectorise.
#[inline(always)]
pub(crate) fn f32_bits_to_f16(x: u32) -> u16 {
    let sign = (x >> 16) & 0x8000;
    let a = x & 0x7fff_ffff;
    // A normal result: the exponent rebiased (127 -> 15), the 13 dropped
    // bits rounded to nearest even (a carry runs on into the exponent).
    let normal = a.wrapping_sub(0x3800_0000).wrapping_add(0x0fff + ((a >> 13) & 1)) >> 13;
    // A subnormal result (or zero): the significand with its implicit bit,
    // shifted right by 126 - exponent (14 at the largest subnormal; from
    // 25 on everything rounds to zero), rounded the same way.
    let shift = 126u32.saturating_sub(a >> 23).min(31);
    let m = (a & 0x007f_ffff) | 0x0080_0000;
    let half = (1u32 << shift) >> 1;
    let sub = m.wrapping_add(half.wrapping_sub(1)).wrapping_add((m >> shift) & 1) >> shift;
    let h = if a > 0x7f80_0000 {
        0x7e00
    } else if a >= 0x477f_f000 {
        // 65520 and up (and infinity): half a step past the largest f16.
        0x7c00
    } else if a >= 0x3880_0000 {
        normal
    } else {
        sub
    };
    (h | sign) as u16
}

/// f16 bits to f32 bits, exactly; NaN to the quiet NaN with the sign kept
/// (as through f64, [`f16_bits_to_f64`]). Branch-free: loops over it
/// vectorise.
#[inline(always)]
pub(crate) fn f16_bits_to_f32(h: u16) -> u32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let a = h & 0x7fff;
    let (e, m) = (a >> 10, a & 0x3ff);
    let normal = (a << 13) + 0x3800_0000;
    // m x 2^-24: a normal f32, exact (m has 10 bits, the scale is a power
    // of two far above f32's subnormals).
    let sub = ((m as i32) as f32 * (1.0 / 16_777_216.0)).to_bits();
    let special = if m == 0 { 0x7f80_0000 } else { 0x7fc0_0000 };
    sign | if e == 0 {
        sub
    } else if e == 31 {
        special
    } else {
        normal
    }
}

/// f16 bits to f64 (exact).
pub(crate) fn f16_bits_to_f64(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let man = (h & 0x3ff) as f64;
    match exp {
        0 => sign * man * 2f64.powi(-24),
        31 if man == 0.0 => sign * f64::INFINITY,
        31 => f64::NAN.copysign(sign),
        _ => sign * (1.0 + man / 1024.0) * 2f64.powi(exp - 15),
    }
}

/// Rounds an f64 (given as bits) to a binary format with `eb` exponent bits
/// and `mb` mantissa bits, round to nearest even; returns the format's bits.
/// Handles subnormals, overflow to infinity and NaN.
fn round_f64(bits: u64, eb: u32, mb: u32) -> u64 {
    let sign = (bits >> 63) << (eb + mb);
    let exp = ((bits >> 52) & 0x7ff) as i64;
    let man = bits & ((1u64 << 52) - 1);
    let max_exp = (1i64 << eb) - 1;
    if exp == 0x7ff {
        let nan = if man != 0 { 1u64 << (mb - 1) } else { 0 };
        return sign | ((max_exp as u64) << mb) | nan;
    }
    if exp == 0 && man == 0 {
        return sign;
    }
    let bias = (1i64 << (eb - 1)) - 1;
    // Unbiased exponent; f64 subnormals are far below any target range.
    let e = exp - 1023;
    // Full significand with implicit bit: 53 bits.
    let sig = man | (1u64 << 52);
    let mut target_exp = e + bias;
    // Number of low bits to drop from the 53-bit significand.
    let mut shift = 52 - mb as i64;
    if target_exp <= 0 {
        // Subnormal in the target: shift further.
        shift += 1 - target_exp;
        target_exp = 0;
    }
    if shift > 63 {
        return sign; // rounds to zero
    }
    let shift = shift as u32;
    let half = 1u64 << (shift - 1);
    let rem = sig & ((1u64 << shift) - 1);
    let mut q = sig >> shift;
    if rem > half || (rem == half && (q & 1) == 1) {
        q += 1;
    }
    // q now holds the (implicit-bit-included) significand; fix up carries.
    let result = if target_exp == 0 {
        // Subnormal; if rounding carried into the implicit bit, q encodes
        // the smallest normal naturally (exp field 1, mantissa 0).
        q
    } else {
        let mut te = target_exp as u64;
        let mut m = q;
        if m >> (mb + 1) != 0 {
            m >>= 1;
            te += 1;
        }
        if te as i64 >= max_exp {
            return sign | ((max_exp as u64) << mb); // infinity
        }
        (te << mb) | (m & ((1u64 << mb) - 1))
    };
    sign | result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_to(t: DType, v: f32) -> Vec<u8> {
        let mut out = vec![0u8; t.size() as usize];
        convert_slice(DType::F32, &v.to_le_bytes(), t, &mut out);
        out
    }

    #[test]
    fn names_round_trip() {
        for d in ALL_DTYPES {
            assert_eq!(DType::from_name(d.name()), Some(d));
        }
        assert_eq!(DType::from_name("fp32"), None);
    }

    #[test]
    fn indices_round_trip() {
        for (i, d) in ALL_DTYPES.into_iter().enumerate() {
            assert_eq!(d.index() as usize, i);
        }
    }

    #[test]
    fn wire_is_narrower() {
        assert_eq!(wire_dtype(DType::F32, DType::BF16), DType::BF16);
        assert_eq!(wire_dtype(DType::BF16, DType::F32), DType::BF16);
        assert_eq!(wire_dtype(DType::BF16, DType::F16), DType::F16);
        assert_eq!(wire_dtype(DType::I32, DType::I32), DType::I32);
        assert!(!can_convert(DType::BF16, DType::I32));
        assert!(can_convert(DType::F64, DType::F16));
    }

    #[test]
    fn bf16_rounding_matches_generic_path() {
        // The fast f32->bf16 path and the generic f64 path must agree.
        let mut x: u32 = 0x1234_5678;
        for _ in 0..200_000 {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let f = f32::from_bits(x);
            if f.is_nan() {
                continue;
            }
            let fast = f32_bits_to_bf16(x);
            let generic = round_f64((f as f64).to_bits(), 8, 7) as u16;
            assert_eq!(fast, generic, "x={x:#x}");
        }
    }

    /// Every pair's loop gives what the element-by-element path through
    /// f64 gives (the one `convert_slice` took for all but f32 <-> bf16
    /// until 2026-12-05): on random bits and on the edges (NaNs with
    /// payloads, infinities, zeros, subnormals, the largest finite
    /// values, halfway cases), at lengths around the vector widths, in
    /// every vector build the CPU runs.
    #[test]
    fn every_pair_converts_as_rounding_through_f64_does() {
        let floats = [DType::F64, DType::F32, DType::BF16, DType::F16];
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut values: Vec<f64> = vec![
            0.0,
            -0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            -f64::NAN,
            65504.0,
            65519.99,
            65520.0,
            -65520.0,
            65536.0,
            6.103_515_625e-5,
            6.1e-5,
            5.960_464_477_539_063e-8,
            2.98e-8,
            2.980_232_238_769_531_2e-8,
            1e-45,
            1.4e-45,
            3.4e38,
            3.5e38,
            1.0 + 2f64.powi(-11),
            1.0 + 3.0 * 2f64.powi(-11),
            1.0 + 2f64.powi(-8),
            1.0 + 3.0 * 2f64.powi(-8),
        ];
        let mut bits32: Vec<u32> =
            vec![0x7f80_0001, 0xff80_0001, 0x7fc0_0000, 0x7fbf_ffff, 0x0000_0001, 0x8000_8000, 0x3f80_8000, 0x477f_efff];
        for _ in 0..20_000 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            bits32.push((x >> 32) as u32);
            // Values spread over every magnitude the narrow types hold.
            values.push(f64::from_bits(x >> 1 >> 11 | ((1023 - 40 + (x % 80)) << 52)) * if x & 1 == 0 { 1.0 } else { -1.0 });
        }
        for from in floats {
            // The values in `from`: the f64s rounded into it, and raw bits.
            let mut src: Vec<u8> = Vec::new();
            for v in &values {
                let mut e = vec![0u8; from.size() as usize];
                write_from_f64(from, *v, &mut e);
                src.extend(e);
            }
            for b in &bits32 {
                src.extend(&b.to_le_bytes()[..from.size().min(4) as usize]);
                if from == DType::F64 {
                    src.extend(b.to_le_bytes());
                }
            }
            let fs = from.size() as usize;
            for to in floats.into_iter().filter(|&t| t != from) {
                let ts = to.size() as usize;
                let all = src.len() / fs;
                for n in [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 64, 65, all] {
                    let src = &src[..n * fs];
                    let mut got = vec![0u8; n * ts];
                    convert_slice(from, src, to, &mut got);
                    let mut want = vec![0u8; n * ts];
                    for (s, d) in src.chunks_exact(fs).zip(want.chunks_exact_mut(ts)) {
                        write_from_f64(to, read_as_f64(from, s), d);
                    }
                    for (i, (g, w)) in got.chunks_exact(ts).zip(want.chunks_exact(ts)).enumerate() {
                        let at = || format!("{from} -> {to}: element {i} of {n}, bits {:02x?}", &src[i * fs..(i + 1) * fs]);
                        if read_as_f64(to, w).is_nan() {
                            // A NaN stays a NaN of its sign (its payload: as
                            // the pair's loop keeps it, e.g. bf16 -> f32
                            // exactly, bits and all).
                            assert!(read_as_f64(to, g).is_nan() && g[ts - 1] >> 7 == w[ts - 1] >> 7, "{}: {g:02x?}", at());
                        } else {
                            assert_eq!(g, w, "{}", at());
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn slices_convert_as_their_elements_do_at_any_length() {
        // The vectorised loops and the element function agree everywhere:
        // NaNs (quieted, sign kept), infinities, subnormals, ties; and
        // bf16 widens exactly. Lengths around the vector width.
        let mut x: u32 = 0x9e37_79b9;
        let mut bits: Vec<u32> =
            vec![0x7f80_0001, 0xff80_0001, 0x7fc0_0000, 0x7f80_0000, 0xff80_0000, 0x0000_0001, 0x8000_8000, 0x3f80_8000];
        bits.extend((0..5_000).map(|_| {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            x
        }));
        for n in [0, 1, 3, 4, 7, 8, 15, 16, 17, 31, 33, 64, 1000, bits.len()] {
            let src: Vec<u8> = bits[..n].iter().flat_map(|b| b.to_le_bytes()).collect();
            let mut narrow = vec![0u8; n * 2];
            convert_slice(DType::F32, &src, DType::BF16, &mut narrow);
            let want: Vec<u8> = bits[..n].iter().flat_map(|&b| f32_bits_to_bf16(b).to_le_bytes()).collect();
            assert_eq!(narrow, want, "{n} elements");
            // The baseline build of the loop too, and the AVX2 one
            // (convert_slice may have taken the AVX-512 one).
            let mut plain = vec![0u8; n * 2];
            f32_to_bf16(&src, &mut plain);
            assert_eq!(plain, want, "{n} elements");
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                let mut wide_build = vec![0u8; n * 2];
                // SAFETY: this CPU has AVX2 (asked just above).
                unsafe { wide::avx2(&src, &mut wide_build, f32_to_bf16) };
                assert_eq!(wide_build, want, "{n} elements, AVX2");
            }
            let mut wide = vec![0u8; n * 4];
            convert_slice(DType::BF16, &narrow, DType::F32, &mut wide);
            let want: Vec<u8> =
                narrow.chunks_exact(2).flat_map(|h| ((u16::from_le_bytes([h[0], h[1]]) as u32) << 16).to_le_bytes()).collect();
            assert_eq!(wide, want, "{n} elements");
            let mut plain = vec![0u8; n * 4];
            bf16_to_f32(&narrow, &mut plain);
            assert_eq!(plain, want, "{n} elements");
        }
        // A NaN stays a NaN, its sign kept.
        assert_eq!(f32_bits_to_bf16(0x7f80_0001), 0x7fc0);
        assert_eq!(f32_bits_to_bf16(0xff80_0001), 0xffc0);
    }

    #[test]
    fn f16_known_values() {
        let check = |v: f32, bits: u16| {
            assert_eq!(f32_to(DType::F16, v), bits.to_le_bytes(), "{v}");
        };
        check(1.0, 0x3c00);
        check(-2.0, 0xc000);
        check(65504.0, 0x7bff);
        check(65520.0, 0x7c00); // rounds up to infinity
        check(5.960_464_5e-8, 0x0001); // smallest subnormal
        check(2.980_232_2e-8, 0x0000); // exactly half of it: ties to even (0)
        check(6.103_515_6e-5, 0x0400); // smallest normal
        check(1.000_976_6, 0x3c01);
        check(1.000_488_3, 0x3c00); // halfway 1 and next: ties to even
        check(1.001_464_8, 0x3c02); // halfway 0x3c01 and 0x3c02: to even
        check(f32::INFINITY, 0x7c00);
    }

    #[test]
    fn f16_round_trips_exactly() {
        for h in 0u16..=0xffff {
            let v = f16_bits_to_f64(h);
            if v.is_nan() {
                continue;
            }
            let mut out = [0u8; 2];
            write_from_f64(DType::F16, v, &mut out);
            assert_eq!(u16::from_le_bytes(out), h);
        }
    }

    #[test]
    fn bf16_widening_is_exact() {
        let mut out = [0u8; 4];
        convert_slice(DType::BF16, &0x3f81u16.to_le_bytes(), DType::F32, &mut out);
        assert_eq!(f32::from_le_bytes(out), f32::from_bits(0x3f81_0000));
    }
}
