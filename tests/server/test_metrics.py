"""The engine collector: the aggregate KV cache gauges and one labelled sample per cache group,
from the stats snapshot the engine core sends."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import torch
from prometheus_client.parser import text_string_to_metric_families

from heron.cache import FullAttentionSpec, KVCacheCoordinator, SlidingWindowSpec
from heron.engine.messages import EngineStats
from heron.engine.request import Request
from heron.sampling_params import SamplingParams
from heron.server.metrics import ServerMetrics
from heron.speculative import SpecDecodeStats


def test_every_cache_group_is_reported():
    full = FullAttentionSpec(4, torch.float16, 2, 8)
    sliding = SlidingWindowSpec(4, torch.float16, 2, 8, 8)
    kv = KVCacheCoordinator([full, sliding], [41, 11])
    request = Request("a", list(range(20)), SamplingParams(max_tokens=None))
    assert kv.allocate_slots(request, 20)
    scheduler = SimpleNamespace(running=[request], waiting=[], num_preemptions=0, connector=None)
    # As the core sends it.
    snapshot = msgspec.msgpack.encode(
        EngineStats.of(
            SimpleNamespace(scheduler=scheduler, kv_cache=kv, spec_decode_stats=SpecDecodeStats())
        )
    )
    stats = msgspec.msgpack.decode(snapshot, type=EngineStats)
    text = ServerMetrics(lambda: stats).render().decode()
    samples = {
        (s.name, s.labels.get("group")): (s.value, s.labels.get("spec"))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    # A 20-token prompt takes 5 blocks in each group: 5 of 40 and 5 of 10.
    assert samples["heron:kv_cache_usage_perc", None][0] == 0.5
    assert samples["heron:kv_cache_free_blocks", None][0] == 5
    assert samples["heron:kv_cache_total_blocks", None][0] == 10
    for group, spec, total, free in [("0", full, 40, 35), ("1", sliding, 10, 5)]:
        assert samples["heron:kv_cache_group_total_blocks", group] == (total, spec.describe())
        assert samples["heron:kv_cache_group_free_blocks", group] == (free, spec.describe())
        usage = samples["heron:kv_cache_group_usage_perc", group]
        assert usage == (5 / total, spec.describe())
