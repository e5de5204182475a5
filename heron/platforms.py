"""Platforms: device facts, default operators and the model-build context."""

from __future__ import annotations

import torch

from heron.metadata import ModelBuildContext


class Platform:
    """A platform without step-metadata support.

    Its build context collects nothing, so every operator runs on the compatibility fallback
    (metadata derived from the model configuration). Platforms that support operator-owned
    metadata override :meth:`model_build_context`.
    """

    name = "base"
    default_block_size = 16

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def model_build_context(self) -> ModelBuildContext:
        return ModelBuildContext(collecting=False)

    def default_attention_backend(self) -> str:
        return "reference"

    def layer_kernels(self) -> str:
        """The kernel set the layers launch (``heron.ops.selector.LAYER_KERNELS``)."""
        return "torch"


class CpuPlatform(Platform):
    name = "cpu"

    def model_build_context(self) -> ModelBuildContext:
        return ModelBuildContext()


class CudaPlatform(Platform):
    name = "cuda"
    # 64-token blocks (lmdeploy's size): a decode step takes the KV cache's slow path (a block
    # boundary) every 64 tokens instead of every 16, and its block tables are a quarter as wide,
    # which measured faster on large batches of long contexts (BENCHMARKS.md).
    default_block_size = 64

    def default_attention_backend(self) -> str:
        return "triton"

    def layer_kernels(self) -> str:
        return "triton"

    def model_build_context(self) -> ModelBuildContext:
        return ModelBuildContext()

    def kv_cache_budget(self, utilization: float, peak_bytes: int) -> int:
        """Bytes the KV cache may take: ``utilization`` of the device, less this process's peak
        (weights and a profiled forward) and what is used outside torch's allocator (the CUDA
        context, other processes)."""
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        return max(int(total * utilization) - peak_bytes - outside_torch, 0)


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = str(device)
    try:
        device = torch.device(device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}: use auto, cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} requested but CUDA is not available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def platform_for(device: torch.device) -> Platform:
    if device.type == "cuda":
        return CudaPlatform(device)
    if device.type == "cpu":
        return CpuPlatform(device)
    return Platform(device)
