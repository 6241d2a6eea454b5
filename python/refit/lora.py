"""LoRA adapters refitted in memory: the trainer's PEFT adapter straight into
an engine's adapter slot, no file written.

The source is a PEFT LoRA adapter (its A and B matrices, sharded however
the trainer shards them: FSDP2's ``Shard(0)`` DTensors, or whole tensors on
one rank), as a layout of the tensors PEFT saves: ``adapter_parameters``
names them as ``save_pretrained`` writes them
(``base_model.model.….q_proj.lora_A.weight``), so the engine takes them as
it takes the same adapter from disk. The destination is a vLLM engine
(``refit.vllm.VLLMRollouts(..., adapter=Adapter(...))``) started with
``enable_lora=True``: each refit commits on every worker of every engine or
on none, then every worker builds the adapter from what it received and
puts it in place of the previous version under the same LoRA id, in one
step of the engine (the base weights are not touched). Requests name it
with ``Adapter.request()``, a ``vllm.lora.request.LoRARequest`` of that id.

Imports no framework: torch and vLLM only where a function asks for them.
See docs/python.md, "vLLM: LoRA adapters".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping

from ._refit import LayoutError

__all__ = ["Adapter", "adapter_config", "adapter_parameters"]


def adapter_config(config: Any) -> Dict[str, Any]:
    """A PEFT ``LoraConfig`` (or its dict, as ``adapter_config.json``
    holds it) as plain JSON values (sets as sorted lists): what an engine's
    worker reads it from."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise LayoutError(f"adapter config: a {type(config).__name__}, expected a PEFT LoraConfig or its dict")

    def plain(value: Any) -> Any:
        if isinstance(value, (set, frozenset)):
            return sorted(plain(v) for v in value)
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if hasattr(value, "value") and not isinstance(value, (str, int, float, bool)):
            return value.value  # PEFT's enums (peft_type, task_type)
        return value

    out = plain(config)
    for key in ("r", "lora_alpha", "target_modules"):
        if out.get(key) is None:
            raise LayoutError(f"adapter config: no '{key}' (a PEFT LoraConfig has one)")
    try:
        json.dumps(out)
    except TypeError as e:
        raise LayoutError(f"adapter config: not plain JSON values ({e})") from None
    return out


def adapter_parameters(model: Any, adapter: str = "default") -> Dict[str, Any]:
    """The parameters of LoRA adapter ``adapter`` of a PEFT model
    (``get_peft_model(...)``, FSDP2-sharded or not), named as PEFT's
    ``save_pretrained`` names them in ``adapter_model.safetensors`` (the
    adapter's name dropped: ``….q_proj.lora_A.default.weight`` is
    ``….q_proj.lora_A.weight``): the tensors of the training layout
    (``refit.layout_from_dtensors``) and of ``refit.param_buffers``."""
    out: Dict[str, Any] = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        # The adapter's name follows its LoRA part: "lora_A.default.weight",
        # "lora_embedding_A.default".
        at = [i for i in range(1, len(parts)) if parts[i] == adapter and parts[i - 1].startswith("lora_")]
        if at:
            out[".".join(parts[: at[0]] + parts[at[0] + 1 :])] = param
    if not out:
        raise LayoutError(f"the model has no parameter of LoRA adapter '{adapter}' (names with 'lora_*.{adapter}')")
    return out


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter slot of the engines: refits go to LoRA id
    ``lora_id`` (> 0) under ``name``; ``config``: the adapter's PEFT
    ``LoraConfig`` or its dict (rank, alpha, target modules: what the
    engine needs to apply it, as ``adapter_config.json`` tells it)."""

    name: str
    lora_id: int
    config: Any = field(repr=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise LayoutError("adapter: empty name")
        if int(self.lora_id) <= 0:
            raise LayoutError(f"adapter '{self.name}': lora_id {self.lora_id}, vLLM's LoRA ids are > 0")
        object.__setattr__(self, "config", adapter_config(self.config))

    @property
    def path(self) -> str:
        """The placeholder path of its requests: the engine never reads it
        (the adapter is kept in its memory from the first refit on)."""
        return f"refit://{self.name}"

    def info(self) -> Dict[str, Any]:
        """What each engine worker is told at connect."""
        return {"name": self.name, "id": int(self.lora_id), "config": self.config}

    def request(self) -> Any:
        """vLLM's ``LoRARequest`` for this adapter (requests served with the
        version last refitted; before the first refit the engine has no
        adapter of this id and refuses them)."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, int(self.lora_id), self.path)
