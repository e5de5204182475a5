"""The gated-delta-rule decode kernels against the PyTorch reference (Triton's interpreter on
the CPU, fp32), their lowering for Hopper, and bf16 on the GPU against the fp32 recurrence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_lowering import check_lowering

from heron.kernels.gated_delta import causal_conv1d_update, gated_delta_decode
from heron.ops.linear_attention.reference import causal_conv1d_step, gated_delta_step, prepare_qk

HK, HV, K, V, W = 2, 4, 8, 6, 4  # V is no power of two: masked value lanes
CONV = 2 * HK * K + HV * V
SLOTS = torch.tensor([2, 0, 1], dtype=torch.int32)  # row 1 is a padded row on the null slot
HAS_STATE = torch.tensor([True, False, False])  # row 2 is a new request: its slot is stale


def reference(x, a, b, A_log, dt_bias, weight, conv_state, state, keep=HAS_STATE):
    """The operator's PyTorch decode path on copies: (conv output, output, conv_state, state)
    afterwards."""
    conv_state, state = conv_state.clone(), state.clone()
    slots = SLOTS.long()
    conv_in = torch.where(keep[:, None, None], conv_state[slots], 0)
    conv_out, new_conv = causal_conv1d_step(x, weight, conv_in)
    q, k, v = conv_out.split([HK * K, HK * K, HV * V], dim=-1)
    q, k = (t.reshape(-1, HK, K).repeat_interleave(HV // HK, dim=1) for t in (q, k))
    q, k = prepare_qk(q, k)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    s = torch.where(keep[:, None, None, None], state[slots], 0)
    out, s = gated_delta_step(q, k, v.reshape(-1, HV, V), g, b.sigmoid(), s)
    real = slots != 0
    conv_state[slots[real]], state[slots[real]] = new_conv[real], s[real]
    return conv_out, out, conv_state, state


def case(dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)
    x, a, b = rand(3, CONV), rand(3, HV), rand(3, HV)
    A_log, dt_bias, weight = rand(HV).float().abs().log(), rand(HV).float(), rand(CONV, W)
    conv_state, state = rand(3, CONV, W - 1), rand(3, HV, K, V).float()
    return x, a, b, A_log, dt_bias, weight, conv_state, state


def run_kernels(x, a, b, A_log, dt_bias, weight, conv_state, state, keep=HAS_STATE):
    # The slots as the builder hands them: the first column of the step's tables.
    tables = torch.zeros(len(SLOTS), 16, dtype=torch.int32, device=x.device)
    tables[:, 0] = SLOTS
    slots, keep = tables[:, 0], keep.to(x.device)
    conv_out = causal_conv1d_update(x, conv_state, weight, slots, keep)
    out = gated_delta_decode(conv_out, a, b, A_log, dt_bias, state, slots, keep, HK)
    return conv_out, out


def test_decode_kernels_equal_the_reference():
    inputs = case()
    x, a, b, A_log, dt_bias, weight, conv_state, state = inputs
    want_conv, want_out, want_conv_state, want_state = reference(*inputs)
    conv_out, out = run_kernels(*inputs)  # updates conv_state and state in place
    torch.testing.assert_close(conv_out, want_conv)
    torch.testing.assert_close(out, want_out)
    # Real rows' slots hold the new states (slot 2 continued, slot 1 started from zeros).
    torch.testing.assert_close(conv_state[1:], want_conv_state[1:])
    torch.testing.assert_close(state[1:], want_state[1:])
    torch.testing.assert_close(conv_state[1, :, :-1], torch.zeros(CONV, W - 2))


def decode_launches() -> None:
    """The launches of a Qwen3.5-0.8B decode step in bf16, and of a verification step of 4
    tokens per row (for the lowering test)."""
    slots, keep = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.bool)
    conv_state = torch.empty(5, 2 * 16 * 128 + 16 * 128, 3, dtype=torch.bfloat16)
    weight = torch.empty(conv_state.shape[1], 4, dtype=torch.bfloat16)
    state = torch.empty(5, 16, 128, 128)
    bias = torch.empty(16)
    for q in (1, 4):
        x = torch.empty(4 * q, conv_state.shape[1], dtype=torch.bfloat16)
        ab = torch.empty(4 * q, 32, dtype=torch.bfloat16)
        conv_kept = torch.empty(4, 3, *conv_state.shape[1:], dtype=torch.bfloat16)[:, : q - 1]
        state_kept = torch.empty(4, 3, *state.shape[1:])[:, : q - 1]
        kept = q > 1
        causal_conv1d_update(x, conv_state, weight, slots, keep, conv_kept if kept else None)
        gated_delta_decode(
            x, ab[:, :16], ab[:, 16:], bias, bias, state, slots, keep, 16,
            state_kept if kept else None,
        )  # fmt: skip


def test_decode_kernels_lower_for_hopper():
    assert check_lowering(
        "ops.test_gated_delta_kernels:decode_launches",
        "heron.kernels.gated_delta:_conv_update_kernel",
        "heron.kernels.gated_delta:_gated_delta_decode_kernel",
    )


@pytest.mark.gpu
def test_bf16_decode_kernels_follow_the_fp32_recurrence():
    """bf16 inputs and conv state, fp32 recurrent state, against the fp32 reference of the
    same (bf16-rounded) inputs, over a few steps so the state's errors would accumulate."""
    inputs = list(case(torch.bfloat16, "cuda", seed=3))
    fp32 = [t.float().cpu() for t in inputs]
    keep = HAS_STATE
    for _ in range(8):
        _, want_out, fp32[6], fp32[7] = reference(*fp32, keep=keep)
        _, out = run_kernels(*inputs, keep=keep)
        torch.testing.assert_close(out.cpu(), want_out, atol=5e-2, rtol=5e-2)
        keep = torch.tensor([True, False, True])  # every real row continues from now on
        inputs[0] = torch.randn_like(inputs[0])
        fp32[0] = inputs[0].float().cpu()
