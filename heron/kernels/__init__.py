"""Triton kernels and their launch helpers (PDL), one module per kernel family.

Each kernel module imports Triton; this package does not, so that the kernel choice below can be
named on machines without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerKernels:
    """The kernels a model's layers launch, chosen once when the model is built
    (``heron.ops.selector.layer_kernels``), never by the input's device at call time. A layer
    whose entry is None runs its PyTorch code."""

    name: str
    rms_norm: Callable[..., Any] | None = None  # heron.kernels.rmsnorm.rms_norm
    gated_rms_norm: Callable[..., Any] | None = None  # rmsnorm.gated_rms_norm
    gated_activation: Callable[..., Any] | None = None  # activation.gated_activation
    gemv: Callable[..., Any] | None = None  # gemv.linear_small_m
    gemv_serves: Callable[..., bool] | None = None  # gemv.serves
    fused_experts: Callable[..., Any] | None = None  # moe.fused_experts
    route_topk: Callable[..., Any] | None = None  # moe_route.route_topk (a Routing's rule)
    router_logits: Callable[..., Any] | None = None  # moe_route.router_logits (fp32 routers)
    fp8_mm: Callable[..., Any] | None = None  # heron.layers.fp8.scaled_mm (FP8 weights, many rows)
    wna16_mm: Callable[..., Any] | None = None  # wna16.wna16_linear (packed integer weights)
    wna16_gemv_serves: Callable[[int], bool] | None = None  # wna16.gemv_serves (rows it fuses)
    lora_shrink: Callable[..., Any] | None = None  # lora.lora_shrink (LoRA layers)
    lora_expand: Callable[..., Any] | None = None  # lora.lora_expand
    lora_gemv: Callable[..., Any] | None = None  # lora_gemv.lora_linear (a few rows, one launch)
    lora_gemv_serves: Callable[..., bool] | None = None  # lora_gemv.serves


#: Plain PyTorch everywhere: the CPU's choice and every layer's default.
TORCH_KERNELS = LayerKernels("torch")
