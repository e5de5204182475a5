"""compressed-tensors ``float-quantized`` (W8A8-FP8) checkpoints, written by the library's own
compressor, load into Heron's FP8 path as stored (per channel, per block) and generate HF
transformers' greedy tokens and prompt logprobs on the weights the library decompresses."""

from __future__ import annotations

import json

import pytest
import transformers as tf
from wna16_checkpoints import SHAPE, write_checkpoint

from heron import LLM, SamplingParams
from heron.layers.fp8 import FP8
from heron.layers.linear import Linear

from tiny_models import check_greedy_and_logprobs, hf_on_weights, save_random_model

PROMPTS = [list(range(10, 40)), [5, 6, 7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return save_random_model(tf.Qwen3Config(**SHAPE, head_dim=32), tmp_path_factory.mktemp("q3"))


@pytest.mark.parametrize("block", [None, (32, 32), (64, 128)], ids=["channel", "32x32", "64x128"])
def test_checkpoint_loads_as_fp8_and_equals_hf(block, qwen3, tmp_path):
    weights = write_checkpoint(qwen3, tmp_path / "q", "float-quantized", block=block)
    llm = LLM(str(tmp_path / "q"), max_model_len=128)
    scheme = llm.engine.model_config.quantization
    assert scheme.from_checkpoint and scheme.block == block
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert len(layers) == 2 * 4 and all(m.weight.dtype == FP8 for m in layers)
    check_greedy_and_logprobs(llm, hf_on_weights(qwen3, weights), PROMPTS, GREEDY)


def test_plan_and_refusals_name_the_format(qwen3, tmp_path, capsys):
    from heron.cli import main

    path = tmp_path / "q"
    write_checkpoint(qwen3, path, "float-quantized", block=None)
    assert main(["plan", "--model", str(path)]) == 0
    assert (
        "weights: fp8 e4m3 weights, channel scales, from the checkpoint" in capsys.readouterr().out
    )
    with pytest.raises(ValueError, match="already quantised \\(quant_method 'compressed-tensors'"):
        LLM(str(path), quantization="fp8")
    config = json.loads((path / "config.json").read_text())
    qc = config["quantization_config"]
    group = qc["config_groups"]["group_0"]
    for change, message in [
        ({"weights": group["weights"] | {"symmetric": False}}, "weights: symmetric false"),
        ({"weights": group["weights"] | {"num_bits": 4}}, "num_bits 4, dynamic False is not"),
        ({"input_activations": group["input_activations"] | {"type": "int"}}, "type 'int'"),
        ({"weights": group["weights"] | {"strategy": "group"}}, "strategy 'group' is not"),
    ]:
        bad = qc | {"config_groups": {"group_0": group | change}}
        (path / "config.json").write_text(json.dumps(config | {"quantization_config": bad}))
        with pytest.raises(ValueError, match=message):
            LLM(str(path))
