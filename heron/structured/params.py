"""What a request's output must match, as plain serialisable data (no xgrammar here)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class ReasoningTokens:
    """A reasoning model's think block, which the grammar leaves free (as vLLM does): the
    grammar applies from the token after ``end`` (``</think>``). With ``start`` (Qwen3) a sample
    reasons only if its first token is ``start``, which the grammar then allows beside its own;
    without it (DeepSeek-R1, whose template opens the block) every sample reasons first."""

    end: int
    start: int | None = None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint, named as in vLLM: ``json`` (a JSON schema, as a dict or its
    text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings) or
    ``grammar`` (EBNF, as xgrammar reads it); ``reasoning``: where it starts (None: at the
    first token)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    reasoning: ReasoningTokens | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(_KINDS)}; got {', '.join(given) or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or text)")
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """The constraint as hashable text: equal keys compile to the same grammar."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        if isinstance(value, str):
            return self.kind, value
        return self.kind, json.dumps(value, sort_keys=True, separators=(",", ":"))
