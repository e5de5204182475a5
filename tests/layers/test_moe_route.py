"""The one-launch router (heron.kernels.moe_route) against ``Routing.select``, the PyTorch
rule held to HF transformers' routers: every scoring, expert groups of sizes that are not
powers of two, DeepSeek-V3's correction bias (Triton interpreter on the CPU, tiny)."""

from __future__ import annotations

import pytest
import torch
from triton_lowering import check_lowering

from heron.kernels.moe_route import route_topk
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


def route_launches() -> None:
    """DeepSeek-V3's grouped sigmoid rule and gpt-oss's, for the lowering test."""
    for num_experts, routing in (ROUTINGS["deepseek-v3"], ROUTINGS["gpt-oss"]):
        bias = torch.zeros(num_experts) if routing.scoring == "sigmoid" else None
        route_topk(torch.zeros(4, num_experts, dtype=torch.bfloat16), bias, **routing.rule())


def test_route_launches_lower_for_hopper():
    kernel = "heron.kernels.moe_route:_route_kernel"
    assert check_lowering("layers.test_moe_route:route_launches", kernel) == 2
