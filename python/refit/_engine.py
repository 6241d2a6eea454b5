"""An inference engine's side of a refit, without vLLM: its refit buffers.

An engine whose loading reprocesses what it loads (fusing q/k/v and
gate/up, repacking for a CPU kernel, quantizing) cannot have a refit write
its parameters: it keeps **refit buffers** instead, one per checkpoint
tensor it loads a part of, holding that part as the checkpoint has it. A
refit writes them (an in-place ``refit.Destination`` over them); a load
hands them, as checkpoint tensors, to the engine's own loading inside
``dst.serving()`` (no refit commits meanwhile).

``RefitBuffers`` is that side for any engine: vLLM's workers
(``refit._vllm_worker``) and the engine-shaped process of
``scripts/colocated_check.py`` run the same code. It takes the
checkpoint tensors, the boxes of each this rank loads and the destination
layout, and:

- **allocates** the buffers where the engine's model lives: host memory
  for a model on the CPU, device memory of the model's GPU for a model on
  CUDA (then it joins with ``gpu=`` that device, and the refit moves on the
  orchestrator's GPU fabric, ``"ipc"`` or ``"nccl"``);
- **refuses** a fabric that cannot reach them at once, naming the rank and
  what to change (device buffers on a host fabric, or the reverse), rather
  than at the first refit;
- **registers** them (``Destination.in_place``) and joins the rendezvous;
- **loads** a committed version: checks it is the one asked, then gives
  the engine's load function every checkpoint tensor it holds a part of,
  full-shape (``receive``).

Does not import vLLM.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

import refit

from .vllm import buffer_name, dst_dtype

TORCH_DTYPES = {
    "f64": torch.float64,
    "f32": torch.float32,
    "bf16": torch.bfloat16,
    "f16": torch.float16,
    "i64": torch.int64,
    "i32": torch.int32,
    "i8": torch.int8,
    "u8": torch.uint8,
}
"""refit's dtypes as torch's."""

REFIT_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}
"""torch's dtypes as refit's."""

HOST_FABRICS = ("node", "tcp", "in_process", "simulated-nccl", "simulated-ipc")
"""The orchestrator's fabrics that move host memory."""

DEVICE_FABRICS = ("ipc", "nccl")
"""The orchestrator's fabrics that move CUDA device memory."""

Box = Tuple[Sequence[int], Sequence[int]]
Load = Callable[[Iterator[Tuple[str, torch.Tensor]]], None]


def check_fabric(device: torch.device, fabric: Optional[str], who: str) -> None:
    """Refuses (``RefitError`` naming ``who``, the rank, and what to
    change) buffers on ``device`` that the orchestrator's ``fabric`` cannot
    move; None (a fabric not said) checks nothing (the first refit
    refuses)."""
    if device.type not in ("cpu", "cuda"):
        raise refit.RefitError(f"{who}: the model is on {device}: refit moves host memory and CUDA device memory only")
    if fabric is None:
        return
    if fabric not in HOST_FABRICS + DEVICE_FABRICS:
        raise refit.RefitError(f"{who}: the orchestrator's fabric '{fabric}' is none refit knows ({', '.join(HOST_FABRICS + DEVICE_FABRICS)})")
    if device.type == "cuda" and fabric in HOST_FABRICS:
        raise refit.RefitError(
            f"{who}: the model is on {device}, so its refit buffers are device memory, but the orchestrator's fabric is "
            f"'{fabric}', which moves host memory only: make the orchestrator with refit.Orchestrator(fabric='ipc') where "
            "trainers and engines share the GPUs, fabric='nccl' otherwise"
        )
    if device.type == "cpu" and fabric in DEVICE_FABRICS:
        raise refit.RefitError(
            f"{who}: the model is on the CPU, so its refit buffers are host memory, but the orchestrator's fabric is "
            f"'{fabric}', which moves CUDA device memory only: make the orchestrator with refit.Orchestrator(fabric='node')"
        )


