"""gpt-oss as published: MXFP4 experts (held packed) against HF transformers on the same
checkpoint, which transformers dequantises itself on the CPU (its ``Mxfp4Dequantize``). The
tiny model has sliding windows and attention sinks; the experts are random weights quantised to
MXFP4, the others stay fp32."""

from __future__ import annotations

import json

import pytest
import torch
from mxfp4_checkpoints import hf_on_mxfp4, write_mxfp4_checkpoint
from test_cuda_kernels_interpreted import _save_gpt_oss
from test_gpt_oss import PROMPTS

from heron import LLM, SamplingParams
from heron.layers.moe import ClampedSwiGLUExperts
from heron.ops import selector
from heron.platforms import CpuPlatform

from tiny_models import check_greedy_and_logprobs, greedy_tokens, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """The checkpoint and HF's model of it."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    path = write_mxfp4_checkpoint(_save_gpt_oss(root / "dense"), root / "mxfp4")
    return path, hf_on_mxfp4(path)


def _banks(llm: LLM) -> list[ClampedSwiGLUExperts]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, ClampedSwiGLUExperts)]


def test_experts_held_packed_and_greedy_equals_hf(mxfp4):
    path, hf = mxfp4
    llm = LLM(str(path), max_model_len=128, max_num_batched_tokens=16)
    for bank in _banks(llm):  # half a byte a weight, a byte of scale per 32
        assert bank.mxfp4 and not hasattr(bank, "gate_up_proj")
        assert bank.gate_up_proj_blocks.dtype == torch.uint8
        assert bank.gate_up_proj_blocks.shape == (4, 64, 2, 16)
        assert bank.down_proj_scales.shape == (4, 64, 1)
    check_greedy_and_logprobs(llm, hf, [PROMPTS[3], PROMPTS[2]], GREEDY)  # past the window


def test_fused_mxfp4_kernels_through_the_model_equal_hf(mxfp4, monkeypatch):
    """The whole model with the fused MoE kernels reading MXFP4 (interpreted, fp32)."""
    path, hf = mxfp4
    calls = []
    triton_set = selector.layer_kernels("triton")

    def counted(*args, **kwargs):
        calls.append(kwargs["gate_up"].dtype)
        return triton_set.fused_experts(*args, **kwargs)

    kernels = selector.TORCH_KERNELS.__class__("mxfp4", fused_experts=counted)
    monkeypatch.setitem(selector.LAYER_KERNELS, "mxfp4", lambda: kernels)
    monkeypatch.setattr(CpuPlatform, "layer_kernels", lambda self: "mxfp4")
    llm = LLM(str(path), max_model_len=128, enable_prefix_caching=False)
    prompts = [PROMPTS[0], PROMPTS[2]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert greedy_tokens(llm, prompts, params) == hf_greedy(hf, prompts, params.max_tokens)
    assert calls and set(calls) == {torch.uint8}


def test_plan_names_the_format_and_bytes_a_layer(mxfp4, capsys):
    from heron.cli import main

    path, _ = mxfp4
    assert main(["plan", "--model", str(path)]) == 0
    text = capsys.readouterr().out
    assert "weights: mxfp4 expert weights (FP4 E2M1, E8M0 scale per 32 values), held packed" in text
    assert "MiB of weights a decoder layer" in text


def test_refusals_name_the_format(mxfp4, tmp_path):
    path, _ = mxfp4
    with pytest.raises(ValueError, match="already quantised \\(quant_method 'mxfp4'\\)"):
        LLM(str(path), quantization="fp8")
    config = json.loads((path / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        if f.name != "config.json":
            (bad / f.name).symlink_to(f)
    qc = config["quantization_config"]
    for change, message in [
        ({"dequantize": True}, "dequantize true is not supported"),
        ({"group_size": 16}, "unsupported fields group_size"),
    ]:
        (bad / "config.json").write_text(json.dumps(config | {"quantization_config": qc | change}))
        with pytest.raises(ValueError, match=message):
            LLM(str(bad))
