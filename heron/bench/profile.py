"""``heron bench profile``: where a decode step's time goes, at each ``--batch``.

With torch.profiler over ``--steps`` decode steps: the device time per step, the kernels that
take most of it (printed), and the device timeline (span of the steps, time some kernel or copy
ran, the gaps between them: the device waiting for work; under the profiler kernels do not
overlap as they do with programmatic dependent launch, so the busy time is an upper bound).
With ``--host``: a cProfile of the host over the steps instead (printed, by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from heron import LLM, SamplingParams
from heron.bench import engines
from heron.bench.result import Metric
from heron.config import EngineConfig

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--host", action="store_true", help="cProfile of the host instead")
    parser.add_argument("--mtp", action="store_true", help="give --shape one MTP layer")


def start_decoding(llm: LLM, batch: int, context: int) -> list[str]:
    """Add ``batch`` requests and step until all of them decode; they generate up to the
    model's length, so none finishes while a measurement runs (:func:`drop` ends them)."""
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    ids = [f"profile{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        llm.add_request(request_id, [3 + i] * context, params)
    tokens: dict[str, int] = {}
    while len(tokens) < batch or min(tokens.values()) < 3:
        for out in llm.step():
            tokens[out.request_id] = len(out.outputs[0].token_ids)
    return ids


def drop(llm: LLM, ids: list[str]) -> None:
    for request_id in ids:
        llm.abort_request(request_id)
    while llm.has_unfinished_requests():
        llm.step()


def device_profile(llm: LLM, on: str, batch: int, context: int, steps: int) -> list[Metric]:
    from torch.profiler import ProfilerActivity, profile

    ids = start_decoding(llm, batch, context)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    drop(llm, ids)
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    device = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
        key=lambda e: e["ts"],
    )
    per_call: dict[str, list[float]] = {}
    for e in device:
        per_call.setdefault(e["name"], []).append(e["dur"])
    total = sum(e["dur"] for e in device) / steps
    print(f"\nbatch {batch}, context {context}: device µs per engine step {total:.0f}")
    print("| kernel | µs/step | calls/step | µs per call (min / median / max) | share |")
    print("| --- | --- | --- | --- | --- |")
    for name, times in sorted(per_call.items(), key=lambda item: -sum(item[1]))[:20]:
        t = sum(times) / steps
        spread = f"{min(times):.1f} / {statistics.median(times):.1f} / {max(times):.1f}"
        print(f"| {name[:70]} | {t:.1f} | {len(times) / steps:.1f} | {spread} | {t / total:.0%} |")
    span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
    covered, end = 0.0, device[0]["ts"]
    for e in device:  # the union of the activities' intervals
        start, stop = max(e["ts"], end), e["ts"] + e["dur"]
        covered += max(0.0, stop - start)
        end = max(end, stop)
    case = f"{on}, batch {batch}, context {context}"
    return [
        Metric(f"{case}: device µs per step (kernels and copies)", total, "µs"),
        Metric(f"{case}: device timeline span per step", span / steps, "µs"),
        Metric(f"{case}: device busy per step", covered / steps, "µs"),
        Metric(f"{case}: device gaps per step", (span - covered) / steps, "µs"),
    ]


def host_profile(llm: LLM, on: str, batch: int, context: int, steps: int) -> list[Metric]:
    ids = start_decoding(llm, batch, context)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        llm.step()
    profiler.disable()
    drop(llm, ids)
    print(f"\nbatch {batch}, context {context}: host functions by own time ({steps} steps)")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)
    return [
        Metric(
            f"host s per step under cProfile, batch {batch}, context {context}",
            stats.total_tt / steps,
            "s",
        )
    ]


def run(args: argparse.Namespace, config: EngineConfig) -> tuple[dict[str, Any], list[Metric]]:
    shape = engines.resolve_shape(args, config)
    if not args.host and not torch.cuda.is_available():
        raise ValueError("the device profile needs a CUDA device; --host profiles the host")
    # Room for the measured steps after the longest chunked-prefill stagger.
    options = dict(max_model_len=max(4096, args.context + 4 * args.steps + 256))
    measure = host_profile if args.host else device_profile
    metrics: list[Metric] = []
    with engines.open_llm(shape, config, **options) as llm:
        for batch in args.batch:
            metrics += measure(llm, engines.label(args, config), batch, args.context, args.steps)
    keys = ("shape", "num_layers", "batch", "context", "steps", "host", "mtp")
    return {k: getattr(args, k) for k in keys}, metrics
