"""Platforms: device facts, default operators and the model-build context."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from heron.metadata import ModelBuildContext

logger = logging.getLogger(__name__)

# The most the CPU's KV cache takes by default (a quarter of the available memory, up to this).
MAX_DEFAULT_HOST_KV_CACHE_BYTES = 2 << 30


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

    def note_memory_baseline(self) -> None:
        """Remember the device's memory before the model is built (where budgets are measured)."""

    def host_kv_cache_budget(self) -> int:
        """Bytes a KV cache in host memory may take by default: a quarter of the memory
        available now (to this process's cgroup), at most 2 GiB."""
        return min(available_memory() // 4, MAX_DEFAULT_HOST_KV_CACHE_BYTES)


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

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._outside_torch_at_start: int | None = None

    def note_memory_baseline(self) -> None:
        """Remember what the device holds outside this process's allocator before the model
        is built: other processes' memory (another engine's, on a shared device) is theirs,
        not this engine's to count against its ``utilization``. The first call counts (a
        draft model's runner comes after the target's)."""
        if self._outside_torch_at_start is None:
            free, total = torch.cuda.mem_get_info(self.device)
            self._outside_torch_at_start = total - free - torch.cuda.memory_reserved(self.device)

    def kv_cache_budget(self, utilization: float, peak_bytes: int) -> int:
        """Bytes the KV cache may take: ``utilization`` of the device for this engine (as
        vLLM's: two engines on one device at 0.4 each both get their share), less this
        process's peak (weights and a profiled forward) and what it added outside torch's
        allocator since its baseline; never more than is free now."""
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        outside_torch = total - free - reserved - (self._outside_torch_at_start or 0)
        budget = int(total * utilization) - peak_bytes - max(outside_torch, 0)
        available = free + reserved - torch.cuda.memory_allocated(self.device)
        return max(min(budget, available), 0)


def set_server_cpu_threads() -> None:
    """torch's threads in the engine core process of a CPU server: ``OMP_NUM_THREADS`` when
    set, else one fewer than the CPUs this process may use (its affinity and cgroup quota),
    leaving one to the HTTP front and the rest of the machine: a thread whose CPU another
    process holds stalls every parallel region of a step (decode speed falls by two thirds)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, usable_cpus() - 1))
    logger.info("CPU: %d torch threads", torch.get_num_threads())


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, within its cgroup's CPU quota."""
    count = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            count = min(count, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota
    return count


def available_memory() -> int:
    """Bytes of memory available (the kernel's MemAvailable), within the cgroup's limit."""
    meminfo = Path("/proc/meminfo").read_text()
    available = int(meminfo.split("MemAvailable:")[1].split()[0]) * 1024
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass  # no cgroup v2 limit
    return max(available, 0)


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
