"""Packed integer experts (W4A16, W8A16: GPTQ, AWQ, compressed-tensors MoE checkpoints): the
fused Triton MoE kernels reading the packed stacks under the interpreter, and the bank's CPU
path, against dequantise-then-matmul in fp32 on tiny ragged grids; the launches compiled for
sm_90."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from layers.test_mxfp4_moe import FUSED_MOE_KERNELS, rel_err, routing
from triton_lowering import check_lowering

from heron.kernels.moe import fused_experts
from heron.layers.moe import SwiGLUExperts
from heron.layers.wna16 import WNA16Scheme, dequantize, pack, quantize, unpack
from heron.ops.selector import layer_kernels
from heron.parallel import TensorParallel, tensor_parallel_scope


def packed_bank(num_experts, hidden, inter, bits, group, zeros, seed=0):
    """A bank of random experts quantised to ``bits`` in groups of ``group`` (None: per
    channel), with zero points or symmetric; and each expert's dequantised fp32 matrices."""
    g = torch.Generator().manual_seed(seed)
    bank = SwiGLUExperts(num_experts, hidden, inter, kernels=layer_kernels("triton"))
    with torch.no_grad():
        bank.gate_up_proj.copy_(torch.randn(bank.gate_up_proj.shape, generator=g) / 4)
        bank.down_proj.copy_(torch.randn(bank.down_proj.shape, generator=g) / 4)
    bank.quantize_wna16(WNA16Scheme("gptq", bits, group, zero_points=zeros))
    dense = [
        [dequantize(*bank._packed(name, e), bits, group) for name in ("gate_up_proj", "down_proj")]
        for e in range(num_experts)
    ]
    return bank, dense


def reference(x, weights, indices, dense):
    """Each token's experts on the dequantised weights, summed with the routing weights."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), indices[t].tolist(), strict=True):
            gate, up = F.linear(x[t], dense[e][0]).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, dense[e][1])
    return out


# (hidden, intermediate, bits, group, zero points, kernel blocks): groups narrower than a K
# step; a K tail (96 of 64) per channel at 8 bits; 2I = 192 in three column tiles and groups
# of 32 in a K step of 64; groups wider than a K step with a ragged last one (160 in 64s) and
# row blocks past a token's pairs; at 8 bits, one group of 128 wider than gate/up's 64 inputs.
SHAPES = [
    (64, 32, 4, 32, True, None),
    (96, 64, 8, None, False, None),
    (128, 96, 4, 32, False, (16, 64, 64)),
    (160, 64, 4, 64, True, (32, 32, 32)),
    (64, 128, 8, 128, True, (16, 32, 128)),
]


@pytest.mark.parametrize("num_tokens", [1, 13])
@pytest.mark.parametrize("hidden, inter, bits, group, zeros, blocks", SHAPES)
def test_fused_packed_experts_match_dequantised_fp32(
    num_tokens, hidden, inter, bits, group, zeros, blocks
):
    bank, dense = packed_bank(4, hidden, inter, bits, group, zeros, seed=hidden + inter)
    assert bank.gate_up_proj is None and bank.gate_up_proj_qweight.dtype == torch.int32
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(num_tokens))
    weights, indices = routing(num_tokens, 4, 2, seed=num_tokens)
    want = reference(x, weights, indices, dense)
    with torch.no_grad():
        got = fused_experts(x, weights, indices, **bank.fused_layout(), blocks=blocks)
        sparse = bank.forward_sparse(x, weights, indices)  # the CPU's path
    assert rel_err(got, want) < 1e-5
    assert rel_err(sparse, want) < 1e-5


def test_fp16_activations_and_shared_expert():
    bank, dense = packed_bank(4, 64, 64, 4, 32, True, seed=3)
    g = torch.Generator().manual_seed(3)
    x, add, gate = (torch.randn(9, n, generator=g) for n in (64, 64, 1))
    weights, indices = routing(9, 4, 2, seed=3)
    got = fused_experts(
        x.half(), weights.half(), indices, **bank.fused_layout(), add=add.half(),
        add_gate=gate.half(),
    )  # fmt: skip
    want = reference(x, weights, indices, dense) + torch.sigmoid(gate) * add
    assert got.dtype == torch.float16
    assert rel_err(got, want) < 5e-3


def test_refuses_packed_weights_without_matching_scales():
    bank, _ = packed_bank(4, 64, 32, 4, 32, True)
    x = torch.zeros(3, 64)
    weights, indices = routing(3, 4, 2)
    layout = bank.fused_layout()
    for change, message in (
        (dict(down_scale=layout["down_scale"][:, :, :0]), "packed down weights are contiguous"),
        (dict(group_size=64), "packed gate_up weights are contiguous"),
        (dict(down_zeros=None), "both zero points or neither"),
        (dict(interleaved=True), "output-major \\[gate \\| up\\] without biases"),
        (dict(bits=2), "packed integers of 2 bits"),
        (dict(input_perm=torch.zeros(4, 32, dtype=torch.int32)), "input_perm is a contiguous"),
    ):
        with pytest.raises(ValueError, match=message):
            fused_experts(x, weights, indices, **(layout | change))


def act_order_bank(num_experts, hidden, inter, bits, group, zeros, seed=0):
    """A bank loaded as an act-order (``desc_act``) checkpoint stores its experts: each
    matrix's columns grouped in a random order of its own (gate's and up's one order), the
    words in the columns' order, ``g_idx`` the group of each; and the dequantised matrices."""
    g = torch.Generator().manual_seed(seed)
    scheme = WNA16Scheme("gptq", bits, group, zero_points=zeros, act_order=True)
    bank = SwiGLUExperts(num_experts, hidden, inter, kernels=layer_kernels("triton"))
    bank.hold_wna16(scheme)
    dense = []
    for e in range(num_experts):
        matrices = []
        for name, count in (("gate_up_proj", 2), ("down_proj", 1)):
            n, k = (2 * inter, hidden) if count == 2 else (hidden, inter)
            w = torch.randn(n, k, generator=g) / 4
            perm = torch.randperm(k, generator=g)
            qweight, scales, qzeros = quantize(w[:, perm], bits, group, zeros)  # groups sorted
            unsorted = torch.argsort(perm)
            getattr(bank, f"{name}_qweight")[e] = pack(unpack(qweight, bits)[:, unsorted], bits)
            getattr(bank, f"{name}_scales")[e] = scales
            if zeros:
                getattr(bank, f"{name}_qzeros")[e] = qzeros
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
            getattr(bank, f"{name}_g_idx")[e] = g_idx.repeat(count)
            matrices.append(dequantize(qweight, scales, qzeros, bits, group)[:, unsorted])
        dense.append(matrices)
    bank.finish_wna16("mlp.experts")
    return bank, dense


