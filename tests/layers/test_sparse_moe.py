"""The sparse MoE pieces against HF transformers (fp32, CPU): each family's routing against its
HF router on the same weights, and whole blocks (routed experts, shared experts and their gate)
against HF's blocks, their weights loaded through Heron's loader in both checkpoint forms
(HF's stacked expert tensors and one tensor per expert)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch import nn
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe, DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeSparseMoeBlock,
    Qwen3MoeTopKRouter,
)

from heron.layers.moe import SparseMoE
from heron.layers.routing import Routing, TopKRouter
from heron.loader.weights import load_weights
from heron.models.common import PACKED_MODULES
from heron.ops.selector import layer_kernels

HIDDEN, EXPERTS, TOP_K, TOKENS = 32, 16, 4, 41
COMMON = dict(hidden_size=HIDDEN, moe_intermediate_size=24, num_experts_per_tok=TOP_K)


def qwen3_config(norm: bool) -> tf.Qwen3MoeConfig:
    return tf.Qwen3MoeConfig(**COMMON, num_experts=EXPERTS, norm_topk_prob=norm)


def qwen2_config() -> tf.Qwen2MoeConfig:
    return tf.Qwen2MoeConfig(
        **COMMON, num_experts=EXPERTS, norm_topk_prob=True, shared_expert_intermediate_size=40
    )


def deepseek_v2_config(method: str) -> tf.DeepseekV2Config:
    return tf.DeepseekV2Config(
        **COMMON,
        n_routed_experts=EXPERTS,
        n_shared_experts=2,
        topk_method=method,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    )


def deepseek_v3_config(norm: bool = True) -> tf.DeepseekV3Config:
    return tf.DeepseekV3Config(
        **COMMON,
        n_routed_experts=EXPERTS,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
    )


def randomize(module: nn.Module, seed: int = 0) -> None:
    """Decisive random weights (HF's init is zeros or tiny); a correction bias large enough to
    change DeepSeek-V3's choice."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in [*module.parameters(), *module.buffers()]:
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() >= 2 else 0.5))


