"""The PyTorch gated delta rule and causal conv1d against HF transformers' torch fallbacks."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from heron.ops.linear_attention.reference import (
    causal_conv1d,
    chunked_gated_delta_rule,
    recurrent_gated_delta_rule,
)

HEADS, KEY, VALUE = 3, 8, 6


def inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    q, k, v = rand(length, HEADS, KEY), rand(length, HEADS, KEY), rand(length, HEADS, VALUE)
    g = -torch.rand(length, HEADS, generator=gen) * 2  # log decay <= 0
    beta = torch.rand(length, HEADS, generator=gen)
    state = rand(HEADS, KEY, VALUE)
    return q, k, v, g, beta, state


def hf_rule(fn, q, k, v, g, beta, state, **kw):
    out, final = fn(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None] if state is not None else None,
        output_final_state=True, use_qk_l2norm_in_kernel=True, **kw,
    )  # fmt: skip
    return out[0], final[0]


@pytest.mark.parametrize("length", [1, 5, 21])
@pytest.mark.parametrize("with_state", [False, True])
def test_both_forms_equal_hf(length, with_state):
    q, k, v, g, beta, state = inputs(length)
    state = state if with_state else None
    ref_out, ref_state = hf_rule(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
    chunk_out, chunk_state = hf_rule(
        hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, state, chunk_size=8
    )
    for out, final in [
        recurrent_gated_delta_rule(q, k, v, g, beta, state),
        chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=8),
    ]:
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, ref_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunk_out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunk_state, ref_state, atol=1e-5, rtol=1e-5)


def test_a_sequence_split_in_two_continues_from_its_state():
    q, k, v, g, beta, _ = inputs(19, seed=1)
    whole, final = chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=4)
    first, mid = chunked_gated_delta_rule(q[:7], k[:7], v[:7], g[:7], beta[:7], chunk_size=4)
    second, end = recurrent_gated_delta_rule(q[7:], k[7:], v[7:], g[7:], beta[7:], mid)
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, final, atol=1e-5, rtol=1e-5)


def test_causal_conv1d_equals_hf_and_continues_from_its_state():
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(11, 10, generator=gen), torch.randn(10, 4, generator=gen)
    out, state = causal_conv1d(x, weight)
    ref = hf.causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(state, x[-3:].T)
    first, mid = causal_conv1d(x[:6], weight)
    second, end = causal_conv1d(x[6:7], weight, mid)  # a decode step
    third, end = causal_conv1d(x[7:], weight, end)
    torch.testing.assert_close(torch.cat([first, second, third]), out)
    torch.testing.assert_close(end, state)
    # HF's one-token update keeps the last K inputs as its state; the output agrees.
    hf_state = torch.cat([torch.zeros(10, 1), mid], 1)[None].clone()
    step = hf.causal_conv1d_update(x[6:7].T[None], hf_state, weight, None, activation="silu")
    torch.testing.assert_close(step[0].T, second)
