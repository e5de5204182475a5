"""The paged-attention view and its builder, shared by paged attention backends."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from heron.cache.paged import paged_table_width
from heron.cache.paged_parts import PagedParts
from heron.metadata import GraphSupport, MetadataBuilder, SequenceMetadata, StepMetadataError


@dataclass(frozen=True)
class PagedAttentionView:
    """What a paged attention operator reads each step.

    Device tensors cover ``num_reqs`` rows (padded rows of a graph batch have KV length 0 and
    point at the null block 0). The host arrays serve eager kernels that loop over requests.
    """

    is_decode: bool
    num_reqs: int
    block_size: int
    sliding_window: int | None
    positions: torch.Tensor  # [tokens]
    slot_mapping: torch.Tensor  # [tokens]
    block_tables: torch.Tensor  # [reqs, table width]; a windowed row starts at the window
    table_starts: torch.Tensor  # [reqs]: the table index of each row's first entry
    kv_lens: torch.Tensor  # [reqs]
    query_start_loc: torch.Tensor  # [reqs + 1]
    query_start_host: np.ndarray
    query_lens_host: np.ndarray
    kv_lens_host: np.ndarray
    max_query_len: int
    workspace: Any = None  # a backend's per-step extras (e.g. split-KV buffers)
    key_limits: torch.Tensor | None = None  # [tokens] (SequenceMetadata.key_limits)


@dataclass(frozen=True)
class PagedGraphBuffers:
    """Persistent buffers of uniform steps (``q`` tokens per row, ``q = 1`` decode), sized once
    for the largest graph batch and query length."""

    positions: torch.Tensor  # [max_batch * max_q]
    slot_mapping: torch.Tensor  # [max_batch * max_q]
    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    table_starts: torch.Tensor
    query_start_loc: torch.Tensor  # [max_batch + 1]: 0, 1, 2, ... (decode)
    # [max_q, max_batch + 1]: row q - 1 is 0, q, 2q, ... (constants, so never filled)
    uniform_query_starts: torch.Tensor
    # The destination views of the last step's shape, by (requests, tokens, table width).
    _rows: dict[tuple[int, int, int], list[torch.Tensor]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def max_query_len(self) -> int:
        return self.uniform_query_starts.shape[0]

    def rows(self, num_reqs: int, num_tokens: int, width: int) -> list[torch.Tensor]:
        """Positions and slots of the first ``num_tokens`` tokens; block tables (``width``
        columns), KV lengths and table starts of the first ``num_reqs`` rows. Views are made
        again only when the shape changes: consecutive steps mostly share it, and each view
        costs the host a dispatch."""
        views = self._rows.get((num_reqs, num_tokens, width))
        if views is None:
            self._rows.clear()  # only the last shape is kept
            views = self._rows[num_reqs, num_tokens, width] = [
                self.positions[:num_tokens],
                self.slot_mapping[:num_tokens],
                self.block_tables[:num_reqs, :width],
                self.kv_lens[:num_reqs],
                self.table_starts[:num_reqs],
            ]
        return views


class PagedAttentionBuilder(MetadataBuilder):
    """Builds :class:`PagedAttentionView` for one (block size, sliding window) configuration.

    A sliding-window configuration's block tables hold only the blocks its queries can still
    read: row ``r`` starts at the block of the first key that the request's first new token sees
    (``SlidingWindowSpec.first_table_block``; the step metadata carries each row's start), so a
    decode row is at most ``table_width`` entries wide whatever the context length.

    Decode steps are graph-capturable: ``fill`` copies the step into persistent buffers whose
    block-table width is bounded by ``max_model_len / block_size`` (by the window, with one);
    padded rows get length 0 and the null block. ``fill`` takes uniform steps too (``q``
    tokens per row, for a backend whose extend path reads only device metadata: it declares
    ``UNIFORM``). Eager steps use ``build``; it and ``graph_view`` end in :meth:`_view`.

    ``cache_group`` is the KV cache group whose block tables and slots this builder reads (set by
    the runner after planning: every builder with the same sliding window shares one group).
    A sliding group's table holds the null block where blocks slid out of the window.
    """

    cache_group: int = 0

    graph_support = GraphSupport.DECODE_ONLY

    def __init__(
        self,
        backend: str,
        block_size: int,
        sliding_window: int | None,
        max_model_len: int,
        lengths_on_device: bool = False,
    ) -> None:
        """``lengths_on_device``: the backend's operators read no host copy of the KV
        lengths (``MetadataBuilder.lengths_on_device``)."""
        self.backend = backend
        self.lengths_on_device = lengths_on_device
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.table_width = paged_table_width(max_model_len, block_size, sliding_window)

    @property
    def key(self) -> Hashable:
        return (
            type(self).__name__,
            self.backend,
            self.block_size,
            self.sliding_window,
            self.max_blocks_per_seq,
        )

    def describe(self) -> str:
        return f"{type(self).__name__}({self.backend})"

    def build(self, seq: SequenceMetadata) -> PagedAttentionView:
        self._check_layout(seq)
        slot_mapping, block_tables, table_starts = self._group_tables(seq)
        return self._view(
            seq,
            seq.positions,
            slot_mapping,
            block_tables,
            table_starts,
            seq.kv_lens,
            seq.query_start_loc,
            seq.num_reqs,
        )

    def make_graph_buffers(
        self, max_batch: int, device: torch.device, max_query_len: int = 1
    ) -> PagedGraphBuffers:
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int32, device=device)
        rows = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        starts = (
            rows * torch.arange(1, max_query_len + 1, dtype=torch.int32, device=device)[:, None]
        )
        return PagedGraphBuffers(
            positions=zeros(max_batch * max_query_len),
            slot_mapping=zeros(max_batch * max_query_len),
            block_tables=zeros(max_batch, self.table_width),
            kv_lens=zeros(max_batch),
            table_starts=zeros(max_batch),
            query_start_loc=starts[0],
            uniform_query_starts=starts,
        )

    def fill(self, seq: SequenceMetadata, buffers: PagedGraphBuffers, batch: int) -> None:
        self._check_layout(seq)
        if seq.key_limits is not None:
            raise StepMetadataError("graph buffers take causal steps only (key_limits given)")
        n, q = seq.num_reqs, seq.max_query_len
        if seq.num_tokens != n * q or q > buffers.max_query_len or batch < n:
            raise StepMetadataError(
                f"graph buffers take steps of at most {batch} requests of the same query length "
                f"(at most {buffers.max_query_len}), got {n} requests with {seq.num_tokens} tokens"
            )
        slot_mapping, block_tables, table_starts = self._group_tables(seq)
        width = block_tables.shape[1]
        if width > self.table_width:
            width = self.table_width
            block_tables = block_tables[:, :width]
        # Few, in-place copies: this runs before every replay. Table entries past a row's
        # length are never read, so stale ones need no reset; padded rows get length 0, the
        # null block, slot 0 (their garbage K/V goes to the null block) and table start 0.
        # One foreach call: a launch per dtype on the GPU instead of one per copy.
        torch._foreach_copy_(
            buffers.rows(n, n * q, width),
            [seq.positions, slot_mapping, block_tables, seq.kv_lens, table_starts],
        )
        if n < batch:
            torch._foreach_zero_(
                [
                    buffers.slot_mapping[n * q : batch * q],
                    buffers.block_tables[n:batch],
                    buffers.kv_lens[n:batch],
                    buffers.table_starts[n:batch],
                ]
            )

    def graph_view(
        self, seq: SequenceMetadata, buffers: PagedGraphBuffers, batch: int
    ) -> PagedAttentionView:
        q = seq.max_query_len
        return self._view(
            seq,
            buffers.positions[: batch * q],
            buffers.slot_mapping[: batch * q],
            buffers.block_tables[:batch],
            buffers.table_starts[:batch],
            buffers.kv_lens[:batch],
            buffers.uniform_query_starts[q - 1, : batch + 1],
            batch,
        )

    def _group_tables(
        self, seq: SequenceMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This builder's cache group's slots, block tables and table starts."""
        parts = seq.parts(self.cache_group, PagedParts)
        return parts.slot_mapping, parts.block_tables, parts.table_starts

    def _check_layout(self, seq: SequenceMetadata) -> None:
        # Block tables and slots in SequenceMetadata are laid out for one block size.
        if seq.block_size != self.block_size:
            raise StepMetadataError(
                f"{self.describe()} needs block size {self.block_size}, the step was laid out "
                f"for {seq.block_size}"
            )

    def _view(
        self,
        seq: SequenceMetadata,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        table_starts: torch.Tensor,
        kv_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_reqs: int,
    ) -> PagedAttentionView:
        return PagedAttentionView(
            is_decode=seq.is_decode,
            num_reqs=num_reqs,
            block_size=self.block_size,
            sliding_window=self.sliding_window,
            positions=positions,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            table_starts=table_starts,
            kv_lens=kv_lens,
            query_start_loc=query_start_loc,
            query_start_host=seq.query_start_host,
            query_lens_host=seq.query_lens_host,
            kv_lens_host=seq.kv_lens_host,
            max_query_len=seq.max_query_len,
            key_limits=seq.key_limits,
        )
