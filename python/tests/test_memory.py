"""refit never touches memory it does not hold: in-place tensors and
arrays that move, shrink, change dtype or are freed after registration,
read-only memory, wrong dtypes and shapes, and the raw-address entry
points. Each scenario ends in a clear exception naming the rank and the
buffer, or in a correct refit — never in a signal — and the destinations'
values prove that a source whose memory moved sent nothing it did not own.
Each runs with numpy and, where installed, torch."""

import pickle
import warnings

import numpy as np
import pytest

import refit

FABRICS = ["node", "simulated-ipc"]


def layouts(dst_dtype="f32"):
    """Two training ranks (rows of ``w``), two inference ranks (columns)."""
    train = refit.LayoutBuilder(2).tensor(refit.TensorBuilder("w", "f32", [4, 8]).mesh([2], ["shard(0)"])).build()
    infer = refit.LayoutBuilder(2).tensor(refit.TensorBuilder("w", dst_dtype, [4, 8]).mesh([2], ["shard(1)"])).build()
    return train, infer


def full(step):
    return np.arange(32, dtype=np.float32).reshape(4, 8) + 100 * step


class Pipeline:
    """In-place sources and destinations, every member in this process,
    over ``fabric``; ``src``/``dst`` make each rank's memory."""

    def __init__(self, fabric, src, dst, follow=False, dst_dtype="f32", direct=False):
        self.train, self.infer = layouts(dst_dtype)
        self.orch = refit.Orchestrator(fabric=fabric, deadline=20.0)
        self.src_mem = [src(r) for r in range(2)]
        self.dst_mem = [dst(r) for r in range(2)]
        self.sources = [refit.Source.in_place(self.train, r, {"w#0": self.src_mem[r]}, follow=follow) for r in range(2)]
        self.dests = [refit.Destination.in_place(self.infer, r, {"w#0": self.dst_mem[r]}, follow=follow, direct=direct) for r in range(2)]
        self.joined = refit.join(self.orch.address, self.orch.secret)
        for m in self.sources + self.dests:
            m.join(joined=self.joined)
        self.orch.connect(2, 2)

    def step(self, step, write):
        """Writes step ``step``'s rows into every source (``write(r, rows)``)."""
        for r, s in enumerate(self.sources):
            with s.stepping():
                write(r, full(step)[2 * r : 2 * r + 2])

    def served(self, r, read):
        with self.dests[r].serving() as version:
            return version, np.array(read(self.dst_mem[r]), dtype=np.float32)

    def close(self):
        self.joined.shutdown()
        self.orch.close()


def np_src(r):
    return np.zeros((2, 8), np.float32)


def np_dst(r):
    return np.zeros((4, 4), np.float32)


def np_write(p):
    def write(r, rows):
        p.src_mem[r][...] = rows

    return write


def cols(r, step):
    return full(step)[:, 4 * r : 4 * r + 4]


@pytest.fixture(params=FABRICS)
def fabric(request):
    return request.param


def torch_or_skip():
    return pytest.importorskip("torch")


# --- destinations whose memory moves --------------------------------------


def test_a_torch_destination_whose_data_was_replaced_fails_the_refit_cleanly(fabric):
    torch = torch_or_skip()
    p = Pipeline(fabric, np_src, lambda r: torch.zeros(4, 4))
    try:
        p.step(1, np_write(p))
        p.orch.refit(1)
        assert p.served(0, lambda t: t.numpy())[0] == 1
        # Post-load weight processing swaps the parameter's memory.
        old = p.dst_mem[0]
        old.data = torch.zeros_like(old)
        p.step(2, np_write(p))
        with pytest.raises(refit.MemberError, match=r"buffer 'w#0': its memory was replaced since it was registered"):
            p.orch.refit(2)
        # Nothing was committed anywhere: the group still serves version 1.
        for r in (0, 1):
            with pytest.raises(refit.RegistrationError, match=r"dst rank 0: buffer 'w#0'") if r == 0 else _nothing():
                version, _ = p.served(r, lambda t: t.numpy())
                assert version == 1
        np.testing.assert_array_equal(p.dst_mem[1].numpy(), cols(1, 1))
    finally:
        p.close()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def refit_a_followed_destination_that_moves(p, torch):
    """Refits version 1, moves destination rank 0's tensor (its ``.data``
    replaced) and refits version 2 — both ranks serve it, rank 0 from its
    new memory —, then gives it memory that no longer fits (f64), which
    the refit of version 3 refuses. Returns the tensor and a copy of its
    memory from before the move."""
    p.step(1, np_write(p))
    p.orch.refit(1)
    t = p.dst_mem[0]
    before = t.clone()
    t.data = torch.full((4, 4), -1.0)
    p.step(2, np_write(p))
    p.orch.refit(2)
    for r in (0, 1):
        version, got = p.served(r, lambda t: t.numpy())
        assert version == 2
        np.testing.assert_array_equal(got, cols(r, 2))
    t.data = torch.zeros(4, 4, dtype=torch.float64)
    p.step(3, np_write(p))
    with pytest.raises(refit.MemberError, match=r"buffer 'w#0': .*f64 given for a f32 buffer"):
        p.orch.refit(3)
    return t, before


