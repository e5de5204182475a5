"""gpt-oss: sliding-window and full attention layers in turn, learned attention sinks, and a
mixture-of-experts MLP with clamped SwiGLU experts."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from transformers import PretrainedConfig

from heron.layers.embedding import VocabEmbedding
from heron.layers.linear import Linear, PackedLinear
from heron.layers.moe import MoEMLP
from heron.layers.norm import RMSNorm
from heron.layers.rotary import QKTransform, RotaryEmbedding
from heron.models.common import (
    DecoderForCausalLM,
    DecoderModel,
    attention_spec,
    head_dim_of,
    norm_with_residual,
    sliding_windows,
)
from heron.ops.attention.base import AttentionSpec
from heron.ops.selector import OperatorRuntime, make_attention

# HF's GptOssExperts uses this clamp whatever the config says; configs that name one say 7.0.
_DEFAULT_SWIGLU_LIMIT = 7.0


class GptOssAttention(nn.Module):
    """Packed qkv (with biases) -> the layer's attention operator with sinks -> o_proj."""

    def __init__(
        self,
        hidden_size: int,
        spec: AttentionSpec,
        bias: bool,
        rotary: RotaryEmbedding,
        runtime: OperatorRuntime,
        prefix: str,
    ) -> None:
        super().__init__()
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = PackedLinear(
            hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=bias
        )
        self.o_proj = Linear(q_size, hidden_size, bias=bias)
        # This module owns (and loads) the sink logits; registered before the operator, which
        # also holds them, so that their parameter name is the checkpoint's self_attn.sinks.
        self.sinks = nn.Parameter(torch.empty(spec.num_heads), requires_grad=False)
        self.attn = make_attention(
            f"{prefix}.attn", spec, runtime, QKTransform(rotary), sinks=self.sinks
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(self.qkv_proj(x)))


class GptOssDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        sliding_window: int | None,
        rotary: RotaryEmbedding,
        runtime: OperatorRuntime,
        prefix: str,
    ) -> None:
        super().__init__()
        spec = attention_spec(config, sliding_window=sliding_window)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GptOssAttention(
            config.hidden_size,
            dataclasses.replace(spec, has_sinks=True),
            config.attention_bias,
            rotary,
            runtime,
            f"{prefix}.self_attn",
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoEMLP(
            config.hidden_size,
            config.intermediate_size,
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            swiglu_limit=getattr(config, "swiglu_limit", _DEFAULT_SWIGLU_LIMIT),
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = norm_with_residual(self.input_layernorm, x, residual)
        x = self.self_attn(x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class GptOssModel(DecoderModel):
    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        super().__init__()
        # One table for all layers; not a submodule of each layer so it is stored once.
        rotary = RotaryEmbedding(config, head_dim_of(config), runtime.max_model_len)
        self.rotary = rotary
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(config, window, rotary, runtime, f"model.layers.{i}")
            for i, window in enumerate(sliding_windows(config))
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GptOssForCausalLM(DecoderForCausalLM):
    """Expert weights load as ``save_pretrained`` writes them (dense, fused ``gate_up_proj``);
    MXFP4-quantized checkpoints (``*_blocks`` / ``*_scales`` tensors) are not supported."""

    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        super().__init__(config, GptOssModel(config, runtime))
