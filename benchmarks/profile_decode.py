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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp))
        llm = LLM(tmp, enforce_eager=args.enforce_eager, max_model_len=4096)
        for batch in (1, 64):
            profile_batch(llm, batch, args.steps)


if __name__ == "__main__":
    main()