def test_a_followed_torch_destination_is_written_where_it_moved(fabric):
    torch = torch_or_skip()
    p = Pipeline(fabric, np_src, lambda r: torch.zeros(4, 4), follow=True)
    try:
        _, before = refit_a_followed_destination_that_moves(p, torch)
        np.testing.assert_array_equal(before.numpy(), cols(0, 1))
    finally:
        p.close()


def test_a_resized_torch_destination_is_refused(fabric):
    torch = torch_or_skip()
    p = Pipeline(fabric, np_src, lambda r: torch.zeros(4, 4))
    try:
        p.step(1, np_write(p))
        p.orch.refit(1)
        p.dst_mem[1].resize_(64, 64)
        p.step(2, np_write(p))
        with pytest.raises(refit.MemberError, match=r"buffer 'w#0'"):
            p.orch.refit(2)
        assert p.served(0, lambda t: t.numpy())[0] == 1
    finally:
        p.close()


@pytest.mark.parametrize("host_fabric", ["node", "tcp"])
def test_destinations_written_in_place_never_write_memory_that_moved_shrank_or_was_replaced(host_fabric):
    """``direct=True``: the refit writes the engine's tensors during its
    run. One whose memory was replaced, shrunk or given another state since
    it was registered fails the refit naming the rank and buffer, before a
    byte lands in it (the new memory keeps its bytes), and the group serves
    no version (the other rank was written); with ``follow=True`` the new
    memory is written, and memory that no longer fits is refused."""
    torch = torch_or_skip()

    def broken(p, r, change, match):
        p.step(1, np_write(p))
        p.orch.refit(1)
        assert p.served(r, lambda t: np.asarray(t))[0] == 1
        before = change(p.dst_mem[r])
        p.step(2, np_write(p))
        with pytest.raises(refit.MemberError, match=match):
            p.orch.refit(2)
        np.testing.assert_array_equal(np.asarray(p.dst_mem[r]), before)
        other = 1 - r
        assert p.served(other, lambda t: np.asarray(t))[0] in (None, 1)

    def replaced(t):
        t.data = torch.full((4, 4), -3.0)
        return np.full((4, 4), -3.0, np.float32)

    def shrunk(t):
        t.resize_(1, 2)
        return t.numpy().copy()

    def state(a):
        a.__setstate__(np.ones((64, 64), np.float32).__reduce__()[2])
        return np.ones((64, 64), np.float32)

    for dst, change, match in [
        (lambda r: torch.zeros(4, 4), replaced, r"dst rank 0: .*buffer 'w#0': its memory was replaced since it was registered"),
        (lambda r: torch.zeros(4, 4), shrunk, r"dst rank 0: .*buffer 'w#0'"),
        (np_dst, state, r"dst rank 0: .*buffer 'w#0'"),
    ]:
        p = Pipeline(host_fabric, np_src, dst, direct=True)
        try:
            broken(p, 0, change, match)
        finally:
            p.close()
    # Followed: written where it moved; a dtype that no longer fits is refused.
    p = Pipeline(host_fabric, np_src, lambda r: torch.zeros(4, 4), follow=True, direct=True)
    try:
        t, _ = refit_a_followed_destination_that_moves(p, torch)
        assert not t.any(), "written though it no longer fits"
    finally:
        p.close()


