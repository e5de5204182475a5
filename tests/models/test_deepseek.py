"""DeepSeek-V2 (plain q_proj, interleaved rope, softmax routing limited to groups) and V3
(q_lora, YaRN with mscale, sigmoid routing with correction bias over grouped top-k) against HF
transformers on tiny random models (one dense layer, one MoE layer with shared experts): greedy
tokens of a batch, chunked prefill with prefix hits, preemption, prompt logprobs, the plan's
latent groups."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from execution.view_replay import replay_views

from heron import LLM, SamplingParams
from heron.cli import main
from heron.layers.fp8 import FP8, dequantize, quantize
from heron.layers.linear import Linear
from heron.layers.moe import SwiGLUExperts
from heron.layers.rotary import MLARotary, RotaryEmbedding
from heron.models.deepseek import mla_softmax_scale

from tiny_models import (
    FP8_PROJECTIONS,
    SHARED_PREFIX_PROMPTS,
    cuda_graph_llm,
    first_divergence_is_a_near_tie,
    greedy_tokens,
    hf_greedy,
    hf_on_saved_weights,
    hf_on_weights,
    prompt_logprob_error,
    rerun_from_prefix_cache,
    save_with_hf_reference,
    write_fp8_checkpoint,
)

MAX_NEW = 16
PROMPTS = SHARED_PREFIX_PROMPTS
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=4,
    topk_group=2,
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
    return tf.DeepseekV2Config(
        **COMMON,
        q_lora_rank=None,
        n_shared_experts=2,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.5,
    )


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
    return tf.DeepseekV3Config(
        **COMMON,
        q_lora_rank=24,
        rope_parameters=rope,
        num_mtp_layers=0,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )


def randomize(module: torch.nn.Module) -> None:
    """HF's init is small; scale it up so logits are decisive. V3's correction bias (a buffer)
    gets values that change which experts win."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.1)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """Factory: the saved tiny model of a variant, its HF eager reference and HF's greedy
    continuations (built once per module)."""
    cache = {}

    def get(variant: str):
        if variant not in cache:
            torch.manual_seed(0)
            path = tmp_path_factory.mktemp(f"deepseek_{variant}")
            v2 = variant == "v2"
            model = (tf.DeepseekV2ForCausalLM if v2 else tf.DeepseekV3ForCausalLM)(
                v2_config() if v2 else v3_config()
            )
            randomize(model)
            cache[variant] = save_with_hf_reference(model, path, PROMPTS, MAX_NEW)
        return cache[variant]

    return get


@pytest.fixture(params=["v2", "v3"])
def deepseek(request, saved_models):
    return saved_models(request.param)


@pytest.fixture
def deepseek_v3(saved_models):
    """V3 alone, for the engine paths (chunks, prefix hits, preemption) that do not depend
    on the attention's variant."""
    return saved_models("v3")


