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
DeepSeek's MLA: ``q_b_proj`` and ``kv_b_proj`` are column-parallel, and
``q_a_proj`` and ``kv_a_proj_with_mqa`` are replicated, fused in
``…fused_qkv_a_proj.weight``.
With fewer KV heads than TP ranks, each rank holds whole KV heads, replicated
(``num_kv_heads``).

Mixture-of-experts layers (``…mlp.experts.{e}.gate_proj/up_proj/down_proj``,
as Qwen3-MoE and DeepSeek checkpoints name them, or the fused
``…mlp.experts.gate_up_proj`` [E, 2I, H] and ``…mlp.experts.down_proj``
[E, H, I] that transformers 5 writes) are laid out as vLLM's FusedMoE holds
them: per layer one buffer ``…mlp.experts.w13_weight`` = [gate_0; up_0;
gate_1; up_1; ...] and one ``…mlp.experts.w2_weight`` = [down_0; down_1;
...]. Without expert parallelism every rank holds every expert, its TP
share (gate/up by rows, down by columns); with ``ep`` (vLLM's
``--enable-expert-parallel``, EP size = ``ep``), ranks ``g * ep .. (g + 1)
* ep`` form one EP group and EP rank ``k`` holds experts ``k * E / ep ..
(k + 1) * E / ep`` whole, in order (vLLM's linear placement), once per
group. The router (``…mlp.gate``) is replicated; shared experts are an
ordinary TP-split MLP with their own ``gate_up_proj``.
"""

from __future__ import annotations


from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ._moe import EXPERT, FUSED_EXPERTS, routed_experts
from ._refit import LayoutBuilder, LayoutError, TensorBuilder

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head", "q_b_proj", "kv_b_proj")
ROW = ("o_proj", "down_proj")
KV = ("k_proj", "v_proj")
VOCAB = ("embed_tokens", "lm_head")
FUSED = {"q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
         "up_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
         # MLA (DeepSeek): the replicated down-projections, in one buffer.
         "q_a_proj": ("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa")),
         "kv_a_proj_with_mqa": ("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa"))}


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
    ep: Optional[int] = None,
    vocab_padding: int = 64,
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

    ``vocab_padding``: ``embed_tokens`` and ``lm_head`` are split as the
    engines' ``VocabParallelEmbedding`` splits them: the vocabulary padded
    to a multiple of ``vocab_padding`` (their default, 64), TP rank ``t``
    holding rows ``t * P / tp ..`` of the padded ``P`` (the padding rows,
    at the end of the last ranks' blocks, are no tensor's:
    ``refit.param_buffers`` cuts the engines' parameters to the layout).

    ``ep``: expert parallelism for MoE experts (see the module doc): the
    size of one EP group, a multiple of ``tp`` dividing ``tp * dp`` (vLLM
    with ``--enable-expert-parallel``: ``tp * dp``); each layer's experts
    must split evenly over it. ``None``: experts are TP-split on every
    rank.
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
    fused_at = _fused_places(shapes, tp, kv_split) if fuse else {}
    b = LayoutBuilder(tp * dp, ranks_per_node)
    experts = _experts(shapes, tp, dp, ep)
    for name, shape in shapes.items():
        if name in experts:
            b = b.tensor(experts[name](TensorBuilder(name, dtype, shape)))
            continue
        _, proj, kind = _split(name)
        if proj in COLUMN:
            placement = "shard(0)"
        elif proj in ROW and kind == "weight" and len(shape) >= 2:
            placement = "shard(1)"
        else:
            placement = "replicate"
        if proj in VOCAB and kind == "weight":
            # Rows t * P / tp .. of the padded vocabulary P, on every replica.
            vocab = shape[0]
            padded = -(-vocab // vocab_padding) * vocab_padding
            if padded % tp:
                raise LayoutError(f"tensor '{name}': the padded vocabulary {padded} does not split over tp={tp}")
            per = padded // tp
            t = TensorBuilder(name, dtype, shape)
            for replica in range(dp):
                for r in range(tp):
                    rows = max(0, min(per, vocab - r * per))
                    if rows:
                        t = t.shard(replica * tp + r, offset=[r * per] + [0] * (len(shape) - 1), extent=[rows] + shape[1:])
        elif name in kv_split:
            # Whole KV heads: mesh (replica, head, copy of the head).
            t = TensorBuilder(name, dtype, shape).mesh([dp, num_kv_heads, kv_replicas], ["replicate", "shard(0)", "replicate"])
        else:
            t = TensorBuilder(name, dtype, shape).mesh([dp, tp], ["replicate", placement])
        if name in fused_at:
            t = t.buffer(*fused_at[name])
        b = b.tensor(t)
    return b.build()


def _fused_places(shapes: Mapping[str, List[int]], tp: int, kv_split: Mapping[str, int]) -> Dict[str, Tuple[str, int]]:
    """Where each projection fused with its siblings lands: ``{name:
    (fused buffer, element offset)}``, for the projections whose siblings
    are all present (the others stay apart)."""
    fused_at: Dict[str, Tuple[str, int]] = {}
    for name in shapes:
        prefix, proj, kind = _split(name)
        if proj not in FUSED or fused_at.get(name) or EXPERT.match(name) or FUSED_EXPERTS.match(name):
            continue
        buffer_proj, members = FUSED[proj]
        names = [f"{prefix}.{m}.{kind}" if prefix else f"{m}.{kind}" for m in members]
        if not all(n in shapes for n in names):
            continue  # not all parts present: keep them apart
        buffer = f"{prefix}.{buffer_proj}.{kind}" if prefix else f"{buffer_proj}.{kind}"
        at = 0
        for n in names:
            rows = shapes[n][0]
            ways = kv_split.get(n, tp) if _split(n)[1] in COLUMN else 1  # else replicated
            if rows % ways:
                raise LayoutError(f"tensor '{n}': {rows} rows do not split evenly over tp={tp}, so it cannot be fused in '{buffer}'")
            fused_at[n] = (buffer, at)
            per_rank = rows // ways
            for s in shapes[n][1:]:
                per_rank *= s
            at += per_rank
    return fused_at


def _experts(shapes: Mapping[str, Sequence[int]], tp: int, dp: int, ep: Optional[int]) -> Dict[str, Any]:
    """For every routed expert's projection: how to place it in its layer's
    FusedMoE buffers (a function completing its ``TensorBuilder``)."""
    if ep is not None and (ep < 1 or ep % tp or (tp * dp) % ep):
        raise LayoutError(f"ep={ep}: an EP group must be a multiple of tp={tp} dividing the {tp * dp} ranks")
    place: Dict[str, Any] = {}
    _fused_experts(shapes, tp, dp, ep, place)
    for moe, by_expert in routed_experts(shapes, ep or 1).items():
        count = len(by_expert)
        shape = None
        for e, names in sorted(by_expert.items()):
            projs = {p: shapes[n] for p, n in names.items()}
            missing = [p for p in ("gate_proj", "up_proj", "down_proj") if p not in projs]
            if missing:
                raise LayoutError(f"'{moe}.{e}': no {missing} (FusedMoE needs gate_proj, up_proj and down_proj of every expert)")
            inter, hidden = projs["gate_proj"]
            this = {"gate_proj": [inter, hidden], "up_proj": [inter, hidden], "down_proj": [hidden, inter]}
            if any(list(projs[p]) != this[p] for p in this):
                raise LayoutError(f"'{moe}.{e}': gate/up {list(projs['gate_proj'])}, {list(projs['up_proj'])} and down {list(projs['down_proj'])} are not [I, H], [I, H], [H, I]")
            if shape is not None and this != shape:
                raise LayoutError(f"'{moe}.{e}': shapes differ from expert 0's")
            shape = this
        inter, hidden = shape["gate_proj"]
        w13, w2 = f"{moe}.w13_weight", f"{moe}.w2_weight"
        if ep is None:
            if inter % tp:
                raise LayoutError(f"'{moe}': intermediate size {inter} does not split evenly over tp={tp}")
            share = inter // tp * hidden  # elements of one projection's TP share
            for e in range(count):
                for proj, buffer, at, placement in (
                    ("gate_proj", w13, 2 * e * share, "shard(0)"),
                    ("up_proj", w13, (2 * e + 1) * share, "shard(0)"),
                    ("down_proj", w2, e * share, "shard(1)"),
                ):
                    place[f"{moe}.{e}.{proj}.weight"] = (
                        lambda t, buffer=buffer, at=at, placement=placement: t.mesh([dp, tp], ["replicate", placement]).buffer(buffer, at)
                    )
        else:
            local, whole = count // ep, inter * hidden
            for e in range(count):
                k, i = divmod(e, local)
                ranks = list(range(k, tp * dp, ep))  # EP rank k of every group
                for proj, buffer, at in (("gate_proj", w13, 2 * i * whole), ("up_proj", w13, (2 * i + 1) * whole), ("down_proj", w2, i * whole)):
                    place[f"{moe}.{e}.{proj}.weight"] = lambda t, buffer=buffer, at=at, ranks=ranks: _on_ranks(t, ranks, buffer, at)
    return place


def _fused_experts(shapes: Mapping[str, Sequence[int]], tp: int, dp: int, ep: Optional[int], place: Dict[str, Any]) -> None:
    """``place`` for the fused expert tensors (``…experts.gate_up_proj``
    [E, 2I, H], ``…experts.down_proj`` [E, H, I]): each rank's part where
    FusedMoE keeps it, ``w13_weight`` [E_local, 2 * I_share, H] (an expert's
    gate share, then its up share) and ``w2_weight`` [E_local, H, I_share]."""
    layers: Dict[str, Dict[str, str]] = {}
    for name in shapes:
        m = FUSED_EXPERTS.match(name)
        if m:
            layers.setdefault(m["moe"], {})[m["proj"]] = name
    for moe, names in layers.items():
        if set(names) != {"gate_up_proj", "down_proj"}:
            raise LayoutError(f"'{moe}': fused experts need gate_up_proj and down_proj, found {sorted(names)}")
        gu, dn = names["gate_up_proj"], names["down_proj"]
        if len(shapes[gu]) != 3 or len(shapes[dn]) != 3:
            raise LayoutError(f"'{moe}': fused experts {gu} {list(shapes[gu])} and {dn} {list(shapes[dn])} are not 3-D")
        count, inter2, hidden = shapes[gu]
        inter = inter2 // 2
        if inter2 % 2 or list(shapes[dn]) != [count, hidden, inter]:
            raise LayoutError(f"'{moe}': {gu} {list(shapes[gu])} and {dn} {list(shapes[dn])} are not [E, 2I, H] and [E, H, I]")
        w13, w2 = f"{moe}.w13_weight", f"{moe}.w2_weight"
        if ep is None:
            if inter % tp:
                raise LayoutError(f"'{moe}': intermediate size {inter} does not split evenly over tp={tp}")
            s = inter // tp

            def gate_up(t, s=s, count=count, hidden=hidden, inter=inter, w13=w13):
                for replica in range(dp):
                    for r in range(tp):
                        for e in range(count):
                            for half in range(2):
                                at = (2 * e + half) * s * hidden
                                t = t.shard(replica * tp + r, offset=[e, half * inter + r * s, 0], extent=[1, s, hidden], buffer=w13, at=at)
                return t

            def down(t, s=s, count=count, hidden=hidden, w2=w2):
                for replica in range(dp):
                    for r in range(tp):
                        t = t.shard(replica * tp + r, offset=[0, 0, r * s], extent=[count, hidden, s], buffer=w2, at=0)
                return t

            place[gu], place[dn] = gate_up, down
        else:
            if count % ep:
                raise LayoutError(f"'{moe}': {count} experts do not split evenly over ep={ep}")
            local = count // ep

            def on_ep_ranks(t, buffer, shape, local=local):
                for r in range(tp * dp):
                    k = r % ep  # EP rank k of its group
                    t = t.shard(r, offset=[k * local, 0, 0], extent=[local, *shape[1:]], buffer=buffer, at=0)
                return t

            place[gu] = lambda t, shape=shapes[gu], w13=w13: on_ep_ranks(t, w13, shape)
            place[dn] = lambda t, shape=shapes[dn], w2=w2: on_ep_ranks(t, w2, shape)


def _on_ranks(t: Any, ranks: Sequence[int], buffer: str, at: int) -> Any:
    """The whole tensor on each of ``ranks``, at ``at`` in its ``buffer``."""
    return t.mesh([len(ranks)], ["replicate"], list(ranks)).buffer(buffer, at)
