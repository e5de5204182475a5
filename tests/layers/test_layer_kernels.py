"""The Triton RMSNorm and gated-activation kernels against the PyTorch code they replace.

Small cases run on the GPU when there is one, else under the Triton interpreter (fp32/fp16
only: the interpreter's bf16 arithmetic is wrong); ``gpu`` cases check bf16 at model shapes.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from triton_lowering import check_lowering

from heron.kernels.activation import ACTIVATIONS, gated_activation
from heron.kernels.rmsnorm import gated_rms_norm, rms_norm
from heron.layers.norm import GatedRMSNorm
from heron.ops.selector import layer_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def reference_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF LlamaRMSNorm, after the residual add; returns (out, x + residual)."""
    s = x if residual is None else x + residual
    xf = s.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(s.dtype), s


REFERENCE_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
    "sigmoid": torch.sigmoid,
}


def reference_gated(x: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return REFERENCE_ACTIVATIONS[act](gate) * up


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: within an ulp or so (sum order, rsqrt); fp16/bf16: within one ulp of the dtype."""
    assert actual.dtype == expected.dtype
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-6)
    else:
        ulp = torch.finfo(expected.dtype).eps
        torch.testing.assert_close(actual.float(), expected.float(), rtol=ulp, atol=ulp)


def _rows(tokens: int, width: int, dtype: torch.dtype, strided: bool = False) -> torch.Tensor:
    """Random rows; ``strided`` makes them a column slice of a wider tensor."""
    x = torch.randn(tokens, width + 3 * strided, dtype=dtype, device=DEVICE) * 2
    return x[:, :width]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [64, 96])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm(dtype: torch.dtype, width: int, strided: bool) -> None:
    torch.manual_seed(0)
    x = _rows(5, width, dtype, strided)
    weight = torch.rand(width, dtype=dtype, device=DEVICE) + 0.5
    expected, _ = reference_rms_norm(x, weight, EPS)
    assert_close(rms_norm(x, weight, EPS), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_residual_in_place(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = _rows(7, 48, dtype, strided=True)
    residual = torch.randn(7, 48, dtype=dtype, device=DEVICE)
    weight = torch.rand(48, dtype=dtype, device=DEVICE) + 0.5
    expected, expected_sum = reference_rms_norm(x, weight, EPS, residual)
    out, new_residual = rms_norm(x, weight, EPS, residual)
    assert new_residual.data_ptr() == residual.data_ptr()
    # The add is one rounding of the exact sum in both: it must agree bit for bit.
    assert torch.equal(residual, expected_sum)
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_gated_activation(dtype: torch.dtype, act: str) -> None:
    assert set(ACTIVATIONS) == set(REFERENCE_ACTIVATIONS)
    torch.manual_seed(2)
    x = _rows(3, 2 * 40, dtype, strided=True)
    assert_close(gated_activation(x, act), reference_gated(x, act))
    out = torch.empty(3, 40, dtype=dtype, device=DEVICE)
    assert gated_activation(x, act, out=out) is out
    assert_close(out, reference_gated(x, act))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_rms_norm_bf16(tokens: int) -> None:
    torch.manual_seed(3)
    x = torch.randn(tokens, 1024, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.rand(1024, dtype=torch.bfloat16, device="cuda") + 0.5
    expected, _ = reference_rms_norm(x, weight, EPS)
    assert_close(rms_norm(x, weight, EPS), expected)
    expected, expected_sum = reference_rms_norm(x, weight, EPS, residual)
    out, _ = rms_norm(x, weight, EPS, residual)
    assert torch.equal(residual, expected_sum)
    assert_close(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 2048])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_gated_activation_bf16(tokens: int, act: str) -> None:
    torch.manual_seed(4)
    x = torch.randn(tokens, 2 * 3072, dtype=torch.bfloat16, device="cuda") * 3
    assert_close(gated_activation(x, act), reference_gated(x, act))


def reference_gemma_rms_norm(x, weight, eps, residual=None):
    """HF Gemma3RMSNorm, after the residual add: (1 + w) * norm(x) in fp32, cast once."""
    s = x if residual is None else x + residual
    xf = s.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(s.dtype), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemma_rms_norm(dtype: torch.dtype) -> None:
    """The weight offset and the single fp32 rounding of Gemma's norm, with and without the
    fused residual; GemmaRMSNorm uses exactly this with the Triton kernels."""
    torch.manual_seed(5)
    x = _rows(6, 72, dtype, strided=True)
    residual = torch.randn(6, 72, dtype=dtype, device=DEVICE)
    weight = torch.randn(72, dtype=dtype, device=DEVICE) * 0.3  # zero-centred, as stored
    expected, _ = reference_gemma_rms_norm(x, weight, EPS)
    assert_close(rms_norm(x, weight, EPS, None, 1.0, True), expected)
    expected, expected_sum = reference_gemma_rms_norm(x, weight, EPS, residual)
    out, new_residual = rms_norm(x, weight, EPS, residual, 1.0, True)
    assert torch.equal(new_residual, expected_sum)
    assert_close(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_gemma_rms_norm_module_bf16(tokens: int) -> None:
    from heron.layers.norm import GemmaRMSNorm

    torch.manual_seed(6)
    norm = GemmaRMSNorm(1152, kernels=layer_kernels("triton")).cuda().to(torch.bfloat16)
    norm.weight.data.normal_(0, 0.3)
    x = torch.randn(tokens, 1152, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn_like(x)
    expected, expected_sum = reference_gemma_rms_norm(x, norm.weight, EPS, residual)
    assert_close(norm(x), reference_gemma_rms_norm(x, norm.weight, EPS)[0])
    out, _ = norm(x, residual)
    assert torch.equal(residual, expected_sum)
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_prenorm(dtype: torch.dtype, gemma: bool) -> None:
    """A post-norm fused into the next norm: exactly the two norms in sequence, the first one's
    output rounded to the activation dtype before the residual add."""
    torch.manual_seed(7)
    reference = reference_gemma_rms_norm if gemma else reference_rms_norm
    form = (1.0, True) if gemma else (0.0, False)
    x = _rows(5, 72, dtype, strided=True)
    residual = torch.randn(5, 72, dtype=dtype, device=DEVICE)
    pre_weight, weight = (torch.randn(72, dtype=dtype, device=DEVICE) * 0.3 + 0.5 for _ in "ab")
    normed_x, _ = reference(x, pre_weight, EPS)
    expected, expected_sum = reference(normed_x, weight, EPS, residual)
    out, new_residual = rms_norm(x, weight, EPS, residual, *form, prenorm_weight=pre_weight)
    assert_close(new_residual, expected_sum)
    assert_close(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_gemma_norm_module_prenorm_bf16(tokens: int) -> None:
    """GemmaRMSNorm with a prenorm and the Triton kernels (one launch) equals the two modules in
    sequence with the residual add between them, in PyTorch on the CPU."""
    from heron.layers.norm import GemmaRMSNorm

    torch.manual_seed(8)
    post, pre = (GemmaRMSNorm(1152).to(torch.bfloat16) for _ in "ab")
    for norm in (post, pre):
        norm.weight.data.normal_(0, 0.3)
    x = torch.randn(tokens, 1152, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    expected, expected_sum = pre(post(x), residual.clone())
    fused_post, fused_pre = (
        GemmaRMSNorm(1152, kernels=layer_kernels("triton")).to(torch.bfloat16) for _ in "ab"
    )
    fused_post.load_state_dict(post.state_dict())
    fused_pre.load_state_dict(pre.state_dict())
    out, new_residual = fused_pre.cuda()(x.cuda(), residual.cuda(), fused_post.cuda())
    assert_close(new_residual.cpu(), expected_sum)  # post(x) may differ by an ulp (sum order)
    assert_close(out.cpu(), expected)


def _gated_norm_case(tokens: int, heads: int, dim: int, dtype: torch.dtype, device: str):
    """x and a gate strided as Qwen3.5's mixer hands them over (views into its projection),
    and HF's RMSNormGated form in PyTorch with a random weight."""
    g = torch.Generator(device).manual_seed(tokens)
    x = torch.randn(tokens, heads, dim + 8, generator=g, device=device).to(dtype)[..., :dim]
    z = torch.randn(tokens, 3 * heads * dim, generator=g, device=device).to(dtype) * 3
    gate = z[:, heads * dim : 2 * heads * dim].reshape(tokens, heads, dim)
    norm = GatedRMSNorm(dim, EPS).to(device)
    norm.weight.data = (torch.rand(dim, generator=g, device=device) + 0.5).to(dtype)
    return x, gate, norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_rms_norm(dtype: torch.dtype) -> None:
    x, gate, norm = _gated_norm_case(3, 4, 32, dtype, DEVICE)
    assert_close(gated_rms_norm(x, gate, norm.weight, EPS), norm(x, gate))
    with pytest.raises(ValueError, match="T, H, D"):
        gated_rms_norm(x[0], gate[0], norm.weight, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_gated_rms_norm_bf16(tokens: int) -> None:
    x, gate, norm = _gated_norm_case(tokens, 16, 128, torch.bfloat16, "cuda")
    assert_close(gated_rms_norm(x, gate, norm.weight, EPS), norm(x, gate))


def layer_kernel_launches() -> None:
    """bf16 launches at real hidden sizes (Qwen3-0.6B, Gemma-3-1B, gpt-oss, Llama-3-8B): the
    RMSNorm plain, with a residual, in Gemma's form with a fused post-norm; every gated
    activation at the models' intermediate sizes (for the lowering test)."""
    bf16 = torch.bfloat16
    for hidden in (1024, 1152, 2880, 4096):
        x, weight = torch.empty(3, hidden, dtype=bf16), torch.empty(hidden, dtype=bf16)
        rms_norm(x, weight, EPS)
        rms_norm(x, weight, EPS, residual=torch.empty_like(x))
        rms_norm(
            x, weight, EPS, torch.empty_like(x), weight_offset=1.0, scale_in_fp32=True,
            prenorm_weight=weight,
        )  # fmt: skip
    for inter, act in itertools.product((3072, 6912, 14336), ACTIVATIONS):
        gated_activation(torch.empty(3, 2 * inter, dtype=bf16), act)
    x = torch.empty(3, 16, 128, dtype=bf16)  # Qwen3.5's linear-attention heads
    gated_rms_norm(x, x, torch.empty(128, dtype=bf16), EPS)


def test_layer_kernel_launches_lower_for_hopper():
    """Triton's compiler accepts the norm's and the activation's launch variants at real sizes
    (which the interpreter alone would not prove)."""
    assert check_lowering(
        "layers.test_layer_kernels:layer_kernel_launches",
        "heron.kernels.rmsnorm:_rms_norm_kernel",
        "heron.kernels.activation:_gated_activation_kernel",
        "heron.kernels.rmsnorm:_gated_rms_norm_kernel",
    )
