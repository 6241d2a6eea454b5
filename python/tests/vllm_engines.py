"""Helpers of the tests (and benchmarks) that run vLLM's CPU build: engines
started for refit, greedy generation compared, and training ranks in the
test's own process. Not a test module (pytest collects nothing here)."""

import gc
import os

import pytest
import torch

import refit
import refit.vllm

PROMPTS = [[1, 2, 3, 4, 5], [17, 42, 99], [250, 7, 7, 7, 120, 3]]
MAX_TOKENS = 6
TRAIN_RANKS = 2

# Prompts longer than two KV blocks of BLOCK tokens (so an engine that
# served them holds whole blocks of them in its prefix cache), for engines
# started with block_size=BLOCK and max_model_len=LONG_MODEL_LEN.
BLOCK = 32
LONG_MODEL_LEN = 128
_ids = torch.Generator().manual_seed(5)
LONG_PROMPTS = [torch.randint(1, 300, (n,), generator=_ids).tolist() for n in (80, 97, 71)]


SHM = "/dev/shm"


def _vllm_shm():
    """vLLM's shared-memory files (its CPU backend's, with TP > 1)."""
    try:
        return {n for n in os.listdir(SHM) if n.startswith("vllm_")}
    except FileNotFoundError:
        return set()


def engine_args(model, tp, ep=False, long=False):
    """The engine arguments of every engine of the tests (``long``: for
    LONG_PROMPTS, with prefix caching in blocks of BLOCK tokens)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp > 1:
        # One NUMA node here: bind rank r to core r.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r) for r in range(tp))
    args = dict(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        enable_expert_parallel=ep,
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=4,
        seed=0,
        weight_transfer_config={"backend": refit.vllm.BACKEND},
    )
    if long:
        args.update(max_model_len=LONG_MODEL_LEN, block_size=BLOCK, enable_prefix_caching=True)
    return args


def start(model, tp, ep=False, long=False):
    from vllm import LLM

    before = _vllm_shm()
    llm = LLM(**engine_args(model, tp, ep, long))
    # What this engine made in /dev/shm, for `stop` to remove: vLLM's
    # shutdown leaves its CPU backend's files behind.
    llm._refit_shm = _vllm_shm() - before
    return llm


def stop(llm):
    made = getattr(llm, "_refit_shm", set())
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    for name in made:
        try:
            os.unlink(os.path.join(SHM, name))
        except FileNotFoundError:
            pass


def sampling(logprobs=3):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False, logprobs=logprobs)


def generate(llm, prompts=None, logprobs=3, lora=None):
    """Greedy generation of ``prompts`` (default PROMPTS), with LoRA
    adapter ``lora`` (a ``LoRARequest``) if given: for each, the tokens and
    the top-``logprobs`` (token, logprob) of every step."""
    prompts = PROMPTS if prompts is None else prompts
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling(logprobs), use_tqdm=False, lora_request=lora)
    return [tokens_and_top(o.outputs[0]) for o in outs]


def tokens_and_top(completion):
    top = [sorted((t, lp.logprob) for t, lp in step.items()) for step in completion.logprobs]
    return (list(completion.token_ids), top)


def hf_tokens(model, prompts=None):
    out = []
    with torch.no_grad():
        for p in PROMPTS if prompts is None else prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def assert_same(got, want):
    for (g_tok, g_top), (w_tok, w_top) in zip(got, want):
        assert g_tok == w_tok
        for gs, ws in zip(g_top, w_top):
            assert [t for t, _ in gs] == [t for t, _ in ws]
            assert [lp for _, lp in gs] == pytest.approx([lp for _, lp in ws], abs=1e-5)


def train_layout(state):
    """The checkpoint's tensors on TRAIN_RANKS ranks, f32, rows split where
    there are enough rows (else replicated), each block in a buffer named
    as the tensor."""
    b = refit.LayoutBuilder(TRAIN_RANKS, None)
    for name, t in state.items():
        shape = list(t.shape)
        placement = "shard(0)" if shape and shape[0] >= TRAIN_RANKS else "replicate"
        b = b.tensor(refit.TensorBuilder(name, "f32", shape).mesh([TRAIN_RANKS], [placement]).buffer(name, 0))
    return b.build()


class Trainer:
    """TRAIN_RANKS in-place sources over torch tensors, in this process."""

    def __init__(self, layout, state, orch):
        self.blocks = []
        self.sources = []
        self.joined = refit.join(orch.address, orch.secret)
        for rank in range(TRAIN_RANKS):
            blocks = {}
            for name, _, offset, extent in layout.blocks(rank):
                blocks[name] = (offset, extent, torch.zeros(extent, dtype=torch.float32))
            src = refit.Source.in_place(layout, rank, {n: t for n, (_, _, t) in blocks.items()})
            src.join(joined=self.joined)
            self.blocks.append(blocks)
            self.sources.append(src)

    def step(self, state):
        versions = set()
        for src, blocks in zip(self.sources, self.blocks):
            with src.stepping():
                for name, (offset, extent, t) in blocks.items():
                    t.copy_(state[name][tuple(slice(o, o + e) for o, e in zip(offset, extent))])
            versions.add(src.version)
        assert len(versions) == 1
        return versions.pop()
