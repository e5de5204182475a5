"""What generate() returns: one RequestOutput per prompt, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

from heron.engine.request import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: str | int | None = None
    logprobs: list[Logprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[Logprob | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request was rejected (it then has no outputs)
    metrics: dict[str, float] = field(default_factory=dict)