def by_expert(weights: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing with each token's experts in index order (HF does not always sort)."""
    indices, order = indices.sort(dim=-1)
    return weights.gather(1, order), indices


def heron_router(hf: nn.Module, routing: Routing, bias: bool = False) -> TopKRouter:
    router = TopKRouter(HIDDEN, EXPERTS, routing, bias=bias)
    state = dict(hf.state_dict())  # e_score_correction_bias is an HF buffer, a parameter here
    router.load_state_dict(state)
    return router


CASES = {
    "qwen3": lambda: (Qwen3MoeTopKRouter(qwen3_config(False)), Routing.qwen(qwen3_config(False))),
    "qwen3-norm": lambda: (Qwen3MoeTopKRouter(qwen3_config(True)), Routing.qwen(qwen3_config(True))),
    "gpt-oss": lambda: (
        GptOssTopKRouter(tf.GptOssConfig(**COMMON, num_local_experts=EXPERTS)),
        Routing(TOP_K, "softmax_of_topk"),
    ),
    "deepseek-v2-greedy": lambda: (
        DeepseekV2TopkRouter(deepseek_v2_config("greedy")),
        Routing.deepseek_v2(deepseek_v2_config("greedy")),
    ),
    "deepseek-v2-group-limited": lambda: (
        DeepseekV2TopkRouter(deepseek_v2_config("group_limited_greedy")),
        Routing.deepseek_v2(deepseek_v2_config("group_limited_greedy")),
    ),
    "deepseek-v3": lambda: (
        DeepseekV3TopkRouter(deepseek_v3_config()),
        Routing.deepseek_v3(deepseek_v3_config()),
    ),
    "deepseek-v3-unnormalized": lambda: (
        DeepseekV3TopkRouter(deepseek_v3_config(False)),
        Routing.deepseek_v3(deepseek_v3_config(False)),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_routing_equals_hf(case):
    hf, routing = CASES[case]()
    randomize(hf)
    router = heron_router(hf, routing, bias=case == "gpt-oss")
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, want_weights, want_indices = hf(x)
        got_weights, got_indices = router(x)
    want_weights, want_indices = by_expert(want_weights, want_indices)
    got_weights, got_indices = by_expert(got_weights, got_indices)
    assert torch.equal(got_indices, want_indices)
    torch.testing.assert_close(got_weights, want_weights, rtol=1e-6, atol=1e-7)
    if routing.num_groups > 1:
        # The group limit changes some token's choice (so the test exercises it).
        plain = Routing(TOP_K, routing.scoring, scaling=routing.scaling, fp32_logits=True)
        assert not torch.equal(by_expert(*heron_router(hf, plain).forward(x))[1], got_indices)


def test_routing_rejects_bad_rules():
    with pytest.raises(ValueError, match="scoring"):
        Routing(2, "softplus")
    with pytest.raises(ValueError, match="topk_groups"):
        Routing(2, num_groups=4, topk_groups=5)
    with pytest.raises(ValueError, match="equal groups"):
        TopKRouter(HIDDEN, 10, Routing(2, num_groups=4, topk_groups=2))
    with pytest.raises(ValueError, match="top_k"):
        TopKRouter(HIDDEN, 4, Routing(5))
    with pytest.raises(ValueError, match="topk_method"):
        Routing.deepseek_v2(deepseek_v2_config("noaux_tc"))


class Holder(nn.Module):
    """A block under the name ``mlp`` with the decoder models' packed-projection map."""

    packed_modules = PACKED_MODULES

    def __init__(self, mlp: nn.Module, renames: dict[str, str] | None = None) -> None:
        super().__init__()
        self.mlp = mlp
        self.checkpoint_renames = renames or {}


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's stacked expert tensors split as checkpoints store them, one per expert."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e, (gate, up) in enumerate(t.chunk(2) for t in tensor):
                out[f"{prefix}{e}.gate_proj.weight"] = gate
                out[f"{prefix}{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            out.update({f"{prefix}{e}.down_proj.weight": t for e, t in enumerate(tensor)})
        else:
            out[name] = tensor
    return out


BLOCKS = {
    "qwen3-moe": lambda: (Qwen3MoeSparseMoeBlock(qwen3_config(True)), SparseMoE.qwen(qwen3_config(True)), {}),
    "qwen2-moe-gated-shared": lambda: (Qwen2MoeSparseMoeBlock(qwen2_config()), SparseMoE.qwen(qwen2_config()), {}),
    "deepseek-v2": lambda: (
        DeepseekV2Moe(deepseek_v2_config("group_limited_greedy")),
        SparseMoE.deepseek(deepseek_v2_config("group_limited_greedy")),
        {"shared_experts": "shared_expert"},
    ),
    "deepseek-v3": lambda: (
        DeepseekV3MoE(deepseek_v3_config()),
        SparseMoE.deepseek(deepseek_v3_config()),
        {"shared_experts": "shared_expert"},
    ),
}  # fmt: skip


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("block", list(BLOCKS))
def test_block_equals_hf(block, layout):
    hf, moe, renames = BLOCKS[block]()
    randomize(hf, seed=2)
    state = {f"mlp.{k}": v for k, v in hf.state_dict().items()}
    load_weights(
        Holder(moe, renames), (per_expert(state) if layout == "per_expert" else state).items()
    )
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(x[None])[0]
        got = moe(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_block_on_interpreted_triton_kernels():
    """The Qwen2-MoE block (gated shared expert) with the Triton kernel set, run by the
    interpreter: the fused experts inside the block equal HF's block."""
    hf = Qwen2MoeSparseMoeBlock(qwen2_config())
    randomize(hf, seed=4)
    moe = SparseMoE.qwen(qwen2_config(), layer_kernels("triton"))
    load_weights(Holder(moe), ((f"mlp.{k}", v) for k, v in hf.state_dict().items()))
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), hf(x[None])[0], rtol=1e-5, atol=1e-5)


def test_loader_names_missing_and_unknown_experts():
    config = qwen3_config(True)
    state = per_expert(
        {f"mlp.{k}": v for k, v in Qwen3MoeSparseMoeBlock(config).state_dict().items()}
    )
    del state["mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match="missing weights for: mlp.experts.gate_up_proj"):
        load_weights(Holder(SparseMoE.qwen(config)), state.items())
    state["mlp.experts.5.up_proj.weight"] = state["mlp.experts.4.up_proj.weight"]
    state["mlp.experts.16.down_proj.weight"] = state["mlp.experts.4.down_proj.weight"]
    with pytest.raises(ValueError, match="expert 16 is out of range"):
        load_weights(Holder(SparseMoE.qwen(config)), state.items())
    del state["mlp.experts.16.down_proj.weight"]
    state["mlp.experts.3.w1.weight"] = state["mlp.experts.4.down_proj.weight"]
    with pytest.raises(ValueError, match="'mlp.experts.3.w1.weight' has no parameter"):
        load_weights(Holder(SparseMoE.qwen(config)), state.items())
