"""FP8 weights end to end on the CPU: quantised at load (``quantization="fp8"``), and FP8
checkpoints written here as published (per-tensor ``weight_scale`` + ``input_scale``; block-wise
``weight_scale_inv``), each against HF transformers run on the dequantised weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file
from test_dummy import config_for

from heron import LLM, SamplingParams
from heron.layers.fp8 import FP8, dequantize, quantize
from heron.layers.linear import Linear

from tiny_models import (
    FP8_PROJECTIONS,
    check_greedy_and_logprobs,
    greedy_tokens,
    hf_greedy,
    hf_on_weights,
    hf_prompt_logprobs,
    write_fp8_checkpoint,
)

PROMPTS = [list(range(10, 40)), [5, 6, 7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _fp8_layers(llm: LLM) -> list[Linear]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]


def _check_parity(llm: LLM, hf) -> None:
    check_greedy_and_logprobs(llm, hf, PROMPTS, GREEDY)


def test_quantised_at_load_equals_hf_on_the_dequantised_weights(tiny_model_dir):
    path = tiny_model_dir("qwen2")  # qkv biases
    llm = LLM(str(path), max_model_len=128, quantization="fp8")
    layers = _fp8_layers(llm)
    assert len(layers) == 3 * 4  # qkv, o, gate_up, down in each of 3 layers
    assert all(m.weight.dtype == FP8 and m.weight_scale.shape == (m.out_features,) for m in layers)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    weights = {
        name: dequantize(*quantize(w))
        for name, w in hf.state_dict().items()
        if name.endswith("weight") and name.split(".")[-2] in FP8_PROJECTIONS
    }
    _check_parity(llm, hf_on_weights(path, weights))


@pytest.mark.parametrize("layout", ["per-tensor", "block-wise"])
def test_fp8_checkpoint_loads_as_stored_and_equals_hf(layout, tiny_model_dir, tmp_path):
    """Block-wise, the down projections are left in full precision (modules_to_not_convert)."""
    src = tiny_model_dir("llama")
    skip = ("down_proj",) if layout == "block-wise" else ()
    weights = write_fp8_checkpoint(src, tmp_path / "fp8", layout, skip)
    llm = LLM(str(tmp_path / "fp8"), max_model_len=128)
    block = (32, 32) if layout == "block-wise" else None
    layers = [(n, m) for n, m in llm.engine.runner.model.named_modules() if isinstance(m, Linear)]
    assert len(layers) == 12
    for name, m in layers:
        if skip and name.endswith(skip):
            assert m.weight.dtype == torch.float32 and m.weight_scale is None
            continue
        rows = (m.out_features,) if block is None else (m.out_features // 32, m.in_features // 32)
        assert m.weight.dtype == FP8 and m.weight_block == block
        assert m.weight_scale.shape == rows
    assert llm.engine.model_config.quantization.from_checkpoint
    _check_parity(llm, hf_on_weights(src, weights))


def test_invalid_quantization_settings_are_named(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="quantization must be one of fp8, got 'int4'"):
        LLM(str(tiny_model_dir("llama")), quantization="int4")
    path = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    for qc, message in [
        ({"quant_method": "hqq"}, "checkpoint quantization 'hqq' is not supported"),
        ({"quant_method": "fp8", "kv_cache_scheme": {}}, "unsupported fields kv_cache_scheme"),
        ({"quant_method": "fp8", "weight_block_size": [128, 96]}, "not two powers of two"),
        ({"quant_method": "fp8", "modules_to_not_convert": ["q_proj"]}, "skips some of"),
    ]:
        (path / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
        with pytest.raises(ValueError, match=message):
            LLM(str(path))


def test_checkpoint_kv_scales_reach_an_fp8_cache_only(tiny_model_dir, tmp_path):
    """``self_attn.k_scale`` / ``v_scale`` set the operators' scales under an FP8 cache (whose
    logprobs stay near HF's); under a full-precision cache they are not used and parity with
    HF stays exact."""
    src, dst = tiny_model_dir("llama"), tmp_path / "scaled"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for i in range(3):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5 + i)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(tensors, dst / "model.safetensors")
    hf = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ops = lambda llm: [m for m in llm.engine.runner.model.modules() if hasattr(m, "k_scale")]

    fp8 = LLM(str(dst), max_model_len=128, kv_cache_dtype="fp8")
    assert [(op.k_scale, op.v_scale) for op in ops(fp8)] == [(0.5, 0.25), (1.5, 0.25), (2.5, 0.25)]
    out = fp8.generate(PROMPTS[0], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    got = torch.tensor([lp.logprob for lp in out[0].prompt_logprobs[1:]])
    assert (got - hf_prompt_logprobs(hf, PROMPTS[0])).abs().mean() < 0.05

    full = LLM(str(dst), max_model_len=128)
    assert all(op.k_scale == op.v_scale == 1.0 for op in ops(full))
    assert greedy_tokens(full, PROMPTS, GREEDY) == hf_greedy(hf, PROMPTS, GREEDY.max_tokens)

    tensors["model.layers.0.self_attn.k_scale"] = torch.ones(2)
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ValueError, match="only one scale per layer is supported"):
        LLM(str(dst), max_model_len=128, kv_cache_dtype="fp8")


def test_moe_routers_and_experts_stay_unquantised(tiny_model_dir, tmp_path):
    """gpt-oss with FP8 weights (dummy ones): attention projections are FP8, the MoE router
    and experts keep the model's dtype, and it generates."""
    config_for("gpt_oss").save_pretrained(tmp_path)
    llm = LLM(
        str(tmp_path),
        tokenizer=str(tiny_model_dir("llama")),
        load_format="dummy",
        max_model_len=64,
        quantization="fp8",
    )
    params = dict(llm.engine.runner.model.named_parameters())
    fp8 = sorted(name for name, p in params.items() if p.dtype == FP8)
    assert fp8 and all(".self_attn." in name for name in fp8)
    assert all(p.dtype == torch.float32 for n, p in params.items() if ".mlp." in n)
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
