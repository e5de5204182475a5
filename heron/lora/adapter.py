"""Reading a PEFT LoRA adapter: ``adapter_config.json`` + ``adapter_model.safetensors``.

An adapter is checked against what the engine serves here, once, when it is read: every
refusal names the adapter and the field or module at fault.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from heron.loader.hub import download, is_hub_id
from heron.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# transformers' stacked experts' parameters, as declared (PEFT wraps them in this order, the
# first innermost: a module's wrappers below the outermost are named ``.base_layer``).
EXPERT_STACKS = ("gate_up_proj", "down_proj")
_NESTED = ".base_layer"


@dataclass(frozen=True)
class LoRAPair:
    """One target module's update ``x A^T B^T`` (``a``: ``[r, in]``; ``b``: ``[out, r]``,
    already multiplied by the adapter's scaling). A stack of experts' pair has one per expert
    (``a``: ``[E, r, in]``; ``b``: ``[E, out, r]``)."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class PeftAdapter:
    """An adapter's pairs by the checkpoint name of the module each updates
    (``model.layers.0.self_attn.q_proj``), in host memory."""

    request: LoRARequest
    rank: int
    pairs: dict[str, LoRAPair]

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for p in self.pairs.values())


def adapter_dir(request: LoRARequest) -> Path:
    """The local directory of ``request.lora_path`` (a Hub id is downloaded)."""
    path = Path(request.lora_path).expanduser()
    if not path.exists() and is_hub_id(request.lora_path):
        path = download(request.lora_path)
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(
            f"LoRA adapter {request.lora_name!r}: {request.lora_path!r} is not a PEFT adapter "
            f"directory (no {CONFIG_FILE})"
        )
    return path


def read_peft_adapter(
    request: LoRARequest, max_rank: int, is_experts: Callable[[str], bool] = lambda m: False
) -> PeftAdapter:
    """The adapter's pairs, scaled by ``lora_alpha / r`` (rsLoRA: ``/ sqrt(r)``; ``r`` and
    ``lora_alpha`` per module where ``rank_pattern`` / ``alpha_pattern`` match), in fp32. A
    stacked experts' pair (of a module ``is_experts`` says holds the stacks) is keyed by its
    parameter (``mlp.experts.gate_up_proj``)."""
    name = request.lora_name
    path = adapter_dir(request)
    config = json.loads((path / CONFIG_FILE).read_text())
    _check_config(name, config)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {path} has no {WEIGHTS_FILE}")
    tensors = load_file(weights_path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix(_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ValueError(
                f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight (embeddings, "
                "biases and modules_to_save are not supported)"
            )
        pairs.setdefault(module, {})[kind[0]] = tensor.float()
    out = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: module {module!r} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        key, stacked = _peft_key(module, config.get("target_parameters") or [], is_experts)
        rank, scaling = _rank_and_scaling(name, key, config, max_rank)
        # A stacked parameter's (target_parameters) holds each expert's r rows of A and
        # columns of B, the latter interleaved (column i * E + e: expert e's i-th).
        experts = a.shape[0] // rank if stacked and a.dim() == 2 else 1
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank * experts or b.shape[1] != a.shape[0]:
            raise ValueError(
                f"LoRA adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}, not of rank r={rank}"
            )
        if not (a.isfinite().all() and b.isfinite().all()):  # (kernels read unused slots' B)
            raise ValueError(
                f"LoRA adapter {name!r}: module {module!r} has weights that are not finite"
            )
        if stacked:
            a = a.reshape(experts, rank, -1)
            b = b.reshape(b.shape[0], rank, experts).permute(2, 0, 1)
        out[key] = LoRAPair(a.contiguous(), (b * scaling).contiguous())
    if not out:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return PeftAdapter(request, max(p.a.shape[-2] for p in out.values()), out)


def _peft_key(
    module: str, target_parameters: list[str], is_experts: Callable[[str], bool]
) -> tuple[str, bool]:
    """PEFT's name of what the pair of ``module`` (as saved) updates, and whether that is a
    stack of experts: the wrapped module's ``n``-th wrapper from outside (``n`` nested
    ``.base_layer``) wraps the ``n``-th last of its targeted stacks, as PEFT nests them."""
    depth = module.count(_NESTED)
    owner = module.replace(_NESTED, "")
    if not is_experts(owner):
        return module, False
    targeted = [
        stack
        for stack in EXPERT_STACKS
        if any(
            f"{owner}.{stack}" == t or f"{owner}.{stack}".endswith(f".{t}")
            for t in target_parameters
        )
    ]
    if depth >= len(targeted):
        return owner, False
    return f"{owner}.{targeted[len(targeted) - 1 - depth]}", True


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's ``get_pattern_key``: the first pattern matching the end of ``key``."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _rank_and_scaling(name: str, key: str, config: dict, max_rank: int) -> tuple[int, float]:
    """Module ``key``'s rank and scaling (``rank_pattern`` / ``alpha_pattern`` over ``r`` and
    ``lora_alpha``)."""
    rank = _pattern_value(config.get("rank_pattern") or {}, key, config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise ValueError(
            f"LoRA adapter {name!r}: rank r={rank} is above max_lora_rank={max_rank} ({key!r})"
        )
    alpha = _pattern_value(config.get("alpha_pattern") or {}, key, config.get("lora_alpha", 8))
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _check_config(name: str, config: dict) -> None:
    """Refuses by name what is not served."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {config['peft_type']!r} is not LORA")
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {name!r}: use_dora (DoRA) is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported")
    if config.get("modules_to_save"):
        raise ValueError(
            f"LoRA adapter {name!r}: modules_to_save {config['modules_to_save']} is not supported"
        )
