"""The attention operator contract shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.metadata import MetadataOperator, ModelBuildContext, StepMetadataError


@dataclass(frozen=True)
class AttentionSpec:
    """The per-layer configuration of an attention operator."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # a query at position i sees keys j with i - j < window

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )


class AttentionOperator(MetadataOperator):
    """Paged attention over this layer's KV cache.

    ``forward`` writes the step's new K/V into the cache at the view's slots, then dispatches
    to ``forward_decode`` (every request has one query token) or ``forward_extend``. Models
    never see cache slots or block tables.
    """

    def __init__(
        self, layer_name: str, spec: AttentionSpec, build_context: ModelBuildContext | None = None
    ) -> None:
        super().__init__(layer_name, build_context)
        self.spec = spec
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, kv_heads, head_dim]

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] -> [tokens, heads, head_dim]."""
        if self.kv_cache is None:
            raise StepMetadataError(f"layer {self.layer_name!r} has no KV cache bound")
        view = self.view
        self.write_kv(k, v, view)
        if view.is_decode:
            return self.forward_decode(q, view)
        return self.forward_extend(q, view)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, view) -> None:
        raise NotImplementedError

    def forward_decode(self, q: torch.Tensor, view) -> torch.Tensor:
        raise NotImplementedError

    def forward_extend(self, q: torch.Tensor, view) -> torch.Tensor:
        raise NotImplementedError
