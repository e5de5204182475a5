"""Where a decode step's GPU time goes: torch.profiler over decode steps of the
Qwen3-0.6B-shaped model of ``gpu_decode.py`` (or the Gemma-3-1B shape of ``gemma_decode.py``),
per kernel, at batch 1 and 64.

    python benchmarks/profile_decode.py [--model gemma3] [--context 4096] [--enforce-eager]
        [--steps 20] [--phases | --host]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from heron import LLM, SamplingParams

import gemma_decode
import gpu_decode

MODELS = {"qwen3": gpu_decode.build_model, "gemma3": gemma_decode.build_model}


def prefill(llm: LLM, name: str, batch: int, context: int, steps: int) -> None:
    """Add ``batch`` requests of ``context`` prompt tokens and run until all of them decode."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{name}{batch}-{i}", [3 + i] * context, params)
    while any(len(r.output_token_ids) < 3 for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()


def profile_batch(llm: LLM, batch: int, context: int, steps: int) -> None:
    engine = llm.engine
    prefill(llm, "p", batch, context, steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    kernels = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels) / steps
    print(f"\n### batch {batch}, context {context}: GPU time per decode step {total:.0f} µs")
    print("| kernel | µs/step | calls/step | share |\n| --- | --- | --- | --- |")
    for e in kernels[:20]:
        t = e.self_device_time_total / steps
        print(f"| {e.key[:70]} | {t:.1f} | {e.count / steps:.0f} | {t / total:.0%} |")


def phase_times(llm: LLM, batch: int, context: int, steps: int) -> None:
    """Host time per decode step by phase, as the engine runs them (asynchronous scheduling on,
    nothing synchronised that the engine does not synchronise itself). ``wait for the device``
    is the time the host blocks on a step's sampled tokens: near zero means the host, not the
    GPU, sets the pace."""
    import statistics
    import time

    from heron.engine import llm_engine
    from heron.execution import model_runner

    engine, runner = llm.engine, llm.engine.runner
    prefill(llm, "t", batch, context, steps)
    phases: dict[str, list[float]] = {}
    patched = {  # name: (owner, attribute); the owner's attribute is wrapped while timing
        "schedule": (engine.scheduler, "schedule"),
        "launch": (runner, "launch"),
        "- inputs (StepBatch, copy)": (runner.inputs, "prepare"),
        "- graph fill + replay": (runner.graphs, "run"),
        "- sampler": (runner.sampler, "sample_on_device"),
        "- pending tokens": (runner, "_fill_pending_tokens"),
        "- LaunchedStep": (model_runner.LaunchedStep, "__init__"),
        "read": (engine, "_read"),
        "- wait for the device": (torch.cuda.Event, "synchronize"),
        "- detokenize": (llm_engine.IncrementalDetokenizer, "append"),
        "- stop checks": (llm_engine, "check_stop"),
        "outputs": (llm_engine._Parent, "output"),
    }

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            phases.setdefault(name, []).append(time.perf_counter() - t)
            return out

        return wrapper

    saved = {name: getattr(owner, attr) for name, (owner, attr) in patched.items()}
    for name, (owner, attr) in patched.items():
        setattr(owner, attr, timed(name, saved[name]))
    total = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            total.append(time.perf_counter() - t)
    finally:
        for name, (owner, attr) in patched.items():
            setattr(owner, attr, saved[name])
    while engine.has_unfinished_requests():
        engine.step()
    step = statistics.median(total) * 1e6
    print(f"\n### batch {batch}, context {context}: host µs per decode step (median of {steps})")
    print("| phase | µs |\n| --- | --- |")
    for name, times in phases.items():
        print(f"| {name} | {statistics.median(times) * 1e6 * len(times) / steps:.0f} |")
    print(f"| step | {step:.0f} |")


def host_profile(llm: LLM, batch: int, context: int, steps: int) -> None:
    """cProfile over decode steps as they run (asynchronous scheduling on): the host functions
    that cost the most own time per step."""
    import cProfile
    import pstats

    prefill(llm, "h", batch, context, steps)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        llm.engine.step()
    profiler.disable()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    print(f"\n### batch {batch}, context {context}: host functions by own time ({steps} steps)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--phases", action="store_true", help="host phase timings instead")
    parser.add_argument("--host", action="store_true", help="cProfile of the host instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        MODELS[args.model](Path(tmp))
        llm = LLM(
            tmp,
            enforce_eager=args.enforce_eager,
            max_model_len=max(4096, args.context + args.steps + 64),
        )
        for batch in args.batches:
            measure = phase_times if args.phases else host_profile if args.host else profile_batch
            measure(llm, batch, args.context, args.steps)


if __name__ == "__main__":
    main()
