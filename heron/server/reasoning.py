"""``--reasoning-parser``: a reasoning model's ``<think>`` ... ``</think>`` as
``reasoning_content``, apart from the ``content`` that follows.

The parser reads text as it streams (``feed``) and at the end (``finish``), holding back only
what could still be the start of a tag; a response that is not streamed is one ``feed``.
"""

from __future__ import annotations

from heron.server.partial_tags import partial_tag_length
from heron.structured import ReasoningTokens

OPEN, CLOSE = "<think>", "</think>"

Split = tuple[str, str]  # reasoning, content


class ThinkReasoningParser:
    """``reasoning_starts_open``: DeepSeek-R1's template opens ``<think>`` in the prompt, so the
    reply reasons from its first token (an own ``<think>`` is dropped) until ``</think>``.
    Otherwise (Qwen3) a reply reasons only if it starts with ``<think>``; without one it is all
    content. A reply cut off before ``</think>`` is all reasoning."""

    def __init__(self, reasoning_starts_open: bool) -> None:
        self._starts_open = reasoning_starts_open
        self._buffer = ""
        self._state = "start"  # then "reasoning" or "content"

    def feed(self, text: str) -> Split:
        if self._state == "content":
            return "", text
        self._buffer += text
        reasoning = content = ""
        if self._state == "start":
            if len(self._buffer) < len(OPEN) and OPEN.startswith(self._buffer):
                return "", ""
            opened = self._buffer.startswith(OPEN)
            if opened:
                self._buffer = self._buffer[len(OPEN) :]
            self._state = "reasoning" if opened or self._starts_open else "content"
            if self._state == "content":
                content, self._buffer = self._buffer, ""
                return "", content
        end = self._buffer.find(CLOSE)
        if end >= 0:
            reasoning, content = self._buffer[:end], self._buffer[end + len(CLOSE) :]
            self._buffer, self._state = "", "content"
            return reasoning, content
        keep = partial_tag_length(self._buffer, CLOSE)
        reasoning = self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return reasoning, content

    def finish(self) -> Split:
        rest, self._buffer = self._buffer, ""
        if self._state == "reasoning" or (self._state == "start" and self._starts_open):
            return rest, ""
        return "", rest


# Parser name -> whether the reply reasons from its first token (the template opened <think>).
REASONING_STARTS_OPEN = {"qwen3": False, "deepseek_r1": True}


def reasoning_parser(name: str) -> ThinkReasoningParser:
    return ThinkReasoningParser(REASONING_STARTS_OPEN[name])


def reasoning_tokens(name: str, tokenizer) -> ReasoningTokens:
    """The think block's tokens, for grammars that start after it; ``ValueError`` if the
    tokenizer does not have each tag as one token (as Qwen3's and DeepSeek-R1's do)."""
    vocab = tokenizer.get_vocab()
    missing = [tag for tag in (OPEN, CLOSE) if tag not in vocab]
    if missing:
        raise ValueError(
            f"--reasoning-parser {name} needs {' and '.join(missing)} as one token of the "
            "tokenizer, so that structured outputs can start after the reasoning"
        )
    return ReasoningTokens(vocab[CLOSE], None if REASONING_STARTS_OPEN[name] else vocab[OPEN])
