//! `reshard::quantize` against torch: blocks of bf16 values quantized by
//! `torch.float8_e4m3fn` (`scripts/e4m3-golden.py` wrote the vectors in
//! `tests/data/e4m3_torch.txt`: per block its bf16 bits, the f32 bits of
//! its scale, the e4m3 codes) agree bit for bit.

use reshard::{block_scale, quantize_value};

fn hex(line: &str) -> Vec<u32> {
    line.split_whitespace().map(|w| u32::from_str_radix(w, 16).unwrap()).collect()
}

#[test]
fn quantization_matches_torch_bit_for_bit() {
    let text = include_str!("data/e4m3_torch.txt");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len() % 3, 0);
    let mut checked = 0;
    for case in lines.chunks(3) {
        let values: Vec<f32> = hex(case[0]).into_iter().map(|b| f32::from_bits(b << 16)).collect();
        let (scale, codes) = (hex(case[1])[0], hex(case[2]));
        let s = block_scale(values.iter().fold(0f32, |m, v| m.max(v.abs())));
        assert_eq!(s.to_bits(), scale, "scale of a block of {}", values.len());
        for (x, &want) in values.iter().zip(&codes) {
            assert_eq!(quantize_value(*x, s) as u32, want, "{x:e} / {s:e}");
            checked += 1;
        }
    }
    assert!(checked > 400, "{checked}");
}
