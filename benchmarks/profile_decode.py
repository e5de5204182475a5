"""Where a decode step's GPU time goes: torch.profiler over decode steps of the
Qwen3-0.6B-shaped model of ``gpu_decode.py`` (or the Gemma-3-1B, Qwen3.5-0.8B or -35B-A3B or
DeepSeek-V2-Lite shape of ``gemma_decode.py``, ``qwen3_5_decode.py``, ``deepseek_decode.py``;
dummy weights), per kernel and as a timeline (busy and idle), at batch 1 and 64.

With ``--tensor-parallel-size N`` the profile is rank 0's (the engine's process), its
all-reduces among the kernels. With ``--speculative-config`` the steps are verification steps
and their proposer's passes (the random weights' proposals are refused, which changes no
step's shape); ``qwen3_5_mtp`` and ``deepseek_v3_mtp`` are case E's shapes of
``speculative_decode.py``, with one MTP layer.

    python benchmarks/profile_decode.py [--model gemma3|qwen3_5|deepseek|qwen3_5_mtp|...]
        [--context 4096] [--enforce-eager] [--steps 20] [--phases | --host | --all]
        [--quantization fp8] [--kv-cache-dtype fp8] [--speculative-config JSON]
        [--tensor-parallel-size 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from functools import partial
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from heron import LLM, SamplingParams

import deepseek_decode
import gemma_decode
import gpu_decode
import qwen3_5_decode

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def build_deepseek(path: Path, load_format: str) -> None:
    """The DeepSeek-V2-Lite shape of ``deepseek_decode.py``, as a config only."""
    import transformers as tf

    family, shape = deepseek_decode.SHAPES["v2-lite"]
    config = getattr(tf, f"{family}Config")(**shape)
    gpu_decode.save_config_only(config, f"{family}ForCausalLM", path)


def build_mtp(shape: str, path: Path, load_format: str) -> None:
    """One of case E's shapes (``speculative_decode.MTP_SHAPES``), as a config only."""
    import speculative_decode
    import transformers as tf

    config_class, fields, architecture = speculative_decode.MTP_SHAPES[shape]
    gpu_decode.save_config_only(getattr(tf, config_class)(**fields), architecture, path)


MODELS = {
    "qwen3": gpu_decode.build_model,
    "gemma3": gemma_decode.build_model,
    "qwen3_5": partial(qwen3_5_decode.build_model, "0.8b"),
    "qwen3_5_35b_a3b": partial(qwen3_5_decode.build_model, "35b-a3b"),
    "deepseek": build_deepseek,
    "qwen3_5_mtp": partial(build_mtp, "qwen3.5-0.8b"),
    "deepseek_v3_mtp": partial(build_mtp, "deepseek-v3-5l"),
}


