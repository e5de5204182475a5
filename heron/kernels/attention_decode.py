"""Flash-decoding over a paged KV cache: one query token per request, split-KV, graph-safe.

Layout contract (all tensors on one device):

* ``q``, ``out``: ``[B, H, D]`` (any strides, last dim contiguous).
* ``kv_cache``: ``[2, num_blocks, block_size, KVH, D]`` (0 = K, 1 = V), the model dtype or FP8; block 0
  is the null block that padded rows point at.
* ``block_tables``: int32 ``[B, width]``; position ``p`` of request ``r`` lives in block
  ``block_tables[r, p // block_size - table_starts[r]]`` at offset ``p % block_size``.
* ``table_starts``: int32 ``[B]``, the table index each row starts at (the step metadata's):
  0 without a window; with one, the block of the first key the query sees, so that a windowed
  row starts at the window.
* ``kv_lens``: int32 ``[B]``, tokens in the cache including this step's (already written) one;
  0 marks a padded row, whose output is zeros.
* ``partial_out``: fp32 ``[B, H, num_splits, D]``, ``partial_lse``: fp32 ``[B, H, num_splits]``
  and ``tickets``: int32, at least ``tickets_needed(B, KVH, num_splits)`` entries, all zero:
  the split workspace (only used when ``num_splits > 1``, see below).
* ``sinks`` (optional, gpt-oss): ``[H]``, any float dtype: one learned logit per head, in the
  units of the scaled scores, that joins every softmax's normaliser and adds nothing to the
  output. It is added once per (request, head), by whichever program finishes the softmax.

One launch does the whole call. With ``num_splits > 1`` (flash-decoding) each program covers
one contiguous split of a request's visible range for the query heads of one KV head, stores
its partial output and log-sum-exp, and takes a ticket from the counter of its (request,
KV head); the program that draws the last ticket merges all the splits (in split order, so the
result does not depend on the arrival order), adds the sinks, writes ``out`` and sets the
counter back to zero. When more than ``_MERGE_GROUP`` splits have keys the merge has two
levels: the last program of each group of ``_MERGE_GROUP`` splits (by its group's counter)
merges the group into the group's first partial slot, then the last of those merges the
groups, so no program reads more than ``_MERGE_GROUP`` partials. The
counters are zeroed once by their owner and left at zero by every
call, so a call needs no memset. Rule: calls sharing ``tickets`` (and the partials) must run
one after another, each finishing before the next starts: one stream, as for the layers of a
model (two streams running split calls at once on shared tickets would mix their counts).

Scores are ``s = (q . k) * scale``, soft-capped to ``cap * tanh(s / cap)`` when a ``softcap`` is
given (Gemma 2), then masked. Both features are constexpr flags of the kernels, so a layer
without them compiles to exactly the plain kernels.

Every length-dependent quantity (visible range, split bounds) is computed inside the kernels
from ``kv_lens``, so one launch configuration serves any lengths: the call never synchronises
with the host and can be captured in a CUDA graph and replayed with new lengths and tables.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from heron.kernels.pdl import (
    fits_one_wave,
    pdl_launch,
    start_next_kernel,
    wait_for_previous_kernel,
)

# Logits are scaled by log2(e) so the online softmax can use exp2; LSEs stay in log2 units
# between a split and the merge (never exposed). Sinks and soft-caps are converted to those
# units as well.
_LOG2E = 1.4426950408889634
_LOG2E_JIT = tl.constexpr(_LOG2E)  # the same, for kernels (they read only constexpr globals)
# Finite "minus infinity" for the running max: a fully masked tile then gives exp2(-inf) = 0
# and a rescale factor of exp2(0) = 1, instead of the NaN of (-inf) - (-inf).
_NEG_BIG = tl.constexpr(-1.0e30)
# Keys per tile. Tiles are gathered token by token through the block table, so they need not
# match the cache block size; 64 keeps K and V tiles of head_dim 256 within shared memory.
# A split is a whole number of tiles, so one tile is the smallest useful split.
_BLOCK_N = 64
_MAX_SPLITS = 128
# fp32 values per thread of the merge's [heads, splits, head_dim] tile of partial outputs:
# it loads many splits at once (one L2 round trip per chunk, not per split) within registers.
_MERGE_VALUES_PER_THREAD = 32
# The most partial results one program merges (see the module docstring): one program merging
# every split of a long context is slow, groups of this size measured fastest
# (`benchmarks/tune_decode_attention.py --splits`).
_MERGE_GROUP = 16


def tickets_needed(batch: int, num_kv_heads: int, num_splits: int) -> int:
    """The split workspace's tickets for a launch: one per (request, KV head), and one per
    group of ``_MERGE_GROUP`` splits of each when there are more splits than that (the
    two-level merge)."""
    groups = triton.cdiv(num_splits, _MERGE_GROUP) if num_splits > _MERGE_GROUP else 0
    return batch * num_kv_heads * (1 + groups)


@triton.jit
def soft_cap(qk, qk_scale, softcap):
    """Gemma 2's soft-capped logit ``cap * tanh(s / cap)`` of the raw scores ``qk`` (q . k), in
    log2 units, as ``cap - 2 cap / (exp(2 s / cap) + 1)``: ``qk_scale`` is
    ``2 * scale * log2(e) / cap`` and ``softcap`` is ``cap * log2(e)``.

    One exp2 and one division (libdevice's tanh does not run in Triton's interpreter, and this
    is cheaper than a sign-symmetric form); exact to a few ulps of the cap in absolute terms.
    Past the exponent range, exp2 gives inf and the logit the cap.
    """
    return softcap - (2.0 * softcap) / (tl.exp2(qk * qk_scale) + 1.0)


@triton.jit
def scores(qk, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """The raw scores ``qk`` (q . k) scaled into log2 units, soft-capped with ``HAS_SOFTCAP``;
    ``qk_scale`` and ``softcap`` come from :func:`score_constants`."""
    if HAS_SOFTCAP:
        return soft_cap(qk, qk_scale, softcap)
    return qk * qk_scale


def score_constants(scale: float, softcap: float | None) -> tuple[float, float]:
    """``(qk_scale, softcap)`` kernel arguments for a softmax scale and an optional cap."""
    if softcap is None:
        return scale * _LOG2E, 0.0
    return 2.0 * scale * _LOG2E / softcap, softcap * _LOG2E  # the constants of soft_cap


@triton.jit
def add_sink(m_i, l_i, acc, sink):
    """Joins a sink logit to an online softmax state (log2 units) at the end of its key loop.

    ``sink`` is fp32 in the units of the scaled scores (one per row, or one for all rows);
    ``m_i`` [rows] is the running max, ``l_i`` [rows] the normaliser and ``acc`` [rows, D] the
    unnormalised output, both relative to ``m_i``. The sink adds ``exp(sink)`` to the
    normaliser and nothing to the output; returns ``(l_i, acc)`` relative to the new max. A row
    that saw no key (``m_i`` the finite minus infinity) gets ``l_i = 1`` and ``acc = 0``.
    """
    sink = sink * _LOG2E_JIT
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


@triton.jit
def _normalised(m_i, l_i, acc, sinks_ptr, heads, head_mask, HAS_SINKS: tl.constexpr):
    """The output of a finished online softmax state (``m_i``, ``l_i`` [rows], ``acc``
    [rows, D], log2 units), the sinks of ``heads`` joining the normaliser with ``HAS_SINKS``.
    A row that saw no key gets zeros, sink or not."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
        l_i, acc = add_sink(m_i, l_i, acc, sink)
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]


