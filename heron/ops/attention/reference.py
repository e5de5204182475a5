"""Reference paged attention in plain PyTorch: any device, every feature, readable first."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heron.layers.fp8 import FP8, to_fp8
from heron.ops.attention.base import AttentionOperator, AttentionSpec
from heron.ops.attention.paged import PagedAttentionBuilder, PagedAttentionView


class ReferenceAttention(AttentionOperator):
    """Paged attention written with torch ops; the default on CPU and the kernels' reference.

    Decode gathers each request's blocks into a padded dense tensor and masks by length, with
    no host synchronisation (so it can be captured in a graph). Extend loops over requests and
    calls SDPA with a causal mask offset by the request's KV history (or by the view's key
    limits, where tokens see past themselves).
    """

    def make_builder(
        self, spec: AttentionSpec, block_size: int, max_model_len: int
    ) -> PagedAttentionBuilder:
        # (extend reads the KV lengths from the device, the query lengths, which a row moved
        # back keeps, from the host)
        return PagedAttentionBuilder(
            "reference", block_size, spec.sliding_window, max_model_len, lengths_on_device=True
        )

    def prepare_qkv(self, qkv: torch.Tensor, view: PagedAttentionView) -> torch.Tensor:
        q, k, v = self.split_qkv(qkv)
        if self.qk_transform is not None:
            q, k = self.qk_transform(view.positions[: qkv.shape[0]], q, k)
        self.write_kv(k, v, view)
        return q

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, view: PagedAttentionView) -> None:
        _, num_blocks, block_size, kv_heads, head_dim = self.kv_cache.shape
        slots = view.slot_mapping.long()
        n = k.shape[0]
        if self.kv_cache.dtype == FP8:
            k, v = to_fp8(k / self.k_scale), to_fp8(v / self.v_scale)
        self.kv_cache[0].view(-1, kv_heads, head_dim)[slots[:n]] = k.to(self.kv_cache.dtype)
        self.kv_cache[1].view(-1, kv_heads, head_dim)[slots[:n]] = v.to(self.kv_cache.dtype)

    def _gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks as [..., blocks * block_size, kv_heads, head_dim] (an
        FP8 cache's dequantised to fp32)."""
        k = self.kv_cache[0][block_tables.long()]
        v = self.kv_cache[1][block_tables.long()]
        if self.kv_cache.dtype == FP8:
            k, v = k.float() * self.k_scale, v.float() * self.v_scale
        shape = (*block_tables.shape[:-1], -1, *k.shape[-2:])
        return k.reshape(shape), v.reshape(shape)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """Softmax attention in fp32 with soft-capping and sinks.

        q: [n, kv_heads, group, queries, D]; k, v: [n, keys, kv_heads, D];
        visible: [n, queries, keys] -> [n, kv_heads, group, queries, D].
        """
        spec = self.spec
        scores = torch.einsum("nhgqd,nlhd->nhgql", q.float(), k.float()) * spec.scale
        if spec.logit_softcap is not None:
            scores = spec.logit_softcap * torch.tanh(scores / spec.logit_softcap)
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
        if self.sinks is not None:
            sink = self.sinks.float().view(1, spec.num_kv_heads, -1, 1, 1)
            scores = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
        # Padded rows see no key at all; give them zeros instead of NaNs.
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        if self.sinks is not None:
            probs = probs[..., :-1]
        return torch.einsum("nhgql,nlhd->nhgqd", probs, v.float())

    def forward_decode(self, q: torch.Tensor, view: PagedAttentionView) -> torch.Tensor:
        spec = self.spec
        k, v = self._gather(view.block_tables)  # [reqs, L, kv_heads, D]
        kv_lens = view.kv_lens[:, None]
        # Each row's table starts at the block its metadata names (0 without a window).
        first = view.table_starts[:, None] * view.block_size
        positions = torch.arange(k.shape[1], device=q.device)[None, :] + first
        visible = positions < kv_lens
        if view.sliding_window is not None:
            visible &= positions > kv_lens - 1 - view.sliding_window
        qg = q.view(-1, spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, 1, spec.head_dim)
        out = self._attend(qg, k, v, visible[:, None, :])
        return out.reshape(q.shape).to(q.dtype)

    def forward_extend(self, q: torch.Tensor, view: PagedAttentionView) -> torch.Tensor:
        spec = self.spec
        plain = spec.logit_softcap is None and self.sinks is None
        out = torch.empty_like(q)
        # Slices below need host ints: the device's lengths (a step may have been moved back
        # there), read once.
        table_starts, kv_lens = torch.stack([view.table_starts, view.kv_lens]).tolist()
        for i in range(view.num_reqs):
            q_start, q_len = int(view.query_start_host[i]), int(view.query_lens_host[i])
            kv_len, bs, first = kv_lens[i], view.block_size, table_starts[i]
            k, v = self._gather(view.block_tables[i, : -(-kv_len // bs) - first])
            k, v = k[: kv_len - first * bs], v[: kv_len - first * bs]
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
            k_pos = torch.arange(first * bs, kv_len, device=q.device)[None, :]
            limits = q_pos
            if view.key_limits is not None:
                limits = view.key_limits[q_start : q_start + q_len, None]
            mask = k_pos <= limits
            if view.sliding_window is not None:
                mask &= k_pos > q_pos - view.sliding_window
            qi = q[q_start : q_start + q_len]
            if plain:  # SDPA's fused kernels are much faster on long CPU prompts
                attn = F.scaled_dot_product_attention(
                    qi.transpose(0, 1).float(),
                    k.transpose(0, 1).float(),
                    v.transpose(0, 1).float(),
                    attn_mask=mask,
                    scale=spec.scale,
                    enable_gqa=True,
                ).transpose(0, 1)
            else:
                group = spec.num_heads // spec.num_kv_heads
                qg = qi.view(q_len, spec.num_kv_heads, group, spec.head_dim).permute(1, 2, 0, 3)
                attn = self._attend(qg[None], k[None], v[None], mask[None])[0]
                attn = attn.permute(2, 0, 1, 3).reshape(q_len, spec.num_heads, spec.head_dim)
            out[q_start : q_start + q_len] = attn.to(q.dtype)
        return out
