"""Rollout replicas that join and leave a running job, as Ray actors.

The driver (this process) runs the orchestrator over a destination group of
replicas: one replica is 2 rollout actors (TP2, bf16: `w` split by rows,
`b` split too); the job starts with 2 replicas. 2 trainer actors (TP2,
f32) take 6 optimizer steps with a known update; after each, the
orchestrator refits and every rollout actor of every replica in the group
copies the version in (`load`) and checks every value. Before the refit
of step 3 a third replica's 2 actors start and join under a replica name;
`add_replica` seeds them with the version the others serve, sent by a
serving replica (no trainer sends anything: the trainers' versions do not
move), and they check it at once. Before the refit of step 5 replica 0
leaves (`remove_replica(0)`): its actors keep serving step 4's weights,
checked after step 6, while the others move on. Exits non-zero on any
wrong value.

    pip install ./python numpy ray && python examples/ray_elastic.py
"""

import sys
import time

import numpy as np
import ray

import refit

STEPS = 6
ADD_BEFORE_STEP, REMOVE_BEFORE_STEP = 3, 5
W_SHAPE, B_SHAPE = (8, 6), (6,)

TRAINING = refit.LayoutBuilder(2).tensor(
    refit.TensorBuilder("w", "f32", list(W_SHAPE)).mesh([2], ["shard(1)"])
).tensor(refit.TensorBuilder("b", "f32", list(B_SHAPE)).mesh([2], ["replicate"])).build()

# One rollout replica: TP2 on one node.
REPLICA = refit.LayoutBuilder(2, ranks_per_node=2).tensor(
    refit.TensorBuilder("w", "bf16", list(W_SHAPE)).mesh([2], ["shard(0)"])
).tensor(refit.TensorBuilder("b", "bf16", list(B_SHAPE)).mesh([2], ["shard(0)"])).build()


def expected(name, step):
    """The whole tensor after `step` optimizer steps from zero (f32, as the
    trainers compute it): each step subtracts 0.5 * g, g[i] = (i + 1) / 64
    for w and -(i + 1) / 8 for b."""
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
        self.src = refit.Source(TRAINING, rank)
        self.params = {n: np.zeros(self.src.block(n)[1], np.float32) for n in ("w", "b")}
        self.src.register_all(self.params)
        self.src.join(address, secret)

    def step(self):
        for name, p in self.params.items():
            p -= np.float32(0.5) * block(expected(name, 1) / np.float32(-0.5), *self.src.block(name))
        return self.src.step()

    def version(self):
        return self.src.version


@ray.remote
class Rollout:
    """Rank `rank` of the group laid out as `layout` (the first replicas), or
    rank `rank` of a replica named `replica` joining later (laid out as one
    replica)."""

    def __init__(self, layout, rank, address, secret, replica=None):
        self.dst = refit.Destination(layout, rank)
        self.weights = {n: np.zeros(self.dst.block(n)[1], np.uint16) for n in ("w", "b")}
        self.dst.register_all(self.weights)
        self.dst.join(address, secret, replica=replica)

    def check(self, version, step):
        got = self.dst.load(version)
        wrong = []
        for name, a in self.weights.items():
            want = bf16_bits(block(expected(name, step), *self.dst.block(name)))
            if not np.array_equal(a, want):
                wrong.append(f"{name}: got {a.tolist()}, expected {want.tolist()}")
        return got, sum(a.size for a in self.weights.values()), wrong


def check(replicas, version, step, what):
    results = ray.get([r.check.remote(version, step) for replica in replicas for r in replica])
    for i, (got, _, wrong) in enumerate(results):
        if got != version or wrong:
            raise RuntimeError(f"{what}: rollout actor {i} (version {got}): {wrong}")
    return sum(r[1] for r in results)


def main():
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=True)
    group = REPLICA.replicated(2)
    with refit.Orchestrator(bind=f"{ray.util.get_node_ip_address()}:0", replica=REPLICA) as orch:
        trainers = [Trainer.remote(r, orch.address, orch.secret) for r in range(2)]
        replicas = [[Rollout.remote(group, 2 * i + j, orch.address, orch.secret) for j in range(2)] for i in range(2)]
        plan = orch.connect(src_ranks=2, dst_ranks=group.ranks, timeout=120)
        print(f"driver: 2 trainer actors (f32), 2 rollout replicas of 2 actors (bf16); plan {plan.fingerprint} moves {plan.bytes} bytes")
        left = None
        for step in range(1, STEPS + 1):
            t0 = time.perf_counter()
            versions = ray.get([t.step.remote() for t in trainers])
            if len(set(versions)) != 1:
                raise RuntimeError(f"step {step}: trainers disagree on the version: {versions}")
            if step == ADD_BEFORE_STEP:
                joining = [Rollout.remote(REPLICA, j, orch.address, orch.secret, "late") for j in range(2)]
                added = orch.add_replica("late", timeout=120)
                seeded = added.seeded
                if seeded is None or seeded["version"] != step - 1:
                    raise RuntimeError(f"the new replica was seeded with {seeded}, not version {step - 1}")
                held = ray.get([t.version.remote() for t in trainers])
                n = check([joining], step - 1, step - 1, "the new replica, seeded")
                print(
                    f"driver: replica 'late' joined, seeded with version {seeded['version']} from replica {seeded['from_replica']} "
                    f"({seeded['bytes']} bytes sent by that replica; the trainers hold {held} and sent nothing); {n} values exact"
                )
                replicas.append(joining)
            if step == REMOVE_BEFORE_STEP:
                left = replicas.pop(0)
                removed = orch.remove_replica(0)
                print(f"driver: replica 0 left; {removed.replicas} replicas remain; its actors keep serving version {step - 1}")
            report = orch.refit(versions[0])
            n = check(replicas, report.version, step, f"step {step}")
            print(
                f"step {step}: refit version {report.version} into {len(replicas)} replicas in {report.seconds * 1e3:.1f} ms "
                f"({report.bytes} bytes); {n} values: all exact ({(time.perf_counter() - t0) * 1e3:.0f} ms with the step)"
            )
        n = check([left], REMOVE_BEFORE_STEP - 1, REMOVE_BEFORE_STEP - 1, "the replica that left")
        print(f"driver: the replica that left still serves version {REMOVE_BEFORE_STEP - 1} whole ({n} values exact)")
        print(f"{STEPS} steps: every replica in the group served every step's weights bit-exact")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
