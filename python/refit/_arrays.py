"""Arrays and tensors as the stores see them: buffer formats and dtypes,
the buffers of a model's parameters (``param_buffers``), and the copies
in and out of host memory."""

from __future__ import annotations

import collections as _collections
import sys as _sys
from typing import Any, Dict, List, Mapping, Optional, Sequence

from . import _refit
from ._refit import Layout, TensorError

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
