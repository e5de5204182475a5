"""LoRALatent: the low-rank updates of MLA's ``kv_b_proj``, where the latent attention reads it."""

from __future__ import annotations

import torch

from heron.layers.linear import Linear
from heron.lora.adapter import LoRAPair
from heron.lora.config import LoRAConfig
from heron.lora.layer import LoRALinear, shrink_expand
from heron.ops.mla.base import MLASpec


class LoRALatent(LoRALinear):
    """``kv_b_proj`` (``[heads * (nope + v), lora]``, per head ``[W_UK; W_UV]``) under each
    token's adapter ``W + B A``, ``B`` per head ``[B_K; B_V]``. The operator never runs the
    layer on a batch's tokens: it decompresses a request's cached latents (:meth:`decompress`)
    or absorbs the weight, so the update is absorbed likewise, per token and head:
    the query ``q_nope W_UK`` gains ``(q_nope B_K) A`` (:meth:`absorb_query`) and the values
    ``o W_UV^T`` gain ``(o A^T) B_V^T`` (:meth:`expand_values`). The cached latents are as
    they were (the update acts after the cache; the prefix cache is keyed by adapter anyway).

    Each product is a token-indexed shrink and expand over (token, head) rows, one of its two
    tables indexed by slot and the other by (slot, head) entry ``s * heads + h``; beside the
    linear layer's tables, ``lora_bk_t`` ``[slots * heads, window, nope]`` holds each
    ``B_K^T`` and ``lora_a_t`` ``[slots, lora, window]`` each ``A^T`` (the kernels read rows
    of unit stride; ``B_V`` is a view of ``lora_b``). Under tensor parallelism ``kv_b_proj`` is
    column-parallel by heads: a rank holds its heads' rows of ``B`` and all of ``A``."""

    def __init__(self, layer_name: str, base: Linear, spec: MLASpec, config: LoRAConfig) -> None:
        super().__init__(layer_name, base, config)
        self.heads, self.nope, self.v_dim = spec.num_heads, spec.nope_dim, spec.v_head_dim
        slots, rank = config.max_loras + 1, self.window
        self.register_buffer(
            "lora_bk_t", torch.zeros(slots * self.heads, rank, self.nope), persistent=False
        )
        self.register_buffer(
            "lora_a_t", torch.zeros(slots, self.in_features, rank), persistent=False
        )

    def set_slot(self, slot: int, pairs: dict[str | None, LoRAPair]) -> None:
        super().set_slot(slot, pairs)
        b_k = self._b_heads()[slot, :, : self.nope]  # [heads, nope, rank]
        self.lora_bk_t[slot * self.heads : (slot + 1) * self.heads].copy_(b_k.transpose(1, 2))
        self.lora_a_t[slot].copy_(self.lora_a[slot].T)

    def _b_heads(self) -> torch.Tensor:
        """``lora_b`` per slot and head: ``[slots, heads, nope + v, rank]`` (a view)."""
        return self.lora_b.view(-1, self.heads, self.nope + self.v_dim, self.window)

    def _rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each (token, head) row's slot and (slot, head) entry, rows ``t * heads + h``; None
        where no token of the step uses an adapter."""
        slots = self.view.token_slots
        if slots is None:
            return None
        heads = torch.arange(self.heads, dtype=slots.dtype, device=slots.device)
        return slots.repeat_interleave(self.heads), (slots[:, None] * self.heads + heads).flatten()

    def absorb_query(self, q_nope: torch.Tensor, q: torch.Tensor) -> None:
        """Add each token's update to the latent part of its absorbed query ``q`` ``[tokens,
        heads, lora + rope]`` (contiguous; in place), from ``q_nope`` ``[tokens, heads,
        nope]``."""
        rows = self._rows()
        if rows is None:
            return
        slot_rows, head_entries = rows
        x = q_nope.reshape(-1, self.nope).to(self.lora_bk_t.dtype)
        latent = q[..., : self.in_features].view(-1, self.in_features)
        latent.copy_(  # (the kernels update it in place: a copy onto itself does nothing)
            shrink_expand(
                self.kernels, x, self.lora_bk_t, self.lora_a_t, head_entries, latent, slot_rows
            )
        )

    def expand_values(self, latent_out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``values`` ``[tokens, heads, v]`` (``W_UV``'s of ``latent_out`` ``[tokens, heads,
        lora]``, a tensor of their own) plus each token's update."""
        rows = self._rows()
        if rows is None:
            return values
        slot_rows, head_entries = rows
        x = latent_out.reshape(-1, self.in_features).to(self.lora_a.dtype)
        b_v = self._b_heads()[:, :, self.nope :].flatten(0, 1)  # [slots * heads, v, rank]
        y = values.reshape(-1, self.v_dim)
        y = shrink_expand(self.kernels, x, self.lora_a, b_v, slot_rows, y, head_entries)
        return y.view_as(values)

    def decompress(self, latent: torch.Tensor, kv: torch.Tensor, token: int) -> torch.Tensor:
        """``kv`` ``[keys, heads * (nope + v)]`` (the base decompression of a request's cached
        ``latent`` ``[keys, lora]``, fp32) plus the update under the adapter of the request's
        query token ``token``."""
        slots = self.view.token_slots
        if slots is None:
            return kv
        slot = slots[token : token + 1].long()  # (indexed on the device: no synchronisation)
        a, b = self.lora_a.index_select(0, slot)[0], self.lora_b.index_select(0, slot)[0]
        return kv + (latent @ a.float().T) @ b.float().T
