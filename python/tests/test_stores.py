"""Stores and refits in one process: writes land on the destinations, the
version fence, the commit, errors."""

import numpy as np
import pytest

import refit


def layouts(dst_dtype="f32"):
    train = (
        refit.LayoutBuilder(2)
        .tensor(refit.TensorBuilder("w", "f32", [4, 8]).mesh([2], ["shard(0)"]).buffer("params", 0))
        .tensor(refit.TensorBuilder("b", "f32", [8]).mesh([2], ["replicate"]).buffer("params", 16))
        .build()
    )
    infer = (
        refit.LayoutBuilder(4)
        .tensor(refit.TensorBuilder("w", dst_dtype, [4, 8]).mesh([2, 2], ["replicate", "shard(1)"]))
        .tensor(refit.TensorBuilder("b", dst_dtype, [8]).mesh([2, 2], ["replicate", "shard(0)"]))
        .build()
    )
    return train, infer


def full(step):
    return {"w": np.arange(32, dtype=np.float32).reshape(4, 8) + 100 * step, "b": -np.arange(8, dtype=np.float32) - step}


def block(x, offset, extent):
    return x[tuple(slice(o, o + e) for o, e in zip(offset, extent))]


def setup(dst_dtype="f32", np_dtype=np.float32):
    system = refit.spawn_local(*layouts(dst_dtype))
    src_arrays = []
    for s in system.sources:
        arrays = {n: np.zeros(s.block(n)[1], np.float32) for n in ("w", "b")}
        s.register_all(arrays)
        src_arrays.append(arrays)
    dst_arrays = []
    for d in system.destinations:
        arrays = {n: np.full(d.block(n)[1], 7, np_dtype) for n in ("w", "b")}
        d.register_all(arrays)
        dst_arrays.append(arrays)
    return system, src_arrays, dst_arrays


def train_step(system, src_arrays, step):
    versions = []
    for s, arrays in zip(system.sources, src_arrays):
        for n, a in arrays.items():
            a[...] = block(full(step)[n], *s.block(n))
        versions.append(s.step())
    return versions


def test_writes_land_on_every_destination():
    system, src_arrays, dst_arrays = setup()
    for step in (1, 2, 3):
        assert train_step(system, src_arrays, step) == [step, step]
        report = system.refit_latest()
        assert isinstance(report, refit.RefitReport) and report.version == step and report.bytes > 0 and report.seconds > 0
        for d, arrays in zip(system.destinations, dst_arrays):
            assert d.load() == step
            for n, a in arrays.items():
                np.testing.assert_array_equal(a, block(full(step)[n], *d.block(n)))
    # Refitting what is served moves nothing.
    again = system.refit(3)
    assert again.already_served and again.bytes == 0


def test_bf16_destination_rounds_to_nearest_even():
    system, src_arrays, dst_arrays = setup("bf16", np.uint16)
    train_step(system, src_arrays, 1)
    system.sources[0]._slots["w"][1][0, 0] = 1 / 3  # one value that rounds
    system.sources[0].step()
    system.sources[1].step()
    system.refit_latest()
    d = system.destinations[0]
    d.load()
    assert dst_arrays[0]["w"][0, 0] == 0x3EAB  # bf16(1/3)
    bits = np.float32(100 + 1).view(np.uint32) >> 16  # w[0,1] = 101, exact in bf16
    assert dst_arrays[0]["w"][0, 1] == bits


def test_version_fence_and_errors():
    system, src_arrays, dst_arrays = setup()
    # Nothing written: refused before anything moves.
    with pytest.raises(refit.VersionError, match=r"nothing written; every source must hold a whole version"):
        system.refit_latest()
    with pytest.raises(refit.VersionError, match="no refit has committed yet"):
        system.destinations[0].load()
    train_step(system, src_arrays, 1)
    with pytest.raises(refit.VersionError, match="holds version 1, the refit asked for 2"):
        system.refit(2)
    system.refit(1)
    # Sources on different versions.
    system.sources[0].step()
    with pytest.raises(refit.VersionError):
        system.refit(2)
    system.sources[1].step()
    system.refit(2)
    # The previous committed version stays readable; older ones do not.
    d = system.destinations[1]
    assert d.load(1) == 1 and d.load(2) == 2 and d.version == 2
    train_step(system, src_arrays, 3)
    system.refit_latest()
    with pytest.raises(refit.VersionError, match="dst rank 1: version 1 is not served"):
        d.load(1)
    assert all(issubclass(e, refit.RefitError) for e in (refit.VersionError, refit.TensorError, refit.PlanError, refit.MemberError))


