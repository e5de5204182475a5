"""Loading checkpoint tensors into a model: name mapping, packing, completeness check."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from heron.layers.linear import Linear, PackedLinear

# Tensors some checkpoints carry that are recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy ``weights`` into ``model``; raise naming any unknown tensor or unloaded parameter.

    ``model.packed_modules`` maps a checkpoint module name (``q_proj``) to the packed module
    that holds it and its shard (``("qkv_proj", "q")``). ``model.checkpoint_prefixes`` maps a
    checkpoint name prefix to the model's (``None``: tensors the model does not load, such as
    a multimodal checkpoint's vision tower).
    """
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    prefixes: dict[str, str | None] = getattr(model, "checkpoint_prefixes", {})
    params = dict(model.named_parameters())
    owners = {
        f"{prefix}.{pname}" if prefix else pname: module
        for prefix, module in model.named_modules()
        for pname, _ in module.named_parameters(recurse=False)
    }
    tied_head = getattr(getattr(model, "lm_head", None), "tied", False)
    loaded: dict[str, set[str | None]] = {}
    for name, tensor in weights:
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is not None:
            if prefixes[prefix] is None:
                continue
            name = prefixes[prefix] + name.removeprefix(prefix)
        if name.endswith(_IGNORED_SUFFIXES) or (tied_head and name == "lm_head.weight"):
            continue
        target, shard = name, None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in packed:
                parts[i], shard = packed[part]
                target = ".".join(parts)
                break
        param = params.get(target)
        if param is None:
            raise ValueError(
                f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}"
            )
        owner = owners[target]
        loader = owner.weight_loader if isinstance(owner, Linear) else None
        with torch.no_grad():
            if loader is not None:
                loader(param, tensor.to(param.dtype), shard)
            elif param.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            else:
                param.copy_(tensor)
        loaded.setdefault(target, set()).add(shard)

    missing = []
    for name in params:
        owner = owners[name]
        expected = set(owner.shard_offsets) if isinstance(owner, PackedLinear) else {None}
        if loaded.get(name, set()) != expected:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {', '.join(missing)}")
