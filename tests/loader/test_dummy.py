"""load_format="dummy": seeded random weights built from config.json alone."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from heron import LLM, SamplingParams
from heron.config import EngineConfig
from heron.layers.norm import RMSNorm

from tiny_models import BASE, DEEPSEEK, QWEN3_5, tiny_config

STD = 0.05
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def config_for(family: str) -> tf.PretrainedConfig:
    """Tiny configs covering the fill rules: biases (qwen2), qk-norm (qwen3), ``(1 + w)`` norms
    (gemma3), routers, experts and sinks (gpt-oss), stacked SwiGLU experts (qwen3_moe); and an
    MTP layer each (qwen3_5, deepseek_v3)."""
    if family == "gemma3":
        config = tf.Gemma3TextConfig(**BASE, head_dim=16, sliding_window=8)
    elif family == "gpt_oss":
        config = tf.GptOssConfig(
            **(BASE | {"intermediate_size": 32}),
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
        )
    elif family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            **BASE, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2
        )
    elif family == "qwen3_5":
        config = tf.Qwen3_5TextConfig(**QWEN3_5, mtp_num_hidden_layers=1)
    elif family == "deepseek_v3":
        config = tf.DeepseekV3Config(**DEEPSEEK, q_lora_rank=24, num_nextn_predict_layers=1)
    else:
        config = tiny_config(family)
    config.architectures = [ARCHITECTURES[family]]
    config.initializer_range = STD
    return config


@pytest.fixture
def dummy_dir(tmp_path):
    """Factory: a directory holding only ``config.json`` of ``family``."""

    def make(family: str):
        config_for(family).save_pretrained(tmp_path)
        assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
        return tmp_path

    return make


def dummy_llm(path, tokenizer_dir, seed: int = 0, **options) -> LLM:
    return LLM(
        str(path),
        tokenizer=str(tokenizer_dir),
        load_format="dummy",
        seed=seed,
        max_model_len=128,
        **options,
    )


def weights(llm: LLM) -> dict[str, torch.Tensor]:
    return dict(llm.engine.runner.model.named_parameters())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3", "gpt_oss", "qwen3_moe"])
def test_dummy_model_generates_with_the_configured_init(family, dummy_dir, tiny_model_dir):
    llm = dummy_llm(dummy_dir(family), tiny_model_dir("llama"))
    norms = assert_configured_init(llm.engine.runner.model)
    assert set(norms) == ({0.0} if family == "gemma3" else {1.0})
    outputs = llm.generate([[5, 6, 7], [9] * 20], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8]


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_dummy_weights_fill_the_mtp_head(family, dummy_dir, tiny_model_dir):
    """The MTP head (``method: "mtp"``) is built and filled apart from the target: by the same
    rules, and it proposes."""
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    llm = dummy_llm(dummy_dir(family), tiny_model_dir("llama"), speculative_config=mtp)
    neutral = 0.0 if family == "qwen3_5" else 1.0  # Qwen3.5's norms are (1 + w)
    assert set(assert_configured_init(llm.engine.draft_runner.model)) == {neutral}
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert llm.spec_decode_stats.num_draft_tokens > 0


def assert_configured_init(model: torch.nn.Module) -> list[float]:
    """Every parameter of ``model`` filled by the dummy rules; the neutral norm weights."""
    norms = {id(m.weight): 1.0 - m.weight_offset for m in model.modules() if isinstance(m, RMSNorm)}
    for name, p in model.named_parameters():
        if id(p) in norms:
            assert torch.all(p == norms[id(p)]), name
        elif p.dim() == 1:  # biases, sinks
            assert torch.all(p == 0), name
        else:  # projections, embeddings, routers, experts
            assert abs(p.std().item() - STD) < 0.1 * STD, name
            assert abs(p.mean().item()) < 0.1 * STD, name
    return list(norms.values())


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_routers_spread_tokens_over_experts(family, dummy_dir, tiny_model_dir):
    llm = dummy_llm(dummy_dir(family), tiny_model_dir("llama"))
    model = llm.engine.runner.model
    x = model.model.embed_tokens(torch.arange(64))
    for layer in model.model.layers:
        _, chosen = layer.mlp.gate(x)
        assert chosen.unique().numel() == layer.mlp.experts.num_experts


def test_same_seed_same_weights_other_seed_other_weights(dummy_dir, tiny_model_dir):
    path, tok = dummy_dir("qwen3"), tiny_model_dir("llama")
    first, again, other = (weights(dummy_llm(path, tok, seed)) for seed in (0, 0, 1))
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    matrices = [k for k in first if first[k].dim() > 1]
    assert not any(torch.equal(first[k], other[k]) for k in matrices)


def test_unknown_load_format_is_rejected_by_name():
    with pytest.raises(ValueError, match=r"load_format must be one of auto, dummy, got 'pt'"):
        EngineConfig(load_format="pt")


def test_dummy_without_tokenizer_files_asks_for_tokenizer(dummy_dir):
    path = dummy_dir("llama")
    with pytest.raises(ValueError, match="pass tokenizer="):
        LLM(str(path), load_format="dummy")
    with pytest.raises(ValueError, match="pass tokenizer="):
        EngineConfig(model=str(path), load_format="dummy")


def test_auto_still_demands_weight_files(dummy_dir, tiny_model_dir):
    with pytest.raises(ValueError, match=r"no \*\.safetensors checkpoint"):
        LLM(str(dummy_dir("llama")), tokenizer=str(tiny_model_dir("llama")))