def test_a_failed_step_keeps_the_version_and_the_weights():
    system, src_arrays, dst_arrays = setup()
    train_step(system, src_arrays, 1)
    s = system.sources[0]
    before = s.read("params")
    with pytest.raises(refit.TensorError, match=r"src rank 0: tensor 'w' .*: shape \[3, 8\] given"):
        s.step({"w": np.zeros((3, 8), np.float32)})
    assert s.version == 1 and s.weights == "version 1" and s.read("params") == before


def test_registration_checks_dtype_shape_and_names():
    train, infer = layouts("bf16")
    s = refit.Source(train, 1)
    with pytest.raises(refit.TensorError, match=r"src rank 1: tensor 'w' \(block of extent \[2, 8\] at offset \[2, 0\], f32\): shape \[4, 8\] given"):
        s.register("w", np.zeros((4, 8), np.float32))
    with pytest.raises(refit.TensorError, match="an array of format 'd'"):
        s.register("w", np.zeros((2, 8), np.float64))
    with pytest.raises(refit.TensorError, match="no tensor or buffer 'v'"):
        s.register("v", np.zeros(2, np.float32))
    with pytest.raises(refit.TensorError, match="neither a torch tensor nor"):
        s.register("b", [0.0] * 8)
    s.register("params", np.zeros(24, np.float32))  # the whole fused buffer
    d = refit.Destination(infer, 0)
    with pytest.raises(refit.TensorError, match="give bf16 as its raw bits"):
        d.register("w", np.zeros((4, 4), np.float16))
    ro = np.zeros((4, 4), np.uint16)
    ro.setflags(write=False)
    d.register("w", ro)
    sub = refit.Layout.from_json('{"ranks": 2, "tensors": [{"name": "x", "dtype": "f32", "shape": [2], "mesh": {"shape": [1], "ranks": [1]}, "placements": ["replicate"]}]}')
    with pytest.raises(refit.TensorError, match="src rank 0 holds no part of tensor 'x'"):
        refit.Source(sub, 0).register("x", np.zeros(2, np.float32))


def test_read_only_destination_array_is_refused_at_load():
    system, src_arrays, dst_arrays = setup()
    train_step(system, src_arrays, 1)
    system.refit_latest()
    d = system.destinations[0]
    ro = np.zeros(d.block("w")[1], np.float32)
    ro.setflags(write=False)
    d.register("w", ro)
    with pytest.raises(refit.TensorError, match="read-only"):
        d.load()


def test_layouts_that_cannot_be_planned_fail_at_spawn():
    train, _ = layouts()
    other = refit.LayoutBuilder(1).tensor(refit.TensorBuilder("w", "f32", [4, 9]).mesh([1], ["replicate"])).build()
    with pytest.raises(refit.PlanError, match="planning failed"):
        refit.spawn_local(train, other)


def test_torch_tensors_both_sides():
    torch = pytest.importorskip("torch")
    train, infer = layouts("bf16")
    system = refit.spawn_local(train, infer)
    full_w = torch.arange(32, dtype=torch.float32).reshape(4, 8) / 3
    for s in system.sources:
        (o, e) = s.block("w")
        s.register("w", full_w[o[0] : o[0] + e[0]].clone())
        s.register("b", torch.ones(8))
        s.step()
    system.refit_latest()
    for d in system.destinations:
        (o, e) = d.block("w")
        w = torch.zeros(e, dtype=torch.bfloat16)
        d.register("w", w)
        d.register("b", torch.zeros(d.block("b")[1], dtype=torch.bfloat16))
        d.load()
        assert torch.equal(w, full_w[:, o[1] : o[1] + e[1]].to(torch.bfloat16))
    with pytest.raises(refit.TensorError, match="a torch tensor of torch.float32 given"):
        system.destinations[0].register("w", torch.zeros(4, 4))


