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
    kv_expected = torch.cat([zero, torch.cumsum(torch.tensor(kv_lens), 0)])
    assert torch.equal(seq.query_start_loc.long(), q_expected)
    assert torch.equal(seq.kv_start_loc.long(), kv_expected)
    assert seq.query_start_loc.dtype == torch.int32
    assert seq.query_start_host.tolist() == q_expected.tolist()
    assert seq.query_lens.tolist() == query_lens and seq.kv_lens.tolist() == kv_lens
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
    for t in (seq.positions, seq.slot_mapping, seq.query_lens, seq.kv_lens, seq.block_tables,
              seq.query_start_loc, seq.kv_start_loc, seq.logits_indices):  # fmt: skip
        assert t.untyped_storage().data_ptr() == ptr


def test_decode_batch_is_flagged():
    seq = SequenceMetadata.from_step_batch(_batch([1, 1, 1], [7, 2, 30]), CPU)
    assert seq.is_decode and seq.max_query_len == 1 and seq.max_kv_len == 30
    assert seq.query_start_loc.tolist() == [0, 1, 2, 3]
    assert seq.kv_start_loc.tolist() == [0, 7, 9, 39]
