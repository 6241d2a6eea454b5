"""The ranks: ``Source`` (a training rank's weights, stepped under the
version fence) and ``Destination`` (an inference rank's served
versions), and ``join`` for member processes."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from . import _refit
from ._refit import Layout, RefitError, RegistrationError, TensorError
from ._arrays import _Slot, _copy_into, _local, _step_value, _wait_for_producers

class Joined:
    """This process's membership of a rendezvous (see ``join``)."""

    def __init__(self, rendezvous: Optional[str] = None, secret: Optional[str] = None):
        self._inner = _refit.Joined(rendezvous, secret)

    def wait_closed(self, timeout: Optional[float] = None) -> Optional[str]:
        """Blocks until the orchestrator's rendezvous goes away (returns why),
        or ``timeout`` seconds pass (returns None). Ctrl-C interrupts it."""
        return self._inner.wait_closed(timeout)

    def shutdown(self) -> None:
        self._inner.shutdown()


def join(rendezvous: Optional[str] = None, secret: Optional[str] = None) -> Joined:
    """Joins the orchestrator's rendezvous (``host:port``) with ``secret``.

    Either missing comes from the environment: ``REFIT_RENDEZVOUS`` (or
    torchrun's ``MASTER_ADDR`` with ``REFIT_PORT``) and ``REFIT_SECRET``.
    """
    return Joined(rendezvous, secret)


class _Rank:
    _side = ""

    def __init__(self, layout: Layout, rank: int, store: Any):
        self.layout = layout
        self.rank = rank
        self._store = store
        self._slots: Dict[str, Tuple[_Slot, Any]] = {}
        self._joined: Optional[Joined] = None

    def register(self, name: str, array: Any) -> None:
        """Registers the array or tensor that holds this rank's block of
        tensor ``name`` (shape: the block's extent; dtype: the layout's), or
        the whole buffer ``name`` (a fused buffer: any shape with its number
        of elements). Numpy arrays, anything with the buffer protocol, torch
        tensors (CPU for destinations), DTensors (their local shard)."""
        slot = _Slot(self.layout, self.rank, name, self._side)
        slot.check(array)
        self._slots[name] = (slot, array)

    def register_all(self, arrays: Mapping[str, Any]) -> None:
        for name, array in arrays.items():
            self.register(name, array)

    def unregister(self, name: str) -> None:
        self._slots.pop(name, None)

    @property
    def registered(self) -> List[str]:
        return list(self._slots)

    def block(self, name: str) -> Tuple[List[int], List[int]]:
        """(offset, extent) of this rank's block of tensor ``name``."""
        slot = _Slot(self.layout, self.rank, name, self._side)
        return list(slot.offset), list(slot.extent)

    def held(self) -> List[str]:
        """Names of the tensors this rank holds a block of."""
        seen: List[str] = []
        for name, *_ in self.layout.blocks(self.rank):
            if name not in seen:
                seen.append(name)
        return seen

    @property
    def version(self) -> Optional[int]:
        return self._store.version

    def join(
        self,
        rendezvous: Optional[str] = None,
        secret: Optional[str] = None,
        joined: Optional[Joined] = None,
        *,
        gpu: Optional[int] = None,
    ) -> Joined:
        """Serves this rank's refit member through ``joined`` (or a new
        ``join(rendezvous, secret)``); returns the membership. ``gpu``: the
        CUDA device this rank uses when the orchestrator runs the
        ``"nccl"`` or ``"ipc"`` fabric (usually the local rank)."""
        joined = joined or join(rendezvous, secret)
        self._serve(joined, gpu)
        self._joined = joined
        return joined

    def wait_closed(self, timeout: Optional[float] = None) -> Optional[str]:
        if self._joined is None:
            raise RefitError(f"{self._side} rank {self.rank} has not joined")
        return self._joined.wait_closed(timeout)


def _objects_for(layout: Layout, rank: int, buffers: Mapping[str, Any], side: str) -> List[Any]:
    """The object of every buffer of the rank, in layout order;
    ``RegistrationError`` naming those missing (or unknown)."""
    names = [n for n, _, _ in layout.buffers(rank)]
    missing = [n for n in names if n not in buffers]
    if missing:
        raise RegistrationError(f"{side} rank {rank}: no array for buffer(s) {missing} (an in-place {side} registers every buffer)")
    unknown = [n for n in buffers if n not in names]
    if unknown:
        raise RegistrationError(f"{side} rank {rank}: the rank has no buffer(s) {unknown} (its buffers: {names[:8]})")
    return [buffers[n] for n in names]


