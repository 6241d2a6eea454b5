"""refit into every vLLM front end, as RL loops run them: ``LLM``,
``AsyncLLM`` and the OpenAI-compatible server, on vLLM's CPU build as
shipped (skipped where `import vllm` fails).

Every engine serves prompts longer than two KV blocks, twice, before and
after each refit (so its prefix cache holds whole blocks of them), and
every generation is compared with a fresh engine loaded from the same
checkpoint: an engine started from checkpoint B generates the reference
before any refit; after refitting A it generates as Hugging Face's A
does; after refitting B back it generates the reference exactly (tokens
and top-5 logprobs), the repeated prompts too. An engine that continued
cached prompts from the KV of the weights it had before fails both.

Also: training layouts an engine cannot take are refused at connect by
name, as ``LayoutError``, and the next good connect on the same engine
succeeds (TP 2: every worker answers, none is left out of step); vLLM's
own trainer-side API (``WeightTransferTrainerFactory``) drives refit's
engine through ``AsyncLLM`` and through vLLM's ``HTTPVLLMWeightSyncClient``;
a load that fails in one of two replicas leaves that replica scheduling
nothing (no client gets tokens from its torn model) until the next good
load, the other serving the new version.
"""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import torch  # noqa: E402

import refit  # noqa: E402
import refit.vllm  # noqa: E402
from test_vllm_refit import dense_config, save  # noqa: E402
from vllm_engines import (  # noqa: E402
    BLOCK,
    LONG_MODEL_LEN,
    LONG_PROMPTS,
    TRAIN_RANKS,
    Trainer,
    assert_same,
    engine_args,
    generate,
    hf_tokens,
    sampling,
    start,
    stop,
    tokens_and_top,
    train_layout,
)

TOP = 5


def tokens(got):
    return [t for t, _ in got]


def checkpoints(tmp_path):
    """Checkpoints A and B of one dense Qwen2 (two KV heads); Hugging
    Face's greedy tokens of A for LONG_PROMPTS; B's tensors."""
    config = dense_config(2)
    _, model_a, state_a = save(config, tmp_path / "a", seed=0)
    path_b, _, state_b = save(config, tmp_path / "b", seed=1)
    return path_b, state_a, state_b, hf_tokens(model_a, LONG_PROMPTS)


def bad_layouts(state):
    """Training layouts no engine of ``state``'s model can take, each with
    what its refusal must say."""
    wide = dict(state)
    name = "model.layers.0.self_attn.o_proj.weight"
    wide[name] = torch.cat([state[name], torch.zeros(state[name].shape[0], 8)], 1)
    no_norm = {n: t for n, t in state.items() if n != "model.norm.weight"}
    transposed = dict(state)
    transposed["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"].t()
    b = refit.LayoutBuilder(TRAIN_RANKS, None)
    for n, t in state.items():
        shape = list(t.shape)
        placement = "shard(0)" if shape[0] >= TRAIN_RANKS else "replicate"
        b = b.tensor(refit.TensorBuilder(n, "i32" if n == "model.norm.weight" else "f32", shape).mesh([TRAIN_RANKS], [placement]).buffer(n, 0))
    return [
        (train_layout(wide), r"tensor 'model\.layers\.0\.self_attn\.o_proj\.weight' \[128, 136\] f32: 1024 of its 17408 elements land in no parameter .*\[0:128, 128:136\]"),
        (train_layout(no_norm), r"no tensor of the training layout loads 1 parameter.*'model\.norm\.weight'"),
        (b.build(), r"tensor 'model\.norm\.weight' is i32 in the training layout .* parameter\(s\) of another kind: 'model\.norm\.weight' \[128\] float32"),
        (train_layout(transposed), r"tensor 'model\.layers\.0\.mlp\.down_proj\.weight' \[256, 128\] f32: the model's load_weights refused it \(loading it into parameter 'model\.layers\.0\.mlp\.down_proj\.weight' \[128, \d+\] float32\)"),
    ]


