"""StepInputBuilder from step plans: tables kept from their updates, sliding rows from the window,
each cache kind's own parts (paged rows of the group's own width, recurrent slots and states)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from heron.cache.paged import FullAttentionSpec, SlidingWindowSpec
from heron.cache.paged_parts import PagedParts
from heron.cache.recurrent import RecurrentStateSpec
from heron.cache.recurrent_parts import RecurrentParts
from heron.execution.request_state import RequestState
from heron.execution.step_inputs import StepInputBuilder
from heron.execution.step_plan import NewRequest, SentTables, StepPlan
from heron.metadata import StepMetadataError
from heron.ops.attention.paged import PagedAttentionBuilder
from heron.ops.linear_attention.builder import GatedDeltaNetBuilder
from heron.sampling_params import SamplingParams

BS = 4
WINDOW = 10


def _specs(windows):
    return [
        FullAttentionSpec(BS, torch.float32, 1, 8)
        if w is None
        else SlidingWindowSpec(BS, torch.float32, 1, 8, w)
        for w in windows
    ]


def _state(request_id: str, tokens: list[int]) -> RequestState:
    new = NewRequest(request_id, tokens, len(tokens), SamplingParams(), None)
    return RequestState(new, torch.device("cpu"))


class _Sync:
    """What the scheduler sends of each table: its new entries, or all after a drop."""

    def __init__(self, builder: StepInputBuilder) -> None:
        self.builder, self.sent = builder, SentTables()

    def drop(self, request_id: str) -> None:
        self.sent.forget(request_id)
        self.builder.tables.drop(request_id)

    def prepare(self, states, rows, tables):
        """``rows``: (request id, context, new tokens); ``tables``: request id -> tables."""
        for request_id, _, _ in rows:
            for update in self.sent.updates(request_id, tables[request_id]):
                self.builder.tables.apply(update)
        plan = StepPlan(
            [r for r, _, _ in rows],
            [c for _, c, _ in rows],
            [n for _, _, n in rows],
            [c + n == len(states[r].all_token_ids) for r, c, n in rows],
        )
        return self.builder.prepare(plan, states)


def test_tables_follow_growth_replacement_and_window():
    builder = StepInputBuilder(BS, torch.device("cpu"), _specs([None, WINDOW]))
    sync = _Sync(builder)
    n = 35
    state = _state("r", list(range(1, n * BS)))
    full = list(range(100, 100 + n))
    sliding = list(range(500, 500 + n))
    for step in range(3):
        if step == 1:
            full.append(999)  # the table grows between steps (append only)
            sliding.append(998)
            state.all_token_ids += [7, 7, 7, 7]
        if step == 2:
            full = [300 + i for i in range(len(full))]  # re-allocated (after a preemption)
            sync.drop("r")
        position = len(state.all_token_ids) - 1
        step_inputs = sync.prepare({"r": state}, [("r", position, 1)], {"r": [full, sliding]})
        full_parts, sliding_parts = (step_inputs.seq.parts(g, PagedParts) for g in range(2))
        assert full_parts.block_tables.tolist() == [full]
        first = max(0, position - WINDOW + 1) // BS
        # A sliding row starts at the window: it holds only the blocks the step can read, and
        # the group's rows are no wider than that.
        assert sliding_parts.block_tables.tolist() == [sliding[first:]]
        assert sliding_parts.table_starts.tolist() == [first]
        assert full_parts.table_starts.tolist() == [0]


def test_vectorised_rows_equal_per_request_rows():
    """Random steps (decode and prefill chunks, tables growing, sliding, replaced, requests
    leaving and coming back): every group's rows, slots, positions and lengths are what each
    request's own table gives."""
    rng = random.Random(0)
    windows = [None, WINDOW, 3]
    builder = StepInputBuilder(BS, torch.device("cpu"), _specs(windows))
    sync = _Sync(builder)
    states = {f"r{i}": _state(f"r{i}", list(range(1, rng.randint(2, 60)))) for i in range(6)}
    computed = dict.fromkeys(states, 0)
    tables = {r: [[] for _ in windows] for r in states}
    next_block = iter(range(1, 10**6))
    for _ in range(200):
        rows = []
        for r in rng.sample(sorted(states), rng.randint(1, len(states))):
            num_tokens = len(states[r].all_token_ids)
            if rng.random() < 0.05:  # preempted and re-admitted: new tables
                tables[r] = [[] for _ in windows]
                computed[r] = 0
                sync.drop(r)
            # Contexts only grow while a request holds its tables.
            c = rng.randint(computed[r], num_tokens - 1)
            n = rng.randint(1, num_tokens - c)
            computed[r] = c
            for g, table in enumerate(tables[r]):
                table.extend(next(next_block) for _ in range(-(-(c + n) // BS) - len(table)))
                first = max(0, c - (windows[g] or 10**9) + 1) // BS
                table[:first] = [0] * first  # slid out of the window
            rows.append((r, c, n))
        seq = sync.prepare(states, rows, tables).seq
        assert seq.positions.tolist() == [p for _, c, n in rows for p in range(c, c + n)]
        assert seq.query_lens_host.tolist() == [n for _, _, n in rows]
        assert seq.kv_lens.tolist() == [c + n for _, c, n in rows]
        for g, window in enumerate(windows):
            firsts = [max(0, c - (window or 10**9) + 1) // BS for _, c, _ in rows]
            # The group's own width: its longest row from that row's first block.
            width = max(len(tables[r][g]) - first for (r, _, _), first in zip(rows, firsts))
            block_rows, slots = [], []
            for (r, c, n), first in zip(rows, firsts):
                table = tables[r][g]
                block_rows.append(table[first:] + [0] * (width - len(table) + first))
                slots += [table[p // BS] * BS + p % BS for p in range(c, c + n)]
            parts = seq.parts(g, PagedParts)
            assert parts.block_tables.tolist() == block_rows
            assert parts.table_starts.tolist() == firsts
            assert parts.slot_mapping.tolist() == slots
        for state in states.values():  # decode steps grow the sequences
            if rng.random() < 0.5:
                state.all_token_ids.append(7)


RECURRENT = RecurrentStateSpec(1, torch.float32, conv_dim=4, conv_kernel=2, num_heads=1,
                               key_dim=2, value_dim=2)  # fmt: skip


def _fields(record) -> dict[str, torch.Tensor]:
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


def test_each_kind_contributes_its_own_parts_at_its_own_width():
    """A full group, a window group of 4 tokens and a recurrent group, as a hybrid model has."""
    builder = StepInputBuilder(BS, torch.device("cpu"), [*_specs([None, 4]), RECURRENT])
    sync = _Sync(builder)
    states = {"a": _state("a", list(range(1, 30))), "b": _state("b", [5, 6, 7])}
    tables = {"a": [list(range(10, 18)), [0, 0, 0, 0, 0, 0, 26, 27], [3]], "b": [[40], [41], [1]]}
    seq = sync.prepare(states, [("a", 0, 29), ("b", 0, 3)], tables).seq
    full, window, recurrent = (seq.group_parts[g] for g in range(3))
    assert full.block_tables.shape == (2, 8)  # the longest table
    # A step starting at 0 reads every block of the window group too.
    assert window.block_tables.shape == (2, 8) and window.table_starts.tolist() == [0, 0]
    assert _fields(recurrent).keys() == {"state_slots", "has_saved_state"}
    assert recurrent.state_slots.tolist() == [3, 1]
    assert recurrent.has_saved_state.tolist() == [0, 0]
    # Decode: the window group's rows shrink to the window, the full group's do not.
    for state in states.values():
        state.all_token_ids.append(9)
    seq = sync.prepare(states, [("a", 29, 1), ("b", 3, 1)], tables).seq
    full, window, recurrent = (seq.group_parts[g] for g in range(3))
    assert full.block_tables.tolist() == [tables["a"][0], [40] + [0] * 7]
    assert window.table_starts.tolist() == [(29 - 4 + 1) // BS, 0]
    assert window.block_tables.tolist() == [[26, 27], [41, 0]]
    assert recurrent.has_saved_state.tolist() == [1, 1]
    assert window.slot_mapping.tolist() == [27 * BS + 29 % BS, 41 * BS + 3]
    # One packed copy: every group's parts are views of the one array.
    ptr = seq.token_ids.untyped_storage().data_ptr()
    for record in seq.group_parts:
        assert all(t.untyped_storage().data_ptr() == ptr for t in _fields(record).values())


def test_a_builder_reads_only_its_own_kinds_parts():
    builder = StepInputBuilder(BS, torch.device("cpu"), [*_specs([None]), RECURRENT])
    seq = _Sync(builder).prepare({"a": _state("a", [1, 2])}, [("a", 0, 2)], {"a": [[5], [2]]}).seq
    paged = PagedAttentionBuilder("reference", BS, None, 64)
    paged.cache_group = 1
    with pytest.raises(StepMetadataError, match="RecurrentParts, not PagedParts"):
        paged.build(seq)
    gdn = GatedDeltaNetBuilder("reference")
    with pytest.raises(StepMetadataError, match="PagedParts, not RecurrentParts"):
        gdn.build(seq)
    gdn.cache_group = 1
    assert gdn.build(seq).state_slots.tolist() == [2]
    with pytest.raises(StepMetadataError, match="cache group 2"):
        seq.parts(2, RecurrentParts)


def test_a_saved_state_is_the_runners_own_record_of_the_slot():
    """A row starts from a saved state only once the runner's steps put its tokens in the slot:
    chunks continue it, a preempted request's new slot starts empty, and a step whose context
    the slot does not hold (its prefix counted as computed, its state not there) is refused."""
    builder = StepInputBuilder(BS, torch.device("cpu"), [*_specs([None]), RECURRENT])
    sync = _Sync(builder)
    states = {"a": _state("a", list(range(1, 12)))}
    tables = {"a": [[4, 5, 6], [2]]}
    saved = lambda rows: sync.prepare(states, rows, tables).seq.parts(1, RecurrentParts)
    assert saved([("a", 0, 5)]).has_saved_state.tolist() == [0]
    assert saved([("a", 5, 6)]).has_saved_state.tolist() == [1]
    sync.drop("a")  # preempted: it comes back with a new slot and recomputes from 0
    tables = {"a": [[7, 8, 9], [3]]}
    parts = saved([("a", 0, 8)])
    assert parts.has_saved_state.tolist() == [0] and parts.state_slots.tolist() == [3]
    with pytest.raises(StepMetadataError, match="request a: the step starts at token 9, but its "
                       "state slot holds 8 of its tokens"):  # fmt: skip
        saved([("a", 9, 2)])
    sync.drop("a")
    tables = {"a": [[7, 8, 9], [1]]}
    with pytest.raises(StepMetadataError, match="holds 0 of its tokens"):  # a prefix hit
        saved([("a", 8, 3)])
