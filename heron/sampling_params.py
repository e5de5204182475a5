"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from heron.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# OpenAI's own limit; it also bounds the sequences one request can add to the engine.
MAX_N = 128
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _is_token_id(value: object) -> bool:
    """An integer the engine's int64 tensors can hold (the vocabulary is checked later)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _INT64_MAX


@dataclass
class SamplingParams:
    """How to sample a request's completion (names and meanings follow vLLM and OpenAI).

    Every field is checked in ``__post_init__``; an invalid value raises ``ValueError`` naming
    the field and the allowed range, so a bad request fails before it reaches the engine.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the context length is reached
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (0: only the sampled one)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output matches
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # For a KV connector (prefill/decode disaggregation): what it needs, checked by it.
    kv_transfer_params: dict[str, Any] | None = None
    # Filled by the engine from the model's generation config / tokenizer, not by users.
    eos_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an integer in [1, {MAX_N}]")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= _INT64_MAX:
            raise bad("top_k", "an integer in [0, 2^63) (0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "in (0, 10]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not _INT64_MIN <= self.seed <= _INT64_MAX
        ):
            # A seed torch cannot take would fail the whole step, every request in it.
            raise bad("seed", "a 64-bit signed integer or None")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= _INT64_MAX
        ):
            raise bad("max_tokens", "an integer in [1, 2^63) or None")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= _INT64_MAX:
            raise bad("min_tokens", "an integer in [0, 2^63)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if not all(_is_token_id(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of token ids (integers in [0, 2^63))")
        if self.logit_bias is not None and not all(
            _is_token_id(t) and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()
        ):
            raise bad("logit_bias", "a map of token ids in [0, 2^63) to biases in [-100, 100]")
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise bad("kv_transfer_params", "a dictionary or None")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= 20):
                raise bad(name, "an integer in [0, 20] or None")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "a StructuredOutputsParams or None")
            # A finished grammar allows only a stop token, which these would forbid.
            if self.min_tokens or self.ignore_eos:
                raise ValueError(
                    "structured_outputs cannot be combined with min_tokens or ignore_eos"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def plain_argmax(self) -> bool:
        """Greedy on the model's own logits: no bias or grammar mask changes them before the
        argmax."""
        return self.greedy and not self.logit_bias and self.structured_outputs is None

    def clone(self) -> SamplingParams:
        """A copy that can be modified without touching the caller's object."""
        return SamplingParams(**{name: getattr(self, name) for name in self.__dataclass_fields__})
