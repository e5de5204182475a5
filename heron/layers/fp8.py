"""FP8 (E4M3) linear weights: the scheme a model runs under, quantisation, dequantisation.

A weight is stored as ``float8_e4m3fn`` with fp32 scales, ``w ≈ q * scale``, in one of two
layouts: per output channel (``scale`` is ``[N]``; quantised at load from a bf16/fp32
checkpoint, or a published per-tensor checkpoint whose shard scales are repeated over their
rows, which is exact) or block-wise (``scale`` is ``[ceil(N / bn), ceil(K / bk)]``, the
``weight_block_size`` layout of the Qwen3 and DeepSeek-V3 FP8 releases, kept as published).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max

#: ``EngineConfig.quantization`` values.
QUANTIZATIONS = ("fp8",)

# The keys of a checkpoint's ``quantization_config`` with ``quant_method: fp8`` that are read.
_CHECKPOINT_KEYS = {
    "quant_method",
    "activation_scheme",
    "fmt",
    "weight_block_size",
    "modules_to_not_convert",
    "ignored_layers",
}


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's linear layers and SwiGLU experts hold FP8 weights.

    ``from_checkpoint``: the checkpoint stores FP8 weights and scales (loaded as they are);
    otherwise full-precision weights are quantised per channel after loading. ``block`` is the
    checkpoint's ``weight_block_size`` (None: per-channel scales). ``skip`` lists module-name
    fragments that stay in full precision (the checkpoint's ``modules_to_not_convert``).
    """

    from_checkpoint: bool
    block: tuple[int, int] | None = None
    skip: tuple[str, ...] = ()
    skip_patterns: tuple[str, ...] = ()  # regular expressions (compressed-tensors' ``re:``)

    def skips(self, name: str) -> bool:
        """Whether module ``name`` (a checkpoint name) stays in full precision."""
        return any(f in name for f in self.skip) or any(
            re.fullmatch(p, name) for p in self.skip_patterns
        )

    def describe(self) -> str:
        layout = f"{self.block[0]}x{self.block[1]} block scales" if self.block else "channel scales"
        source = "from the checkpoint" if self.from_checkpoint else "quantised at load"
        return f"fp8 e4m3 weights, {layout}, {source}"


def fp8_scheme(hf_config: PretrainedConfig, quantization: str | None) -> Fp8Scheme | None:
    """The FP8 scheme of a checkpoint (its ``quantization_config``) and the user's
    ``quantization`` (None or a value of ``QUANTIZATIONS``, checked by ``EngineConfig``); None
    when the model runs unquantised. A checkpoint config Heron cannot load is an error that
    names what is unsupported."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return Fp8Scheme(from_checkpoint=False) if quantization == "fp8" else None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    if qc.get("quant_method") != "fp8":
        raise ValueError(
            f"checkpoint quantization {qc.get('quant_method')!r} is not supported; "
            "Heron loads quant_method 'fp8', 'awq', 'gptq', 'compressed-tensors' and 'mxfp4' "
            "checkpoints"
        )
    unknown = sorted(set(qc) - _CHECKPOINT_KEYS)
    if unknown:
        raise ValueError(f"fp8 quantization_config: unsupported fields {', '.join(unknown)}")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 quantization_config: fmt {qc['fmt']!r} is not supported (e4m3)")
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise ValueError(
            f"fp8 quantization_config: activation_scheme {qc['activation_scheme']!r} is not "
            "supported (dynamic, static)"
        )
    block = qc.get("weight_block_size")
    if block is not None:
        if len(block) != 2 or any(b < 1 or b & (b - 1) for b in block):
            raise ValueError(
                f"fp8 quantization_config: weight_block_size {block} is not two powers of two"
            )
        block = (int(block[0]), int(block[1]))
    skip = tuple(qc.get("modules_to_not_convert") or ()) + tuple(qc.get("ignored_layers") or ())
    return Fp8Scheme(from_checkpoint=True, block=block, skip=skip)


def quantize(
    weight: torch.Tensor, block: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``q`` E4M3 ``[N, K]``, ``scale`` fp32 ``[N]`` (``block`` None) or one per
    ``block`` tile. Each row's (tile's) absolute maximum maps to the format's largest value;
    an all-zero one gets scale 1."""
    w = weight.float()
    if block is None:
        amax = w.abs().amax(dim=1)
    else:
        amax = _tiles(w, block).abs().amax(dim=(1, 3))
    # Times the fp32 reciprocal: CUDA divides by a scalar so, the CPU would not.
    scale = torch.where(amax > 0, amax * (1 / FP8_MAX), torch.ones_like(amax))
    return to_fp8(w / _expand(scale, block, w.shape)), scale


def scale_shape(n: int, k: int, block: tuple[int, int] | None) -> tuple[int, ...]:
    """The shape of an ``[n, k]`` weight's scales: ``[n]`` per channel, else one per tile."""
    return (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))


def channel_scales(loaded: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's per-channel scales (``[rows]`` or ``[rows, 1]``) or per-tensor scale as
    ``rows`` per-channel values (the one scale repeated, which is exact)."""
    values = loaded.reshape(-1)
    return values.expand(rows) if values.numel() == 1 else values


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to E4M3, saturating at its largest value (a plain cast gives NaN)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
) -> torch.Tensor:
    """The fp32 weight ``q * scale`` of either layout."""
    return q.float() * _expand(scale, block, q.shape)


def _expand(scale: torch.Tensor, block: tuple[int, int] | None, shape: torch.Size) -> torch.Tensor:
    """``scale`` broadcast to a weight of ``shape``."""
    if block is None:
        return scale[:, None]
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[: shape[0], : shape[1]]


def _tiles(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w`` zero-padded to whole tiles, as ``[N / bn, bn, K / bk, bk]``."""
    (n, k), (bn, bk) = w.shape, block
    padded = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
    return padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)


def scaled_mm(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    quantize_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = quantize,
) -> torch.Tensor:
    """``x (q * scale)^T (+ bias)`` on FP8 tensor cores (cuBLASLt through ``torch._scaled_mm``):
    ``x`` [M, K] is quantised per row as weights are (dynamic per-token scales; the Triton set
    passes its one-launch ``quantize_rows``), ``scale`` is the weight's per-channel ``[N]``.
    Needs K and N multiples of 16."""
    xq, x_scale = quantize_rows(x)
    y = torch._scaled_mm(
        xq, q.t(), scale_a=x_scale[:, None], scale_b=scale[None], out_dtype=x.dtype
    )
    return y if bias is None else y + bias


def scaled_mm_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`scaled_mm` in fp32 PyTorch, rounded where it rounds (the per-token FP8
    activations, the fp32 product scaled per row and channel, one rounding to ``x``'s dtype),
    so that the CPU's figures are the tensor cores'."""
    xq, x_scale = quantize(x)
    y = ((xq.float() @ q.float().t()) * x_scale[:, None] * scale).to(x.dtype)
    return y if bias is None else y + bias
