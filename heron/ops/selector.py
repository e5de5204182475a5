"""Picks the operator implementation for a (platform, layer configuration)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from heron.layers.rotary import QKTransform
from heron.metadata import ModelBuildContext
from heron.ops.attention.base import AttentionOperator, AttentionSpec
from heron.ops.attention.reference import ReferenceAttention


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
) -> AttentionOperator:
    """The attention operator for one layer, registered in the runtime's build scope."""
    try:
        cls = ATTENTION_BACKENDS[runtime.attention_backend]()
    except KeyError:
        raise ValueError(
            f"unknown attention backend {runtime.attention_backend!r}; "
            f"available: {sorted(ATTENTION_BACKENDS)}"
        ) from None
    return cls(
        layer_name,
        spec,
        runtime.block_size,
        runtime.max_model_len,
        qk_transform,
        runtime.build_context,
    )
