"""Layouts from DTensors (torch.distributed.tensor), without importing torch.

Reads each DTensor's device mesh (shape and rank order), placements and
global shape. ``Shard(d)`` becomes ``"shard(d)"`` (negative ``d``
normalised), ``Replicate()`` ``"replicate"``; FSDP2 + TP's
``_StridedShard(d, split_factor=s)`` is mapped to the equivalent mesh order:
the strided mesh dimension moves after the later mesh dimensions that shard
the same tensor dimension (whose sizes multiply to ``s``), and the mesh's
ranks are permuted with it. So a ``[dp, tp]`` mesh with
``[_StridedShard(0, split_factor=tp), Shard(0)]`` is the mesh ``[tp, dp]``
with ranks listed tp-major and ``["shard(0)", "shard(0)"]``. ``Partial`` is
refused: a refit moves whole values, reduce first.

Duck-typed: anything with ``device_mesh.mesh`` (a nested list, a numpy
array or a torch tensor of ranks), ``placements``, ``shape`` and ``dtype``
works, so tests run without torch.distributed.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

from ._refit import LayoutBuilder, LayoutError, TensorBuilder

_DTYPE_NAMES = {
    "float64": "f64",
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "int64": "i64",
    "int32": "i32",
    "int8": "i8",
    "uint8": "u8",
    "float8_e4m3fn": "f8e4m3",
    "float8_e5m2": "f8e5m2",
}


def _dtype_name(dtype: Any, tensor: str) -> str:
    text = str(dtype)
    if text in _DTYPE_NAMES.values():
        return text
    short = text.rsplit(".", 1)[-1]  # torch.bfloat16 -> bfloat16
    if short in _DTYPE_NAMES:
        return _DTYPE_NAMES[short]
    raise LayoutError(f"tensor '{tensor}': dtype {text} has no refit equivalent")


def _mesh_ranks(mesh: Any, tensor: str) -> Tuple[List[int], List[int]]:
    """(shape, ranks in row-major order) of a device mesh's rank array."""
    ranks = getattr(mesh, "mesh", mesh)
    if hasattr(ranks, "tolist"):
        ranks = ranks.tolist()
    shape: List[int] = []
    level: Any = ranks
    while isinstance(level, (list, tuple)):
        shape.append(len(level))
        level = level[0] if level else None
    flat: List[int] = []

    def walk(x: Any, depth: int) -> None:
        if depth == len(shape):
            flat.append(int(x))
            return
        if not isinstance(x, (list, tuple)) or len(x) != shape[depth]:
            raise LayoutError(f"tensor '{tensor}': the device mesh's rank array is ragged")
        for y in x:
            walk(y, depth + 1)

    walk(ranks, 0)
    return shape, flat


def _placement(p: Any, ndim: int, tensor: str, i: int) -> Tuple[str, int, int]:
    """(kind, tensor dim, split factor) with kind in shard/strided/replicate."""
    name = type(p).__name__
    partial = getattr(p, "is_partial", None)
    if "Partial" in name or (callable(partial) and partial()):
        raise LayoutError(
            f"tensor '{tensor}': placements[{i}]: {p!r} is a partial (pending reduction) placement; "
            "refit moves whole values: reduce it (DTensor.redistribute to Replicate or Shard) first"
        )
    replicate = getattr(p, "is_replicate", None)
    if name == "Replicate" or (callable(replicate) and replicate()):
        return ("replicate", 0, 1)
    if hasattr(p, "dim"):
        d = int(p.dim)
        if d < 0:
            d += ndim
        if not 0 <= d < ndim:
            raise LayoutError(f"tensor '{tensor}': placements[{i}]: {p!r} shards dim {p.dim} but the tensor has {ndim} dims")
        if hasattr(p, "split_factor"):
            return ("strided", d, int(p.split_factor))
        return ("shard", d, 1)
    raise LayoutError(f"tensor '{tensor}': placements[{i}]: unknown placement {p!r} (expected Shard, Replicate or _StridedShard)")


def _permute(flat: List[int], shape: List[int], order: List[int]) -> List[int]:
    """Ranks of a row-major array of `shape` with its axes reordered."""
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    new_shape = [shape[a] for a in order]
    out = []
    idx = [0] * len(shape)
    total = len(flat)
    for _ in range(total):
        src = sum(idx[j] * strides[order[j]] for j in range(len(order)))
        out.append(flat[src])
        for j in range(len(new_shape) - 1, -1, -1):
            idx[j] += 1
            if idx[j] < new_shape[j]:
                break
            idx[j] = 0
    return out


