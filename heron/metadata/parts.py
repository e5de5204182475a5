"""The contract by which a cache kind contributes its own parts to a step's packed batch.

Each cache group's kind (``CacheSpec.step_parts``) says which int32 arrays the step carries for
the group and at what sizes (:meth:`StepParts.layout`), fills them on the host from the step's
rows and the group's stored tables (:meth:`StepParts.fill`), and names the typed record its
builders read on the device (``GroupLayout.record``, one field per part). The packed batch and
its one copy to the device know parts only by name and size. ``layout`` and ``fill`` pair like a
cache manager's ``plan`` and ``commit``: what the first worked out goes to the second.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np


class Part(NamedTuple):
    """One int32 array of a group's parts: ``cols`` entries, or ``rows`` rows of them (each
    row on its own aligned start)."""

    name: str
    cols: int
    rows: int | None = None


class GroupLayout(NamedTuple):
    """A group's parts in one step, and the record type its device views are handed out as
    (a frozen dataclass whose fields are the parts' names)."""

    record: type
    parts: tuple[Part, ...]


class StepRows(NamedTuple):
    """What a kind fills its parts from: the step's requests and tokens, on the host.

    ``table_rows[i]`` is request ``request_ids[i]``'s row in the stored tables
    (:class:`GroupTables`); per token, ``token_table_rows`` is its request's row there and
    ``block_indices`` / ``block_offsets`` its position's block in the request's table and its
    offset in that block (every group that pages by blocks shares one block size).
    """

    request_ids: list[str]
    table_rows: np.ndarray  # [reqs]
    contexts: np.ndarray  # [reqs] int32: tokens computed before this step
    token_table_rows: np.ndarray  # [tokens]
    block_indices: np.ndarray  # [tokens]
    block_offsets: np.ndarray  # [tokens]
    block_size: int


class GroupTables(NamedTuple):
    """One cache group's stored per-request rows, as the runner keeps them across steps."""

    array: np.ndarray  # [stored rows, capacity]: each request's table from index 0, 0 past its end
    lengths: np.ndarray  # [reqs]: the step's requests' table lengths
    # [reqs]: tokens the runner's steps have put in the request's caches since it got its row
    # (a fresh row holds none).
    written: np.ndarray


class StepParts(ABC):
    """A cache kind's share of the packed step batch."""

    @abstractmethod
    def layout(
        self, contexts: np.ndarray, num_tokens: int, tables: GroupTables
    ) -> tuple[GroupLayout, Any]:
        """The group's parts for a step of these contexts (one per request) and tokens, and
        what the kind worked out for them that :meth:`fill` needs again (its own business)."""

    @abstractmethod
    def layout_of(self, num_reqs: int, num_tokens: int, width: int) -> GroupLayout:
        """The group's parts at given sizes, for steps made without tables (profiling, graph
        capture), whose zero-filled parts point every row at the null entry."""

    @abstractmethod
    def fill(
        self, parts: Mapping[str, np.ndarray], step: StepRows, tables: GroupTables, planned: Any
    ) -> None:
        """Write the step's values into the group's (zero-filled) host parts; ``planned`` is
        what :meth:`layout` returned beside them."""
