"""Dynamic per-token FP8 (E4M3) activations in one Triton launch.

The FP8 tensor-core product (``heron.layers.fp8.scaled_mm``) quantises its input per row; in
PyTorch that is a chain of elementwise kernels and temporaries. This kernel reads each row
twice (its absolute maximum, then the scaled values) and writes the E4M3 row and its fp32
scale, rounding as ``heron.layers.fp8.quantize`` does (the scale times E4M3's reciprocal
maximum, an IEEE division by it, round-to-nearest-even).

Triton converts fp32 to E4M3 through fp16, which rounds twice: a value just below a midpoint
of E4M3 can round up to it in fp16 and then away. Rounding to fp16 toward zero and setting the
last bit where that dropped any (round-to-odd, with fp16's seven more bits) keeps the second
rounding exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FP8_MAX = tl.constexpr(448.0)  # E4M3's largest value
_INV_FP8_MAX = tl.constexpr(1.0 / 448.0)
_MAX_BLOCK_K = 4096


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + tl.cast(row, tl.int64) * stride_x
    q_row = q_ptr + tl.cast(row, tl.int64) * K
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        x = tl.load(x_row + start + offs, mask=start + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    row_max = tl.max(amax, axis=0)
    scale = tl.where(row_max > 0.0, row_max * _INV_FP8_MAX, 1.0)
    for start in range(0, K, BLOCK_K):
        mask = start + offs < K
        x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -_FP8_MAX, _FP8_MAX)
        tl.store(q_row + start + offs, to_e4m3(q, q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def to_e4m3(x, fp8_dtype: tl.constexpr):
    """``x`` (fp32) rounded once to nearest-even E4M3, through a round-to-odd fp16."""
    h = x.to(tl.float16, fp_downcast_rounding="rtz")
    dropped = (h.to(tl.float32) != x).to(tl.int16)
    odd = (h.to(tl.int16, bitcast=True) | dropped).to(tl.float16, bitcast=True)
    return odd.to(fp8_dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x`` [M, K] as E4M3 ``[M, K]`` with one fp32 scale per row ``[M]``,
    each row's absolute maximum mapped to E4M3's largest value (an all-zero row gets scale 1):
    ``heron.layers.fp8.quantize(x)`` in one launch."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows: x must be [M, K], got shape {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m and k:
        block_k = min(triton.next_power_of_2(k), _MAX_BLOCK_K)
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), BLOCK_K=block_k)
    else:
        scale.fill_(1.0)
    return q, scale
