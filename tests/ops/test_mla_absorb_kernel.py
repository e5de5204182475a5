"""The one-launch query absorption of MLA decode (heron.kernels.mla_absorb) against the
operator's PyTorch form (the batched product with ``W_UK`` and the concatenation, which the
DeepSeek parity tests hold to HF): ``W_UK`` as the strided view of ``kv_b_proj``'s weight the
operator reads, sizes that do not fill the tiles (Triton interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from triton_lowering import check_lowering

from heron.kernels.mla_absorb import mla_absorb_query

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def absorb_inputs(tokens, heads, nope, rope, v_dim, lora, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, nope + rope, generator=g).to(dtype).to(DEVICE)
    kv_b = torch.randn(heads * (nope + v_dim), lora, generator=g).to(dtype).to(DEVICE)
    w_uk = kv_b.view(heads, nope + v_dim, lora)[:, :nope]
    q_nope, q_rope = q.split([nope, rope], dim=-1)
    return q_nope, q_rope, w_uk


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_absorption_equals_the_batched_product(tokens, dtype):
    q_nope, q_rope, w_uk = absorb_inputs(tokens, 3, 24, 8, 16, 40, dtype)
    want = torch.cat([torch.einsum("thn,hnl->thl", q_nope.float(), w_uk.float()), q_rope], -1)
    got = mla_absorb_query(q_nope, q_rope, w_uk)
    assert got.dtype == dtype and got.shape == (tokens, 3, 48)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(got[..., 40:], q_rope)  # the rotary part is copied as it is


def test_absorption_refuses_mismatched_heads():
    q_nope, q_rope, w_uk = absorb_inputs(1, 3, 24, 8, 16, 40)
    with pytest.raises(ValueError, match="w_uk"):
        mla_absorb_query(q_nope, q_rope, w_uk[:2])


def absorb_launches() -> None:
    """DeepSeek-V2-Lite's and V3's heads at decode, for the lowering test."""
    for heads in (16, 128):
        mla_absorb_query(*absorb_inputs(4, heads, 128, 64, 128, 512, torch.bfloat16))


def test_absorption_launches_lower_for_hopper():
    kernel = "heron.kernels.mla_absorb:_absorb_kernel"
    assert check_lowering("ops.test_mla_absorb_kernel:absorb_launches", kernel) >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16])
def test_bf16_absorption_on_cuda_at_deepseek_shapes(tokens):
    """DeepSeek-V2-Lite's heads in bf16 against the fp32 product of the same values."""
    q_nope, q_rope, w_uk = absorb_inputs(tokens, 16, 128, 64, 128, 512, torch.bfloat16)
    want = torch.einsum("thn,hnl->thl", q_nope.float(), w_uk.float())
    got = mla_absorb_query(q_nope, q_rope, w_uk)
    torch.testing.assert_close(got[..., :512].float(), want, rtol=1e-2, atol=5e-2)
    assert torch.equal(got[..., 512:], q_rope)
