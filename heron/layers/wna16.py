"""Integer weights with half-precision activations (W4A16, W8A16): the AWQ, GPTQ and
compressed-tensors ``pack-quantized`` checkpoints, held packed.

Each format stores ``w = (q - z) * s`` per group of ``group_size`` input columns (or one group
per output channel) in its own packing. A layer holds one layout whatever the file's:

- ``qweight`` int32 ``[N, K * bits / 32]``: row ``n``'s values along ``K``, value ``k`` in bits
  ``[bits * (k % p), bits * (k % p + 1))`` of word ``k // p`` (``p = 32 / bits``);
- ``scales`` ``[N, G]`` in the checkpoint's float dtype (``G`` groups along ``K``);
- ``qzeros`` uint8 ``[N, G]``, or None for symmetric weights (zero ``2 ** (bits - 1)``);
- GPTQ's act-order (``desc_act``): the input columns sorted by group at load (``perm``), the
  activations gathered in that order at run time;
- NVFP4 (compressed-tensors ``nvfp4-pack-quantized``): 4-bit values that are FP4 E2M1 codes
  rather than integers, FP8 E4M3 scales per 16 columns, and each checkpoint matrix's fp32
  global scale, which divides its rows (``global_scale`` ``[N]``: a packed layer's shards
  keep their own).

That is compressed-tensors' own layout, and what the Triton kernels read. The converters
below take each checkpoint tensor apart (one tensor alone: a packed layer's shards arrive
separately), so a tensor-parallel rank narrows the converted tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import PretrainedConfig

from heron.layers.compressed_tensors import WHAT, ConfigGroup, config_group
from heron.layers.mxfp4 import FP4_VALUES

if TYPE_CHECKING:
    # (a type only: EngineConfig reads the formats here, and a server front imports no kernels)
    from heron.kernels import LayerKernels

#: AutoAWQ's GEMM packing puts column ``8c + AWQ_ORDER[i]`` in nibble ``i`` of word ``c``.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = (0, 4, 1, 5, 2, 6, 3, 7)  # nibble of column 8c + j

# The quantization_config keys each format reads; ``_IGNORED`` lists what only describes how
# the checkpoint was made (calibration settings, kernel choices of other engines).
_AWQ_KEYS = {"quant_method", "bits", "w_bit", "group_size", "q_group_size", "zero_point"}
_AWQ_KEYS |= {"version", "modules_to_not_convert"}
_GPTQ_KEYS = {"quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format"}
_GPTQ_KEYS |= {"lm_head", "dynamic", "modules_to_not_convert", "static_groups"}
_IGNORED = {
    "backend", "batch_size", "block_name_to_quantize", "cache_block_outputs", "damp_auto_increment",
    "damp_percent", "dataset", "do_fuse", "exllama_config", "fuse_max_seq_len", "max_input_length",
    "meta", "model_file_base_name", "model_name_or_path", "module_name_preceding_first_block",
    "modules_to_fuse", "pad_token_id", "pack_dtype", "tokenizer", "true_sequential",
    "use_cuda_fp16", "use_exllama", "use_marlin", "quant_type", "v2", "mse", "format",
}  # fmt: skip

#: ``quant_method`` values read here.
FORMATS = ("awq", "gptq", "compressed-tensors")


@dataclass(frozen=True)
class WNA16Scheme:
    """How a checkpoint stores integer weights: ``format`` (a value of ``FORMATS``), ``bits``
    (4 or 8), ``group_size`` (None: one group per output channel), ``zero_points`` (stored; else
    symmetric), ``act_order`` (GPTQ's ``g_idx`` is stored), ``zeros_minus_one`` (GPTQ's first
    checkpoint format stores each zero less one), the scales' dtype, and the module-name
    fragments left in full precision (``skip``; ``skip_patterns``: regular expressions)."""

    format: str
    bits: int
    group_size: int | None
    zero_points: bool
    act_order: bool = False
    zeros_minus_one: bool = False
    scale_dtype: torch.dtype = torch.float16
    skip: tuple[str, ...] = ()
    skip_patterns: tuple[str, ...] = ()
    fp4: bool = False  # NVFP4: E2M1 codes, FP8 scales and a global scale a matrix

    @property
    def pack(self) -> int:
        """Values a 32-bit word holds."""
        return 32 // self.bits

    def bytes_per_weight(self, k: int) -> float:
        """Bytes a weight of a ``k``-wide row takes in memory, its share of scales and zeros
        included."""
        group = self.group_size or k
        per_group = torch.finfo(self.scale_dtype).bits / 8 + (1 if self.zero_points else 0)
        return self.bits / 8 + per_group / group

    def describe(self) -> str:
        if self.fp4:
            return (
                f"{self.format} nvfp4 weights (FP4 E2M1, FP8 scales per {self.group_size}, a "
                f"global scale a matrix; W4A16), held packed ({self.bytes_per_weight(4096):.3f} "
                "bytes a weight at K=4096)"
            )
        group = f"groups of {self.group_size}" if self.group_size else "per-channel scales"
        zeros = "zero points" if self.zero_points else "symmetric"
        order = ", act-order" if self.act_order else ""
        return (
            f"{self.format} int{self.bits} weights (W{self.bits}A16), {group}, {zeros}{order}, "
            f"held packed ({self.bytes_per_weight(4096):.3f} bytes a weight at K=4096)"
        )

    def skips(self, name: str) -> bool:
        """Whether module ``name`` (a checkpoint name) stays in full precision."""
        return any(f in name for f in self.skip) or any(
            re.fullmatch(p, name) for p in self.skip_patterns
        )

    # -- checkpoint tensors into the layer's layout ---------------------------------------

    def convert(self, name: str, loaded: torch.Tensor) -> torch.Tensor:
        """Checkpoint tensor ``name`` (``qweight``, ``scales``, ``qzeros`` or ``g_idx``, as the
        layer names them) of one matrix in the layer's layout (rows are output features)."""
        if name == "g_idx":
            return loaded.to(torch.int32)
        if self.fp4 and name == "qweight":  # uint8 [N, K / 2], the low nibble first
            return loaded.contiguous().view(torch.int32)
        if self.fp4 and name == "global_scale":
            return loaded.float().reshape(-1)
        if self.format == "compressed-tensors":
            if name == "qzeros":  # packed along the output features
                return unpack(loaded.t(), self.bits).t().to(torch.uint8)
            return loaded
        if name == "scales":
            return loaded.t()
        if self.format == "awq":
            values = unpack(loaded, self.bits)
            values = values.view(*values.shape[:-1], -1, 8)[..., list(_AWQ_UNDO)].flatten(-2)
            return pack(values.t(), self.bits) if name == "qweight" else values.t().to(torch.uint8)
        if name == "qweight":  # gptq: packed along the input features
            return pack(unpack(loaded.t(), self.bits), self.bits)
        zeros = unpack(loaded, self.bits).t().to(torch.int32) + int(self.zeros_minus_one)
        if zeros.max() >= 256:
            raise ValueError(f"a {self.bits}-bit zero point of {int(zeros.max())}")
        return zeros.to(torch.uint8)


