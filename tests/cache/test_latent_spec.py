"""The latent (MLA) cache kind: its real size in the budget, its tensor, and a paged group of it
next to a full-attention group, prefix-cached through the real coordinator."""

from __future__ import annotations

import torch

from heron.cache import FullAttentionSpec, KVCacheCoordinator, LatentAttentionSpec
from heron.cache.layout import CacheLayout
from heron.engine.request import Request
from heron.sampling_params import SamplingParams

from kv_invariants import InvariantChecked

DEEPSEEK = LatentAttentionSpec(16, torch.bfloat16, kv_lora_rank=512, rope_dim=64)


class CheckedCoordinator(InvariantChecked, KVCacheCoordinator):
    """Checks every invariant after every public operation."""


class _Owner:
    def __init__(self, name, spec):
        self.layer_name, self.cache_spec, self.cache = name, spec, None

    def bind_cache(self, cache):
        self.cache = cache


def test_entry_is_latent_plus_rope_at_its_real_size():
    # 576 values per token (1152 bytes in bf16), not 2 x heads x head_dim.
    assert DEEPSEEK.bytes_per_block == 16 * 576 * 2
    assert DEEPSEEK.tensor_shape(7) == (7, 16, 576)
    assert DEEPSEEK.blocks_per_seq(100, 32) == 7
    assert DEEPSEEK.first_table_block(40) == 0
    assert "latent 512 + rope 64" in DEEPSEEK.describe()


def test_budget_counts_each_group_by_its_bytes():
    full = FullAttentionSpec(16, torch.bfloat16, num_kv_heads=8, head_dim=128)
    owners = [_Owner("a", DEEPSEEK), _Owner("b", DEEPSEEK), _Owner("c", full)]
    layout = CacheLayout(owners)
    assert layout.specs == [DEEPSEEK, full]
    assert layout.bytes_per_block() == [2 * 16 * 576 * 2, 16 * 2 * 8 * 128 * 2]
    per_seq = DEEPSEEK.blocks_per_seq(1024, 64)  # 64 blocks in both groups
    budget = sum(layout.bytes_per_block()) * (10 * per_seq + 1)
    assert layout.split_budget(budget, 1024, 64) == [10 * per_seq + 1] * 2
    layout.allocate([3, 5], torch.device("cpu"))
    assert owners[0].cache.shape == (3, 16, 576) and owners[1].cache is not owners[0].cache
    assert owners[2].cache.shape == (2, 5, 16, 8, 128)


def test_latent_group_is_paged_and_prefix_cached_with_a_full_group():
    full = FullAttentionSpec(4, torch.float32, num_kv_heads=1, head_dim=8)
    latent = LatentAttentionSpec(4, torch.float32, kv_lora_rank=8, rope_dim=4)
    kv = CheckedCoordinator([latent, full], [12, 12], True)
    params = SamplingParams(max_tokens=None)
    first = Request("a", list(range(10)), params)
    hits, n = kv.get_computed_blocks(first)
    assert n == 0 and kv.allocate_slots(first, 10, hits)
    first.num_computed_tokens = 10
    assert [len(t) for t in kv.block_tables("a")] == [3, 3]
    second = Request("b", list(range(9)) + [99], params)
    hits, n = kv.get_computed_blocks(second)
    assert n == 8  # two full blocks shared in both groups
    assert list(hits) == [kv.block_tables("a")[g][:2] for g in range(2)]
    assert kv.allocate_slots(second, 2, hits)
    kv.free(first)
    kv.free(second)
    assert kv.num_free_blocks == 11
