"""Cache memory: specs (what each operator needs), the groups' managers and their coordinator."""

from heron.cache.block_pool import NULL_BLOCK_ID, BlockPool, hash_block_tokens
from heron.cache.coordinator import GroupUsage, KVCacheCoordinator
from heron.cache.manager import AllocationHeadroom, AllocationPlan, CacheManager
from heron.cache.paged import (
    FullAttentionSpec,
    LatentAttentionSpec,
    PagedCacheManager,
    PagedPlan,
    SlidingWindowSpec,
)
from heron.cache.recurrent import RecurrentStateManager, RecurrentStateSpec
from heron.cache.spec import CacheSpec

__all__ = [
    "NULL_BLOCK_ID",
    "AllocationHeadroom",
    "AllocationPlan",
    "BlockPool",
    "CacheManager",
    "CacheSpec",
    "FullAttentionSpec",
    "GroupUsage",
    "KVCacheCoordinator",
    "LatentAttentionSpec",
    "PagedCacheManager",
    "PagedPlan",
    "RecurrentStateManager",
    "RecurrentStateSpec",
    "SlidingWindowSpec",
    "hash_block_tokens",
]
