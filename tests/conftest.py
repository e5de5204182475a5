"""Shared fixtures: tiny random-weight HF models (no network), saved in HF format."""

from __future__ import annotations

import functools
import gc
import os
import sys

# Without a GPU, Triton kernels run in its interpreter; it must be chosen before triton loads.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
from pathlib import Path

import pytest
import torch

from tiny_models import save_tiny_model

# HF's Qwen3.5 / Qwen3-Next references stay on their torch path where fla-core is installed
# (they would take its kernels, which need a GPU); set before anything imports transformers.
sys.modules["fla"] = None

# Keep CPU tests deterministic and fast on small machines: the cores shared among the xdist
# workers, since more threads than cores make torch's thread pools spin against each other.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: the saved directory of a tiny model of ``family`` (built once per session)."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = save_tiny_model(family, tmp_path_factory.mktemp(family))
        return cache[family]

    return get


@pytest.fixture(scope="session", autouse=True)
def cpu_unless_asked():
    """Tests run on the CPU even on a GPU machine; ``gpu`` tests name their device."""
    import heron.engine.resolved_config as resolved_config

    real = resolved_config.resolve_device
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            resolved_config, "resolve_device", lambda d: real("cpu" if d in (None, "auto") else d)
        )
        yield


@pytest.fixture(scope="session", autouse=True)
def gpu_shared_by_workers():
    """xdist workers share one GPU: an engine's KV budget is at most its worker's share of
    the device (one that took 90% of it would leave the other workers' graph captures and
    caches none)."""
    from heron.platforms import CudaPlatform

    real = CudaPlatform.kv_cache_budget

    @functools.wraps(real)  # (its arithmetic's tests unwrap it)
    def shared(self, utilization: float, peak: int) -> int:
        share = int(torch.cuda.mem_get_info(self.device)[1] * utilization / _WORKERS) - peak
        return max(0, min(real(self, utilization, peak), share))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CudaPlatform, "kv_cache_budget", shared)
        yield


@pytest.fixture(autouse=True)
def gpu_memory_given_back():
    """Another worker's KV budget is at most what the device has free
    (``CudaPlatform.kv_cache_budget``), which this process's cached blocks take: after each
    test, engines it dropped are collected and the allocator's cache is given back."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def pytest_report_header(config):
    if torch.cuda.is_available():
        return (
            "CUDA found, so Triton's interpreter is off: the tests that run Triton kernels on "
            "CPU tensors are reported as skipped here; they run on a CPU-only machine."
        )
    return None


# What a Triton launch on CPU tensors raises where the interpreter is off (Triton's driver).
_CPU_TENSOR_LAUNCH = "cannot be accessed from Triton (cpu tensor?)"


def _launched_on_cpu_tensors(excinfo) -> bool:
    error = excinfo.value
    while error is not None:
        if _CPU_TENSOR_LAUNCH in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a CUDA machine a test that launches Triton kernels on CPU tensors needs the
    interpreter, which is off there: it is reported as skipped, with the reason, not failed."""
    report = (yield).get_result()
    if (
        report.failed
        and call.excinfo is not None
        and torch.cuda.is_available()
        and _launched_on_cpu_tensors(call.excinfo)
    ):
        report.outcome = "skipped"
        report.longrepr = (
            str(item.path),
            item.location[1] or 0,
            "Skipped: runs Triton kernels on CPU tensors (needs the interpreter: a CPU-only "
            "machine)",
        )


# Files whose module fixtures take minutes (the real default model's runs) start first: under
# xdist's per-file scheduling, collected last as they are, they would end the run alone.
_FIRST = ("test_fp8_accuracy.py", "test_default_model.py")


def pytest_collection_modifyitems(config, items):
    """The slowest files first (above); ``gpu``-marked tests need CUDA: elsewhere they are
    reported as skipped, never passed."""
    items.sort(key=lambda item: item.path.name not in _FIRST)  # (stable: the rest keep order)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fla_chunk_rule(monkeypatch):
    """fla-core's chunked rule for a GPU test of Heron's prefill path, with HF's models still
    bound to their torch fallbacks (their modules are imported while fla is blocked)."""
    import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe  # noqa: F401
    import transformers.models.qwen3_next.modeling_qwen3_next  # noqa: F401

    from heron.ops.linear_attention.fla_prefill import load_chunk_rule

    monkeypatch.delitem(sys.modules, "fla")
    rule = load_chunk_rule()
    if rule is None:
        pytest.fail("fla-core (pyproject's CUDA dependency) is not installed")
    return rule
