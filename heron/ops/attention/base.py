"""The attention operator contract shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.cache.paged import FullAttentionSpec, SlidingWindowSpec
from heron.layers.rotary import QKTransform
from heron.metadata import MetadataBuilder, MetadataOperator, ModelBuildContext, StepMetadataError


@dataclass(frozen=True)
class AttentionSpec:
    """The per-layer configuration of an attention operator."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # a query at position i sees keys j with i - j < window
    logit_softcap: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    has_sinks: bool = False  # a learned per-head logit joins every softmax (gpt-oss)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )


def _attention_cache_spec(
    spec: AttentionSpec, block_size: int, dtype: torch.dtype
) -> FullAttentionSpec:
    """Paged K/V in ``dtype``."""
    if spec.sliding_window is None:
        return FullAttentionSpec(block_size, dtype, spec.num_kv_heads, spec.head_dim)
    return SlidingWindowSpec(
        block_size, dtype, spec.num_kv_heads, spec.head_dim, spec.sliding_window
    )


class AttentionOperator(MetadataOperator):
    """Paged attention over this layer's KV cache, from the fused qkv projection to the output.

    ``forward`` applies the layer's q/k transform (qk-norm, RoPE at the view's positions),
    writes the step's new K/V into the cache at the view's slots (:meth:`prepare_qkv`, which a
    GPU operator fuses into one kernel), then dispatches to ``forward_decode`` (every request
    has one query token) or ``forward_extend``. Models never see positions, cache slots or
    block tables.
    """

    def __init__(
        self,
        layer_name: str,
        spec: AttentionSpec,
        block_size: int,
        max_model_len: int,
        qk_transform: QKTransform | None = None,
        build_context: ModelBuildContext | None = None,
        sinks: torch.Tensor | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(layer_name, build_context)
        if spec.has_sinks != (sinks is not None):
            raise ValueError(f"layer {layer_name!r}: has_sinks={spec.has_sinks} but sinks={sinks}")
        if not self.covers(spec, qk_transform):
            raise ValueError(
                f"layer {layer_name!r}: {type(self).__name__} does not implement this layer's "
                "configuration (soft-cap, sinks or q/k norm); use the reference operator"
            )
        self.spec = spec
        # The model's dtype is the default dtype while the model is built.
        cache_dtype = kv_cache_dtype or torch.get_default_dtype()
        self._cache_spec = _attention_cache_spec(spec, block_size, cache_dtype)
        # An FP8 cache stores K / k_scale and V / v_scale: the checkpoint's (the loader sets
        # them), else 1.0, as E4M3 keeps 3 mantissa bits for any magnitude in [2**-6, 448],
        # the range of these models' keys and values.
        self.k_scale = self.v_scale = 1.0
        self._builder = self.make_builder(spec, block_size, max_model_len)
        self.qk_transform = qk_transform
        # The model's module owns (and loads) the sink logits; the operator only reads them.
        self.sinks = sinks
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, kv_heads, head_dim]

    @property
    def cache_spec(self) -> FullAttentionSpec:
        return self._cache_spec

    def bind_cache(self, cache: torch.Tensor | None) -> None:
        self.kv_cache = cache

    @classmethod
    def covers(cls, spec: AttentionSpec, qk_transform: QKTransform | None) -> bool:
        """Whether this implementation computes a layer of this configuration exactly."""
        return True

    def make_builder(
        self, spec: AttentionSpec, block_size: int, max_model_len: int
    ) -> MetadataBuilder:
        """The builder of the metadata this implementation reads."""
        raise NotImplementedError

    def metadata_builder(self) -> MetadataBuilder:
        return self._builder

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv: [tokens, (heads + 2 * kv_heads) * head_dim] -> [tokens, heads * head_dim]."""
        if self.kv_cache is None:
            raise StepMetadataError(f"layer {self.layer_name!r} has no KV cache bound")
        view = self.view
        q = self.prepare_qkv(qkv, view)
        out = self.forward_decode(q, view) if view.is_decode else self.forward_extend(q, view)
        return out.view(qkv.shape[0], -1)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.spec
        q, k, v = qkv.split(
            [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim],
            dim=-1,
        )
        tokens = qkv.shape[0]
        return (
            q.view(tokens, s.num_heads, s.head_dim),
            k.view(tokens, s.num_kv_heads, s.head_dim),
            v.view(tokens, s.num_kv_heads, s.head_dim),
        )

    def prepare_qkv(self, qkv: torch.Tensor, view) -> torch.Tensor:
        """Transform q and k, write k and v into the cache; return q as [tokens, heads, head_dim]."""
        raise NotImplementedError

    def forward_decode(self, q: torch.Tensor, view) -> torch.Tensor:
        raise NotImplementedError

    def forward_extend(self, q: torch.Tensor, view) -> torch.Tensor:
        raise NotImplementedError
