"""StepInputBuilder's block-table rows: kept rows of growing tables, sliding rows from the window."""

from __future__ import annotations

import random

import torch

from heron.cache.spec import FullAttentionSpec, SlidingWindowSpec
from heron.engine.request import Request
from heron.engine.scheduler import ScheduledRequest, SchedulerOutput
from heron.execution.step_inputs import StepInputBuilder
from heron.sampling_params import SamplingParams

BS = 4
WINDOW = 10


def _decode(builder, request, tables):
    request.num_computed_tokens = request.num_tokens - 1
    output = SchedulerOutput([ScheduledRequest(request, 1, samples=True)])
    step = builder.prepare(output, lambda _: tables)
    return [t[0].numpy() for t in step.seq.group_block_tables]


def test_tables_follow_growth_replacement_and_window():
    builder = StepInputBuilder(BS, torch.device("cpu"), _specs([None, WINDOW]))
    n = 35
    request = Request("r", list(range(1, n * BS)), SamplingParams())
    full = list(range(100, 100 + n))
    sliding = list(range(500, 500 + n))
    for step in range(3):
        if step == 1:
            full.append(999)  # the table grows between steps (append only)
            sliding.append(998)
            request.append_output_token(7)
            request.append_output_token(7)
            request.append_output_token(7)
            request.append_output_token(7)
        if step == 2:
            full = [300 + i for i in range(len(full))]  # re-allocated (after a preemption)
        rows = _decode(builder, request, [full, sliding])
        assert list(rows[0][: len(full)]) == full
        position = request.num_tokens - 1
        first = max(0, position - WINDOW + 1) // BS
        # A sliding row starts at the window: it holds only the blocks the step can read.
        count = len(sliding) - first
        assert list(rows[1][:count]) == sliding[first:]
        assert not rows[1][count:].any()


def _specs(windows):
    return [
        FullAttentionSpec(BS, torch.float32, 1, 8)
        if w is None
        else SlidingWindowSpec(BS, torch.float32, 1, 8, w)
        for w in windows
    ]


def test_vectorised_rows_equal_per_request_rows():
    """Random steps (decode and prefill chunks, tables growing, sliding, replaced, requests
    leaving and coming back): every group's rows, slots, positions and lengths are what each
    request's own table gives."""
    rng = random.Random(0)
    windows = [None, WINDOW, 3]
    builder = StepInputBuilder(BS, torch.device("cpu"), _specs(windows))
    requests = [
        Request(f"r{i}", list(range(1, rng.randint(2, 60))), SamplingParams()) for i in range(6)
    ]
    tables = {r: [[] for _ in windows] for r in requests}
    next_block = iter(range(1, 10**6))
    for _ in range(200):
        scheduled = []
        for r in rng.sample(requests, rng.randint(1, len(requests))):
            if rng.random() < 0.05:  # preempted and re-admitted: new tables
                tables[r] = [[] for _ in windows]
                r.num_computed_tokens = 0
            # Contexts only grow while a request holds its tables.
            c = rng.randint(r.num_computed_tokens, r.num_tokens - 1)
            n = rng.randint(1, r.num_tokens - c)
            r.num_computed_tokens = c
            for g, table in enumerate(tables[r]):
                table.extend(next(next_block) for _ in range(-(-(c + n) // BS) - len(table)))
                first = max(0, c - (windows[g] or 10**9) + 1) // BS
                table[:first] = [0] * first  # slid out of the window
            scheduled.append(ScheduledRequest(r, n, samples=n == r.num_tokens - c))
        by_id = {r.request_id: tables[r] for r in requests}
        seq = builder.prepare(SchedulerOutput(scheduled), by_id.__getitem__).seq
        width = max(len(t) for s in scheduled for t in tables[s.request])
        positions = [
            p
            for s in scheduled
            for p in range(
                s.request.num_computed_tokens, s.request.num_computed_tokens + s.num_new_tokens
            )
        ]
        assert seq.positions.tolist() == positions
        assert seq.query_lens.tolist() == [s.num_new_tokens for s in scheduled]
        assert seq.kv_lens.tolist() == [
            s.request.num_computed_tokens + s.num_new_tokens for s in scheduled
        ]
        for g, window in enumerate(windows):
            rows, slots = [], []
            for s in scheduled:
                c, table = s.request.num_computed_tokens, tables[s.request][g]
                first = max(0, c - (window or 10**9) + 1) // BS
                rows.append(table[first:] + [0] * (width - len(table) + first))
                slots += [table[p // BS] * BS + p % BS for p in range(c, c + s.num_new_tokens)]
            assert seq.group_block_tables[g].tolist() == rows
            assert seq.group_slot_mappings[g].tolist() == slots
        for r in requests:  # decode steps grow the sequences
            if rng.random() < 0.5:
                r.append_output_token(7)
