"""Prometheus metrics of one server, in its own registry (two apps in one process never clash)."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from heron.engine.messages import EngineStats
from heron.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.5)


class _EngineCollector(Collector):
    """Engine state at scrape time: the newest snapshot the engine core sent."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        gauges = {
            "num_requests_running": ("requests being generated", stats.num_requests_running),
            "num_requests_waiting": (
                "requests waiting to be scheduled",
                stats.num_requests_waiting,
            ),
            "kv_cache_usage_perc": (
                "fraction of KV cache blocks in use (0-1), in the fullest cache group",
                stats.kv_cache_usage,
            ),
            "kv_cache_free_blocks": (
                "KV cache blocks allocatable now, in the cache group with the fewest",
                stats.kv_cache_free_blocks,
            ),
            "kv_cache_total_blocks": (
                "usable KV cache blocks, in the smallest cache group",
                stats.kv_cache_total_blocks,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"heron:{name}", doc, value=value)
        # Per cache group under names of their own, so that summing a family never mixes the
        # groups with the aggregates above.
        groups = stats.groups
        per_group = {
            "kv_cache_group_usage_perc": (
                "fraction of the cache group's blocks in use (0-1)",
                [g.usage for g in groups],
            ),
            "kv_cache_group_free_blocks": (
                "the cache group's blocks allocatable now",
                [g.num_free_blocks for g in groups],
            ),
            "kv_cache_group_total_blocks": (
                "the cache group's usable blocks",
                [g.num_blocks for g in groups],
            ),
        }
        labels = [[str(g.group), g.spec] for g in groups]
        for name, (doc, values) in per_group.items():
            family = GaugeMetricFamily(f"heron:{name}", doc, labels=["group", "spec"])
            for label, value in zip(labels, values):
                family.add_metric(label, value)
            yield family
        counters = {
            "prefix_cache_queries": (
                "prompt tokens looked up in the prefix cache",
                stats.prefix_cache_queries,
            ),
            "prefix_cache_hits": (
                "prompt tokens found in the prefix cache",
                stats.prefix_cache_hits,
            ),
            "num_preemptions": (
                "requests preempted for lack of KV blocks",
                stats.num_preemptions,
            ),
            "spec_decode_num_drafts": (
                "rows of steps that verified proposed tokens",
                stats.spec_decode_num_drafts,
            ),
            "spec_decode_num_draft_tokens": (
                "proposed tokens verified",
                stats.spec_decode_num_draft_tokens,
            ),
            "spec_decode_num_accepted_tokens": (
                "proposed tokens accepted",
                stats.spec_decode_num_accepted_tokens,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"heron:{name}", doc, value=value)
        for name, doc, value, counter in stats.connector:
            family = CounterMetricFamily if counter else GaugeMetricFamily
            yield family(f"heron:{name}", doc, value=value)


class ServerMetrics:
    """Request-level metrics, observed as outputs stream out, plus the engine's state.

    With ``PROMETHEUS_MULTIPROC_DIR`` set (several front processes, see
    :mod:`heron.server.api_servers`) the request metrics live in files there and a scrape
    sums those of every front; the engine gauges are the core's snapshot either way.
    """

    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine_stats))
        self._scraped = self.registry
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            self._scraped = CollectorRegistry()
            MultiProcessCollector(self._scraped)
            self._scraped.register(_EngineCollector(engine_stats))
        reg = self.registry
        self.prompt_tokens = Counter("heron:prompt_tokens", "prompt tokens", registry=reg)
        self.generation_tokens = Counter(
            "heron:generation_tokens", "generated tokens", registry=reg
        )
        self.request_success = Counter(
            "heron:request_success",
            "finished requests by finish reason",
            ["finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            "heron:time_to_first_token_seconds",
            "arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "heron:inter_token_latency_seconds",
            "time between output tokens",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "heron:e2e_request_latency_seconds",
            "arrival to finish",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            "heron:request_queue_time_seconds",
            "arrival to first schedule",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )

    def render(self) -> bytes:
        return generate_latest(self._scraped)

    async def track(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Pass ``outputs`` through, observing token latencies and the finished request."""
        # prompt_len: known from the first output on; rejected: the request was invalid.
        last_time, last_count, prompt_len, finished, rejected = None, 0, None, False, False
        async with aclosing(outputs):
            try:
                async for output in outputs:
                    prompt_len = len(output.prompt_token_ids)
                    now = time.monotonic()
                    count = sum(len(c.token_ids) for c in output.outputs)
                    if count > last_count:
                        if last_time is not None and last_count > 0:
                            # One step may add several tokens (n > 1): spread the gap over them.
                            gap = (now - last_time) / (count - last_count)
                            for _ in range(count - last_count):
                                self.itl.observe(gap)
                        last_time, last_count = now, count
                    if output.finished:
                        finished = True
                        self._observe_finished(output, count)
                    yield output
            except ValueError:
                rejected = True
                raise
            finally:
                if not (finished or rejected):
                    # The consumer left early (client disconnect): the request was aborted,
                    # maybe before its first output, with the tokens seen so far.
                    self.prompt_tokens.inc(prompt_len or 0)
                    self.generation_tokens.inc(last_count)
                    self.request_success.labels(finished_reason="abort").inc()

    def _observe_finished(self, output: RequestOutput, num_generated: int) -> None:
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(num_generated)
        reason = output.outputs[0].finish_reason if output.outputs else "abort"
        self.request_success.labels(finished_reason=reason).inc()
        timings = output.metrics
        arrival = timings.get("arrival_time")
        if arrival is None:
            return
        self.e2e.observe(timings["finished_time"] - arrival)
        if "first_token_time" in timings:
            self.ttft.observe(timings["first_token_time"] - arrival)
        if "first_scheduled_time" in timings:
            self.queue_time.observe(timings["first_scheduled_time"] - arrival)