def test_softmax_scale_is_hfs(deepseek):
    _, hf, _ = deepseek
    assert mla_softmax_scale(hf.config) == hf.model.layers[0].self_attn.scaling


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_equals_hfs(interleave):
    """V3's rope in both layouts (V2's is the interleaved one, as complex products)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

    config = v3_config()
    config.rope_interleave = interleave
    rotary = MLARotary(RotaryEmbedding(config, config.qk_rope_head_dim, 128), interleave)
    positions = torch.tensor([0, 5, 77, 127])
    q, k = torch.randn(4, 3, 8), torch.randn(4, 1, 8)
    cos, sin = hf_v3.DeepseekV3RotaryEmbedding(config)(q, positions[None])
    apply = hf_v3.apply_rotary_pos_emb_interleave if interleave else hf_v3.apply_rotary_pos_emb
    want = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    for got, ref in zip(rotary(positions, q, k), want):
        torch.testing.assert_close(got, ref[0].transpose(0, 1))


def test_plan_shows_the_latent_group_and_cache_group(deepseek_v3, capsys):
    path, _, _ = deepseek_v3
    assert main(["plan", "--model", str(path), "--max-model-len", "128", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert plan["fallback_reason"] is None
    assert [(g["builder"], g["layers"], g["cache_group"]) for g in plan["groups"]] == [
        ("LatentAttentionBuilder(reference)", layers, 0)
    ]
    (cache,) = plan["cache_groups"]
    assert cache["spec"] == {
        "kind": "LatentAttentionSpec",
        "block_size": 16,
        "dtype": "float32",
        "kv_lora_rank": 32,
        "rope_dim": 8,
    }
    assert cache["layers"] == layers
    assert main(["plan", "--model", str(path), "--max-model-len", "128"]) == 0
    assert "latent attention: 16-token blocks, latent 32 + rope 8" in capsys.readouterr().out


def test_fp8_kv_cache_is_refused_by_name(deepseek_v3):
    """Latent caches have no FP8 form: the switch is refused, not ignored."""
    path, _, _ = deepseek_v3
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported for latent"):
        LLM(str(path), max_model_len=128, kv_cache_dtype="fp8")


def test_greedy_batch_equals_hf(deepseek):
    path, _, refs = deepseek
    llm = LLM(str(path), max_model_len=128, enable_prefix_caching=False)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == refs


def test_chunked_prefill_and_prefix_caching(deepseek_v3):
    path, _, refs = deepseek_v3
    llm = LLM(str(path), max_model_len=128, max_num_batched_tokens=16)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == refs
    rerun_from_prefix_cache(llm, PROMPTS, GREEDY, refs)


def test_preemption_under_memory_pressure(deepseek_v3):
    path, _, refs = deepseek_v3
    llm = LLM(str(path), max_model_len=80, num_kv_blocks=7, enable_prefix_caching=False)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == refs
    assert llm.engine.scheduler.num_preemptions > 0


def test_prompt_logprobs_match_hf(deepseek_v3):
    path, hf, _ = deepseek_v3
    llm = LLM(str(path), max_model_len=128, max_num_batched_tokens=16)
    assert prompt_logprob_error(llm, hf, PROMPTS[3]) <= 1e-3


def test_triton_operator_equals_hf(deepseek_v3):
    """The CUDA default latent operator, its decode kernel run by Triton's interpreter, with a
    chunked prefill mixed into decode steps."""
    path, hf, _ = deepseek_v3
    prompts, new = [PROMPTS[0], PROMPTS[2]], 6
    llm = LLM(str(path), attention_backend="triton", max_model_len=128, max_num_batched_tokens=16)
    assert [g.builder.describe() for g in llm.engine.runner.plan.groups] == [
        "TritonMLABuilder(triton)"
    ]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    assert greedy_tokens(llm, prompts, params) == hf_greedy(hf, prompts, new)


def test_verification_through_graph_buffers_equals_hf(deepseek_v3):
    """Decode and verification steps as their graphs replay them (emulated on the CPU, see
    ``execution.view_replay``) on the interpreted latent operator, whose decode kernel runs the
    verification rows (1 + k queries each, padded rows on the null block): HF's tokens."""
    path, hf, refs = deepseek_v3
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    llm = LLM(str(path), attention_backend="triton", max_model_len=128, speculative_config=spec)
    graphs = replay_views(llm)
    new = 6
    # the prompt ends in the model's own continuation, whose repeats the proposals find
    continued = PROMPTS[1] + refs[1][:12]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    got = greedy_tokens(llm, [PROMPTS[2], continued], params)
    assert got == [refs[2][:new], *hf_greedy(hf, [continued], new)]
    assert (2, 3) in graphs.replayed
    assert llm.spec_decode_stats.num_accepted_tokens > 0


@pytest.mark.gpu
def test_greedy_on_cuda_with_graphs(deepseek):
    """The Triton latent operator inside captured decode graphs (its plan made on replay)."""
    path, _, refs = deepseek
    llm = cuda_graph_llm(path)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == refs