@pytest.mark.parametrize("num_tokens", [1, 13])
def test_act_order_experts_match_dequantised_fp32(num_tokens):
    """Columns sorted by group at load: ``x`` gathered in each expert's order by the kernel,
    down's order folded into gate's and up's rows."""
    bank, dense = act_order_bank(4, 64, 96, 4, 32, True, seed=num_tokens)
    assert bank.input_perm.shape == (4, 64) and bank.gate_up_proj_g_idx is None
    x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens))
    weights, indices = routing(num_tokens, 4, 2, seed=num_tokens)
    want = reference(x, weights, indices, dense)
    with torch.no_grad():
        got = fused_experts(x, weights, indices, **bank.fused_layout(), blocks=(16, 64, 32))
        sparse = bank.forward_sparse(x, weights, indices)
    assert rel_err(got, want) < 1e-5
    assert rel_err(sparse, want) < 1e-5


def test_act_order_refusals_name_the_experts():
    scheme = WNA16Scheme("gptq", 4, 32, zero_points=True, act_order=True)
    bank = SwiGLUExperts(2, 64, 32)
    bank.hold_wna16(scheme)
    bank.gate_up_proj_g_idx.copy_(torch.cat([torch.arange(64) // 32, torch.arange(64) % 2]))
    with pytest.raises(ValueError, match="mlp.experts: an expert's gate_proj and up_proj g_idx"):
        bank.finish_wna16("mlp.experts")
    with tensor_parallel_scope(TensorParallel(0, 2)):
        bank = SwiGLUExperts(2, 64, 64)
    bank.hold_wna16(scheme)
    bank.gate_up_proj_g_idx.copy_((torch.arange(64) // 32).flip(0).repeat(2, 2))
    bank.down_proj_g_idx.zero_()
    with pytest.raises(ValueError, match="experts under tensor parallelism is not supported"):
        bank.finish_wna16("mlp.experts")


def test_nvfp4_experts_are_refused_by_name():
    nvfp4 = WNA16Scheme("compressed-tensors", 4, 16, zero_points=False, fp4=True)
    with pytest.raises(ValueError, match="compressed-tensors nvfp4 MoE experts are not supported"):
        SwiGLUExperts(2, 64, 32).hold_wna16(nvfp4)


def wna16_moe_launches() -> None:
    """bf16 launches at Qwen3-30B-A3B's expert shape (128 experts of 2048 x 768, top 8) in
    GPTQ int4 groups of 128 (act-order) and int8 per channel, decode- and prefill-sized, for
    the lowering test."""
    for bits, group, zeros in ((4, 128, True), (8, None, False)):
        bank = SwiGLUExperts(128, 2048, 768, kernels=layer_kernels("triton"))
        bank.hold_wna16(WNA16Scheme("gptq", bits, group, zero_points=zeros))
        if zeros:
            bank.input_perm = torch.zeros(128, 2048, dtype=torch.int32)
        for tokens in (1, 4096):
            indices = torch.randint(0, 128, (tokens, 8), generator=torch.Generator().manual_seed(0))
            x, weights = torch.empty(tokens, 2048, dtype=torch.bfloat16), torch.empty(tokens, 8)
            fused_experts(x, weights.to(torch.bfloat16), indices, **bank.fused_layout())


def test_packed_launches_lower_for_hopper():
    assert check_lowering("layers.test_wna16_moe:wna16_moe_launches", *FUSED_MOE_KERNELS)
