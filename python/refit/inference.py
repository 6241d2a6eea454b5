"""Inference-side layouts as vLLM and SGLang shard Llama/Qwen-style models.

Tensor parallelism within a replica, data parallelism across replicas:
rank ``replica * tp + t`` holds TP shard ``t``. Column-parallel weights
(``q/k/v_proj``, ``gate/up_proj``, ``embed_tokens``, ``lm_head``) are split
by rows, row-parallel ones (``o_proj``, ``down_proj``) by columns, the rest
(norms, row-parallel biases) replicated. With ``fuse=True`` (as vLLM and
SGLang load them) ``q/k/v_proj`` live in one buffer ``…qkv_proj.weight``
per rank (q's rows, then k's, then v's) and ``gate/up_proj`` in
``…gate_up_proj.weight`` (gate, then up): register those fused tensors on
the inference rank, and keep the per-projection names on the training side.
With fewer KV heads than TP ranks, each rank holds whole KV heads, replicated
(``num_kv_heads``).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from ._refit import LayoutBuilder, LayoutError, TensorBuilder

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")
KV = ("k_proj", "v_proj")
FUSED = {"q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
         "up_proj": ("gate_up_proj", ("gate_proj", "up_proj"))}


def _split(name: str) -> Tuple[str, str, str]:
    """('model.layers.0.self_attn', 'q_proj', 'weight')."""
    parts = name.split(".")
    if len(parts) >= 2:
        return ".".join(parts[:-2]), parts[-2], parts[-1]
    return "", name, ""


def tp_inference_layout(
    tensors: Mapping[str, Sequence[int]],
    *,
    tp: int,
    dp: int = 1,
    dtype: str = "bf16",
    ranks_per_node: Optional[int] = None,
    fuse: bool = True,
    num_kv_heads: Optional[int] = None,
) -> Any:
    """A ``refit.Layout`` for ``tp × dp`` inference ranks of the tensors
    ``{name: global shape}`` (HF names, e.g. from
    ``{n: p.shape for n, p in model.named_parameters()}``).

    ``num_kv_heads``: the model's KV heads (``num_key_value_heads``). With
    fewer KV heads than ``tp`` the engines do not split ``k_proj`` and
    ``v_proj`` below a head: TP rank ``t`` holds whole KV head
    ``t // (tp // num_kv_heads)``, replicated over ``tp // num_kv_heads``
    consecutive ranks, and that is what this layout says (so give it for
    GQA models with ``tp > num_kv_heads``; ``tp`` must then be a multiple
    of it, as the engines require). With as many or more KV heads than
    ``tp`` they must split evenly over ``tp``; left out, ``k_proj`` and
    ``v_proj`` are split by rows like the other column-parallel weights.
    """
    if tp < 1 or dp < 1:
        raise LayoutError(f"tp={tp}, dp={dp}: both must be >= 1")
    kv_replicas = 1  # TP ranks holding each KV head
    if num_kv_heads is not None:
        if num_kv_heads < 1:
            raise LayoutError(f"num_kv_heads={num_kv_heads}: must be >= 1")
        if num_kv_heads < tp:
            if tp % num_kv_heads:
                raise LayoutError(f"num_kv_heads={num_kv_heads} < tp={tp}: tp must be a multiple of num_kv_heads to replicate whole KV heads")
            kv_replicas = tp // num_kv_heads
        elif num_kv_heads % tp:
            raise LayoutError(f"num_kv_heads={num_kv_heads} does not split evenly over tp={tp}")
    shapes = {n: [int(s) for s in shape] for n, shape in tensors.items()}
    # k/v projections whose rows split by whole heads, replicated: name -> ways.
    kv_split: Dict[str, int] = {}
    for name, shape in shapes.items():
        if num_kv_heads is None or _split(name)[1] not in KV:
            continue
        if not shape or shape[0] % num_kv_heads:
            raise LayoutError(f"tensor '{name}': shape {shape} does not hold num_kv_heads={num_kv_heads} heads of equal rows along dim 0")
        if kv_replicas > 1:
            kv_split[name] = num_kv_heads
    fused_at: Dict[str, Tuple[str, int]] = {}
    if fuse:
        for name, shape in shapes.items():
            prefix, proj, kind = _split(name)
            if proj not in FUSED or fused_at.get(name):
                continue
            buffer_proj, members = FUSED[proj]
            names = [f"{prefix}.{m}.{kind}" if prefix else f"{m}.{kind}" for m in members]
            if not all(n in shapes for n in names):
                continue  # not all parts present: keep them apart
            buffer = f"{prefix}.{buffer_proj}.{kind}" if prefix else f"{buffer_proj}.{kind}"
            at = 0
            for n in names:
                rows, ways = shapes[n][0], kv_split.get(n, tp)
                if rows % ways:
                    raise LayoutError(f"tensor '{n}': {rows} rows do not split evenly over tp={tp}, so it cannot be fused in '{buffer}'")
                fused_at[n] = (buffer, at)
                per_rank = rows // ways
                for s in shapes[n][1:]:
                    per_rank *= s
                at += per_rank
    b = LayoutBuilder(tp * dp, ranks_per_node)
    for name, shape in shapes.items():
        _, proj, kind = _split(name)
        if proj in COLUMN:
            placement = "shard(0)"
        elif proj in ROW and kind == "weight" and len(shape) >= 2:
            placement = "shard(1)"
        else:
            placement = "replicate"
        if name in kv_split:
            # Whole KV heads: mesh (replica, head, copy of the head).
            t = TensorBuilder(name, dtype, shape).mesh([dp, num_kv_heads, kv_replicas], ["replicate", "shard(0)", "replicate"])
        else:
            t = TensorBuilder(name, dtype, shape).mesh([dp, tp], ["replicate", placement])
        if name in fused_at:
            t = t.buffer(*fused_at[name])
        b = b.tensor(t)
    return b.build()
