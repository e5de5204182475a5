"""The gated-delta-rule view and its builder: each row's state slot and whether it has a state.

Both come per row from the recurrent-state group's step parts (``RecurrentParts``), never as
one flag for the batch: a step mixes new prompts, continued chunks and decodes.

A builder given a ``chunk_size`` (the GPU operator's) also hands extend steps the chunked
kernels' tiling: ``cu_seqlens`` and ``chunk_indices``, made once per step for every layer.

Graph buffers take decode steps and uniform verification steps (``q`` tokens per row, every row
verifying ``q - 1`` proposals): their views say so in ``verifies_uniformly``, which an operator
that runs such steps from device metadata alone reads (its builder declares ``UNIFORM``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, replace

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
    cu_seqlens: torch.Tensor | None = None  # [reqs + 1] int64, extend steps with a chunk size
    chunk_indices: torch.Tensor | None = None  # [tiles, 2] int64: request, tile within it
    # per request, the proposals it verifies (see SequenceMetadata), or None
    num_proposed_host: np.ndarray | None = None
    # every row verifies max_query_len - 1 proposals (graph views of such steps too)
    verifies_uniformly: bool = False


def chunk_indices(query_start: np.ndarray, chunk_size: int) -> np.ndarray:
    """(request, tile within the request) of every ``chunk_size``-token tile, in order: the
    tiling fla's varlen kernels take as ``chunk_indices``."""
    tiles = -(-np.diff(query_start.astype(np.int64)) // chunk_size)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    rows = np.repeat(np.arange(len(tiles)), tiles)
    return np.stack([rows, np.arange(first.shape[0]) - first], axis=1)


@dataclass(frozen=True)
class GatedDeltaNetGraphBuffers:
    state_slots: torch.Tensor
    has_initial_state: torch.Tensor
    # [max_q, max_batch + 1]: row q - 1 is 0, q, 2q, ... (constants, so never filled)
    query_starts: torch.Tensor

    @property
    def max_query_len(self) -> int:
        return self.query_starts.shape[0]


class GatedDeltaNetBuilder(MetadataBuilder):
    """Builds :class:`GatedDeltaNetView` from the step parts of ``cache_group`` (set by the
    runner after planning: the recurrent-state group its operators' specs form)."""

    cache_group: int = 0

    graph_support = GraphSupport.DECODE_ONLY

    def __init__(self, backend: str, chunk_size: int | None = None) -> None:
        self.backend = backend
        self.chunk_size = chunk_size

    @property
    def key(self) -> Hashable:
        return (type(self).__name__, self.backend, self.chunk_size)

    def describe(self) -> str:
        return f"{type(self).__name__}({self.backend})"

    def build(self, seq: SequenceMetadata) -> GatedDeltaNetView:
        slots, has_state = self._rows(seq)
        uniform = seq.is_uniform_verification  # decode steps of the operator's own kernels
        view = self._view(seq, slots, has_state, seq.query_start_loc, seq.num_reqs, uniform)
        if self.chunk_size is None or seq.is_decode or uniform:
            return view
        tiles = chunk_indices(seq.query_start_host, self.chunk_size)
        device = seq.query_start_loc.device
        return replace(
            view,
            cu_seqlens=seq.query_start_loc.long(),
            chunk_indices=torch.from_numpy(tiles).to(device),
        )

    def make_graph_buffers(
        self, max_batch: int, device: torch.device, max_query_len: int = 1
    ) -> GatedDeltaNetGraphBuffers:
        rows = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        lens = torch.arange(1, max_query_len + 1, dtype=torch.int32, device=device)
        return GatedDeltaNetGraphBuffers(
            state_slots=torch.zeros(max_batch, dtype=torch.int32, device=device),
            has_initial_state=torch.zeros(max_batch, dtype=torch.bool, device=device),
            query_starts=rows * lens[:, None],
        )

    def fill(self, seq: SequenceMetadata, buffers: GatedDeltaNetGraphBuffers, batch: int) -> None:
        uniform = seq.is_decode or seq.is_uniform_verification
        if not uniform or seq.max_query_len > buffers.max_query_len or batch < seq.num_reqs:
            raise StepMetadataError(
                f"graph buffers take decode steps or uniform verification steps (at most "
                f"{buffers.max_query_len} tokens per row) of at most {batch} requests, got "
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
        q = seq.max_query_len
        return self._view(
            seq,
            buffers.state_slots[:batch],
            buffers.has_initial_state[:batch],
            buffers.query_starts[q - 1, : batch + 1],
            batch,
            q > 1,
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
        verifies_uniformly: bool,
    ) -> GatedDeltaNetView:
        return GatedDeltaNetView(
            is_decode=seq.is_decode,
            num_reqs=num_reqs,
            state_slots=slots,
            has_initial_state=has_state,
            query_start_loc=query_start_loc,
            query_start_host=seq.query_start_host,
            max_query_len=seq.max_query_len,
            num_proposed_host=seq.num_proposed_host,
            verifies_uniformly=verifies_uniformly,
        )


class UniformGatedDeltaNetBuilder(GatedDeltaNetBuilder):
    """The builder of an operator that runs uniform verification steps from the view's device
    tensors alone (``verifies_uniformly``), so their graphs can be captured."""

    graph_support = GraphSupport.UNIFORM
