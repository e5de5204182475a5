"""The (token, slot) pairs of a routing sorted by expert into row blocks, for the fused MoE.

``align_by_expert`` lays the ``T * k`` pairs out in row blocks of ``block_m``, each expert's
pairs in token order and padded to whole blocks, so that every block of the grouped GEMMs
belongs to one expert. Shapes depend only on ``T``, ``k`` and ``E``, never on the routing, and
nothing syncs with the host: the call can be captured in a CUDA graph.

In PyTorch that is about fifteen small kernels (counts, cumulative sums, a stable sort, gathers,
scatters, a search), which at decode, a few pairs per layer, cost more than the experts' GEMMs.
Up to ``ONE_PROGRAM_PAIRS`` pairs a single Triton program does it all: counts from one-hot
comparisons with the experts, each pair's place from the counts before it, then each block's
expert. One token (batch-1 decode) needs none of that: its ``k`` pairs go to distinct experts
(a router's top-k), so each pair is a block of its own, in slot order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Up to this many pairs (and ``ONE_PROGRAM_EXPERTS`` experts) one program aligns them.
ONE_PROGRAM_PAIRS = 256
ONE_PROGRAM_EXPERTS = 1024
_TILE = 4096  # elements of a program's [pairs or blocks, experts] comparison tile


@triton.jit
def _align_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    num_pairs,
    num_experts,
    max_rows,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    ONE_TOKEN: tl.constexpr,
):
    if ONE_TOKEN:  # pair p is block p (a layout valid for any indices: blocks need no order)
        rows = tl.arange(0, BLOCK_P)
        pair_rows = tl.where(rows % BLOCK_M == 0, rows // BLOCK_M, num_pairs)
        tl.store(sorted_ptr + rows, pair_rows, mask=rows < max_rows)
        pairs = rows < num_pairs
        tl.store(block_expert_ptr + rows, tl.load(ids_ptr + rows, mask=pairs), mask=pairs)
        tl.store(num_blocks_ptr, num_pairs)
        return
    experts = tl.arange(0, BLOCK_E)
    offs = tl.arange(0, BLOCK_P)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK_P):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)

    sentinel = tl.zeros([BLOCK_P], dtype=tl.int32) + num_pairs
    for row in range(0, max_rows, BLOCK_P):
        tl.store(sorted_ptr + row + offs, sentinel, mask=row + offs < max_rows)
    tl.debug_barrier()  # the padding is written before the pairs land on it
    placed = padded_end - padded  # where each expert's next pair goes
    for start in range(0, num_pairs, BLOCK_P):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_pairs, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        earlier = tl.cumsum(hit, axis=0) - hit  # the same expert's pairs before, in this tile
        dest = tl.sum(hit * (placed[None, :] + earlier), axis=1)
        tl.store(sorted_ptr + dest, start + offs, mask=start + offs < num_pairs)
        placed += tl.sum(hit, axis=0)

    # Block b's expert: the number of experts whose padded rows end by b * BLOCK_M.
    num_row_blocks = max_rows // BLOCK_M
    real = (experts < num_experts)[None, :]
    for block in range(0, num_row_blocks, BLOCK_P):
        first_row = (block + offs) * BLOCK_M
        ended = (padded_end[None, :] <= first_row[:, None]) & real
        expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), num_experts - 1)
        tl.store(block_expert_ptr + block + offs, expert, mask=block + offs < num_row_blocks)
    tl.store(num_blocks_ptr, tl.sum(padded, axis=0) // BLOCK_M)


def align_by_expert(
    indices: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of ``indices`` [T, k] sorted by expert into row blocks.

    Returns ``sorted_ids`` [max_rows] (int32: the flat pair index ``token * k + slot``, or the
    sentinel ``T * k`` on padding rows), ``block_expert`` [max_rows / block_m] (int32: each
    block's expert) and ``num_blocks`` [1] (int32: how many blocks are used; the later ones
    hold any valid expert and only padding).
    """
    flat = indices.flatten()
    num_pairs = flat.numel()
    max_rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    max_rows = triton.cdiv(max_rows, block_m) * block_m
    if num_pairs > ONE_PROGRAM_PAIRS or num_experts > ONE_PROGRAM_EXPERTS:
        return _align_with_torch(flat.to(torch.int64), num_experts, block_m, max_rows)
    sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(max_rows // block_m, dtype=torch.int32, device=flat.device)
    num_blocks = torch.empty(1, dtype=torch.int32, device=flat.device)
    block_e = triton.next_power_of_2(num_experts)
    one_token = indices.shape[0] == 1
    _align_kernel[(1,)](
        flat,
        sorted_ids,
        block_expert,
        num_blocks,
        num_pairs,
        num_experts,
        max_rows,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        BLOCK_P=triton.next_power_of_2(max_rows) if one_token else max(16, _TILE // block_e),
        ONE_TOKEN=one_token,
    )
    return sorted_ids, block_expert, num_blocks


def _align_with_torch(
    flat: torch.Tensor, num_experts: int, block_m: int, max_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`align_by_expert` in PyTorch ops (many pairs: a prefill)."""
    num_pairs = flat.numel()
    device = flat.device
    # Pairs per expert (scatter_add, not bincount: bincount reads the maximum on the host).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)

    # A stable sort keeps each expert's pairs in token order; a pair's rank among its expert's
    # pairs is its sorted position less the number of pairs of the experts before.
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[experts]
    dest = (padded_end - padded)[experts] + rank
    sorted_ids = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))

    # Block b starts at row b * block_m; its expert is the number of experts that end by then.
    starts = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, starts, right=True, out_int32=True)
    block_expert.clamp_(max=num_experts - 1)  # blocks past the used ones: any valid expert
    num_blocks = (padded_end[-1:] // block_m).to(torch.int32)
    return sorted_ids, block_expert, num_blocks
