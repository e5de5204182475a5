"""A mixin for KV cache tests: check every invariant after every public operation."""

from __future__ import annotations


class InvariantChecked:
    """Put before a KV cache class (a manager or the coordinator) so no test can forget to call
    ``check_invariants``."""

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

    def reset_prefix_cache(self):
        result = super().reset_prefix_cache()
        self.check_invariants()
        return result
