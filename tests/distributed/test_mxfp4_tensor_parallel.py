"""gpt-oss with MXFP4 experts over two ranks (gloo): gate/up rows and their scales cut in
pairs, down's packed inputs and scales in whole 32-value blocks, against HF on the same
checkpoint; a rank boundary inside a block refused, naming the tensor."""

from __future__ import annotations

import pytest
import torch
from mxfp4_checkpoints import hf_on_mxfp4, write_mxfp4_checkpoint
from tp_models import tiny_config

from heron import LLM, SamplingParams
from heron.config import ModelConfig
from heron.models.build import build_model
from heron.parallel import TensorParallel
from heron.platforms import CpuPlatform

from tiny_models import greedy_tokens, hf_greedy, save_random_model

PROMPTS = [list(range(10, 40)), [5, 6, 7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread_per_worker(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _mxfp4_gpt_oss(root, intermediate_size: int):
    config = tiny_config("gpt_oss")
    config.intermediate_size = intermediate_size
    return write_mxfp4_checkpoint(save_random_model(config, root / "dense"), root / "mxfp4")


def test_two_ranks_equal_hf(tmp_path):
    """Intermediate size 64: each rank holds 32 features of every expert, one MXFP4 block of
    down's inputs."""
    path = _mxfp4_gpt_oss(tmp_path, 64)
    llm = LLM(str(path), tensor_parallel_size=2, max_model_len=96)
    try:
        hf = hf_on_mxfp4(path)
        assert greedy_tokens(llm, PROMPTS, GREEDY) == hf_greedy(hf, PROMPTS, GREEDY.max_tokens)
    finally:
        llm.engine.shutdown()


def test_a_rank_boundary_inside_a_block_is_refused_naming_the_tensor(tmp_path):
    path = _mxfp4_gpt_oss(tmp_path, 32)  # 16 features a rank: half a block
    cpu = torch.device("cpu")
    config = ModelConfig.from_path(path, "float32", cpu, 96)
    message = (
        r"layers\.0\.mlp\.experts\.down_proj_blocks: .* 16 of the experts' intermediate features"
    )
    with pytest.raises(ValueError, match=message):
        build_model(config, CpuPlatform(cpu), "reference", 16, TensorParallel(0, 2))
