#!/usr/bin/env bash
# The GPU check of the `cuda` data plane, for one NVIDIA GPU (see
# docs/gpu.md). Built on a machine with the Rust toolchain, run on one
# without it:
#
#   scripts/gpu-check.sh --build     here: builds the check program
#                                    (examples/gpu_check/, stripped) and the
#                                    Python wheel with the cuda feature into
#                                    target/gpu-carry/
#   scripts/gpu-check.sh --dry-run   here: what the run will do — the
#                                    commands, the files it carries and their
#                                    sizes, every check with its timeout and
#                                    expected time
#   scripts/gpu-check.sh --only NAME [--out DIR]   one check only, its JSON
#                                    in DIR/NAME.json (no torch stream check)
#   scripts/gpu-check.sh [--out DIR] on the GPU machine, from the repository
#                                    root with target/gpu-carry/ beside it:
#                                    runs every check, each in its own process
#                                    with its own timeout (NCCL last), then the
#                                    torch stream check; results as JSON in
#                                    DIR/gpu-check.json and DIR/torch-stream.json
#
# Checks (examples/gpu_check/ has the details): environment (driver, NCCL,
# NVRTC, where the kernels came from: must be the shipped PTX), kernels
# (device casts against the host's, every 16-bit value), layouts (every
# examples/*/ pair on the device, byte-compared with the host executor), ipc
# (two processes, one GPU), throughput, orchestrator-ipc (+ in place),
# ipc-abort-in-flight, nccl-same-device (refused before NCCL), nccl-missing-
# peer (3 s creation timeout), nccl (one rank: init, groups, abort),
# orchestrator (2+ GPUs; skipped on one). Any check that ran a piece on the
# host instead of the device fails. Exit status: 0 all passed, 1 a check
# failed, 2 the GPU or the carried build is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

CARRY=target/gpu-carry
# Seconds for the Rust checks together (each also has its own timeout),
# and for the torch stream check: under 8 minutes in all.
BUDGET=360
PY_TIMEOUT=90
BIN=$CARRY/gpu_check
mode=run
out=""
only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build) mode=build ;;
    --dry-run) mode=dry ;;
    --out) out="$2"; shift ;;
    --only) only="$2"; shift ;;
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

# The one command the device runs (it carries $CARRY; $OUT is its output
# folder).
DEVICE_COMMAND='bash scripts/gpu-check.sh --out $OUT'

