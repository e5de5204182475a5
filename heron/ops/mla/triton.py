"""Triton latent attention: the MLA operator on CUDA, with a lazily planned split decode."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from heron.kernels.mla_absorb import ABSORB_KERNEL_MAX_TOKENS, mla_absorb_query
from heron.kernels.mla_decode import (
    MLADecodePlan,
    choose_max_splits,
    mla_decode_attention,
    plan_mla_decode,
)
from heron.kernels.mla_extend import mla_extend_attention
from heron.kernels.mla_rope import mla_rope_latent_write
from heron.kernels.pdl import multiprocessor_count
from heron.layers.norm import RMSNorm
from heron.layers.rotary import MLARotary
from heron.metadata import GraphSupport, SequenceMetadata, StepMetadataError
from heron.ops.attention.paged import PagedAttentionView, PagedGraphBuffers
from heron.ops.mla.base import LatentAttentionBuilder, MLAOperator, MLASpec


@dataclass(frozen=True)
class MLADecodeWorkspace:
    """A decode step's launch depth, its split plan (filled on the device by the step's first
    latent layer, then shared by the others), the partial buffers of the merge, and the query
    tokens per request (``1 + k`` in a verification step)."""

    max_splits: int
    plan: MLADecodePlan  # per request
    partial_out: torch.Tensor | None  # [tokens, heads, max_splits, lora] fp32
    partial_lse: torch.Tensor | None  # [tokens, heads, max_splits] fp32
    query_len: int = 1


@dataclass(frozen=True)
class MLAGraphBuffers:
    paged: PagedGraphBuffers
    plan: MLADecodePlan  # [max_batch] tensors, shared by every bucket's view
    partial_out: torch.Tensor  # flat, sized for the bucket with the most tokens * splits
    partial_lse: torch.Tensor


class TritonMLABuilder(LatentAttentionBuilder):
    """The paged view plus the decode workspace.

    The split plan is the lazily initialised metadata of a FlashMLA-style kernel: it depends on
    the step's KV lengths, which only the device knows once a graph replays, so the first
    latent layer of a step computes it on the device and marks it ready for the later layers.
    A captured graph must contain that computation: ``before_capture`` marks the graph
    buffers' plan not ready, so the capture records it (the warm-up before left it ready) and
    every replay plans from its own lengths.

    Uniform verification steps (``1 + k`` tokens per row) take the decode kernel too, each
    token a decode query one key longer than the one before, under the same per-request plan:
    split-KV keeps a small batch's long contexts spread over the GPU, where the extend kernel
    would give each row's few tokens one program per head tile. So they replay graphs keyed
    by (rows, query length), the split depth chosen for the graph's tokens.
    """

    graph_support = GraphSupport.UNIFORM

    def __init__(self, spec: MLASpec, block_size: int, max_model_len: int) -> None:
        super().__init__("triton", block_size, max_model_len)
        self.spec = spec
        self.max_model_len = max_model_len

    @property
    def key(self) -> Hashable:
        s = self.spec
        return (*super().key, s.num_heads, s.kv_lora_rank, s.rope_dim)

    def _max_splits(self, batch: int, max_kv_len: int, device: torch.device) -> int:
        return choose_max_splits(
            batch, self.spec.num_heads, max_kv_len, multiprocessor_count(device)
        )

    def _workspace(
        self,
        tokens: int,
        splits: int,
        plan: MLADecodePlan,
        out: torch.Tensor,
        lse: torch.Tensor,
        query_len: int,
    ) -> MLADecodeWorkspace:
        if splits == 1:
            return MLADecodeWorkspace(1, plan, None, None, query_len)
        h, lora = self.spec.num_heads, self.spec.kv_lora_rank
        return MLADecodeWorkspace(
            splits,
            plan,
            out[: tokens * h * splits * lora].view(tokens, h, splits, lora),
            lse[: tokens * h * splits].view(tokens, h, splits),
            query_len,
        )

    @staticmethod
    def _plan(batch: int, device: torch.device) -> MLADecodePlan:
        empty = lambda: torch.empty(batch, dtype=torch.int32, device=device)
        return MLADecodePlan(empty(), empty())

    def build(self, seq: SequenceMetadata) -> PagedAttentionView:
        """A decode or uniform verification step's view holds the decode workspace; any other
        step's view has none (it runs the extend kernel)."""
        view = super().build(seq)
        if not (seq.is_decode or seq.is_uniform_verification):
            return view
        device, tokens = seq.kv_lens.device, seq.num_tokens
        splits = self._max_splits(tokens, seq.max_kv_len, device)
        rows = tokens * self.spec.num_heads * splits if splits > 1 else 0
        out = torch.empty(rows * self.spec.kv_lora_rank, dtype=torch.float32, device=device)
        lse = torch.empty(rows, dtype=torch.float32, device=device)
        plan = self._plan(seq.num_reqs, device)
        workspace = self._workspace(tokens, splits, plan, out, lse, seq.max_query_len)
        return dataclasses.replace(view, workspace=workspace)

    def make_graph_buffers(
        self, max_batch: int, device: torch.device, max_query_len: int = 1
    ) -> MLAGraphBuffers:
        # The partials hold the most tokens * splits of any graph (splits fall as tokens grow).
        most = max_batch * max_query_len
        splits = [self._max_splits(t, self.max_model_len, device) for t in range(1, most + 1)]
        rows = max((t * s for t, s in enumerate(splits, 1) if s > 1), default=0)
        rows *= self.spec.num_heads
        return MLAGraphBuffers(
            paged=super().make_graph_buffers(max_batch, device, max_query_len),
            plan=self._plan(max_batch, device),
            partial_out=torch.empty(
                rows * self.spec.kv_lora_rank, dtype=torch.float32, device=device
            ),
            partial_lse=torch.empty(rows, dtype=torch.float32, device=device),
        )

    def fill(self, seq: SequenceMetadata, buffers: MLAGraphBuffers, batch: int) -> None:
        super().fill(seq, buffers.paged, batch)

    def graph_view(
        self, seq: SequenceMetadata, buffers: MLAGraphBuffers, batch: int
    ) -> PagedAttentionView:
        view = super().graph_view(seq, buffers.paged, batch)
        q = seq.max_query_len
        splits = self._max_splits(batch * q, self.max_model_len, seq.kv_lens.device)
        workspace = self._workspace(
            batch * q, splits, buffers.plan, buffers.partial_out, buffers.partial_lse, q
        )
        return dataclasses.replace(view, workspace=workspace)

    def before_capture(self, buffers: MLAGraphBuffers) -> None:
        buffers.plan.ready = False