def wna16_scheme(qc: dict, hf_config: PretrainedConfig) -> WNA16Scheme:
    """The scheme of a ``quantization_config`` whose ``quant_method`` is one of ``FORMATS``;
    anything Heron cannot load is an error naming the field."""
    method = qc["quant_method"]
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    return _compressed_tensors(qc, hf_config)


def _check_keys(qc: dict, known: set[str], what: str) -> None:
    unknown = sorted(set(qc) - known - _IGNORED)
    if unknown:
        raise ValueError(f"{what} quantization_config: unsupported fields {', '.join(unknown)}")


def _group(value: int | None, what: str) -> int | None:
    if value in (None, -1):
        return None
    if value not in (32, 64, 128, 256):
        raise ValueError(f"{what}: group_size {value} is not supported (32, 64, 128, 256, -1)")
    return value


def _awq(qc: dict) -> WNA16Scheme:
    _check_keys(qc, _AWQ_KEYS, "awq")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"awq quantization_config: version {version!r} is not supported (gemm)")
    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits != 4:
        raise ValueError(f"awq quantization_config: bits {bits} is not supported (4)")
    if not qc.get("zero_point", True):
        raise ValueError("awq quantization_config: zero_point false is not supported")
    group = _group(qc.get("group_size", qc.get("q_group_size", 128)), "awq quantization_config")
    if group is None:
        raise ValueError("awq quantization_config: group_size -1 is not supported")
    skip = tuple(qc.get("modules_to_not_convert") or ())
    return WNA16Scheme("awq", 4, group, zero_points=True, skip=skip)


