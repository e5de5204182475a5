"""Decode kernels of the gated-delta-rule layer, updating each row's state in place in its slot.

Two launches per layer and step: :func:`causal_conv1d_update` (the conv over ``[q|k|v]`` from
the row's conv state, SiLU, the state shifted by one token) and :func:`gated_delta_decode` (the
gating ``g``/``beta`` from ``a``/``b``, q/k L2 norms, one step of the delta rule on the row's
recurrent state, the output). A row without a saved state starts from zeros whatever its slot
holds; padded graph rows point at the null slot 0. Numerics follow
``heron.ops.linear_attention.reference`` (fp32 state, fp32 maths).

Both read each row's states at ``slots[n]`` and write them back there, or, given ``into``
(``(states, rows)``: another tensor of the same per-row layout and each row's place in it), write
them there instead: a verification step chains its tokens' states through its own buffers
(read from the slot, written to the buffer, ..., read from the buffer, written to the slot), so
each token moves a state once in and once out, as a decode step does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_update_kernel(
    x_ptr,  # [N, C]
    state_ptr,  # [slots, C, W - 1]: read
    weight_ptr,  # [C, W] (any strides)
    out_ptr,  # [N, C]
    slots_ptr,
    has_state_ptr,
    dst_ptr,  # [rows, C, W - 1]: written (may be state_ptr)
    dst_rows_ptr,
    channels,
    stride_slots,
    stride_x,
    stride_state_slot,
    stride_state_c,
    stride_dst_rows,
    stride_dst_row,
    stride_weight_c,
    stride_weight_w,
    stride_out,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < channels
    slot = tl.load(slots_ptr + row * stride_slots).to(tl.int64)
    keep = tl.load(has_state_ptr + row) != 0
    state = state_ptr + slot * stride_state_slot + cols * stride_state_c
    dst_row = tl.load(dst_rows_ptr + row * stride_dst_rows).to(tl.int64)
    dst = dst_ptr + dst_row * stride_dst_row + cols * stride_state_c
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w_last = tl.load(weight_ptr + cols * stride_weight_c + (WIDTH - 1) * stride_weight_w, mask=mask)
    acc = x * w_last.to(tl.float32)
    # The state's entries, oldest first; after the step each moves one place towards the
    # front and x becomes the newest.
    for i in tl.static_range(WIDTH - 1):
        s = tl.load(state + i, mask=mask & keep, other=0.0)
        w = tl.load(weight_ptr + cols * stride_weight_c + i * stride_weight_w, mask=mask)
        acc += s.to(tl.float32) * w.to(tl.float32)
        if i > 0:
            tl.store(dst + i - 1, s, mask=mask)
    tl.store(dst + WIDTH - 2, x.to(dst_ptr.dtype.element_ty), mask=mask)
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One token per row: x [N, C] -> SiLU(conv) [N, C]; ``conv_state[slots[n]]`` [C, W - 1]
    is read (zeros where not ``has_state[n]``) and shifted in place, or into
    ``states[rows[n]]`` for ``into = (states, rows)``. ``weight``: [C, W]; ``slots`` may be
    strided (a column of the step's tables), ``has_state`` is contiguous."""
    n, channels = x.shape
    width = weight.shape[1]
    dst, dst_rows = into if into is not None else (conv_state, slots)
    for states in (conv_state, dst):
        if states.shape[1:] != (channels, width - 1) or states.stride()[1:] != (width - 1, 1):
            raise ValueError(f"conv state {tuple(states.shape)} does not fit x and weight")
    if x.stride(1) != 1:
        raise ValueError("x's rows must be contiguous")
    out = torch.empty_like(x)
    if n:
        block = min(256, triton.next_power_of_2(channels))
        _conv_update_kernel[(n, triton.cdiv(channels, block))](
            x,
            conv_state,
            weight,
            out,
            slots,
            has_state,
            dst,
            dst_rows,
            channels,
            slots.stride(0),
            x.stride(0),
            conv_state.stride(0),
            conv_state.stride(1),
            dst_rows.stride(0),
            dst.stride(0),
            weight.stride(0),
            weight.stride(1),
            out.stride(0),
            WIDTH=width,
            BLOCK=block,
        )
    return out