def prefill(llm: LLM, name: str, batch: int, context: int) -> list[str]:
    """Add ``batch`` requests of ``context`` prompt tokens and run until all of them decode;
    return their ids. They generate up to the model's length, so none finishes while a
    measurement runs (chunked prefill starts them steps apart): :func:`drop` ends them."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    ids = [f"{name}{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, [3 + i] * context, params)
    while any(len(r.output_token_ids) < 3 for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    return ids


def drop(llm: LLM, ids: list[str]) -> None:
    """Abort the measured requests and let the engine settle."""
    for request_id in ids:
        llm.engine.abort_request(request_id)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def profile_batch(llm: LLM, batch: int, context: int, steps: int) -> None:
    """Per kernel: µs per step, calls, and µs per call (min / median / max: one kernel name
    serves layers of different kinds, e.g. full and sliding attention). Then the GPU timeline:
    the span of the profiled steps, the time some kernel or copy ran, and the gaps between them
    (the GPU waiting for work). Under the profiler kernels do not overlap as they do with PDL,
    so the busy time is an upper bound."""
    import json
    import statistics

    engine = llm.engine
    ids = prefill(llm, "p", batch, context)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
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
    ranked = sorted(per_call.items(), key=lambda item: -sum(item[1]))
    total = sum(e["dur"] for e in device) / steps
    print(f"\n### batch {batch}, context {context}: GPU time per engine step {total:.0f} µs")
    print("| kernel | µs/step | calls/step | µs per call (min / median / max) | share |")
    print("| --- | --- | --- | --- | --- |")
    for name, times in ranked[:20]:
        t = sum(times) / steps
        spread = f"{min(times):.1f} / {statistics.median(times):.1f} / {max(times):.1f}"
        print(f"| {name[:70]} | {t:.1f} | {len(times) / steps:.1f} | {spread} | {t / total:.0%} |")
    span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
    covered, end = 0.0, device[0]["ts"]
    for e in device:  # the union of the activities' intervals
        start, stop = max(e["ts"], end), e["ts"] + e["dur"]
        covered += max(0.0, stop - start)
        end = max(end, stop)
    print(
        f"\nGPU timeline per step: span {span / steps:.0f} µs, busy {covered / steps:.0f} µs, "
        f"gaps {(span - covered) / steps:.0f} µs"
    )


def phase_times(llm: LLM, batch: int, context: int, steps: int) -> None:
    """Host time per decode step by phase, as the engine runs them (asynchronous scheduling on,
    nothing synchronised that the engine does not synchronise itself). ``sampled tokens`` is
    the time the host waits for a step's sampled tokens and reads them: near zero means the
    host, not the GPU, sets the pace."""
    import statistics
    import time

    from heron.engine import llm_engine
    from heron.execution import model_runner

    engine, runner = llm.engine, llm.engine.runner
    ids = prefill(llm, "t", batch, context)
    phases: dict[str, list[float]] = {}
    patched = {  # name: (owner, attribute); the owner's attribute is wrapped while timing
        "schedule": (engine.scheduler, "schedule"),
        "launch": (runner, "launch"),
        "- inputs (StepBatch, copy)": (runner.inputs, "prepare"),
        "- graph fill + replay": (runner.graphs, "run"),
        "- sampler": (runner.sampler, "sample_on_device"),
        "- pending tokens": (runner, "_fill_pending_tokens"),
        "- LaunchedStep": (model_runner.LaunchedStep, "__init__"),
        "- staging buffer free": (runner.inputs, "_staging_buffer"),
        "read": (engine, "_read"),
        "- sampled tokens (wait, copy)": (model_runner.LaunchedStep, "result"),
        "- detokenize": (llm_engine.IncrementalDetokenizer, "append"),
        "- stop checks": (llm_engine, "check_stop"),
        "outputs": (llm_engine.ParentRequest, "output"),
    }

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            phases.setdefault(name, []).append(time.perf_counter() - t)
            return out

        return wrapper

    # (an eager run has no graph runner to time)
    patched = {name: part for name, part in patched.items() if part[0] is not None}
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
    drop(llm, ids)
    step = statistics.median(total) * 1e6
    print(f"\n### batch {batch}, context {context}: host µs per engine step (median of {steps})")
    print("| phase | µs |\n| --- | --- |")
    for name, times in phases.items():
        print(f"| {name} | {statistics.median(times) * 1e6 * len(times) / steps:.0f} |")
    print(f"| step | {step:.0f} |")


def host_profile(llm: LLM, batch: int, context: int, steps: int) -> None:
    """cProfile over decode steps as they run (asynchronous scheduling on): the host functions
    that cost the most own time per step."""
    import cProfile
    import pstats

    ids = prefill(llm, "h", batch, context)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        llm.engine.step()
    profiler.disable()
    drop(llm, ids)
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
    parser.add_argument(
        "--all", action="store_true", help="all three, on one engine (one build, one graph capture)"
    )
    parser.add_argument("--speculative-config", type=json.loads, default=None)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    gpu_decode.add_fp8_args(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        MODELS[args.model](Path(tmp), "dummy")
        llm = LLM(
            tmp,
            load_format="dummy",
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            enforce_eager=args.enforce_eager,
            cuda_graph_max_bs=max(args.batches),
            speculative_config=args.speculative_config,
            tensor_parallel_size=args.tensor_parallel_size,
            # Room for the measured steps after the longest chunked-prefill stagger.
            max_model_len=max(4096, args.context + 4 * args.steps + 256),
        )
        if args.all:
            measures = [profile_batch, phase_times, host_profile]
        else:
            measures = [
                phase_times if args.phases else host_profile if args.host else profile_batch
            ]
        for batch in args.batches:
            for measure in measures:
                measure(llm, batch, args.context, args.steps)


if __name__ == "__main__":
    main()
