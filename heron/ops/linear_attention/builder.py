"""The gated-delta-rule view and its builder: each row's state slot and whether it has a state.

Both come per row from the recurrent-state group's step parts (``RecurrentParts``), never as
one flag for the batch: a step mixes new prompts, continued chunks and decodes.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

from heron.cache.recurrent_parts import RecurrentParts
from heron.metadata import GraphSupport, MetadataBuilder, SequenceMetadata, StepMetadataError


@dataclass(frozen=True)
class GatedDeltaNetView:
    """What a gated-delta-rule operator reads each step. Padded graph rows have slot 0 (the
    null slot) and no saved state."""

    is_decode: bool
    num_reqs: int
    state_slots: torch.Tensor  # [reqs] int32
    has_initial_state: torch.Tensor  # [reqs] bool
    query_start_loc: torch.Tensor  # [reqs + 1]: the prefill kernels' cu_seqlens
    query_start_host: np.ndarray  # [reqs + 1]
    max_query_len: int


@dataclass(frozen=True)
class GatedDeltaNetGraphBuffers:
    state_slots: torch.Tensor
    has_initial_state: torch.Tensor
    query_start_loc: torch.Tensor


class GatedDeltaNetBuilder(MetadataBuilder):
    """Builds :class:`GatedDeltaNetView` from the step parts of ``cache_group`` (set by the
    runner after planning: the recurrent-state group its operators' specs form)."""

    cache_group: int = 0

    graph_support = GraphSupport.DECODE_ONLY

    def __init__(self, backend: str) -> None:
        self.backend = backend

    @property
    def key(self) -> Hashable:
        return (type(self).__name__, self.backend)

    def describe(self) -> str:
        return f"{type(self).__name__}({self.backend})"

    def build(self, seq: SequenceMetadata) -> GatedDeltaNetView:
        slots, has_state = self._rows(seq)
        return self._view(seq, slots, has_state, seq.query_start_loc, seq.num_reqs)

    def make_graph_buffers(self, max_batch: int, device: torch.device) -> GatedDeltaNetGraphBuffers:
        return GatedDeltaNetGraphBuffers(
            state_slots=torch.zeros(max_batch, dtype=torch.int32, device=device),
            has_initial_state=torch.zeros(max_batch, dtype=torch.bool, device=device),
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
        )

    def fill(self, seq: SequenceMetadata, buffers: GatedDeltaNetGraphBuffers, batch: int) -> None:
        if not seq.is_decode or batch < seq.num_reqs:
            raise StepMetadataError(
                f"graph buffers take decode steps of at most {batch} requests, got "
                f"{seq.num_reqs} requests with {seq.num_tokens} tokens"
            )
        n = seq.num_reqs
        slots, has_state = self._rows(seq)
        buffers.state_slots[:n].copy_(slots)
        buffers.has_initial_state[:n].copy_(has_state)
        if n < batch:  # padded rows: the null slot, no saved state
            buffers.state_slots[n:batch].zero_()
            buffers.has_initial_state[n:batch].zero_()

    def graph_view(
        self, seq: SequenceMetadata, buffers: GatedDeltaNetGraphBuffers, batch: int
    ) -> GatedDeltaNetView:
        return self._view(
            seq,
            buffers.state_slots[:batch],
            buffers.has_initial_state[:batch],
            buffers.query_start_loc[: batch + 1],
            batch,
        )

    def _rows(self, seq: SequenceMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's slot and whether it starts from the state saved there."""
        parts = seq.parts(self.cache_group, RecurrentParts)
        return parts.state_slots, parts.has_saved_state.bool()

    def _view(
        self,
        seq: SequenceMetadata,
        slots: torch.Tensor,
        has_state: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_reqs: int,
    ) -> GatedDeltaNetView:
        return GatedDeltaNetView(
            is_decode=seq.is_decode,
            num_reqs=num_reqs,
            state_slots=slots,
            has_initial_state=has_state,
            query_start_loc=query_start_loc,
            query_start_host=seq.query_start_host,
            max_query_len=seq.max_query_len,
        )
