"""Packed integer checkpoints (W4A16, W8A16) as they are published, end to end on the CPU:
Heron on the packed checkpoint must generate the greedy tokens and prompt logprobs of HF
transformers on the same weights dequantised in fp32 (``wna16_checkpoints``)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from wna16_checkpoints import SHAPE, count_kernel_rows, write_checkpoint

from heron import LLM, SamplingParams
from heron.layers.linear import Linear

from tiny_models import (
    check_greedy_and_logprobs,
    greedy_tokens,
    hf_greedy,
    hf_on_weights,
    save_random_model,
)

PROMPTS = [list(range(10, 40)), [5, 6, 7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    """Llama and Qwen3 (qk-norm, head_dim apart) of ``SHAPE``, saved once."""
    root = tmp_path_factory.mktemp("wide")
    return {
        "llama": save_random_model(tf.LlamaConfig(**SHAPE), root / "llama"),
        "qwen3": save_random_model(tf.Qwen3Config(**SHAPE, head_dim=32), root / "qwen3"),
    }


def _check_parity(llm: LLM, hf) -> None:
    check_greedy_and_logprobs(llm, hf, PROMPTS, GREEDY)


def _packed_layers(llm: LLM) -> list[Linear]:
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert len(layers) == 2 * 4 and all(m.weight is None and m.wna16 for m in layers)
    return layers


CASES = [
    ("llama", "awq", dict(group_size=32)),
    ("qwen3", "awq", dict(group_size=128)),
    ("llama", "gptq", dict(bits=4, group_size=128, sym=True, desc_act=False)),
    ("qwen3", "gptq", dict(bits=4, group_size=32, sym=False, desc_act=True)),
    ("llama", "gptq", dict(bits=8, group_size=64, sym=True, desc_act=True)),
    ("qwen3", "compressed-tensors", dict(group_size=32, sym=True)),
    ("llama", "compressed-tensors", dict(group_size=None, sym=False)),
]


@pytest.mark.parametrize("family, fmt, opts", CASES, ids=[f"{c[1]}-{c[2]}" for c in CASES])
def test_checkpoint_loads_packed_and_equals_hf(family, fmt, opts, wide_models, tmp_path):
    src = wide_models[family]
    weights = write_checkpoint(src, tmp_path / "q", fmt, **opts)
    llm = LLM(str(tmp_path / "q"), max_model_len=128)
    scheme = llm.engine.model_config.quantization
    assert (scheme.format, scheme.group_size) == (fmt, opts["group_size"])
    for m in _packed_layers(llm):  # as packed as the file: bits / 32 words a weight
        assert m.qweight.dtype == torch.int32
        assert m.qweight.shape == (m.out_features, m.in_features * scheme.bits // 32)
        assert (m.perm is not None) == bool(opts.get("desc_act"))
    _check_parity(llm, hf_on_weights(src, weights))


@pytest.mark.parametrize("desc_act", [True, False], ids=["act-order", "in-order"])
def test_triton_kernels_through_the_model_equal_hf(wide_models, tmp_path, monkeypatch, desc_act):
    """The whole model on the packed-weight kernels (interpreted, fp32): GPTQ with and
    without act-order, prefill through the GEMM and decode through the GEMV, which applies
    the MLP's activation as it loads the down projection's input (not in act-order, whose
    input columns are reordered)."""
    calls = count_kernel_rows(monkeypatch)
    src = wide_models["qwen3"]
    opts = dict(bits=4, group_size=32, sym=False, desc_act=desc_act)
    weights = write_checkpoint(src, tmp_path / "q", "gptq", **opts)
    llm = LLM(str(tmp_path / "q"), max_model_len=128, enable_prefix_caching=False)
    hf = hf_on_weights(src, weights)
    prompts, params = (
        [list(range(10, 22))],
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    )
    assert greedy_tokens(llm, prompts, params) == hf_greedy(hf, prompts, params.max_tokens)
    rows = [r for r, _ in calls]
    assert max(rows) > 8 and min(rows) == 1  # both kernels ran
    assert ((1, "act") in calls) == (not desc_act)


def test_plan_names_the_format_and_bytes_a_layer(wide_models, tmp_path, capsys):
    """One decoder layer of the AWQ model: 4 bits a weight, fp16 scales and uint8 zero points
    a group of 32, and the layer's two norms in fp32."""
    from heron.cli import main

    write_checkpoint(wide_models["llama"], tmp_path / "q", "awq", group_size=32)
    assert main(["plan", "--model", str(tmp_path / "q")]) == 0
    text = capsys.readouterr().out
    d, ff, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], 2 * 32  # 2 KV heads of 32
    weights = d * (d + 2 * kv) + d * d + 3 * d * ff
    packed = weights / 2 + weights // 32 * 3
    mib = (packed + 2 * d * 4) / 2**20
    assert (
        "weights: awq int4 weights (W4A16), groups of 32, zero points, held packed "
        f"(0.594 bytes a weight at K=4096); {mib:.2f} MiB of weights a decoder layer" in text
    )


def test_unsupported_checkpoints_are_refused_by_name(wide_models, tmp_path):
    path = tmp_path / "m"
    write_checkpoint(wide_models["llama"], path, "awq", group_size=32)
    config = json.loads((path / "config.json").read_text())
    awq = config["quantization_config"]
    with pytest.raises(ValueError, match="already quantised \\(quant_method 'awq'\\)"):
        LLM(str(path), quantization="fp8")
    for qc, message in [
        (awq | {"version": "gemv"}, "awq quantization_config: version 'gemv' is not supported"),
        (awq | {"zero_point": False}, "zero_point false is not supported"),
        ({"quant_method": "gptq", "bits": 3}, "gptq quantization_config: bits 3"),
        ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"quant_method": "gptq", "group_size": 48}, "group_size 48 is not supported"),
        ({"quant_method": "bitsandbytes"}, "checkpoint quantization 'bitsandbytes'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "marlin-24",
                "config_groups": {"g": {"targets": ["Linear"]}},
            },
            "format 'marlin-24' is not supported",
        ),
        (awq | {"unknown_knob": 1}, "unsupported fields unknown_knob"),
    ]:
        (path / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
        with pytest.raises(ValueError, match=message):
            LLM(str(path))
