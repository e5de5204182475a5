"""Host-side step inputs: a step plan to StepBatch and SequenceMetadata (one packed copy)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from heron.cache.spec import CacheSpec
from heron.execution.request_state import RequestState
from heron.execution.sampler import prompt_logprobs
from heron.execution.step_plan import StepPlan, TableUpdate
from heron.metadata import SequenceMetadata, StepBatch
from heron.metadata.parts import GroupTables, StepRows
from heron.outputs import Logprob


@dataclass(frozen=True)
class PreparedStep:
    """A step ready for the forward pass: shared metadata plus how to read its logits."""

    seq: SequenceMetadata
    sample_states: list[RequestState]
    sample_rows: slice  # rows of the step's logits that are sampled (a verified row's all)
    prompt_rows: list[tuple[RequestState, int, int, int]]  # state, first row, position, count
    # Tokens still being sampled by the previous step: (token offset, that step's sample row).
    pending_sources: list[tuple[int, int]]
    # Proposals on the device: (first token offset, request id, count), in the launch's drafts.
    draft_sources: list[tuple[int, str, int]]

    def prompt_logprobs(self, logits: torch.Tensor) -> dict[str, list[Logprob]]:
        """The logprobs of the prompt positions the step computed, per request."""
        prompt_lps: dict[str, list[Logprob]] = {}
        for state, row, position, count in self.prompt_rows:
            next_ids = state.all_token_ids[position + 1 : position + 1 + count]
            top = state.sampling_params.prompt_logprobs
            lps = prompt_logprobs(logits[row : row + count], next_ids, top)
            prompt_lps.setdefault(state.request_id, []).extend(lps)
        return prompt_lps


class StepInputBuilder:
    """Turns a step plan into the step's shared metadata (one packed copy).

    It keeps every request's block tables (:class:`BlockTableRows`, updated by the plans'
    table updates); one pass over the plan's rows collects their tokens, then positions and
    every cache group's parts (by its kind) are filled for all rows at once.

    The groups' views are built afterwards by the runner: eagerly through the plan, or by the
    builders' ``fill`` into graph buffers when the step is replayed.
    """

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        specs: Sequence[CacheSpec],
        adapters: bool = False,
    ) -> None:
        """``adapters``: steps carry each row's LoRA adapter slot."""
        self.block_size = block_size
        self.device = device
        self.adapters = adapters
        self.parts = [spec.step_parts() for spec in specs]  # each cache group's kind's parts
        self.tables = BlockTableRows(len(self.parts))
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
        plan: StepPlan,
        states: Mapping[str, RequestState],
        pending_rows: Mapping[str, int] | None = None,
        adapter_slots: np.ndarray | None = None,
    ) -> PreparedStep:
        """Host work of a step: the packed StepBatch and its one copy to the device
        (``adapter_slots``: each row's LoRA adapter slot, where the steps carry them).

        Each cache group's kind lays out and fills its own parts (``CacheSpec.step_parts``).
        A decode token that is still pending (sampled by the previous step, not yet read) is
        left as 0 and listed in ``pending_sources`` with its row in ``pending_rows``, for the
        runner to fill on the device; so are proposals on the device (``draft_sources``), and
        a ``device_inputs`` row's tokens.
        """
        request_ids = plan.request_ids
        bs = self.block_size
        token_ids: list[int] = []  # 0 for a pending token
        sample_states: list[RequestState] = []
        sample_rows: list[int] = []  # their last tokens' offsets
        prompt_spans: list[tuple[RequestState, int, int, int]] = []  # state, offset, pos, count
        pending_sources: list[tuple[int, int]] = []
        draft_sources: list[tuple[int, str, int]] = []
        drafts, device_drafts = plan.draft_token_ids, plan.device_drafts
        device_inputs = plan.device_inputs
        num_tokens = 0
        for request_id, c, n, samples in zip(
            request_ids, plan.num_computed, plan.num_new, plan.samples
        ):
            state = states[request_id]
            tokens = state.all_token_ids
            proposed = drafts.get(request_id) if drafts else None
            on_device = device_drafts.get(request_id) if device_drafts else None
            if device_inputs and request_id in device_inputs:  # all from the device, sampled
                draft_sources.append((num_tokens, request_id, n))
                token_ids += [0] * n
                sample_states.append(state)
                sample_rows += range(num_tokens, num_tokens + n)
                num_tokens += n
                continue
            if proposed or on_device:  # the last token, then the proposals: all are sampled
                if c >= len(tokens):  # still being sampled (verified) by the previous step
                    pending_sources.append((num_tokens, pending_rows[request_id]))
                    token_ids.append(0)
                else:
                    token_ids += tokens[c:]
                if proposed:
                    token_ids += proposed
                else:
                    draft_sources.append((num_tokens + 1, request_id, on_device))
                    token_ids += [0] * on_device
                sample_states.append(state)
                sample_rows += range(num_tokens, num_tokens + n)
                num_tokens += n
                continue
            if n == 1 and c >= len(tokens):  # decode of a token not read yet
                pending_sources.append((num_tokens, pending_rows[request_id]))
                token_ids.append(0)
            else:
                token_ids += tokens[c : c + n]
            if state.wants_prompt_logprobs:
                # A preempted request recomputes its prompt; positions that already have their
                # logprob are not computed twice.
                first = max(c, state.num_prompt_logprobs)
                count = min(c + n, state.num_prompt_tokens - 1) - first
                if count > 0:
                    prompt_spans.append((state, num_tokens + first - c, first, count))
                    state.num_prompt_logprobs = first + count
            if samples:
                sample_states.append(state)
                sample_rows.append(num_tokens + n - 1)
            num_tokens += n
        num_reqs = len(request_ids)
        num_prompt_rows = sum(span[3] for span in prompt_spans)
        num_logits = num_prompt_rows + len(sample_rows)
        contexts = np.array(plan.num_computed, dtype=np.int32)
        table_rows = self.tables.rows(request_ids)
        groups = self.tables.groups(table_rows)
        planned = [
            parts.layout(contexts, num_tokens, tables) for parts, tables in zip(self.parts, groups)
        ]
        layouts = [layout for layout, _ in planned]
        size = StepBatch.packed_size(num_reqs, num_tokens, num_logits, layouts, self.adapters)
        batch = StepBatch(
            num_reqs,
            num_tokens,
            num_logits,
            bs,
            layouts,
            staging=self._staging_buffer(size),
            adapters=self.adapters,
        )
        batch.token_ids[:] = token_ids
        if adapter_slots is not None:
            batch.adapter_slots[:] = adapter_slots
        batch.query_lens[:] = plan.num_new
        np.add(contexts, batch.query_lens, out=batch.kv_lens)
        batch.finish()
        positions = batch.positions
        if num_tokens == num_reqs:  # decode only: a token per request, at its context
            positions[:] = contexts
            token_table_rows = table_rows
        else:  # each token at its request's context plus its offset in the request
            token_rows = np.repeat(np.arange(num_reqs), batch.query_lens)
            np.subtract(np.arange(num_tokens), batch.start_locs[0][token_rows], out=positions)
            positions += contexts[token_rows]
            token_table_rows = table_rows[token_rows]
        if num_reqs:
            block_indices, block_offsets = np.divmod(positions, bs)
            step = StepRows(
                request_ids,
                table_rows,
                contexts,
                token_table_rows,
                block_indices,
                block_offsets,
                bs,
            )
            for parts, tables, out, (_, kind_plan) in zip(
                self.parts, groups, batch.group_parts, planned
            ):
                parts.fill(out, step, tables, kind_plan)
            self.tables.wrote(table_rows, batch.kv_lens)
        batch.logits_indices[num_prompt_rows:num_logits] = sample_rows
        row = 0
        prompt_rows = []
        for state, token_offset, position, count in prompt_spans:
            batch.logits_indices[row : row + count] = np.arange(
                token_offset, token_offset + count, dtype=np.int32
            )
            prompt_rows.append((state, row, position, count))
            row += count

        seq = SequenceMetadata.from_step_batch(batch, self.device)
        if plan.verifies:
            proposed = [plan.num_proposed(request_id) for request_id in request_ids]
            seq = replace(seq, num_proposed_host=np.array(proposed, dtype=np.int32))
        if self._copied is not None:
            self._copied.record()
        return PreparedStep(
            seq,
            sample_states,
            slice(num_prompt_rows, num_logits),
            prompt_rows,
            pending_sources,
            draft_sources,
        )


