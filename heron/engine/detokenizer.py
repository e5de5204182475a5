"""Incremental detokenization of one request's output, and stop-string matching on it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from heron.engine.stopping import stop_token_reason
from heron.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded ahead of the output, so that the first output tokens decode as they do
# in context: sentencepiece decoders drop the leading space of a text's first word, and a
# character may be split between the prompt and the output.
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Builds a request's output text token by token and watches it for stop strings.

    Decoding is the tokenizers library's ``DecodeStream`` (in Rust), primed with the prompt's
    last few tokens: each token's text is what it adds to the decode of the tokens before it,
    emitted once it no longer ends in an incomplete character. Text thus equals
    ``tokenizer.decode(prompt + output)`` past the prompt's text, with no full re-decode, except
    that tokens ending in an incomplete character are held back (also at the end: an output cut
    inside a character never shows its U+FFFD).

    A token that ends the output as EOS or a stop token adds no text unless
    ``include_stop_str_in_output`` (as in vLLM). Stop strings are only looked for once
    ``min_tokens`` tokens were generated.

    Without stop strings nothing needs the text until it is read, so tokens are decoded when
    ``text`` is read: an offline ``generate`` decodes each output once, at the end, instead of
    a DecodeStream call per token on the engine's step (64 of them a step at batch 64).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        self._params = params
        self._max_stop_len = max(map(len, params.stop), default=0)
        self._num_output_tokens = 0
        self._finished = False
        self._text = ""
        self._undecoded: list[int] = []  # appended, not yet decoded into ``_text``
        self._backend = tokenizer.backend_tokenizer
        self._vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        for token_id in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]:
            self._step(token_id)  # context only: its text is the prompt's

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def text(self) -> str:
        """The output's text so far."""
        if self._undecoded:
            self._decode_undecoded()
        return self._text

    @property
    def text_safe_to_stream(self) -> str:
        """``text`` less the tail that could still turn out to begin a stop string."""
        text = self.text
        if self._finished or self._max_stop_len <= 1:
            return text
        return text[: max(len(text) - self._max_stop_len + 1, 0)]

    def finish(self) -> None:
        """Marks the output complete, so nothing is held back from streaming any more."""
        self._finished = True

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Appends tokens to the text; returns the stop string that ended it, if one did.

        On a match, ``text`` is cut at the stop string (kept when
        ``include_stop_str_in_output``) and tokens after it are ignored.
        """
        for token_id in new_token_ids:
            stop = self.append(token_id)
            if self._finished:
                return stop
        return None

    def append(self, token_id: int) -> str | None:
        """:meth:`update` with one token (the engine's per-step call, kept cheap)."""
        self._num_output_tokens += 1
        params = self._params
        ends_output = stop_token_reason(params, token_id, self._num_output_tokens)
        if ends_output and not params.include_stop_str_in_output:
            self._finished = True
            return None
        self._undecoded.append(token_id)
        stop = None
        if params.stop:
            old_len = len(self._text)
            self._decode_undecoded()
            stop = self._match_stop_string(old_len)
        if stop is not None or ends_output:
            self._finished = True
        return stop

    def _decode_undecoded(self) -> None:
        undecoded = self._undecoded
        if len(undecoded) == 1:  # (a step's one token: the common case, kept cheap)
            piece = self._step(undecoded.pop())
            if piece:
                self._text += piece
            return
        pieces = [self._step(token_id) for token_id in undecoded]
        undecoded.clear()
        self._text += "".join(filter(None, pieces))

    def _step(self, token_id: int) -> str | None:
        """The text ``token_id`` completes after the tokens before it (None while a character
        is incomplete, and for out-of-vocabulary ids)."""
        if not 0 <= token_id < self._vocab_size:
            return None
        return self._stream.step(self._backend, token_id)

    def _match_stop_string(self, old_len: int) -> str | None:
        """Finds the earliest stop string ending in the text added after ``old_len``; cuts there."""
        if self._num_output_tokens < self._params.min_tokens:
            return None
        match: tuple[int, str] | None = None
        for stop in self._params.stop:
            # A match wholly inside the old text would have ended the output already.
            index = self._text.find(stop, max(old_len - len(stop) + 1, 0))
            if index != -1 and (match is None or index < match[0]):
                match = (index, stop)
        if match is None:
            return None
        index, stop = match
        end = index + len(stop) if self._params.include_stop_str_in_output else index
        self._text = self._text[:end]
        return stop
