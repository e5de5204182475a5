"""Triton paged attention: the default attention operator on CUDA."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch
import triton
from torch import nn

from heron.kernels.attention_decode import (
    choose_num_splits,
    paged_decode_attention,
    tickets_needed,
)
from heron.kernels.attention_extend import paged_extend_attention
from heron.kernels.kv_write import kv_write, qk_norm_rope_kv_write
from heron.kernels.pdl import multiprocessor_count
from heron.layers.rotary import QKTransform
from heron.metadata import GraphSupport, SequenceMetadata
from heron.ops.attention.base import AttentionOperator, AttentionSpec
from heron.ops.attention.paged import PagedAttentionBuilder, PagedAttentionView, PagedGraphBuffers

#: The longest uniform query (tokens per row) the decode kernel runs, a program per token: a
#: verification step of up to 7 proposals. At batch 1 the extend kernel has a program per head
#: for the whole context, several times slower (``benchmarks/batch_invariance.py``).
MAX_DECODE_QUERIES = 8


@dataclass(frozen=True)
class DecodeWorkspace:
    """Split-KV partitioning of a step the decode kernel runs and the buffers its merge needs
    (None with one split): one query token per row, or ``queries_per_row`` of a uniform step.
    The tickets are all zero between launches: each launch leaves them so."""

    num_splits: int
    partial_out: torch.Tensor | None  # [rows, heads, splits, head_dim] fp32
    partial_lse: torch.Tensor | None  # [rows, heads, splits] fp32
    tickets: torch.Tensor | None  # int32, tickets_needed(rows, kv_heads, num_splits)
    queries_per_row: int = 1


_SINGLE_SPLIT = DecodeWorkspace(1, None, None, None)


@dataclass(frozen=True)
class LeadingDecodeRows:
    """A mixed step's first ``rows`` requests, which have one new token each (the running
    requests' decodes before the prefills), for the decode kernel: the extend kernel would give
    each a program per query head and a 64-query tile in a grid as long as the step's longest
    query, where the decode kernel gives it a program per KV head."""

    rows: int
    decode: DecodeWorkspace


def decode_queries(seq: SequenceMetadata) -> int | None:
    """Query tokens per row when the decode kernel runs the step: 1 for decode, ``q`` for a
    uniform step of up to ``MAX_DECODE_QUERIES`` new tokens a row (verification, a draft's
    ingest), whose tokens it runs as rows of their own; None for the extend kernel."""
    if seq.is_decode:
        return 1
    q = seq.max_query_len
    uniform = seq.num_tokens == seq.num_reqs * q
    return q if uniform and q <= MAX_DECODE_QUERIES else None


@dataclass(frozen=True)
class TritonGraphBuffers:
    paged: PagedGraphBuffers
    partial_out: torch.Tensor  # flat, sized for the bucket with the most requests * splits
    partial_lse: torch.Tensor
    tickets: torch.Tensor  # int32, enough for any bucket; zeroed once (launches leave it zero)


class TritonAttentionBuilder(PagedAttentionBuilder):
    """The paged view plus the decode workspace; the head layout is part of the key because
    the workspace's shape depends on it.

    Split counts depend only on the batch (eager steps also use the step's longest context),
    never on values that change between graph replays: each split finds its key range from
    the request's length inside the kernel, so a replay needs no host-side recomputation.

    The split decode kernel merges its splits in the same launch, counting finished splits
    with tickets that must be zero before a launch and that every launch leaves zero. They are
    zeroed once (never per step: that would be one more launch): graph steps use the graph
    buffers' tickets, eager steps a builder-owned buffer, replaced by a bigger zeroed one when
    a step needs more. All layers of a group share them, which is safe because they run one
    after another on one stream: a launch finishes before the next starts.
    """

    # Uniform steps of several tokens per row (verification) replay too: the extend kernel
    # reads only device metadata, and its grid (rows, query length) is the graph's.
    graph_support = GraphSupport.UNIFORM

    def __init__(self, spec: AttentionSpec, block_size: int, max_model_len: int) -> None:
        # (its kernels read lengths on the device; split counts take the step's longest
        # context as a bound only)
        super().__init__(
            "triton", block_size, spec.sliding_window, max_model_len, lengths_on_device=True
        )
        self.spec = spec
        self.max_model_len = max_model_len
        self._eager_tickets: torch.Tensor | None = None

    @property
    def key(self) -> Hashable:
        s = self.spec
        return (*super().key, s.num_heads, s.num_kv_heads, s.head_dim)

    def _splits(self, batch: int, max_kv_len: int, device: torch.device) -> int:
        return choose_num_splits(
            batch,
            self.spec.num_kv_heads,
            max_kv_len,
            multiprocessor_count(device),
            self.sliding_window,
        )

    def _workspace(
        self,
        rows: int,
        splits: int,
        out: torch.Tensor | None,
        lse: torch.Tensor | None,
        tickets: torch.Tensor | None,
        queries: int,
    ) -> DecodeWorkspace:
        """Views of the flat ``out``/``lse``/``tickets`` buffers (unused with one split) for
        ``rows`` query tokens, ``queries`` a request, and ``splits``."""
        if splits == 1:
            return DecodeWorkspace(1, None, None, None, queries)
        h, d = self.spec.num_heads, self.spec.head_dim
        return DecodeWorkspace(
            splits,
            out[: rows * h * splits * d].view(rows, h, splits, d),
            lse[: rows * h * splits].view(rows, h, splits),
            tickets[: tickets_needed(rows, self.spec.num_kv_heads, splits)],
            queries,
        )

    def _tickets(self, batch: int, splits: int, device: torch.device) -> torch.Tensor:
        """The eager steps' zeroed tickets, for at least ``batch`` requests in ``splits``. A
        bigger step gets a new zeroed buffer (a power of two, so this happens a few times at
        most); the old one is freed in stream order, after the launches that used it."""
        count = tickets_needed(batch, self.spec.num_kv_heads, splits)
        if self._eager_tickets is None or self._eager_tickets.numel() < count:
            size = triton.next_power_of_2(count)
            self._eager_tickets = torch.zeros(size, dtype=torch.int32, device=device)
        return self._eager_tickets

    def build(self, seq: SequenceMetadata) -> PagedAttentionView:
        view = super().build(seq)
        if seq.key_limits is not None:
            return view  # every row to the extend kernel, the only one that reads key limits
        device = seq.kv_lens.device
        queries = decode_queries(seq)
        if queries is not None:
            workspace = self._eager_workspace(seq.num_tokens, seq.max_kv_len, queries, device)
            return dataclasses.replace(view, workspace=workspace)
        rows = int(np.argmax(seq.query_lens_host != 1))  # (some row has more than one)
        if rows == 0:
            return view
        workspace = self._eager_workspace(rows, int(seq.kv_lens_host[:rows].max()), 1, device)
        return dataclasses.replace(view, workspace=LeadingDecodeRows(rows, workspace))

    def _eager_workspace(
        self, rows: int, max_kv_len: int, queries: int, device: torch.device
    ) -> DecodeWorkspace:
        """A decode workspace of ``rows`` query tokens for an eager step."""
        splits = self._splits(rows, max_kv_len, device)
        out = lse = tickets = None
        if splits > 1:
            partials = rows * self.spec.num_heads * splits
            out = torch.empty(partials * self.spec.head_dim, dtype=torch.float32, device=device)
            lse = torch.empty(partials, dtype=torch.float32, device=device)
            tickets = self._tickets(rows, splits, device)
        return self._workspace(rows, splits, out, lse, tickets, queries)

    def make_graph_buffers(
        self, max_batch: int, device: torch.device, max_query_len: int = 1
    ) -> TritonGraphBuffers:
        # Fewer query rows leave more of the GPU to each one, so small batches split the
        # most; the workspace holds the largest rows * splits of any batch up to max_batch
        # (rows: its tokens, for uniform steps of up to max_query_len tokens a request).
        max_rows = max_batch * min(max_query_len, MAX_DECODE_QUERIES)
        splits = [self._splits(t, self.max_model_len, device) for t in range(1, max_rows + 1)]
        per_head = max((t * s for t, s in enumerate(splits, 1) if s > 1), default=0)
        rows = per_head * self.spec.num_heads
        kv_heads = self.spec.num_kv_heads
        tickets = max(tickets_needed(t, kv_heads, s) for t, s in enumerate(splits, 1))
        return TritonGraphBuffers(
            paged=super().make_graph_buffers(max_batch, device, max_query_len),
            partial_out=torch.empty(rows * self.spec.head_dim, dtype=torch.float32, device=device),
            partial_lse=torch.empty(rows, dtype=torch.float32, device=device),
            tickets=torch.zeros(tickets, dtype=torch.int32, device=device),
        )

    def fill(self, seq: SequenceMetadata, buffers: TritonGraphBuffers, batch: int) -> None:
        super().fill(seq, buffers.paged, batch)

    def graph_view(
        self, seq: SequenceMetadata, buffers: TritonGraphBuffers, batch: int
    ) -> PagedAttentionView:
        view = super().graph_view(seq, buffers.paged, batch)
        queries = decode_queries(seq)
        if queries is None:
            return view
        rows = batch * queries
        splits = self._splits(rows, self.max_model_len, seq.kv_lens.device)
        workspace = self._workspace(
            rows, splits, buffers.partial_out, buffers.partial_lse, buffers.tickets, queries
        )
        return dataclasses.replace(view, workspace=workspace)


def _norm_form(norm: nn.Module | None) -> tuple[float, bool, float] | None:
    """``(weight_offset, scale_in_fp32, eps)`` of an RMS norm that declares the form the fused
    pre-write computes (``heron.layers.norm.RMSNorm`` and ``GemmaRMSNorm`` do), else None."""
    offset = getattr(norm, "weight_offset", None)
    in_fp32 = getattr(norm, "scale_in_fp32", None)
    if not isinstance(offset, float) or not isinstance(in_fp32, bool):
        return None
    return offset, in_fp32, norm.eps


class TritonAttention(AttentionOperator):
    """Paged attention with Triton kernels: a fused qk-norm + RoPE + KV-store pre-write, a
    split-KV decode kernel (query heads of one KV head packed per program) and a varlen extend
    kernel reading the paged cache directly. Soft-capping and sinks are constexpr flags of the
    attention kernels; the qk-norm's form (Llama's ``w * norm(x)`` or Gemma's
    ``(1 + w) * norm(x)``) is one of the pre-write."""

    @classmethod
    def covers(cls, spec: AttentionSpec, qk_transform: QKTransform | None) -> bool:
        # Soft-caps and sinks are always covered; a q/k norm must be a pair of RMS norms of
        # one declared form (see RMSNorm.weight_offset), which the pre-write reproduces.
        if qk_transform is None or (qk_transform.q_norm is None and qk_transform.k_norm is None):
            return True
        form = _norm_form(qk_transform.q_norm)
        return form is not None and form == _norm_form(qk_transform.k_norm)

    def make_builder(
        self, spec: AttentionSpec, block_size: int, max_model_len: int
    ) -> TritonAttentionBuilder:
        return TritonAttentionBuilder(spec, block_size, max_model_len)

    def prepare_qkv(self, qkv: torch.Tensor, view: PagedAttentionView) -> torch.Tensor:
        s, t = self.spec, self.qk_transform
        if t is None:
            q, k, v = self.split_qkv(qkv)
            kv_write(
                k,
                v,
                self.kv_cache,
                view.slot_mapping,
                start_next=view.is_decode,
                k_scale=self.k_scale,
                v_scale=self.v_scale,
            )
            return q
        q_norm = t.q_norm.weight if t.q_norm is not None else None
        k_norm = t.k_norm.weight if t.k_norm is not None else None
        offset, in_fp32, eps = _norm_form(t.q_norm) if t.q_norm is not None else (0.0, False, 0.0)
        return qk_norm_rope_kv_write(
            qkv,
            view.positions,
            t.rotary.cos,
            t.rotary.sin,
            q_norm,
            k_norm,
            eps,
            self.kv_cache,
            view.slot_mapping,
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            norm_weight_offset=offset,
            norm_scale_in_fp32=in_fp32,
            # The decode kernel loads its first cached keys while this one runs.
            start_next=view.is_decode,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )

    def forward_decode(self, q: torch.Tensor, view: PagedAttentionView) -> torch.Tensor:
        # A view without a workspace (the compatibility fallback's) runs one split.
        return self._decode(q, torch.empty_like(q), view, view.workspace or _SINGLE_SPLIT)

    def forward_extend(self, q: torch.Tensor, view: PagedAttentionView) -> torch.Tensor:
        ws = view.workspace
        if isinstance(ws, DecodeWorkspace):  # a uniform step of few tokens a row
            return self.forward_decode(q, view)
        out = torch.empty_like(q)
        first = 0 if ws is None else ws.rows  # the leading one-token rows: the decode kernel's
        if first:
            self._decode(q[:first], out[:first], view, ws.decode, rows=first)
        return paged_extend_attention(
            q,
            self.kv_cache,
            view.block_tables[first:],
            view.table_starts[first:],
            view.query_start_loc[first:],
            view.kv_lens[first:],
            view.max_query_len,
            self.spec.scale,
            view.sliding_window,
            out,
            softcap=self.spec.logit_softcap,
            sinks=self.sinks,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            key_limits=view.key_limits,
        )

    def _decode(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        view: PagedAttentionView,
        ws: DecodeWorkspace,
        rows: int | None = None,
    ) -> torch.Tensor:
        """The decode kernel over the view's requests (its first ``rows``, if given)."""
        tables, starts, lens = view.block_tables, view.table_starts, view.kv_lens
        if rows is not None:
            tables, starts, lens = tables[:rows], starts[:rows], lens[:rows]
        return paged_decode_attention(
            q,
            self.kv_cache,
            tables,
            starts,
            lens,
            self.spec.scale,
            view.sliding_window,
            out,
            ws.num_splits,
            ws.partial_out,
            ws.partial_lse,
            ws.tickets,
            softcap=self.spec.logit_softcap,
            sinks=self.sinks,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            queries_per_row=ws.queries_per_row,
        )
