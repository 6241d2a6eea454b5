#!/usr/bin/env python3
"""refit against torch written by hand, from Python, on a real model: one weight
update of an FSDP2 trainer into a vLLM-style tensor-parallel inference group.

A transformers Qwen2 model built from a config (random weights, nothing is
downloaded; about 150M parameters by default) is trained by 2 FSDP2
processes (gloo, f32, every parameter Shard(0) over them); 2 inference
processes hold it as a vLLM-style TP2 engine does (bf16; q/k/v fused into
qkv_proj and gate/up into gate_up_proj, row-parallel o_proj/down_proj split
by columns, the vocabulary split as VocabParallelEmbedding splits it). After
each "optimizer step" (every parameter changed in place) the weights move
to the inference ranks three ways, taking turns, the order rotated round by
round:

  refit         refit's Python API as docs/python.md shows it: in-place
                sources over the FSDP2 shards, in-place destinations over
                the inference buffers, `orchestrator.refit(version)`
                (`--fabric`: node, the default, or tcp). The destinations
                are written in place (`direct=True`: the usual RL loop,
                where the engine does not serve during the update; no
                staging copy); `--staged` stages them instead (group-atomic:
                a failed refit leaves every rank on the version before).
  p2p           torch send/recv written by hand: each trainer rank casts the
                part of its shard each inference rank needs to bf16 and
                sends it; each inference rank receives straight into its
                buffers (gloo isend/irecv, all posted at once).
  broadcast     torch gather-broadcast: every parameter's full_tensor() on
                trainer rank 0, cast to bf16, packed in buckets of
                --bucket-mib, broadcast to the inference ranks, each of which
                copies its blocks out.

Every transfer is checked: the inference ranks' buffers are poisoned (NaN)
before it and digested (CRC-32 of every buffer) after; the three methods
must leave the same bytes in every round, and the bytes must change from
round to round. Measured per transfer: wall time (refit: the
orchestrator's call; torch: a barrier to the last rank done), CPU seconds
and minor page faults summed over the 4 processes (and the driver, which
runs refit's orchestrator), and each inference rank's peak RSS above its RSS
before (its VmHWM reset first). Printed: medians and min-max per method.

    target/pyenv/bin/python benchmarks/torch_compare.py [--rounds 6] [--hidden 768]
        [--layers 16] [--intermediate 2048] [--vocab 32000] [--fabric node|tcp] [--staged]
        [--methods refit,p2p,broadcast] [--json]

Needs torch and transformers (pip install torch transformers) and the
refit package (pip install ./python).
"""

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time
import zlib
from datetime import timedelta

