"""Loading checkpoint tensors into a model: name mapping, packing, completeness check."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from heron.layers.fp8 import FP8
from heron.layers.linear import PackedLinear
from heron.layers.moe import PACKED_TENSORS, SCALE_SUFFIX, ExpertBank
from heron.loader.safetensors import LazyTensor, materialize
from heron.ops.attention.base import AttentionOperator

logger = logging.getLogger(__name__)

# Tensors some checkpoints carry that are recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Block-wise FP8 checkpoints name a weight's scales weight_scale_inv (they multiply, despite
# the name); Heron's layers call both layouts weight_scale.
_SCALE_INV = ".weight_scale_inv"
# A static FP8 checkpoint's activation scales: Heron scales activations per token instead.
_INPUT_SCALE = ".input_scale"
# compressed-tensors' names of packed integer weights, and the layer's (AWQ's and GPTQ's). Its
# weight_shape restates the layer's shape (a wrong one shows in weight_packed's).
_PACKED_NAMES = {
    "weight_packed": "qweight",
    "weight_scale": "scales",
    "weight_zero_point": "qzeros",
    "weight_g_idx": "g_idx",
    "weight_global_scale": "global_scale",
}
# An NVFP4 checkpoint's activation scale (W4A4): Heron runs its weights with 16-bit activations.
_INPUT_GLOBAL_SCALE = "input_global_scale"
_PACKED_SHAPE = ".weight_shape"
# What one expert's tensor fills in its bank: the stack itself, its scales, or (unused) the
# input scale of a static FP8 checkpoint.
_EXPERT_TENSORS = {"weight": "", "weight_scale": SCALE_SUFFIX, "input_scale": _INPUT_SCALE}
# An FP8 checkpoint's per-layer KV-cache scales, on the attention module (self_attn.k_scale).
_KV_SCALES = (".k_scale", ".v_scale")


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | LazyTensor]],
    complete: bool = True,
) -> LoadedWeights:
    """Copy ``weights`` into ``model``; raise naming any unknown tensor, or (``complete``: a
    whole checkpoint) any parameter left unloaded. Returns what was loaded and skipped.

    ``model.checkpoint_prefixes`` maps a checkpoint name prefix to the model's (``None``: tensors
    the model does not load, such as a multimodal checkpoint's vision tower); a model that
    ``loads_prefixes_only`` (an MTP head) skips every tensor outside them;
    ``model.checkpoint_renames`` maps a checkpoint module name to the model's (``router`` ->
    ``gate``); ``model.packed_modules`` maps a checkpoint module name (``q_proj``) to the packed
    module that holds it and its shard (``("qkv_proj", "q")``). One tensor per expert
    (``experts.3.gate_proj.weight``) goes into its ``ExpertBank``'s stacked parameter.
    A parameter's module may narrow each tensor to the part it holds (``checkpoint_part``:
    tensor-parallel shards; ``weights`` may be lazy, read only there; a tuple of row runs is
    read and joined) and copy it itself (``weight_loader``).
    """
    renames: dict[str, str] = getattr(model, "checkpoint_renames", {})
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    prefixes: dict[str, str | None] = getattr(model, "checkpoint_prefixes", {})
    prefixes_only = getattr(model, "loads_prefixes_only", False)
    params = dict(model.named_parameters())
    banks = {name: m for name, m in model.named_modules() if isinstance(m, ExpertBank)}
    owners = {
        f"{prefix}.{pname}" if prefix else pname: module
        for prefix, module in model.named_modules()
        for pname, _ in module.named_parameters(recurse=False)
    }
    tied_head = getattr(getattr(model, "lm_head", None), "tied", False)
    loaded: dict[str, set] = {}
    skipped: list[str] = []
    unused_input_scales = unused_kv_scales = 0
    modules = dict(model.named_modules())
    for name, tensor in weights:
        source = name  # as the checkpoint names it
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if (prefix is None and prefixes_only) or (prefix is not None and prefixes[prefix] is None):
            skipped.append(source)
            continue
        if prefix is not None:
            name = prefixes[prefix] + name.removeprefix(prefix)
        if name.endswith(_IGNORED_SUFFIXES) or (tied_head and name == "lm_head.weight"):
            skipped.append(source)
            continue
        if name.endswith(_KV_SCALES):
            unused_kv_scales += not _set_kv_scale(modules, name, materialize(tensor))
            continue
        if name.endswith(_SCALE_INV):
            name = name.removesuffix(_SCALE_INV) + ".weight_scale"
        if name in params:  # a module kept as the checkpoint has it (a vision tower's q_proj)
            target, shard = name, None
        else:
            target, shard = _target([renames.get(p, p) for p in name.split(".")], packed, banks)
        owner, _, leaf = target.rpartition(".")
        if leaf == _PACKED_SHAPE[1:] and f"{owner}_qweight" in params:  # an expert's
            continue
        if f"{owner}.qweight" in params:  # packed integer weights
            if target.endswith(_PACKED_SHAPE) or leaf == _INPUT_GLOBAL_SCALE:
                continue
            target = f"{owner}.{_PACKED_NAMES.get(leaf, leaf)}"
        if target.endswith(_INPUT_SCALE) and _scales_weights(target, params):
            unused_input_scales += 1
            continue
        param = params.get(target)
        if param is None:
            raise ValueError(
                f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}"
            )
        try:
            _load(owners[target], target.rsplit(".", 1)[-1], param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {source!r}: {e}") from e
        loaded.setdefault(target, set()).add(shard)

    if unused_kv_scales:
        logger.info("%d KV-cache scales not used: the KV cache is not FP8", unused_kv_scales)
    if unused_input_scales:
        logger.info(
            "%d static FP8 input scales not used: activations are scaled per token",
            unused_input_scales,
        )
    missing = [name for name in params if not _complete(owners[name], name, loaded.get(name))]
    if complete and missing:
        raise ValueError(f"checkpoint is missing weights for: {', '.join(missing)}")
    return LoadedWeights(set(loaded), skipped)


class LoadedWeights(NamedTuple):
    """The parameters :func:`load_weights` wrote (names in the model) and the checkpoint
    tensors it skipped (another model's: an MTP head's, a vision tower's; recomputed ones)."""

    parameters: set[str]
    skipped: list[str]


def _load(
    owner: nn.Module,
    name: str,
    param: nn.Parameter,
    tensor: torch.Tensor | LazyTensor,
    shard: object,
) -> None:
    """Copy ``tensor`` (or the part of it this rank holds) into ``owner``'s parameter ``name``."""
    part = getattr(owner, "checkpoint_part", None)
    if part is not None:  # a tensor-parallel rank's part of the tensor
        try:
            tensor = part(name, tensor, shard)
        except (RuntimeError, IndexError) as e:  # narrowed past its end
            raise ValueError(f"shape {tuple(tensor.shape)} has no part for this rank: {e}") from e
    tensor = materialize(tensor)
    loader = getattr(owner, "weight_loader", None)
    with torch.no_grad():
        if loader is not None:
            loader(param, tensor.to(param.dtype), shard)
        elif param.shape != tensor.shape:
            raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        else:
            param.copy_(tensor)


def _target(
    parts: list[str], packed: dict[str, tuple[str, str]], banks: dict[str, ExpertBank]
) -> tuple[str, object]:
    """The parameter a checkpoint name (split at dots, renamed) fills, and the shard."""
    for i, part in enumerate(parts):
        bank = banks.get(".".join(parts[:i])) if part.isdigit() else None
        leaf = parts[i + 2 :]
        suffix = _expert_suffix(bank, leaf[0]) if bank is not None and len(leaf) == 1 else None
        if suffix is not None:
            param, piece = bank.per_expert_names.get(parts[i + 1], (parts[i + 1], ""))
            return ".".join([*parts[:i], param]) + suffix, (int(part), piece)
    for i, part in enumerate(parts):
        if part in packed:
            parts[i], shard = packed[part]
            return ".".join(parts), shard
    return ".".join(parts), None


def _expert_suffix(bank: ExpertBank, leaf: str) -> str | None:
    """What one expert's tensor ``leaf`` fills in ``bank``'s stack (None: not an expert's
    tensor): the stack, its FP8 scales, or a packed integer tensor (in any format's names;
    compressed-tensors' ``weight_shape`` to be skipped)."""
    if getattr(bank, "wna16", None) is None:
        return _EXPERT_TENSORS.get(leaf)
    if leaf == _PACKED_SHAPE[1:]:
        return _PACKED_SHAPE
    leaf = _PACKED_NAMES.get(leaf, leaf)
    return f"_{leaf}" if leaf in PACKED_TENSORS else None


def _complete(owner: nn.Module, name: str, shards: set | None) -> bool:
    """Whether the shards loaded into parameter ``name`` fill it: all of a packed layer's, a
    whole stacked expert tensor or every expert's piece of it, else the one whole tensor."""
    if isinstance(owner, PackedLinear):
        return shards == set(owner.shard_offsets)
    if isinstance(owner, ExpertBank):
        return shards == {None} or shards == owner.checkpoint_shards(name.rsplit(".", 1)[-1])
    return shards == {None}


def _scales_weights(input_scale: str, params: dict[str, nn.Parameter]) -> bool:
    """Whether ``input_scale`` (a layer's ``.input_scale``, or an expert stack's
    ``gate_up_proj.input_scale``) belongs to FP8 weights (``.weight_scale``,
    ``gate_up_proj_scale``)."""
    owner = input_scale.removesuffix(_INPUT_SCALE)
    return owner + ".weight_scale" in params or owner + SCALE_SUFFIX in params


def _set_kv_scale(modules: dict[str, nn.Module], name: str, tensor: torch.Tensor) -> bool:
    """Give the attention operator under ``name``'s module its checkpoint K or V scale;
    False if its cache is not FP8 (the scale means nothing there)."""
    prefix, which = name.rsplit(".", 1)
    op = modules.get(f"{prefix}.attn")
    if not isinstance(op, AttentionOperator):
        raise ValueError(f"checkpoint tensor {name!r} has no attention operator to scale")
    if tensor.numel() != 1:
        raise ValueError(
            f"checkpoint tensor {name!r}: only one scale per layer is supported, got shape "
            f"{tuple(tensor.shape)}"
        )
    if op.cache_spec.dtype != FP8:
        return False
    setattr(op, which, float(tensor))
    return True
