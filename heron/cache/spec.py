"""Cache specs: what cache memory one metadata operator needs, declared by the operator.

A spec is a frozen record; operators with equal specs share one cache group (one pool, one
table per request). Everything that sizes, shapes or budgets cache memory reads specs only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from heron.cache.paged_parts import PagedStepParts

if TYPE_CHECKING:
    from heron.cache.manager import CacheManager
    from heron.metadata.parts import StepParts


def paged_table_width(max_model_len: int, block_size: int, sliding_window: int | None) -> int:
    """Widest table row a decode step reads: every block of the context, or with a window the
    blocks from the window's first key to the newest token."""
    width = -(-max_model_len // block_size)
    if sliding_window is None:
        return width
    return min(width, -(-(sliding_window - 1) // block_size) + 1)


@dataclass(frozen=True)
class CacheSpec:
    """The contract of a cache kind. ``block_size`` is in tokens (1 for per-request slots)."""

    block_size: int
    dtype: torch.dtype

    # Whether the kind's entries are content-addressed by the chain of prefix block hashes
    # (groups that are share one block size); the others key theirs by the chain's hashes.
    joins_prefix_chain = True
    # Whether a request holds a fixed number of entries whatever its length (a state slot).
    per_request = False

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block (or slot) of one operator's cache."""
        raise NotImplementedError

    def blocks_per_seq(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The most blocks one sequence holds at once."""
        raise NotImplementedError

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one operator's cache tensor over a pool of ``num_blocks`` blocks."""
        raise NotImplementedError

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor | tuple:
        """One operator's zeroed cache over a pool of ``num_blocks``."""
        return torch.zeros(self.tensor_shape(num_blocks), dtype=self.dtype, device=device)

    def step_parts(self) -> StepParts:
        """What the kind contributes to each step's packed batch."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def make_manager(
        self, num_blocks: int, enable_prefix_caching: bool, chain_block_size: int
    ) -> CacheManager:
        """The manager of a cache group of this spec over a pool of ``num_blocks``; the prefix
        chain's blocks are ``chain_block_size`` tokens."""
        raise NotImplementedError

    def _element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class PagedSpec(CacheSpec):
    """A kind whose every token keeps its entry in paged blocks for the whole sequence, served
    by the paged manager (prefix caching included); subclasses give the entry's shape."""

    def blocks_per_seq(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return -(-max_model_len // self.block_size)

    def first_table_block(self, context: int | np.ndarray) -> int | np.ndarray:
        """Index, in a request's table, of the first block a step at ``context`` reads."""
        return 0

    def step_parts(self) -> StepParts:
        return PagedStepParts(self)

    def make_manager(
        self, num_blocks: int, enable_prefix_caching: bool, chain_block_size: int
    ) -> CacheManager:
        from heron.cache.paged import PagedCacheManager  # paged.py imports this module

        return PagedCacheManager(self, num_blocks, enable_prefix_caching)


@dataclass(frozen=True)
class FullAttentionSpec(PagedSpec):
    """Paged K and V of every token: ``[2, blocks, block_size, kv_heads, head_dim]``."""

    num_kv_heads: int
    head_dim: int

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self._element_size()

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def describe(self) -> str:
        return (
            f"full attention: {self.block_size}-token blocks, {self.num_kv_heads} KV heads of "
            f"{self.head_dim}, {str(self.dtype).removeprefix('torch.')}"
        )


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Paged K and V of the last ``sliding_window`` tokens; older blocks are released.

    A query at position ``p`` sees keys ``j`` with ``p - sliding_window < j <= p``.
    """

    sliding_window: int

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def blocks_per_seq(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        # A step of n tokens keeps keys from W before its first one (one more than it reads).
        live = -(-(self.sliding_window + max_num_batched_tokens) // self.block_size) + 1
        return min(super().blocks_per_seq(max_model_len, max_num_batched_tokens), live)

    def first_table_block(self, context: int | np.ndarray) -> int | np.ndarray:
        """The block of the first key that a token at position ``context`` sees: the one rule
        by which a windowed row starts at the window (and, at ``context - 1``, the first block
        a step keeps: the key before the first one it reads)."""
        if isinstance(context, int):  # the managers' per-request calls: no numpy dispatch
            return max(context - self.sliding_window + 1, 0) // self.block_size
        return np.maximum(context - self.sliding_window + 1, 0) // self.block_size

    def describe(self) -> str:
        return f"sliding window {self.sliding_window}, " + super().describe()


@dataclass(frozen=True)
class LatentAttentionSpec(PagedSpec):
    """Paged multi-head latent attention (DeepSeek's MLA): per token one entry of the
    compressed KV latent and the shared rotary key, ``[blocks, block_size, kv_lora_rank +
    rope_dim]``. Every query head reads the same entry, so it is one "KV head" wide; blocks are
    paged and prefix-cached as full attention's are."""

    kv_lora_rank: int
    rope_dim: int

    @property
    def entry_size(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.entry_size * self._element_size()

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.entry_size)

    def describe(self) -> str:
        return (
            f"latent attention: {self.block_size}-token blocks, latent {self.kv_lora_rank} + "
            f"rope {self.rope_dim}, {str(self.dtype).removeprefix('torch.')}"
        )
