"""gpt-oss: sliding-window and full attention layers in turn, learned attention sinks, and a
mixture-of-experts MLP with clamped SwiGLU experts."""

from __future__ import annotations

import dataclasses

from torch import nn
from transformers import PretrainedConfig

from heron.kernels import LayerKernels
from heron.layers.embedding import VocabEmbedding
from heron.layers.moe import ClampedSwiGLUExperts, SparseMoE
from heron.layers.mxfp4 import mxfp4_scheme
from heron.layers.norm import RMSNorm
from heron.layers.rotary import RotaryEmbedding
from heron.layers.routing import Routing, TopKRouter
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

# HF's GptOssExperts uses this clamp whatever the config says; configs that name one say 7.0.
_DEFAULT_SWIGLU_LIMIT = 7.0


def gpt_oss_moe(
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    top_k: int,
    swiglu_limit: float,
    kernels: LayerKernels,
    mxfp4: bool = False,
) -> SparseMoE:
    """gpt-oss's MoE block: a router with bias whose top-k logits are softmaxed, then the
    clamped-SwiGLU experts (held as MXFP4 if ``mxfp4``); no shared expert."""
    return SparseMoE(
        TopKRouter(hidden_size, num_experts, Routing(top_k, "softmax_of_topk"), True, kernels),
        ClampedSwiGLUExperts(
            num_experts,
            hidden_size,
            intermediate_size,
            swiglu_limit,
            kernels=kernels,
            mxfp4=mxfp4,
        ),  # fmt: skip
    )


def _mxfp4_experts(config: PretrainedConfig, name: str) -> bool:
    """Whether the checkpoint holds bank ``name``'s experts in MXFP4 (its quantization_config,
    as ``load_model`` reads it)."""
    qc = getattr(config, "quantization_config", None)
    qc = qc if qc is None or isinstance(qc, dict) else qc.to_dict()
    return qc is not None and qc.get("quant_method") == "mxfp4" and not mxfp4_scheme(qc).skips(name)


class GptOssDecoderLayer(PreNormDecoderLayer):
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
        eps, kernels = config.rms_norm_eps, runtime.kernels
        self.input_layernorm = RMSNorm(config.hidden_size, eps, kernels)
        self.self_attn = PackedAttention(
            config.hidden_size,
            dataclasses.replace(spec, has_sinks=True),
            rotary,
            runtime,
            f"{prefix}.self_attn",
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, kernels)
        try:
            self.mlp = gpt_oss_moe(
                config.hidden_size,
                config.intermediate_size,
                config.num_local_experts,
                config.num_experts_per_tok,
                getattr(config, "swiglu_limit", _DEFAULT_SWIGLU_LIMIT),
                kernels,
                _mxfp4_experts(config, f"{prefix}.mlp.experts"),
            )
        except ValueError as e:  # MXFP4 stacks this shape or rank cannot hold
            raise ValueError(f"{prefix}.mlp.experts.{e}") from e


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
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, runtime.kernels)


class GptOssForCausalLM(DecoderForCausalLM):
    """Expert weights load as ``save_pretrained`` writes them (dense, fused ``gate_up_proj``)
    or as published (MXFP4 ``*_blocks`` / ``*_scales``, held packed: ``load_model``)."""

    checkpoint_renames = {"router": "gate"}  # SparseMoE's name for it

    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        super().__init__(config, GptOssModel(config, runtime), runtime)
