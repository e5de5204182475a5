"""The Triton MLA extend kernel, with weight absorption around it, against dense fp32 causal
attention over decompressed keys and values (no absorption), on shuffled, NaN-filled latent
caches: prefill rows, chunks over a history, decode rows of a mixed step and a padded row in
one launch. Small cases run under the interpreter; ``gpu`` cases use DeepSeek's shapes in
bf16."""

from __future__ import annotations

import pytest
import torch
from ops.mla_cases import DEVICE, dense_reference, latent_cache
from triton_lowering import check_lowering

from heron.kernels.mla_extend import mla_extend_attention

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def run_case(q_lens, kv_lens, heads, lora, rope, nope, v_dim, dtype, block_size=16):
    """(kernel output, reference) ``[tokens, heads, v_dim]``, the reference on ``DEVICE``."""
    gen = torch.Generator().manual_seed(1)
    cache, tables, dense = latent_cache(kv_lens, block_size, lora + rope, dtype)
    tokens = sum(q_lens)
    w_uk = (torch.randn(heads, nope, lora, generator=gen) / lora**0.5).to(DEVICE)
    w_uv = (torch.randn(heads, v_dim, lora, generator=gen) / lora**0.5).to(DEVICE)
    q_nope = torch.randn(tokens, heads, nope, generator=gen).to(DEVICE)
    q_rope = torch.randn(tokens, heads, rope, generator=gen).to(DEVICE)
    scale = (nope + rope) ** -0.5
    want = dense_reference(q_nope, q_rope, dense, q_lens, w_uk, w_uv, scale)
    # Absorbed: the query in latent space, the kernel over the cache, W_UV after.
    q = torch.cat([torch.einsum("thn,hnl->thl", q_nope, w_uk), q_rope], -1).to(dtype)
    starts = torch.tensor([0, *q_lens], device=DEVICE).cumsum(0).to(torch.int32)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    out = torch.empty(tokens, heads, lora, dtype=dtype, device=DEVICE)
    mla_extend_attention(q, cache, tables, starts, lens, scale, out)
    return torch.einsum("thl,hvl->thv", out.float(), w_uv), want


@pytest.mark.parametrize("heads", [5, 40])
def test_extend_equals_dense_attention(heads):
    # A chunk over a 32-token history, a decode row, a fresh prefill of several token tiles,
    # a padded row (no tokens), a short chunk over a history of several key tiles. 5 heads
    # make one head tile of 8 (4 tokens per tile), 40 two tiles of 32, the second one masked.
    q_lens, kv_lens = [5, 1, 12, 0, 3], [37, 20, 12, 0, 70]
    got, want = run_case(q_lens, kv_lens, heads, lora=32, rope=8, nope=16, v_dim=12,
                         dtype=torch.float32)  # fmt: skip
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def mla_extend_launches() -> None:
    """bf16 launches at DeepSeek's latent shape: V2's 16 heads (two tokens per tile) and V3's
    128 (32 heads per tile)."""
    bf16 = torch.bfloat16
    cache = torch.empty(8, 64, 576, dtype=bf16)
    tables = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    starts = torch.arange(3, dtype=torch.int32)
    for heads in (16, 128):
        q = torch.empty(2, heads, 576, dtype=bf16)
        out = torch.empty(2, heads, 512, dtype=bf16)
        mla_extend_attention(q, cache, tables, starts, lens, 0.1, out)


def test_mla_extend_launches_lower_for_hopper():
    assert (
        check_lowering(
            "ops.test_mla_extend_kernel:mla_extend_launches",
            "heron.kernels.mla_extend:_mla_extend_kernel",
        )
        == 2
    )


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_extend_bf16_deepseek_shape(heads):
    q_lens, kv_lens = [1, 300, 512, 3, 0, 1], [4096, 1000, 512, 3, 0, 77]
    got, want = run_case(q_lens, kv_lens, heads, lora=512, rope=64, nope=128, v_dim=128,
                         dtype=torch.bfloat16, block_size=64)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
