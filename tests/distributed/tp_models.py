"""Tiny models whose shapes exercise tensor-parallel sharding (the CPU and GPU tests share
them)."""

from __future__ import annotations

import transformers as tf

from tiny_models import BASE, DEEPSEEK, QWEN3_5

SLIDING, FULL = "sliding_attention", "full_attention"
QWEN3_5_EXPERTS = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)


def tiny_config(family: str) -> tf.PretrainedConfig:
    """Tiny models whose shapes test the sharding: split and shared KV heads, a vocabulary that
    two ranks do not divide evenly, both expert layouts, latent attention, gated delta rule."""
    if family == "llama":  # one KV head: both ranks hold it
        return tf.LlamaConfig(**(BASE | dict(num_key_value_heads=1)), tie_word_embeddings=False)
    if family == "qwen3":  # qk-norm, head_dim apart from hidden / heads, tied, 321 tokens
        return tf.Qwen3Config(
            **(BASE | dict(vocab_size=321)), head_dim=32, tie_word_embeddings=True
        )
    if family == "gemma3":
        return tf.Gemma3TextConfig(
            **(BASE | dict(num_hidden_layers=4)),
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=12,
            layer_types=[SLIDING, FULL] * 2,
            final_logit_softcapping=15.0,
        )
    if family == "gpt_oss":  # sinks, biases everywhere, interleaved input-major experts
        return tf.GptOssConfig(
            **(BASE | dict(intermediate_size=32, num_hidden_layers=2)),
            layer_types=[SLIDING, FULL],
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=12,
            tie_word_embeddings=False,
        )
    if family == "qwen3_moe":  # one tensor per expert in the checkpoint; a dense layer
        return tf.Qwen3MoeConfig(
            **BASE,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        )
    if family == "deepseek_v2":  # q_proj, grouped softmax routing, two shared experts
        return tf.DeepseekV2Config(
            **DEEPSEEK, q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy"
        )
    if family == "deepseek_v3":  # q_lora, sigmoid routing with correction bias, one shared
        return tf.DeepseekV3Config(
            **DEEPSEEK, q_lora_rank=24, n_shared_experts=1, norm_topk_prob=True
        )
    if family == "qwen3_5":  # split GDN input projections, tied
        return tf.Qwen3_5TextConfig(**QWEN3_5, tie_word_embeddings=True)
    if family == "qwen3_5_moe":  # every MLP sparse, a gated shared expert
        return tf.Qwen3_5MoeTextConfig(**QWEN3_5, **QWEN3_5_EXPERTS, tie_word_embeddings=False)
    if family == "qwen3_next":  # interleaved GDN input projections, sparse and dense MLPs
        return tf.Qwen3NextConfig(
            **QWEN3_5, **QWEN3_5_EXPERTS, decoder_sparse_step=2, tie_word_embeddings=False
        )
    raise ValueError(family)
