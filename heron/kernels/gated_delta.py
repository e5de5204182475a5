"""Decode kernels of the gated-delta-rule layer, updating each row's state in place in its slot.

Two launches per layer and step: :func:`causal_conv1d_update` (the conv over ``[q|k|v]`` from
the row's conv state, SiLU, the state shifted by one token) and :func:`gated_delta_decode` (the
gating ``g``/``beta`` from ``a``/``b``, q/k L2 norms, one step of the delta rule on the row's
recurrent state, the output). A row without a saved state starts from zeros whatever its slot
holds; padded graph rows point at the null slot 0. Numerics follow
``heron.ops.linear_attention.reference`` (fp32 state, fp32 maths).

Given ``kept`` (``[rows, q - 1, *state]``), a row has ``q`` tokens (rows ``n * q ...`` of the
inputs: a verification step's last token and its proposals) run as ``q`` decode steps in one
program, in the same two launches: the state after each token but the last goes to ``kept[n]``,
rounded to the state's dtype as a decode step stores it, and the last one to the slot. The
recurrent state stays in registers between tokens; the conv state is re-read from ``kept``.

``gated_delta_fused`` runs both with the layer's gated norm in one launch, from the helpers here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def conv_silu(x, src, weight, stride_weight_w, mask, load_mask, WIDTH: tl.constexpr):
    """SiLU of one token's causal conv on some channels, in fp32, with loads only (a kernel can
    issue them before any store): ``x`` their fp32 inputs, ``src`` pointers to their conv
    states' oldest entries (read under ``load_mask``, zeros elsewhere), ``weight`` to their
    first taps."""
    acc = x * tl.load(weight + (WIDTH - 1) * stride_weight_w, mask=mask).to(tl.float32)
    for i in tl.static_range(WIDTH - 1):
        s = tl.load(src + i, mask=load_mask, other=0.0).to(tl.float32)
        acc += s * tl.load(weight + i * stride_weight_w, mask=mask).to(tl.float32)
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def shift_conv_state(x, src, dst, mask, load_mask, WIDTH: tl.constexpr):
    """The conv state after the token (arguments as :func:`conv_silu`'s) to ``dst``, which may
    be ``src``: each entry moves one place towards the front (re-read, as a cache hit) and x
    becomes the newest."""
    for i in tl.static_range(1, WIDTH - 1):
        tl.store(dst + i - 1, tl.load(src + i, mask=load_mask, other=0.0), mask=mask)
    tl.store(dst + WIDTH - 2, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def l2_normed_qk(q, k, KEY_DIM: tl.constexpr):
    """fp32 q and k of one key head, L2-normalised (fla's form), q scaled by key_dim ** -0.5."""
    q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * (KEY_DIM**-0.5)
    return q, k * tl.rsqrt(tl.sum(k * k) + 1e-6)


@triton.jit
def delta_rule_token(s, q, k, v, a, b, a_log, dt_bias):
    """One step of the gated delta rule on the fp32 state tile ``s`` [K, V] of a value head
    from its normed ``q``, ``k`` [K], ``v`` [V] and gate inputs: (new state, output [V])."""
    dt = a + dt_bias
    softplus = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))
    s = s * tl.exp(-tl.exp(a_log) * softplus)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * tl.sigmoid(b)
    s += k[:, None] * delta[None, :]
    return s, tl.sum(s * q[:, None], axis=0)