def host_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in host memory whose untouched pages cost no memory
    (numpy's zeros come from calloc: the kernel maps pages on first
    write)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(int(np.prod(tuple(shape), dtype=np.int64)) * size, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(tuple(shape))


def _slices(offset: Sequence[int], extent: Sequence[int]) -> Tuple[slice, ...]:
    return tuple(slice(int(o), int(o) + int(e)) for o, e in zip(offset, extent))


class RefitBuffers:
    """Rank ``rank``'s refit buffers of destination ``layout`` (see the
    module doc).

    ``tensors``: the checkpoint tensors ``(name, refit dtype, shape)``;
    ``held``: the boxes ``(offset, extent)`` of each this rank loads (the
    layout's buffers of the rank, named ``refit.vllm.buffer_name``);
    ``dtype``: what floating-point tensors arrive as. ``device``: where the
    engine's model lives, and the buffers with it. ``fabric``: the
    orchestrator's (``check_fabric``). ``staged``: refits stage in the
    member's own store before the commit copies into the buffers (on the
    host fabrics; the GPU fabrics always stage: docs/python.md).

    ``full_tensors``: whether each checkpoint tensor the rank holds part of
    is kept at its full shape, the boxes being views of it (a box that is
    not contiguous there has a buffer of its own, copied in before each
    load), so a load hands the engine's loading the buffers themselves.
    Default: in host memory, where the pages outside the rank's part are
    never written and cost nothing; not in device memory, where they
    would: there each box is a buffer of its own, and a load builds each
    full-shape tensor of a rank holding part of it for the loading only,
    one at a time (a tensor the rank holds whole is its buffer).
    """

    def __init__(
        self,
        tensors: Sequence[Tuple[str, str, Sequence[int]]],
        held: Mapping[str, Sequence[Box]],
        layout: Any,
        rank: int,
        *,
        dtype: str,
        device: Any = "cpu",
        fabric: Optional[str] = None,
        staged: bool = False,
        full_tensors: Optional[bool] = None,
    ):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank = int(rank)
        self.who = f"dst rank {self.rank}"
        check_fabric(self.device, fabric, self.who)
        self.fabric = fabric
        self.layout = layout
        on_host = self.device.type == "cpu"
        full_tensors = on_host if full_tensors is None else bool(full_tensors)
        # Per checkpoint tensor: (shape, dtype, [(box slices, buffer)]), and
        # the full-shape tensor where one is kept.
        self.parts: Dict[str, Tuple[Tuple[int, ...], torch.dtype, List[Tuple[Tuple[slice, ...], torch.Tensor]]]] = {}
        self.full: Dict[str, torch.Tensor] = {}
        # (view of a full tensor, the box's own buffer) copied before a load.
        self.copies: List[Tuple[torch.Tensor, torch.Tensor]] = []
        buffers: Dict[str, torch.Tensor] = {}
        for name, src_dtype, shape in tensors:
            boxes = list(held.get(name, ()))
            if not boxes:
                continue
            shape = tuple(int(s) for s in shape)
            dt = TORCH_DTYPES[dst_dtype(src_dtype, dtype)]
            whole = len(boxes) == 1 and all(int(o) == 0 and int(e) == s for o, e, s in zip(boxes[0][0], boxes[0][1], shape))
            full = None
            if whole or full_tensors:
                full = self._zeros(shape, dt)
                self.full[name] = full
            parts = []
            for i, (offset, extent) in enumerate(boxes):
                where = _slices(offset, extent)
                if full is not None:
                    view = full[where]
                    if not view.is_contiguous():
                        box = self._zeros(tuple(int(e) for e in extent), dt)
                        self.copies.append((view, box))
                        view = box
                else:
                    view = self._zeros(tuple(int(e) for e in extent), dt)
                parts.append((where, view))
                buffers[buffer_name(name, i, len(boxes))] = view
            self.parts[name] = (shape, dt, parts)
        if on_host:
            # Every page a refit writes, faulted in now rather than by the
            # first refit and load while the engine serves (the memory is
            # the same; docs/benchmarks.md, "vLLM: the pause": the first
            # update after a connect was 5-10x slower). Device memory was
            # written by its allocation.
            for view in buffers.values():
                view.zero_()
            for view, _ in self.copies:
                view.zero_()
        self.buffers = buffers
        # The engine reads the refit buffers only inside serving() (a
        # load), so a refit can write them in place while it generates
        # (direct): no staging copy. A refit that fails leaves them torn
        # and serving() says so (None): the load is refused and the engine
        # keeps its weights.
        self.dst = refit.Destination.in_place(layout, self.rank, buffers, direct=not staged)
        self.joined: Optional[refit.Joined] = None

    def _zeros(self, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return host_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def gpu(self) -> Optional[int]:
        """The CUDA device the member joins with (None in host memory)."""
        return self.device.index if self.device.type == "cuda" else None

    @property
    def bytes(self) -> int:
        """Bytes of the refit buffers."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def join(self, rendezvous: Optional[str], secret: Optional[str]) -> refit.Joined:
        """Serves the rank's member at the orchestrator's rendezvous (on the
        buffers' GPU for a model on CUDA)."""
        self.joined = self.dst.join(rendezvous, secret, gpu=self.gpu)
        return self.joined

    def tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """Every checkpoint tensor the rank holds part of, full-shape (zeros
        outside the rank's part): the buffers themselves where a full tensor
        is kept, else built here one at a time. Read only inside
        ``serving()`` (``receive``)."""
        for name, (shape, dt, parts) in self.parts.items():
            full = self.full.get(name)
            if full is None:
                full = torch.zeros(shape, dtype=dt, device=self.device)
                for where, box in parts:
                    full[where].copy_(box)
            yield name, full

    def receive(self, version: int, load: Load) -> Dict[str, float]:
        """Loads committed ``version`` into the engine: holds commits off
        (``serving()``), checks the buffers hold ``version``
        (``VersionError`` naming the rank, before ``load`` is called), copies
        the boxes kept apart into their full tensors and calls
        ``load(tensors())``; on a GPU, waits for the device's work (the
        load's kernels read the buffers) before commits may write them
        again. Seconds by part: waiting for the hold, the copies, the
        load."""
        t0 = time.perf_counter()
        with self.dst.serving() as served:
            t1 = time.perf_counter()
            if served != version:
                holds = "a version torn by a failed refit" if served is None else f"version {served}"
                raise refit.VersionError(f"{self.who}: asked to load version {version}, its refit buffers hold {holds}")
            for view, box in self.copies:
                view.copy_(box)
            t2 = time.perf_counter()
            try:
                load(self.tensors())
            finally:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
        return {"wait": t1 - t0, "copy": t2 - t1, "load": time.perf_counter() - t2}

    def shutdown(self) -> None:
        """Leaves the rendezvous (the buffers stay, serving what they hold)."""
        if self.joined is not None:
            self.joined.shutdown()
            self.joined = None
