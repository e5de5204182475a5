"""Prompt-lookup proposals: what followed the latest earlier occurrence of the sequence's end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from heron.speculative.proposer import Proposer

if TYPE_CHECKING:
    from heron.engine.request import Request
    from heron.execution.launched import LaunchedStep


class NgramProposer(Proposer):
    """Proposes up to ``num_tokens`` tokens from the sequence itself, on the host.

    The candidates are the earlier positions holding the last token; each further step back
    keeps those whose preceding tokens still match the sequence's, so the search costs one
    vectorised comparison over the sequence plus ``max_n`` over the candidates. Each request's
    tokens are kept as an array that grows by its new tokens (sequences only grow), so a
    lookup never converts the whole sequence.
    """

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}  # request -> (buffer, length)

    def propose(
        self,
        requests: Sequence[Request],
        limits: Sequence[int],
        verifying: LaunchedStep | None = None,
    ) -> list[list[int]]:
        return [self.lookup(r.request_id, r.all_token_ids, n) for r, n in zip(requests, limits)]

    def lookup(self, request_id: str, token_ids: Sequence[int], limit: int) -> list[int]:
        """At most ``min(limit, num_tokens)`` tokens; none without a match of ``min_n`` tokens."""
        limit = min(limit, self.num_tokens)
        if limit <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = self._array(request_id, token_ids)
        last = len(tokens) - 1
        ends = np.flatnonzero(tokens[:last] == tokens[last])  # matches of length 1, by end
        best = ends[-1] if ends.size and self.min_n <= 1 else None
        for length in range(2, self.max_n + 1):
            ends = ends[ends >= length - 1]
            ends = ends[tokens[ends - (length - 1)] == tokens[last - (length - 1)]]
            if not ends.size:
                break
            if length >= self.min_n:
                best = ends[-1]
        if best is None:
            return []
        return tokens[best + 1 : best + 1 + limit].tolist()

    def forget(self, request_id: str) -> None:
        self._arrays.pop(request_id, None)

    def _array(self, request_id: str, token_ids: Sequence[int]) -> np.ndarray:
        """The request's tokens as an array view, appending those added since the last call."""
        buffer, length = self._arrays.get(request_id, (None, 0))
        n = len(token_ids)
        if buffer is None or n < length:
            buffer, length = np.empty(max(2 * n, 64), dtype=np.int64), 0
        elif n > len(buffer):
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:length] = buffer[:length]
            buffer = grown
        buffer[length:n] = token_ids[length:n]
        self._arrays[request_id] = (buffer, n)
        return buffer[:n]
