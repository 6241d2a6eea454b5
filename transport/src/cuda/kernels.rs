//! Device casts and strided copy-casts: the CUDA C source (`kernels.cu`,
//! for NVRTC) and the launch geometry of its kernels. Compiled in every
//! build: the conversions are integer code that also compiles as C on the
//! host, where the tests check them against the host conversion
//! ([`reshard::dtype::convert_slice`]) over every 16-bit value and a
//! million f32 values, without a GPU.
//!
//! Not on a refit path yet: the device executors still convert through
//! host memory (see `docs/gpu.md`).

/// The kernels' CUDA C source.
pub const SOURCE: &str = include_str!("kernels.cu");

/// The kernels `SOURCE` defines: element-wise casts (`refit_cast_*`,
/// arguments `src, dst, n`; launch with [`launch_1d`]) and strided box
/// copy-casts (`refit_strided_*`, arguments `src, dst, c0, c1, c2, sb, ss0,
/// ss1, ss2, db, ds0, ds1, ds2`; launch with [`launch_3d`]).
pub const KERNELS: [&str; 10] = [
    "refit_cast_f32_bf16",
    "refit_cast_bf16_f32",
    "refit_cast_f32_f16",
    "refit_cast_f16_f32",
    "refit_strided_f32_bf16",
    "refit_strided_bf16_f32",
    "refit_strided_f32_f16",
    "refit_strided_f16_f32",
    "refit_strided_copy32",
    "refit_strided_copy16",
];

/// Threads per block of every kernel.
pub const THREADS: u32 = 256;

/// Most blocks a grid-stride launch uses along x (enough to fill any
/// current GPU several times over; more only adds scheduling).
pub const MAX_BLOCKS_X: u32 = 8192;

/// Most blocks along y and z (CUDA's limit); the kernels stride past it.
pub const MAX_BLOCKS_YZ: u32 = 65_535;

/// Grid and block dimensions of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Blocks per dimension (x, y, z), each at least 1.
    pub grid: [u32; 3],
    /// Threads per block (x, y, z).
    pub block: [u32; 3],
}

/// The launch of an element-wise kernel over `n` elements: a thread per
/// element up to [`MAX_BLOCKS_X`] blocks, the kernel striding past that.
pub fn launch_1d(n: u64) -> Launch {
    let blocks = n.div_ceil(THREADS as u64).clamp(1, MAX_BLOCKS_X as u64) as u32;
    Launch { grid: [blocks, 1, 1], block: [THREADS, 1, 1] }
}

/// The launch of a strided kernel over a box of `counts` elements
/// (innermost first): x covers the innermost dimension like
/// [`launch_1d`], y and z one block per index up to [`MAX_BLOCKS_YZ`].
pub fn launch_3d(counts: [u64; 3]) -> Launch {
    let x = launch_1d(counts[0]).grid[0];
    let yz = |c: u64| c.clamp(1, MAX_BLOCKS_YZ as u64) as u32;
    Launch { grid: [x, yz(counts[1]), yz(counts[2])], block: [THREADS, 1, 1] }
}

/// Compiles [`SOURCE`] to PTX with NVRTC (`libnvrtc`, loaded at run time;
/// no GPU needed). Never panics: a missing library is an error.
#[cfg(feature = "cuda")]
pub fn compile() -> Result<String, String> {
    crate::cuda::device::no_panic("NVRTC", || {
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(
                "NVRTC (libnvrtc.so) is not loadable: install the CUDA toolkit's nvrtc, or add its directory to LD_LIBRARY_PATH".into()
            );
        }
        let opts = cudarc::nvrtc::CompileOptions { name: Some("refit_kernels.cu".into()), ..Default::default() };
        cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map(|ptx| ptx.to_src()).map_err(|e| format!("NVRTC: {e}"))
    })
}

