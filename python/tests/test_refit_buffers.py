"""An engine's refit buffers without vLLM (``refit._engine``): what a refit
writes into them and a load hands the engine, in host memory and laid out
as on a GPU; the fabric they need, refused at once otherwise."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import refit  # noqa: E402
import refit.vllm  # noqa: E402
from refit._engine import RefitBuffers, check_fabric  # noqa: E402

TENSORS = [("w", "f32", [4, 6]), ("b", "f32", [6]), ("e", "f32", [3, 2]), ("n", "i32", [5])]
# What each engine rank loads: `w` by columns (a box not contiguous in the
# full tensor), `b` by rows (rank 1 in two boxes, element 4 in none), `e`
# and `n` whole on both.
HELD = [
    {"w": [([0, 0], [4, 3])], "b": [([0], [3])], "e": [([0, 0], [3, 2])], "n": [([0], [5])]},
    {"w": [([0, 3], [4, 3])], "b": [([3], [1]), ([5], [1])], "e": [([0, 0], [3, 2])], "n": [([0], [5])]},
]


def values(step):
    return {
        "w": np.arange(24, dtype=np.float32).reshape(4, 6) + 100 * step,
        "b": -np.arange(6, dtype=np.float32) - step,
        "e": np.full((3, 2), 0.5 * step, np.float32),
        "n": np.arange(5, dtype=np.int32) * step,
    }


def expected(rank, step):
    """The full-shape tensors rank ``rank`` hands its engine: its boxes of
    version ``step``, zeros elsewhere."""
    out = {}
    for name, boxes in HELD[rank].items():
        full = values(step)[name]
        want = np.zeros_like(full)
        for offset, extent in boxes:
            where = tuple(slice(o, o + e) for o, e in zip(offset, extent))
            want[where] = full[where]
        out[name] = want
    return out


@pytest.mark.parametrize("full_tensors", [None, False], ids=["host-default", "as-on-a-gpu"])
def test_a_refit_lands_in_the_buffers_and_a_load_hands_full_tensors(full_tensors):
    """Two engine ranks over the node fabric: each load hands the engine
    every tensor the rank holds part of, full-shape, its part of the
    committed version in place and zeros elsewhere — the same whether the
    full tensors are kept (host memory) or built per load (device memory's
    way); a version the buffers do not hold is refused before the engine's
    load runs, naming the rank."""
    whole = {n: [([0] * len(s), s)] for n, _, s in TENSORS}
    train, _ = refit.vllm.derived_layout(TENSORS, [whole], dtype="f32")
    infer, missing = refit.vllm.derived_layout(TENSORS, HELD, dtype="f32")
    assert missing == []
    with refit.Orchestrator(fabric="node", deadline=10.0) as orch:
        src = refit.Source(train, 0)
        src.join(orch.address, orch.secret)
        engines = [RefitBuffers(TENSORS, HELD[r], infer, r, dtype="f32", fabric="node", full_tensors=full_tensors) for r in range(2)]
        # Host memory by default: the full tensors are kept, `w`'s column
        # box apart (copied in before each load); as on a GPU, only `e` and
        # `n` (held whole) are.
        assert sorted(engines[1].full) == (["b", "e", "n", "w"] if full_tensors is None else ["e", "n"])
        assert len(engines[1].copies) == (1 if full_tensors is None else 0)
        for e in engines:
            assert e.gpu is None
            e.join(orch.address, orch.secret)
        orch.connect(1, 2, timeout=30)
        for step in (1, 2):
            src.step({n: v for n, v in values(step).items()})
            orch.refit(step)
            for r, e in enumerate(engines):
                got = {}
                e.receive(step, lambda tensors: got.update({n: t.clone() for n, t in tensors}))
                want = expected(r, step)
                assert sorted(got) == sorted(want)
                for name, t in got.items():
                    assert t.dtype == (torch.int32 if name == "n" else torch.float32)
                    np.testing.assert_array_equal(t.numpy(), want[name], err_msg=f"rank {r} {name}")
        called = []
        with pytest.raises(refit.VersionError, match=r"dst rank 1: asked to load version 1, its refit buffers hold version 2"):
            engines[1].receive(1, called.append)
        assert called == []
        for e in engines:
            e.shutdown()


def test_a_fabric_that_cannot_reach_the_buffers_is_refused_naming_the_rank():
    """Device buffers on a host fabric, host buffers on a GPU fabric: refused
    before anything is allocated or joined, saying which fabric to use."""
    with pytest.raises(refit.RefitError, match=r"dst rank 3: the model is on cuda:0, .*fabric is 'node', which moves host memory only: .*fabric='ipc'.*fabric='nccl'"):
        check_fabric(torch.device("cuda", 0), "node", "dst rank 3")
    with pytest.raises(refit.RefitError, match=r"dst rank 0: the model is on the CPU, .*fabric is 'ipc', which moves CUDA device memory only: .*fabric='node'"):
        check_fabric(torch.device("cpu"), "ipc", "dst rank 0")
    with pytest.raises(refit.RefitError, match=r"fabric 'bogus' is none refit knows"):
        check_fabric(torch.device("cpu"), "bogus", "dst rank 0")
    with pytest.raises(refit.RefitError, match=r"the model is on meta"):
        check_fabric(torch.device("meta"), None, "dst rank 0")
    for device, fabric in (("cuda", "ipc"), ("cuda", "nccl"), ("cuda", None), ("cpu", "node"), ("cpu", "simulated-ipc"), ("cpu", None)):
        check_fabric(torch.device(device, 0) if device == "cuda" else torch.device(device), fabric, "dst rank 0")
    # Through the engine's own constructor (no GPU needed: refused first).
    infer, _ = refit.vllm.derived_layout(TENSORS, HELD, dtype="f32")
    with pytest.raises(refit.RefitError, match=r"dst rank 1: the model is on cuda:0"):
        RefitBuffers(TENSORS, HELD[1], infer, 1, dtype="f32", device="cuda:0", fabric="tcp")


def test_vllm_rollouts_tell_the_workers_the_fabric():
    """``VLLMRollouts.connect`` sends every worker the orchestrator's fabric
    (with which each refuses, at connect, one it cannot use)."""

    class Orch:
        address, secret, fabric = "127.0.0.1:1", "s", "ipc"

        def connect(self, src_ranks, dst_ranks, timeout):
            return (src_ranks, dst_ranks)

    class Client:
        world_size = 2
        infos = []

        def init_weight_transfer_engine(self, info):
            self.infos.append(info)

        start_weight_update = update_weights = finish_weight_update = lambda self, *a, **k: None

    whole = {n: [([0] * len(s), s)] for n, _, s in TENSORS}
    train, _ = refit.vllm.derived_layout(TENSORS, [whole], dtype="f32")
    rollouts = refit.vllm.VLLMRollouts(Orch(), [Client()], train)
    assert rollouts.connect(src_ranks=1) == (1, 2)
    assert [i["fabric"] for i in Client.infos] == ["ipc"]
    with refit.Orchestrator(fabric="tcp") as orch:
        assert orch.fabric == "tcp"