METHODS = ("refit", "p2p", "broadcast")
TRAINERS, INFERENCE = 2, 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(a):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 64,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def usage():
    """(CPU seconds, minor page faults) of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def box(offset, extent):
    return tuple(slice(o, o + e) for o, e in zip(offset, extent))


def intersect(a_off, a_ext, b_off, b_ext):
    """The intersection of two boxes, as (offset, extent), or None."""
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + e, y + f) for x, e, y, f in zip(a_off, a_ext, b_off, b_ext)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, [h - l for l, h in zip(lo, hi)]


# --- a trainer process --------------------------------------------------------


def trainer(rank, a, ports, address, secret, conn):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2ForCausalLM

    import refit

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=TRAINERS)
    store = dist.TCPStore("127.0.0.1", ports[1], TRAINERS + INFERENCE, rank == 0, timedelta(seconds=120))
    everyone = dist.ProcessGroupGloo(dist.PrefixStore("all", store), rank, TRAINERS + INFERENCE, timedelta(seconds=120))
    bcast = dist.ProcessGroupGloo(dist.PrefixStore("bcast", store), 0, 1 + INFERENCE, timedelta(seconds=120)) if rank == 0 else None
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config(a))
    mesh = init_device_mesh("cpu", (TRAINERS,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = dict(model.named_parameters())
    layout = refit.layout_from_dtensors(params)
    src = refit.Source.in_place(layout, rank, refit.param_buffers(layout, rank, params))
    src.join(address, secret)
    mine = {name: (off, ext) for name, _, off, ext in layout.blocks(rank)}
    conn.send((layout.to_json(), sum(p.numel() for p in params.values())) if rank == 0 else None)
    infer = refit.Layout.from_json(conn.recv())
    wanted = [{name: (off, ext) for name, _, off, ext in infer.blocks(t)} for t in range(INFERENCE)]

    def p2p():
        ops = []
        for i, (name, p) in enumerate(params.items()):
            local = p.to_local()
            s_off, s_ext = mine[name]
            for t in range(INFERENCE):
                cut = intersect(s_off, s_ext, *wanted[t][name])
                if cut is None:
                    continue
                piece = local[box([o - so for o, so in zip(cut[0], s_off)], cut[1])].to(torch.bfloat16).contiguous()
                ops.append(everyone.send([piece], TRAINERS + t, i))
        for w in ops:
            w.wait()

    def broadcast():
        bucket, size = [], 0
        names = list(params)
        for i, name in enumerate(names):
            full = params[name].full_tensor()
            if rank != 0:
                continue
            bucket.append(full.to(torch.bfloat16).reshape(-1))
            size += full.numel() * 2
            if size >= a.bucket_mib << 20 or i == len(names) - 1:
                flat = torch.cat(bucket)
                bcast.broadcast(flat, 0).wait()
                bucket, size = [], 0

    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg == "step":
            with torch.no_grad(), src.stepping():
                for p in params.values():
                    local = p.to_local()
                    local.mul_(0.999).add_(0.001)
            conn.send(src.version)
            continue
        cpu0, faults0 = usage()
        if msg in ("p2p", "broadcast"):
            everyone.barrier().wait()
            t0 = time.perf_counter()
            with torch.no_grad():
                p2p() if msg == "p2p" else broadcast()
            elapsed = time.perf_counter() - t0
        else:  # refit: the orchestrator moves the bytes; measure until told
            conn.send("measuring")
            conn.recv()
            elapsed = None
        cpu1, faults1 = usage()
        conn.send({"cpu": cpu1 - cpu0, "faults": faults1 - faults0, "elapsed": elapsed})
    src.wait_closed(0)
    dist.destroy_process_group()


# --- an inference process ------------------------------------------------------


def inference(t, a, ports, address, secret, conn):
    import torch
    import torch.distributed as dist

    import refit

    torch.set_num_threads(1)
    rank = TRAINERS + t
    store = dist.TCPStore("127.0.0.1", ports[1], TRAINERS + INFERENCE, False, timedelta(seconds=120))
    everyone = dist.ProcessGroupGloo(dist.PrefixStore("all", store), rank, TRAINERS + INFERENCE, timedelta(seconds=120))
    bcast = dist.ProcessGroupGloo(dist.PrefixStore("bcast", store), 1 + t, 1 + INFERENCE, timedelta(seconds=120))
    train_json, shapes = conn.recv()
    train = refit.Layout.from_json(train_json)
    infer = refit.tp_inference_layout(shapes, tp=INFERENCE, dtype="bf16", num_kv_heads=2)
    if t == 0:
        conn.send(infer.to_json())
    # The engine's buffers (fused where vLLM fuses), and a view of each
    # tensor's block in them.
    buffers = {name: torch.zeros(elems, dtype=torch.bfloat16) for name, _, elems in infer.buffers(t)}
    placed = {x["name"]: x for x in json.loads(infer.to_json())["tensors"]}
    views = {}
    for name, _, off, ext in infer.blocks(t):
        n = 1
        for e in ext:
            n *= e
        where = placed[name]
        if "buffer" in where:
            views[name] = (off, buffers[where["buffer"]][where["at"] : where["at"] + n].view(ext))
        else:
            own = [b for b in buffers if b.startswith(name + "#")]
            views[name] = (off, buffers[own[0]].view(ext))
    for b in buffers.values():
        b.fill_(0.0)  # (faulted in: the engine's weights are resident)
    rss_with_weights, shared_with_weights = status_kib("VmRSS"), status_kib("RssShmem")
    dst = refit.Destination.in_place(infer, t, buffers, direct=not a.staged)
    dst.join(address, secret)
    have = [{name: (off, ext) for name, _, off, ext in train.blocks(r)} for r in range(TRAINERS)]
    names = list(shapes)

    def p2p():
        ops = []
        for i, name in enumerate(names):
            d_off, view = views[name]
            for r in range(TRAINERS):
                cut = intersect(*have[r][name], d_off, list(view.shape))
                if cut is None:
                    continue
                ops.append(everyone.recv([view[box([o - do for o, do in zip(cut[0], d_off)], cut[1])]], r, i))
        for w in ops:
            w.wait()

    def broadcast():
        bucket, size = [], 0
        for i, name in enumerate(names):
            n = 1
            for s in shapes[name]:
                n *= s
            bucket.append((name, n))
            size += n * 2
            if size >= a.bucket_mib << 20 or i == len(names) - 1:
                flat = torch.empty(sum(k for _, k in bucket), dtype=torch.bfloat16)
                bcast.broadcast(flat, 0).wait()
                at = 0
                for nm, k in bucket:
                    d_off, view = views[nm]
                    view.copy_(flat[at : at + k].view(shapes[nm])[box(d_off, list(view.shape))])
                    at += k
                bucket, size = [], 0

    def digest():
        return [zlib.crc32(b.view(torch.int16).numpy().tobytes()) for b in buffers.values()]

    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg == "digest":
            conn.send(digest())
            continue
        if msg == "rss":
            conn.send(
                (
                    (status_kib("VmRSS") - rss_with_weights) / 1024,
                    (status_kib("RssShmem") - shared_with_weights) / 1024,
                    sum(b.numel() * 2 for b in buffers.values()) / 2**20,
                )
            )
            continue
        for b in buffers.values():
            b.fill_(float("nan"))
        rss0 = status_kib("VmRSS")
        reset_peak()
        cpu0, faults0 = usage()
        if msg in ("p2p", "broadcast"):
            everyone.barrier().wait()
            t0 = time.perf_counter()
            p2p() if msg == "p2p" else broadcast()
            elapsed = time.perf_counter() - t0
        else:
            conn.send("measuring")
            conn.recv()
            elapsed = None
        cpu1, faults1 = usage()
        peak = status_kib("VmHWM")
        conn.send({"cpu": cpu1 - cpu0, "faults": faults1 - faults0, "elapsed": elapsed, "rss_rise_kib": peak - rss0})
    dst.wait_closed(0)


# --- the driver --------------------------------------------------------------


def spread(xs):
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--fabric", choices=("node", "tcp"), default="node")
    ap.add_argument("--staged", action="store_true", help="refit's destinations staged (Destination.in_place(direct=False)): group-atomic, a staging copy of the weights; by default they are written in place (direct=True)")
    ap.add_argument("--json", action="store_true", help="one JSON line of every measurement")
    ap.add_argument("--methods", default=",".join(METHODS), help="the methods to run, comma-separated (for profiling one alone; the comparison needs all three)")
    a = ap.parse_args()
    methods = tuple(m for m in METHODS if m in a.methods.split(","))
    unknown = set(a.methods.split(",")) - set(METHODS)
    if unknown or not methods:
        ap.error(f"--methods: {', '.join(sorted(unknown)) or 'none given'}; choose from {', '.join(METHODS)}")
    try:
        import torch.multiprocessing as mp
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"{e.name} not installed: skipped (pip install torch transformers)")
        return 0
    import refit

    orch = refit.Orchestrator(fabric=a.fabric, deadline=120.0)
    ports = (free_port(), free_port())
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for i in range(TRAINERS + INFERENCE):
        here, there = ctx.Pipe()
        target, arg = (trainer, i) if i < TRAINERS else (inference, i - TRAINERS)
        p = ctx.Process(target=target, args=(arg, a, ports, orch.address, orch.secret, there), daemon=True)
        p.start()
        pipes.append(here)
        procs.append(p)
    trainers, infers = pipes[:TRAINERS], pipes[TRAINERS:]
    train_json, n_params = trainers[0].recv()
    trainers[1].recv()
    train = refit.Layout.from_json(train_json)
    shapes = {name: train.tensor(name)[1] for name in train.tensor_names()}
    for p in infers:
        p.send((train_json, shapes))
    infer_json = infers[0].recv()
    for p in trainers:
        p.send(infer_json)
    plan = orch.connect(TRAINERS, INFERENCE)
    print(f"Qwen2 from a config: {n_params / 1e6:.1f}M parameters; FSDP2 x{TRAINERS} (f32) -> TP{INFERENCE} (bf16); refit over '{a.fabric}'{', destinations staged' if a.staged else ', destinations written in place'}, {plan.bytes / 2**20:.1f} MiB a refit", file=sys.stderr)

    results = {m: [] for m in methods}
    last = None
    ok = True
    for rnd in range(a.rounds):
        for p in trainers:
            p.send("step")
        versions = {p.recv() for p in trainers}
        assert len(versions) == 1, versions
        version = versions.pop()
        digests = {}
        k = rnd % len(methods)
        order = methods[k:] + methods[:k]
        for m in order:
            for p in pipes:
                p.send(m)
            if m == "refit":
                for p in pipes:
                    assert p.recv() == "measuring"
                cpu0, faults0 = usage()
                t0 = time.perf_counter()
                orch.refit(version)
                elapsed = time.perf_counter() - t0
                cpu1, faults1 = usage()
                for p in pipes:
                    p.send("done")
                stats = [p.recv() for p in pipes]
                driver = (cpu1 - cpu0, faults1 - faults0)
            else:
                stats = [p.recv() for p in pipes]
                elapsed = max(s["elapsed"] for s in stats)
                driver = (0.0, 0)
            for p in infers:
                p.send("digest")
            digests[m] = [p.recv() for p in infers]
            results[m].append(
                {
                    "seconds": elapsed,
                    "cpu_seconds": sum(s["cpu"] for s in stats) + driver[0],
                    "cpu_seconds_by_process": [s["cpu"] for s in stats] + [driver[0]],
                    "page_faults": sum(s["faults"] for s in stats) + driver[1],
                    "inference_rss_rise_mib": max(s["rss_rise_kib"] for s in stats[TRAINERS:]) / 1024,
                }
            )
        same = len({json.dumps(d) for d in digests.values()}) == 1
        changed = last is None or digests[methods[0]] != last
        ok = ok and same and changed
        last = digests[methods[0]]
        print(f"round {rnd + 1}: " + ", ".join(f"{m} {results[m][-1]['seconds'] * 1e3:.0f} ms" for m in order) + f"; bytes equal: {same}, changed: {changed}", file=sys.stderr)

    rss = []
    for p in infers:
        p.send("rss")
        rss.append(p.recv())
    for p in pipes:
        p.send(None)
    for p in procs:
        p.join(timeout=60)
    orch.close()
    # The first round warms every method up (connections, buffers): the
    # figures are of the later rounds.
    steady = {m: r[1:] if len(r) > 1 else r for m, r in results.items()}
    print(f"{'method':<10} {'seconds':>22} {'cpu seconds':>22} {'page faults':>26} {'inference RSS rise MiB':>26}")
    for m in methods:
        rs = steady[m]
        col = lambda k: spread([r[k] for r in rs])  # noqa: E731
        print(f"{m:<10} {col('seconds'):>22} {col('cpu_seconds'):>22} {col('page_faults'):>26} {col('inference_rss_rise_mib'):>26}")
    med = {m: statistics.median(r["seconds"] for r in steady[m]) for m in methods}
    cpu = {m: statistics.median(r["cpu_seconds"] for r in steady[m]) for m in methods}
    if methods == METHODS:
        print(f"refit / p2p: {med['refit'] / med['p2p']:.2f}x time, {cpu['refit'] / cpu['p2p']:.2f}x CPU; refit / broadcast: {med['refit'] / med['broadcast']:.2f}x time")
    print(
        "; ".join(
            f"inference rank {t}: RSS {r:.0f} MiB above its RSS with its weights ({w:.0f} MiB) before anything moved, {sh:.0f} MiB of it shared memory"
            for t, (r, sh, w) in enumerate(rss)
        )
        + " (every method's leftovers together; with --staged, refit's staging copy of the weights among them)"
    )
    print(f"every round: the three methods left the same bytes, and they changed from round to round: {ok}")
    if a.json:
        print(json.dumps({"fabric": a.fabric, "staged": a.staged, "parameters": n_params, "rounds": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