@triton.jit
def _gated_delta_decode_kernel(
    qkv_ptr,  # [N, conv_dim]: q (Hk * K) | k (Hk * K) | v (Hv * V)
    a_ptr,  # [N, Hv]
    b_ptr,  # [N, Hv]
    a_log_ptr,  # [Hv]
    dt_bias_ptr,  # [Hv]
    state_ptr,  # [slots, Hv, K, V]: read
    out_ptr,  # [N, Hv, V]
    slots_ptr,
    has_state_ptr,
    dst_ptr,  # [rows, Hv, K, V]: written (may be state_ptr)
    dst_rows_ptr,
    stride_slots,
    stride_qkv,
    stride_ab,
    stride_state_slot,
    stride_dst_rows,
    stride_dst_row,
    stride_out,
    NUM_KEY_HEADS: tl.constexpr,
    NUM_VALUE_HEADS: tl.constexpr,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // (NUM_VALUE_HEADS // NUM_KEY_HEADS)
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = ks < KEY_DIM, vs < VALUE_DIM
    qkv = qkv_ptr + row * stride_qkv
    q = tl.load(qkv + key_head * KEY_DIM + ks, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(qkv + (NUM_KEY_HEADS + key_head) * KEY_DIM + ks, mask=k_mask, other=0.0)
    k = k.to(tl.float32)
    v_offset = 2 * NUM_KEY_HEADS * KEY_DIM + head * VALUE_DIM
    v = tl.load(qkv + v_offset + vs, mask=v_mask, other=0.0).to(tl.float32)
    # L2 norms (fla's form), q scaled by key_dim ** -0.5.
    q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * (KEY_DIM**-0.5)
    k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
    a = tl.load(a_ptr + row * stride_ab + head).to(tl.float32)
    b = tl.load(b_ptr + row * stride_ab + head).to(tl.float32)
    dt = a + tl.load(dt_bias_ptr + head).to(tl.float32)
    softplus = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus)
    beta = tl.sigmoid(b)

    slot = tl.load(slots_ptr + row * stride_slots).to(tl.int64)
    keep = tl.load(has_state_ptr + row) != 0
    within = head * KEY_DIM * VALUE_DIM + ks[:, None] * VALUE_DIM + vs[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    s = tl.load(state_ptr + slot * stride_state_slot + within, mask=mask & keep, other=0.0)
    s = s.to(tl.float32) * decay
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s += k[:, None] * delta[None, :]
    out = tl.sum(s * q[:, None], axis=0)
    dst_row = tl.load(dst_rows_ptr + row * stride_dst_rows).to(tl.int64)
    dst = dst_ptr + dst_row * stride_dst_row + within
    tl.store(dst, s.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + row * stride_out + head * VALUE_DIM + vs, out, mask=v_mask)


def gated_delta_decode(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    num_key_heads: int,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One delta-rule step per row on ``state[slots[n]]`` [Hv, K, V] (zeros where not
    ``has_state[n]``), written back in place, or into ``states[rows[n]]`` for ``into = (states,
    rows)``; qkv: the convolved ``[q|k|v]`` [N, conv_dim]; a, b: [N, Hv]. Returns [N, Hv, V] in
    fp32."""
    n = qkv.shape[0]
    _, num_value_heads, key_dim, value_dim = state.shape
    dst, dst_rows = into if into is not None else (state, slots)
    for states in (state, dst):
        if states.shape[1:] != state.shape[1:] or states.stride()[1:] != (
            key_dim * value_dim,
            value_dim,
            1,
        ):
            raise ValueError("each slot's state must be contiguous")
    if qkv.stride(1) != 1 or a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0):
        raise ValueError("qkv, a and b need contiguous rows, a and b of one stride")
    out = torch.empty(n, num_value_heads, value_dim, dtype=torch.float32, device=qkv.device)
    if n:
        block_v = min(32, triton.next_power_of_2(value_dim))
        _gated_delta_decode_kernel[(n, num_value_heads, triton.cdiv(value_dim, block_v))](
            qkv,
            a,
            b,
            A_log,
            dt_bias,
            state,
            out,
            slots,
            has_state,
            dst,
            dst_rows,
            slots.stride(0),
            qkv.stride(0),
            a.stride(0),
            state.stride(0),
            dst_rows.stride(0),
            dst.stride(0),
            out.stride(0),
            NUM_KEY_HEADS=num_key_heads,
            NUM_VALUE_HEADS=num_value_heads,
            KEY_DIM=key_dim,
            VALUE_DIM=value_dim,
            BLOCK_K=triton.next_power_of_2(key_dim),
            BLOCK_V=block_v,
            num_warps=4,
        )
    return out