build() {
  mkdir -p "$CARRY"
  # A separate target folder: the cuda feature would rebuild the usual one.
  CARGO_TARGET_DIR=target/gpu CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=true \
    cargo build --release --example gpu_check --features cuda
  cp target/gpu/release/examples/gpu_check "$BIN"
  rm -f "$CARRY"/*.whl
  # The Python package with the GPU fabrics (abi3: any CPython >= 3.9).
  ( CARGO_TARGET_DIR=target/gpu-py maturin build --release --strip -m python/Cargo.toml --features cuda -o "$CARRY" )
  ls -l "$CARRY"
}

dry_run() {
  [ -x "$BIN" ] || { echo "gpu-check: $BIN is missing: run scripts/gpu-check.sh --build first" >&2; exit 2; }
  echo "device command (carry: [\"$CARRY\"]):"
  echo "  $DEVICE_COMMAND"
  echo "which runs, in order:"
  echo "  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader"
  echo "  (a libnccl.so / libnvrtc.so link to the installed libnccl.so.2 / libnvrtc.so.13 on LD_LIBRARY_PATH if only those exist)"
  echo "  $BIN --root . --budget $BUDGET --out \$OUT   # each check below: $BIN --only NAME --root ."
  echo "  python3 -m pip install -q --no-index --no-deps --target \$SITE $CARRY/*.whl   # SITE: a temporary folder"
  echo "  PYTHONPATH=\$SITE timeout $PY_TIMEOUT python3 python/tests/gpu_stream_check.py --out \$OUT/torch-stream.json"
  echo
  echo "carried files:"
  local carried tree
  carried=$(du -cb "$CARRY"/* | tail -1 | cut -f1)
  du -b "$CARRY"/* | sed 's/^/  /'
  tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  printf '  working tree (tracked files): %d bytes\n' "$tree"
  awk -v b=$((carried + tree)) 'BEGIN { printf "  in all: %.1f MiB (limit 64 MiB)\n", b / 1048576 }'
  echo
  echo "checks (timeout s, expected s: as measured on one H200):"
  local total=0 limit=0
  while IFS=$'\t' read -r name timeout expected; do
    printf '  %-28s %4s %4s\n' "$name" "$timeout" "$expected"
    total=$((total + expected)); limit=$((limit + timeout))
  done < <("$BIN" --list)
  printf '  %-28s %4s %4s\n' "torch-stream (python)" "$PY_TIMEOUT" 15
  total=$((total + 15))
  limit=$(( (limit < BUDGET ? limit : BUDGET) + PY_TIMEOUT ))
  echo "expected in all: ${total} s; at most ${limit} s (the Rust checks stop at their ${BUDGET} s budget)"
}

# cudarc loads libnccl.so and libnvrtc.so (or .so.12); where only the
# versioned library is installed (the nvidia-nccl / nvidia-cuda-nvrtc
# wheels, CUDA 13's libnvrtc.so.13), link it under the plain name.
SHIM=""
shim_libraries() {
  local found lib want
  SHIM=$(mktemp -d)
  trap 'rm -rf "$SHIM"' EXIT
  for pair in "libnccl.so:libnccl.so.2" "libnvrtc.so:libnvrtc.so.13"; do
    want=${pair%%:*}; lib=${pair##*:}
    if ldconfig -p 2>/dev/null | grep -q "$want "; then continue; fi
    found=$(python3 - "$lib" <<'PY' 2>/dev/null || true
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
places = [os.path.join(r, "nvidia", *d, "lib") for r in roots for d in (["*"], ["*", "*"])]
places += ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64"]
for place in places:
    for p in sorted(glob.glob(os.path.join(place, sys.argv[1]))):
        print(p); raise SystemExit
PY
)
    if [ -n "$found" ]; then
      ln -s "$found" "$SHIM/$want"
      echo "gpu-check: $want -> $found" >&2
    else
      echo "gpu-check: no $want or $lib found" >&2
    fi
  done
  export LD_LIBRARY_PATH="$SHIM${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

run() {
  [ -x "$BIN" ] || { echo "gpu-check: $BIN is missing: build it where cargo is (scripts/gpu-check.sh --build) and carry $CARRY" >&2; exit 2; }
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || true
  shim_libraries
  local status=0 py=0
  if [ -n "$only" ]; then
    # One check, in its own process, its JSON line to DIR/NAME.json (for a
    # device session with little time left; no torch stream check).
    timeout "$BUDGET" "$BIN" --only "$only" --root . > "${out:-.}/$only.json" || status=$?
    cat "${out:-.}/$only.json"
    exit "$status"
  fi
  "$BIN" --root . --budget "$BUDGET" ${out:+--out "$out"} || status=$?
  if [ "$status" -eq 2 ]; then exit 2; fi
  local site
  site=$(mktemp -d)
  if python3 -m pip install -q --no-index --no-deps --target "$site" "$CARRY"/*.whl; then
    PYTHONPATH="$site" timeout "$PY_TIMEOUT" python3 python/tests/gpu_stream_check.py ${out:+--out "$out/torch-stream.json"} || py=$?
  else
    echo "gpu-check: cannot install the carried wheel" >&2
    py=1
  fi
  rm -rf "$site"
  echo "gpu-check: checks exit $status, torch stream check exit $py" >&2
  if [ "$status" -ne 0 ] || [ "$py" -ne 0 ]; then exit 1; fi
}

case "$mode" in
  build) build ;;
  dry) dry_run ;;
  run) run ;;
esac
