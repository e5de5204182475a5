"""LoRA's two products over a batch whose tokens use different adapters (token-indexed, as
punica's BGMV): ``shrink`` gives each token ``x A[s]^T`` (fp32 partial sums) and ``expand``
adds ``shrunk B[s]^T`` to the base layer's output, ``s`` the token's slot in the stacked
tables. Slot 0 holds zeros (the base model), so no token needs a branch. Both take part in
programmatic dependent launch (``heron.kernels.pdl``): a decode step's LoRA kernels sit
between the projections', and would otherwise break their chain; a launch that fits one wave
lets the next kernel be scheduled while it runs, as the RMSNorm's does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.pdl import fits_one_wave, pdl_launch, start_next_kernel, wait_for_previous_kernel

# Programs a shrink launch aims for: enough to spread a decode step's few tokens over the SMs.
_PROGRAMS = 512
# From this many tokens an expand program covers 128 output columns rather than 64: the
# tokens fill the grid anyway, and fewer, fuller programs cost less to schedule; a few tokens
# want narrow tiles, to spread over the multiprocessors.
_WIDE_TOKENS = 16


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    out_ptr,
    K,
    R,
    CHUNKS_PER_SPLIT,
    stride_x,
    stride_as,
    stride_ar,
    stride_out_t,
    stride_out_split,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    START_NEXT: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    if START_NEXT:  # (the expand is scheduled now, and waits for this kernel to complete)
        start_next_kernel(USE_PDL)
    token = tl.cast(tl.program_id(0), tl.int64)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    a_rows = a_ptr + slot * stride_as + rows[:, None] * stride_ar
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    first = split * CHUNKS_PER_SPLIT * BLOCK_K
    for k0 in range(first, first + CHUNKS_PER_SPLIT * BLOCK_K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token * stride_x + cols, mask=cols < K, other=0.0)
        a = tl.load(
            a_rows + cols[None, :], mask=(rows[:, None] < R) & (cols[None, :] < K), other=0.0
        )
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    out = out_ptr + token * stride_out_t + split * stride_out_split + rows
    tl.store(out, acc, mask=rows < R)


@triton.jit
def _expand_kernel(
    s_ptr,
    b_ptr,
    slots_ptr,
    y_ptr,
    N,
    R,
    SPLITS,
    stride_s_t,
    stride_s_split,
    stride_bs,
    stride_bn,
    stride_y,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
    START_NEXT: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    if START_NEXT:
        start_next_kernel(USE_PDL)
    token = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    s = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for split in range(SPLITS):
        s += tl.load(
            s_ptr + token * stride_s_t + split * stride_s_split + ranks, mask=ranks < R, other=0.0
        )
    b = tl.load(
        b_ptr + slot * stride_bs + cols[:, None] * stride_bn + ranks[None, :],
        mask=(cols[:, None] < N) & (ranks[None, :] < R),
        other=0.0,
    )
    delta = tl.sum(b.to(tl.float32) * s[None, :], axis=1)
    y = tl.load(y_ptr + token * stride_y + cols, mask=cols < N, other=0.0)
    out = y.to(tl.float32) + delta
    tl.store(y_ptr + token * stride_y + cols, out.to(y_ptr.dtype.element_ty), mask=cols < N)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """``x[t] @ a[token_slots[t]]^T`` for every token as fp32 partial sums over slices of
    ``K`` (``[T, splits, R]``, summed by :func:`lora_expand`): ``x`` [T, K], ``a`` [S, R, K].

    A decode step has a token or a few, and ``R`` is small: one program a token would walk
    all of ``K`` alone, so the input's width is split until the grid fills the device."""
    t, k = x.shape
    r = a.shape[1]
    assert a.shape[2] == k and a.stride(2) == 1 and x.stride(1) == 1
    block_r = triton.next_power_of_2(r)
    block_k = max(16, min(128, 8192 // block_r, triton.next_power_of_2(k)))
    chunks = triton.cdiv(k, block_k)
    splits = max(1, min(chunks, _PROGRAMS // max(t, 1)))
    per_split = triton.cdiv(chunks, splits)
    splits = triton.cdiv(chunks, per_split)
    out = torch.empty(t, splits, r, dtype=torch.float32, device=x.device)
    if t:
        strides = (x.stride(0), *a.stride()[:2], *out.stride()[:2])
        _shrink_kernel[(t, splits)](
            x,
            a,
            token_slots,
            out,
            k,
            r,
            per_split,
            *strides,
            BLOCK_R=block_r,
            BLOCK_K=block_k,
            START_NEXT=fits_one_wave(x.device, t * splits),
            **pdl_launch(x.device),
        )
    return out


def lora_expand(
    shrunk: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    """``y[t] += shrunk[t].sum(0) @ b[token_slots[t]]^T`` in place (``shrunk`` from
    :func:`lora_shrink`, ``b`` [S, N, R]); returns ``y``."""
    t, splits, r = shrunk.shape
    n = b.shape[1]
    assert b.shape[2] == r and b.stride(2) == 1 and y.shape == (t, n) and y.stride(1) == 1
    assert shrunk.stride(2) == 1
    if t:
        block_n = 128 if t >= _WIDE_TOKENS else 64
        grid = (t, triton.cdiv(n, block_n))
        strides = (*shrunk.stride()[:2], *b.stride()[:2], y.stride(0))
        block_r = triton.next_power_of_2(r)
        _expand_kernel[grid](
            shrunk,
            b,
            token_slots,
            y,
            n,
            r,
            splits,
            *strides,
            BLOCK_N=block_n,
            BLOCK_R=block_r,
            START_NEXT=fits_one_wave(y.device, grid[0] * grid[1]),
            **pdl_launch(y.device),
        )
    return y
