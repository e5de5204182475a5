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
from heron.layers.mlp import GatedMLP
from heron.layers.moe import SparseMoE

from tiny_models import cuda_graph_llm, greedy_tokens, hf_greedy, hf_prompt_logprobs, make_tokenizer

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


@pytest.mark.gpu
def test_greedy_on_cuda_with_graphs(qwen_moe):
    """The fused Triton MoE inside the decode graphs, fp32 (exact greedy parity)."""
    _, path, _, refs = qwen_moe
    llm = cuda_graph_llm(path)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == refs
