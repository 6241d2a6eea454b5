"""A pipeline on a busy host: refits go on while every core is loaded.

The host is loaded with two spinning processes per core, beside an
FSDP2 -> TP2 pipeline: two trainer processes whose weights are torch
tensors registered in place (``Source.in_place``, each holding half of
every tensor's rows, as FSDP2 shards them), two rollout processes serving
TP2 (column and row splits) from numpy arrays registered in place. Midway
a trainer process is stopped (SIGSTOP) for longer than the control
plane's heartbeat timeout and then continued: its member's control
connection is given up meanwhile while its process lives, as a starved
host does to it. Every refit must commit, or fail and the next one commit
by itself, every destination keeping its version whole in between; the
weights every rollout serves are checked after every refit.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import refit

REFITS = 20
# The control plane's heartbeat timeout (10 s) and some: the orchestrator
# gives the stopped member's connection up while its own process runs.
STOPPED_FOR = 15.0

TRAIN = """{"ranks": 2, "tensors": [
  {"name": "w1", "dtype": "f32", "shape": [64, 48], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
  {"name": "w2", "dtype": "f32", "shape": [48, 64], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}"""
INFER = """{"ranks": 2, "tensors": [
  {"name": "w1", "dtype": "f32", "shape": [64, 48], "mesh": {"shape": [2]}, "placements": ["shard(0)"]},
  {"name": "w2", "dtype": "f32", "shape": [48, 64], "mesh": {"shape": [2]}, "placements": ["shard(1)"]}]}"""

COMMON = f"""
import sys, numpy as np, refit
TRAIN = '''{TRAIN}'''
INFER = '''{INFER}'''
SHAPES = {{"w1": (64, 48), "w2": (48, 64)}}

def value(step, name):
    base = 0 if name == "w1" else 1000
    n = int(np.prod(SHAPES[name]))
    return (np.float32(step) + base + np.arange(n, dtype=np.float32) / np.float32(64)).reshape(SHAPES[name])

def block(x, offset, extent):
    return x[tuple(slice(o, o + e) for o, e in zip(offset, extent))]
"""

# A trainer: torch tensors registered in place, written inside the fence;
# a little real work in the process between steps.
TRAINER = COMMON + """
import torch
rank, address, secret = int(sys.argv[1]), sys.argv[2], sys.argv[3]
layout = refit.Layout.from_json(TRAIN)
probe = refit.Source(layout, rank)
params = {n: torch.zeros(tuple(probe.block(n)[1]), dtype=torch.float32) for n in SHAPES}
src = refit.Source.in_place(layout, rank, refit.param_buffers(layout, rank, params))
src.join(address, secret)
print("ready", flush=True)
x = torch.randn(256, 256)
for line in sys.stdin:
    step = int(line)
    for _ in range(4):
        x = torch.tanh(x @ x.T / 256)
    with src.stepping():
        for n, p in params.items():
            p.copy_(torch.from_numpy(np.ascontiguousarray(block(value(step, n), *src.block(n)))))
    print(src.version, flush=True)
"""

# A rollout: numpy arrays registered in place; checks what it serves.
ROLLOUT = COMMON + """
rank, address, secret = int(sys.argv[1]), sys.argv[2], sys.argv[3]
layout = refit.Layout.from_json(INFER)
probe = refit.Destination(layout, rank)
arrays = {n: np.zeros(probe.block(n)[1], np.float32) for n in SHAPES}
dst = refit.Destination.in_place(layout, rank, refit.param_buffers(layout, rank, arrays))
dst.join(address, secret)
print("ready", flush=True)
for line in sys.stdin:
    with dst.serving() as version:
        exact = version is not None and all(np.array_equal(a, block(value(version, n), *dst.block(n))) for n, a in arrays.items())
    print(version, exact, flush=True)
"""

# Spins until its parent goes, whichever way the test ends.
SPIN = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(100000):
        pass
"""


class Busy:
    """Two spinning processes per core, killed on every way out."""

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(2 * (os.cpu_count() or 1))]
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def test_slow_busy_host_refits_commit_or_recover_by_themselves(capfd):
    orch = refit.Orchestrator(deadline=30.0)
    procs = {}

    def start(code, role, rank):
        p = subprocess.Popen(
            [sys.executable, "-c", code, str(rank), orch.address, orch.secret], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        procs[(role, rank)] = p

    def ask(key, line):
        p = procs[key]
        p.stdin.write(f"{line}\n")
        p.stdin.flush()
        answer = p.stdout.readline().split()
        assert answer, f"{key} ended (exit code {p.poll()})"
        return answer

    def served():
        return [ask(("rollout", r), "check") for r in (0, 1)]

    outcomes = []
    try:
        with Busy():
            for rank in (0, 1):
                start(TRAINER, "trainer", rank)
                start(ROLLOUT, "rollout", rank)
            for key, p in procs.items():
                assert p.stdout.readline().strip() == "ready", f"{key} did not start"
            orch.connect(2, 2, timeout=120)
            committed = None
            for step in range(1, REFITS + 1):
                if step == REFITS // 2:
                    # A live member lost: its process does not run for
                    # longer than the heartbeat timeout, then goes on.
                    trainer = procs[("trainer", 0)]
                    trainer.send_signal(signal.SIGSTOP)
                    time.sleep(STOPPED_FOR)
                    trainer.send_signal(signal.SIGCONT)
                versions = [ask(("trainer", r), step) for r in (0, 1)]
                assert versions == [[str(step)]] * 2, versions
                try:
                    report = orch.refit(step)
                    assert report.version == step
                    committed = step
                    outcomes.append("committed")
                except (refit.MemberError, refit.RefitError) as e:
                    outcomes.append(f"failed: {e}")
                # Every rollout serves the last committed version, whole.
                assert served() == [[str(committed), "True"]] * 2, (step, outcomes)
    finally:
        orch.close()
        for p in procs.values():
            p.kill()
            p.wait()
    failed = [i for i, o in enumerate(outcomes) if o.startswith("failed")]
    err = capfd.readouterr().err
    with capfd.disabled():
        print(f"\n{len(outcomes)} refits, {len(failed)} failed: {[outcomes[i] for i in failed]}")
        print("\n".join(line for line in err.splitlines() if "WARN" in line or "INFO" in line))
    assert len(outcomes) == REFITS
    # A failed refit is followed by one that commits, with nobody's help.
    assert all(i + 1 < len(outcomes) and outcomes[i + 1] == "committed" for i in failed), outcomes
    # The stopped trainer's member was given up meanwhile and found again,
    # alive, by the refit after (logged on the orchestrator's side).
    assert "found again as itself and put back" in err, err[-4000:]
