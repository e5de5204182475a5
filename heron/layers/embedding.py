"""Token embedding and the LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heron.kernels import TORCH_KERNELS, LayerKernels
from heron.layers.linear import linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids.long(), self.weight)


class LMHead(nn.Module):
    """Hidden states to vocabulary logits; shares the embedding matrix when tied."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tied_to: VocabEmbedding | None,
        kernels: LayerKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight, None, self.kernels)
