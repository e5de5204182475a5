"""Weights broadcast over gloo from a trainer in another process: the engine's outputs after
the update (sent in two chunks) are HF transformers' on the trainer's weights."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers as tf
from ports import free_port
from safetensors.torch import load_file

from heron import LLM, SamplingParams
from heron.distributed.weight_sync import WeightSender, parse_dtype

from tiny_models import greedy_tokens, hf_greedy, save_tiny_model

# The trainer: rank 0 of the group, broadcasting a checkpoint's tensors in name order, in two
# chunks.
TRAINER = """
import sys
from safetensors.torch import load_file
from heron.distributed.weight_sync import WeightSender

sender = WeightSender("127.0.0.1", int(sys.argv[2]), 2, "gloo")
tensors = sorted(load_file(sys.argv[1] + "/model.safetensors").items())
for chunk in (tensors[: len(tensors) // 2], tensors[len(tensors) // 2 :]):
    sender.send(chunk)
sender.close()
"""


def chunks(path) -> list[dict[str, list]]:
    """What the engine's calls take for the trainer's two chunks of ``path``'s tensors."""
    tensors = sorted(load_file(path / "model.safetensors").items())
    half = len(tensors) // 2
    return [WeightSender.describe(tensors[:half]), WeightSender.describe(tensors[half:])]


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(10, 30)), [3, 4, 5]]


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_update_from_a_trainer_process_over_gloo(tiny_model_dir, tmp_path, tensor_parallel_size):
    """With two ranks, rank 0 receives the broadcast and each rank writes its own shards."""
    second = save_tiny_model("qwen3", tmp_path, seed=1)
    llm = LLM(
        str(tiny_model_dir("qwen3")),
        max_model_len=64,
        num_kv_blocks=16,
        tensor_parallel_size=tensor_parallel_size,
    )
    greedy_tokens(llm, PROMPTS, GREEDY)
    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(second), str(port)])
    try:
        llm.init_weight_update_group("127.0.0.1", port, 1, 2, backend="gloo")
        for chunk in chunks(second):
            assert llm.update_weights_from_distributed(**chunk) == len(chunk["names"])
        assert trainer.wait(timeout=60) == 0
    finally:
        trainer.kill()
    hf = tf.AutoModelForCausalLM.from_pretrained(second, dtype=torch.float32)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf, PROMPTS, GREEDY.max_tokens)
    assert outputs[0].num_cached_tokens == 0
    llm.shutdown()  # (leaves the group, stops the workers)


def test_bad_group_and_chunk_arguments(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("qwen3")), max_model_len=64, num_kv_blocks=16)
    with pytest.raises(RuntimeError, match="init_weight_update_group\\(\\) first"):
        llm.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]])
    with pytest.raises(ValueError, match="backend must be one of nccl, gloo, got 'mpi'"):
        llm.init_weight_update_group("127.0.0.1", free_port(), 1, 2, backend="mpi")
    with pytest.raises(ValueError, match="rank_offset must be >= 1"):
        llm.init_weight_update_group("127.0.0.1", free_port(), 0, 2, backend="gloo")
    with pytest.raises(ValueError, match="'int8' is not a floating-point torch dtype"):
        parse_dtype("int8")
    assert parse_dtype("torch.bfloat16") is torch.bfloat16
