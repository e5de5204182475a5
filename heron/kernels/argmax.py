"""Greedy decoding's argmax over a large vocabulary, split over the GPU (Triton).

``torch.argmax`` over rows of a large vocabulary gives each row to few thread blocks, a
noticeable share of a small model's decode step. Here the vocabulary is cut into chunks of ``_CHUNK`` logits, one program per
(row, chunk) finds the chunk's maximum and its first position, and a second launch takes, per
row, the first chunk holding the row's maximum. The result equals ``torch.argmax``'s (the
first index of the maximum) on finite logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 4096  # logits per program of the first pass


@triton.jit
def _chunk_argmax_kernel(logits_ptr, best_ptr, where_ptr, n_cols, stride_row, num_chunks,
                         CHUNK: tl.constexpr):  # fmt: skip
    """The maximum of one (row, chunk) of ``logits`` and the first column that holds it."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(
        logits_ptr + row.to(tl.int64) * stride_row + cols,
        mask=cols < n_cols,
        other=float("-inf"),
    ).to(tl.float32)
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_ptr + row * num_chunks + chunk, best)
    tl.store(where_ptr + row * num_chunks + chunk, chunk * CHUNK + at)


@triton.jit
def _row_argmax_kernel(best_ptr, where_ptr, out_ptr, num_chunks, CHUNKS: tl.constexpr):
    """Per row, the column of the first chunk whose maximum is the row's."""
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS)
    mask = offs < num_chunks
    best = tl.load(best_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    chunk = tl.argmax(best, axis=0, tie_break_left=True)
    tl.store(out_ptr + row, tl.load(where_ptr + row * num_chunks + chunk))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (int64) of a 2-D tensor whose rows are contiguous, by the two
    Triton passes above."""
    assert logits.dim() == 2 and logits.stride(-1) == 1
    rows, n_cols = logits.shape
    num_chunks = triton.cdiv(n_cols, _CHUNK)
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    where = torch.empty(rows, num_chunks, dtype=torch.int64, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    _chunk_argmax_kernel[(rows, num_chunks)](
        logits, best, where, n_cols, logits.stride(0), num_chunks, CHUNK=_CHUNK, num_warps=8
    )
    _row_argmax_kernel[(rows,)](
        best, where, out, num_chunks, CHUNKS=triton.next_power_of_2(num_chunks), num_warps=1
    )
    return out
