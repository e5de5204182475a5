"""FP8 E4M3 weights: the formats against hand-written references, and every product path (the
few-row GEMV in Triton's interpreter on the CPU, FP8 tensor cores on a GPU, the dequantising
CPU path) against dense fp32 ``F.linear`` on the dequantised weight."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from triton_lowering import check_lowering

from heron.kernels.fp8_quant import quantize_rows
from heron.kernels.gemv import GemvConfig, _launch, linear_small_m
from heron.layers.fp8 import (
    FP8,
    FP8_MAX,
    dequantize,
    quantize,
    scaled_mm,
    scaled_mm_reference,
    to_fp8,
)
from heron.layers.linear import Linear, PackedLinear
from heron.ops.selector import layer_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# One rounding of a product's inputs to fp16 (the activations) over K terms.
TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def _weight(n: int, k: int, block=None, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes: one scale per tensor would lose the small ones.
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None]
    q, s = quantize(w, block)
    return q.to(device), s.to(device)


def test_per_channel_quantisation_keeps_each_row_to_e4m3_precision():
    w = torch.randn(8, 40) * torch.logspace(-3, 2, 8)[:, None]
    w[3] = 0.0
    q, s = quantize(w)
    assert q.dtype == FP8 and s.shape == (8,) and s[3] == 1.0
    # Each row's largest magnitude lands on the format's largest value.
    assert torch.equal(q.float().abs().amax(1)[w.abs().amax(1) > 0], torch.full((7,), FP8_MAX))
    # 3 mantissa bits: half an ulp is 1/16 of the value (normals); subnormals are 2**-9 apart.
    err = (dequantize(q, s) - w).abs()
    assert (err <= w.abs() / 16 + s[:, None] * 2.0**-10).all()


def test_block_quantisation_matches_a_loop_over_tiles():
    w = torch.randn(40, 72)
    q, s = quantize(w, (16, 32))
    assert s.shape == (3, 3)
    for i in range(3):
        for j in range(3):
            tile = w[16 * i : 16 * i + 16, 32 * j : 32 * j + 32]
            assert s[i, j] == tile.abs().max() * (1 / FP8_MAX)
            want = (tile / s[i, j]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            assert torch.equal(q[16 * i : 16 * i + 16, 32 * j : 32 * j + 32].float(), want.float())
            got = dequantize(q, s, (16, 32))[16 * i : 16 * i + 16, 32 * j : 32 * j + 32]
            assert torch.equal(got, want.float() * s[i, j])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block", [None, (16, 32)])
def test_gemv_reads_fp8_weights(dtype, block):
    """Per-channel scales in the epilogue and block scales per tile, with a bias, a K tail
    and column tails, on the rule's configs and on forced split-K / tl.dot ones."""
    n, k = 48, 160
    q, s = _weight(n, k, block)
    ref_w = dequantize(q, s, block)
    for m in (1, 5):
        x = torch.randn(m, k, device=DEVICE).to(dtype)
        b = torch.randn(n, device=DEVICE).to(dtype)
        ref = F.linear(x.float(), ref_w, b.float())
        y = linear_small_m(x, q, b, w_scale=s, w_block=block)
        assert y.dtype == dtype and _rel_err(y, ref) < TOL[dtype]
        for cfg in (GemvConfig(False, 16, 32, 4, 1, 3), GemvConfig(True, 32, 32, 4, 1, 2)):
            out = torch.empty(m, n, device=DEVICE, dtype=dtype)
            _launch(x, q, b, out, cfg, w_scale=s, w_block=block)
            assert _rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("block", [None, (16, 32)])
def test_gemv_fuses_gated_activations_over_fp8_weights(block):
    """A gated MLP's two products, FP8: the activation as the down projection loads its input,
    and in the gate_up projection's epilogue (each half with its own rows' scales)."""
    n, k = 32, 64
    down, s_down = _weight(n, k, block, seed=1)
    x2 = torch.randn(3, 2 * k, device=DEVICE)
    act = F.silu(x2[:, :k]) * x2[:, k:]
    ref = F.linear(act, dequantize(down, s_down, block))
    y = linear_small_m(x2, down, act="silu", w_scale=s_down, w_block=block)
    assert _rel_err(y, ref) < TOL[torch.float32]

    gate_up, s_gu = _weight(2 * n, k, block, seed=2)
    x = torch.randn(3, k, device=DEVICE)
    h = F.linear(x, dequantize(gate_up, s_gu, block))
    y = linear_small_m(x, gate_up, gated_out="silu", w_scale=s_gu, w_block=block)
    assert _rel_err(y, F.silu(h[:, :n]) * h[:, n:]) < TOL[torch.float32]


