"""Trainer and rollout Ray actors refit after every optimizer step.

The driver (this process) runs the orchestrator and opens its rendezvous;
2 trainer actors (TP2, f32: `w` split by rows, `b` replicated, torch
tensors when torch is installed, else numpy) and 4 rollout actors (TP2 x
DP2, bf16) each run in a Ray worker process of their own, hold their rank's
weights in their own arrays, and join the rendezvous. For 5 steps every
trainer applies a known update (w <- w - 0.5 * lr-free "gradient" g(step)),
the orchestrator refits the new version, and every rollout actor copies it
in (`load(version)`) and checks every value against the expected one.
Before step 3 one rollout actor's process is killed: Ray restarts the
actor (`max_restarts=1`), whose constructor joins again as the same rank;
the refit that finds its member dead raises `MemberError`, the driver
calls `orch.recover()`, which puts the restarted member in its place, and
refits again. Exits non-zero on any wrong value.

    pip install ./python numpy ray && python examples/ray_pipeline.py
"""

import sys
import time

import numpy as np
import ray

import refit

STEPS = 5
KILL_BEFORE_STEP, KILLED_ROLLOUT = 3, 1
W_SHAPE, B_SHAPE = (8, 6), (6,)

TRAINING = refit.LayoutBuilder(2).tensor(
    refit.TensorBuilder("w", "f32", list(W_SHAPE)).mesh([2], ["shard(0)"])
).tensor(refit.TensorBuilder("b", "f32", list(B_SHAPE)).mesh([2], ["replicate"])).build()

ROLLOUT = refit.LayoutBuilder(4, ranks_per_node=2).tensor(
    refit.TensorBuilder("w", "bf16", list(W_SHAPE)).mesh([2, 2], ["replicate", "shard(0)"])
).tensor(refit.TensorBuilder("b", "bf16", list(B_SHAPE)).mesh([2, 2], ["replicate", "shard(0)"])).build()


def expected(name, step):
    """The whole tensor after `step` optimizer steps from zero: each step
    subtracts 0.5 * g, with g[i] = (flat index i + 1) / 64 for w and
    -(i + 1) / 8 for b; in f32, as the trainer computes it."""
    shape = W_SHAPE if name == "w" else B_SHAPE
    n = int(np.prod(shape))
    g = (np.arange(n, dtype=np.float32) + 1) / np.float32(64 if name == "w" else -8)
    x = np.zeros(n, np.float32)
    for _ in range(step):
        x = x - np.float32(0.5) * g
    return x.reshape(shape)


def bf16_bits(x):
    """f32 -> bf16 bit patterns, round to nearest even (as refit converts)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def block(x, offset, extent):
    return x[tuple(slice(o, o + e) for o, e in zip(offset, extent))]


@ray.remote
class Trainer:
    def __init__(self, rank, address, secret):
        try:
            import torch

            self.lib = "torch"
            zeros = lambda shape: torch.zeros(shape, dtype=torch.float32)  # noqa: E731
        except ImportError:
            self.lib = "numpy"
            zeros = lambda shape: np.zeros(shape, np.float32)  # noqa: E731
        self.src = refit.Source(TRAINING, rank)
        self.params = {n: zeros(self.src.block(n)[1]) for n in ("w", "b")}
        self.src.register_all(self.params)
        self.src.join(address, secret)

    def step(self, step):
        # A known update in place on this rank's own tensors: x -= 0.5 * g.
        for name, p in self.params.items():
            g = block(expected(name, 1) / np.float32(-0.5), *self.src.block(name))
            if self.lib == "torch":
                import torch

                p -= 0.5 * torch.from_numpy(np.ascontiguousarray(g))
            else:
                p -= np.float32(0.5) * g
        return self.src.step()

    def backend(self):
        return self.lib


@ray.remote(max_restarts=1)
class Rollout:
    def __init__(self, rank, address, secret):
        self.dst = refit.Destination(ROLLOUT, rank)
        self.weights = {n: np.zeros(self.dst.block(n)[1], np.uint16) for n in ("w", "b")}  # bf16 bits
        self.dst.register_all(self.weights)
        self.dst.join(address, secret)

    def check(self, version, step):
        got = self.dst.load(version)
        wrong = []
        for name, a in self.weights.items():
            want = bf16_bits(block(expected(name, step), *self.dst.block(name)))
            if not np.array_equal(a, want):
                wrong.append(f"{name}: got {a.tolist()}, expected {want.tolist()}")
        return got, sum(a.size for a in self.weights.values()), wrong

    def pid(self):
        import os

        return os.getpid()


def refit_after_a_lost_actor(orch, actor, version):
    """Kills `actor`'s process, lets Ray restart it, and refits `version`:
    the refit fails on the dead member, `recover` puts the restarted one in
    its place, and the refit is retried."""
    before = ray.get(actor.pid.remote())
    ray.kill(actor, no_restart=False)
    # The kill takes effect asynchronously: wait until the restarted actor
    # (a new process, joined again in its constructor) answers.
    deadline, after = time.monotonic() + 120, before
    while after == before:
        if time.monotonic() > deadline:
            raise RuntimeError("the rollout actor was not restarted within 120 s")
        try:
            after = ray.get(actor.pid.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            pass
        time.sleep(0.05)
    try:
        orch.refit(version)
        raise RuntimeError("a refit with a dead member committed")
    except refit.MemberError as e:
        print(f"driver: rollout actor {KILLED_ROLLOUT} lost (process {before}); the refit failed: {str(e)[:80]}")
    replaced = orch.recover(timeout=120)
    print(f"driver: recover() put back {replaced} (Ray restarted it as process {after}); refitting again")
    return orch.refit(version)


def main():
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=True)
    with refit.Orchestrator(bind=f"{ray.util.get_node_ip_address()}:0") as orch:
        trainers = [Trainer.remote(r, orch.address, orch.secret) for r in range(2)]
        rollouts = [Rollout.remote(r, orch.address, orch.secret) for r in range(4)]
        plan = orch.connect(src_ranks=2, dst_ranks=4, timeout=120)
        backend = ray.get(trainers[0].backend.remote())
        print(f"driver: 2 trainer actors ({backend}, f32) and 4 rollout actors (bf16); plan {plan.fingerprint} moves {plan.bytes} bytes")
        for step in range(1, STEPS + 1):
            t0 = time.perf_counter()
            versions = ray.get([t.step.remote(step) for t in trainers])
            if len(set(versions)) != 1:
                raise RuntimeError(f"step {step}: trainers disagree on the version: {versions}")
            if step == KILL_BEFORE_STEP:
                report = refit_after_a_lost_actor(orch, rollouts[KILLED_ROLLOUT], versions[0])
            else:
                report = orch.refit(versions[0])
            results = ray.get([r.check.remote(report.version, step) for r in rollouts])
            for rank, (got, _, wrong) in enumerate(results):
                if got != report.version or wrong:
                    raise RuntimeError(f"step {step}: rollout actor {rank} (version {got}): {wrong}")
            print(
                f"step {step}: refit version {report.version} in {report.seconds * 1e3:.1f} ms ({report.bytes} bytes); "
                f"rollout actors checked {[r[1] for r in results]} values: all exact ({(time.perf_counter() - t0) * 1e3:.0f} ms with the step)"
            )
        print(f"{STEPS} steps: every rollout actor served every step's weights bit-exact")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
