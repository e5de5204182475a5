"""The Llama family: Llama, Mistral, Qwen2 and Qwen3 decoder-only models.

They differ only in a few switches (biases, qk-norm, which layers slide), read from the HF
config by :class:`LlamaFamily`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from heron.layers.activation import SiluAndMul
from heron.layers.embedding import LMHead, VocabEmbedding
from heron.layers.linear import Linear, PackedLinear
from heron.layers.norm import RMSNorm
from heron.layers.rotary import QKTransform, RotaryEmbedding
from heron.ops.attention.base import AttentionSpec
from heron.ops.selector import OperatorRuntime, make_attention


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
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:  # Mistral: one window (or none) for every layer
            windows = (window,) * config.num_hidden_layers
        return cls(
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_windows=windows,
        )


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        family: LlamaFamily,
        layer_idx: int,
        rotary: RotaryEmbedding,
        runtime: OperatorRuntime,
        prefix: str,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=family.qkv_bias
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=family.o_bias)
        # Registered here first so their checkpoint names are self_attn.{q,k}_norm.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if family.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if family.qk_norm else None
        spec = AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            scale=self.head_dim**-0.5,
            sliding_window=family.sliding_windows[layer_idx],
        )
        transform = QKTransform(rotary, self.q_norm, self.k_norm)
        self.attn = make_attention(f"{prefix}.attn", spec, runtime, transform)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(self.qkv_proj(x)))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, bias: bool) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, {"gate": inter, "up": inter}, bias)
        self.down_proj = Linear(inter, config.hidden_size, bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, family, layer_idx, rotary, runtime, prefix) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(
            config, family, layer_idx, rotary, runtime, f"{prefix}.self_attn"
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, family.mlp_bias)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        super().__init__()
        family = LlamaFamily.from_config(config)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        # One table for all layers; not a submodule of each layer so it is stored once.
        rotary = RotaryEmbedding(config, head_dim, runtime.max_model_len)
        self.rotary = rotary
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, family, i, rotary, runtime, f"model.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(token_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Checkpoint names map onto this module tree one to one, except the packed projections."""

    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, runtime)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LMHead(
            config.vocab_size, config.hidden_size, self.model.embed_tokens if tied else None
        )

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states of the step's tokens; positions reach attention through its view."""
        return self.model(token_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
