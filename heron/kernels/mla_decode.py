"""Latent attention (MLA) decode over a paged latent cache: ``query_len`` query tokens per
request (1 in plain decode, ``1 + k`` when ``k`` proposals are verified), every query head
against one shared latent "KV head", split-KV with a second-pass merge.

A request's ``query_len`` tokens are its last ones; each runs as a decode query that sees one
key more than the token before it (causal within the block), through the request's block table
and split plan. Verification thus keeps decode's split-KV parallelism at small batches,
and a graph of ``(rows, query_len)`` needs nothing from the host.

Layout contract (all tensors on one device):

* ``q``: ``[B * query_len, H, L + R]``, the absorbed query (latent part ``L = kv_lora_rank``,
  rotary part ``R``), request ``r``'s tokens in rows ``r * query_len ...``, last dim contiguous;
  ``out``: ``[B * query_len, H, L]``.
* ``cache``: ``[num_blocks, block_size, L + R]``: per token the latent (also the value) and the
  roped shared key; block 0 is the null block that padded rows point at.
* ``block_tables``: int32 ``[B, width]``; position ``p`` of request ``r`` lives in block
  ``block_tables[r, p // block_size]`` at offset ``p % block_size``.
* ``kv_lens``: int32 ``[B]``, tokens in the cache including this step's (token ``i`` of a
  request sees ``kv_len - query_len + 1 + i`` keys); 0 marks a padded row (zeros out).
* The split plan (:class:`MLADecodePlan`): per request its number of splits (at most the
  launch's ``max_splits``) and the keys per split, computed on the device from ``kv_lens`` by
  :func:`plan_mla_decode`. Split programs beyond a request's count return at once; a split's
  key range is clipped to the request's length, so a plan never makes a program read past it.

Scores are ``(q . entry) * scale`` over all ``L + R`` values; values are the entries' first
``L``. Masked keys are never loaded (a cache may hold anything there). Accumulation is fp32.
Nothing is read on the host, so a call can be captured in a CUDA graph; the plan must then be
computed inside the graph (the builder's ``before_capture`` sees to that).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity": no NaN from (-inf) - (-inf)
_MAX_SPLITS = 128
_MERGE_CHUNK = 16  # partials the merge loads at once (a [16, kv_lora_rank] fp32 tile)


@dataclass(frozen=True)
class MLADecodeLaunch:
    """The decode's launch shape: the split rule's keys per split, the split kernel's tile
    (keys gathered token by token, so independent of the block size; heads, at least
    ``tl.dot``'s smallest M, fewer are masked) and its warps and pipeline stages.
    ``benchmarks/tune_mla_decode.py`` times the alternatives; :data:`LAUNCH` is what runs."""

    min_keys_per_split: int = 64  # fewer would make splits whose merge costs more than they save
    block_n: int = 32
    block_h: int = 16
    num_warps: int | None = None  # None: 8 for a latent of 256 or more, else 4
    num_stages: int = 3  # Triton's default

    def __post_init__(self) -> None:
        for name in ("block_n", "block_h"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two of at least 16, got {value}")


LAUNCH = MLADecodeLaunch()


@dataclass
class MLADecodePlan:
    """Per-request split counts and keys per split (int32 ``[B]`` device tensors), and whether
    they were computed for this step: the first call of a step plans, the other layers reuse."""

    num_splits: torch.Tensor
    split_len: torch.Tensor
    ready: bool = False


def choose_max_splits(batch: int, num_heads: int, max_kv_len: int, num_sms: int) -> int:
    """The launch's split count: enough (request, head block, split) programs to fill
    ``num_sms``, no more than a ``max_kv_len`` context can give ``min_keys_per_split`` each."""
    programs = batch * triton.cdiv(num_heads, LAUNCH.block_h)
    wanted = min(triton.cdiv(num_sms, programs), triton.cdiv(max_kv_len, LAUNCH.min_keys_per_split))
    return max(1, min(wanted, _MAX_SPLITS))


def plan_mla_decode(kv_lens: torch.Tensor, max_splits: int, plan: MLADecodePlan) -> None:
    """Write each request's split count and keys per split into ``plan`` (on the device, no
    synchronisation): a request gets one split per ``min_keys_per_split`` keys, at most
    ``max_splits``, each a whole number of tiles."""
    lens, n = kv_lens.to(torch.int32), kv_lens.numel()
    min_keys, block_n = LAUNCH.min_keys_per_split, LAUNCH.block_n
    splits = ((lens + min_keys - 1) // min_keys).clamp_(1, max_splits)
    per_split = (lens + splits - 1) // splits
    torch.mul((per_split + block_n - 1) // block_n, block_n, out=plan.split_len[:n])
    plan.num_splits[:n].copy_(splits)


@triton.jit
def load_absorbed_query(
    rows,
    row_mask,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The latent ``[M, BLOCK_L]`` and rotary ``[M, BLOCK_R]`` parts of the absorbed query rows
    that start at ``rows`` ``[M]`` (zeros where ``row_mask`` is off and past the widths)."""
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    lat = tl.load(
        rows[:, None] + offs_l[None, :],
        mask=row_mask[:, None] & (offs_l < LORA)[None, :],
        other=0.0,
    )
    rope = tl.load(
        rows[:, None] + LORA + offs_r[None, :],
        mask=row_mask[:, None] & (offs_r < ROPE)[None, :],
        other=0.0,
    )
    return lat, rope


