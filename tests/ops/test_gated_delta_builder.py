"""The gated-delta-rule builder: each row's slot and saved-state flag, eager and in graph buffers."""

from __future__ import annotations

import pytest
import torch

from heron.cache.paged_parts import paged_layout
from heron.cache.recurrent_parts import RecurrentStepParts
from heron.metadata import SequenceMetadata, StepBatch, StepMetadataError
from heron.ops.linear_attention.builder import GatedDeltaNetBuilder


def step(contexts, query_lens, slots) -> SequenceMetadata:
    """A step over a paged group 0 and the recurrent group 1, whose kind says a row has a saved
    state when the runner has put its first ``context`` tokens in the slot."""
    n, tokens = len(contexts), sum(query_lens)
    groups = [paged_layout(n, tokens, 3), RecurrentStepParts().layout_of(n, tokens, 1)]
    batch = StepBatch(n, tokens, n, 4, groups)
    batch.query_lens[:] = query_lens
    batch.kv_lens[:] = [c + q for c, q in zip(contexts, query_lens)]
    batch.group_parts[1]["state_slots"][:] = slots
    batch.group_parts[1]["has_saved_state"][:] = [c > 0 for c in contexts]
    batch.group_parts[0]["block_tables"][:] = 7  # another group's tables, never read
    batch.finish()
    return SequenceMetadata.from_step_batch(batch, torch.device("cpu"))


def builder() -> GatedDeltaNetBuilder:
    b = GatedDeltaNetBuilder("reference")
    b.cache_group = 1
    return b


def test_rows_carry_their_slot_and_whether_they_continue():
    view = builder().build(step([0, 5, 9], [4, 1, 2], [3, 1, 2]))
    assert view.state_slots.tolist() == [3, 1, 2]
    assert view.has_initial_state.tolist() == [False, True, True]  # per row, not per batch
    assert view.query_start_loc.tolist() == [0, 4, 5, 7] and not view.is_decode


def test_graph_rows_past_the_batch_take_the_null_slot_without_state():
    b = builder()
    buffers = b.make_graph_buffers(8, torch.device("cpu"))
    buffers.state_slots.fill_(5)
    buffers.has_initial_state.fill_(True)
    seq = step([3, 0, 6], [1, 1, 1], [4, 2, 6])
    b.fill(seq, buffers, 4)
    view = b.graph_view(seq, buffers, 4)
    assert view.state_slots.tolist() == [4, 2, 6, 0]
    assert view.has_initial_state.tolist() == [True, False, True, False]
    assert view.is_decode and view.num_reqs == 4
    with pytest.raises(StepMetadataError, match="decode steps"):
        b.fill(step([0], [3], [1]), buffers, 4)


def test_a_chunk_size_tiles_extend_steps_for_the_chunked_kernels():
    b = GatedDeltaNetBuilder("triton", chunk_size=4)
    b.cache_group = 1
    view = b.build(step([0, 5, 9], [9, 1, 4], [3, 1, 2]))
    assert view.cu_seqlens.tolist() == [0, 9, 10, 14]
    assert view.chunk_indices.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [2, 0]]
    decode = b.build(step([3, 4], [1, 1], [1, 2]))
    assert decode.chunk_indices is None and decode.cu_seqlens is None
    assert builder().build(step([0], [9], [1])).chunk_indices is None  # no chunk size
