"""A LoRA adapter slot inside a vLLM worker: the adapter refitted into the
engine's LoRA manager from memory (``refit.lora``; docs/python.md, "vLLM:
LoRA adapters").

``AdapterSlot(model, info)`` at connect: the engine must serve LoRA
(``enable_lora=True``) and the adapter's config be one it takes (rank,
target modules); ``check(tensors)`` then puts an adapter of zeros shaped as
the training layout's tensors through everything a real one goes through
— vLLM's own build of an adapter from tensors (its names mapped onto the
model's modules) and an activation into a LoRA slot, where every matrix is
cut for this worker's tensor-parallel rank and copied into the slot's
stacked weights — under an id of its own, removed after: a layout the
engine cannot apply fails at connect, naming the tensor, never in a
serving step. ``build(tensors)`` builds the refitted version the same way
(from copies: the refit buffers are written again by the next refit);
only then ``put`` puts it in place of the previous one under the adapter's id,
kept in the manager's memory for good (never evicted, so never loaded from
its placeholder path; kept through vLLM's clearing of its adapters at the
end of every weight-update session: ``_keep``); the next step that serves it activates it as any
adapter. Both run between two engine steps (vLLM's worker RPCs), so no
step sees half an adapter.

Imports vLLM: only vLLM's worker processes import this module.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Tuple

import torch

import refit

# The id of the zeros adapter checked at connect: far above ids users give.
_CHECK_ID = 2**31 - 7


class AdapterSlot:
    """One LoRA adapter of one worker (see the module doc)."""

    def __init__(self, model: torch.nn.Module, info: Mapping[str, Any]):
        from vllm.lora.peft_helper import PEFTHelper

        self.manager = getattr(model, "lora_manager", None)
        if self.manager is None:
            raise refit.LayoutError("the engine serves no LoRA adapters: start it with enable_lora=True (and max_lora_rank >= the adapter's r)")
        self.name = str(info["name"])
        self.id = int(info["id"])
        if self.id == _CHECK_ID:
            raise refit.LayoutError(f"adapter '{self.name}': LoRA id {self.id} is the one refit checks adapters under; take another")
        self.config = dict(info["config"])
        try:
            self.peft = PEFTHelper.from_dict(self.config)
            self.peft.validate_legal(self.manager.lora_config)
        except Exception as e:  # noqa: BLE001 - vLLM's checks raise ValueError or their own
            raise refit.LayoutError(f"adapter '{self.name}': the engine refuses its config: {e}") from None
        model_ = self.manager.model
        mapper = getattr(model_, "hf_to_vllm_mapper", None)
        self.mapper = mapper.get_rename_mapper() if mapper is not None else None
        self.skip = getattr(model_, "lora_skip_prefixes", None)

    def _expected(self) -> set:
        """The module names the engine applies LoRA to (as vLLM's own
        loading of an adapter from disk lists them)."""
        manager = self.manager
        out = set()
        for module in manager.supported_lora_modules:
            out.update(manager.packed_modules_mapping.get(module, [module]))
            if module == "experts":
                out.add(module)
        return out

    def _build(self, lora_id: int, tensors: Dict[str, torch.Tensor]) -> Any:
        """vLLM's adapter of ``tensors``, checked as vLLM checks one loaded
        from disk."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

        expected = self._expected()
        for name in tensors:
            # As vLLM's check of an adapter on disk skips them: base
            # embeddings, PEFT's experts' base layers, skipped prefixes.
            if is_base_embedding_weights(name) or "base_layer" in name or LoRAModel._should_skip_module(name, self.skip or []):
                continue
            module, _ = parse_fine_tuned_lora_name(name, self.mapper)
            # An expert's matrices are named by what follows ".experts".
            base = module[module.find(".experts") + 1 :] if ".experts" in module else module.rsplit(".", 1)[-1]
            if base not in expected and base not in (self.peft.modules_to_save or ()):
                raise refit.LayoutError(f"adapter '{self.name}': tensor '{name}' is of module '{module}', which this engine applies no LoRA to (it does to {sorted(expected)})")
        manager = self.manager
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=lora_id,
            tensors=tensors,
            peft_helper=self.peft,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=self.mapper,
            skip_prefixes=self.skip,
        )
        manager._validate_modules_to_save(lora)
        return lora

    def check(self, tensors: List[Tuple[str, str, Tuple[int, ...]]]) -> None:
        """An adapter of zeros of these ``(name, dtype, shape)`` tensors
        built and activated into a slot, then removed (see the module doc):
        ``LayoutError`` names what the engine cannot take."""
        manager = self.manager
        zeros = {name: torch.zeros(shape, dtype=torch.float32) for name, _, shape in tensors}
        try:
            lora = self._build(_CHECK_ID, zeros)
        except refit.LayoutError:
            raise
        except Exception as e:  # noqa: BLE001 - vLLM's builder raises what it raises
            raise refit.LayoutError(f"adapter '{self.name}': vLLM cannot build it from the training layout's tensors: {e}") from None
        built = {m for m in lora.loras}
        if not built:
            raise refit.LayoutError(f"adapter '{self.name}': none of the training layout's {len(tensors)} tensor(s) is a LoRA matrix of this engine's model")
        try:
            manager.add_adapter(lora)
            manager.activate_adapter(_CHECK_ID)
        except Exception as e:  # noqa: BLE001 - a shape the slot cannot take raises here
            raise refit.LayoutError(f"adapter '{self.name}': its tensors do not fit the engine's LoRA slots (their shapes against the model's modules): {e}") from None
        finally:
            manager.remove_adapter(_CHECK_ID)

    def build(self, tensors: Iterator[Tuple[str, torch.Tensor]]) -> Any:
        """The refitted version, from copies of ``tensors`` (the engine
        unchanged so far)."""
        return self._build(self.id, {name: t.clone() for name, t in tensors})

    def put(self, lora: Any) -> None:
        """``lora`` (of ``build``) in place of the previous version, kept
        (see ``_keep``)."""
        self.manager.remove_adapter(self.id)
        _keep(self.manager, self.id, lora)

    def loaded(self) -> bool:
        """Whether the engine holds a version of this adapter."""
        return self.id in self.manager.list_adapters()


def _register(manager: Any, lora: Any) -> None:
    """``lora`` in the manager's memory for good, without holding a slot:
    pinned in its cache of adapters where it has one (the LRU manager),
    else as vLLM's ``pin_lora`` pins."""
    manager.add_adapter(lora)
    pin = getattr(manager, "_pin_lora_in_cpu_cache", None)
    if pin is not None:
        pin(lora.id)
    else:
        manager.pin_adapter(lora.id)


def _keep(manager: Any, lora_id: int, lora: Any) -> None:
    """Registers ``lora`` under ``lora_id`` and keeps it there: vLLM drops
    every adapter at the end of each weight-update session (it assumes the
    base weights changed: ``reset_lora_state``) and wherever it clears its
    adapters; an adapter's A and B matrices apply to any base weights, so
    the manager's ``remove_all_adapters`` (wrapped once per manager) puts
    the kept ones back after clearing the others."""
    kept = manager.__dict__.setdefault("_refit_kept", {})
    if "remove_all_adapters" not in manager.__dict__:
        clear = manager.remove_all_adapters

        def remove_all_adapters() -> None:
            clear()
            for one in kept.values():
                _register(manager, one)

        manager.remove_all_adapters = remove_all_adapters
    kept[lora_id] = lora
    _register(manager, lora)
