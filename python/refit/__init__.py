"""refit from Python: move weights from training ranks to inference ranks.

A thin layer over the Rust crates (compiled as ``refit._refit``): layouts
are ``reshard`` layouts, the stores are the Rust ``SrcStore``/``DstStore``
with their version fence and group-atomic commit, the orchestrator is the
Rust actor. See docs/python.md.

Weights cross into the stores by copy: ``Source.step()`` copies every
registered array or tensor into the rank's store (one optimizer step, one
version); ``Destination.load()`` copies one committed version out into the
registered arrays. ``Source.in_place`` and ``Destination.in_place`` keep
the weights in the framework's own tensors instead (CUDA tensors on the GPU
fabrics, host arrays on ``"node"``): sources are read where they are,
destinations receive each committed version by one copy from the refit's
staging.
"""

from __future__ import annotations

import collections as _collections
import secrets as _secrets
import sys as _sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from . import _refit
from ._refit import (
    JoinError,
    Layout,
    LayoutBuilder,
    LayoutError,
    MemberError,
    PlanError,
    RefitError,
    RegistrationError,
    TensorBuilder,
    TensorError,
    VersionError,
)
from .dtensor import layout_from_dtensors
from .inference import tp_inference_layout
from .megatron import megatron_layout

__all__ = [
    "Destination",
    "JoinError",
    "Joined",
    "Layout",
    "LayoutBuilder",
    "LayoutError",
    "LocalSystem",
    "MemberError",
    "Orchestrator",
    "PlanError",
    "PlanFigures",
    "PlanReport",
    "RefitError",
    "RefitReport",
    "RegistrationError",
    "Source",
    "TensorBuilder",
    "TensorError",
    "VersionError",
    "join",
    "layout_from_dtensors",
    "megatron_layout",
    "param_buffers",
    "VOCABULARY",
    "plan",
    "spawn_local",
    "tp_inference_layout",
]


@dataclass(frozen=True)
class RefitReport:
    """What one refit did."""

    version: int
    """The version every destination now serves."""
    bytes: int
    """Bytes moved (0 if every destination already served ``version``)."""
    seconds: float
    """Wall time of the refit."""
    transfer_seconds: float
    """Time the data movement took."""
    verify_seconds: float
    """The digest check before the commit (``digest_check``): the longest
    time a member took to read back what its run moved (part of
    ``transfer_seconds``) plus the orchestrator's comparison; 0 when off."""
    verified_ranks: int
    """Destination ranks the digest check compared whole with what their
    senders sent (0 when off)."""
    unverified_ranks: int
    """Destination ranks it could not (device memory on the NCCL and IPC
    fabrics; the baseline's bypassed scratch); 0 when off."""
    already_served: bool
    replanned: bool
    fingerprint: Optional[str]
    mode: str
    dropped_replicas: List[int] = field(default_factory=list)
    """Replicas of a destination group of replicas that failed this refit
    and left the group (each by its index in the group when it left): they
    serve what they served before; the others serve ``version``."""
    plan_seconds: float = 0.0
    """Asking members for their status and (re)planning if needed."""
    connect_seconds: float = 0.0
    """Opening the refit's data plane (or resuming the kept one)."""
    commit_seconds: float = 0.0
    """Committing on every destination."""


@dataclass(frozen=True)
class ReplicaReport:
    """What adding or removing a replica did."""

    replicas: int
    """Replicas in the destination group now."""
    seeded: Optional[Dict[str, Any]]
    """How the added replica was seeded from a serving one: ``version``,
    ``from_replica``, ``bytes`` (sent by that replica's ranks; no training
    rank sends anything), ``seconds``, ``fingerprint``. None when no replica
    served a whole version yet (the next refit fills it) or one was
    removed."""
    destinations: List["Destination"] = field(default_factory=list)
    """The added replica's ranks (a local system only)."""


@dataclass(frozen=True)
class PlanReport:
    """The plan installed on every member."""

    fingerprint: str
    bytes: int
    """Bytes every refit with this plan moves."""
    replanned: bool
    mode: str


