"""Elastic destination groups from Python: replicas of one inference layout
added (seeded from a serving replica) and removed while refits go on, in
one process and across processes; every served value checked."""

import subprocess
import sys

import numpy as np
import pytest

import refit

TRAIN = (
    refit.LayoutBuilder(2)
    .tensor(refit.TensorBuilder("w", "f32", [4, 8]).mesh([2], ["shard(0)"]).buffer("params", 0))
    .tensor(refit.TensorBuilder("b", "f32", [8]).mesh([2], ["replicate"]).buffer("params", 16))
    .build()
)
# One inference replica: TP2 the other way.
REPLICA = (
    refit.LayoutBuilder(2)
    .tensor(refit.TensorBuilder("w", "f32", [4, 8]).mesh([2], ["shard(1)"]))
    .tensor(refit.TensorBuilder("b", "f32", [8]).mesh([2], ["shard(0)"]))
    .build()
)


def full(step):
    return {"w": np.arange(32, dtype=np.float32).reshape(4, 8) + 100 * step, "b": -np.arange(8, dtype=np.float32) - step}


def block(x, offset, extent):
    return x[tuple(slice(o, o + e) for o, e in zip(offset, extent))]


def registered(rank):
    arrays = {n: np.zeros(rank.block(n)[1], np.float32) for n in ("w", "b")}
    rank.register_all(arrays)
    return arrays


def check(d, arrays, step):
    assert d.load(step) == step
    for n, a in arrays.items():
        np.testing.assert_array_equal(a, block(full(step)[n], *d.block(n)), err_msg=f"{n} on a destination at step {step}")


def test_a_local_group_of_replicas_grows_and_shrinks_between_refits():
    assert REPLICA.replicated(1).fingerprint == REPLICA.fingerprint
    system = refit.spawn_local(TRAIN, REPLICA.replicated(2), replica=REPLICA)
    src = [registered(s) for s in system.sources]
    dst = {id(d): registered(d) for d in system.destinations}

    def step(n):
        for s, arrays in zip(system.sources, src):
            for name, a in arrays.items():
                a[...] = block(full(n)[name], *s.block(name))
            assert s.step() == n

    step(1)
    system.refit(1)
    for d in system.destinations:
        check(d, dst[id(d)], 1)

    added = system.add_replica()
    assert added.replicas == 3 and len(added.destinations) == 2
    assert added.seeded["version"] == 1 and added.seeded["from_replica"] in (0, 1)
    # Every element of one replica once (40 f32), sent by that replica.
    assert added.seeded["bytes"] == 40 * 4
    for d in added.destinations:
        dst[id(d)] = registered(d)
        check(d, dst[id(d)], 1)
    assert len(system.destinations) == 6

    step(2)
    assert system.refit(2).dropped_replicas == []
    for d in system.destinations:
        check(d, dst[id(d)], 2)

    leaving = system.destinations[2:4]
    removed = system.remove_replica(1)
    assert (removed.replicas, removed.seeded) == (2, None)
    assert len(system.destinations) == 4 and all(d not in system.destinations for d in leaving)
    step(3)
    system.refit(3)
    for d in system.destinations:
        check(d, dst[id(d)], 3)
    for d in leaving:
        assert d.version == 2


MEMBER = """
import sys, numpy as np, refit
role, rank, address, secret, replica = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
train = refit.Layout.from_json('{"ranks": 1, "tensors": [{"name": "w", "dtype": "f32", "shape": [4, 4], "mesh": {"shape": [1]}, "placements": ["replicate"]}]}')
one = refit.Layout.from_json('{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [4, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}')
me = refit.Source(train, rank) if role == "src" else refit.Destination(one, rank)
a = np.zeros(me.block("w")[1], np.float32)
me.register("w", a)
if role == "src":
    me.join(address, secret)
else:
    me.join(address, secret, replica=replica or None)
print("joined", flush=True)
for line in sys.stdin:
    n = int(line)
    if role == "src":
        a[...] = n
        me.restore(n)
        print(n, flush=True)
    else:
        print(me.load(n), a.tolist() == np.full(a.shape, n, np.float32).tolist(), flush=True)
"""


def test_a_replica_process_joins_a_running_job_and_is_seeded_from_a_serving_one():
    one = refit.Layout.from_json('{"ranks": 2, "tensors": [{"name": "w", "dtype": "f32", "shape": [4, 4], "mesh": {"shape": [2]}, "placements": ["shard(0)"]}]}')
    orch = refit.Orchestrator(deadline=20.0, replica=one)
    procs = {}

    def start(role, rank, replica=""):
        p = subprocess.Popen(
            [sys.executable, "-c", MEMBER, role, str(rank), orch.address, orch.secret, replica], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert p.stdout.readline().strip() == "joined"
        procs[(role, rank, replica)] = p

    def ask(key, n):
        p = procs[key]
        p.stdin.write(f"{n}\n")
        p.stdin.flush()
        return p.stdout.readline().split()

    try:
        for key in (("src", 0), ("dst", 0), ("dst", 1)):
            start(*key)
        orch.connect(1, 2)
        assert ask(("src", 0, ""), 1) == ["1"]
        orch.refit(1)
        start("dst", 0, "late")
        start("dst", 1, "late")
        added = orch.add_replica("late", timeout=30)
        assert added.replicas == 2 and added.seeded["version"] == 1 and added.seeded["from_replica"] == 0
        for rank in (0, 1):
            assert ask(("dst", rank, "late"), 1) == ["1", "True"], f"the new replica's rank {rank} serves version 1"
        assert ask(("src", 0, ""), 2) == ["2"]
        assert orch.refit(2).version == 2
        for key in (("dst", 0, ""), ("dst", 1, ""), ("dst", 0, "late"), ("dst", 1, "late")):
            assert ask(key, 2) == ["2", "True"], key
        # The first replica leaves; the late one stays and takes version 3.
        assert orch.remove_replica(0).replicas == 1
        assert ask(("src", 0, ""), 3) == ["3"]
        orch.refit(3)
        for rank in (0, 1):
            assert ask(("dst", rank, "late"), 3) == ["3", "True"]
    finally:
        orch.close()
        for p in procs.values():
            p.kill()
            p.wait()


def test_a_failed_refit_says_which_replicas_left():
    # Every exception from a refit says which replicas left the group during
    # it (none here: the sources hold no version 5), and a local system's
    # destinations stay those of the group.
    system = refit.spawn_local(TRAIN, REPLICA.replicated(2), replica=REPLICA)
    before = list(system.destinations)
    try:
        system.refit(5)
    except refit.VersionError as e:
        assert e.dropped_replicas == []
    else:
        raise AssertionError("a refit of a version no source holds committed")
    assert system.destinations == before


def test_a_second_replica_under_a_serving_replicas_name_is_refused_by_name():
    """A process joining as rank 0 of replica "r1" while another live
    process serves it gets a JoinError naming the replica's rank; the name
    is free again once that process has left."""
    orch = refit.Orchestrator(replica=REPLICA)
    first, second = refit.join(orch.address, orch.secret), refit.join(orch.address, orch.secret)
    try:
        refit.Destination(REPLICA, 0).join(joined=first, replica="r1")
        with pytest.raises(refit.JoinError, match=r"'refit\.member\.replica\.r1\.0' is already served by the live process at"):
            refit.Destination(REPLICA, 0).join(joined=second, replica="r1")
        refit.Destination(REPLICA, 0).join(joined=second, replica="r2")
        first.shutdown()
        refit.Destination(REPLICA, 0).join(joined=second, replica="r1")
    finally:
        first.shutdown()
        second.shutdown()
        orch.close()
