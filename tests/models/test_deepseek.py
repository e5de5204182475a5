"""DeepSeek-V2 (plain q_proj, interleaved rope) and V3 (q_lora, YaRN with mscale) against HF
transformers on tiny random models with every layer dense: greedy tokens of a batch, chunked
prefill with prefix hits, preemption, prompt logprobs, and the plan's latent groups."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from heron import LLM, SamplingParams
from heron.cache import LatentAttentionSpec
from heron.models.deepseek import mla_softmax_scale

from tiny_models import (
    SHARED_PREFIX_PROMPTS,
    cuda_graph_llm,
    greedy_tokens,
    hf_greedy,
    make_tokenizer,
    prompt_logprob_error,
    rerun_from_prefix_cache,
)

MAX_NEW = 16
PROMPTS = SHARED_PREFIX_PROMPTS
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    first_k_dense_replace=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    eos_token_id=0,
    bos_token_id=0,
    pad_token_id=0,
)


def v2_config() -> tf.DeepseekV2Config:
    return tf.DeepseekV2Config(**COMMON, q_lora_rank=None)


def v3_config() -> tf.DeepseekV3Config:
    # YaRN stretching a 64-token context 8x; mscale != mscale_all_dim, so both the rope's
    # attention factor and the softmax scale's mscale ** 2 matter.
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    }
    return tf.DeepseekV3Config(**COMMON, q_lora_rank=24, rope_parameters=rope, num_mtp_layers=0)


def randomize(module: torch.nn.Module) -> None:
    """HF's init is small; scale it up so logits are decisive."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.1)


@pytest.fixture(scope="module", params=["v2", "v3"])
def deepseek(request, tmp_path_factory):
    """The saved tiny model, its HF eager reference and HF's greedy continuations."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(f"deepseek_{request.param}")
    config = v2_config() if request.param == "v2" else v3_config()
    cls = tf.DeepseekV2ForCausalLM if request.param == "v2" else tf.DeepseekV3ForCausalLM
    model = cls(config)
    randomize(model)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    hf = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return path, hf, hf_greedy(hf, PROMPTS, MAX_NEW)


def test_softmax_scale_is_hfs(deepseek):
    _, hf, _ = deepseek
    assert mla_softmax_scale(hf.config) == hf.model.layers[0].self_attn.scaling


def test_plan_has_a_latent_group_and_cache_group(deepseek):
    path, _, _ = deepseek
    runner = LLM(str(path), max_model_len=128).engine.runner
    groups = runner.plan.describe()["groups"]
    assert runner.plan.fallback_reason is None
    assert [(g["builder"], g["layers"]) for g in groups] == [
        (
            "LatentAttentionBuilder(reference)",
            ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
        )
    ]
    assert runner.cache_specs == [LatentAttentionSpec(16, torch.float32, 32, 8)]


def test_greedy_batch_equals_hf(deepseek):
    path, _, refs = deepseek
    llm = LLM(str(path), max_model_len=128, enable_prefix_caching=False)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == refs


def test_chunked_prefill_and_prefix_caching(deepseek):
    path, _, refs = deepseek
    llm = LLM(str(path), max_model_len=128, max_num_batched_tokens=16)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == refs
    rerun_from_prefix_cache(llm, PROMPTS, GREEDY, refs)


def test_preemption_under_memory_pressure(deepseek):
    path, _, refs = deepseek
    llm = LLM(str(path), max_model_len=80, num_kv_blocks=7, enable_prefix_caching=False)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == refs
    assert llm.engine.scheduler.num_preemptions > 0


def test_prompt_logprobs_match_hf(deepseek):
    path, hf, _ = deepseek
    llm = LLM(str(path), max_model_len=128, max_num_batched_tokens=16)
    assert prompt_logprob_error(llm, hf, PROMPTS[3]) <= 1e-3


def test_moe_layers_are_refused_by_name(tmp_path):
    config = tf.DeepseekV2Config(**{**COMMON, "first_k_dense_replace": 1}, n_routed_experts=4)
    tf.DeepseekV2ForCausalLM(config).save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="layer 1 .* mixture-of-experts"):
        LLM(str(tmp_path), max_model_len=64)


def test_triton_operator_equals_hf(deepseek):
    """The CUDA default latent operator, its decode kernel run by Triton's interpreter, with a
    chunked prefill mixed into decode steps."""
    path, hf, _ = deepseek
    prompts, new = [PROMPTS[0], PROMPTS[2]], 6
    llm = LLM(str(path), attention_backend="triton", max_model_len=128, max_num_batched_tokens=16)
    assert [g.builder.describe() for g in llm.engine.runner.plan.groups] == [
        "TritonMLABuilder(triton)"
    ]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    assert greedy_tokens(llm, prompts, params) == hf_greedy(hf, prompts, new)


@pytest.mark.gpu
def test_greedy_on_cuda_with_graphs(deepseek):
    """The Triton latent operator inside captured decode graphs (its plan made on replay)."""
    path, _, refs = deepseek
    llm = cuda_graph_llm(path)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == refs