def test_numpy_destinations_cannot_be_resized_and_a_replaced_state_is_refused(fabric):
    p = Pipeline(fabric, np_src, np_dst)
    try:
        p.step(1, np_write(p))
        p.orch.refit(1)
        # refit holds a weak reference: numpy refuses to resize the array.
        with pytest.raises(ValueError, match="resize"):
            p.dst_mem[0].resize(4096, refcheck=False)
        # __setstate__ gives the array other memory (and frees its own):
        # the next refit refuses before writing it.
        p.dst_mem[0].__setstate__(np.ones((64, 64), np.float32).__reduce__()[2])
        p.step(2, np_write(p))
        with pytest.raises(refit.MemberError, match=r"dst rank 0: registered weights: buffer 'w#0'"):
            p.orch.refit(2)
        np.testing.assert_array_equal(p.dst_mem[0], np.ones((64, 64), np.float32))
        version, got = p.served(1, lambda a: a)
        assert version == 1
        np.testing.assert_array_equal(got, cols(1, 1))
    finally:
        p.close()


def test_read_only_destinations_are_refused_at_registration(tmp_path):
    train, infer = layouts()
    ro = np.zeros((4, 4), np.float32)
    ro.setflags(write=False)
    with pytest.raises(refit.RegistrationError, match=r"dst rank 0: buffer 'w#0': read-only memory"):
        refit.Destination.in_place(infer, 0, {"w#0": ro})
    path = tmp_path / "weights.bin"
    np.zeros((4, 4), np.float32).tofile(path)
    mapped = np.memmap(path, np.float32, mode="r", shape=(4, 4))
    with pytest.raises(refit.RegistrationError, match="read-only memory"):
        refit.Destination.in_place(infer, 0, {"w#0": mapped})
    try:
        import torch
    except ImportError:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the array is not writable
        tensor = torch.from_numpy(mapped)
    # torch does not say its memory is read-only; the process's mappings do.
    with pytest.raises(refit.RegistrationError, match="not writable memory"):
        refit.Destination.in_place(infer, 0, {"w#0": tensor})
    # ... and load() refuses to copy into it too.
    system = refit.spawn_local(train, infer)
    for r, s in enumerate(system.sources):
        s.register("w", full(1)[2 * r : 2 * r + 2].copy())
        s.step()
    system.refit_latest()
    d = system.destinations[0]
    d.register("w", tensor)
    with pytest.raises(refit.TensorError, match=r"dst rank 0: 'w': its 64 bytes at .* are not writable memory"):
        d.load()
    system.orchestrator.close()


# --- sources whose memory moves -------------------------------------------


def test_a_source_whose_memory_was_freed_sends_nothing(fabric):
    """A source tensor resized (its memory reallocated, the old freed)
    after a step: the refit fails before the source sends a byte, and the
    destinations still hold exactly version 1 — no freed memory, nothing
    of the new memory."""
    torch = torch_or_skip()
    p = Pipeline(fabric, lambda r: torch.zeros(2, 8), np_dst)
    try:
        p.step(1, lambda r, rows: p.src_mem[r].copy_(torch.from_numpy(rows)))
        p.orch.refit(1)
        with p.sources[1].stepping():
            p.src_mem[1].copy_(torch.from_numpy(full(2)[2:4]))
        with p.sources[0].stepping():
            p.src_mem[0].copy_(torch.from_numpy(full(2)[0:2]))
        # Outside the fence, the trainer reallocates a parameter.
        p.src_mem[1].resize_(512, 512).fill_(12345.0)
        with pytest.raises(refit.MemberError, match=r"src rank 1: registered weights: buffer 'w#0'"):
            p.orch.refit(2)
        for r in (0, 1):
            version, got = p.served(r, lambda a: a)
            assert version == 1
            np.testing.assert_array_equal(got, cols(r, 1))
    finally:
        p.close()


