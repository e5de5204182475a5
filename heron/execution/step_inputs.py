"""Host-side step inputs: scheduler output to StepBatch, SequenceMetadata and group views."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from heron.engine.request import Request
from heron.engine.scheduler import SchedulerOutput
from heron.metadata import SequenceMetadata, StepBatch
from heron.ops.attention.paged import window_start_block


@dataclass(frozen=True)
class PreparedStep:
    """A step ready for the forward pass: shared metadata plus how to read its logits."""

    seq: SequenceMetadata
    sample_requests: list[Request]
    sample_rows: slice  # rows of the step's logits that are sampled
    prompt_rows: list[tuple[Request, int, int, int]]  # request, first row, first position, count
    # Tokens still being sampled by the previous step: (token offset, that step's sample row).
    pending_sources: list[tuple[int, int]]


class StepInputBuilder:
    """Turns a scheduler decision into the step's shared metadata (one packed copy).

    The groups' views are built afterwards by the runner: eagerly through the plan, or by the
    builders' ``fill`` into graph buffers when the step is replayed.
    """

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.windows = list(windows)  # each KV cache group's sliding window (None: full)
        self.num_groups = len(self.windows)
        # Without windows every row starts at 0: one shared list instead of a call per request.
        self._zero_starts = [0] * self.num_groups if all(w is None for w in windows) else None
        # Block tables only grow at their end while a request holds them (a sliding window's
        # also has the entries before its window set to the null block, which are never
        # copied), so each long one is mirrored in a numpy array that takes only the new
        # entries each step (converting a long Python list every step costs more than the rest
        # of a request's preparation).
        self._mirrors: dict[tuple[Request, int], _TableMirror] = {}
        # On a GPU the packed batch is staged in one pinned buffer reused every step; an event
        # recorded after each copy guards the buffer until that copy has completed.
        self._staging = torch.empty(0, dtype=torch.int32)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def _staging_buffer(self, size: int) -> torch.Tensor | None:
        if self._copied is None:
            return None
        self._copied.synchronize()
        if self._staging.numel() < size:
            self._staging = torch.empty(
                max(size, 2 * self._staging.numel()), dtype=torch.int32, pin_memory=True
            )
        return self._staging

    def prepare(
        self,
        output: SchedulerOutput,
        block_tables: Callable[[str], Sequence[list[int]]],
        pending_rows: Mapping[Request, int] | None = None,
    ) -> PreparedStep:
        """Host work of a step: the packed StepBatch and its one copy to the device.

        ``block_tables(request_id)`` gives the request's table in every KV cache group; a
        sliding-window group's table has the null block where blocks slid out of the window,
        and its row in the step starts at the window (``window_start_block``).
        A decode token that is still pending (sampled by the previous step, value not yet read)
        is left as 0 and listed in ``pending_sources`` with its row in ``pending_rows``, for the
        runner to fill on the device.
        """
        items = output.scheduled
        bs = self.block_size
        num_groups = self.num_groups
        group_tables = [block_tables(item.request.request_id) for item in items]
        if any(len(tables) != num_groups for tables in group_tables):
            raise ValueError(f"expected a block table for each of {num_groups} cache groups")
        sample_requests: list[Request] = []
        prompt_spans: list[tuple[Request, int, int, int]] = []  # request, token offset, pos, count
        num_tokens = 0
        for item in items:
            r, c = item.request, item.request.num_computed_tokens
            if r.wants_prompt_logprobs:
                # A preempted request recomputes its prompt; positions that already have their
                # logprob are not computed twice.
                first = max(c, len(r.prompt_logprobs) - 1)
                count = min(c + item.num_new_tokens, r.num_prompt_tokens - 1) - first
                if count > 0:
                    prompt_spans.append((r, num_tokens + first - c, first, count))
            if item.samples:
                sample_requests.append(r)
            num_tokens += item.num_new_tokens
        num_prompt_rows = sum(span[3] for span in prompt_spans)
        num_reqs = len(items)
        width = max((len(t) for tables in group_tables for t in tables), default=0)
        num_logits = num_prompt_rows + len(sample_requests)
        size = StepBatch.packed_size(num_reqs, num_tokens, num_logits, width, num_groups)
        batch = StepBatch(
            num_reqs,
            num_tokens,
            num_logits,
            width,
            bs,
            staging=self._staging_buffer(size),
            num_groups=num_groups,
        )
        offset = 0
        rows = num_prompt_rows
        pending_sources: list[tuple[int, int]] = []
        all_tables, all_slots = batch.group_block_tables, batch.group_slot_mappings
        mirrors, self._mirrors = self._mirrors, {}
        zero_starts = self._zero_starts
        for i, (item, tables) in enumerate(zip(items, group_tables)):
            r, c, n = item.request, item.request.num_computed_tokens, item.num_new_tokens
            batch.query_lens[i] = n
            batch.kv_lens[i] = c + n
            firsts = zero_starts or self._row_starts(c)
            for g, (table, first) in enumerate(zip(tables, firsts)):
                # A sliding window's row starts at the first block this step can read (the
                # manager released the blocks before it).
                if len(table) > _MIRROR_MIN_BLOCKS:
                    mirror = mirrors.get((r, g))
                    if mirror is None or mirror.source is not table or len(table) < mirror.length:
                        mirror = _TableMirror(table)
                    self._mirrors[r, g] = mirror
                    all_tables[g, i, : len(table) - first] = mirror.sync()[first:]
                else:
                    all_tables[g, i, : len(table) - first] = table[first:]
            if n == 1:  # decode: scalar writes are cheaper than array ops
                if c < len(r.all_token_ids):
                    batch.token_ids[offset] = r.all_token_ids[c]
                else:
                    pending_sources.append((offset, pending_rows[r]))
                batch.positions[offset] = c
                for g, table in enumerate(tables):
                    all_slots[g, offset] = table[c // bs] * bs + c % bs
            else:
                positions = np.arange(c, c + n, dtype=np.int32)
                batch.token_ids[offset : offset + n] = r.all_token_ids[c : c + n]
                batch.positions[offset : offset + n] = positions
                for g, first in enumerate(firsts):
                    all_slots[g, offset : offset + n] = (
                        all_tables[g, i, positions // bs - first] * bs + positions % bs
                    )
            offset += n
            if item.samples:
                batch.logits_indices[rows] = offset - 1
                rows += 1
        row = 0
        prompt_rows = []
        for r, token_offset, position, count in prompt_spans:
            batch.logits_indices[row : row + count] = np.arange(
                token_offset, token_offset + count, dtype=np.int32
            )
            prompt_rows.append((r, row, position, count))
            row += count
        batch.finish()

        seq = SequenceMetadata.from_step_batch(batch, self.device)
        if self._copied is not None:
            self._copied.record()
        return PreparedStep(
            seq, sample_requests, slice(num_prompt_rows, rows), prompt_rows, pending_sources
        )

    def _row_starts(self, context: int) -> list[int]:
        """Each group's first table index in a request's row, for a step whose first new token
        is at position ``context`` (0 for full attention; see ``window_start_block``)."""
        return [window_start_block(context, w, self.block_size) for w in self.windows]


# Shorter tables are converted directly: below this, the mirror's bookkeeping costs more.
_MIRROR_MIN_BLOCKS = 32


class _TableMirror:
    """A numpy copy of a growing block table (a live Python list that is appended to; entries
    changed in place later, the slid-out blocks of a window, are not followed)."""

    __slots__ = ("source", "array", "length")

    def __init__(self, source: list[int]) -> None:
        self.source = source
        self.array = np.empty(max(16, 2 * len(source)), dtype=np.int32)
        self.length = 0

    def sync(self) -> np.ndarray:
        """The table as it is now (new entries copied in)."""
        n = len(self.source)
        if n > self.length:
            if n > len(self.array):
                grown = np.empty(2 * n, dtype=np.int32)
                grown[: self.length] = self.array[: self.length]
                self.array = grown
            self.array[self.length : n] = self.source[self.length : n]
            self.length = n
        return self.array[:n]
