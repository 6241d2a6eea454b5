//! Conversion speed on one thread against a memcpy of the same source
//! bytes: f32 -> bf16 and bf16 -> f32 through `reshard::convert_slice`
//! (what packing and unpacking a converted piece runs), then every other
//! pair of float types, from as many elements.
//!
//!     cargo run --release -p reshard --example convert_bench [-- MIB [REPEATS]]
//!
//! Prints the best and median GB/s of each (source bytes per second).

use reshard::{convert_slice, DType};
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(64);
    let repeats: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(15);
    let n = mib << 20 >> 2; // f32 elements
    let f32s: Vec<u8> = (0..n).flat_map(|i| ((i as f32) * 0.37 - 1e3).to_le_bytes()).collect();
    let mut bf16s = vec![0u8; n * 2];
    let mut copy = vec![0u8; n * 4];
    let mut back = vec![0u8; n * 4];
    // Touch every destination page first: page faults are not conversion.
    convert_slice(DType::F32, &f32s, DType::BF16, &mut bf16s);
    copy.copy_from_slice(&f32s);
    convert_slice(DType::BF16, &bf16s, DType::F32, &mut back);
    let time = |f: &mut dyn FnMut(), bytes: usize| {
        let mut rates: Vec<f64> = (0..repeats)
            .map(|_| {
                let t = Instant::now();
                f();
                bytes as f64 / t.elapsed().as_secs_f64() / 1e9
            })
            .collect();
        rates.sort_by(|a, b| a.total_cmp(b));
        (rates[rates.len() - 1], rates[rates.len() / 2])
    };
    let memcpy = time(&mut || copy.copy_from_slice(std::hint::black_box(&f32s)), n * 4);
    let narrow = time(&mut || convert_slice(DType::F32, std::hint::black_box(&f32s), DType::BF16, &mut bf16s), n * 4);
    let widen = time(&mut || convert_slice(DType::BF16, std::hint::black_box(&bf16s), DType::F32, &mut back), n * 2);
    let scalar = time(&mut || element_by_element(std::hint::black_box(&f32s), &mut bf16s), n * 4);
    println!("{mib} MiB of f32 source, {repeats} runs each, one thread (GB/s of source bytes: best, median)");
    println!("memcpy        {:6.2} {:6.2}", memcpy.0, memcpy.1);
    println!("f32 -> bf16   {:6.2} {:6.2}   median {:.2}x memcpy's", narrow.0, narrow.1, narrow.1 / memcpy.1);
    println!("bf16 -> f32   {:6.2} {:6.2}   median {:.2}x memcpy's", widen.0, widen.1, widen.1 / memcpy.1);
    println!("f32 -> bf16, element by element over byte slices (the loop before 2026-12-05): {:6.2} {:6.2}", scalar.0, scalar.1);
    // Every other pair of the float types a layout may convert between,
    // from the same values (as many elements: f64 has twice the bytes,
    // bf16 and f16 half).
    let floats = [DType::F64, DType::F32, DType::BF16, DType::F16];
    for from in floats {
        let mut src = vec![0u8; n * from.size() as usize];
        convert_slice(DType::F32, &f32s, from, &mut src);
        for to in floats.into_iter().filter(|&t| t != from && !matches!((from, t), (DType::F32, DType::BF16) | (DType::BF16, DType::F32))) {
            let mut dst = vec![0u8; n * to.size() as usize];
            convert_slice(from, &src, to, &mut dst);
            let r = time(&mut || convert_slice(from, std::hint::black_box(&src), to, &mut dst), src.len());
            println!("{:<13} {:6.2} {:6.2}   median {:.2}x memcpy's", format!("{from} -> {to}"), r.0, r.1, r.1 / memcpy.1);
        }
    }
}

/// f32 -> bf16 as `convert_slice` did it until 2026-12-05: a loop over
/// byte chunks with a branch for NaN, which the compiler does not
/// vectorise. Same results.
fn element_by_element(src: &[u8], dst: &mut [u8]) {
    for (s, d) in src.chunks_exact(4).zip(dst.chunks_exact_mut(2)) {
        let v = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let b = if (v & 0x7fff_ffff) > 0x7f80_0000 {
            ((v >> 16) | 0x0040) as u16
        } else {
            (v.wrapping_add(0x7fff + ((v >> 16) & 1)) >> 16) as u16
        };
        d.copy_from_slice(&b.to_le_bytes());
    }
}