class TritonMLA(MLAOperator):
    """Latent attention with Triton kernels: RoPE, the latent's norm and write fused in one
    launch (for an ``MLARotary`` and a Llama-form norm; otherwise the base class's torch path
    runs), the query's absorption in one launch at decode's few tokens, and the MLA
    decode and extend kernels over the latent cache, both with the weights absorbed (see
    ``heron.kernels.mla_extend`` for why extend is too). No launch uses programmatic
    dependent launch: the attention is preceded by the query absorption, not by the kernel
    that writes what it reads."""

    def make_builder(self, block_size: int, max_model_len: int) -> TritonMLABuilder:
        return TritonMLABuilder(self.spec, block_size, max_model_len)

    def rope_and_store(
        self,
        q: torch.Tensor,
        kv_latent: torch.Tensor,
        k_rope: torch.Tensor,
        view: PagedAttentionView,
    ) -> torch.Tensor:
        norm = self.latent_norm
        fused_norm = norm is not None and type(norm) is RMSNorm  # HF Llama's form
        if not isinstance(self.rotary, MLARotary) or (norm is not None and not fused_norm):
            return super().rope_and_store(q, kv_latent, k_rope, view)
        q, tokens = q.contiguous(), q.shape[0]  # rotated in place: a copy if it is a view
        table = self.rotary.rotary
        mla_rope_latent_write(
            q,
            kv_latent,
            k_rope,
            view.positions[:tokens],
            view.slot_mapping[:tokens],
            table.cos,
            table.sin,
            self.kv_cache,
            self.spec.nope_dim,
            self.rotary.interleaved,
            norm.weight if fused_norm else None,
            norm.eps if fused_norm else 0.0,
        )
        return q

    def absorb_query(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        if q_nope.shape[0] > ABSORB_KERNEL_MAX_TOKENS:
            return super().absorb_query(q_nope, q_rope)
        return mla_absorb_query(q_nope, q_rope, self._kv_b_heads()[0])

    def decodes(self, view: PagedAttentionView) -> bool:
        # verification steps as well: the builder gave their views a decode workspace
        return view.workspace is not None

    def attend_latent(self, q: torch.Tensor, view: PagedAttentionView) -> torch.Tensor:
        ws: MLADecodeWorkspace | None = view.workspace
        if ws is None:
            raise StepMetadataError(f"layer {self.layer_name!r}: decode view without workspace")
        if not ws.plan.ready:
            plan_mla_decode(view.kv_lens, ws.max_splits, ws.plan)
            ws.plan.ready = True
        s = self.spec
        out = q.new_empty(q.shape[0], s.num_heads, s.kv_lora_rank)
        return mla_decode_attention(
            q,
            self.kv_cache,
            view.block_tables,
            view.kv_lens,
            s.scale,
            s.kv_lora_rank,
            ws.plan,
            ws.max_splits,
            out,
            ws.partial_out,
            ws.partial_lse,
            ws.query_len,
        )

    def forward_extend(self, q: torch.Tensor, view: PagedAttentionView) -> torch.Tensor:
        return self.attend_absorbed(q, view, self.extend_latent)

    def extend_latent(self, q: torch.Tensor, view: PagedAttentionView) -> torch.Tensor:
        """Extend: ``q [tokens, heads, lora + rope]`` causal over each request's cached
        entries -> the attention-weighted latents ``[tokens, heads, lora]``."""
        out = q.new_empty(q.shape[0], self.spec.num_heads, self.spec.kv_lora_rank)
        return mla_extend_attention(
            q,
            self.kv_cache,
            view.block_tables,
            view.query_start_loc,
            view.kv_lens,
            self.spec.scale,
            out,
        )
