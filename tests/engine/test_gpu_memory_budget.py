"""The KV budget on a CUDA device, with the device's memory figures stubbed (as
``torch.cuda`` reports them) so the arithmetic runs anywhere: ``gpu_memory_utilization`` is
this engine's share of the device, as in vLLM, whatever another process on it holds."""

from __future__ import annotations

import inspect

import pytest
import torch

from heron.platforms import CudaPlatform

GIB = 1 << 30
TOTAL = 100 * GIB


class Device:
    """A device's memory: what other processes hold, and this process's allocator."""

    def __init__(self, others: int) -> None:
        self.others, self.context, self.reserved, self.allocated = others, GIB // 2, 0, 0

    def free(self) -> int:
        return TOTAL - self.others - self.context - self.reserved


def budget(platform: CudaPlatform, utilization: float, peak: int) -> int:
    """The platform's own budget (on a GPU the suite caps it by each worker's share)."""
    return inspect.unwrap(CudaPlatform.kv_cache_budget)(platform, utilization, peak)


@pytest.fixture
def device(monkeypatch):
    dev = Device(others=35 * GIB)  # another engine at 0.35, started first
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _=None: (dev.free(), TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda _=None: dev.reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _=None: dev.allocated)
    return dev


def test_a_second_engine_gets_its_share_not_what_the_first_left(device):
    platform = CudaPlatform(torch.device("cuda", 0))
    platform.note_memory_baseline()
    device.reserved = device.allocated = 3 * GIB  # weights and the profiled forward's peak
    assert budget(platform, 0.35, 3 * GIB) == 35 * GIB - 3 * GIB


def test_memory_this_process_adds_outside_torch_counts(device):
    platform = CudaPlatform(torch.device("cuda", 0))
    platform.note_memory_baseline()
    device.context += 2 * GIB  # (communication buffers, say) after the baseline
    device.reserved = device.allocated = 3 * GIB
    assert budget(platform, 0.35, 3 * GIB) == 35 * GIB - 3 * GIB - 2 * GIB


def test_the_budget_never_passes_what_is_free(device):
    platform = CudaPlatform(torch.device("cuda", 0))
    platform.note_memory_baseline()
    device.reserved, device.allocated = 4 * GIB, 3 * GIB  # 1 GiB cached by the allocator
    assert budget(platform, 0.9, 3 * GIB) == device.free() + GIB


def test_the_first_baseline_counts(device):
    platform = CudaPlatform(torch.device("cuda", 0))
    platform.note_memory_baseline()
    device.others += 10 * GIB  # a process that came after: not told apart from this one
    device.context += GIB
    platform.note_memory_baseline()  # (a draft model's runner)
    device.reserved = device.allocated = 3 * GIB
    assert budget(platform, 0.35, 3 * GIB) == 35 * GIB - 3 * GIB - 11 * GIB
