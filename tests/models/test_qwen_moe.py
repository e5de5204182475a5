"""Qwen3-MoE and Qwen2-MoE against HF transformers on tiny random models (fp32, CPU): greedy
tokens for a batch of prompts of different lengths, with chunked prefill and prefix caching,
and prompt logprobs; the checkpoints hold one tensor per expert, as ``save_pretrained`` and
the released checkpoints store them."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from safetensors import safe_open

from heron import LLM, SamplingParams
from heron.layers.fp8 import FP8, dequantize, quantize
from heron.layers.mlp import GatedMLP
from heron.layers.moe import SparseMoE, SwiGLUExperts

from tiny_models import (
    FP8_PROJECTIONS,
    cuda_graph_llm,
    greedy_tokens,
    hf_greedy,
    hf_on_saved_weights,
    hf_on_weights,
    hf_prompt_logprobs,
    make_tokenizer,
    prompt_logprob_error,
    write_fp8_checkpoint,
)

MAX_NEW = 16
# Different lengths; the first two share a 32-token prefix (two full blocks).
PROMPTS = [
    list(range(10, 42)) + [7, 8, 9],
    list(range(10, 42)) + [200, 201, 202, 203, 204],
    [3, 4, 5],
    [(i * 37) % 300 + 5 for i in range(50)],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    eos_token_id=0,
    bos_token_id=0,
    pad_token_id=0,
)


def tiny_config(family: str):
    if family == "qwen3_moe":  # q/k norm, head_dim other than hidden / heads, a dense layer
        return tf.Qwen3MoeConfig(**COMMON, head_dim=32, norm_topk_prob=True, mlp_only_layers=[1])
    # qkv bias, gated shared expert, unnormalised top-k, every second layer sparse
    return tf.Qwen2MoeConfig(
        **COMMON, shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=2
    )


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def qwen_moe(request, tmp_path_factory):
    """The saved tiny model, its HF eager reference and HF's greedy continuations."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(request.param), dtype=torch.float32)
    with torch.no_grad():  # HF's init is small: scale up so logits and routing are decisive
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.08 if p.dim() >= 2 else 0.02)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf, hf_greedy(hf, PROMPTS, MAX_NEW)


def test_checkpoint_holds_one_tensor_per_expert(qwen_moe):
    family, path, _, _ = qwen_moe
    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    sparse_layer = 0 if family == "qwen3_moe" else 1
    assert f"model.layers.{sparse_layer}.mlp.experts.7.gate_proj.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    llm = LLM(str(path), max_model_len=128)
    layers = llm.engine.runner.model.model.layers
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in layers]
    assert sparse == ([True, False, True] if family == "qwen3_moe" else [False, True, False])
    assert all(isinstance(layer.mlp, GatedMLP) for layer, s in zip(layers, sparse) if not s)
    gated = [layer.mlp.shared_expert_gate is not None for layer, s in zip(layers, sparse) if s]
    assert all(gated) == (family == "qwen2_moe")


def test_greedy_batch_with_chunked_prefill_and_prefix_caching(qwen_moe):
    """The batch at once, prompts chunked by 16 tokens alongside decodes; then again with
    their full blocks cached."""
    _, path, _, refs = qwen_moe
    llm = LLM(str(path), max_model_len=128, max_num_batched_tokens=16)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == refs
    # Again: every prompt's full blocks are now cached, only the rest is computed.
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == refs
    assert outputs[0].num_cached_tokens == 32


def test_prompt_logprobs_match_hf(qwen_moe):
    _, path, hf, _ = qwen_moe
    llm = LLM(str(path), max_model_len=128, max_num_batched_tokens=16)
    prompt = PROMPTS[3]
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    assert (got - hf_prompt_logprobs(hf, prompt)).abs().max().item() <= 1e-3


def _expert_banks(llm: LLM) -> list[SwiGLUExperts]:
    banks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SwiGLUExperts)]
    assert banks and all(b.gate_up_proj.dtype == b.down_proj.dtype == FP8 for b in banks)
    return banks


def test_fp8_experts_quantised_at_load_equal_hf_on_the_dequantised_weights(qwen_moe):
    """``quantization="fp8"``: every expert's gate, up and down rows get their own scale (as
    the projections, and Qwen2-MoE's one-row shared-expert gate, do); greedy tokens and prompt
    logprobs equal HF's on those weights dequantised."""
    _, path, hf, _ = qwen_moe
    llm = LLM(str(path), max_model_len=128, quantization="fp8")
    for bank in _expert_banks(llm):
        assert bank.gate_up_proj_scale.shape == (8, 64) and bank.down_proj_scale.shape == (8, 64)
    weights = {}
    for name, w in hf.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, out, in]
            weights[name] = torch.stack([dequantize(*quantize(expert)) for expert in w])
        elif w.dim() == 2 and name.split(".")[-2] in (*FP8_PROJECTIONS, "shared_expert_gate"):
            weights[name] = dequantize(*quantize(w))
    fp8_hf = hf_on_weights(path, weights)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == hf_greedy(fp8_hf, PROMPTS, MAX_NEW)
    assert prompt_logprob_error(llm, fp8_hf, PROMPTS[3]) <= 1e-3


def test_per_tensor_fp8_checkpoint_with_fp8_experts_equals_hf(qwen_moe, tmp_path):
    """A static per-tensor FP8 checkpoint, one tensor per expert (its ``weight_scale`` and
    ``input_scale`` too): each expert matrix's one scale repeats over its rows, the input
    scales are not used. Qwen2-MoE's one-row shared-expert gate stays in full precision."""
    _, path, _, _ = qwen_moe
    weights = write_fp8_checkpoint(path, tmp_path / "fp8", "per-tensor", ("shared_expert_gate",))
    llm = LLM(str(tmp_path / "fp8"), max_model_len=128)
    for bank in _expert_banks(llm):
        gate, up = bank.gate_up_proj_scale.chunk(2, dim=1)
        for scales in (gate, up, bank.down_proj_scale):
            assert (scales == scales[:, :1]).all() and scales.unique().numel() == 8
    hf = hf_on_saved_weights(path, weights, tmp_path / "dequantised")
    assert greedy_tokens(llm, PROMPTS, GREEDY) == hf_greedy(hf, PROMPTS, MAX_NEW)


@pytest.mark.gpu
def test_greedy_on_cuda_with_graphs(qwen_moe):
    """The fused Triton MoE inside the decode graphs, fp32 (exact greedy parity)."""
    _, path, _, refs = qwen_moe
    llm = cuda_graph_llm(path)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == refs


@pytest.mark.gpu
def test_block_wise_fp8_experts_on_cuda_with_graphs(qwen_moe, tmp_path):
    """The fused Triton MoE over FP8 16 x 16 tiles inside the decode graphs, fp32: the dense
    projections take their dequantised weights there, so parity with HF on the dequantised
    weights is exact."""
    _, path, _, _ = qwen_moe
    weights = write_fp8_checkpoint(
        path, tmp_path / "fp8", "block-wise", ("shared_expert_gate",), block=(16, 16)
    )
    llm = cuda_graph_llm(tmp_path / "fp8")
    assert _expert_banks(llm)
    hf = hf_on_saved_weights(path, weights, tmp_path / "dequantised")
    assert greedy_tokens(llm, PROMPTS, GREEDY) == hf_greedy(hf, PROMPTS, MAX_NEW)
