"""Which weight format a model runs under: a checkpoint's ``quantization_config``, as HF
transformers reads it, or the user's ``quantization``."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from heron.layers.compressed_tensors import config_group, float_quantized_scheme
from heron.layers.fp8 import Fp8Scheme, fp8_scheme
from heron.layers.mxfp4 import Mxfp4Scheme, mxfp4_scheme
from heron.layers.wna16 import FORMATS, WNA16Scheme, wna16_scheme

#: What a model's linear layers (or, for MXFP4, its experts) may hold (None: the model's dtype).
WeightScheme = Fp8Scheme | WNA16Scheme | Mxfp4Scheme


def weight_scheme(hf_config: PretrainedConfig, quantization: str | None) -> WeightScheme | None:
    """The scheme of a checkpoint (FP8, integer weights in one of ``FORMATS``, MXFP4 experts)
    and the user's ``quantization``, which cannot apply to a checkpoint quantised otherwise."""
    qc = getattr(hf_config, "quantization_config", None)
    qc = qc if qc is None or isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method") if qc is not None else None
    if method not in (*FORMATS, "mxfp4"):
        return fp8_scheme(hf_config, quantization)
    if quantization is not None:
        raise ValueError(
            f"quantization={quantization!r}: the checkpoint is already quantised "
            f"(quant_method {method!r}); leave quantization unset to load it as stored"
        )
    if method == "mxfp4":
        return mxfp4_scheme(qc)
    if method == "compressed-tensors" and config_group(qc).format == "float-quantized":
        return float_quantized_scheme(config_group(qc))
    return wna16_scheme(qc, hf_config)


def describe_weights(scheme: WeightScheme | None, model: nn.Module | None) -> str:
    """The weights' format and, given the built ``model``, the bytes its first decoder layer's
    weights take in memory (packed ones as held, with their scales and zero points)."""
    text = scheme.describe() if scheme is not None else "unquantised weights"
    layer = next(
        (m for n, m in (model.named_modules() if model else ()) if n.endswith("layers.0")), None
    )
    if layer is None:
        return text
    nbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    return f"{text}; {nbytes / 2**20:.2f} MiB of weights a decoder layer (layer 0)"