def _gptq(qc: dict) -> WNA16Scheme:
    _check_keys(qc, _GPTQ_KEYS, "gptq")
    what = "gptq quantization_config"
    bits = qc.get("bits", 4)
    if bits not in (4, 8):
        raise ValueError(f"{what}: bits {bits} is not supported (4, 8)")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{what}: checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    if qc.get("lm_head"):
        raise ValueError(f"{what}: lm_head true (a quantised LM head) is not supported")
    if qc.get("dynamic"):
        raise ValueError(f"{what}: dynamic (per-module overrides) is not supported")
    return WNA16Scheme(
        "gptq",
        bits,
        _group(qc.get("group_size", 128), what),
        zero_points=True,  # stored even when symmetric
        act_order=True,  # g_idx is stored (desc_act or not); a trivial one is dropped at load
        zeros_minus_one=fmt == "gptq",
        skip=tuple(qc.get("modules_to_not_convert") or ()),
    )


def _compressed_tensors(qc: dict, hf_config: PretrainedConfig) -> WNA16Scheme:
    group = config_group(qc)
    if group.format == "nvfp4-pack-quantized":
        return _nvfp4(group)
    if group.format != "pack-quantized":
        raise ValueError(
            f"{WHAT}: format {group.format!r} is not supported (pack-quantized, "
            "nvfp4-pack-quantized, float-quantized)"
        )
    if group.input_activations:
        raise ValueError(f"{group.where}.input_activations is not supported (W4A16)")
    w, where = group.weights, f"{group.where}.weights"
    if w.get("type") != "int" or w.get("num_bits") not in (4, 8) or w.get("dynamic"):
        raise ValueError(
            f"{where}: type {w.get('type')!r}, num_bits {w.get('num_bits')}, dynamic "
            f"{w.get('dynamic')} is not supported (static int, 4 or 8 bits)"
        )
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise ValueError(f"{where}: strategy {strategy!r} is not supported (group, channel)")
    actorder = w.get("actorder")
    if actorder not in (None, "weight", "static", "group", "dynamic"):
        raise ValueError(f"{where}: actorder {actorder!r} is not supported")
    size = _group(w.get("group_size"), where) if strategy == "group" else None
    if strategy == "group" and size is None:
        raise ValueError(f"{where}: strategy 'group' needs a group_size")
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return WNA16Scheme(
        "compressed-tensors",
        w["num_bits"],
        size,
        zero_points=not w.get("symmetric", True),
        act_order=actorder in ("group", "dynamic"),  # g_idx stored as weight_g_idx
        scale_dtype=dtype
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point
        else torch.bfloat16,
        skip=group.skip,
        skip_patterns=group.skip_patterns,
    )


