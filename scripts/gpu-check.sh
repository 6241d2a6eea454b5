#!/usr/bin/env bash
# The GPU check of the `cuda` data plane, for one NVIDIA GPU (see
# docs/gpu.md, "Testing"). Built on a machine with the Rust toolchain, run
# on one without it (and without .git):
#
#   scripts/gpu-check.sh --build     here: builds the check program
#                                    (cli/examples/gpu_check/, stripped) and the
#                                    Python wheel with the cuda feature into
#                                    target/gpu-carry/, with BUILD_INFO.json
#                                    (the commit, whether the tree was dirty,
#                                    when it was built)
#   scripts/gpu-check.sh --dry-run   here: the plan — the command, every
#                                    check with its timeout and expected time
#                                    (measured or estimated), the carried
#                                    files and their bytes against 64 MiB, the
#                                    expected time against the 8-minute call
#                                    with room to re-run the longest check;
#                                    exits 1 if it does not fit
#   scripts/gpu-check.sh --only NAME [--out DIR]   one check only, its JSON
#                                    in DIR/NAME.json (a Rust check, or
#                                    torch-stream, or colocated)
#   scripts/gpu-check.sh [--out DIR] on the GPU machine, from the repository
#                                    root with target/gpu-carry/ beside it:
#                                    runs every check, each in its own process
#                                    with its own timeout (NCCL last), then the
#                                    Python checks (torch stream, colocated),
#                                    all within the call's 8 minutes; results
#                                    as JSON in DIR/gpu-check.json,
#                                    DIR/torch-stream.json, DIR/colocated.json,
#                                    each recording what ran (commit, GPU,
#                                    driver, CUDA, NVRTC, NCCL, torch)
#
# The Rust checks are listed by `gpu_check --list` (cli/examples/gpu_check/ has
# the details); any check that ran work on the host instead of the device
# (a dtype conversion through host memory, FP8 quantized on the host)
# fails, naming it. Exit status: 0 all passed, 1 a check failed (or, with
# --dry-run, the plan does not fit), 2 the GPU or the carried build is
# missing. GPU_CHECK_CARRY overrides the carried folder (tests).
set -euo pipefail
cd "$(dirname "$0")/.."

