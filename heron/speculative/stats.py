"""Counters of proposed and accepted tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodeStats:
    """``num_drafts``: rows that verified at least one proposal; a row's acceptance length is
    its accepted proposals plus the token the step samples after them."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying row step (1.0 when nothing was verified)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
