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
    """Host-side phases of graph-replayed decode steps (the GPU is synchronised after each,
    so this runs without asynchronous scheduling)."""
    import statistics
    import time

    engine, runner = llm.engine, llm.engine.runner
    prefill(llm, "t", batch, context, steps)
    phases: dict[str, list[float]] = {}
    originals = {
        "schedule": (engine.scheduler, "schedule"),
        "prepare (StepBatch, copy)": (runner.inputs, "prepare"),
        "fill + replay + sync": (runner.graphs, "run"),
    }

    def timed(name, fn, sync):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            if sync:
                torch.cuda.synchronize()
            phases.setdefault(name, []).append(time.perf_counter() - t)
            return out

        return wrapper

    saved = {name: getattr(obj, attr) for name, (obj, attr) in originals.items()}
    for name, (obj, attr) in originals.items():
        setattr(obj, attr, timed(name, saved[name], "replay" in name))
    total = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            total.append(time.perf_counter() - t)
    finally:
        for name, (obj, attr) in originals.items():
            setattr(obj, attr, saved[name])
    while engine.has_unfinished_requests():
        engine.step()
    med = {k: statistics.median(v) * 1e6 for k, v in phases.items()}
    step = statistics.median(total) * 1e6
    rest = step - sum(med.values())
    print(f"\n### batch {batch}: host phases per decode step (µs, median of {steps})")
    print(
        " | ".join(f"{k} {v:.0f}" for k, v in med.items())
        + f" | sample, outputs, detokenize, stops {rest:.0f} | step {step:.0f}"
    )


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
        # Phases are timed with a synchronisation after each replay: steps are read at once.
        llm = LLM(
            tmp,
            enforce_eager=args.enforce_eager,
            max_model_len=max(4096, args.context + args.steps + 64),
            async_scheduling=not args.phases,
        )
        for batch in args.batches:
            measure = phase_times if args.phases else host_profile if args.host else profile_batch
            measure(llm, batch, args.context, args.steps)


if __name__ == "__main__":
    main()
