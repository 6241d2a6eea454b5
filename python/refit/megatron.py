"""Training-side layouts as Megatron-Core shards Llama/Qwen/DeepSeek-style models.

The layout's tensors are the model's Hugging Face weights (``q_proj``,
``gate_proj``, ...: what the inference side names them, see
``tp_inference_layout``); its buffers are Megatron-Core's parameters, under
the names ``named_parameters()`` gives them on each rank (Transformer Engine
layer specs, or Megatron-Core's local spec with ``layer_spec="local"``, see
below; local layer numbers within a pipeline stage):

- ``embedding.word_embeddings.weight`` (first stage) and ``output_layer.weight``
  (last stage; absent with tied embeddings): vocab-parallel, rows split over
  TP after padding the vocabulary to a multiple of ``vocab_multiple * tp``
  (``--make-vocab-size-divisible-by``); padding rows are no tensor's.
- ``decoder.layers.{i}.self_attention.linear_qkv.weight`` (and ``.bias``):
  query groups interleaved, ``[q heads of group 0; k_0; v_0; q heads of
  group 1; k_1; v_1; ...]``, that whole matrix split by rows into ``tp``
  equal parts (a ``ColumnParallelLinear``): whole groups per rank where the
  query groups are a multiple of ``tp``; where ``tp`` is a multiple of them,
  each rank holds a part of one group, cut at any row (one group over TP 2:
  rank 0 the first ``(heads + 2) / 2`` heads' rows of ``[q; k; v]``, rank 1
  the rest), as Megatron-Core's ``SelfAttention`` builds it (its forward
  all-gathers ``linear_qkv``'s output and takes its own group's heads); no
  KV head is replicated in the parameters.
- ``...linear_qkv.layer_norm_weight`` (``input_layernorm``),
  ``...self_attention.q_layernorm.weight`` / ``k_layernorm`` (Qwen3's
  ``q_norm`` / ``k_norm``), ``...mlp.linear_fc1.layer_norm_weight``
  (``post_attention_layernorm``), ``decoder.final_layernorm.weight``
  (``model.norm``, last stage): replicated.
- ``...self_attention.linear_proj.weight`` (``o_proj``) and
  ``...mlp.linear_fc2.weight`` (``down_proj``): split by columns.
- ``...mlp.linear_fc1.weight``: ``[gate; up]`` of the rank's TP share
  (gate rows ``t``-th share, then up's).

The local layer spec (``get_gpt_layer_local_spec``, ``layer_spec="local"``:
no Transformer Engine) fuses no norm into a linear layer:
``input_layernorm`` is ``decoder.layers.{i}.input_layernorm.weight`` and
``post_attention_layernorm`` is ``...pre_mlp_layernorm.weight`` (in every
layer), and multi-latent attention's ``q_a_layernorm`` / ``kv_a_layernorm``
are ``...self_attention.q_layernorm.weight`` / ``kv_layernorm.weight``; its
routed experts are ``SequentialMLP``'s (``grouped_experts=False``: the
legacy ``GroupedMLP`` it builds with ``--moe-grouped-gemm`` holds every
local expert in one transposed parameter, which is not modelled).

Ranks are Megatron's default order (TP fastest, then DP, then PP): global
rank ``t + tp * (d + dp * p)``; pipeline stage ``p`` holds layers
``p * L / pp .. (p + 1) * L / pp``.

Mixture-of-experts layers (Qwen-MoE / DeepSeek names: ``mlp.gate``,
``mlp.experts.{e}.*``, ``mlp.shared_experts.*`` or Qwen2-MoE's
``mlp.shared_expert.*`` with its ``mlp.shared_expert_gate``, Megatron's
``mlp.shared_experts.gate_weight``): the router
``mlp.router.weight`` (and DeepSeek's ``mlp.router.expert_bias``) and
``pre_mlp_layernorm.weight`` replicated; shared experts as a dense MLP
(``mlp.shared_experts.linear_fc1`` / ``linear_fc2``); routed experts on
the expert grid (expert TP ``etp`` fastest, then EP, then expert DP, within
a stage: a stage's rank ``r`` is expert-TP rank ``r % etp`` of EP rank
``r // etp % ep``), EP rank ``k`` holding experts ``k * E / ep ..`` as
local experts ``0 ..``, each split over expert TP like a dense MLP, in
Transformer Engine's grouped parameters ``mlp.experts.linear_fc1.weight{j}``
/ ``linear_fc2.weight{j}`` (``--moe-grouped-gemm``) or, with
``grouped_experts=False``, ``mlp.experts.local_experts.{j}.linear_fc1.weight``.

Multi-latent attention (DeepSeek's MLA, a layer with ``kv_a_proj_with_mqa``)
as Megatron-Core's Transformer Engine spec builds it: the down-projections
``linear_q_down_proj`` (``q_a_proj``) and ``linear_kv_down_proj``
(``kv_a_proj_with_mqa``) replicated; the up-projections
``linear_q_up_proj`` (``q_b_proj``, or ``linear_q_proj`` = ``q_proj``
without a query LoRA) and ``linear_kv_up_proj`` (``kv_b_proj``) split by
rows (whole heads), each with its norm fused in
(``...linear_q_up_proj.layer_norm_weight`` = ``q_a_layernorm``,
``...linear_kv_up_proj.layer_norm_weight`` = ``kv_a_layernorm``); the
layer's ``input_layernorm.weight`` its own.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ._moe import routed_experts
from ._refit import LayoutBuilder, LayoutError, TensorBuilder

LAYER = re.compile(r"^model\.layers\.(?P<l>\d+)\.(?P<rest>.+)$")

# HF name within a layer -> (Megatron name within the layer, how it is split).
# "qkv": interleaved by query group; "fc1": [gate; up] per TP share;
# "col": rows over TP; "row": columns over TP; "rep": replicated.
IN_LAYER = {
    "self_attn.q_proj.weight": ("self_attention.linear_qkv.weight", "qkv"),
    "self_attn.k_proj.weight": ("self_attention.linear_qkv.weight", "qkv"),
    "self_attn.v_proj.weight": ("self_attention.linear_qkv.weight", "qkv"),
    "self_attn.q_proj.bias": ("self_attention.linear_qkv.bias", "qkv"),
    "self_attn.k_proj.bias": ("self_attention.linear_qkv.bias", "qkv"),
    "self_attn.v_proj.bias": ("self_attention.linear_qkv.bias", "qkv"),
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", "row"),
    "self_attn.q_norm.weight": ("self_attention.q_layernorm.weight", "rep"),
    "self_attn.k_norm.weight": ("self_attention.k_layernorm.weight", "rep"),
    "input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight", "rep"),
    "post_attention_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight", "rep"),
    "mlp.gate_proj.weight": ("mlp.linear_fc1.weight", "fc1"),
    "mlp.up_proj.weight": ("mlp.linear_fc1.weight", "fc1"),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight", "row"),
    "mlp.gate.weight": ("mlp.router.weight", "rep"),
    "mlp.gate.e_score_correction_bias": ("mlp.router.expert_bias", "rep"),
    "mlp.shared_experts.gate_proj.weight": ("mlp.shared_experts.linear_fc1.weight", "fc1"),
    "mlp.shared_experts.up_proj.weight": ("mlp.shared_experts.linear_fc1.weight", "fc1"),
    "mlp.shared_experts.down_proj.weight": ("mlp.shared_experts.linear_fc2.weight", "row"),
    # Qwen2-MoE's one shared expert, and its gate.
    "mlp.shared_expert.gate_proj.weight": ("mlp.shared_experts.linear_fc1.weight", "fc1"),
    "mlp.shared_expert.up_proj.weight": ("mlp.shared_experts.linear_fc1.weight", "fc1"),
    "mlp.shared_expert.down_proj.weight": ("mlp.shared_experts.linear_fc2.weight", "row"),
    "mlp.shared_expert_gate.weight": ("mlp.shared_experts.gate_weight", "rep"),
}
# The same within a multi-latent attention layer, where they differ.
IN_MLA_LAYER = {
    "self_attn.q_a_proj.weight": ("self_attention.linear_q_down_proj.weight", "rep"),
    "self_attn.q_a_layernorm.weight": ("self_attention.linear_q_up_proj.layer_norm_weight", "rep"),
    "self_attn.q_b_proj.weight": ("self_attention.linear_q_up_proj.weight", "col"),
    "self_attn.q_proj.weight": ("self_attention.linear_q_proj.weight", "col"),
    "self_attn.kv_a_proj_with_mqa.weight": ("self_attention.linear_kv_down_proj.weight", "rep"),
    "self_attn.kv_a_layernorm.weight": ("self_attention.linear_kv_up_proj.layer_norm_weight", "rep"),
    "self_attn.kv_b_proj.weight": ("self_attention.linear_kv_up_proj.weight", "col"),
    "input_layernorm.weight": ("input_layernorm.weight", "rep"),
}
# Each layer spec's names where they differ from IN_LAYER's / IN_MLA_LAYER's
# (the Transformer Engine spec's): the local spec fuses no norm into a
# linear layer.
SPECS: Dict[str, Dict[str, str]] = {
    "transformer_engine": {},
    "local": {
        "input_layernorm.weight": "input_layernorm.weight",
        "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
        "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
        "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
    },
}
OUTSIDE = {
    # HF name -> (Megatron name, how it is split, on the first stage? else the last)
    "model.embed_tokens.weight": ("embedding.word_embeddings.weight", "vocab", True),
    "lm_head.weight": ("output_layer.weight", "vocab", False),
    "model.norm.weight": ("decoder.final_layernorm.weight", "rep", False),
}


def megatron_layout(
    tensors: Mapping[str, Sequence[int]],
    *,
    tp: int,
    pp: int = 1,
    dp: int = 1,
    num_attention_heads: int,
    num_kv_heads: Optional[int] = None,
    dtype: str = "bf16",
    ranks_per_node: Optional[int] = None,
    vocab_multiple: int = 128,
    ep: int = 1,
    etp: Optional[int] = None,
    grouped_experts: bool = True,
    layer_spec: str = "transformer_engine",
) -> Any:
    """A ``refit.Layout`` of ``tp × dp × pp`` Megatron-Core training ranks
    holding the Hugging Face tensors ``{name: global shape}`` (see the
    module doc for the parameters and rank order).

    ``num_kv_heads``: query groups (GQA; default ``num_attention_heads``),
    a multiple or a divisor of ``tp`` (as Megatron-Core requires).
    ``layer_spec``: ``"transformer_engine"`` (norms fused into
    ``linear_qkv`` / ``linear_fc1``) or ``"local"`` (Megatron-Core's local
    spec: ``input_layernorm`` / ``pre_mlp_layernorm`` of their own). ``ep``, ``etp`` (default ``tp``): expert
    parallelism and expert tensor parallelism of MoE layers; ``etp * ep``
    must divide ``tp * dp``. On a rank, hand refit its Megatron parameters
    as the buffers of those names, each cut to the buffer's elements (the
    vocabulary padding is no tensor's)::

        src = refit.Source.in_place(layout, rank, refit.param_buffers(layout, rank, dict(model.named_parameters())))
    """
    heads, groups = num_attention_heads, num_kv_heads or num_attention_heads
    _check_split(tp, pp, dp, heads, groups, layer_spec)
    renamed = SPECS[layer_spec]
    shapes = {n: [int(s) for s in shape] for n, shape in tensors.items()}
    layers = sorted({int(m["l"]) for m in map(LAYER.match, shapes) if m})
    if layers != list(range(len(layers))):
        raise LayoutError(f"layers {layers[:8]}...: expected model.layers.0 .. model.layers.{len(layers) - 1}")
    if len(layers) % pp:
        raise LayoutError(f"{len(layers)} layers do not split evenly over pp={pp}")
    per_stage = len(layers) // pp
    etp = tp if etp is None else etp
    if ep < 1 or etp < 1 or (tp * dp) % (ep * etp):
        raise LayoutError(f"ep={ep} x etp={etp} does not divide the {tp * dp} ranks of a stage (tp={tp} x dp={dp})")
    experts = _experts(shapes, ep)
    moe_layers = {layer for layer, _ in experts.values()}
    mla_layers = {int(m["l"]) for m in map(LAYER.match, shapes) if m and m["rest"] == "self_attn.kv_a_proj_with_mqa.weight"}

    def ranks_of(stage: int) -> List[Tuple[int, int]]:
        """(global rank, TP rank) of every rank of pipeline stage `stage`."""
        return [(t + tp * (d + dp * stage), t) for d in range(dp) for t in range(tp)]

    def expert_ranks_of(stage: int, k: int) -> List[Tuple[int, int]]:
        """(global rank, expert-TP rank) of EP rank `k`'s ranks in `stage`."""
        base = tp * dp * stage
        return [(base + r, r % etp) for r in range(tp * dp) if r // etp % ep == k]

    b = LayoutBuilder(tp * dp * pp, ranks_per_node)
    for name, shape in shapes.items():
        m = LAYER.match(name)
        if m:
            layer, rest = int(m["l"]), m["rest"]
            stage, local = divmod(layer, per_stage)
            prefix = f"decoder.layers.{local}."
        if m and name in experts:
            if layer_spec == "local" and grouped_experts:
                raise LayoutError(
                    f"tensor '{name}': the local layer spec's grouped experts (the legacy GroupedMLP) are not modelled; "
                    "build SequentialMLP experts and pass grouped_experts=False"
                )
            owner, j = experts[name][1]
            fc = "linear_fc2" if rest.endswith("down_proj.weight") else "linear_fc1"
            part = f"mlp.experts.{fc}.weight{j}" if grouped_experts else f"mlp.experts.local_experts.{j}.{fc}.weight"
            buffer, how = prefix + part, "row" if fc == "linear_fc2" else "fc1"
            holders, ways = expert_ranks_of(stage, owner), etp
        elif m:
            if rest == "post_attention_layernorm.weight" and layer in moe_layers:
                buffer, how = prefix + "pre_mlp_layernorm.weight", "rep"  # no fused norm before a router
            elif layer in mla_layers and rest in IN_MLA_LAYER:
                buffer, how = prefix + renamed.get(rest, IN_MLA_LAYER[rest][0]), IN_MLA_LAYER[rest][1]
            elif layer in mla_layers and rest.startswith("self_attn.") and rest != "self_attn.o_proj.weight":
                raise LayoutError(f"tensor '{name}': not a weight of multi-latent attention, which this layer has")
            elif rest in IN_LAYER:
                buffer, how = prefix + renamed.get(rest, IN_LAYER[rest][0]), IN_LAYER[rest][1]
            else:
                raise LayoutError(_unknown(name, rest))
            holders, ways = ranks_of(stage), tp
        elif name in OUTSIDE:
            buffer, how, first = OUTSIDE[name]
            holders, ways = ranks_of(0 if first else pp - 1), tp
        else:
            raise LayoutError(_unknown(name, name))
        shares = _shares(name, shape, how, ways, "etp" if m and name in experts else "tp", heads, groups, vocab_multiple, shapes)
        b = b.tensor(_placed(TensorBuilder(name, dtype, shape), buffer, how, holders, ways, shares))
    return b.build()


def _check_split(tp: int, pp: int, dp: int, heads: int, groups: int, layer_spec: str) -> None:
    """``megatron_layout``'s parallelism and heads, as Megatron-Core
    accepts them."""
    if min(tp, pp, dp) < 1:
        raise LayoutError(f"tp={tp}, pp={pp}, dp={dp}: each must be >= 1")
    if heads < 1 or groups < 1 or heads % groups:
        raise LayoutError(f"num_attention_heads={heads}, num_kv_heads={groups}: heads must be a multiple of KV heads")
    if groups % tp and tp % groups:
        raise LayoutError(f"num_kv_heads={groups} and tp={tp}: Megatron-Core needs the query groups a multiple or a divisor of tp")
    if heads % tp:
        raise LayoutError(f"num_attention_heads={heads} does not split over tp={tp}")
    if layer_spec not in SPECS:
        raise LayoutError(f"layer_spec={layer_spec!r}: expected one of {sorted(SPECS)}")


def _placed(t: Any, buffer: str, how: str, holders: List[Tuple[int, int]], ways: int, shares: Any) -> Any:
    """Tensor ``t`` placed in ``buffer`` of each holder ``(rank, TP
    rank)``, split ``how`` ``ways`` ways into ``shares`` (per TP rank:
    ``(offset, extent, at)`` blocks)."""
    if how in MESH:
        # An even split, every share one block at the same place in its
        # buffer: the mesh (copies, TP ranks) over the holders, which
        # are listed copy by copy, TP rank fastest.
        at = shares[0][0][2]
        return t.mesh([len(holders) // ways, ways], ["replicate", MESH[how]], [rank for rank, _ in holders]).buffer(buffer, at)
    for rank, tp_rank in holders:
        for offset, extent, at in shares[tp_rank]:
            t = t.shard(rank, offset=offset, extent=extent, buffer=buffer, at=at)
    return t


# Splits a mesh says: the placement of the TP dimension.
MESH = {"rep": "replicate", "row": "shard(1)", "col": "shard(0)", "fc1": "shard(0)"}


def _unknown(name: str, part: str) -> str:
    if part in IN_MLA_LAYER:
        return f"tensor '{name}': multi-latent attention weights in a layer without kv_a_proj_with_mqa"
    return f"tensor '{name}': '{part}' is not a Llama/Qwen/DeepSeek weight megatron_layout knows"


def _experts(shapes: Mapping[str, Sequence[int]], ep: int) -> Dict[str, Tuple[int, Tuple[int, int]]]:
    """Every routed expert's projection: its layer, its EP rank and its
    local index there (experts ``k * E / ep ..`` on EP rank ``k``)."""
    placed: Dict[str, Tuple[int, Tuple[int, int]]] = {}
    for moe, experts in routed_experts(shapes, ep).items():
        m = LAYER.match(moe)
        if not m:
            continue  # outside the layers: refused by name later
        local = len(experts) // ep
        for e, projs in experts.items():
            for name in projs.values():
                placed[name] = (int(m["l"]), divmod(e, local))
    return placed


def _shares(
    name: str,
    shape: List[int],
    how: str,
    ways: int,
    label: str,
    heads: int,
    groups: int,
    vocab_multiple: int,
    shapes: Mapping[str, List[int]],
) -> List[List[Tuple[List[int], List[int], int]]]:
    """Per rank of the ``ways``-way tensor parallelism that splits it (TP,
    or expert TP for a routed expert), the blocks ``(offset, extent, at)``
    of tensor ``name`` that rank holds and where they start in its buffer."""
    dims = len(shape)
    rest = 1
    for s in shape[1:]:
        rest *= s  # elements per row

    def rows(start: int, count: int, at: int) -> Tuple[List[int], List[int], int]:
        return [start] + [0] * (dims - 1), [count] + shape[1:], at

    if how == "rep":
        return [[([0] * dims, list(shape), 0)] for _ in range(ways)]
    if how == "row":
        if dims != 2 or shape[1] % ways:
            raise LayoutError(f"tensor '{name}': shape {shape}: columns do not split evenly over {label}={ways}")
        cols = shape[1] // ways
        return [[([0, t * cols], [shape[0], cols], 0)] for t in range(ways)]
    if how == "vocab":
        step = vocab_multiple * ways
        padded = -(-shape[0] // step) * step
        per = padded // ways
        out = []
        for t in range(ways):
            count = max(0, min(per, shape[0] - t * per))
            out.append([rows(t * per, count, 0)] if count else [])
        return out
    if how == "col":
        if shape[0] % ways:
            raise LayoutError(f"tensor '{name}': {shape[0]} rows do not split evenly over {label}={ways}")
        per = shape[0] // ways
        return [[rows(t * per, per, 0)] for t in range(ways)]
    if how == "fc1":
        if shape[0] % ways:
            raise LayoutError(f"tensor '{name}': {shape[0]} rows do not split evenly over {label}={ways}")
        per = shape[0] // ways
        second = name.rsplit(".", 2)[-2] == "up_proj"  # up's share follows gate's
        return [[rows(t * per, per, per * rest if second else 0)] for t in range(ways)]
    # "qkv": [q rows of group g (heads / groups heads); k_g; v_g] per group.
    proj = name.rsplit(".", 2)[-2]
    q_name = name.replace(f".{proj}.", ".q_proj.")
    if q_name not in shapes:
        raise LayoutError(f"tensor '{name}': no '{q_name}' beside it (linear_qkv holds q, k and v)")
    q_rows = shapes[q_name][0]
    if q_rows % heads:
        raise LayoutError(f"tensor '{q_name}': {q_rows} rows are not num_attention_heads={heads} heads")
    head = q_rows // heads
    per_group = heads // groups  # query heads per group
    want = q_rows if proj == "q_proj" else groups * head
    if shape[0] != want:
        raise LayoutError(f"tensor '{name}': {shape[0]} rows, expected {want} ({groups} KV heads of {head})")
    span = (per_group + 2) * head  # rows of one group in linear_qkv
    total = groups * span
    if total % ways:
        raise LayoutError(f"tensor '{name}': linear_qkv's {total} rows ({groups} query groups of {span}) do not split evenly over {label}={ways}")
    per = total // ways  # linear_qkv rows per rank
    inside, count = {"q_proj": (0, per_group * head), "k_proj": (per_group * head, head), "v_proj": ((per_group + 1) * head, head)}[proj]
    out = []
    for t in range(ways):
        first, last = t * per, (t + 1) * per  # the rank's rows of linear_qkv
        blocks = []
        for g in range(groups):
            lo, hi = max(first, g * span + inside), min(last, g * span + inside + count)
            if lo < hi:  # rows lo..hi of linear_qkv: this projection's, of group g
                blocks.append(rows(g * count + lo - (g * span + inside), hi - lo, (lo - first) * rest))
        out.append(blocks)
    return out
