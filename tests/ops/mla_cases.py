"""Shared inputs and the dense reference of the MLA kernel tests: shuffled, NaN-filled latent
caches and attention over keys and values decompressed in fp32 (no weight absorption)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def latent_cache(kv_lens, block_size, entry, dtype, seed=0):
    """A NaN-filled ``[blocks, block_size, entry]`` cache holding random entries for each
    request in shuffled blocks (0 reserved); the block tables and each request's fp32 entries."""
    gen = torch.Generator().manual_seed(seed)
    per_req = [-(-n // block_size) for n in kv_lens]
    num_blocks = 1 + sum(per_req) + 2
    cache = torch.full((num_blocks, block_size, entry), float("nan"))
    tables = torch.zeros(len(kv_lens), max(per_req + [1]) + 1, dtype=torch.int32)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    dense = []
    for r, n in enumerate(kv_lens):
        values = torch.randn(n, entry, generator=gen).to(dtype)
        for i in range(per_req[r]):
            block = free.pop()
            tables[r, i] = block
            rows = values[i * block_size : (i + 1) * block_size]
            cache[block, : rows.shape[0]] = rows.float()
        dense.append(values.float())
    return cache.to(dtype).to(DEVICE), tables.to(DEVICE), dense


def dense_reference(q_nope, q_rope, dense, q_lens, w_uk, w_uv, scale):
    """Request ``r`` owns the next ``q_lens[r]`` rows of ``q_nope`` / ``q_rope`` ``[T, heads,
    *]``, its last tokens; per request, keys ``[W_UK latent, rope]`` and values ``W_UV latent``
    of every head from its entries, causal SDPA in fp32 on ``w_uk``'s device ->
    ``[T, heads, v]`` (zeros for a request without entries)."""
    lora, heads, device = w_uk.shape[-1], q_nope.shape[1], w_uk.device
    out, start = [], 0
    for entries, q_len in zip(dense, q_lens):
        rows = slice(start, start + q_len)
        start += q_len
        if entries.shape[0] == 0:
            out.append(torch.zeros(q_len, heads, w_uv.shape[1], device=device))
            continue
        entries = entries.to(device)
        latent, rope = entries[:, :lora], entries[:, lora:]
        k = torch.cat([torch.einsum("kl,hnl->hkn", latent, w_uk), rope.expand(heads, -1, -1)], -1)
        v = torch.einsum("kl,hvl->hkv", latent, w_uv)
        q = torch.cat([q_nope[rows], q_rope[rows]], -1).to(device).transpose(0, 1)
        kv_len = entries.shape[0]
        positions = torch.arange(kv_len - q_len, kv_len, device=device)
        mask = torch.arange(kv_len, device=device)[None, :] <= positions[:, None]
        out.append(F.scaled_dot_product_attention(q, k, v, mask, scale=scale).transpose(0, 1))
    return torch.cat(out)
