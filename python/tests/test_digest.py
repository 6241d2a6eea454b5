"""The digest check before every commit (``digest_check``, on by default):
every member reads back what its run moved and the orchestrator compares
before any destination commits. Reports say what was checked; in-place
destinations (the engine's own arrays) are read back where they are; the
NCCL and IPC planes' memory (here their simulated planes) is not, and says
so. A byte flipped between a transfer and its commit cannot be staged from
Python (the fault injection is Rust test machinery, not in the wheel):
orchestrator/tests/digest.rs covers that."""

import numpy as np
import pytest

import refit
from test_stores import layouts, served_in_place, setup, train_step


def test_every_refit_is_checked_by_default_and_the_check_can_be_turned_off():
    # f32 sources, bf16 destinations: the senders' digests are of what
    # they narrow to.
    system, src_arrays, _ = setup("bf16", np.uint16)
    train_step(system, src_arrays, 1)
    report = system.refit_latest()
    assert (report.verified_ranks, report.unverified_ranks) == (4, 0)
    assert 0 < report.verify_seconds <= report.transfer_seconds
    off = refit.spawn_local(*layouts(), digest_check=False)
    for s in off.sources:
        s.register_all({n: np.ones(s.block(n)[1], "float32") for n in ("w", "b")})
        s.step()
    report = off.refit_latest()
    assert (report.verify_seconds, report.verified_ranks, report.unverified_ranks) == (0.0, 0, 0)


@pytest.mark.parametrize("direct", [False, True])
def test_in_place_destinations_are_read_back_where_they_are(direct):
    with refit.Orchestrator(fabric="node") as orch:
        memory, dests, joined, step, holds = served_in_place(
            orch, lambda infer, r, mem: refit.Destination.in_place(infer, r, mem, direct=direct)
        )
        for k in (1, 2):
            step(k)
            report = orch.refit(k)
            assert (report.verified_ranks, report.unverified_ranks) == (4, 0)
            assert all(holds(d, mem, k) for d, mem in zip(dests, memory))
        joined.shutdown()


def test_simulated_device_memory_is_reported_unverified():
    with refit.Orchestrator(fabric="simulated-nccl") as orch:
        memory, dests, joined, step, holds = served_in_place(orch, lambda infer, r, mem: refit.Destination.in_place(infer, r, mem))
        step(1)
        report = orch.refit(1)
        assert (report.verified_ranks, report.unverified_ranks) == (0, 4)
        joined.shutdown()
