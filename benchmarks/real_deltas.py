#!/usr/bin/env python3
"""What real training changes between two refits, and what refit's delta
sends for it.

A transformers Qwen2 built from a config (random weights, nothing
downloaded) trains with AdamW on next-token loss over a fixed synthetic
corpus (or, `--objective reinforce`, on a REINFORCE loss over completions
it samples itself), f32 masters; after every optimizer step the bf16 weights an
inference engine would hold are compared with the step before:

- the fraction of bf16 elements that changed, and their structure: the
  mean run of consecutive changed elements, the rows (of 2-D weights) with
  any change, the tensors with any change;
- the information in the change: the changed values (2 bytes each) plus
  the entropy of their positions, taken per tensor as independent draws
  (n·H(p) bits for p of n elements changed);
- what refit's delta refit sends (`spawn_local(..., delta=True)`: one
  source rank with the f32 masters, two bf16 destination ranks splitting
  every 2-D weight by rows; the report's bytes), against the dense refit's
  bytes; and what the index and bitmap forms alone (the delta encoder
  before the gaps form) would send, estimated per tensor;
- encode and decode rates of the delta codec on the whole model's bf16
  bytes (`transport/examples/delta_codec`, one core), beside a copy of the
  same bytes.

    python3 benchmarks/real_deltas.py [--sizes 150m,1b] [--lrs 1e-6,1e-5,1e-4]
        [--steps 4] [--warmup 2] [--objective next-token|reinforce] [--json OUT]

Needs torch, transformers, numpy and the refit package; builds the codec
example with cargo. The 1B model skips the refit (its stores would not fit
beside AdamW's state in 24 GiB) and measures the codec on its weights in
chunks of 512 MiB.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SIZES = {
    # ~153M parameters.
    "150m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4),
    # ~0.85B parameters.
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4),
}


def model_of(size, seed):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=False, **SIZES[size])
    return Qwen2ForCausalLM(config).float()


def corpus(seed, batch, seq, vocab=32000):
    """A fixed synthetic corpus with structure to learn: a Zipf-like token
    distribution and repeated phrases."""
    rng = np.random.default_rng(seed)
    phrases = rng.zipf(1.3, size=(64, 16)) % vocab
    rows = []
    for _ in range(batch):
        picks = rng.integers(0, len(phrases), seq // 16 + 1)
        rows.append(np.concatenate([phrases[p] for p in picks])[:seq])
    return torch.tensor(np.stack(rows), dtype=torch.long)


GOOD = 3200  # REINFORCE: completion tokens below this id earn reward (a tenth of the vocabulary)


def objective_loss(model, data, args):
    """The step's loss: next-token on the corpus, or REINFORCE with a mean
    baseline on completions the model samples itself (`args.gen` tokens
    after the first 16 of each corpus row; reward: the fraction of
    completion tokens with ids below GOOD), as `examples/vllm_rl.py`
    trains."""
    if args.objective == "next-token":
        return model(input_ids=data[:, :-1], labels=data[:, :-1]).loss
    prompts = data[:, :16]
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.gen, min_new_tokens=args.gen, do_sample=True, top_k=0, pad_token_id=0)
    completions = out[:, prompts.shape[1] :]
    rewards = (completions < GOOD).float().mean(dim=1)
    advantage = rewards - rewards.mean()
    logits = model(input_ids=out).logits[:, prompts.shape[1] - 1 : -1]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(2, completions[:, :, None]).squeeze(2).sum(dim=1)
    return -(advantage * logp).mean()


def bf16_bits(param):
    return param.detach().to(torch.bfloat16).view(torch.int16).numpy().copy()


def entropy_bits(n, c):
    if c == 0 or c == n:
        return 0.0
    p = c / n
    return n * -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def change_stats(before, after):
    """Per step: elements, changed, runs, rows touched, tensors touched,
    the information bound, and the index/bitmap forms' bytes (per tensor)."""
    s = dict(elements=0, changed=0, runs=0, rows=0, rows_touched=0, tensors=0, tensors_touched=0, bound=0.0, listed=0)
    for name, a in after.items():
        b = before[name]
        diff = a != b
        n, c = diff.size, int(diff.sum())
        s["elements"] += n
        s["changed"] += c
        s["tensors"] += 1
        s["tensors_touched"] += int(c > 0)
        flat = diff.ravel()
        # Runs: changed elements whose predecessor did not change.
        s["runs"] += int(flat[0]) + int(np.count_nonzero(flat[1:] & ~flat[:-1])) if n else 0
        if diff.ndim == 2:
            s["rows"] += diff.shape[0]
            s["rows_touched"] += int(diff.any(axis=1).sum())
        s["bound"] += 2 * c + entropy_bits(n, c) / 8
        # The encoder before the gaps form: the shortest of dense, bitmap,
        # indices (and its 26-byte header).
        s["listed"] += 26 + min(2 * n, (n + 7) // 8 + 2 * c, 6 * c)
    return s


def layouts(params):
    import refit

    src = refit.LayoutBuilder(1)
    dst = refit.LayoutBuilder(2)
    for name, p in params.items():
        shape = list(p.shape)
        src = src.tensor(refit.TensorBuilder(name, "f32", shape).mesh([1], ["replicate"]))
        split = "shard(0)" if len(shape) == 2 and shape[0] % 2 == 0 else "replicate"
        dst = dst.tensor(refit.TensorBuilder(name, "bf16", shape).mesh([2], [split]))
    return src.build(), dst.build()


class Refits:
    """One source rank (the f32 masters, copied in at each step) and two
    bf16 destination ranks, delta refits after the first."""

    def __init__(self, params):
        import refit

        src, dst = layouts(params)
        self.system = refit.spawn_local(src, dst, delta=True, deadline=600.0)
        self.params = params
        (self.source,) = self.system.sources
        self.arrays = {n: p.detach().numpy() for n, p in params.items()}
        self.source.register_all(self.arrays)
        for d in self.system.destinations:
            d.register_all({n: np.zeros(d.block(n)[1], np.uint16) for n in params})

    def refit(self):
        self.source.step()
        report = self.system.refit_latest()
        return report.bytes, report.transfer_seconds


def codec(example, before, after, chunk):
    """Encode/decode/copy rates (GB/s, best of 3) and encoded bytes of the
    model's bf16 bytes, in chunks of `chunk` bytes."""
    a = np.concatenate([x.ravel() for x in before.values()]).view(np.uint8)
    b = np.concatenate([x.ravel() for x in after.values()]).view(np.uint8)
    out = dict(encoded=0, enc_s=0.0, dec_s=0.0, copy_s=0.0, forms=set())
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        for at in range(0, a.size, chunk):
            pa, pb = os.path.join(tmp, "base"), os.path.join(tmp, "new")
            a[at : at + chunk].tofile(pa)
            b[at : at + chunk].tofile(pb)
            r = json.loads(subprocess.run([example, pa, pb, "2", "3"], check=True, capture_output=True, text=True).stdout)
            if not r["exact"]:
                sys.exit("the delta codec decoded wrong")
            n = r["bytes"]
            out["encoded"] += r["encoded_bytes"]
            out["enc_s"] += n / (r["encode_gbps"] * 1e9)
            out["dec_s"] += n / (r["decode_gbps"] * 1e9)
            out["copy_s"] += n / (r["copy_gbps"] * 1e9)
            out["forms"].add(r["form"])
    total = a.size
    return dict(
        encoded=out["encoded"],
        encode_gbps=total / out["enc_s"] / 1e9,
        decode_gbps=total / out["dec_s"] / 1e9,
        copy_gbps=total / out["copy_s"] / 1e9,
        forms=sorted(out["forms"]),
    )


def run(size, lr, args, example):
    model = model_of(size, args.seed)
    params = {n: p for n, p in model.named_parameters()}
    n_params = sum(p.numel() for p in params.values())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = corpus(args.seed, args.batch, args.seq + 1)
    refits = Refits(params) if size != "1b" and not args.no_refit else None
    dense_bytes = None
    if refits is not None:
        dense_bytes, _ = refits.refit()
    rows = []
    before = {n: bf16_bits(p) for n, p in params.items()}
    for step in range(1, args.warmup + args.steps + 1):
        t = time.time()
        loss = objective_loss(model, data, args)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_s = time.time() - t
        after = {n: bf16_bits(p) for n, p in params.items()}
        sent = refits.refit()[0] if refits is not None else None
        if step > args.warmup:
            s = change_stats(before, after)
            c = codec(example, before, after, args.chunk_bytes)
            dense = 2 * s["elements"]
            row = dict(
                size=size,
                objective=args.objective,
                lr=lr,
                step=step,
                params=n_params,
                loss=float(loss.detach()),
                step_seconds=step_s,
                changed=s["changed"] / s["elements"],
                mean_run=s["changed"] / max(s["runs"], 1),
                rows_touched=s["rows_touched"] / max(s["rows"], 1),
                tensors_touched=s["tensors_touched"] / s["tensors"],
                bound=s["bound"] / dense,
                listed=s["listed"] / dense,
                codec=c["encoded"] / dense,
                refit=None if sent is None else sent / dense_bytes,
                refit_over_bound=None if sent is None else sent / s["bound"],
                codec_over_bound=c["encoded"] / s["bound"],
                encode_gbps=c["encode_gbps"],
                decode_gbps=c["decode_gbps"],
                copy_gbps=c["copy_gbps"],
                forms=c["forms"],
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
        before = after
    return rows


def summary(rows):
    def rng(rs, key, fmt):
        vals = [r[key] for r in rs if r[key] is not None]
        if not vals:
            return "—"
        lo, hi = min(vals), max(vals)
        return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}–{fmt(hi)}"

    pct = lambda x: f"{100 * x:.2f}%"
    ratio = lambda x: f"{x:.2f}"
    rate = lambda x: f"{x:.2f}"
    print()
    print("| model | lr | changed | mean run | rows touched | bound / dense | refit delta / dense | refit / bound | codec / bound | index+bitmap / dense | encode GB/s | decode GB/s | copy GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    objective = lambda r: r.get("objective", "next-token")
    keys = sorted({(r["size"], objective(r), r["lr"]) for r in rows})
    for size, obj, lr in keys:
        rs = [r for r in rows if r["size"] == size and objective(r) == obj and r["lr"] == lr]
        print(
            f"| {size} ({rs[0]['params'] / 1e6:.0f}M){'' if obj == 'next-token' else ', ' + obj} | {lr:g} | {rng(rs, 'changed', pct)} | {rng(rs, 'mean_run', ratio)} | {rng(rs, 'rows_touched', pct)} | "
            f"{rng(rs, 'bound', pct)} | {rng(rs, 'refit', pct)} | {rng(rs, 'refit_over_bound', ratio)} | {rng(rs, 'codec_over_bound', ratio)} | "
            f"{rng(rs, 'listed', pct)} | {rng(rs, 'encode_gbps', rate)} | {rng(rs, 'decode_gbps', rate)} | {rng(rs, 'copy_gbps', rate)} |"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="150m,1b")
    ap.add_argument("--lrs", default="1e-6,1e-5,1e-4")
    ap.add_argument("--steps", type=int, default=4, help="steps measured per learning rate")
    ap.add_argument("--warmup", type=int, default=2, help="steps before measuring (AdamW's first steps move every weight by about lr)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk-bytes", type=int, default=512 << 20)
    ap.add_argument("--no-refit", action="store_true", help="measure the codec only")
    ap.add_argument("--objective", choices=["next-token", "reinforce"], default="next-token")
    ap.add_argument("--gen", type=int, default=16, help="REINFORCE: tokens sampled per completion")
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--table", help="print the table of the rows in this JSON file (of --json) and stop")
    args = ap.parse_args()
    if args.table:
        rows = []
        for path in args.table.split(","):
            with open(path) as f:
                rows += json.load(f)
        summary(rows)
        return
    torch.set_num_threads(os.cpu_count() or 1)
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "transport", "--example", "delta_codec"], cwd=ROOT, check=True)
    example = os.path.join(ROOT, "target", "release", "examples", "delta_codec")
    rows = []
    for size in args.sizes.split(","):
        for lr in (float(x) for x in args.lrs.split(",")):
            rows += run(size, lr, args, example)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    summary(rows)


if __name__ == "__main__":
    main()