@triton.jit
def attend_latent_tile(
    q_lat,
    q_rope,
    m_i,
    l_i,
    acc,
    cache_ptr,
    table_row,
    pos,
    valid,
    visible,
    qk_scale,
    stride_blk,
    stride_slot,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key tile of the online softmax over latent entries, shared by decode and extend.

    ``q_lat`` ``[M, BLOCK_L]`` / ``q_rope`` ``[M, BLOCK_R]`` are the absorbed query rows; keys
    at positions ``pos`` ``[N]`` are read through ``table_row`` (the request's block table)
    where ``valid`` (others are never loaded: a cache may hold anything there), and a score
    counts where ``visible`` (``[M, N]`` or ``[1, N]``). Returns the updated running maximum,
    normaliser and fp32 accumulator ``[M, BLOCK_L]``.
    """
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    lat_mask = valid[:, None] & (offs_l < LORA)[None, :]
    rope_mask = valid[:, None] & (offs_r < ROPE)[None, :]
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0)
    rows = cache_ptr + block.to(tl.int64) * stride_blk + (pos % BLOCK_SIZE) * stride_slot
    k_lat = tl.load(rows[:, None] + offs_l[None, :], mask=lat_mask)
    k_rope = tl.load(rows[:, None] + LORA + offs_r[None, :], mask=rope_mask)
    k_lat = tl.where(lat_mask, k_lat, 0.0).to(q_lat.dtype)
    k_rope = tl.where(rope_mask, k_rope, 0.0).to(q_rope.dtype)
    s = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PRECISION)
    s += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
    s = tl.where(visible, s * qk_scale, _NEG_BIG)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.where(visible, tl.exp2(s - m_new[:, None]), 0.0)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _mla_split_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    kv_lens_ptr,
    num_splits_ptr,
    split_len_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    num_heads,
    stride_qb,
    stride_qh,
    stride_blk,
    stride_slot,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    query_len,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)  # the query token's row
    r = b // query_len  # its request
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    if split >= tl.load(num_splits_ptr + r):
        return
    # Causal within the request's block: earlier tokens see fewer keys (a padded row none).
    kv_len = tl.load(kv_lens_ptr + r) - (query_len - 1 - b % query_len)
    split_len = tl.load(split_len_ptr + r)
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    head_mask = heads < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    l_mask = offs_l < LORA
    q_lat, q_rope = load_absorbed_query(
        q_ptr + b * stride_qb + heads * stride_qh, head_mask, LORA, ROPE, BLOCK_L, BLOCK_R
    )
    m_i = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table_row = block_tables_ptr + r * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < end
        m_i, l_i, acc = attend_latent_tile(
            q_lat, q_rope, m_i, l_i, acc, cache_ptr, table_row, pos, valid, valid[None, :],
            qk_scale, stride_blk, stride_slot, LORA, ROPE, BLOCK_L, BLOCK_R, BLOCK_SIZE,
            DOT_PRECISION,
        )  # fmt: skip
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    result = acc / safe_l[:, None]
    out_mask = head_mask[:, None] & l_mask[None, :]
    if MAX_SPLITS == 1:
        dst = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_l[None, :]
        tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = part_out_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps
        tl.store(part + offs_l[None, :], result, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), _NEG_BIG)
        lse_dst = part_lse_ptr + b * stride_lb + heads * stride_lh + split
        tl.store(lse_dst, lse, mask=head_mask)


@triton.jit
def _mla_merge_kernel(
    num_splits_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    query_len,
    LORA: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_splits = tl.load(num_splits_ptr + b // query_len)
    offs_l = tl.arange(0, BLOCK_L)
    l_mask = offs_l < LORA
    # Splits in chunks of BLOCK_S, with a running maximum (the partials' online softmax).
    m_i = tl.full([1], _NEG_BIG, tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_L], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        used = offs_s < num_splits
        lse_src = part_lse_ptr + b * stride_lb + h * stride_lh + offs_s
        lse = tl.load(lse_src, mask=used, other=_NEG_BIG)
        m_new = tl.maximum(m_i, tl.max(lse, 0))
        weights = tl.where(lse > _NEG_BIG, tl.exp2(lse - m_new), 0.0)
        part_src = part_out_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps
        parts = tl.load(
            part_src + offs_l[None, :], mask=(weights > 0)[:, None] & l_mask[None, :], other=0.0
        )
        alpha = tl.exp2(m_i - m_new)
        total = total * alpha + tl.sum(weights, 0)
        acc = acc * alpha + tl.sum(parts * weights[:, None], 0)
        m_i = m_new
    merged = acc / tl.where(total > 0, total, 1.0)
    dst = out_ptr + b * stride_ob + h * stride_oh + offs_l
    tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=l_mask)


def latent_layout(q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor) -> dict:
    """The constexprs of a latent kernel's launch for query rows ``q [..., H, L + R]``, the
    cache ``[blocks, block_size, L + R]`` and outputs ``out [..., H, L]`` (checked to match)."""
    entry, kv_lora_rank = q.shape[-1], out.shape[-1]
    rope = entry - kv_lora_rank
    assert cache.shape[-1] == entry and out.shape == (*q.shape[:-1], kv_lora_rank)
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and cache.stride(-1) == 1
    block_size = cache.shape[1]
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    return dict(
        LORA=kv_lora_rank,
        ROPE=rope,
        BLOCK_L=triton.next_power_of_2(kv_lora_rank),
        BLOCK_R=max(16, triton.next_power_of_2(rope)),
        BLOCK_SIZE=block_size,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


def mla_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    plan: MLADecodePlan,
    max_splits: int,
    out: torch.Tensor,
    partial_out: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
    query_len: int = 1,
) -> torch.Tensor:
    """Decode attention of ``q`` (``query_len`` tokens per request) over the latent cache;
    writes and returns ``out``.

    ``max_splits`` is the launch's grid depth (fixed per graph batch); with more than one the
    splits go to ``partial_out`` fp32 ``[B * query_len, H, max_splits, L]`` and
    ``partial_lse`` fp32 ``[B * query_len, H, max_splits]`` and a second launch merges them.
    The plan must have been written (:func:`plan_mla_decode`) for these ``kv_lens`` (one per
    request) and ``max_splits``.
    """
    batch, num_heads, _ = q.shape  # query tokens
    layout = latent_layout(q, cache, out)
    assert batch == kv_lens.shape[0] * query_len, "query_len tokens per request"
    if batch == 0:
        return out
    if max_splits > 1:
        assert partial_out.shape == (batch, num_heads, max_splits, kv_lora_rank)
        assert partial_lse.shape == (batch, num_heads, max_splits)
        assert partial_out.stride(-1) == 1 and partial_lse.stride(-1) == 1
        part_out, part_lse = partial_out, partial_lse
    else:
        part_out, part_lse = out, out  # unused: any tensor fills the pointer arguments
    _mla_split_kernel[(batch, triton.cdiv(num_heads, LAUNCH.block_h), max_splits)](
        q,
        cache,
        block_tables,
        kv_lens,
        plan.num_splits,
        plan.split_len,
        out,
        part_out,
        part_lse,
        scale * _LOG2E.value,
        num_heads,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2) if max_splits > 1 else 0,
        part_lse.stride(0),
        part_lse.stride(1),
        query_len,
        BLOCK_H=LAUNCH.block_h,
        BLOCK_N=LAUNCH.block_n,
        MAX_SPLITS=max_splits,
        num_warps=LAUNCH.num_warps or (8 if layout["BLOCK_L"] >= 256 else 4),
        num_stages=LAUNCH.num_stages,
        **layout,
    )
    if max_splits > 1:
        _mla_merge_kernel[(batch, num_heads)](
            plan.num_splits,
            out,
            partial_out,
            partial_lse,
            out.stride(0),
            out.stride(1),
            partial_out.stride(0),
            partial_out.stride(1),
            partial_out.stride(2),
            partial_lse.stride(0),
            partial_lse.stride(1),
            query_len,
            LORA=kv_lora_rank,
            BLOCK_L=layout["BLOCK_L"],
            BLOCK_S=min(_MERGE_CHUNK, triton.next_power_of_2(max_splits)),
        )
    return out
