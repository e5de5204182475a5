"""Token embedding and the LM head, vocabulary-parallel inside a tensor-parallel build scope:
each rank holds an equal, zero-padded run of the vocabulary's rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heron.kernels import TORCH_KERNELS, LayerKernels
from heron.layers.linear import linear
from heron.parallel import current_tensor_parallel


class VocabRows(nn.Module):
    """The rows ``[vocab_start, vocab_start + rows)`` of a ``[vocab_size, hidden]`` matrix
    (all of them on one rank); rows past the vocabulary are zeros."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        tp = current_tensor_parallel()
        self.tp = tp if tp.size > 1 else None
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows

    @property
    def _held(self) -> tuple[int, int]:
        """The first vocabulary row this rank holds and how many (the rest is padding)."""
        start = min(self.vocab_start, self.vocab_size)
        return start, min(self.rows, self.vocab_size - start)

    def checkpoint_part(self, name: str, loaded: torch.Tensor, shard: None) -> torch.Tensor:
        return loaded if self.tp is None else loaded.narrow(0, *self._held)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: None) -> None:
        held = self._held[1]
        if tuple(loaded.shape) != (held, *param.shape[1:]):
            raise ValueError(
                f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                f"{(held, *param.shape[1:])}"
            )
        param.data[:held].copy_(loaded)
        param.data[held:].zero_()


class VocabEmbedding(VocabRows):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(token_ids.long(), self.weight)
        local = token_ids.long() - self.vocab_start
        mine = (local >= 0) & (local < self.rows)
        x = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mine.unsqueeze(-1)
        return self.tp.all_reduce(x)


class LMHead(VocabRows):
    """Hidden states to vocabulary logits; shares the embedding matrix when tied. Vocabulary-
    parallel, every rank gathers all ranks' logits, so each samples from the whole row."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tied_to: VocabEmbedding | None,
        kernels: LayerKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__(vocab_size)
        self.kernels = kernels
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self.kernels)
        if self.tp is None:
            return logits
        logits = self.tp.all_gather(logits)
        return logits if logits.shape[-1] == self.vocab_size else logits[:, : self.vocab_size]