@pytest.mark.gpu
def test_bf16_greedy_on_cuda_is_hfs_up_to_near_ties(deepseek):
    """bf16 with graphs, chunked prefill and prefix hits against HF's bf16 model: where the
    greedy tokens first differ, Heron's is in HF's top-5."""
    path, _, _ = deepseek
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=128,
              max_num_batched_tokens=32, num_kv_blocks=64, cuda_graph_max_bs=8)  # fmt: skip
    assert llm.engine.runner.graphs is not None
    runs = [greedy_tokens(llm, PROMPTS, GREEDY), greedy_tokens(llm, PROMPTS, GREEDY)]
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    for want, prompt, *got in zip(hf_greedy(hf, PROMPTS, MAX_NEW), PROMPTS, *runs):
        for tokens in got:
            assert first_divergence_is_a_near_tie(hf, prompt, tokens, want)


def test_fp8_weights_leave_the_absorbed_kv_b_proj_dense(deepseek_v3):
    """``quantization="fp8"``: every projection and expert but ``kv_b_proj`` (which the
    operator reads as a matrix) and the router is FP8; greedy equals HF on those weights
    dequantised."""
    path, hf, _ = deepseek_v3
    llm = LLM(str(path), max_model_len=128, quantization="fp8")
    kinds = {
        name: m.weight.dtype
        for name, m in llm.engine.runner.model.named_modules()
        if name.endswith(("kv_b_proj", "o_proj", "q_b_proj"))
    }
    assert kinds and all((t == torch.float32) == n.endswith("kv_b_proj") for n, t in kinds.items())
    projections = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", *FP8_PROJECTIONS}
    weights = {
        name: dequantize(*quantize(w))
        for name, w in hf.state_dict().items()
        if w.dim() == 2 and name.split(".")[-2] in projections
    }
    for name, w in hf.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, out, in]
            weights[name] = torch.stack([dequantize(*quantize(expert)) for expert in w])
    fp8_hf = hf_on_weights(path, weights)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == hf_greedy(fp8_hf, PROMPTS, MAX_NEW)


def test_block_wise_fp8_checkpoint_with_fp8_experts_equals_hf(deepseek_v3, tmp_path):
    """DeepSeek-V3's FP8 release in miniature: every projection and each expert's FP8 in
    16 x 16 tiles of ``weight_scale_inv`` (part-tiles over q_a's 24 and kv_a's 40 rows and q_b's
    24 columns). The experts hold their tiles as stored, ``kv_b_proj`` is dequantised (the
    operator absorbs it); greedy tokens equal HF's on the dequantised weights."""
    path, _, _ = deepseek_v3
    latent = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    weights = write_fp8_checkpoint(
        path, tmp_path / "fp8", "block-wise", block=(16, 16), projections=FP8_PROJECTIONS + latent
    )
    llm = LLM(str(tmp_path / "fp8"), max_model_len=128)
    model = llm.engine.runner.model
    banks = [m for m in model.modules() if isinstance(m, SwiGLUExperts)]
    assert banks and all(b.gate_up_proj.dtype == FP8 and b.weight_block == (16, 16) for b in banks)
    # 8 experts: 2 row tiles each for gate and up (32 rows), 4 column tiles of the hidden 64.
    assert all(b.gate_up_proj_scale.shape == (8, 4, 4) for b in banks)
    assert all(b.down_proj_scale.shape == (8, 4, 2) for b in banks)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    for name, m in linears.items():
        dense = name.endswith("kv_b_proj") or name.endswith("mlp.gate")  # the router
        assert (m.weight.dtype == torch.float32) == dense, name
    hf = hf_on_saved_weights(path, weights, tmp_path / "dequantised")
    assert greedy_tokens(llm, PROMPTS, GREEDY) == hf_greedy(hf, PROMPTS, MAX_NEW)
