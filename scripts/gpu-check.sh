#!/usr/bin/env bash
# GPU check for the `cuda` data plane. Needs one NVIDIA GPU, its driver
# (libcuda.so.1) and NCCL >= 2.14; see docs/gpu.md. Builds the root crate's
# examples/gpu_check.rs with the cuda feature and runs it:
#   kernels     the cast kernels against the host conversion (every 16-bit
#               value, a million f32 values);
#   layouts     every examples/*/ layout pair, reshard and baseline, on the
#               device, byte-compared with the host executor;
#   ipc         a colocated refit between two processes on one GPU through
#               CUDA IPC (one bucket handle per source rank), verified;
#   nccl        a one-rank communicator: init, empty group, 64 MiB self
#               send/recv (verified), abort within its deadline, again with
#               a new id;
#   throughput  a device refit of llama3-8b --scale 2 against a same-run
#               cuMemcpyDtoD of the same bytes (passes at ratio >= 0.7);
#   orchestrator-ipc  a colocated refit through the orchestrator on the
#               CUDA IPC fabric: sources served by a child process, destinations
#               here, one GPU, every element checked;
#   orchestrator-ipc-in-place  the same into destination device buffers
#               registered in place (the commit copies into them);
#   orchestrator  with 2 GPUs or more (SKIP on one): three refits through
#               the orchestrator on the NCCL fabric, one rank per GPU,
#               every destination element checked.
# One line per check, then "N passed, N failed". Arguments are passed on
# (--json: one JSON object per check and one with the totals). Exits 0 if
# all pass, 1 if one fails, 2 if CUDA is unavailable. Budget: under 8
# minutes (build ~2-4, run ~1-2).
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
    trap 'rm -rf "$shim"' EXIT
    ln -s "$so2" "$shim/libnccl.so"
    export LD_LIBRARY_PATH="$shim${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "gpu-check: using NCCL $so2 (through $shim/libnccl.so)" >&2
  else
    echo "gpu-check: no libnccl.so or libnccl.so.2 found; the NCCL check will fail (see docs/gpu.md)" >&2
  fi
fi

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || true

start=$(date +%s)
timeout 300 cargo build --release --example gpu_check --features cuda
echo "gpu-check: built in $(( $(date +%s) - start )) s" >&2
timeout 180 cargo run --release -q --example gpu_check --features cuda -- "$@"