class BlockTableRows:
    """Per cache group, a numpy copy of every request's block table, one row per request.

    ``array[g, r]`` holds group ``g``'s table of the request given row ``r``, from index 0;
    entries past the table's end are 0 (the null block), and the array is wider than every
    table, so a read past a table's end gives the padding that a step's table needs. Each
    group's kind reads its rows of a step's requests at once (:meth:`groups`), by numpy
    indexing instead of a copy per request.

    Beside the tables it keeps how many of the request's tokens this runner's steps have put in
    its caches since it got its row (:meth:`wrote`): what a kind whose cache is the result of
    those steps alone (a recurrent state) holds.

    Plans send each table's new entries once (:class:`TableUpdate`); a request keeps its row
    until it is finished or preempted. Entries of a sliding window set to the null block once
    they slid out are not followed, which is harmless: they lie before the window's first
    block, where no step reads.
    """

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.array = np.zeros((num_groups, 0, 1), dtype=np.int32)
        self._lengths = np.zeros((num_groups, 0), dtype=np.int64)  # [group, row]
        self._written = np.zeros(0, dtype=np.int32)  # [row]: every group holds the same tokens
        self._row_of: dict[str, int] = {}
        self._free: list[int] = []
        # The last step's requests and their rows: decode steps mostly repeat them.
        self._last_ids: list[str] = []
        self._last_rows = np.zeros(0, dtype=np.int64)

    def apply(self, update: TableUpdate) -> bool:
        """Entries ``update.start:`` of the request's table in ``update.group`` are replaced;
        True if that gave the request its row."""
        row = self._row_of.get(update.request_id)
        given = row is None
        if given:
            row = self._row_of[update.request_id] = (
                self._free.pop() if self._free else self._add_row()
            )
        g, start, end = update.group, update.start, update.start + len(update.block_ids)
        if end >= self.array.shape[2]:
            grown = np.zeros((self.num_groups, self.array.shape[1], 2 * end), dtype=np.int32)
            grown[:, :, : self.array.shape[2]] = self.array
            self.array = grown
        self.array[g, row, start:end] = update.block_ids
        self.array[g, row, end : self._lengths[g, row]] = 0
        self._lengths[g, row] = end
        return given

    def drop(self, request_id: str) -> None:
        """Forget the request's tables (finished or preempted); its row is reused."""
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self.array[:, row] = 0
            self._lengths[:, row] = 0
            self._written[row] = 0
            self._free.append(row)
            self._last_ids = []

    def rows(self, request_ids: list[str]) -> np.ndarray:
        """The rows of ``request_ids``, in order."""
        if request_ids != self._last_ids:
            row_of = self._row_of
            self._last_rows = np.array([row_of[i] for i in request_ids], dtype=np.int64)
            self._last_ids = list(request_ids)
        return self._last_rows

    def groups(self, rows: np.ndarray) -> list[GroupTables]:
        """Each group's tables, with the lengths and written tokens of ``rows``."""
        lengths, written = self._lengths[:, rows], self._written[rows]
        return [GroupTables(self.array[g], lengths[g], written) for g in range(self.num_groups)]

    def covers(self, rows: np.ndarray, num_blocks: np.ndarray) -> bool:
        """Whether request ``rows[i]``'s table in every group has ``num_blocks[i]`` blocks."""
        return bool((self._lengths[:, rows] >= num_blocks).all())

    def wrote(self, rows: np.ndarray, kv_lens: np.ndarray) -> None:
        """A step was packed: request ``rows[i]``'s caches now hold its first ``kv_lens[i]``
        tokens."""
        self._written[rows] = kv_lens

    def first_block(self, request_id: str, group: int) -> int:
        """Request ``request_id``'s first table entry in ``group``: a recurrent group's slot."""
        return int(self.array[group, self._row_of[request_id], 0])

    def holds(self, request_id: str, num_tokens: int) -> None:
        """Request ``request_id``'s caches hold its first ``num_tokens`` tokens already (a
        prefix hit, restored before its first step)."""
        self._written[self._row_of[request_id]] = num_tokens

    def _add_row(self) -> int:
        """A new row at the end, with room for as many again after it."""
        row = self.array.shape[1]
        grown = np.zeros((self.num_groups, 2 * row + 1, self.array.shape[2]), dtype=np.int32)
        grown[:, :row] = self.array
        self.array = grown
        lengths = np.zeros((self.num_groups, 2 * row + 1), dtype=np.int64)
        lengths[:, :row] = self._lengths
        self._lengths = lengths
        written = np.zeros(2 * row + 1, dtype=np.int32)
        written[:row] = self._written
        self._written = written
        self._free += range(2 * row, row, -1)
        return row
