"""A LoRA adapter refitted in memory into a running vLLM (vLLM's CPU build,
as shipped): FSDP2 trainers (two processes, gloo) train a PEFT adapter on a
Qwen2 policy; after each optimizer step refit moves the adapter's shards
straight into the engine's LoRA manager (``refit.lora.Adapter``), no file
written. Checked as users serve it: prompts longer than a KV block, served
with the adapter before and after each refit (prefix caching on); every
refitted version generates exactly as vLLM's own load of the same adapter
from disk (PEFT's ``save_pretrained``, then a ``LoRARequest`` of its
directory); a refit that fails (a trainer's step torn) leaves the previous
adapter serving, and the next refit succeeds; the base weights are never
touched. Also prints the time of each refit (with the engine's load of the
adapter) beside saving the adapter and loading it through vLLM's own path.

No download: the policy is a tiny random-weight model made here with
transformers, the prompts token ids.
"""

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
pytest.importorskip("peft")

import refit  # noqa: E402
import refit.lora  # noqa: E402
import refit.vllm  # noqa: E402
from lora_trainers import Trainers  # noqa: E402
from vllm_engines import LONG_PROMPTS, assert_same, engine_args, generate, stop  # noqa: E402

STEPS = 3
RANK = 8


def start_lora(base):
    from vllm import LLM

    args = engine_args(base, 1, long=True)
    args.update(enable_lora=True, max_loras=2, max_lora_rank=RANK, max_cpu_loras=3)
    return LLM(**args)


def disk_load(llm, path, lora_id):
    """vLLM's own load of the adapter saved at ``path`` (as its
    ``/v1/load_lora_adapter`` does): the request, and the seconds."""
    import time

    from vllm.lora.request import LoRARequest

    request = LoRARequest(f"disk-{lora_id}", lora_id, str(path))
    t = time.perf_counter()
    assert llm.llm_engine.add_lora(request)
    return request, time.perf_counter() - t


def one_tensor_layout(name, shape):
    b = refit.LayoutBuilder(2, None)
    return b.tensor(refit.TensorBuilder(name, "f32", list(shape)).mesh([2], ["shard(0)"]).buffer(name, 0)).build()


def refused_at_connect(orch, llm, adapter):
    """Adapter layouts the engine cannot apply fail at connect, naming the
    tensor (an adapter of zeros shaped as the layout is built and activated
    into a LoRA slot, then removed), and the engine serves on."""
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    with pytest.raises(refit.LayoutError, match=r"do not fit the engine's LoRA slots"):
        refit.vllm.VLLMRollouts(orch, [llm], one_tensor_layout(q_a, [RANK, 96]), adapter=adapter).connect(src_ranks=2, timeout=5)
    rotary = "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight"
    with pytest.raises(refit.LayoutError, match=r"tensor '.*rotary\.lora_A\.weight' is of module .* which this engine applies no LoRA to"):
        refit.vllm.VLLMRollouts(orch, [llm], one_tensor_layout(rotary, [RANK, 128]), adapter=adapter).connect(src_ranks=2, timeout=5)
    wide = refit.lora.Adapter("policy", 1, dict(adapter.config, r=4 * RANK))
    with pytest.raises(refit.LayoutError, match=r"the engine refuses its config"):
        refit.vllm.VLLMRollouts(orch, [llm], one_tensor_layout(q_a, [4 * RANK, 128]), adapter=wide).connect(src_ranks=2, timeout=5)


def test_lora_adapter_refits_equal_vllms_own_load_and_a_failed_refit_keeps_the_previous(tmp_path):
    orch = refit.Orchestrator(deadline=20.0)
    trainers = Trainers(orch, str(tmp_path / "base"), rank_r=RANK)
    llm = None
    try:
        llm = start_lora(str(tmp_path / "base"))
        adapter = refit.lora.Adapter("policy", 1, trainers.config)
        refused_at_connect(orch, llm, adapter)
        rollouts = refit.vllm.VLLMRollouts(orch, [llm], trainers.layout, adapter=adapter)
        plan = rollouts.connect(src_ranks=2)
        base = generate(llm, LONG_PROMPTS)

        timings = []
        want = None
        for step in range(STEPS):
            version = trainers.step()
            report = rollouts.refit(version)
            saved = trainers.save(tmp_path / f"adapter-{step}")
            disk, load = disk_load(llm, tmp_path / f"adapter-{step}", 100 + step)
            timings.append((report.seconds, saved, load))
            # Served twice (the second from the prefix cache), each time
            # exactly as vLLM's own load of the same adapter.
            want = generate(llm, LONG_PROMPTS, lora=disk)
            for _ in range(2):
                assert_same(generate(llm, LONG_PROMPTS, lora=adapter.request()), want)
            assert [t for t, _ in want] != [t for t, _ in base], "the adapter changes nothing: the test would prove nothing"

        # A refit that fails (rank 1's step torn): the previous adapter
        # serves on; then the next refit succeeds.
        torn = trainers.tear(1)
        with pytest.raises(refit.RefitError):
            rollouts.refit(torn)
        assert_same(generate(llm, LONG_PROMPTS, lora=adapter.request()), want)
        version = trainers.step()
        rollouts.refit(version)
        trainers.save(tmp_path / "adapter-after")
        disk, _ = disk_load(llm, tmp_path / "adapter-after", 200)
        assert_same(generate(llm, LONG_PROMPTS, lora=adapter.request()), generate(llm, LONG_PROMPTS, lora=disk))

        # The base weights untouched by every adapter refit.
        assert_same(generate(llm, LONG_PROMPTS), base)
        print(f"adapter: {plan.bytes} bytes per refit")
        for refit_s, save_s, load_s in timings:
            print(f"refit with the load {1e3 * refit_s:.1f} ms; PEFT save {1e3 * save_s:.1f} ms + vLLM's load from disk {1e3 * load_s:.1f} ms")
    finally:
        trainers.close()
        orch.close()
        if llm is not None:
            stop(llm)
