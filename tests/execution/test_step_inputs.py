"""StepInputBuilder's block-table rows: mirrored long tables, sliding rows from the window."""

from __future__ import annotations

import torch

from heron.engine.request import Request
from heron.engine.scheduler import ScheduledRequest, SchedulerOutput
from heron.execution.step_inputs import _MIRROR_MIN_BLOCKS, StepInputBuilder
from heron.sampling_params import SamplingParams

BS = 4
WINDOW = 10


def _decode(builder, request, tables):
    request.num_computed_tokens = request.num_tokens - 1
    output = SchedulerOutput([ScheduledRequest(request, 1, samples=True)])
    step = builder.prepare(output, lambda _: tables)
    return [t[0].numpy() for t in step.seq.group_block_tables]


def test_tables_follow_growth_replacement_and_window():
    builder = StepInputBuilder(BS, torch.device("cpu"), [None, WINDOW])
    n = _MIRROR_MIN_BLOCKS + 3  # long enough for the mirror
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
