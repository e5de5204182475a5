"""Variable-length causal attention of each request's new tokens over its paged KV history.

Serves prefill, chunked-prefill continuations, prefix-cache hits and mixed batches (requests
with one new token included). Layout contract (all tensors on one device):

* ``q``, ``out``: ``[T, H, D]``, the new tokens of all requests back to back (any strides,
  last dim contiguous); request ``r`` owns rows ``query_start_loc[r]:query_start_loc[r + 1]``.
* ``kv_cache``: ``[2, num_blocks, block_size, KVH, D]`` (0 = K, 1 = V), the model dtype, with
  the new tokens' K/V ALREADY written; everything is read from it through the block table.
* ``block_tables``: int32 ``[B, width]``; position ``p`` of request ``r`` lives in block
  ``block_tables[r, p // block_size - table_starts[r]]`` at offset ``p % block_size``.
* ``table_starts``: int32 ``[B]``, the table index each row starts at (the step metadata's):
  0 without a window; with one, the block of the first key the request's first new token
  sees, so that a windowed row starts at the window.
* ``query_start_loc``: int32 ``[B + 1]``; ``kv_lens``: int32 ``[B]``, cached tokens including
  the new ones, so new token ``i`` of a request with ``q_len`` new tokens is at position
  ``kv_len - q_len + i``.
* ``sinks`` (optional, gpt-oss): ``[H]``, any float dtype: one learned logit per head, in the
  units of the scaled scores, that joins every softmax's normaliser and adds nothing to the
  output.
* ``key_limits`` (optional, Gemma 3's images): int32 ``[T]``, the last position each new token
  sees (at least its own; past it for a token of an image whose tokens attend to the whole
  image). Every position up to a limit must be among the request's ``kv_len`` keys.

Scores are ``s = (q . k) * scale``, soft-capped to ``cap * tanh(s / cap)`` when a ``softcap`` is
given (Gemma 2), then masked. Soft-caps, sinks and key limits are constexpr flags of the
kernel, so a step without them compiles to exactly the plain kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.attention_decode import add_sink, score_constants, scores
from heron.kernels.pdl import pdl_launch, wait_for_previous_kernel

# Finite "minus infinity" for the running max: a fully masked tile then gives exp2(-inf) = 0
# and a rescale factor of exp2(0) = 1, instead of the NaN of (-inf) - (-inf).
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _extend_kernel(
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    table_starts_ptr,
    query_start_ptr,
    kv_lens_ptr,
    out_ptr,
    qk_scale,  # softmax scale * log2(e); with HAS_SOFTCAP, 2 * softmax scale * log2(e) / cap
    window,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_blk,
    stride_slot,
    stride_kvh,
    stride_btb,
    stride_ot,
    stride_oh,
    sinks_ptr,
    softcap,  # with HAS_SOFTCAP: cap * log2(e) (see decode.score_constants)
    v_scale,  # an FP8 cache's V scale (its K scale is in qk_scale)
    key_limits_ptr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_KEY_LIMITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program: BLOCK_M new tokens of one request for one query head."""
    wait_for_previous_kernel(USE_PDL)
    r = tl.program_id(0)
    m_block = tl.program_id(1)
    h = tl.program_id(2)

    q_start = tl.load(query_start_ptr + r)
    q_len = tl.load(query_start_ptr + r + 1) - q_start
    m0 = m_block * BLOCK_M
    # The grid is sized for the longest request; shorter ones have nothing here.
    if m0 >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + r)
    context = kv_len - q_len  # position of the request's first new token

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m < q_len
    q_pos = context + offs_m

    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )
    dt = q_ptr.dtype.element_ty  # an FP8 cache's keys and values are converted to it

    # Keys up to the causal end of the block's last real row, from the window start of its
    # first row (aligned down to a tile; earlier positions are masked per element).
    hi = context + tl.minimum(m0 + BLOCK_M, q_len)
    if HAS_KEY_LIMITS:  # a row may see past itself: up to the furthest limit of the block
        limit = tl.load(key_limits_ptr + q_start + offs_m, mask=row_mask, other=0)
        hi = tl.maximum(hi, tl.minimum(tl.max(limit, 0) + 1, kv_len))
    else:
        limit = q_pos
    if USE_WINDOW:
        lo = (tl.maximum(context + m0 - window + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        lo = hi * 0
    # A windowed row starts at the window (the row's table start, see the module docstring);
    # keys before its first block are outside every new token's window.
    table_start = tl.load(table_starts_ptr + r)
    row_start = table_start * BLOCK_SIZE

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    table_row = block_tables_ptr + r.to(tl.int64) * stride_btb - table_start
    kv_head = kv_ptr + (h // GROUP).to(tl.int64) * stride_kvh
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + offs_n
        in_range = (k_pos >= row_start) & (k_pos < hi)
        block_ids = tl.load(table_row + k_pos // BLOCK_SIZE, mask=in_range, other=0)
        # int64: block_id * block stride overflows int32 for caches beyond 2^31 elements.
        tok_off = block_ids.to(tl.int64) * stride_blk + (k_pos % BLOCK_SIZE) * stride_slot
        k_ptrs = kv_head + tok_off[:, None] + offs_d[None, :]
        k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0).to(dt)

        visible = (k_pos[None, :] <= limit[:, None]) & in_range[None, :]
        if USE_WINDOW:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        qk = scores(
            tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale, softcap, HAS_SOFTCAP
        )
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # V is loaded only now, after the softmax, so K and V tiles are not live together.
        v = tl.load(k_ptrs + stride_kv, mask=in_range[:, None], other=0.0).to(dt)
        acc = acc * alpha[:, None] + tl.dot(p.to(dt), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if HAS_SINKS:
        l_i, acc = add_sink(m_i, l_i, acc, tl.load(sinks_ptr + h).to(tl.float32))
    # Every real row sees at least its own key, so l_i > 0 there; the guard keeps padding rows
    # of the tile finite.
    result = acc * v_scale / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None],
    )


def paged_extend_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    table_starts: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens over their requests' paged KV; writes, returns ``out``.

    Shapes are in the module docstring. A query at position ``p`` sees keys ``j`` with
    ``p - sliding_window < j <= p`` (all ``j <= p`` when the window is None), or up to its
    key limit instead of ``p`` where ``key_limits`` are given. ``softcap``
    caps the scaled scores (Gemma 2), ``sinks`` [H] joins each head's softmax (gpt-oss).
    ``max_query_len`` (a host int, at least the longest request's new-token count) sizes the
    grid; programs beyond a request's new tokens return at once. An FP8 (E4M3) cache holds
    ``K / k_scale`` and ``V / v_scale``.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    num_reqs = kv_lens.shape[0]
    assert cache_head_dim == head_dim and out.shape == q.shape
    assert head_dim in (16, 32, 64, 128, 256), f"unsupported head_dim {head_dim}"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and kv_cache.stride(-1) == 1
    assert sinks is None or (sinks.shape == (num_heads,) and sinks.stride(0) == 1)
    assert softcap is None or softcap > 0
    assert key_limits is None or (key_limits.shape == (num_tokens,) and key_limits.stride(0) == 1)
    if num_tokens == 0 or num_reqs == 0 or max_query_len == 0:
        return out
    qk_scale, softcap_log2 = score_constants(scale * k_scale, softcap)
    # Tiles and warps chosen (by ptxas register reports for sm_90, not by timing) so q, the
    # K/V tiles and the fp32 accumulator fit in registers: no spills up to head_dim 128.
    block_m, block_n = (64, 64) if head_dim <= 128 else (64, 32)
    num_warps = 4 if head_dim <= 64 else 8
    grid = (num_reqs, triton.cdiv(max_query_len, block_m), num_heads)
    _extend_kernel[grid](
        q,
        kv_cache,
        block_tables,
        table_starts,
        query_start_loc,
        kv_lens,
        out,
        qk_scale,
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
        out if sinks is None else sinks,  # any valid pointer when unused
        softcap_log2,
        v_scale,
        out if key_limits is None else key_limits,  # any valid pointer when unused
        GROUP=num_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        HAS_KEY_LIMITS=key_limits is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=2,
        **pdl_launch(q.device),
    )
    return out