@dataclass(frozen=True)
class PlanFigures:
    """What a refit of one plan moves, as ``refit plan`` prints it."""

    bytes: int
    """Every message's payload between two ranks, in its wire dtype."""
    src_egress_bytes: int
    """The part training ranks send."""
    relayed_bytes: int
    """The part inference ranks forward to other inference ranks."""
    cross_node_bytes: int
    dst_node_ingress_bytes: List[int]
    """Bytes into each inference node from outside it."""
    src_rank_egress_bytes: List[int]
    """Bytes each training rank sends to other nodes."""
    max_rank_send_bytes: int
    max_rank_recv_bytes: int
    messages: int
    rounds: int
    fingerprint: str


def plan(src: Layout, dst: Layout, mode: str = "reshard") -> PlanFigures:
    """Plans a refit from ``src`` to ``dst`` without members or memory
    (``mode``: ``"reshard"`` or ``"baseline"``, the gather-broadcast) and
    says what it moves; a pair that cannot be planned raises ``PlanError``
    naming the tensor."""
    return PlanFigures(**_refit.plan_figures(src, dst, mode))


# --- arrays and tensors ---------------------------------------------------

# Buffer-protocol formats (after any byte-order prefix) each dtype accepts.
# bf16 has no buffer format: give its raw bits as uint16/int16; 8-bit floats
# as uint8/int8.
_FORMATS = {
    "f64": {"d"},
    "f32": {"f"},
    "f16": {"e"},
    "bf16": {"H", "h"},
    "f8e4m3": {"B", "b"},
    "f8e5m2": {"B", "b"},
    "i64": {"q", "l", "n"},
    "i32": {"i", "l"},
    "i8": {"b"},
    "u8": {"B"},
}
_SIZES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "f8e4m3": 1, "f8e5m2": 1, "i64": 8, "i32": 4, "i8": 1, "u8": 1}


def _torch_tensor(obj: Any) -> bool:
    torch = _sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _wait_for_producers(objects: Any) -> None:
    """Waits until the work queued so far on torch's current CUDA stream of
    every device among ``objects`` (torch CUDA tensors) has finished: an
    optimizer's kernels that write weights in place run there, and refit's
    own streams are not ordered after torch's, so a refit must not read
    before they end. Host arrays and other objects need nothing."""
    torch = _sys.modules.get("torch")
    if torch is None:
        return
    devices = []
    for obj in objects:
        obj = _local(obj)
        if _torch_tensor(obj) and obj.is_cuda and obj.device not in devices:
            devices.append(obj.device)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def _torch_dtype_name(dtype: Any) -> Optional[str]:
    torch = _sys.modules.get("torch")
    if torch is None:
        return None
    names = {
        torch.float64: "f64",
        torch.float32: "f32",
        torch.float16: "f16",
        torch.bfloat16: "bf16",
        torch.int64: "i64",
        torch.int32: "i32",
        torch.int8: "i8",
        torch.uint8: "u8",
    }
    for attr, name in (("float8_e4m3fn", "f8e4m3"), ("float8_e5m2", "f8e5m2")):
        if hasattr(torch, attr):
            names[getattr(torch, attr)] = name
    return names.get(dtype)


