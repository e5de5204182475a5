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

    def synchronize(self) -> None:
        pass

    def memory_available_for_cache(self, utilization: float) -> int | None:
        """Bytes the KV cache may take, or None where only an explicit size makes sense."""
        return None


class CpuPlatform(Platform):
    name = "cpu"

    def model_build_context(self) -> ModelBuildContext:
        return ModelBuildContext()


class CudaPlatform(Platform):
    name = "cuda"

    def model_build_context(self) -> ModelBuildContext:
        return ModelBuildContext()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def memory_available_for_cache(self, utilization: float) -> int | None:
        free, total = torch.cuda.mem_get_info(self.device)
        # What the process may still take within the utilisation budget of the whole device.
        used = total - free
        return max(int(total * utilization) - used, 0)


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
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
