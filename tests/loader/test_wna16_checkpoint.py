"""Packed integer checkpoints (W4A16, W8A16) as they are published, end to end on the CPU.

The checkpoints are written here from random weights: AWQ (GEMM) and GPTQ packed as AutoAWQ's
``WQLinear_GEMM.from_linear`` and AutoGPTQ's ``QuantLinear.pack`` document it (numpy words,
AWQ's interleaved nibble order, GPTQ's zeros less one and ``g_idx``), compressed-tensors by
its own library's compressor. HF transformers runs the same weights dequantised in fp32 (by
the formula of each format, or the compressed-tensors library's decompressor) as a plain
checkpoint, and Heron must generate its greedy tokens and prompt logprobs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from heron import LLM, SamplingParams
from heron.kernels import TORCH_KERNELS
from heron.kernels.wna16 import wna16_linear
from heron.layers.linear import Linear
from heron.ops import selector
from heron.platforms import CpuPlatform

from tiny_models import (
    BASE,
    FP8_PROJECTIONS,
    check_greedy_and_logprobs,
    greedy_tokens,
    hf_greedy,
    hf_on_weights,
    save_random_model,
)

PROMPTS = [list(range(10, 40)), [5, 6, 7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Wide enough for groups of 128 along every input (hidden 128, intermediate 256).
SHAPE = BASE | dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    """Llama and Qwen3 (qk-norm, head_dim apart) of ``SHAPE``, saved once."""
    root = tmp_path_factory.mktemp("wide")
    return {
        "llama": save_random_model(tf.LlamaConfig(**SHAPE), root / "llama"),
        "qwen3": save_random_model(tf.Qwen3Config(**SHAPE, head_dim=32), root / "qwen3"),
    }


def _quantise(w: torch.Tensor, bits: int, group: int, sym: bool, perm: torch.Tensor | None):
    """Round-to-nearest ``(q [N, K], scales [G, N] fp16, zeros [G, N], g_idx [K])`` with groups
    of ``group`` columns taken in ``perm``'s order (act-order), and the dequantised weight."""
    n, k = w.shape
    perm = torch.arange(k) if perm is None else perm
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
    grouped = w[:, perm].view(n, k // group, group)
    top = (1 << bits) - 1
    if sym:
        scale = (grouped.abs().amax(-1) / (top // 2)).half()
        zero = torch.full(scale.shape, (top + 1) // 2)
    else:
        lo, hi = grouped.amin(-1), grouped.amax(-1)
        scale = ((hi - lo) / top).half()
        zero = (-lo / scale.float()).round().clamp(0, top).long()
    s, z = scale.float()[:, g_idx], zero[:, g_idx]  # [N, K], each column's group's
    q = (w / s + z).round().clamp(0, top).long()
    return q, scale.t(), zero.t(), g_idx, (q - z) * s


def _words(values: np.ndarray, bits: int, order: list[int] | None = None) -> np.ndarray:
    """``values`` [R, C] packed along C into uint32 words, value ``i`` of each word in bits
    ``[bits * i, bits * (i + 1))``, word ``c`` holding columns ``c * p + order[i]``."""
    p = 32 // bits
    order = order or list(range(p))
    out = np.zeros((values.shape[0], values.shape[1] // p), dtype=np.uint32)
    for i in range(p):
        out |= values[:, order[i] :: p].astype(np.uint32) << np.uint32(bits * i)
    return out


def _int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(words).view(np.int32))


def _awq(w, group):
    q, scales, zeros, _, deq = _quantise(w, 4, group, sym=False, perm=None)
    tensors = {  # [K, N / 8] and [G, N / 8]: packed along the output features
        "qweight": _int32(_words(q.t().numpy(), 4, AWQ_ORDER)),
        "qzeros": _int32(_words(zeros.numpy(), 4, AWQ_ORDER)),
        "scales": scales,
    }
    return tensors, deq


def _gptq(w, bits, group, sym, desc_act):
    k = w.shape[1]
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(k)) if desc_act else None
    q, scales, zeros, g_idx, deq = _quantise(w, bits, group, sym, perm)
    tensors = {  # qweight [K * bits / 32, N]: packed along the input features
        "qweight": _int32(_words(q.numpy(), bits).T),
        "qzeros": _int32(_words((zeros - 1).numpy() & ((1 << bits) - 1), bits)),
        "scales": scales,
        "g_idx": g_idx,
    }
    return tensors, deq


def _compressed(w, group, sym):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    strategy = "group" if group else "channel"
    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=sym, strategy=strategy, group_size=group
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    grouped = w.view(w.shape[0], -1, group or w.shape[1])
    scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero}
    tensors = PackedQuantizationCompressor.compress(state, scheme)
    deq = PackedQuantizationCompressor.decompress(tensors, scheme)["weight"]
    config = {"config_groups": {"group_0": scheme.model_dump(mode="json")}}
    return tensors, deq, config


def write_checkpoint(src, dst, fmt: str, **opts) -> dict[str, torch.Tensor]:
    """``src`` re-saved with its projections in ``fmt``; returns the dequantised weights HF
    runs, by checkpoint name."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    dequantised = {}
    ct_config = None
    for name in [n for n in tensors if n.split(".")[-2] in FP8_PROJECTIONS]:
        w, module = tensors.pop(name), name.removesuffix(".weight")
        if fmt == "awq":
            packed, deq = _awq(w, opts["group_size"])
        elif fmt == "gptq":
            packed, deq = _gptq(w, opts["bits"], opts["group_size"], opts["sym"], opts["desc_act"])
        else:
            packed, deq, ct_config = _compressed(w, opts["group_size"], opts["sym"])
        tensors |= {f"{module}.{leaf}": t.contiguous() for leaf, t in packed.items()}
        dequantised[name] = deq.float()
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "awq": lambda: (
            {"quant_method": "awq", "bits": 4, "zero_point": True, "version": "gemm"}
            | {"group_size": opts["group_size"], "modules_to_not_convert": None}
        ),
        "gptq": lambda: (
            {"quant_method": "gptq", "checkpoint_format": "gptq", "damp_percent": 0.01}
            | {k: opts[k] for k in ("bits", "group_size", "sym", "desc_act")}
        ),
        "compressed-tensors": lambda: (
            ct_config
            | {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "ignore": ["lm_head"],
            }
            | {"quantization_status": "compressed", "kv_cache_scheme": None}
        ),
    }[fmt]()
    (dst / "config.json").write_text(json.dumps(config))
    return dequantised


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


def test_triton_kernels_through_the_model_equal_hf(wide_models, tmp_path, monkeypatch):
    """The whole model on the packed-weight kernels (interpreted, fp32): AWQ and GPTQ with
    act-order, prefill through the GEMM and decode through the GEMV."""
    calls = []

    def counted(x, *args):
        calls.append(x.shape[0])
        return wna16_linear(x, *args)

    kernels = TORCH_KERNELS.__class__("wna16", wna16_mm=counted)
    monkeypatch.setitem(selector.LAYER_KERNELS, "wna16", lambda: kernels)
    monkeypatch.setattr(CpuPlatform, "layer_kernels", lambda self: "wna16")
    src = wide_models["qwen3"]
    opts = dict(bits=4, group_size=32, sym=False, desc_act=True)
    weights = write_checkpoint(src, tmp_path / "q", "gptq", **opts)
    llm = LLM(str(tmp_path / "q"), max_model_len=128, enable_prefix_caching=False)
    hf = hf_on_weights(src, weights)
    assert greedy_tokens(llm, PROMPTS[:1], GREEDY) == hf_greedy(hf, PROMPTS[:1], GREEDY.max_tokens)
    assert max(calls) > 8 and min(calls) == 1  # both kernels ran


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
                "format": "float-quantized",
                "config_groups": {"g": {}},
            },
            "format 'float-quantized' is not supported",
        ),
        (awq | {"unknown_knob": 1}, "unsupported fields unknown_knob"),
    ]:
        (path / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
        with pytest.raises(ValueError, match=message):
            LLM(str(path))
