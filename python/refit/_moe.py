"""Routed experts of mixture-of-experts layers, as both layout helpers
(``megatron_layout``, ``tp_inference_layout``) find them in a model's
Hugging Face tensor names."""

from __future__ import annotations

import re
from typing import Dict, Iterable

from ._refit import LayoutError

# ``{moe}.{e}.{proj}.weight``, ``moe`` ending in ``.experts``.
EXPERT = re.compile(r"^(?P<moe>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")

# A layer's routed experts in one tensor each, as transformers 5 writes
# them: ``{moe}.gate_up_proj`` [E, 2I, H] (every expert's gate rows, then
# its up rows) and ``{moe}.down_proj`` [E, H, I].
FUSED_EXPERTS = re.compile(r"^(?P<moe>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)(\.weight)?$")


def routed_experts(names: Iterable[str], ep: int = 1) -> Dict[str, Dict[int, Dict[str, str]]]:
    """``{moe: {expert: {proj: tensor name}}}`` for every routed expert's
    projection among ``names``; each layer's experts must be numbered
    ``0 .. E - 1`` and split evenly over ``ep`` EP ranks (EP rank ``k``
    holds experts ``k * E / ep ..``), else ``LayoutError`` naming it."""
    layers: Dict[str, Dict[int, Dict[str, str]]] = {}
    for name in names:
        m = EXPERT.match(name)
        if m:
            layers.setdefault(m["moe"], {}).setdefault(int(m["e"]), {})[m["proj"]] = name
    for moe, experts in layers.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))):
            raise LayoutError(f"'{moe}': experts {ids[:8]}{'...' if len(ids) > 8 else ''} are not 0..{len(ids) - 1}")
        if len(ids) % ep:
            raise LayoutError(f"'{moe}': {len(ids)} experts do not split evenly over ep={ep}")
    return layers
