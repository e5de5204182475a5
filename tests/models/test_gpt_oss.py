"""gpt-oss against HF transformers on a tiny random model: greedy tokens, prompt logprobs, the
metadata plan (sliding and full layers in separate groups) and the MoE block alone."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from safetensors import safe_open
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from heron import LLM, SamplingParams
from heron.models.gpt_oss import gpt_oss_moe
from heron.ops.selector import layer_kernels

from tiny_models import (
    SHARED_PREFIX_PROMPTS,
    cuda_graph_llm,
    greedy_tokens,
    hf_greedy,
    prompt_logprob_error,
    rerun_from_prefix_cache,
    save_with_hf_reference,
)

WINDOW = 12
MAX_NEW = 20
# Three prompts longer than the window; the short one's generation crosses it.
PROMPTS = SHARED_PREFIX_PROMPTS
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def tiny_config() -> tf.GptOssConfig:
    return tf.GptOssConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        max_position_embeddings=512,
        # Yarn stretching a 64-token original context 8x: its frequencies and attention
        # factor both matter at the positions tested.
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )


def randomize(module: torch.nn.Module) -> None:
    """HF's init is small; scale it up so logits are not near-uniform and routing is decisive,
    with random non-zero sinks and biases."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            elif p.dim() >= 2:  # matrices, and the stacked expert matrices
                p.normal_(0.0, 0.08)
            else:
                p.normal_(0.0, 0.1)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """The saved tiny model, its HF eager reference and HF's greedy continuations."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt_oss")
    model = tf.GptOssForCausalLM(tiny_config())
    randomize(model)
    return save_with_hf_reference(model, path, PROMPTS, MAX_NEW)


def _greedy_tokens(llm: LLM) -> list[list[int]]:
    return greedy_tokens(llm, PROMPTS, GREEDY)


def test_checkpoint_layout_is_what_the_loader_maps(gpt_oss):
    """save_pretrained writes the experts fused and input-major, under the module's names."""
    path, _, _ = gpt_oss
    with safe_open(path / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"F32"}
    experts = "model.layers.0.mlp.experts."
    assert shapes[experts + "gate_up_proj"] == (4, 64, 64)
    assert shapes[experts + "gate_up_proj_bias"] == (4, 64)
    assert shapes[experts + "down_proj"] == (4, 32, 64)
    assert shapes[experts + "down_proj_bias"] == (4, 64)
    assert shapes["model.layers.0.mlp.router.bias"] == (4,)
    assert shapes["model.layers.0.self_attn.sinks"] == (4,)


def test_plan_has_one_group_per_window(gpt_oss):
    path, _, _ = gpt_oss
    plan = LLM(str(path), max_model_len=128).engine.runner.plan
    assert plan.fallback_reason is None
    assert len(plan.describe()["groups"]) == 2
    by_window = {g.builder.sliding_window: g.layers for g in plan.groups}
    assert by_window == {
        WINDOW: ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"],
        None: ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"],
    }


def test_greedy_batch_equals_hf(gpt_oss):
    path, _, refs = gpt_oss
    llm = LLM(str(path), max_model_len=128, enable_prefix_caching=False)
    assert _greedy_tokens(llm) == refs


def test_chunked_prefill_and_prefix_caching(gpt_oss):
    path, _, refs = gpt_oss
    llm = LLM(str(path), max_model_len=128, max_num_batched_tokens=16)
    assert _greedy_tokens(llm) == refs
    rerun_from_prefix_cache(llm, PROMPTS, GREEDY, refs)


def test_preemption_under_memory_pressure(gpt_oss):
    path, _, refs = gpt_oss
    # 7 usable blocks of 16 tokens; the batch needs about 14 to run at once.
    llm = LLM(str(path), max_model_len=112, num_kv_blocks=8, enable_prefix_caching=False)
    assert _greedy_tokens(llm) == refs
    assert llm.engine.scheduler.num_preemptions > 0


def test_triton_operator_equals_hf(gpt_oss):
    """The CUDA default operator run by Triton's interpreter on the CPU, on every layer: sinks
    in the extend and decode kernels, sliding and full layers, chunked prefill mixed with
    decode. Fewer, shorter requests than the other tests (the interpreter is slow)."""
    path, hf, _ = gpt_oss
    prompts, new = [PROMPTS[0], PROMPTS[2], PROMPTS[3][:30]], 10
    llm = LLM(str(path), attention_backend="triton", max_model_len=128, max_num_batched_tokens=32)
    plan = llm.engine.runner.plan
    assert {g.builder.backend for g in plan.groups} == {"triton"}
    assert len(plan.groups) == 2
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    assert greedy_tokens(llm, prompts, params) == hf_greedy(hf, prompts, new)


def test_prompt_logprobs_match_hf(gpt_oss):
    path, hf, _ = gpt_oss
    llm = LLM(str(path), max_model_len=128, max_num_batched_tokens=16)
    assert prompt_logprob_error(llm, hf, PROMPTS[3]) <= 1e-3


@pytest.mark.parametrize("path", ["routed", "sparse"])
def test_moe_block_equals_hf(path):
    """Heron's MoE block on random input, weights copied from HF's GptOssMLP (same names).

    The input is large enough that the SwiGLU clamps bite; ``sparse`` is the experts' reference
    (the CPU path, which tests/layers/test_triton_moe.py holds the Triton one to) on the
    router's choice, ``routed`` the block's own forward.
    """
    torch.manual_seed(1)
    config = tiny_config()
    hf = GptOssMLP(config)
    randomize(hf)
    moe = gpt_oss_moe(
        config.hidden_size,
        config.intermediate_size,
        config.num_local_experts,
        config.num_experts_per_tok,
        7.0,
        layer_kernels("torch"),
    )
    # The checkpoint's router is the block's gate (GptOssForCausalLM.checkpoint_renames).
    moe.load_state_dict({k.replace("router.", "gate."): v for k, v in hf.state_dict().items()})
    x = torch.randn(37, config.hidden_size) * 8
    with torch.no_grad():
        want = hf(x[None])[0][0]
        gate_up = torch.einsum("th,ehi->eti", x, hf.experts.gate_up_proj)
        assert gate_up.abs().max() > 2 * moe.experts.limit  # the clamps are exercised
        if path == "routed":
            got = moe(x)
        else:
            got = moe.experts.forward_sparse(x, *moe.gate(x))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_greedy_on_cuda_with_graphs(gpt_oss):
    """Sinks and windows on the Triton operator, the Triton MoE inside the graphs."""
    path, _, refs = gpt_oss
    llm = cuda_graph_llm(path)
    assert {g.builder.backend for g in llm.engine.runner.plan.groups} == {"triton"}
    assert _greedy_tokens(llm) == refs
