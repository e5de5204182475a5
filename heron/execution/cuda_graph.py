"""CUDA graphs of the whole decode step (embedding to logits and greedy tokens), one per batch
bucket, and of verification steps (the same with ``1 + k`` tokens per row) where speculative
decoding is on and every metadata group supports uniform steps.

The metadata plan owns the graph buffers: each group's builder makes persistent buffers once
for the largest bucket, and fills them in place before every replay through the same ``fill``
path it uses during capture. Buckets use views of those buffers (taken once, at capture: a
replay runs no operator code), so capturing many buckets costs no extra metadata memory. The
eager metadata build is skipped on replayed steps.

Each graph ends with the greedy argmax of its logits (``greedy_argmax``), so an all-greedy
decode step launches nothing after the replay (sampling after it costs host time per step,
mostly the argmax's two launches). A step that samples otherwise ignores those tokens; their GPU
time is a small fraction of such a step.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from heron.metadata import GraphSupport, MetadataGroup, SequenceMetadata, StepBatch, StepMetaPlan
from heron.metadata.parts import StepParts

logger = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_batch`` (which is always included)."""
    buckets = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 1, 8))
    if not buckets or buckets[-1] != max_batch:
        buckets.append(max_batch)
    return buckets


class CudaGraphRunner:
    """Captures and replays uniform steps of ``model``: decode steps in batch buckets up to
    ``max_batch``, and, for each query length ``q`` of ``verify_batches`` (``1 + k``: the
    verification of ``k`` proposals per row, for plans whose every group supports
    ``UNIFORM``), buckets up to ``verify_batches[q]`` (each graph keeps its logits, ``q`` rows
    per request: large verification batches would hold much memory)."""

    def __init__(
        self,
        model: nn.Module,
        plan: StepMetaPlan,
        device: torch.device,
        max_batch: int,
        verify_batches: dict[int, int] | None = None,
    ) -> None:
        if plan.graph_support < GraphSupport.DECODE_ONLY:
            raise ValueError("the metadata plan does not support graphs")
        if verify_batches and plan.graph_support < GraphSupport.UNIFORM:
            raise ValueError("the metadata plan does not support graphs of uniform steps")
        self.model = model
        self.plan = plan
        self.device = device
        # query length -> its batch buckets
        self.buckets_of = {1: graph_buckets(max_batch)} | {
            q: graph_buckets(min(b, max_batch)) for q, b in (verify_batches or {}).items()
        }
        self.query_lens = sorted(self.buckets_of)
        self.buckets = self.buckets_of[1]
        self.max_batch = self.buckets[-1]
        # (batch, query length) -> (graph, its hidden states, logits and greedy tokens): its
        # output buffers.
        self.graphs: dict[
            tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]
        ] = {}
        self._make_buffers()

    def _make_buffers(self) -> None:
        """The input token ids and each metadata group's graph buffers, for the largest step."""
        max_q = self.query_lens[-1]
        self.token_ids = torch.zeros(self.max_batch * max_q, dtype=torch.int32, device=self.device)
        extra = (max_q,) if max_q > 1 else ()  # only UNIFORM builders take a query length
        self.buffers: dict[int, Any] = {
            id(g): g.builder.make_graph_buffers(self.max_batch, self.device, *extra)
            for g in self.plan.groups
        }

    def release(self) -> None:
        """Drop the graphs and every buffer they read (sleep mode): their device memory
        returns to the allocator, and :meth:`rebuild` makes and captures them again."""
        self.graphs.clear()
        self.buffers.clear()
        self.token_ids = None
        for group in self.plan.groups:  # (a captured view reads the released buffers)
            group.view = None

    def rebuild(self, block_size: int, group_parts: Sequence[StepParts]) -> None:
        """New buffers, every graph captured again over the live weights and caches."""
        self._make_buffers()
        self.capture(block_size, group_parts)

    def _fill(self, seq: SequenceMetadata, batch: int) -> None:
        for group in self.plan.groups:
            group.builder.fill(seq, self.buffers[id(group)], batch)

    @torch.inference_mode()
    def capture(self, block_size: int, group_parts: Sequence[StepParts]) -> None:
        """Capture every bucket, longest steps and largest batches first, in one memory pool."""
        from heron.kernels.argmax import greedy_argmax  # Triton only on GPU paths

        pool = torch.cuda.graph_pool_handle()
        for q in reversed(self.query_lens):
            for batch in reversed(self.buckets_of[q]):
                dummy = _dummy_step(batch, q, block_size, self.device, group_parts)
                self._fill(dummy, batch)
                group: MetadataGroup
                for group in self.plan.groups:
                    group.view = group.builder.graph_view(dummy, self.buffers[id(group)], batch)
                tokens = self.token_ids[: batch * q]
                greedy_argmax(self.model.compute_logits(self.model(tokens)))  # warm-up
                for group in self.plan.groups:
                    group.builder.before_capture(self.buffers[id(group)])
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self.model(tokens)
                    logits = self.model.compute_logits(hidden)
                    greedy = greedy_argmax(logits)
                self.graphs[batch, q] = (graph, hidden, logits, greedy)
        torch.cuda.synchronize(self.device)
        for q, buckets in self.buckets_of.items():
            logger.info("captured CUDA graphs of %d tokens per row for batches %s", q, buckets)

    def can_run(self, seq: SequenceMetadata) -> bool:
        """Every row has the same captured query length, and the batch fits."""
        q = seq.max_query_len
        buckets = self.buckets_of.get(q)
        return (
            buckets is not None
            and seq.num_reqs <= buckets[-1]
            and seq.num_tokens == seq.num_reqs * q
        )

    def run(self, seq: SequenceMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replay the step of ``seq`` (every request with the same query length); its hidden
        states and logits rows (every token's) and each row's greedy token. All are views of
        the graph's buffers, which the next replay overwrites: read them (on the stream)
        before it."""
        n, q = seq.num_reqs, seq.max_query_len
        buckets = self.buckets_of[q]
        batch = buckets[bisect.bisect_left(buckets, n)]
        self.token_ids[: n * q].copy_(seq.token_ids)
        self._fill(seq, batch)
        graph, hidden, logits, greedy = self.graphs[batch, q]
        graph.replay()
        return hidden[: n * q], logits[: n * q], greedy[: n * q]


def _dummy_step(
    batch: int, q: int, block_size: int, device: torch.device, group_parts: Sequence[StepParts]
) -> SequenceMetadata:
    """A step of ``batch`` requests of ``q`` new tokens each, all on every group's null entry,
    for capture; with ``q > 1`` every row verifies ``q - 1`` proposals, as the steps the graph
    will replay."""
    num_tokens = batch * q
    width = -(-q // block_size)
    layouts = [parts.layout_of(batch, num_tokens, width) for parts in group_parts]
    step = StepBatch(batch, num_tokens, num_tokens, block_size, layouts)
    step.query_lens[:] = q
    step.kv_lens[:] = q
    step.positions[:] = list(range(q)) * batch
    step.logits_indices[:] = range(num_tokens)
    step.finish()
    seq = SequenceMetadata.from_step_batch(step, device)
    return replace(seq, num_proposed_host=np.full(batch, q - 1)) if q > 1 else seq
