"""StepBatch packing and SequenceMetadata: cumulative lengths, field slicing, groups' parts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heron.cache.paged_parts import PagedParts, paged_layout
from heron.cache.recurrent_parts import RecurrentParts, RecurrentStepParts
from heron.metadata import SequenceMetadata, StepBatch, StepMetadataError

CPU = torch.device("cpu")


def _batch(query_lens, kv_lens, width=3, block_size=4):
    n, tokens = len(query_lens), sum(query_lens)
    batch = StepBatch(n, tokens, n, block_size, [paged_layout(n, tokens, width)])
    batch.query_lens[:] = query_lens
    batch.kv_lens[:] = kv_lens
    batch.token_ids[:] = np.arange(100, 100 + tokens)
    batch.positions[:] = np.arange(200, 200 + tokens)
    batch.group_parts[0]["slot_mapping"][:] = np.arange(300, 300 + tokens)
    batch.logits_indices[:] = np.cumsum(query_lens) - 1
    batch.group_parts[0]["block_tables"][:] = np.arange(400, 400 + n * width).reshape(n, width)
    batch.finish()
    return batch


def test_start_locs_are_cumsums_with_a_leading_zero():
    query_lens, kv_lens = [3, 1, 5, 2], [10, 1, 8, 6]
    seq = SequenceMetadata.from_step_batch(_batch(query_lens, kv_lens), CPU)
    zero = torch.zeros(1, dtype=torch.int64)
    q_expected = torch.cat([zero, torch.cumsum(torch.tensor(query_lens), 0)])
    assert torch.equal(seq.query_start_loc.long(), q_expected)
    assert seq.query_start_loc.dtype == torch.int32
    assert seq.query_start_host.tolist() == q_expected.tolist()
    assert seq.kv_lens.tolist() == kv_lens
    assert seq.query_lens_host.tolist() == query_lens and seq.kv_lens_host.tolist() == kv_lens
    assert (seq.num_reqs, seq.num_tokens) == (4, 11)
    assert (seq.max_query_len, seq.max_kv_len) == (5, 10)
    assert seq.block_size == 4 and not seq.is_decode


def test_every_field_slices_its_own_data():
    query_lens = [3, 1, 5]
    seq = SequenceMetadata.from_step_batch(_batch(query_lens, [4, 9, 5], width=2), CPU)
    assert seq.token_ids.tolist() == list(range(100, 109))
    assert seq.positions.tolist() == list(range(200, 209))
    paged = seq.parts(0, PagedParts)
    assert paged.slot_mapping.tolist() == list(range(300, 309))
    assert seq.logits_indices.tolist() == [2, 3, 8]
    assert paged.block_tables.shape == (3, 2)
    assert paged.block_tables.tolist() == [[400, 401], [402, 403], [404, 405]]
    # One packed buffer: every device field is a view of the same storage.
    ptr = seq.token_ids.untyped_storage().data_ptr()
    for t in (seq.positions, paged.slot_mapping, seq.kv_lens, paged.block_tables,
              seq.query_start_loc, seq.logits_indices, paged.table_starts):  # fmt: skip
        assert t.untyped_storage().data_ptr() == ptr


def test_decode_batch_is_flagged():
    seq = SequenceMetadata.from_step_batch(_batch([1, 1, 1], [7, 2, 30]), CPU)
    assert seq.is_decode and seq.max_query_len == 1 and seq.max_kv_len == 30
    assert seq.query_start_loc.tolist() == [0, 1, 2, 3]


def test_each_group_has_its_kinds_parts_in_one_packed_array():
    """A full group, a sliding group of its own (narrower) width and a recurrent group: each
    has exactly its kind's parts at its own sizes, all in one packed array."""
    from heron.ops.attention.paged import PagedAttentionBuilder

    n, tokens = 2, 3
    groups = [
        paged_layout(n, tokens, 3),
        paged_layout(n, tokens, 1),
        RecurrentStepParts().layout_of(n, tokens, 3),
    ]
    batch = StepBatch(n, tokens, n, 4, groups)
    shared = StepBatch.packed_size(n, tokens, n, [])
    # Per group: its rows of 16-aligned entries (a slot row, table rows, a start row; the
    # recurrent group's slot and state rows).
    assert batch.packed.numel() == shared + 16 * (1 + 2 + 1) * 2 + 16 * 2
    assert batch.packed.numel() == StepBatch.packed_size(n, tokens, n, groups)
    batch.query_lens[:] = [2, 1]
    batch.kv_lens[:] = [6, 5]
    full, sliding, recurrent = batch.group_parts
    full["block_tables"][:] = [[1, 2, 5], [3, 4, 0]]
    sliding["block_tables"][:] = [[7], [8]]  # rows from the window's first block
    sliding["table_starts"][:] = [1, 1]
    full["slot_mapping"][:] = [8, 9, 16]
    sliding["slot_mapping"][:] = [28, 29, 32]
    recurrent["state_slots"][:] = [2, 1]
    recurrent["has_saved_state"][:] = [1, 0]
    batch.finish()
    seq = SequenceMetadata.from_step_batch(batch, CPU)
    assert seq.num_groups == 3
    assert seq.parts(0, PagedParts).block_tables.tolist() == [[1, 2, 5], [3, 4, 0]]
    assert seq.parts(1, PagedParts).block_tables.tolist() == [[7], [8]]
    assert seq.parts(2, RecurrentParts).state_slots.tolist() == [2, 1]
    with pytest.raises(StepMetadataError, match="carries RecurrentParts, not PagedParts"):
        seq.parts(2, PagedParts)
    ptr = seq.token_ids.untyped_storage().data_ptr()
    for record in seq.group_parts:
        for t in vars(record).values():
            assert t.untyped_storage().data_ptr() == ptr

    full = PagedAttentionBuilder("reference", 4, None, 64)
    sliding = PagedAttentionBuilder("reference", 4, 4, 64)
    sliding.cache_group = 1
    assert full.build(seq).block_tables.tolist() == [[1, 2, 5], [3, 4, 0]]
    view = sliding.build(seq)
    assert view.block_tables.tolist() == [[7], [8]] and view.table_starts.tolist() == [1, 1]
    assert view.slot_mapping.tolist() == [28, 29, 32]
    # Graph buffers: fill copies the group's table (decode steps only).
    decode = StepBatch(n, n, n, 4, [paged_layout(n, n, 3), paged_layout(n, n, 2)])
    decode.query_lens[:] = 1
    decode.kv_lens[:] = [6, 5]
    decode.group_parts[1]["block_tables"][:] = [[0, 7], [0, 8]]
    decode.group_parts[1]["slot_mapping"][:] = [29, 32]
    decode.finish()
    dseq = SequenceMetadata.from_step_batch(decode, CPU)
    buffers = sliding.make_graph_buffers(4, CPU)
    sliding.fill(dseq, buffers, 4)
    view = sliding.graph_view(dseq, buffers, 4)
    assert view.block_tables[:2, :2].tolist() == [[0, 7], [0, 8]]
    assert view.slot_mapping[:2].tolist() == [29, 32]


