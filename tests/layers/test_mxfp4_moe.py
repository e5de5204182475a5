"""MXFP4 experts (gpt-oss): Heron's dequantisation and quantiser against transformers' own
MXFP4 dequantiser, and the fused Triton MoE kernels reading packed MXFP4 against HF's
``GptOssExperts`` in fp32 on the weights transformers dequantises (ragged shapes, under the
interpreter); the MXFP4 launches compiled for sm_90."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from triton_lowering import check_lowering

from heron.kernels.moe import fused_experts
from heron.layers.moe import ClampedSwiGLUExperts
from heron.layers.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from heron.ops.selector import layer_kernels


def random_packed(*shape, seed=0):
    """Random blocks ``[*shape, 16]`` and scales ``[*shape]`` near 2 ** -4."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    return blocks, torch.randint(120, 128, shape, generator=g, dtype=torch.uint8)


def hf_dequantised(blocks, scales):
    """transformers' dequantisation: input-major ``[E, K, N]`` (gpt-oss's dense layout)."""
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def test_dequantize_equals_transformers():
    blocks, scales = random_packed(3, 24, 4)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every nibble, both halves
    want = hf_dequantised(blocks, scales).transpose(1, 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales), want)


def test_quantize_rounds_to_the_nearest_value():
    """Values on the grid come back exactly; others to within half the grid's step."""
    blocks, scales = random_packed(2, 8, 3, seed=1)
    grid = dequantize_mxfp4(blocks, scales)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(grid)), grid)
    w = torch.randn(2, 8, 96, generator=torch.Generator().manual_seed(2))
    got_blocks, got_scales = quantize_mxfp4(w)
    got = hf_dequantised(got_blocks, got_scales).transpose(1, 2)
    scale = torch.exp2(got_scales.float() - 127)
    assert (w.view(2, 8, 3, 32).abs().amax(-1) <= 6 * scale).all()  # nothing clipped
    assert ((got - w).abs() <= scale.repeat_interleave(32, -1)).all()  # half of 4 -> 6


def mxfp4_bank(num_experts, hidden, inter, seed=0):
    """A Heron bank and HF's ``GptOssExperts`` (fp32) on the same random MXFP4 weights."""
    g = torch.Generator().manual_seed(seed)
    bank = ClampedSwiGLUExperts(num_experts, hidden, inter, 7.0, kernels=layer_kernels("triton"))
    bank.hold_mxfp4()
    config = tf.GptOssConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=num_experts
    )
    hf = GptOssExperts(config)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            blocks, scales = random_packed(*getattr(bank, name + "_scales").shape, seed=seed)
            getattr(bank, name + "_blocks").copy_(blocks)
            getattr(bank, name + "_scales").copy_(scales)
            getattr(hf, name).copy_(hf_dequantised(blocks, scales))
            bias = torch.randn(getattr(bank, name + "_bias").shape, generator=g)
            getattr(bank, name + "_bias").copy_(bias)
            getattr(hf, name + "_bias").copy_(bias)
    return bank, hf


def routing(num_tokens, num_experts, top_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    indices = torch.rand(num_tokens, num_experts, generator=g).topk(top_k, -1).indices
    return torch.softmax(torch.randn(num_tokens, top_k, generator=g), -1), indices


def rel_err(got, want):
    return ((got.double() - want.double()).abs().max() / want.abs().max()).item()


# (hidden, intermediate, kernel blocks): one K step; several; column tails in both kernels
# (96 = one and a half 64-column tiles, 2I = 192 three); row blocks past a token's pairs.
SHAPES = [(32, 32, None), (64, 96, None), (96, 64, (16, 64, 64)), (160, 32, (32, 32, 128))]


@pytest.mark.parametrize("num_tokens", [1, 13])
@pytest.mark.parametrize("hidden,inter,blocks", SHAPES)
def test_fused_mxfp4_experts_match_hf_on_dequantised_weights(num_tokens, hidden, inter, blocks):
    bank, hf = mxfp4_bank(4, hidden, inter, seed=hidden + inter)
    x = 4 * torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(num_tokens))
    weights, indices = routing(num_tokens, 4, 2, seed=num_tokens)
    with torch.no_grad():
        want = hf(x, indices, weights)
        gate_up = torch.einsum("th,ehi->eti", x, hf.gate_up_proj)
        got = fused_experts(x, weights, indices, **bank.fused_layout(), blocks=blocks)
        sparse = bank.forward_sparse(x, weights, indices)  # the CPU's path
    assert gate_up.abs().max() > 2 * bank.limit  # the clamps bite
    assert rel_err(got, want) < 1e-5
    assert rel_err(sparse, want) < 1e-5


def test_fp16_activations():
    bank, hf = mxfp4_bank(4, 64, 32, seed=3)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    weights, indices = routing(9, 4, 2, seed=3)
    bank.gate_up_proj_bias.data, bank.down_proj_bias.data = (
        bank.gate_up_proj_bias.half(),
        bank.down_proj_bias.half(),
    )
    with torch.no_grad():
        got = fused_experts(x.half(), weights.half(), indices, **bank.fused_layout())
        want = hf(x, indices, weights)
    assert got.dtype == torch.float16
    assert rel_err(got, want) < 5e-3


def test_refuses_mxfp4_weights_without_matching_scales():
    bank, _ = mxfp4_bank(4, 64, 32)
    x = torch.zeros(3, 64)
    weights, indices = routing(3, 4, 2)
    layout = bank.fused_layout()
    for change in (
        dict(down_scale=None),
        dict(gate_up_scale=layout["gate_up_scale"][:, :, :1].contiguous()),
        dict(output_major=False),
    ):
        with pytest.raises(ValueError, match="MXFP4 (gate_up|down) weights are output-major"):
            fused_experts(x, weights, indices, **(layout | change))


def test_bank_refuses_features_that_are_not_whole_blocks():
    bank = ClampedSwiGLUExperts(2, 48, 32, 7.0)
    with pytest.raises(ValueError, match="gate_up_proj: MXFP4 needs a multiple of 32 input"):
        bank.hold_mxfp4()


def mxfp4_launches() -> None:
    """bf16 launches at gpt-oss-20b's expert shape (32 experts of 2880 x 2880, top 4) for a
    decode-sized and a prefill-sized batch, for the lowering test."""
    bank = ClampedSwiGLUExperts(32, 2880, 2880, 7.0, kernels=layer_kernels("triton"))
    bank.hold_mxfp4()
    bank.to(torch.bfloat16)
    for tokens in (1, 4096):
        indices = torch.randint(0, 32, (tokens, 4), generator=torch.Generator().manual_seed(0))
        x, weights = torch.empty(tokens, 2880, dtype=torch.bfloat16), torch.empty(tokens, 4)
        fused_experts(x, weights.to(torch.bfloat16), indices, **bank.fused_layout())


#: The launches of one fused MoE call, for the lowering tests.
FUSED_MOE_KERNELS = (
    "heron.kernels.moe:_gate_up_kernel",
    "heron.kernels.moe:_down_kernel",
    "heron.kernels.moe:_combine_kernel",
    "heron.kernels.moe_align:_align_kernel",
)


def test_mxfp4_launches_lower_for_hopper():
    assert check_lowering("layers.test_mxfp4_moe:mxfp4_launches", *FUSED_MOE_KERNELS)
