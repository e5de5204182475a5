"""The decode table width covers every row a window's first-block rule can produce."""

import pytest
import torch

from heron.cache.paged import SlidingWindowSpec, paged_table_width


@pytest.mark.parametrize("window,block_size", [(1, 4), (5, 4), (8, 4), (9, 4), (64, 16)])
def test_width_is_the_widest_decode_row(window, block_size):
    spec = SlidingWindowSpec(block_size, torch.float32, 1, 8, window)
    max_model_len = 200
    # A decode token at position p reads blocks first_table_block(p) .. p // block_size.
    widest = max(p // block_size - spec.first_table_block(p) + 1 for p in range(max_model_len))
    assert paged_table_width(max_model_len, block_size, window) == widest
    assert paged_table_width(max_model_len, block_size, None) == -(-max_model_len // block_size)
