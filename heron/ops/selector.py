"""Picks the operator implementation for a (platform, layer configuration)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from heron.layers.rotary import QKTransform
from heron.metadata import ModelBuildContext
from heron.ops.attention.base import AttentionOperator, AttentionSpec
from heron.ops.attention.reference import ReferenceAttention

logger = logging.getLogger(__name__)


def _triton_attention() -> type[AttentionOperator]:
    # Imported on demand: Triton is only needed (and only importable) where it runs.
    from heron.ops.attention.triton.operator import TritonAttention

    return TritonAttention


ATTENTION_BACKENDS: dict[str, Callable[[], type[AttentionOperator]]] = {
    "reference": lambda: ReferenceAttention,
    "triton": _triton_attention,
}


@dataclass(frozen=True)
class OperatorRuntime:
    """Engine-level facts every operator of a model needs at build time."""

    attention_backend: str
    block_size: int
    max_model_len: int
    build_context: ModelBuildContext


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
    backend = runtime.attention_backend
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {backend!r}; available: {sorted(ATTENTION_BACKENDS)}"
        )
    cls = ATTENTION_BACKENDS[backend]()
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
    )
