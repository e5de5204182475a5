"""The recurrent-state cache kind: slots, its share of the budget, no leaks beside paged groups."""

from __future__ import annotations

import pytest
import torch

from heron.cache import FullAttentionSpec, KVCacheCoordinator
from heron.cache.layout import CacheLayout
from heron.cache.recurrent import NULL_SLOT, RecurrentStateSpec
from heron.engine.request import Request
from heron.sampling_params import SamplingParams

from kv_invariants import InvariantChecked

SPEC = RecurrentStateSpec(
    1, torch.float16, conv_dim=12, conv_kernel=4, num_heads=2, key_dim=4, value_dim=3
)
FULL = FullAttentionSpec(4, torch.float16, 1, 8)


class CheckedCoordinator(InvariantChecked, KVCacheCoordinator):
    pass


def make_request(request_id: str, tokens) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=None))


def test_spec_sizes_and_tensors():
    conv_bytes, state_bytes = 12 * 3 * 2, 2 * 4 * 3 * 4  # fp16 conv, fp32 state
    assert SPEC.bytes_per_block == conv_bytes + state_bytes
    assert SPEC.blocks_per_seq(4096, 512) == 1
    conv, state = SPEC.allocate(5, torch.device("cpu"))
    assert conv.shape == (5, 12, 3) and conv.dtype == torch.float16
    assert state.shape == (5, 2, 4, 3) and state.dtype == torch.float32
    assert not conv.any() and not state.any()
    assert "recurrent state" in SPEC.describe()


class _Owner:
    def __init__(self, name, spec):
        self.layer_name, self.cache_spec, self.cache = name, spec, None

    def bind_cache(self, cache):
        self.cache = cache


def test_budget_counts_slots_beside_blocks():
    """Every group fits the same number of max-length sequences: as many slots as sequences."""
    owners = [_Owner("a", FULL), _Owner("g0", SPEC), _Owner("g1", SPEC)]
    layout = CacheLayout(owners)
    assert layout.num_groups == 2 and layout.group_layers(1) == ["g0", "g1"]
    max_len, per_block = 64, layout.bytes_per_block()
    seq_bytes = 16 * per_block[0] + per_block[1]
    budget = sum(per_block) + 10 * seq_bytes
    assert layout.split_budget(budget, max_len, 64) == [16 * 10 + 1, 10 + 1]
    assert layout.split_budget(budget, max_len, 64, max_num_seqs=3) == [3 * 16 + 1, 4]
    layout.allocate([9, 4], torch.device("cpu"))
    assert owners[1].cache[1].shape == (4, 2, 4, 3)
    with pytest.raises(ValueError, match="recurrent state"):
        layout.check_fits([17, 1], max_len, 64)


def test_slots_follow_the_running_requests_not_the_longest_sequence():
    """With ``max_running``, the recurrent group gets a slot per running request and the full
    group the rest of the budget, when that still holds one max-length sequence."""
    layout = CacheLayout([_Owner("a", FULL), _Owner("g", SPEC)])
    (full, slot) = layout.bytes_per_block()
    budget = full + 8 * 16 * full + 33 * slot  # 8 max-length sequences of 64 tokens and 33 slots
    assert layout.split_budget(budget, 64, 64)[1] < 16  # as many slots as long sequences fit
    assert layout.split_budget(budget, 64, 64, max_running=32) == [8 * 16 + 1, 33]
    tight = full + 16 * full + 10 * slot  # 32 slots would leave no max-length sequence
    assert layout.split_budget(tight, 64, 64, max_running=32) == layout.split_budget(tight, 64, 64)
    # With prefix caching, a checkpoint's worth of entries beside each slot.
    budget += 32 * slot
    assert layout.split_budget(budget, 64, 64, max_running=32, state_checkpoints=True) == [
        8 * 16 + 1,
        65,
    ]


def test_one_slot_per_request_never_the_null_one():
    kv = CheckedCoordinator([FULL, SPEC], [20, 3], enable_prefix_caching=False)
    a, b, c = (make_request(i, range(6)) for i in "abc")
    assert kv.allocate_slots(a, 6) and kv.allocate_slots(b, 3)
    slots = {kv.block_tables(r.request_id)[1][0] for r in (a, b)}
    assert slots == {1, 2} and NULL_SLOT not in slots
    b.num_computed_tokens = 3
    assert kv.allocate_slots(b, 3)  # later steps keep the slot
    assert kv.block_tables("b")[1] == [kv.block_table("b", 1)[0]] and kv.num_free_blocks == 0
    before = [g.num_free_blocks for g in kv.groups]
    assert not kv.allocate_slots(c, 2)  # no slot left: nothing changes in any group
    assert [g.num_free_blocks for g in kv.groups] == before
    kv.free(a)
    assert kv.allocate_slots(c, 2) and kv.block_tables("c")[1] != [NULL_SLOT]


def test_block_size_is_shared_only_within_the_prefix_chain():
    kv = KVCacheCoordinator([FULL, SPEC], [10, 3], enable_prefix_caching=False)
    assert kv.block_size == FULL.block_size
    with pytest.raises(ValueError, match="one block size"):
        KVCacheCoordinator([FULL, FullAttentionSpec(8, torch.float16, 1, 8), SPEC], [9, 9, 3])
