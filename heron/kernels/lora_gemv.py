"""A LoRA layer's product for a decode step of a few rows, adapters mixed, in one launch:
``y[m] = x[m] W^T (+ bias) + x[m] A[s]^T B[s]^T``, ``s`` row ``m``'s slot (0: none).

Launched apart, LoRA's shrink and expand each cost a decode step about as much time as the
base product they update: the work is tiny, the launch and the drain between kernels are not.
Here one kernel does all three. Its first ``shrink`` programs compute the rows' ``x A[s]^T``,
a work item a (chunk of ``K``, slot in use) as a ``tl.dot`` over that slot's rows; the last of
them to finish adds the chunks in order into a workspace and raises a flag. The other programs
stream the weight as ``gemv.linear_small_m`` does (``tl.dot`` on weight tiles, ``K`` split over
programs, the last of a column block adding the partial sums) and, where they store output,
wait for the flag and add their tiles' updates: a ``tl.dot`` per group of slots, masked to each
slot's rows, over the ``B`` columns of the part (q, k, v; gate, up) the tile lies in. Where the
part's rank fills its columns (``DENSE_B``), a tile reads every slot's ``B`` columns, in use or
not: a slot no row uses adds zero (its shrunk values are masked to zero, and adapters' weights
are finite in the tables' dtype: ``read_peft_adapter``, ``LoRALinear.check``), and a mask
that leaves each slot's columns whole keeps the loads vectorised; masking the unused slots'
columns made them scalar, which cost more than the bytes they save. Where the rows use one
adapter (or none), a tile reads and multiplies that slot's columns alone, not every slot's:
the update's work for one adapter does not grow with the engine's number of slots.

The shrink programs have the lowest program ids and wait for nothing; the waiting programs are
fewer than the multiprocessors (``_plan``), so a shrink program always finds room to run, and
under Triton's interpreter (programs one after another, in id order) the shrink is done before
anything waits. The last program to add updates resets the counters: a call needs no host sync,
and a CUDA graph replays it. Sums are added in a fixed order: the same inputs, the same bits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from heron.kernels.gemv import (
    MAX_M,
    GemvConfig,
    _accumulate,
    _config,
    _counters,
    _default_config,
    _finish,
    _load_tiles,
    _m_pad,
    _split_layout,
    _split_sum,
    _tile,
)
from heron.kernels.pdl import multiprocessor_count, pdl_launch, wait_for_previous_kernel

#: Columns of one update product: a group of slots' rank columns.
_GROUP_COLUMNS = 128
#: ``K`` per shrink ``tl.dot`` (over the rows of one slot).
_SHRINK_K = 256
#: Partial sums of the shrink a row may have (chunks of ``K``, each a work item per slot):
#: more make each item shorter, fewer leave the last shrink program less to add.
_CHUNKS = 8


@triton.jit
def _shrink(
    x_ptr, a_ptr, slots_ptr, ws_ptr, chunks_ptr, flag_ptr, pid, M, K, WIDTH, CHUNK_K,
    stride_xm, stride_as, stride_ar, SHRINK,
    M_PAD: tl.constexpr, W_PAD: tl.constexpr, S_BLOCK_K: tl.constexpr,
    CHUNKS_PAD: tl.constexpr, L_SLOTS: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Program ``pid``'s share of the rows' ``x A[s]^T``, one work item a (chunk of ``K``, slot
    some row uses): a ``tl.dot`` over the rows of that slot, stored as the chunk's partial
    sums. The last program to finish adds the chunks' sums in chunk order (the same result
    whatever the order of arrival) into the workspace, then signals the waiting programs."""
    offs_m = tl.arange(0, M_PAD)
    ranks = tl.arange(0, W_PAD)
    token_slots = tl.load(slots_ptr + offs_m, mask=offs_m < M, other=0)
    chunk_ptrs = chunks_ptr + offs_m[:, None] * W_PAD + ranks[None, :]
    chunks = tl.cdiv(K, CHUNK_K)
    for item in range(pid, chunks * L_SLOTS, SHRINK):
        slot = item % L_SLOTS + 1
        rows = token_slots == slot
        if tl.max(rows.to(tl.int32), axis=0) > 0:
            chunk = item // L_SLOTS
            partial = tl.zeros([M_PAD, W_PAD], dtype=tl.float32)
            for k in range(chunk * CHUNK_K, tl.minimum(chunk * CHUNK_K + CHUNK_K, K), S_BLOCK_K):
                cols = k + tl.arange(0, S_BLOCK_K)
                x = tl.load(
                    x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                    mask=rows[:, None] & (cols[None, :] < K),
                    other=0.0,
                )
                a = tl.load(
                    a_ptr + slot * stride_as + ranks[:, None] * stride_ar + cols[None, :],
                    mask=(ranks[:, None] < WIDTH) & (cols[None, :] < K),
                    other=0.0,
                )
                partial = tl.dot(x, tl.trans(a), acc=partial, input_precision=DOT_PREC)
            tl.store(chunk_ptrs + chunk * M_PAD * W_PAD, partial, mask=rows[:, None])
    tl.debug_barrier()  # every thread's stores are done before the ticket (release)
    if tl.atomic_add(flag_ptr + 2, 1, sem="acq_rel", scope="gpu") == SHRINK - 1:
        total = tl.zeros([M_PAD, W_PAD], dtype=tl.float32)
        adapted = (token_slots != 0)[:, None]
        for chunk in tl.static_range(CHUNKS_PAD):
            total += tl.load(
                chunk_ptrs + chunk * M_PAD * W_PAD,
                mask=adapted & (chunk < chunks),
                other=0.0,
                cache_modifier=".cg",
            )
        tl.store(ws_ptr + offs_m[:, None] * W_PAD + ranks[None, :], total)
        tl.store(flag_ptr + 2, 0)
        tl.debug_barrier()
        tl.atomic_xchg(flag_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _add_updates(
    acc, ws_ptr, lb_ptr, slots_ptr, flag_ptr, offs_m, m_mask, offs_n, n_mask, n0,
    part1, part2, WINDOW, stride_lbs, stride_lbn,
    M_PAD: tl.constexpr, W_PAD: tl.constexpr, L_RP: tl.constexpr, L_GROUP: tl.constexpr,
    L_SLOTS: tl.constexpr, DOT_PREC: tl.constexpr, DENSE_B: tl.constexpr,
):  # fmt: skip
    """``acc`` [M_PAD, BLOCK_N] plus each row's update, once the shrink has signalled; and this
    program's ticket among those that add updates."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    while seen == 0:
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    ticket = tl.atomic_add(flag_ptr + 1, 1, sem="acq_rel", scope="gpu")
    # The tile's part: its rank columns start at part * WINDOW (one part: WINDOW is the width).
    first = ((n0 >= part1).to(tl.int32) + (n0 >= part2).to(tl.int32)) * WINDOW
    token_slots = tl.load(slots_ptr + offs_m, mask=m_mask, other=0)
    top = tl.max(token_slots, axis=0)
    if tl.min(tl.where(token_slots == 0, top, token_slots), axis=0) == top:
        acc = _one_slot_update(
            acc, ws_ptr, lb_ptr, top, token_slots, offs_m, offs_n, n_mask, first, WINDOW,
            stride_lbs, stride_lbn, W_PAD, L_RP, DOT_PREC, DENSE_B,
        )  # fmt: skip
    else:
        acc = _every_slot_update(
            acc, ws_ptr, lb_ptr, token_slots, offs_m, offs_n, n_mask, first, WINDOW,
            stride_lbs, stride_lbn, W_PAD, L_RP, L_GROUP, L_SLOTS, DOT_PREC, DENSE_B,
        )  # fmt: skip
    return acc, ticket


@triton.jit
def _one_slot_update(
    acc, ws_ptr, lb_ptr, slot, token_slots, offs_m, offs_n, n_mask, first, WINDOW,
    stride_lbs, stride_lbn,
    W_PAD: tl.constexpr, L_RP: tl.constexpr, DOT_PREC: tl.constexpr, DENSE_B: tl.constexpr,
):  # fmt: skip
    """The update where the rows use one adapter, ``slot`` (or none: slot 0's zeros): its
    columns alone, a slot the program knows, where every slot's would cost ``L_SLOTS`` times
    the reads and products."""
    rank = tl.arange(0, L_RP)
    b_ptrs = lb_ptr + slot * stride_lbs + offs_n[:, None] * stride_lbn + first + rank[None, :]
    if DENSE_B:
        b = tl.load(b_ptrs, mask=n_mask[:, None], other=0.0)
    else:
        b = tl.load(b_ptrs, mask=n_mask[:, None] & (rank < WINDOW)[None, :], other=0.0)
    rows = (token_slots != 0)[:, None] & (rank < WINDOW)[None, :]
    return _add_update(acc, b, ws_ptr, offs_m, first, rank, rows, W_PAD, DOT_PREC)


@triton.jit
def _every_slot_update(
    acc, ws_ptr, lb_ptr, token_slots, offs_m, offs_n, n_mask, first, WINDOW,
    stride_lbs, stride_lbn,
    W_PAD: tl.constexpr, L_RP: tl.constexpr, L_GROUP: tl.constexpr, L_SLOTS: tl.constexpr,
    DOT_PREC: tl.constexpr, DENSE_B: tl.constexpr,
):  # fmt: skip
    """The update where the rows use several adapters: a product per group of slots."""
    cols = tl.arange(0, L_GROUP * L_RP)
    rank = cols % L_RP
    for group in tl.static_range(0, L_SLOTS, L_GROUP):
        col_slot = cols // L_RP + 1 + group
        rows = (token_slots[:, None] == col_slot[None, :]) & (rank < WINDOW)[None, :]
        if DENSE_B:  # every slot's columns of the group: loads a column mask leaves whole
            b_cols = col_slot <= L_SLOTS
        else:
            b_cols = tl.max(rows.to(tl.int32), axis=0) > 0  # the slots the rows use
        b = tl.load(
            lb_ptr + col_slot[None, :] * stride_lbs + offs_n[:, None] * stride_lbn
            + first + rank[None, :],
            mask=n_mask[:, None] & b_cols[None, :],
            other=0.0,
        )  # fmt: skip
        acc = _add_update(acc, b, ws_ptr, offs_m, first, rank, rows, W_PAD, DOT_PREC)
    return acc


@triton.jit
def _add_update(
    acc, b, ws_ptr, offs_m, first, rank, rows, W_PAD: tl.constexpr, DOT_PREC: tl.constexpr
):
    """``acc`` plus the rows' shrunk values (where ``rows``, at rank columns ``first + rank``)
    times ``b`` [BLOCK_N, those columns]."""
    shrunk = tl.load(
        ws_ptr + offs_m[:, None] * W_PAD + first + rank[None, :],
        mask=rows,
        other=0.0,
        cache_modifier=".cg",
    )
    return tl.dot(shrunk.to(b.dtype), tl.trans(b), acc=acc, input_precision=DOT_PREC)


@triton.jit
def _lora_gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, a_ptr, lb_ptr, slots_ptr, ws_ptr, chunks_ptr,
    M, N, K, stride_xm, stride_ym, k_per_split, n_blocks, split_k,
    WIDTH, WINDOW, part1, part2, SHRINK, CHUNK_K, stride_as, stride_ar, stride_lbs, stride_lbn,
    HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    W_PAD: tl.constexpr, S_BLOCK_K: tl.constexpr, CHUNKS_PAD: tl.constexpr, L_RP: tl.constexpr,
    L_GROUP: tl.constexpr, L_SLOTS: tl.constexpr, DENSE_B: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    # Counters: [0, n_blocks) the split tickets; then the shrink's signal, the update tickets
    # and the shrink tickets.
    flag_ptr = cnt_ptr + n_blocks
    if pid < SHRINK:
        _shrink(
            x_ptr, a_ptr, slots_ptr, ws_ptr, chunks_ptr, flag_ptr, pid, M, K, WIDTH, CHUNK_K,
            stride_xm, stride_as, stride_ar, SHRINK,
            M_PAD, W_PAD, S_BLOCK_K, CHUNKS_PAD, L_SLOTS, DOT_PREC,
        )  # fmt: skip
    else:
        tile = pid - SHRINK
        pid_n = tile % n_blocks
        pid_k = tile // n_blocks
        offs_m, offs_n, offs_k, m_mask, n_mask, k_start, k_end, w_ptrs, x_ptrs = _tile(
            x_ptr, w_ptr, pid_n, pid_k, M, N, K, stride_xm, k_per_split, M_PAD, BLOCK_N, BLOCK_K
        )
        acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
        for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
            w, x, _, _ = _load_tiles(
                w_ptrs, x_ptrs, k, k_end, offs_k, m_mask, n_mask, EVEN_N, EVEN_K
            )
            acc = _accumulate(acc, w, x, True, DOT_PREC)
        acc = tl.trans(acc)
        out_mask = m_mask[:, None] & n_mask[None, :]
        last = split_k == 1
        if split_k > 1:
            acc, last = _split_sum(
                acc, part_ptr, cnt_ptr, pid_n, pid_k, split_k, M, N, offs_m, offs_n, out_mask
            )
        if last:
            acc, ticket = _add_updates(
                acc, ws_ptr, lb_ptr, slots_ptr, flag_ptr, offs_m, m_mask, offs_n, n_mask,
                pid_n * BLOCK_N, part1, part2, WINDOW, stride_lbs, stride_lbn,
                M_PAD, W_PAD, L_RP, L_GROUP, L_SLOTS, DOT_PREC, DENSE_B,
            )  # fmt: skip
            _finish(acc, b_ptr, y_ptr, offs_m, offs_n, n_mask, out_mask, stride_ym, HAS_BIAS)
            if ticket == n_blocks - 1:  # every program that waited has seen every signal
                tl.store(flag_ptr, 0)
                tl.store(flag_ptr + 1, 0)


@functools.cache
def _plan(m_pad: int, n: int, k: int, elem_size: int, device: torch.device):
    """``(config, programs left for the shrink)`` for a product of ``m_pad`` rows, or None.

    The GEMV's configuration on ``tl.dot`` (rows padded to 16), its ``K`` split halved until
    its programs take at most half the multiprocessors; the rest may run the shrink."""
    sms = multiprocessor_count(device)
    cfg = _config(m_pad, n, k, elem_size, device)
    if not cfg.use_dot or cfg.block_n < 16:
        cfg = _default_config(max(2, m_pad), n, k, elem_size, sms)
    n_blocks, split = triton.cdiv(n, cfg.block_n), cfg.split_k
    while split > 1 and n_blocks * split > sms // 2:
        split //= 2
    if n_blocks * split >= sms:
        return None
    return GemvConfig(*cfg[:5], split), sms - n_blocks * split


def serves(m: int, n: int, k: int, device: torch.device, elem_size: int = 2) -> bool:
    """Whether :func:`lora_linear` takes ``m`` rows of an ``[n, k]`` weight on ``device``."""
    return 1 < m <= MAX_M and _plan(max(16, _m_pad(m)), n, k, elem_size, device) is not None


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    parts: tuple[int, ...] = (),
) -> torch.Tensor:
    """``x weight^T (+ bias)`` plus each row's ``x[m] a[slots[m]]^T b[slots[m]]^T`` (``x``
    [M, K] with ``1 < M <= MAX_M``, ``weight`` [N, K], ``a`` [S, W, K], ``b`` [S, N, W], slot 0
    zero). ``parts``: the first output row of each part after the first, when the layer packs
    parts whose ranks lie in ``W / (len(parts) + 1)`` columns each, in order (a tile within
    one part reads only its part's columns)."""
    m, k = x.shape
    n = weight.shape[0]
    width = a.shape[1]
    if (
        not serves(m, n, k, x.device, x.element_size())
        or weight.shape[1] != k
        or weight.dtype != x.dtype
        or x.stride(1) != 1
        or not weight.is_contiguous()
        or a.shape[2] != k
        or b.shape[1:] != (n, width)
        or a.stride(2) != 1
        or b.stride(2) != 1
        or slots.shape != (m,)
        or len(parts) > 2
    ):
        raise ValueError(
            f"lora_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, A {tuple(a.shape)}, "
            f"B {tuple(b.shape)}, slots {tuple(slots.shape)}, parts {parts}"
        )
    m_pad = max(16, _m_pad(m))
    cfg, shrink = _plan(m_pad, n, k, x.element_size(), x.device)
    if any(p % cfg.block_n for p in parts):  # tiles across parts: every rank column
        parts = ()
    window = width // (len(parts) + 1)
    part1, part2 = (*parts, n, n)[:2]
    k_per_split, split, n_blocks = _split_layout(n, k, cfg)
    w_pad = max(16, triton.next_power_of_2(width))
    s_block_k = max(16, min(_SHRINK_K, triton.next_power_of_2(k)))
    # At most _CHUNKS partial sums a row (the last shrink program adds them), each some tiles.
    chunk_k = s_block_k * triton.cdiv(triton.cdiv(k, s_block_k), _CHUNKS)
    chunks = triton.cdiv(k, chunk_k)
    slots_max = a.shape[0] - 1
    shrink = min(shrink, chunks * slots_max)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split * m * n if split > 1 else 1, dtype=torch.float32, device=x.device)
    ws = torch.empty(chunks + 1, m_pad, w_pad, dtype=torch.float32, device=x.device)
    cnt = _counters(x.device, n_blocks + 3)
    l_rp = max(16, triton.next_power_of_2(window))
    _lora_gemv_kernel[(shrink + n_blocks * split,)](
        x, weight, bias if bias is not None else weight, out, part, cnt, a, b, slots, ws[0], ws[1:],
        m, n, k, x.stride(0), out.stride(0), k_per_split, n_blocks, split,
        width, window, part1, part2, shrink, chunk_k, *a.stride()[:2], *b.stride()[:2],
        HAS_BIAS=bias is not None,
        EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % k_per_split == 0,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        M_PAD=m_pad,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages,
        W_PAD=w_pad,
        S_BLOCK_K=s_block_k,
        CHUNKS_PAD=triton.next_power_of_2(chunks),
        L_RP=l_rp,
        L_GROUP=min(triton.next_power_of_2(slots_max), max(1, _GROUP_COLUMNS // l_rp)),
        L_SLOTS=slots_max,
        DENSE_B=window == l_rp,
        num_warps=cfg.num_warps,
        **pdl_launch(x.device),
    )  # fmt: skip
    return out