def _nvfp4(group: ConfigGroup) -> WNA16Scheme:
    """NVFP4 weights, run with 16-bit activations: a checkpoint's FP4 activation settings
    (W4A4) are not used."""
    w, where = group.weights, f"{group.where}.weights"
    if (
        w.get("type") != "float"
        or w.get("num_bits") != 4
        or w.get("group_size") != 16
        or w.get("strategy") != "tensor_group"
        or w.get("dynamic")
        or not w.get("symmetric", True)
    ):
        raise ValueError(
            f"{where}: type {w.get('type')!r}, num_bits {w.get('num_bits')}, group_size "
            f"{w.get('group_size')}, strategy {w.get('strategy')!r} is not supported (NVFP4: "
            "static symmetric float, 4 bits, tensor_group of 16)"
        )
    a = group.input_activations
    if a is not None and (a.get("type") != "float" or a.get("num_bits") not in (4, 8, 16)):
        raise ValueError(f"{group.where}.input_activations: type {a.get('type')!r} is not float")
    return WNA16Scheme(
        "compressed-tensors", 4, 16, zero_points=False, scale_dtype=torch.float8_e4m3fn,
        skip=group.skip, skip_patterns=group.skip_patterns, fp4=True,
    )  # fmt: skip


# -- packing -------------------------------------------------------------------------------


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words ``[..., c]`` as their ``32 / bits`` values each, low bits first: int32
    ``[..., c * 32 / bits]``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`unpack` undone: unsigned ``bits``-bit values ``[..., k]`` (``k`` a multiple of
    ``32 / bits``) as int32 words, low bits first."""
    if values.shape[-1] % (32 // bits):
        raise ValueError(f"{values.shape[-1]} values do not fill {bits}-bit words")
    v = values.to(torch.int64).view(*values.shape[:-1], -1, 32 // bits)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    words = (v << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def zero_of(bits: int) -> int:
    """The implicit zero point of symmetric weights."""
    return 1 << (bits - 1)


def group_width(group_size: int | None, k: int) -> int:
    """Input columns per group: one group a row when per channel."""
    return group_size or k


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    bits: int,
    group_size: int | None,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fp32 weight ``[N, K]`` a layer's packed tensors stand for (with ``global_scale``
    ``[N]``: NVFP4's E2M1 codes, scaled and divided by it)."""
    q = unpack(qweight, bits)
    k = q.shape[1]
    g = group_width(group_size, k)
    s = scales.float().repeat_interleave(g, 1)[:, :k]
    if global_scale is not None:
        return torch.tensor(FP4_VALUES, device=q.device)[q] * s / global_scale[:, None]
    z = zero_of(bits) if qzeros is None else qzeros.to(torch.int32).repeat_interleave(g, 1)[:, :k]
    return (q - z).float() * s


