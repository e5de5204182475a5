"""StepInputBuilder from step plans: tables kept from their updates, sliding rows from the window."""

from __future__ import annotations

import random

import torch

from heron.cache.spec import FullAttentionSpec, SlidingWindowSpec
from heron.execution.request_state import RequestState
from heron.execution.step_inputs import StepInputBuilder
from heron.execution.step_plan import NewRequest, SentTables, StepPlan
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
        rows = [t[0].numpy() for t in step_inputs.seq.group_block_tables]
        assert list(rows[0][: len(full)]) == full
        first = max(0, position - WINDOW + 1) // BS
        # A sliding row starts at the window: it holds only the blocks the step can read.
        count = len(sliding) - first
        assert list(rows[1][:count]) == sliding[first:]
        assert not rows[1][count:].any()
        assert step_inputs.seq.group_table_starts[1].tolist() == [first]
        assert step_inputs.seq.group_table_starts[0].tolist() == [0]


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
        width = max(len(t) for r, _, _ in rows for t in tables[r])
        assert seq.positions.tolist() == [p for _, c, n in rows for p in range(c, c + n)]
        assert seq.query_lens_host.tolist() == [n for _, _, n in rows]
        assert seq.kv_lens.tolist() == [c + n for _, c, n in rows]
        for g, window in enumerate(windows):
            block_rows, slots = [], []
            for r, c, n in rows:
                table = tables[r][g]
                first = max(0, c - (window or 10**9) + 1) // BS
                block_rows.append(table[first:] + [0] * (width - len(table) + first))
                slots += [table[p // BS] * BS + p % BS for p in range(c, c + n)]
            assert seq.group_block_tables[g].tolist() == block_rows
            assert seq.group_slot_mappings[g].tolist() == slots
        for state in states.values():  # decode steps grow the sequences
            if rng.random() < 0.5:
                state.all_token_ids.append(7)
