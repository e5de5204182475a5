"""Flash-decoding over a paged KV cache: one query token per request, split-KV, graph-safe.

Layout contract (all tensors on one device):

* ``q``, ``out``: ``[B, H, D]`` (any strides, last dim contiguous).
* ``kv_cache``: ``[2, num_blocks, block_size, KVH, D]`` (0 = K, 1 = V), the model dtype; block 0
  is the null block that padded rows point at.
* ``block_tables``: int32 ``[B, width]``; position ``p`` of request ``r`` lives in block
  ``block_tables[r, p // block_size]`` at offset ``p % block_size``.
* ``kv_lens``: int32 ``[B]``, tokens in the cache including this step's (already written) one;
  0 marks a padded row, whose output is zeros.
* ``partial_out``: fp32 ``[B, H, num_splits, D]`` and ``partial_lse``: fp32 ``[B, H, num_splits]``,
  the split workspace (only used when ``num_splits > 1``).

Every length-dependent quantity (visible range, split bounds) is computed inside the kernels
from ``kv_lens``, so one launch configuration serves any lengths: the call never synchronises
with the host and can be captured in a CUDA graph and replayed with new lengths and tables.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Logits are scaled by log2(e) so the online softmax can use exp2; LSEs stay in log2 units
# between the split kernel and the reduce kernel (never exposed).
_LOG2E = 1.4426950408889634
# Finite "minus infinity" for the running max: a fully masked tile then gives exp2(-inf) = 0
# and a rescale factor of exp2(0) = 1, instead of the NaN of (-inf) - (-inf).
_NEG_BIG = tl.constexpr(-1.0e30)
# Smallest KV range worth its own split: below this the reduce costs more than it saves.
_MIN_SPLIT_TOKENS = 128
_MAX_SPLITS = 64
# Keys per tile. Tiles are gathered token by token through the block table, so they need not
# match the cache block size; 64 keeps K and V tiles of head_dim 256 within shared memory.
_BLOCK_N = 64


@triton.jit
def _decode_split_kernel(
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    kv_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,  # softmax scale * log2(e)
    window,
    stride_qb,
    stride_qh,
    stride_kv,
    stride_blk,
    stride_slot,
    stride_kvh,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: all GROUP query heads of one KV head, over one split of the KV range."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP
    heads = kvh * GROUP + offs_h

    kv_len = tl.load(kv_lens_ptr + b)
    if USE_WINDOW:
        first = tl.maximum(kv_len - window, 0)
    else:
        first = kv_len * 0
    # Tiles start on BLOCK_N-aligned absolute positions so each covers as few cache blocks as
    # possible; positions before `first` are masked.
    aligned = (first // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(kv_len - aligned, NUM_SPLITS)
    per_split = tl.cdiv(per_split, BLOCK_N) * BLOCK_N
    lo = aligned + split * per_split
    hi = tl.minimum(lo + per_split, kv_len)

    q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_rows, mask=head_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)

    table_row = block_tables_ptr + b.to(tl.int64) * stride_btb
    kv_head = kv_ptr + kvh.to(tl.int64) * stride_kvh
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        valid = (pos >= first) & (pos < kv_len)
        block_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0)
        # int64: block_id * block stride overflows int32 for caches beyond 2^31 elements.
        tok_off = block_ids.to(tl.int64) * stride_blk + (pos % BLOCK_SIZE) * stride_slot
        k_ptrs = kv_head + tok_off[:, None] + offs_d[None, :]
        k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # V is loaded only now, after the softmax, so K and V tiles are not live together.
        v = tl.load(k_ptrs + stride_kv, mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    result = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
        tl.store(
            o_ptrs + offs_d[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None],
        )
    else:
        p_ptrs = (
            part_out_ptr
            + b.to(tl.int64) * stride_pb
            + heads[:, None] * stride_ph
            + split * stride_ps
            + offs_d[None, :]
        )
        tl.store(p_ptrs, result, mask=head_mask[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        l_ptrs = part_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split
        tl.store(l_ptrs, lse, mask=head_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One program per (request, head): merge the splits' partial results by their LSEs."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    split_mask = offs_s < NUM_SPLITS

    lse = tl.load(
        part_lse_ptr + b.to(tl.int64) * stride_lb + h * stride_lh + offs_s,
        mask=split_mask,
        other=float("-inf"),
    )
    has_keys = lse > float("-inf")
    # Splits without keys (and padded rows, where every split is empty) weigh nothing.
    m = tl.max(tl.where(has_keys, lse, _NEG_BIG), 0)
    w = tl.where(has_keys, tl.exp2(lse - m), 0.0)
    total = tl.sum(w, 0)
    parts = tl.load(
        part_out_ptr
        + b.to(tl.int64) * stride_pb
        + h * stride_ph
        + offs_s[:, None] * stride_ps
        + offs_d[None, :],
        mask=split_mask[:, None],
        other=0.0,
    )
    merged = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
        merged.to(out_ptr.dtype.element_ty),
    )


def choose_num_splits(batch: int, num_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """Splits per (request, KV head) so the grid fills ``num_sms`` multiprocessors.

    A power of two; 1 when ``batch * num_kv_heads`` programs already fill the GPU. Each split
    keeps at least ``_MIN_SPLIT_TOKENS`` of ``max_kv_len`` (the longest length the launch must
    serve, e.g. the model's max length for a captured graph), capped at ``_MAX_SPLITS``.
    """
    programs = max(1, batch * num_kv_heads)
    if programs >= num_sms:
        return 1
    wanted = triton.next_power_of_2(triton.cdiv(num_sms, programs))
    by_length = max(1, max_kv_len // _MIN_SPLIT_TOKENS)
    limit = min(_MAX_SPLITS, 1 << (by_length.bit_length() - 1))  # largest power of 2 <= it
    return max(1, min(wanted, limit))


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    num_splits: int,
    partial_out: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per request over its paged history; writes and returns ``out``.

    Shapes are in the module docstring. A query at position ``p = kv_len - 1`` sees keys
    ``j`` with ``p - sliding_window < j <= p`` (all ``j <= p`` when the window is None).
    ``num_splits > 1`` splits each request's visible range into that many contiguous parts
    (split-KV / flash-decoding) and merges them in a second kernel, using ``partial_out`` /
    ``partial_lse`` as workspace (allocated here when None; pass them when capturing a graph).
    """
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim and out.shape == q.shape
    assert head_dim in (16, 32, 64, 128, 256), f"unsupported head_dim {head_dim}"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert num_heads % num_kv_heads == 0 and num_splits >= 1
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    if num_splits > 1:
        if partial_out is None:
            partial_out = torch.empty(
                batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
            )
        if partial_lse is None:
            partial_lse = torch.empty(
                batch, num_heads, num_splits, dtype=torch.float32, device=q.device
            )
        assert partial_out.shape[:3] == (batch, num_heads, num_splits)
        assert partial_lse.shape == (batch, num_heads, num_splits)
        assert partial_out.stride(-1) == 1 and partial_lse.stride(-1) == 1
        part_out, part_lse = partial_out, partial_lse
    else:
        # Unused by the single-split path; any tensor fills the pointer arguments.
        part_out, part_lse = out, out
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        kv_cache,
        block_tables,
        kv_lens,
        out,
        part_out,
        part_lse,
        scale * _LOG2E,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2) if num_splits > 1 else 0,
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=_BLOCK_N,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        USE_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if head_dim <= 128 else 8,
        num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out,
            part_lse,
            out,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            num_warps=4,
        )
    return out