def dtensor_placement(dt: Any, name: str = "tensor") -> Tuple[List[int], List[str], List[int]]:
    """(mesh shape, placement strings, mesh ranks row-major) for one DTensor,
    with ``_StridedShard`` mapped to the equivalent mesh order."""
    shape = [int(s) for s in dt.shape]
    mesh_shape, ranks = _mesh_ranks(dt.device_mesh, name)
    placements = list(dt.placements)
    if len(placements) != len(mesh_shape):
        raise LayoutError(f"tensor '{name}': {len(placements)} placements for a {len(mesh_shape)}-dimensional mesh")
    kinds = [_placement(p, len(shape), name, i) for i, p in enumerate(placements)]
    order = list(range(len(mesh_shape)))
    for i, (kind, d, split) in enumerate(kinds):
        if kind != "strided":
            continue
        # The later mesh dims that shard dim d: the strided one is applied
        # inside them (split_factor = the product of their sizes).
        product, last = 1, None
        for j in range(i + 1, len(kinds)):
            if kinds[j][0] in ("shard", "strided") and kinds[j][1] == d:
                if product == split:
                    break
                product *= mesh_shape[j]
                last = j
        if last is None or product != split:
            raise LayoutError(
                f"tensor '{name}': placements[{i}]: {placements[i]!r}: split_factor {split} does not match the sizes of "
                f"the later mesh dimensions that shard dim {d} (mesh {mesh_shape})"
            )
        pieces = 1
        for (k, dd, _), size in zip(kinds, mesh_shape):
            if k in ("shard", "strided") and dd == d:
                pieces *= size
        if shape[d] % pieces:
            raise LayoutError(
                f"tensor '{name}': placements[{i}]: {placements[i]!r} on dim {d} of size {shape[d]}, not divisible by the "
                f"{pieces} pieces it is cut into: uneven _StridedShard is not supported yet"
            )
        order.remove(i)
        order.insert(order.index(last) + 1, i)
    strings = ["replicate" if kinds[a][0] == "replicate" else f"shard({kinds[a][1]})" for a in order]
    return [mesh_shape[a] for a in order], strings, _permute(ranks, mesh_shape, order)


def _group_ranks(group: Any) -> Optional[Dict[int, int]]:
    """World rank -> group rank for ``group`` (world ranks in group order,
    or a ``torch.distributed`` process group); ``None`` for no group."""
    if group is None:
        return None
    if not isinstance(group, (list, tuple, range)):
        try:
            import torch.distributed as dist

            group = dist.get_process_group_ranks(group)
        except Exception as e:  # noqa: BLE001 - said in the error
            raise LayoutError(f"group={group!r}: expected a list of world ranks or a torch.distributed process group ({e})") from None
    ranks = [int(r) for r in group]
    if len(set(ranks)) != len(ranks) or any(r < 0 for r in ranks):
        raise LayoutError(f"group={ranks}: world ranks must be distinct and >= 0")
    return {w: i for i, w in enumerate(ranks)}


def layout_from_dtensors(
    tensors: Mapping[str, Any],
    *,
    ranks: Optional[int] = None,
    ranks_per_node: Optional[int] = None,
    dtype: Optional[str] = None,
    plain: Optional[str] = None,
    group: Any = None,
) -> Any:
    """A ``refit.Layout`` of ``{name: DTensor}`` (e.g. a model's
    ``named_parameters()`` under FSDP2/TP). ``ranks`` defaults to one more
    than the largest rank of any mesh; ``dtype`` (``"f32"``, ``"bf16"``, ...)
    overrides every tensor's.

    A device mesh names world ranks. ``group``, the training group's world
    ranks in its order (a list, or a ``torch.distributed`` process group),
    makes the layout's rank ``i`` the group's rank ``i`` (world rank
    ``group[i]``; ``ranks`` then defaults to the group's size): trainers on
    world ranks 2 and 3 are the layout's ranks 0 and 1, and each process
    takes ``Source(layout, group.index(world_rank))``. Without it the
    layout's ranks are world ranks.

    A plain tensor among them (``parallelize_module`` leaves the modules
    no plan names, norms say, as ordinary parameters, whole on every rank)
    is refused, naming it, unless ``plain="replicate"``: then it is held
    whole by every rank."""
    if plain not in (None, "replicate"):
        raise LayoutError(f"plain={plain!r}: expected None (refuse plain tensors) or 'replicate'")
    of_group = _group_ranks(group)
    builders = []
    plains = []
    world = 0
    for name, dt in tensors.items():
        if not hasattr(dt, "device_mesh") or not hasattr(dt, "placements"):
            if plain is None:
                raise LayoutError(
                    f"tensor '{name}': a plain {type(dt).__name__}, not a DTensor: pass plain='replicate' if every rank "
                    "holds it whole (as parallelize_module leaves the modules its plan does not name), or distribute it"
                )
            plains.append((name, dt))
            continue
        mesh_shape, placements, mesh_ranks = dtensor_placement(dt, name)
        if of_group is not None:
            outside = [r for r in mesh_ranks if r not in of_group]
            if outside:
                raise LayoutError(f"tensor '{name}': its device mesh holds world rank {outside[0]}, not in group {list(of_group)}")
            mesh_ranks = [of_group[r] for r in mesh_ranks]
        world = max(world, max(mesh_ranks) + 1)
        dt_name = dtype or _dtype_name(dt.dtype, name)
        t = TensorBuilder(name, dt_name, [int(s) for s in dt.shape])
        default = list(range(len(mesh_ranks)))
        t = t.mesh(mesh_shape, placements, None if mesh_ranks == default else mesh_ranks)
        builders.append((name, t))
    if ranks is None and of_group is not None:
        ranks = len(of_group)
    world = ranks if ranks is not None else world
    if plains and world == 0:
        raise LayoutError(f"tensor '{plains[0][0]}': a plain tensor is replicated over the ranks, but no DTensor or ranks= says how many")
    for name, tensor in plains:
        t = TensorBuilder(name, dtype or _dtype_name(tensor.dtype, name), [int(s) for s in tensor.shape])
        builders.append((name, t.mesh([world], ["replicate"])))
    order = {name: i for i, name in enumerate(tensors)}
    builders.sort(key=lambda nt: order[nt[0]])
    b = LayoutBuilder(world, ranks_per_node)
    for _, t in builders:
        b = b.tensor(t)
    return b.build()
