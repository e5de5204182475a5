"""RMSNorm in Triton, optionally fused with the residual add and a post-norm before it; and
the gated RMSNorm of linear attention (a norm per head times ``silu(gate)``).

Numerics follow ``heron.layers.norm`` step by step (statistics in fp32, the same intermediate
roundings to the activation dtype), so on the GPU the kernel agrees with it up to the order of
the sum of squares, and under the Triton interpreter in fp32 to within an ulp. The RMS helpers
below are shared with the qk-norm of the fused attention pre-processing kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.pdl import (
    fits_one_wave,
    pdl_launch,
    start_next_kernel,
    wait_for_previous_kernel,
)


@triton.jit
def rms_inv(x, n_cols, eps):
    """Per-row ``rsqrt(mean(x**2) + eps)`` of an fp32 tile ``x`` [rows, cols].

    Columns past ``n_cols`` must hold zeros so that they add nothing to the sum.
    """
    return tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)


@triton.jit
def rms_scale(x, inv, w, dtype: tl.constexpr, IN_FP32: tl.constexpr):
    """An RMS norm's output in fp32, before its final rounding: HF LlamaRMSNorm's
    ``w * (x * inv).to(dtype)``, or with ``IN_FP32`` Gemma's ``(x * inv) * w`` (no rounding
    between; ``w`` then already holds Gemma's ``1 + weight``).

    ``x`` is an fp32 tile [rows, cols], ``inv`` its per-row factor from ``rms_inv`` (or any
    other row's, for the rotate-half partner of a head), ``w`` the fp32 weight [cols].
    """
    if IN_FP32:
        return x * inv[:, None] * w[None, :]
    return w[None, :] * (x * inv[:, None]).to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    pre_w_ptr,
    res_ptr,
    out_ptr,
    n_rows,
    n_cols,
    stride_x,
    stride_res,
    stride_out,
    eps,
    HAS_PRENORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr,
    SCALE_IN_FP32: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    START_NEXT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if START_NEXT:  # the projection that reads the norm is scheduled now, and waits below
        start_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    # int64 rows: row * stride can pass 2**31 for long prompts times wide rows.
    rows64 = tl.cast(rows, tl.int64)[:, None]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    dtype = x_ptr.dtype.element_ty
    col_mask = cols < n_cols
    if HAS_PRENORM:
        # x is first normed on its own (Gemma's post-attention / post-FFN norm) and rounded to
        # its dtype, as that norm's output is before the residual add.
        xf = x.to(tl.float32)
        pre_w = tl.load(pre_w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + WEIGHT_OFFSET
        x = rms_scale(xf, rms_inv(xf, n_cols, eps), pre_w, dtype, SCALE_IN_FP32).to(dtype)
    if HAS_RESIDUAL:
        res_ptrs = res_ptr + rows64 * stride_res + cols[None, :]
        res = tl.load(res_ptrs, mask=mask, other=0.0)
        # The sum is rounded to the activation dtype, as PyTorch's x + residual would be, and
        # that rounded value is both the new residual and what gets normalised.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(res_ptrs, x.to(res_ptr.dtype.element_ty), mask=mask)
    xf = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + WEIGHT_OFFSET
    out = rms_scale(xf, rms_inv(xf, n_cols, eps), w, dtype, SCALE_IN_FP32)
    tl.store(
        out_ptr + rows64 * stride_out + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D with contiguous rows, got {tuple(t.shape)}")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    scale_in_fp32: bool = False,
    prenorm_weight: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the rows of ``x`` [T, N] (rows may be strided), as HF's LlamaRMSNorm, or
    with ``weight_offset=1.0, scale_in_fp32=True`` as Gemma's ``(1 + w) * norm(x)``.

    Without ``residual``: returns the norm. With it: ``residual`` is overwritten in place by
    ``x + residual`` (rounded to ``x``'s dtype) and ``(norm(x + residual), residual)`` is
    returned. The output dtype is that of ``weight * x`` in PyTorch (Llama) or ``x``'s (Gemma).

    With ``prenorm_weight``, ``x`` is first replaced by its own norm of the same form and eps
    with that weight, rounded to ``x``'s dtype: a post-norm (Gemma normalises the attention and
    MLP outputs before their residual adds) fused into the next norm's kernel.

    A launch that fits one wave lets the next kernel (the projection that reads the norm) start
    while it runs (``heron.kernels.pdl.fits_one_wave``).
    """
    check_rows("x", x)
    if prenorm_weight is not None and prenorm_weight.dtype != x.dtype and not scale_in_fp32:
        raise ValueError("rms_norm: a Llama-form prenorm needs its weight in x's dtype")
    n_rows, n_cols = x.shape
    if residual is not None:
        check_rows("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    dtype = x.dtype if scale_in_fp32 else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if n_rows > 0:
        block_n = triton.next_power_of_2(n_cols)
        # Narrow rows: several per program, so that each program still moves a useful amount.
        rows = min(triton.next_power_of_2(n_rows), max(1, 2048 // block_n))
        tile = rows * block_n
        res = x if residual is None else residual  # any valid pointer when unused
        programs = triton.cdiv(n_rows, rows)
        _rms_norm_kernel[(programs,)](
            x,
            weight,
            weight if prenorm_weight is None else prenorm_weight,  # any valid pointer if unused
            res,
            out,
            n_rows,
            n_cols,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            eps,
            HAS_PRENORM=prenorm_weight is not None,
            HAS_RESIDUAL=residual is not None,
            WEIGHT_OFFSET=float(weight_offset),
            SCALE_IN_FP32=bool(scale_in_fp32),
            ROWS=rows,
            BLOCK_N=block_n,
            START_NEXT=fits_one_wave(x.device, programs),
            num_warps=min(16, max(1, tile // 512)),
            **pdl_launch(x.device),
        )
    return out if residual is None else (out, residual)


@triton.jit
def gated_rms_scale(x, g, w, n_cols, eps, dtype: tl.constexpr):
    """The gated RMSNorm of fp32 tiles ``x`` and gate ``g`` [rows, cols] (``x`` holding values
    of ``dtype``, zeros past ``n_cols``) with the fp32 weight ``w`` [cols], in fp32 before its
    final rounding: the weighted norm is rounded to ``dtype`` (PyTorch multiplies two such
    tensors), then scaled by ``silu(g)`` in fp32."""
    normed = rms_scale(x, rms_inv(x, n_cols, eps), w, dtype, False).to(dtype).to(tl.float32)
    return normed * (g * tl.sigmoid(g))


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    gate_ptr,
    w_ptr,
    out_ptr,
    n_rows,
    heads,
    n_cols,
    stride_x_t,
    stride_x_h,
    stride_g_t,
    stride_g_h,
    eps,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    token, head = tl.cast(rows // heads, tl.int64), rows % heads
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(
        x_ptr + (token * stride_x_t + head * stride_x_h)[:, None] + cols[None, :],
        mask=mask,
        other=0.0,
    )
    g = tl.load(
        gate_ptr + (token * stride_g_t + head * stride_g_h)[:, None] + cols[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    out = gated_rms_scale(x.to(tl.float32), g, w, n_cols, eps, dtype)
    rows64 = tl.cast(rows, tl.int64)[:, None]
    tl.store(out_ptr + rows64 * n_cols + cols[None, :], out.to(dtype), mask=mask)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """HF's ``RMSNormGated`` (``heron.layers.norm.GatedRMSNorm``) of ``x`` [T, H, D] per head,
    times ``silu(gate)`` [T, H, D]; both may be strided over tokens and heads (unit last
    stride). Returns a contiguous [T, H, D] in ``x``'s dtype."""
    if x.dim() != 3 or gate.shape != x.shape or x.stride(2) != 1 or gate.stride(2) != 1:
        raise ValueError(
            f"gated_rms_norm: x {tuple(x.shape)} and gate {tuple(gate.shape)} must be [T, H, D] "
            "with a unit last stride"
        )
    tokens, heads, n_cols = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = tokens * heads
    if n_rows > 0:
        block_n = triton.next_power_of_2(n_cols)
        rows = min(triton.next_power_of_2(n_rows), max(1, 2048 // block_n))
        _gated_rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
            x,
            gate,
            weight,
            out,
            n_rows,
            heads,
            n_cols,
            x.stride(0),
            x.stride(1),
            gate.stride(0),
            gate.stride(1),
            eps,
            ROWS=rows,
            BLOCK_N=block_n,
            num_warps=min(16, max(1, rows * block_n // 512)),
            **pdl_launch(x.device),
        )
    return out
