"""Helpers for KV cache tests: specs of given windows, and a mixin that checks every invariant
after every public operation."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from heron.cache import CacheSpec, FullAttentionSpec, SlidingWindowSpec


def cache_specs(block_size: int, windows: Sequence[int | None] = (None,)) -> list[CacheSpec]:
    """One spec per window (``None``: full attention); the head shape does not matter here."""
    return [
        FullAttentionSpec(block_size, torch.float16, 1, 8)
        if w is None
        else SlidingWindowSpec(block_size, torch.float16, 1, 8, w)
        for w in windows
    ]


class InvariantChecked:
    """Put before the coordinator class so no test can forget to call ``check_invariants``."""

    def get_computed_blocks(self, request):
        result = super().get_computed_blocks(request)
        self.check_invariants()
        return result

    def allocate_slots(self, request, num_new_tokens, new_computed_blocks=()):
        result = super().allocate_slots(request, num_new_tokens, new_computed_blocks)
        self.check_invariants()
        return result

    def free(self, request):
        super().free(request)
        self.check_invariants()

    def truncate(self, request, num_tokens):
        super().truncate(request, num_tokens)
        self.check_invariants()

    def reset_prefix_cache(self):
        result = super().reset_prefix_cache()
        self.check_invariants()
        return result

    def take_state_copies(self):
        copies = super().take_state_copies()
        self.check_invariants()
        return copies
