"""Grammar compilation off the step loop, and the per-request matcher that fills token masks.

Compiling a grammar against the vocabulary takes milliseconds to seconds, so it runs in a
worker thread; a request waits in the scheduler until its grammar is ready, while the others
keep stepping. Parsing the spec (which is what fails on bad input) runs at once, so an invalid
schema, regex or grammar is refused when the request is added.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

from heron.structured.params import ReasoningTokens, StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse by later requests with the same spec.
_CACHE_ENTRIES = 256


def parse_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The spec as an xgrammar ``Grammar``; ``ValueError`` names the field when it is invalid.

    JSON is laid out compactly (no free whitespace), so a constrained sample cannot spend its
    tokens on blanks; object properties follow the schema's order and no others are allowed.
    """
    kind = params.kind
    try:
        if kind == "json":
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            return xgr.Grammar.from_json_schema(
                json.dumps(_without_raw_control_characters(schema)),
                any_whitespace=False,
                strict_mode=True,
            )
        if kind == "json_object":
            schema = json.dumps({"type": "object"})
            return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_regex("|".join(_escape_regex(c) for c in params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except RuntimeError as e:
        # xgrammar prefixes its messages with a timestamp and source location.
        reason = str(e).strip().rsplit(": ", 1)[-1] if ": " in str(e) else str(e)
        raise ValueError(f"structured_outputs.{kind} is invalid: {reason}") from None


def _without_raw_control_characters(schema: Any) -> Any:
    """The schema with each length-bounded string's bounds moved into a pattern of printable
    characters.

    xgrammar lets a string with ``minLength`` / ``maxLength`` hold raw control characters,
    which JSON forbids; the pattern keeps such strings valid (escapes are left out of them) and
    carries the bounds, which xgrammar would ignore beside a pattern.
    """
    if isinstance(schema, list):
        return [_without_raw_control_characters(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _without_raw_control_characters(value) for key, value in schema.items()}
    bounded = "minLength" in schema or "maxLength" in schema
    free = not any(key in schema for key in ("pattern", "format", "enum", "const"))
    if schema.get("type") == "string" and bounded and free:
        low, high = schema.pop("minLength", 0), schema.pop("maxLength", "")
        schema["pattern"] = rf'^[^"\\\x00-\x1f]{{{low},{high}}}$'
    return schema


def _escape_regex(text: str) -> str:
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/" else c for c in text)


class GrammarCompiler:
    """Compiles specs in one worker thread for one tokenizer, caching results by spec.

    The tokenizer's vocabulary is read (``TokenizerInfo``) in the worker too, on the first
    request that needs it, so an engine that never sees a grammar never pays for it.
    ``vocab_size`` is the model's logits width: ids the tokenizer lacks (padding) are masked.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="heron-grammar")
        self.stop_token_ids = sorted(stop_token_ids)
        self.vocab_size = vocab_size
        self._compiler = self._executor.submit(self._make_compiler, tokenizer)
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._batch = xgr.BatchGrammarMatcher()

    def _make_compiler(self, tokenizer) -> xgr.GrammarCompiler:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of ``params`` (shared by every request with the same spec; a
        failed compilation is tried again)."""
        key = params.key
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        grammar = parse_grammar(params)
        future = self._executor.submit(lambda: self._compiler.result().compile_grammar(grammar))
        self._cache[key] = future
        if len(self._cache) > _CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return future

    def request_grammars(self, params: StructuredOutputsParams, n: int) -> list[RequestGrammar]:
        """One grammar position per sample of a request (``ValueError`` for a bad spec)."""
        compiled = self.compile(params)
        return [RequestGrammar(compiled, self.stop_token_ids, params.reasoning) for _ in range(n)]

    @staticmethod
    def wait_for_any(grammars: Iterable[RequestGrammar], timeout: float) -> None:
        """Block until one of these grammars is compiled, or ``timeout`` seconds pass."""
        wait([g.compiled for g in grammars], timeout=timeout, return_when=FIRST_COMPLETED)

    def token_bitmask(self, grammars: Sequence[RequestGrammar | None]) -> torch.Tensor:
        """Each row's allowed next tokens as xgrammar's bit-packed int32 mask (host memory),
        filled by several threads; rows without a grammar (or whose grammar failed, which ends
        them, or that are reasoning) allow everything."""
        bitmask = xgr.allocate_token_bitmask(len(grammars), self.vocab_size)
        rows = [i for i, g in enumerate(grammars) if g is not None and g.constrains]
        if rows:
            matchers = [grammars[i].matcher for i in rows]
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        words = bitmask.numpy().view(np.uint32)
        for i in rows:
            token = grammars[i].also_allowed
            if token is not None:
                words[i, token // 32] |= np.uint32(1 << (token % 32))
        return bitmask


class RequestGrammar:
    """One sample's position in its grammar: a matcher, made once the grammar is compiled, and
    with ``reasoning`` the think block before it (a phase: "opening", the first token, which
    may open the block; "reasoning", until its end token; then "grammar")."""

    def __init__(
        self,
        compiled: Future[xgr.CompiledGrammar],
        stop_token_ids: list[int],
        reasoning: ReasoningTokens | None = None,
    ) -> None:
        self.compiled = compiled
        self._stop_token_ids = stop_token_ids
        self._matcher: xgr.GrammarMatcher | None = None
        self._reasoning = reasoning
        if reasoning is None:
            self._phase = "grammar"
        else:
            self._phase = "reasoning" if reasoning.start is None else "opening"

    @property
    def is_ready(self) -> bool:
        return self.compiled.done()

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(
                self.compiled.result(), override_stop_tokens=self._stop_token_ids
            )
        return self._matcher

    @property
    def failed(self) -> bool:
        return self.compiled.done() and self.compiled.exception() is not None

    @property
    def constrains(self) -> bool:
        """Whether the grammar masks the next token (not while reasoning, nor once failed)."""
        return self._phase != "reasoning" and not self.failed

    @property
    def also_allowed(self) -> int | None:
        """A token the mask allows beside the grammar's: the one that opens the think block,
        for the first token."""
        return self._reasoning.start if self._phase == "opening" else None

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False (logged) if the grammar does not allow it or
        failed to compile."""
        if self.failed:
            logger.error("a grammar failed to compile: %r", self.compiled.exception())
            return False
        if self._phase == "reasoning":
            if token_id == self._reasoning.end:
                self._phase = "grammar"
            return True
        if self._phase == "opening":
            opened = token_id == self._reasoning.start
            self._phase = "reasoning" if opened else "grammar"
            if opened:
                return True
        if not self.matcher.accept_token(token_id):
            logger.error("token %d breaks its grammar", token_id)
            return False
        return True
