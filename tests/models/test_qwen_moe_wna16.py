"""Qwen-MoE checkpoints of packed integer weights (GPTQ with and without act-order, AWQ,
compressed-tensors), one tensor per expert as their writers store them: the experts held packed in stacks, greedy tokens and
prompt logprobs against HF transformers running the same weights dequantised in fp32 as a plain
checkpoint; the fused MoE kernels reading the packed stacks through the whole model."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from wna16_checkpoints import MOE_SHAPE, write_checkpoint

from heron import LLM, SamplingParams
from heron.layers.moe import SparseMoE, SwiGLUExperts
from heron.ops import selector
from heron.platforms import CpuPlatform

from tiny_models import (
    check_greedy_and_logprobs,
    greedy_tokens,
    hf_greedy,
    hf_on_saved_weights,
    save_random_model,
)

PROMPTS = [list(range(10, 40)), [5, 6, 7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Qwen3-MoE (q/k norm, a dense layer) and Qwen2-MoE (qkv bias, a gated shared expert)."""
    root = tmp_path_factory.mktemp("qwen_moe")
    configs = {
        "qwen3_moe": tf.Qwen3MoeConfig(
            **MOE_SHAPE, head_dim=32, norm_topk_prob=True, mlp_only_layers=[1]
        ),
        "qwen2_moe": tf.Qwen2MoeConfig(**MOE_SHAPE, shared_expert_intermediate_size=64),
    }
    return {name: save_random_model(config, root / name) for name, config in configs.items()}


def _banks(llm: LLM) -> list[SwiGLUExperts]:
    banks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SwiGLUExperts)]
    assert banks
    return banks


CASES = [
    ("qwen3_moe", "gptq", dict(bits=4, group_size=32, sym=False, desc_act=False)),
    ("qwen3_moe", "gptq", dict(bits=4, group_size=32, sym=True, desc_act=True)),
    ("qwen2_moe", "gptq", dict(bits=8, group_size=32, sym=True, desc_act=False)),
    ("qwen2_moe", "awq", dict(group_size=32)),
    ("qwen3_moe", "compressed-tensors", dict(group_size=32, sym=True)),
]


@pytest.mark.parametrize(
    "family, fmt, opts",
    CASES,
    ids=[f"{c[0]}-{c[1]}{'-act-order' * c[2].get('desc_act', 0)}" for c in CASES],
)
def test_experts_held_packed_and_equal_hf(family, fmt, opts, models, tmp_path):
    src = models[family]
    weights = write_checkpoint(src, tmp_path / "q", fmt, **opts)
    assert any(".experts.7.down_proj." in name for name in weights)
    llm = LLM(str(tmp_path / "q"), max_model_len=128, max_num_batched_tokens=16)
    bits = opts.get("bits", 4)
    for bank in _banks(llm):  # as packed as the file: bits / 32 words a weight
        assert bank.gate_up_proj is None and bank.down_proj is None
        assert bank.gate_up_proj_qweight.shape == (8, 128, 64 * bits // 32)
        assert bank.down_proj_qweight.shape == (8, 64, 64 * bits // 32)
        assert bank.gate_up_proj_scales.shape == (8, 128, 2)
        assert bank.gate_up_proj_g_idx is None  # used and dropped
        assert (bank.input_perm is not None) == bool(opts.get("desc_act"))
    for moe in (m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)):
        assert moe.gate.weight is not None  # the router stays in full precision
        if moe.shared_expert is not None:  # Qwen2-MoE's: packed linears, its gate not
            assert moe.shared_expert.down_proj.wna16 and moe.shared_expert_gate.wna16 is None
    hf = hf_on_saved_weights(src, weights, tmp_path / "dequantised")
    check_greedy_and_logprobs(llm, hf, PROMPTS, GREEDY)


def test_fused_kernels_through_the_model_equal_hf(models, tmp_path, monkeypatch):
    """The whole model on the Triton kernels (interpreted, fp32): the fused MoE reading the
    packed experts, the packed linear kernels for the rest."""
    triton_set = selector.layer_kernels("triton")
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["gate_up"].dtype)
        return triton_set.fused_experts(*args, **kwargs)

    kernels = selector.TORCH_KERNELS.__class__(
        "wna16-moe", fused_experts=counted, wna16_mm=triton_set.wna16_mm
    )
    monkeypatch.setitem(selector.LAYER_KERNELS, "wna16-moe", lambda: kernels)
    monkeypatch.setattr(CpuPlatform, "layer_kernels", lambda self: "wna16-moe")
    src = models["qwen2_moe"]
    opts = dict(bits=4, group_size=32, sym=True, desc_act=False)
    weights = write_checkpoint(src, tmp_path / "q", "gptq", **opts)
    llm = LLM(str(tmp_path / "q"), max_model_len=128, enable_prefix_caching=False)
    hf = hf_on_saved_weights(src, weights, tmp_path / "dequantised")
    prompts, params = [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert greedy_tokens(llm, prompts, params) == hf_greedy(hf, prompts, params.max_tokens)
    assert calls and set(calls) == {torch.int32}


def test_dummy_weights_quantised_to_the_scheme(models, tmp_path):
    """``load_format="dummy"`` (the benchmarks' shapes): random experts quantised to the
    checkpoint's scheme, every projection packed."""
    write_checkpoint(models["qwen3_moe"], tmp_path / "q", "gptq", bits=4, group_size=32,
                     sym=True, desc_act=False)  # fmt: skip
    llm = LLM(str(tmp_path / "q"), max_model_len=128, load_format="dummy")
    assert all(b.down_proj_qweight.dtype == torch.int32 for b in _banks(llm))
    layer = llm.engine.runner.model.model.layers[0]
    assert layer.self_attn.o_proj.wna16 and layer.mlp.gate.weight is not None
    assert len(greedy_tokens(llm, PROMPTS, GREEDY)[0]) == GREEDY.max_tokens
