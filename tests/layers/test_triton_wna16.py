"""The packed-integer-weight kernels under the interpreter against dequantise-then-matmul in
fp32 (GEMV and GEMM, 4 and 8 bits, groups and channels, zero points or symmetric, ragged
shapes), and their lowering for sm_90."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_lowering import check_lowering

from heron.kernels.wna16 import GEMV_MAX_M, wna16_linear
from heron.layers.wna16 import dequantize, quantize

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _case(m, n, k, bits, group, zeros, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qweight, scales, qzeros = quantize(torch.randn(n, k, generator=g), bits, group, zeros)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, qweight, scales, qzeros, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m, n, k, bits, group, zeros",
    [
        (1, 24, 96, 4, 32, True),  # ragged column block, a K tail in the tile
        (3, 64, 128, 4, 64, False),
        (GEMV_MAX_M, 40, 64, 8, None, True),  # per channel, 8 bits
        (GEMV_MAX_M + 1, 48, 160, 4, 32, True),  # the GEMM: ragged rows and columns
        (20, 32, 256, 8, 128, False),
        (17, 16, 72, 4, None, True),  # K of no power of two, per channel
        (2, 16, 512, 4, 256, False),  # groups wider than a tile
        (GEMV_MAX_M + 3, 24, 512, 4, 256, True),
    ],
)
def test_matches_dequantised_fp32_matmul(dtype, m, n, k, bits, group, zeros):
    x, qweight, scales, qzeros, bias = _case(m, n, k, bits, group, zeros, dtype)
    w = dequantize(qweight, scales, qzeros, bits, group)
    for b in (None, bias):
        y = wna16_linear(x, qweight, scales, qzeros, bits, group, b)
        ref = F.linear(x.float(), w, None if b is None else b.float())
        assert y.dtype == dtype and y.shape == (m, n)
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < TOL[dtype], err


ACTS = {
    "silu": F.silu,
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
    "sigmoid": torch.sigmoid,
}


def _gated(act: str, gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``act(gate) * up`` as an unfused activation kernel stores it in ``dtype``."""
    return (ACTS[act](gate.float()).to(dtype).float() * up.float()).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("m, bits, group, zeros", [(1, 4, 32, True), (GEMV_MAX_M, 8, None, False)])
def test_fused_gated_activations_match_the_unfused_products(dtype, act, m, bits, group, zeros):
    """The GEMV applies a gated activation to its input as it loads it (from ``[gate | up]``
    or from two tensors), or to its ``[gate | up]`` output rows, as the unfused kernels
    would: the activation rounded to the input's dtype first."""
    n, k = 24, 96
    x, qweight, scales, qzeros, _ = _case(m, n, 2 * k, bits, group, zeros, dtype)
    qweight, scales = qweight[:, : qweight.shape[1] // 2], scales[:, : -(-k // (group or k))]
    qweight, scales = qweight.contiguous(), scales.contiguous()
    qzeros = None if qzeros is None else qzeros[:, : scales.shape[1]].contiguous()
    w = dequantize(qweight, scales, qzeros, bits, group)
    gate, up = x.chunk(2, dim=1)
    want = F.linear(_gated(act, gate, up, dtype).float(), w)
    for got in (
        wna16_linear(x, qweight, scales, qzeros, bits, group, act=act),
        wna16_linear(gate, qweight, scales, qzeros, bits, group, act=act, up=up),
    ):
        assert got.shape == (m, n)
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < TOL[dtype], err
    # The output side: W's rows as [gate | up].
    products = F.linear(gate.float(), w).to(dtype)
    want = _gated(act, products[:, : n // 2], products[:, n // 2 :], dtype).float()
    got = wna16_linear(gate, qweight, scales, qzeros, bits, group, gated_out=act)
    assert got.shape == (m, n // 2)
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < 4 * TOL[dtype], err


def test_fused_activations_are_refused_beyond_the_gemv():
    x, qweight, scales, qzeros, bias = _case(GEMV_MAX_M + 1, 16, 64, 4, 32, True, torch.float32)
    with pytest.raises(ValueError, match="fused activation"):
        wna16_linear(x, qweight, scales, qzeros, 4, 32, gated_out="silu")
    with pytest.raises(ValueError, match="fused activation"):
        wna16_linear(x[:1], qweight, scales, qzeros, 4, 32, bias, gated_out="silu")


def test_bad_shapes_are_refused():
    x, qweight, scales, qzeros, _ = _case(2, 16, 64, 4, 32, True, torch.float32)
    with pytest.raises(ValueError, match="qweight"):
        wna16_linear(x[:, :32], qweight, scales, qzeros, 4, 32)
    with pytest.raises(ValueError, match="scales"):
        wna16_linear(x, qweight, scales[:, :1], qzeros, 4, 32)


def wna16_launches() -> None:
    """Decode and prefill launches of the 8B shapes in bf16 (for the lowering test)."""
    for n, k in [(6144, 4096), (4096, 12288)]:
        for bits, group, zeros in [(4, 128, True), (8, 32, False)]:  # a group a tile, and 4
            qweight = torch.empty(n, k * bits // 32, dtype=torch.int32)
            scales = torch.empty(n, k // group, dtype=torch.float16)
            qzeros = torch.empty(n, k // group, dtype=torch.uint8) if zeros else None
            for m in (1, 64):
                x = torch.empty(m, k, dtype=torch.bfloat16)
                wna16_linear(x, qweight, scales, qzeros, bits, group)
            x = torch.empty(1, 2 * k, dtype=torch.bfloat16)
            wna16_linear(x, qweight, scales, qzeros, bits, group, act="silu")
            wna16_linear(x[:, :k], qweight, scales, qzeros, bits, group, gated_out="silu")


def test_kernels_lower_for_sm90():
    assert check_lowering(
        "layers.test_triton_wna16:wna16_launches",
        "heron.kernels.wna16:_wna16_gemv_kernel",
        "heron.kernels.wna16:_wna16_gemm_kernel",
    )


# The Qwen3-8B shapes (n, k): qkv, o, gate_up, down.
GPU_SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", GPU_SHAPES)
def test_gpu_bf16_shapes_of_an_8b_model(n, k):
    for bits, group, zeros in [(4, 128, True), (4, 32, False), (8, 128, False), (4, None, True)]:
        x, qweight, scales, qzeros, bias = _case(64, n, k, bits, group, zeros, torch.bfloat16)
        packed = [t.cuda() if t is not None else None for t in (qweight, scales, qzeros)]
        w = dequantize(qweight, scales, qzeros, bits, group)
        for m in (1, 4, GEMV_MAX_M, 64):
            y = wna16_linear(x[:m].cuda(), *packed, bits, group, bias.cuda())
            ref = F.linear(x[:m].float(), w, bias.float())
            err = ((y.float().cpu() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, (bits, group, zeros, m, err)
