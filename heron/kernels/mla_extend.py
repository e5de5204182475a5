"""Latent attention (MLA) extend over a paged latent cache: the new tokens of every request
(prefill, chunked-prefill continuations, prefix hits, decode rows of a mixed step), causal over
the request's cached entries, with the weights absorbed as in decode.

The absorbed form attends over the cache as stored (one latent "KV head", ``L + R`` wide,
shared by every query head) instead of decompressing each request's history through
``kv_b_proj``. Per head, decompressing costs ``2 L (nope + v)`` FLOPs per key, absorbing the
same per new query, and each (query, key) pair costs ``2 (L + R) + 2 L`` absorbed against
``2 (nope + rope) + 2 v`` decompressed. So the absorbed form is the cheaper one when few new
tokens extend a long history (fewer than ``L (nope + v) / (2 L + R - nope - rope - v)``, about
170 at DeepSeek's widths): the decode rows of mixed steps and short chunks; decompressing is
cheaper for long fresh prefills. It also needs no host-known count of the step's keys.

Layout contract (all tensors on one device):

* ``q``: ``[T, H, L + R]``, the absorbed query of all requests' new tokens back to back (last
  dim contiguous); request ``r`` owns rows ``query_start_loc[r]:query_start_loc[r + 1]``.
  ``out``: ``[T, H, L]``.
* ``cache``: ``[num_blocks, block_size, L + R]`` with the new tokens' entries already written;
  ``block_tables``: int32 ``[B, width]`` (position ``p`` in block ``block_tables[r, p //
  block_size]`` at offset ``p % block_size``).
* ``kv_lens``: int32 ``[B]``, tokens in the cache including the new ones, so new token ``i`` of
  a request with ``q_len`` new tokens is at position ``kv_len - q_len + i``.

Masked keys are never loaded; accumulation is fp32. The grid is sized from the token and
request counts alone (no host copy of the lengths), so a call can be captured in a graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.mla_decode import (
    _LOG2E,
    _NEG_BIG,
    attend_latent_tile,
    latent_layout,
    load_absorbed_query,
)

# (token, head) rows per program (tokens x heads of one request), keys per tile, and one
# pipeline stage: chosen by ptxas register reports for sm_90 (not by timing) as the tallest
# tile whose fp32 accumulator [rows, 512] and query fit in registers without spills.
_BLOCK_M = 32
_BLOCK_N = 32


@triton.jit
def _tile_request(query_start_ptr, tile, num_reqs, BLOCK_T: tl.constexpr):
    """The request that owns ``tile`` of the launch's flat tile index: request ``r``'s tiles
    start at ``query_start[r] // BLOCK_T + r`` (so it has at least the ``cdiv(q_len,
    BLOCK_T)`` it needs, and the grid needs only ``tokens // BLOCK_T + reqs``); a binary
    search over those starts."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_T + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _mla_extend_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    kv_lens_ptr,
    out_ptr,
    qk_scale,
    num_reqs,
    num_heads,
    stride_qt,
    stride_qh,
    stride_blk,
    stride_slot,
    stride_bt,
    stride_ot,
    stride_oh,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: BLOCK_T new tokens x BLOCK_H heads of one request, as one tile of rows
    (every row shares the keys, so the tile's height is what a key tile is reused for)."""
    tile = tl.program_id(0)
    r = _tile_request(query_start_ptr, tile, num_reqs, BLOCK_T)
    q_start = tl.load(query_start_ptr + r)
    q_len = tl.load(query_start_ptr + r + 1) - q_start
    t0 = (tile - q_start // BLOCK_T - r) * BLOCK_T
    # A request has up to one tile more than its tokens fill.
    if t0 >= q_len:
        return
    context = tl.load(kv_lens_ptr + r) - q_len  # position of the request's first new token
    rows = tl.arange(0, BLOCK_T * BLOCK_H)
    tokens = t0 + rows // BLOCK_H
    heads = tl.program_id(1) * BLOCK_H + rows % BLOCK_H
    row_mask = (tokens < q_len) & (heads < num_heads)
    q_pos = context + tokens
    q_rows = (q_start + tokens).to(tl.int64) * stride_qt + heads * stride_qh
    q_lat, q_rope = load_absorbed_query(q_ptr + q_rows, row_mask, LORA, ROPE, BLOCK_L, BLOCK_R)

    m_i = tl.full([BLOCK_T * BLOCK_H], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_T * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_L], tl.float32)
    table_row = block_tables_ptr + r.to(tl.int64) * stride_bt
    hi = context + tl.minimum(t0 + BLOCK_T, q_len)  # the causal end of the tile's last token
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < hi
        # Rows past the request's tokens have q_pos >= hi; `valid` keeps them off unread keys.
        visible = (pos[None, :] <= q_pos[:, None]) & valid[None, :]
        m_i, l_i, acc = attend_latent_tile(
            q_lat, q_rope, m_i, l_i, acc, cache_ptr, table_row, pos, valid, visible, qk_scale,
            stride_blk, stride_slot, LORA, ROPE, BLOCK_L, BLOCK_R, BLOCK_SIZE, DOT_PRECISION,
        )  # fmt: skip
    # Every real row sees at least its own key; the guard keeps padding rows finite.
    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    offs_l = tl.arange(0, BLOCK_L)
    out_rows = (q_start + tokens).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(
        out_ptr + out_rows[:, None] + offs_l[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & (offs_l < LORA)[None, :],
    )


def mla_extend_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of the absorbed queries ``q`` over the latent cache; writes and
    returns ``out`` (shapes in the module docstring)."""
    num_tokens, num_heads, _ = q.shape
    layout = latent_layout(q, cache, out)
    num_reqs = kv_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    block_h = min(triton.next_power_of_2(num_heads), _BLOCK_M)
    block_t = _BLOCK_M // block_h
    grid = (num_tokens // block_t + num_reqs, triton.cdiv(num_heads, block_h))
    _mla_extend_kernel[grid](
        q,
        cache,
        block_tables,
        query_start_loc,
        kv_lens,
        out,
        scale * _LOG2E.value,
        num_reqs,
        num_heads,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_H=block_h,
        BLOCK_T=block_t,
        BLOCK_N=_BLOCK_N,
        num_warps=8 if layout["BLOCK_L"] >= 256 else 4,
        num_stages=1,
        **layout,
    )
    return out
