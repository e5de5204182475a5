"""Each operator kind's implementations, by ``attention_backend`` name, imported when chosen.

The names are known without importing an operator, so :class:`heron.config.EngineConfig`
checks them up front, and a process that only builds an ``EngineConfig`` (a server front)
imports no model code.
"""

from __future__ import annotations

from collections.abc import Callable


def _reference_attention() -> type:
    from heron.ops.attention.reference import ReferenceAttention

    return ReferenceAttention


def _triton_attention() -> type:
    # Triton is only needed (and only importable) where it runs.
    from heron.ops.attention.triton.operator import TritonAttention

    return TritonAttention


ATTENTION_BACKENDS: dict[str, Callable[[], type]] = {
    "reference": _reference_attention,
    "triton": _triton_attention,
}


def _reference_gated_delta_net() -> type:
    from heron.ops.linear_attention.operator import GatedDeltaNet

    return GatedDeltaNet


def _triton_gated_delta_net() -> type:
    from heron.ops.linear_attention.triton_operator import TritonGatedDeltaNet

    return TritonGatedDeltaNet


#: The gated-delta-rule operator of each attention backend.
GATED_DELTA_NET_BACKENDS: dict[str, Callable[[], type]] = {
    "reference": _reference_gated_delta_net,
    "triton": _triton_gated_delta_net,
}


def _reference_mla() -> type:
    from heron.ops.mla.reference import ReferenceMLA

    return ReferenceMLA


def _triton_mla() -> type:
    from heron.ops.mla.triton import TritonMLA

    return TritonMLA


# Latent attention follows the attention backend's name: one switch picks both families.
MLA_BACKENDS: dict[str, Callable[[], type]] = {
    "reference": _reference_mla,
    "triton": _triton_mla,
}


# Each operator kind's implementations, by backend name: one ``attention_backend`` picks all.
OPERATOR_BACKENDS: dict[str, dict[str, Callable[[], type]]] = {
    "attention": ATTENTION_BACKENDS,
    "gated delta rule": GATED_DELTA_NET_BACKENDS,
    "latent attention": MLA_BACKENDS,
}


def check_backend(name: str) -> None:
    """Raises ``ValueError`` unless every operator kind has a backend ``name``."""
    for kind, backends in OPERATOR_BACKENDS.items():
        if name not in backends:
            raise ValueError(
                f"attention_backend {name!r} has no {kind} operator; available: "
                f"{', '.join(sorted(backends))}"
            )


def operator_class(kind: str, name: str) -> type:
    """The ``kind`` operator of backend ``name``."""
    check_backend(name)
    return OPERATOR_BACKENDS[kind][name]()