@triton.jit
def _store_heads(out_ptr, b, heads, head_mask, offs_d, stride_ob, stride_oh, values):
    """Stores ``values`` [rows, D] as the outputs of request ``b``'s ``heads``."""
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, values.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])


@triton.jit
def _store_partial(
    part_out_ptr, part_lse_ptr, b, heads, head_mask, offs_d, slot, m_i, l_i, acc,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
):  # fmt: skip
    """Stores an online softmax state (``m_i``, ``l_i`` [rows], ``acc`` [rows, D], log2
    units) of request ``b``'s ``heads`` as the partial result in split ``slot``: its own
    softmax's output (no sink: the last merge adds it once) and its LSE. Rows without keys
    store nothing: merges read only the busy splits."""
    has_keys = l_i > 0.0
    partial = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    row = b.to(tl.int64)
    p_ptrs = (
        part_out_ptr
        + row * stride_pb
        + heads[:, None] * stride_ph
        + slot * stride_ps
        + offs_d[None, :]
    )
    store_mask = head_mask & has_keys
    tl.store(p_ptrs, partial, mask=store_mask[:, None])
    lse = m_i + tl.log2(tl.where(has_keys, l_i, 1.0))
    tl.store(part_lse_ptr + row * stride_lb + heads * stride_lh + slot, lse, mask=store_mask)


