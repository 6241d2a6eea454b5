"""A LoRA adapter's update into a running vLLM (CPU build), side by side in
one run (docs/benchmarks.md, "vLLM: LoRA adapters"):

- **refit in memory**: after each optimizer step of two FSDP2 trainer
  processes (a PEFT adapter on every linear module of a Qwen2 policy),
  ``rollouts.refit(version)`` with ``refit.vllm.VLLMRollouts(...,
  adapter=refit.lora.Adapter(...))``: the adapter's shards move straight
  into the engine's worker, which builds the adapter and puts it in place
  of the previous one (the whole call: plan, transfer, commit, load).
- **save and load from disk**: what users do without it: the adapter
  gathered whole on the trainers (``full_tensor()``) and written by PEFT's
  ``save_pretrained`` (rank 0), then vLLM's own load of it in place of the
  previous version (``add_lora`` of a ``LoRARequest`` with
  ``load_inplace=True``, as the server's ``/v1/load_lora_adapter`` does),
  each timed.

After every step both versions are served (greedy, token ids) and must be
equal. Random weights, nothing downloaded; the trainers and the engine share
the machine's cores (on 2 cores, both ways wait on the same CPUs).

    target/vllm-env/bin/python benchmarks/vllm_lora.py [--hidden 768] [--layers 12] [--vocab 32000] [--rank 16] [--steps 5]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))

import refit  # noqa: E402
import refit.lora  # noqa: E402
import refit.vllm  # noqa: E402
from lora_trainers import Trainers  # noqa: E402
from vllm_engines import PROMPTS, engine_args, generate, stop  # noqa: E402


def span(xs):
    return f"{min(xs):.1f}–{max(xs):.1f}" if len(xs) > 1 else f"{xs[0]:.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    from vllm import LLM
    from vllm.lora.request import LoRARequest

    work = tempfile.mkdtemp(prefix="refit-vllm-lora-")
    base = os.path.join(work, "base")
    orch = refit.Orchestrator(deadline=120.0)
    size = dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab)
    trainers = Trainers(orch, base, size=size, rank_r=args.rank)
    llm = None
    try:
        engine = engine_args(base, 1)
        engine.update(enable_lora=True, max_loras=2, max_lora_rank=args.rank, max_cpu_loras=2)
        llm = LLM(**engine)
        adapter = refit.lora.Adapter("policy", 1, trainers.config)
        rollouts = refit.vllm.VLLMRollouts(orch, [llm], trainers.layout, adapter=adapter)
        plan = rollouts.connect(src_ranks=2)
        print(f"Qwen2 hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}; LoRA r={args.rank} on every linear module: {plan.bytes:,} bytes of adapter (f32)")
        rows = []
        for step in range(args.steps):
            version = trainers.step()
            report = rollouts.refit(version)
            path = os.path.join(work, f"adapter-{step}")
            saved = trainers.save(path)
            disk = LoRARequest("disk", 2, path, load_inplace=True)
            t = time.perf_counter()
            llm.llm_engine.add_lora(disk)
            loaded = time.perf_counter() - t
            same = [tokens for tokens, _ in generate(llm, PROMPTS, lora=adapter.request())] == [
                tokens for tokens, _ in generate(llm, PROMPTS, lora=disk)
            ]
            rows.append((report.seconds, report.refit.transfer_seconds, sum(report.load_seconds), saved, loaded, same))
            print(
                f"step {step}: refit {1e3 * report.seconds:.1f} ms (transfer {1e3 * report.refit.transfer_seconds:.1f}, "
                f"load {1e3 * sum(report.load_seconds):.1f}); save {1e3 * saved:.1f} ms + load from disk {1e3 * loaded:.1f} ms; "
                f"same tokens: {same}"
            )
        later = rows[1:] or rows
        refit_ms = [1e3 * r[0] for r in later]
        disk_ms = [1e3 * (r[3] + r[4]) for r in later]
        print(
            f"after the first step: refit in memory {span(refit_ms)} ms (median {statistics.median(refit_ms):.1f}); "
            f"save + load from disk {span(disk_ms)} ms (median {statistics.median(disk_ms):.1f}): "
            f"{statistics.median(disk_ms) / statistics.median(refit_ms):.1f}x"
        )
        if not all(r[5] for r in rows):
            print("FAILED: the refitted adapter and vLLM's load of the saved one generate differently")
            sys.exit(1)
    finally:
        trainers.close()
        orch.close()
        if llm is not None:
            stop(llm)


if __name__ == "__main__":
    main()
