"""Packed integer (and NVFP4) checkpoints over two ranks (gloo): weights, scales and zero points
cut along their words and groups (MoE experts' along their intermediate features), against HF
on the dequantised weights; a cut inside a group refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf
from wna16_checkpoints import MOE_SHAPE, SHAPE, write_checkpoint

from heron import LLM, SamplingParams
from heron.config import ModelConfig
from heron.models.build import build_model
from heron.parallel import TensorParallel
from heron.platforms import CpuPlatform

from tiny_models import (
    greedy_tokens,
    hf_greedy,
    hf_on_saved_weights,
    hf_on_weights,
    save_random_model,
)

PROMPTS = [list(range(10, 40)), [5, 6, 7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_random_model(tf.LlamaConfig(**SHAPE), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    config = tf.Qwen2MoeConfig(**MOE_SHAPE, shared_expert_intermediate_size=64)
    return save_random_model(config, tmp_path_factory.mktemp("qwen2_moe"))


@pytest.fixture(autouse=True)
def one_thread_per_worker(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _rank0(path: Path) -> torch.nn.Module:
    cpu = torch.device("cpu")
    config = ModelConfig.from_path(path, "float32", cpu, 96)
    return build_model(config, CpuPlatform(cpu), "reference", 16, TensorParallel(0, 2)).model


@pytest.mark.parametrize(
    "fmt, opts",
    [
        ("awq", dict(group_size=32)),
        ("gptq", dict(bits=4, group_size=64, sym=False, desc_act=False)),
        ("nvfp4-pack-quantized", {}),  # each shard's global scale on its rows of each rank
    ],
)
def test_two_ranks_equal_hf(fmt, opts, llama, tmp_path):
    """Each rank: half the query heads, one of the 2 KV heads, half of gate/up's rows, half
    of o's 128 and down's 256 input columns (whole groups of scales and zero points)."""
    weights = write_checkpoint(llama, tmp_path / "q", fmt, **opts)
    llm = LLM(str(tmp_path / "q"), tensor_parallel_size=2, max_model_len=96)
    try:
        hf = hf_on_weights(llama, weights)
        assert greedy_tokens(llm, PROMPTS, GREEDY) == hf_greedy(hf, PROMPTS, GREEDY.max_tokens)
    finally:
        llm.engine.shutdown()


def test_a_rank_boundary_inside_a_group_is_refused_naming_the_tensor(llama, tmp_path):
    """Groups of 128 over o_proj's 128 input columns, 64 a rank; act-order groups scattered
    over all of them."""
    write_checkpoint(llama, tmp_path / "awq", "awq", group_size=128)
    message = r"o_proj\.(qzeros|scales)'.* 64 of its 128 input columns, which splits its 128-col"
    with pytest.raises(ValueError, match=message):
        _rank0(tmp_path / "awq")
    opts = dict(bits=4, group_size=32, sym=True, desc_act=True)
    write_checkpoint(llama, tmp_path / "gptq", "gptq", **opts)
    with pytest.raises(ValueError, match=r"self_attn\.o_proj: its g_idx does not put whole"):
        _rank0(tmp_path / "gptq")


def test_moe_experts_over_two_ranks_equal_hf(qwen2_moe, tmp_path):
    """GPTQ Qwen2-MoE: each rank holds 32 of every expert's 64 intermediate features (gate's
    and up's rows, down's input words and one of its two groups) and half the shared expert."""
    opts = dict(bits=4, group_size=32, sym=False, desc_act=False)
    weights = write_checkpoint(qwen2_moe, tmp_path / "q", "gptq", **opts)
    llm = LLM(str(tmp_path / "q"), tensor_parallel_size=2, max_model_len=96)
    try:
        hf = hf_on_saved_weights(qwen2_moe, weights, tmp_path / "dequantised")
        assert greedy_tokens(llm, PROMPTS, GREEDY) == hf_greedy(hf, PROMPTS, GREEDY.max_tokens)
    finally:
        llm.engine.shutdown()


def test_a_rank_boundary_inside_an_experts_group_is_refused_naming_the_tensor(qwen2_moe, tmp_path):
    opts = dict(bits=4, group_size=64, sym=True, desc_act=False)
    write_checkpoint(qwen2_moe, tmp_path / "q", "gptq", **opts)
    message = (
        r"experts\.\d+\.down_proj\.(qzeros|scales)'.* 32 of its 64 input columns, which splits"
    )
    with pytest.raises(ValueError, match=message):
        _rank0(tmp_path / "q")
