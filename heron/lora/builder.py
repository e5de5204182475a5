"""The LoRA layers' per-step metadata: each token's adapter slot, from each row's."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

from heron.metadata import GraphSupport, MetadataBuilder, SequenceMetadata


@dataclass(frozen=True)
class LoRAView:
    """``token_slots[t]``: token ``t``'s adapter slot (0: the base model); ``slots``: the
    step's adapter slots on the host, or None where they are not known (a graph's view, which
    serves any step). ``token_slots`` None: no token of the step uses an adapter."""

    token_slots: torch.Tensor | None
    slots: tuple[int, ...] | None


NO_ADAPTER = LoRAView(None, ())


class LoRABuilder(MetadataBuilder):
    """Every LoRA layer of a model shares one group: the view depends only on the step's rows.

    Eager steps list the step's slots (the PyTorch path computes each adapter's tokens apart);
    graphs keep one token-slot buffer, filled before each replay, and read it whatever the
    adapters (slot 0 contributes nothing), so no graph is captured per adapter."""

    graph_support = GraphSupport.UNIFORM
    lengths_on_device = True  # (it reads no positions or lengths but the query lengths)

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank

    @property
    def key(self) -> Hashable:
        return (type(self).__name__, self.max_loras, self.max_rank)

    def build(self, seq: SequenceMetadata) -> LoRAView:
        rows = seq.adapter_slots_host
        if rows is None or not rows.any():
            return NO_ADAPTER
        slots = tuple(int(s) for s in np.unique(rows) if s)
        return LoRAView(_token_slots(seq), slots)

    def make_graph_buffers(
        self, max_batch: int, device: torch.device, max_query_len: int = 1
    ) -> torch.Tensor:
        return torch.zeros(max_batch * max_query_len, dtype=torch.int32, device=device)

    def fill(self, seq: SequenceMetadata, buffers: torch.Tensor, batch: int) -> None:
        n = seq.num_tokens
        if seq.adapter_slots is None:
            buffers[:n].zero_()
        else:
            buffers[:n].copy_(_token_slots(seq))
        buffers[n:].zero_()  # padded rows: the base model

    def graph_view(self, seq: SequenceMetadata, buffers: torch.Tensor, batch: int) -> LoRAView:
        return LoRAView(buffers[: batch * seq.max_query_len], None)

    def describe(self) -> str:
        return f"{type(self).__name__}(max_loras={self.max_loras}, max_rank={self.max_rank})"


def _token_slots(seq: SequenceMetadata) -> torch.Tensor:
    """Each token's slot: its row's, repeated over the row's query tokens (on the device)."""
    if seq.num_tokens == seq.num_reqs:
        return seq.adapter_slots
    lens = seq.query_start_loc.diff()
    return torch.repeat_interleave(seq.adapter_slots, lens, output_size=seq.num_tokens)
