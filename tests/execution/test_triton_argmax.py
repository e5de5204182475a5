"""The split Triton argmax against ``torch.argmax`` (the GPU when there is one, else Triton's
interpreter; ``gpu`` cases at a Gemma-3 vocabulary in bf16)."""

from __future__ import annotations

import pytest
import torch
from triton_lowering import check_lowering

from heron.kernels.argmax import greedy_argmax

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows, vocab", [(1, 100), (3, 9000), (5, 2 * 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_torch_argmax(rows: int, vocab: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab, device=DEVICE).to(dtype)
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))


def test_ties_take_the_first_column() -> None:
    """A row's maximum repeated, within one chunk and across chunks: the first column wins, as
    in ``torch.argmax`` (rows of a wider tensor, to check the row stride too)."""
    logits = torch.zeros(3, 9000 + 7, device=DEVICE)[:, :9000]
    logits[0, [5000, 4097, 8999]] = 2.0  # across chunks: 4097 (chunk 1) before 5000
    logits[1, [4200, 4100]] = 1.0  # within a chunk
    logits[2] = -1.0  # the whole row equal: column 0
    assert greedy_argmax(logits).tolist() == [4097, 4100, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64])
def test_gemma_vocabulary_bf16(rows: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(rows, 262144, device="cuda", dtype=torch.bfloat16) * 8
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))


def argmax_launches() -> None:
    """The launches of a decode step's argmax (for ``check_lowering``)."""
    greedy_argmax(torch.zeros(64, 262144, dtype=torch.bfloat16))
    greedy_argmax(torch.zeros(1, 151936, dtype=torch.float32))


def test_argmax_launches_lower_for_hopper() -> None:
    assert check_lowering(
        "execution.test_triton_argmax:argmax_launches",
        "heron.kernels.argmax:_chunk_argmax_kernel",
        "heron.kernels.argmax:_row_argmax_kernel",
    )
