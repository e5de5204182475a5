"""Building blocks shared by the decoder-only families (Llama-like, Gemma).

A family file decides what differs (norms, activation, scale, windows, soft-caps); the pieces
here hold what does not: the packed projections around the layer's attention operator, the
embed-layers-norm stack with its fused residual, and the LM-head shell.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from heron.kernels import LayerKernels
from heron.layers.embedding import LMHead, VocabEmbedding
from heron.layers.linear import Linear, PackedLinear
from heron.layers.rotary import QKTransform, RotaryEmbedding
from heron.ops.attention.base import AttentionSpec
from heron.ops.selector import OperatorRuntime, make_attention

# Checkpoint module name -> (packed module, shard) for the projections the blocks below pack.
PACKED_MODULES: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_spec(
    config: PretrainedConfig,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> AttentionSpec:
    """One layer's attention spec; the head counts come from ``config``, ``scale`` defaults
    to ``head_dim ** -0.5``."""
    num_heads = config.num_attention_heads
    head_dim = head_dim_of(config)
    return AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        scale=head_dim**-0.5 if scale is None else scale,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )


def sliding_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window: from ``layer_types`` where the config has them, else the
    config's one window (or none) for every layer, as Mistral's."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (window,) * config.num_hidden_layers


def norm_with_residual(
    norm: nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    prenorm: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input norm, fusing the previous layer's residual add (``norm(x)``, or
    ``(norm(x + residual), x + residual)``) and its ``output_norm`` (``prenorm``) if it left
    one; the first layer's input becomes the residual."""
    if residual is None:
        return norm(x), x
    return norm(x, residual, prenorm)


def head_parallel_qkv(
    hidden_size: int,
    spec: AttentionSpec,
    bias: bool,
    kernels: LayerKernels,
    q_head_dims: int = 1,
) -> tuple[PackedLinear, AttentionSpec]:
    """The packed qkv projection, column-parallel by heads (each query head ``q_head_dims``
    head dims wide: Qwen3.5's query and its gate; KV heads shared below one per rank), and the
    spec of this rank's heads (all of them on one rank)."""
    d = spec.head_dim
    q_rows, kv_size = q_head_dims * d, spec.num_kv_heads * d
    qkv_proj = PackedLinear(
        hidden_size,
        {"q": spec.num_heads * q_rows, "k": kv_size, "v": kv_size},
        bias,
        kernels,
        parallel="column",
        unit_rows={"q": q_rows, "k": d, "v": d},
        shared=("k", "v"),
    )
    local = dataclasses.replace(
        spec,
        num_heads=qkv_proj.shard_offsets["q"][1] // q_rows,
        num_kv_heads=qkv_proj.shard_offsets["k"][1] // d,
    )
    return qkv_proj, local


class PackedAttention(nn.Module):
    """Packed qkv projection -> the layer's attention operator -> output projection.

    The operator applies the optional per-head qk-norm and RoPE itself and owns the KV cache,
    so this module never sees positions or slots.
    """

    def __init__(
        self,
        hidden_size: int,
        spec: AttentionSpec,
        rotary: RotaryEmbedding,
        runtime: OperatorRuntime,
        prefix: str,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: Callable[[int], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        q_size, kernels = spec.num_heads * spec.head_dim, runtime.kernels
        self.qkv_proj, spec = head_parallel_qkv(hidden_size, spec, qkv_bias, kernels)
        self.o_proj = Linear(q_size, hidden_size, o_bias, kernels, parallel="row")
        self.first_head = self.qkv_proj.shard_starts["q"] // spec.head_dim  # this rank's first
        # Registered here, before the operator (which also holds them), so their checkpoint
        # names are self_attn.{q,k}_norm and self_attn.sinks, not names inside the operator.
        self.q_norm = qk_norm(spec.head_dim) if qk_norm is not None else None
        self.k_norm = qk_norm(spec.head_dim) if qk_norm is not None else None
        self.sinks = (
            nn.Parameter(torch.empty(spec.num_heads), requires_grad=False)
            if spec.has_sinks
            else None
        )
        transform = QKTransform(rotary, self.q_norm, self.k_norm)
        self.attn = make_attention(f"{prefix}.attn", spec, runtime, transform, self.sinks)

    def checkpoint_part(self, name: str, loaded: torch.Tensor, shard: None) -> torch.Tensor:
        """This rank's heads of the sinks."""
        return loaded.narrow(0, self.first_head, self.attn.spec.num_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(self.qkv_proj(x)))


class PreNormDecoderLayer(nn.Module):
    """norm -> attention -> +residual, norm -> MLP; the residual adds are fused into the norms.

    Subclasses build ``input_layernorm``, ``self_attn``, ``post_attention_layernorm`` and
    ``mlp``.
    """

    output_norm = None  # see DecoderModel

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, prenorm: nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = norm_with_residual(self.input_layernorm, x, residual, prenorm)
        x = self.self_attn(x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """``embed_tokens`` -> ``layers`` -> ``norm``, set by the subclass.

    Each layer maps ``(x, residual, prenorm)`` to ``(x, residual)`` and leaves its last residual
    add to the next norm, which fuses it (with the Triton kernels, in one launch). A layer whose output is
    normed before that add (Gemma's post-FFN norm) leaves that norm too: it names it
    ``output_norm``, and the next layer's input norm (or the final norm) applies it as its
    ``prenorm``, in the same kernel.
    """

    embed_tokens: VocabEmbedding
    layers: nn.ModuleList
    norm: nn.Module

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.forward_embeddings(self.embed(token_ids))

    def forward_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        """The layers and final norm over the step's input embeddings (a multimodal model's
        have its image features in them)."""
        residual, pending = None, None
        for layer in self.layers:
            x, residual = layer(x, residual, pending)
            pending = layer.output_norm
        x, _ = self.norm(x, residual, pending)
        return x


class DecoderForCausalLM(nn.Module):
    """A decoder model and its LM head (the embedding matrix, when the config ties them).

    Checkpoint names map onto this module tree one to one, except the packed projections.
    """

    packed_modules = PACKED_MODULES

    def __init__(
        self, config: PretrainedConfig, model: DecoderModel, runtime: OperatorRuntime
    ) -> None:
        super().__init__()
        self.config = config
        self.model = model
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LMHead(
            config.vocab_size,
            config.hidden_size,
            model.embed_tokens if tied else None,
            runtime.kernels,
        )

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states of the step's tokens; positions reach attention through its view."""
        return self.model(token_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
