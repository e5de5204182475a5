"""A gated-delta-rule layer's decode step in one launch: the causal conv update, the gating, the
delta rule and the gated RMSNorm with ``z`` (the three launches of ``gated_delta.py``'s two
kernels and ``rmsnorm.gated_rms_norm``), for decode at small batch where each of those is
bound by its launch and ramp rather than by its bytes.

One program per (row, key head): it convolves its key head's q and k channels and each of its
value heads' v channels, then runs each value head's whole state tile ``[K, V]`` (the norm
needs the whole head) through the rule and the norm. A program that owned one value head would
shift the conv state of q and k that the other value heads of its key head still read; a key
head's channels therefore belong to one program. Numerics and roundings are those of the
unfused kernels in sequence (the conv output and the rule's output rounded to the activation
dtype), the slot, ``has_state`` and null-slot rules too.

Given ``kept``, a row has ``q`` tokens, run as ``q`` decode steps in the program: the conv and
recurrent states after each token but the last go to ``kept``, and the next token reads them
back from there (after a barrier; the same values a register carry would hold, since a decode
step stores its state rounded to the state's dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.gated_delta import (
    check_conv_state,
    check_recurrent_state,
    conv_silu,
    delta_rule_token,
    l2_normed_qk,
    shift_conv_state,
)
from heron.kernels.pdl import pdl_launch, wait_for_previous_kernel
from heron.kernels.rmsnorm import gated_rms_scale

#: The largest ``K * V`` state tile (both padded to powers of two) one program holds.
MAX_STATE_TILE = 128 * 128


@triton.jit
def _conv_of(
    x_row, src, weight_ptr, cols, mask, load_mask, stride_conv_c, stride_weight_c,
    stride_weight_w, dtype: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    """Channels ``cols``' fp32 inputs of one token (from ``x_row``) and their conv output
    (:func:`conv_silu` from the conv states ``src``), rounded to the activation dtype as the
    unfused conv stores it, in fp32."""
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    weight = weight_ptr + cols * stride_weight_c
    out = conv_silu(x, src + cols * stride_conv_c, weight, stride_weight_w, mask, load_mask, WIDTH)
    return x, out.to(dtype).to(tl.float32)


@triton.jit
def _value_head_inputs(
    x_row, conv_src, conv_weight_ptr, v_cols, v_mask, load_mask, gate_row, a_row, b_row,
    a_log_ptr, dt_bias_ptr, head, vs, stride_conv_c, stride_weight_c, stride_weight_w,
    dtype: tl.constexpr, VALUE_DIM: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    """What one value head's step loads besides its state: its v channels' inputs and conv
    output (:func:`_conv_of`), a, b, A_log, dt_bias (fp32 scalars) and its gate (fp32 [V])."""
    x, v = _conv_of(
        x_row, conv_src, conv_weight_ptr, v_cols, v_mask, load_mask, stride_conv_c,
        stride_weight_c, stride_weight_w, dtype, WIDTH,
    )  # fmt: skip
    a = tl.load(a_row + head).to(tl.float32)
    b = tl.load(b_row + head).to(tl.float32)
    a_log = tl.load(a_log_ptr + head).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    gate = tl.load(gate_row + head * VALUE_DIM + vs, mask=v_mask, other=0.0).to(tl.float32)
    return x, v, a, b, a_log, dt_bias, gate


@triton.jit
def _fused_decode_kernel(
    x_ptr,  # [N * Q, conv_dim]: q (Hk * K) | k (Hk * K) | v (Hv * V), before the conv
    gate_ptr,  # [N * Q, Hv * V]: z
    a_ptr,  # [N * Q, Hv]
    b_ptr,  # [N * Q, Hv]
    conv_weight_ptr,  # [conv_dim, W] (any strides)
    a_log_ptr,  # [Hv]
    dt_bias_ptr,  # [Hv]
    norm_weight_ptr,  # [V]
    conv_state_ptr,  # [slots, conv_dim, W - 1]
    state_ptr,  # [slots, Hv, K, V]
    out_ptr,  # [N * Q, Hv, V]
    slots_ptr,
    has_state_ptr,
    conv_kept_ptr,  # [rows, Q - 1, conv_dim, W - 1] (unused with Q = 1)
    state_kept_ptr,  # [rows, Q - 1, Hv, K, V] (unused with Q = 1)
    stride_slots,
    stride_x,
    stride_gate,
    stride_ab,
    stride_weight_c,
    stride_weight_w,
    stride_conv_slot,
    stride_conv_c,
    stride_conv_kept_row,
    stride_conv_kept_token,
    stride_state_slot,
    stride_state_kept_row,
    stride_state_kept_token,
    eps,
    QUERY_LEN: tl.constexpr,
    NUM_KEY_HEADS: tl.constexpr,
    NUM_VALUE_HEADS: tl.constexpr,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    key_head = tl.program_id(1)
    per_key: tl.constexpr = NUM_VALUE_HEADS // NUM_KEY_HEADS
    ks, vs = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    k_mask, v_mask = ks < KEY_DIM, vs < VALUE_DIM
    tile_mask = k_mask[:, None] & v_mask[None, :]
    within = ks[:, None] * VALUE_DIM + vs[None, :]
    # Before the wait (as the decode attention loads cached keys): the slots and has_state
    # were copied before the step's kernels, and only this layer's kernel writes its states
    # (in earlier steps), so no running kernel writes what is loaded here: the first value
    # head's state, the largest load, overlaps the previous kernel's end.
    slot = tl.load(slots_ptr + row * stride_slots).to(tl.int64)
    keep = tl.load(has_state_ptr + row) != 0
    conv_slot = conv_state_ptr + slot * stride_conv_slot
    state_slot = state_ptr + slot * stride_state_slot
    first_state = tl.load(
        state_slot + key_head * per_key * KEY_DIM * VALUE_DIM + within,
        mask=tile_mask & keep,
        other=0.0,
    )
    norm_weight = tl.load(norm_weight_ptr + vs, mask=v_mask, other=0.0).to(tl.float32)
    wait_for_previous_kernel(USE_PDL)
    conv_kept = conv_kept_ptr + row.to(tl.int64) * stride_conv_kept_row
    state_kept = state_kept_ptr + row.to(tl.int64) * stride_state_kept_row
    q_cols = key_head * KEY_DIM + ks
    dtype = x_ptr.dtype.element_ty
    for t in tl.static_range(QUERY_LEN):
        # Token t reads the states token t - 1 wrote (in kept, a barrier between).
        if t == 0:
            conv_src, state_src, keep_t = conv_slot, state_slot, keep
        else:
            conv_src = conv_kept + (t - 1) * stride_conv_kept_token
            state_src = state_kept + (t - 1) * stride_state_kept_token
            keep_t = True
            tl.debug_barrier()
        if t == QUERY_LEN - 1:
            conv_dst, state_dst = conv_slot, state_slot
        else:
            conv_dst = conv_kept + t * stride_conv_kept_token
            state_dst = state_kept + t * stride_state_kept_token
        token = row * QUERY_LEN + t
        x_row = x_ptr + token * stride_x
        a_row, b_row = a_ptr + token * stride_ab, b_ptr + token * stride_ab
        gate_row = gate_ptr + token * stride_gate
        # The token's loads first (the first value head's with its key head's), then its maths
        # and stores: a load after a store would wait for its latency there.
        k_cols = q_cols + NUM_KEY_HEADS * KEY_DIM
        q_x, q = _conv_of(
            x_row, conv_src, conv_weight_ptr, q_cols, k_mask, k_mask & keep_t, stride_conv_c,
            stride_weight_c, stride_weight_w, dtype, WIDTH,
        )  # fmt: skip
        k_x, k = _conv_of(
            x_row, conv_src, conv_weight_ptr, k_cols, k_mask, k_mask & keep_t, stride_conv_c,
            stride_weight_c, stride_weight_w, dtype, WIDTH,
        )  # fmt: skip
        for j in tl.static_range(per_key):
            head = key_head * per_key + j
            v_cols = 2 * NUM_KEY_HEADS * KEY_DIM + head * VALUE_DIM + vs
            head_tile = head * KEY_DIM * VALUE_DIM + within
            v_x, v, a, b, a_log, dt_bias, gate = _value_head_inputs(
                x_row, conv_src, conv_weight_ptr, v_cols, v_mask, v_mask & keep_t, gate_row,
                a_row, b_row, a_log_ptr, dt_bias_ptr, head, vs, stride_conv_c, stride_weight_c,
                stride_weight_w, dtype, VALUE_DIM, WIDTH,
            )  # fmt: skip
            if t == 0 and j == 0:
                s = first_state
            else:
                s = tl.load(state_src + head_tile, mask=tile_mask & keep_t, other=0.0)
            if j == 0:
                q, k = l2_normed_qk(q, k, KEY_DIM)
            s, out = delta_rule_token(s.to(tl.float32), q, k, v, a, b, a_log, dt_bias)
            tl.store(state_dst + head_tile, s.to(state_ptr.dtype.element_ty), mask=tile_mask)
            out = out.to(dtype).to(tl.float32)  # the rule's output in the activation dtype
            normed = gated_rms_scale(
                out[None, :], gate[None, :], norm_weight, VALUE_DIM, eps, dtype
            )
            out_cols = (token * NUM_VALUE_HEADS + head) * VALUE_DIM + vs[None, :]
            tl.store(out_ptr + out_cols, normed.to(dtype), mask=v_mask[None, :])
            v_src, v_dst = conv_src + v_cols * stride_conv_c, conv_dst + v_cols * stride_conv_c
            shift_conv_state(v_x, v_src, v_dst, v_mask, v_mask & keep_t, WIDTH)
        q_src, q_dst = conv_src + q_cols * stride_conv_c, conv_dst + q_cols * stride_conv_c
        shift_conv_state(q_x, q_src, q_dst, k_mask, k_mask & keep_t, WIDTH)
        k_src, k_dst = conv_src + k_cols * stride_conv_c, conv_dst + k_cols * stride_conv_c
        shift_conv_state(k_x, k_src, k_dst, k_mask, k_mask & keep_t, WIDTH)


def fused_decode_applies(key_dim: int, value_dim: int) -> bool:
    """Whether a value head's whole state tile fits one program of :func:`fused_gdn_decode`."""
    return triton.next_power_of_2(key_dim) * triton.next_power_of_2(value_dim) <= MAX_STATE_TILE


