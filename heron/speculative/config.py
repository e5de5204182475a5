"""``speculative_config``: the user's dictionary, checked field by field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "mtp")
# Fields that only one method reads: refused by name for the others.
METHOD_FIELDS = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "draft_model": ("model", "draft_tensor_parallel_size", "async_verification"),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How proposals are made, named as vLLM names them.

    ``ngram``: prompt lookup. The longest suffix of the sequence (``prompt_lookup_max`` tokens
    down to ``prompt_lookup_min``) that occurred before proposes the ``num_speculative_tokens``
    tokens that followed its latest earlier occurrence.

    ``draft_model``: a smaller model with the target's tokenizer (``model``, a path or hub
    name) proposes its greedy continuation; it runs on the target's first device
    (``draft_tensor_parallel_size`` 1). With ``async_verification`` (the default) the next
    step is scheduled and launched before a verification is read (rows moved back on the
    device by their refused proposals) where the caches allow it; on the H200 that is faster
    than reading each verification first (BENCHMARKS.md).

    ``mtp``: the checkpoint's multi-token-prediction head (DeepSeek-V3, Qwen3.5, Qwen3-Next)
    proposes from the target's hidden states, applied again to its own output for each
    further token.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    # No proposals while more requests than this run: verification costs compute that large
    # batches do not have to spare (on the H200 it lost from batch 16 up: BENCHMARKS.md);
    # None: always propose.
    disable_by_batch_size: int | None = 8
    model: str | None = None
    draft_tensor_parallel_size: int = 1
    async_verification: bool = True

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> SpeculativeConfig:
        """Raises ``ValueError`` naming the first bad or unknown field."""
        if not isinstance(options, Mapping):
            raise ValueError(
                f"speculative_config must be a dictionary, got {type(options).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown field(s) {', '.join(map(repr, unknown))} "
                f"(known: {', '.join(sorted(known))})"
            )
        for name in ("method", "num_speculative_tokens"):
            if name not in options:
                raise ValueError(f"speculative_config: {name!r} is required")
        method = options["method"]
        if method not in METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}"
            )
        for other, names in METHOD_FIELDS.items():
            given = [name for name in names if name in options]
            if other != method and given:
                raise ValueError(
                    f"speculative_config: {given[0]} applies to method {other!r}, not {method!r}"
                )
        if method == "draft_model":
            model = options.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(
                    "speculative_config: 'model' (the draft model's path or name) is required "
                    f"for method 'draft_model', got {model!r}"
                )
            size = options.get("draft_tensor_parallel_size", 1)
            if isinstance(size, bool) or size != 1:
                raise ValueError(
                    "speculative_config: draft_tensor_parallel_size must be 1 (the draft runs "
                    f"on one device), got {size!r}"
                )
            if not isinstance(options.get("async_verification", False), bool):
                raise ValueError(
                    "speculative_config: async_verification must be true or false, got "
                    f"{options['async_verification']!r}"
                )
        values = dict(options)
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "disable_by_batch_size",
        ):
            value = values.get(name)
            if name not in values or (value is None and name == "disable_by_batch_size"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"speculative_config: {name} must be an integer >= 1, got {value!r}"
                )
        config = cls(**values)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({config.prompt_lookup_min}) must not "
                f"exceed prompt_lookup_max ({config.prompt_lookup_max})"
            )
        return config
