"""refit.lora without an engine: the adapter's tensors named as PEFT saves
them, its config as plain values, the slot's checks. (The refit into vLLM:
test_vllm_lora.py.)"""

import enum

import pytest

import refit
import refit.lora
import refit.vllm


class Params:
    """What ``adapter_parameters`` reads of a model: ``named_parameters()``."""

    def __init__(self, names):
        self.names = names

    def named_parameters(self):
        return [(n, f"param:{n}") for n in self.names]


def test_adapter_parameters_are_named_as_peft_saves_them():
    layer = "base_model.model.model.layers.0"
    model = Params([
        f"{layer}.self_attn.q_proj.base_layer.weight",
        f"{layer}.self_attn.q_proj.lora_A.default.weight",
        f"{layer}.self_attn.q_proj.lora_B.default.weight",
        f"{layer}.self_attn.q_proj.lora_A.other.weight",
        "base_model.model.model.embed_tokens.lora_embedding_A.default",
        # A module named as the adapter, not after a LoRA part: kept as is.
        f"{layer}.default.mlp.lora_B.default.weight",
    ])
    got = refit.lora.adapter_parameters(model)
    assert got == {
        f"{layer}.self_attn.q_proj.lora_A.weight": f"param:{layer}.self_attn.q_proj.lora_A.default.weight",
        f"{layer}.self_attn.q_proj.lora_B.weight": f"param:{layer}.self_attn.q_proj.lora_B.default.weight",
        "base_model.model.model.embed_tokens.lora_embedding_A": "param:base_model.model.model.embed_tokens.lora_embedding_A.default",
        f"{layer}.default.mlp.lora_B.weight": f"param:{layer}.default.mlp.lora_B.default.weight",
    }
    assert list(refit.lora.adapter_parameters(model, "other")) == [f"{layer}.self_attn.q_proj.lora_A.weight"]
    with pytest.raises(refit.LayoutError, match=r"no parameter of LoRA adapter 'missing'"):
        refit.lora.adapter_parameters(model, "missing")


class PeftType(enum.Enum):
    LORA = "LORA"


class Config:
    """What ``adapter_config`` reads of a PEFT LoraConfig: ``to_dict()``."""

    def to_dict(self):
        return {"r": 8, "lora_alpha": 16, "target_modules": {"v_proj", "q_proj"}, "peft_type": PeftType.LORA, "layers_to_transform": (0, 1)}


def test_adapter_config_is_plain_json_values():
    assert refit.lora.adapter_config(Config()) == {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "peft_type": "LORA",
        "layers_to_transform": [0, 1],
    }
    with pytest.raises(refit.LayoutError, match=r"adapter config: no 'r'"):
        refit.lora.adapter_config({"lora_alpha": 16, "target_modules": ["q_proj"]})
    with pytest.raises(refit.LayoutError, match=r"expected a PEFT LoraConfig or its dict"):
        refit.lora.adapter_config(["r", 8])
    with pytest.raises(refit.LayoutError, match=r"not plain JSON values"):
        refit.lora.adapter_config({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "init": object()})


def test_adapter_slot():
    adapter = refit.lora.Adapter("policy", 3, Config())
    assert adapter.info() == {"name": "policy", "id": 3, "config": refit.lora.adapter_config(Config())}
    assert adapter.path == "refit://policy"
    with pytest.raises(refit.LayoutError, match=r"lora_id 0, vLLM's LoRA ids are > 0"):
        refit.lora.Adapter("policy", 0, Config())
    with pytest.raises(refit.LayoutError, match=r"empty name"):
        refit.lora.Adapter("", 1, Config())

    class Orch:
        address = "127.0.0.1:1"
        secret = "s"

    with pytest.raises(refit.RefitError, match=r"adapter is a dict, expected a refit.lora.Adapter"):
        refit.vllm.VLLMRollouts(Orch(), [object()], None, world_size=1, adapter={"name": "policy"})
