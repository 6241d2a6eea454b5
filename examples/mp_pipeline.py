"""Trainer and rollout processes refit after every optimizer step, with plain
multiprocessing (no Ray needed): the Python twin of
examples/multiprocess_pipeline.rs.

The driver opens the orchestrator's rendezvous and starts 2 trainer
processes (TP2, f32, `w` and `b` in one fused buffer per rank) and 4 rollout
processes (TP2 x DP2, bf16). For 5 steps every trainer writes step s's
weights into its own numpy arrays and calls `step()`, the orchestrator
refits, and every rollout copies the committed version into its own arrays
(`load(version)`) and checks every value. Exits non-zero on any wrong value.

    pip install ./python numpy && python examples/mp_pipeline.py
"""

import multiprocessing as mp
import sys

import numpy as np

import refit

STEPS = 5

TRAINING = """{"ranks": 2, "tensors": [
  {"name": "w", "dtype": "f32", "shape": [8, 6], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "buffer": "params", "at": 0},
  {"name": "b", "dtype": "f32", "shape": [8], "mesh": {"shape": [2]}, "placements": ["shard(0)"], "buffer": "params", "at": 24}]}"""

ROLLOUT = """{"ranks": 4, "ranks_per_node": 2, "tensors": [
  {"name": "w", "dtype": "bf16", "shape": [8, 6], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]},
  {"name": "b", "dtype": "bf16", "shape": [8], "mesh": {"shape": [2, 2]}, "placements": ["replicate", "shard(0)"]}]}"""


def value(step, name, shape):
    """Step `step`'s whole tensor `name` (f32)."""
    base = 0 if name == "w" else 48
    index = base + np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    return (np.float32(step * 0.5) - index / np.float32(16)).astype(np.float32)


def bf16_bits(x):
    """f32 -> bf16 bit patterns, round to nearest even (as refit converts)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def block(x, offset, extent):
    return x[tuple(slice(o, o + e) for o, e in zip(offset, extent))]


def trainer(rank, address, secret, conn):
    layout = refit.Layout.from_json(TRAINING)
    src = refit.Source(layout, rank)
    arrays = {}
    for name in ("w", "b"):
        offset, extent = src.block(name)
        arrays[name] = np.zeros(extent, np.float32)
        src.register(name, arrays[name])
    src.join(address, secret)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        step = msg
        shapes = {"w": (8, 6), "b": (8,)}
        for name, a in arrays.items():  # the "optimizer step": in place
            a[...] = block(value(step, name, shapes[name]), *src.block(name))
        conn.send(src.step())


def rollout(rank, address, secret, conn):
    layout = refit.Layout.from_json(ROLLOUT)
    dst = refit.Destination(layout, rank)
    arrays = {}
    for name in ("w", "b"):
        arrays[name] = np.zeros(dst.block(name)[1], np.uint16)  # bf16 bits
        dst.register(name, arrays[name])
    dst.join(address, secret)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        version, step = msg
        got = dst.load(version)
        checked, wrong = 0, []
        shapes = {"w": (8, 6), "b": (8,)}
        for name, a in arrays.items():
            want = bf16_bits(block(value(step, name, shapes[name]), *dst.block(name)))
            if not np.array_equal(a, want):
                wrong.append(f"{name}: got {a.tolist()}, expected {want.tolist()}")
            checked += a.size
        conn.send((got, checked, wrong))


def main():
    ctx = mp.get_context("spawn")
    with refit.Orchestrator() as orch:
        procs, trainers, rollouts = [], [], []
        for role, n, target, conns in (("trainer", 2, trainer, trainers), ("rollout", 4, rollout, rollouts)):
            for rank in range(n):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=target, args=(rank, orch.address, orch.secret, theirs), name=f"{role}{rank}", daemon=True)
                p.start()
                procs.append(p)
                conns.append(mine)
        try:
            for c in trainers + rollouts:
                if not c.poll(120):
                    raise RuntimeError("a member process did not start within 120 s")
                assert c.recv() == "ready"
            plan = orch.connect(src_ranks=2, dst_ranks=4)
            print(f"driver: trainers and rollouts in processes {[p.pid for p in procs]}; plan {plan.fingerprint} moves {plan.bytes} bytes")
            for step in range(1, STEPS + 1):
                for c in trainers:
                    c.send(step)
                versions = [c.recv() for c in trainers]
                if len(set(versions)) != 1:
                    raise RuntimeError(f"step {step}: trainers disagree on the version: {versions}")
                report = orch.refit(versions[0])
                for c in rollouts:
                    c.send((report.version, step))
                results = [c.recv() for c in rollouts]
                for rank, (got, _, wrong) in enumerate(results):
                    if got != report.version or wrong:
                        raise RuntimeError(f"step {step}: rollout {rank} (version {got}): {wrong}")
                print(
                    f"step {step}: refit version {report.version} in {report.seconds * 1e3:.1f} ms ({report.bytes} bytes); "
                    f"rollouts checked {[r[1] for r in results]} values: all exact"
                )
            print(f"{STEPS} steps: every rollout process served every step's weights bit-exact")
        finally:
            for c in trainers + rollouts:
                try:
                    c.send(None)
                except OSError:
                    pass
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
