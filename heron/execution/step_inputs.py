"""Host-side step inputs: scheduler output to StepBatch, SequenceMetadata and group views."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from heron.cache.spec import CacheSpec
from heron.engine.request import Request
from heron.engine.scheduler import SchedulerOutput
from heron.metadata import SequenceMetadata, StepBatch


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

    One pass over the requests collects their lengths and tokens; block tables, positions and
    slot mappings are then filled for all requests at once from :class:`BlockTableRows`.

    The groups' views are built afterwards by the runner: eagerly through the plan, or by the
    builders' ``fill`` into graph buffers when the step is replayed.
    """

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        specs: Sequence[CacheSpec],
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.specs = list(specs)  # each cache group's spec
        self.num_groups = len(self.specs)
        self._rows = BlockTableRows(self.num_groups)
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
        and its row in the step starts at the window (``CacheSpec.first_table_block``).
        A decode token that is still pending (sampled by the previous step, value not yet read)
        is left as 0 and listed in ``pending_sources`` with its row in ``pending_rows``, for the
        runner to fill on the device.
        """
        items = output.scheduled
        bs = self.block_size
        requests: list[Request] = []
        contexts: list[int] = []
        query_lens: list[int] = []
        token_ids: list[int] = []  # 0 for a pending token
        sample_requests: list[Request] = []
        sample_rows: list[int] = []  # their last tokens' offsets
        prompt_spans: list[tuple[Request, int, int, int]] = []  # request, token offset, pos, count
        pending_sources: list[tuple[int, int]] = []
        num_tokens = 0
        for item in items:
            r, c, n = item.request, item.request.num_computed_tokens, item.num_new_tokens
            requests.append(r)
            contexts.append(c)
            query_lens.append(n)
            if n == 1 and c >= len(r.all_token_ids):  # decode of a token not read yet
                pending_sources.append((num_tokens, pending_rows[r]))
                token_ids.append(0)
            else:
                token_ids += r.all_token_ids[c : c + n]
            if r.wants_prompt_logprobs:
                # A preempted request recomputes its prompt; positions that already have their
                # logprob are not computed twice.
                first = max(c, len(r.prompt_logprobs) - 1)
                count = min(c + n, r.num_prompt_tokens - 1) - first
                if count > 0:
                    prompt_spans.append((r, num_tokens + first - c, first, count))
            if item.samples:
                sample_requests.append(r)
                sample_rows.append(num_tokens + n - 1)
            num_tokens += n
        table_rows = self._rows.update(requests, [block_tables(r.request_id) for r in requests])
        num_prompt_rows = sum(span[3] for span in prompt_spans)
        num_reqs = len(items)
        lengths = self._rows.lengths(table_rows)
        width = int(lengths.max()) if num_reqs else 0
        num_logits = num_prompt_rows + len(sample_requests)
        size = StepBatch.packed_size(num_reqs, num_tokens, num_logits, width, self.num_groups)
        batch = StepBatch(
            num_reqs,
            num_tokens,
            num_logits,
            width,
            bs,
            staging=self._staging_buffer(size),
            num_groups=self.num_groups,
        )
        batch.token_ids[:] = token_ids
        batch.query_lens[:] = query_lens
        contexts_array = np.array(contexts, dtype=np.int32)
        np.add(contexts_array, batch.query_lens, out=batch.kv_lens)
        batch.finish()
        query_starts = batch.start_locs[0]
        positions = batch.positions
        if num_tokens == num_reqs:  # decode only: a token per request, at its context
            positions[:] = contexts_array
            token_table_rows = table_rows
        else:  # each token at its request's context plus its offset in the request
            token_rows = np.repeat(np.arange(num_reqs), batch.query_lens)
            np.subtract(np.arange(num_tokens), query_starts[token_rows], out=positions)
            positions += contexts_array[token_rows]
            token_table_rows = table_rows[token_rows]
        if num_reqs:
            for g, spec in enumerate(self.specs):
                firsts = spec.first_table_block(contexts_array)
                self._rows.gather(g, table_rows, lengths[g], firsts, batch.group_block_tables[g])
                batch.group_table_starts[g] = firsts
            # Every group's slot of each token: its block's id * block_size + its offset in it.
            block_indices, block_offsets = np.divmod(positions, bs)
            slot_mappings = batch.group_slot_mappings
            np.multiply(self._rows.array[:, token_table_rows, block_indices], bs, out=slot_mappings)
            slot_mappings += block_offsets
        rows = num_prompt_rows + len(sample_requests)
        batch.logits_indices[num_prompt_rows:rows] = sample_rows
        row = 0
        prompt_rows = []
        for r, token_offset, position, count in prompt_spans:
            batch.logits_indices[row : row + count] = np.arange(
                token_offset, token_offset + count, dtype=np.int32
            )
            prompt_rows.append((r, row, position, count))
            row += count

        seq = SequenceMetadata.from_step_batch(batch, self.device)
        if self._copied is not None:
            self._copied.record()
        return PreparedStep(
            seq, sample_requests, slice(num_prompt_rows, rows), prompt_rows, pending_sources
        )


class BlockTableRows:
    """Per KV cache group, a numpy copy of each scheduled request's block table, one row each.

    ``array[g, r]`` holds group ``g``'s table of the request given row ``r``, from index 0;
    entries past the table's end are 0 (the null block), and the array is wider than every
    table, so a read past a table's end gives the padding that a step's table needs.
    :meth:`gather` copies the rows of a step's requests into the step's tables at once (one
    numpy indexing per group instead of a copy per request).

    A request keeps its row from step to step while it is scheduled, and each step copies in
    only the entries its tables gained: a table only grows at its end while a request holds it.
    The one exception, a sliding window's entries set to the null block once they slid out, is
    not followed, which is harmless: they lie before the window's first block, where no step
    reads (rows start at ``CacheSpec.first_table_block``). A table replaced by another list (the request
    was preempted and re-admitted) is copied afresh. A request left out of a step loses its
    row (and is copied afresh when it comes back).
    """

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.array = np.zeros((num_groups, 0, 1), dtype=np.int32)
        # The last step's requests and their rows (as a list and an array).
        self._requests: list[Request] = []
        self._row_list: list[int] = []
        self._row_array = np.zeros(0, dtype=np.int64)
        self._free: list[int] = []
        # Per row, per group: the table list copied in and how many of its entries (also kept
        # as an array, [group, row], for the vectorised reads).
        self._sources: list[list[list[int] | None]] = []
        self._counts: list[list[int]] = []
        self._lengths = np.zeros((num_groups, 0), dtype=np.int64)

    def update(self, requests: list[Request], tables: list[Sequence[list[int]]]) -> np.ndarray:
        """Give each request a row holding its ``tables`` (one per group); return the rows."""
        if requests != self._requests:  # (the same requests in the same order keep their rows)
            self._assign_rows(requests)
        sources, counts = self._sources, self._counts
        for row, group_tables in zip(self._row_list, tables):
            for g, table in enumerate(group_tables):
                if table is not sources[row][g] or len(table) != counts[row][g]:
                    self._sync(row, group_tables)
                    break
        return self._row_array

    def _assign_rows(self, requests: list[Request]) -> None:
        """Keep the rows of requests that had one, free the others', give new requests one."""
        previous = dict(zip(self._requests, self._row_list))
        row_list = [previous.pop(r, -1) for r in requests]
        self._free += previous.values()
        for i, row in enumerate(row_list):
            if row < 0:
                row_list[i] = self._free.pop() if self._free else self._add_row()
        self._requests = list(requests)
        self._row_list = row_list
        self._row_array = np.array(row_list, dtype=np.int64)

    def lengths(self, rows: np.ndarray) -> np.ndarray:
        """``[group, i]``: the length of ``rows[i]``'s table in each group."""
        return self._lengths[:, rows]

    def gather(
        self,
        group: int,
        rows: np.ndarray,
        lengths: np.ndarray,
        firsts: np.ndarray | int,
        out: np.ndarray,
    ) -> None:
        """``out[i, :lengths[i] - firsts[i]] = table_i[firsts[i]:]`` for ``rows[i]``'s table
        in ``group`` (``out`` is zero-filled and at least as wide as the longest table)."""
        tables = self.array[group]
        if isinstance(firsts, int):
            out[:, :] = tables[rows, : out.shape[1]]
            return
        live = max(int((lengths - firsts).max()), 0)
        columns = firsts[:, None] + np.arange(live)
        np.minimum(columns, tables.shape[1] - 1, out=columns)  # past every end: a 0 entry
        out[:, :live] = tables[rows[:, None], columns]

    def _sync(self, row: int, tables: Sequence[list[int]]) -> None:
        """Bring ``array[:, row]`` up to date with ``tables`` (new tails, or whole tables)."""
        if len(tables) != self.num_groups:
            raise ValueError(f"expected a block table for each of {self.num_groups} cache groups")
        sources, counts = self._sources[row], self._counts[row]
        for group, table in enumerate(tables):
            start, end = counts[group], len(table)
            if table is not sources[group] or end < start:
                self.array[group, row, :start] = 0
                sources[group] = table
                start = 0
            if end >= self.array.shape[2]:
                grown = np.zeros((self.num_groups, self.array.shape[1], 2 * end), dtype=np.int32)
                grown[:, :, : self.array.shape[2]] = self.array
                self.array = grown
            self.array[group, row, start:end] = table[start:end]
            counts[group] = end
            self._lengths[group, row] = end

    def _add_row(self) -> int:
        """A new row at the end, with room for as many again after it."""
        row = self.array.shape[1]
        grown = np.zeros((self.num_groups, 2 * row + 1, self.array.shape[2]), dtype=np.int32)
        grown[:, :row] = self.array
        self.array = grown
        lengths = np.zeros((self.num_groups, 2 * row + 1), dtype=np.int64)
        lengths[:, :row] = self._lengths
        self._lengths = lengths
        self._sources += [[None] * self.num_groups for _ in range(row + 1)]
        self._counts += [[0] * self.num_groups for _ in range(row + 1)]
        self._free += range(2 * row, row, -1)
        return row
