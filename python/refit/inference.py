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
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from ._refit import LayoutBuilder, LayoutError, TensorBuilder

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")
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

    ``num_kv_heads``: if given and smaller than ``tp``, the engines
    replicate KV heads across TP ranks, which this helper does not model
    yet (it raises ``LayoutError``).
    """
    if tp < 1 or dp < 1:
        raise LayoutError(f"tp={tp}, dp={dp}: both must be >= 1")
    if num_kv_heads is not None and num_kv_heads < tp:
        raise LayoutError(
            f"num_kv_heads={num_kv_heads} < tp={tp}: the engines replicate KV heads across TP ranks; not supported yet"
        )
    shapes = {n: [int(s) for s in shape] for n, shape in tensors.items()}
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
                rows = shapes[n][0]
                if rows % tp:
                    raise LayoutError(f"tensor '{n}': {rows} rows do not split evenly over tp={tp}, so it cannot be fused in '{buffer}'")
                fused_at[n] = (buffer, at)
                per_rank = rows // tp
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
        t = TensorBuilder(name, dtype, shape).mesh([dp, tp], ["replicate", placement])
        if name in fused_at:
            t = t.buffer(*fused_at[name])
        b = b.tensor(t)
    return b.build()
