"""DeepSeek-V2 and V3: multi-head latent attention (MLA), dense then mixture-of-experts MLPs.

The attention layer projects the query (directly, or through the low-rank ``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj``) and the compressed latent plus shared rotary key
(``kv_a_proj_with_mqa``), and hands both to the latent attention operator, which owns the
latent cache and reads ``kv_b_proj`` and the latent's norm ``kv_a_layernorm``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PretrainedConfig

from heron.layers.activation import SiluAndMul
from heron.layers.embedding import VocabEmbedding
from heron.layers.linear import Linear
from heron.layers.mlp import GatedMLP
from heron.layers.moe import SparseMoE
from heron.layers.norm import RMSNorm
from heron.layers.rotary import MLARotary, RotaryEmbedding
from heron.models.common import (
    PACKED_MODULES,
    DecoderForCausalLM,
    DecoderModel,
    PreNormDecoderLayer,
)
from heron.models.mtp import MultiTokenPredictor, num_mtp_layers
from heron.ops.mla.base import MLASpec
from heron.ops.selector import OperatorRuntime, make_mla

# HF's DeepSeek norms inside attention keep RMSNorm's default eps, not ``rms_norm_eps``.
_LORA_NORM_EPS = 1e-6


def mla_softmax_scale(config: PretrainedConfig) -> float:
    """``(nope + rope) ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` when the
    rope is scaled and the config names ``mscale_all_dim`` (HF's ``yarn_apply_mscale``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params.get("rope_type", "default") != "default" and mscale_all_dim:
        factor = params["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class DeepseekAttention(nn.Module):
    """The query and latent projections around the latent attention operator.

    Tensor-parallel by heads: each rank projects its heads' queries (``q_proj`` / ``q_b_proj``
    column-parallel) and decompresses their keys and values (``kv_b_proj`` column-parallel, so
    the operator's absorbed decode weights are the rank's heads'); ``o_proj`` is row-parallel
    (one all-reduce). ``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms are replicated: the
    latent and the rotary key serve every head, so each rank caches the whole latent.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        rotary: MLARotary,
        runtime: OperatorRuntime,
        prefix: str,
    ) -> None:
        super().__init__()
        kernels, hidden = runtime.kernels, config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        heads, lora, rope = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
        nope, v_dim = config.qk_nope_head_dim, config.v_head_dim
        qk_dim = nope + rope
        q_size = heads * qk_dim
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_size, False, kernels, "column", unit_rows=qk_dim)
            q_out = self.q_proj
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias, kernels)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LORA_NORM_EPS, kernels)
            self.q_b_proj = Linear(
                self.q_lora_rank, q_size, False, kernels, "column", unit_rows=qk_dim
            )
            q_out = self.q_b_proj
        self.kv_a_proj_with_mqa = Linear(hidden, lora + rope, bias, kernels)
        self.kv_a_layernorm = RMSNorm(lora, _LORA_NORM_EPS, kernels)
        # Registered before the operator (which reads it), so its name is self_attn.kv_b_proj.
        self.kv_b_proj = Linear(
            lora, heads * (nope + v_dim), False, kernels, "column", unit_rows=nope + v_dim
        )
        self.kv_b_proj.keep_dense = True  # the operator absorbs it into the query
        self.o_proj = Linear(heads * v_dim, hidden, bias, kernels, parallel="row")
        spec = MLASpec(
            num_heads=q_out.out_features // qk_dim,  # this rank's heads
            kv_lora_rank=lora,
            nope_dim=nope,
            rope_dim=rope,
            v_head_dim=v_dim,
            scale=mla_softmax_scale(config),
        )
        self.attn = make_mla(
            f"{prefix}.attn", spec, runtime, rotary, self.kv_b_proj, self.kv_a_layernorm
        )
        self._split = [lora, rope]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        latent, k_rope = self.kv_a_proj_with_mqa(x).split(self._split, dim=-1)
        return self.o_proj(self.attn(q, latent, k_rope))  # the operator norms the latent


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        rotary: MLARotary,
        runtime: OperatorRuntime,
        prefix: str,
    ) -> None:
        super().__init__()
        eps, kernels = config.rms_norm_eps, runtime.kernels
        self.input_layernorm = RMSNorm(config.hidden_size, eps, kernels)
        self.self_attn = DeepseekAttention(config, rotary, runtime, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, kernels)
        if layer_idx >= config.first_k_dense_replace:
            self.mlp = SparseMoE.deepseek(config, kernels)
        else:
            mlp_bias = bool(getattr(config, "mlp_bias", False))
            self.mlp = GatedMLP(
                config.hidden_size, config.intermediate_size, SiluAndMul, mlp_bias, kernels
            )


def mla_rotary(config: PretrainedConfig, runtime: OperatorRuntime) -> MLARotary:
    interleaved = config.model_type == "deepseek_v2" or bool(
        getattr(config, "rope_interleave", True)
    )
    table = RotaryEmbedding(config, config.qk_rope_head_dim, runtime.max_model_len)
    return MLARotary(table, interleaved)


class DeepseekModel(DecoderModel):
    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        super().__init__()
        # One table for all layers, stored once (not a submodule of each layer first).
        self.rotary = mla_rotary(config, runtime)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, self.rotary, runtime, f"model.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, runtime.kernels)


class DeepseekForCausalLM(DecoderForCausalLM):
    """``DeepseekV2ForCausalLM`` and ``DeepseekV3ForCausalLM``: the first
    ``first_k_dense_replace`` layers dense, the others DeepSeek MoE (``SparseMoE.deepseek``)."""

    # Only the MLPs' gate and up are packed; the attention projections load as they are named.
    packed_modules = {k: v for k, v in PACKED_MODULES.items() if v[0] == "gate_up_proj"}
    checkpoint_renames = {"shared_experts": "shared_expert"}  # SparseMoE's name for it

    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        super().__init__(config, DeepseekModel(config, runtime), runtime)
        # The MTP layers stored after the last one are DeepseekMTP's.
        first = config.num_hidden_layers
        self.checkpoint_prefixes = {
            f"model.layers.{n}.": None
            for n in range(first, first + (getattr(config, "num_nextn_predict_layers", 0) or 0))
        }


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """DeepSeek-V3's MTP module: a decoder layer (MLA, MoE) with the norms of its two inputs
    (``enorm``, ``hnorm``), their projection ``eh_proj`` and its output norm
    ``shared_head.norm``, all stored under the layer's own name."""

    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        rotary: MLARotary,
        runtime: OperatorRuntime,
        prefix: str,
    ) -> None:
        super().__init__(config, layer_idx, rotary, runtime, prefix)
        hidden, eps, kernels = config.hidden_size, config.rms_norm_eps, runtime.kernels
        self.enorm = RMSNorm(hidden, eps, kernels)
        self.hnorm = RMSNorm(hidden, eps, kernels)
        self.eh_proj = Linear(2 * hidden, hidden, False, kernels)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps, kernels)


class DeepseekMTP(MultiTokenPredictor):
    """The first of the ``num_nextn_predict_layers`` layers ``model.layers.{num_hidden_layers +
    i}``; its stored copies of the embedding and LM head (``embed_tokens``,
    ``shared_head.head``) are the target's, not loaded."""

    packed_modules = DeepseekForCausalLM.packed_modules
    checkpoint_renames = DeepseekForCausalLM.checkpoint_renames
    # Stored unquantised in DeepSeek-V3's FP8 checkpoints (vLLM and SGLang load it so).
    full_precision_modules = ("eh_proj",)

    def __init__(self, target: DeepseekForCausalLM, runtime: OperatorRuntime) -> None:
        super().__init__(target)
        config = target.config
        first = config.num_hidden_layers
        count = num_mtp_layers(config, "num_nextn_predict_layers")
        self.rotary = mla_rotary(config, runtime)
        own = f"model.layers.{first}."
        layer = DeepseekMTPLayer(config, first, self.rotary, runtime, own.rstrip("."))
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(first): layer})
        self.checkpoint_prefixes = {own + "embed_tokens.": None, own + "shared_head.head.": None}
        self.checkpoint_prefixes[own] = own
        self.checkpoint_prefixes.update(
            {f"model.layers.{n}.": None for n in range(first + 1, first + count)}
        )
        self.parts = (layer.enorm, layer.hnorm, layer.eh_proj, layer, layer.shared_head.norm)