CARRY=${GPU_CHECK_CARRY:-target/gpu-carry}
BIN=$CARRY/gpu_check
# The device call: at most 8 minutes, what it carries at most 64 MiB.
CALL_S=480
CARRY_LIMIT=$((64 << 20))
# The whole run ends within RUN_S (each stage gets what is left, at most
# its own timeout); the Rust checks stop starting checks past RUST_BUDGET.
RUN_S=450
RUST_BUDGET=300
# Set-up outside the checks (nvidia-smi, the library links, installing the
# wheel, the record): an estimate.
OVERHEAD_S=15
# The Python checks: name|timeout s|expected s|basis|script and arguments
# ({json}: its JSON file, {dir}: the output folder).
PY_CHECKS=(
  "torch-stream|90|15|estimate: not timed apart in runs 1-8|python/tests/gpu_stream_check.py --out {json}"
  "colocated|240|120|estimate: 60-120 s on an H100 (a ~1B model's trainer and engine on one GPU), not yet run|scripts/colocated_check.py --out {dir} --json-name colocated.json"
)
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
    cargo build --release -p refit-cli --example gpu_check --features cuda
  cp target/gpu/release/examples/gpu_check "$BIN"
  rm -f "$CARRY"/*.whl
  # The Python package with the GPU fabrics (abi3: any CPython >= 3.9).
  ( CARGO_TARGET_DIR=target/gpu-py maturin build --release --strip -m python/Cargo.toml --features cuda -o "$CARRY" )
  # What the device cannot ask git: the commit this was built from.
  local commit dirty
  commit=$(git rev-parse HEAD 2>/dev/null || echo "unknown: not a git checkout")
  if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then dirty=true; else dirty=false; fi
  printf '{"commit": "%s", "dirty": %s, "built_at": "%s"}\n' "$commit" "$dirty" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$CARRY/BUILD_INFO.json"
  ls -l "$CARRY"
}

# field N of a PY_CHECKS entry
py_field() { echo "$1" | cut -d'|' -f"$2"; }

dry_run() {
  [ -x "$BIN" ] || { echo "gpu-check: $BIN is missing: run scripts/gpu-check.sh --build first" >&2; exit 2; }
  local fits=1
  echo "device command (carry: [\"$CARRY\"]), at most ${CALL_S} s:"
  echo "  $DEVICE_COMMAND"
  echo "which runs, in order, all within ${RUN_S} s (each stage gets at most what is left):"
  echo "  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader"
  echo "  (a libnccl.so / libnvrtc.so link to the installed libnccl.so.2 / libnvrtc.so.13 on LD_LIBRARY_PATH if only those exist)"
  echo "  $BIN --root . --budget $RUST_BUDGET --out \$OUT   # each check below: $BIN --only NAME --root ."
  echo "  $BIN --record > \$OUT/run.json   # what ran, for the Python checks' files"
  echo "  python3 -m pip install -q --no-index --no-deps --target \$SITE $CARRY/*.whl   # SITE: a temporary folder"
  local entry
  for entry in "${PY_CHECKS[@]}"; do
    echo "  PYTHONPATH=\$SITE timeout $(py_field "$entry" 2) python3 $(py_field "$entry" 5 | sed 's|{json}|$OUT/'"$(py_field "$entry" 1)"'.json|; s|{dir}|$OUT|')"
    echo "    then python3 scripts/gpu_record.py --record \$OUT/run.json --check $(py_field "$entry" 1) \$OUT/$(py_field "$entry" 1).json"
  done
  echo
  echo "carried files ($CARRY):"
  local carried tree f
  carried=0
  for f in "$CARRY"/*; do
    [ -e "$f" ] || continue
    printf '  %-60s %12d bytes\n' "$f" "$(du -b "$f" | cut -f1)"
    carried=$((carried + $(du -b "$f" | cut -f1)))
  done
  [ -e "$CARRY/BUILD_INFO.json" ] && sed 's/^/  BUILD_INFO.json: /' "$CARRY/BUILD_INFO.json" || echo "  (no BUILD_INFO.json: every file's record will say the commit is unknown; run --build)"
  awk -v b="$carried" -v l="$CARRY_LIMIT" 'BEGIN { printf "  carried in all: %d bytes = %.1f MiB of %.0f MiB\n", b, b / 1048576, l / 1048576 }'
  if [ "$carried" -gt "$CARRY_LIMIT" ]; then echo "  DOES NOT FIT: the carry is over 64 MiB"; fits=0; fi
  if tree=$(git ls-files -z 2>/dev/null | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) && [ -n "$tree" ]; then
    awk -v b="$tree" 'BEGIN { printf "  working tree (tracked files, copied beside the carry): %.1f MiB\n", b / 1048576 }'
  fi
  echo
  echo "checks (timeout s, expected s, where the expected time comes from):"
  local total=0 longest=0 longest_name="" rust=0 name timeout expected basis list
  list=$("$BIN" --list) || { echo "gpu-check: $BIN --list failed" >&2; exit 2; }
  while IFS=$'\t' read -r name timeout expected basis; do
    [ -n "$name" ] || continue
    printf '  %-28s %4s %4s  %s\n' "$name" "$timeout" "$expected" "$basis"
    rust=$((rust + expected))
    if [ "$expected" -gt "$longest" ]; then longest=$expected; longest_name=$name; fi
  done <<< "$list"
  total=$rust
  for entry in "${PY_CHECKS[@]}"; do
    name=$(py_field "$entry" 1); timeout=$(py_field "$entry" 2); expected=$(py_field "$entry" 3); basis=$(py_field "$entry" 4)
    printf '  %-28s %4s %4s  %s\n' "$name (python)" "$timeout" "$expected" "$basis"
    local script
    script=$(py_field "$entry" 5 | cut -d' ' -f1)
    [ -e "$script" ] || printf '  %-28s           WARNING: %s is not in this tree (the run records it as failed)\n' "" "$script"
    total=$((total + expected))
    if [ "$expected" -gt "$longest" ]; then longest=$expected; longest_name=$name; fi
  done
  total=$((total + OVERHEAD_S))
  echo "  set-up (libraries, wheel, record)   ${OVERHEAD_S}  estimate"
  echo
  echo "expected: ${total} s in all (Rust checks ${rust} s, within their ${RUST_BUDGET} s budget); the longest check, ${longest_name} (${longest} s), run again: $((total + longest)) s of the call's ${CALL_S} s"
  echo "at most: ${RUN_S} s whatever hangs (each stage's timeout is cut to what is left of it)"
  if [ "$rust" -gt "$RUST_BUDGET" ]; then echo "DOES NOT FIT: the Rust checks expect more than their budget"; fits=0; fi
  if [ $((total + longest)) -gt "$CALL_S" ]; then echo "DOES NOT FIT: no room to re-run the longest check in one call"; fits=0; fi
  if [ "$fits" -eq 1 ]; then echo "fits"; else exit 1; fi
}

# cudarc loads libnccl.so and libnvrtc.so (or .so.12); where only the
# versioned library is installed (the nvidia-nccl / nvidia-cuda-nvrtc
# wheels, CUDA 13's libnvrtc.so.13), link it under the plain name.
SHIM=""
SITE=""
cleanup() { rm -rf "$SHIM" "$SITE"; }
shim_libraries() {
  local found lib want
  SHIM=$(mktemp -d)
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

START=$(date +%s)
# Seconds a stage may take: its own timeout, cut to what is left of RUN_S.
stage_limit() {
  local left=$((RUN_S - ($(date +%s) - START)))
  if [ "$left" -lt "$1" ]; then echo $((left > 1 ? left : 1)); else echo "$1"; fi
}

# The carried wheel, installed once into a temporary folder (WHEEL: ok or
# failed, once tried).
WHEEL=""
install_wheel() {
  if [ -z "$WHEEL" ]; then
    SITE=$(mktemp -d)
    if python3 -m pip install -q --no-index --no-deps --target "$SITE" "$CARRY"/*.whl; then WHEEL=ok; else WHEEL=failed; fi
  fi
  [ "$WHEEL" = ok ]
}

# Runs the Python check NAME (a PY_CHECKS entry) within its timeout; its
# JSON in $out/NAME.json with the record; returns its exit status.
run_py() {
  local entry="" e name status=0 limit args script
  for e in "${PY_CHECKS[@]}"; do [ "$(py_field "$e" 1)" = "$1" ] && entry=$e; done
  name=$1
  [ -f "$out/run.json" ] || "$BIN" --record > "$out/run.json" || true
  args=$(py_field "$entry" 5 | sed "s|{json}|$out/$name.json|; s|{dir}|$out|")
  script=${args%% *}
  rm -f "$out/$name.json"
  if [ ! -e "$script" ]; then
    printf '{"check": "%s", "ok": false, "line": "%s is missing from this tree"}\n' "$name" "$script" > "$out/$name.json"
    status=1
  elif ! install_wheel; then
    printf '{"check": "%s", "ok": false, "line": "cannot install the carried wheel"}\n' "$name" > "$out/$name.json"
    status=1
  else
    limit=$(stage_limit "$(py_field "$entry" 2)")
    # shellcheck disable=SC2086 # the arguments are words
    # Killed 10 s after the timeout's SIGTERM if it has not ended by then.
    PYTHONPATH="$SITE" timeout --kill-after=10 "$limit" python3 $args || status=$?
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then echo "gpu-check: $name: no answer within ${limit} s" >&2; fi
  fi
  python3 scripts/gpu_record.py --record "$out/run.json" --check "$name" "$out/$name.json" || status=1
  echo "gpu-check: $name exit $status" >&2
  return "$status"
}

is_py_check() {
  local e
  for e in "${PY_CHECKS[@]}"; do [ "$(py_field "$e" 1)" = "$1" ] && return 0; done
  return 1
}

run() {
  [ -x "$BIN" ] || { echo "gpu-check: $BIN is missing: build it where cargo is (scripts/gpu-check.sh --build) and carry $CARRY" >&2; exit 2; }
  out=${out:-target/gpu-check-out}
  mkdir -p "$out"
  trap cleanup EXIT
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || true
  shim_libraries
  local status=0 py=0 entry
  if [ -n "$only" ]; then
    # One check, in its own process, its JSON to DIR/NAME.json (for a
    # device session with little time left).
    if is_py_check "$only"; then
      run_py "$only" || status=$?
    else
      timeout "$(stage_limit "$RUST_BUDGET")" "$BIN" --only "$only" --root . > "$out/$only.json" || status=$?
    fi
    cat "$out/$only.json"
    exit "$status"
  fi
  "$BIN" --root . --budget "$(stage_limit "$RUST_BUDGET")" --out "$out" || status=$?
  if [ "$status" -eq 2 ]; then exit 2; fi
  for entry in "${PY_CHECKS[@]}"; do
    run_py "$(py_field "$entry" 1)" || py=1
  done
  echo "gpu-check: Rust checks exit $status, Python checks $([ "$py" -eq 0 ] && echo passed || echo failed); results in $out" >&2
  if [ "$status" -ne 0 ] || [ "$py" -ne 0 ]; then exit 1; fi
}

case "$mode" in
  build) build ;;
  dry) dry_run ;;
  run) run ;;
esac