@triton.jit
def _merge_splits(
    part_out_ptr,
    part_lse_ptr,
    b,
    heads,
    head_mask,
    first_slot,
    slot_step,
    count,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    MERGE_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
):
    """The online softmax state (``m_i``, ``l_i``, ``acc``; log2 units) of the ``count``
    partial results in slots ``first_slot + i * slot_step`` of request ``b``'s ``heads``
    (``MERGE_H`` rows, ``head_mask`` the real ones).

    Each partial output is normalised by its own softmax and weighs ``2^lse``: the merge is an
    online softmax over the slots, ``SPLIT_CHUNK`` a step, in slot order (deterministic). A
    step's LSE and partial-output loads do not depend on each other, so each step costs one
    L2 round trip, and only the ``count`` busy slots are read: a graph sized for the longest
    context does not pay for its empty splits. Loads bypass L1 (``.cg``): the partials were
    written by other programs, possibly on other SMs.
    """
    offs_s = tl.arange(0, SPLIT_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    lse_rows = part_lse_ptr + b.to(tl.int64) * stride_lb + heads[:, None] * stride_lh
    out_rows = (
        part_out_ptr
        + b.to(tl.int64) * stride_pb
        + heads[:, None, None] * stride_ph
        + offs_d[None, None, :]
    )

    m_i = tl.full([MERGE_H], _NEG_BIG, tl.float32)
    l_i = tl.zeros([MERGE_H], tl.float32)
    acc = tl.zeros([MERGE_H, HEAD_DIM], tl.float32)
    for first in range(0, count, SPLIT_CHUNK):
        index = first + offs_s
        slots = first_slot + index * slot_step
        valid = head_mask[:, None] & (index < count)[None, :]
        lse = tl.load(
            lse_rows + slots[None, :], mask=valid, other=float("-inf"), cache_modifier=".cg"
        )
        parts = tl.load(
            out_rows + slots[None, :, None] * stride_ps,
            mask=valid[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m_i, tl.max(lse, 1))
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new[:, None])  # 0 where masked (lse = -inf)
        l_i = l_i * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(parts * w[:, :, None], 1)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _last_ticket(ticket_ptr, programs):
    """Whether this program is the last of ``programs`` to take a ticket at ``ticket_ptr``;
    that program also sets the counter back to zero for the next launch. Every thread's stores
    are issued before the ticket is taken; the acq_rel atomic publishes them (release) and,
    for the last program, makes the other programs' stores visible to its loads (acquire)."""
    tl.debug_barrier()
    last = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu") == programs - 1
    if last:
        tl.store(ticket_ptr, 0)
    return last


@triton.jit
def _tile(table_row, kv_head, start, kv_len, offs_n, offs_d, stride_blk, stride_slot,
          BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """The K pointers [BLOCK_N, D] of the tile of keys from position ``start`` (V lies one
    ``stride_kv`` further) and which of its positions are visible (``pos < kv_len``; tiles
    start at the first visible key or later)."""
    pos = start + offs_n
    valid = pos < kv_len
    block_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0)
    # int64: block_id * block stride overflows int32 for caches beyond 2^31 elements.
    tok_off = block_ids.to(tl.int64) * stride_blk + (pos % BLOCK_SIZE) * stride_slot
    return kv_head + tok_off[:, None] + offs_d[None, :], valid


@triton.jit
def _value_tile(x, dt, BY_PTX: tl.constexpr):
    """A value tile ``x`` converted to the dots' type ``dt``. With ``BY_PTX`` (E4M3 to fp16),
    by inline PTX that Triton cannot move: it would otherwise convert after the layout change
    into the dot's operand, which for values (keys along the dot's reduction, strided in
    memory) reads shared memory a byte at a time, where fp16 is transposed by ``ldmatrix``."""
    if BY_PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r",
            [x.to(tl.uint8, bitcast=True)],
            dtype=tl.float16,
            is_pure=False,
            pack=4,
        )
    return x.to(dt)


