"""Which layers of a model get LoRA operators: the targeted linear layers, expert banks and the
latent attention's ``kv_b_proj``."""

from __future__ import annotations

from torch import nn

from heron.layers.linear import Linear
from heron.layers.moe import SwiGLUExperts
from heron.lora.config import LoRAConfig
from heron.lora.experts import LoRAExperts
from heron.lora.latent import LoRALatent
from heron.lora.layer import LoRALinear
from heron.ops.mla.base import MLAOperator

# The linear layers an adapter may update, by their names in the model (packed ones included).
TARGETS = frozenset(
    {
        "qkv_proj",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_up_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        # DeepSeek's latent projections (MLA).
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
    }
)


def attach_lora(model: nn.Module, config: LoRAConfig) -> None:
    """Give every targeted linear layer, SwiGLU expert bank and latent attention's
    ``kv_b_proj`` of ``model`` its LoRA operator (inside the model's build scope, where they
    register)."""
    modules = dict(model.named_modules())
    latent = {id(m.kv_b_proj): m.spec for m in modules.values() if isinstance(m, MLAOperator)}
    for name, module in modules.items():
        if id(module) in latent:
            module.lora = LoRALatent(f"{name}.lora", module, latent[id(module)], config)
        elif isinstance(module, Linear) and name.rpartition(".")[2] in TARGETS:
            module.lora = LoRALinear(f"{name}.lora", module, config)
        elif isinstance(module, SwiGLUExperts):
            module.lora = LoRAExperts(f"{name}.lora", module, config)


def lora_layers(model: nn.Module) -> dict[str, LoRALinear | LoRAExperts]:
    """The LoRA operators of ``model``, by the name of the layer (or bank) each updates."""
    return {
        name: module.lora
        for name, module in model.named_modules()
        if isinstance(module, Linear | SwiGLUExperts) and module.lora is not None
    }
