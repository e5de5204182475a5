"""StepBatch packing and SequenceMetadata: cumulative lengths and field slicing."""

from __future__ import annotations

import numpy as np
import torch

from heron.metadata import SequenceMetadata, StepBatch

CPU = torch.device("cpu")


def _batch(query_lens, kv_lens, width=3, block_size=4):
    n, tokens = len(query_lens), sum(query_lens)
    batch = StepBatch(n, tokens, n, width, block_size)
    batch.query_lens[:] = query_lens
    batch.kv_lens[:] = kv_lens
    batch.token_ids[:] = np.arange(100, 100 + tokens)
    batch.positions[:] = np.arange(200, 200 + tokens)
    batch.slot_mapping[:] = np.arange(300, 300 + tokens)
    batch.logits_indices[:] = np.cumsum(query_lens) - 1
    batch.block_tables[:] = np.arange(400, 400 + n * width).reshape(n, width)
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
    assert seq.slot_mapping.tolist() == list(range(300, 309))
    assert seq.logits_indices.tolist() == [2, 3, 8]
    assert seq.block_tables.shape == (3, 2)
    assert seq.block_tables.tolist() == [[400, 401], [402, 403], [404, 405]]
    # One packed buffer: every device field is a view of the same storage.
    ptr = seq.token_ids.untyped_storage().data_ptr()
    for t in (seq.positions, seq.slot_mapping, seq.kv_lens, seq.block_tables,
              seq.query_start_loc, seq.logits_indices, *seq.group_table_starts):  # fmt: skip
        assert t.untyped_storage().data_ptr() == ptr


def test_decode_batch_is_flagged():
    seq = SequenceMetadata.from_step_batch(_batch([1, 1, 1], [7, 2, 30]), CPU)
    assert seq.is_decode and seq.max_query_len == 1 and seq.max_kv_len == 30
    assert seq.query_start_loc.tolist() == [0, 1, 2, 3]


def test_one_table_and_slot_mapping_per_cache_group_in_one_packed_array():
    from heron.ops.attention.paged import PagedAttentionBuilder

    n, tokens, width = 2, 3, 2
    batch = StepBatch(n, tokens, n, width, 4, num_groups=2)
    assert batch.packed.numel() == StepBatch.packed_size(n, tokens, n, width, num_groups=2)
    batch.query_lens[:] = [2, 1]
    batch.kv_lens[:] = [6, 5]
    batch.group_block_tables[0] = [[1, 2], [3, 4]]
    batch.group_block_tables[1] = [[0, 7], [0, 8]]  # a sliding group: slid-out entries are null
    batch.group_slot_mappings[0] = [8, 9, 16]
    batch.group_slot_mappings[1] = [28, 29, 32]
    batch.finish()
    assert batch.block_tables.tolist() == [[1, 2], [3, 4]]  # group 0's
    seq = SequenceMetadata.from_step_batch(batch, CPU)
    assert seq.num_groups == 2
    assert seq.block_tables.tolist() == [[1, 2], [3, 4]]
    assert seq.slot_mapping.tolist() == [8, 9, 16]
    assert seq.group_block_tables[1].tolist() == [[0, 7], [0, 8]]
    for t in (*seq.group_block_tables, *seq.group_slot_mappings):
        assert t.untyped_storage().data_ptr() == seq.token_ids.untyped_storage().data_ptr()

    full = PagedAttentionBuilder("reference", 4, None, 64)
    sliding = PagedAttentionBuilder("reference", 4, 4, 64)
    sliding.cache_group = 1
    assert full.build(seq).block_tables.tolist() == [[1, 2], [3, 4]]
    view = sliding.build(seq)
    assert view.block_tables.tolist() == [[0, 7], [0, 8]]
    assert view.slot_mapping.tolist() == [28, 29, 32]
    # Graph buffers: fill copies the group's table (decode steps only).
    decode = StepBatch(n, n, n, width, 4, num_groups=2)
    decode.query_lens[:] = 1
    decode.kv_lens[:] = [6, 5]
    decode.group_block_tables[1] = [[0, 7], [0, 8]]
    decode.group_slot_mappings[1] = [29, 32]
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
    for n, width, groups in [(3, 5, 1), (1, 1, 2), (7, 33, 2)]:
        query_lens = list(range(1, n + 1))
        batch = StepBatch(n, sum(query_lens), n + 1, width, 16, num_groups=groups)
        assert np.shares_memory(batch.group_block_tables, batch.packed.numpy())
        assert batch.group_block_tables.shape == (groups, n, width)
        seq = SequenceMetadata.from_step_batch(batch, CPU)
        fields = [seq.token_ids, seq.positions, seq.kv_lens, seq.logits_indices]
        fields += [seq.query_start_loc, *seq.group_table_starts]
        fields += [*seq.group_slot_mappings, *seq.group_block_tables]
        assert all(t.storage_offset() % 16 == 0 for t in fields)
        assert all(t.stride(0) % 16 == 0 for t in seq.group_block_tables)
