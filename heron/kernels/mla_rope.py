"""MLA's fused pre-attention kernel: RoPE on the query's rotary part and on the shared key,
the latent's RMSNorm (``kv_a_layernorm``) and the latent cache write, in one launch per layer
and step.

* ``q``: ``[T, H, nope + rope]``, rotated in place (its rotary part leaves in rotate-half order:
  the first half the pairs' first outputs; with ``interleaved`` it enters as DeepSeek's pairs
  ``(2i, 2i + 1)``, else in rotate-half order).
* ``latent``: ``[T, L]``, normed here with ``norm_weight`` (HF Llama's RMSNorm form, as
  ``heron.kernels.rmsnorm``) or stored as it is without; ``k_rope``: ``[T, rope]`` (entering as
  ``q``'s).
* ``cache``: ``[blocks, block_size, L + rope]``; token ``t`` goes to flat slot ``slots[t]`` as
  ``[latent, rotated key]``.
* ``cos``, ``sin``: fp32 ``[max_positions, rope / 2]`` (``RotaryEmbedding``'s tables).

Numerics are ``heron.layers.rotary.RotaryEmbedding``'s: the products and sums in fp32, rounded
one at a time (no fp contraction), then cast to the tensors' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.rmsnorm import rms_inv, rms_scale


@triton.jit
def _rotated(x_ptr, offs_first, offs_second, mask, cos, sin):
    x1 = tl.load(x_ptr + offs_first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs_second, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _mla_rope_write_kernel(
    q_ptr,
    latent_ptr,
    k_rope_ptr,
    positions_ptr,
    slots_ptr,
    cos_ptr,
    sin_ptr,
    cache_ptr,
    norm_w_ptr,
    eps,
    num_heads,
    stride_qt,
    stride_qh,
    stride_lt,
    stride_kt,
    stride_cos,
    NOPE: tl.constexpr,
    HALF: tl.constexpr,
    LORA: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_L: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0)
    position = tl.load(positions_ptr + t).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    i_mask = offs_i < HALF
    cos = tl.load(cos_ptr + position * stride_cos + offs_i, mask=i_mask, other=0.0)
    sin = tl.load(sin_ptr + position * stride_cos + offs_i, mask=i_mask, other=0.0)
    if INTERLEAVED:
        first, second = 2 * offs_i, 2 * offs_i + 1
    else:
        first, second = offs_i, offs_i + HALF
    # Every head of the token in this program: all loads happen before the in-place stores.
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < num_heads)[:, None] & i_mask[None, :]
    q_rows = q_ptr + t * stride_qt + heads[:, None] * stride_qh + NOPE
    q1, q2 = _rotated(q_rows, first[None, :], second[None, :], mask, cos[None, :], sin[None, :])
    k1, k2 = _rotated(k_rope_ptr + t * stride_kt, first, second, i_mask, cos, sin)
    tl.store(q_rows + offs_i[None, :], q1.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(q_rows + HALF + offs_i[None, :], q2.to(q_ptr.dtype.element_ty), mask=mask)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    entry = cache_ptr + slot * (LORA + 2 * HALF)
    dtype = cache_ptr.dtype.element_ty
    offs_l = tl.arange(0, BLOCK_L)
    l_mask = offs_l < LORA
    latent = tl.load(latent_ptr + t * stride_lt + offs_l[None, :], mask=l_mask[None, :], other=0.0)
    if HAS_NORM:
        x = latent.to(tl.float32)
        w = tl.load(norm_w_ptr + offs_l, mask=l_mask, other=0.0).to(tl.float32)
        latent = rms_scale(x, rms_inv(x, LORA, eps), w, latent_ptr.dtype.element_ty, False)
    tl.store(entry + offs_l[None, :], latent.to(dtype), mask=l_mask[None, :])
    tl.store(entry + LORA + offs_i, k1.to(dtype), mask=i_mask)
    tl.store(entry + LORA + HALF + offs_i, k2.to(dtype), mask=i_mask)


def mla_rope_latent_write(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    nope_dim: int,
    interleaved: bool,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """Rotate ``q``'s rotary part in place and store ``[latent (normed with norm_weight and
    eps if given), rotated k_rope]`` at the slots (shapes in the module docstring)."""
    tokens, num_heads, head_dim = q.shape
    lora, rope = latent.shape[-1], k_rope.shape[-1]
    assert head_dim == nope_dim + rope and rope % 2 == 0 and cos.shape[-1] == rope // 2
    assert cache.shape[-1] == lora + rope and cache.is_contiguous()
    assert q.stride(-1) == latent.stride(-1) == k_rope.stride(-1) == cos.stride(-1) == 1
    assert sin.stride() == cos.stride()
    if tokens == 0:
        return
    _mla_rope_write_kernel[(tokens,)](
        q,
        latent,
        k_rope,
        positions,
        slots,
        cos,
        sin,
        cache,
        cache if norm_weight is None else norm_weight,  # not read without a norm
        eps,
        num_heads,
        q.stride(0),
        q.stride(1),
        latent.stride(0),
        k_rope.stride(0),
        cos.stride(0),
        NOPE=nope_dim,
        HALF=rope // 2,
        LORA=lora,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HALF=triton.next_power_of_2(rope // 2),
        BLOCK_L=triton.next_power_of_2(lora),
        INTERLEAVED=interleaved,
        HAS_NORM=norm_weight is not None,
        enable_fp_fusion=False,
    )
