"""FP8 E4M3 experts: the fused Triton MoE kernels reading FP8 weights (per-channel scales in the
epilogue, 2-D tile scales per K step) and the bank's dequantising PyTorch path, each against
dense fp32 PyTorch on the dequantised weights (the dequantisation written out here). Tiny
shapes in Triton's interpreter on the CPU; bf16 at Qwen3-30B-A3B's and DeepSeek-V3's expert
shapes on a GPU; the FP8 launches compiled for sm_90."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_lowering import check_lowering

from heron.kernels.moe import fused_experts
from heron.layers.fp8 import FP8
from heron.layers.moe import SwiGLUExperts
from heron.ops.selector import layer_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYOUTS = [None, (16, 16), (32, 16)]  # per channel; tiles; tiles taller than a K step


def expanded(scale: torch.Tensor, rows: int, cols: int, block) -> torch.Tensor:
    """``scale`` of one matrix per expert ([E, rows] channels, or [E, R, C] tiles) as a
    factor per weight, [E, rows, cols]."""
    if block is None:
        return scale[:, :, None].expand(-1, -1, cols)
    full = scale.repeat_interleave(block[0], 1).repeat_interleave(block[1], 2)
    return full[:, :rows, :cols]


def dense_weights(gate_up, gate_up_scale, down, down_scale, block):
    """The fp32 ``[gate | up]`` and down stacks that FP8 stacks stand for: each of gate, up
    and down is its own matrix of channels or tiles."""
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    halves = []
    for q, s in zip(gate_up.chunk(2, 1), gate_up_scale.chunk(2, 1), strict=True):
        halves.append(q.float() * expanded(s, inter, hidden, block))
    return torch.cat(halves, 1), down.float() * expanded(down_scale, hidden, inter, block)


def dense_moe(x, weights, indices, gate_up, down):
    """fp32: every expert on every token, each token's ``indices`` gathered and weighted."""
    gate, up = torch.einsum("th,enh->ten", x.float(), gate_up).chunk(2, -1)
    y = torch.einsum("tei,ehi->teh", F.silu(gate) * up, down)
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    return (y[rows, indices] * weights.float()[..., None]).sum(1)


def scale_shape(num_experts, n, k, matrices, block):
    """The scales of a stack of ``matrices`` [n / matrices, k] per expert."""
    if block is None:
        return (num_experts, n)
    return (num_experts, -(-n // matrices // block[0]) * matrices, -(-k // block[1]))


def random_fp8_experts(num_experts, hidden, inter, block, device=DEVICE, seed=0):
    """FP8 stacks of random E4M3 values and scales of the layout's shapes, so that the
    products have unit scale."""
    g = torch.Generator(device).manual_seed(seed)

    def stack(n, k, matrices):
        q = torch.randn(num_experts, n, k, generator=g, device=device) * 64
        scale = torch.rand(scale_shape(num_experts, n, k, matrices, block), generator=g,
                           device=device)  # fmt: skip
        return q.clamp(-448, 448).to(FP8), (scale + 0.5) / 64 / k**0.5

    return (*stack(2 * inter, hidden, 2), *stack(hidden, inter, 1))


def empty_fp8_experts(num_experts, hidden, inter, block):
    """FP8 stacks and scales of the layout's shapes, unset (for launches that only compile)."""
    return (
        torch.empty(num_experts, 2 * inter, hidden, dtype=FP8),
        torch.empty(scale_shape(num_experts, 2 * inter, hidden, 2, block)),
        torch.empty(num_experts, hidden, inter, dtype=FP8),
        torch.empty(scale_shape(num_experts, hidden, inter, 1, block)),
    )


def routing(num_tokens, num_experts, top_k, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    indices = torch.rand(num_tokens, num_experts, generator=g).topk(top_k, -1).indices
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=g), -1)
    return weights.to(device), indices.to(device)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.abs().max()).item()


# (hidden, intermediate, kernel blocks): several K steps; K, column and tile tails.
SHAPES = [(64, 48, (16, 16, 16)), (40, 24, None)]
CASES = [(torch.float32, block, *shape) for block in LAYOUTS for shape in SHAPES]
CASES += [(torch.float16, block, *SHAPES[0]) for block in LAYOUTS[:2]]