def test_c_order_arrays_are_copied_in_place_and_others_through_bytes():
    # Which path each array takes: C-order numpy arrays are handed to the
    # store themselves (read and written in place); a strided view, a
    # Fortran-order array and a plain buffer-protocol object go through
    # bytes. Both must give the same weights. (A destination must be C
    # order: it is written in place either way.)
    from refit import _host_array

    c = np.zeros((4, 8), np.float32)
    assert _host_array(c) is c
    assert _host_array(np.zeros((8, 4), np.float32).T) is None
    assert _host_array(np.zeros((4, 16), np.float32)[:, ::2]) is None
    assert _host_array(bytearray(8)) is None

    system, src_arrays, dst_arrays = setup()
    # Source 1 holds its block of w as a strided view of a wider array.
    wide = np.zeros((2, 16), np.float32)
    view = wide[:, ::2]
    system.sources[1].register("w", view)
    src_arrays[1]["w"] = view
    for step in (1, 2):
        train_step(system, src_arrays, step)
        system.refit_latest()
        for d, arrays in zip(system.destinations, dst_arrays):
            assert d.load() == step
            for n, a in arrays.items():
                np.testing.assert_array_equal(a, block(full(step)[n], *d.block(n)))
    d = system.destinations[0]
    d.register("w", np.asfortranarray(np.zeros(d.block("w")[1], np.float32)))
    with pytest.raises(refit.TensorError, match="not C-contiguous"):
        d.load()


def test_a_step_reads_the_array_when_it_runs():
    # The store copies the registered array's memory at step time: what
    # the optimizer wrote in place since the last step is what moves.
    system, src_arrays, dst_arrays = setup()
    train_step(system, src_arrays, 1)
    for arrays in src_arrays:
        arrays["b"] *= 10
    for s in system.sources:
        s.step()
    system.refit_latest()
    d = system.destinations[0]
    d.load()
    np.testing.assert_array_equal(dst_arrays[0]["b"], 10 * block(full(1)["b"], *d.block("b")))


def test_a_load_that_does_not_fit_writes_nothing():
    system, src_arrays, dst_arrays = setup()
    train_step(system, src_arrays, 1)
    system.refit_latest()
    d = system.destinations[0]
    before = {n: a.copy() for n, a in dst_arrays[0].items()}
    # An array swapped behind the registration's back, one element short:
    # the store refuses before it writes any registered array.
    d._slots["w"] = (d._slots["w"][0], np.zeros(int(np.prod(d.block("w")[1])) - 1, np.float32))
    with pytest.raises(refit.TensorError, match=r"dst rank 0: 'w'"):
        d.load()
    for n in ("b",):
        np.testing.assert_array_equal(dst_arrays[0][n], before[n])


def test_torch_tensors_in_place_and_not():
    torch = pytest.importorskip("torch")
    from refit import _host_array

    t = torch.zeros(4, 8)
    assert _host_array(t) is t
    assert _host_array(torch.zeros(8, 4).T) is None
    system = refit.spawn_local(*layouts())
    for s in system.sources:
        s.register("w", torch.zeros(s.block("w")[1]))
        # Source 1's b is a strided (non-contiguous) view: through bytes.
        b = torch.zeros(8) if s.rank == 0 else torch.zeros(8, 2)[:, 0]
        assert (_host_array(b) is None) == (s.rank == 1)
        s.register("b", b)
    outs = []
    for d in system.destinations:
        w, b = torch.zeros(d.block("w")[1]), torch.zeros(d.block("b")[1])
        d.register_all({"w": w, "b": b})
        outs.append((w, b))
    for step in (1, 2):
        for s in system.sources:
            s._slots["w"][1].copy_(torch.from_numpy(block(full(step)["w"], *s.block("w"))))
            s._slots["b"][1].copy_(torch.from_numpy(full(step)["b"]))
            s.step()
        system.refit_latest()
        for d, (w, b) in zip(system.destinations, outs):
            assert d.load() == step
            assert torch.equal(w, torch.from_numpy(block(full(step)["w"], *d.block("w")).copy()))
            assert torch.equal(b, torch.from_numpy(block(full(step)["b"], *d.block("b")).copy()))


