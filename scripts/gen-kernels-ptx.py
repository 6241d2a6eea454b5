#!/usr/bin/env python3
"""Regenerates transport/src/cuda/kernels.ptx from kernels.cu with NVRTC.

The GPU data plane compiles kernels.cu with NVRTC at run time where
libnvrtc loads, and otherwise loads this PTX (the driver compiles PTX
itself). Run after changing kernels.cu; a unit test checks that the PTX
names the source it came from (an FNV-1a 64-bit hash of kernels.cu).

    python3 scripts/gen-kernels-ptx.py /path/to/libnvrtc.so.12

Use NVRTC 12.0 (`pip download --no-deps nvidia-cuda-nvrtc-cu12==12.0.76`,
unzip, pass nvidia/cuda_nvrtc/lib/libnvrtc.so.12): its PTX is ISA 8.0,
which every driver of CUDA 12.0 and later loads (525 on); a newer NVRTC
writes a newer ISA that older drivers refuse (a unit test holds the ISA at
8.0 or older). compute_80: Ampere, Hopper and later.
"""
import ctypes
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CU = ROOT / "transport/src/cuda/kernels.cu"
PTX = ROOT / "transport/src/cuda/kernels.ptx"
ARCH = "compute_80"


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    lib = ctypes.CDLL(sys.argv[1])
    src = CU.read_bytes()
    prog = ctypes.c_void_p()

    def check(what, rc):
        if rc != 0:
            raise SystemExit(f"{what}: NVRTC error {rc}")

    check("nvrtcCreateProgram", lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"refit_kernels.cu", 0, None, None))
    opts = [f"--gpu-architecture={ARCH}".encode()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    if rc != 0:
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise SystemExit(f"NVRTC failed:\n{log.value.decode()}")
    n = ctypes.c_size_t()
    check("nvrtcGetPTXSize", lib.nvrtcGetPTXSize(prog, ctypes.byref(n)))
    buf = ctypes.create_string_buffer(n.value)
    check("nvrtcGetPTX", lib.nvrtcGetPTX(prog, buf))
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    header = (
        f"// Generated from kernels.cu (fnv1a64 {fnv1a64(src):016x}) by scripts/gen-kernels-ptx.py\n"
        f"// with NVRTC {major.value}.{minor.value}, --gpu-architecture={ARCH}. Do not edit.\n"
    )
    PTX.write_text(header + buf.value.decode())
    print(f"wrote {PTX.relative_to(ROOT)} ({PTX.stat().st_size} bytes, NVRTC {major.value}.{minor.value})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
