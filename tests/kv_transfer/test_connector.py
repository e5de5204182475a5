"""The connector seam: configuration checked by field name, the host pool's LRU index and
the offload scheduler's bookkeeping, and the layer step counter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from heron.cache.block_pool import ROOT_HASH, hash_block_tokens
from heron.cache.layout import CacheLayout
from heron.cache.paged import FullAttentionSpec
from heron.cache.recurrent import RecurrentStateSpec
from heron.config import EngineConfig, KVTransferConfig
from heron.kv_transfer import LayerSteps, TransferResults, make_connector
from heron.kv_transfer.offload import HostBlockIndex, OffloadScheduler

SPEC = FullAttentionSpec(4, torch.float32, 1, 8)  # 256 bytes a block
STATE = RecurrentStateSpec(1, torch.float32, 4, 3, 1, 2, 4)  # 64 bytes an entry (32 + 32)


@pytest.mark.parametrize(
    "options, error",
    [
        ({"kv_role": "kv_both"}, "'kv_connector' is required"),
        ({"kv_connector": "offload", "kv_size": 1}, "unknown field.*'kv_size'"),
        ({"kv_connector": "lmcache"}, "kv_connector must be one of offload, nixl, got 'lmcache'"),
        ({"kv_connector": "offload", "kv_role": "sender"}, "kv_role must be one of"),
        (
            {"kv_connector": "offload", "kv_connector_extra_config": [1]},
            "kv_connector_extra_config must be a dictionary",
        ),
        ("offload", "kv_transfer_config must be a dictionary"),
    ],
)
def test_kv_transfer_config_names_the_bad_field(options, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig(kv_transfer_config=options)


@pytest.mark.parametrize(
    "options, error",
    [
        (dict(kv_offload_bytes=1, kv_transfer_config={"kv_connector": "offload"}), "give one"),
        (dict(kv_offload_bytes="8G"), "kv_offload_bytes must be an integer"),
        (dict(kv_offload_bytes=1 << 20, tensor_parallel_size=2), "tensor_parallel_size"),
        (dict(kv_offload_bytes=1 << 20, enable_prefix_caching=False), "enable_prefix_caching"),
        (dict(kv_offload_bytes=1 << 20, enable_lora=True), "enable_lora"),
        (dict(kv_offload_bytes=1 << 20, enable_sleep_mode=True), "enable_sleep_mode"),
        (
            dict(
                kv_offload_bytes=1 << 20,
                speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            ),
            "speculative_config",
        ),
    ],
)
def test_connector_options_that_cannot_combine_are_refused(options, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig(**options)


def _layout(num_layers: int = 2, specs=(SPEC,)) -> CacheLayout:
    return CacheLayout(
        [
            SimpleNamespace(layer_name=f"l{i}", cache_spec=specs[i % len(specs)])
            for i in range(num_layers)
        ]
    )


def test_the_offload_connector_gives_state_checkpoints_their_device_share():
    """A recurrent group of 5 entries (320 bytes) beside 9 blocks (2304 bytes) on the device:
    of 4 x 2624 host bytes, its checkpoints get 1280 (20 of 64), the blocks the rest."""
    config = KVTransferConfig("offload", "kv_both", {"num_bytes": 4 * 2624})
    scheduler, worker = make_connector(config, _layout(2, (STATE, SPEC)), 4, [5, 9])
    assert scheduler.checkpoints == (0, 20, 64) and worker.num_state_slots == 20
    assert scheduler.index.num_slots == worker.num_slots == (4 * 2624 - 1280) // 256
    assert scheduler.paged_groups == [1] and "20 state checkpoints" in scheduler.describe()
    small = KVTransferConfig("offload", "kv_both", {"num_bytes": 100})
    with pytest.raises(ValueError, match="100 bytes hold no state checkpoint"):
        make_connector(small, _layout(2, (STATE, SPEC)), 4, [5, 9])
    other = RecurrentStateSpec(1, torch.float32, 4, 3, 2, 2, 4)
    with pytest.raises(ValueError, match="one recurrent cache group; cache group 2"):
        make_connector(config, _layout(3, (STATE, SPEC, other)), 4, [5, 9, 5])


@pytest.mark.parametrize(
    "extra, role, error",
    [
        ({}, "kv_both", "'num_bytes' is required"),
        ({"num_bytes": 0}, "kv_both", "num_bytes must be an integer >= 1"),
        ({"num_bytes": 1 << 20, "cpu": 1}, "kv_both", "unknown kv_connector_extra_config.*'cpu'"),
        ({"num_bytes": 511}, "kv_both", "511 bytes hold no block; .* takes 512 bytes"),
        ({"num_bytes": 1 << 20}, "kv_producer", "kv_role 'kv_both'"),
        (
            {"num_bytes": 1 << 20, "load_timeout_s": 0},
            "kv_both",
            "load_timeout_s must be a number > 0, got 0",
        ),
    ],
)
def test_the_offload_connector_checks_its_options(extra, role, error):
    config = KVTransferConfig("offload", role, extra)
    with pytest.raises(ValueError, match=error):
        make_connector(config, _layout(), 4, [16])


@pytest.mark.parametrize(
    "extra, role, error",
    [
        ({}, "kv_both", "kv_role is 'prefill' or 'decode', got 'kv_both'"),
        ({"hold_timeout_s": 0}, "prefill", "hold_timeout_s must be a number > 0, got 0"),
        ({"transfer_timeout_s": "5"}, "decode", "transfer_timeout_s must be a number > 0"),
        ({"timeout_s": 5}, "decode", "unknown kv_connector_extra_config.*'timeout_s'"),
        (
            {"on_read_failure": "retry"},
            "decode",
            "on_read_failure must be one of 'recompute', 'abort', got 'retry'",
        ),
    ],
)
def test_the_nixl_connector_checks_its_options(extra, role, error):
    config = KVTransferConfig("nixl", role, extra)
    with pytest.raises(ValueError, match=error):
        make_connector(config, _layout(), 4, [16])


def test_the_host_index_evicts_the_least_recently_used():
    index = HostBlockIndex(2)
    a, b = index.add(10), index.add(11)
    assert index.use(10) == a  # 11 is now the oldest
    assert index.add(12) == b and 11 not in index and index.num_evicted == 1
    index.discard(10)
    assert index.add(13) == a and len(index) == 2
    index.check_invariants()


class Seq(SimpleNamespace):
    """What the connector reads of a request."""

    wants_prompt_logprobs = False
    prefix_root = ROOT_HASH


def test_the_offload_scheduler_loads_saved_blocks_and_forgets_failed_ones():
    connector = OffloadScheduler(num_slots=4, block_size=4, bytes_per_slot=512)
    writer = Seq(request_id="w", all_token_ids=list(range(13)))
    hashes = [1, 2, 3]  # stand-ins: the connector keys what the coordinator hashed
    connector.scheduled(writer, [[5, 6, 7, 8]], hashes, 13)
    meta = connector.take_step_meta()
    assert meta.save_slots == [0, 1, 2] and meta.save_blocks == [[5], [6], [7]]
    assert connector.take_step_meta() is None  # reset
    # A reader finds nothing under those stand-in hashes: lookups hash the tokens.
    reader = Seq(request_id="r", all_token_ids=list(range(13)))
    assert connector.lookup(reader, 0).num_tokens == 0
    connector.check_invariants()


def test_the_offload_scheduler_round_trip_and_in_flight_waits():
    connector = OffloadScheduler(num_slots=4, block_size=4, bytes_per_slot=512)
    tokens = list(range(13))
    chain, parent = [], ROOT_HASH
    for i in range(3):
        parent = hash_block_tokens(parent, tokens[4 * i : 4 * i + 4])
        chain.append(parent)
    connector.scheduled(Seq(request_id="w", all_token_ids=tokens), [[5, 6, 7, 8]], chain, 13)
    connector.take_step_meta()
    reader = Seq(request_id="r", all_token_ids=tokens)
    assert connector.lookup(reader, 4).num_tokens == 8  # past one block on the device
    connector.load(reader, [[9, 10, 11]], 4, 8)
    meta = connector.take_step_meta()
    assert meta.load_requests == ["r"] and meta.load_blocks == [[10], [11]]
    # Another request whose device hit reaches a block being loaded waits for it.
    assert connector.lookup(Seq(request_id="t", all_token_ids=tokens), 12).wait
    connector.check_invariants()
    connector.finished(TransferResults(failed_loads=["r"]))
    assert connector.lookup(reader, 4).num_tokens == 0  # the failed entries are dropped
    assert connector.failed_loads == 1
    connector.check_invariants()


def test_layer_steps_count_in_order_and_time_out():
    steps = LayerSteps(3, torch.device("cpu"))
    seen = []
    for _ in range(2):
        for _ in range(3):
            steps.record()
            seen.append(steps.count)
    assert seen == [1, 2, 3, 4, 5, 6]
    assert steps.wait_for(6, timeout_s=0.0)
    assert not steps.wait_for(7, timeout_s=0.01)
