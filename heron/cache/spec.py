"""The abstract cache spec: what cache memory one metadata operator needs, declared by the
operator. Each cache kind (paged: full, window, latent; recurrent state) keeps its concrete
specs beside its manager in a module of its own.

A spec is a frozen record; operators with equal specs share one cache group (one pool, one
table per request). Everything that sizes, shapes or budgets cache memory reads specs only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from heron.cache.manager import CacheManager
    from heron.metadata.parts import StepParts


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
        self,
        num_blocks: int,
        enable_prefix_caching: bool,
        chain_block_size: int,
        decode_checkpoint_interval: int,
    ) -> CacheManager:
        """The manager of a cache group of this spec over a pool of ``num_blocks``; the prefix
        chain's blocks are ``chain_block_size`` tokens; a kind that checkpoints states keeps
        those of generated tokens as ``decode_checkpoint_interval`` says (the coordinator's)."""
        raise NotImplementedError

    def _element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()
