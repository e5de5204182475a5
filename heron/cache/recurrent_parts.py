"""The recurrent-state kind's parts of a step: each row's state slot and whether it starts from
the state saved there. No token slots, no table rows."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from heron.metadata.errors import StepMetadataError
from heron.metadata.parts import GroupLayout, GroupTables, Part, StepParts, StepRows


@dataclass(frozen=True)
class RecurrentParts:
    """A recurrent group's step parts on the device."""

    state_slots: torch.Tensor  # [reqs]: each row's slot
    has_saved_state: torch.Tensor  # [reqs] int32: 1 where the slot holds the request's state


@functools.lru_cache(maxsize=256)
def _recurrent_layout(num_reqs: int) -> GroupLayout:
    return GroupLayout(
        RecurrentParts, (Part("state_slots", num_reqs), Part("has_saved_state", num_reqs))
    )


class RecurrentStepParts(StepParts):
    """A row's slot is its one-entry table; it starts from a saved state when the runner's own
    steps have folded tokens into that slot since the request was given it.

    Only those steps' tokens are in a slot, so a step that starts elsewhere (a prefix counted
    as computed whose state is not in the slot: dropped, or restored without the runner
    knowing) cannot be computed from it and is refused.
    """

    def layout(
        self, contexts: np.ndarray, num_tokens: int, tables: GroupTables
    ) -> tuple[GroupLayout, None]:
        return self.layout_of(len(contexts), num_tokens, 1), None

    def layout_of(self, num_reqs: int, num_tokens: int, width: int) -> GroupLayout:
        return _recurrent_layout(num_reqs)

    def fill(
        self, parts: Mapping[str, np.ndarray], step: StepRows, tables: GroupTables, planned: None
    ) -> None:
        mismatched = np.flatnonzero(tables.written != step.contexts)
        if len(mismatched):
            i = int(mismatched[0])
            raise StepMetadataError(
                f"request {step.request_ids[i]}: the step starts at token {step.contexts[i]}, "
                f"but its state slot holds {tables.written[i]} of its tokens"
            )
        parts["state_slots"][:] = tables.array[step.table_rows, 0]
        np.greater(tables.written, 0, out=parts["has_saved_state"])