class _Slot:
    """Where a registered name lives on a rank: a tensor's block or a buffer."""

    def __init__(self, layout: Layout, rank: int, name: str, side: str):
        self.name = name
        blocks = [b for b in layout.blocks(rank) if b[0] == name]
        if len(blocks) == 1:
            _, self.dtype, self.offset, self.extent = blocks[0]
            self.elems = 1
            for e in self.extent:
                self.elems *= e
            self.what = f"{side} rank {rank}: tensor '{name}' (block of extent {list(self.extent)} at offset {list(self.offset)}, {self.dtype})"
            self.exact_shape = True
            return
        if len(blocks) > 1:
            raise TensorError(
                f"{side} rank {rank} holds tensor '{name}' in {len(blocks)} blocks: registering it is not supported yet "
                "(register the buffer that holds them instead)"
            )
        buffers = [b for b in layout.buffers(rank) if b[0] == name]
        if buffers:
            _, self.dtype, self.elems = buffers[0]
            self.offset, self.extent = [0], [self.elems]
            self.what = f"{side} rank {rank}: buffer '{name}' ({self.elems} elements, {self.dtype})"
            self.exact_shape = False
            return
        if name in layout.tensor_names():
            raise TensorError(f"{side} rank {rank} holds no part of tensor '{name}'")
        known = [b[0] for b in layout.buffers(rank)]
        raise TensorError(f"{side} rank {rank}: the layout has no tensor or buffer '{name}' (this rank's buffers: {known[:8]})")

    def check(self, obj: Any) -> None:
        """Raises TensorError unless `obj` has this slot's dtype and shape."""
        obj = _local(obj)
        if _torch_tensor(obj):
            dtype = _torch_dtype_name(obj.dtype)
            shape = tuple(obj.shape)
            if dtype != self.dtype:
                raise TensorError(f"{self.what}: a torch tensor of {obj.dtype} given")
        else:
            try:
                mv = memoryview(obj)
            except TypeError:
                raise TensorError(
                    f"{self.what}: {type(obj).__name__} is neither a torch tensor nor an object with the buffer protocol (numpy array)"
                ) from None
            fmt = mv.format.lstrip("@=<")
            if fmt not in _FORMATS[self.dtype] or mv.itemsize != _SIZES[self.dtype] or mv.format.startswith((">", "!")):
                hint = " (give bf16 as its raw bits: a uint16 array)" if self.dtype == "bf16" else ""
                raise TensorError(f"{self.what}: an array of format '{mv.format}' ({mv.itemsize} bytes) given{hint}")
            shape = tuple(mv.shape)
        numel = 1
        for s in shape:
            numel *= s
        if self.exact_shape and shape != tuple(self.extent):
            raise TensorError(f"{self.what}: shape {list(shape)} given")
        if numel != self.elems:
            raise TensorError(f"{self.what}: {numel} elements given")


def _local(obj: Any) -> Any:
    return obj.to_local() if type(obj).__name__ == "DTensor" else obj


# Parameters whose rows past the layout's are padding (the vocabulary
# padding of the engines' VocabParallelEmbedding and of Megatron-Core):
# their names' dotted parts include one of these.
VOCABULARY = ("embed_tokens", "lm_head", "word_embeddings", "output_layer")


def _padded(name: str, padded: Optional[Sequence[str]]) -> bool:
    parts = name.split(".")
    return any(p in parts for p in (VOCABULARY if padded is None else padded))