class Source(_Rank):
    """A training rank's weights, behind the version fence.

    ``step()`` copies every registered array into the store as one
    optimizer step (waiting while a refit reads), and returns the new
    version: straight from the array's memory for numpy arrays and torch
    CPU tensors in C order, through bytes for anything else. The copy is checked whole before anything is written: a step
    that fails keeps the version.
    """

    _side = "src"

    def __init__(self, layout: Layout, rank: int, *, _store: Any = None):
        super().__init__(layout, rank, _store or _refit.SrcStore(layout, rank))
        # The objects an in-place source reads (kept alive with it).
        self._in_place: Optional[Dict[str, Any]] = None

    @classmethod
    def in_place(cls, layout: Layout, rank: int, buffers: Mapping[str, Any], *, follow: bool = False) -> "Source":
        """A source whose weights stay where they are: ``buffers`` maps
        every buffer of the rank (``layout.buffers(rank)``: a fused buffer's
        name, or ``"{tensor}#{shard}"``) to the C-contiguous array or tensor
        holding it, with the buffer's bytes — CUDA tensors of one GPU
        (torch, anything with ``__cuda_array_interface__`` and a
        ``device.id``, or a DLPack tensor or capsule) for the ``"nccl"`` and
        ``"ipc"`` fabrics, host arrays (numpy, torch CPU, DLPack) for
        ``"node"`` and the simulated ones. A refit reads them in
        place, no copy. Write them only inside ``with src.stepping(): ...``
        (the version fence); ``step()`` is refused.

        Each object must have the buffer's dtype (bf16 may be given as
        16-bit integers, the 8-bit floats as bytes), exactly its elements,
        and, for a tensor's own buffer, the block's shape (or be flat).
        The source holds the memory (a torch tensor's storage, a DLPack
        capsule) and looks every object up again when a step ends and
        before every refit reads it: an object whose memory was replaced
        (``param.data = ...``, ``resize_``, ``.to(...)`` into it), or whose
        dtype, shape or contiguity changed, makes the step or the refit
        fail with ``RegistrationError`` naming the rank, the buffer and
        what changed, and no byte of other memory is sent. ``follow=True``
        takes the object's new memory instead, after the same checks.
        ``RegistrationError`` also names what does not fit here."""
        objects = _objects_for(layout, rank, buffers, "src")
        src = cls(layout, rank, _store=_refit.SrcStore(layout, rank, objects, follow))
        src._in_place = dict(buffers)
        return src

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """One optimizer step on an in-place source: waits while a refit
        reads, holds the version fence while the block writes the arrays,
        and on leaving without an exception the version goes up by one
        (``version``). An exception keeps the version and tears the source
        (refits refuse it until the next step succeeds). For CUDA tensors
        the version goes up only once the work queued on torch's current
        stream of their devices (the optimizer's kernels) has finished; work
        on other streams must be finished, or waited for on the current
        stream, inside the block."""
        if self._in_place is None:
            raise TensorError(f"src rank {self.rank}: stepping() is for in-place sources; use step()")
        self._store.check()
        self._store.begin_step()
        ok = False
        try:
            yield
            # The step's kernels (on torch's current streams) end before
            # the version is raised and a refit may read the weights.
            _wait_for_producers(self._in_place.values())
            ok = True
        finally:
            self._store.end_step(ok)

    def _writes(self, values: Optional[Mapping[str, Any]]) -> List[Tuple[str, Any]]:
        writes = []
        for name, (slot, array) in self._slots.items():
            if values is None or name not in values:
                writes.append((name, _step_value(array)))
        for name, array in (values or {}).items():
            slot = self._slots[name][0] if name in self._slots else _Slot(self.layout, self.rank, name, self._side)
            slot.check(array)
            writes.append((name, _step_value(array)))
        if not writes:
            raise TensorError(f"src rank {self.rank}: nothing registered and no values given")
        return writes

    def step(self, values: Optional[Mapping[str, Any]] = None) -> int:
        """One optimizer step: copies every registered array (and
        ``values``, name → array, for this step only) into the store; the
        version goes up by one (1 for the first step). Returns it."""
        if self._in_place is not None:
            raise TensorError(f"src rank {self.rank}: an in-place source steps with `with src.stepping(): ...`")
        return self._store.update(self._writes(values))

    def restore(self, version: int, values: Optional[Mapping[str, Any]] = None) -> None:
        """Loads the registered arrays (and ``values``) as ``version``
        (initial weights, a checkpoint). An in-place source reads its
        arrays where they are: load the checkpoint into them, then
        ``restore(version)`` says they hold ``version`` (no ``values``;
        waits while a refit reads, as a step does)."""
        if self._in_place is not None:
            if values is not None:
                raise TensorError(f"src rank {self.rank}: an in-place source restores the arrays it holds (load them, then restore(version))")
            self._store.check()
            _wait_for_producers(self._in_place.values())
            self._store.restore(version, [])
            return
        self._store.restore(version, self._writes(values))

    def read(self, name: str) -> bytes:
        """The bytes the store holds for ``name`` (a block or a buffer)."""
        return self._store.read(name)

    @property
    def weights(self) -> str:
        """As a refit finds them, in words."""
        return self._store.weights

    def _serve(self, joined: Joined, gpu: Optional[int]) -> None:
        joined._inner.serve_src(self._store, gpu)