def test_a_source_whose_data_was_replaced_inside_a_step_is_refused_or_followed(fabric):
    torch = torch_or_skip()
    for follow in (False, True):
        p = Pipeline(fabric, lambda r: torch.zeros(2, 8), np_dst, follow=follow)
        try:
            p.step(1, lambda r, rows: p.src_mem[r].copy_(torch.from_numpy(rows)))
            p.orch.refit(1)
            with p.sources[0].stepping():
                p.src_mem[0].copy_(torch.from_numpy(full(2)[0:2]))
            if follow:
                with p.sources[1].stepping():
                    p.src_mem[1].data = torch.from_numpy(full(2)[2:4].copy())
                p.orch.refit(2)
                for r in (0, 1):
                    assert p.served(r, lambda a: a)[0] == 2
                    np.testing.assert_array_equal(p.served(r, lambda a: a)[1], cols(r, 2))
            else:
                with pytest.raises(refit.RegistrationError, match=r"src rank 1: buffer 'w#0': its memory was replaced"):
                    with p.sources[1].stepping():
                        p.src_mem[1].data = torch.from_numpy(full(2)[2:4].copy())
                assert p.sources[1].version == 1 and "torn" in p.sources[1].weights
                with pytest.raises(refit.VersionError):
                    p.orch.refit_latest()
                assert p.served(0, lambda a: a)[0] == 1
        finally:
            p.close()


def test_a_numpy_source_given_other_memory_sends_nothing(fabric):
    p = Pipeline(fabric, np_src, np_dst)
    try:
        p.step(1, np_write(p))
        p.orch.refit(1)
        p.step(2, np_write(p))
        state = np.full((256, 256), 777.0, np.float32).__reduce__()[2]
        p.src_mem[0].__setstate__(state)
        with pytest.raises(refit.MemberError, match=r"src rank 0: registered weights: buffer 'w#0'"):
            p.orch.refit(2)
        for r in (0, 1):
            version, got = p.served(r, lambda a: a)
            assert version == 1
            np.testing.assert_array_equal(got, cols(r, 1))
            assert not (got == 777.0).any()
    finally:
        p.close()