@pytest.mark.parametrize("dtype,block,hidden,inter,blocks", CASES)
def test_fused_fp8_experts_match_dense_reference(dtype, block, hidden, inter, blocks):
    gate_up, gate_up_scale, down, down_scale = random_fp8_experts(4, hidden, inter, block)
    x = torch.randn(9, hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    weights, indices = routing(9, 4, 2)
    want = dense_moe(x, weights, indices, *dense_weights(
        gate_up, gate_up_scale, down, down_scale, block
    ))  # fmt: skip
    got = fused_experts(
        x, weights.to(dtype), indices, gate_up, down, activation="swiglu", output_major=True,
        interleaved=False, gate_up_scale=gate_up_scale, down_scale=down_scale, scale_block=block,
        blocks=blocks,
    )  # fmt: skip
    assert got.dtype == dtype
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("block", [None, (16, 16)])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_quantised_bank_runs_its_fp8_weights(block, kernels):
    """``quantize_fp8`` leaves FP8 stacks and scales (the gate's tiles apart from the up's);
    the bank's torch reference and its fused kernels both compute what they stand for, which
    is close to the full-precision experts."""
    torch.manual_seed(0)
    bank = SwiGLUExperts(4, 64, 24, layer_kernels(kernels)).to(DEVICE)
    with torch.no_grad():
        bank.gate_up_proj.normal_(0.0, 64**-0.5)
        bank.down_proj.normal_(0.0, 24**-0.5)
    x = torch.randn(7, 64, device=DEVICE)
    weights, indices = routing(7, 4, 2)
    full = bank.forward_sparse(x, weights, indices)
    bank.quantize_fp8(block)
    assert bank.gate_up_proj.dtype == bank.down_proj.dtype == FP8
    tiles = block is not None
    assert bank.gate_up_proj_scale.shape == ((4, 2 * 2, 4) if tiles else (4, 48))
    assert bank.down_proj_scale.shape == ((4, 4, 2) if tiles else (4, 64))
    dense = dense_weights(
        bank.gate_up_proj, bank.gate_up_proj_scale, bank.down_proj, bank.down_proj_scale, block
    )
    got = bank(x, weights, indices)
    assert rel_err(got, dense_moe(x, weights, indices, *dense)) < 1e-5
    assert rel_err(got, full) < 0.1  # E4M3 keeps 3 mantissa bits


def test_fused_experts_refuses_fp8_weights_without_matching_scales():
    gate_up, gate_up_scale, down, down_scale = random_fp8_experts(4, 32, 16, (16, 16))
    x = torch.zeros(3, 32, device=DEVICE)
    weights, indices = routing(3, 4, 2)
    layout = dict(activation="swiglu", output_major=True, interleaved=False)
    call = lambda **kw: fused_experts(x, weights, indices, gate_up, down, **(layout | kw))  # noqa: E731
    with pytest.raises(ValueError, match="in x's dtype"):
        call()
    with pytest.raises(ValueError, match=r"scales of shape \(4, 32\)"):
        call(gate_up_scale=gate_up_scale, down_scale=down_scale)  # tiles read as channels
    with pytest.raises(ValueError, match="FP8 down weights .* got torch.float8_e4m3fn and None"):
        call(gate_up_scale=gate_up_scale, scale_block=(16, 16))
    with pytest.raises(ValueError, match="bk >= 16"):
        call(gate_up_scale=gate_up_scale, down_scale=down_scale, scale_block=(16, 8))
    with pytest.raises(ValueError, match="output-major"):
        call(gate_up_scale=gate_up_scale, down_scale=down_scale, scale_block=(16, 16),
             interleaved=True)  # fmt: skip


# (experts, top-k, hidden, intermediate, scale layout): Qwen3-30B-A3B-FP8's experts, and
# DeepSeek-V3's (32 of its 256 experts: the per-expert shape is what the kernels see).
GPU_SHAPES = {
    "qwen3-30b-a3b channels": (128, 8, 2048, 768, None),
    "qwen3-30b-a3b 128x128": (128, 8, 2048, 768, (128, 128)),
    "deepseek-v3 128x128": (32, 8, 7168, 2048, (128, 128)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_bf16_fp8_experts_real_shapes(shape, num_tokens):
    num_experts, top_k, hidden, inter, block = GPU_SHAPES[shape]
    stacks = random_fp8_experts(num_experts, hidden, inter, block, device="cuda")
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, indices = routing(num_tokens, num_experts, top_k, device="cuda", seed=num_tokens)
    gate_up, down = dense_weights(*stacks, block)
    want = torch.zeros(num_tokens, hidden, device="cuda")
    for e in indices.unique().tolist():  # fp32, expert by expert (the dense stacks are large)
        rows, slots = (indices == e).nonzero(as_tuple=True)
        y = dense_moe(x[rows], weights[rows, slots, None], torch.zeros_like(rows)[:, None],
                      gate_up[e : e + 1], down[e : e + 1])  # fmt: skip
        want.index_add_(0, rows, y)
    gate_up_q, gate_up_scale, down_q, down_scale = stacks
    got = fused_experts(
        x, weights.to(torch.bfloat16), indices, gate_up_q, down_q, activation="swiglu",
        output_major=True, interleaved=False, gate_up_scale=gate_up_scale, down_scale=down_scale,
        scale_block=block,
    )  # fmt: skip
    assert got.dtype == torch.bfloat16
    assert rel_err(got, want) < 1e-2


def fp8_moe_launches() -> None:
    """bf16 launches over FP8 experts at Qwen3-30B-A3B's (per channel) and DeepSeek-V3's
    (128 x 128 tiles) sizes, for a decode-sized and a prefill-sized batch."""
    for shape in ("qwen3-30b-a3b channels", "deepseek-v3 128x128"):
        num_experts, top_k, hidden, inter, block = GPU_SHAPES[shape]
        gate_up, gate_up_scale, down, down_scale = empty_fp8_experts(
            num_experts, hidden, inter, block
        )
        for tokens in (4, 4096):
            weights, indices = routing(tokens, num_experts, top_k, device="cpu")
            x = torch.empty(tokens, hidden, dtype=torch.bfloat16)
            fused_experts(
                x, weights.to(torch.bfloat16), indices, gate_up, down, activation="swiglu",
                output_major=True, interleaved=False, gate_up_scale=gate_up_scale,
                down_scale=down_scale, scale_block=block,
            )  # fmt: skip


def test_fp8_moe_launches_lower_for_hopper():
    """Triton's compiler accepts both expert kernels over FP8 weights, each scale layout."""
    kernels = (
        "heron.kernels.moe:_gate_up_kernel",
        "heron.kernels.moe:_down_kernel",
        "heron.kernels.moe:_combine_kernel",
    )
    # The alignment launches on the way, so it is recorded (and lowered) too.
    align = "heron.kernels.moe_align:_align_kernel"
    assert check_lowering("layers.test_fp8_moe:fp8_moe_launches", *kernels, align) >= 4