@triton.jit
def _conv_update_kernel(
    x_ptr,  # [N * Q, C]
    state_ptr,  # [slots, C, W - 1]
    weight_ptr,  # [C, W] (any strides)
    out_ptr,  # [N * Q, C]
    slots_ptr,
    has_state_ptr,
    kept_ptr,  # [rows, Q - 1, C, W - 1] (unused with Q = 1)
    channels,
    stride_slots,
    stride_x,
    stride_state_slot,
    stride_state_c,
    stride_kept_row,
    stride_kept_token,
    stride_weight_c,
    stride_weight_w,
    stride_out,
    QUERY_LEN: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < channels
    slot = tl.load(slots_ptr + row * stride_slots).to(tl.int64)
    keep = tl.load(has_state_ptr + row) != 0
    state = state_ptr + slot * stride_state_slot + cols * stride_state_c
    kept = kept_ptr + row.to(tl.int64) * stride_kept_row + cols * stride_state_c
    for t in tl.static_range(QUERY_LEN):
        # Token t reads what token t - 1 wrote (each lane its own channels, a barrier between).
        src = state if t == 0 else kept + (t - 1) * stride_kept_token
        dst = state if t == QUERY_LEN - 1 else kept + t * stride_kept_token
        if t == 0:
            load_mask = mask & keep
        else:
            load_mask = mask
            tl.debug_barrier()
        token = row * QUERY_LEN + t
        x = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        weight = weight_ptr + cols * stride_weight_c
        out = conv_silu(x, src, weight, stride_weight_w, mask, load_mask, WIDTH)
        shift_conv_state(x, src, dst, mask, load_mask, WIDTH)
        tl.store(out_ptr + token * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def check_conv_state(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, kept: torch.Tensor | None
) -> tuple[int, int]:
    """The tokens per row and the rows of a conv update of ``x`` (arguments as
    :func:`causal_conv1d_update`'s); a ``ValueError`` where the tensors do not fit."""
    channels, width = x.shape[1], weight.shape[1]
    q = 1 if kept is None else 1 + kept.shape[1]
    n = x.shape[0] // q
    if conv_state.shape[1:] != (channels, width - 1) or conv_state.stride(2) != 1:
        raise ValueError(f"conv_state {tuple(conv_state.shape)} does not fit x and weight")
    if kept is not None and (
        kept.shape[0] < n
        or kept.shape[2:] != conv_state.shape[1:]
        or kept.stride()[2:] != conv_state.stride()[1:]
    ):
        raise ValueError(f"kept {tuple(kept.shape)} does not fit {n} rows of conv_state's")
    if x.stride(1) != 1 or n * q != x.shape[0]:
        raise ValueError(f"x's rows must be contiguous, {q} per row")
    return q, n


def check_recurrent_state(
    state: torch.Tensor, kept: torch.Tensor | None, n: int, a: torch.Tensor, b: torch.Tensor
) -> None:
    """A ``ValueError`` where the recurrent states, ``kept`` (for ``n`` rows) or the gate
    inputs ``a``, ``b`` do not fit a decode step (as :func:`gated_delta_decode`'s)."""
    _, _, key_dim, value_dim = state.shape
    contiguous = (key_dim * value_dim, value_dim, 1)
    if state.stride()[1:] != contiguous or (kept is not None and kept.stride()[2:] != contiguous):
        raise ValueError("each slot's state must be contiguous")
    if kept is not None and (kept.shape[0] < n or kept.shape[2:] != state.shape[1:]):
        raise ValueError(f"kept {tuple(kept.shape)} does not fit {n} rows of state's")
    if a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0):
        raise ValueError("a and b need contiguous rows of one stride")


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    kept: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row: x [N, C] -> SiLU(conv) [N, C]; ``conv_state[slots[n]]`` [C, W - 1]
    is read (zeros where not ``has_state[n]``) and shifted in place. With ``kept`` [>= N,
    q - 1, C, W - 1], ``q`` tokens per row (x [N * q, C]); the states after each but the last
    go to ``kept``. ``weight``: [C, W]; ``slots`` may be strided (a column of the step's
    tables), ``has_state`` is contiguous."""
    q, n = check_conv_state(x, conv_state, weight, kept)
    channels, width = x.shape[1], weight.shape[1]
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
            conv_state if kept is None else kept,
            channels,
            slots.stride(0),
            x.stride(0),
            conv_state.stride(0),
            conv_state.stride(1),
            0 if kept is None else kept.stride(0),
            0 if kept is None else kept.stride(1),
            weight.stride(0),
            weight.stride(1),
            out.stride(0),
            QUERY_LEN=q,
            WIDTH=width,
            BLOCK=block,
        )
    return out


@triton.jit
def _gated_delta_decode_kernel(
    qkv_ptr,  # [N * Q, conv_dim]: q (Hk * K) | k (Hk * K) | v (Hv * V)
    a_ptr,  # [N * Q, Hv]
    b_ptr,  # [N * Q, Hv]
    a_log_ptr,  # [Hv]
    dt_bias_ptr,  # [Hv]
    state_ptr,  # [slots, Hv, K, V]
    out_ptr,  # [N * Q, Hv, V]
    slots_ptr,
    has_state_ptr,
    kept_ptr,  # [rows, Q - 1, Hv, K, V] (unused with Q = 1)
    stride_slots,
    stride_qkv,
    stride_ab,
    stride_state_slot,
    stride_kept_row,
    stride_kept_token,
    stride_out,
    QUERY_LEN: tl.constexpr,
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
    a_log = tl.load(a_log_ptr + head).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)

    slot = tl.load(slots_ptr + row * stride_slots).to(tl.int64)
    keep = tl.load(has_state_ptr + row) != 0
    within = head * KEY_DIM * VALUE_DIM + ks[:, None] * VALUE_DIM + vs[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    tile = state_ptr + slot * stride_state_slot + within
    s = tl.load(tile, mask=mask & keep, other=0.0).to(tl.float32)
    for t in tl.static_range(QUERY_LEN):
        token = row * QUERY_LEN + t
        qkv = qkv_ptr + token * stride_qkv
        q = tl.load(qkv + key_head * KEY_DIM + ks, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(qkv + (NUM_KEY_HEADS + key_head) * KEY_DIM + ks, mask=k_mask, other=0.0)
        v_offset = 2 * NUM_KEY_HEADS * KEY_DIM + head * VALUE_DIM
        v = tl.load(qkv + v_offset + vs, mask=v_mask, other=0.0).to(tl.float32)
        q, k = l2_normed_qk(q, k.to(tl.float32), KEY_DIM)
        a = tl.load(a_ptr + token * stride_ab + head).to(tl.float32)
        b = tl.load(b_ptr + token * stride_ab + head).to(tl.float32)
        s, out = delta_rule_token(s, q, k, v, a, b, a_log, dt_bias)
        # stored (and carried on) at the state's precision, as decode steps one by one would
        s = s.to(state_ptr.dtype.element_ty)
        if t == QUERY_LEN - 1:
            tl.store(tile, s, mask=mask)
        else:
            kept = kept_ptr + row.to(tl.int64) * stride_kept_row + t * stride_kept_token
            tl.store(kept + within, s, mask=mask)
        s = s.to(tl.float32)
        out = out.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + token * stride_out + head * VALUE_DIM + vs, out, mask=v_mask)


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
    kept: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One delta-rule step per row on ``state[slots[n]]`` [Hv, K, V] in place (zeros where
    not ``has_state[n]``); qkv: the convolved ``[q|k|v]`` [N, conv_dim]; a, b: [N, Hv].
    With ``kept`` [>= N, q - 1, Hv, K, V], ``q`` tokens per row (qkv, a, b of N * q rows); the
    states after each but the last go to ``kept``. Returns [N * q, Hv, V] in fp32."""
    _, num_value_heads, key_dim, value_dim = state.shape
    q = 1 if kept is None else 1 + kept.shape[1]
    n = qkv.shape[0] // q
    if n * q != qkv.shape[0] or qkv.stride(1) != 1:
        raise ValueError(f"qkv must have contiguous rows, {q} per row of slots")
    check_recurrent_state(state, kept, n, a, b)
    out = torch.empty(n * q, num_value_heads, value_dim, dtype=out_dtype, device=qkv.device)
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
            state if kept is None else kept,
            slots.stride(0),
            qkv.stride(0),
            a.stride(0),
            state.stride(0),
            0 if kept is None else kept.stride(0),
            0 if kept is None else kept.stride(1),
            out.stride(0),
            QUERY_LEN=q,
            NUM_KEY_HEADS=num_key_heads,
            NUM_VALUE_HEADS=num_value_heads,
            KEY_DIM=key_dim,
            VALUE_DIM=value_dim,
            BLOCK_K=triton.next_power_of_2(key_dim),
            BLOCK_V=block_v,
            num_warps=4,
        )
    return out


def gdn_decode(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    num_key_heads: int,
    kept: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """A GDN layer's decode step in two launches: :func:`causal_conv1d_update` of x [N,
    conv_dim] then :func:`gated_delta_decode`, states in place by slot; with ``kept`` (the conv
    and the recurrent states after each token but the last), ``q`` tokens per row. Returns
    [N * q, Hv, V] in x's dtype."""
    conv_kept, state_kept = kept if kept is not None else (None, None)
    conv_out = causal_conv1d_update(x, conv_state, conv_weight, slots, has_state, conv_kept)
    return gated_delta_decode(
        conv_out, a, b, A_log, dt_bias, state, slots, has_state, num_key_heads, state_kept,
        x.dtype,
    )  # fmt: skip
