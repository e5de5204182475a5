"""MXFP4 expert weights (gpt-oss): FP4 E2M1 values with one E8M0 scale per 32, held packed.

gpt-oss's checkpoints store each expert matrix output-major as ``*_blocks`` uint8 ``[E, N,
K / 32, 16]`` (two values a byte, the lower-indexed one in the low nibble) and ``*_scales``
uint8 ``[E, N, K / 32]`` (``2 ** (s - 127)``); ``w[n, k] = fp4(nibble) * scale[n, k // 32]``.
A bank holds exactly those tensors, which the fused MoE kernels read as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Values one scale covers, and bytes of packed values it covers.
BLOCK = 32
BLOCK_BYTES = BLOCK // 2
#: The E2M1 value of each nibble (sign in bit 3, two exponent bits, one mantissa bit).
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
_SCALE_BIAS = 127

# The quantization_config keys read (``dequantize`` asks HF to expand the weights at load).
_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}


@dataclass(frozen=True)
class Mxfp4Scheme:
    """gpt-oss's MXFP4 experts; every other weight stays in the model's dtype. ``skip``: the
    checkpoint's ``modules_to_not_convert`` (``fnmatch`` patterns or name fragments)."""

    skip: tuple[str, ...] = ()

    def skips(self, name: str) -> bool:
        """Whether expert bank ``name`` stays in full precision (gpt-oss lists its
        attention, routers, embeddings and head, never its experts)."""
        import fnmatch

        return any(fnmatch.fnmatch(name, p) or p == name for p in self.skip)

    def describe(self) -> str:
        return (
            "mxfp4 expert weights (FP4 E2M1, E8M0 scale per 32 values), held packed "
            f"({bytes_per_weight():.3f} bytes a weight); other weights in the model's dtype"
        )


def bytes_per_weight() -> float:
    """Bytes an expert weight takes in memory, its share of the scale included."""
    return 0.5 + 1 / BLOCK


def mxfp4_scheme(qc: dict) -> Mxfp4Scheme:
    """The scheme of a ``quantization_config`` with ``quant_method: mxfp4``."""
    unknown = sorted(set(qc) - _KEYS)
    if unknown:
        raise ValueError(f"mxfp4 quantization_config: unsupported fields {', '.join(unknown)}")
    if qc.get("dequantize"):
        raise ValueError(
            "mxfp4 quantization_config: dequantize true is not supported (Heron keeps the "
            "experts in MXFP4)"
        )
    return Mxfp4Scheme(tuple(qc.get("modules_to_not_convert") or ()))


def packed_shapes(n: int, k: int, what: str) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """The shapes of one ``[n, k]`` matrix's blocks and scales (without the expert dimension);
    ``k`` must be whole blocks of 32."""
    if k % BLOCK:
        raise ValueError(f"{what}: MXFP4 needs a multiple of {BLOCK} input features, got {k}")
    return (n, k // BLOCK, BLOCK_BYTES), (n, k // BLOCK)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weights ``[..., N, K]`` of ``blocks`` ``[..., N, K / 32, 16]`` and ``scales``
    ``[..., N, K / 32]``."""
    lut = torch.tensor(FP4_VALUES, device=blocks.device)
    byte = torch.arange(256, device=blocks.device)
    pairs = torch.stack([lut[byte & 0xF], lut[byte >> 4]], dim=-1)  # each byte's two values
    values = pairs[blocks.to(torch.int32)].flatten(-2)  # [..., G, 32]
    return (values * torch.exp2(scales.float() - _SCALE_BIAS)[..., None]).flatten(-2)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest ``(blocks, scales)`` of ``weight`` ``[..., N, K]``: each block's scale
    is the power of two that brings its largest magnitude to at most 6 (E2M1's largest value).
    For dummy weights and tests, not for calibrated quality."""
    *lead, n, k = weight.shape
    packed_shapes(n, k, "quantize")
    w = weight.float().reshape(*lead, n, k // BLOCK, BLOCK)
    amax = w.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-_SCALE_BIAS, _SCALE_BIAS)
    scaled = w / torch.exp2(exponent)[..., None]
    lut = torch.tensor(FP4_VALUES[:8], device=w.device)
    nearest = (scaled.abs()[..., None] - lut).abs().argmin(-1)  # ties to the lower magnitude
    nibbles = (nearest | ((scaled < 0).int() << 3)).to(torch.uint8)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return blocks, (exponent + _SCALE_BIAS).to(torch.uint8)
