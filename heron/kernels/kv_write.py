"""The fused pre-attention kernel: qk-norm, rotary embedding and the paged KV-cache write.

One launch per layer and step takes the packed ``qkv`` projection and writes the rotated
queries to ``q_out`` and the rotated keys and the values to their cache slots. It reads
positions and slots from device tensors only, so it can be captured in a CUDA graph.

Numerics follow ``heron.layers.norm.RMSNorm`` (or ``GemmaRMSNorm``, ``(1 + w) * norm(x)`` scaled
in fp32: the norms' ``weight_offset`` and ``scale_in_fp32`` say which) and
``heron.layers.rotary.RotaryEmbedding``: the normed values are rounded to the activation dtype
before the rotation, and the rotation's products and sums are rounded one at a time (fp
contraction is turned off, as PyTorch's separate elementwise ops never fuse them), so in fp32
the result matches the reference exactly up to the order of the qk-norm's sum of squares.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from heron.kernels.fp8_quant import to_e4m3
from heron.kernels.pdl import pdl_launch, start_next_kernel, wait_for_previous_kernel
from heron.kernels.rmsnorm import rms_inv, rms_scale

# Largest [heads, head_dim] tile one program handles; larger ones leave too few programs to
# cover the GPU at decode, when there is one token per sequence.
_MAX_TILE = 512
_FP8_MAX = tl.constexpr(448.0)  # E4M3's largest value


@triton.jit
def _store_kv(
    cache_ptr,
    slot_ptr,
    token,
    heads,
    dims,
    mask,
    k,
    v,
    block_size,
    stride_c_kv,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    k_scale,
    v_scale,
):
    """Stores the [heads, dims] tiles ``k`` and ``v`` of ``token`` in its cache slot; an FP8
    cache gets ``k / k_scale`` and ``v / v_scale``, saturated to E4M3's range.

    A negative slot marks a token whose KV is not kept (padding); nothing is written for it.
    """
    slot = tl.cast(tl.load(slot_ptr + token), tl.int64)
    # int64 throughout: block index times block stride passes 2**31 for large caches.
    base = (
        (slot // block_size) * stride_c_blk
        + (slot % block_size) * stride_c_slot
        + tl.cast(heads, tl.int64)[:, None] * stride_c_head
        + dims[None, :]
    )
    mask = mask & (slot >= 0)
    dtype = cache_ptr.dtype.element_ty
    if dtype == tl.float8e4nv:
        k = to_e4m3(tl.clamp(k.to(tl.float32) / k_scale, -_FP8_MAX, _FP8_MAX), dtype)
        v = to_e4m3(tl.clamp(v.to(tl.float32) / v_scale, -_FP8_MAX, _FP8_MAX), dtype)
    tl.store(cache_ptr + base, k.to(dtype), mask=mask)
    tl.store(cache_ptr + stride_c_kv + base, v.to(dtype), mask=mask)


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    num_kv_heads,
    head_dim,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    block_size,
    stride_c_kv,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    k_scale,
    v_scale,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    START_NEXT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    if START_NEXT:
        start_next_kernel(USE_PDL)
    token = tl.cast(tl.program_id(0), tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    k = tl.load(k_ptr + token * stride_k_t + heads[:, None] * stride_k_h + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_v_t + heads[:, None] * stride_v_h + dims, mask=mask)
    _store_kv(
        cache_ptr,
        slot_ptr,
        token,
        heads,
        dims,
        mask,
        k,
        v,
        block_size,
        stride_c_kv,
        stride_c_blk,
        stride_c_slot,
        stride_c_head,
        k_scale,
        v_scale,
    )


@triton.jit
def _qk_norm_rope_kv_write_kernel(
    qkv_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    q_out_ptr,
    cache_ptr,
    slot_ptr,
    eps,
    num_heads,
    num_kv_heads,
    head_dim,
    half_rot,
    stride_qkv_t,
    stride_rope,
    stride_q_t,
    stride_q_head,
    block_size,
    stride_c_kv,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    k_scale,
    v_scale,
    HAS_NORM: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr,
    SCALE_IN_FP32: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    START_NEXT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    if START_NEXT:
        start_next_kernel(USE_PDL)
    # Program (token, block): blocks [0, num_heads / BLOCK_H) hold query heads, the rest key
    # heads (with their value heads). BLOCK_H divides both head counts, so no block mixes them.
    token = tl.cast(tl.program_id(0), tl.int64)
    head0 = tl.program_id(1) * BLOCK_H
    is_q = head0 < num_heads
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    mask = tl.broadcast_to(dim_ok[None, :], (BLOCK_H, BLOCK_D))
    dtype = qkv_ptr.dtype.element_ty

    # Rotate-half: dimension d < R/2 pairs with d + R/2 and the other way round; dimensions
    # past R are copied through (pairing them with themselves keeps their loads in bounds).
    first = dims < half_rot
    rotated = dims < 2 * half_rot
    partner = tl.where(first, dims + half_rot, tl.where(rotated, dims - half_rot, dims))
    row = qkv_ptr + token * stride_qkv_t + (head0 + heads)[:, None] * head_dim
    x = tl.load(row + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    # The partner is read again rather than shuffled in registers: it is an L1 hit.
    xp = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)

    if HAS_NORM:
        if is_q:
            w_ptr = q_norm_ptr
        else:
            w_ptr = k_norm_ptr
        w = tl.load(w_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=dim_ok, other=0.0).to(tl.float32)
        if WEIGHT_OFFSET != 0.0:  # Gemma's zero-centred weights scale by 1 + w (in fp32)
            w = w + WEIGHT_OFFSET
            wp = wp + WEIGHT_OFFSET
        inv = rms_inv(x, head_dim, eps)
        x = rms_scale(x, inv, w, dtype, SCALE_IN_FP32)
        xp = rms_scale(xp, inv, wp, dtype, SCALE_IN_FP32)
        # The norm's output is rounded to the activation dtype before the rotation sees it.
        x = x.to(dtype).to(tl.float32)
        xp = xp.to(dtype).to(tl.float32)

    pos = tl.cast(tl.load(pos_ptr + token), tl.int64)
    freq = tl.where(first, dims, dims - half_rot)
    cos = tl.load(cos_ptr + pos * stride_rope + freq, mask=rotated, other=1.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_rope + freq, mask=rotated, other=0.0)[None, :]
    out = tl.where(
        first[None, :], x * cos - xp * sin, tl.where(rotated[None, :], xp * sin + x * cos, x)
    ).to(dtype)

    if is_q:
        q_heads = tl.cast(head0 + heads, tl.int64)
        q_ptrs = q_out_ptr + token * stride_q_t + q_heads[:, None] * stride_q_head + dims[None, :]
        tl.store(q_ptrs, out.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        # This block's value heads sit num_kv_heads heads past its key heads.
        v = tl.load(row + num_kv_heads * head_dim + dims[None, :], mask=mask)
        _store_kv(
            cache_ptr,
            slot_ptr,
            token,
            head0 - num_heads + heads,
            dims,
            mask,
            out,
            v,
            block_size,
            stride_c_kv,
            stride_c_blk,
            stride_c_slot,
            stride_c_head,
            k_scale,
            v_scale,
        )


def _block_heads(num_heads: int, num_kv_heads: int, block_d: int) -> int:
    """Heads per program: a power of two dividing both head counts, within ``_MAX_TILE``."""
    common = math.gcd(num_heads, num_kv_heads)
    block_h = common & -common  # its largest power-of-two divisor
    return max(1, min(block_h, _MAX_TILE // block_d))


def _cache_strides(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple:
    """(block_size, stride_kv, stride_block, stride_slot, stride_head) of ``kv_cache``."""
    if (
        kv_cache.dim() != 5
        or kv_cache.shape[0] != 2
        or kv_cache.shape[3:] != (num_kv_heads, head_dim)
        or kv_cache.stride(4) != 1
    ):
        raise ValueError(
            f"kv_cache must be [2, blocks, block_size, {num_kv_heads}, {head_dim}] with "
            f"contiguous head_dim, got {tuple(kv_cache.shape)}"
        )
    return (kv_cache.shape[2], *kv_cache.stride()[:4])


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    start_next: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Stores ``k`` and ``v`` [T, KVH, D] in ``kv_cache`` [2, NB, BS, KVH, D] at the slots
    ``slot_mapping[:T]`` (slot = block * BS + offset; negative slots are skipped). An FP8
    (E4M3) cache stores ``k / k_scale`` and ``v / v_scale``.

    ``start_next`` lets the next kernel start while this one runs (see
    ``heron.kernels.pdl.start_next_kernel``): for the decode attention, which loads cached keys
    before it waits."""
    tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"k and v must both be [T, KVH, D] with contiguous D, got {k.shape}")
    cache = _cache_strides(kv_cache, num_kv_heads, head_dim)
    if tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE // block_d))
    _kv_write_kernel[(tokens, triton.cdiv(num_kv_heads, block_h))](
        k,
        v,
        kv_cache,
        slot_mapping,
        num_kv_heads,
        head_dim,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *cache,
        k_scale,
        v_scale,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        START_NEXT=start_next,
        num_warps=max(1, min(4, block_h * block_d // 128)),
        **pdl_launch(k.device),
    )


def qk_norm_rope_kv_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_out: torch.Tensor | None = None,
    norm_weight_offset: float = 0.0,
    norm_scale_in_fp32: bool = False,
    start_next: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Splits ``qkv`` [T, (H + 2 KVH) * D] into q, k, v; RMS-normalises q and k per head when
    the norm weights are given (Qwen3's qk-norm ``w * norm(x)``, or with
    ``norm_weight_offset=1.0, norm_scale_in_fp32=True`` Gemma 3's ``(1 + w) * norm(x)``; see
    ``heron.layers.norm.RMSNorm.weight_offset``); rotates the first ``R = 2 * cos.shape[1]``
    dimensions of q and k at ``positions`` (HF rotate-half layout; ``cos``/``sin`` [P, R/2]
    fp32, already scaled); writes k and v to ``kv_cache`` [2, NB, BS, KVH, D] at the slots
    ``slot_mapping[:T]`` (negative slots are skipped) and returns q as ``q_out`` [T, H, D].

    The norm weights are taken to be in ``qkv``'s dtype, as the model's are: the normed values
    are rounded to it before the rotation. ``start_next``, ``k_scale``, ``v_scale``: as for
    :func:`kv_write`.
    """
    tokens = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_heads}+2*{num_kv_heads} heads")
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("qkv rows and the cos/sin tables must be contiguous")
    half_rot = cos.shape[1]
    if 2 * half_rot > head_dim:
        raise ValueError(f"rotary dimension {2 * half_rot} exceeds head_dim {head_dim}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both qk-norm weights or neither")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} heads do not group into {num_kv_heads} kv heads")
    cache = _cache_strides(kv_cache, num_kv_heads, head_dim)
    if q_out is None:
        q_out = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    elif q_out.shape != (tokens, num_heads, head_dim) or q_out.stride(2) != 1:
        raise ValueError(f"q_out {tuple(q_out.shape)} != {(tokens, num_heads, head_dim)}")
    if tokens == 0:
        return q_out
    has_norm = q_norm_weight is not None
    block_d = triton.next_power_of_2(head_dim)
    block_h = _block_heads(num_heads, num_kv_heads, block_d)
    grid = (tokens, (num_heads + num_kv_heads) // block_h)
    _qk_norm_rope_kv_write_kernel[grid](
        qkv,
        positions,
        cos,
        sin,
        q_norm_weight if has_norm else qkv,  # any valid pointer when unused
        k_norm_weight if has_norm else qkv,
        q_out,
        kv_cache,
        slot_mapping,
        eps,
        num_heads,
        num_kv_heads,
        head_dim,
        half_rot,
        qkv.stride(0),
        cos.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        *cache,
        k_scale,
        v_scale,
        HAS_NORM=has_norm,
        WEIGHT_OFFSET=float(norm_weight_offset),
        SCALE_IN_FP32=bool(norm_scale_in_fp32),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        START_NEXT=start_next,
        num_warps=max(1, min(4, block_h * block_d // 128)),
        # PyTorch rounds each product and sum of the rotation on its own; so do we.
        enable_fp_fusion=False,
        **pdl_launch(qkv.device),
    )
    return q_out