@triton.jit
def _softmax_step(q, k, valid, m_i, l_i, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Folds a tile's scores into the online softmax (running max ``m_i``, normaliser ``l_i``):
    returns the tile's weights ``p``, the factor ``alpha`` that rescales the output so far, and
    the new max and normaliser."""
    qk = scores(
        tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale, softcap, HAS_SOFTCAP
    )
    qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _decode_kernel(
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    table_starts_ptr,
    kv_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    tickets_ptr,
    qk_scale,  # softmax scale * log2(e); with HAS_SOFTCAP, 2 * softmax scale * log2(e) / cap
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
    sinks_ptr,
    softcap,  # with HAS_SOFTCAP: cap * log2(e) (see soft_cap)
    v_scale,  # an FP8 cache's V scale (its K scale is in qk_scale)
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MERGE_H: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    MERGE_GROUP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    START_NEXT: tl.constexpr,
    USE_PDL: tl.constexpr,
    F16_DOT: tl.constexpr,
    QUERIES: tl.constexpr,
    FP8_CVT: tl.constexpr,
):
    """One program: all GROUP query heads of one KV head, over one split of the KV range; with
    several splits, the last of a (request, KV head)'s programs to finish merges them. With
    ``QUERIES > 1`` a program's row is one of a verification row's tokens (see
    :func:`paged_decode_attention`).

    Before it waits for the previous kernel, a program loads the keys and values of its first
    tile, all but the newest: the lengths, tables and table starts were copied before the
    step's kernels and the cached keys and values written by earlier steps, so no running
    kernel writes them. The newest key and value (position ``kv_len - 1``) are this step's, written by the kernel
    before (which lets this one start early, see ``heron.kernels.pdl.start_next_kernel``): they
    are loaded after the wait. With ``START_NEXT`` (a launch that fits one wave) a program lets
    the output projection after it start once it has waited. With ``F16_DOT`` keys, values
    and the query are fp16 in the dots (an FP8 cache, see :func:`_f16_dot`), and with
    ``FP8_CVT`` too (:func:`fp8_conversions`) value tiles are converted by inline PTX. With
    ``QUERIES > 1`` every token of a row is this step's, so a program loads nothing from the
    cache before its wait."""
    b = tl.program_id(0)  # the query row; with QUERIES > 1 token b % QUERIES of request r
    r = b // QUERIES
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if QUERIES > 1:
        wait_for_previous_kernel(USE_PDL)
        if START_NEXT:
            start_next_kernel(USE_PDL)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP
    heads = kvh * GROUP + offs_h

    kv_len = tl.load(kv_lens_ptr + r)
    if QUERIES > 1:  # the token sees the keys up to its own (a padded row's none)
        kv_len = tl.maximum(kv_len - (QUERIES - 1 - b % QUERIES), 0)
    if USE_WINDOW:
        first = tl.maximum(kv_len - window, 0)
    else:
        first = kv_len * 0
    # Splits are whole tiles from `first` on (a window of W keys is cdiv(W, BLOCK_N) tiles,
    # wherever it starts: tiles are gathered key by key, so they need not start on a cache
    # block); with more splits than tiles the last ones are empty, and the splits that start
    # before `kv_len` all have keys.
    per_split = tl.cdiv(kv_len - first, NUM_SPLITS)
    per_split = tl.cdiv(per_split, BLOCK_N) * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, kv_len)
    busy = tl.cdiv(kv_len - first, tl.maximum(per_split, 1))  # splits with keys; 0 if padded

    # A windowed row starts at the window (the row's table start, see the module docstring).
    table_start = tl.load(table_starts_ptr + r)
    table_row = block_tables_ptr + r.to(tl.int64) * stride_btb - table_start
    kv_head = kv_ptr + kvh.to(tl.int64) * stride_kvh
    k_ptrs, valid = _tile(table_row, kv_head, lo, kv_len, offs_n, offs_d,
                          stride_blk, stride_slot, BLOCK_SIZE)  # fmt: skip
    last = kv_len - 1  # the newest key's position
    newest = valid & (lo + offs_n == last)
    cached = (valid & ~newest)[:, None]
    dt = q_ptr.dtype.element_ty  # an FP8 cache's keys and values are converted to it
    if F16_DOT:
        dt = tl.float16
    k = tl.load(k_ptrs, mask=cached, other=0.0).to(dt)
    v = _value_tile(tl.load(k_ptrs + stride_kv, mask=cached, other=0.0), dt, F16_DOT and FP8_CVT)
    in_tile = (last >= lo) & (last < lo + BLOCK_N)
    last_block = tl.load(table_row + last // BLOCK_SIZE, mask=in_tile, other=0).to(tl.int64)
    last_key = kv_head + last_block * stride_blk + (last % BLOCK_SIZE) * stride_slot + offs_d

    if QUERIES == 1:
        wait_for_previous_kernel(USE_PDL)
        if START_NEXT:  # the output projection is scheduled now, on the idle multiprocessors
            start_next_kernel(USE_PDL)
    k_new = tl.load(last_key, mask=in_tile, other=0.0).to(dt)
    k = tl.where(newest[:, None], k_new[None, :], k)
    v_new = tl.load(last_key + stride_kv, mask=in_tile, other=0.0).to(dt)
    v = tl.where(newest[:, None], v_new[None, :], v)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_rows, mask=head_mask[:, None], other=0.0).to(dt)

    m_i = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    p, alpha, m_i, l_i = _softmax_step(q, k, valid, m_i, l_i, qk_scale, softcap,
                                       HAS_SOFTCAP, DOT_PRECISION)  # fmt: skip
    acc = acc * alpha[:, None] + tl.dot(p.to(dt), v, input_precision=DOT_PRECISION)
    for start in range(lo + BLOCK_N, hi, BLOCK_N):
        k_ptrs, valid = _tile(table_row, kv_head, start, kv_len, offs_n, offs_d,
                              stride_blk, stride_slot, BLOCK_SIZE)  # fmt: skip
        k = tl.load(k_ptrs, mask=valid[:, None], other=0.0).to(dt)
        p, alpha, m_i, l_i = _softmax_step(q, k, valid, m_i, l_i, qk_scale, softcap,
                                           HAS_SOFTCAP, DOT_PRECISION)  # fmt: skip
        # V is loaded only now, after the softmax, so K and V tiles are not live together.
        v = _value_tile(
            tl.load(k_ptrs + stride_kv, mask=valid[:, None], other=0.0), dt, F16_DOT and FP8_CVT
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(dt), v, input_precision=DOT_PRECISION)
    acc *= v_scale

    if NUM_SPLITS == 1:
        # This program saw the whole range, so it finishes the softmax, sink included.
        result = _normalised(m_i, l_i, acc, sinks_ptr, heads, head_mask, HAS_SINKS)
        _store_heads(out_ptr, b, heads, head_mask, offs_d, stride_ob, stride_oh, result)
    else:
        _store_partial(
            part_out_ptr, part_lse_ptr, b, heads, head_mask, offs_d, split, m_i, l_i, acc,
            stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
        )  # fmt: skip
        # The last program of a (request, KV head) merges its splits: directly when at most
        # MERGE_GROUP have keys; else the last of each group of MERGE_GROUP merges its group
        # into the group's first slot, and the last of those merges the groups. Every program
        # of a (request, KV head) sees the same `busy`, so all take the same path.
        offs_m = tl.arange(0, MERGE_H)
        merge_heads = kvh * GROUP + offs_m
        merge_mask = offs_m < GROUP
        pair = b * tl.num_programs(1) + kvh
        # (Scalars that a runtime branch reassigns start as tensors of their type.)
        top = tl.full([], NUM_SPLITS, tl.int32)  # programs taking the top-level ticket
        stride = tl.full([], 1, tl.int32)  # slots apart of the partials the top merges
        merge = tl.full([], 1, tl.int1)  # whether this program takes the top-level ticket
        if NUM_SPLITS > MERGE_GROUP:
            groups: tl.constexpr = (NUM_SPLITS + MERGE_GROUP - 1) // MERGE_GROUP
            if busy > MERGE_GROUP:
                top = tl.full([], groups, tl.int32)
                stride = tl.full([], MERGE_GROUP, tl.int32)
                group = split // MERGE_GROUP
                in_group = tl.minimum(NUM_SPLITS - group * MERGE_GROUP, MERGE_GROUP)
                pairs = tl.num_programs(0) * tl.num_programs(1)
                merge = _last_ticket(tickets_ptr + pairs + pair * groups + group, in_group)
                if merge:
                    m_g, l_g, acc_g = _merge_splits(
                        part_out_ptr, part_lse_ptr, b, merge_heads, merge_mask,
                        group * MERGE_GROUP, 1,
                        tl.minimum(tl.maximum(busy - group * MERGE_GROUP, 0), MERGE_GROUP),
                        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                        MERGE_H, HEAD_DIM, SPLIT_CHUNK,
                    )  # fmt: skip
                    _store_partial(
                        part_out_ptr, part_lse_ptr, b, merge_heads, merge_mask, offs_d,
                        group * MERGE_GROUP, m_g, l_g, acc_g,
                        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                    )  # fmt: skip
        if merge:
            if _last_ticket(tickets_ptr + pair, top):
                m_t, l_t, acc_t = _merge_splits(
                    part_out_ptr, part_lse_ptr, b, merge_heads, merge_mask, 0, stride,
                    tl.cdiv(busy, stride),
                    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                    MERGE_H, HEAD_DIM, SPLIT_CHUNK,
                )  # fmt: skip
                result = _normalised(m_t, l_t, acc_t, sinks_ptr, merge_heads, merge_mask, HAS_SINKS)
                _store_heads(
                    out_ptr, b, merge_heads, merge_mask, offs_d, stride_ob, stride_oh, result
                )


def _launch_shape(head_dim: int, num_splits: int) -> tuple[int, int, int]:
    """``(keys per tile, num_warps, num_stages)`` of the decode kernel, as measured fastest
    (``benchmarks/tune_decode_attention.py``). Split programs walk a few tiles each and keep
    two stages at ``_BLOCK_N`` keys (so ``choose_num_splits`` counts the tiles they walk).
    Without splits (large batches) a program walks a whole context: at head_dim 256 a third
    stage keeps more tiles in flight; at 128 and below two stages are faster, over a model-dtype
    or an FP8 cache alike."""
    if head_dim > 128:
        return _BLOCK_N, 8, 3 if num_splits == 1 else 2
    return _BLOCK_N, 4, 2


def _f16_dot(fp8: bool, q: torch.Tensor) -> bool:
    """Whether the kernel converts an FP8 cache's tiles (and the query) to fp16 rather than to
    the query's bf16: E4M3 becomes fp16 in one conversion, bf16 in more, and at head_dim 128
    and below that conversion bounds the kernel. Every E4M3 value is exact in fp16; a query
    entry past fp16's range (65,504) would overflow, far beyond what attention layers make."""
    return fp8 and q.dtype == torch.bfloat16 and q.shape[-1] <= 128


@functools.cache
def fp8_conversions(device: torch.device) -> bool:
    """Whether ``device`` converts E4M3 in hardware (CUDA compute capability 8.9 and newer),
    which the kernel then asks for by inline PTX (see :func:`_value_tile`)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_kv_len: int,
    num_sms: int,
    sliding_window: int | None = None,
) -> int:
    """Splits per (request, KV head) so the grid fills ``num_sms`` multiprocessors.

    A power of two; 1 when ``batch * num_kv_heads`` programs already fill the GPU. A split is
    a whole number of ``_BLOCK_N``-key tiles, so more splits than the tiles a request's visible
    range can span only add empty programs: the count is at most that many tiles (rounded up
    to a power of two), and ``_MAX_SPLITS``. ``max_kv_len`` is the longest length the launch
    must serve (the model's max length for a captured graph, so that a graph's count depends
    on its batch only). Tiles start at a request's first visible key, so a
    ``sliding_window`` ``W`` shorter than that is ``cdiv(W, _BLOCK_N)`` tiles.
    """
    programs = max(1, batch * num_kv_heads)
    if programs >= num_sms:
        return 1
    visible = min(max_kv_len, sliding_window or max_kv_len)
    tiles = triton.cdiv(visible, _BLOCK_N)
    wanted = min(triton.cdiv(num_sms, programs), tiles, _MAX_SPLITS)
    return triton.next_power_of_2(max(1, wanted))


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    table_starts: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    num_splits: int,
    partial_out: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
    tickets: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    queries_per_row: int = 1,
) -> torch.Tensor:
    """Attention of one new token per request over its paged history; writes and returns ``out``.

    Shapes are in the module docstring. A query at position ``p = kv_len - 1`` sees keys
    ``j`` with ``p - sliding_window < j <= p`` (all ``j <= p`` when the window is None).
    ``softcap`` caps the scaled scores (Gemma 2), ``sinks`` [H] joins each head's softmax
    (gpt-oss); see the module docstring.
    ``num_splits > 1`` splits each request's visible range into that many contiguous parts
    (split-KV / flash-decoding), merged in the same launch by the last program of each
    (request, KV head): ``partial_out`` / ``partial_lse`` / ``tickets`` are its workspace. When
    None they are allocated here (the tickets zeroed: a memset per call); pass persistent ones,
    tickets zeroed once, for CUDA graphs and on hot paths. One launch at a time per workspace.
    An FP8 (E4M3) cache holds ``K / k_scale`` and ``V / v_scale``.

    ``queries_per_row = Q > 1`` serves a uniform verification step: ``q`` and ``out`` hold
    ``Q`` consecutive new tokens of each request (``[requests * Q, H, D]``, and the
    workspace as many rows), the tables, starts and lengths one row per request, and token
    ``i`` of a request sees the keys up to its own position ``kv_len - Q + i``. Each token then
    runs exactly as when it is decoded alone at the same split count.
    """
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim and out.shape == q.shape
    assert head_dim in (16, 32, 64, 128, 256), f"unsupported head_dim {head_dim}"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert num_heads % num_kv_heads == 0 and num_splits >= 1
    assert batch == kv_lens.shape[0] * queries_per_row, "queries_per_row tokens per length"
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and kv_cache.stride(-1) == 1
    assert sinks is None or (sinks.shape == (num_heads,) and sinks.stride(0) == 1)
    assert softcap is None or softcap > 0
    assert sliding_window is None or sliding_window > 0
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    qk_scale, softcap_log2 = score_constants(scale * k_scale, softcap)
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    block_n, num_warps, num_stages = _launch_shape(head_dim, num_splits)
    merge_h = triton.next_power_of_2(group)
    if num_splits > 1:
        if partial_out is None:
            partial_out = torch.empty(
                batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
            )
        if partial_lse is None:
            partial_lse = torch.empty(
                batch, num_heads, num_splits, dtype=torch.float32, device=q.device
            )
        if tickets is None:
            tickets = torch.zeros(
                tickets_needed(batch, num_kv_heads, num_splits), dtype=torch.int32, device=q.device
            )
        assert partial_out.shape[:3] == (batch, num_heads, num_splits)
        assert partial_lse.shape == (batch, num_heads, num_splits)
        assert partial_out.stride(-1) == 1 and partial_lse.stride(-1) == 1
        assert tickets.dtype == torch.int32 and tickets.is_contiguous()
        assert tickets.numel() >= tickets_needed(batch, num_kv_heads, num_splits)
        part_out, part_lse = partial_out, partial_lse
        # Splits per merge step: as many as fit _MERGE_VALUES_PER_THREAD in each of the
        # program's 32 * num_warps threads (all powers of two).
        fit = _MERGE_VALUES_PER_THREAD * 32 * num_warps // (merge_h * head_dim)
        split_chunk = max(1, min(triton.next_power_of_2(num_splits), fit))
    else:
        # Unused by the single-split path; any tensor fills the pointer arguments.
        part_out, part_lse, tickets = out, out, out
        split_chunk = 1
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        kv_cache,
        block_tables,
        table_starts,
        kv_lens,
        out,
        part_out,
        part_lse,
        tickets,
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
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2) if num_splits > 1 else 0,
        part_lse.stride(0),
        part_lse.stride(1),
        out if sinks is None else sinks,  # any valid pointer when unused
        softcap_log2,
        v_scale,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        MERGE_H=merge_h,
        SPLIT_CHUNK=split_chunk,
        MERGE_GROUP=_MERGE_GROUP,
        USE_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        START_NEXT=fits_one_wave(q.device, batch * num_kv_heads * num_splits),
        num_warps=num_warps,
        num_stages=num_stages,
        F16_DOT=_f16_dot(fp8, q),
        FP8_CVT=fp8_conversions(q.device),
        QUERIES=queries_per_row,
        **pdl_launch(q.device),
    )
    return out
