"""What an engine step returns: each advanced request's new tokens, per sample.

:meth:`heron.engine.llm_engine.LLMEngine.step` makes them; the output processor turns them into
``RequestOutput``s, in the engine's process (``LLM``) or in a server front, which receives them
from the engine core process as they are (msgpack).
"""

from __future__ import annotations

import msgspec

from heron.outputs import Logprob


class SampleDelta(msgspec.Struct, array_like=True):
    """One sample's tokens since the last delta, and its finish once finished."""

    index: int
    token_ids: list[int]
    logprobs: list[Logprob] | None
    finish_reason: str | None
    stop_reason: int | None  # a stop token (stop strings are the front's)


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    samples: list[SampleDelta]
    finished: bool
    num_cached_tokens: int
    # With the request's first delta:
    prompt_logprobs: list[Logprob | None] | None = None
    first_scheduled_time: float | None = None  # monotonic (one clock for every process)
    pooled: list[float] | None = None  # a pooling request's answer (its one, final delta)
    kv_transfer_params: dict | None = None  # with the final delta: a KV connector's answer
    error: str | None = None  # with the final delta: why the request failed (no answer)