def test_gemv_refuses_fp8_weights_without_matching_scales():
    q, s = _weight(16, 32)
    x = torch.randn(1, 32, device=DEVICE)
    with pytest.raises(ValueError, match="share a dtype"):
        linear_small_m(x, q)
    with pytest.raises(ValueError, match=r"scales of shape \(16,\)"):
        linear_small_m(x, q, w_scale=s[:8])
    with pytest.raises(ValueError, match="two powers of two"):
        linear_small_m(x, q, w_scale=s, w_block=(16, 24))


def fp8_gemv_launches() -> None:
    """FP8 launches of the H200 decode shapes (per channel and 128x128 blocks), for lowering."""
    for block in (None, (128, 128)):
        for m, n, k in ((1, 4096, 1024), (8, 1024, 2048), (32, 3072, 1024)):
            q = torch.zeros(n, k, dtype=FP8)
            s = torch.ones(n if block is None else (n // 128, k // 128))
            linear_small_m(torch.zeros(m, k, dtype=torch.bfloat16), q, w_scale=s, w_block=block)
        gate_up = torch.zeros(2 * 3072, 1024, dtype=FP8)
        s = torch.ones(6144 if block is None else (48, 8))
        x = torch.zeros(4, 1024, dtype=torch.bfloat16)
        linear_small_m(x, gate_up, gated_out="silu", w_scale=s, w_block=block)


def test_fp8_gemv_launches_lower_for_sm90():
    kernel = "heron.kernels.gemv:_gemv_kernel"
    # Several launches share a specialisation; there are at least one per scale layout.
    assert check_lowering("layers.test_fp8_linear:fp8_gemv_launches", kernel) >= 2


def test_linear_layers_quantise_and_load_fp8_per_shard():
    """``quantize_fp8`` after loading (per channel), and ``hold_fp8`` filled by a checkpoint's
    shards: per-tensor scales repeat over their rows, block scales land on their block rows."""
    torch.manual_seed(0)
    layer = Linear(32, 24, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    w = layer.weight.data.clone()
    layer.quantize_fp8()
    x = torch.randn(4, 32)
    ref = F.linear(x, dequantize(layer.weight, layer.weight_scale), layer.bias)
    assert torch.allclose(layer(x), ref) and _rel_err(layer(x), F.linear(x, w, layer.bias)) < 0.05

    packed = PackedLinear(32, {"a": 16, "b": 32})
    packed.hold_fp8(None)
    wa, wb = torch.randn(16, 32), torch.randn(32, 32)
    qa, qb = (wa / 0.01).to(FP8), (wb / 0.02).to(FP8)
    for shard, q, scale in (("a", qa, 0.01), ("b", qb, 0.02)):
        packed.weight_loader(packed.weight, q, shard)
        packed.weight_loader(packed.weight_scale, torch.tensor(scale), shard)
    assert torch.equal(packed.weight.view(torch.uint8), torch.cat([qa, qb]).view(torch.uint8))
    assert torch.equal(packed.weight_scale, torch.tensor([0.01] * 16 + [0.02] * 32))
    want = torch.cat([qa.float() * 0.01, qb.float() * 0.02])
    assert torch.allclose(packed(x), F.linear(x, want), rtol=1e-5, atol=1e-5)
    # In half precision the torch set rounds as the tensor cores do: FP8 activations too.
    assert torch.equal(
        packed(x.half()), scaled_mm_reference(x.half(), packed.weight, packed.weight_scale)
    )

    blocked = PackedLinear(32, {"a": 16, "b": 32})
    blocked.hold_fp8((16, 16))
    (qa, sa), (qb, sb) = quantize(wa, (16, 16)), quantize(wb, (16, 16))
    for shard, q, s in (("a", qa, sa), ("b", qb, sb)):
        blocked.weight_loader(blocked.weight, q, shard)
        blocked.weight_loader(blocked.weight_scale, s, shard)
    want = torch.cat([dequantize(qa, sa, (16, 16)), dequantize(qb, sb, (16, 16))])
    assert torch.allclose(blocked(x), F.linear(x, want), rtol=1e-5, atol=1e-5)

    misaligned = PackedLinear(32, {"a": 8, "b": 16})
    misaligned.hold_fp8((16, 16))
    with pytest.raises(ValueError, match="row 8 does not start a 16-row block"):
        misaligned.weight_loader(misaligned.weight_scale, torch.ones(1, 2), "b")


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_layer_products_on_the_gpu(block):
    """A bf16 FP8 layer on the Triton kernel set: the GEMV up to its rows, FP8 tensor cores
    (per channel) or the dequantised weight (blocks) past them; each against fp32."""
    layer = Linear(1024, 768, bias=True, kernels=layer_kernels("triton")).cuda()
    q, s = _weight(768, 1024, block, device="cuda")
    layer.weight.data = q  # the layer as hold_fp8 leaves it, filled
    layer.weight_scale, layer.weight_block = torch.nn.Parameter(s, requires_grad=False), block
    layer.bias.data = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    ref_w = dequantize(q, s, block)
    for m in (1, 16, 64, 300):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.float(), ref_w, layer.bias.float())
        # Past the GEMV, the per-token FP8 activations add their own rounding.
        tol = 0.02 if layer.takes_gemv(x) or block else 0.06
        assert _rel_err(layer(x), ref) < tol, m


@pytest.mark.gpu
def test_scaled_mm_against_fp32():
    q, s = _weight(512, 256, device="cuda")
    x = torch.randn(100, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), dequantize(q, s), b.float())
    assert _rel_err(scaled_mm(x, q, s, b), ref) < 0.06


def test_scaled_mm_reference_against_fp32():
    """The CPU's emulation of the tensor cores' product is dense fp32 over both operands
    quantised per row (the activations' scales per token), rounded once to bf16."""
    q, s = _weight(96, 64, device="cpu")
    x = (torch.randn(20, 64) * torch.logspace(-3, 2, 20)[:, None]).to(torch.bfloat16)
    y = scaled_mm_reference(x, q, s)
    assert y.dtype == torch.bfloat16
    assert _rel_err(y, F.linear(dequantize(*quantize(x)), dequantize(q, s))) < 0.01
    b = torch.randn(96, dtype=torch.bfloat16)
    ref = F.linear(x.float(), dequantize(q, s), b.float())
    assert _rel_err(scaled_mm_reference(x, q, s, b), ref) < 0.06


@pytest.mark.gpu
def test_scaled_mm_rounds_as_its_cpu_reference():
    """The CPU figures stand for the GPU's: the tensor cores' product and its emulation share
    every rounding but the order of the fp32 sums and the bf16 output."""
    q, s = _weight(512, 256, device="cuda")
    x = torch.randn(100, 256, device="cuda", dtype=torch.bfloat16)
    ref = scaled_mm_reference(x, q, s).float()
    assert _rel_err(scaled_mm(x, q, s), ref) < 0.01


def _exact_rows(k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose scaled values are E4M3 values (Triton's interpreter rounds fp32 to FP8
    without carrying a rounded-up mantissa into the exponent): each row ``2**e`` times E4M3
    values reaching 448, so its scale is ``2**e``; one row is zeros."""
    x = to_fp8(torch.randn(4, k) * 64).float()
    x[:, k // 3] = FP8_MAX
    x *= torch.tensor([2.0**-10, 0.0, 1.0, 2.0**-3])[:, None]
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_activation_quantisation_equals_quantize(dtype):
    """Bit for bit, with a zero row, a tail past the last whole tile, strided rows and, at
    K = 4200, rows longer than one tile."""
    for k in (200, 4200):
        x = _exact_rows(k + 8, dtype).to(DEVICE)[:, :k]
        q, scale = quantize_rows(x)
        want_q, want_scale = quantize(x)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), k
        assert torch.equal(scale, want_scale), k
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        quantize_rows(x[0])


def activation_quantisation_launches() -> None:
    """Per-token quantisation of prefill- and decode-sized bf16 rows (one tile, and longer)."""
    for m, k in ((1, 1024), (256, 3072), (64, 8192)):
        quantize_rows(torch.zeros(m, k, dtype=torch.bfloat16))


def test_activation_quantisation_lowers_for_sm90():
    kernel = "heron.kernels.fp8_quant:_quantize_rows_kernel"
    # Two specialisations: one 1024-wide tile, and 4096-wide tiles (K = 3072, and K = 8192 in two).
    assert check_lowering("layers.test_fp8_linear:activation_quantisation_launches", kernel) == 2


@pytest.mark.gpu
def test_triton_activation_quantisation_rounds_like_torch():
    """On the GPU's FP8 conversion, any values: round-to-nearest-even, as ``quantize``."""
    x = torch.randn(64, 3000, device="cuda", dtype=torch.bfloat16) * 3
    q, scale = quantize_rows(x)
    want_q, want_scale = quantize(x)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_scale)


@pytest.mark.parametrize("block", [None, (16, 16)])
def test_reordered_rows_carry_their_scales(block):
    """A layer's rows put in another order (Qwen3.5's gates after k and v) keep their own
    scales: the product equals the dequantised weight's rows in that order; an order that
    splits a block of scales is refused."""
    layer = Linear(32, 64, bias=True)
    layer.weight.data, layer.bias.data = (
        _weight(64, 32, seed=1, device="cpu")[0].float(),
        torch.randn(64),
    )
    layer.quantize_fp8(block)
    dense = dequantize(layer.weight.data, layer.weight_scale.data, block)
    bias = layer.bias.data.clone()
    order = torch.cat([torch.arange(48, 64), torch.arange(0, 48)])
    layer.reorder_rows(order)
    x = torch.randn(3, 32)
    assert torch.allclose(layer(x), F.linear(x, dense[order], bias[order]), atol=1e-5)
    with pytest.raises(ValueError, match="blocks") if block else contextlib.nullcontext():
        layer.reorder_rows(torch.arange(64).roll(1))