def quantize(
    weight: torch.Tensor, bits: int, group_size: int | None, zero_points: bool, fp4: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest ``(qweight, scales, qzeros)`` of a full-precision ``[N, K]`` weight,
    min-max per group (zero points) or absolute-max (symmetric); scales in fp16 (``fp4``: E2M1
    codes under FP8 scales, a global scale of 1). For dummy weights and tests, not for
    calibrated quality."""
    n, k = weight.shape
    g = group_width(group_size, k)
    w = torch.nn.functional.pad(weight.float(), (0, -k % g)).view(n, -1, g)
    top = (1 << bits) - 1
    if fp4:
        scale = (w.abs().amax(-1) / 6).clamp(min=2.0**-9).to(torch.float8_e4m3fn)
        values = torch.tensor(FP4_VALUES[:8], device=w.device)
        scaled = w / scale.float()[..., None]
        codes = (scaled.abs()[..., None] - values).abs().argmin(-1) | ((scaled < 0).long() << 3)
        return pack(codes.view(n, -1)[:, :k].to(torch.int32), 4), scale, None
    if zero_points:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = ((hi - lo) / top).clamp(min=1e-8).half()
        zero = (-lo / scale.float()).round().clamp(0, top)
    else:
        scale = (w.abs().amax(-1) / (zero_of(bits) - 1)).clamp(min=1e-8).half()
        zero = torch.full_like(scale, zero_of(bits), dtype=torch.float32)
    q = (w / scale.float()[..., None] + zero[..., None]).round().clamp(0, top)
    qweight = pack(q.view(n, -1)[:, :k].to(torch.int32), bits)
    return qweight, scale, zero.to(torch.uint8) if zero_points else None


def act_order(
    g_idx: torch.Tensor, group_size: int | None, what: str
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(perm, groups)`` of a layer's ``g_idx`` (the group of each input column): the column
    order that makes groups contiguous (None: the order they have) and which stored groups
    those are, in that order. Each group must be whole (``group_size`` columns; the last may be
    short) within the columns a layer holds."""
    k = g_idx.numel()
    g = group_width(group_size, k)
    perm = torch.argsort(g_idx, stable=True)
    ordered = g_idx[perm]
    groups = ordered[::g]
    if not torch.equal(ordered, groups.repeat_interleave(g)[:k]):
        raise ValueError(
            f"{what}: its g_idx does not put whole groups of {g} columns in this layer (an "
            "act-order checkpoint split inside a group, by tensor parallelism or a bad file)"
        )
    identity = torch.equal(perm, torch.arange(k, device=perm.device))
    return (None if identity else perm), groups


def in_act_order(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    perm: torch.Tensor | None,
    groups: torch.Tensor,
    bits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A packed matrix's ``(qweight, scales, qzeros)`` with its columns in ``perm``'s order
    (None: as they are) and its groups in ``groups``' (what :func:`act_order` gives)."""
    if perm is not None:
        qweight = pack(unpack(qweight, bits)[:, perm], bits)
    picked = scales[:, groups].contiguous()
    return qweight, picked, None if qzeros is None else qzeros[:, groups].contiguous()


def column_part(
    scheme: WNA16Scheme, name: str, converted: torch.Tensor, cols: tuple[int, int], k: int
) -> torch.Tensor:
    """The input columns ``cols`` (a rank's ``(start, length)`` of the checkpoint's ``k``) of a
    converted tensor: words of ``qweight``, whole groups of ``scales`` and ``qzeros`` (all of
    them where ``g_idx`` picks them, or per channel), entries of ``g_idx``. A split inside a
    word or group is an error naming the tensor."""
    start, length = cols
    if name == "qweight":
        unit, what = scheme.pack, f"{scheme.bits}-bit words"
    elif name in ("scales", "qzeros") and scheme.group_size and not scheme.act_order:
        unit, what = scheme.group_size, f"{scheme.group_size}-column groups"
    elif name == "g_idx":
        return converted.narrow(0, start, length)
    else:
        return converted
    if start % unit or (length % unit and start + length != k):
        raise ValueError(
            f"{name}: tensor parallelism gives each rank {length} of its {k} input columns, "
            f"which splits its {what}"
        )
    return converted.narrow(1, start // unit, -(-length // unit))


def wna16_forward(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    perm: torch.Tensor | None,
    scheme: WNA16Scheme,
    bias: torch.Tensor | None,
    kernels: LayerKernels,
    global_scale: torch.Tensor | None = None,
    **fused: Any,
) -> torch.Tensor:
    """``x W^T (+ b)`` for a packed weight: the kernel set's ``wna16_mm`` (dequantising in
    registers; ``fused``: its gated activations), else the weight dequantised in fp32 for this
    product (the CPU's reference). Act-order weights take ``x``'s columns in ``perm``'s order."""
    if perm is not None:
        x = x.index_select(-1, perm)
    if kernels.wna16_mm is not None and x.dim() == 2:
        return kernels.wna16_mm(
            x, qweight, scales, qzeros, scheme.bits, scheme.group_size, bias, global_scale,
            **fused,
        )  # fmt: skip
    if fused:
        raise ValueError(f"packed weights fuse {', '.join(fused)} only in the kernel set's GEMV")
    w = dequantize(qweight, scales, qzeros, scheme.bits, scheme.group_size, global_scale)
    return torch.nn.functional.linear(x, w.to(x.dtype), bias)