def test_llm_at_tp2_refits_long_cached_prompts_and_refuses_what_does_not_fit(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fail_the_next_load)
    path_b, state_a, state_b, hf_a = checkpoints(tmp_path)
    llm = start(path_b, 2, long=True)
    orch = refit.Orchestrator(deadline=20.0)
    try:
        want_b = generate(llm, LONG_PROMPTS, TOP)
        assert_same(generate(llm, LONG_PROMPTS, TOP), want_b)  # cached

        capfd.readouterr()
        for layout, says in bad_layouts(state_b):
            with pytest.raises(refit.LayoutError, match=says):
                refit.vllm.VLLMRollouts(orch, [llm], layout, dtype="f32").connect(src_ranks=TRAIN_RANKS, timeout=5)
        logged = capfd.readouterr()
        # The refusals reach the caller only: vLLM logs no traceback of them.
        assert "[refit LayoutError" not in logged.err + logged.out, logged.err[-3000:]
        assert_same(generate(llm, LONG_PROMPTS, TOP), want_b)

        train = train_layout(state_b)
        trainer = Trainer(train, state_b, orch)
        rollouts = refit.vllm.VLLMRollouts(orch, [llm], train, dtype="f32")
        rollouts.connect(src_ranks=TRAIN_RANKS)
        report = rollouts.refit(trainer.step(state_a))
        assert report.refit.bytes > 0 and len(report.load_seconds) == 1
        for _ in range(2):  # the second from the prefix cache of A's KV
            assert tokens(generate(llm, LONG_PROMPTS, TOP)) == hf_a
        v = trainer.step(state_b)
        rollouts.refit(v)
        for _ in range(2):
            assert_same(generate(llm, LONG_PROMPTS, TOP), want_b)
        assert llm.get_weight_version() == str(v)

        # A load that fails half-way on worker 0 only: one error naming it
        # (from the last worker), every reply read; loading again succeeds.
        llm.collective_rpc(fail_the_next_load, kwargs={"only_worker": 0})
        v = trainer.step(state_a)
        with pytest.raises(refit.RefitError, match=r"engine 0: loading version .* failed on 1 of 2 worker\(s\): worker 0: .*half-way.*torn"):
            rollouts.refit(v)
        rollouts.load(v)
        assert tokens(generate(llm, LONG_PROMPTS, TOP)) == hf_a
        assert llm.get_weight_version() == str(v)
    finally:
        orch.close()
        stop(llm)


# --- AsyncLLM --------------------------------------------------------------


async def astart(path):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(path, 1, long=True)))


async def agenerate(engine, prompts, logprobs=TOP, max_tokens=None):
    """Greedy generation of ``prompts`` at once; each prompt's (tokens, top)
    and the final output (its ``weight_versions``)."""
    params = sampling(logprobs)
    if max_tokens is not None:
        params.max_tokens = max_tokens

    async def one(prompt):
        final = None
        async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id=uuid.uuid4().hex):
            final = out
        return final.outputs[0]

    outs = await asyncio.gather(*(one(p) for p in prompts))
    return [tokens_and_top(o) for o in outs], outs