def test_every_array_starts_aligned_whatever_the_sizes():
    """Each device field starts on 16 elements (64 bytes) and tables' rows are 16-aligned, so
    Triton's specialisation on pointer alignment and divisible strides never changes between
    steps; the host views write into the packed array itself."""
    for n, widths in [(3, [5]), (1, [1, 2]), (7, [33, 3])]:
        tokens = n * (n + 1) // 2
        groups = [paged_layout(n, tokens, w) for w in widths]
        groups.append(RecurrentStepParts().layout_of(n, tokens, 1))
        batch = StepBatch(n, tokens, n + 1, 16, groups)
        for parts, width in zip(batch.group_parts, widths):
            assert np.shares_memory(parts["block_tables"], batch.packed.numpy())
            assert parts["block_tables"].shape == (n, width)
        seq = SequenceMetadata.from_step_batch(batch, CPU)
        fields = [seq.token_ids, seq.positions, seq.kv_lens, seq.logits_indices]
        fields += [seq.query_start_loc]
        fields += [t for record in seq.group_parts for t in vars(record).values()]
        assert all(t.storage_offset() % 16 == 0 for t in fields)
        tables = [seq.parts(g, PagedParts).block_tables for g in range(len(widths))]
        assert all(t.stride(0) % 16 == 0 for t in tables)
