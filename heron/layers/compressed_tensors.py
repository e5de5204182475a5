"""compressed-tensors checkpoints (what llm-compressor writes): the one config group Heron
reads, and its ``float-quantized`` form (FP8 weights, held as Heron's FP8 path holds them);
``pack-quantized`` integer weights are ``heron.layers.wna16``'s."""

from __future__ import annotations

from dataclasses import dataclass

from heron.layers.fp8 import Fp8Scheme

WHAT = "compressed-tensors quantization_config"
_KEYS = {"quant_method", "format", "config_groups", "ignore", "kv_cache_scheme"}
_KEYS |= {"quantization_status", "global_compression_ratio", "sparsity_config", "version"}
_KEYS |= {"transform_config", "moe_sparsity_config"}
_WEIGHT_KEYS = {"num_bits", "type", "symmetric", "strategy", "group_size", "actorder"}
_WEIGHT_KEYS |= {"dynamic", "observer", "observer_kwargs", "block_structure"}
_WEIGHT_KEYS |= {"scale_dtype", "zp_dtype"}


@dataclass(frozen=True)
class ConfigGroup:
    """A checkpoint's one config group: its ``format``, the ``weights`` and
    ``input_activations`` arguments, and the modules left in full precision (``ignore``:
    name fragments in ``skip``, ``re:`` expressions in ``skip_patterns``)."""

    name: str
    format: str | None
    weights: dict
    input_activations: dict | None
    skip: tuple[str, ...]
    skip_patterns: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{WHAT}: config_groups.{self.name}"


def config_group(qc: dict) -> ConfigGroup:
    """The one config group of a compressed-tensors ``quantization_config``; what Heron cannot
    load (several groups, a KV-cache scheme, sparsity, transforms, output activations, targets
    other than ``Linear``, unknown fields) is an error naming the field."""
    unknown = sorted(set(qc) - _KEYS)
    if unknown:
        raise ValueError(f"{WHAT}: unsupported fields {', '.join(unknown)}")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{WHAT}: {len(groups)} config_groups; one is supported")
    ((name, group),) = groups.items()
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config"):
        if qc.get(field):
            raise ValueError(f"{WHAT}: {field} is not supported")
    if group.get("output_activations"):
        raise ValueError(f"{WHAT}: config_groups.{name}.output_activations is not supported")
    if group.get("targets") != ["Linear"]:
        raise ValueError(f"{WHAT}: config_groups.{name}.targets {group.get('targets')} ('Linear')")
    weights = group.get("weights") or {}
    unknown = sorted(set(weights) - _WEIGHT_KEYS)
    if unknown:
        raise ValueError(
            f"{WHAT}: config_groups.{name}.weights: unsupported fields {', '.join(unknown)}"
        )
    ignore = tuple(qc.get("ignore") or ())
    return ConfigGroup(
        name,
        group.get("format") or qc.get("format"),
        weights,
        group.get("input_activations"),
        skip=tuple(i for i in ignore if not i.startswith("re:")),
        skip_patterns=tuple(i[3:] for i in ignore if i.startswith("re:")),
    )


def float_quantized_scheme(group: ConfigGroup) -> Fp8Scheme:
    """The FP8 scheme of a ``float-quantized`` group: static symmetric E4M3 weights per
    channel (or tensor) or per block, activations FP8 (quantised per token wherever Heron's
    FP8 path quantises them; a static input scale is not used)."""
    w, where = group.weights, f"{group.where}.weights"
    if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("dynamic"):
        raise ValueError(
            f"{where}: type {w.get('type')!r}, num_bits {w.get('num_bits')}, dynamic "
            f"{w.get('dynamic')} is not supported (static float, 8 bits)"
        )
    if not w.get("symmetric", True):
        raise ValueError(f"{where}: symmetric false is not supported")
    strategy, block = w.get("strategy"), None
    if strategy == "block":
        block = w.get("block_structure") or []
        if len(block) != 2 or any(b < 1 or b & (b - 1) for b in block):
            raise ValueError(f"{where}: block_structure {block} is not two powers of two")
        block = (int(block[0]), int(block[1]))
    elif strategy not in ("channel", "tensor"):
        raise ValueError(
            f"{where}: strategy {strategy!r} is not supported (channel, tensor, block)"
        )
    a = group.input_activations
    if a is not None and (a.get("type") != "float" or a.get("num_bits") != 8):
        raise ValueError(
            f"{group.where}.input_activations: type {a.get('type')!r}, num_bits "
            f"{a.get('num_bits')} is not supported (float, 8 bits)"
        )
    return Fp8Scheme(True, block, group.skip, group.skip_patterns)
