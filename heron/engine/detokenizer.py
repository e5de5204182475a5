"""Incremental detokenization of one request's output, and stop-string matching on it."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from heron.engine.stopping import stop_token_reason
from heron.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded ahead of the output, so that the first output tokens decode as they do
# in context: sentencepiece decoders drop the leading space of a text's first word, and a
# character may be split between the prompt and the output.
_PROMPT_CONTEXT_TOKENS = 6

# What a decoder yields for bytes that are not (yet) a whole UTF-8 character.
_REPLACEMENT_CHAR = "\ufffd"


@lru_cache(maxsize=8)
def _special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids that ``tokenizer.decode(..., skip_special_tokens=True)`` leaves out.

    The tokenizers backend skips every added token flagged special, which can be more than
    ``all_special_ids`` (e.g. ``<|im_end|>``); cached because building the map is not free.
    """
    return frozenset(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)


class IncrementalDetokenizer:
    """Builds a request's output text token by token and watches it for stop strings.

    Decoding follows vLLM's offsets scheme: the tokens after the last emitted boundary are
    decoded together with the few before it (the already emitted "prefix"), and the text beyond
    the prefix's text is appended once it no longer ends in an incomplete character. Text thus
    equals ``tokenizer.decode(prompt + output)`` past the prompt's text, with no full re-decode,
    except that tokens ending in an incomplete character are held back (also at the end: an
    output cut inside a character never shows its U+FFFD).

    A token that ends the output as EOS or a stop token adds no text unless
    ``include_stop_str_in_output`` (as in vLLM). Stop strings are only looked for once
    ``min_tokens`` tokens were generated.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._skipped_ids = (
            _special_token_ids(tokenizer) if params.skip_special_tokens else frozenset()
        )
        self._max_stop_len = max(map(len, params.stop), default=0)
        self._num_output_tokens = 0
        self._finished = False
        self.text = ""
        # The decode window: _tokens[:_read_offset] is the prefix, whose text _prefix_text was
        # already emitted (or belongs to the prompt); tokens after it wait to be emitted.
        self._tokens = [
            token
            for token in map(self._token_string, prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
            if token is not None
        ]
        self._read_offset = len(self._tokens)
        self._prefix_text = self._tokenizer.convert_tokens_to_string(self._tokens)

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def text_safe_to_stream(self) -> str:
        """``text`` less the tail that could still turn out to begin a stop string."""
        if self._finished or self._max_stop_len <= 1:
            return self.text
        return self.text[: max(len(self.text) - self._max_stop_len + 1, 0)]

    def finish(self) -> None:
        """Marks the output complete, so nothing is held back from streaming any more."""
        self._finished = True

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Appends tokens to the text; returns the stop string that ended it, if one did.

        On a match, ``text`` is cut at the stop string (kept when
        ``include_stop_str_in_output``) and tokens after it are ignored.
        """
        for token_id in new_token_ids:
            self._num_output_tokens += 1
            ends_output = stop_token_reason(self._params, token_id, self._num_output_tokens)
            if ends_output and not self._params.include_stop_str_in_output:
                self._finished = True
                return None
            old_len = len(self.text)
            self._decode_next(token_id)
            stop = self._match_stop_string(old_len)
            if stop is not None or ends_output:
                self._finished = True
                return stop
        return None

    def _token_string(self, token_id: int) -> str | None:
        """The vocabulary string of a token; None for skipped and out-of-vocabulary ids."""
        if token_id in self._skipped_ids:
            return None
        return self._tokenizer.convert_ids_to_tokens(token_id)

    def _decode_next(self, token_id: int) -> None:
        token = self._token_string(token_id)
        if token is None:
            return
        self._tokens.append(token)
        text = self._tokenizer.convert_tokens_to_string(self._tokens)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            return
        self.text += text[len(self._prefix_text) :]
        self._tokens = self._tokens[self._read_offset :]
        self._read_offset = len(self._tokens)
        self._prefix_text = self._tokenizer.convert_tokens_to_string(self._tokens)

    def _match_stop_string(self, old_len: int) -> str | None:
        """Finds the earliest stop string ending in the text added after ``old_len``; cuts there."""
        if self._num_output_tokens < self._params.min_tokens:
            return None
        match: tuple[int, str] | None = None
        for stop in self._params.stop:
            # A match wholly inside the old text would have ended the output already.
            index = self.text.find(stop, max(old_len - len(stop) + 1, 0))
            if index != -1 and (match is None or index < match[0]):
                match = (index, stop)
        if match is None:
            return None
        index, stop = match
        end = index + len(stop) if self._params.include_stop_str_in_output else index
        self.text = self.text[:end]
        return stop