def param_buffers(
    layout: Layout, rank: int, params: Mapping[str, Any], *, padded: Optional[Sequence[str]] = None
) -> Dict[str, Any]:
    """Every buffer of ``rank`` in ``layout`` as a flat view of the
    framework parameter that holds it (``params``: a model's
    ``dict(named_parameters())``), for ``Source.in_place`` /
    ``Destination.in_place`` or ``register_all``. A fused buffer
    (``…qkv_proj.weight``, ``…experts.w13_weight``, Megatron's
    ``…linear_qkv.weight``) is the parameter of that name; a tensor's own
    buffer (``"{tensor}#k"``) is the parameter named as the tensor.

    A parameter must hold exactly its buffer: a tensor's own buffer the
    block's shape, a fused buffer its number of elements. Only a
    vocabulary parameter (a name with one of ``padded``'s dotted parts;
    default ``VOCABULARY``: ``embed_tokens``, ``lm_head``,
    ``word_embeddings``, ``output_layer``) may hold more rows — the
    vocabulary padding of the engines and of Megatron, no tensor's — and
    is cut to the buffer's rows. Parameters must be contiguous (torch
    tensors, C-contiguous numpy arrays, DTensors' local shards); the views
    share their memory, and an in-place registration of a torch view looks
    the parameter itself up before every use (so ``param.data = ...`` is
    seen). ``TensorError`` names the rank, the buffer, the parameter and
    both shapes where a parameter does not fit."""
    out: Dict[str, Any] = {}
    buffers = layout.buffers(rank)
    # Tensor -> how many buffers of its own it has on this rank.
    own = _collections.Counter(b.rsplit("#", 1)[0] for b, _, _ in buffers if "#" in b)
    blocks: Dict[str, List[Any]] = {}
    for tensor, _dt, _offset, extent in layout.blocks(rank):
        blocks.setdefault(tensor, []).append(list(extent))
    for buffer, _dtype, elems in buffers:
        name = buffer
        if buffer not in params and "#" in buffer:
            name = buffer.rsplit("#", 1)[0]
            if own[name] > 1:
                raise TensorError(
                    f"rank {rank}: buffer '{buffer}': the rank holds several blocks of '{name}', "
                    "one parameter cannot be all of them (give each its array by hand)"
                )
        if name not in params:
            raise TensorError(f"rank {rank}: buffer '{buffer}': no parameter '{name}'{_megatron_spec_hint(name, params)}")
        what = f"rank {rank}: buffer '{buffer}': parameter '{name}'"
        param = params[name]
        shape = [int(n) for n in _local(param).shape]
        numel = 1
        for n in shape:
            numel *= n
        extent = None
        if "#" in buffer:
            held = blocks.get(buffer.rsplit("#", 1)[0], [])
            extent = held[0] if len(held) == 1 else None
        if _padded(name, padded) or _padded(buffer, padded):
            row = 1
            for n in shape[1:]:
                row *= n
            if numel < elems:
                raise TensorError(f"{what}: {numel} elements (shape {shape}), the buffer needs {elems}")
            if row and elems % row:
                raise TensorError(f"{what}: shape {shape}: the buffer's {elems} elements are not whole rows of it")
            if extent is not None and extent[1:] != shape[1:]:
                raise TensorError(f"{what}: shape {shape}, the buffer's block is {extent} (padding may add rows only)")
        elif extent is not None:
            if shape != extent and shape != [elems]:
                raise TensorError(f"{what}: shape {shape}, the buffer's block is {extent}")
        elif numel != elems:
            raise TensorError(f"{what}: {numel} elements (shape {shape}), the buffer holds {elems}")
        out[buffer] = _flat_prefix(param, elems, what)
    return out


# A Megatron-Core norm under the other layer spec's name: (the name in one
# spec, the name in the other, megatron_layout's layer_spec for the second).
_MEGATRON_NORMS = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight", "local"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight", "local"),
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight", "transformer_engine"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", "transformer_engine"),
)


def _megatron_spec_hint(name: str, params: Mapping[str, Any]) -> str:
    """Where a missing parameter is a Megatron norm that the model has under
    the other layer spec's name, what to pass ``megatron_layout``."""
    for mine, theirs, spec in _MEGATRON_NORMS:
        if name.endswith("." + mine) and name[: -len(mine)] + theirs in params:
            return f" (the model has '{name[: -len(mine)] + theirs}': Megatron-Core's {spec} layer spec; megatron_layout(..., layer_spec='{spec}'))"
    return ""


def _flat_prefix(param: Any, elems: int, what: str) -> Any:
    """The first ``elems`` elements of a contiguous tensor or array, as a
    1-D view of its memory (a torch view remembers ``param``)."""
    obj = _local(param)
    if _torch_tensor(obj):
        if not obj.is_contiguous():
            raise TensorError(f"{what}: a non-contiguous tensor has no flat view")
        flat = obj.detach().view(-1)[:elems]
        flat._refit_param = (param, elems)
        return flat
    if hasattr(obj, "flags") and hasattr(obj, "reshape"):
        if not obj.flags.c_contiguous:
            raise TensorError(f"{what}: a non-C-contiguous array has no flat view")
        return obj.reshape(-1)[:elems]
    raise TensorError(f"{what}: {type(obj).__name__} is neither a torch tensor nor a numpy array")


