"""The Gemma 2 and Gemma 3 (text) decoder-only models.

Both interleave sliding-window and full-attention layers (``layer_types``), so each layer's
operator carries its own window and the two kinds land in different metadata groups. On top
of the Llama shape they add: Gemma's ``(1 + w)`` RMSNorm, four norms per layer (the
attention and MLP outputs are normed before their residual adds), an embedding scaled by
``sqrt(hidden_size)``, a gelu(tanh) gated MLP, the ``query_pre_attn_scalar`` attention scale
and soft-capped logits. Gemma 3 adds qk-norm and one RoPE table per layer type.

Gemma 1 (two norms per layer) is not covered; Gemma 3 with images is :mod:`heron.models.gemma3_mm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from transformers import PretrainedConfig

from heron.layers.activation import GeluTanhAndMul
from heron.layers.embedding import VocabEmbedding
from heron.layers.mlp import GatedMLP
from heron.layers.norm import GemmaRMSNorm
from heron.layers.rotary import RotaryEmbedding
from heron.models.common import (
    DecoderForCausalLM,
    DecoderModel,
    PackedAttention,
    attention_spec,
    head_dim_of,
    norm_with_residual,
    sliding_windows,
)
from heron.ops.selector import OperatorRuntime

_MODEL_TYPES = ("gemma2", "gemma3_text")


@dataclass(frozen=True)
class GemmaFamily:
    """The switches that tell Gemma 2 from Gemma 3, read from the HF config."""

    qk_norm: bool
    attn_logit_softcap: float | None
    sliding_windows: tuple[int | None, ...]  # per layer

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> GemmaFamily:
        model_type = config.model_type
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not one of {_MODEL_TYPES}")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma with use_bidirectional_attention=True is not supported")
        if config.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"hidden_activation {config.hidden_activation!r} is not supported; "
                "Gemma uses 'gelu_pytorch_tanh'"
            )
        gemma3 = model_type == "gemma3_text"
        return cls(
            qk_norm=gemma3,
            # HF's Gemma 3 attention never passes attn_logit_softcapping on to its kernels
            # (Gemma 3 replaced soft-capping with qk-norm), so a configured value is ignored
            # there and here alike.
            attn_logit_softcap=None if gemma3 else config.attn_logit_softcapping,
            sliding_windows=sliding_windows(config),
        )


def rotary_tables(
    config: PretrainedConfig, head_dim: int, max_positions: int
) -> dict[str, RotaryEmbedding]:
    """The RoPE table of each layer type.

    Gemma 3 keys ``rope_parameters`` by layer type (a local base for sliding layers, the global
    base with its scaling for full ones); Gemma 2 has one table for every layer.
    """
    layer_types = sorted(set(config.layer_types))
    params = getattr(config, "rope_parameters", None) or {}
    if set(layer_types) <= params.keys():
        return {
            t: RotaryEmbedding(config, head_dim, max_positions, layer_type=t) for t in layer_types
        }
    shared = RotaryEmbedding(config, head_dim, max_positions)
    return dict.fromkeys(layer_types, shared)


class GemmaDecoderLayer(nn.Module):
    """norm -> attention -> norm -> +residual -> norm -> MLP -> norm -> +residual.

    The ``+residual`` adds are fused into the next pre-norm (``pre_feedforward_layernorm``,
    then the next layer's ``input_layernorm``), as in the Llama layer, and so are the post-norms
    before them: ``post_attention_layernorm`` runs inside ``pre_feedforward_layernorm``'s kernel,
    and ``post_feedforward_layernorm`` (the layer's ``output_norm``) inside the next norm's.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        family: GemmaFamily,
        layer_idx: int,
        rotary: RotaryEmbedding,
        runtime: OperatorRuntime,
        prefix: str,
    ) -> None:
        super().__init__()
        hidden, eps, kernels = config.hidden_size, config.rms_norm_eps, runtime.kernels
        bias = bool(getattr(config, "attention_bias", False))
        self.input_layernorm = GemmaRMSNorm(hidden, eps, kernels)
        spec = attention_spec(
            config,
            scale=config.query_pre_attn_scalar**-0.5,
            sliding_window=family.sliding_windows[layer_idx],
            logit_softcap=family.attn_logit_softcap,
        )
        self.self_attn = PackedAttention(
            hidden,
            spec,
            rotary,
            runtime,
            f"{prefix}.self_attn",
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=partial(GemmaRMSNorm, eps=eps) if family.qk_norm else None,
        )
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, kernels)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, kernels)
        self.mlp = GatedMLP(hidden, config.intermediate_size, GeluTanhAndMul, kernels=kernels)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, kernels)

    @property
    def output_norm(self) -> GemmaRMSNorm:
        return self.post_feedforward_layernorm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, prenorm: nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = norm_with_residual(self.input_layernorm, x, residual, prenorm)
        x = self.self_attn(x)
        x, residual = self.pre_feedforward_layernorm(x, residual, self.post_attention_layernorm)
        return self.mlp(x), residual


class GemmaModel(DecoderModel):
    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        super().__init__()
        family = GemmaFamily.from_config(config)
        tables = rotary_tables(config, head_dim_of(config), runtime.max_model_len)
        # Stored once here (a shared table appears under each of its layer types).
        self.rotary = nn.ModuleDict(tables)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # Built in the model's dtype: HF rounds the normalizer to the hidden dtype too
        # (sqrt(3072) becomes 55.5 in bf16), and the checkpoints were trained with that.
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, family, i, tables[layer_type], runtime, f"model.layers.{i}")
            for i, layer_type in enumerate(config.layer_types)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, runtime.kernels)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids) * self.normalizer


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma 2 and Gemma 3 text checkpoints; logits are soft-capped where the config says."""

    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        super().__init__(config, GemmaModel(config, runtime), runtime)
        self.final_logit_softcap: float | None = config.final_logit_softcapping

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcap
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits
