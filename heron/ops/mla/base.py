"""The multi-head latent attention (MLA) operator contract: DeepSeek-V2/V3's attention over a
paged cache of compressed latents."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from heron.cache.paged import LatentAttentionSpec
from heron.layers.norm import RMSNorm
from heron.metadata import MetadataOperator, ModelBuildContext, StepMetadataError
from heron.ops.attention.paged import PagedAttentionBuilder, PagedAttentionView


@dataclass(frozen=True)
class MLASpec:
    """The per-layer shape of latent attention. A query head has ``nope_dim + rope_dim``
    values; every head's key and value are decompressed from one ``kv_lora_rank`` latent and
    share one ``rope_dim`` rotary key."""

    num_heads: int
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_head_dim: int
    scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.nope_dim + self.rope_dim


class LatentAttentionBuilder(PagedAttentionBuilder):
    """The paged view over a latent cache group (no window). Its own class, so latent layers
    form their own metadata group, apart from any paged attention of the model."""

    def __init__(self, backend: str, block_size: int, max_model_len: int) -> None:
        super().__init__(backend, block_size, None, max_model_len)


class MLAOperator(MetadataOperator):
    """Latent attention from the layer's query and latent to its per-head values.

    ``forward(q, kv_latent, k_rope)`` takes the query ``[tokens, heads * (nope + rope)]``, the
    latent ``[tokens, kv_lora_rank]`` (rows may be strided) and the shared rotary key
    ``[tokens, rope]`` (before RoPE). It applies RoPE at the view's positions, norms the latent
    with ``latent_norm`` (the model's ``kv_a_layernorm``; none: it enters normed), stores
    ``[latent, roped key]`` at the view's slots (the cache is the only reader of the normed
    latent, so a backend may norm it in the same launch), then:

    - extend (prefill, chunks, prefix hits): here, decompresses every cached latent of the
      request through ``kv_b_proj`` into per-head keys and values and attends causally, one
      request at a time (the reference; a backend may attend absorbed, as in decode), under
      the request's LoRA adapter where ``kv_b_proj`` has one;
    - decode: absorbs ``kv_b_proj``'s key part into the query (``q_nope @ W_UK`` is a query in
      latent space), attends over the cached entries directly (:meth:`attend_latent`: one
      latent "KV head" shared by every query head), and applies the value part ``W_UV`` after.

    The model owns ``kv_b_proj`` and ``latent_norm`` (checkpoint weights); the operator only
    reads them. With LoRA, ``kv_b_proj.lora`` (``heron.lora.latent.LoRALatent``) adds each
    token's adapter's update wherever the weight is read (after the cache: the latents cached
    are unchanged by it).
    """

    def __init__(
        self,
        layer_name: str,
        spec: MLASpec,
        block_size: int,
        max_model_len: int,
        rotary: nn.Module,
        kv_b_proj: nn.Module,
        build_context: ModelBuildContext | None = None,
        latent_norm: RMSNorm | None = None,
    ) -> None:
        super().__init__(layer_name, build_context)
        self.spec = spec
        self.rotary = rotary
        self.kv_b_proj = kv_b_proj
        self.latent_norm = latent_norm
        self._cache_spec = LatentAttentionSpec(
            block_size, torch.get_default_dtype(), spec.kv_lora_rank, spec.rope_dim
        )
        self._builder = self.make_builder(block_size, max_model_len)
        self.kv_cache: torch.Tensor | None = None  # [num_blocks, block_size, lora + rope]

    @property
    def cache_spec(self) -> LatentAttentionSpec:
        return self._cache_spec

    def bind_cache(self, cache: torch.Tensor | None) -> None:
        self.kv_cache = cache

    def make_builder(self, block_size: int, max_model_len: int) -> LatentAttentionBuilder:
        raise NotImplementedError

    def metadata_builder(self) -> LatentAttentionBuilder:
        return self._builder

    def forward(
        self, q: torch.Tensor, kv_latent: torch.Tensor, k_rope: torch.Tensor
    ) -> torch.Tensor:
        """-> [tokens, heads * v_head_dim]."""
        if self.kv_cache is None:
            raise StepMetadataError(f"layer {self.layer_name!r} has no latent cache bound")
        s, view, tokens = self.spec, self.view, q.shape[0]
        q = self.rope_and_store(q.view(tokens, s.num_heads, s.qk_head_dim), kv_latent, k_rope, view)
        if self.decodes(view):
            out = self.attend_absorbed(q, view, self.attend_latent)
        else:
            out = self.forward_extend(q, view)
        return out.reshape(tokens, -1)

    def decodes(self, view: PagedAttentionView) -> bool:
        """Whether the step's queries go to :meth:`attend_latent` (else :meth:`forward_extend`)."""
        return view.is_decode

    def rope_and_store(
        self,
        q: torch.Tensor,
        kv_latent: torch.Tensor,
        k_rope: torch.Tensor,
        view: PagedAttentionView,
    ) -> torch.Tensor:
        """RoPE on ``q [tokens, heads, nope + rope]`` and the shared key, ``[latent, roped key]``
        into the cache at the view's slots; returns the roped query."""
        tokens = q.shape[0]
        if self.latent_norm is not None:
            kv_latent = self.latent_norm(kv_latent)
        q_nope, q_rope = q.split([self.spec.nope_dim, self.spec.rope_dim], dim=-1)
        q_rope, k_rope = self.rotary(view.positions[:tokens], q_rope, k_rope.view(tokens, 1, -1))
        entry = torch.cat([kv_latent, k_rope.view(tokens, -1)], dim=-1)
        self.kv_cache.view(-1, self._cache_spec.entry_size)[view.slot_mapping[:tokens].long()] = (
            entry.to(self.kv_cache.dtype)
        )
        return torch.cat([q_nope, q_rope], dim=-1)

    def _kv_b_heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj``'s weight per head: W_UK ``[heads, nope, lora]``, W_UV ``[heads, v, lora]``."""
        s = self.spec
        w = self.kv_b_proj.weight.view(s.num_heads, s.nope_dim + s.v_head_dim, s.kv_lora_rank)
        return w[:, : s.nope_dim], w[:, s.nope_dim :]

    def attend_absorbed(
        self,
        q: torch.Tensor,
        view: PagedAttentionView,
        attend: Callable[[torch.Tensor, PagedAttentionView], torch.Tensor],
    ) -> torch.Tensor:
        """``q [tokens, heads, nope + rope]`` (roped) -> ``[tokens, heads, v_head_dim]``:
        ``attend`` (absorbed query, view) over the cache as stored, between the absorption of
        ``W_UK`` into the query and ``W_UV`` on its latent output (each with its LoRA update,
        where ``kv_b_proj`` has one)."""
        q_nope, q_rope = q.split([self.spec.nope_dim, self.spec.rope_dim], dim=-1)
        lora = self.kv_b_proj.lora
        q_latent = self.absorb_query(q_nope, q_rope)
        if lora is not None:
            lora.absorb_query(q_nope, q_latent)
        latent_out = attend(q_latent, view)
        values = self.expand_values(latent_out)
        return values if lora is None else lora.expand_values(latent_out, values)

    def absorb_query(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """``[tokens, heads, lora + rope]``: the query against a cache entry as it is stored."""
        w_uk, _ = self._kv_b_heads()
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        return torch.cat([q_latent, q_rope.to(q_latent.dtype)], dim=-1)

    def expand_values(self, latent_out: torch.Tensor) -> torch.Tensor:
        """``[tokens, heads, lora] -> [tokens, heads, v_head_dim]`` through W_UV."""
        _, w_uv = self._kv_b_heads()
        return torch.einsum("thl,hvl->thv", latent_out.to(w_uv.dtype), w_uv)

    def attend_latent(self, q: torch.Tensor, view: PagedAttentionView) -> torch.Tensor:
        """Decode: ``q [tokens, heads, lora + rope]`` over each request's cached entries ->
        the attention-weighted latents ``[tokens, heads, lora]``."""
        raise NotImplementedError

    def forward_extend(self, q: torch.Tensor, view: PagedAttentionView) -> torch.Tensor:
        """``q [tokens, heads, nope + rope]`` (roped) -> ``[tokens, heads, v_head_dim]``,
        causal over each request's cached latents decompressed through ``kv_b_proj``."""
        s = self.spec
        out = q.new_empty(q.shape[0], s.num_heads, s.v_head_dim)
        for i in range(view.num_reqs):
            q_start, q_len = int(view.query_start_host[i]), int(view.query_lens_host[i])
            kv_len = int(view.kv_lens_host[i])
            blocks = view.block_tables[i, : -(-kv_len // view.block_size)].long()
            entries = self.kv_cache[blocks].view(-1, self._cache_spec.entry_size)[:kv_len]
            latent, k_rope = entries.float().split([s.kv_lora_rank, s.rope_dim], dim=-1)
            kv = latent @ self.kv_b_proj.weight.float().T
            if self.kv_b_proj.lora is not None:  # (the request's adapter: its tokens' slot)
                kv = self.kv_b_proj.lora.decompress(latent, kv, q_start)
            kv = kv.view(kv_len, s.num_heads, -1)
            k_nope, v = kv.split([s.nope_dim, s.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_rope[:, None].expand(-1, s.num_heads, -1)], dim=-1)
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
            mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos
            attn = torch.nn.functional.scaled_dot_product_attention(
                q[q_start : q_start + q_len].transpose(0, 1).float(),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                scale=s.scale,
            )
            out[q_start : q_start + q_len] = attn.transpose(0, 1).to(out.dtype)
        return out