def fused_gdn_decode(
    x: torch.Tensor,
    gate: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    num_key_heads: int,
    kept: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """``causal_conv1d_update``, ``gated_delta_decode`` and ``gated_rms_norm`` in one launch:
    x [N, conv_dim] (before the conv), gate (z) [N, Hv * V], a, b [N, Hv]; the conv state and
    the recurrent state of ``slots[n]`` updated in place (zeros where not ``has_state[n]``).
    With ``kept`` (the conv and the recurrent states after each token but the last, [>= N,
    q - 1, *state]), ``q`` tokens per row. Returns the normed output [N * q, Hv, V] in x's
    dtype. ``num_warps``: the launch's warps per program (benchmarks compare them)."""
    conv_kept, state_kept = kept if kept is not None else (None, None)
    q, n = check_conv_state(x, conv_state, conv_weight, conv_kept)
    check_recurrent_state(state, state_kept, n, a, b)
    _, num_value_heads, key_dim, value_dim = state.shape
    if not fused_decode_applies(key_dim, value_dim):
        raise ValueError(f"a [{key_dim}, {value_dim}] state tile is too large for one program")
    if gate.shape != (x.shape[0], num_value_heads * value_dim) or gate.stride(1) != 1:
        raise ValueError(f"gate {tuple(gate.shape)} must be [{x.shape[0]}, Hv * V], unit stride")
    if norm_weight.shape != (value_dim,):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} must be [{value_dim}]")
    out = torch.empty(x.shape[0], num_value_heads, value_dim, dtype=x.dtype, device=x.device)
    if n:
        _fused_decode_kernel[(n, num_key_heads)](
            x,
            gate,
            a,
            b,
            conv_weight,
            A_log,
            dt_bias,
            norm_weight,
            conv_state,
            state,
            out,
            slots,
            has_state,
            conv_state if conv_kept is None else conv_kept,
            state if state_kept is None else state_kept,
            slots.stride(0),
            x.stride(0),
            gate.stride(0),
            a.stride(0),
            conv_weight.stride(0),
            conv_weight.stride(1),
            conv_state.stride(0),
            conv_state.stride(1),
            0 if conv_kept is None else conv_kept.stride(0),
            0 if conv_kept is None else conv_kept.stride(1),
            state.stride(0),
            0 if state_kept is None else state_kept.stride(0),
            0 if state_kept is None else state_kept.stride(1),
            eps,
            QUERY_LEN=q,
            NUM_KEY_HEADS=num_key_heads,
            NUM_VALUE_HEADS=num_value_heads,
            KEY_DIM=key_dim,
            VALUE_DIM=value_dim,
            WIDTH=conv_weight.shape[1],
            BLOCK_K=triton.next_power_of_2(key_dim),
            BLOCK_V=triton.next_power_of_2(value_dim),
            num_warps=num_warps,
            **pdl_launch(x.device),
        )
    return out
