"""Two ranks over NCCL on two GPUs: decode steps replay CUDA graphs that hold the layers'
all-reduces and the logits' all-gather, and greedy tokens equal HF's (fp32), for the dense and
MoE families, latent attention (DeepSeek-V3: the Triton MLA kernels over each rank's heads) and
the gated delta rule (Qwen3.5: the Triton GDN operator over each rank's key heads)."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers as tf
from tp_models import tiny_config

from heron import LLM, SamplingParams

from tiny_models import (
    SHARED_PREFIX_PROMPTS,
    cuda_graph_llm,
    greedy_tokens,
    hf_greedy,
    save_random_model,
)

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.device_count() < 2,
        reason="tensor parallelism over NCCL needs two CUDA devices",
    ),
]


@pytest.mark.parametrize(
    "family", ["llama", "qwen3", "gemma3", "gpt_oss", "qwen3_moe", "deepseek_v3", "qwen3_5"]
)
def test_two_gpus_with_graphs_equal_hf(family, tmp_path):
    path = save_random_model(tiny_config(family), tmp_path)
    hf = (
        tf.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        )
        .to("cuda")
        .eval()
    )
    refs = hf_greedy(hf, SHARED_PREFIX_PROMPTS, MAX_NEW)
    llm = cuda_graph_llm(path, tensor_parallel_size=2)
    try:
        assert greedy_tokens(llm, SHARED_PREFIX_PROMPTS, GREEDY) == refs
    finally:
        llm.engine.shutdown()


def test_both_gpus_profile_and_share_the_smaller_kv_budget(tmp_path):
    """Without a fixed pool every rank profiles its forward (collectives included) and the
    pool is sized from the smaller budget: here rank 0's, whose GPU holds 8 GiB more."""
    path = save_random_model(tiny_config("qwen3"), tmp_path)  # 2 KV heads: 1 per GPU
    options = dict(device="cuda", dtype="float32", max_model_len=128, gpu_memory_utilization=0.3)
    hog = torch.empty(8 << 30, dtype=torch.uint8, device="cuda:0")
    one = LLM(str(path), **options)
    blocks_one = one.engine.kv_cache.group_usage()[0].num_blocks
    del one
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(str(path), tensor_parallel_size=2, **options)
    try:
        # Half the KV bytes per block on each GPU, the same budget as one GPU with the hog
        # (rank 1's larger one would give about 2.5 times the blocks).
        blocks_two = llm.engine.kv_cache.group_usage()[0].num_blocks
        assert 1.8 * blocks_one < blocks_two < 2.2 * blocks_one
        hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
        refs = hf_greedy(hf, SHARED_PREFIX_PROMPTS, MAX_NEW)
        assert greedy_tokens(llm, SHARED_PREFIX_PROMPTS, GREEDY) == refs
    finally:
        llm.engine.shutdown()
        del hog