def _host_array(obj: Any) -> Any:
    """``obj`` (its local tensor, for a DTensor) if refit copies its memory
    in place: a C-contiguous numpy array, torch CPU tensor or CPU DLPack
    tensor; else None (it is copied through bytes)."""
    local = _local(obj)
    return local if _refit.is_host_array(local) else None


def _step_value(obj: Any) -> Any:
    """What a step hands the store for ``obj``: the array itself (copied
    in place, once) or a copy of its bytes."""
    host = _host_array(obj)
    return host if host is not None else _to_bytes(obj)


def _to_bytes(obj: Any) -> Any:
    """A copy of `obj`'s elements in C order (bytes or bytearray)."""
    obj = _local(obj)
    if _torch_tensor(obj):
        import torch

        t = obj.detach().to("cpu").contiguous().reshape(-1)
        if t.numel() == 0:
            return b""
        raw = t.view(torch.uint8)
        try:
            return raw.numpy().tobytes()
        except (RuntimeError, ImportError):  # torch without numpy
            out = bytearray(raw.numel())
            torch.frombuffer(out, dtype=torch.uint8).copy_(raw)
            return out
    return memoryview(obj).tobytes()


def _copy_into(obj: Any, data: bytes, what: str) -> None:
    """Overwrites `obj`'s elements with `data` (C order)."""
    obj = _local(obj)
    if _torch_tensor(obj):
        import warnings

        import torch

        if not obj.is_contiguous():
            raise TensorError(f"{what}: the registered tensor is not contiguous, so it cannot be written in place")
        if len(data) == 0:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer: only read here
            src = torch.frombuffer(data, dtype=torch.uint8)
        with torch.no_grad():
            obj.view(-1).view(torch.uint8).copy_(src)
        return
    mv = memoryview(obj)
    if mv.readonly:
        raise TensorError(f"{what}: the registered array is read-only")
    if not mv.c_contiguous:
        raise TensorError(f"{what}: the registered array is not C-contiguous, so it cannot be written in place")
    mv.cast("B")[:] = data


