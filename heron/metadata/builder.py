"""The contract between an operator's metadata builder and the engine."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from heron.metadata.sequence import SequenceMetadata


class GraphSupport(enum.IntEnum):
    """How much of a step a builder's metadata lets the engine capture as a CUDA graph.

    Ordered from weakest to strongest, so the engine's mode is ``min`` over all groups.
    """

    NEVER = 0
    DECODE_ONLY = 1  # steps where every request decodes exactly one token
    UNIFORM = 2  # steps where every request has the same query length
    ALWAYS = 3


class MetadataBuilder(ABC):
    """Turns the step's shared :class:`SequenceMetadata` into one group's typed view.

    ``key`` holds every parameter the metadata depends on; operators whose builders have equal
    keys share one group (and this builder). For CUDA graphs a builder owns persistent buffers:
    ``make_graph_buffers`` sizes them once for the largest batch, ``fill`` writes a step into
    them in place (before every capture and replay), ``graph_view`` is the view operators read
    from them (taken once per captured batch size: a replay runs no Python, so it needs no view),
    ``before_capture`` resets metadata that initialises itself lazily during warm-up. Eager
    steps go through ``build``, which must share its code with ``fill`` and ``graph_view`` so
    that eager, capture and replay cannot drift apart.
    """

    graph_support: GraphSupport = GraphSupport.NEVER
    # Whether its operators read the step's positions, slots and lengths only as the device
    # tensors of SequenceMetadata (never its host copies): the runner may then move a row back
    # on the device before the forward pass (a step scheduled past an unread verification).
    lengths_on_device: bool = False

    @property
    @abstractmethod
    def key(self) -> Hashable:
        """Everything this builder's metadata depends on (hashable)."""

    @abstractmethod
    def build(self, seq: SequenceMetadata) -> Any:
        """The group's view for an eagerly executed step."""

    def make_graph_buffers(self, max_batch: int, device: torch.device) -> Any:
        """Persistent buffers for graph steps of up to ``max_batch`` requests. A builder that
        declares ``UNIFORM`` also takes ``max_query_len``: the most tokens per row."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def fill(self, seq: SequenceMetadata, buffers: Any, batch: int) -> None:
        """Write ``seq`` into ``buffers``, padded to ``batch`` rows."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def graph_view(self, seq: SequenceMetadata, buffers: Any, batch: int) -> Any:
        """The view on ``buffers`` for steps of ``batch`` rows, after ``fill`` wrote ``seq``."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def before_capture(self, buffers: Any) -> None:
        """Reset lazily initialised metadata so a captured graph recomputes it on replay."""

    def describe(self) -> str:
        return type(self).__name__
