"""The one-launch router (heron.kernels.moe_route) against ``Routing.select``, the PyTorch
rule held to HF transformers' routers: every scoring, expert groups of sizes that are not
powers of two, DeepSeek-V3's correction bias (Triton interpreter on the CPU, tiny)."""

from __future__ import annotations

import pytest
import torch
from triton_lowering import check_lowering

from heron.kernels.moe_route import ROUTER_KERNEL_MAX_TOKENS, route_topk, router_logits
from heron.layers.routing import Routing

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

ROUTINGS = {  # name: (experts, Routing)
    "qwen": (24, Routing(4, "softmax", renormalize=True)),
    "deepseek-v2 greedy": (64, Routing(6, "softmax", scaling=1.5)),
    "deepseek-v2 grouped": (160, Routing(6, "softmax", num_groups=8, topk_groups=3)),
    "deepseek-v3": (
        256,
        Routing(8, "sigmoid", renormalize=True, num_groups=8, topk_groups=4, scaling=2.5),
    ),
    "gpt-oss": (32, Routing(4, "softmax_of_topk")),
}


@pytest.mark.parametrize("name", sorted(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_route_topk_equals_the_torch_rule(name, dtype):
    num_experts, routing = ROUTINGS[name]
    g = torch.Generator().manual_seed(num_experts)
    logits = (torch.randn(5, num_experts, generator=g) * 2).to(dtype).to(DEVICE)
    bias = None
    if routing.scoring == "sigmoid":
        bias = (torch.randn(num_experts, generator=g) * 0.5).to(DEVICE)
    want_w, want_i = routing.select(logits, bias)
    got_w, got_i = route_topk(logits, bias, **routing.rule())
    assert torch.equal(got_i, want_i)
    assert got_w.dtype == want_w.dtype
    torch.testing.assert_close(got_w, want_w, rtol=2e-6 if dtype == torch.float32 else 1e-3, atol=0)


def test_route_topk_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="groups"):
        route_topk(
            torch.zeros(1, 10), None, top_k=2, scoring="softmax", renormalize=False,
            num_groups=3, topk_groups=1, scaling=1.0,
        )  # fmt: skip


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_router_logits_equal_the_fp32_product(dtype, with_bias):
    """HF DeepSeek's router product (``F.linear`` on the input cast to fp32), experts and a
    hidden size that do not fill the kernel's tiles."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 200, generator=g).to(dtype).to(DEVICE)
    weight = torch.randn(13, 200, generator=g).to(DEVICE)
    bias = torch.randn(13, generator=g).to(DEVICE) if with_bias else None
    want = torch.nn.functional.linear(
        x.double(), weight.double(), None if bias is None else bias.double()
    )
    torch.testing.assert_close(router_logits(x, weight, bias).double(), want, rtol=1e-5, atol=1e-5)
    many = x.new_zeros(ROUTER_KERNEL_MAX_TOKENS + 1, 200)  # cuBLAS's size
    assert router_logits(many, weight, bias).shape == (ROUTER_KERNEL_MAX_TOKENS + 1, 13)


def route_launches() -> None:
    """DeepSeek-V3's grouped sigmoid rule and gpt-oss's, and DeepSeek-V3's fp32 router
    product at its size, for the lowering test."""
    for num_experts, routing in (ROUTINGS["deepseek-v3"], ROUTINGS["gpt-oss"]):
        bias = torch.zeros(num_experts) if routing.scoring == "sigmoid" else None
        route_topk(torch.zeros(4, num_experts, dtype=torch.bfloat16), bias, **routing.rule())
    for tokens in (1, 64):
        router_logits(torch.zeros(tokens, 7168, dtype=torch.bfloat16), torch.zeros(256, 7168))


def test_route_launches_lower_for_hopper():
    kernels = (
        "heron.kernels.moe_route:_route_kernel",
        "heron.kernels.moe_route:_router_logits_kernel",
    )
    assert check_lowering("layers.test_moe_route:route_launches", *kernels) == 4
