"""Picks the operator implementation for a (platform, layer configuration), and the kernel set
the model's layers launch."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from heron.kernels import TORCH_KERNELS, LayerKernels
from heron.layers.rotary import QKTransform
from heron.metadata import ModelBuildContext
from heron.ops.attention.base import AttentionOperator, AttentionSpec
from heron.ops.attention.reference import ReferenceAttention
from heron.ops.backends import operator_class
from heron.ops.linear_attention.operator import GatedDeltaNet, GatedDeltaNetSpec
from heron.ops.mla.base import MLAOperator, MLASpec

logger = logging.getLogger(__name__)


def _triton_layer_kernels() -> LayerKernels:
    # Imported on demand, as the Triton attention operator is.
    from heron.kernels import (
        activation,
        fp8_quant,
        gemv,
        lora,
        lora_gemv,
        moe,
        moe_route,
        rmsnorm,
        wna16,
    )
    from heron.layers import fp8

    return LayerKernels(
        "triton",
        rms_norm=rmsnorm.rms_norm,
        gated_rms_norm=rmsnorm.gated_rms_norm,
        gated_activation=activation.gated_activation,
        gemv=gemv.linear_small_m,
        gemv_serves=gemv.serves,
        fused_experts=moe.fused_experts,
        route_topk=moe_route.route_topk,
        router_logits=moe_route.router_logits,
        fp8_mm=partial(fp8.scaled_mm, quantize_rows=fp8_quant.quantize_rows),
        wna16_mm=wna16.wna16_linear,
        wna16_gemv_serves=wna16.gemv_serves,
        lora_shrink=lora.lora_shrink,
        lora_expand=lora.lora_expand,
        lora_gemv=lora_gemv.lora_linear,
        lora_gemv_serves=lora_gemv.serves,
    )


LAYER_KERNELS: dict[str, Callable[[], LayerKernels]] = {
    "torch": lambda: TORCH_KERNELS,
    "triton": _triton_layer_kernels,
}


def layer_kernels(name: str) -> LayerKernels:
    """The kernel set ``name`` (a key of ``LAYER_KERNELS``; platforms name theirs)."""
    if name not in LAYER_KERNELS:
        raise ValueError(f"unknown layer kernel set {name!r}; available: {sorted(LAYER_KERNELS)}")
    return LAYER_KERNELS[name]()


@dataclass(frozen=True)
class OperatorRuntime:
    """Engine-level facts every operator and layer of a model needs at build time."""

    attention_backend: str
    block_size: int
    max_model_len: int
    build_context: ModelBuildContext
    kernels: LayerKernels = TORCH_KERNELS  # what the layers launch (``layer_kernels``)
    kv_cache_dtype: torch.dtype | None = None  # None: the model's dtype


def make_attention(
    layer_name: str,
    spec: AttentionSpec,
    runtime: OperatorRuntime,
    qk_transform: QKTransform | None = None,
    sinks: torch.Tensor | None = None,
) -> AttentionOperator:
    """The attention operator for one layer, registered in the runtime's build scope.

    A layer whose configuration the chosen backend's kernels do not cover (on Triton: a q/k
    norm that is neither Llama's ``w * norm(x)`` nor Gemma's ``(1 + w) * norm(x)``) gets the
    reference operator: its own builder puts it in its own metadata group, so the rest of the
    model keeps the fast path.
    """
    cls = operator_class("attention", runtime.attention_backend)
    if not cls.covers(spec, qk_transform):
        logger.info("layer %s: its configuration runs on the reference operator", layer_name)
        cls = ReferenceAttention
    return cls(
        layer_name,
        spec,
        runtime.block_size,
        runtime.max_model_len,
        qk_transform=qk_transform,
        build_context=runtime.build_context,
        sinks=sinks,
        kv_cache_dtype=runtime.kv_cache_dtype,
    )


def make_gated_delta_net(
    layer_name: str,
    spec: GatedDeltaNetSpec,
    runtime: OperatorRuntime,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> GatedDeltaNet:
    """The gated-delta-rule operator of the runtime's attention backend, registered in its
    build scope (the layer's module owns the weights it reads)."""
    cls = operator_class("gated delta rule", runtime.attention_backend)
    return cls(layer_name, spec, conv_weight, A_log, dt_bias, runtime.build_context)


def make_mla(
    layer_name: str,
    spec: MLASpec,
    runtime: OperatorRuntime,
    rotary: nn.Module,
    kv_b_proj: nn.Module,
    latent_norm: nn.Module,
) -> MLAOperator:
    """The latent attention operator for one layer, of the runtime's attention backend.
    Latent caches are held in the model's dtype only: an FP8 KV cache is refused by name."""
    if runtime.kv_cache_dtype is not None:
        raise ValueError(
            f"kv_cache_dtype='fp8' is not supported for latent attention (MLA, layer "
            f"{layer_name}): its cache stays in the model's dtype; use kv_cache_dtype='auto'"
        )
    return operator_class("latent attention", runtime.attention_backend)(
        layer_name,
        spec,
        runtime.block_size,
        runtime.max_model_len,
        rotary,
        kv_b_proj,
        build_context=runtime.build_context,
        latent_norm=latent_norm,
    )