def test_a_subset_refit_moves_only_the_named_tensors():
    system, src_arrays, dst_arrays = setup()
    train_step(system, src_arrays, 1)
    with pytest.raises(refit.RefitError, match="a subset refit needs a committed version"):
        system.refit_latest(only=["b"])
    whole = system.refit_latest()
    train_step(system, src_arrays, 2)
    part = system.refit_latest(only=["b"])
    assert part.version == 2 and 0 < part.bytes < whole.bytes
    for d, arrays in zip(system.destinations, dst_arrays):
        assert d.load() == 2
        np.testing.assert_array_equal(arrays["b"], block(full(2)["b"], *d.block("b")))
        np.testing.assert_array_equal(arrays["w"], block(full(1)["w"], *d.block("w")))  # kept from version 1
    with pytest.raises(refit.PlanError, match="tensor 'x' named for a subset refit"):
        train_step(system, src_arrays, 3)
        system.refit(3, only=["x"])


def _e4m3(x):
    """A reference e4m3 (float8_e4m3fn) encoder: the nearest code, ties to
    the even code, saturating to 448, the sign kept."""
    values = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        values.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    a = min(abs(float(x)), 448.0)
    best = min(range(0x7F), key=lambda c: (abs(values[c] - a), c % 2))
    return best | (0x80 if np.signbit(x) else 0)


