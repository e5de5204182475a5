"""MLA decode's query absorption in one launch: ``[q_nope @ W_UK | q_rope]`` per token and head.

The absorbed query of latent attention is each head's no-rope part times that head's key
decompression ``W_UK`` ``[nope, lora]``, followed by its roped part. In PyTorch that is a
batched GEMM and a concatenation: two launches, both latency-bound at decode's few tokens.
Here one program per (token, head, tile of latent columns) does its products (fp32 sums, one
rounding to the query's dtype, as the GEMM's) and the first tile's program copies the rotary
part. Past a few tokens the batched GEMM reads ``W_UK`` once for many tokens and wins, so the
caller keeps it there (``ABSORB_KERNEL_MAX_TOKENS``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ABSORB_KERNEL_MAX_TOKENS = 16


@triton.jit
def _absorb_kernel(
    q_nope_ptr,
    q_rope_ptr,
    w_ptr,  # [heads, nope, lora] (any head and row strides)
    out_ptr,  # [tokens, heads, lora + rope]
    stride_nt,
    stride_nh,
    stride_rt,
    stride_rh,
    stride_wh,
    stride_wn,
    stride_ot,
    stride_oh,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    LORA: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    col_mask = cols < LORA
    ns = tl.arange(0, BLOCK_N)
    n_mask = ns < NOPE
    q = tl.load(q_nope_ptr + t * stride_nt + h * stride_nh + ns, mask=n_mask, other=0.0)
    w_ptrs = w_ptr + h * stride_wh + ns[:, None] * stride_wn + cols[None, :]
    w = tl.load(w_ptrs, mask=n_mask[:, None] & col_mask[None, :], other=0.0)
    latent = tl.sum(q.to(tl.float32)[:, None] * w.to(tl.float32), axis=0)
    out = out_ptr + t * stride_ot + h * stride_oh
    tl.store(out + cols, latent.to(out_ptr.dtype.element_ty), mask=col_mask)
    if tl.program_id(2) == 0:
        rs = tl.arange(0, BLOCK_R)
        r_mask = rs < ROPE
        rope = tl.load(q_rope_ptr + t * stride_rt + h * stride_rh + rs, mask=r_mask)
        tl.store(out + LORA + rs, rope.to(out_ptr.dtype.element_ty), mask=r_mask)


def mla_absorb_query(
    q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor
) -> torch.Tensor:
    """``q_nope [T, H, nope]``, ``q_rope [T, H, rope]``, ``w_uk [H, nope, lora]`` (each with a
    unit last stride) -> ``[T, H, lora + rope]`` in ``q_nope``'s dtype."""
    tokens, heads, nope = q_nope.shape
    rope, lora = q_rope.shape[-1], w_uk.shape[-1]
    if w_uk.shape[:2] != (heads, nope) or q_rope.shape[:2] != (tokens, heads):
        raise ValueError(
            f"mla_absorb_query: q_nope {tuple(q_nope.shape)}, q_rope {tuple(q_rope.shape)}, "
            f"w_uk {tuple(w_uk.shape)}"
        )
    if q_nope.stride(-1) != 1 or q_rope.stride(-1) != 1 or w_uk.stride(-1) != 1:
        raise ValueError("mla_absorb_query: every input needs a unit last stride")
    out = torch.empty(tokens, heads, lora + rope, dtype=q_nope.dtype, device=q_nope.device)
    block_l = min(128, triton.next_power_of_2(lora))
    if tokens:
        _absorb_kernel[(tokens, heads, triton.cdiv(lora, block_l))](
            q_nope,
            q_rope,
            w_uk,
            out,
            q_nope.stride(0),
            q_nope.stride(1),
            q_rope.stride(0),
            q_rope.stride(1),
            w_uk.stride(0),
            w_uk.stride(1),
            out.stride(0),
            out.stride(1),
            NOPE=nope,
            ROPE=rope,
            LORA=lora,
            BLOCK_N=triton.next_power_of_2(nope),
            BLOCK_L=block_l,
            BLOCK_R=triton.next_power_of_2(rope),
            num_warps=4,
        )
    return out
