#!/usr/bin/env bash
# GPU check for the `cuda` data plane. Needs one NVIDIA GPU, its driver
# (libcuda.so.1) and NCCL >= 2.14; see docs/gpu.md. Builds with the cuda
# feature and runs transport/examples/gpu_check.rs:
#   1. a 4->2 rank reshard whose ranks are separate buffers on the one GPU,
#      verified bit-exact, throughput next to a plain device-to-device copy
#      of the same bytes (target ratio >= 0.8), plus a mixed-dtype/3-D plan;
#   2. a one-rank NCCL communicator: create, empty group, self send/recv,
#      abort, recreate with a new id, each timed;
#   3. the gather-broadcast baseline, verified bit-exact.
# Prints a summary; exits non-zero on any mismatch or failure (2: CUDA
# unavailable). Budget: under 8 minutes (build ~2-4, run < 1).
set -euo pipefail
cd "$(dirname "$0")/.."

# cudarc loads NCCL as libnccl.so (not libnccl.so.2). If only libnccl.so.2
# is installed (the usual case for the nvidia-nccl-cu12 wheel), point the
# loader at a directory holding a libnccl.so symlink to it.
have_nccl_so() {
  ldconfig -p 2>/dev/null | grep -q 'libnccl\.so ' && return 0
  local d
  IFS=: read -ra dirs <<< "${LD_LIBRARY_PATH:-}"
  for d in "${dirs[@]}"; do [ -n "$d" ] && [ -e "$d/libnccl.so" ] && return 0; done
  return 1
}
if ! have_nccl_so; then
  so2=""
  for d in ${NCCL_HOME:+"$NCCL_HOME/lib"} /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/cuda/lib64 /usr/local/nccl/lib; do
    if [ -e "$d/libnccl.so.2" ]; then so2="$d/libnccl.so.2"; break; fi
  done
  if [ -z "$so2" ] && command -v python3 >/dev/null; then
    so2=$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
for r in roots:
    for p in glob.glob(os.path.join(r, "nvidia", "nccl", "lib", "libnccl.so.2")):
        print(p); raise SystemExit
PY
)
  fi
  if [ -n "$so2" ]; then
    shim=$(mktemp -d)
    ln -s "$so2" "$shim/libnccl.so"
    export LD_LIBRARY_PATH="$shim${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "gpu-check: using NCCL $so2 (through $shim/libnccl.so)"
  else
    echo "gpu-check: no libnccl.so or libnccl.so.2 found; the NCCL check will fail (see docs/gpu.md)"
  fi
fi

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

start=$(date +%s)
timeout 330 cargo build --release -p transport --example gpu_check --features cuda
echo "gpu-check: built in $(( $(date +%s) - start )) s"
timeout 150 cargo run --release -q -p transport --example gpu_check --features cuda
