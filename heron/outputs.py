"""What generate() returns: one RequestOutput per prompt, one CompletionOutput per sample; what
the pooling calls return: one PoolingRequestOutput per prompt."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Logprob:
    """Log-probability of the chosen token, its rank, and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]


class PrefixView(Sequence):
    """A read-only view of the first ``len`` items of a list that only ever grows.

    Outputs of unfinished, streamed requests use it so that a step does not copy every
    request's whole token list (which made output building quadratic in the output length);
    finished outputs hold plain lists.
    """

    __slots__ = ("_items", "_len")

    def __init__(self, items: list[Any]) -> None:
        self._items, self._len = items, len(items)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._items[: self._len][index]
        if not -self._len <= index < self._len:
            raise IndexError("PrefixView index out of range")
        return self._items[index % self._len]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(self._items[: self._len])


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: Sequence[int]  # a list once finished; a PrefixView while streaming
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: str | int | None = None
    logprobs: Sequence[Logprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[Logprob | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request was rejected or failed (no answer then)
    metrics: dict[str, float] = field(default_factory=dict)
    kv_transfer_params: dict | None = None  # what a KV connector tells the client (finished)


@dataclass(slots=True)
class PoolingRequestOutput:
    """A pooling request's answer: the embedding, the class probabilities, the score or the
    model's raw pooled output (a reward), by the request's task."""

    request_id: str
    prompt_token_ids: list[int]
    data: list[float]
    error: str | None = None  # set when the request was rejected (``data`` is then empty)