def fail_the_next_load(worker, only_worker=None):
    """(Run in a worker by collective_rpc.) The next load hands half of the
    version to the model's loading, then fails: the model is torn. Only
    on the engine's worker ``only_worker`` if given."""
    engine = worker.weight_transfer_engine
    if only_worker is not None and engine.workers.rank != only_worker:
        return
    model = engine.model
    load = model.load_weights

    def half(weights):
        del model.load_weights  # once
        items = list(weights)
        load(iter(items[: len(items) // 2]))
        raise RuntimeError("the load failed half-way (injected by the test)")

    model.load_weights = half


def test_async_engines_refit_while_generating_and_a_torn_replica_serves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fail_the_next_load)
    asyncio.run(_async_engines(tmp_path))


async def _async_engines(tmp_path):
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    path_b, state_a, state_b, hf_a = checkpoints(tmp_path)
    engines = [await astart(path_b), await astart(path_b)]
    orch = refit.Orchestrator(deadline=20.0)
    loop = asyncio.get_running_loop()
    try:
        want_b, _ = await agenerate(engines[0], LONG_PROMPTS)
        for e in engines:
            assert_same((await agenerate(e, LONG_PROMPTS))[0], want_b)

        train = train_layout(state_b)
        trainer = Trainer(train, state_b, orch)
        # vLLM's own trainer-side API, one AsyncLLM client per replica.
        info = refit.vllm.RefitTrainerInitInfo(rank=0, orchestrator=orch, layout=train, src_ranks=TRAIN_RANKS, dtype="f32")
        clients = [refit.vllm.client_of(e) for e in engines]
        sender = await loop.run_in_executor(None, lambda: WeightTransferTrainerFactory.trainer_init(info, client=clients))

        # A refit while engine 0 streams a long generation: the stream goes
        # on, and says which tokens came from which version.
        stream = asyncio.create_task(agenerate(engines[0], LONG_PROMPTS[:1], max_tokens=40))
        v = trainer.step(state_a)
        report = await loop.run_in_executor(None, sender.send_weights)
        assert report.version == v and len(report.load_seconds) == 2
        (_, (streamed,)) = await stream
        assert len(streamed.token_ids) == 40
        spans = [(s.version, s.start, s.end) for s in streamed.weight_versions]
        assert [s[1] for s in spans] == [0] + [s[2] for s in spans[:-1]] and spans[-1][2] == 40, spans
        assert {s[0] for s in spans} <= {"default", str(v)}, spans
        for e in engines:
            for _ in range(2):
                assert tokens((await agenerate(e, LONG_PROMPTS))[0]) == hf_a
            assert await e.get_weight_version() == str(v)

        # The next load fails half-way on replica 1: it is refused naming the
        # engine; replica 0 serves the new version; replica 1 serves nothing
        # (a request waits) and cannot be resumed by hand.
        await engines[1].collective_rpc(fail_the_next_load)
        v2 = trainer.step(state_b)
        with pytest.raises(refit.RefitError, match=r"engine 1: loading version .* failed on 1 of 1 worker.*half-way.*torn"):
            await loop.run_in_executor(None, sender.send_weights)
        assert_same((await agenerate(engines[0], LONG_PROMPTS))[0], want_b)
        held = asyncio.create_task(agenerate(engines[1], LONG_PROMPTS))
        await asyncio.sleep(3)
        assert not held.done(), "a torn engine generated"
        with pytest.raises(Exception, match="torn by a failed load"):
            await engines[1].resume_generation()

        # The next good load: the held requests are served, from version v2.
        await loop.run_in_executor(None, sender.rollouts.load, v2)
        got, _ = await asyncio.wait_for(held, 60)
        assert_same(got, want_b)
        for e in engines:
            assert await e.get_weight_version() == str(v2)
    finally:
        orch.close()
        for e in engines:
            e.shutdown()


# --- the OpenAI-compatible server -------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def serve(path, port, log):
    """``vllm serve`` (as a module: the same server) with refit's backend and
    vLLM's weight-update routes (``VLLM_SERVER_DEV_MODE=1``)."""
    args = engine_args(path, 1, long=True)
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", path, "--port", str(port), "--host", "127.0.0.1",
        "--skip-tokenizer-init", "--dtype", args["dtype"], "--enforce-eager",
        "--max-model-len", str(LONG_MODEL_LEN), "--block-size", str(BLOCK), "--enable-prefix-caching",
        "--max-num-seqs", str(args["max_num_seqs"]), "--seed", "0", "--enable-scale-out",
        "--weight-transfer-config", json.dumps({"backend": refit.vllm.BACKEND}),
    ]  # fmt: skip
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise AssertionError("the server did not answer /health in 300 s")


def complete(base, prompts):
    """Greedy generation of token-id prompts by the server's token-in,
    token-out route (RL frameworks' way: no tokenizer needed): tokens and
    top-5 logprobs of each."""
    out = []
    for p in prompts:
        params = {"max_tokens": 6, "temperature": 0.0, "logprobs": TOP, "detokenize": False}
        choice = _post(f"{base}/inference/v1/generate", {"token_ids": p, "sampling_params": params})["choices"][0]
        top = [sorted((c["token_id"], c["logprob"]) for c in step["top_logprobs"]) for step in choice["logprobs"]["content"]]
        out.append((list(choice["token_ids"]), top))
    return out


def test_server_refits_through_vllms_own_http_client(tmp_path):
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    path_b, state_a, state_b, hf_a = checkpoints(tmp_path)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with open(tmp_path / "server.log", "wb") as log:
        server = serve(path_b, port, log)
    orch = refit.Orchestrator(deadline=20.0)
    try:
        want_b = complete(base, LONG_PROMPTS)
        assert_same(complete(base, LONG_PROMPTS), want_b)

        # A refusal arrives whole through refit's HTTP client; the next
        # connect succeeds.
        layout, says = bad_layouts(state_b)[0]
        with pytest.raises(refit.LayoutError, match=says):
            refit.vllm.VLLMRollouts(orch, [base], layout, dtype="f32").connect(src_ranks=TRAIN_RANKS, timeout=5)

        train = train_layout(state_b)
        trainer = Trainer(train, state_b, orch)
        info = refit.vllm.RefitTrainerInitInfo(rank=0, orchestrator=orch, layout=train, src_ranks=TRAIN_RANKS, world_size=1, dtype="f32")
        sender = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(base))
        v = trainer.step(state_a)
        assert sender.send_weights().version == v
        for _ in range(2):
            assert tokens(complete(base, LONG_PROMPTS)) == hf_a
        trainer.step(state_b)
        sender.send_weights()
        for _ in range(2):
            assert_same(complete(base, LONG_PROMPTS), want_b)
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert 'vllm:rl_weight_update_operation_duration_seconds_count{operation="update"' in metrics
    finally:
        orch.close()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
