"""The paged kinds' parts of a step (full attention, sliding window, latent): per-token slots,
table rows of the group's own width, each row's first table block."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from heron.metadata.parts import GroupLayout, GroupTables, Part, StepParts, StepRows


class TableStarts(Protocol):
    """What the parts read of a paged spec: where a row's table starts."""

    def first_table_block(self, context: int | np.ndarray) -> int | np.ndarray: ...


@dataclass(frozen=True)
class PagedParts:
    """A paged group's step parts on the device."""

    slot_mapping: torch.Tensor  # [tokens]: each token's cache slot (block id * block size + offset)
    block_tables: torch.Tensor  # [reqs, width]: each row from its first table block on
    table_starts: torch.Tensor  # [reqs]: the table index of each row's first entry


@functools.lru_cache(maxsize=256)
def paged_layout(num_reqs: int, num_tokens: int, width: int) -> GroupLayout:
    """A paged group's parts with table rows ``width`` entries wide."""
    return GroupLayout(
        PagedParts,
        (
            Part("slot_mapping", num_tokens),
            Part("block_tables", width, num_reqs),
            Part("table_starts", num_reqs),
        ),
    )


class PagedStepParts(StepParts):
    """A row's table starts at ``spec.first_table_block(context)`` (0 without a window), so a
    windowed row holds only the blocks its step can read, and the group's table width is its
    own rows' widest."""

    def __init__(self, spec: TableStarts) -> None:
        self.spec = spec

    def layout(
        self, contexts: np.ndarray, num_tokens: int, tables: GroupTables
    ) -> tuple[GroupLayout, np.ndarray | int]:
        """The layout, and each row's first table block."""
        firsts = self.spec.first_table_block(contexts)
        lengths = tables.lengths if isinstance(firsts, int) else tables.lengths - firsts
        return paged_layout(len(contexts), num_tokens, int(lengths.max(initial=0))), firsts

    def layout_of(self, num_reqs: int, num_tokens: int, width: int) -> GroupLayout:
        return paged_layout(num_reqs, num_tokens, width)

    def fill(
        self,
        parts: Mapping[str, np.ndarray],
        step: StepRows,
        tables: GroupTables,
        firsts: np.ndarray | int,
    ) -> None:
        out = parts["block_tables"]
        if isinstance(firsts, int):  # every row from index 0: whole rows at once
            out[:] = tables.array[step.table_rows, : out.shape[1]]
        else:
            columns = firsts[:, None] + np.arange(out.shape[1])
            np.minimum(columns, tables.array.shape[1] - 1, out=columns)  # past every end: a 0
            out[:] = tables.array[step.table_rows[:, None], columns]
            parts["table_starts"][:] = firsts
        # Each token's slot: its block's id * block_size + its offset in the block.
        slots = parts["slot_mapping"]
        blocks = tables.array[step.token_table_rows, step.block_indices]
        np.multiply(blocks, step.block_size, out=slots)
        slots += step.block_offsets
