"""Refused proposals roll back: a request's tables shrink to its computed tokens in every group,
the blocks go to the head of the free queue, hashes stay only on blocks of known tokens, and the
allocation fast path (the headroom) follows the shorter tables."""

from __future__ import annotations

import pytest
from test_coordinator import FULL, SLIDING, assert_idle, coordinator, make_request


def test_truncate_gives_back_the_refused_tokens_blocks():
    bs, window, k = 2, 4, 3
    kv = coordinator([40, 40], bs, [None, window])
    r = make_request("a", range(6))
    assert kv.allocate_slots(r, 6)
    r.num_computed_tokens = 6
    r.append_output_token(100)  # the step's last token; proposals follow it
    for accepted in (0, 3, 1, 2, 0):
        computed, known = r.num_computed_tokens, len(r.all_token_ids)
        assert kv.allocate_slots(r, 1 + k)  # the last token and k proposals
        tables = kv.block_tables("a")
        assert len(tables[FULL]) == -(-(computed + 1 + k) // bs)
        for g in (FULL, SLIDING):  # only blocks of known tokens are registered
            assert len(kv.groups[g].block_hashes("a")) <= known // bs
        dropped = tables[FULL][-(-(computed + 1 + accepted) // bs) :]
        r.num_computed_tokens += 1 + k - (k - accepted)  # the step ran; k - accepted refused
        kv.truncate(r, r.num_computed_tokens)
        tables = kv.block_tables("a")
        assert len(tables[FULL]) == len(tables[SLIDING]) == -(-r.num_computed_tokens // bs)
        # the freed blocks, in table order, are the next ones handed out
        assert list(kv.groups[FULL]._pool.free_queue)[: len(dropped)] == dropped
        # the headroom shrank with the table (the fast path never covers a dropped block)
        assert kv._headroom["a"].tokens <= len(tables[FULL]) * bs
        for token in range(accepted + 1):
            r.append_output_token(200 + token)
    kv.free(r)
    assert_idle(kv)


def test_truncate_never_drops_registered_blocks():
    kv = coordinator([20], 2)
    r = make_request("a", range(8))
    assert kv.allocate_slots(r, 8)  # 4 full blocks of known tokens: registered
    r.num_computed_tokens = 8
    with pytest.raises(RuntimeError, match="would drop registered blocks"):
        kv.truncate(r, 4)