class Destination(_Rank):
    """An inference rank's weights: refits stage and commit in the store;
    ``load()`` copies one committed version out into the registered
    arrays (straight into numpy arrays and torch CPU tensors in C order)."""

    _side = "dst"

    def __init__(self, layout: Layout, rank: int, *, _store: Any = None):
        super().__init__(layout, rank, _store or _refit.DstStore(layout, rank))
        # The objects an in-place destination's weights live in (kept alive
        # with it).
        self._in_place: Optional[Dict[str, Any]] = None

    @classmethod
    def in_place(cls, layout: Layout, rank: int, buffers: Mapping[str, Any], *, follow: bool = False, direct: bool = False) -> "Destination":
        """A destination whose weights are served where the inference
        engine keeps them: ``buffers`` maps every buffer of the rank
        (``layout.buffers(rank)``) to the C-contiguous array or tensor
        holding it, as for ``Source.in_place`` (torch, CUDA arrays, DLPack
        tensors or capsules) — CUDA tensors of one GPU for the ``"nccl"``
        and ``"ipc"`` fabrics, host arrays for ``"node"`` and the simulated
        ones. A refit
        writes the member's own staging and, once every rank of both groups
        succeeded, its commit copies the version in (a failed refit never
        touches them). Read them only inside ``with dst.serving(): ...``,
        which holds commits off (a refit waits for it, within its
        deadline); ``load()`` is refused.

        The objects are checked as for ``Source.in_place``, and must be
        writable (read-only arrays, and tensors over read-only memory, are
        refused). Each commit looks every object up again right before it
        copies into it: one whose memory was replaced or changed fails the
        refit (``MemberError`` on the orchestrator's side; every
        destination keeps the version it served) and ``serving()`` raises
        ``RegistrationError``, until it is registered again —
        or, with ``follow=True``, the commit writes its new memory.

        ``direct=True``: refits
        write the arrays **in place**, for an engine that does not serve
        while its weights are updated (the usual RL loop). No staging copy
        of the weights is kept and a commit copies nothing; a refit waits
        for ``serving()`` holds to end, then holds them off from its first
        byte to its commit. A refit that fails leaves the arrays torn:
        ``serving()`` yields None (do not serve) until the next refit
        commits. The group still commits only once every rank ran to the
        end, so no two ranks serve different versions. On every fabric
        (host arrays on ``"node"``/``"tcp"``, CUDA tensors of the member's GPU
        on ``"nccl"``/``"ipc"``); on ``"ipc"`` with the sources on the same GPU
        (colocated), each byte is copied once, from the trainer's tensors
        straight into these."""
        objects = _objects_for(layout, rank, buffers, "dst")
        dst = cls(layout, rank, _store=_refit.DstStore(layout, rank, objects, follow, direct))
        dst._in_place = dict(buffers)
        return dst

    @contextmanager
    def serving(self) -> Iterator[Optional[int]]:
        """Holds the served weights while the block reads them: waits while
        a commit copies a version in, then no commit changes them until the
        block ends (finish the GPU work that reads them inside it, e.g.
        ``torch.cuda.synchronize()``). Yields the version they hold (None:
        nothing committed yet)."""
        version = self._store.begin_serving()
        try:
            yield version
        finally:
            self._store.end_serving()

    @property
    def weights(self) -> str:
        """As a refit finds them, in words."""
        return self._store.weights

    def load(self, version: Optional[int] = None) -> int:
        """Copies the committed weights (the current version, or
        ``version`` if it is the current or the previous one, so a
        tensor-parallel group reads one agreed version) into every
        registered array. Returns the version copied."""
        if self._in_place is not None:
            raise TensorError(f"dst rank {self.rank}: an in-place destination's weights are served where they are: read them inside `with dst.serving(): ...`")
        names = list(self._slots)
        if not names:
            raise TensorError(f"dst rank {self.rank}: nothing registered")
        targets = [(name, _local(self._slots[name][1])) for name in names]
        served, datas = self._store.load_into(targets, version)
        for name, data in zip(names, datas):
            if data is not None:
                slot, array = self._slots[name]
                _copy_into(array, data, slot.what)
        return served

    def read(self, name: str, version: Optional[int] = None) -> Tuple[int, bytes]:
        """(version, bytes) of ``name`` from a committed version."""
        served, datas = self._store.read([name], version)
        return served, datas[0]

    def _serve(self, joined: Joined, gpu: Optional[int]) -> None:
        joined._inner.serve_dst(self._store, gpu, self._replica)

    _replica: Optional[str] = None

    def join(self, *args: Any, replica: Optional[str] = None, **kwargs: Any) -> Joined:
        """As ``Source.join`` (the same arguments). ``replica``: this rank
        (laid out as one replica) belongs to a new replica of that name,
        which the orchestrator adds to its destination group with
        ``add_replica(replica)``."""
        self._replica = replica
        return super().join(*args, **kwargs)
