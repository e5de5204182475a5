"""Reading a PEFT LoRA adapter: ``adapter_config.json`` + ``adapter_model.safetensors``.

An adapter is checked against what the engine serves here, once, when it is read: every
refusal names the adapter and the field or module at fault.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from heron.loader.hub import download, is_hub_id
from heron.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


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


def read_peft_adapter(request: LoRARequest, max_rank: int) -> PeftAdapter:
    """The adapter's pairs, scaled by ``lora_alpha / r`` (rsLoRA: ``/ sqrt(r)``), in fp32."""
    name = request.lora_name
    path = adapter_dir(request)
    config = json.loads((path / CONFIG_FILE).read_text())
    rank, scaling = _check_config(name, config, max_rank)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {path} has no {WEIGHTS_FILE}")
    tensors = load_file(weights_path)
    stacks = bool(config.get("target_parameters"))
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
        # A stacked parameter's (target_parameters) holds each expert's r rows of A and
        # columns of B, the latter interleaved (column i * E + e: expert e's i-th).
        experts = a.shape[0] // rank if stacks and a.dim() == 2 else 1
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank * experts or b.shape[1] != a.shape[0]:
            raise ValueError(
                f"LoRA adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}, not of rank r={rank}"
            )
        if experts > 1:
            a = a.reshape(experts, rank, -1)
            b = b.reshape(b.shape[0], rank, experts).permute(2, 0, 1)
        out[module] = LoRAPair(a.contiguous(), (b * scaling).contiguous())
    if not out:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return PeftAdapter(request, rank, out)


def _check_config(name: str, config: dict, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling; refuses by name what is not served."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {config['peft_type']!r} is not LORA")
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {name!r}: use_dora (DoRA) is not supported")
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise ValueError(f"LoRA adapter {name!r}: {field} (per-module ranks) is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported")
    if config.get("modules_to_save"):
        raise ValueError(
            f"LoRA adapter {name!r}: modules_to_save {config['modules_to_save']} is not supported"
        )
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank r={rank} is above max_lora_rank={max_rank}")
    alpha = config.get("lora_alpha", 8)
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return rank, scaling
