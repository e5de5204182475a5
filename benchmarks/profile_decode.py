"""Where a decode step's GPU time goes: torch.profiler over decode steps of the
Qwen3-0.6B-shaped model of ``gpu_decode.py``, per kernel, at batch 1 and 64.

    python benchmarks/profile_decode.py [--enforce-eager] [--steps 20]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from heron import LLM, SamplingParams

from gpu_decode import build_model


def profile_batch(llm: LLM, batch: int, steps: int) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}", [3 + i] * 128, params)
    for _ in range(5):  # prefill, then a few decode steps
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    print(f"\n### batch {batch}: {steps} decode steps")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    )


def phase_times(llm: LLM, batch: int, steps: int) -> None:
    """Host-side phases of graph-replayed decode steps (the GPU is synchronised after each,
    so this runs without asynchronous scheduling)."""
    import statistics
    import time

    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"t{batch}-{i}", [5 + i] * 128, params)
    for _ in range(5):
        engine.step()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--phases", action="store_true", help="host phase timings instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp))
        # Phases are timed with a synchronisation after each replay: steps are read at once.
        llm = LLM(
            tmp,
            enforce_eager=args.enforce_eager,
            max_model_len=4096,
            async_scheduling=not args.phases,
        )
        for batch in (1, 64):
            if args.phases:
                phase_times(llm, batch, args.steps)
            else:
                profile_batch(llm, batch, args.steps)


if __name__ == "__main__":
    main()