# --- ranks ----------------------------------------------------------------


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
        src = cls(layout, rank, _store=_refit.SrcStore.in_place(layout, rank, objects, follow))
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
        (initial weights, a checkpoint)."""
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
        dst = cls(layout, rank, _store=_refit.DstStore.in_place(layout, rank, objects, follow, direct))
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


# --- the orchestrator -----------------------------------------------------


def _report(d: Dict[str, Any]) -> RefitReport:
    return RefitReport(**d)


class Orchestrator:
    """Runs refits: every source's weights into every destination.

    ``Orchestrator()`` opens a rendezvous (``address``, ``secret``) that
    member processes ``join``; ``connect(src_ranks, dst_ranks)`` waits for
    their members and plans. ``spawn_local`` makes one over members in this
    process.

    ``fabric``: how the bytes move. ``"node"`` (default): shared memory
    between ranks of a node, TCP between nodes. ``"nccl"``: one NCCL
    communicator over every member, each on the GPU it joined with
    (``join(gpu=...)``). ``"ipc"``: CUDA IPC between members of one node
    (colocated training and inference). Where a GPU fabric cannot run, the
    refit raises ``MemberError`` saying why (``... transport unavailable:
    ...``), before anything moves. ``"simulated-nccl"``,
    ``"simulated-ipc"``: the same fabrics over host memory, every member in
    this process, for testing a pipeline (and in-place sources) without a
    GPU.

    ``delta``: on every fabric, each refit after a clean one sends every
    message as what changed since the same message of the refit before
    (checksummed against it; any failure makes the next refit dense), and
    ``RefitReport.bytes`` counts the bytes on the wire. Each member keeps
    what it sent and received meanwhile. It pays on slow links when few
    weights change (docs/benchmarks.md, "Delta refits"); on the GPU fabrics
    each message goes through the host to be encoded (docs/gpu.md).

    ``digest_check`` (on by default): before any destination commits, every
    member reads back what its run moved — a sender what it sent, a
    receiver what it holds, from the memory the commit serves — as CRC-32C
    digests, and the orchestrator compares them; a difference raises
    ``MemberError`` naming the rank (``... the digest check failed ...;
    nothing was committed``), and every destination keeps its version.
    Off saves one read of every byte moved (docs/benchmarks.md, "The digest
    check"). Device memory (NCCL, IPC) is not read back
    (``RefitReport.unverified_ranks``).
    """

    def __init__(
        self,
        secret: Optional[str] = None,
        bind: str = "127.0.0.1:0",
        *,
        deadline: float = 60.0,
        control_timeout: float = 10.0,
        fabric: str = "node",
        delta: bool = False,
        replica: Optional[Layout] = None,
        digest_check: bool = True,
        _inner: Any = None,
    ):
        # The fabric, as named (what members in other processes are told,
        # e.g. refit.vllm's workers, which allocate where it moves bytes).
        self.fabric = fabric
        if _inner is not None:
            self._inner, self.secret, self.replica = _inner, None, replica
            return
        self.secret = secret or _secrets.token_hex(32)
        self.replica = replica
        self._inner = _refit.Orchestrator(self.secret, bind, deadline, control_timeout, fabric, delta, replica, digest_check)

    @property
    def address(self) -> Optional[str]:
        """``host:port`` member processes join (None for a local system)."""
        return self._inner.address

    def connect(self, src_ranks: int, dst_ranks: int, timeout: float = 60.0) -> PlanReport:
        """Waits up to ``timeout`` s for every member to join, then plans
        and installs every member's program (a pair of layouts that cannot
        be planned fails here)."""
        return PlanReport(**self._inner.connect(src_ranks, dst_ranks, timeout))

    def refit(self, version: int, only: Optional[Sequence[str]] = None) -> RefitReport:
        """Refits exactly ``version``, which every source must hold.
        ``only``: a subset refit of these destination tensors (LoRA
        adapters): every destination keeps the other tensors from the
        version it serves (see docs/pipeline.md, "Subset refits")."""
        if only is not None:
            return _report(self._inner.refit_only(list(only), version))
        return _report(self._inner.refit(version))

    def refit_latest(self, only: Optional[Sequence[str]] = None) -> RefitReport:
        """Refits the newest version every source holds (``only``: as in
        ``refit``)."""
        if only is not None:
            return _report(self._inner.refit_only(list(only)))
        return _report(self._inner.refit_latest())

    def recover(self, timeout: float = 60.0) -> List[Tuple[str, int]]:
        """Puts a new member in the place of every member whose process
        died (or went silent for the heartbeat timeout, 2 s): the process
        that joins as the dead one's rank (``Source(...).join`` or
        ``Destination(...).join``, before or after this call) within
        ``timeout`` seconds in all. Returns the ranks replaced, as
        ``("src" | "dst", rank)``; empty when every member is alive. A
        refit that failed with ``MemberError`` because a member died can be
        retried once this returns: the new member gets its program then. A
        new destination serves nothing until that refit commits; a new
        source holds no version until it steps (``restore(version)`` puts
        it on its peers' version). A rank whose replacement does not join
        in time raises ``JoinError`` naming it; those replaced before it
        stay replaced, and calling again picks up the rest."""
        return [(g, r) for g, r in self._inner.recover(timeout)]

    def add_replica(self, name: Optional[str] = None, timeout: float = 60.0) -> ReplicaReport:
        """Adds a replica to a destination group of replicas (``replica``
        given at construction: the layout of one replica; the group is
        replicas of it, ``Layout.replicated(n)``). It is seeded with the
        newest version a whole replica serves, from that replica's memory
        (no training rank sends anything), and every later refit includes
        it. Over a rendezvous, ``name`` is the name its processes joined
        with (``Destination(replica_layout, j).join(..., replica=name)``),
        waited for up to ``timeout`` s; a local system makes the replica's
        ranks here (``ReplicaReport.destinations``). Waits for a refit in
        progress."""
        report, stores = self._inner.add_replica(name, timeout)
        return ReplicaReport(
            destinations=[Destination(self.replica, d.rank, _store=d) for d in stores] if self.replica is not None else [],
            **report,
        )

    def remove_replica(self, index: int) -> ReplicaReport:
        """Removes replica ``index`` (its place in the group) from a
        destination group of replicas: its ranks keep serving what they
        served and are refitted no more; the replicas after it move up one
        place. Waits for a refit in progress."""
        return ReplicaReport(**self._inner.remove_replica(index))

    def plan(self) -> PlanReport:
        return PlanReport(**self._inner.plan())

    def set_mode(self, mode: str) -> None:
        """``"reshard"`` (default) or ``"baseline"`` (gather, broadcast)."""
        self._inner.set_mode(mode)

    def close(self) -> None:
        """Stops the orchestrator; member processes see the rendezvous go."""
        self._inner.close()

    def __enter__(self) -> "Orchestrator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class LocalSystem:
    """Every rank in this process: for tests and single-process use."""

    orchestrator: Orchestrator
    sources: List[Source]
    destinations: List[Destination]

    def refit(self, version: int, only: Optional[Sequence[str]] = None) -> RefitReport:
        return self._refit(lambda: self.orchestrator.refit(version, only))

    def refit_latest(self, only: Optional[Sequence[str]] = None) -> RefitReport:
        return self._refit(lambda: self.orchestrator.refit_latest(only))

    def _refit(self, call) -> RefitReport:
        # Replicas that left the group leave ``destinations``, whether the
        # refit committed or failed after they left.
        try:
            report = call()
        except RefitError as e:
            self._drop(getattr(e, "dropped_replicas", []))
            raise
        self._drop(report.dropped_replicas)
        return report

    def add_replica(self) -> ReplicaReport:
        """Adds a replica (``spawn_local(replica=...)``): its ranks join
        ``destinations`` at the end, serving what the others serve."""
        report = self.orchestrator.add_replica()
        self.destinations.extend(report.destinations)
        return report

    def remove_replica(self, index: int) -> ReplicaReport:
        """Removes replica ``index``: its ranks leave ``destinations``."""
        report = self.orchestrator.remove_replica(index)
        k = self.orchestrator.replica.ranks if self.orchestrator.replica is not None else 0
        del self.destinations[index * k : (index + 1) * k]
        return report

    def _drop(self, dropped: Sequence[int]) -> None:
        k = self.orchestrator.replica.ranks if self.orchestrator.replica is not None else 0
        for index in dropped:
            del self.destinations[index * k : (index + 1) * k]


def spawn_local(
    src: Layout,
    dst: Layout,
    *,
    deadline: float = 60.0,
    control_timeout: float = 10.0,
    fabric: str = "in_process",
    delta: bool = False,
    replica: Optional[Layout] = None,
    digest_check: bool = True,
) -> LocalSystem:
    """One store and member per rank of both layouts, in this process, and
    an orchestrator over them; plans (a pair that cannot be planned raises
    ``PlanError`` here). ``fabric``: ``"in_process"`` (default), or any of
    ``Orchestrator``'s; on ``"nccl"`` rank ``i`` of the communicator
    (sources first) runs on GPU ``i``. ``delta``, ``digest_check``: as for
    ``Orchestrator``."""
    orch, srcs, dsts = _refit.spawn_local(src, dst, deadline, control_timeout, fabric, delta, replica, digest_check)
    return LocalSystem(
        Orchestrator(_inner=orch, replica=replica, fabric=fabric),
        [Source(src, s.rank, _store=s) for s in srcs],
        [Destination(dst, d.rank, _store=d) for d in dsts],
    )