/// Every index a launch's threads visit with the kernels' loops, as
/// (i, j, k), in no particular order: what the tests check covers a box
/// exactly once.
pub fn visited(launch: &Launch, counts: [u64; 3], mut f: impl FnMut(u64, u64, u64)) {
    let [gx, gy, gz] = launch.grid.map(u64::from);
    let bx = launch.block[0] as u64;
    for bz in 0..gz {
        for by in 0..gy {
            for b in 0..gx {
                for t in 0..bx {
                    let mut k = bz;
                    while k < counts[2] {
                        let mut j = by;
                        while j < counts[1] {
                            let mut i = b * bx + t;
                            while i < counts[0] {
                                f(i, j, k);
                                i += gx * bx;
                            }
                            j += gy;
                        }
                        k += gz;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard::dtype::convert_slice;
    use reshard::DType;
    use std::io::Write;
    use std::process::{Command, Stdio};

    #[test]
    fn launches_stay_within_limits_and_cover_each_index_once() {
        assert_eq!(launch_1d(0).grid, [1, 1, 1]);
        assert_eq!(launch_1d(256).grid, [1, 1, 1]);
        assert_eq!(launch_1d(257).grid, [2, 1, 1]);
        assert_eq!(launch_1d(u64::MAX).grid, [MAX_BLOCKS_X, 1, 1]);
        assert_eq!(launch_3d([10, 70_000, 3]).grid, [1, MAX_BLOCKS_YZ, 3]);
        for counts in [[1, 1, 1], [300, 2, 2], [5, 3, 7], [0, 4, 4], [257, 1, 11]] {
            // A small grid with the same loop shape: the coverage rule does
            // not depend on the sizes.
            let mut l = launch_3d(counts);
            l.grid = [l.grid[0].min(3), l.grid[1].min(2), l.grid[2].min(5)];
            l.block[0] = 64;
            let mut seen = std::collections::HashMap::new();
            visited(&l, counts, |i, j, k| *seen.entry((i, j, k)).or_insert(0) += 1);
            let n = counts.iter().product::<u64>() as usize;
            assert_eq!(seen.len(), n, "{counts:?}");
            assert!(seen.values().all(|&c| c == 1), "{counts:?}");
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn the_source_compiles_with_nvrtc() {
        match compile() {
            Ok(ptx) => {
                for k in KERNELS {
                    assert!(ptx.contains(&format!(".entry {k}(")), "{k} missing from the PTX");
                }
            }
            Err(e) if e.contains("not loadable") => eprintln!("skipped: {e}"),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn the_source_names_every_kernel() {
        for k in KERNELS {
            assert!(SOURCE.contains(&format!("({k},")), "{k}");
        }
    }

    /// The conversions compiled as C by the host compiler, fed `input`
    /// (`mode`: which conversion) on stdin; `None` without a C compiler.
    fn run_host(mode: &str, input: &[u8]) -> Option<Vec<u8>> {
        let dir = std::env::temp_dir().join(format!("refit-kernels-{}-{mode}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let harness = format!(
            "{SOURCE}\n#include <stdio.h>\n#include <string.h>\n\
             int main(void) {{ unsigned char b[4]; const char *m = \"{mode}\";\n\
             int wide = m[0] == 'f' && m[1] == '3';\n\
             while (fread(b, wide ? 4 : 2, 1, stdin) == 1) {{\n\
               u32 v; u16 h; memcpy(&v, b, 4); memcpy(&h, b, 2);\n\
               if (!strcmp(m, \"f32_bf16\")) {{ u16 o = refit_f32_to_bf16(v); fwrite(&o, 2, 1, stdout); }}\n\
               if (!strcmp(m, \"f32_f16\")) {{ u16 o = refit_f32_to_f16(v); fwrite(&o, 2, 1, stdout); }}\n\
               if (!strcmp(m, \"bf16_f32\")) {{ u32 o = refit_bf16_to_f32(h); fwrite(&o, 4, 1, stdout); }}\n\
               if (!strcmp(m, \"f16_f32\")) {{ u32 o = refit_f16_to_f32(h); fwrite(&o, 4, 1, stdout); }}\n\
             }} return 0; }}\n"
        );
        let (c, exe) = (dir.join("harness.c"), dir.join("harness"));
        std::fs::write(&c, harness).ok()?;
        let built = Command::new("cc").args(["-O1", "-o"]).arg(&exe).arg(&c).status().ok()?;
        assert!(built.success(), "the kernel source does not compile as C");
        let mut child = Command::new(&exe).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().ok()?;
        let mut stdin = child.stdin.take()?;
        let input = input.to_vec();
        let writer = std::thread::spawn(move || stdin.write_all(&input));
        let out = child.wait_with_output().ok()?;
        writer.join().ok()?.ok()?;
        let _ = std::fs::remove_dir_all(&dir);
        Some(out.stdout)
    }

    /// Every 16-bit pattern, and a million f32 values (every exponent,
    /// random mantissas, NaNs and infinities among them).
    fn inputs() -> (Vec<u8>, Vec<u8>) {
        let all16: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut f32s: Vec<u8> = Vec::with_capacity(4 << 20);
        for i in 0..1_000_000u32 {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let r = (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) as u32;
            // Every 256th value an exponent sweep with exact ties.
            let v = if i % 256 == 0 { ((i >> 8) % 512) << 23 | 0x1000 | (r & 0x8000_0000) } else { r };
            f32s.extend_from_slice(&v.to_le_bytes());
        }
        (all16, f32s)
    }

    #[test]
    fn host_compiled_conversions_equal_the_host_conversion() {
        let (all16, f32s) = inputs();
        for (mode, from, to, input) in [
            ("f32_bf16", DType::F32, DType::BF16, &f32s),
            ("f32_f16", DType::F32, DType::F16, &f32s),
            ("bf16_f32", DType::BF16, DType::F32, &all16),
            ("f16_f32", DType::F16, DType::F32, &all16),
        ] {
            let Some(got) = run_host(mode, input) else {
                eprintln!("no C compiler: the kernel conversions are not checked");
                return;
            };
            let n = input.len() / from.size() as usize;
            let mut want = vec![0u8; n * to.size() as usize];
            convert_slice(from, input, to, &mut want);
            assert_eq!(got.len(), want.len(), "{mode}");
            let ts = to.size() as usize;
            if let Some(k) = (0..n).find(|&k| got[k * ts..(k + 1) * ts] != want[k * ts..(k + 1) * ts]) {
                let fs = from.size() as usize;
                panic!(
                    "{mode}: input {:02x?} gives {:02x?}, the host {:02x?}",
                    &input[k * fs..(k + 1) * fs],
                    &got[k * ts..(k + 1) * ts],
                    &want[k * ts..(k + 1) * ts]
                );
            }
        }
    }
}