@pytest.mark.parametrize("change", ["resized", "replaced", "followed", "numpy-state"])
def test_a_source_converted_on_its_way_into_shared_memory_never_reads_memory_it_lost(change):
    """An f32 source refitted into a bf16 group on one host: its pieces are
    converted as the shared-memory link copies them, read from the
    registered memory only during the send. A source whose memory was
    freed, replaced or given another state since it was registered fails
    the refit naming its rank and buffer, and the destinations keep
    version 1 (nothing of the new memory, no freed memory); a followed one
    is read where it moved. Values as torch rounds them to bf16."""
    torch = torch_or_skip()

    def src(r):
        return np.zeros((2, 8), np.float32) if change == "numpy-state" else torch.zeros(2, 8)

    p = Pipeline("node", src, lambda r: torch.zeros(4, 4, dtype=torch.bfloat16), follow=change == "followed", dst_dtype="bf16")

    def write(r, rows):
        p.src_mem[r][...] = rows if change == "numpy-state" else torch.from_numpy(rows)

    def bf16(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(torch.bfloat16).float().numpy()

    def served(r):
        return p.served(r, lambda t: t.float().numpy())

    try:
        p.step(1, write)
        p.orch.refit(1)
        for r in (0, 1):
            version, got = served(r)
            assert version == 1
            np.testing.assert_array_equal(got, bf16(cols(r, 1)))
        if change == "followed":
            with p.sources[0].stepping():
                write(0, full(2)[0:2])
            with p.sources[1].stepping():
                p.src_mem[1].data = torch.from_numpy(full(3)[2:4].copy())
            p.orch.refit(2)
            want = np.vstack([full(2)[0:2], full(3)[2:4]])
            for r in (0, 1):
                version, got = served(r)
                assert version == 2
                np.testing.assert_array_equal(got, bf16(want[:, 4 * r : 4 * r + 4]))
            return
        p.step(2, write)
        if change == "resized":
            p.src_mem[1].resize_(512, 512).fill_(12345.0)
        elif change == "replaced":
            p.src_mem[1].data = torch.full((2, 8), 12345.0)
        else:
            p.src_mem[1].__setstate__(np.full((256, 256), 12345.0, np.float32).__reduce__()[2])
        with pytest.raises(refit.MemberError, match=r"src rank 1: registered weights: buffer 'w#0'"):
            p.orch.refit(2)
        for r in (0, 1):
            version, got = served(r)
            assert version == 1
            np.testing.assert_array_equal(got, bf16(cols(r, 1)))
            assert not (got == bf16(np.float32([12345.0]))[0]).any()
    finally:
        p.close()


def test_a_view_from_param_buffers_sees_its_parameter_replaced(fabric):
    torch = torch_or_skip()
    train, infer = layouts()
    with refit.Orchestrator(fabric=fabric, deadline=20.0) as orch:
        params = [{"w": torch.zeros(4, 4)} for _ in range(2)]
        dests = [refit.Destination.in_place(infer, r, refit.param_buffers(infer, r, params[r])) for r in range(2)]
        sources = [refit.Source(train, r) for r in range(2)]
        arrays = [np.zeros((2, 8), np.float32) for _ in range(2)]
        for s, a in zip(sources, arrays):
            s.register("w", a)
        joined = refit.join(orch.address, orch.secret)
        for m in sources + dests:
            m.join(joined=joined)
        orch.connect(2, 2)
        for r, (s, a) in enumerate(zip(sources, arrays)):
            a[...] = full(1)[2 * r : 2 * r + 2]
            s.step()
        orch.refit(1)
        np.testing.assert_array_equal(params[0]["w"].numpy(), cols(0, 1))
        # The engine repacks the parameter after loading: the flat view
        # refit registered still points at the old memory, but refit looks
        # the parameter itself up.
        params[0]["w"].data = torch.zeros(4, 4)
        for r, (s, a) in enumerate(zip(sources, arrays)):
            a[...] = full(2)[2 * r : 2 * r + 2]
            s.step()
        with pytest.raises(refit.MemberError, match=r"dst rank 0: registered weights: buffer 'w#0': its memory was replaced"):
            orch.refit(2)
        joined.shutdown()


# --- wrong dtypes and shapes ----------------------------------------------


def test_a_wrong_dtype_or_size_is_refused_with_torch_and_numpy():
    _, bf16 = layouts("bf16")
    f32, _ = layouts()
    numpy_cases = [
        (bf16, "dst", np.zeros(16, np.float32), r"f32 given for a bf16 buffer"),
        (bf16, "dst", np.zeros(16, np.float16), r"f16 given for a bf16 buffer"),
        (bf16, "dst", np.zeros(16, np.int64), r"i64 given for a bf16 buffer"),
        (f32, "src", np.zeros(8, np.float32), r"8 elements \(32 bytes\) given, the buffer holds 16"),
        (f32, "src", np.zeros(16, np.float64), r"f64 given for a f32 buffer"),
        (f32, "src", np.zeros((8, 2), np.float32), r"shape \[8, 2\] given, the block is \[2, 8\]"),
    ]
    cases = list(numpy_cases)
    try:
        import torch

        cases += [
            (bf16, "dst", torch.zeros(16), r"f32 given for a bf16 buffer"),
            (bf16, "dst", torch.zeros(16, dtype=torch.float16), r"f16 given for a bf16 buffer"),
            (bf16, "dst", torch.zeros(8), r"f32 given for a bf16 buffer"),
            (bf16, "dst", torch.zeros(16, dtype=torch.int64), r"i64 given for a bf16 buffer"),
            (f32, "src", torch.zeros(16, dtype=torch.float64), r"f64 given for a f32 buffer"),
            (f32, "src", torch.zeros(8, 2), r"shape \[8, 2\] given, the block is \[2, 8\]"),
            (f32, "src", torch.zeros(2, 16)[:, ::2], r"a non-contiguous tensor"),
        ]
    except ImportError:
        pass
    for layout, side, obj, message in cases:
        make = refit.Source.in_place if side == "src" else refit.Destination.in_place
        with pytest.raises(refit.RegistrationError, match=rf"{side} rank 0: buffer 'w#0': {message}"):
            make(layout, 0, {"w#0": obj})
    # bf16 given as its raw bits, a flat view and the block's shape are fine.
    refit.Destination.in_place(bf16, 0, {"w#0": np.zeros(16, np.uint16)})
    refit.Destination.in_place(bf16, 0, {"w#0": np.zeros((4, 4), np.int16)})
    refit.Source.in_place(f32, 0, {"w#0": np.zeros((2, 8), np.float32)})


def test_the_raw_address_entry_points_are_gone():
    for store in (refit._refit.SrcStore, refit._refit.DstStore):
        assert not hasattr(store, "registered")
    _, infer = layouts()
    with pytest.raises(refit.RegistrationError, match="holds no memory refit can use in place"):
        refit._refit.DstStore(infer, 0, [0x1000])
    with pytest.raises(refit.RegistrationError, match=r"1 objects for 1 buffers|0 objects for 1 buffers"):
        refit._refit.DstStore(infer, 0, [])


# --- look-ups that run user code ------------------------------------------


def test_a_look_up_never_runs_an_ndarray_subclass_property():
    """numpy arrays are read from their C struct: an ndarray subclass's
    ``__array_interface__`` property (user code, here one that gives
    another registered array other memory, freeing its own) never runs
    when refit looks arrays up, so loads and steps use each array's own
    memory and nothing is freed under them."""
    whole = lambda name: refit.TensorBuilder(name, "f32", [64]).mesh([1], ["replicate"])  # noqa: E731
    train = refit.LayoutBuilder(1).tensor(whole("a")).tensor(whole("b")).build()
    victim = np.zeros(64, np.float32)
    calls = []

    class Sneaky(np.ndarray):
        @property
        def __array_interface__(self):
            calls.append(1)
            victim.__setstate__(np.full(64, 5.0, np.float32).__reduce__()[2])
            return np.asarray(self).__array_interface__

    sneaky = np.zeros(64, np.float32).view(Sneaky)
    system = refit.spawn_local(train, train)
    s, d = system.sources[0], system.destinations[0]
    s.register("a", np.arange(64, dtype=np.float32))
    s.register("b", np.arange(64, dtype=np.float32) * 2)
    s.step()
    system.refit_latest()
    d.register("a", victim)
    d.register("b", sneaky)
    for _ in range(3):
        d.load()
        np.testing.assert_array_equal(victim, np.arange(64, dtype=np.float32))
        np.testing.assert_array_equal(np.asarray(sneaky), np.arange(64, dtype=np.float32) * 2)
    s.register("a", victim)
    s.register("b", sneaky)
    s.step()
    system.refit_latest()
    d.register("a", np.zeros(64, np.float32))
    d.register("b", np.zeros(64, np.float32))
    d.load()
    np.testing.assert_array_equal(d._slots["a"][1], np.arange(64, dtype=np.float32))
    np.testing.assert_array_equal(d._slots["b"][1], np.arange(64, dtype=np.float32) * 2)
    assert calls == []
    system.orchestrator.close()


def test_pickled_layouts_still_register():
    # A layout that travelled (pickled) registers the same memory.
    train, _ = layouts()
    again = pickle.loads(pickle.dumps(train))
    refit.Source.in_place(again, 1, {"w#0": np.zeros((2, 8), np.float32)})


def test_a_torch_look_up_that_reallocates_an_earlier_target_cannot_crash_a_load():
    """The torch form of the test above: a tensor subclass whose
    ``__torch_function__`` (run by refit's look-up of it) reallocates the
    tensor registered before it."""
    torch = torch_or_skip()
    whole = lambda name: refit.TensorBuilder(name, "f32", [64]).mesh([1], ["replicate"])  # noqa: E731
    layout = refit.LayoutBuilder(1).tensor(whole("a")).tensor(whole("b")).build()
    victim = torch.zeros(64)

    class Sneaky(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            victim.resize_(4096).fill_(5.0)  # new memory, the old freed
            victim.resize_(64)
            return super().__torch_function__(func, types, args, kwargs or {})

    sneaky = torch.zeros(64).as_subclass(Sneaky)
    system = refit.spawn_local(layout, layout)
    s, d = system.sources[0], system.destinations[0]
    s.register("a", np.arange(64, dtype=np.float32))
    s.register("b", np.arange(64, dtype=np.float32) * 2)
    s.step()
    system.refit_latest()
    d.register("a", victim)
    d.register("b", sneaky)
    for _ in range(3):
        d.load()
        assert torch.equal(torch.Tensor(sneaky).as_subclass(torch.Tensor), torch.arange(64, dtype=torch.float32) * 2)
    system.orchestrator.close()
