"""The GDN layers' verification buffers (the states after every verified token, per verifying
row) are reserved before the KV cache is sized and leave its budget: on the CPU the host budget
shrinks by exactly their size (computed here from the HF config), on the GPU the profiled
budget does (the profile's peak holds them)."""

from __future__ import annotations

import pytest
from test_qwen3_5 import LAYER_TYPES, LINEAR, qwen3_5_config, save_qwen3_5

from heron import LLM
from heron.engine.builder import kv_cache_budget

K = 3
SPECULATION = {"method": "ngram", "num_speculative_tokens": K}


def verification_bytes(rows: int, k: int = K) -> int:
    """Per GDN layer and verifying row: ``k`` conv states ([conv_dim, kernel - 1], fp32 here)
    and ``k`` recurrent states ([value heads, key dim, value dim], fp32)."""
    c = qwen3_5_config()
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim
    conv_dim += c.linear_num_value_heads * c.linear_value_head_dim
    conv = conv_dim * (c.linear_conv_kernel_dim - 1) * 4
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    return LAYER_TYPES.count(LINEAR) * rows * k * (conv + state)


def budget(engine) -> int:
    runners = [r for r in (engine.runner, engine.draft_runner) if r is not None]
    return kv_cache_budget(engine.resolved, runners, engine.verification_bytes)


def test_host_budget_shrinks_by_the_verification_buffers(tmp_path):
    path = str(save_qwen3_5(tmp_path))
    plain = LLM(path, max_model_len=128).engine
    assert plain.verification_bytes == 0
    # as many verifying rows as requests may run: max_num_seqs, or disable_by_batch_size (8)
    for max_num_seqs, rows in ((6, 6), (32, 8)):
        engine = LLM(
            path, max_model_len=128, max_num_seqs=max_num_seqs, speculative_config=SPECULATION
        ).engine
        assert engine.verification_bytes == verification_bytes(rows)
        assert budget(plain) - budget(engine) == verification_bytes(rows)


@pytest.mark.gpu
def test_profiled_budget_shrinks_by_the_verification_buffers(tmp_path):
    from heron.execution.model_runner import ModelRunner

    path = str(save_qwen3_5(tmp_path))
    engine = LLM(path, device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=8).engine
    runner = ModelRunner(engine.model_config, engine.platform, engine.block_size, "triton", 0)
    before = runner.kv_cache_budget(0.9, 128)
    reserved = runner.reserve_verification(4096, 7)  # large enough to stand out of rounding
    assert reserved == verification_bytes(4096, 7)
    after = runner.kv_cache_budget(0.9, 128)
    # within the caching allocator's rounding of the profiled peak and of its segments
    assert abs(before - after - reserved) <= reserved // 100, (before, after, reserved)