def test_a_block_scaled_fp8_destination_refits_codes_and_scales():
    # f32 TP2 by rows -> FP8 in blocks of 2 x 3, TP2 by columns (4 each:
    # block column 1 is cut), scales sharded with the blocks they hold.
    train = refit.LayoutBuilder(2).tensor(refit.TensorBuilder("w", "f32", [4, 8]).mesh([2], ["shard(0)"])).build()
    infer = (
        refit.LayoutBuilder(2)
        .tensor(refit.TensorBuilder("w", "f8e4m3", [4, 8]).mesh([2], ["shard(1)"]).scale("w_scale", [2, 3]))
        .tensor(refit.TensorBuilder("w_scale", "f32", [2, 3]).mesh([2], ["replicate"]))
        .build()
    )
    system = refit.spawn_local(train, infer)
    values = (np.arange(32, dtype=np.float32).reshape(4, 8) - 13.0) / 7.0
    for s in system.sources:
        a = block(values, *s.block("w")).copy()
        s.register("w", a)
        s.step()
    outs = []
    for d in system.destinations:
        arrays = {"w": np.zeros(d.block("w")[1], np.uint8), "w_scale": np.zeros(d.block("w_scale")[1], np.float32)}
        d.register_all(arrays)
        outs.append(arrays)
    system.refit_latest()
    scales = np.zeros((2, 3), np.float32)
    for i in range(2):
        for j in range(3):
            amax = np.abs(values[2 * i : 2 * i + 2, 3 * j : 3 * j + 3]).max()
            scales[i, j] = np.float32(amax) / np.float32(448.0) if amax else 1.0
    codes = np.array([[_e4m3(np.float32(values[r, c]) / scales[r // 2, c // 3]) for c in range(8)] for r in range(4)], np.uint8)
    for d, arrays in zip(system.destinations, outs):
        assert d.load() == 1
        np.testing.assert_array_equal(arrays["w"], block(codes, *d.block("w")))
        np.testing.assert_array_equal(arrays["w_scale"], scales)
    # A NaN fails the refit, naming the tensor; version 1 keeps serving.
    for s in system.sources:
        s._slots["w"][1][...] = np.nan
        s.step()
    with pytest.raises(refit.RefitError, match="tensor 'w'.*NaN or infinity"):
        system.refit_latest()
    assert all(d.load() == 1 for d in system.destinations)


def test_gpu_fabrics_without_a_gpu_refuse_before_anything_moves():
    train, infer = layouts()
    for fabric in ("nccl", "ipc"):
        system = refit.spawn_local(train, infer, fabric=fabric)
        for s in system.sources:
            s.register_all({n: np.ones(s.block(n)[1], np.float32) for n in ("w", "b")})
            s.step()
        try:
            system.refit(1)
        except refit.MemberError as e:
            assert "transport unavailable" in str(e), str(e)
        else:
            pytest.skip("a GPU is available here: scripts/gpu-check.sh covers the GPU fabrics")
        assert all(d.version is None for d in system.destinations)
        system.orchestrator.close()


def test_unknown_fabrics_are_refused():
    train, infer = layouts()
    with pytest.raises(ValueError, match="fabric 'shm'"):
        refit.spawn_local(train, infer, fabric="shm")
    with pytest.raises(ValueError, match="expected 'node', 'tcp', 'nccl'"):
        refit.Orchestrator(fabric="in_process")


def test_both_entry_points_take_one_set_of_settings_with_one_set_of_defaults():
    import inspect

    train, infer = layouts()
    with pytest.raises(TypeError, match="deadlin"):
        refit.spawn_local(train, infer, deadlin=5.0)
    with pytest.raises(refit.RefitError, match="control_timeout: -1"):
        refit.spawn_local(train, infer, control_timeout=-1.0)
    # spawn_local takes the settings' defaults from the binding;
    # Orchestrator's signature spells them out: the two must agree.
    binding = inspect.signature(refit._refit.Settings).parameters
    spelled = inspect.signature(refit.Orchestrator.__init__).parameters
    shared = [n for n in binding if n != "fabric"]
    assert shared and all(n in spelled for n in shared)
    assert {n: spelled[n].default for n in shared} == {n: binding[n].default for n in shared}


class DLPackOnly:
    """An array seen only through the DLPack protocol."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, *args, **kwargs):
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_dlpack_tensors_and_capsules_are_found_in_place():
    from refit._refit import memory_of

    a = np.zeros((3, 4), np.float32)
    assert memory_of(DLPackOnly(a)) == (a.ctypes.data, 48, None)
    assert memory_of(a.__dlpack__()) == (a.ctypes.data, 48, None)
    tail = np.zeros(10, np.float32)[2:]
    assert memory_of(DLPackOnly(tail)) == (tail.ctypes.data, 32, None)
    column = np.zeros((4, 1), np.float32)  # a dimension of 1 has any stride
    assert memory_of(DLPackOnly(column)) == (column.ctypes.data, 16, None)
    with pytest.raises(refit.TensorError, match="non-contiguous DLPack"):
        memory_of(DLPackOnly(np.zeros((4, 4), np.float32)[:, ::2]))
    with pytest.raises(refit.TensorError, match="holds no memory refit can use in place"):
        memory_of(object())


@pytest.mark.parametrize("fabric", ["simulated-nccl", "simulated-ipc", "node", "tcp"])
def test_in_place_sources_are_read_where_they_are(fabric):
    """Sources over the trainer's own arrays (no copy into the store), on
    the GPU fabrics' simulated planes and the node fabric: what a step
    writes in place inside ``stepping()`` is what every destination loads,
    and so is a checkpoint loaded into them and ``restore``d as a version."""
    train, infer = layouts()
    with refit.Orchestrator(fabric=fabric) as orch:
        params = [np.zeros(24, np.float32) for _ in range(2)]  # rank r's fused "params": w rows, then b
        # Rank 1's array reaches refit only through DLPack (as a JAX or
        # CuPy array can).
        sources = [refit.Source.in_place(train, r, {"params": params[r] if r == 0 else DLPackOnly(params[r])}) for r in range(2)]
        dests = [refit.Destination(infer, r) for r in range(4)]
        dst_arrays = []
        for d in dests:
            arrays = {n: np.zeros(d.block(n)[1], np.float32) for n in ("w", "b")}
            d.register_all(arrays)
            dst_arrays.append(arrays)
        joined = refit.join(orch.address, orch.secret)
        for r in sources + dests:
            r.join(joined=joined)
        orch.connect(2, 4)
        for step in (1, 2):
            for s, p in zip(sources, params):
                w_off, w_ext = s.block("w")
                with s.stepping():
                    p[:16] = block(full(step)["w"], w_off, w_ext).reshape(-1)
                    p[16:] = full(step)["b"]
            assert [s.version for s in sources] == [step, step]
            orch.refit(step)
            for d, arrays in zip(dests, dst_arrays):
                d.load(step)
                for n, a in arrays.items():
                    np.testing.assert_array_equal(a, block(full(step)[n], *d.block(n)))
        with pytest.raises(refit.TensorError, match="stepping"):
            sources[0].step()
        with pytest.raises(refit.TensorError, match="restores the arrays it holds"):
            sources[0].restore(2, {"params": params[0]})
        # A checkpoint loaded into the arrays in place, then restored as
        # version 3: a refit of 3 moves exactly them.
        for s, p in zip(sources, params):
            w_off, w_ext = s.block("w")
            p[:16] = block(full(3)["w"], w_off, w_ext).reshape(-1)
            p[16:] = full(3)["b"]
            s.restore(3)
        assert [s.version for s in sources] == [3, 3]
        orch.refit(3)
        for d, arrays in zip(dests, dst_arrays):
            d.load(3)
            for n, a in arrays.items():
                np.testing.assert_array_equal(a, block(full(3)[n], *d.block(n)))
        with pytest.raises(RuntimeError):
            with sources[0].stepping():
                raise RuntimeError("the optimizer diverged")
        assert "torn" in sources[0].weights
        joined.shutdown()


def served_in_place(orch, destination):
    """Two sources and four destinations over ``memory`` (the engine's
    arrays, 7 everywhere), made by ``destination(layout, rank, arrays)``,
    joined to ``orch`` and connected; with ``step(k)`` (every source to
    version ``k``) and ``holds(dst, arrays, k)`` (the arrays hold ``k``)."""
    train, infer = layouts()
    sources = [refit.Source(train, r) for r in range(2)]
    src_arrays = []
    for s in sources:
        arrays = {n: np.zeros(s.block(n)[1], np.float32) for n in ("w", "b")}
        s.register_all(arrays)
        src_arrays.append(arrays)
    memory = [{name: np.full(elems, 7, np.float32) for name, _, elems in infer.buffers(r)} for r in range(4)]
    dests = [destination(infer, r, memory[r]) for r in range(4)]
    joined = refit.join(orch.address, orch.secret)
    for r in sources + dests:
        r.join(joined=joined)
    orch.connect(2, 4)

    def step(k):
        for s, arrays in zip(sources, src_arrays):
            for n, a in arrays.items():
                a[...] = block(full(k)[n], *s.block(n))
            s.step()

    def holds(d, mem, k):
        return all(np.array_equal(a, block(full(k)[n.split("#")[0]], *d.block(n.split("#")[0])).reshape(-1)) for n, a in mem.items())

    return memory, dests, joined, step, holds


def serving_everywhere(dests, memory, holds):
    """Whether every destination serves version ``k`` and its arrays hold it."""

    def check(k):
        ok = True
        for d, mem in zip(dests, memory):
            with d.serving() as version:
                ok &= version == k and holds(d, mem, k)
        return ok

    return check


@pytest.mark.parametrize("fabric", ["simulated-nccl", "simulated-ipc", "node", "tcp"])
def test_in_place_destinations_receive_each_commit_where_they_are(fabric):
    """Destinations over the inference engine's own arrays, on the GPU
    fabrics' simulated planes and the node fabric: each committed version
    is copied into them
    (read inside ``serving()``), a reader serving them holds the next
    commit off until it lets go, and ``load()`` is refused."""
    import threading
    import time

    with refit.Orchestrator(fabric=fabric) as orch:
        # Rank 3's arrays as DLPack capsules.
        memory, dests, joined, step, holds = served_in_place(
            orch, lambda infer, r, mem: refit.Destination.in_place(infer, r, mem if r < 3 else {n: a.__dlpack__() for n, a in mem.items()})
        )
        serves_everywhere = serving_everywhere(dests, memory, holds)
        with dests[0].serving() as version:
            assert version is None and "nothing written" in dests[0].weights
        for k in (1, 2):
            step(k)
            orch.refit(k)
            assert serves_everywhere(k)
        # A reader holds the next commit off until it leaves its block.
        step(3)
        done = []
        with dests[1].serving() as version:
            t = threading.Thread(target=lambda: done.append(orch.refit(3).version))
            t.start()
            time.sleep(0.5)
            assert not done and version == 2 and holds(dests[1], memory[1], 2)
        t.join(30)
        assert done == [3]
        assert all(holds(d, mem, 3) for d, mem in zip(dests, memory))
        with pytest.raises(refit.TensorError, match="serving"):
            dests[0].load()
        joined.shutdown()


@pytest.mark.parametrize("fabric", ["node", "tcp"])
def test_destinations_written_in_place_serve_each_commit_and_tear_on_failure(fabric):
    """``direct=True``: refits write the engine's arrays in place; each
    commit is served; a refit that fails after writing (here: a reader on
    rank 1 holds its weights past the deadline while the other ranks were
    written) leaves the written ranks torn (``serving()`` yields None),
    the held rank on its version, none on another; the next refit serves
    again."""
    with refit.Orchestrator(fabric=fabric, deadline=2.0) as orch:
        memory, dests, joined, step, holds = served_in_place(
            orch, lambda infer, r, mem: refit.Destination.in_place(infer, r, mem, direct=True)
        )
        serves_everywhere = serving_everywhere(dests, memory, holds)
        for k in (1, 2):
            step(k)
            orch.refit(k)
            assert serves_everywhere(k)
        step(3)
        with dests[1].serving() as version:
            assert version == 2
            with pytest.raises(refit.MemberError):
                orch.refit(3)
            assert holds(dests[1], memory[1], 2), "written under a reader"
        served = []
        for d in dests:
            with d.serving() as version:
                served.append(version)
        assert served[1] == 2 and all(v in (2, None) for v in served), served
        assert None in served, "the written ranks are torn"
        step(4)
        orch.refit(4)
        assert serves_everywhere(4)
        joined.shutdown()


def test_in_place_destinations_need_every_buffer_writable():
    _, infer = layouts()
    arrays = {name: np.zeros(elems, np.float32) for name, _, elems in infer.buffers(0)}
    first = next(iter(arrays))
    arrays[first].flags.writeable = False
    with pytest.raises(refit.TensorError, match="read-only"):
        refit.Destination.in_place(infer, 0, arrays)
    with pytest.raises(refit.TensorError, match="no array for buffer"):
        refit.Destination.in_place(infer, 0, {})


def test_in_place_sources_need_every_buffer_contiguous():
    train, _ = layouts()
    with pytest.raises(refit.TensorError, match="no array for buffer"):
        refit.Source.in_place(train, 0, {})
    with pytest.raises(refit.RegistrationError, match="src rank 0: buffer 'params': an array not in C order"):
        refit.Source.in_place(train, 0, {"params": np.zeros((24, 2), np.float32)[:, 0]})


def test_delta_refits_send_what_changed():
    """With ``delta=True`` a refit after a clean one sends what changed:
    one weight changed moves a fraction of the dense bytes, and every
    destination still holds every value bit for bit."""
    train = refit.LayoutBuilder(1).tensor(refit.TensorBuilder("w", "f32", [64, 64]).mesh([1], ["replicate"])).build()
    infer = refit.LayoutBuilder(2).tensor(refit.TensorBuilder("w", "f32", [64, 64]).mesh([2], ["shard(0)"])).build()
    for delta in (False, True):
        system = refit.spawn_local(train, infer, delta=delta)
        w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
        sent = []
        for step in range(3):
            w[step, step] += 1  # the optimizer touches one weight
            system.sources[0].step({"w": w})
            sent.append(system.refit_latest().bytes)
            for d in system.destinations:
                np.testing.assert_array_equal(np.frombuffer(d.read("w")[1], np.float32).reshape(32, 64), w[32 * d.rank:32 * (d.rank + 1)])
        dense = 64 * 64 * 4
        if delta:
            assert sent[0] >= dense and all(b < dense / 10 for b in sent[1:]), sent  # the first: dense, with headers
        else:
            assert sent == [dense] * 3, sent
        system.orchestrator.close()
