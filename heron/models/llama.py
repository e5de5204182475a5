"""The Llama family: Llama, Mistral, Qwen2 and Qwen3 decoder-only models.

They differ only in a few switches (biases, qk-norm, which layers slide), read from the HF
config by :class:`LlamaFamily`. Their mixture-of-experts relatives (``heron.models.qwen_moe``)
reuse the stack with another MLP per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from torch import nn
from transformers import PretrainedConfig

from heron.kernels import LayerKernels
from heron.layers.activation import SiluAndMul
from heron.layers.embedding import VocabEmbedding
from heron.layers.mlp import GatedMLP
from heron.layers.norm import RMSNorm
from heron.layers.rotary import RotaryEmbedding
from heron.models.common import (
    DecoderForCausalLM,
    DecoderModel,
    PackedAttention,
    PreNormDecoderLayer,
    attention_spec,
    head_dim_of,
    sliding_windows,
)
from heron.ops.selector import OperatorRuntime


@dataclass(frozen=True)
class LlamaFamily:
    """The per-family switches of a Llama-like config."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # per layer

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> LlamaFamily:
        model_type = config.model_type
        attention_bias = bool(getattr(config, "attention_bias", False))
        qwen2 = model_type in ("qwen2", "qwen2_moe")
        return cls(
            qkv_bias=bool(getattr(config, "qkv_bias", True)) if qwen2 else attention_bias,
            o_bias=False if qwen2 else attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "qwen3_vl_text"),
            sliding_windows=sliding_windows(config),
        )


#: A layer's MLP from ``(config, family, layer index, kernels)``.
MLPFactory = Callable[[PretrainedConfig, LlamaFamily, int, LayerKernels], nn.Module]


def dense_mlp(
    config: PretrainedConfig, family: LlamaFamily, layer_idx: int, kernels: LayerKernels
) -> nn.Module:
    return GatedMLP(
        config.hidden_size, config.intermediate_size, SiluAndMul, family.mlp_bias, kernels
    )


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self,
        config: PretrainedConfig,
        family: LlamaFamily,
        layer_idx: int,
        rotary: RotaryEmbedding,
        runtime: OperatorRuntime,
        prefix: str,
        mlp: MLPFactory,
    ) -> None:
        super().__init__()
        eps, kernels = config.rms_norm_eps, runtime.kernels
        self.input_layernorm = RMSNorm(config.hidden_size, eps, kernels)
        self.self_attn = PackedAttention(
            config.hidden_size,
            attention_spec(config, sliding_window=family.sliding_windows[layer_idx]),
            rotary,
            runtime,
            f"{prefix}.self_attn",
            qkv_bias=family.qkv_bias,
            o_bias=family.o_bias,
            qk_norm=partial(RMSNorm, eps=eps) if family.qk_norm else None,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, kernels)
        self.mlp = mlp(config, family, layer_idx, kernels)


class LlamaModel(DecoderModel):
    def __init__(
        self,
        config: PretrainedConfig,
        runtime: OperatorRuntime,
        mlp: MLPFactory = dense_mlp,
        rotary_class: type[RotaryEmbedding] = RotaryEmbedding,
    ) -> None:
        super().__init__()
        family = LlamaFamily.from_config(config)
        # One table for all layers; not a submodule of each layer so it is stored once.
        rotary = rotary_class(config, head_dim_of(config), runtime.max_model_len)
        self.rotary = rotary
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, family, i, rotary, runtime, f"model.layers.{i}", mlp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, runtime.kernels)


class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        super().__init__(config, LlamaModel(config, runtime), runtime)
