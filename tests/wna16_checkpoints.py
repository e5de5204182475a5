"""Checkpoints of packed integer weights (and compressed-tensors FP8 ones) written from random
weights, as they are published.

AWQ (GEMM) and GPTQ are packed as AutoAWQ's ``WQLinear_GEMM.from_linear`` and AutoGPTQ's
``QuantLinear.pack`` document it (numpy words, AWQ's interleaved nibble order, GPTQ's zeros
less one and ``g_idx``), compressed-tensors (``pack-quantized`` and ``float-quantized``) by its
own library's compressors; the writer returns the dequantised weights (each format's formula,
or the library's decompressor) that HF transformers runs as a plain checkpoint."""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tiny_models import BASE, FP8_PROJECTIONS

# Wide enough for groups of 128 along every input (hidden 128, intermediate 256).
SHAPE = BASE | dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2)
# Qwen-MoE: every input whole groups of 32 (hidden 64; experts', dense and shared 64), on each
# of two tensor-parallel ranks too.
MOE_SHAPE = BASE | dict(
    num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=64, num_experts=8,
    num_experts_per_tok=2, tie_word_embeddings=False,
)  # fmt: skip
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


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


def _compressed_fp8(w, block):
    """W8A8-FP8 as llm-compressor's FP8_DYNAMIC (channel) and FP8_BLOCK schemes store it, with
    ``block`` tiles (None: per channel)."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    fp8 = dict(num_bits=8, type="float", symmetric=True)
    if block is None:
        args = QuantizationArgs(**fp8, strategy="channel")
        acts = QuantizationArgs(**fp8, strategy="token", dynamic=True)
        tiles, dims = w[:, None, :], (2,)
    else:
        args = QuantizationArgs(**fp8, strategy="block", block_structure=list(block))
        acts = QuantizationArgs(**fp8, strategy="group", group_size=block[1], dynamic=True)
        padded = torch.nn.functional.pad(w, (0, -w.shape[1] % block[1], 0, -w.shape[0] % block[0]))
        tiles, dims = padded.view(-1, block[0], padded.shape[1] // block[1], block[1]), (1, 3)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)
    scale, zero = calculate_qparams(tiles.amin(dims), tiles.amax(dims), args)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero}
    tensors = FloatQuantizationCompressor.compress(state, scheme)
    deq = FloatQuantizationCompressor.decompress(tensors, scheme)["weight"]
    return tensors, deq, {"config_groups": {"group_0": scheme.model_dump(mode="json")}}


def nvfp4_tensors(w):
    """``w`` as llm-compressor's NVFP4A16 scheme stores it (FP4 E2M1 codes, FP8 scales per 16,
    a global scale), by compressed-tensors' own compressor, and the library's dequantisation
    of them in fp32 (its ``decompress`` rounds to bf16)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    global_scale = generate_gparam(w.amin(), w.amax())
    groups = w.view(w.shape[0], -1, 16)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale)
    state = {"weight": w, "weight_scale": scale, "weight_global_scale": global_scale}
    tensors = NVFP4PackedCompressor.compress(state, scheme)
    packed = tensors["weight_packed"]
    codes = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], torch.float32)
    deq = dequantize(
        x_q=codes, scale=tensors["weight_scale"].float(), args=scheme.weights,
        global_scale=global_scale, dtype=torch.float32,
    )  # fmt: skip
    return tensors, deq, {"config_groups": {"group_0": scheme.model_dump(mode="json")}}


def write_checkpoint(src, dst, fmt: str, **opts) -> dict[str, torch.Tensor]:
    """``src`` re-saved with its projections in ``fmt``; returns the dequantised weights HF
    runs, by checkpoint name."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    dequantised = {}
    ct_config = None
    for name in [
        n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in FP8_PROJECTIONS
    ]:
        w, module = tensors.pop(name), name.removesuffix(".weight")
        if fmt == "awq":
            packed, deq = _awq(w, opts["group_size"])
        elif fmt == "gptq":
            packed, deq = _gptq(w, opts["bits"], opts["group_size"], opts["sym"], opts["desc_act"])
        elif fmt == "float-quantized":
            packed, deq, ct_config = _compressed_fp8(w, opts["block"])
        elif fmt == "nvfp4-pack-quantized":
            packed, deq, ct_config = nvfp4_tensors(w)
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
        "compressed-tensors": lambda: _ct_config(ct_config, "pack-quantized"),
        "float-quantized": lambda: _ct_config(ct_config, "float-quantized"),
        "nvfp4-pack-quantized": lambda: _ct_config(ct_config, "nvfp4-pack-quantized"),
    }[fmt]()
    (dst / "config.json").write_text(json.dumps(config))
    return dequantised


def _ct_config(groups: dict, fmt: str) -> dict:
    return groups | {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
    }


def count_kernel_rows(monkeypatch) -> list[tuple[int, str | None]]:
    """Engines built after this run their packed linear layers on the Triton kernels
    (interpreted on the CPU); returns the list each product's row count is appended to, with
    the gated activation it fused (``act`` on its input, ``gated_out`` on its output)."""
    from heron.kernels import TORCH_KERNELS
    from heron.kernels.wna16 import gemv_serves, wna16_linear
    from heron.ops import selector
    from heron.platforms import CpuPlatform

    calls = []

    def counted(x, *args, **fused):
        calls.append((x.shape[0], next((k for k in fused if k != "up"), None)))
        return wna16_linear(x, *args, **fused)

    kernels = TORCH_KERNELS.__class__("wna16", wna16_mm=counted, wna16_gemv_serves=gemv_serves)
    monkeypatch.setitem(selector.LAYER_KERNELS, "wna16", lambda: kernels)
    monkeypatch.setattr(CpuPlatform, "layer_kernels", lambda self: "wna16")
    return calls
