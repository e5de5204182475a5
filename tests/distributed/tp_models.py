"""Tiny models whose shapes exercise tensor-parallel sharding (the CPU and GPU tests share
them)."""

from __future__ import annotations

import transformers as tf

from tiny_models import BASE

SLIDING, FULL = "sliding_attention", "full_attention"


def tiny_config(family: str) -> tf.PretrainedConfig:
    """Tiny models whose shapes test the sharding: split and shared KV heads, a vocabulary that
    two ranks do not divide evenly, both expert layouts."""
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
    raise ValueError(family)
