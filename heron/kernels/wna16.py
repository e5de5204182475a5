"""Linear layers over packed integer weights (W4A16, W8A16): ``y = x @ dequant(w).T (+ bias)``.

The weight stays packed in memory (``heron.layers.wna16``'s layout: int32 words along ``K``,
scales and uint8 zero points per group of ``GROUP`` input columns); each tile is unpacked and
scaled in registers, ``(q - z) * s`` in fp32, so a decode step reads a quarter of bf16's
bytes (NVFP4, ``FP4``: each 4-bit value an E2M1 code, ``fp4(q) * s``, the row's global scale
dividing the sum). Two kernels:

- the GEMV (few rows: decode): one program per ``BLOCK_N`` output features and row of ``x``,
  a broadcast multiply and sum over ``[BLOCK_N, BLOCK_K]`` tiles, fp32 throughout;
- the GEMM (prefill): ``[BLOCK_M, BLOCK_N]`` output tiles, the dequantised weight tile rounded
  to ``x``'s dtype for ``tl.dot`` on the tensor cores, fp32 accumulation.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from heron.kernels.activation import ACTIVATIONS, gated
from heron.kernels.pdl import pdl_launch, wait_for_previous_kernel

#: Up to this many rows a product takes the GEMV; more take the GEMM.
GEMV_MAX_M = 8


@triton.jit
def dequant_tile(
    qw_ptr,
    s_ptr,
    z_ptr,
    offs_n,
    n_mask,
    k0,
    K,
    stride_qn,
    stride_sn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    FP4: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The fp32 weight tile ``[BLOCK_N, BLOCK_K]`` at rows ``offs_n``, columns from ``k0``:
    whole words loaded (``BLOCK_K / PACK`` a row) and split by shifts, then scaled per group
    (``GROUP`` divides ``BLOCK_K``, or a tile lies in one group). Columns past ``K`` are not
    zero: the activations there are."""
    PACK: tl.constexpr = 32 // BITS
    rows = tl.cast(offs_n, tl.int64)[:, None]
    offs_w = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    w_mask = n_mask[:, None] & (offs_w < K // PACK)[None, :]
    words = tl.load(qw_ptr + rows * stride_qn + offs_w[None, :], mask=w_mask, other=0)
    shifts = tl.arange(0, PACK) * BITS
    q = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    if FP4:  # E2M1 code -> fp16 bits of its value times 2 ** -14 (exact), then the value
        bits = (((q & 7) << 9) | ((q & 8) << 12)).to(tl.uint16)
        q = bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0
    if GROUP < BLOCK_K:  # BLOCK_K / GROUP groups a tile
        SUB: tl.constexpr = BLOCK_K // GROUP
        offs_g = k0 // GROUP + tl.arange(0, SUB)
        g_mask = n_mask[:, None] & (offs_g < tl.cdiv(K, GROUP))[None, :]
        g_ptrs = rows * stride_sn + offs_g[None, :]
        s = tl.load(s_ptr + g_ptrs, mask=g_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + g_ptrs, mask=g_mask, other=0).to(tl.int32)
        else:
            z = tl.full([BLOCK_N, SUB], 1 << (BITS - 1), tl.int32)
        q = tl.reshape(q, (BLOCK_N, SUB, GROUP))
        if FP4:
            w = q * s[:, :, None]
        else:
            w = (q - z[:, :, None]).to(tl.float32) * s[:, :, None]
    else:  # the tile lies in one group
        g_ptrs = offs_n.to(tl.int64) * stride_sn + k0 // GROUP
        s = tl.load(s_ptr + g_ptrs, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + g_ptrs, mask=n_mask, other=0).to(tl.int32)
        else:
            z = tl.full([BLOCK_N], 1 << (BITS - 1), tl.int32)
        if FP4:
            w = q * s[:, None, None]
        else:
            w = (q - z[:, None, None]).to(tl.float32) * s[:, None, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _wna16_gemv_kernel(
    x_ptr,
    u_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    g_ptr,
    y_ptr,
    N,
    K,
    stride_xm,
    stride_um,
    stride_ym,
    stride_qn,
    stride_sn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    FP4: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,  # 0: x as given; else act(x) * u (activation.ACTIVATIONS)
    GATED_OUT: tl.constexpr,  # 0: y; else act(y) * y' of rows n and N + n
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    dtype = y_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros_like(acc)  # with GATED_OUT: rows N + n
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = dequant_tile(
            qw_ptr, s_ptr, z_ptr, offs_n, n_mask, k, K, stride_qn, stride_sn,
            BITS, GROUP, HAS_ZEROS, FP4, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        x = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_mask, other=0.0)
        if ACT != 0:  # rounded as an activation kernel would store it
            up = tl.load(u_ptr + m * stride_um + offs_k, mask=k_mask, other=0.0)
            x = gated(x, up, ACT, dtype).to(dtype)
        x = x.to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
        if GATED_OUT != 0:
            w_up = dequant_tile(
                qw_ptr, s_ptr, z_ptr, offs_n + N, n_mask, k, K, stride_qn, stride_sn,
                BITS, GROUP, HAS_ZEROS, FP4, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            acc_up += tl.sum(w_up * x[None, :], axis=1)
    if FP4:
        acc /= tl.load(g_ptr + offs_n, mask=n_mask, other=1.0)
        if GATED_OUT != 0:
            acc_up /= tl.load(g_ptr + N + offs_n, mask=n_mask, other=1.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if GATED_OUT != 0:  # (of the products rounded as the GEMV would store them)
        acc = gated(acc.to(dtype), acc_up.to(dtype), GATED_OUT, dtype)
    tl.store(y_ptr + m * stride_ym + offs_n, acc.to(dtype), mask=n_mask)


@triton.jit
def _wna16_gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    g_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    stride_qn,
    stride_sn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    FP4: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + tl.cast(offs_m, tl.int64)[:, None] * stride_xm
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = dequant_tile(
            qw_ptr, s_ptr, z_ptr, offs_n, n_mask, k, K, stride_qn, stride_sn,
            BITS, GROUP, HAS_ZEROS, FP4, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc=acc, input_precision=DOT_PREC)
    if FP4:
        acc /= tl.load(g_ptr + offs_n, mask=n_mask, other=1.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + tl.cast(offs_m, tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _block(size: int, largest: int, smallest: int = 16) -> int:
    """A power-of-two tile side: ``largest``, or less for a smaller ``size``."""
    return max(smallest, min(largest, triton.next_power_of_2(size)))


#: Measured launch configurations (``benchmarks/tune_wna16.py --write``): per device name,
#: per ``"rows,N,K,bits,group"`` (rows 1 for the GEMV, else the GEMM's rows padded to a power
#: of two), ``[block_m, block_n, block_k, num_warps, num_stages]``. Other shapes take the rule
#: in :func:`launch_config`.
TUNED_PATH = Path(__file__).parent / "configs" / "wna16.json"
FIELDS = ["block_m", "block_n", "block_k", "num_warps", "num_stages"]


@functools.cache
def _tuned(device_name: str) -> dict[str, list[int]]:
    data = json.loads(TUNED_PATH.read_text()) if TUNED_PATH.exists() else {"devices": {}}
    return data["devices"].get(device_name, {})


def tuned_key(rows: int, n: int, k: int, bits: int, group: int | None) -> str:
    """A shape's key in the tuned table: the GEMV's (``rows`` up to ``GEMV_MAX_M``) is one."""
    rows = 1 if rows <= GEMV_MAX_M else triton.next_power_of_2(rows)
    return f"{rows},{n},{k},{bits},{group or 0}"


def launch_config(
    m: int, n: int, k: int, bits: int, group: int | None, device: torch.device
) -> tuple[int, int, int, int, int]:
    """``(block_m, block_n, block_k, num_warps, num_stages)`` of an ``[m, k] x [n, k]^T``
    product: the measured entry for this device, else narrow column blocks for the GEMV
    (enough programs to keep loads in flight on many SMs) and 64-square GEMM tiles."""
    if device.type == "cuda":
        entry = _tuned(torch.cuda.get_device_name(device)).get(tuned_key(m, n, k, bits, group))
        if entry is not None:
            return tuple(entry)
    if m <= GEMV_MAX_M:
        return 1, _block(n, 16), _block(k, 128), 4, 3
    return _block(m, 64), _block(n, 64), _block(k, 128), 4, 3


def gemv_serves(m: int) -> bool:
    """Whether a product over ``m`` rows runs as the GEMV (which fuses gated activations)."""
    return m <= GEMV_MAX_M


def wna16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    bits: int,
    group_size: int | None,
    bias: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    act: str | None = None,
    up: torch.Tensor | None = None,
    gated_out: str | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` for the packed ``W [N, K]`` (``qweight`` int32
    ``[N, K * bits / 32]``, ``scales`` ``[N, G]``, ``qzeros`` uint8 ``[N, G]`` or None for
    symmetric weights; ``group_size`` None: one group a row; with ``global_scale`` fp32 [N],
    NVFP4: 4-bit E2M1 codes whose rows it divides). Returns ``x.dtype``. For few rows
    (:func:`gemv_serves`) a gated activation (a key of ``activation.ACTIVATIONS``) fuses in:
    ``act`` on the input (``act(gate) * up`` of ``x``'s ``[gate | up]``, or of ``x`` and
    ``up``) as it loads, ``gated_out`` on the output (``W``'s ``[gate | up]`` rows; [M, N/2])."""
    if act is not None and up is None:
        x, up = x.chunk(2, dim=1)
    M, K = x.shape
    rows = qweight.shape[0]
    N = rows // 2 if gated_out is not None else rows
    if qweight.dtype != torch.int32 or qweight.shape[1] * (32 // bits) != K:
        raise ValueError(f"wna16_linear: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}")
    group = group_size or K
    shape = (rows, -(-K // group))
    if scales.shape != shape or (qzeros is not None and qzeros.shape != scales.shape):
        raise ValueError(f"wna16_linear: scales {tuple(scales.shape)} for {rows}x{K} in {group}s")
    if not (qweight.is_contiguous() and scales.is_contiguous()):
        raise ValueError("wna16_linear: qweight and scales must be contiguous")
    fused = act is not None or gated_out is not None
    if fused and (not gemv_serves(M) or (gated_out is not None and bias is not None)):
        raise ValueError(f"wna16_linear: no fused activation over {M} rows or with a bias")
    if x.stride(1) != 1:
        x = x.contiguous()
    if up is not None and up.stride(1) != 1:
        up = up.contiguous()
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    strides = (out.stride(0), qweight.stride(0), scales.stride(0))  # (after x's, and u's)
    weights = (
        qweight,
        scales,
        qzeros if qzeros is not None else scales,
        bias if bias is not None else scales,
        global_scale if global_scale is not None else scales,
        out,
    )
    block_m, block_n, block_k, warps, stages = launch_config(M, rows, K, bits, group_size, x.device)
    if group_size is not None and block_k % group_size and group_size % block_k:
        raise ValueError(f"wna16_linear: tiles of {block_k} columns across groups of {group_size}")
    # Per channel: one group as wide as a tile at least, so that a tile lies in it.
    group = group_size or max(K, block_k)
    flags = dict(
        BITS=bits, GROUP=group, HAS_ZEROS=qzeros is not None, FP4=global_scale is not None,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    if gemv_serves(M):
        u = x if up is None else up
        _wna16_gemv_kernel[(triton.cdiv(N, block_n), M)](
            x, u, *weights, N, K, x.stride(0), u.stride(0), *strides, **flags,
            ACT=ACTIVATIONS[act] if act else 0,
            GATED_OUT=ACTIVATIONS[gated_out] if gated_out else 0, **pdl_launch(x.device),
        )  # fmt: skip
        return out
    _wna16_gemm_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
        x, *weights, M, N, K, x.stride(0), *strides, **flags, BLOCK_M=block_m,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", **pdl_launch(x.device),
    )  # fmt: skip
    return out
