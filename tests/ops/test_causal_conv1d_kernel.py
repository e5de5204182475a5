"""The varlen prefill conv against the PyTorch reference request by request (Triton's
interpreter on the CPU, fp32), its lowering for Hopper, and bf16 on the GPU."""

from __future__ import annotations

import pytest
import torch
from triton_lowering import check_lowering

from heron.kernels.causal_conv1d import causal_conv1d_varlen
from heron.ops.linear_attention.builder import chunk_indices
from heron.ops.linear_attention.reference import causal_conv1d

C, W, CHUNK = 12, 4, 16  # C is no power of two: masked channel lanes
LENGTHS = [5, 1, 37, 2]  # one request spans three tiles; two are shorter than the state
SLOTS = torch.tensor([3, 1, 4, 2], dtype=torch.int32)  # shuffled; slot 0 is the null slot
HAS_STATE = torch.tensor([True, True, False, True])  # request 2 is new: its slot is stale


def case(dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)
    x, weight, conv_state = rand(sum(LENGTHS), C), rand(C, W), rand(5, C, W - 1)
    conv_state[4] = float("nan")  # never read: request 2 starts from zeros
    return x, weight, conv_state


def reference(x, weight, conv_state):
    """The operator's PyTorch extend path: each request's conv from its saved state or zeros."""
    out, states = torch.empty_like(x), conv_state.clone()
    start = 0
    for length, slot, keep in zip(LENGTHS, SLOTS.tolist(), HAS_STATE.tolist()):
        rows = slice(start, start + length)
        out[rows], states[slot] = causal_conv1d(x[rows], weight, conv_state[slot] if keep else None)
        start += length
    return out, states


def run_kernel(x, weight, conv_state):
    starts = torch.tensor([0, *LENGTHS]).cumsum(0)
    tiles = torch.from_numpy(chunk_indices(starts.numpy(), CHUNK)).to(x.device)
    # The slots as the builder hands them: the first column of the step's tables.
    tables = torch.zeros(len(SLOTS), 16, dtype=torch.int32, device=x.device)
    tables[:, 0] = SLOTS
    keep = HAS_STATE.to(x.device)
    return causal_conv1d_varlen(
        x, conv_state, weight, starts.to(x.device), tiles, CHUNK, tables[:, 0], keep
    )


def test_varlen_conv_equals_the_reference_per_request():
    x, weight, conv_state = case()
    want_out, want_states = reference(x, weight, conv_state)
    untouched = conv_state[0].clone()
    out = run_kernel(x, weight, conv_state)  # updates conv_state in place
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(conv_state[1:], want_states[1:])
    torch.testing.assert_close(conv_state[0], untouched)


def prefill_launches() -> None:
    """The launches of a Qwen3.5-0.8B prefill step in bf16 (for the lowering test)."""
    starts = torch.tensor([0, 100, 4196])
    tiles = torch.from_numpy(chunk_indices(starts.numpy(), 64))
    x = torch.empty(4196, 2 * 16 * 128 + 16 * 128, dtype=torch.bfloat16)
    conv_state = torch.empty(5, x.shape[1], 3, dtype=torch.bfloat16)
    weight = torch.empty(x.shape[1], 4, dtype=torch.bfloat16)
    slots, keep = torch.tensor([1, 2], dtype=torch.int32), torch.tensor([True, False])
    causal_conv1d_varlen(x, conv_state, weight, starts, tiles, 64, slots, keep)


def test_varlen_conv_lowers_for_hopper():
    assert check_lowering(
        "ops.test_causal_conv1d_kernel:prefill_launches",
        "heron.kernels.causal_conv1d:_conv_varlen_kernel",
        "heron.kernels.causal_conv1d:_conv_state_kernel",
    )


@pytest.mark.gpu
def test_bf16_varlen_conv_follows_fp32():
    x, weight, conv_state = case(torch.bfloat16, "cuda", seed=1)
    want_out, want_states = reference(*(t.float().cpu() for t in (x, weight, conv_state)))
    out = run_kernel(x, weight, conv_state)
    torch.testing.assert_close(out.float().cpu(), want_out, atol=2e-2, rtol=2e-2)
    # The new states are inputs (or old state entries) moved, not computed: exact.
    torch.testing.assert_close(conv_state[1:].float().cpu(), want_states[1:])
