"""PoolingParams: what a pooling request asks of its pooled vector (validated on
construction), and how that vector becomes the request's answer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

# embed: an embedding (Matryoshka-truncated, then normalised where the model says);
# classify: the class probabilities; score: a cross-encoder's relevance (one label: its
# sigmoid); encode: the model's pooled output as it is (a reward model's reward).
POOLING_TASKS = ("embed", "classify", "score", "encode")


@dataclass(frozen=True)
class PoolingParams:
    """``dimensions``: keep the first so many of an embedding's values (Matryoshka), before
    it is normalised; ``normalize``: None follows the model (its sentence-transformers
    ``Normalize`` module, else on for embedding models)."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None:
            if self.task != "embed":
                raise ValueError(f"dimensions applies to task 'embed', not {self.task!r}")
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int):
                raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}")
            if self.dimensions < 1:
                raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
        if self.normalize is not None and self.task != "embed":
            raise ValueError(f"normalize applies to task 'embed', not {self.task!r}")

    def finish(self, pooled: torch.Tensor, model_normalizes: bool) -> list[float]:
        """The answer from one request's pooled output (float32, on the host)."""
        if self.task == "embed":
            if self.dimensions is not None:
                pooled = pooled[: self.dimensions]
            normalize = model_normalizes if self.normalize is None else self.normalize
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
        elif self.task in ("classify", "score"):
            pooled = pooled.sigmoid() if pooled.numel() == 1 else pooled.softmax(-1)
        return pooled.tolist()


def pair_token_ids(tokenizer: PreTrainedTokenizerBase, query: str, document: str) -> list[int]:
    """A cross-encoder's input: the pair as the tokenizer joins a text pair."""
    return tokenizer(query, document)["input_ids"]


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two embeddings (a bi-encoder's score)."""
    return torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0).item()
