"""The GPU prefill path (Heron's varlen conv, fla-core's chunked rule, states gathered and
scattered by slot) in bf16 against the fp32 token-by-token recurrence, request by request."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from heron.ops.linear_attention.builder import GatedDeltaNetView, chunk_indices
from heron.ops.linear_attention.fla_prefill import FLA_CHUNK_SIZE, chunked_prefill
from heron.ops.linear_attention.reference import causal_conv1d, recurrent_gated_delta_rule

HK, HV, K, V, W = 2, 4, 128, 128, 4
CONV = 2 * HK * K + HV * V
LENGTHS = [70, 1, 130, 5]  # across chunk boundaries, and a one-token extend row
SLOTS = [4, 2, 5, 1]  # shuffled; slots 0 and 3 belong to nobody this step
HAS_STATE = [True, False, True, False]


def reference(x, g, beta, weight, conv_state, state):
    """Each request from its saved states (or zeros) in fp32: output, and both states after."""
    out = torch.empty(x.shape[0], HV, V)
    conv_state, state = conv_state.clone(), state.clone()
    start = 0
    for length, slot, keep in zip(LENGTHS, SLOTS, HAS_STATE):
        rows = slice(start, start + length)
        conv_out, conv_state[slot] = causal_conv1d(
            x[rows], weight, conv_state[slot] if keep else None
        )
        q, k, v = conv_out.split([HK * K, HK * K, HV * V], dim=-1)
        q, k = (t.reshape(length, HK, K).repeat_interleave(HV // HK, dim=1) for t in (q, k))
        out[rows], state[slot] = recurrent_gated_delta_rule(
            q, k, v.reshape(length, HV, V), g[rows], beta[rows], state[slot] if keep else None
        )
        start += length
    return out, conv_state, state


@pytest.mark.gpu
def test_bf16_fla_prefill_follows_the_fp32_recurrence(fla_chunk_rule):
    gen = torch.Generator().manual_seed(0)
    tokens = sum(LENGTHS)
    x = torch.randn(tokens, CONV, generator=gen).bfloat16()
    weight = (torch.randn(CONV, W, generator=gen) * 0.5).bfloat16()
    g = -torch.rand(tokens, HV, generator=gen).mul(0.5).exp() * F.softplus(
        torch.randn(tokens, HV, generator=gen)
    )
    beta = torch.rand(tokens, HV, generator=gen)
    conv_state = torch.randn(6, CONV, W - 1, generator=gen).bfloat16()
    state = torch.randn(6, HV, K, V, generator=gen) * 0.1
    state[2] = float("nan")  # request 1 is new: its slot is stale and must not be read
    conv_state[2] = float("nan")
    want_out, want_conv, want_state = reference(
        x.float(), g, beta, weight.float(), conv_state.float(), state
    )

    starts = np.cumsum([0, *LENGTHS])
    view = GatedDeltaNetView(
        is_decode=False,
        num_reqs=len(LENGTHS),
        state_slots=torch.tensor(SLOTS, dtype=torch.int32, device="cuda"),
        has_initial_state=torch.tensor(HAS_STATE, device="cuda"),
        query_start_loc=torch.from_numpy(starts).int().cuda(),
        query_start_host=starts,
        max_query_len=max(LENGTHS),
        cu_seqlens=torch.from_numpy(starts).cuda(),
        chunk_indices=torch.from_numpy(chunk_indices(starts, FLA_CHUNK_SIZE)).cuda(),
    )
    conv_gpu, state_gpu = conv_state.cuda(), state.cuda()
    out = chunked_prefill(
        fla_chunk_rule, x.cuda(), g.cuda(), beta.cuda(), weight.cuda(), conv_gpu, state_gpu,
        HK, view,
    )  # fmt: skip
    torch.testing.assert_close(out.float().cpu(), want_out, atol=5e-2, rtol=5e-2)
    used = torch.tensor(SLOTS)
    torch.testing.assert_close(conv_gpu[used].float().cpu(), want_conv[used])
    torch.testing.assert_close(state_gpu[used].cpu(), want_state[used], atol=5e-2, rtol=5e-2)
    # Slots outside the step are left as they were.
    assert torch.equal(state_gpu[[0, 3]].cpu(), state[[0, 3]])
