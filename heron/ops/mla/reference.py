"""Reference latent attention in plain PyTorch: the CPU default and the kernels' reference."""

from __future__ import annotations

import torch

from heron.ops.attention.paged import PagedAttentionView
from heron.ops.mla.base import LatentAttentionBuilder, MLAOperator


class ReferenceMLA(MLAOperator):
    """Decode gathers every request's cached entries into a padded dense tensor and masks by
    length, in fp32 and with no host synchronisation (so it can be captured in a graph)."""

    def make_builder(self, block_size: int, max_model_len: int) -> LatentAttentionBuilder:
        return LatentAttentionBuilder("reference", block_size, max_model_len)

    def attend_latent(self, q: torch.Tensor, view: PagedAttentionView) -> torch.Tensor:
        return dense_latent_attention(
            q,
            self.kv_cache,
            view.block_tables,
            view.kv_lens,
            self.spec.kv_lora_rank,
            self.spec.scale,
        )


def dense_latent_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """``q [reqs, heads, entry]`` over the paged ``cache [blocks, block_size, entry]`` ->
    ``[reqs, heads, kv_lora_rank]`` in fp32; a row of length 0 gives zeros."""
    entries = cache[block_tables.long()].flatten(1, 2).float()  # [reqs, keys, entry]
    scores = torch.einsum("rhd,rkd->rhk", q.float(), entries) * scale
    visible = torch.arange(entries.shape[1], device=q.device)[None, :] < kv_lens[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    # Masked keys may hold anything (NaN in tests); keep them out of the product.
    values = entries[..., :kv_lora_rank].masked_fill(~visible[..., None], 0.0)
    return torch.einsum("rhk,rkl->rhl", probs, values)
