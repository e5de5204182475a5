"""The pooler: reduces each finished request's hidden states to one vector, across the prefill
chunks it ran in (a pooling step samples nothing)."""

from __future__ import annotations

import torch

from heron.execution.step_plan import StepPlan


class Pooler:
    """Pools the step's rows by the model's pooling type: ``last`` (the request's last token),
    ``mean`` (over all its tokens) or ``cls`` (its first token).

    A request prefilled in chunks keeps its partial result (the running sum, or the first
    token's state) between steps; a row that starts at position 0 starts afresh (a preempted
    request is recomputed). ``mean`` and ``cls`` need every token computed here: the engine
    turns the prefix cache off for them.
    """

    def __init__(self, pooling_type: str) -> None:
        self.pooling_type = pooling_type
        self._partial: dict[str, torch.Tensor] = {}

    def __call__(self, plan: StepPlan, hidden: torch.Tensor) -> tuple[list[str], torch.Tensor]:
        """The requests whose last token the step computed, and their pooled hidden states
        (one row each, in plan order)."""
        for request_id in plan.finished_ids + plan.preempted_ids:
            self._partial.pop(request_id, None)
        done_ids, pooled = [], []
        start = 0
        for request_id, computed, n, done in zip(
            plan.request_ids, plan.num_computed, plan.num_new, plan.samples
        ):
            rows, start = hidden[start : start + n], start + n
            if self.pooling_type == "last":
                value = rows[-1]
            elif self.pooling_type == "cls":
                value = rows[0] if computed == 0 else self._partial.pop(request_id)
            else:
                value = rows.float().sum(0)
                if computed:
                    value += self._partial.pop(request_id)
            if not done:
                if self.pooling_type != "last":
                    self._partial[request_id] = value
                continue
            if self.pooling_type == "mean":
                value = value / (computed + n)
            done_ids.append(request_id)
            pooled.append(value.to(hidden.dtype))
        if not pooled:
            return [], hidden.new_empty((0, hidden.shape[-1]))
        return done_ids, torch.stack(pooled)
