"""Two ranks over NCCL on two GPUs: decode steps replay CUDA graphs that hold the layers'
all-reduces and the logits' all-gather, and greedy tokens equal HF's (fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from tp_models import tiny_config

from heron import SamplingParams

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


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gpt_oss", "qwen3_moe"])
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
