"""Which weight format a model runs under: a checkpoint's ``quantization_config``, as HF
transformers reads it, or the user's ``quantization``."""

from __future__ import annotations

from transformers import PretrainedConfig

from heron.layers.fp8 import Fp8Scheme, fp8_scheme
from heron.layers.wna16 import FORMATS, WNA16Scheme, wna16_scheme

#: What a model's linear layers may hold (None: the model's dtype).
WeightScheme = Fp8Scheme | WNA16Scheme


def weight_scheme(hf_config: PretrainedConfig, quantization: str | None) -> WeightScheme | None:
    """The scheme of a checkpoint (FP8, or integer weights in one of ``FORMATS``) and the
    user's ``quantization``, which cannot apply to a checkpoint quantised otherwise."""
    qc = getattr(hf_config, "quantization_config", None)
    qc = qc if qc is None or isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method") if qc is not None else None
    if method not in FORMATS:
        return fp8_scheme(hf_config, quantization)
    if quantization is not None:
        raise ValueError(
            f"quantization={quantization!r}: the checkpoint is already quantised "
            f"(quant_method {method!r}); leave quantization unset to load it as stored"
        )
    return wna16_scheme(qc, hf_config)
